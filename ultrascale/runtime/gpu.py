"""What this GPU is: its name, memory, compute capability and SMs, read once from torch, and which datasheet
card that is.

The GPU levers (the fused loss's chunk, activation recompute, the attention kernel) are decided from a
:class:`GpuInfo` by pure functions in ``ultrascale/levers/``, and MFU divides by the card's datasheet peak for the
run's dtype (``ultrascale/runtime/peak.py``), so a rule measured on one card is not carried to the next as a
constant. A name alone does not tell cards apart: "H100" is a 989 TFLOP/s SXM5 part, a 756 TFLOP/s PCIe part or
an 835 TFLOP/s NVL part, and torch names the SXM5 one "NVIDIA H100 80GB HBM3": :func:`identify` says "unknown"
rather than guess. A planned run (the dry run for ``cluster=...``) builds the same record without a GPU
(:meth:`GpuInfo.from_cluster`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

GIB = 2**30


@dataclass(frozen=True)
class Card:
    """One datasheet row: what identifies the card and its dense (no 2:4 sparsity) peaks per dtype."""

    name: str
    """Canonical name, e.g. ``H100 SXM5 80GB``."""
    family: str
    """Cards that share a name stem (``H100``): the SM count and memory tell them apart when the name does not."""
    pattern: str
    """Regex over the upper-cased torch device name."""
    memory_gib: float
    capability: tuple[int, int]
    sms: int
    tflops: dict[str, float | None] = field(default_factory=dict)
    """Dense peak TFLOP/s by dtype (``bf16``, ``fp16``, ``tf32``, ``fp32``); None: no tensor-core path for it."""
    source: str = ""
    hbm_tbps: float | None = None
    """Datasheet memory bandwidth (TB/s): what a decode step's weight and KV-cache reads run against
    (:mod:`ultrascale.cost.decode`); None where the table has no figure."""


def _peaks(bf16: float | None, fp16: float | None, tf32: float | None, fp32: float) -> dict[str, float | None]:
    return {"bf16": bf16, "fp16": fp16, "tf32": tf32, "fp32": fp32}


_H100 = "NVIDIA H100 Tensor Core GPU datasheet and the Hopper architecture whitepaper (dense = half the starred sparse)"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet (dense = half the starred sparse figure)"
_A100 = "NVIDIA A100 Tensor Core GPU datasheet (SXM4 and PCIe list the same peaks)"
_ADA = "NVIDIA Ada Lovelace architecture whitepaper, appendix A (16-bit tensor ops with FP32 accumulate)"
_GA102 = "NVIDIA Ampere GA102 architecture whitepaper (16-bit tensor ops with FP32 accumulate)"
# fmt: off
CARDS: tuple[Card, ...] = (
    Card("H100 NVL 94GB", "H100", r"\bH100\b.*\bNVL\b", 94, (9, 0), 132, _peaks(835.5, 835.5, 417.5, 60.0), _H100, hbm_tbps=3.9),
    Card("H100 PCIe 80GB", "H100", r"\bH100\b.*\bPCIE\b", 80, (9, 0), 114, _peaks(756.5, 756.5, 378.0, 51.2), _H100, hbm_tbps=2.0),
    Card("H100 SXM5 80GB", "H100", r"\bH100\b.*\b(SXM|HBM3)\b", 80, (9, 0), 132,
         _peaks(989.4, 989.4, 494.7, 66.9), _H100, hbm_tbps=3.35),
    Card("H200 NVL 141GB", "H200", r"\bH200\b.*\bNVL\b", 141, (9, 0), 132, _peaks(835.5, 835.5, 417.5, 60.0), _H200, hbm_tbps=4.8),
    Card("H200 SXM 141GB", "H200", r"\bH200\b(?!.*\b(NVL|PCIE)\b)", 141, (9, 0), 132,
         _peaks(989.5, 989.5, 494.5, 67.0), _H200, hbm_tbps=4.8),
    Card("GH200 96GB", "GH200", r"\bGH200\b", 96, (9, 0), 132, _peaks(989.4, 989.4, 494.7, 66.9),
         "NVIDIA GH200 Grace Hopper Superchip datasheet (its Hopper GPU has the H100 SXM5's peaks)", hbm_tbps=4.0),
    Card("A100 SXM4 80GB", "A100", r"\bA100\b.*\bSXM", 80, (8, 0), 108, _peaks(312, 312, 156, 19.5), _A100, hbm_tbps=2.039),
    Card("A100 SXM4 40GB", "A100", r"\bA100\b.*\bSXM", 40, (8, 0), 108, _peaks(312, 312, 156, 19.5), _A100, hbm_tbps=1.555),
    Card("A100 PCIe 80GB", "A100", r"\bA100\b.*\bPCIE\b", 80, (8, 0), 108, _peaks(312, 312, 156, 19.5), _A100, hbm_tbps=1.935),
    Card("A100 PCIe 40GB", "A100", r"\bA100\b.*\bPCIE\b", 40, (8, 0), 108, _peaks(312, 312, 156, 19.5), _A100, hbm_tbps=1.555),
    Card("L40S 48GB", "L40", r"\bL40S\b", 48, (8, 9), 142, _peaks(362.05, 362.05, 183.0, 91.6),
         "NVIDIA L40S datasheet (dense = half the starred sparse figure)", hbm_tbps=0.864),
    Card("L40 48GB", "L40", r"\bL40\b(?!S)", 48, (8, 9), 142, _peaks(181.05, 181.05, 90.5, 90.5),
         "NVIDIA L40 datasheet (dense = half the starred sparse figure)", hbm_tbps=0.864),
    Card("L4 24GB", "L4", r"\bL4\b", 24, (8, 9), 58, _peaks(121.0, 121.0, 60.0, 30.3),
         "NVIDIA L4 Tensor Core GPU datasheet (dense = half the starred sparse figure)", hbm_tbps=0.3),
    Card("A10 24GB", "A10", r"\bA10\b(?!G)", 24, (8, 6), 72, _peaks(125.0, 125.0, 62.5, 31.2),
         "NVIDIA A10 Tensor Core GPU datasheet (dense = half the starred sparse figure)", hbm_tbps=0.6),
    Card("RTX 4090 24GB", "RTX 4090", r"\bRTX 4090\b(?! D\b)", 24, (8, 9), 128, _peaks(165.2, 165.2, 82.6, 82.6), _ADA, hbm_tbps=1.008),
    Card("RTX 3090 24GB", "RTX 3090", r"\bRTX 3090\b(?! TI)", 24, (8, 6), 82, _peaks(71.0, 71.0, 35.6, 35.6), _GA102, hbm_tbps=0.936),
    Card("V100 SXM2", "V100", r"\bV100\b.*\bSXM2", 32, (7, 0), 80, _peaks(None, 125.0, None, 15.7),
         "NVIDIA Tesla V100 datasheet (no bf16 or tf32 tensor cores: Volta)", hbm_tbps=0.9),
    Card("V100 PCIe", "V100", r"\bV100\b.*\bPCIE\b", 32, (7, 0), 80, _peaks(None, 112.0, None, 14.0),
         "NVIDIA Tesla V100 datasheet (no bf16 or tf32 tensor cores: Volta)", hbm_tbps=0.9),
    Card("B200 180GB", "B200", r"\bB200\b", 180, (10, 0), 148, _peaks(2250.0, 2250.0, 1125.0, 75.0),
         "NVIDIA HGX B200 specifications, per GPU (dense = half the starred sparse figure)", hbm_tbps=8.0),
)
# fmt: on
"""Cards with a published datasheet. Absent on purpose: the A10G (AWS publishes no tensor-core rate for it) and
cards whose figure we could not source; an unknown card reports no MFU rather than a borrowed one."""
MEMORY_TOLERANCE = 0.1
"""A card's memory as torch reports it (GiB, less the driver's reserve) within 10 % of its nominal size."""


@dataclass(frozen=True)
class Identified:
    """The datasheet row a device is, how sure we are, and the share of it a MIG slice has."""

    card: Card | None
    why: str
    """In words: which evidence chose the row, or why none was chosen."""
    share: float = 1.0
    """Fraction of the card's SMs this device has (a MIG slice < 1)."""


