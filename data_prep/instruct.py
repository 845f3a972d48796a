"""``python -m data_prep.instruct output=FILE.jsonl problems.train_repos_from=DATA``: a real instruction set from
the code on this machine, as chat JSONL for ``python -m data_prep.chat``.

Every documented function (and, with ``kinds=[function,method]``, method) of the corpus's *train* repositories
(the ``repos.json`` of the prepared dataset ``problems.train_repos_from``, so its validation repositories, where
held-out evaluations come from, stay out) becomes one docstring -> function pair: the user turn asks for the code and shows what HumanEval shows, the
imports and helpers it uses, the signature and the docstring; the assistant turn is that code with the file's own
body under it. The pairs are mined, filtered and decontaminated by SSD's prompt builder
(:func:`ultrascale.data.prompts.build_prompts`): stubs, over-long prompts and bodies, duplicate prompts and bodies
are dropped, and so is any pair whose word 10-grams overlap a HumanEval problem or a doctested problem of a
validation repository, each counted under its reason in ``<output>.report.json``.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from data_prep.config import register_configs
from ultrascale.config.compose import compose
from ultrascale.config.describe import help_if_asked
from ultrascale.data.instruct_format import assistant_turn, user_turn
from ultrascale.errors import DataError, UltrascaleError
from ultrascale.paths import resolve_path


def conversation(record: dict, instruction: str) -> dict:
    """One chat line of a mined pair (``prompt`` ends after the docstring, ``reference`` is the body), in
    :mod:`ultrascale.data.instruct_format`'s turns; the loss also covers the prompt the answer repeats, which the
    model learns quickly."""
    return {
        "id": record["task_id"],
        "repo": record["repo"],
        "messages": [
            {"role": "user", "content": user_turn(record["prompt"], instruction)},
            {"role": "assistant", "content": assistant_turn(record["prompt"], record["reference"])},
        ],
    }


def build(cfg) -> dict:
    """Mine, filter, decontaminate, write ``cfg.output`` and its report; returns the report."""
    from ultrascale.atomic import atomic_write_text
    from ultrascale.data.prompts import build_prompts

    records, report = build_prompts(cfg.problems)
    kinds = {str(k) for k in cfg.kinds}
    report["not_in_kinds"] = sum(r["kind"] not in kinds for r in records)
    records = [r for r in records if r["kind"] in kinds]
    if not records:
        raise DataError(
            f"no pair of kinds={sorted(kinds)} survived ({report['functions']} functions, {report['methods']} "
            "methods mined): add the other kind (kinds=[function,method]) or use a larger problems.input"
        )
    out = resolve_path(cfg.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(conversation(r, cfg.instruction)) for r in records]
    atomic_write_text(out, "".join(f"{ln}\n" for ln in lines))
    report = {"output": str(out), "conversations": len(lines), "kinds": sorted(kinds), **report}
    atomic_write_text(Path(f"{out}.report.json"), json.dumps(report, indent=1) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    register_configs()
    if (rc := help_if_asked("data_prep_instruct", argv, __doc__)) is not None:
        return rc
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    try:
        report = build(compose(argv, config_name="data_prep_instruct"))
    except UltrascaleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {report['output']}: {report['conversations']} conversations; {json.dumps(report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
