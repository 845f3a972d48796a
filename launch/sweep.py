"""Hydra ``-m`` sweeps where every job is its own multi-rank run, and the table that ends a sweep.

Jobs run through the task function in ``ultrascale/cli.py``: with ``launcher=deepspeed|torchrun`` it
starts the launcher for that job (``launch.spawn``), with ``launcher=slurm`` it submits the job's own sbatch
script, and with ``launcher=local`` it trains in the sweep's process. Each job gets its Hydra job directory
as run directory and one wandb group named after the sweep. Hydra's own launchers still work
(``hydra/launcher=submitit_slurm`` runs each job's task function as its own Slurm job).

    python -m launch.sweep multirun/2026-11-22/10-00-00    # (re)build the summary after Slurm jobs finish
"""

from __future__ import annotations

import csv
import math
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from launch.spawn import STATUS_FILE
from ultrascale.errors import DataError
from ultrascale.jsonio import read_json
from ultrascale.paths import resolve_path

if TYPE_CHECKING:
    from ultrascale.config.logger import LoggerConfig

SUMMARY_CSV = "sweep_summary.csv"
COLUMNS = ["job", "overrides", "status", "final_loss", "eval_loss", "tokens_per_s", "mfu", "mem_gb", "run_dir", "best"]
BEST_JSON = "best.json"
OPTUNA_RESULTS = "optimization_results.yaml"
# Set in the sweep's driver process by SweepRecorder, read by cli.py after the sweep (even a failed one).
ACTIVE: dict[str, Path] = {}


class SweepRecorder(Callback):
    """Remembers the sweep directory in the driver process (where the summary is written at the end)."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        # Hydra makes a relative sweep dir under the current directory (not the project root, unlike output_dir)
        ACTIVE["dir"] = Path(config.hydra.sweep.dir).absolute()


def group_name(sweep_dir: str | Path) -> str:
    """A wandb group for the sweep: its directory name, with the date for Hydra's timestamped default."""
    p = Path(sweep_dir)
    if re.fullmatch(r"[\d_:.-]+", p.name):  # multirun/<date>/<time>: the time alone is ambiguous
        return f"{p.parent.name}_{p.name}"
    return p.name


def job_extras(logger: LoggerConfig, job_dir: str, sweep_dir: str, job_num: int) -> dict[str, str]:
    """Per-job settings a sweep adds: its own run dir, the sweep's wandb group, a readable run name."""
    group = logger.wandb_group or group_name(sweep_dir)
    return {
        "output_dir": str(resolve_path(job_dir)),
        "logger.wandb_group": group,
        "logger.run_name": logger.run_name or f"{group}-{job_num}",
    }


def _read_json(path: Path) -> dict:
    """A job's summary or status; a job still writing (or killed mid-write) is just not done yet."""
    try:
        return read_json(path, {})
    except DataError:
        return {}


def collect(sweep_dir: str | Path) -> list[dict]:
    """One row per job directory: the overrides that differ between jobs, status and final numbers."""
    from ultrascale.report import overrides as ov

    jobs = ov.job_dirs(sweep_dir)
    differ = ov.differing({d: ov.read(d) for d in jobs})
    rows = []
    for d in jobs:
        summary, status = _read_json(d / "summary.json"), _read_json(d / STATUS_FILE)
        if "final_loss" in summary:
            state = "done"
        elif status.get("returncode", 0) != 0:
            state = f"failed (exit {status['returncode']})"
        elif "slurm_job" in status:
            state = f"submitted (Slurm job {status['slurm_job']})" if status["slurm_job"] else "sbatch written"
        else:
            state = "incomplete"
        rows.append(
            {
                "job": d.name,
                "overrides": " ".join(differ[d]) or "(none)",
                "status": state,
                **{k: summary.get(k) for k in ("final_loss", "eval_loss", "tokens_per_s", "mfu", "mem_gb")},
                "run_dir": str(d),
            }
        )
    return rows


def _fmt(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:,.1f}" if abs(v) >= 100 else f"{v:.4g}"
    return str(v)


def table(rows: list[dict]) -> str:
    cols = ["job", "overrides", "status", "final_loss", "eval_loss", "tokens_per_s"]
    cells = [cols] + [[_fmt(r[c]) for c in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def best(rows: list[dict]) -> dict | None:
    """The finished job with the lowest eval loss (what a search minimizes; ties to the earlier job)."""
    done = [r for r in rows if isinstance(r.get("eval_loss"), int | float) and not math.isnan(r["eval_loss"])]
    return min(done, key=lambda r: r["eval_loss"]) if done else None


def record_best(sweep_dir: Path, rows: list[dict]) -> str:
    """``best.json`` (the best job, its overrides and eval loss, and Optuna's own verdict when a search ran) and a
    run named ``<group>-best`` in the sweep's wandb group carrying the same; returns the line to print."""
    top = best(rows)
    if top is None:
        return ""
    top["best"] = True
    record = {k: top[k] for k in ("job", "overrides", "eval_loss", "final_loss", "run_dir")}
    optuna = sweep_dir / OPTUNA_RESULTS
    if optuna.exists():
        res = OmegaConf.to_container(OmegaConf.load(optuna))
        record.update(optuna_best_params=res.get("best_params"), optuna_best_value=res.get("best_value"))
    from ultrascale.jsonio import write_json

    write_json(sweep_dir / BEST_JSON, record)
    _wandb_best(Path(top["run_dir"]), record)
    return f"best: job {top['job']} ({top['overrides']}) eval_loss {_fmt(top['eval_loss'])}; {sweep_dir / BEST_JSON}"


def _wandb_best(run_dir: Path, record: dict) -> None:
    """The best trial, as a run of its own in the sweep's wandb group (offline unless the sweep was online)."""
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.exists():
        return
    logger = OmegaConf.load(cfg_path).logger
    if not logger.wandb or logger.wandb_mode == "disabled":
        return
    import wandb

    run = wandb.init(project=logger.wandb_project, entity=logger.wandb_entity, group=logger.wandb_group,
                     name=f"{logger.wandb_group}-best", dir=str(run_dir.parent), mode=str(logger.wandb_mode),
                     config={"best_job": record["job"], "overrides": record["overrides"]}, job_type="sweep-best")  # fmt: skip
    run.summary.update({"best_eval_loss": record["eval_loss"], "best_run_dir": record["run_dir"]})
    run.finish()


def summarize(sweep_dir: str | Path) -> tuple[Path, str]:
    """Write ``<sweep_dir>/sweep_summary.csv`` and return it with the printable table (the best job last)."""
    sweep_dir = Path(sweep_dir)
    rows = collect(sweep_dir)
    line = record_best(sweep_dir, rows)
    path = sweep_dir / SUMMARY_CSV
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in rows)
    return path, table(rows) + (f"\n{line}" if line else "")


def report(sweep_dir: str | Path) -> str:
    """The end-of-sweep message: the table and where the CSV went."""
    path, text = summarize(sweep_dir)
    return f"sweep summary ({path}):\n{text}"


def main(argv: list[str] | None = None) -> int:
    from ultrascale.argv import ArgParser

    parser = ArgParser(prog="python -m launch.sweep", description=__doc__)
    parser.add_argument("sweep_dir", help="a Hydra -m output directory (hydra.sweep.dir), e.g. multirun/DATE/TIME")
    args = parser.parse_args(argv)
    if not Path(args.sweep_dir).is_dir():
        print(f"error: sweep directory {args.sweep_dir} does not exist: pass the hydra.sweep.dir of a -m run",
              file=sys.stderr)  # fmt: skip
        return 2
    print(report(args.sweep_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
