"""What was built and what came out, in words: the rank-0 start-up banner and the end-of-run lines (the dry run's
report, which adds the planner's figures, is :mod:`ultrascale.plan.dryrun`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ultrascale.config.topology import Topology
from ultrascale.levers.decide import Decisions
from ultrascale.levers.length import describe as run_length

if TYPE_CHECKING:
    from ultrascale.config.data import DataConfig
    from ultrascale.config.root import RootConfig
    from ultrascale.config.stability import StabilityConfig
    from ultrascale.config.zero import ZeroConfig


def batch_line(data: DataConfig, topo: Topology) -> str:
    mb, gb, s = data.micro_batch, data.global_batch, data.seq_len
    gas = topo.grad_accum(mb, gb)
    return f"micro {mb} x grad-accum {gas} x dp {topo.dp} = global {gb} samples x {s} tokens = {gb * s:,} tokens/step"


def zero_line(z: ZeroConfig, d: Decisions) -> str:
    extras = []
    if z.offload_optimizer != "none":
        extras.append(f"optimizer offload={z.offload_optimizer}")
    if z.offload_param != "none":
        extras.append(f"param offload={z.offload_param}")
    if d.zero_stage >= 1 and z.overlap_comm:
        extras.append("overlap_comm")
    return f"ZeRO-{d.zero_stage}" + (f" ({', '.join(extras)})" if extras else "")


def finetune_line(cfg: RootConfig, d: Decisions, trainable: int, total: int) -> str:
    """Trainable against total parameters, and the gradient and optimizer memory per rank that training only the
    adapters saves against a full fine-tune of the same layout (the planner's model-state terms,
    ``ultrascale/cost/memory.py``)."""
    from dataclasses import replace

    from ultrascale.cost.layout import layout_from_cfg
    from ultrascale.cost.memory import GIB, model_state_bytes
    from ultrascale.model.arch import arch_from_hf

    arch = arch_from_hf(d.hf_config)
    lay = replace(layout_from_cfg(cfg, d.topo.world), zero_stage=d.zero_stage, trainable_params=trainable)
    terms = ("grads", "optimizer", "step_transient")
    lora = sum(model_state_bytes(arch, lay)[k] for k in terms)
    full = sum(model_state_bytes(arch, replace(lay, trainable_params=None))[k] for k in terms)
    return (f"trainable {trainable / 1e6:,.2f}M of {total / 1e6:,.2f}M params ({trainable / total:.2%}); gradients "
            f"+ optimizer state {lora / GIB:.3f} GiB per rank against {full / GIB:.3f} GiB for a full fine-tune: "
            f"saves {(full - lora) / GIB:.3f} GiB per rank (planner, ZeRO-{d.zero_stage})")  # fmt: skip


def _stability_line(st: StabilityConfig) -> str:
    spike = "off" if st.spike == "none" else f"{st.spike} at z>{st.spike_zscore:g} (window {st.spike_window})"
    return f"non-finite -> {st.nonfinite}, spike -> {spike}, stop after {st.max_consecutive} bad steps in a row"


def deepspeed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("deepspeed")
    except PackageNotFoundError:
        return "?"


def grpo_line(cfg: RootConfig, d: Decisions) -> str:
    """What a GRPO step does: its rollouts, loss and rewards (the batch line counts its completions)."""
    g = cfg.grpo
    ref = (
        "no reference"
        if not g.beta
        else f"beta {g.beta:g} (reference: {'adapter off' if d.finetune.on else 'frozen copy'})"
    )
    gen = f"on {d.rollout_weights.why}"
    return (f"{g.prompts_per_step} prompts x {g.num_generations} generations a step ({g.prompts_per_step // d.topo.dp} "
            f"prompts per rank), <= {g.max_completion_length} tokens at temperature {g.temperature:g}, sampled {gen}; "
            f"loss {g.loss_type}, clip [{1 - g.epsilon:g}, {1 + g.clip_high:g}], {ref}; rewards {list(g.reward_funcs)} "
            f"(sandbox {g.reward_timeout_s:g}s); problems {cfg.problems.source}"
            + (f" {cfg.problems.split}" if str(cfg.problems.source) == "humaneval" else ""))  # fmt: skip


def banner(cfg: RootConfig, d: Decisions, ds_config: dict, info, peak_src: str, out: Path) -> str:
    """What was built, on rank 0: the layout and every decision with its reason (this module only prints)."""
    from ultrascale.runtime.cpu import detect
    from ultrascale.runtime.device import runtime
    from ultrascale.runtime.dist import select_accelerator, threads_note

    backend = select_accelerator()
    threads = f"; {threads_note()}" if threads_note() else ""
    grpo = cfg.grpo is not None  # its loss is the policy gradient over sampled completions, not packed documents
    lines = [
        "ultrascale run",
        f"  model      {cfg.model.type} '{cfg.model.name}': {info.n_params / 1e6:,.2f}M params, "
        f"attn={cfg.model.attn_implementation}, act-ckpt={d.activation_checkpointing.value}",
        f"  layout     {d.topo.describe()}  |  {zero_line(cfg.zero, d)}  |  precision {cfg.precision.dtype}",
        f"  batch      {batch_line(cfg.data, d.topo)}",
        f"  length     {run_length(cfg)}",
        *([f"  grpo       {grpo_line(cfg, d)}"] if grpo else []),
        f"  optimizer  {d.optimizer_owner.why}, lr {cfg.optim.lr:g}, schedule {cfg.optim.sched.name} "
        f"(warmup {cfg.optim.sched.warmup_steps}), clip {cfg.optim.grad_clip}",
        f"  finetune   {d.finetune.why}",
        *([f"  {'':<10} {finetune_line(cfg, d, info.n_trainable, info.n_params)}"] if info.n_trainable else []),
        f"  device     {'cpu' if backend == 'gloo' else 'cuda'} / {backend}{threads}; MFU peak from {peak_src}",
        f"  runtime    {runtime()}, deepspeed {deepspeed_version()}",
        *([f"  cpu        {detect().describe()}"] if backend == "gloo" else []),
        *([f"  gpu        {d.gpu.describe()}"] if d.gpu is not None else []),
        *([] if grpo else [f"  packing    document masking {d.document_masking.why}"]),
        f"  stability  {_stability_line(cfg.stability)}",
        f"  timing     step breakdown {d.step_breakdown.why}; {d.overlap_loss_reduce.why}",
        *(
            []
            if grpo
            else [f"  loss       {d.fused_loss.why}" + (f"; kernel: {d.loss_kernel.why}" if d.loss_kernel.on else "")]
        ),
        f"  act-ckpt   {d.activation_checkpointing.why}",
        f"  attention  {d.attention.why}",
        f"  compile    {d.compile.why}",
        f"  autocast   {d.autocast.why}",
        f"  output     {out}  (config.yaml, ds_config.json, metrics.jsonl, checkpoints/, logs/)",
    ]
    from ultrascale.data import sources

    if sources.is_mixture(cfg.data):
        table = sources.stage_table(cfg.data, int(cfg.train.steps))
        lines += [f"  {'data' if i == 0 else '':<10} {line}" for i, line in enumerate(table)]
    for k, v in info.extras.items():
        lines.append(f"  {k:<10} {v}")
    if cfg.launcher.env:
        lines.append(f"  env        {' '.join(f'{k}={v}' for k, v in cfg.launcher.env.items())}")
    return "\n".join(lines)


def done_lines(summary: dict, out: Path, paths: dict[str, Any], steps: int) -> str:
    """Rank 0's last words: the summary and where everything is. ``paths``: ``metrics``, ``plot``, ``report``,
    ``checkpoint``, ``tensorboard`` and ``wandb`` (each None when there is none)."""
    shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()}
    plot, report, wandb_dir = paths.get("plot"), paths.get("report"), paths.get("wandb")
    lines = [f"done: {json.dumps(shown)}", f"  run dir     {out}",
             f"  metrics     {paths['metrics']}" + (f"  plot {plot}" if plot else "")]  # fmt: skip
    if report:
        lines.append(f"  report      {report}  (python -m ultrascale.report run_dir={out})")
    lines.append(f"  checkpoint  {paths.get('checkpoint')}")
    if summary.get("stopped_by"):
        lines.insert(1, f"  stopped     by {summary['stopped_by']} before step {steps}: run the same command "
                        "again to resume from the checkpoint")  # fmt: skip
    if paths.get("tensorboard"):
        lines.append(f"  tensorboard tensorboard --logdir {paths['tensorboard']}")
    if wandb_dir:
        lines.append(f"  wandb       {Path(wandb_dir).parent}  (wandb sync {Path(wandb_dir).parent})")
    return "\n".join(lines)
