"""One named point where a test may act inside a real rank: at the top of every optimizer step.

Tests that prove kill-then-resume, a rollback that survives a crash, or a failing rank that brings the job down
must act inside the ranks torchrun or deepspeed start, so they name a function in ``ULTRASCALE_STEP_HOOK``
(``module:function``, e.g. ``tests.support.faults:at_step``) and every rank's trainer calls it with itself and
the step about to run. Unset (every real run), the hook is a no-op and nothing is imported.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

STEP_HOOK_ENV = "ULTRASCALE_STEP_HOOK"


def _none(trainer: Any, step: int) -> None:
    return None


def step_hook() -> Callable[[Any, int], None]:
    """The function ``ULTRASCALE_STEP_HOOK`` names (``module:function``), or a no-op when it is unset."""
    spec = os.environ.get(STEP_HOOK_ENV)
    if not spec:
        return _none
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name or "at_step")
