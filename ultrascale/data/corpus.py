"""The source files of a corpus, read as data prep reads them (same files, same repository names), split by a
prepared dataset's ``repos.json`` so held-out repositories stay held out.

Shared by everything that mines or cuts code from a corpus: SSD's problems and prompts, the instruction set
(``python -m data_prep.instruct``) and the FIM evaluation's held-out files (:mod:`ultrascale.eval.fim`).
"""

from __future__ import annotations

import json
from collections import Counter

from ultrascale.config.problems import ProblemsConfig
from ultrascale.errors import ConfigError
from ultrascale.paths import resolve_path


def corpus_documents(cfg: ProblemsConfig, counts: Counter) -> list[dict]:
    """Source files of ``problems.input`` as data prep reads them (same files, same repository names)."""
    from data_prep.config import to_cfg
    from data_prep.sources import iter_documents

    source = cfg.input if cfg.input in ("stdlib", "site-packages") else resolve_path(cfg.input)
    dp = to_cfg({"input": str(source)})  # data prep's defaults (conf/data_prep.yaml adds none a reader sees)
    docs = list(iter_documents(dp, counts=Counter()))
    counts["files"] = len(docs)
    if cfg.train_repos_from:
        path = resolve_path(cfg.train_repos_from) / "repos.json"
        if not path.exists():
            raise ConfigError(
                f"problems.train_repos_from={cfg.train_repos_from}: {path} not found; point it at a prepared "
                "dataset (python -m data_prep output_dir=...) or set it to null to mine every repository"
            )
        split = json.loads(path.read_text())
        want = "validation" if cfg.held_out else "train"
        kept = [d for d in docs if split.get(d["repo"]) == want]
        counts["files_held_out_repo"] = sum(split.get(d["repo"]) == "validation" for d in docs)
        counts["files_not_in_prepared_data"] = sum(d["repo"] not in split for d in docs)
        if docs and not kept:
            raise ConfigError(
                f"problems.train_repos_from={cfg.train_repos_from}: no repository of problems.input={cfg.input} "
                f"is in its train split; was it prepared from the same input?"
            )
        docs = kept
    return docs
