"""One attempt at a run, start to end, on every rank: preflight, the process group, the stop handlers, the run
directory (this attempt's config beside the run's), the trainer's setup and loop, then the summary, its files and
rank 0's closing lines, and the engine's release.

The caller (``train.py``) passes how to write the comb report: the report sits above training, so training asks
for it by a function it is handed rather than importing it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import OmegaConf

from ultrascale.config.convert import plain
from ultrascale.jsonio import write_json
from ultrascale.levers.decide import Decisions
from ultrascale.levers.rules import agree_across_ranks
from ultrascale.paths import resolve_path
from ultrascale.runtime import dist
from ultrascale.train.banner import done_lines
from ultrascale.train.grpo.trainer import GRPOTrainer
from ultrascale.train.loggers import read_metrics
from ultrascale.train.plot import plot_curves
from ultrascale.train.preflight import preflight
from ultrascale.train.rundir import ATTEMPTS, CONFIG, DS_CONFIG, METRICS, STOP_REQUEST, SUMMARY
from ultrascale.train.stop import StopRequest
from ultrascale.train.summary import run_summary
from ultrascale.train.trainer import Trainer

if TYPE_CHECKING:
    from ultrascale.config.root import RootConfig

log = logging.getLogger("ultrascale")


def restart_count() -> dict[str, int]:
    """How many times the launcher restarted this job after a lost rank (torchrun's ``--max-restarts``, our
    deepspeed driver's and the sbatch script's loop) and how often Slurm requeued it."""
    out = {}
    for key, names in (("restart", ("TORCHELASTIC_RESTART_COUNT", dist.RESTART_ENV)),
                       ("requeue", ("SLURM_RESTART_COUNT",))):  # fmt: skip
        n = max((int(os.environ[v]) for v in names if os.environ.get(v, "").isdigit()), default=0)
        if n:
            out[key] = n
    return out


def prepare_run_dir(cfg: RootConfig, out: Path, ds_config: dict) -> Path | None:
    """Rank 0 alone creates the run directory and writes this attempt's resolved config and DeepSpeed JSON to
    ``attempts/NNN/``; the others wait. Returns that directory on rank 0.

    The run's own ``config.yaml`` and ``ds_config.json`` are replaced only by :func:`promote_attempt`, once the
    checkpoint has loaded: an attempt that fails (a resume DeepSpeed refuses, a crash while building) leaves
    them describing the run that made the checkpoints, and its own config beside them."""
    attempt = None
    if dist.is_rank0():
        (out / "logs").mkdir(parents=True, exist_ok=True)
        (out / "checkpoints").mkdir(exist_ok=True)
        n = 1 + max((int(p.name) for p in (out / ATTEMPTS).glob("[0-9]*") if p.name.isdigit()), default=0)
        attempt = out / ATTEMPTS / f"{n:03d}"
        attempt.mkdir(parents=True)
        (attempt / CONFIG).write_text(OmegaConf.to_yaml(cfg, resolve=True))
        write_json(attempt / DS_CONFIG, ds_config)
    dist.barrier()
    return attempt


def promote_attempt(attempt: Path | None, out: Path) -> None:
    """Rank 0: this attempt is the run now (its checkpoint loaded, or it started fresh): its config becomes the
    run's, each file replaced atomically."""
    if attempt is not None:
        from ultrascale.atomic import atomic_write_bytes

        for name in (CONFIG, DS_CONFIG):
            atomic_write_bytes(out / name, (attempt / name).read_bytes())


def finish(t: Trainer, summary: dict, report: Callable[[Path], Path | None] | None = None) -> None:
    """Rank 0: summary.json, the plot, the comb report (``report``, the caller's), the loggers closed, and
    where everything is."""
    if not dist.is_rank0():
        return
    write_json(t.out / SUMMARY, summary)
    t.metrics.summary(summary)
    plot = None
    if t.cfg.logger.plot:
        plot = plot_curves(read_metrics(t.out / METRICS), t.out / "curves.png", title=t.out.name)
    md = None
    try:  # a failure to draw the report never fails a finished run
        md = report(t.out) if report is not None else None
    except Exception as e:
        log.warning(f"report not written: {type(e).__name__}: {e}")
    paths = {"metrics": t.out / METRICS, "plot": plot, "report": md, "checkpoint": t.checkpointer.latest(),
             "wandb": t.metrics.close(),
             "tensorboard": t.out / "tensorboard" if t.cfg.logger.tensorboard else None}  # fmt: skip
    log.info(done_lines(summary, t.out, paths, t.cfg.train.steps))


def run(cfg: RootConfig, d: Decisions, report: Callable[[Path], Path | None] | None = None) -> dict | None:
    """Train with an already-validated config and its decisions. Collective: every rank calls it. ``report``
    writes the comb report of a run directory and returns its path (rank 0, at the end)."""
    out = resolve_path(cfg.output_dir)
    found = preflight(cfg, d)  # read-only, on every rank: nothing is written for a run that cannot start
    dist.init_distributed()
    d = agree_across_ranks(d)  # each rank decided from its own GPU; every rank runs rank 0's decisions
    stop = StopRequest(dist.rank(), out / STOP_REQUEST).install()  # from here a signal is a stop, not a kill
    trainer = (GRPOTrainer if cfg.grpo is not None else Trainer)(cfg, d, out, plain(cfg), found, stop)
    attempt = prepare_run_dir(cfg, out, trainer.ds_config)
    dist.setup_logging(str(out / "logs" / f"rank{dist.rank():05d}.log"))
    trainer.setup(restart_count())
    promote_attempt(attempt, out)
    result = trainer.fit()
    stop.settle()  # training is over: nothing left for the stop watchdog to guard
    summary = run_summary(trainer, result)
    finish(trainer, summary, report)
    trainer.close()
    stop.restore()
    return summary
