"""The one way the benchmarks start a multi-rank ``train.py`` (or a baseline script) on this CPU box."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

BENCH_ENV = {
    "DS_ACCELERATOR": "cpu",
    "OMP_NUM_THREADS": "1",  # one core per rank: the ranks, not intra-op threads, share the machine
    "WANDB_MODE": "disabled",
    "TOKENIZERS_PARALLELISM": "false",
    "TORCH_EXTENSIONS_DIR": str(ROOT / ".cache" / "torch_extensions"),
    "ULTRASCALE_CACHE_DIR": str(ROOT / ".cache" / "ultrascale"),  # the calibrated CPU peak
    "PYTHONPATH": str(ROOT),
}


def torchrun(nproc: int, args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``torchrun --nproc_per_node nproc args`` from the project root; exit with its output on failure."""
    from ultrascale.runtime.dist import free_port

    full_env = {**os.environ, **BENCH_ENV, **(env or {})}
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", str(free_port()), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"benchmark run failed: {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc
