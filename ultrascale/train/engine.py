"""Model + optimizer + scheduler -> a DeepSpeed engine, per the composed config and topology."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from omegaconf import DictConfig

from ultrascale.config.topology import Topology
from ultrascale.model.build import build_hf_config, build_model
from ultrascale.model.moe import is_moe
from ultrascale.train.optim import build_optimizer, param_groups
from ultrascale.train.stability import StepGate

log = logging.getLogger("ultrascale")


@dataclass
class EngineInfo:
    """What was built, for the rank-0 banner and for metrics."""

    hf_config: object
    n_params: int
    optimizer: str
    gate: StepGate | None = None
    fused_loss: bool = False
    extras: dict = field(default_factory=dict)


def _enable_hf_zero3(ds_config: dict):
    """Let transformers build ZeRO-3 models already partitioned (a 15B model never exists whole on a rank).

    transformers does this itself when an ``HfDeepSpeedConfig`` is alive: it builds under
    ``deepspeed.zero.Init`` and then initialises weights module by module with the parameters gathered.
    Entering ``zero.Init`` ourselves skips that weight init and trains from garbage (loss ~80 at step 1).
    The returned object must be kept alive while the model is built (transformers holds a weakref).
    """
    import torch._dynamo  # noqa: F401  (zero.Init patches tensor creation; dynamo must be imported first)
    from transformers.integrations import HfDeepSpeedConfig

    return HfDeepSpeedConfig(ds_config)


def build_engine(cfg: DictConfig, topo: Topology, ds_config: dict):
    """Return (engine, EngineInfo). The model is built identically on every rank from train.seed."""
    import deepspeed

    hf = build_hf_config(cfg.model)
    keep_alive = _enable_hf_zero3(ds_config) if cfg.zero.stage == 3 else None
    model = build_model(cfg.model, seed=cfg.train.seed, dtype=torch.float32)
    del keep_alive
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in {id(p): p for p in model.parameters()}.values())
    model, mpu, extras = _wrap_for_parallel(model, cfg, topo)
    if cfg.train.activation_checkpointing and topo.pp == 1:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    fused_loss, extras["loss"] = _install_loss(model, cfg, topo)
    extras["attention"] = _install_attention(model, cfg, topo)

    optimizer = build_optimizer(model, cfg)
    if optimizer is not None:
        opt_name = f"AdamW (torch{', fused' if cfg.optim.fused else ''}, no decay on norms/biases)"
        params = None
        if topo.ep > 1:  # build it after AutoEP, with the expert params in their own groups
            from ultrascale.model.moe import deferred_optimizer

            optimizer, params = deferred_optimizer(optimizer)
            opt_name += ", MoE expert groups split"
    else:
        opt_name = f"{ds_config['optimizer']['type']} (DeepSpeed{', CPU offload' if cfg.zero.offload_optimizer != 'none' else ''})"
        params = param_groups(model, cfg.optim.weight_decay, cfg.optim.decay_embeddings)

    # No lr_scheduler: the trainer sets each step's lr from the step number (optim.apply_lr).
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, model_parameters=params, config=ds_config, mpu=mpu
    )
    gate = StepGate(engine.basic_optimizer or engine.optimizer)
    if topo.pp > 1:
        from ultrascale.model.pipeline import stage_summary

        extras["pipeline"] = stage_summary(engine)
    extras["compile"] = _compile(engine, cfg, topo)
    return engine, EngineInfo(hf, n_params, opt_name, gate=gate, fused_loss=fused_loss, extras=extras)


def _install_loss(model, cfg: DictConfig, topo: Topology) -> tuple[bool, str]:
    """(installed?, banner line): the chunked linear cross-entropy where it computes the same loss."""
    if not cfg.train.fused_loss:
        return False, "plain HF cross-entropy (train.fused_loss=false)"
    why_not = None
    if topo.pp > 1:
        why_not = "the pipeline's last stage computes its own loss"
    elif topo.sp > 1:
        why_not = "sequence parallelism sums per-shard losses itself"
    elif topo.tp > 1:
        why_not = "AutoTP shards the LM head"
    if why_not:
        return False, f"plain HF cross-entropy ({why_not})"
    from ultrascale.model.loss import install_fused_loss

    try:
        installed = install_fused_loss(model, chunk_tokens=int(cfg.train.loss_chunk_tokens) or None)
    except ValueError as e:  # a model whose logits are not a plain linear head (soft-capping, MoE aux loss)
        return False, f"plain HF cross-entropy ({e})"
    if installed is False:
        return False, "plain HF cross-entropy (MoE: the forward adds the router loss)"
    return True, "chunked linear cross-entropy (no [tokens, vocab] logits; train.fused_loss)"


def _install_attention(model, cfg: DictConfig, topo: Topology) -> str:
    """Banner line: causal SDPA by query blocks (ultrascale/model/attention.py) where the layout allows it."""
    block = cfg.train.attn_block_size
    if block is None:
        from ultrascale.dist import select_accelerator
        from ultrascale.model.attention import CPU_BLOCK

        if select_accelerator() != "gloo":
            return "HF attention as configured (train.attn_block_size unset: the blocks are measured on CPU only)"
        block = CPU_BLOCK
    if block and topo.pp > 1:
        return "HF attention as configured (the pipeline stages build their own masks; train.attn_block_size unused)"
    if block and topo.sp > 1:
        return "HF attention as configured (Ulysses wraps the attention core; train.attn_block_size unused)"
    from ultrascale.model.attention import install_blocked_attention

    return install_blocked_attention(model, int(block))[1]


def _compile(engine, cfg: DictConfig, topo: Topology) -> str:
    """torch.compile the module via DeepSpeed; the compile itself happens at the first forward."""
    if not cfg.train.compile:
        return "off (train.compile=false)"
    why_not = None
    if topo.pp > 1:
        why_not = "not with the pipeline engine"
    elif topo.tp > 1 or topo.sp > 1 or topo.ep > 1:
        why_not = "not with AutoTP/Ulysses/AutoEP module rewrites"
    elif is_moe(engine.module):
        why_not = "MoE routing is data-dependent"
    elif int(cfg.zero.stage) == 3:
        why_not = "ZeRO-3's per-module gather hooks would split the graph"
    if why_not:
        return f"off ({why_not}; eager)"
    engine.compile()
    return "torch.compile (inductor) at the first step"


def _wrap_for_parallel(model, cfg: DictConfig, topo: Topology):
    """(model, mpu, banner extras): pipeline stages, Ulysses attention and MoE hooks, per the topology.

    Tensor parallelism needs nothing here: DeepSpeed AutoTP shards the Linear layers inside
    ``deepspeed.initialize`` from the ``tensor_parallel`` JSON section (and remaps our optimizer).
    """
    mpu, extras = None, {}
    from ultrascale.model.moe import prepare_moe

    if is_moe(model):
        extras["moe"] = prepare_moe(model, cfg, topo)
    if topo.pp > 1:
        from ultrascale.model.pipeline import build_pipeline

        pc = cfg.parallel.pipeline
        interval = int(pc.activation_checkpoint_interval) or (1 if cfg.train.activation_checkpointing else 0)
        model = build_pipeline(model, topo.pp, str(pc.partition_method), interval)
    elif topo.sp > 1:
        from ultrascale.model.sequence import enable_ulysses

        mpu = enable_ulysses(model, cfg, topo)
        extras["sequence"] = (
            f"Ulysses sp={topo.sp}: each rank holds {cfg.data.seq_len // topo.sp} of {cfg.data.seq_len} tokens"
        )
    if topo.tp > 1:
        extras["tensor"] = f"AutoTP tp={topo.tp}: Linear layers sharded by DeepSpeed inside initialize()"
    return model, mpu, extras
