"""``conf/parallel/``: tensor, pipeline, sequence and expert parallel degrees."""

from __future__ import annotations

from dataclasses import dataclass, field

from ultrascale.config.fields import num


@dataclass
class PipelineConfig:
    micro_batches: int | None = num(None, ge=1)
    """Micro-batches per pipeline step; defaults to gradient accumulation steps. More = smaller bubble
    (p-1)/(m+p-1)."""
    partition_method: str = "parameters"
    """``parameters`` (balance parameter counts), ``uniform`` (balance layer counts), or ``type:<regex>``."""
    activation_checkpoint_interval: int = num(0, ge=0)
    """Checkpoint every N layers inside each stage (0 = off)."""


@dataclass
class MoEConfig:
    num_experts: int = num(8, ge=1)
    """Experts per MoE layer (HF MoE models read it from their own config; this is for the DeepSpeed MoE swap)."""
    top_k: int = num(2, ge=1)
    """Experts each token is routed to."""
    capacity_factor: float = num(1.25, gt=0)
    """Expert capacity = capacity_factor * tokens * top_k / num_experts; overflow tokens are dropped."""
    aux_loss_coef: float = num(0.01, ge=0)
    """Weight of the router load-balancing loss added to the LM loss."""
    drop_tokens: bool = True
    """Drop tokens over capacity (fixed shapes, faster) instead of padding capacity to the max load."""


@dataclass
class ParallelConfig:
    tp: int = num(1, ge=1)
    """Tensor-parallel degree (DeepSpeed AutoTP). Keep it inside a node: it all-reduces twice per layer."""
    pp: int = num(1, ge=1)
    """Pipeline-parallel stages. Needs zero.stage <= 1."""
    sp: int = num(1, ge=1)
    """Sequence-parallel degree (Ulysses all-to-all). Must divide the attention head count."""
    ep: int = num(1, ge=1)
    """Expert-parallel degree for MoE models. Must divide dp and the expert count."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
