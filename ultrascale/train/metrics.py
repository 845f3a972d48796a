"""Throughput, MFU and memory: the numbers that tell a comb-shaped run from a busy one."""

from __future__ import annotations

import os
import time

import psutil
import torch

from ultrascale.runtime.peak import device_peak_flops


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
    """This process's memory now: allocated device memory on GPU, resident set size on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.memory_allocated() / 2**30
    return psutil.Process(os.getpid()).memory_info().rss / 2**30


def _reset_host_peak() -> bool:
    """Reset this process's resident-set high-water mark (VmHWM) to its current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class MemoryMeter:
    """The metrics' ``mem_gb``: this rank's peak memory over one logged interval (the steps since the previous
    logged row), and the run's peak over every interval for ``summary.json``.

    GPU: ``torch.cuda.max_memory_allocated``, reset with ``torch.cuda.reset_peak_memory_stats`` after each logged
    row (tensors allocated by torch: the CUDA context, NCCL's buffers and the caching allocator's unused reserve
    are not in it). CPU: the process's peak resident set (``VmHWM``), reset through ``/proc/self/clear_refs``;
    where that cannot be reset, the resident set when the row is written. A running peak that is never reset
    (what ``mem_gb`` was) shows the first step's worst moment on every later row, so a leak, or a later phase that
    needs less, never showed."""

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()
        self.host_peak = not self.cuda and _reset_host_peak()
        self.run_peak_gb = 0.0

    @property
    def kind(self) -> str:
        """What ``mem_gb`` is on this rank, in words (the summary and the banner say it)."""
        if self.cuda:
            return "peak GPU memory allocated by torch per logged interval (torch.cuda.max_memory_allocated)"
        if self.host_peak:
            return "peak resident set of the rank's process per logged interval (VmHWM)"
        return "resident set of the rank's process at each logged row (this OS keeps no resettable peak)"

    def peak_gb(self) -> float:
        """The peak since the last :meth:`reset` (read without resetting it)."""
        if self.cuda:
            gb = torch.cuda.max_memory_allocated() / 2**30
        elif self.host_peak:
            gb = _status_kb("VmHWM") / 2**20
        else:
            gb = memory_gb()
        self.run_peak_gb = max(self.run_peak_gb, gb)
        return gb

    def reset(self) -> None:
        """Start the next interval (after a logged row)."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        elif self.host_peak:
            _reset_host_peak()


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


def peak_flops(dtype: str, autocast: bool, gpu) -> tuple[float, str]:
    """The device's peak FLOP/s for MFU and where the figure comes from. The matmuls' dtype picks the peak's column:
    autocast's reach the bf16 peak, fp16 weights the fp16 one."""
    mm = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
    return device_peak_flops(torch.bfloat16 if autocast else mm, gpu)
