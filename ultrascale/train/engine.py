"""Model + optimizer -> a DeepSpeed engine, applying the run's :class:`~ultrascale.levers.decide.Decisions`.

Nothing here decides whether a feature is on: that was decided once, with its reason, before anything was
built. Each ``apply`` step below takes the decision and the sub-config it needs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ultrascale.errors import ConfigError
from ultrascale.levers.decide import Decisions
from ultrascale.model.build import build_model, count_params, require_attn_kernel, zero_init_config
from ultrascale.runtime import hostmem
from ultrascale.train.metrics import HostPeak
from ultrascale.train.optim import build_optimizer, param_groups
from ultrascale.train.stability import StepGate

if TYPE_CHECKING:
    from ultrascale.config.optim import OptimConfig
    from ultrascale.config.root import RootConfig

log = logging.getLogger("ultrascale")


@dataclass
class EngineInfo:
    """What was built that only exists once it is built, for the banner and metrics."""

    n_params: int
    gate: StepGate | None = None
    n_trainable: int | None = None
    """Parameters that get gradients and optimizer state (``finetune=lora``: the adapters); None: all of them."""
    extras: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    """Host RSS rise per rank: ``construct_peak_gb`` (building the model), ``setup_peak_gb`` (inside
    ``deepspeed.initialize``), ``after_setup_gb`` (from before construction to the end of engine setup)."""


def build_engine(cfg: RootConfig, d: Decisions, ds_config: dict) -> tuple[Any, EngineInfo]:
    """Return (engine, EngineInfo). The model is built identically on every rank from train.seed."""
    import deepspeed

    with HostPeak() as built, hostmem.construction():
        model, n_params = _construct(cfg, d, ds_config)
    n_trainable = None
    if d.finetune.on:  # before any lever patches the model: they then patch the tree with the adapters in it
        from ultrascale.model.adapters import apply_lora, count_params

        model = apply_lora(model, cfg.finetune, cfg.train.seed)
        n_trainable, n_params = count_params(model)
    model, mpu, extras = _wrap_for_parallel(model, cfg, d)
    if not d.pipeline:  # the pipeline's stages checkpoint their layers themselves (_construct)
        from ultrascale.model.recompute import enable_checkpointing

        enable_checkpointing(model, d.activation_checkpointing.value, d.compile.on and d.compile.value == "layers")
    _apply_loss(model, d)
    _apply_attention(model, d)
    _apply_autocast(model, d)
    optimizer, params = _optimizer(model, cfg.optim, d)
    # No lr_scheduler: the trainer sets each step's lr from the step number (optim.apply_lr).
    with HostPeak() as setup, hostmem.construction():  # AutoTP shards and ZeRO flattens in here
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, model_parameters=params, config=ds_config, mpu=mpu
        )
    gate = StepGate(engine.basic_optimizer or engine.optimizer)
    if d.pipeline:
        from ultrascale.model.pipeline import stage_summary

        extras["pipeline"] = stage_summary(engine)
    if d.compile.on:
        _apply_compile(engine, d.compile.value)  # the compile itself happens at the first forward
    memory = {"construct_peak_gb": built.peak_rise_gb, "setup_peak_gb": setup.peak_rise_gb, "base_kb": built.base_kb,
              "after_setup_gb": (setup.end_kb - built.base_kb) / 2**20 if built.ok and setup.ok else None}  # fmt: skip
    if built.ok:
        extras["memory"] = (f"host RSS per rank: +{memory['construct_peak_gb']:.2f} GB peak while the model was "
                            f"built, +{memory['after_setup_gb']:.2f} GB after engine setup")  # fmt: skip
    return engine, EngineInfo(n_params, gate=gate, extras=extras, memory=memory, n_trainable=n_trainable)


def _construct(cfg: RootConfig, d: Decisions, ds_config: dict) -> tuple[Any, int]:
    """(model, total parameters): a pipeline stage builds only its layers; ZeRO-3 builds partitioned."""
    require_attn_kernel(str(cfg.model.attn_implementation))
    if d.pipeline:
        from ultrascale.model.pipeline import build_pipeline

        pc = cfg.parallel.pipeline
        interval = pc.activation_checkpoint_interval or (1 if d.activation_checkpointing.value == "full" else 0)
        model = build_pipeline(d.hf_config, cfg.model, cfg.train.seed, d.topo.pp, str(pc.partition_method), interval)
        return model, count_params(cfg.model)["total"]
    if d.finetune.value == "qlora":  # a 4-bit base on this rank's GPU (validation: CUDA, bitsandbytes, ZeRO<=2)
        from ultrascale.model.adapters import build_quantized

        model = build_quantized(cfg.model, d.hf_config)
        return model, sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    zero3 = zero_init_config(ds_config) if d.zero3_init.on else None
    model = build_model(cfg.model, seed=cfg.train.seed, hf_config=d.hf_config, dtype=torch.float32, zero3=zero3,
                        partitioned_experts=d.zero3_init.value == "experts")  # fmt: skip
    return model, sum(getattr(p, "ds_numel", p.numel()) for p in {id(p): p for p in model.parameters()}.values())


def build_reference(cfg: RootConfig, d: Decisions, ds_config: dict, policy: torch.nn.Module) -> tuple[Any, str]:
    """A frozen copy of the policy as it starts (GRPO's reference for the KL with full fine-tuning), and a line
    saying how it is held. ZeRO-0/1/2: a copy of the module (every rank holds the policy whole already). ZeRO-3:
    the pretrained weights built again partitioned from the first byte, inside a DeepSpeed engine with no optimizer,
    so each rank holds 1/dp of it and its forward gathers a layer at a time as the policy's does (TRL's
    ``prepare_deepspeed``). Built before any checkpoint is loaded: a resumed run's reference is the start, too."""
    import copy

    if d.zero_stage < 3:
        ref = copy.deepcopy(policy).eval().requires_grad_(False)
        return ref, f"a frozen copy of the start policy, whole on every rank (ZeRO-{d.zero_stage})"
    import deepspeed

    with hostmem.construction():
        model, _ = _construct(cfg, d, ds_config)
    model.requires_grad_(False)
    _apply_attention(model, d)
    _apply_autocast(model, d)
    frozen = {k: v for k, v in ds_config.items() if k not in ("optimizer", "scheduler")}
    frozen["zero_optimization"] = {k: v for k, v in ds_config["zero_optimization"].items()
                                   if k not in ("offload_optimizer",)}  # fmt: skip
    engine, _, _, _ = deepspeed.initialize(model=model, config=frozen)
    engine.eval()
    params = {id(p): p for p in engine.module.parameters()}.values()
    local = sum(p.ds_tensor.numel() for p in params)
    total = sum(p.ds_numel for p in params)
    return engine, (f"a frozen copy of the start policy, ZeRO-3 partitioned: {local:,} of its {total:,} parameters "
                    f"on this rank")  # fmt: skip


