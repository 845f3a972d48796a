"""``conf/stability/``: what a run does by itself about a NaN or a loss spike."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from ultrascale.config.fields import num


class NonFinitePolicy(StrEnum):
    skip = "skip"
    rollback = "rollback"
    stop = "stop"


class SpikePolicy(StrEnum):
    none = "none"
    skip = "skip"
    lr_cut = "lr_cut"
    rollback = "rollback"


@dataclass
class StabilityConfig:
    """What a run does by itself about a bad step, so a week-long job survives a spike or a NaN unattended.

    Every decision is taken from the all-reduced step loss and grad norm and then all-reduced again, so all
    ranks act identically. Each event is a row in metrics.jsonl (``event``), a console line, a wandb/TensorBoard
    point under ``stability/`` and an entry in the report."""

    nonfinite: NonFinitePolicy = NonFinitePolicy.skip
    """A NaN/inf loss or gradient norm: ``skip`` (no optimizer update; the data position still advances),
    ``rollback`` (reload the last checkpoint and skip the data since it) or ``stop`` (end with an error).
    The bad update is never applied in any case."""
    spike: SpikePolicy = SpikePolicy.skip
    """A loss spike (see spike_zscore): ``none``, ``skip`` (drop this step's update), ``lr_cut`` (apply it with
    lr x lr_cut_factor and keep the cut for lr_cut_steps) or ``rollback`` (last checkpoint, skip the data
    window from it to the spike). ``skip`` needs parallel.pp=1 (the pipeline updates inside train_batch)."""
    spike_zscore: float = num(6.0, gt=0)
    """A step is a spike when its loss exceeds the mean of the recent window by this many standard deviations.
    One-sided: a loss that falls fast is progress, not a spike."""
    spike_window: int = num(50, ge=1)
    """Accepted (non-skipped) steps in the moving window of losses the z-score is measured against."""
    spike_min_history: int = num(20, ge=1)
    """No spike detection until the window holds this many steps (early losses fall too fast to be a baseline)."""
    spike_min_rel_std: float = num(0.02, ge=0)
    """Floor on the window's standard deviation as a fraction of its mean loss, so a flat stretch of the
    curve (or a short window) does not turn ordinary noise into a 'spike'."""
    lr_cut_factor: float = num(0.5, gt=0, le=1)
    """``spike=lr_cut``: multiply the scheduled lr by this factor..."""
    lr_cut_steps: int = num(100, ge=1)
    """...for this many steps after the spike."""
    max_consecutive: int = num(5, ge=1)
    """End the run with an error after this many bad steps in a row (skips and rollbacks without a clean
    step between them): something is persistently broken and a human should look."""
    max_rollbacks: int = num(10, ge=0)
    """End the run with an error after this many rollbacks in total."""
