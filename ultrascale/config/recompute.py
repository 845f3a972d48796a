"""What ``train.activation_checkpointing``'s values mean, for the rules (``levers/decide.py``) and the planner
(``cost/memory.py``) alike: its own module so the planner reads it without importing the rules, which consult the
planner for ``auto``."""

from __future__ import annotations

from typing import Any

AC_MODES = ("none", "selective", "full")
"""The modes a run can train in (``auto`` resolves to one of them)."""


def checkpointing_mode(value: Any) -> str:
    """``train.activation_checkpointing`` as one of auto/none/selective/full: YAML's and the command line's
    booleans (``true``/``false``, which the config keeps as ``"True"``/``"False"``) mean full/none, as they did
    before the modes. Raises ValueError for anything else."""
    v = str(value).strip().lower()
    v = {"true": "full", "false": "none"}.get(v, v)
    if v not in ("auto", *AC_MODES):
        raise ValueError(value)
    return v
