"""Declared bounds for numeric keys, and the schema check every composed config goes through.

A type says ``int``; it does not say that ``train.checkpoint_interval=-1`` is nonsense. Left to the code,
such a value does something silently wrong far from the command line (a negative interval checkpoints every
step, a negative lr trains backwards). So every numeric field declares its range where it is declared::

    checkpoint_interval: int = num(50, ge=0)
    lr: float = num(3e-4, gt=0)

and :func:`check` walks a composed config against its dataclasses: a value outside its range, or a key the
schema does not declare (Hydra's ``+key=`` adds keys even to a struct config), is one ``ConfigError`` naming
the key, the value and the bound. Lists of numbers are checked element by element.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from ultrascale.errors import ConfigError

RANGE = "ultrascale.range"
"""Key of a field's ``metadata`` that holds its :class:`Range`."""


@dataclass(frozen=True)
class Range:
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def holds(self, v: float) -> bool:
        return not (
            (self.ge is not None and v < self.ge)
            or (self.gt is not None and v <= self.gt)
            or (self.le is not None and v > self.le)
            or (self.lt is not None and v >= self.lt)
        )

    def __str__(self) -> str:
        parts = [
            f"{op} {b:g}"
            for op, b in ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
            if b is not None
        ]
        return " and ".join(parts)


def num(
    default: Any = dataclasses.MISSING,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A numeric dataclass field (or a list of numbers) with its allowed range; ``None`` is always allowed
    where the type is optional (it means 'derive it')."""
    meta = {RANGE: Range(ge=ge, gt=gt, le=le, lt=lt)}
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def range_of(f: dataclasses.Field) -> Range | None:
    return f.metadata.get(RANGE)


def check(cfg: DictConfig, help_command: str = "--help") -> None:
    """Every key declared and every number in range, for a config composed on dataclass schemas."""
    _check_node(cfg, "", help_command)


def _check_node(node: DictConfig, prefix: str, help_command: str) -> None:
    cls = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(cls):
        return  # a free-form dict (model.config, launcher.env): its own consumer validates it
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in node:
        if key not in fields:
            group = prefix.rstrip(".") or "the root config"
            raise ConfigError(
                f"unknown config key '{prefix}{key}': it is not in the schema of {group} (a leading + does not "
                f"declare a key); check the spelling, `{help_command}` lists the keys"
            )
    for name, f in fields.items():
        key = f"{prefix}{name}"
        if OmegaConf.is_missing(node, name):
            continue
        value = node[name]
        if isinstance(value, DictConfig):
            _check_node(value, key + ".", help_command)
            continue
        bound = range_of(f)
        if bound is None:
            continue
        raw = OmegaConf.to_container(value, resolve=True) if isinstance(value, ListConfig) else value
        for v in raw if isinstance(raw, list) else [raw]:
            if v is not None and not isinstance(v, bool) and not bound.holds(v):
                shown = raw if isinstance(raw, list) else v
                raise ConfigError(
                    f"{key}={shown} is out of range: it must be {bound}; `{help_command}` says what it means"
                )
