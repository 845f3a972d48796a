"""Tokens/s of ``train.py`` against a bare DeepSpeed loop: same model, batch, ZeRO stage, ranks, data.

The trainer adds metrics (a loss all-reduce, grad norm, RSS), deterministic step-addressed data and
logging; this measures what that costs. Both sides are timed by wall clock over steps 2..N, so
everything the trainer does between steps (metrics.jsonl, console, all-reduces) counts against it. Runs alternate (train, bare, train, bare, ...) so drift on a
shared machine hits both, and the table reports medians. Target: ratio >= 0.97.

    python bench/train_overhead.py [--rounds 3] [--steps 30] [--zero stage1] [--nproc 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT))


def _torchrun(nproc: int, args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
           "TORCH_EXTENSIONS_DIR": str(ROOT / ".cache" / "torch_extensions"), "PYTHONPATH": str(ROOT)}  # fmt: skip
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"benchmark run failed: {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--zero", default="stage1")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--json", dest="json_path", help="write results as JSON here")
    a = ap.parse_args()

    from ultrascale.data.bytecorpus import write_byte_dataset

    tmp = Path(tempfile.mkdtemp(prefix="bench_train_"))
    data = write_byte_dataset(tmp / "data", seq_len=a.seq_len, max_files=200)
    common = ["logger=none", f"zero={a.zero}", f"data.path={data}", f"data.seq_len={a.seq_len}", "data.micro_batch=4",
              f"data.global_batch={4 * a.nproc * 2}", f"train.steps={a.steps}", "train.eval_interval=0",
              "train.checkpoint_interval=0", "optim.sched.warmup_steps=5"]  # fmt: skip
    ours, bare = [], []
    for r in range(a.rounds):
        run = tmp / f"run{r}"
        _torchrun(a.nproc, ["train.py", *common, f"output_dir={run}"])
        ours.append(json.loads((run / "summary.json").read_text())["wall_tokens_per_s"])
        out = _torchrun(a.nproc, ["bench/_bare_loop.py", str(run), str(data), str(a.steps)])
        bare.append(json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1])["tokens_per_s"])
        print(
            f"round {r + 1}/{a.rounds}: train.py {ours[-1]:,.0f} tok/s | bare DeepSpeed loop {bare[-1]:,.0f} tok/s",
            flush=True,
        )
    res = {
        "zero": a.zero, "nproc": a.nproc, "steps": a.steps, "seq_len": a.seq_len, "rounds": a.rounds,
        "train_py_tokens_per_s": ours, "bare_tokens_per_s": bare,
        "train_py_median": statistics.median(ours), "bare_median": statistics.median(bare),
    }  # fmt: skip
    res["ratio"] = res["train_py_median"] / res["bare_median"]
    print(f"\n| {'loop':<22} | {'tokens/s (median)':>17} | {'ratio':>6} |\n|{'-' * 24}|{'-' * 19}|{'-' * 8}|")
    print(f"| {'bare DeepSpeed loop':<22} | {res['bare_median']:>17,.0f} | {1:>6.3f} |")
    print(f"| {'train.py (ultrascale)':<22} | {res['train_py_median']:>17,.0f} | {res['ratio']:>6.3f} |")
    print(f"\ntarget >= 0.97: {'met' if res['ratio'] >= 0.97 else 'NOT met'}  (ZeRO {a.zero}, {a.nproc} CPU ranks)")
    if a.json_path:
        Path(a.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json_path).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
