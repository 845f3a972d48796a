"""The one place that turns a composed config + topology into DeepSpeed's JSON.

Pure: no I/O, no ``torch.distributed``, no environment reads, so it is unit-testable and the golden
files in ``tests/golden/`` pin its output for every recipe. Batch sizes are always explicit (never
``"auto"``): DeepSpeed checks ``train_batch_size == micro * grad_accum * dp`` and so do we, earlier.
The pipeline degree is a model-build argument, not JSON; tensor and expert parallelism are JSON because
DeepSpeed's AutoTP and AutoEP rewrite the model inside ``deepspeed.initialize``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ultrascale.levers.decide import Decisions

if TYPE_CHECKING:
    from ultrascale.config.optim import OptimConfig
    from ultrascale.config.root import RootConfig
    from ultrascale.config.zero import ZeroConfig


def _zero_section(z: ZeroConfig, stage: int) -> dict[str, Any]:
    out: dict[str, Any] = {"stage": stage}
    if stage >= 1:
        out["overlap_comm"] = bool(z.overlap_comm)
        out["contiguous_gradients"] = bool(z.contiguous_gradients)
        out["reduce_bucket_size"] = int(z.reduce_bucket_size)
    if stage in (1, 2):
        out["allgather_bucket_size"] = int(z.allgather_bucket_size)
        out["reduce_scatter"] = bool(z.reduce_scatter)
        if z.round_robin_gradients:
            out["round_robin_gradients"] = True
    if stage == 3:
        out.update(
            stage3_prefetch_bucket_size=int(z.stage3_prefetch_bucket_size),
            stage3_param_persistence_threshold=int(z.stage3_param_persistence_threshold),
            stage3_max_live_parameters=int(z.stage3_max_live_parameters),
            stage3_max_reuse_distance=int(z.stage3_max_reuse_distance),
            stage3_gather_16bit_weights_on_model_save=bool(z.stage3_gather_16bit_weights_on_model_save),
        )
        if z.zero_hpz_partition_size > 1:
            out["zero_hpz_partition_size"] = int(z.zero_hpz_partition_size)
        if z.zero_quantized_weights:
            out["zero_quantized_weights"] = True
        if z.zero_quantized_gradients:
            out["zero_quantized_gradients"] = True
    if z.offload_optimizer != "none":
        out["offload_optimizer"] = {"device": z.offload_optimizer, "pin_memory": bool(z.pin_memory)}
    if z.offload_param != "none":
        out["offload_param"] = {"device": z.offload_param, "pin_memory": bool(z.pin_memory)}
    return out


def _optimizer_section(o: OptimConfig, d: Decisions) -> dict[str, Any] | None:
    """The optimizer DeepSpeed owns (``d.optimizer_owner``): Muon is DeepSpeed's own, offload needs
    DeepSpeedCPUAdam. None when the trainer builds torch AdamW itself and hands it over."""
    if d.optimizer_owner.value != "deepspeed":
        return None
    if o.name == "muon":
        params: dict[str, Any] = {
            "lr": float(o.lr),
            "momentum": float(o.momentum),
            "betas": [float(b) for b in o.betas],
            "eps": float(o.eps),
            "weight_decay": float(o.weight_decay),
        }
        if o.muon_lr is not None:
            params["muon_lr"] = float(o.muon_lr)
        if o.torch_adam:  # the Adam half as torch AdamW: no FusedAdam JIT build (~1-2 min) on first use
            params["torch_adam"] = True
        return {"type": "muon", "params": params}
    return {
        "type": "AdamW",
        "params": {
            "lr": float(o.lr),
            "betas": [float(b) for b in o.betas],
            "eps": float(o.eps),
            "weight_decay": float(o.weight_decay),
        },
    }


def build_ds_config(cfg: RootConfig, d: Decisions) -> dict[str, Any]:
    """The DeepSpeed config dict for a validated config and its decisions (``validate`` returns them)."""
    topo = d.topo
    mb, gb = int(cfg.data.micro_batch), int(cfg.data.global_batch)
    gas = topo.grad_accum(mb, gb)
    ds: dict[str, Any] = {
        # DeepSpeed 0.19.8 sizes its batch check before AutoTP builds the tp groups, so with tp>1 it counts
        # every rank of a tp group as a replica: micro * accum * world. The samples per step are still gb.
        "train_batch_size": gb * topo.tp,
        "train_micro_batch_size_per_gpu": mb,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": float(cfg.optim.grad_clip),
        "steps_per_print": 10**9,  # we log ourselves; DeepSpeed's own print is noise
        "wall_clock_breakdown": d.step_breakdown.on,  # engine timers feed the step breakdown
        # DeepSpeed's throughput timer (on by default) synchronises the device at every forward and step() to
        # print samples/s we never print (steps_per_print above); the step rows carry tokens/s instead
        "timers": {"throughput": {"enabled": False}},
        "zero_optimization": _zero_section(cfg.zero, d.zero_stage),
        "zero_allow_untested_optimizer": True,
        "seed": int(cfg.train.seed),
    }
    dtype = cfg.precision.dtype
    if dtype == "bf16":
        ds["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        p = cfg.precision
        ds["fp16"] = {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": int(p.initial_scale_power),
            "loss_scale_window": int(p.loss_scale_window),
            "hysteresis": int(p.hysteresis),
            "min_loss_scale": float(p.min_loss_scale),
        }
    opt = _optimizer_section(cfg.optim, d)
    if opt is not None:
        ds["optimizer"] = opt
    if topo.tp > 1:
        ds["tensor_parallel"] = {"autotp_size": topo.tp}
    if topo.sp > 1:
        ds["sequence_parallel_size"] = topo.sp
    if topo.ep > 1:
        # AutoEP swaps the HF MoE blocks inside deepspeed.initialize; the preset is the HF model_type.
        ds["expert_parallel"] = {"enabled": True, "autoep_size": topo.ep, "preset_model": str(cfg.model.type)}
    if cfg.train.universal_checkpoint:
        ds["checkpoint"] = {"load_universal": True}
    return ds
