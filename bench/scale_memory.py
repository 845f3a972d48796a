"""Peak host memory per rank while a ~0.5B model is built, and its model states after a step, per layout.

Each layout runs ``python -m ultrascale.train.memprobe`` on its ranks (the engine exactly as ``train.py`` builds
it, then one optimizer step on random tokens) and reports the maximum over its ranks of the construction peak,
the setup peak and the steady state, against a bound per layout and against the planner's
``ultrascale.cost.memory`` figures, which must be within 15 % of every measured steady state (the script exits 1
if not). The ``whole`` row is the old construction (every rank builds the whole model). Each column and its
bound: bench/README.md, "bench/scale_memory.py". All sizes in GiB (2**30 bytes).

    python bench/scale_memory.py [--json PATH]      # make bench-scale
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# ~0.51B parameters: Llama-style, 26 layers, hidden 1280, GQA 20:4, SwiGLU 3456, a 49,152 vocabulary (tied).
MODEL = ["model.config.hidden_size=1280", "model.config.intermediate_size=3456", "model.config.num_hidden_layers=26",
         "model.config.num_attention_heads=20", "model.config.num_key_value_heads=4", "model.config.vocab_size=49152",
         "model.config.max_position_embeddings=2048", "model.name=llama_500m"]  # fmt: skip
COMMON = ["data.seq_len=32", "data.micro_batch=1", "logger=none", "train.compile=false"]
PRETRAINED = "{pretrained}"  # replaced by the checkpoint main() saves once
LAYOUTS = [  # (name, ranks, overrides)
    ("whole", 2, ["zero=stage1"]),
    ("zero3", 1, ["zero=stage3"]),
    ("zero3", 2, ["zero=stage3"]),
    ("zero3", 4, ["zero=stage3"]),
    ("pp2", 2, ["zero=stage1", "parallel=pp2"]),
    ("tp2", 2, ["zero=stage1", "parallel=tp2"]),
    ("zero3_load", 2, ["zero=stage3", f"model.pretrained_path={PRETRAINED}"]),
    ("pp2_load", 2, ["zero=stage1", "parallel=pp2", f"model.pretrained_path={PRETRAINED}"]),
]
GB = 2**30
SLACK = 300e6 / GB  # the bound's fixed allowance: 300 MB (runtime buffers, one tensor in flight)
SHARD = "200MB"  # checkpoint file size of the loaded rows: a loading rank may hold one file besides its share
PLANNER_TOLERANCE = 0.15


def save_pretrained(tmp: Path) -> tuple[Path, float]:
    """The model saved once as a sharded safetensors checkpoint; (its directory, its largest file in GiB)."""
    from ultrascale.config.compose import compose
    from ultrascale.model.build import build_model

    out = tmp / "pretrained"
    build_model(compose([*MODEL, *COMMON]).model, seed=1).save_pretrained(out, max_shard_size=SHARD)
    return out, max(f.stat().st_size for f in out.glob("*.safetensors")) / GB


def probe(name: str, ranks: int, overrides: list[str], tmp: Path) -> list[dict]:
    from ultrascale.runtime.dist import free_port

    out = tmp / f"{name}_{ranks}.json"
    args = [*MODEL, *COMMON, f"data.global_batch={ranks}", *overrides]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    if ranks == 1:
        cmd = [sys.executable, "-m", "ultrascale.train.memprobe", str(out), *args]
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    else:
        torchrun = str(Path(sys.executable).parent / "torchrun")
        cmd = [torchrun, "--nproc_per_node", str(ranks), "--master_port", str(free_port()),
               "-m", "ultrascale.train.memprobe", str(out), *args]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"error: {name} x{ranks} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return [json.loads(Path(f).read_text()) for f in sorted(glob.glob(f"{out}.rank*"))]


def planner(name: str, ranks: int, overrides: list[str]) -> tuple[float, float, float, float]:
    """(planner steady GB, planner build GB, full model GB, per-rank model or stage bytes GB) for the layout."""
    from ultrascale.config.compose import compose
    from ultrascale.cost.memory import construction_bytes, host_step_bytes, rank_params
    from ultrascale.model.arch import arch_from_cfg
    from ultrascale.plan.search import layout_from_cfg

    cfg = compose([*MODEL, *COMMON, f"data.global_batch={ranks}", *overrides])
    arch, lay = arch_from_cfg(cfg.model), layout_from_cfg(cfg, ranks)
    full = 4 * (arch.dense_params + arch.expert_params)
    if lay.pp > 1:
        share = 4 * sum(rank_params(arch, lay))
    else:
        share = full / ranks
    return host_step_bytes(arch, lay) / GB, construction_bytes(arch, lay) / GB, full / GB, share / GB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--only", help="comma-separated layout names (whole,zero3,pp2,tp2,zero3_load,pp2_load)")
    a = ap.parse_args()
    rows = []
    chosen = [lay for lay in LAYOUTS if not a.only or lay[0] in a.only.split(",")]
    with tempfile.TemporaryDirectory(prefix="scale_memory_") as tmp:
        pretrained, file_gb = (None, 0.0)
        if any(name.endswith("_load") for name, _, _ in chosen):
            pretrained, file_gb = save_pretrained(Path(tmp))
        for name, ranks, overrides in chosen:
            overrides = [o.replace(PRETRAINED, str(pretrained)) for o in overrides]
            t0 = time.perf_counter()
            per_rank = probe(name, ranks, overrides, Path(tmp))
            plan_gb, plan_build_gb, full_gb, share_gb = planner(name, ranks, overrides)
            construct = max(r["construct_peak_gb"] for r in per_rank)
            steady = max(r["after_step_gb"] for r in per_rank)
            bound = None
            if name not in ("tp2", "whole"):
                bound = 1.25 * share_gb + SLACK + (file_gb if name.endswith("_load") else 0.0)
            err = plan_gb / steady - 1
            rows.append({
                "layout": name, "ranks": ranks, "construct_peak_gb": round(construct, 3),
                "bound_gb": None if bound is None else round(bound, 3),
                "setup_peak_gb": round(max(r["setup_peak_gb"] for r in per_rank), 3),
                "after_setup_gb": round(max(r["after_setup_gb"] for r in per_rank), 3),
                "steady_gb": round(steady, 3), "planner_gb": round(plan_gb, 3),
                "planner_build_gb": round(plan_build_gb, 3), "full_model_gb": round(full_gb, 3),
                "within_bound": None if bound is None else construct <= bound, "planner_error": round(err, 3),
                "planner_ok": abs(err) <= PLANNER_TOLERANCE, "seconds": round(time.perf_counter() - t0, 1),
                "n_params": per_rank[0]["n_params"],
            })  # fmt: skip
            print(f"{name} x{ranks}: done in {rows[-1]['seconds']} s", file=sys.stderr, flush=True)
    head = (f"{'layout':<10} {'ranks':>5} {'build GB':>9} {'bound':>7} {'planned':>8} {'setup pk':>9} {'after setup':>11} "
            f"{'steady GB':>10} {'planner':>8} {'err':>6} {'full':>6}")  # fmt: skip
    print(head + "\n" + "-" * len(head))
    for r in rows:
        bound = "-" if r["bound_gb"] is None else f"{r['bound_gb']:.2f}"
        print(f"{r['layout']:<10} {r['ranks']:>5} {r['construct_peak_gb']:9.2f} {bound:>7} {r['planner_build_gb']:8.2f} "
              f"{r['setup_peak_gb']:9.2f} {r['after_setup_gb']:11.2f} {r['steady_gb']:10.2f} {r['planner_gb']:8.2f} "
              f"{r['planner_error']:+6.1%} {r['full_model_gb']:6.2f}")  # fmt: skip
    print(
        f"model: {rows[0]['n_params'] / 1e9:.3f} B params (fp32); build = RSS rise at its peak while the model is "
        "built or loaded, setup pk = peak inside deepspeed.initialize, steady = after one optimizer step; "
        "whole = every rank builds the whole model (ZeRO-1, and every layout before partitioned building); "
        "tp2 is built whole by DeepSpeed 0.19.8's AutoTP"
    )
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"rows": rows, "model": MODEL, "shard": SHARD}, indent=2) + "\n")
        print(f"wrote {a.json}")
    bad = [f"{r['layout']} x{r['ranks']}" for r in rows if r["within_bound"] is False or not r["planner_ok"]]
    if bad:
        raise SystemExit(f"error: outside the construction bound or the planner's 15 %: {', '.join(bad)}")


if __name__ == "__main__":
    main()
