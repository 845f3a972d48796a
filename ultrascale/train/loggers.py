"""Fan-out of per-step metrics and events to metrics.jsonl, the console, TensorBoard and wandb (rank 0 only).

metrics.jsonl is the source of truth (plots, the comb report, sweeps and tests read it); the others are
views. Its rows are either step rows (loss, lr, throughput and the step-time breakdown) or event rows
with an ``event`` key (eval, checkpoint, skip, lr_cut, rollback, stop, resume); every row has ``step`` and
``time_s``: seconds since this process opened the logger, once the engine is built and just before the first
step (so model build and JIT compilation of ops are not in it; a resumed process starts again from 0). On wandb and TensorBoard the same numbers are
grouped by what they answer: ``train/`` (is it learning), ``eval/`` (does it generalise), ``perf/`` (is the
hardware busy) and ``stability/`` (is the run healthy).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from ultrascale.jsonio import read_jsonl
from ultrascale.train.parts import PARTS

log = logging.getLogger("ultrascale")

CONSOLE_KEYS = ("loss", "lr", "grad_norm", "tokens_per_s", "tflops", "mfu", "mem_gb", "data_wait")
PERF_KEYS = {"tokens_per_s", "tflops", "mfu", "mem_gb", "step_s", *PARTS, "data_wait", "checkpoint_s", "write_s", "wait_s",
             "steps_lost", "lost_s", "restart", "requeue"}  # fmt: skip
EVAL_KEYS = {"eval_loss": "eval/loss", "eval_perplexity": "eval/perplexity", "eval_s": "eval/seconds",
             "eval_samples": "eval/samples", "eval_coverage": "eval/coverage"}  # fmt: skip
STABILITY_EVENTS = ("skip", "lr_cut", "rollback", "stop")


def dashboard_key(key: str) -> str:
    """The wandb/TensorBoard name of a metrics.jsonl key."""
    if "/" in key:
        return key
    if key in EVAL_KEYS:
        return EVAL_KEYS[key]
    if key.startswith("humaneval"):
        return f"eval/{key}"
    if key in PERF_KEYS:
        return f"perf/{key}"
    return f"train/{key}"


def _fmt(k: str, v: float) -> str:
    if k == "lr":
        return f"{k} {v:.2e}"
    if k in ("mfu", "data_wait"):
        return f"{k} {100 * v:.1f}%"
    if k == "tokens_per_s":
        return f"tok/s {v:,.0f}"
    return f"{k} {v:.4g}"


class MetricLogger:
    """``logger`` is the run's logger group; ``config`` the resolved config (wandb records it with the JSON)."""

    def __init__(self, logger: Any, out_dir: Path, enabled: bool, config: dict, ds_config: dict | None = None):
        self.enabled = enabled
        self.cfg = logger
        self.jsonl = None
        self.tb = None
        self.wandb_run = None
        self.t0 = time.perf_counter()
        self.counts = dict.fromkeys(STABILITY_EVENTS, 0)
        if not enabled:
            return
        self.jsonl = open(out_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115 (closed in close())
        if self.cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out_dir / "tensorboard"))
        if self.cfg.wandb and self.cfg.wandb_mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_MODE", str(self.cfg.wandb_mode))
            config = {**config, "deepspeed": ds_config or {}}
            self.wandb_run = wandb.init(
                project=self.cfg.wandb_project,
                entity=self.cfg.wandb_entity,
                group=self.cfg.wandb_group,
                name=self.cfg.run_name or out_dir.name,
                dir=str(out_dir),
                mode=str(self.cfg.wandb_mode),
                config=config,
                resume="allow",
                id=_wandb_id(out_dir),
            )

    def _write(self, step: int, fields: dict) -> dict:
        row = {"step": step, "time_s": round(time.perf_counter() - self.t0, 4), **fields}
        self.jsonl.write(json.dumps(row) + "\n")
        return row

    def _scalars(self, step: int, values: dict) -> None:
        if self.tb:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb_run and values:
            self.wandb_run.log(values, step=step)

    def log(self, step: int, metrics: dict, console: bool = True) -> None:
        """A step row: numbers only."""
        if not self.enabled:
            return
        row = self._write(step, {k: float(v) for k, v in metrics.items() if v is not None})
        self._scalars(step, {dashboard_key(k): v for k, v in row.items() if k not in ("step", "time_s")})
        if console and self.cfg.console:
            parts = [_fmt(k, row[k]) for k in CONSOLE_KEYS if k in row]
            log.info(f"step {step:>6} | " + " | ".join(parts))

    def event(self, step: int, kind: str, console: bool = True, **fields) -> None:
        """An event row (eval, checkpoint, checkpoint_written, skip, lr_cut, rollback, stop, resume)."""
        if not self.enabled:
            return
        fields = {k: v for k, v in fields.items() if v is not None}
        self._write(step, {"event": kind, **fields})
        nums = {k: float(v) for k, v in fields.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        numbers = {dashboard_key(k): v for k, v in nums.items()}
        if kind in STABILITY_EVENTS and "signal" not in fields:  # a signal's stop is not a health verdict
            self.counts[kind] += 1
            numbers = {f"stability/{kind}_{k}": v for k, v in nums.items()}
            numbers.update({f"stability/{k}s": float(n) for k, n in self.counts.items()})
        self._scalars(step, numbers)
        if console and self.cfg.console:
            detail = ", ".join(f"{k}={_short(v)}" for k, v in fields.items())
            (log.warning if kind in STABILITY_EVENTS else log.info)(f"step {step:>6} | {kind}: {detail}")

    def summary(self, values: dict) -> None:
        if self.wandb_run:
            for k, v in values.items():
                self.wandb_run.summary[k] = v

    def close(self) -> str | None:
        """Flush everything; returns the wandb run directory (for the 'where are my logs' message)."""
        if not self.enabled:
            return None
        self.jsonl.close()
        if self.tb:
            self.tb.close()
        run_dir = None
        if self.wandb_run:
            run_dir = self.wandb_run.dir
            self.wandb_run.finish()
        return run_dir


def _short(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _wandb_id(out_dir: Path) -> str:
    """One wandb run per output dir, stable across resumes (so a resumed run continues its curves)."""
    id_file = out_dir / ".wandb_id"
    if id_file.exists():
        return id_file.read_text().strip()
    import uuid

    run_id = uuid.uuid4().hex[:12]
    id_file.write_text(run_id)
    return run_id


def read_metrics(path: str | os.PathLike) -> list[dict]:
    return read_jsonl(path)
