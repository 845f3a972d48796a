"""Throughput, MFU and memory: the numbers that tell a comb-shaped run from a busy one."""

from __future__ import annotations

import os
import time

import psutil
import torch


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


class HostPeak:
    """The rise of this process's resident memory over a window and its peak inside it (Linux).

    The kernel's high-water mark (VmHWM) is reset on entry (``/proc/self/clear_refs``), so the peak is the
    window's own, not the import's; elsewhere both figures are None. Construction is where a layout that
    builds the whole model on every rank shows itself, so the engine builder measures it for the banner.
    """

    def __enter__(self) -> HostPeak:
        self.base_kb = _status_kb("VmRSS") if os.path.exists("/proc/self/status") else 0
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.ok = bool(self.base_kb)
        except OSError:
            self.ok = False
        return self

    def __exit__(self, *exc) -> None:
        self.peak_kb = _status_kb("VmHWM") if self.ok else 0
        self.end_kb = _status_kb("VmRSS") if self.ok else 0

    @property
    def peak_rise_gb(self) -> float | None:
        return (self.peak_kb - self.base_kb) / 2**20 if self.ok else None

    @property
    def end_rise_gb(self) -> float | None:
        return (self.end_kb - self.base_kb) / 2**20 if self.ok else None


def memory_gb() -> float:
    """Peak device memory on GPU; resident set size of this process on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return psutil.Process(os.getpid()).memory_info().rss / 2**30


class StepTimer:
    """Splits wall time into data wait and compute, so input-pipeline stalls show up as a number."""

    def __init__(self) -> None:
        self.data_s = 0.0
        self.t0 = time.perf_counter()

    def data(self):
        timer = self

        class _Ctx:
            def __enter__(self):
                self.t = time.perf_counter()

            def __exit__(self, *exc):
                timer.data_s += time.perf_counter() - self.t

        return _Ctx()

    def finish(self) -> tuple[float, float]:
        """(step seconds, data-wait fraction)."""
        total = time.perf_counter() - self.t0
        return total, (self.data_s / total if total > 0 else 0.0)


def throughput(tokens: int, seconds: float, flops_per_token: float, world: int, peak: float) -> dict[str, float]:
    """tokens/s for the job, model TFLOP/s for the job, and MFU per device."""
    tps = tokens / seconds if seconds > 0 else 0.0
    flops = tps * flops_per_token
    return {
        "tokens_per_s": tps,
        "tflops": flops / 1e12,
        "mfu": flops / world / peak if peak > 0 else 0.0,
    }
