"""Where each step's time goes: data wait, forward, backward, communication, optimizer, other.

Averages hide the comb: a run that is 30 % idle looks fine in tokens/s until someone asks where the
30 % went. Backward, gradient reduction and optimizer come from DeepSpeed's own engine timers
(``wall_clock_breakdown``); the forward is timed here around the engine call, because DeepSpeed times it
from module hooks, and a ``time.time()`` inside a compiled module's hooks breaks the ``torch.compile``
graph. The parts are disjoint, and ``other_s`` is the rest of the step's wall time:

    data_wait_s + fwd_s + bwd_s + comm_s + opt_s + other_s = step_s

How ``other_s`` and ``comm_s`` are taken, the GPU's lazy timer reads and the pipeline engine: :class:`StepBreakdown`.
"""

from __future__ import annotations

import time

import torch
from deepspeed.utils.timer import BACKWARD_INNER_MICRO_TIMER, BACKWARD_REDUCE_MICRO_TIMER, STEP_MICRO_TIMER

from ultrascale.train.parts import MEASURED, OTHER, RL

_ENGINE = {"bwd_s": BACKWARD_INNER_MICRO_TIMER, "comm_s": BACKWARD_REDUCE_MICRO_TIMER, "opt_s": STEP_MICRO_TIMER}


