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


def absolute(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The module a ``from`` import names, as Python resolves it: ``from ..train import banner`` in
    ``ultrascale/model/flops.py`` is ``ultrascale.train``. A relative import counts like any other, or one
    written with dots would reach up a layer (or close a circle) unseen."""
    if node.level == 0:
        return node.module or ""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    if node.level > len(package):  # above the top package: Python refuses it, and it names nothing of ours
        return ""
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the first-party modules it imports anywhere in its body (``from pkg import module`` included,
    relative imports resolved). A package's ``__init__`` is an edge only when it is imported by name, as Python
    would run it."""
    out: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                module = absolute(name, path, node)
                for alias in node.names:
                    sub = f"{module}.{alias.name}"
                    target = sub if sub in mods else module
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


def test_a_relative_import_is_an_edge(tmp_path):
    """Each form of relative import, inside a function as a circle would hide it, resolves to the module it names."""
    files = {
        "pkg/__init__.py": "from . import errors\n",
        "pkg/errors.py": "",
        "pkg/model/__init__.py": "",
        "pkg/model/flops.py": "def f():\n    from ..train import banner\n    from .. import errors\n",
        "pkg/model/build.py": "from .flops import f\nfrom . import flops\n",
        "pkg/train/__init__.py": "",
        "pkg/train/banner.py": "def g():\n    from ...pkg.model import build\n",
    }
    mods = {}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
        parts = Path(rel).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = tmp_path / rel
    assert edges(mods) == {
        "pkg": {"pkg.errors"},
        "pkg.errors": set(),
        "pkg.model": set(),
        "pkg.model.flops": {"pkg.train.banner", "pkg.errors"},
        "pkg.model.build": {"pkg.model.flops"},
        "pkg.train": set(),
        "pkg.train.banner": set(),  # three dots from pkg/train/ climb above pkg: an ImportError, no edge
    }


def test_no_module_imports_itself_through_others():
    mods = modules()
    assert "ultrascale.cli" in mods and "launch.slurm" in mods
    found = cycles(edges(mods))
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)
