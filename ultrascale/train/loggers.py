"""Fan-out of per-step metrics to metrics.jsonl, the console, TensorBoard and wandb (rank 0 only).

metrics.jsonl is the source of truth (plots, sweeps and tests read it); the others are views.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("ultrascale")

CONSOLE_KEYS = ("loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "tflops", "mfu", "mem_gb", "data_wait")


def _fmt(k: str, v: float) -> str:
    if k == "lr":
        return f"{k} {v:.2e}"
    if k in ("mfu", "data_wait"):
        return f"{k} {100 * v:.1f}%"
    if k == "tokens_per_s":
        return f"tok/s {v:,.0f}"
    return f"{k} {v:.4g}"


class MetricLogger:
    def __init__(self, cfg: DictConfig, out_dir: Path, enabled: bool):
        self.enabled = enabled
        self.cfg = cfg.logger
        self.jsonl = None
        self.tb = None
        self.wandb_run = None
        self.history: list[dict] = []
        if not enabled:
            return
        self.jsonl = open(out_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115 (closed in close())
        if self.cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out_dir / "tensorboard"))
        if self.cfg.wandb and self.cfg.wandb_mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_MODE", self.cfg.wandb_mode)
            self.wandb_run = wandb.init(
                project=self.cfg.wandb_project,
                entity=self.cfg.wandb_entity,
                group=self.cfg.wandb_group,
                name=self.cfg.run_name or out_dir.name,
                dir=str(out_dir),
                mode=self.cfg.wandb_mode,
                config=OmegaConf.to_container(cfg, resolve=True),
                resume="allow",
                id=_wandb_id(out_dir),
            )

    def log(self, step: int, metrics: dict, console: bool = True) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: float(v) for k, v in metrics.items() if v is not None}}
        self.history.append(row)
        self.jsonl.write(json.dumps(row) + "\n")
        if self.tb:
            for k, v in row.items():
                if k != "step":
                    self.tb.add_scalar(k if "/" in k else f"train/{k}", v, step)
        if self.wandb_run:
            self.wandb_run.log({k if "/" in k else f"train/{k}": v for k, v in row.items() if k != "step"}, step=step)
        if console and self.cfg.console:
            parts = [_fmt(k, row[k]) for k in CONSOLE_KEYS if k in row]
            log.info(f"step {step:>6} | " + " | ".join(parts))

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
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
