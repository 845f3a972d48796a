"""``conf/zero/``: DeepSpeed's ``zero_optimization`` knobs."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from ultrascale.config.fields import num


class Offload(StrEnum):
    none = "none"
    cpu = "cpu"


@dataclass
class ZeroConfig:
    """DeepSpeed ``zero_optimization`` knobs, named exactly as DeepSpeed names them."""

    stage: int = num(1, ge=0, le=3)
    """0 = plain DDP-style data parallel; 1 shards optimizer state; 2 also gradients; 3 also weights.
    Rule of thumb: the lowest stage that fits is the fastest."""
    offload_optimizer: Offload = Offload.none
    """``none`` or ``cpu``: optimizer state and step on the host (ZeRO-Offload). Needs stage >= 1."""
    offload_param: Offload = Offload.none
    """``none`` or ``cpu``: parameters on the host between uses (ZeRO-Infinity style). Needs stage 3."""
    pin_memory: bool = False
    """Pinned host buffers speed up offload transfers on GPU; useless (and slow to allocate) on CPU."""
    overlap_comm: bool = True
    """Overlap gradient reduction with backward compute. Costs extra bucket memory (~4.5x reduce_bucket_size)."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced: less fragmentation at peak."""
    reduce_scatter: bool = True
    """Use reduce-scatter instead of all-reduce for gradient averaging (stage >= 2)."""
    reduce_bucket_size: int = num(50_000_000, ge=1)
    """Elements per gradient reduction bucket. Larger = fewer, bigger collectives; more memory."""
    allgather_bucket_size: int = num(50_000_000, ge=1)
    """Elements per all-gather bucket after the optimizer step (stage 1/2)."""
    round_robin_gradients: bool = False
    """Stage 1/2 with CPU offload: parallelise gradient copies to host across ranks."""
    stage3_prefetch_bucket_size: int = num(50_000_000, ge=0)
    """Stage 3: elements of upcoming parameters to prefetch (all-gather ahead of use)."""
    stage3_param_persistence_threshold: int = num(100_000, ge=0)
    """Stage 3: parameters smaller than this stay resident (not partitioned): saves many tiny gathers."""
    stage3_max_live_parameters: int = num(1_000_000_000, ge=1)
    """Stage 3: upper bound on gathered parameters alive at once; lower it if memory spikes."""
    stage3_max_reuse_distance: int = num(1_000_000_000, ge=0)
    """Stage 3: keep a gathered parameter if it is reused within this many parameters."""
    stage3_gather_16bit_weights_on_model_save: bool = False
    """Stage 3: also write a consolidated 16-bit state dict on save (costs a full gather)."""
    zero_hpz_partition_size: int = num(1, ge=1)
    """ZeRO++ hierarchical partitioning: secondary weight copy within groups of this many ranks (1 = off)."""
    zero_quantized_weights: bool = False
    """ZeRO++ qwZ: int8 weight all-gather. Needs CUDA kernels."""
    zero_quantized_gradients: bool = False
    """ZeRO++ qgZ: int4 gradient reduce-scatter. Needs CUDA kernels."""
