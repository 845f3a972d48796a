"""Finetune on the kept samples with ``train.py`` on N ranks, then export the result as an HF directory.

The finetune is the command a user would type: ``python train.py <overrides> launcher=torchrun
launcher.nproc_per_node=2``, which starts the launcher itself (``launch/spawn.py``). So it gets DeepSpeed,
ZeRO, checkpoints, metrics and train.py's auto-resume for free: a killed finetune rerun with the same
``output_dir`` continues from its newest checkpoint. The model group is deleted (``~model``): the
architecture comes from ``model.pretrained_path``'s config.json, as in the CPT recipe.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

from ultrascale.errors import UltrascaleError
from ultrascale.paths import PROJECT_ROOT
from ultrascale.ssd.config import FinetuneConfig
from ultrascale.train.checkpoint import tag_for
from ultrascale.train.rundir import LATEST, STOPPED


class FinetuneFailed(UltrascaleError):
    """train.py exited non-zero; its own error line and per-rank logs say why."""


def steps_for(rows: int, cfg: FinetuneConfig) -> int:
    """Optimizer steps for ``rows`` packed rows: ``epochs`` passes, clamped to [min_steps, max_steps]."""
    return max(cfg.min_steps, min(cfg.max_steps, math.ceil(cfg.epochs * rows / cfg.global_batch)))


def train_overrides(
    cfg: FinetuneConfig, model_dir: Path, data_dir: Path, run_dir: Path, steps: int, seq_len: int
) -> list[str]:
    """The ``train.py`` command line after the script name: the user's overrides, then SSD's own."""
    return [
        *cfg.train_overrides,
        "~model",
        f"model.pretrained_path={model_dir}",
        f"data.path={data_dir}",
        "data.prepare_if_missing=false",
        f"data.seq_len={seq_len}",
        f"data.micro_batch={cfg.micro_batch}",
        f"data.global_batch={cfg.global_batch}",
        f"optim.lr={cfg.lr}",
        f"optim.sched.warmup_steps={cfg.warmup_steps}",
        f"optim.sched.min_lr_ratio={cfg.min_lr_ratio}",
        f"optim.weight_decay={cfg.weight_decay}",
        f"optim.betas=[{cfg.betas[0]},{cfg.betas[1]}]",
        f"train.steps={steps}",
        f"train.checkpoint_interval={cfg.checkpoint_interval}",
        "train.eval_interval=0",
        f"train.keep_checkpoints={cfg.keep_checkpoints}",
        f"output_dir={run_dir}",
        f"launcher={cfg.launcher}",
        f"launcher.nproc_per_node={cfg.nproc}",
    ]


def finished(run_dir: Path, steps: int) -> bool:
    """Whether the run already holds its final checkpoint (``latest`` is written last, atomically)."""
    latest = run_dir / "checkpoints" / LATEST
    return latest.exists() and latest.read_text().strip() == tag_for(steps)


def require_finished(run_dir: Path, steps: int) -> None:
    """train.py exits 0 when a signal or a STOP file stops it (Ctrl-C, preemption): its checkpoint is saved, but
    the run is not over. The finetune stage is done only at its final step; otherwise the round stops with one
    line, and the same command resumes train.py from that checkpoint."""
    if finished(run_dir, steps):
        return
    latest = run_dir / "checkpoints" / LATEST
    newest = latest.read_text().strip() if latest.exists() else "none"
    why = "stopped by a signal or a STOP file" if (run_dir / STOPPED).exists() else "it exited before its last step"
    raise FinetuneFailed(
        f"finetune (train.py) ended before step {steps} ({why}); newest checkpoint {newest} in {run_dir}: "
        "run the same command again to resume it"
    )


def run_train(args: list[str], log_path: Path) -> None:
    """Run ``python train.py args`` from the project root; its output goes to ``log_path`` and the console."""
    cmd = [sys.executable, str(PROJECT_ROOT / "train.py"), *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(
            cmd, cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        tail: list[str] = []
        for line in proc.stdout:
            log.write(line)
            tail = [*tail[-20:], line.rstrip()]
            if "error:" in line or "done:" in line or " step " in line or line.startswith("launching:"):
                print(line, end="", flush=True)
        rc = proc.wait()
    if rc != 0:
        errors = [ln for ln in tail if ln.startswith("error:")]
        why = errors[-1][len("error: ") :] if errors else f"exit code {rc}"
        raise FinetuneFailed(f"finetune (train.py) failed: {why}; full output in {log_path}")


def export_model(run_dir: Path, out: Path, dtype: str, step: int | None = None) -> dict:
    """Export the run's final checkpoint (or ``step``'s) to ``out`` (via a temporary sibling, so ``out`` is
    complete or absent)."""
    from ultrascale.export import export

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    stats = export(run_dir, tmp, step=step, dtype=dtype)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return {k: stats[k] for k in ("tag", "zero_stage", "dtype", "model_mb")}


def export_checkpoints(run_dir: Path, out_root: Path, dtype: str) -> list[str]:
    """Every other kept checkpoint of the finetune as ``out_root/step_XXXXXXXX``: the candidates an evaluation
    chooses from on its dev split (``python -m ultrascale.ssd.evaluate --model ssd=DIR,DIR,...``)."""
    from ultrascale.train.checkpoint import complete_tags

    latest = (run_dir / "checkpoints" / LATEST).read_text().strip()
    out = []
    for tag in complete_tags(run_dir / "checkpoints"):
        if tag != latest:
            export_model(run_dir, out_root / tag, dtype, step=int(tag.split("_")[-1]))
            out.append(str(out_root / tag))
    return out
