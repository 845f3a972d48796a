"""The project's modules import each other without a circle.

A circle (``ultrascale/cli.py`` imported ``launch/slurm.py`` for ``submit_run``, which imported ``ultrascale/cli.py``
for ``help_if_asked``) works only while every import in it stays inside a function, and says two modules are one
responsibility split in two. Imports inside functions count here too: that is where such circles hide.
"""

from __future__ import annotations

import ast
from pathlib import Path

from ultrascale.paths import PROJECT_ROOT

PACKAGES = ("ultrascale", "launch", "data_prep")


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((PROJECT_ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(PROJECT_ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the first-party modules it imports anywhere in its body (``from pkg import module`` included).
    A package's ``__init__`` is an edge only when it is imported by name, as Python would run it."""
    out: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    target = sub if sub in mods else node.module
                    if target in mods and target != name:
                        out[name].add(target)
            elif isinstance(node, ast.Import):
                out[name].update(a.name for a in node.names if a.name in mods and a.name != name)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_through_others():
    mods = modules()
    assert "ultrascale.cli" in mods and "launch.slurm" in mods
    found = cycles(edges(mods))
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)
