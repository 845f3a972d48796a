"""Baseline for bench/train_overhead.py: HF ``Trainer`` + DeepSpeed as a user gets it, on a train.py run's job.

It trains the same model, DeepSpeed JSON, packed shards, batch and optimizer settings as the train.py run whose
directory it is given, and times it the same way (end of step 1 to end of step N). ``MODE`` picks the flavour:
``default`` (Trainer's own defaults), ``tuned`` (compile, fused AdamW, train.py's log cadence) and the ``+gc``,
``+bf16`` and ``+like`` flags (the GPU probe's anchor: the run's own loss kernel, recompute and document-masked
position ids). What each mode sets, the CPU-only accelerate setup and what cannot be matched:
bench/README.md, "bench/_trainer_loop.py".

Run under torchrun as ``_trainer_loop.py RUN_DIR DATA_DIR STEPS OUT_DIR [MODE]``; prints one JSON line on rank 0.
Not a user-facing tool.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from itertools import pairwise
from pathlib import Path

import numpy as np
import torch


class PackedRows(torch.utils.data.Dataset):
    """The packed shards as Trainer expects them: int64 ``input_ids`` and unshifted ``labels``, no padding; with
    ``eos`` also ``position_ids`` that restart after each EOS (the document mask) and each document's first
    token not a target, exactly as train.py's batches."""

    def __init__(self, split, eos: int | None = None):
        self.split, self.eos = split, eos

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        idx = np.asarray([i])
        ids = torch.from_numpy(self.split.get(idx)[0])
        labels = ids.clone()
        mask = self.split.get_loss_mask(idx)
        if self.eos is not None:
            from ultrascale.data.loader import make_batch

            b = make_batch(ids[None].numpy(), None if mask is None else mask, self.eos, True)
            return {"input_ids": ids, "labels": b.labels[0], "position_ids": b.position_ids[0]}
        if mask is not None:  # supervised data: prompt tokens are read but not learned
            labels[~torch.from_numpy(mask[0])] = -100
        return {"input_ids": ids, "labels": labels}


def like_ours(cfg, ds: dict, data_dir: str) -> tuple[dict, list[str]]:
    """What the train.py run decided, in Trainer's terms: ({liger, gc, flex, eos}, what cannot be matched)."""
    from ultrascale.data.shards import load_manifest
    from ultrascale.levers.rules import validate
    from ultrascale.runtime.gpu import detect

    d = validate(cfg, int(os.environ.get("WORLD_SIZE", "1")), backend=trainer_backend(), gpu=detect())
    notes = []
    liger = bool(d.fused_loss.on and d.loss_kernel.value == "liger")
    if d.fused_loss.on and not liger:
        notes.append("loss: ours chunked fused, Trainer full logits")
        gas, micro = int(ds["gradient_accumulation_steps"]), int(ds["train_micro_batch_size_per_gpu"])
        if torch.cuda.is_available() and micro > 1 and micro % 2 == 0:  # the full-logit loss's ~50 GiB at micro 8
            ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"] = micro // 2, gas * 2
            notes.append(f"Trainer micro batch {micro // 2} x {gas * 2} accumulation (ours {micro} x {gas})")
    ac = d.activation_checkpointing.value if d.activation_checkpointing.on else "none"
    if ac == "selective":
        notes.append("activation checkpointing: ours selective, Trainer full")
    attn = d.attention.value if d.attention.on else "sdpa"
    flex = attn == "flex"
    if d.document_masking.on and not flex:
        notes.append(f"attention: ours {'blocked causal SDPA' if attn != 'sdpa' else 'sdpa'}, Trainer sdpa with "
                     "a dense document mask")  # fmt: skip
    eos = int(load_manifest(data_dir)["eos_token_id"]) if d.document_masking.on else None
    return {"liger": liger, "gc": ac != "none", "flex": flex, "eos": eos}, notes


