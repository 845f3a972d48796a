"""Enumerate layouts for a world size and global batch, reject the invalid and the too-big with a reason,
and rank the rest by predicted tokens/s.

Validity is decided by :func:`ultrascale.levers.rules.validate`, the same function ``train.py`` runs,
so every layout the planner proposes is one the trainer accepts; the override line it prints composes.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from ultrascale.cost.layout import layout_from_cfg
from ultrascale.cost.memory import GIB, Layout, Memory, checkpoint_staging_bytes, construction_bytes, memory
from ultrascale.cost.timing import Timing, step_time
from ultrascale.errors import ConfigError
from ultrascale.levers.decide import Decisions
from ultrascale.levers.rules import validate
from ultrascale.model.arch import Arch, arch_from_cfg

if TYPE_CHECKING:
    from ultrascale.config.cluster import ClusterConfig
    from ultrascale.config.root import PlanRootConfig, RootConfig
    from ultrascale.config.search import SearchConfig


@dataclass
class Candidate:
    """One evaluated layout: its knobs, and either predictions or the reason it was dropped."""

    layout: Layout
    memory: Memory | None = None
    timing: Timing | None = None
    rejected: str | None = None
    overrides: list[str] = field(default_factory=list)
    build_host: float = 0.0
    """Host bytes per rank while the model is built or loaded (:func:`ultrascale.cost.memory.construction_bytes`)."""

    @property
    def fits(self) -> bool:
        return self.rejected is None

    def as_dict(self) -> dict[str, Any]:
        return {
            "layout": {**self.layout.__dict__, "dp": self.layout.dp, "grad_accum": self.layout.grad_accum},
            "memory_bytes": self.memory.as_dict() if self.memory else None,
            "timing": self.timing.as_dict() if self.timing else None,
            "rejected": self.rejected,
            "overrides": " ".join(self.overrides),
            "build_host_bytes": self.build_host,
        }


def world_size(cluster: ClusterConfig) -> int:
    return int(cluster.gpus_per_node * cluster.nodes)


def decided(lay: Layout, d: Decisions) -> Layout:
    """``lay`` as the run's decision record settles it: the ZeRO stage, the fused loss and activation checkpointing
    come from :class:`~ultrascale.levers.decide.Decisions`, the one place their rules live."""
    return replace(lay, zero_stage=d.zero_stage, fused_loss=d.fused_loss.on, loss_chunk_tokens=d.fused_loss.value or 0,
                   activation_checkpointing=d.activation_checkpointing.value)  # fmt: skip


def layout_overrides(lay: Layout) -> list[str]:
    """Hydra overrides that make ``train.py`` run this layout."""
    out = [
        f"parallel.tp={lay.tp}",
        f"parallel.pp={lay.pp}",
        f"parallel.sp={lay.sp}",
        f"parallel.ep={lay.ep}",
        f"zero=stage{lay.zero_stage}",
    ]
    if lay.offload_optimizer:
        out.append("zero.offload_optimizer=cpu")
    if lay.offload_param:
        out.append("zero.offload_param=cpu")
    out += [
        f"data.micro_batch={lay.micro_batch}",
        f"data.global_batch={lay.global_batch}",
        f"data.seq_len={lay.seq_len}",
        f"train.activation_checkpointing={lay.activation_checkpointing}",
    ]
    return out


def _apply(cfg: RootConfig, lay: Layout) -> RootConfig:
    """Write a layout's knobs into ``cfg`` (a scratch copy: every knob is set, so it can be reused)."""
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.sp, cfg.parallel.ep = lay.tp, lay.pp, lay.sp, lay.ep
    cfg.zero.stage = lay.zero_stage
    cfg.zero.offload_optimizer = "cpu" if lay.offload_optimizer else "none"
    cfg.zero.offload_param = "cpu" if lay.offload_param else "none"
    cfg.data.micro_batch = lay.micro_batch
    cfg.train.activation_checkpointing = lay.activation_checkpointing
    return cfg


