"""No module imports a package above its own, in the order ARCHITECTURE.md states.

The order is read from the page itself (its ``layers`` block, bottom first), so the page and the code cannot
drift apart: moving a module, or adding an import that reaches up, fails here with the edge named. The few
upward imports the project still has are listed on the same page (its ``upward`` block), each with its reason;
an exception that no longer exists fails too, so the list only shrinks.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.test_import_graph import edges, modules
from ultrascale.paths import PROJECT_ROOT

PAGE = PROJECT_ROOT / "ARCHITECTURE.md"


def _block(text: str, name: str) -> list[str]:
    m = re.search(rf"^```{name}\n(.*?)^```", text, flags=re.M | re.S)
    assert m, f"ARCHITECTURE.md has no ```{name} block"
    return [line for line in m.group(1).splitlines() if line.strip()]


def layers(text: str) -> list[tuple[str, list[str]]]:
    """(layer name, module prefixes) bottom first: each line is ``N name: prefix prefix ...``."""
    out = []
    for line in _block(text, "layers"):
        head, _, rest = line.partition(":")
        out.append((head.split()[-1], rest.split()))
    return out


def upward_allowed(text: str) -> set[tuple[str, str]]:
    """The listed upward imports: ``importer -> imported   reason``."""
    out = set()
    for line in _block(text, "upward"):
        m = re.match(r"\s*(\S+)\s*->\s*(\S+)", line)
        assert m, f"ARCHITECTURE.md upward block: cannot read {line!r}"
        out.add((m.group(1), m.group(2)))
    return out


def layer_of(module: str, order: list[tuple[str, list[str]]]) -> int | None:
    """The layer of the longest prefix that names the module (``ultrascale.train.banner`` → train)."""
    best: tuple[int, int] | None = None
    for i, (_, prefixes) in enumerate(order):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    return best[0] if best else None


def unknown(names: set[str], mods: dict[str, Path] | set[str]) -> list[str]:
    """The names that are neither a module nor a package of the tree. A prefix that names nothing places no
    module in its layer, so a moved module (``ultrascale.rundir``, now ``ultrascale/train/rundir.py``) would
    leave the page describing code that is not there, and every other check would still pass."""
    return sorted(n for n in names if n not in mods and not any(m.startswith(n + ".") for m in mods))


def upward(graph: dict[str, set[str]], order: list[tuple[str, list[str]]]) -> list[tuple[str, str]]:
    """Every edge from a module to one in a higher layer."""
    return sorted(
        (a, b)
        for a, bs in graph.items()
        for b in bs
        if layer_of(b, order) > layer_of(a, order)  # type: ignore[operator]
    )


def test_every_module_has_a_layer():
    order = layers(PAGE.read_text())
    assert [m for m in modules() if layer_of(m, order) is None] == []


def test_every_name_on_the_page_is_a_module():
    text = PAGE.read_text()
    layer_names = {p for _, prefixes in layers(text) for p in prefixes}
    upward_names = {name for pair in upward_allowed(text) for name in pair}
    mods = modules()
    assert unknown(layer_names, mods) == [], "ARCHITECTURE.md's layers block names no such module or package"
    assert unknown(upward_names, mods) == [], "ARCHITECTURE.md's upward block names no such module"


def test_no_module_imports_a_layer_above_it():
    text = PAGE.read_text()
    order = layers(text)
    found = upward(edges(modules()), order)
    allowed = upward_allowed(text)
    new = [f"{a} -> {b} ({order[layer_of(a, order)][0]} imports {order[layer_of(b, order)][0]})"
           for a, b in found if (a, b) not in allowed]  # fmt: skip
    assert new == [], "imports that reach up a layer (move the code down, or invert the call):\n" + "\n".join(new)
    stale = sorted(allowed - set(found))
    assert stale == [], f"ARCHITECTURE.md lists upward imports that are gone, strike them: {stale}"
    pairs = {(order[layer_of(a, order)][0], order[layer_of(b, order)][0]) for a, b in found}  # type: ignore[index]
    assert len(pairs) <= 5, f"{len(pairs)} pairs of layers import upward (the goal is at most 5): {sorted(pairs)}"


def test_a_planted_upward_import_is_caught():
    order = [("base", ["ultrascale.errors"]), ("model", ["ultrascale.model"]), ("train", ["ultrascale.train"])]
    graph = {"ultrascale.model.build": {"ultrascale.errors", "ultrascale.train.trainer"},
             "ultrascale.train.trainer": {"ultrascale.model.build"}, "ultrascale.errors": set()}  # fmt: skip
    assert upward(graph, order) == [("ultrascale.model.build", "ultrascale.train.trainer")]
    text = "```layers\n1 base: a\n2 top: a.b c\n```\n```upward\nx -> y   why\n```\n"
    assert layers(text) == [("base", ["a"]), ("top", ["a.b", "c"])]
    assert layer_of("a.b.c", layers(text)) == 1 and layer_of("a.z", layers(text)) == 0
    assert upward_allowed(text) == {("x", "y")}


def test_a_name_that_is_no_module_is_caught():
    mods = {"a", "a.b.c", "c"}
    assert unknown({"a", "a.b", "a.b.c", "c", "a.rundir", "d"}, mods) == ["a.rundir", "d"]  # a.b: a package
