"""LoRA against the full fine-tune it replaces: peak RSS per rank and tokens/s, SmolLM2-135M on 2 CPU ranks, under
ZeRO-2 and ZeRO-3 (``train.py`` via torchrun; the baseline, ``finetune=none``, measured in the same run).

    python bench/bench_lora.py [--steps 6] [--seq-len 128] [--json bench/results/bench_lora.json]

Each rank's peak resident set is its kernel high-water mark (``VmHWM``), read from /proc while it runs (the last
read before it exits: exact up to the final sampling interval). tokens/s is the run's wall-clock rate over steps
2..N (``summary.json`` ``wall_tokens_per_s``), with the median step time beside it. Needs
``models/smollm2-135m`` (``make models/smollm2-135m/model.safetensors``); the data is SmolLM2-tokenized stdlib code
(``--data``, or prepared here: 40 files).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import BENCH_ENV, BIN, ROOT

MODEL = ROOT / "models" / "smollm2-135m"


def _hwm_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for kv in env:
        if kv.startswith(b"RANK="):
            return int(kv[5:])
    return None


def launch_and_watch(args: list[str]) -> dict[int, float]:
    """Run ``torchrun --nproc_per_node 2 train.py ARGS`` and return each rank's peak RSS in GiB."""
    import psutil

    from ultrascale.runtime.dist import free_port

    cmd = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()), "train.py", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **BENCH_ENV}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    peaks: dict[int, int] = {}
    parent = psutil.Process(proc.pid)
    while proc.poll() is None:
        for child in parent.children(recursive=True):
            rank = _rank_of(child.pid)
            hwm = _hwm_kb(child.pid) if rank is not None and "train.py" in " ".join(child.cmdline()) else None
            if hwm is not None:
                peaks[rank] = max(peaks.get(rank, 0), hwm)
        time.sleep(0.2)
    out = proc.stdout.read()
    if proc.returncode:
        sys.exit(f"benchmark run failed: {' '.join(cmd)}\n{out[-4000:]}")
    return {r: kb / 2**20 for r, kb in sorted(peaks.items())}


def prepare(out: Path, seq_len: int) -> Path:
    cmd = [sys.executable, "-m", "data_prep", f"output_dir={out}", f"tokenizer.path={MODEL}", "fim.rate=0",
           "source.max_files=40", f"pack.seq_len={seq_len}"]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, env={**os.environ, **BENCH_ENV}, check=True, capture_output=True)
    return out


def run(tmp: Path, data: Path, zero: str, finetune: str, a: argparse.Namespace) -> dict:
    out = tmp / f"{finetune}_{zero}"
    args = ["recipe=smollm2_135m_lora", f"finetune={finetune}", f"zero={zero}", f"data.path={data}",
            f"model.pretrained_path={MODEL}", f"data.seq_len={a.seq_len}", "data.micro_batch=2", "data.global_batch=4",
            f"train.steps={a.steps}", "train.log_interval=1", "train.checkpoint_interval=0", "train.eval_interval=0",
            "logger=none", "optim.sched.warmup_steps=1", f"output_dir={out}", *a.train_args.split()]  # fmt: skip
    peaks = launch_and_watch(args)
    s = json.loads((out / "summary.json").read_text())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if "event" not in r and "step_s" in r]
    return {"zero": zero, "finetune": finetune, "peak_rss_gb_per_rank": peaks,
            "trainable_params": s["trainable_params"], "total_params": s["total_params"],
            "tokens_per_s": s["wall_tokens_per_s"], "median_step_s": statistics.median(r["step_s"] for r in steps[1:]),
            "final_loss": s.get("final_loss")}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--zero", default="stage2,stage3", help="comma-separated zero= options")
    ap.add_argument("--data", help="SmolLM2-tokenized shards of --seq-len (default: prepared here)")
    ap.add_argument("--train-args", default="train.compile=false", help="extra train.py overrides for every run")
    ap.add_argument("--json", dest="json_path", help="write results as JSON here")
    a = ap.parse_args()
    if not (MODEL / "model.safetensors").exists():
        sys.exit(f"{MODEL} is missing: make models/smollm2-135m/model.safetensors")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        data = Path(a.data) if a.data else prepare(Path(tmp) / "data", a.seq_len)
        for zero in a.zero.split(","):
            for finetune in ("none", "lora"):  # the baseline first, in the same run
                rows.append(run(Path(tmp), data, zero, finetune, a))
                print(f"  measured finetune={finetune} zero={zero}", file=sys.stderr)
    print(f"SmolLM2-135M, 2 CPU ranks, fp32, seq {a.seq_len}, 512 tokens/step x {a.steps} steps")
    print(f"{'zero':<8}{'finetune':<10}{'trainable':>14}{'peak RSS rank0/rank1 GiB':>28}{'tokens/s':>10}"
          f"{'step s':>8}{'RSS vs full':>13}{'tok/s vs full':>15}")  # fmt: skip
    base = {}
    for r in rows:
        peak = max(r["peak_rss_gb_per_rank"].values())
        if r["finetune"] == "none":
            base[r["zero"]] = (peak, r["tokens_per_s"])
        b_peak, b_tps = base[r["zero"]]
        ranks = " / ".join(f"{v:.2f}" for v in r["peak_rss_gb_per_rank"].values())
        print(f"{r['zero']:<8}{'full' if r['finetune'] == 'none' else r['finetune']:<10}"
              f"{r['trainable_params'] / 1e6:>13.2f}M{ranks:>28}{r['tokens_per_s']:>10.1f}{r['median_step_s']:>8.2f}"
              f"{peak / b_peak:>12.2f}x{r['tokens_per_s'] / b_tps:>14.2f}x")  # fmt: skip
    if a.json_path:
        Path(a.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json_path).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
