"""Prompts for self-distillation without tests: every documented function and method, HumanEval-shaped.

SSD (Zhang et al. 2026, "Embarrassingly Simple Self-Distillation Improves Code Generation") samples one
solution per prompt from the frozen model and fine-tunes on the raw samples: nothing is executed, so a prompt
needs no tests, only a docstring that says what the body should do. Demanding doctests (as
:mod:`ultrascale.data.mine` must, for the sandboxed rounds) leaves a few dozen problems in the stdlib; any
docstring leaves thousands. A prompt is what the model reads before writing a body, laid out as HumanEval lays it
out and ending right after the docstring's newline; how it is laid out, and what is dropped with a reason counted
in the report: :func:`build_prompts`.
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from ultrascale.data.corpus import corpus_documents
from ultrascale.data.decontam import HELD_OUT_PREFIX, decontaminate
from ultrascale.data.mine import BUILTINS, MineOptions, Module, closure, free_names, mine_file, used_modules_and_names
from ultrascale.config.problems import ProblemsConfig
from ultrascale.errors import ConfigError, DataError
from ultrascale.jsonio import iter_jsonl
from ultrascale.paths import resolve_path

log = logging.getLogger("ultrascale")

"""Decontamination item ids of validation-repository problems (HumanEval's are ``HumanEval/<n>``)."""

DROP_REASONS = (
    "unparsable_file",
    "no_body",
    "inline_body",
    "stub",
    "needs_module_helpers",
    "denied_name",
    "prompt_too_long",
    "reference_too_long",
    "duplicate_prompt",
    "duplicate_body",
    "humaneval_contaminated",
    "validation_contaminated",
    "over_max_problems",
)
"""Every reason a candidate is dropped, in the order the filters run (the report lists them in this order)."""


@dataclass(frozen=True)
class PromptOptions:
    include_helpers: bool = True
    max_prompt_lines: int = 80
    max_reference_lines: int = 40
    deny: frozenset[str] = frozenset()


# ---- one file -------------------------------------------------------------------------------------------
def _is_stub_statement(stmt: ast.stmt) -> bool:
    if isinstance(stmt, ast.Pass):
        return True
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and stmt.value.value is Ellipsis:
        return True
    if isinstance(stmt, ast.Raise) and stmt.exc is not None:
        exc = stmt.exc.func if isinstance(stmt.exc, ast.Call) else stmt.exc
        return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"
    return False


def body_key(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """The body's AST without its docstring, positions or comments: one key for every copy of the same code."""
    return hashlib.sha1(ast.dump(ast.Module(body=fn.body[1:], type_ignores=[])).encode()).hexdigest()


def _lines(block: list[str]) -> str:
    return "".join(ln if ln.endswith("\n") else ln + "\n" for ln in block)


def _first_line(stmt: ast.stmt) -> int:
    return min([stmt.lineno] + [d.lineno for d in getattr(stmt, "decorator_list", [])])


def _class_header(mod: Module, cls: ast.ClassDef) -> list[str]:
    """Decorators, ``class X(Base):`` and the class docstring; none of the other members."""
    if ast.get_docstring(cls, clean=False) is not None:
        end = cls.body[0].end_lineno
    else:
        end = _first_line(cls.body[0]) - 1  # the line before the first member (comments in between stay)
    out = mod.lines[_first_line(cls) - 1 : end]
    while out and not out[-1].strip():
        out = out[:-1]
    return out


def _candidate(
    mod: Module, fn: ast.FunctionDef | ast.AsyncFunctionDef, cls: ast.ClassDef | None, opts: PromptOptions
) -> tuple[dict | None, str | None]:
    """The prompt record of one documented function or method, or the reason it is dropped."""
    if len(fn.body) < 2:
        return None, "no_body"
    doc_end, body_start = fn.body[0].end_lineno, _first_line(fn.body[1])
    if body_start <= doc_end:
        return None, "inline_body"  # `"""doc"""; return x` cannot be split into prompt and completion
    if all(_is_stub_statement(s) for s in fn.body[1:]):
        return None, "stub"
    if cls is None:
        needed, skip = free_names(fn), fn.name
    else:
        header = [*cls.bases, *cls.keywords, *cls.decorator_list]
        needed, skip = free_names(fn).union(*(free_names(n) for n in header)), cls.name
    if (
        cls is None
        and not opts.include_helpers
        and any(
            not isinstance(mod.defs[n], ast.Import | ast.ImportFrom)
            for n in needed - BUILTINS - {skip}
            if n in mod.defs
        )
    ):
        return None, "needs_module_helpers"  # what include_helpers=false means in the config: drop, not hide
    # a prompt is only read: a name from a star import or a try/if block is left out, not a reason to drop it;
    # a method's prompt shows its class header, so only the imports
    context, _ = closure(mod, needed, skip, helpers=cls is None and opts.include_helpers, strict=False)
    if opts.deny:
        used = used_modules_and_names(fn) | set().union(*(used_modules_and_names(s) for s in context))
        if used & opts.deny:
            return None, "denied_name"
    lines = mod.lines
    signature = lines[_first_line(fn) - 1 : doc_end]
    body = lines[doc_end : fn.end_lineno]
    while body and not body[0].strip():
        body = body[1:]  # blank lines after the docstring are layout, not code the model must write
    reference = "".join(body).rstrip() + "\n"
    imports = [s for s in context if isinstance(s, ast.Import | ast.ImportFrom)]
    helpers = [s for s in context if s not in imports]
    head = [ln for stmt in (*mod.future, *imports) for ln in mod.segment(stmt)]
    # HumanEval's layout: an import block, then each helper, then the function, two blank lines apart.
    blocks = ([head] if head else []) + [mod.segment(s) for s in helpers]
    if cls is None:
        blocks.append(signature)
    else:
        cls_header = _class_header(mod, cls)
        has_doc = ast.get_docstring(cls, clean=False) is not None
        blocks.append(cls_header + (["\n"] if has_doc else []) + signature)
    prompt = "\n\n".join(_lines(b) for b in blocks)
    if len(prompt.splitlines()) > opts.max_prompt_lines:
        return None, "prompt_too_long"
    if len(reference.splitlines()) > opts.max_reference_lines:
        return None, "reference_too_long"
    entry_point = fn.name if cls is None else f"{cls.name}.{fn.name}"
    return {
        "prompt": prompt,
        "entry_point": entry_point,
        "kind": "function" if cls is None else "method",
        "reference": reference,
        "_body": body_key(fn),
    }, None


def prompts_from_file(text: str, path: str, repo: str, opts: PromptOptions, counts: Counter) -> list[dict]:
    """Prompt records of one file's documented top-level functions and top-level classes' methods.

    Undocumented ones are counted (``undocumented``) but are not candidates: a bare signature does not say
    what to write. Every candidate dropped here is counted under its reason.
    """
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        counts["unparsable_file"] += 1
        return []
    mod = Module(tree, text.splitlines(keepends=True))
    targets: list[tuple[ast.FunctionDef | ast.AsyncFunctionDef, ast.ClassDef | None]] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            targets.append((node, None))
        elif isinstance(node, ast.ClassDef):
            targets += [(m, node) for m in node.body if isinstance(m, ast.FunctionDef | ast.AsyncFunctionDef)]
    out = []
    for fn, cls in targets:
        if not ast.get_docstring(fn, clean=True):
            counts["undocumented"] += 1
            continue
        counts["candidates"] += 1
        record, reason = _candidate(mod, fn, cls, opts)
        if reason:
            counts[reason] += 1
            continue
        out.append({"task_id": f"{path}::{record['entry_point']}", "path": path, "repo": repo, **record})
    return out


# ---- the corpus -----------------------------------------------------------------------------------------
def _split_documents(cfg: ProblemsConfig, counts: Counter) -> tuple[list[dict], list[dict]]:
    """(train documents, validation documents): the corpus read once, split by ``train_repos_from``'s repos.json."""
    docs = corpus_documents(
        OmegaConf.create({"input": cfg.input, "train_repos_from": None, "held_out": False}), Counter()
    )
    python = [d for d in docs if d.get("lang", "python") == "python"]
    counts["files_not_python"] = len(docs) - len(python)
    if not cfg.train_repos_from:
        return python, []
    path = resolve_path(cfg.train_repos_from) / "repos.json"
    if not path.exists():
        raise ConfigError(
            f"problems.train_repos_from={cfg.train_repos_from}: {path} not found; point it at a prepared "
            "dataset (python -m data_prep output_dir=...) or set it to null to use every repository"
        )
    split = json.loads(path.read_text())
    train = [d for d in python if split.get(d["repo"]) == "train"]
    held_out = [d for d in python if split.get(d["repo"]) == "validation"]
    counts["files_held_out_repo"] = len(held_out)
    counts["files_not_in_prepared_data"] = sum(d["repo"] not in split for d in python)
    if python and not train:
        raise ConfigError(
            f"problems.train_repos_from={cfg.train_repos_from}: no repository of problems.input={cfg.input} "
            "is in its train split; was it prepared from the same input?"
        )
    return train, held_out


def held_out_problems(docs: list[dict]) -> tuple[list[tuple[str, str]], set[str]]:
    """The validation repositories' doctested problems as decontamination items, and their body keys.

    Mined with :func:`ultrascale.data.mine.mine_file` under the loosest options (helpers, no deny list, no
    length limits), so they cover whatever a second evaluation set built from these repositories can hold.
    Each problem is two items, its signature + docstring and its body, without the helpers its prompt carries:
    n-gram overlap is a share of the *item's* n-grams, so a training copy of the body under another docstring
    (or of the docstring over another body) must match an item in full, which the other half would dilute.
    """
    opts = MineOptions(include_helpers=True, max_prompt_lines=10**9, max_reference_lines=10**9, asserts=True)
    items, keys = [], set()
    for doc in docs:
        problems = mine_file(doc["text"], doc["path"], opts, Counter())
        if not problems:
            continue
        by_line = {
            n.lineno: n for n in ast.parse(doc["text"]).body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        lines = doc["text"].splitlines(keepends=True)
        for p in problems:
            fn = by_line[p["origin"]["line"]]
            header = "".join(lines[_first_line(fn) - 1 : fn.body[0].end_lineno])
            items += [
                (f"{HELD_OUT_PREFIX}{p['task_id']}#prompt", header),
                (f"{HELD_OUT_PREFIX}{p['task_id']}#body", p["reference"]),
            ]
            keys.add(body_key(fn))
    return items, keys


def _dedupe(records: list[dict], counts: Counter) -> list[dict]:
    """The first of each prompt (ignoring trailing spaces and blank lines) and of each body AST."""
    prompts, bodies, out = set(), set(), []
    for r in records:
        norm = "\n".join(ln.rstrip() for ln in r["prompt"].splitlines() if ln.strip())
        if norm in prompts:
            counts["duplicate_prompt"] += 1
        elif r["_body"] in bodies:
            counts["duplicate_body"] += 1
        else:
            prompts.add(norm)
            bodies.add(r["_body"])
            out.append(r)
    return out


def _unique_ids(records: list[dict]) -> None:
    """``path::name`` twice in a file (a redefinition) gets ``#2``, ``#3``...: task ids key the samples."""
    seen: Counter = Counter()
    for r in records:
        seen[r["task_id"]] += 1
        if seen[r["task_id"]] > 1:
            r["task_id"] = f"{r['task_id']}#{seen[r['task_id']]}"


def build_prompts(cfg: ProblemsConfig, *, deny: bool = False) -> tuple[list[dict], dict]:
    """(prompts, report) from ``problems.input``: each prompt ``{task_id, prompt, entry_point, path, repo,
    kind, reference}``, in corpus order (file path, then line), seeded-sampled to ``max_problems``.

    ``cfg`` is the ``problems`` node. ``deny=True`` also drops prompts using ``deny_names``: off by default,
    because nothing is executed and code that opens files is still code to learn from. The report counts
    files, candidates (documented functions and methods), each drop reason, and what is kept, by kind.

    A function's prompt is the imports and module-level helpers it uses (transitively, :mod:`ultrascale.data.mine`'s
    machinery), then its signature and docstring; a method's is the imports it and its class header use, the class
    header (decorators, bases, docstring), then the method's signature and docstring indented inside the class
    (``entry_point`` is ``Class.method``). Since nothing runs, names that cannot be resolved and non-stdlib imports
    are no reason to drop a prompt: the model sees the same kind of code it will be asked to complete. What *is*
    dropped: bodies with nothing to learn (stubs), prompts or bodies too long for the sampling budget, duplicates,
    and anything overlapping an evaluation set: HumanEval, and (with ``train_repos_from``) the doctested problems of
    the corpus's *validation* repositories, which are the second evaluation set.
    """
    counts: Counter = Counter()
    train_docs, held_out_docs = _split_documents(cfg, counts)
    counts["files"] = len(train_docs)
    opts = PromptOptions(
        include_helpers=cfg.include_helpers,
        max_prompt_lines=cfg.max_prompt_lines,
        max_reference_lines=cfg.max_reference_lines,
        deny=frozenset(cfg.deny_names) if deny else frozenset(),
    )
    records = []
    for doc in train_docs:
        records += prompts_from_file(doc["text"], doc["path"], doc["repo"], opts, counts)
    _unique_ids(records)
    records = _dedupe(records, counts)
    held_out, held_out_keys = held_out_problems(held_out_docs)
    counts["heldout_problems"] = sum(item_id.endswith("#body") for item_id, _ in held_out)
    records = decontaminate(records, cfg, counts, held_out, held_out_keys)
    if cfg.max_problems is not None and len(records) > cfg.max_problems:
        keep = sorted(random.Random(cfg.seed).sample(range(len(records)), cfg.max_problems))
        counts["over_max_problems"] = len(records) - len(keep)
        records = [records[i] for i in keep]
    for r in records:
        del r["_body"]
    counts["kept"] = len(records)
    counts["functions"] = sum(r["kind"] == "function" for r in records)
    counts["methods"] = sum(r["kind"] == "method" for r in records)
    if not records:
        raise DataError(
            f"no prompt survived the filters ({dict(counts)}): use a larger problems.input or relax "
            "problems.max_prompt_lines/max_reference_lines"
        )
    head = ("files", "files_not_python", "files_held_out_repo", "files_not_in_prepared_data", "heldout_problems")
    order = (*head, "undocumented", "candidates", *DROP_REASONS, "kept", "functions", "methods")
    report = {"input": cfg.input, "train_repos_from": cfg.train_repos_from}
    report |= {k: counts[k] for k in order}  # zeros too: a filter that dropped nothing is worth knowing
    return records, report


def jsonl_prompts(cfg: ProblemsConfig) -> tuple[list[dict], dict]:
    """(prompts, report) from ``problems.jsonl`` (``cfg`` is the ``problems`` node), through the same
    decontamination as mined prompts: HumanEval always, and with ``train_repos_from`` the doctested problems of
    that dataset's validation repositories (the second evaluation set). A prompt file is someone else's data:
    nothing in it is known to be clean."""
    if not cfg.jsonl:
        raise ConfigError('problems.source=jsonl needs problems.jsonl=FILE (one {"prompt": ...} per line)')
    counts: Counter = Counter()
    records = load_prompt_jsonl(cfg.jsonl)
    counts["seen"] = len(records)
    held_out, held_out_keys = [], set()
    if cfg.train_repos_from:
        held_out, held_out_keys = held_out_problems(_split_documents(cfg, Counter())[1])
    counts["heldout_problems"] = sum(item_id.endswith("#body") for item_id, _ in held_out)
    records = decontaminate(records, cfg, counts, held_out, held_out_keys)
    counts["kept"] = len(records)
    if not records:
        raise DataError(f"problems.jsonl={cfg.jsonl}: every prompt overlaps an evaluation set ({dict(counts)})")
    keys = ("seen", "heldout_problems", "humaneval_contaminated", "validation_contaminated", "kept")
    return records, {"jsonl": str(cfg.jsonl), "train_repos_from": cfg.train_repos_from} | {k: counts[k] for k in keys}


def load_prompt_jsonl(path: str | Path) -> list[dict]:
    """Prompts from a JSONL file, one object per line; only ``prompt`` is required.

    ``task_id`` defaults to ``jsonl/<line number>`` (1-based, as in the error messages) and ``entry_point`` is
    optional, because prompts from elsewhere (a dataset's questions) have neither. A bad line is a DataError
    naming ``file:line``, so a large file is fixed without bisecting it.
    """
    p = resolve_path(path)
    if not p.is_file():
        raise DataError(f"{p}: prompt file not found (JSONL, one {{'prompt': ...}} object per line)")
    out, ids = [], set()
    for lineno, row in iter_jsonl(p, "prompt object"):
        if not isinstance(row, dict):
            raise DataError(f"{p} line {lineno}: a {type(row).__name__}, not an object with a 'prompt' key")
        if not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise DataError(f"{p} line {lineno}: 'prompt' is missing or not a non-empty string")
        row.setdefault("task_id", f"jsonl/{lineno}")
        for key in ("task_id", "entry_point"):
            if key in row and not isinstance(row[key], str):
                raise DataError(f"{p} line {lineno}: {key!r} must be a string, got {row[key]!r}")
        if row["task_id"] in ids:
            raise DataError(f"{p} line {lineno}: duplicate task_id {row['task_id']!r}")
        ids.add(row["task_id"])
        out.append(row)
    return out
