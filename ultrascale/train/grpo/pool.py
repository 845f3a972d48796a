"""The problems a GRPO run can learn from: the base model's pass rate on each, at G samples, and the ones where
0 < pass < 1 (DeepCoder's filter): a group that always passes or always fails has zero reward variance, so zero
advantage and no gradient. Written as a problems JSONL with each problem's pass rate, and the overrides that train on
it in the report (``train_with``): HumanEval's by ``problems.task_ids`` (a JSONL of HumanEval problems would be
dropped by the decontamination against HumanEval that every JSONL and mined problem goes through), others by
``problems.source=jsonl``.

    python -m ultrascale.train.grpo.pool --model models/smollm2-135m --out data/grpo_pool.jsonl \\
        --source humaneval --split dev --samples 8 --max-new-tokens 128

On the recipe's base (SmolLM2-135M-Instruct, HumanEval's dev half) unfiltered GRPO steps found no signal: in 10 of
11 steps every group's rewards were equal (``runs/grpo_dev_unfiltered``), hence this file.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from ultrascale.config.problems import ProblemsConfig, ProblemSource, ProblemSplit
from ultrascale.eval.humaneval import generate
from ultrascale.eval.problems import build
from ultrascale.eval.sandbox import Limits, check_available
from ultrascale.jsonio import write_jsonl

log = logging.getLogger("ultrascale")
MIN_POOL = 8
"""The fewest problems a run should sample from: below it (two steps of 4 prompts) every epoch repeats within a few
steps and the policy can memorise the pool rather than learn; the tool says so."""


def pass_rates(model, tokenizer, problems: list[dict], samples: int, max_new_tokens: int, temperature: float,
               timeout_s: float, workers: int, seed: int) -> list[float]:  # fmt: skip
    """Each problem's share of ``samples`` sampled completions that pass its tests in the sandbox."""
    from ultrascale.eval.execute import verdicts

    completions = generate(model, tokenizer, [p["prompt"] for p in problems], n_samples=samples,
                           temperature=temperature, top_p=1.0, max_new_tokens=max_new_tokens, seed=seed,
                           draft=0, progress=True)  # fmt: skip
    pairs = [(p, c) for p, cs in zip(problems, completions) for c in cs]
    outcomes = verdicts(pairs, Limits(timeout_s=timeout_s), workers=workers)
    return [sum(o.passed for o in outcomes[i * samples : (i + 1) * samples]) / samples for i in range(len(problems))]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the base model directory (with its tokenizer)")
    ap.add_argument("--out", required=True, help="the problems JSONL to write (problems.jsonl=...)")
    ap.add_argument("--source", default="humaneval", choices=[s.value for s in ProblemSource])
    ap.add_argument("--split", default="dev", choices=[s.value for s in ProblemSplit])
    ap.add_argument("--input", default="stdlib", help="source=corpus: what to mine (stdlib, site-packages, a dir)")
    ap.add_argument("--jsonl", default=None, help="source=jsonl: the problems file")
    ap.add_argument("--max-problems", type=int, default=None, help="source=corpus: verify and keep at most this many")
    ap.add_argument("--samples", type=int, default=8, help="G: completions per problem, as grpo.num_generations")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="as grpo.max_completion_length")
    ap.add_argument("--temperature", type=float, default=1.0, help="as grpo.temperature")
    ap.add_argument("--timeout", type=float, default=10.0, help="sandbox limit per program (s)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_available()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)  # before the minutes of sampling, not after
    cfg = ProblemsConfig(source=ProblemSource(a.source), split=ProblemSplit(a.split), input=a.input, jsonl=a.jsonl,
                         max_problems=a.max_problems)  # fmt: skip
    problems, report = build(cfg)
    model = AutoModelForCausalLM.from_pretrained(a.model).eval()
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    t0 = time.perf_counter()
    rates = pass_rates(model, tokenizer, problems, a.samples, a.max_new_tokens, a.temperature, a.timeout,
                       a.workers, a.seed)  # fmt: skip
    kept = [{**p, "pass_rate": r} for p, r in zip(problems, rates) if 0 < r < 1]
    write_jsonl(Path(a.out), kept)
    summary = {"source": report, "problems": len(problems), "samples": a.samples, "always_fail": rates.count(0.0),
               "always_pass": rates.count(1.0), "kept": len(kept), "min_pool": MIN_POOL,
               "wall_s": round(time.perf_counter() - t0, 1), "out": a.out,
               "pass_rates": {p["task_id"]: r for p, r in zip(problems, rates)}}  # fmt: skip
    ids = ",".join(p["task_id"] for p in kept)
    summary["train_with"] = (f"problems.source=humaneval problems.split={a.split} problems.task_ids=[{ids}]"
                             if a.source == "humaneval" else f"problems.source=jsonl problems.jsonl={a.out}")  # fmt: skip
    Path(a.out).with_suffix(".report.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    if len(kept) < MIN_POOL:
        print(f"warning: {len(kept)} problems with 0 < pass < 1 is below the minimum pool of {MIN_POOL}: add problems "
              "(--source corpus --input site-packages, decontaminated against HumanEval) or raise --samples")  # fmt: skip
    return summary


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()
