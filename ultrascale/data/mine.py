"""Turn one Python source file into HumanEval-style problems: functions whose docstrings carry doctests.

A problem is ``{task_id, prompt, tests, entry_point, reference}``. The prompt is what a model needs to write
the body and nothing more: the imports and module-level helpers the function uses (transitively, so it is
self-contained), then its signature and docstring. The reference is the original body. The tests run the
docstring's ``>>>`` examples through :mod:`doctest` (output matching, exceptions and directives exactly as the
author meant them), plus any ``assert f(...)`` statements elsewhere in the module that call the function.

Everything here is static (``ast``); whether the reference really passes its own tests, and whether the
tests really reject a wrong body, is decided later in the sandbox (:mod:`ultrascale.eval.problems`). Static
filters only drop what cannot be made self-contained or is not a pure function; each drop has a reason,
counted for the report.
"""

from __future__ import annotations

import ast
import builtins
import doctest
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

BUILTINS = frozenset(dir(builtins))
_PARSER = doctest.DocTestParser()


@dataclass(frozen=True)
class MineOptions:
    include_helpers: bool = True
    max_prompt_lines: int = 80
    max_reference_lines: int = 40
    asserts: bool = True
    deny: frozenset[str] = frozenset()


def _stored(node: ast.AST) -> set[str]:
    """Names a node binds anywhere inside it (a deliberate over-approximation of Python's scoping)."""
    out: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load):
            out.add(n.id)
        elif isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(n.name)
        elif isinstance(n, ast.arg):
            out.add(n.arg)
        elif isinstance(n, ast.Import | ast.ImportFrom):
            out.update(_import_names(n))
        elif isinstance(n, ast.ExceptHandler | ast.MatchAs | ast.MatchStar) and n.name:
            out.add(n.name)
    return out


