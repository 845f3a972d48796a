"""Peak memory and time of the LM loss: HF's plain path (full fp32 logits) vs the chunked linear cross-entropy.

Two shapes, each variant in a fresh subprocess so peaks do not mix:

* ``head``: only the LM head + loss, forward and backward, on hidden states [seq, hidden] (what differs
  between the two paths, without the rest of the model's activations around it);
* ``model``: a whole SmolLM2-135M-shaped Llama (30 layers, hidden 576, vocab 49,152; random init from its
  config, nothing downloaded) doing forward + backward on one sequence.

Memory is the growth of the process's peak resident set (``ru_maxrss``) across the measured call, over the
resident set just before it: on CPU every tensor lives in host memory, so this is what the allocator really
needed. The theoretical logits footprint (seq x vocab x 4 bytes, once for the logits and once for their
gradient) is printed beside it. The baseline (plain path) runs in the same invocation.

    python bench/bench_loss.py [--seq 2048] [--vocab 49152] [--hidden 576] [--shapes head,model] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _child(shape: str, impl: str, seq: int, vocab: int, hidden: int, dtype: str) -> None:
    """Runs in a subprocess: builds the inputs, measures one forward+backward, prints one JSON line."""
    import resource
    import time

    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT))
    from ultrascale.model.loss import install_fused_loss, linear_cross_entropy

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    torch.manual_seed(0)
    if shape == "head":
        h = torch.randn(seq, hidden, dtype=dt, requires_grad=True)
        w = (torch.randn(vocab, hidden) * 0.02).to(dt).requires_grad_()
        y = torch.randint(0, vocab, (seq,))

        def step():
            if impl == "plain":  # what HF's ForCausalLMLoss does: logits, upcast, cross-entropy
                loss = F.cross_entropy((h @ w.t()).float(), y)
            else:
                loss = linear_cross_entropy(h, w, y)
            loss.backward()
            return loss

    else:
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.for_model("llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=1536,
                                   num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                   tie_word_embeddings=True, use_cache=False, max_position_embeddings=8192,
                                   bos_token_id=0, eos_token_id=0)  # fmt: skip
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dt)
        if impl == "chunked":
            install_fused_loss(model)
        ids = torch.randint(0, vocab, (1, seq))

        def step():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            return loss

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    import psutil

    rss_before = psutil.Process().memory_info().rss / 1024
    t0 = time.perf_counter()
    loss = step()
    secs = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    grew = max(peak, before) - rss_before
    print(json.dumps({"shape": shape, "impl": impl, "dtype": dtype, "loss": float(loss), "seconds": secs,
                      "peak_growth_mb": grew / 1024}))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--shapes", default="head,model")
    ap.add_argument("--dtypes", default="fp32,bf16", help="bf16 runs only for the head shape")
    ap.add_argument("--json", dest="json_path")
    ap.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        shape, impl, seq, vocab, hidden, dtype = a.child
        _child(shape, impl, int(seq), int(vocab), int(hidden), dtype)
        return
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": str(ROOT)}
    rows = []
    for shape in a.shapes.split(","):
        for dtype in a.dtypes.split(",") if shape == "head" else ["fp32"]:
            for impl in ("plain", "chunked"):
                cmd = [sys.executable, __file__, "--child", shape, impl, str(a.seq), str(a.vocab), str(a.hidden), dtype]
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
                if proc.returncode:
                    sys.exit(f"error: {' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
                rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
                print(f"{shape:<6} {dtype:<5} {impl:<8} {rows[-1]['peak_growth_mb']:>9.0f} MB  "
                      f"{rows[-1]['seconds']:>7.2f} s  loss {rows[-1]['loss']:.4f}", flush=True)  # fmt: skip
    logits_mb = a.seq * a.vocab * 4 / 2**20
    print(f"\nseq {a.seq} x vocab {a.vocab}: fp32 logits {logits_mb:.0f} MB + their gradient {logits_mb:.0f} MB "
          f"(what the plain path materialises; the chunked path holds 256 x {a.vocab} at a time)\n")  # fmt: skip
    print(f"| {'shape':<6} | {'dtype':<5} | {'plain MB':>9} | {'chunked MB':>10} | {'saved':>6} | {'plain s':>7} | "
          f"{'chunked s':>9} | {'speedup':>7} |")  # fmt: skip
    summary = []
    for i in range(0, len(rows), 2):
        p, c = rows[i], rows[i + 1]
        saved = 1 - c["peak_growth_mb"] / p["peak_growth_mb"]
        summary.append({"shape": p["shape"], "dtype": p["dtype"], "plain_mb": p["peak_growth_mb"],
                        "chunked_mb": c["peak_growth_mb"], "saved_fraction": saved, "plain_s": p["seconds"],
                        "chunked_s": c["seconds"], "speedup": p["seconds"] / c["seconds"],
                        "loss_diff": abs(p["loss"] - c["loss"])})  # fmt: skip
        s = summary[-1]
        print(f"| {s['shape']:<6} | {s['dtype']:<5} | {s['plain_mb']:>9.0f} | {s['chunked_mb']:>10.0f} | "
              f"{100 * saved:>5.0f}% | {s['plain_s']:>7.2f} | {s['chunked_s']:>9.2f} | {s['speedup']:>7.2f} |")  # fmt: skip
    if a.json_path:
        Path(a.json_path).parent.mkdir(parents=True, exist_ok=True)
        settings = {"seq": a.seq, "vocab": a.vocab, "hidden": a.hidden, "logits_mb": logits_mb}
        Path(a.json_path).write_text(json.dumps({"settings": settings, "results": summary, "runs": rows}, indent=2))


if __name__ == "__main__":
    main()
