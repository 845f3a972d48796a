"""Peak memory and time of the LM loss's forward+backward: HF's plain path vs the chunked linear cross-entropy.

Two shapes (``smollm2``: SmolLM2-135M at 1 x 2,048 tokens; ``tiny``: the cpu_smoke batch), each measured as
``head`` (the LM head and loss alone: plain, ours chunked, and PyTorch's own chunked loss for reference) and as
``model`` (the whole model, stock vs ``install_fused_loss``). Memory is the host high-water mark of the first
forward+backward in a fresh process; time is the best of ``--repeats`` further calls. ``--sweep`` adds the chunk
sizes the default was chosen from. The method in full: bench/README.md, "bench/bench_loss.py".

    python bench/bench_loss.py [--shapes smollm2,tiny] [--dtypes fp32,bf16] [--repeats 3] [--sweep] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._harness import BENCH_ENV  # noqa: E402

SHAPES = {  # batch, seq, vocab, hidden, layers, heads, kv heads, intermediate
    "smollm2": dict(batch=1, seq=2048, vocab=49152, hidden=576, layers=30, heads=9, kv=3, inter=1536),
    "tiny": dict(batch=4, seq=256, vocab=4096, hidden=128, layers=4, heads=4, kv=2, inter=352),
}
SWEEP = (64, 128, 170, 256, 512, 1024)


def _proc_status() -> dict[str, float]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) / 1024  # kB -> MiB
    return out


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def child(kind: str, shape: str, impl: str, dtype: str, chunk: int, repeats: int) -> dict:
    """One variant in this (fresh) process: the first call's peak memory, then the best time of ``repeats``."""
    import resource
    import time

    import torch
    import torch.nn.functional as F

    from ultrascale.model.loss import default_chunk_tokens, install_fused_loss, linear_cross_entropy

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    s = SHAPES[shape]
    n, dt = s["batch"] * s["seq"], {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    chunk = chunk or default_chunk_tokens(s["vocab"], cpu=True)
    torch.manual_seed(0)
    if kind == "head":
        hidden = torch.randn(n, s["hidden"], dtype=dt, requires_grad=True)
        weight = (torch.randn(s["vocab"], s["hidden"]) * 0.02).to(dt).requires_grad_()
        labels = torch.randint(0, s["vocab"], (n,))
        params = (hidden, weight)
        if impl == "torch":
            options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=chunk, chunking_method=None)

        def loss_fn():
            if impl == "plain":  # HF's ForCausalLMLoss: logits in the model's dtype, upcast, cross-entropy
                return F.cross_entropy((hidden @ weight.t()).float(), labels)
            if impl == "torch":
                return F.linear_cross_entropy(hidden, weight, labels, ignore_index=-100, options=options)
            return linear_cross_entropy(hidden, weight, labels, chunk_tokens=chunk)

    else:
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.for_model("llama", vocab_size=s["vocab"], hidden_size=s["hidden"],
                                   intermediate_size=s["inter"], num_hidden_layers=s["layers"],
                                   num_attention_heads=s["heads"], num_key_value_heads=s["kv"],
                                   tie_word_embeddings=True, use_cache=False, max_position_embeddings=s["seq"],
                                   bos_token_id=0, eos_token_id=0)  # fmt: skip
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dt)
        if impl == "chunked":
            install_fused_loss(model, chunk_tokens=chunk)
        ids = torch.randint(0, s["vocab"], (s["batch"], s["seq"]))
        params = tuple(model.parameters())

        def loss_fn():
            return model(input_ids=ids, labels=ids).loss

    def step() -> float:
        for p in params:
            p.grad = None
        loss = loss_fn()
        loss.backward()
        return loss.item()

    exact = _reset_peak()
    rss_before, maxrss_before = _proc_status()["VmRSS"], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    loss = step()
    first_s = time.perf_counter() - t0
    if exact:
        peak = _proc_status()["VmHWM"] - rss_before
    else:  # the process's lifetime peak: only growth beyond the pre-call peak is visible
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - max(maxrss_before, rss_before)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"kind": kind, "shape": shape, "impl": impl, "dtype": dtype, "chunk": chunk if impl != "plain" else None,
            "tokens": n, "loss": loss, "peak_mb": peak, "peak_method": "VmHWM" if exact else "ru_maxrss",
            "first_s": first_s, "best_s": min(times) if times else first_s}  # fmt: skip


def theory_mb(shape: str, dtype: str, chunk: int) -> dict[str, float]:
    """What each path must hold for the head+loss, from the shapes alone (MiB)."""
    s = SHAPES[shape]
    n, v, h = s["batch"] * s["seq"], s["vocab"], s["hidden"]
    mib, low = 2**20, dtype != "fp32"
    logits = n * v * 4 / mib  # the fp32 logits (HF upcasts), and as much again for log-softmax and gradient
    plain = 3 * logits + (n * v * 2 / mib if low else 0)  # + the bf16 logits before the upcast
    chunked = chunk * v * 4 / mib + v * h * 4 / mib + n * h * 4 / mib + (v * h * 4 / mib if low else 0)
    return {"logits_fp32_mb": logits, "plain_mb": plain, "chunked_mb": chunked}


