"""Loader throughput: a three-source mixture against the single-source loader, in one run.

What ``data.sources`` costs per micro-batch on the trainer's path (``StepBatches.get``: apportionment, slot
shuffle, per-source row permutation, gather, labels and document-masking position ids). The two sides alternate
in paired rounds, each from a fresh loader; the ratio is the median of the per-round ratios. Sources, method and
the measured table: bench/README.md, "The mixture loader".

    python bench/bench_mixture.py [--rounds 7] [--steps 1500] [--seq-len 2048] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ultrascale.data.bytecorpus import EOS, write_byte_dataset
from ultrascale.data.loader import StepBatches
from ultrascale.data.mixture import Mixture, Stage
from ultrascale.data.shards import load_manifest, open_split

WEIGHTS = (0.5, 0.3, 0.2)


def _byte_sources(root: Path, seq_len: int) -> list[Path]:
    kinds = [("top", "*.py", 60), ("email", "email/*.py", 40), ("asyncio", "asyncio/*.py", 40)]
    return [write_byte_dataset(root / n, seq_len=seq_len, max_files=k, pattern=p) for n, p, k in kinds]


def _rate(readers, mixture, mb: int, gb: int, dp: int, steps: int, eos: int) -> float:
    b = StepBatches(readers, mb, gb, 0, dp, 0, eos_id=eos, document_masking=True, mixture=mixture)
    t0, n = time.perf_counter(), 0
    for step in range(steps):
        for micro in range(b.grad_accum):
            n += b.get(step, micro).input_ids.shape[0]
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sources", default="", help="comma-separated prepared dirs (3); default: byte corpora")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--seq-len", type=int, default=2048, help="byte corpora only")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        paths = [Path(p) for p in a.sources.split(",")] if a.sources else _byte_sources(Path(tmp), a.seq_len)
        readers = [open_split(p, "train", verify=False) for p in paths]
        eos = int(load_manifest(paths[0]).get("eos_token_id", EOS))
        sizes = [len(r) for r in readers]
        seq = readers[0].seq_len
        rows = []
        for r in range(a.rounds):
            order = ("single", "mix") if r % 2 == 0 else ("mix", "single")
            got = {}
            for side in order:
                if side == "single":
                    got[side] = _rate(readers[:1], Mixture.single(sizes[0], a.global_batch, 0), a.micro_batch,
                                      a.global_batch, 2, a.steps, eos)  # fmt: skip
                else:
                    m = Mixture(["a", "b", "c"], sizes, [Stage(0, None, WEIGHTS)], a.global_batch, 0)
                    got[side] = _rate(readers, m, a.micro_batch, a.global_batch, 2, a.steps, eos)
            rows.append({"round": r, **got, "ratio": got["mix"] / got["single"]})
    ratios = [x["ratio"] for x in rows]
    med = statistics.median(ratios)
    print(f"loader throughput, rank 0 of dp=2, micro {a.micro_batch}, global {a.global_batch}, seq_len {seq}, "
          f"{a.steps} steps per round; sources {', '.join(str(p) for p in paths) if a.sources else 'byte corpora'} "
          f"({', '.join(f'{n:,}' for n in sizes)} samples)")  # fmt: skip
    print(f"{'round':>5} {'single samples/s':>17} {'3-source mix samples/s':>23} {'ratio':>7}")
    for x in rows:
        print(f"{x['round']:>5} {x['single']:>17,.0f} {x['mix']:>23,.0f} {x['ratio']:>7.3f}")
    print(f"median ratio mix/single {med:.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}); target >= 0.95")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"rounds": rows, "median_ratio": med, "seq_len": seq, "sizes": sizes,
                                            "weights": WEIGHTS, "steps": a.steps, "micro_batch": a.micro_batch,
                                            "global_batch": a.global_batch}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
