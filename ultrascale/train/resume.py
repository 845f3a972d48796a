"""What a checkpoint fixes, and whether a resume may change it: checked before anything is written.

A checkpoint pins the run's layout (ranks, tp/pp/sp/ep, ZeRO stage, precision: DeepSpeed's files are sharded
by them), the model's shape, and the learning-rate curve the run was on. A resume that changes one of them
used to fail late (DeepSpeed's empty ``AssertionError`` on a ZeRO-3 -> ZeRO-1 resume, its ``ZeRORuntimeException``
on another world size) or, worse, not at all: a longer ``train.steps`` silently reshaped the cosine schedule
under the run. Here each is one error naming the key, the checkpoint's value and the fix; a change that keeps
the run on its curve (more steps with the schedule kept, a WSD run extended in its stable phase) is allowed and
said in words. Pure: the checkpoint's meta in, findings out.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ultrascale.errors import CheckpointError
from ultrascale.levers.decide import Decisions
from ultrascale.train.optim import lr_multiplier

if TYPE_CHECKING:
    from ultrascale.config.optim import OptimConfig
    from ultrascale.config.root import RootConfig
    from ultrascale.config.train import TrainConfig

MODEL_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings",
              "num_local_experts", "num_experts", "moe_intermediate_size")  # fmt: skip
"""The HF config fields that decide the shape of the saved tensors."""
SCHEDULE_KEYS = ("lr", "name", "warmup_steps", "min_lr_ratio", "decay_fraction", "total_steps")


def model_signature(hf_config: Any) -> dict:
    return {k: getattr(hf_config, k) for k in MODEL_KEYS if getattr(hf_config, k, None) is not None}


def schedule_record(optim: OptimConfig, train: TrainConfig) -> dict:
    """The lr curve as the checkpoint's run followed it (``total_steps`` resolved to the length it ran with)."""
    s = optim.sched
    return {"lr": float(optim.lr), "name": str(s.name), "warmup_steps": int(s.warmup_steps),
            "min_lr_ratio": float(s.min_lr_ratio), "decay_fraction": float(s.decay_fraction),
            "total_steps": int(s.total_steps or train.steps)}  # fmt: skip


def checkpoint_meta(cfg: RootConfig, d: Decisions) -> dict:
    """What every checkpoint of this run records about the run (beside its step, data offset and files)."""
    from ultrascale.model.adapters import meta_record

    return {"world_size": d.topo.world, "topology": d.topo.as_dict(), "precision": str(cfg.precision.dtype),
            "zero_stage": d.zero_stage, "model": model_signature(d.hf_config), "schedule": schedule_record(cfg.optim, cfg.train),
            "train_steps": int(cfg.train.steps), "finetune": meta_record(cfg.model, cfg.finetune)}  # fmt: skip


def _lr(rec: dict, step: int) -> float:
    class _S:  # lr_multiplier reads attributes
        pass

    s = _S()
    s.__dict__.update(rec)
    return rec["lr"] * lr_multiplier(step, s, rec["total_steps"])


def _key_for_schedule(field: str, optim: OptimConfig) -> str:
    if field == "lr":
        return "optim.lr"
    if field == "total_steps":
        return "optim.sched.total_steps" if optim.sched.total_steps else "train.steps"
    return f"optim.sched.{field}"


def check_resume(cfg: RootConfig, d: Decisions, meta: dict, tag: str, universal: bool) -> list[str]:
    """Raise :class:`CheckpointError` when this config cannot continue the checkpoint's run; return the allowed
    changes, in words (logged at start and kept in the ``resume`` event)."""
    step = int(meta.get("step", 0))
    convert = (f"convert it once with `python -m ultrascale.train.checkpoint to_universal <run>/checkpoints/{tag}` "
               "and resume with train.universal_checkpoint=true")  # fmt: skip
    if not universal:
        saved_topo, topo = meta.get("topology") or {}, d.topo.as_dict()
        if meta.get("world_size") not in (None, d.topo.world) or any(
            saved_topo.get(k, topo[k]) != topo[k] for k in ("tp", "pp", "sp", "ep")
        ):
            raise CheckpointError(
                f"checkpoint {tag} was saved by {meta.get('world_size')} ranks "
                f"({_layout(saved_topo)}) and this run has {d.topo.world} ({_layout(topo)}): DeepSpeed's files are "
                f"sharded by that layout; relaunch with {meta.get('world_size')} ranks and the same parallel.*, or "
                f"{convert}"
            )
        if meta.get("zero_stage") not in (None, d.zero_stage):
            raise CheckpointError(
                f"zero.stage={d.zero_stage} but checkpoint {tag} was saved with zero.stage={meta['zero_stage']}: "
                f"resume with zero=stage{meta['zero_stage']}, or {convert}"
            )
        if meta.get("precision") not in (None, str(cfg.precision.dtype)):
            raise CheckpointError(
                f"precision.dtype={cfg.precision.dtype} but checkpoint {tag} was saved with "
                f"precision.dtype={meta['precision']}: resume with precision={meta['precision']}, or {convert}"
            )
    saved_model, model = meta.get("model") or {}, model_signature(d.hf_config)
    for k, v in saved_model.items():
        if model.get(k) != v:
            key = "model.type" if k == "model_type" else f"model.config.{k}"
            raise CheckpointError(
                f"{key}={model.get(k)} but checkpoint {tag} holds a model with {k}={v}: resume with {key}={v} "
                f"(or the model= option it was trained with), or start a new run in another output_dir"
            )
    from ultrascale.model.adapters import check_finetune_resume, meta_record

    # the adapters' shapes, and their base
    check_finetune_resume(meta.get("finetune"), meta_record(cfg.model, cfg.finetune), tag)
    _data_positions(cfg, meta, tag)
    return _schedule_changes(cfg, meta.get("schedule"), tag, step, meta.get("train_steps"))


