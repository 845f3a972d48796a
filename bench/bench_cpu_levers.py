"""The CPU levers alone, on the CPU at hand: the attention core by query block and the fused loss by chunk.

The attention block and the fused loss chunk are decided per CPU; this measures what they change on this one, at
a model's real shapes, in one process with one thread (one CPU rank's share), so the rules can be checked here and
on the next CPU. Each candidate's forward+backward is timed in rounds that rotate the candidates' order, relative
to the baseline in the same rounds (attention: HF's SDPA against the blocked SDPA at each block size, on a
one-document row and a row of four; loss: each chunk against the plain head + ``cross_entropy``). The CPU's
fingerprint and what ``decide`` picks for it are printed with the table; the measured tables: bench/README.md,
"The CPU levers, per CPU".

    python bench/bench_cpu_levers.py [--model-dir models/smollm2-135m] [--seq-len 2048] [--dtype fp32|bf16]
                                     [--rounds 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: one core, as one CPU rank has
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

BLOCKS = (64, 128, 256, 512, 1024)
CHUNKS = (32, 64, 128, 256, 512, 1024)


def _shapes(model_dir: str | None) -> dict:
    if model_dir:
        c = json.loads((Path(model_dir) / "config.json").read_text())
    else:  # SmolLM2-135M's
        c = {"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576, "vocab_size": 49152}
    heads, kv = int(c["num_attention_heads"]), int(c.get("num_key_value_heads") or c["num_attention_heads"])
    return {"heads": heads, "kv_heads": kv, "head_dim": int(c["hidden_size"]) // heads,
            "hidden": int(c["hidden_size"]), "vocab": int(c["vocab_size"])}  # fmt: skip


def _doc_mask(s: int, docs: int) -> torch.Tensor:
    """[1, 1, s, s] bool: causal within each of ``docs`` equal documents."""
    doc = torch.arange(s) * docs // s
    causal = torch.ones(s, s, dtype=torch.bool).tril_()
    return (causal & (doc[:, None] == doc[None, :]))[None, None]


def _timed(fn, dtype: torch.dtype) -> float:
    t = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        fn()
    return time.perf_counter() - t


def _attention_cases(sh: dict, s: int) -> dict:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from ultrascale.model.attention import block_size_for, blocked_sdpa_forward

    class Module(torch.nn.Module):  # what HF's attention functions read off the layer
        is_causal = True
        num_key_value_groups = sh["heads"] // sh["kv_heads"]
        training = True

    mod = Module()
    q = torch.randn(1, sh["heads"], s, sh["head_dim"], requires_grad=True)
    k = torch.randn(1, sh["kv_heads"], s, sh["head_dim"], requires_grad=True)
    v = torch.randn(1, sh["kv_heads"], s, sh["head_dim"], requires_grad=True)

    def run(mask, block):
        def go():
            if block:
                out, _ = blocked_sdpa_forward(mod, q, k, v, mask, block=block)
            else:
                out, _ = sdpa_attention_forward(mod, q, k, v, mask)
            out.float().sum().backward()

        return go

    blocks = sorted({block_size_for(s, b) for b in BLOCKS})  # at most MAX_BLOCKS blocks a row
    cases = {("one document", "HF sdpa (is_causal: the kernel skips the upper tiles)"): run(None, 0)}
    for b in blocks:  # what the blocks did with such a row until they left it to the causal kernel
        cases[("one document", f"blocks {b} over the causal mask spelled out")] = run(_doc_mask(s, 1), b)
    cases[("4 documents", "HF sdpa (explicit mask, every tile)")] = run(_doc_mask(s, 4), 0)
    for b in blocks:
        cases[("4 documents", f"blocks {b}")] = run(_doc_mask(s, 4), b)
    return cases


def _loss_cases(sh: dict, s: int) -> dict:
    from ultrascale.model.loss import linear_cross_entropy

    h = torch.randn(s, sh["hidden"], requires_grad=True)
    w = (torch.randn(sh["vocab"], sh["hidden"]) * 0.02).requires_grad_()
    y = torch.randint(0, sh["vocab"], (s,))

    def plain():
        F.cross_entropy((h @ w.T).float(), y).backward()

    cases = {("loss", "plain head + cross_entropy"): plain}
    for c in CHUNKS:
        cases[("loss", f"chunk {c}")] = lambda c=c: linear_cross_entropy(h, w, y, chunk_tokens=c).backward()
    return cases


def measure(cases: dict, rounds: int, dtype: torch.dtype) -> dict:
    """Median seconds per case over ``rounds`` rotations (one untimed call each first)."""
    names = list(cases)
    for n in names:
        _timed(cases[n], dtype)
    times: dict = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            times[n].append(_timed(cases[n], dtype))
    return {n: statistics.median(t) for n, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", help="a model directory with config.json (default SmolLM2-135M's shapes)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="bf16: under CPU autocast")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", choices=("attention", "loss"), help="measure one lever only")
    ap.add_argument("--json", dest="json_path")
    a = ap.parse_args()
    from ultrascale.levers.hardware import cpu_attn_block, cpu_loss_chunk
    from ultrascale.runtime.cpu import detect

    cpu = detect()
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    sh = _shapes(a.model_dir)
    torch.manual_seed(0)
    rows = []
    for lever, make in (("attention", _attention_cases), ("loss", _loss_cases)):
        if a.only and a.only != lever:
            continue
        got = measure(make(sh, a.seq_len), a.rounds, dtype)
        base = {}
        for (group, name), t in got.items():
            base.setdefault(group, t)  # the first case of each group is its baseline
            rows.append({"lever": lever, "case": group, "variant": name, "s": t, "speedup": base[group] / t})
    picks = {"attn_block": cpu_attn_block(cpu, a.seq_len, a.dtype == "bf16"),
             "loss_chunk": cpu_loss_chunk(cpu, sh["vocab"], a.dtype == "bf16")}  # fmt: skip
    print(f"{cpu.describe()}\n{a.dtype}, seq {a.seq_len}, {sh}, one thread, median of {a.rounds} rotated rounds\n")
    print("| lever | rows | variant | fwd+bwd s | speedup vs first |\n|---|---|---|---:|---:|")
    for r in rows:
        print(f"| {r['lever']} | {r['case']} | {r['variant']} | {r['s']:.4f} | {r['speedup']:.2f}x |")
    print(f"\ndecide picks on this CPU: attention block {picks['attn_block'][0]} ({picks['attn_block'][1]}); "
          f"loss chunk {picks['loss_chunk'][0]} ({picks['loss_chunk'][1]})")  # fmt: skip
    if a.json_path:
        from ultrascale.jsonio import write_json

        write_json(Path(a.json_path), {"cpu": cpu.describe(), "fingerprint": cpu.fingerprint(), "dtype": a.dtype,
                                       "seq_len": a.seq_len, "shapes": sh, "rows": rows, "picks": picks})  # fmt: skip


if __name__ == "__main__":
    main()
