"""``--help`` that helps: every group, its options, and every key with its value and its docstring.

The docstrings under each schema field (``ultrascale/config/<group>.py``) are the documentation; this
reads them with ``ast`` so the help can never drift from the code.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import sys
import textwrap
from enum import Enum
from functools import cache

from omegaconf import DictConfig, OmegaConf

from ultrascale.config.fields import range_of
from ultrascale.errors import UltrascaleError
from ultrascale.paths import CONF_DIR


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


def walk_keys(cls: type, node: DictConfig | None, prefix: str, lines: list[str]) -> None:
    """One line per key of dataclass ``cls`` (recursively): its composed value, then its docstring and range."""
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        value = node.get(f.name) if node is not None else None
        sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if sub is not None and dataclasses.is_dataclass(sub):
            _walk_section(type(sub()), value, key, lines)
            continue
        shown = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        if isinstance(shown, list):  # what the user types: ['psm', 'spm'], not [<FimMode.psm: 'psm'>, ...]
            shown = [x.value if isinstance(x, Enum) else x for x in shown]
        shown = shown.value if isinstance(shown, Enum) else shown  # what the user types: 'cpu', not <Offload.cpu>
        bound = range_of(f)
        lines.append(f"  {key} = {shown!r}" + (f"   ({bound})" if bound else ""))
        if f.name in docs:
            lines.extend("      " + ln for ln in textwrap.wrap(docs[f.name], 96))


def _walk_section(cls: type, node: DictConfig | None, key: str, lines: list[str]) -> None:
    if "." not in key:
        lines.append(f"\n[{key}]")
    walk_keys(cls, node, key + ".", lines)


def group_options(config_name: str) -> dict[str, list[str]]:
    """The config groups ``conf/<config_name>.yaml`` composes (its defaults list), each with its options."""
    path = CONF_DIR / f"{config_name}.yaml"
    defaults = OmegaConf.load(path).get("defaults", []) if path.exists() else []
    groups = {}
    for entry in defaults:
        if not isinstance(entry, DictConfig):
            continue
        name = next(iter(entry)).split("@")[0]
        if name.startswith("override ") or not (CONF_DIR / name).is_dir():
            continue
        opts = sorted(p.stem for p in (CONF_DIR / name).glob("*.yaml"))
        if opts:
            groups[name] = opts
    return groups


def describe(cfg: DictConfig, header: str, config_name: str | None = None) -> str:
    """The ``--help`` of any tool whose config is composed on a dataclass schema: its docstring, its groups,
    then every key with the value these overrides compose to, its range and its docstring."""
    lines = [header.rstrip()]
    groups = group_options(config_name) if config_name else {}
    if groups:
        lines += ["", "Config groups (choose with group=option):"]
        width = max(len(g) for g in groups)
        lines += [f"  {g:<{width}}  {', '.join(opts)}" for g, opts in groups.items()]
    lines += ["", "Keys (override with key=value; values below are the ones these overrides compose to):"]
    walk_keys(OmegaConf.get_type(cfg), cfg, "", lines)
    return "\n".join(lines)


HELP_FLAGS = ("--help", "-h")


def help_if_asked(
    config_name: str | None, argv: list[str], help_text: str, cfg: DictConfig | None = None
) -> int | None:
    """``--help``: the tool's docstring, its groups and every key with its composed value, range and docstring.

    Returns the exit code when help was asked for (None otherwise), so every entry point, Hydra-composed or
    not, answers ``--help`` the same way. ``cfg`` is for tools whose config is not a ``conf/`` root.
    """
    if not any(a in HELP_FLAGS for a in argv):
        return None
    from ultrascale.config.compose import compose

    try:
        rest = [a for a in argv if a not in HELP_FLAGS]
        print(describe(cfg if cfg is not None else compose(rest, config_name), help_text, config_name))
    except UltrascaleError as e:  # one line, as every entry point reports a user error
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