def _schedule(sched, steps: int) -> tuple[str, dict, int]:
    """(lr_scheduler_type, lr_scheduler_kwargs, warmup_steps): the config's schedule in Trainer's terms."""
    total = int(sched.total_steps or steps) if "total_steps" in sched else steps
    warmup = min(int(sched.warmup_steps), max(total - 1, 0))
    floor = float(sched.get("min_lr_ratio", 0.0))
    if sched.name == "cosine":
        return "cosine_with_min_lr", {"min_lr_rate": floor}, warmup
    if sched.name == "constant":
        return "constant_with_warmup", {}, warmup
    if sched.name == "wsd":
        decay = max(1, round(total * float(sched.decay_fraction)))
        return "warmup_stable_decay", {"num_decay_steps": decay, "min_lr_ratio": floor}, warmup
    sys.exit(f"error: optim.sched.name={sched.name!r} has no HF Trainer equivalent in this benchmark")


def _tuned(cfg) -> dict:
    """What a user who tunes Trainer for speed sets: compile, the fused AdamW kernel, our logging cadence."""
    return {"torch_compile": True, "optim": "adamw_torch_fused", "logging_steps": int(cfg.train.log_interval),
            "logging_strategy": "steps"}  # fmt: skip


def _describe(opt) -> str:
    """The torch optimizer Trainer built (DeepSpeed wraps it), with its kernel choice."""
    flags = {k: opt.defaults.get(k) for k in ("fused", "foreach") if k in opt.defaults}
    return f"{type(opt).__module__}.{type(opt).__name__}({', '.join(f'{k}={v}' for k, v in flags.items())})"


def _plain(v):
    """JSON-safe: DeepSpeed/accelerate use float('inf') as 'never', which strict JSON cannot hold."""
    return str(v) if isinstance(v, float) and not math.isfinite(v) else v


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def _diff(before: dict, after: dict) -> dict:
    """Keys of the DeepSpeed JSON that Trainer/accelerate added, removed or rewrote: {key: [ours, theirs]}."""
    a, b = _flat(before), _flat(after)
    return {k: [_plain(a.get(k)), _plain(b.get(k))] for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)}