def identify(name: str, memory_bytes: int = 0, sms: int = 0) -> Identified:
    """The datasheet card a torch device name (plus its memory and SM count, where known) describes: the name's
    pattern first; where it matches several rows, the SM count, then the memory; a MIG slice is its card scaled by
    its SMs. Rows left tied with different peaks are "ambiguous" (no card), never the first one."""
    up = name.upper()
    mig = re.search(r"\bMIG\b", up)
    if mig:
        whole = identify(name[: mig.start()].strip())
        if whole.card is None:
            return whole
        if not sms:
            return Identified(None, f"a MIG slice of {whole.card.name} with an unknown SM count")
        share = sms / whole.card.sms
        return Identified(whole.card, f"a MIG slice of {whole.card.name}: {sms} of its {whole.card.sms} SMs", share)
    hits = [c for c in CARDS if re.search(c.pattern, up)]
    if not hits:  # a bare family name ("NVIDIA H100", "NVIDIA A100"): every row of it, for the SMs and memory
        hits = [c for c in CARDS if re.search(rf"\b{re.escape(c.family)}\b", up)]
    if not hits:
        return Identified(None, f"{name!r} is not in ultrascale.runtime.gpu.CARDS (no datasheet peak)")
    evidence = ["name"]
    if sms:
        same = [c for c in hits if c.sms == sms]
        families = {c.family for c in hits}
        if not same:  # the name's row is not this silicon: a sibling the name does not spell out ("NVIDIA H100")
            same = [c for c in CARDS if c.family in families and c.sms == sms]
        if not same:  # a cut-down part the name does not spell out (an "RTX 4090 D" has 114 SMs, not 128)
            return Identified(None, f"{name!r} has {sms} SMs, which no row of {', '.join(sorted(families))} has")
        if [c.name for c in same] != [c.name for c in hits]:
            evidence.append(f"{sms} SMs")
        hits = same
    if memory_bytes and len(hits) > 1:
        gib = memory_bytes / GIB
        near = [c for c in hits if abs(gib - c.memory_gib) <= MEMORY_TOLERANCE * c.memory_gib]
        if near and len(near) < len(hits):
            evidence.append(f"{gib:.0f} GiB")
        hits = near or hits
    if len({tuple(sorted((k, v or 0.0) for k, v in c.tflops.items())) for c in hits}) > 1:
        return Identified(None, f"{name!r} could be {' or '.join(c.name for c in hits)}, whose peaks differ: "
                                "torch's name, SM count and memory do not tell them apart")  # fmt: skip
    card = hits[0]
    tied = f" (or {', '.join(c.name for c in hits[1:])}: the same peaks)" if len(hits) > 1 else ""
    return Identified(card, f"{card.name}{tied} by its {' and '.join(evidence)}")


