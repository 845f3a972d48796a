"""Step time of each parallelism lever against plain ZeRO-1 data parallelism, and the measured pipeline bubble.

Every run is ``train.py`` on the same ranks, data and micro-batch; only the ``parallel`` group changes. The
dense levers (pp=2, tp=2, sp=2) are compared with ZeRO-1 on the tiny Llama; ep=2 with ZeRO-1 on the tiny
MoE (the same model, experts replicated). Step time is the median over steps after warm-up.

The bubble: with p stages and m micro-batches a 1F1B step takes about (m + p - 1) stage-slots, so
T(m) = a*m + b with b = (p-1)*a in theory. We time pp=2 at several m, fit the line, and report the
measured idle fraction b / T(m) next to (p-1)/(m+p-1). The fixed part b also holds the optimizer step and
the per-step handshakes, so the measured value is an upper bound on the schedule's bubble.

    python bench/parallel_levers.py [--steps 10] [--seq-len 128] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _harness import torchrun  # noqa: E402  (the one torchrun-on-CPU helper of the benches)

MICRO = 2
WARMUP = 3  # steps excluded from the median: JIT, allocator and first-touch costs


def _step_time(tmp: Path, name: str, common: list[str], extra: list[str]) -> float:
    run = tmp / name
    torchrun(2, ["train.py", *common, f"output_dir={run}", *extra])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_s"] for r in rows if "step_s" in r and "event" not in r and r["step"] > WARMUP]
    return statistics.median(times)


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares line y = a*x + b."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return a, my - a * mx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batches", default="1,2,4,8", help="pipeline m values for the bubble fit")
    ap.add_argument("--json", dest="json_path", help="write results as JSON here")
    a = ap.parse_args()

    from ultrascale.data.bytecorpus import BYTE_VOCAB, write_byte_dataset

    tmp = Path(tempfile.mkdtemp(prefix="bench_parallel_"))
    data = write_byte_dataset(tmp / "data", seq_len=a.seq_len, max_files=200)
    gb = MICRO * 2 * 2  # dp=2 baselines: 2 micro-steps; dp=1 levers: 4 micro-steps (same samples per step)
    common = ["logger=none", "train.compile=false", "zero=stage1", f"data.path={data}", f"data.seq_len={a.seq_len}",
              f"data.micro_batch={MICRO}", f"data.global_batch={gb}", f"train.steps={a.steps}",
              "train.eval_interval=0", "train.checkpoint_interval=0", "optim.sched.warmup_steps=2",
              f"model.config.vocab_size={BYTE_VOCAB}"]  # fmt: skip
    moe = ["model=tiny_moe", f"model.config.vocab_size={BYTE_VOCAB}"]
    rows = []
    base = _step_time(tmp, "zero1", common, [])
    rows.append({"lever": "ZeRO-1 dp=2 (baseline)", "model": "tiny", "step_s": base, "vs_baseline": 1.0})
    for name, extra in (("pp=2", ["parallel=pp2"]), ("tp=2", ["parallel=tp2"]), ("sp=2", ["parallel=sp2"])):
        t = _step_time(tmp, name.replace("=", ""), common, extra)
        rows.append({"lever": f"{name} (dp=1) + ZeRO-1", "model": "tiny", "step_s": t, "vs_baseline": t / base})
    moe_base = _step_time(tmp, "moe_zero1", common, moe)
    rows.append({"lever": "ZeRO-1 dp=2 (baseline)", "model": "tiny_moe", "step_s": moe_base, "vs_baseline": 1.0})
    t = _step_time(tmp, "ep2", common, [*moe, "parallel=ep2"])
    rows.append({"lever": "ep=2 (dp=2) + ZeRO-1", "model": "tiny_moe", "step_s": t, "vs_baseline": t / moe_base})

    ms = [int(m) for m in a.micro_batches.split(",")]
    pipe = {m: _step_time(tmp, f"pp_m{m}", common, ["parallel=pp2", f"data.global_batch={m * MICRO}"]) for m in ms}
    slope, fixed = _fit([float(m) for m in ms], [pipe[m] for m in ms])
    bubble = [{"m": m, "step_s": pipe[m], "measured": fixed / pipe[m], "theory": (2 - 1) / (m + 2 - 1)} for m in ms]

    print(f"\nparallel levers: 2 CPU ranks, seq_len {a.seq_len}, micro-batch {MICRO}, {gb} samples/step, "
          f"median of steps {WARMUP + 1}-{a.steps}")  # fmt: skip
    print(f"{'lever':<28} {'model':<9} {'step s':>8} {'x baseline':>10}")
    for r in rows:
        print(f"{r['lever']:<28} {r['model']:<9} {r['step_s']:>8.4f} {r['vs_baseline']:>10.2f}")
    print(f"\npipeline bubble, p=2: T(m) = {slope:.4f}*m + {fixed:.4f} s")
    print(f"{'m':>3} {'step s':>8} {'measured b/T':>13} {'(p-1)/(m+p-1)':>14}")
    for b in bubble:
        print(f"{b['m']:>3} {b['step_s']:>8.4f} {b['measured']:>13.3f} {b['theory']:>14.3f}")
    if a.json_path:
        out = {"levers": rows, "bubble": {"p": 2, "slope_s": slope, "fixed_s": fixed, "points": bubble},
               "seq_len": a.seq_len, "micro_batch": MICRO, "global_batch": gb, "steps": a.steps}  # fmt: skip
        Path(a.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json_path).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
