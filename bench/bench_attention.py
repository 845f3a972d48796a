"""Forward+backward time of a model with HF's masked ``sdpa`` vs ultrascale's attention kernels, paired.

The kernels (``train.attention_kernel``) are ``blocks`` (causal SDPA by query blocks) and ``flex``
(FlexAttention over document blocks). Each is a few percent of a step, the size of this box's noise, so copies of
the same model take turns on the same micro-batches in one process and each kernel's speedup is the median of the
paired ratios ``sdpa / kernel``. The method, the modes, the data and the measured tables: bench/README.md,
"``train.attention_kernel=flex`` on a CPU" and "bench/bench_attention.py".

    python bench/bench_attention.py [--kernels blocks,flex] [--modes compiled,eager,eval] [--steps 60] [--json PATH]
    python bench/bench_attention.py --model-dir models/smollm2-135m --data data/stdlib_smollm2 --micro 2 --modes eager --steps 14
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


KERNELS = ("blocks", "flex")
MODES = ("compiled", "eager", "eval")


def _model_config(a: argparse.Namespace):
    from omegaconf import OmegaConf

    from ultrascale.config.compose import compose

    if a.model_dir:
        return OmegaConf.create({"type": "llama", "name": Path(a.model_dir).name, "pretrained_path": a.model_dir,
                                 "init_seed": None, "attn_implementation": "sdpa", "config": None})  # fmt: skip
    return compose([]).model  # conf/model/tiny.yaml, as bench-train trains it


def _vocab(a: argparse.Namespace) -> int:
    """The model's vocabulary (the default corpus must fit in it)."""
    if a.model_dir:
        from transformers import AutoConfig

        return int(AutoConfig.from_pretrained(a.model_dir).vocab_size)
    return int(_model_config(a).config.vocab_size)


def _data(a: argparse.Namespace, vocab: int, tmp: Path) -> tuple[Path, str]:
    if not a.data:
        from train_overhead import pick_data

        return pick_data("auto", 256, vocab, tmp)
    from ultrascale.data.shards import load_manifest
    from ultrascale.errors import DataError

    path = Path(a.data).resolve()
    try:
        load_manifest(path)
    except DataError as e:  # missing or corrupt shards: one line, not a traceback
        sys.exit(f"error: --data: {e}")
    return path, str(path)


def _models(a: argparse.Namespace, kernels: list[str], compiled: bool) -> dict:
    import copy

    import torch

    from ultrascale.levers.decide import attention_unfit, loss_unfit
    from ultrascale.model.attention import install_blocked_attention
    from ultrascale.model.build import build_model
    from ultrascale.model.flex import install_flex_attention
    from ultrascale.model.loss import install_fused_loss

    sdpa = build_model(_model_config(a), seed=0)
    why = loss_unfit(sdpa.config)  # the decision's rule: install_fused_loss acts on it and checks none of it
    if why:
        sys.exit(f"error: the fused loss does not fit this model ({why}); bench a verified model type")
    install_fused_loss(sdpa)
    models = {"sdpa": sdpa}
    for k in kernels:
        m = copy.deepcopy(sdpa)
        why = attention_unfit(m.config, getattr(m.config, "_attn_implementation", None))
        if why:
            sys.exit(f"error: --kernels {k} is not installable on this model: {why}")
        install_blocked_attention(m, a.block) if k == "blocks" else install_flex_attention(m)
        models[k] = m
    return {k: torch.compile(m) if compiled else m for k, m in models.items()}


def _multi_doc_rows(split, eos: int):
    """Indices of the rows holding two or more documents (an EOS before the last token): the rows the kernels
    change (a micro-batch without one takes SDPA's causal kernel on every side)."""
    import numpy as np

    found = []
    for start in range(0, len(split), 4096):
        ids = split.get(np.arange(start, min(start + 4096, len(split))))
        found.append(start + np.flatnonzero((ids[:, :-1] == eos).any(axis=1)))
    return np.concatenate(found)


