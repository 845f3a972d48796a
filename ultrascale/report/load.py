"""Read one run directory: ``metrics.jsonl`` in file order, plus what ran (summary, config, checkpoint meta).

``metrics.jsonl`` is the contract; everything else is optional decoration for the header, so a missing or
unreadable ``summary.json``/``config.yaml`` only leaves a blank in the report. A row that cannot be read
is a DataError naming the file and line: a report built on half a file would misname the stall. The one
exception is a partial *last* line with no newline, which is what a run killed mid-write (or still
running) leaves; it is dropped with a note in the report.

Nothing here imports torch: the trainer calls the report at the end of every run and ``python -m
ultrascale.report`` should answer in about a second.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ultrascale.errors import DataError
from ultrascale.train.rundir import LATEST, META, METRICS


def _last_per_step(rows) -> list[dict]:
    """One row per step, in step order: a step logged again (after a rollback) keeps its last row."""
    last = {r["step"]: r for r in rows}
    return [last[s] for s in sorted(last)]


@dataclass
class Run:
    """One run's rows and whatever describes it. ``rows`` keeps file order: that is what really happened."""

    path: Path
    rows: list[dict]
    summary: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    label: str = ""

    @property
    def step_rows(self) -> list[dict]:
        return [r for r in self.rows if "event" not in r]

    @property
    def events(self) -> list[dict]:
        return [r for r in self.rows if "event" in r]

    def curve(self) -> list[dict]:
        """The surviving history: after a rollback the same step is logged again, and the last row wins."""
        return _last_per_step(self.step_rows)

    def eval_curve(self) -> list[dict]:
        """The held-out evals (``event: eval`` rows, step 0 included where the run evaluated at start), one per
        step: a rolled-back step's eval is run again, and the last row wins."""
        return _last_per_step(r for r in self.events if r["event"] == "eval" and "eval_loss" in r)

    def cfg(self, dotted: str, default: Any = None) -> Any:
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def read_rows(path: Path) -> tuple[list[dict], list[str]]:
    """Parse ``metrics.jsonl``; returns the rows and notes about anything dropped."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read {path} ({e}): pass the output_dir of a run that has logged steps") from None
    lines = text.split("\n")
    rows, notes = [], []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        partial_tail = i == len(lines)  # text did not end in a newline: the writer stopped mid-line
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if partial_tail:
                notes.append(
                    f"dropped a partial last line ({path.name} line {i}): the run was killed or is still writing"
                )
                continue
            raise DataError(
                f"{path} line {i} is not valid JSON ({e.msg}): the file is corrupt; "
                f"delete or repair that line and rerun the report"
            ) from None
        if not isinstance(row, dict) or not _number(row.get("step")) or not _number(row.get("time_s")):
            raise DataError(
                f"{path} line {i} is not a metrics row (every row needs numeric 'step' and 'time_s'): "
                f"is this an ultrascale metrics.jsonl? delete or repair that line and rerun the report"
            )
        row["step"] = int(row["step"])
        rows.append(row)
    return rows, notes


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _yaml(path: Path) -> dict:
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def _checkpoint_meta(run_dir: Path) -> dict:
    ckpt = run_dir / "checkpoints"
    try:
        tag = (ckpt / LATEST).read_text().strip()
    except (OSError, ValueError):
        return {}
    return _json(ckpt / tag / META) if tag else {}


def load_run(run_dir: str | Path) -> Run:
    """Everything the report needs from one run directory; raises DataError for a missing dir or metrics."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise DataError(
            f"run_dir {run_dir} does not exist or is not a directory: pass a run's output_dir, "
            f"e.g. `python -m ultrascale.report run_dir=runs/cpu_smoke`"
        )
    path = run_dir / METRICS
    if not path.is_file():
        raise DataError(f"{path} not found: {run_dir} is not a run directory, or the run stopped before logging a step")
    rows, notes = read_rows(path)
    if not any("event" not in r for r in rows):
        raise DataError(
            f"{path} has no step rows: the run stopped before its first log (train.log_interval steps); "
            f"run longer or lower train.log_interval"
        )
    return Run(
        path=run_dir,
        rows=rows,
        summary=_json(run_dir / "summary.json"),
        config=_yaml(run_dir / "config.yaml"),
        meta=_checkpoint_meta(run_dir),
        notes=notes,
        label=run_dir.name,
    )


def finite(values: list[Any]) -> list[float]:
    """The finite numbers of a column (a NaN loss on a skipped step must not poison a mean)."""
    return [float(v) for v in values if _number(v) and math.isfinite(v)]
