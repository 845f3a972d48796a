"""Composition, schema typing, cross-group validation and the pure DeepSpeed JSON builder."""

from __future__ import annotations

import json

import pytest

from ultrascale.config.compose import compose
from ultrascale.config.topology import Topology
from ultrascale.errors import ConfigError
from ultrascale.levers.deepspeed import build_ds_config
from ultrascale.levers.rules import validate


def test_defaults_compose_and_validate():
    cfg = compose([])
    topo = validate(cfg, 2).topo
    assert (topo.dp, topo.tp, topo.pp) == (2, 1, 1)
    assert cfg.model.type == "llama" and cfg.zero.stage == 1


@pytest.mark.parametrize(
    "override, match",
    [
        ("optim.lrr=1e-3", r"unknown config key 'optim.lrr'"),
        ("zero.stagee=2", r"unknown config key 'zero.stagee'"),
        ("data.micro_batch=four", r"data.micro_batch=four is not a valid integer"),
        ("zero=stage9", r"no config 'zero/stage9': choose one of \[.*'stage3_offload'"),
        ("model.config.hiden_size=3", r"unknown config key 'model.config.hiden_size'.*\+model.config"),
        ("+any.key=1", r"unknown config key 'any': it is not in the schema of the root config"),
        ("+train.bogus=2", r"unknown config key 'train.bogus': it is not in the schema of train"),
        ("train.attn_block_size=-1", r"train.attn_block_size=-1 is out of range: it must be >= 0"),
        ("train.profile_steps=-2", r"train.profile_steps=-2 is out of range: it must be >= 0"),
        ("train.checkpoint_interval=-1", r"train.checkpoint_interval=-1 is out of range: it must be >= 0"),
        ("optim.lr=-1e-3", r"optim.lr=-0.001 is out of range: it must be > 0"),
        ("optim.betas=[0.9,1.5]", r"optim.betas=\[0.9, 1.5\] is out of range: it must be >= 0 and < 1"),
        ("zero.stage=4", r"zero.stage=4 is out of range: it must be >= 0 and <= 3"),
        ("precision.dtype=fp8", r"precision.dtype='fp8' is not one of \[fp32, bf16, fp16\]"),
        ("stability.spike=ignore", r"stability.spike='ignore' is not one of \[none, skip, lr_cut, rollback\]"),
        ("parallel.tp=0", r"parallel.tp=0 is out of range: it must be >= 1"),
    ],
)
def test_compose_errors_name_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        compose([override])


@pytest.mark.parametrize(
    "overrides, world, match",
    [
        (
            ["data.global_batch=10"],
            2,
            r"data.global_batch=10 is not divisible by data.micro_batch\*dp=4\*2=8: use data.global_batch=8",
        ),
        (["parallel.pp=2", "zero=stage3"], 2, r"parallel.pp=2 needs zero.stage<=1 \(got 3\): use zero=stage1"),
        (["zero=stage0", "zero.offload_optimizer=cpu"], 2, r"offload_optimizer=cpu needs zero.stage>=1"),
        (["zero=stage2", "zero.offload_param=cpu"], 2, r"offload_param=cpu needs zero.stage=3 \(got 2\)"),
        (["optim=muon", "zero=stage3"], 2, r"optim=muon needs zero.stage<=2 \(got 3\)"),
        (["optim=muon", "optim.grad_clip=1.0"], 2, r"optim=muon with optim.grad_clip=1.0: DeepSpeed clips Muon's orth"),
        (["parallel.tp=3"], 3, r"parallel.tp=3 does not divide the model's attention heads"),
        (["parallel.tp=2", "parallel.pp=2"], 2, r"tp\*pp\*sp=2\*2\*1=4 does not divide the world size 2"),
        (["+model.config.hidden_sise=64"], 2, r"model.config has keys \['hidden_sise'\]"),
        (["data.seq_len=4096"], 2, r"data.seq_len=4096 exceeds model max_position_embeddings=1024"),
        (["model.type=not_a_model"], 2, r"model.type='not_a_model' is not a transformers model type"),
        (
            ["train.profile_steps=2", "train.profile_start=100", "train.steps=100"],
            2,
            r"train.profile_start=100 is not before train.steps=100: nothing would be profiled; use train.profile_start=5",
        ),
    ],
)
def test_validation_errors_name_key_value_fix(overrides, world, match):
    cfg = compose(overrides)
    with pytest.raises(ConfigError, match=match):
        validate(cfg, world)


def test_ds_config_is_explicit_and_pure():
    cfg = compose(["zero=stage3_offload", "precision=bf16", "data.global_batch=32"])
    d = validate(cfg, 2)
    ds = build_ds_config(cfg, d)
    assert ds == build_ds_config(cfg, d)  # deterministic, no hidden state
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (
        32,
        4,
        4,
    )
    assert "auto" not in json.dumps(ds)
    z = ds["zero_optimization"]
    assert z["stage"] == 3 and z["offload_optimizer"]["device"] == "cpu" and z["offload_param"]["device"] == "cpu"
    assert ds["bf16"] == {"enabled": True}
    assert ds["optimizer"]["type"] == "AdamW"  # offload needs DeepSpeed's CPU Adam


def test_torch_adamw_path_has_no_ds_optimizer():
    cfg = compose(["zero=stage2"])
    ds = build_ds_config(cfg, validate(cfg, 2))
    assert "optimizer" not in ds and ds["zero_optimization"]["reduce_scatter"] is True


def test_muon_maps_to_deepspeed_muon():
    cfg = compose(["optim=muon", "zero=stage2"])
    ds = build_ds_config(cfg, validate(cfg, 2))
    assert ds["optimizer"]["type"] == "muon" and ds["optimizer"]["params"]["muon_lr"] == 0.02


def test_fp16_loss_scaling_is_dynamic():
    cfg = compose(["precision=fp16"])
    ds = build_ds_config(cfg, validate(cfg, 1))
    assert ds["fp16"]["enabled"] and ds["fp16"]["loss_scale"] == 0


def test_topology_arithmetic():
    t = Topology(world=16, tp=2, pp=2, sp=1, ep=2)
    assert t.dp == 4 and t.grad_accum(micro_batch=2, global_batch=64) == 8


def _numeric_fields():
    """Every int/float (or list of them) field of every composed schema: train, plan, eval, SSD, data prep,
    its show tool and the export."""
    import dataclasses
    import typing

    from data_prep.config import DataPrepConfig, ShowConfig
    from ultrascale.config.root import PlanRootConfig
    from ultrascale.eval.config import EvalConfig
    from ultrascale.export import ExportConfig
    from ultrascale.ssd.config import SSDConfig

    seen, out = set(), []

    def walk(cls, prefix):
        if cls in seen:
            return
        seen.add(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            t = hints[f.name]
            if dataclasses.is_dataclass(t):
                walk(t, f"{prefix}{f.name}.")
                continue
            args = {a for a in typing.get_args(t)} | {t} | {a for x in typing.get_args(t) for a in typing.get_args(x)}
            if args & {int, float} and bool not in args:
                out.append((f"{prefix}{f.name}", f))

    for root in (PlanRootConfig, EvalConfig, SSDConfig, DataPrepConfig, ShowConfig, ExportConfig):
        walk(root, "")
    return out


def test_every_numeric_key_declares_its_range():
    from ultrascale.config.fields import range_of

    fields = _numeric_fields()
    assert len(fields) > 100
    missing = [key for key, f in fields if range_of(f) is None]
    assert not missing, f"numeric keys without a declared range: {missing}"