def _loaded(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def free_names(node: ast.AST) -> set[str]:
    """Names a node reads but does not bind: what must come from the module or builtins.

    Over-approximating bindings can only hide a free name, and a hidden one makes the reference fail its
    tests in the sandbox, which drops the problem: the sandbox, not this function, has the last word.
    """
    return _loaded(node) - _stored(node)


def _import_names(stmt: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(stmt, ast.Import):
        return [(a.asname or a.name).split(".")[0] for a in stmt.names]
    return [a.asname or a.name for a in stmt.names]


def import_problem(node: ast.AST) -> str | None:
    """Why the imports inside ``node`` cannot run in the sandbox, which has this Python's stdlib and nothing else."""
    for n in ast.walk(node):
        if isinstance(n, ast.ImportFrom) and n.level:
            return "relative_import"
        mods = (
            [a.name for a in n.names]
            if isinstance(n, ast.Import)
            else [n.module or ""]
            if isinstance(n, ast.ImportFrom)
            else []
        )
        if any(m.split(".")[0] not in sys.stdlib_module_names and m != "__future__" for m in mods):
            return "non_stdlib_import"
    return None


def used_modules_and_names(node: ast.AST) -> set[str]:
    """Every name read plus every module imported inside ``node``: what the deny list is checked against."""
    out = _loaded(node)
    for n in ast.walk(node):
        if isinstance(n, ast.Import):
            out.update(a.name.split(".")[0] for a in n.names)
        elif isinstance(n, ast.ImportFrom) and n.module:
            out.add(n.module.split(".")[0])
    return out


class Module:
    """The top-level bindings of one parsed file: which statement defines each name, if exactly one does."""

    def __init__(self, tree: ast.Module, lines: list[str]):
        self.tree, self.lines = tree, lines
        self.defs: dict[str, ast.stmt] = {}
        self.ambiguous: set[str] = set()
        self.future: list[ast.stmt] = []
        for stmt in tree.body:
            if isinstance(stmt, ast.ImportFrom) and stmt.module == "__future__":
                self.future.append(stmt)
                continue
            for name in self._binds(stmt):
                if name == "*":
                    continue  # whatever it binds is unknown here: a name only it provides stays unresolved
                if name in self.defs:
                    self.ambiguous.add(name)  # defined twice: which one a caller sees depends on the order
                else:
                    self.defs[name] = stmt
        for name in self.ambiguous:
            self.defs.pop(name, None)
        self.asserts: list[tuple[ast.Assert, set[str]]] = [  # once per file: (assert, names it calls)
            (n, {c.func.id for c in ast.walk(n.test) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)})
            for n in ast.walk(tree)
            if isinstance(n, ast.Assert)
        ]

    def _binds(self, stmt: ast.stmt) -> list[str]:
        if isinstance(stmt, ast.Import | ast.ImportFrom):
            return _import_names(stmt)
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            return [stmt.name]
        if isinstance(stmt, ast.Assign):
            return [n.id for t in stmt.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
            return [stmt.target.id]
        if isinstance(stmt, ast.If) and _is_main_guard(stmt):
            return []
        if isinstance(stmt, ast.If | ast.Try | ast.For | ast.While | ast.With | ast.AugAssign | ast.AnnAssign):
            self.ambiguous.update(_stored(stmt))  # conditional or incremental: not one defining statement
        return []

    def segment(self, stmt: ast.stmt) -> list[str]:
        """The statement's source lines, decorators included."""
        first = min([stmt.lineno] + [d.lineno for d in getattr(stmt, "decorator_list", [])])
        return self.lines[first - 1 : stmt.end_lineno]


def _is_main_guard(stmt: ast.If) -> bool:
    t = stmt.test
    return (
        isinstance(t, ast.Compare)
        and isinstance(t.left, ast.Name)
        and t.left.id == "__name__"
        and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in t.comparators)
    )


def _example_names(docstring: str) -> tuple[set[str], bool]:
    """Free names the doctest examples read, and whether every example parses."""
    names: set[str] = set()
    ok = True
    for ex in _PARSER.get_examples(docstring):
        try:
            names |= free_names(ast.parse(ex.source))
        except SyntaxError:
            ok = False
    return names, ok


def closure(
    mod: Module, needed: set[str], skip: str, helpers: bool, strict: bool = True
) -> tuple[list[ast.stmt], str | None]:
    """The module statements that define ``needed`` (transitively), or the reason they cannot be had.

    ``strict`` (a problem, whose tests must run): a name that does not resolve, or a helper when ``helpers`` is
    off, drops the function with its reason. Not strict (a prompt, which is only read): such a name is simply
    left out of the context.
    """
    chosen: dict[int, ast.stmt] = {}
    todo = sorted(needed - BUILTINS - {skip})
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        stmt = mod.defs.get(name)
        if stmt is None:
            if strict:
                return [], "unresolved_name"  # conditional, defined twice, star-imported or simply undefined
            continue
        if id(stmt) in chosen:
            continue
        is_import = isinstance(stmt, ast.Import | ast.ImportFrom)
        if not is_import and not helpers:
            if strict:
                return [], "needs_module_helpers"
            continue
        chosen[id(stmt)] = stmt
        if not is_import:
            todo.extend(sorted(free_names(stmt) - BUILTINS - seen - {skip}))
    return sorted(chosen.values(), key=lambda s: s.lineno), None


def _assert_tests(mod: Module, fn: ast.FunctionDef) -> list[ast.Assert]:
    """``assert`` statements outside the function that call it by name (module level, ``_test()``, main guard)."""
    return [a for a, called in mod.asserts if fn.name in called and not fn.lineno <= a.lineno <= fn.end_lineno]


def tests_source(entry_point: str, docstring: str | None, asserts: Iterable[str]) -> str:
    """A HumanEval-style ``check(candidate)``: the doctest examples run through doctest, then the asserts."""
    lines = ["def check(candidate):", f"    {entry_point} = candidate  # the examples call the function by name"]
    if docstring:
        lines += [
            "    import doctest",
            "    import sys",
            "",
            "    globs = dict(globals())",
            f"    globs[{entry_point!r}] = candidate",
            f"    test = doctest.DocTestParser().get_doctest({docstring!r}, globs, {entry_point!r}, None, 0)",
            "    runner = doctest.DocTestRunner(verbose=False)",
            "    runner.run(test, out=sys.stderr.write, clear_globs=False)",
            "    assert runner.tries > 0 and runner.failures == 0, f'{runner.failures}/{runner.tries} examples failed'",
        ]
    lines += [f"    {a}" for a in asserts]
    return "\n".join(lines) + "\n"


def mine_file(text: str, path: str, opts: MineOptions, counts: Counter) -> list[dict]:
    """Problems from one file's top-level functions; every function with tests that is dropped is counted."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        counts["unparsable_file"] += 1
        return []
    mod = Module(tree, text.splitlines(keepends=True))
    out = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            for m in node.body:  # methods need their class: counted, so the report says what is left out
                doc = ast.get_docstring(m) if isinstance(m, ast.FunctionDef | ast.AsyncFunctionDef) else None
                if doc and ">>>" in doc:
                    counts["seen"] += 1
                    counts["method"] += 1
            continue
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        problem, reason = _problem(mod, node, path, opts)
        if reason == "no_tests":
            continue
        counts["seen"] += 1
        if reason:
            counts[reason] += 1
        else:
            out.append(problem)
    return out


def _problem(mod: Module, fn: ast.stmt, path: str, opts: MineOptions) -> tuple[dict | None, str | None]:
    docstring = ast.get_docstring(fn, clean=True)
    try:
        has_doctests = bool(docstring and _PARSER.get_examples(docstring))
    except ValueError:  # doctest refuses it (inconsistent indentation): the tests could never run
        return None, "unparsable_example"
    asserts = _assert_tests(mod, fn) if opts.asserts and isinstance(fn, ast.FunctionDef) else []
    if not has_doctests and not asserts:
        return None, "no_tests"
    if isinstance(fn, ast.AsyncFunctionDef):
        return None, "async"
    if not docstring:
        return None, "no_docstring"  # asserts but nothing to prompt with: the model would get a bare signature
    if any(isinstance(n, ast.Global | ast.Nonlocal) for n in ast.walk(fn)):
        return None, "global_state"
    if len(fn.body) < 2:
        return None, "no_body"
    doc_end, body_start = fn.body[0].end_lineno, fn.body[1].lineno
    if body_start <= doc_end:
        return None, "inline_body"  # `"""doc"""; return x` cannot be split into prompt and completion
    needed = free_names(fn)
    ex_ok = True
    if has_doctests:
        ex_names, ex_ok = _example_names(docstring)
        needed |= {n for n in ex_names if n in mod.defs}  # only module names; the rest the examples define
    if not ex_ok:
        return None, "unparsable_example"
    kept_asserts = []
    for a in asserts:
        names = free_names(a) - BUILTINS - {fn.name}
        if all(n in mod.defs for n in names):
            kept_asserts.append(a)
            needed |= names
    if not has_doctests and not kept_asserts:
        return None, "unresolved_name"
    context, why = closure(mod, needed, fn.name, opts.include_helpers)
    if why:
        return None, why
    used = used_modules_and_names(fn) | set().union(*(used_modules_and_names(s) for s in context))
    if has_doctests:
        used |= _example_names(docstring)[0]
    if used & opts.deny:
        return None, "denied_name"
    for node in (fn, *context):
        if why := import_problem(node):
            return None, why
    lines = mod.lines
    first = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
    header = lines[first - 1 : doc_end]
    body = lines[doc_end : fn.end_lineno]
    while body and not body[0].strip():
        body = body[1:]  # blank lines after the docstring are layout, not code the model must write
    reference = "".join(body).rstrip() + "\n"
    if not reference.strip():
        return None, "no_body"
    imports = [s for s in context if isinstance(s, ast.Import | ast.ImportFrom)]
    helpers = [s for s in context if s not in imports]
    # HumanEval's layout: an import block, then each helper, then the function, two blank lines apart.
    head = [ln for stmt in (*mod.future, *imports) for ln in mod.segment(stmt)]
    blocks = ([head] if head else []) + [mod.segment(s) for s in helpers] + [header]
    text = "\n\n".join("".join(ln if ln.endswith("\n") else ln + "\n" for ln in b) for b in blocks)
    if len(text.splitlines()) > opts.max_prompt_lines:
        return None, "prompt_too_long"
    if len(reference.splitlines()) > opts.max_reference_lines:
        return None, "reference_too_long"
    prompt = text
    return {
        "task_id": f"{path}::{fn.name}",
        "prompt": prompt,
        "tests": tests_source(fn.name, docstring if has_doctests else None, [ast.unparse(a) for a in kept_asserts]),
        "entry_point": fn.name,
        "reference": reference,
        "origin": {"path": path, "line": fn.lineno, "tests": "doctest" if has_doctests else "asserts"},
    }, None
