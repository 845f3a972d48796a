"""Planted failures inside real ranks, installed through the trainer's one step hook (:mod:`ultrascale.train.hooks`).

A test passes :func:`env` to the launcher: it names :func:`at_step` as every rank's step hook (and puts the
repository on ``PYTHONPATH`` so a rank started from anywhere imports it) plus the failures it plants:

- ``kill_at="STEP"`` or ``"STEP:RANK"`` (rank 0 by default): SIGKILL that rank at the start of that step, once per
  run directory (a restart runs clean), to prove kill-then-resume (and kill-then-restart) loses nothing;
- ``kill_after_rollback=True``: SIGKILL rank 0 right after a rollback, before any later checkpoint could record it;
- ``raise_on_rank=R``: global rank R raises at its first step while its peers wait in a collective, to prove a
  failing rank brings the whole job down with a message naming it (and that no rank hangs).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from ultrascale.train.hooks import STEP_HOOK_ENV

ROOT = Path(__file__).resolve().parents[2]
FAULT_ENV = "ULTRASCALE_FAULT_AT_STEP"
FAULT_ROLLBACK_ENV = "ULTRASCALE_FAULT_AFTER_ROLLBACK"
RAISE_ENV = "ULTRASCALE_RAISE_ON_RANK"
SYNC_SAVES = "train.checkpoint_async=false"
"""For a test that kills a run and then asserts which checkpoint ``latest`` names. By default a checkpoint is written
in the background and becomes ``latest`` only once every rank reports it written, at a later step's all-gather; under
load that can come after the kill (stop 52's CI: killed one step after the save, no ``latest`` at all). That is the
design (a crash mid-write keeps the previous checkpoint), not what these tests measure; the background path's crash is
test_failures_dist's ``test_a_kill_during_the_background_write_keeps_the_previous_latest_and_resumes_exactly``."""
_last_step: list[int] = []
"""The step this rank's hook saw last: a step that is not past it follows a rollback."""


def env(kill_at: str | None = None, kill_after_rollback: bool = False, raise_on_rank: int | None = None) -> dict:
    """The launcher's extra environment: the hook installed in every rank and the failures planted."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    out = {STEP_HOOK_ENV: f"{__name__}:at_step", "PYTHONPATH": path}
    if kill_at is not None:
        out[FAULT_ENV] = str(kill_at)
    if kill_after_rollback:
        out[FAULT_ROLLBACK_ENV] = "1"
    if raise_on_rank is not None:
        out[RAISE_ENV] = str(raise_on_rank)
    return out


def at_step(trainer: Any, step: int) -> None:
    """Called by every rank's trainer at the top of each optimizer step (0-based ``step``)."""
    rank = trainer.rank
    rolled_back = bool(_last_step) and step <= _last_step[0]
    _last_step[:] = [step]
    if rolled_back and os.environ.get(FAULT_ROLLBACK_ENV) and rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    at, _, who = os.environ.get(FAULT_ENV, "").partition(":")
    if at and step == int(at) and rank == int(who or 0):
        marker = trainer.out / f".fault_fired_{at}_{rank}"  # once per run directory: a restart runs clean
        if not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
    raise_on = int(os.environ.get(RAISE_ENV, -1))
    if step == trainer.start_step and rank == raise_on:
        raise RuntimeError(f"injected failure on rank {rank} at step {step} ({RAISE_ENV}={raise_on})")
