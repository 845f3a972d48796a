"""The ``deepspeed`` launcher against ``torchrun`` on the same run: tokens/s, time to first step, the threads each
rank got and the MFU peak it divided by, in paired rounds.

Users type ``deepspeed --num_gpus 2 train.py ...`` (the README leads with it); the other benchmarks use torchrun.
Each round runs both on ``recipe=cpu_smoke`` in alternating order, with the environment a user has (no
``OMP_NUM_THREADS``). The ratio is deepspeed / torchrun per round, reported as the median (target >= 0.97). What
each column measures: bench/README.md, "bench/launchers.py".

    python bench/launchers.py [--rounds 3] [--steps 40] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _harness import BENCH_ENV, BIN  # noqa: E402

from ultrascale.runtime.dist import free_port  # noqa: E402

LAUNCHERS = ("deepspeed", "torchrun")
TARGET = 0.97


def _cmd(launcher: str) -> list[str]:
    if launcher == "deepspeed":
        return [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), "train.py"]
    return [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()), "train.py"]


def run_once(launcher: str, steps: int, out: Path) -> dict:
    env = {k: v for k, v in {**os.environ, **BENCH_ENV}.items() if k != "OMP_NUM_THREADS"}  # as a user types it
    args = ["recipe=cpu_smoke", f"train.steps={steps}", "logger=none", f"output_dir={out}"]
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.time()
    proc = subprocess.run([*_cmd(launcher), *args], cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode:
        sys.exit(f"{launcher} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    s = json.loads((out / "summary.json").read_text())
    threads = re.search(r"(\d+) thread\(s\) per rank x (\d+) local rank", proc.stdout)
    return {
        "launcher": launcher,
        "tokens_per_s": s["wall_tokens_per_s"],
        "first_step_s": s["first_step_unix"] - t0,
        "rank_first_step_s": s["time_to_first_step_s"],
        "wall_s": wall,
        "final_loss": s["final_loss"],
        "threads_per_rank": int(threads.group(1)) if threads else None,
        "local_ranks": int(threads.group(2)) if threads else None,
        "mfu_peak": s["mfu_peak"],
        "mfu": s["mfu"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="paired rounds (default 3)")
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps per run (default 40)")
    ap.add_argument("--json", type=Path, help="write the rows and the summary here")
    a = ap.parse_args()
    from data_prep.api import prepare

    prepare(str(ROOT / "data" / "stdlib"), max_files=400)  # cpu_smoke's corpus, outside the timing
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as tmp:
        run_once("torchrun", 3, Path(tmp) / "warmup")  # caches, the shm op build, the peak calibration
        for r in range(a.rounds):
            order = LAUNCHERS if r % 2 == 0 else LAUNCHERS[::-1]
            for launcher in order:
                rows.append({"round": r, **run_once(launcher, a.steps, Path(tmp) / launcher)})
                print(f"round {r}: {launcher:<9} {rows[-1]['tokens_per_s']:>9,.0f} tok/s  first step "
                      f"{rows[-1]['first_step_s']:5.1f} s", flush=True)  # fmt: skip
    by = {(row["round"], row["launcher"]): row for row in rows}
    ratios = [by[(r, "deepspeed")]["tokens_per_s"] / by[(r, "torchrun")]["tokens_per_s"] for r in range(a.rounds)]
    ttfs = [by[(r, "deepspeed")]["first_step_s"] / by[(r, "torchrun")]["first_step_s"] for r in range(a.rounds)]
    summary = {
        "ratio_tokens_per_s": statistics.median(ratios),
        "ratio_tokens_per_s_min_max": [min(ratios), max(ratios)],
        "ratio_first_step": statistics.median(ttfs),
        "target": TARGET,
        "met": statistics.median(ratios) >= TARGET,
    }
    head = f"{'launcher':<10}{'tokens/s':>10}{'first step s':>14}{'rank first s':>14}{'threads x ranks':>17}{'loss':>8}"
    print("\n" + head)
    for launcher in LAUNCHERS:
        mine = [row for row in rows if row["launcher"] == launcher]
        med = {k: statistics.median(row[k] for row in mine) for k in ("tokens_per_s", "first_step_s",
                                                                      "rank_first_step_s", "final_loss")}  # fmt: skip
        tr = f"{mine[0]['threads_per_rank']} x {mine[0]['local_ranks']}"
        print(f"{launcher:<10}{med['tokens_per_s']:>10,.0f}{med['first_step_s']:>14.1f}{med['rank_first_step_s']:>14.1f}"
              f"{tr:>17}{med['final_loss']:>8.4f}")  # fmt: skip
    print(f"\ndeepspeed / torchrun tokens/s: {summary['ratio_tokens_per_s']:.3f} (median of {a.rounds} paired "
          f"rounds, {min(ratios):.3f}-{max(ratios):.3f}; target >= {TARGET}); first step "
          f"{summary['ratio_first_step']:.3f}x torchrun's")  # fmt: skip
    peaks = {row["mfu_peak"] for row in rows}
    print(f"MFU peak divided by: {' | '.join(sorted(peaks))}" + (" (the same for both)" if len(peaks) == 1 else ""))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"rows": rows, "summary": summary}, indent=2) + "\n")


if __name__ == "__main__":
    main()
