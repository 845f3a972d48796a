"""Sample completions from the current model, execute each in the sandbox, keep the ones that pass.

Generation is HumanEval's (:func:`ultrascale.eval.humaneval.generate` over :mod:`ultrascale.generate`'s sampler:
temperature, top-p, the same stop sequences, a seed per sample), so the completions SSD learns from are cut exactly like the ones it is
scored on. Provided candidates (``extra_candidates`` of a JSONL problem, e.g. human solutions) are executed
and filtered by the same code and recorded with ``source: provided``: they are never presented as the
model's own samples.

Every completion lands in ``samples.jsonl`` with its verdict and, when not kept, the reason (``failed``,
``timeout``, ``duplicate``, ``cap``); the kept ones also in ``kept.jsonl``.
"""

from __future__ import annotations

import ast
import logging
import time
from collections import Counter

from ultrascale.eval.execute import verdicts
from ultrascale.eval.sandbox import Limits
from ultrascale.ssd.config import SampleConfig

log = logging.getLogger("ultrascale")


def normalized(problem: dict, completion: str) -> str:
    """A key under which two completions are the same program: the function's AST without its docstring.

    Comments, blank lines, spacing and quoting differences vanish; anything that changes the code does not.
    Unparsable text (never a passing sample, in practice) falls back to its whitespace-collapsed form.
    """
    try:
        tree = ast.parse(problem["prompt"] + completion)
    except SyntaxError:
        return " ".join(completion.split())
    fns = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == problem["entry_point"]]
    if not fns:
        return " ".join(completion.split())
    body = fns[-1].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return "\n".join(ast.dump(s) for s in body)


def generate_all(
    model_dir,
    problems: list[dict],
    cfg: SampleConfig,
    dtype: str = "fp32",
    details: bool = False,
    device: str = "auto",
) -> tuple[list[list], dict]:
    """``cfg.n`` completions per problem (in problem order; with ``details`` each a dict with ``text``, ``finish``
    and ``tokens``) and timing stats."""
    from transformers import AutoTokenizer

    from ultrascale.eval.humaneval import STOP_SEQUENCES, generate
    from ultrascale.model.build import load_pretrained

    model = load_pretrained(model_dir, dtype, device)  # the GPU a node has (auto), else the CPU
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    t0 = time.perf_counter()
    out = generate(model, tokenizer, [p["prompt"] for p in problems], n_samples=cfg.n, temperature=cfg.temperature,
                   top_p=cfg.top_p, top_k=cfg.top_k, max_new_tokens=cfg.max_new_tokens,
                   batch_size=cfg.batch_size, seed=cfg.seed, stops=(*STOP_SEQUENCES, *cfg.extra_stops),
                   heal_newline=cfg.heal_newline, progress=True, details=details,
                   extra_stops=[METHOD_STOPS if p.get("kind") == "method" else () for p in problems])  # fmt: skip
    return out, {"generate_s": round(time.perf_counter() - t0, 2)}


METHOD_STOPS = ("\n    def ", "\n    async def ", "\n    @")
"""A method's body (indented 8 under its class) ends where the class's next member starts at indent 4; HumanEval's
stops only see column 0, so without these a model writes the rest of the class."""
STUB_LINES = frozenset({"pass", "...", "return", "return None", "raise NotImplementedError",
                        "raise NotImplementedError()"})  # fmt: skip


def stub_reason(completion: str) -> str | None:
    """Why the paper's filter drops a response: ``empty`` (nothing but whitespace and comments) or ``stub`` (a
    single line that does nothing: ``pass``, ``...``, ``return None``, ``raise NotImplementedError``). A real
    one-line body (``return a + b``) is kept: the paper drops stubs, not short solutions."""
    lines = [ln.strip() for ln in completion.splitlines()]
    code = [ln for ln in lines if ln and not ln.startswith("#")]
    if not code:
        return "empty"
    if len(code) == 1 and code[0].split("#")[0].strip() in STUB_LINES:
        return "stub"
    return None


