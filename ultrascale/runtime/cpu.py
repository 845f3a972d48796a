"""What this CPU is: its instruction sets, matrix units, caches and cores, read once from the OS.

The CPU levers (the fused loss chunk, the attention block) are decided from this record by pure functions in
``ultrascale/levers/hardware.py``, threads per rank by :func:`threads_per_rank` here, so a default measured on
one model of CPU is not carried to the next as a constant. ``model name`` alone does not tell CPUs apart: a
cloud VM reports "Intel(R) Xeon(R) Processor" for Ice Lake without bf16 and Sapphire Rapids with AMX alike,
which made the peak calibration of one reused on the other. :meth:`CpuInfo.fingerprint` adds family, model,
stepping and the matrix instruction sets.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

MATRIX_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512_fp16", "avx512f", "avx512_vnni", "avx2", "fma")
"""The flags that change which kernels oneDNN/MKL run for a matmul, in the order the fingerprint lists them."""


@dataclass(frozen=True)
class CpuInfo:
    vendor: str = ""
    model_name: str = ""
    family: int = 0
    model: int = 0
    stepping: int = 0
    flags: frozenset[str] = field(default_factory=frozenset)
    l1d_kib: int = 0
    """Per core."""
    l2_kib: int = 0
    """Per core (what one rank's working set can own)."""
    l3_kib: int = 0
    """The whole last-level cache as the OS reports it (a VM reports its host's, shared with its neighbours)."""
    cpus: int = 1
    """Logical CPUs this process may run on (its affinity mask)."""
    threads_per_core: int = 1
    """SMT siblings per physical core as the OS sees them (1 in most VMs, which hide the host's pairing)."""

    @property
    def amx(self) -> bool:
        return "amx_bf16" in self.flags

    @property
    def bf16_native(self) -> bool:
        """bf16 matmuls run on native instructions (AMX or AVX-512 BF16); elsewhere torch emulates them, slower
        than fp32."""
        return self.amx or "avx512_bf16" in self.flags

    @property
    def vector_bits(self) -> int:
        return 512 if "avx512f" in self.flags else 256 if "avx2" in self.flags else 128

    @property
    def physical_cores(self) -> int:
        return max(1, self.cpus // max(1, self.threads_per_core))

    @property
    def matrix_unit(self) -> str:
        """The fastest bf16 matmul path, in words."""
        if self.amx:
            return "AMX (bf16 tiles)"
        if self.bf16_native:
            return "AVX-512 BF16"
        return f"{self.vector_bits}-bit FMA (no native bf16)"

    def fingerprint(self) -> str:
        """What tells two CPUs' GEMM rates apart: vendor, family/model/stepping and the matrix flags."""
        isa = " ".join(f for f in MATRIX_FLAGS if f in self.flags) or "no-avx2"
        return f"{self.vendor} {self.family}/{self.model}/{self.stepping} {isa}"

    def describe(self) -> str:
        cache = f"L2 {self.l2_kib} KiB/core, L3 {self.l3_kib // 1024} MiB" if self.l2_kib else "caches unknown"
        smt = f", {self.threads_per_core} threads/core" if self.threads_per_core > 1 else ""
        return f"{self.model_name} ({self.fingerprint()}; {self.matrix_unit}; {cache}; {self.cpus} CPUs{smt})"


def parse_cpuinfo(text: str) -> dict[str, str]:
    """The first processor's ``key: value`` lines of ``/proc/cpuinfo``."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if out:
                break
            continue
        k, _, v = line.partition(":")
        out.setdefault(k.strip(), v.strip())
    return out


def _cache_kib(cpu_dir: Path) -> dict[int, int]:
    """Data/unified cache size per level, from sysfs (``48K``, ``2048K``, ``300M``)."""
    sizes: dict[int, int] = {}
    for d in sorted(cpu_dir.glob("cache/index*")):
        try:
            if (d / "type").read_text().strip() == "Instruction":
                continue
            raw = (d / "size").read_text().strip()
            level = int((d / "level").read_text())
        except (OSError, ValueError):
            continue
        mult = {"K": 1, "M": 1024, "G": 1024 * 1024}.get(raw[-1:], 0)
        if mult and raw[:-1].isdigit():
            sizes[level] = int(raw[:-1]) * mult
    return sizes


def _threads_per_core(cpu_dir: Path) -> int:
    try:
        siblings = (cpu_dir / "topology" / "thread_siblings_list").read_text().strip()
    except OSError:
        return 1
    n = 0
    for part in siblings.split(","):
        a, _, b = part.partition("-")
        n += int(b) - int(a) + 1 if b else 1
    return max(1, n)


@lru_cache(maxsize=1)
def detect() -> CpuInfo:
    """This machine's CPU (cached: it does not change under a running process)."""
    try:
        info = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        info = {}
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    sysdir = Path("/sys/devices/system/cpu/cpu0")
    caches = _cache_kib(sysdir)

    def num(key: str) -> int:
        v = info.get(key, "")
        return int(v) if v.isdigit() else 0

    if not info:
        import platform

        info = {"model name": platform.processor() or platform.machine()}
    return CpuInfo(
        vendor=info.get("vendor_id", ""),
        model_name=info.get("model name", ""),
        family=num("cpu family"),
        model=num("model"),
        stepping=num("stepping"),
        flags=frozenset(info.get("flags", "").split()),
        l1d_kib=caches.get(1, 0),
        l2_kib=caches.get(2, 0),
        l3_kib=caches.get(3, 0),
        cpus=cpus,
        threads_per_core=_threads_per_core(sysdir),
    )


def threads_per_rank(cpu: CpuInfo, local_ranks: int, omp: str = "") -> tuple[int, str]:
    """(torch threads per rank, why): how the ranks of one node share its cores, a fact of the process and the
    CPU that no config key changes, so it lives here, below the levers. The user's ``OMP_NUM_THREADS`` wins;
    otherwise each rank gets its share of the *physical* cores: two SMT siblings share one core's FMA/AMX units
    and its L1/L2, so a second GEMM thread on a sibling adds contention, not FLOPs (Intel's and oneDNN's
    guidance: one thread per core)."""
    if omp.isdigit() and int(omp) > 0:
        return int(omp), f"OMP_NUM_THREADS={omp} from the environment"
    local = max(1, local_ranks)
    if cpu.threads_per_core > 1 and cpu.physical_cores >= local:
        return max(1, cpu.physical_cores // local), (
            f"{cpu.physical_cores} physical cores ({cpu.cpus} CPUs, {cpu.threads_per_core} SMT threads a core) / "
            f"{local} local rank(s)"
        )
    return max(1, cpu.cpus // local), f"{cpu.cpus} cores / {local} local rank(s)"