def _data_positions(cfg: RootConfig, meta: dict, tag: str) -> None:
    """The mixture must put every source where the checkpoint's run was: the samples read after the resume are
    then the ones the uninterrupted run would have read. A mixture changed only after the checkpoint passes."""
    from ultrascale.data import sources

    saved = meta.get("data_cursors")
    data_step = int(meta.get("step", 0)) + int(meta.get("data_offset", 0))
    if cfg.grpo is not None:  # a GRPO run reads problems: drawn = data step x prompts per step
        drawn, now_drawn = (saved or {}).get("problems"), data_step * cfg.grpo.prompts_per_step
        if drawn is not None and drawn != now_drawn:
            raise CheckpointError(
                f"grpo: checkpoint {tag} had drawn {drawn} problems by data step {data_step}, this config's "
                f"grpo.prompts_per_step={cfg.grpo.prompts_per_step} puts it at {now_drawn}: the resumed run would not "
                f"sample the problems the uninterrupted one did; restore grpo.prompts_per_step"
            )
        return
    if not saved or (set(saved) == {sources.SHORTHAND} and not sources.is_mixture(cfg.data)):
        return
    now = sources.cursors(cfg.data, data_step, int(cfg.train.steps))
    for name in sorted(set(saved) | set(now)):
        if saved.get(name, 0) != now.get(name, 0):
            raise CheckpointError(
                f"data mixture: checkpoint {tag} had read {saved.get(name, 0)} samples of source {name!r} by data "
                f"step {data_step}, this config's data.sources/data.stages put it at {now.get(name, 0)}: the resumed "
                f"run would not read what the uninterrupted one did; restore the mixture the run had, and to change "
                f"it from here on keep the past as a stage (data.stages=[{{until_step: {data_step}, weights: "
                f"<the old weights>}}, <the new stages>])"
            )


def _schedule_changes(cfg: RootConfig, saved: dict | None, tag: str, step: int, saved_steps: int | None) -> list[str]:
    """The lr the next update gets must be the one the run was heading for, unless the user says otherwise."""
    now, notes = schedule_record(cfg.optim, cfg.train), []
    if saved_steps is not None and saved_steps != cfg.train.steps:
        notes.append(f"train.steps {saved_steps} -> {cfg.train.steps}")
    if not saved or saved == now:
        if notes and saved and cfg.train.steps > now["total_steps"]:
            notes[-1] += (f" with the schedule kept at {now['total_steps']} steps: steps past it run at its final "
                          f"lr {_lr(now, cfg.train.steps - 1):.3e}")  # fmt: skip
        return notes
    diff = [k for k in SCHEDULE_KEYS if saved.get(k) != now[k]]
    before, after = _lr(saved, step), _lr(now, step)
    changed = ", ".join(f"{_key_for_schedule(k, cfg.optim)} {saved.get(k)} -> {now[k]}" for k in diff)
    if not math.isclose(before, after, rel_tol=1e-9) and not cfg.train.allow_schedule_change:
        key = _key_for_schedule(diff[0], cfg.optim)
        keep = (f"optim.sched.total_steps={saved['total_steps']} (steps past {saved['total_steps']} run at its "
                "final lr)" if diff == ["total_steps"] else f"{key}={saved.get(diff[0])}")  # fmt: skip
        raise CheckpointError(
            f"{key}={now[diff[0]]} changes the {saved['name']} schedule checkpoint {tag} was on ({changed}): the "
            f"lr at step {step + 1} would jump from {before:.3e} to {after:.3e}; keep the schedule with {keep}, or "
            "accept the jump with train.allow_schedule_change=true"
        )
    how = ("the lr at the resume step is unchanged" if math.isclose(before, after, rel_tol=1e-9)
           else "accepted with train.allow_schedule_change=true")  # fmt: skip
    return [f"schedule changed at resume ({changed}): lr at step {step + 1} {before:.3e} -> {after:.3e}; {how}"]


def _layout(topo: dict) -> str:
    return " ".join(f"{k}={topo[k]}" for k in ("dp", "tp", "pp", "sp", "ep") if k in topo) or "layout unknown"