def select_raw(problems: list[dict], completions: list[list[dict]]) -> tuple[list[dict], dict]:
    """The paper's filter (``method=ssd``): keep every sample but empty responses and single-line stubs. Nothing
    is executed; ``no_code`` counts kept samples that do not even parse as Python after their prompt (they are
    kept, as the paper keeps them: it has no correctness filter of any kind)."""
    rows: list[dict] = []
    counts: Counter = Counter()
    for p, comps in zip(problems, completions):
        for i, c in enumerate(comps):
            why = stub_reason(c["text"])
            row = {"task_id": p["task_id"], "index": i, "source": "model", "completion": c["text"],
                   "finish": c["finish"], "tokens": c["tokens"], "kept": why is None, "reason": why or "kept"}  # fmt: skip
            counts["truncated"] += c["finish"] == "length"
            if why is None:
                try:
                    ast.parse(p["prompt"] + c["text"])
                except SyntaxError:
                    row["no_code"] = True
                    counts["no_code"] += 1
            counts[why or "kept"] += 1
            rows.append(row)
    stats = {
        "problems": len(problems),
        "sampled": len(rows),
        "kept": counts["kept"],
        "dropped_empty": counts["empty"],
        "dropped_stub": counts["stub"],
        "truncated": counts["truncated"],
        "no_code": counts["no_code"],
        "executed": 0,
        "candidates": len(rows),
        "problems_with_kept": len({r["task_id"] for r in rows if r["kept"]}),
        "sampled_tokens": sum(r["tokens"] for r in rows),
    }
    return rows, stats


def select(problems: list[dict], completions: list[list[str]], cfg: SampleConfig) -> tuple[list[dict], dict]:
    """Execute every candidate (model samples, then provided ones) and decide which to keep.

    Returns one row per candidate, in problem order, and the counts.
    """
    rows: list[dict] = []
    pairs: list[tuple[dict, str]] = []
    for p, comps in zip(problems, completions):
        cands = [("model", c) for c in comps] + [("provided", c) for c in p.get("extra_candidates", [])]
        for i, (source, c) in enumerate(cands):
            rows.append({"task_id": p["task_id"], "index": i, "source": source, "completion": c})
            pairs.append((p, c))
    t0 = time.perf_counter()
    outcomes = verdicts(pairs, Limits(timeout_s=cfg.timeout_s, memory_mb=cfg.memory_mb), workers=cfg.workers)
    exec_s = time.perf_counter() - t0
    kept_keys: dict[str, set[str]] = {}
    kept_n: Counter = Counter()
    counts: Counter = Counter()
    for row, (p, c), o in zip(rows, pairs, outcomes):
        row.update(status=o.status, passed=o.passed, seconds=round(o.seconds, 3))
        counts[f"{row['source']}_samples"] += 1
        if not o.passed:
            row.update(kept=False, reason=o.status, error=o.error)
            continue
        counts[f"{row['source']}_passed"] += 1
        keys = kept_keys.setdefault(p["task_id"], set())
        key = normalized(p, c)
        if cfg.dedupe and key in keys:
            row.update(kept=False, reason="duplicate")
        elif kept_n[p["task_id"]] >= cfg.max_kept_per_problem:
            row.update(kept=False, reason="cap")
        else:
            keys.add(key)
            kept_n[p["task_id"]] += 1
            row.update(kept=True, reason="kept")
            counts[f"{row['source']}_kept"] += 1
    stats = {
        "problems": len(problems),
        "sampled": counts["model_samples"],
        "executed": len(rows),
        "candidates": len(rows),
        "model_samples": counts["model_samples"],
        "model_passed": counts["model_passed"],
        "model_kept": counts["model_kept"],
        "provided_samples": counts["provided_samples"],
        "provided_passed": counts["provided_passed"],
        "provided_kept": counts["provided_kept"],
        "kept": counts["model_kept"] + counts["provided_kept"],
        "problems_with_kept": len(kept_n),
        "model_pass_rate": counts["model_passed"] / max(counts["model_samples"], 1),
        "reasons": dict(Counter(r["reason"] for r in rows)),
        "execute_s": round(exec_s, 2),
    }
    return rows, stats


def kept_records(problems: list[dict], rows: list[dict]) -> list[dict]:
    """The finetuning examples: prompt + completion of every kept row."""
    by_id = {p["task_id"]: p for p in problems}
    return [
        {
            "task_id": r["task_id"],
            "source": r["source"],
            "prompt": by_id[r["task_id"]]["prompt"],
            "completion": r["completion"],
        }
        for r in rows
        if r["kept"]
    ]