def _measure(a: argparse.Namespace, data: Path, kernels: list[str], mode: str) -> dict:
    import numpy as np
    import torch

    from ultrascale.data.loader import make_batch
    from ultrascale.data.shards import load_manifest, open_split

    torch.set_num_threads(1)
    split = open_split(data, "train", verify=False)
    eos = int(load_manifest(data)["eos_token_id"])
    models = _models(a, kernels, compiled=mode == "compiled")
    names = list(models)
    times: dict[str, list[float]] = {k: [] for k in names}
    pool = _multi_doc_rows(split, eos) if a.rows == "multi" else np.arange(len(split))
    if not len(pool):
        sys.exit(f"error: --rows multi: no row of {data} holds several documents; use --rows all")
    rows = multi = 0
    for i in range(a.warmup + a.steps):
        idx = pool[np.arange(i * a.micro, (i + 1) * a.micro) % len(pool)]
        batch = make_batch(split.get(idx), None, eos, document_masking=True)
        if i >= a.warmup:
            restarts = (batch.position_ids[:, 1:] == 0).any(dim=1)
            rows, multi = rows + len(restarts), multi + int(restarts.sum())
        for name in names[i % len(names) :] + names[: i % len(names)]:  # rotate who goes first
            t = time.perf_counter()
            if mode == "eval":
                with torch.no_grad():
                    models[name](**batch.model_inputs())
            else:
                models[name](**batch.model_inputs()).loss.backward()
                models[name].zero_grad(set_to_none=True)
            times[name].append(time.perf_counter() - t)
    base = times["sdpa"][a.warmup :]
    result = {"mode": mode, "sdpa_ms": 1e3 * statistics.median(base), "pairs": len(base),
              "tokens_per_micro": a.micro * split.seq_len, "multi_doc_rows": multi / max(1, rows), "kernels": {}}  # fmt: skip
    for k in kernels:
        mine = times[k][a.warmup :]
        ratios = [s / t for s, t in zip(base, mine)]
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        result["kernels"][k] = {"ms": 1e3 * statistics.median(mine), "speedup": statistics.median(ratios),
                                "q1": q1, "q3": q3}  # fmt: skip
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated: blocks, flex (vs HF sdpa)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated: compiled, eager (fwd+bwd), eval")
    ap.add_argument("--steps", type=int, default=60, help="timed micro-batches per mode (each runs every side)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed micro-batches first (compile, allocator)")
    ap.add_argument("--micro", type=int, default=4, help="rows per micro-batch (bench-train: 4)")
    ap.add_argument("--block", type=int, default=64, help="query block of the blocks kernel (train.attn_block_size)")
    ap.add_argument(
        "--rows",
        choices=("multi", "all"),
        default="multi",
        help="multi: only rows holding several documents (the rows the kernels change); all: every row",
    )
    ap.add_argument("--model-dir", help="a local HF model directory (default: the tiny model of conf/model)")
    ap.add_argument("--data", help="prepared shards (default: the bench-train corpus)")
    ap.add_argument("--json", dest="json_path", help="write results as JSON here")
    a = ap.parse_args()
    modes = [m for m in a.modes.split(",") if m]
    kernels = [k for k in a.kernels.split(",") if k]
    if set(modes) - set(MODES) or set(kernels) - set(KERNELS) or not kernels or a.steps < 4:
        sys.exit(f"error: --modes={a.modes} --kernels={a.kernels} --steps={a.steps}: modes are {'/'.join(MODES)}, "
                 f"kernels {'/'.join(KERNELS)}, and at least 4 steps")  # fmt: skip
    vocab = _vocab(a)
    data, desc = _data(a, vocab, Path(tempfile.mkdtemp(prefix="bench_attention_")))
    results = []
    for mode in modes:
        r = _measure(a, data, kernels, mode)
        results.append(r)
        mine = ", ".join(f"{k} {v['ms']:.1f} ms ({v['speedup']:.3f}x)" for k, v in r["kernels"].items())
        print(f"{mode}: sdpa {r['sdpa_ms']:.1f} ms, {mine}", flush=True)
    print(
        f"\n| {'mode':<8} | {'kernel':<6} | {'sdpa ms':>8} | {'kernel ms':>9} | {'speedup':>7} | {'IQR':>11} | pairs |"
    )
    print(f"|{'-' * 10}|{'-' * 8}|{'-' * 10}|{'-' * 11}|{'-' * 9}|{'-' * 13}|{'-' * 7}|")
    for r in results:
        for k, v in r["kernels"].items():
            print(f"| {r['mode']:<8} | {k:<6} | {r['sdpa_ms']:>8.1f} | {v['ms']:>9.1f} | {v['speedup']:>7.3f} "
                  f"| {v['q1']:.3f}-{v['q3']:.3f} | {r['pairs']:>5} |")  # fmt: skip
    model = a.model_dir or "tiny (conf/model/tiny.yaml)"
    print(f"\nper micro-batch of {results[0]['tokens_per_micro']} tokens ({results[0]['multi_doc_rows']:.0%} of the "
          f"timed rows hold several documents), one thread, fused loss, document masking; compiled/eager: fwd+bwd, "
          f"eval: forward under no_grad; model {model}; block {a.block}; data {desc}")  # fmt: skip
    if a.json_path:
        Path(a.json_path).parent.mkdir(parents=True, exist_ok=True)
        settings = {"model": model, "data": desc, "block": a.block, "micro": a.micro, "steps": a.steps,
                    "kernels": kernels, "rows": a.rows}  # fmt: skip
        Path(a.json_path).write_text(json.dumps({"settings": settings, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
