"""``search`` in ``conf/plan.yaml``: what the planner enumerates."""

from __future__ import annotations

from dataclasses import dataclass, field

from ultrascale.config.fields import num


@dataclass
class SearchConfig:
    """What the planner enumerates. Every combination is validated with the same rules as ``train.py``."""

    enabled: bool = True
    """False: evaluate only the layout given by the parallel/zero/data/train groups (explain one config)."""
    zero_stages: list[int] = num(default_factory=lambda: [0, 1, 2, 3], ge=0, le=3)
    """ZeRO stages to try."""
    offload: bool = True
    """Also try optimizer (stage>=1) and parameter (stage 3) offload to the host."""
    recompute: list[str] = field(default_factory=lambda: ["none", "selective", "full"])
    """Activation checkpointing modes to try (``train.activation_checkpointing``: none, selective, full;
    true/false mean full/none). Selective is tried only where it can run (the rule ``train.py``'s decisions use)."""
    micro_batches: list[int] = num(default_factory=lambda: [1, 2, 4, 8], ge=1)
    """Micro-batch sizes to try; each must divide global_batch / dp."""
    tp: list[int] = num(default_factory=lambda: [1, 2, 4, 8], ge=1)
    """Tensor-parallel degrees to try (capped at gpus_per_node)."""
    pp: list[int] = num(default_factory=lambda: [1, 2, 4, 8], ge=1)
    """Pipeline degrees to try."""
    sp: list[int] = num(default_factory=lambda: [1, 2, 4, 8], ge=1)
    """Ulysses sequence-parallel degrees to try."""
    ep: list[int] = num(default_factory=lambda: [1, 2, 4, 8], ge=1)
    """Expert-parallel degrees to try (MoE models only)."""
    fragmentation: float = num(0.10, ge=0)
    """Headroom, as a fraction of the allocated peak, for allocator fragmentation."""
    overlap: float = num(0.8, ge=0, le=1)
    """Fraction of overlappable communication (DP/ZeRO buckets, prefetch) hidden behind compute."""
    recompute_overhead: float = num(1.0, ge=0)
    """Extra forward passes per step with activation checkpointing (1.0 = one full recompute)."""
