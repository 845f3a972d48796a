"""Train a Hugging Face causal LM with DeepSpeed, composed from typed Hydra config groups.

python train.py recipe=cpu_smoke                        # 1 rank
torchrun --nproc_per_node 2 train.py recipe=cpu_smoke   # 2 ranks
deepspeed --num_gpus 2 train.py recipe=cpu_smoke zero=stage3 train.steps=50
python train.py recipe=starcoder2_3b_zero2 dry_run=true # its cluster's decisions, HBM, step time; no training
python train.py --help                                  # groups, keys and their defaults
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ultrascale.cli import run_app

if TYPE_CHECKING:
    from ultrascale.config.root import RootConfig


def main(cfg: RootConfig) -> dict | None:
    if cfg.dry_run:  # the planner's view of this layout on the recipe's cluster (or this machine); nothing written
        from ultrascale.plan.dryrun import dry_run

        return dry_run(cfg)
    from ultrascale.levers.rules import validate
    from ultrascale.runtime.dist import planned_world_size

    decisions = validate(cfg, planned_world_size(cfg))  # every rule, then what the run does, before anything is built
    from ultrascale.train.run import run

    return run(cfg, decisions, report=_report)


def _report(run_dir: Path) -> Path:
    """The comb report of a finished run (report.md + report.png); the report sits above training, so it is handed
    down from here rather than imported by the trainer."""
    from ultrascale.report import write_report

    return write_report([run_dir])[0]


if __name__ == "__main__":
    raise SystemExit(run_app("train", main, help_text=__doc__))
