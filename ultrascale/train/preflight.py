"""Everything a run needs that can be checked before anything is written, on every rank.

A run that fails after it has created its directory leaves a ``config.yaml``, a ``ds_config.json`` and an
empty ``checkpoints/`` behind, and the next attempt with the same ``output_dir`` looks like a resume. So the
data (present and matching, or preparable), the model source, the checkpoint a resume would load and what
in-training HumanEval needs are all checked here, read-only, before the first byte; ``dry_run`` prints the
same lines.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from ultrascale.config.compose import resolve_path
from ultrascale.data.prepare import check_prepared
from ultrascale.data.shards import MANIFEST, load_manifest
from ultrascale.errors import DataError
from ultrascale.model.build import build_hf_config
from ultrascale.train import checkpoint


@dataclass(frozen=True)
class Preflight:
    notes: dict[str, str]
    """{what: finding}, printed by the dry run."""
    data_checked: bool
    """The prepared data existed and was checked (hashed) here, so setup need not do it again."""


def preflight(cfg: DictConfig) -> Preflight:
    """What was checked; raises the user error that would otherwise come mid-setup, after files were written."""
    hf = build_hf_config(cfg.model)  # a missing model.pretrained_path fails here
    data_checked = (resolve_path(cfg.data.path) / MANIFEST).exists()
    found = {"data": check_prepared(cfg.data, hf.vocab_size)}
    if cfg.model.pretrained_path:
        found["weights"] = f"from {cfg.model.pretrained_path}"
    ckpt_dir = resolve_path(cfg.output_dir) / "checkpoints"
    tag_dir = checkpoint.find_resume(ckpt_dir, str(cfg.train.resume), cfg.train.universal_checkpoint)
    found["resume"] = f"from {tag_dir}" if tag_dir else "fresh start (no checkpoint to resume)"
    n = cfg.train.eval_humaneval
    if n:
        from ultrascale.eval.sandbox import check_available

        data = resolve_path(cfg.data.path)
        if (data / MANIFEST).exists():
            humaneval_tokenizer(data, n)
        check_available()
        found["humaneval"] = f"greedy pass@1 on {n} problems at every eval, in the sandbox"
    return Preflight(found, data_checked)


def humaneval_tokenizer(data: Path, n: int) -> Path:
    """The prepared data's tokenizer directory, which in-training HumanEval decodes with."""
    tok_dir = data / str(load_manifest(data)["tokenizer"])
    if not (tok_dir / "tokenizer.json").exists():
        raise DataError(
            f"train.eval_humaneval={n} needs a tokenizer, but {data} has none at {tok_dir} "
            "(byte-level data?): prepare data with data_prep or set train.eval_humaneval=0"
        )
    return tok_dir