def run_child(args: list[str]) -> dict:
    env = {**os.environ, **BENCH_ENV}
    proc = subprocess.run([sys.executable, __file__, "--child", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True)  # fmt: skip
    if proc.returncode:
        sys.exit(f"error: bench_loss child {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="smollm2,tiny", help="comma list of: " + ", ".join(SHAPES))
    ap.add_argument("--kinds", default="head,model", help="head (LM head + loss only) and/or model (whole model)")
    ap.add_argument("--dtypes", default="fp32,bf16", help="bf16 is measured for the head only")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls after the memory call (best is reported)")
    ap.add_argument("--sweep", action="store_true", help=f"also the chunked head at chunks {SWEEP} (smollm2, fp32)")
    ap.add_argument("--json", type=Path, help="write settings, every run and the summary here")
    ap.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        kind, shape, impl, dtype, chunk, repeats = a.child
        print(json.dumps(child(kind, shape, impl, dtype, int(chunk), int(repeats))))
        return

    from tqdm import tqdm

    from ultrascale.model.loss import default_chunk_tokens

    plan = []
    for shape in a.shapes.split(","):
        for kind in a.kinds.split(","):
            for dtype in a.dtypes.split(",") if kind == "head" else ["fp32"]:
                impls = ("plain", "chunked", "torch") if kind == "head" else ("plain", "chunked")
                plan += [(kind, shape, impl, dtype, 0) for impl in impls]
    if a.sweep:
        plan += [("head", "smollm2", "chunked", "fp32", c) for c in SWEEP]
    rows = []
    for kind, shape, impl, dtype, chunk in tqdm(plan, desc="bench_loss", unit="run"):
        repeats = a.repeats if kind == "head" else 1  # a whole-model step at seq 2048 takes tens of seconds here
        rows.append(run_child([kind, shape, impl, dtype, str(chunk), str(repeats)]))
        r = rows[-1]
        tqdm.write(f"{kind:<5} {shape:<7} {dtype:<4} {impl:<7} chunk {r['chunk'] or '-':>4}  "
                   f"peak {r['peak_mb']:>7.0f} MiB  best {r['best_s']:>6.2f} s  loss {r['loss']:.5f}")  # fmt: skip
        sys.stdout.flush()

    summary = []
    for kind, shape, dtype in dict.fromkeys((r["kind"], r["shape"], r["dtype"]) for r in rows):
        group = [r for r in rows if (r["kind"], r["shape"], r["dtype"]) == (kind, shape, dtype)]
        base = next((r for r in group if r["impl"] == "plain"), None)
        for r in group:
            summary.append({**r, "mem_vs_plain": r["peak_mb"] / base["peak_mb"] if base else None,
                            "speedup_vs_plain": base["best_s"] / r["best_s"] if base else None,
                            "loss_diff_vs_plain": abs(r["loss"] - base["loss"]) if base else None})  # fmt: skip

    print("\nPeak = host memory the first forward+backward needed above what was resident before it (MiB).")
    print("Time = best of the timed calls (s). Same invocation, same inputs, one fresh process per row.\n")
    head = f"| {'kind':<5} | {'shape':<7} | {'dtype':<5} | {'impl':<7} | {'chunk':>5} | {'peak MiB':>8} | "
    head += f"{'x plain':>7} | {'time s':>6} | {'speedup':>7} | {'loss diff':>9} |"
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    for r in summary:
        print(f"| {r['kind']:<5} | {r['shape']:<7} | {r['dtype']:<5} | {r['impl']:<7} | {r['chunk'] or '-':>5} | "
              f"{r['peak_mb']:>8.0f} | {r['mem_vs_plain'] or 0:>7.2f} | {r['best_s']:>6.2f} | "
              f"{r['speedup_vs_plain'] or 0:>7.2f} | {r['loss_diff_vs_plain'] or 0:>9.1e} |")  # fmt: skip

    print("\nFrom the shapes alone (head + loss, MiB):")
    theory = {}
    for shape in a.shapes.split(","):
        for dtype in a.dtypes.split(","):
            t = theory_mb(shape, dtype, default_chunk_tokens(SHAPES[shape]["vocab"], cpu=True))
            theory[f"{shape}/{dtype}"] = t
            s = SHAPES[shape]
            print(f"  {shape} {dtype}: N x V = {s['batch'] * s['seq']} x {s['vocab']}: fp32 logits "
                  f"{t['logits_fp32_mb']:.0f}; plain holds ~{t['plain_mb']:.0f} (logits, log-softmax, gradient"
                  f"{', bf16 logits' if dtype != 'fp32' else ''}), chunked ~{t['chunked_mb']:.0f} (one chunk of "
                  f"{default_chunk_tokens(s['vocab'], cpu=True)} x V, the head's fp32 gradient, the hidden gradient"
                  f"{', the fp32 copy of the head' if dtype != 'fp32' else ''})")  # fmt: skip
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        settings = {"shapes": {k: SHAPES[k] for k in a.shapes.split(",")}, "repeats": a.repeats,
                    "omp_num_threads": BENCH_ENV["OMP_NUM_THREADS"], "theory_mb": theory}  # fmt: skip
        a.json.write_text(json.dumps({"settings": settings, "results": summary}, indent=2) + "\n")
        print(f"\nwrote {a.json}")


if __name__ == "__main__":
    main()