@dataclass(frozen=True)
class GpuInfo:
    """One GPU of this node (all a node's GPUs are assumed alike; ``count`` says how many it has)."""

    name: str
    """As torch names it, e.g. ``NVIDIA H100 80GB HBM3``."""
    memory_bytes: int
    """Total device memory torch reports (less the driver's reserve, so an 80 GB card shows ~79.2 GiB)."""
    capability: tuple[int, int]
    """CUDA compute capability (major, minor): 9.0 Hopper, 8.9 Ada, 8.0 A100, 8.6 GA102."""
    count: int = 1
    """GPUs visible on this node."""
    free_bytes: int | None = None
    """Free device memory when read (``torch.cuda.mem_get_info``), None where unknown (a planned cluster before
    its reserve is known)."""
    sm_count: int = 0
    """Streaming multiprocessors (0: unknown); tells H100 SXM5 (132) from PCIe (114) and sizes a MIG slice."""
    index: int | None = None
    """The CUDA device this was read from on this machine (:func:`detect`); None for a planned cluster's GPU. What
    is tried on the device itself (liger-kernel's trial row) runs there, and only where it is set."""

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB

    @property
    def available_bytes(self) -> int:
        """What a run may plan to use: free memory where known, else the total."""
        return self.memory_bytes if self.free_bytes is None else self.free_bytes

    @property
    def bf16(self) -> bool:
        """bf16 tensor cores (Ampere and later)."""
        return self.capability >= (8, 0)

    def identified(self) -> Identified:
        return identify(self.name, self.memory_bytes, self.sm_count)

    def describe(self) -> str:
        """One line for the banner: name, datasheet card, memory, capability."""
        ident = self.identified()
        card = ident.card.name if ident.card else "unknown card"
        free = f", {self.free_bytes / GIB:.1f} GiB free" if self.free_bytes is not None else ""
        sms = f", {self.sm_count} SMs" if self.sm_count else ""
        many = f" x{self.count}" if self.count > 1 else ""
        cap = f"sm_{self.capability[0]}{self.capability[1]}"
        return f"{self.name}{many} ({card}; {self.memory_gib:.1f} GiB{free}; {cap}{sms})"

    @classmethod
    def from_cluster(cls, cluster: Any, card: str) -> GpuInfo:
        """The GPU a planned cluster (a ``conf/cluster/*.yaml`` node: ``gpu_memory_gib``, ``reserved_gib``,
        ``gpus_per_node``) has, as one of :data:`CARDS` named by ``card`` (its canonical name, or a torch-style
        name such as ``NVIDIA H100 80GB HBM3``): capability and SMs from the datasheet, memory from the cluster.
        ``free_bytes`` is the memory less the runtime's reserve, as the planner counts it. Raises ValueError
        naming the known cards for a card not in the table."""
        mem = int(float(cluster.gpu_memory_gib) * GIB)
        row = next((c for c in CARDS if c.name.lower() == card.strip().lower()), None)
        if row is None:
            row = identify(card, mem).card
        if row is None:
            raise ValueError(f"unknown GPU card {card!r}: use one of {', '.join(c.name for c in CARDS)}")
        reserve = int(float(getattr(cluster, "reserved_gib", 0.0) or 0.0) * GIB)
        return cls(name=f"NVIDIA {row.name}", memory_bytes=mem, capability=row.capability,
                   count=int(getattr(cluster, "gpus_per_node", 1) or 1), free_bytes=max(0, mem - reserve),
                   sm_count=row.sms)  # fmt: skip


def detect(device: int | None = None) -> GpuInfo | None:
    """This process's GPU (``torch.cuda.current_device()`` unless ``device``), or None without CUDA. Not cached:
    free memory changes as a run allocates, and the decisions read it once at start. Before ``set_device`` the
    current device is GPU 0 on every rank: a rank's validation passes its ``LOCAL_RANK``."""
    import torch

    if not torch.cuda.is_available():
        return None
    idx = torch.cuda.current_device() if device is None else device
    p = torch.cuda.get_device_properties(idx)
    try:
        free, _total = torch.cuda.mem_get_info(idx)
    except RuntimeError:  # a device another process holds exclusively
        free = None
    return GpuInfo(name=str(p.name), memory_bytes=int(p.total_memory), capability=(int(p.major), int(p.minor)),
                   count=torch.cuda.device_count(), free_bytes=None if free is None else int(free),
                   sm_count=int(getattr(p, "multi_processor_count", 0)), index=int(idx))  # fmt: skip


def describe(gpu: GpuInfo | None = None) -> str:
    """``gpu`` (default: this machine's) in one line, or a line saying there is no CUDA device."""
    gpu = gpu if gpu is not None else detect()
    return gpu.describe() if gpu is not None else "no CUDA device"