def evaluate(
    cfg: PlanRootConfig,
    arch: Arch,
    lay: Layout,
    scratch: PlanRootConfig | None = None,
    cluster: ClusterConfig | None = None,
    search: SearchConfig | None = None,
) -> Candidate:
    """Validate one layout with the trainer's rules, then predict its memory and time and check the fit.

    ``scratch`` (a reusable copy of ``cfg`` to write the layout into) and plain ``cluster``/``search``
    dataclasses are optional speed-ups for the search loop: deep copies and DictConfig access dominate it."""
    cand = Candidate(layout=lay, overrides=layout_overrides(lay))
    try:
        d = validate(_apply(scratch if scratch is not None else copy.deepcopy(cfg), lay), lay.world, backend="nccl")
    except ConfigError as e:
        cand.rejected = f"invalid: {e}"
        return cand
    cand.layout = lay = decided(lay, d)
    c, s = cluster or plain_node(cfg.cluster), search or plain_node(cfg.search)
    cand.memory = memory(arch, lay, fragmentation=s.fragmentation, reserved=c.reserved_gib * GIB)
    cand.build_host = construction_bytes(arch, lay)
    cand.timing = step_time(arch, lay, c, overlap=s.overlap, recompute_overhead=s.recompute_overhead)
    limit = c.gpu_memory_gib * GIB
    if cand.memory.total > limit:
        cand.rejected = f"does not fit: needs {cand.memory.total / GIB:.1f} GiB per rank > {c.gpu_memory_gib:g} GiB"
    staging = checkpoint_staging_bytes(arch, lay) if cfg.train.checkpoint_async else 0.0
    host = (cand.memory.host + staging) * c.gpus_per_node
    if cand.rejected is None and host > c.host_memory_gib * GIB:
        what = "offload and the checkpoint writer's copy" if cand.memory.host and staging else \
            "offload" if cand.memory.host else "the checkpoint writer's copy"  # fmt: skip
        cand.rejected = (f"{what} does not fit: needs {host / GIB:.0f} GiB host memory per node > "
                         f"{c.host_memory_gib:g} GiB" + (" (train.checkpoint_async=false needs no copy)"
                                                         if staging else ""))  # fmt: skip
    return cand


def plain_node(node: Any) -> Any:
    """The dataclass behind a config node (attribute access on DictConfig costs ~10 us per key)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_object(node) if isinstance(node, DictConfig) else node


def _zero_modes(stages: list[int], offload: bool) -> list[tuple[int, bool, bool]]:
    modes = []
    for st in stages:
        modes.append((st, False, False))
        if offload and st >= 1:
            modes.append((st, True, False))
        if offload and st == 3:
            modes.append((st, True, True))
    return modes


def enumerate_layouts(cfg: PlanRootConfig, arch: Arch) -> list[Layout]:
    """Every combination the search group allows (before validation), for the cluster's world size."""
    world, s = world_size(cfg.cluster), cfg.search
    base = layout_from_cfg(cfg, world)
    eps = list(s.ep) if arch.experts else [1]
    out = []
    for tp, pp, sp, ep in itertools.product(s.tp, s.pp, s.sp, eps):
        if tp > cfg.cluster.gpus_per_node or world % (tp * pp * sp):
            continue  # TP stays inside a node; the degrees must tile the world
        for (st, off_opt, off_par), ckpt, mb in itertools.product(
            _zero_modes(list(s.zero_stages), s.offload), s.recompute, s.micro_batches
        ):
            out.append(
                Layout(
                    **{
                        **base.__dict__,
                        "tp": tp,
                        "pp": pp,
                        "sp": sp,
                        "ep": ep,
                        "zero_stage": st,
                        "offload_optimizer": off_opt,
                        "offload_param": off_par,
                        "activation_checkpointing": ckpt,
                        "micro_batch": mb,
                    }
                )
            )
    return out


def rank(cands: list[Candidate]) -> list[Candidate]:
    """Fitting layouts fastest first (ties: the lower ZeRO stage, then less memory); then the rejected."""
    ok = sorted(
        (c for c in cands if c.fits),
        key=lambda c: (-round(c.timing.tokens_per_s, 6), c.layout.zero_stage, c.memory.total),
    )
    return ok + [c for c in cands if not c.fits]


def plan(cfg: PlanRootConfig) -> list[Candidate]:
    """Search (or, with ``search.enabled=false``, evaluate the one configured layout) and rank."""
    arch = arch_from_cfg(cfg.model)
    world = world_size(cfg.cluster)
    layouts = enumerate_layouts(cfg, arch) if cfg.search.enabled else [layout_from_cfg(cfg, world)]
    scratch, cluster, search = copy.deepcopy(cfg), plain_node(cfg.cluster), plain_node(cfg.search)
    return rank([evaluate(cfg, arch, lay, scratch, cluster, search) for lay in layouts])