def _apply_loss(model, d: Decisions) -> None:
    if not d.fused_loss.on:
        return
    from ultrascale.model.loss import install_fused_loss

    try:
        install_fused_loss(model, chunk_tokens=d.fused_loss.value, impl=d.loss_kernel.value or "chunked")
    except ValueError as e:  # decide.loss_unfit read the config; only the built model's structure can still refuse
        raise ConfigError(
            f"train.fused_loss=true cannot install on this model ({e}): set train.fused_loss=false"
        ) from None


def _apply_attention(model, d: Decisions) -> None:
    """FlexAttention or the blocked SDPA, as decided: each is an HF attention implementation set on the built model."""
    if not d.attention.on:
        return
    from ultrascale.levers.decide import attention_unfit

    why = attention_unfit(model.config, getattr(model.config, "_attn_implementation", None))
    if why:  # the decision read the config; a model built otherwise (a caller's own) is refused with its reason
        raise ConfigError(f"the attention kernel cannot install on this model (off ({why})): set "
                          "train.attention_kernel=sdpa")  # fmt: skip
    if d.attention.value == "flex":
        from ultrascale.model.flex import install_flex_attention

        install_flex_attention(model)
    else:
        from ultrascale.model.attention import install_blocked_attention

        install_blocked_attention(model, d.attention.value)


def _apply_autocast(model, d: Decisions) -> None:
    if d.autocast.on:  # after the fused loss: autocast wraps the forward as patched so far
        from ultrascale.model.autocast import install_autocast

        install_autocast(model, *d.autocast.value)


def _apply_compile(engine, scope: str) -> None:
    if scope == "model":
        engine.compile()
        return
    layers = getattr(getattr(engine.module, "model", None), "layers", None)
    if layers is None:
        raise ConfigError(f"train.compile_scope=layers: {type(engine.module).__name__} has no model.layers: "
                          "use train.compile_scope=model")  # fmt: skip
    for layer in layers:
        layer.compile()  # in place: parameter names and checkpoints are unchanged
    n = sum(getattr(layer, "_compiled_call_impl", None) is not None for layer in layers)
    log.info(f"compile: {n} of {len(layers)} decoder layers compiled in place (train.compile_scope=layers)")


def _optimizer(model, optim: OptimConfig, d: Decisions) -> tuple[Any, Any]:
    """(optimizer or None, model_parameters) for ``deepspeed.initialize``, per who owns the optimizer."""
    if d.optimizer_owner.value == "deepspeed":
        return None, param_groups(model, optim.weight_decay, optim.decay_embeddings)
    optimizer = build_optimizer(model, optim)
    if d.topo.ep > 1:  # built after AutoEP, with the expert params in their own groups
        from ultrascale.model.moe import deferred_optimizer

        return deferred_optimizer(optimizer)
    return optimizer, None


def _wrap_for_parallel(model, cfg: RootConfig, d: Decisions):
    """(model, mpu, banner extras): Ulysses attention and MoE hooks, per the topology (pipeline stages are built
    as stages from the start, see ``build_engine``).

    Tensor parallelism needs nothing here: DeepSpeed AutoTP shards the Linear layers inside
    ``deepspeed.initialize`` from the ``tensor_parallel`` JSON section (and remaps our optimizer).
    """
    topo, mpu, extras = d.topo, None, {}
    if d.moe.on:
        from ultrascale.model.moe import prepare_moe

        extras["moe"] = prepare_moe(model, cfg.parallel.moe, d.moe.why, leaf_modules=d.moe_leaf_modules)
    if topo.sp > 1:
        from ultrascale.model.sequence import enable_ulysses

        mpu = enable_ulysses(model, str(cfg.model.attn_implementation), topo.sp, cfg.data.micro_batch, cfg.data.seq_len)
        extras["sequence"] = (
            f"Ulysses sp={topo.sp}: each rank holds {cfg.data.seq_len // topo.sp} of {cfg.data.seq_len} tokens"
        )
    if topo.tp > 1:
        extras["tensor"] = f"AutoTP tp={topo.tp}: Linear layers sharded by DeepSpeed inside initialize()"
    return model, mpu, extras
