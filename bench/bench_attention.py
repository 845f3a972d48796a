"""Forward+backward time of a model with HF's ``sdpa`` vs ultrascale's causal SDPA by query blocks, paired.

``train.attn_block_size`` is a few percent of a whole ``train.py`` step, which is the size of this box's
run-to-run noise; so this measures what it changes, in one process: two copies of the same model (one with
``install_blocked_attention``, both with the fused loss, as train.py builds them) take turns on the same
micro-batches, alternating which goes first, and the speedup is the median of the per-micro-batch paired
ratios ``sdpa / blocks`` (with the IQR). A slow stretch of the machine hits both sides of a pair. One thread,
as one rank of the CPU runs has. Modes: ``compiled`` (``torch.compile``, train.py's default) and ``eager``
(what pipeline, ZeRO-3 and the short recipes run). The baseline, HF's sdpa, is measured in the same run.

    python bench/bench_attention.py [--modes compiled,eager] [--steps 60] [--block 64] [--json PATH]
    python bench/bench_attention.py --model-dir models/smollm2-135m --data data/stdlib_smollm2 --micro 2 --modes eager --steps 14

Data: ``--data`` shards (their seq_len), else the bench-train corpus (data/stdlib when prepared, else the
byte-level stdlib corpus), with document masking as train.py applies it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: one core, as one CPU rank has
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def _data(a: argparse.Namespace, tmp: Path) -> tuple[Path, str]:
    if not a.data:
        from train_overhead import pick_data

        return pick_data("auto", 256, tmp)
    from ultrascale.data.shards import load_manifest
    from ultrascale.errors import DataError

    path = Path(a.data).resolve()
    try:
        load_manifest(path)
    except DataError as e:  # missing or corrupt shards: one line, not a traceback
        sys.exit(f"error: --data: {e}")
    return path, str(path)


def _models(a: argparse.Namespace, compiled: bool):
    import copy

    import torch
    from omegaconf import OmegaConf

    from ultrascale.config.compose import compose
    from ultrascale.model.attention import install_blocked_attention
    from ultrascale.model.build import build_model
    from ultrascale.model.loss import install_fused_loss

    if a.model_dir:
        mcfg = OmegaConf.create({"type": "llama", "name": Path(a.model_dir).name, "pretrained_path": a.model_dir,
                                 "init_seed": None, "attn_implementation": "sdpa", "config": None})  # fmt: skip
    else:
        mcfg = compose([]).model  # conf/model/tiny.yaml, as bench-train trains it
    sdpa = build_model(mcfg, seed=0)
    install_fused_loss(sdpa)
    blocks = copy.deepcopy(sdpa)
    installed, why = install_blocked_attention(blocks, a.block)
    if not installed:
        sys.exit(f"error: the blocked attention is not installable on this model: {why}")
    models = {"sdpa": sdpa, "blocks": blocks}
    return {k: torch.compile(m) if compiled else m for k, m in models.items()}


def _measure(a: argparse.Namespace, data: Path, mode: str) -> dict:
    import numpy as np
    import torch

    from ultrascale.data.loader import make_batch
    from ultrascale.data.shards import load_manifest, open_split

    torch.set_num_threads(1)
    split = open_split(data, "train", verify=False)
    eos = int(load_manifest(data)["eos_token_id"])
    models = _models(a, compiled=mode == "compiled")
    times: dict[str, list[float]] = {k: [] for k in models}
    for i in range(a.warmup + a.steps):
        rows = np.arange(i * a.micro, (i + 1) * a.micro) % len(split)
        batch = make_batch(split.get(rows), None, eos, document_masking=True)
        order = list(models) if i % 2 else list(models)[::-1]
        for name in order:
            t = time.perf_counter()
            models[name](**batch.model_inputs()).loss.backward()
            times[name].append(time.perf_counter() - t)
            models[name].zero_grad(set_to_none=True)
    sdpa, blocks = times["sdpa"][a.warmup :], times["blocks"][a.warmup :]
    ratios = [s / b for s, b in zip(sdpa, blocks)]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return {
        "mode": mode,
        "sdpa_ms": 1e3 * statistics.median(sdpa),
        "blocks_ms": 1e3 * statistics.median(blocks),
        "speedup": statistics.median(ratios),
        "q1": q1,
        "q3": q3,
        "pairs": len(ratios),
        "tokens_per_micro": a.micro * split.seq_len,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="compiled,eager", help="comma-separated: compiled, eager")
    ap.add_argument("--steps", type=int, default=60, help="timed micro-batches per mode (each runs both sides)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed micro-batches first (compile, allocator)")
    ap.add_argument("--micro", type=int, default=4, help="rows per micro-batch (bench-train: 4)")
    ap.add_argument("--block", type=int, default=64, help="query block (train.attn_block_size)")
    ap.add_argument("--model-dir", help="a local HF model directory (default: the tiny model of conf/model)")
    ap.add_argument("--data", help="prepared shards (default: the bench-train corpus)")
    ap.add_argument("--json", dest="json_path", help="write results as JSON here")
    a = ap.parse_args()
    modes = [m for m in a.modes.split(",") if m]
    if set(modes) - {"compiled", "eager"} or a.steps < 4:
        sys.exit(f"error: --modes={a.modes} --steps={a.steps}: modes are compiled/eager, and at least 4 steps")
    data, desc = _data(a, Path(tempfile.mkdtemp(prefix="bench_attention_")))
    results = []
    for mode in modes:
        r = _measure(a, data, mode)
        results.append(r)
        print(f"{mode}: sdpa {r['sdpa_ms']:.1f} ms, blocks {r['blocks_ms']:.1f} ms, paired {r['speedup']:.3f}",
              flush=True)  # fmt: skip
    print(f"\n| {'mode':<9} | {'sdpa ms':>8} | {'blocks ms':>9} | {'speedup':>7} | {'IQR':>11} | pairs |")
    print(f"|{'-' * 11}|{'-' * 10}|{'-' * 11}|{'-' * 9}|{'-' * 13}|{'-' * 7}|")
    for r in results:
        print(f"| {r['mode']:<9} | {r['sdpa_ms']:>8.1f} | {r['blocks_ms']:>9.1f} | {r['speedup']:>7.3f} "
              f"| {r['q1']:.3f}-{r['q3']:.3f} | {r['pairs']:>5} |")  # fmt: skip
    model = a.model_dir or "tiny (conf/model/tiny.yaml)"
    print(f"\nfwd+bwd per micro-batch of {results[0]['tokens_per_micro']} tokens, one thread, fused loss, document "
          f"masking; model {model}; block {a.block}; data {desc}")  # fmt: skip
    if a.json_path:
        Path(a.json_path).parent.mkdir(parents=True, exist_ok=True)
        settings = {"model": model, "data": desc, "block": a.block, "micro": a.micro, "steps": a.steps}
        Path(a.json_path).write_text(json.dumps({"settings": settings, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
