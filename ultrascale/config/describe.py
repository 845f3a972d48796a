"""``--help`` that helps: every group, its options, and every key with its value and its docstring.

The docstrings under each schema field (``ultrascale/config/schema.py``) are the documentation; this
reads them with ``ast`` so the help can never drift from the code.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import textwrap
from functools import cache

from omegaconf import DictConfig, OmegaConf

from ultrascale.config import schema
from ultrascale.config.compose import CONF_DIR


@cache
def field_docs(cls: type) -> dict[str, str]:
    """{field: docstring} for a dataclass whose fields carry a string literal right under them."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _walk(cls: type, node: DictConfig, prefix: str, lines: list[str]) -> None:
    docs = field_docs(cls)
    hints = {f.name: f for f in dataclasses.fields(cls)}
    for name, f in hints.items():
        key = f"{prefix}{name}"
        value = node.get(name) if node is not None else None
        sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if sub is not None and dataclasses.is_dataclass(sub):
            _walk(type(sub()), value, key + ".", lines)
            continue
        shown = OmegaConf.to_container(value) if isinstance(value, DictConfig) else value
        lines.append(f"  {key} = {shown!r}")
        if name in docs:
            lines.extend("      " + ln for ln in textwrap.wrap(docs[name], 96))


def group_options() -> dict[str, list[str]]:
    groups = {}
    for d in sorted(p for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra"):
        opts = sorted(p.stem for p in d.glob("*.yaml"))
        if opts:
            groups[d.name] = opts
    return groups


def describe(cfg: DictConfig, header: str) -> str:
    lines = [header.rstrip(), "", "Config groups (choose with group=option):"]
    for g, opts in group_options().items():
        lines.append(f"  {g:<10} {', '.join(opts)}")
    lines += ["", "Keys (override with key=value; values below are the ones these overrides compose to):"]
    for f in dataclasses.fields(schema.RootConfig):
        sub = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if sub is not None and dataclasses.is_dataclass(sub):
            lines.append(f"\n[{f.name}]")
            _walk(type(sub), cfg.get(f.name), f"{f.name}.", lines)
        else:
            lines.append(f"\n  {f.name} = {cfg.get(f.name)!r}")
            doc = field_docs(schema.RootConfig).get(f.name)
            if doc:
                lines.extend("      " + ln for ln in textwrap.wrap(doc, 96))
    return "\n".join(lines)
