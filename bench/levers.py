"""Each compute lever off vs on, through ``train.py`` on the same ranks, model, data and batch.

``LEVERS`` below lists each lever's two settings (every other lever stays at its default while one is
toggled). The two settings run alternately in paired rounds; the speedup is the median of the per-round ratios
of wall-clock tokens/s over steps 2..N, with the median-step ratio and the peak memory per rank beside it. What
each lever is, and the method on a shared 2-core machine: bench/README.md, "bench/levers.py".

    python bench/levers.py [--levers compile,fused_loss,...] [--rounds 3] [--steps 30] [--seq-len 256] [--json PATH]
                           [--train-args "train.compile=false"]   # a lever against other defaults
                           [--data data/stdlib]                   # prepared shards instead of the byte corpus
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

from _harness import torchrun  # noqa: E402

LEVERS = {
    "compile": ("train.compile=false", "train.compile=true"),
    "compile_layers": ("train.compile_scope=model", "train.compile_scope=layers"),
    "fused_loss": ("train.fused_loss=false", "train.fused_loss=true"),
    "fused_adamw": ("optim.fused=false", "optim.fused=true"),
    "attn_blocks": ("train.attn_block_size=0", "train.attn_block_size=64"),
    "doc_mask": ("data.document_masking=false", "data.document_masking=true"),
    "breakdown": ("train.step_breakdown=false", "train.step_breakdown=true"),
    "packing": (None, None),  # data differs, see _padded_dataset
    "autocast_bf16": ("precision.autocast=none", "precision.autocast=bf16"),
    "loss_chunk": ("train.loss_chunk_tokens=512", "train.loss_chunk_tokens=0"),
    "act_ckpt": ("train.activation_checkpointing=false", "train.activation_checkpointing=true"),
    "overlap_reduce": ("train.overlap_loss_reduce=false", "train.overlap_loss_reduce=true"),
}


def _padded_dataset(src: Path, out: Path) -> tuple[Path, float]:
    """The packed byte corpus re-cut as one document per row (EOS-terminated, padded with masked EOS).

    Returns the directory and the fraction of real tokens, so a padded run's rate can be counted in the
    tokens that train the model.
    """
    import numpy as np

    from ultrascale.data.shards import open_split, write_samples

    manifest = json.loads((src / "manifest.json").read_text())
    eos, seq = int(manifest["eos_token_id"]), int(manifest["seq_len"])
    splits, masks, real = {}, {}, 0
    for name in ("train", "validation"):
        flat = open_split(src, name).get(np.arange(len(open_split(src, name))))
        toks = flat.reshape(-1)
        ends = np.flatnonzero(toks == eos)
        rows, mrows, start = [], [], 0
        for end in ends:  # each document, cut into rows of seq tokens, the last row padded
            doc = toks[start : end + 1]
            start = end + 1
            for i in range(0, len(doc), seq):
                piece = doc[i : i + seq]
                row = np.full(seq, eos, dtype=np.int64)
                row[: len(piece)] = piece
                m = np.zeros(seq, dtype=bool)
                m[: len(piece)] = True
                rows.append(row)
                mrows.append(m)
        splits[name], masks[name] = [np.stack(rows)], [np.stack(mrows)]
        if name == "train":
            real = float(np.stack(mrows).mean())
    write_samples(out, splits, seq_len=seq, vocab_size=int(manifest["vocab_size"]), eos_token_id=eos,
                  tokenizer="tokenizer", loss_masks=masks)  # fmt: skip
    return out, real


def _run(tmp: Path, name: str, common: list[str], extra: list[str]) -> dict:
    run = tmp / name
    torchrun(2, ["train.py", *common, f"output_dir={run}", *extra])
    summary = json.loads((run / "summary.json").read_text())
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if "event" not in r and "step_s" in r]
    return {
        "tokens_per_s": summary["wall_tokens_per_s"],
        "mem_gb": max(r["mem_gb"] for r in steps),
        "first_step_s": steps[0]["step_s"] if steps else None,
        # the robust companion: the median step time over steps 2..N (every step is logged), which a burst from
        # another process covering a few steps moves far less than the wall-clock window
        "median_step_s": statistics.median(r["step_s"] for r in steps[1:]) if len(steps) > 1 else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levers", default=",".join(LEVERS), help=f"comma-separated subset of {list(LEVERS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--json", dest="json_path", help="write results as JSON here")
    ap.add_argument(
        "--data", help="prepared shards to train on (e.g. data/stdlib); default: the byte-level stdlib corpus"
    )
    ap.add_argument(
        "--train-args", default="", help="extra train.py overrides for every run, e.g. 'train.compile=false'"
    )
    a = ap.parse_args()
    levers = [x for x in a.levers.split(",") if x]
    unknown = set(levers) - set(LEVERS)
    if unknown:
        sys.exit(f"error: unknown lever(s) {sorted(unknown)}: choose from {list(LEVERS)}")

    from ultrascale.data.bytecorpus import write_byte_dataset

    tmp = Path(tempfile.mkdtemp(prefix="bench_levers_"))
    if a.data:
        from ultrascale.data.shards import load_manifest
        from ultrascale.errors import DataError

        data = Path(a.data).resolve()
        try:
            seq = int(load_manifest(data)["seq_len"])
        except DataError as e:  # missing or corrupt shards: one line, not a traceback
            sys.exit(f"error: --data: {e}")
        if seq != a.seq_len:
            sys.exit(f"error: --data {data} is packed with seq_len={seq}, not {a.seq_len}: pass --seq-len {seq}")
    else:
        data = write_byte_dataset(tmp / "data", seq_len=a.seq_len, max_files=200)
    common = ["logger=none", f"data.seq_len={a.seq_len}", "data.micro_batch=4", "data.global_batch=16",
              f"train.steps={a.steps}", "train.eval_interval=0", "train.checkpoint_interval=0",
              "optim.sched.warmup_steps=5", "data.eval_batches=1", "train.log_interval=1", *a.train_args.split()]  # fmt: skip
    padded = real_frac = None
    results = []
    for lever in levers:
        off, on = LEVERS[lever]
        pairs = []
        for r in range(a.rounds):
            order = ("off", "on") if r % 2 == 0 else ("on", "off")
            got = {}
            for side in order:
                if lever == "packing":
                    if padded is None:
                        padded, real_frac = _padded_dataset(data, tmp / "padded")
                    extra = [f"data.path={padded if side == 'off' else data}"]
                else:
                    extra = [f"data.path={data}", off if side == "off" else on]
                got[side] = _run(tmp, f"{lever}_{side}_{r}", common, extra)
                if lever == "packing" and side == "off":
                    got[side]["tokens_per_s"] *= real_frac  # count only real tokens
            pairs.append(got)
            print(f"{lever:<12} round {r + 1}/{a.rounds}: off {got['off']['tokens_per_s']:,.0f} tok/s, "
                  f"on {got['on']['tokens_per_s']:,.0f} tok/s", flush=True)  # fmt: skip
        ratios = [p["on"]["tokens_per_s"] / p["off"]["tokens_per_s"] for p in pairs]
        per_token = 1 / real_frac if lever == "packing" else 1.0  # padded steps carry fewer real tokens
        step_ratios = [p["off"]["median_step_s"] / p["on"]["median_step_s"] * per_token for p in pairs
                       if p["on"]["median_step_s"]]  # fmt: skip
        res = {
            "lever": lever,
            "off": off or "padded rows",
            "on": on or "packed rows",
            "off_tokens_per_s": statistics.median(p["off"]["tokens_per_s"] for p in pairs),
            "on_tokens_per_s": statistics.median(p["on"]["tokens_per_s"] for p in pairs),
            "speedup": statistics.median(ratios),
            "speedup_min": min(ratios),
            "speedup_max": max(ratios),
            "speedup_median_step": statistics.median(step_ratios) if step_ratios else None,
            "speedup_median_step_min": min(step_ratios) if step_ratios else None,
            "speedup_median_step_max": max(step_ratios) if step_ratios else None,
            "mem_off_gb": statistics.median(p["off"]["mem_gb"] for p in pairs),
            "mem_on_gb": statistics.median(p["on"]["mem_gb"] for p in pairs),
            "first_step_on_s": statistics.median(p["on"]["first_step_s"] for p in pairs),
            "first_step_off_s": statistics.median(p["off"]["first_step_s"] for p in pairs),
            "rounds": pairs,
        }
        if lever == "packing":
            res["real_token_fraction_padded"] = real_frac
        results.append(res)

    print(f"\n{'lever':<12} {'off tok/s':>10} {'on tok/s':>10} {'speedup':>8} {'spread':>13} {'med. step':>9} "
          f"{'spread':>13} {'mem off':>8} {'mem on':>8} {'1st step on':>11}")  # fmt: skip
    for r in results:
        ms = r["speedup_median_step"]
        ms_txt = (f"{ms:>9.3f} {r['speedup_median_step_min']:>6.3f}-{r['speedup_median_step_max']:<6.3f}" if ms
                  else f"{'-':>9} {'-':>13}")  # fmt: skip
        print(f"{r['lever']:<12} {r['off_tokens_per_s']:>10,.0f} {r['on_tokens_per_s']:>10,.0f} {r['speedup']:>8.3f} "
              f"{r['speedup_min']:>6.3f}-{r['speedup_max']:<6.3f} {ms_txt} {r['mem_off_gb']:>7.3f}G "
              f"{r['mem_on_gb']:>7.3f}G {r['first_step_on_s']:>10.1f}s")  # fmt: skip
    print(
        "(med. step: the paired ratio of each run's median step time over steps 2..N, robust to a burst that covers"
        " a few steps; when it and the wall-clock speedup disagree, the machine was disturbed)"
    )
    model = next((o.split("=", 1)[1] for o in reversed(common) if o.startswith("model=")), "tiny")  # --train-args
    print(
        f"\n{a.rounds} paired rounds per lever, {a.steps} steps, seq {a.seq_len}, 2 CPU ranks, model {model}, "
        f"data {a.data or 'byte-level stdlib corpus'}"
    )
    if a.json_path:
        Path(a.json_path).parent.mkdir(parents=True, exist_ok=True)
        settings = {"rounds": a.rounds, "steps": a.steps, "seq_len": a.seq_len, "nproc": 2, "model": model, "common": common,
                    "data": a.data or "byte-level stdlib corpus"}  # fmt: skip
        Path(a.json_path).write_text(json.dumps({"settings": settings, "levers": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
