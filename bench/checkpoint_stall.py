"""How long training waits for a checkpoint: the synchronous save against the background writer, on the same job.

Both sides run ``train.py`` under torchrun on 2 CPU ranks with the same model, data and interval; only
``train.checkpoint_async`` differs (``--staging pageable,pinned`` adds a background run per staging mode). From
each run's metrics.jsonl it reports each save's stall, the background write time, the stalls' share of wall time
and the median step. ``--micro GB`` times the staging copy alone on this machine's device, first (allocating)
and later (reusing) snapshot, as the background writer takes it. The columns and the default job:
bench/README.md, "bench/checkpoint_stall.py".

    python bench/checkpoint_stall.py [--job smollm2_135m|tiny] [--steps 9] [--interval 3] [--rounds 1]
                                     [--staging pageable,pinned] [--json PATH]
    python bench/checkpoint_stall.py --micro 4 [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _harness import torchrun  # noqa: E402

MODES = {"sync": "train.checkpoint_async=false", "async": "train.checkpoint_async=true"}


def micro_state(gb: float, device: str) -> dict:
    """An optimizer-shaped state of ``gb`` GB on ``device``: fp32 master/moment slabs (BF16_Optimizer's flat
    groups, DeepSpeed's ZeRO partitions) holding 96 %, and 256 small tensors (norms, counters) the rest."""
    import torch

    n = int(gb * 1e9 / 4)
    big = [torch.randn(int(n * 0.32), device=device) for _ in range(3)]
    small = [torch.randn(max(1, int(n * 0.04 / 256)), device=device) for _ in range(256)]
    return {"flat": big, "small": small, "step": 7}


def micro(gb: float, modes: tuple[str, ...] = ("pinned", "pageable")) -> list[dict]:
    """First (allocating) and later (reusing) staging copies of a ``gb`` GB state per mode, in GB/s."""
    import torch

    from ultrascale.train.ckpt_writer import Staging

    device = "cuda" if torch.cuda.is_available() else "cpu"
    state = micro_state(gb, device)
    nbytes = sum(t.numel() * t.element_size() for t in [*state["flat"], *state["small"]])
    rows = []
    for mode in modes:
        st = Staging(mode)
        times = []
        for _ in range(3):  # first, then two reuses (the median of those is "later")
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            snap = st.stage("state.pt", state)
            st.sync()
            times.append(time.perf_counter() - t0)
        assert torch.equal(snap["flat"][0][:1000].cpu(), state["flat"][0][:1000].cpu())  # the copy landed
        later = statistics.median(times[1:])
        rows.append({"mode": mode, "ran_as": st.mode, "device": device, "gb": nbytes / 1e9, "first_s": times[0],
                     "later_s": later, "alloc_s": st.allocate_s, "later_gbps": nbytes / 1e9 / later,
                     "first_gbps": nbytes / 1e9 / times[0]})  # fmt: skip
        del st, snap
    return rows


def print_micro(rows: list[dict]) -> None:
    dev = rows[0]["device"]
    print(f"staging copy of a {rows[0]['gb']:.2f} GB optimizer-shaped state on {dev} (no training; one sync per save)")
    print(f"{'mode':<10}{'ran as':<10}{'first s':>9}{'alloc s':>9}{'later s':>9}{'later GB/s':>12}")
    for r in rows:
        print(f"{r['mode']:<10}{r['ran_as']:<10}{r['first_s']:>9.3f}{r['alloc_s']:>9.3f}{r['later_s']:>9.3f}"
              f"{r['later_gbps']:>12.2f}")  # fmt: skip
    if dev == "cpu":
        print("on a CPU host both modes are the same host memcpy (pinned runs as pageable): the DMA path is GPU-only")


def job_args(job: str) -> list[str]:
    if job == "tiny":
        return ["recipe=cpu_smoke"]
    from train_overhead import smollm2_data

    data, _ = smollm2_data(2048)
    return ["model=smollm2_135m", f"data.path={data}", "data.seq_len=2048", "data.micro_batch=1",
            "data.global_batch=2", "optim.sched.warmup_steps=2"]  # fmt: skip


def run_once(job: list[str], mode: str, steps: int, interval: int, out: Path) -> dict:
    flag = MODES.get(mode) or f"train.checkpoint_async=true train.checkpoint_staging={mode.split(':')[1]}"
    args = ["train.py", *job, *flag.split(), f"train.steps={steps}", f"train.checkpoint_interval={interval}",
            "train.eval_interval=0", "train.compile=false", "logger=none", "train.keep_checkpoints=1",
            f"output_dir={out}"]  # fmt: skip
    torchrun(2, args)
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    stalls = [r["checkpoint_s"] for r in rows if r.get("event") == "checkpoint"]
    ran_as = {r.get("staging") for r in rows if r.get("event") == "checkpoint"} - {None}
    writes = [r["write_s"] for r in rows if r.get("event") == "checkpoint_written"]
    steps_s = [r["step_s"] for r in rows if "loss" in r]
    times = [r["time_s"] for r in rows if "loss" in r]
    wall = times[-1] - times[0] + steps_s[0]
    size = sum(p.stat().st_size for p in (out / "checkpoints").rglob("*") if p.is_file() and "step_" in str(p))
    return {"mode": mode, "ran_as": ",".join(sorted(ran_as)) or "sync", "saves": len(stalls), "stall_s": statistics.mean(stalls), "stall_max_s": max(stalls),
            "stall_first_s": stalls[0], "stall_later_s": statistics.mean(stalls[1:]) if len(stalls) > 1 else stalls[0],
            "write_s": statistics.mean(writes) if writes else statistics.mean(stalls), "step_s": statistics.median(steps_s),
            "wall_s": wall, "stall_share": sum(stalls) / wall, "checkpoint_gb": size / 1e9}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job", choices=("smollm2_135m", "tiny"), default="smollm2_135m")
    ap.add_argument("--steps", type=int, default=9, help="optimizer steps per run (default 9)")
    ap.add_argument("--interval", type=int, default=3, help="train.checkpoint_interval (default 3)")
    ap.add_argument("--rounds", type=int, default=1, help="paired rounds, alternating order (default 1)")
    ap.add_argument("--staging", default="", help="also a background run per train.checkpoint_staging mode "
                    "(comma-separated: pageable,pinned)")  # fmt: skip
    ap.add_argument("--micro", type=float, metavar="GB", help="only the staging copy of a GB-sized state, per mode")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.micro:
        rows = micro(a.micro)
        print_micro(rows)
        if a.json:
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps({"micro_gb": a.micro, "rows": rows}, indent=2) + "\n")
        return
    job = job_args(a.job)
    modes = [*MODES, *(f"staging:{m.strip()}" for m in a.staging.split(",") if m.strip())]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        for r in range(a.rounds):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                rows.append({"round": r, **run_once(job, mode, a.steps, a.interval, Path(tmp) / f"{mode}{r}")})
                print(f"round {r} {mode:<5} stall {rows[-1]['stall_s']:.2f} s per save", flush=True)
    print(
        f"\n{a.job}: {a.steps} steps, a checkpoint every {a.interval} and at the end (~{rows[0]['checkpoint_gb']:.2f} GB)"
    )
    print(f"{'mode':<18}{'saves':>6}{'stall s':>9}{'first s':>9}{'later s':>9}{'write s':>9}{'step s':>8}{'wall s':>8}"
          f"{'stall share':>13}")  # fmt: skip
    med: dict[str, dict] = {}
    for mode in modes:
        mine = [row for row in rows if row["mode"] == mode]
        med[mode] = {k: statistics.median(row[k] for row in mine) for k in mine[0]
                     if k not in ("mode", "round", "ran_as")}  # fmt: skip
        med[mode]["ran_as"] = mine[0]["ran_as"]
        m = med[mode]
        print(f"{mode:<18}{m['saves']:>6.0f}{m['stall_s']:>9.2f}{m['stall_first_s']:>9.2f}{m['stall_later_s']:>9.2f}"
              f"{m['write_s']:>9.2f}"
              f"{m['step_s']:>8.2f}{m['wall_s']:>8.1f}{100 * m['stall_share']:>12.1f}%")  # fmt: skip
    for mode in modes:
        if mode.startswith("staging:") and med[mode]["ran_as"] != mode.split(":")[1]:
            print(f"{mode} ran as {med[mode]['ran_as']} here (no CUDA: nothing to pin for)")
    cut = med["sync"]["stall_s"] / max(med["async"]["stall_s"], 1e-9)
    later = med["sync"]["stall_later_s"] / max(med["async"]["stall_later_s"], 1e-9)
    print(
        f"\nafter the first save (which allocates the staging buffers): {med['sync']['stall_later_s']:.2f} s -> "
        f"{med['async']['stall_later_s']:.2f} s per save ({later:.1f}x less)"
    )
    print(f"stall per save: {med['sync']['stall_s']:.2f} s -> {med['async']['stall_s']:.2f} s ({cut:.1f}x less); "
          f"share of wall time {100 * med['sync']['stall_share']:.1f} % -> {100 * med['async']['stall_share']:.1f} %")  # fmt: skip
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"job": a.job, "rows": rows, "median": med}, indent=2) + "\n")


if __name__ == "__main__":
    main()
