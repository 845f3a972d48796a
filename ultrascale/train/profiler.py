"""A ``torch.profiler`` window over a few training steps, on every rank, written next to the run.

The step breakdown says *which phase* a step spends its time in; this says *which operators*, when a phase
is larger than it should be (a slow kernel, an unexpected copy, a graph break, Python between ops). It is
off by default (a profiled step is slower and its trace is large) and covers a window chosen after the
warm-up and the compile, so the trace shows the steady state:

    python train.py train.profile_steps=3 train.profile_start=10

writes, per rank, ``profile/rank00000.trace.json`` (open in https://ui.perfetto.dev or
``chrome://tracing``) and ``profile/rank00000.txt``: the operators ranked by self time (CPU, and CUDA
when there is a GPU), the table to read first.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger("ultrascale")


class StepProfiler:
    """Profiles steps ``[start, start + steps)`` of this process (0-based, counted from its start or resume);
    ``first_step`` (the resumed-from step) turns them into the step numbers the metrics log."""

    def __init__(self, out: Path, rank: int, start: int, steps: int, first_step: int = 0):
        self.out, self.rank, self.start, self.steps = out, rank, int(start), int(steps)
        self.first_step = int(first_step)
        self._prof = None

    def before(self, step: int) -> None:
        if self.steps > 0 and step == self.start and self._prof is None:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self._prof = profile(activities=acts, record_shapes=True, with_stack=False)
            self._prof.__enter__()

    def after(self, step: int) -> None:
        if self._prof is not None and step + 1 >= self.start + self.steps:
            self.close(step + 1)

    def close(self, end: int) -> None:
        """Stop and write the trace and the table (also called when the run ends inside the window)."""
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        d = self.out / "profile"
        d.mkdir(parents=True, exist_ok=True)
        trace = d / f"rank{self.rank:05d}.trace.json"
        prof.export_chrome_trace(str(trace))
        by = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=by, row_limit=40, max_name_column_width=70)
        steps = f"{self.first_step + self.start + 1}..{self.first_step + end}"
        head = f"torch.profiler, rank {self.rank}, optimizer steps {steps} (as logged), by {by}\n"
        (d / f"rank{self.rank:05d}.txt").write_text(head + table + "\n")
        log.info(f"profile of steps {steps}: {d / f'rank{self.rank:05d}.txt'} (table), {trace}")