class StepBreakdown:
    """Accumulates one optimizer step's parts; ``finish()`` returns the row fields.

    On CPU ``other_s`` is measured, not taken as the remainder: the step's wall time outside every timed call
    (the batch fetch, the forward, our loss all-reduce, and ``engine.backward``/``engine.step`` clocked from
    outside). The identity then checks DeepSpeed's inner timers against our outer clock: a part counted twice
    shows as parts summing above ``step_s``; what DeepSpeed does inside backward/step but times in no part, as a
    sum below it. On GPU host clocks around asynchronous calls mean nothing, so there it is the remainder.

    ``comm_s`` is what DeepSpeed exposes as a separate phase, the gradient reduction at the end of backward
    (``bwd_allreduce``), plus our own loss all-reduce. Reductions that overlap the backward (ZeRO
    ``overlap_comm`` buckets) are inside ``bwd_s``; ZeRO-1/2's parameter all-gather after the update is inside
    ``opt_s``.

    ``lazy`` (default: on a GPU; the trainer passes the decision, ``step_breakdown.value == "events"``): the
    engine timers are read in ``finish(read=True)`` only, not after every micro-step. On a GPU the timers are
    CUDA events, and reading one waits for its end event: DeepSpeed 0.19.8 reads every engine timer after every
    micro-step (``engine._update_wall_clock_timers``, each a ``end_event.synchronize()``), a stall of the host on
    each ``engine.step()``. Lazy, the events stay queued, are read only for a row the trainer logs (one wait,
    for that step's update) and dropped unread otherwise, so a step whose row is not logged adds no
    synchronisation. (DeepSpeed's throughput timer, which synchronises the device twice per micro-step, is off in
    the DeepSpeed JSON: ``levers/deepspeed.py``.)

    The pipeline engine (``pipe``) cannot run with ``wall_clock_breakdown`` in DeepSpeed 0.19.8 (its backward
    starts a micro timer the base engine's hook already started), so pipeline runs record the data wait and the
    step time, and the rest of the step stays in ``other_s``."""

    def __init__(self, engine, enabled: bool, pipe: bool, lazy: bool | None = None, rl: bool = False):
        self.engine = engine
        self.rl = rl
        """A GRPO step: its rows carry the RL parts (generation, reward, weight sync) too."""
        self.enabled = enabled
        self.pipe = pipe
        self.parts: dict[str, float] = {}
        self.t0 = 0.0
        self.outer_s = 0.0  # host wall time inside the timed calls (fetch, forward, our comm, backward, step)
        self.cuda = torch.cuda.is_available()
        self.lazy = enabled and (self.cuda if lazy is None else lazy)
        self._fwd: list = []
        if enabled:
            _quiet_timer_log(engine.timers, keep=tuple(_ENGINE.values()) if self.lazy else ())
            engine.engine_timers.forward_timers = []  # timed by forward() below, outside any compiled region
        if self.lazy:  # DeepSpeed's per-micro-step read of every timer (a wait on each CUDA end event)
            engine._update_wall_clock_timers = _no_read

    def start(self) -> None:
        self.parts = dict.fromkeys(MEASURED, 0.0)
        self._fwd = []
        self.outer_s = 0.0
        self.t0 = time.perf_counter()

    def engine_call(self, fn, *args, **kwargs):
        """Run ``engine.backward``/``engine.step``, clocking it from outside (its parts come from DeepSpeed)."""
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        self.outer_s += time.perf_counter() - t
        return out

    def forward(self, fn, *args, **kwargs):
        """Run one forward, timing it (CUDA events read at ``finish``; host clock on CPU)."""
        if not self.enabled:  # no row carries the forward's time: no events to record, none to read at finish
            return fn(*args, **kwargs)
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            self._fwd.append((start, end))
            return out
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        self.add("fwd_s", time.perf_counter() - t)
        return out

    def add(self, part: str, seconds: float) -> None:
        """A part we clocked ourselves (the data wait, the forward on CPU, our loss all-reduce)."""
        self.parts[part] += seconds
        self.outer_s += seconds

    def after_micro_step(self) -> None:
        """After ``engine.step()``: DeepSpeed has cached this micro-step's timers (milliseconds). Lazy: nothing
        was read; the events stay on the timers until ``finish``."""
        if not self.enabled or self.lazy:
            return
        cache = self.engine.get_wall_clock_timers() or {}
        for part, name in _ENGINE.items():
            self.parts[part] += cache.get(name, 0.0) / 1000.0

    def reset_engine_timers(self) -> None:
        """Drop time the engine timers recorded outside a training step (evaluation forwards)."""
        if not self.enabled:
            return
        for name in self.engine.engine_timers.active_timers():
            self.engine.timers(name).reset()

    def finish(self, read: bool = True) -> dict[str, float]:
        """The step's row fields. ``read``: the row will be logged. Lazy, a row that is not gets only what the
        host clocked (step time, data wait, our loss all-reduce) and its events are dropped unread."""
        step_s = time.perf_counter() - self.t0
        parts = self.enabled and (read or not self.lazy)
        if self.lazy:
            (self._read_engine_timers if read else self.drop_engine_timers)()
        if parts or not self.lazy:  # the forward's events precede the loss the step waited for: complete
            self.parts["fwd_s"] += sum(a.elapsed_time(b) for a, b in self._fwd) / 1000.0
        row = {"step_s": step_s, "data_wait_s": self.parts["data_wait_s"]}
        row.update({p: self.parts[p] for p in (MEASURED[1:] if parts else ("comm_s", *RL)) if p not in RL or self.rl})
        if parts and not self.cuda and not self.pipe:
            row[OTHER] = max(0.0, step_s - self.outer_s)  # measured: independent of the parts' sum
        else:
            row[OTHER] = max(0.0, step_s - sum(row[p] for p in MEASURED if p in row))
        row["data_wait"] = self.parts["data_wait_s"] / step_s if step_s > 0 else 0.0  # fraction, for the console
        return row

    def _read_engine_timers(self) -> None:
        """Lazy: add every micro-step's events of this step to its parts and clear the timers (one wait, for the
        step's last event)."""
        timers = self.engine.timers.timers
        for part, name in _ENGINE.items():
            if name in timers:
                self.parts[part] += timers[name].elapsed(reset=True) / 1000.0

    def drop_engine_timers(self) -> None:
        """Lazy: forget the queued events unread (no wait)."""
        for name in _ENGINE.values():
            if name in self.engine.timers.timers:
                self.engine.timers.timers[name].reset()


def _no_read() -> None:
    """Stands in for ``DeepSpeedEngine._update_wall_clock_timers`` in lazy mode: no timer is read on the step."""


def _quiet_timer_log(timers, keep: tuple[str, ...] = ()) -> None:
    """DeepSpeed prints every timer group on every micro-step once ``wall_clock_breakdown`` is on; we log
    the numbers ourselves. Keep the resets its callers rely on, except for ``keep`` (the lazy breakdown's
    timers, whose events accumulate over the step's micro-steps until ``finish``), and drop the printing (on
    GPU, formatting the string would read, and wait for, every event)."""

    def log(names, normalizer=1.0, reset=True, memory_breakdown=False, ranks=None):
        if reset:
            for name in names:
                if name in timers.timers and name not in keep:
                    timers.timers[name].reset()

    timers.log = log
