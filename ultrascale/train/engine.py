"""Model + optimizer + scheduler -> a DeepSpeed engine, per the composed config and topology."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from omegaconf import DictConfig

from ultrascale.config.topology import Topology
from ultrascale.model.build import build_hf_config, build_model
from ultrascale.train.optim import build_optimizer, build_scheduler, param_groups

log = logging.getLogger("ultrascale")


@dataclass
class EngineInfo:
    """What was built, for the rank-0 banner and for metrics."""

    hf_config: object
    n_params: int
    optimizer: str
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

    optimizer = build_optimizer(model, cfg)
    if optimizer is not None:
        opt_name = "AdamW (torch, no decay on norms/biases)"
        params = None
        if topo.ep > 1:  # build it after AutoEP, with the expert params in their own groups
            from ultrascale.model.moe import deferred_optimizer

            optimizer, params = deferred_optimizer(optimizer)
            opt_name += ", MoE expert groups split"
    else:
        opt_name = f"{ds_config['optimizer']['type']} (DeepSpeed{', CPU offload' if cfg.zero.offload_optimizer != 'none' else ''})"
        params = param_groups(model, cfg.optim.weight_decay, cfg.optim.decay_embeddings)

    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        model_parameters=params,
        lr_scheduler=lambda opt: build_scheduler(opt, cfg),
        config=ds_config,
        mpu=mpu,
    )
    if topo.pp > 1:
        from ultrascale.model.pipeline import stage_summary

        extras["pipeline"] = stage_summary(engine)
    return engine, EngineInfo(hf_config=hf, n_params=n_params, optimizer=opt_name, extras=extras)


def _wrap_for_parallel(model, cfg: DictConfig, topo: Topology):
    """(model, mpu, banner extras): pipeline stages, Ulysses attention and MoE hooks, per the topology.

    Tensor parallelism needs nothing here: DeepSpeed AutoTP shards the Linear layers inside
    ``deepspeed.initialize`` from the ``tensor_parallel`` JSON section (and remaps our optimizer).
    """
    mpu, extras = None, {}
    from ultrascale.model.moe import is_moe, prepare_moe

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