def trainer_backend() -> str:
    """The process group Trainer's run is built on: NCCL where CUDA is, gloo on a CPU host."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def main() -> None:
    run_dir, data_dir, steps, out_dir = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    mode = sys.argv[5] if len(sys.argv) > 5 else "default"
    mode, *flags = mode.split("+")  # "tuned+bf16": Trainer's bf16=True, as a user who trains in bf16 sets it
    bf16, gc, like = "bf16" in flags, "gc" in flags, "like" in flags
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    from accelerate import PartialState

    PartialState(backend=trainer_backend())  # before TrainingArguments: see the module docstring
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator

    from ultrascale.data.shards import open_split
    from ultrascale.model.build import build_model
    from ultrascale.runtime.dist import shutdown

    cfg = OmegaConf.load(os.path.join(run_dir, "config.yaml"))
    ds = json.loads(Path(run_dir, "ds_config.json").read_text())
    ds["wall_clock_breakdown"] = False  # train.py's step-breakdown timers are one of its extras, not the baseline's
    ours, notes = like_ours(cfg, ds, data_dir) if like else ({}, [])
    gc = ours.get("gc", gc)
    ds_before = json.loads(json.dumps(ds))
    precision = "bf16" if bf16 else str(cfg.precision.dtype)
    if bf16:  # what HF documents for bf16=True with DeepSpeed: the JSON's bf16 block on "auto", Trainer fills it
        ds["bf16"] = {"enabled": "auto"}
    sched_type, sched_kwargs, warmup = _schedule(cfg.optim.sched, steps)
    o = cfg.optim
    targs = TrainingArguments(
        output_dir=out_dir,
        deepspeed=ds,
        per_device_train_batch_size=int(ds["train_micro_batch_size_per_gpu"]),
        gradient_accumulation_steps=int(ds["gradient_accumulation_steps"]),
        max_steps=steps,
        learning_rate=float(o.lr),
        weight_decay=float(o.weight_decay),
        adam_beta1=float(o.betas[0]),
        adam_beta2=float(o.betas[1]),
        adam_epsilon=float(o.eps),
        max_grad_norm=float(o.grad_clip),
        lr_scheduler_type=sched_type,
        lr_scheduler_kwargs=sched_kwargs,
        warmup_steps=warmup,
        bf16=precision == "bf16",
        # Trainer refuses bf16 without a GPU unless told it trains on CPU; the DeepSpeed engine is built either way
        use_cpu=precision == "bf16" and not torch.cuda.is_available(),
        fp16=precision == "fp16",
        seed=int(cfg.train.seed),
        report_to=[],
        save_strategy="no",
        eval_strategy="no",
        dataloader_num_workers=0,
        gradient_checkpointing=gc,
        accelerator_config={"use_configured_state": True},
        use_liger_kernel=bool(ours.get("liger")),
        **_tuned(cfg) if mode == "tuned" else {},
    )
    model = build_model(cfg.model, seed=cfg.train.seed)
    if like:
        model.config.use_cache = False  # a cache turns HF's packed-sequence (document) mask off
        if ours["flex"]:
            model.set_attn_implementation("flex_attention")
    train = PackedRows(open_split(data_dir, "train", verify=False), eos=ours.get("eos"))
    stamps: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())
            if len(stamps) == 1:
                self.first_step_unix = time.time()

    class LossTrainer(Trainer):
        """Trainer, unchanged, except that it keeps each micro-step's (already detached) loss for the report."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.micro_losses: list[torch.Tensor] = []

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            self.micro_losses.append(loss)
            return loss

    clock = StepClock()
    trainer = LossTrainer(
        model=model, args=targs, train_dataset=train, data_collator=default_data_collator, callbacks=[clock]
    )
    trainer.train()
    # Outside the timed window: per-step loss as Trainer logs it (sum of a step's micro losses, mean over ranks).
    gas = int(ds["gradient_accumulation_steps"])
    per_step = torch.stack(trainer.micro_losses).float().reshape(-1, gas).sum(1)
    dist.all_reduce(per_step)
    per_step /= dist.get_world_size()
    tokens = int(ds["train_batch_size"]) * int(cfg.data.seq_len) * (len(stamps) - 1)
    if dist.get_rank() == 0:
        used = trainer.accelerator.state.deepspeed_plugin.deepspeed_config
        engine = trainer.model_wrapped
        print(
            json.dumps(
                {
                    "tokens_per_s": tokens / (stamps[-1] - stamps[0]),
                    "tokens_per_s_median": int(ds["train_batch_size"])
                    * int(cfg.data.seq_len)
                    / statistics.median([b - a for a, b in pairwise(stamps)][1:] or [stamps[-1] - stamps[0]]),
                    "steps_timed": len(stamps) - 1,
                    "first_step_unix": clock.first_step_unix,
                    "step_intervals_s": [round(b - a, 5) for a, b in pairwise(stamps)],
                    "loss": float(per_step[-1]),
                    "losses": [round(float(x), 5) for x in per_step],
                    "settings": {
                        "mode": mode,
                        "bf16": targs.bf16,
                        "gradient_checkpointing": bool(targs.gradient_checkpointing),
                        "liger": bool(targs.use_liger_kernel),
                        "attention": model.config._attn_implementation,
                        "document_mask": ours.get("eos") is not None,
                        "not_like_for_like": notes if like else None,
                        "backend": dist.get_backend(),
                        "logging_steps": targs.logging_steps,
                        "optim": str(getattr(targs.optim, "value", targs.optim)),
                        "optimizer": _describe(engine.basic_optimizer),
                        "lr_scheduler_type": sched_type,
                        "lr_scheduler_kwargs": sched_kwargs,
                        "warmup_steps": warmup,
                        "torch_compile": bool(targs.torch_compile),
                        "average_tokens_across_devices": bool(targs.average_tokens_across_devices),
                        "engine": type(engine).__name__,
                        "zero_stage": int(engine.zero_optimization_stage()),
                        "world_size": int(targs.world_size),
                        "ds_config_changed_by_trainer": _diff(ds_before, used),
                    },
                }
            ),
            flush=True,
        )
    shutdown()


if __name__ == "__main__":
    main()
