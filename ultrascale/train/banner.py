"""What was built, in words: the rank-0 start-up banner and the dry-run report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ultrascale.config.decide import Decisions
from ultrascale.config.topology import Topology


def _batch_line(cfg: Any, topo: Topology) -> str:
    mb, gb, s = cfg.data.micro_batch, cfg.data.global_batch, cfg.data.seq_len
    gas = topo.grad_accum(mb, gb)
    return f"micro {mb} x grad-accum {gas} x dp {topo.dp} = global {gb} samples x {s} tokens = {gb * s:,} tokens/step"


def _zero_line(cfg: Any, d: Decisions) -> str:
    z = cfg.zero
    extras = []
    if z.offload_optimizer != "none":
        extras.append(f"optimizer offload={z.offload_optimizer}")
    if z.offload_param != "none":
        extras.append(f"param offload={z.offload_param}")
    if d.zero_stage >= 1 and z.overlap_comm:
        extras.append("overlap_comm")
    return f"ZeRO-{d.zero_stage}" + (f" ({', '.join(extras)})" if extras else "")


def _stability_line(cfg: Any) -> str:
    st = cfg.stability
    spike = "off" if st.spike == "none" else f"{st.spike} at z>{st.spike_zscore:g} (window {st.spike_window})"
    return f"non-finite -> {st.nonfinite}, spike -> {spike}, stop after {st.max_consecutive} bad steps in a row"


def banner(cfg: Any, d: Decisions, ds_config: dict, info, peak_src: str, out: Path) -> str:
    """What was built, on rank 0: the layout and every decision with its reason (this module only prints)."""
    from ultrascale.dist import select_accelerator

    backend = select_accelerator()
    lines = [
        "ultrascale run",
        f"  model      {cfg.model.type} '{cfg.model.name}': {info.n_params / 1e6:,.2f}M params, "
        f"attn={cfg.model.attn_implementation}, act-ckpt={'on' if cfg.train.activation_checkpointing else 'off'}",
        f"  layout     {d.topo.describe()}  |  {_zero_line(cfg, d)}  |  precision {cfg.precision.dtype}",
        f"  batch      {_batch_line(cfg, d.topo)}",
        f"  optimizer  {d.optimizer_owner.why}, lr {cfg.optim.lr:g}, schedule {cfg.optim.sched.name} "
        f"(warmup {cfg.optim.sched.warmup_steps}), clip {cfg.optim.grad_clip}",
        f"  device     {'cpu' if backend == 'gloo' else 'cuda'} / {backend}; MFU peak from {peak_src}",
        f"  packing    document masking {d.document_masking.why}",
        f"  stability  {_stability_line(cfg)}",
        f"  timing     step breakdown {d.step_breakdown.why}",
        f"  loss       {d.fused_loss.why}",
        f"  attention  {d.attention.why}",
        f"  compile    {d.compile.why}",
        f"  output     {out}  (config.yaml, ds_config.json, metrics.jsonl, checkpoints/, logs/)",
    ]
    for k, v in info.extras.items():
        lines.append(f"  {k:<10} {v}")
    if cfg.launcher.env:
        lines.append(f"  env        {' '.join(f'{k}={v}' for k, v in cfg.launcher.env.items())}")
    return "\n".join(lines)


def _host_memory_line(cfg: Any, d: Decisions) -> str:
    """The planner's host-memory figures for this layout: what building the model costs beside the steady state."""
    from ultrascale.model.arch import arch_from_hf
    from ultrascale.plan.memory import GIB, construction_bytes, host_step_bytes
    from ultrascale.plan.search import layout_from_cfg

    arch, lay = arch_from_hf(d.hf_config), layout_from_cfg(cfg, d.topo.world)
    build = construction_bytes(arch, lay) / GIB
    how = ("partitioned from the first byte (ZeRO-3)" if d.zero3_init.on else
           "this stage's layers only" if d.pipeline else
           "the whole model: DeepSpeed 0.19.8's AutoTP shards it inside initialize(); measured 1.95 GiB per rank "
           "for a 0.51B model at tp=2, make bench-scale" if d.topo.tp > 1 else
           "the whole model")  # fmt: skip
    return (f"construction peak ~{build:.2f} GiB ({how}); model states between steps on a CPU rank "
            f"~{host_step_bytes(arch, lay) / GIB:.2f} GiB")  # fmt: skip


def dry_run_report(cfg: DictConfig, d: Decisions, ds_config: dict, found: dict[str, str]) -> str:
    """Everything needed to sanity-check a run before booking GPUs, computed without building weights."""
    from ultrascale.model.build import count_params
    from ultrascale.model.flops import train_flops_per_token

    counts = count_params(cfg.model)
    tokens = cfg.data.global_batch * cfg.data.seq_len
    flops = train_flops_per_token(d.hf_config, cfg.data.seq_len) * tokens
    parts = [
        "== resolved config ==",
        OmegaConf.to_yaml(cfg, resolve=True),
        "== topology ==",
        d.topo.describe(),
        "== parameters ==",
        f"total {counts['total']:,}  (embedding {counts['embedding']:,}, non-embedding {counts['non_embedding']:,})",
        "== batch ==",
        _batch_line(cfg, d.topo),
        f"model FLOPs per step {flops:.3e}  ({flops / tokens:.3e} per token)",
        "== host memory per rank (planner, fp32 build) ==",
        _host_memory_line(cfg, d),
        "== decisions ==",
        f"{'zero':<10} {_zero_line(cfg, d)}",
        *(f"{k:<10} {'on ' if c.on else 'off'} {c.why}" for k, c in d.features().items()),
        "== checked before start ==",
        *(f"{k:<10} {v}" for k, v in found.items()),
        "== DeepSpeed JSON ==",
        json.dumps(ds_config, indent=2),
    ]
    return "\n".join(parts)
