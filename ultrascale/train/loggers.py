"""Fan-out of per-step metrics and events to metrics.jsonl, the console, TensorBoard and wandb (rank 0 only).

metrics.jsonl is the source of truth (plots, the comb report, sweeps and tests read it); the others are views.
Its rows are step rows or event rows (an ``event`` key), each with ``step`` and ``time_s``
(:class:`MetricLogger`). On wandb and TensorBoard the same numbers are grouped by what they answer: ``train/``
(is it learning), ``eval/`` (does it generalise), ``perf/`` (is the hardware busy) and ``stability/`` (is the run
healthy).

The views must never cost the run a step: a view that raises (wandb's service gone, TensorBoard's disk full) is
turned off with one warning while metrics.jsonl goes on, and during a stop's save the views wait
(:meth:`MetricLogger.hold`) until the checkpoint is ``latest``; wandb's service runs detached, outside the rank's
process tree (:func:`_detached_wandb_service`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ultrascale.jsonio import read_jsonl, write_jsonl
from ultrascale.train.parts import PARTS

log = logging.getLogger("ultrascale")

CONSOLE_KEYS = ("loss", "lr", "grad_norm", "tokens_per_s", "tflops", "mfu", "mem_gb", "data_wait")
PERF_KEYS = {"tokens_per_s", "tflops", "mfu", "mem_gb", "step_s", *PARTS, "data_wait", "checkpoint_s", "write_s", "wait_s",
             "steps_lost", "lost_s", "restart", "requeue"}  # fmt: skip
EVAL_KEYS = {"eval_loss": "eval/loss", "eval_perplexity": "eval/perplexity", "eval_s": "eval/seconds",
             "eval_samples": "eval/samples", "eval_coverage": "eval/coverage"}  # fmt: skip
STABILITY_EVENTS = ("skip", "lr_cut", "rollback", "stop")
VIEWS = {"tb": "TensorBoard", "wandb_run": "wandb"}
WANDB_SERVICE_IDLE = "60s"
"""How long the detached wandb service outlives its last client (a rank 0 killed before it could stop it)."""


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
    """``logger`` is the run's logger group; ``config`` the resolved config (wandb records it with the JSON).

    metrics.jsonl's rows are either step rows (loss, lr, throughput and the step-time breakdown) or event rows with
    an ``event`` key (eval, checkpoint, skip, lr_cut, rollback, stop, resume); every row has ``step`` and
    ``time_s``: seconds since this process opened the logger, once the engine is built and just before the first
    step (so model build and JIT compilation of ops are not in it; a resumed process starts again from 0)."""

    def __init__(self, logger: Any, out_dir: Path, enabled: bool, config: dict, ds_config: dict | None = None):
        self.enabled = enabled
        self.cfg = logger
        self.jsonl = None
        self.tb = None
        self.wandb_run = None
        self.wandb_dir: str | None = None
        self.t0 = time.perf_counter()
        self.counts = dict.fromkeys(STABILITY_EVENTS, 0)
        self._held: list[Callable[[], None]] | None = None
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
            _detached_wandb_service()
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
            self.wandb_dir = self.wandb_run.dir

    def _write(self, step: int, fields: dict) -> dict:
        row = {"step": step, "time_s": round(time.perf_counter() - self.t0, 4), **fields}
        self.jsonl.write(json.dumps(row) + "\n")
        return row

    def hold(self) -> None:
        """Until :meth:`release`, the views (console, TensorBoard, wandb) wait; metrics.jsonl is still written at
        once. A stop holds them while it saves: ``latest`` must move before a dashboard can stall or fail, and a
        resumed run keeps exactly the rows up to its checkpoint."""
        if self.enabled and self._held is None:
            self._held = []

    def release(self) -> None:
        """Show what :meth:`hold` kept back, in order."""
        held, self._held = self._held, None
        for show in held or ():
            show()

    def _show(self, step: int, values: dict, line: str | None = None, warn: bool = False) -> None:
        def show() -> None:
            self._scalars(step, values)
            if line is not None:
                (log.warning if warn else log.info)(line)

        if self._held is not None:
            self._held.append(show)
        else:
            show()

    def _view(self, name: str, call: Callable[[], Any]) -> None:
        """One call into a view; a view that raises is turned off (metrics.jsonl stays the record)."""
        if getattr(self, name) is None:
            return
        try:
            call()
        except Exception as e:
            setattr(self, name, None)
            log.warning(f"{VIEWS[name]} failed ({type(e).__name__}: {str(e).strip()[:200]}): turned off for the rest "
                        f"of this run; metrics.jsonl keeps every row")  # fmt: skip

    def _scalars(self, step: int, values: dict) -> None:
        if self.tb and values:
            self._view("tb", lambda: [self.tb.add_scalar(k, v, step) for k, v in values.items()])
        if self.wandb_run and values:
            self._view("wandb_run", lambda: self.wandb_run.log(values, step=step))

    def log(self, step: int, metrics: dict, console: bool = True) -> None:
        """A step row: numbers only."""
        if not self.enabled:
            return
        row = self._write(step, {k: float(v) for k, v in metrics.items() if v is not None})
        line = None
        if console and self.cfg.console:
            line = f"step {step:>6} | " + " | ".join(_fmt(k, row[k]) for k in CONSOLE_KEYS if k in row)
        self._show(step, {dashboard_key(k): v for k, v in row.items() if k not in ("step", "time_s")}, line)

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
        line = None
        if console and self.cfg.console:
            line = f"step {step:>6} | {kind}: " + ", ".join(f"{k}={_short(v)}" for k, v in fields.items())
        self._show(step, numbers, line, warn=kind in STABILITY_EVENTS)

    def verdict(self, step: int, verdict: Any, row: dict, **extra) -> None:
        """A bad step's event (skip, lr_cut; a rollback is logged once it has happened): why, and the step's figures."""
        self.event(step, verdict.action, reason=verdict.reason, loss=row["loss"], zscore=verdict.zscore,
                   grad_norm=row["grad_norm"], **extra)  # fmt: skip

    def summary(self, values: dict) -> None:
        if self.wandb_run:
            self._view("wandb_run", lambda: [self.wandb_run.summary.__setitem__(k, v) for k, v in values.items()])

    def close(self) -> str | None:
        """Flush everything; returns the wandb run directory (for the 'where are my logs' message)."""
        if not self.enabled:
            return None
        self.release()
        self.jsonl.close()
        if self.tb:
            self._view("tb", self.tb.close)
        if self.wandb_run:
            self._view("wandb_run", self.wandb_run.finish)
        return self.wandb_dir


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


def _detached_wandb_service() -> None:
    """Start wandb's service (``wandb-core``) outside this process's tree, once per process, and point wandb at it.

    DeepSpeed's launcher answers Ctrl-C by SIGTERMing every rank *and all its children*, which killed the service
    wandb starts under rank 0 while that rank was saving its stop.

    ``wandb beta core start`` starts it in its own session and exits, so the service's parent is gone and no launcher
    that tears down a rank and its children (DeepSpeed's launch.py on Ctrl-C) reaches it; wandb then connects
    through ``WANDB_SERVICE`` instead of starting its own. Stopped when this process exits; a process killed before
    that leaves it to end itself after :data:`WANDB_SERVICE_IDLE` without clients. A ``WANDB_SERVICE`` the user set is
    used as it is. Where it cannot start, wandb starts its own service (under this rank) as before."""
    if os.environ.get("WANDB_SERVICE"):
        return
    wandb_cli = [sys.executable, "-m", "wandb"]
    try:
        out = subprocess.run([*wandb_cli, "beta", "core", "start", "--idle-timeout", WANDB_SERVICE_IDLE],
                             capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)  # fmt: skip
        token = out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else ""
    except (OSError, subprocess.SubprocessError) as e:
        out, token = None, ""
        log.debug(f"wandb: no detached service ({e})")
    if not token:
        why = (out.stderr.strip().splitlines() or ["no token printed"])[-1] if out is not None else "it did not start"
        log.warning(f"wandb: the detached service did not start ({why}): wandb's own service runs under this rank, "
                    "where a launcher's teardown on Ctrl-C can end it (metrics.jsonl keeps every row either way)")  # fmt: skip
        return
    os.environ["WANDB_SERVICE"] = token
    atexit.register(_stop_wandb_service, wandb_cli, token)


def _stop_wandb_service(wandb_cli: list[str], token: str) -> None:
    """At exit: stop the service :func:`_detached_wandb_service` started (its runs are finished by then)."""
    if os.environ.get("WANDB_SERVICE") == token:
        os.environ.pop("WANDB_SERVICE")
    with contextlib.suppress(OSError, subprocess.SubprocessError):  # else it ends itself once idle
        subprocess.run([*wandb_cli, "beta", "core", "stop"], env={**os.environ, "WANDB_SERVICE": token},
                       capture_output=True, timeout=30, stdin=subprocess.DEVNULL)  # fmt: skip


def read_metrics(path: str | os.PathLike) -> list[dict]:
    return read_jsonl(path)


def truncate_metrics(path: Path, step: int) -> tuple[int, float]:
    """At a start, drop rows logged past the checkpoint (step 0 for a fresh start): they will be recomputed
    identically. Returns what the interrupted attempt lost: the steps it had run past the checkpoint and
    their logged seconds (the cost of the interval between checkpoints, which the report books as "lost").

    Rollback events stay: a rollback after the checkpoint still holds (it is recorded beside the checkpoints).
    """
    if not path.exists():
        return 0, 0.0
    rows = read_metrics(path)
    lost = [r for r in rows if r["step"] > step and "event" not in r]
    write_jsonl(path, [r for r in rows if r["step"] <= step or r.get("event") == "rollback"])
    steps = max((r["step"] for r in lost), default=step) - step
    return steps, sum(float(r.get("step_s") or 0.0) for r in lost)


def progress_bar(enabled: bool, total: int, initial: int) -> Any:
    """A tqdm bar on a terminal's rank 0 (None elsewhere: logs and pipes get the metric rows only)."""
    if not (enabled and sys.stderr.isatty()):
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)


def data_row(mixture: Any, data_step: int, seq_len: int) -> dict:
    """The mixture as read so far: per source, tokens read, the share read in this stage against the share asked,
    and epochs; plus the stage. The dashboards' ``data/`` group."""
    r = mixture.realized(data_step)
    row = {"data/stage": r["stage"]}
    for i, n in enumerate(mixture.names):
        row.update({f"data/{n}/tokens": int(r["samples"][i]) * seq_len, f"data/{n}/share": float(r["share"][i]),
                    f"data/{n}/asked": float(r["asked"][i]),
                    f"data/{n}/epoch": float(r["samples"][i]) / mixture.sizes[i]})  # fmt: skip
    return row
