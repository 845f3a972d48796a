"""What was built, in words: the rank-0 start-up banner and the dry-run report."""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ultrascale.config.topology import Topology


def _batch_line(cfg: DictConfig, topo: Topology) -> str:
    mb, gb, s = cfg.data.micro_batch, cfg.data.global_batch, cfg.data.seq_len
    gas = topo.grad_accum(mb, gb)
    return f"micro {mb} x grad-accum {gas} x dp {topo.dp} = global {gb} samples x {s} tokens = {gb * s:,} tokens/step"


def _zero_line(cfg: DictConfig) -> str:
    z = cfg.zero
    extras = []
    if z.offload_optimizer != "none":
        extras.append(f"optimizer offload={z.offload_optimizer}")
    if z.offload_param != "none":
        extras.append(f"param offload={z.offload_param}")
    if z.stage >= 1 and z.overlap_comm:
        extras.append("overlap_comm")
    return f"ZeRO-{z.stage}" + (f" ({', '.join(extras)})" if extras else "")


def document_masking(cfg: DictConfig, topo: Topology) -> tuple[bool, str]:
    """(on?, what it does here): Ulysses discards 4-D masks, so with sp>1 only flash attention keeps documents apart."""
    if not cfg.data.document_masking:
        return False, "off: packed rows are one text (data.document_masking=false)"
    attn = str(cfg.model.attn_implementation)
    if topo.sp > 1 and not attn.startswith("flash"):
        return False, f"off: Ulysses sp={topo.sp} drops {attn} masks (use flash_attention_2 for it)"
    how = "varlen kernel, micro-batch as one row" if attn.startswith("flash") else f"{attn} block-diagonal mask"
    return True, f"on: positions restart at EOS, no cross-document attention ({how})"


def _stability_line(cfg: DictConfig) -> str:
    st = cfg.stability
    spike = "off" if st.spike == "none" else f"{st.spike} at z>{st.spike_zscore:g} (window {st.spike_window})"
    return f"non-finite -> {st.nonfinite}, spike -> {spike}, stop after {st.max_consecutive} bad steps in a row"


def banner(
    cfg: DictConfig, topo: Topology, ds_config: dict, info, tokens_per_step: int, peak_src: str, out: Path
) -> str:
    from ultrascale.dist import select_accelerator

    backend = select_accelerator()
    lines = [
        "ultrascale run",
        f"  model      {cfg.model.type} '{cfg.model.name}': {info.n_params / 1e6:,.2f}M params, "
        f"attn={cfg.model.attn_implementation}, act-ckpt={'on' if cfg.train.activation_checkpointing else 'off'}",
        f"  layout     {topo.describe()}  |  {_zero_line(cfg)}  |  precision {cfg.precision.dtype}",
        f"  batch      {_batch_line(cfg, topo)}",
        f"  optimizer  {info.optimizer}, lr {cfg.optim.lr:g}, schedule {cfg.optim.sched.name} "
        f"(warmup {cfg.optim.sched.warmup_steps}), clip {cfg.optim.grad_clip}",
        f"  device     {'cpu' if backend == 'gloo' else 'cuda'} / {backend}; MFU peak from {peak_src}",
        f"  packing    document masking {document_masking(cfg, topo)[1]}",
        f"  stability  {_stability_line(cfg)}",
        f"  timing     step breakdown {'on (DeepSpeed engine timers)' if cfg.train.step_breakdown else 'off'}",
        f"  output     {out}  (config.yaml, ds_config.json, metrics.jsonl, checkpoints/, logs/)",
    ]
    for k, v in info.extras.items():
        lines.append(f"  {k:<10} {v}")
    if cfg.launcher.env:
        lines.append(f"  env        {' '.join(f'{k}={v}' for k, v in cfg.launcher.env.items())}")
    return "\n".join(lines)


def dry_run_report(cfg: DictConfig, topo: Topology, ds_config: dict, found: dict[str, str]) -> str:
    """Everything needed to sanity-check a run before booking GPUs, computed without building weights."""
    from ultrascale.model.build import build_hf_config, count_params
    from ultrascale.plan.flops import train_flops_per_token

    counts = count_params(cfg.model)
    hf = build_hf_config(cfg.model)
    tokens = cfg.data.global_batch * cfg.data.seq_len
    flops = train_flops_per_token(hf, cfg.data.seq_len) * tokens
    parts = [
        "== resolved config ==",
        OmegaConf.to_yaml(cfg, resolve=True),
        "== topology ==",
        topo.describe(),
        "== parameters ==",
        f"total {counts['total']:,}  (embedding {counts['embedding']:,}, non-embedding {counts['non_embedding']:,})",
        "== batch ==",
        _batch_line(cfg, topo),
        f"model FLOPs per step {flops:.3e}  ({flops / tokens:.3e} per token)",
        "== checked before start ==",
        *(f"{k:<10} {v}" for k, v in found.items()),
        "== DeepSpeed JSON ==",
        json.dumps(ds_config, indent=2),
    ]
    return "\n".join(parts)
