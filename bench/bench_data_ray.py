"""Data prep on Ray against the local executor: the same corpus, tasks and buckets, at 1 and 2 workers.

Ray is how a corpus outgrows one box (KubeRay, a cloud cluster); on one 2-core box it cannot win, so this says
what it costs, for a user to judge when to switch: wall time per run, the head's start-up (``ray start --head``,
paid once per cluster, not per run), the time a run spends joining it, and the peak RSS of every task process by
stage (each task records its own). Both executors must write the same manifest (checked).

Method: one head on loopback for the whole benchmark (``--num-cpus`` = workers of the run: a Ray run at
workers=1 gets a 1-CPU cluster, as a local run gets one process); rounds alternate the executors; each row keeps
its fastest round and lists all of them.

    python bench/bench_data_ray.py [--max-files 0] [--tasks 8] [--rounds 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data_prep.work import STAGES  # noqa: E402
from ultrascale.runtime.dist import free_port  # noqa: E402

BIN = Path(sys.executable).parent
ENV = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0"}


def start_head(cpus: int) -> tuple[str, float]:
    port = free_port()
    t0 = time.perf_counter()
    subprocess.run([str(BIN / "ray"), "start", "--head", f"--port={port}", f"--num-cpus={cpus}",
                    "--include-dashboard=false", "--disable-usage-stats", "--node-ip-address=127.0.0.1"],
                   env=ENV, check=True, capture_output=True)  # fmt: skip
    return f"127.0.0.1:{port}", time.perf_counter() - t0


def stop_head() -> None:
    subprocess.run([str(BIN / "ray"), "stop", "--force"], env=ENV, capture_output=True)


def run(out: Path, executor: str, workers: int, a, address: str = "") -> dict:
    shutil.rmtree(out, ignore_errors=True)
    args = [f"output_dir={out}", f"executor.tasks={a.tasks}", f"buckets={a.tasks}", f"executor.workers={workers}",
            "executor.progress=false", f"executor.type={executor}"]  # fmt: skip
    if a.max_files:
        args.append(f"source.max_files={a.max_files}")
    if executor == "ray":
        args.append(f"executor.address={address}")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "data_prep", *args], cwd=ROOT, env=ENV, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"data_prep failed ({' '.join(args)}):\n{proc.stderr[-3000:]}")
    recs = {}
    for stage in STAGES:
        d = out / "_work" / (f"00_map_t{a.tasks}" if stage == "map" else f"{STAGES.index(stage):02d}_{stage}")
        recs[stage] = [json.loads(p.read_text()) for p in d.glob("task_*.json")]
    starts = [r["start"] for rs in recs.values() for r in rs]
    ends = [r["end"] for rs in recs.values() for r in rs]
    return {
        "wall_s": wall,
        "in_tasks_s": max(ends) - min(starts),  # first task start to last task end
        "task_peak_rss_mb": {s: max(r["peak_rss_mb"] for r in rs) for s, rs in recs.items() if rs},
        "processes": len({r["pid"] for rs in recs.values() for r in rs}),
        "manifest_sha": hashlib.sha256((out / "manifest.json").read_bytes()).hexdigest()[:16],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-files", type=int, default=0, help="stdlib files (0: all)")
    ap.add_argument("--tasks", type=int, default=8, help="tasks per stage, and buckets")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    rows: dict[str, dict] = {}
    heads = {}
    with tempfile.TemporaryDirectory(prefix="bench_data_ray_") as tmp:
        for rnd in range(a.rounds):
            for workers in (1, 2):
                order = ("local", "ray") if rnd % 2 == 0 else ("ray", "local")
                for ex in order:
                    address = ""
                    try:
                        if ex == "ray":
                            stop_head()  # a head left by an earlier, interrupted run
                            address, head_s = start_head(workers)
                            heads.setdefault(workers, []).append(head_s)
                        r = run(Path(tmp) / f"{ex}_w{workers}", ex, workers, a, address)
                    finally:
                        if ex == "ray":
                            stop_head()
                    key = f"{ex} w{workers}"
                    walls = [*rows.get(key, {}).get("walls", []), r["wall_s"]]
                    if key not in rows or r["wall_s"] < rows[key]["wall_s"]:
                        rows[key] = r
                    rows[key]["walls"] = walls
                    print(
                        f"round {rnd + 1}: {key}: {r['wall_s']:.1f} s wall, tasks {r['in_tasks_s']:.1f} s", flush=True
                    )
    shas = {k: r["manifest_sha"] for k, r in rows.items()}
    print(
        f"\nstdlib{f' ({a.max_files} files)' if a.max_files else ''}, {a.tasks} tasks = buckets, {os.cpu_count()} cores"
    )
    print("| executor | workers | wall s (best) | all rounds | first task to last s | start-up and hand-over s "
          "| head start s | processes | peak RSS of a task, MB |")  # fmt: skip
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for workers in (1, 2):
        for ex in ("local", "ray"):
            r = rows[f"{ex} w{workers}"]
            head = f"{min(heads[workers]):.1f}" if ex == "ray" else "-"
            print(f"| {ex} | {workers} | {r['wall_s']:.1f} | {', '.join(f'{w:.1f}' for w in r['walls'])} | "
                  f"{r['in_tasks_s']:.1f} | {r['wall_s'] - r['in_tasks_s']:.1f} | {head} | {r['processes']} | "
                  f"{max(r['task_peak_rss_mb'].values()):.0f} |")  # fmt: skip
    print(f"\nsame manifest everywhere: {len(set(shas.values())) == 1} ({shas})")
    print("\npeak RSS of a task by stage, workers=2 (MB)")
    print("| stage | local | ray |\n|---|---:|---:|")
    for s in STAGES:
        print(f"| {s} | {rows['local w2']['task_peak_rss_mb'][s]:.0f} | {rows['ray w2']['task_peak_rss_mb'][s]:.0f} |")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"settings": vars(a), "rows": rows, "head_start_s": heads}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
