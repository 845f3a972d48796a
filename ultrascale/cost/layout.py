"""The layout a composed config describes (what ``train.py`` would run), as the planner's :class:`Layout`.

Apart from the search because the rules (``levers/decide.py``) size ``activation_checkpointing=auto`` with the
planner's memory model for this layout, and the search itself is built on the rules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ultrascale.config.recompute import checkpointing_mode
from ultrascale.cost.memory import Layout
from ultrascale.model.adapters import planned_trainable

if TYPE_CHECKING:
    from ultrascale.config.root import RootConfig


def layout_from_cfg(cfg: RootConfig, world: int) -> Layout:
    """The layout a composed config describes (what ``train.py`` would run)."""
    z, p = cfg.zero, cfg.parallel
    return Layout(
        world=world,
        tp=p.tp,
        pp=p.pp,
        sp=p.sp,
        ep=p.ep,
        zero_stage=int(z.stage),
        offload_optimizer=z.offload_optimizer != "none",
        offload_param=z.offload_param != "none",
        activation_checkpointing=_mode(cfg.train.activation_checkpointing),
        micro_batch=cfg.data.micro_batch,
        global_batch=cfg.data.global_batch,
        seq_len=cfg.data.seq_len,
        dtype=cfg.precision.dtype,
        attn=cfg.model.attn_implementation,
        overlap_comm=bool(z.overlap_comm),
        reduce_bucket_size=int(z.reduce_bucket_size),
        allgather_bucket_size=int(z.allgather_bucket_size),
        prefetch_bucket_size=int(z.stage3_prefetch_bucket_size),
        persistence_threshold=int(z.stage3_param_persistence_threshold),
        trainable_params=planned_trainable(cfg.model, cfg.finetune),
    )


def _mode(value: Any) -> str:
    """A config's checkpointing as a layout holds it: ``auto`` counts as none until :func:`decided` settles it."""
    mode = checkpointing_mode(value)
    return "none" if mode == "auto" else mode
