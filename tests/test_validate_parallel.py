"""Every parallelism rule raises its one clear error from the composed config, before any engine exists."""

from __future__ import annotations

import pytest

from ultrascale.config.compose import compose
from ultrascale.errors import ConfigError
from ultrascale.levers.deepspeed import build_ds_config
from ultrascale.levers.rules import validate

MOE = ["model=tiny_moe"]


@pytest.mark.parametrize(
    "overrides, world, match",
    [
        # pipeline
        (["parallel=pp2", "zero=stage2"], 2, r"parallel.pp=2 needs zero.stage<=1 \(got 2\): use zero=stage1"),
        (["parallel=pp2", "zero=stage3"], 2, r"parallel.pp=2 needs zero.stage<=1 \(got 3\): use zero=stage1"),
        (["parallel=pp2", "parallel.pp=8"], 8, r"parallel.pp=8 exceeds the model's 4 layers: lower parallel.pp"),
        (["parallel=pp2", "parallel.tp=2"], 4, r"parallel.pp=2 with parallel.tp=2 is not supported: DeepSpeed AutoTP"),
        (["parallel=pp2", "parallel.sp=2"], 4, r"parallel.pp=2 with parallel.sp=2 is not supported"),
        (["parallel=pp2", *MOE], 2, r"parallel.pp=2 with a MoE model \(mixtral\) is not supported"),
        (["parallel=pp2", "optim=muon"], 2, r"parallel.pp>1 with optim=muon is not supported: use optim=adamw"),
        (
            ["parallel=pp2", "parallel.pipeline.partition_method=greedy"],
            2,
            r"parallel.pipeline.partition_method='greedy' is not one of \['parameters', 'uniform'\]",
        ),
        (
            ["parallel=pp2", "parallel.pipeline.activation_checkpoint_interval=-1"],
            2,
            r"parallel.pipeline.activation_checkpoint_interval=-1 is out of range: it must be >= 0",
        ),
        (
            ["parallel=pp2", "parallel.pipeline.micro_batches=8", "data.micro_batch=4", "data.global_batch=16"],
            2,
            r"parallel.pipeline.micro_batches=8 but .* gives 4: set data.global_batch=32",
        ),
        # tensor
        (
            ["parallel=tp2", "zero=stage3"],
            2,
            r"parallel.tp=2 needs zero.stage<=2 \(got 3\): DeepSpeed AutoTP training refuses ZeRO-3; use zero=stage2",
        ),
        (["parallel.tp=3"], 3, r"parallel.tp=3 does not divide the model's attention heads \(4\)"),
        (
            ["parallel=tp2", "model.config.num_key_value_heads=1"],
            2,
            r"parallel.tp=2 does not divide the model's kv heads \(1\)",
        ),
        (
            ["parallel=tp2", "model.config.intermediate_size=351"],
            2,
            r"parallel.tp=2 does not divide the model's intermediate_size \(351\)",
        ),
        (["parallel=tp2", *MOE], 2, r"parallel.tp=2 on a MoE model \(mixtral\) is not supported"),
        (["parallel.tp=2", "parallel.sp=2"], 4, r"parallel.sp=2 with parallel.tp=2 is not supported"),
        # sequence
        (["parallel.sp=3"], 3, r"parallel.sp=3 does not divide the model's attention heads \(4\)"),
        (["parallel=sp2", "data.seq_len=255"], 2, r"parallel.sp=2 does not divide data.seq_len=255"),
        (["parallel=sp2", "model.attn_implementation=eager"], 2, r"parallel.sp=2 needs model.attn_implementation=sdpa"),
        (["parallel=sp2", *MOE], 2, r"parallel.sp=2 with a MoE model \(mixtral\) is not supported"),
        # expert
        (["parallel=ep2", *MOE, "parallel.tp=2"], 4, r"parallel.tp=2 on a MoE model"),
        (["parallel=ep2", *MOE, "parallel.ep=4"], 2, r"parallel.ep=4 does not divide dp=2"),
        (
            ["parallel=ep2", *MOE, "parallel.ep=3", "data.global_batch=24"],
            3,
            r"parallel.ep=3 does not divide the model's 4 experts",
        ),
        (["parallel=ep2"], 2, r"parallel.ep=2 needs a MoE model, but model.type=llama has no experts"),
        (
            ["parallel=ep2", "model.type=qwen2_moe", "+model.config.num_experts=4"],
            2,
            r"parallel.ep=2 needs a DeepSpeed AutoEP preset, but model.type=qwen2_moe has none",
        ),
        # the world must hold the model-parallel product
        (["parallel=tp2"], 3, r"parallel.tp\*pp\*sp=2\*1\*1=2 does not divide the world size 3"),
    ],
)
def test_parallel_rule_raises_one_clear_error(overrides, world, match):
    with pytest.raises(ConfigError, match=match):  # a single key's range fails at compose, a rule at validate
        validate(compose(overrides), world)


@pytest.mark.parametrize(
    "overrides, world, dp",
    [
        (["parallel=pp2"], 2, 1),
        (["parallel=pp2"], 4, 2),
        (["parallel=tp2", "zero=stage2"], 4, 2),
        (["parallel=sp2", "zero=stage3"], 2, 1),
        (["parallel=ep2", *MOE, "zero=stage2"], 2, 2),
        (["parallel=ep2", *MOE, "zero=stage3"], 4, 4),
        (["recipe=cpu_smoke", "parallel.pp=2"], 2, 1),
        (["recipe=cpu_smoke", "parallel.tp=2"], 2, 1),
        (["recipe=cpu_moe", "parallel.ep=2"], 2, 2),
    ],
)
def test_valid_layouts_pass_and_build_json(overrides, world, dp):
    cfg = compose(overrides)
    d = validate(cfg, world)
    topo = d.topo
    assert topo.dp == dp
    ds = build_ds_config(cfg, d)
    # with AutoTP, DeepSpeed counts every rank of a tp group as a replica in its batch check
    replicas = dp * topo.tp
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * replicas
    assert ("tensor_parallel" in ds) == (topo.tp > 1)
    assert ("sequence_parallel_size" in ds) == (topo.sp > 1)
    assert ("expert_parallel" in ds) == (topo.ep > 1)
    if topo.ep > 1:
        assert ds["expert_parallel"] == {"enabled": True, "autoep_size": 2, "preset_model": "mixtral"}


def test_cli_rejects_invalid_layout_before_building(tmp_path):
    """The entry point turns the rule into `error: ...`, exit 2, with no engine or run dir created."""
    import subprocess
    import sys

    from tests.conftest import ROOT, TEST_ENV

    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "train.py", "parallel=pp2", "zero=stage3", f"output_dir={out}"],
        cwd=ROOT,
        env={**__import__("os").environ, **TEST_ENV, "WORLD_SIZE": "2"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: parallel.pp=2 needs zero.stage<=1 (got 3): use zero=stage1" in proc.stderr + proc.stdout
    assert not out.exists()


@pytest.mark.parametrize("key", ["zero_quantized_weights", "zero_quantized_gradients"])
def test_zero_plus_plus_is_refused_on_the_cpu_with_the_reason_and_built_for_gpus(key):
    """ZeRO++'s quantized collectives need CUDA kernels: on gloo they are refused at validation, not faked."""
    cfg = compose(["zero=stage3", f"zero.{key}=true"])
    with pytest.raises(ConfigError, match=rf"zero.{key}=true \(ZeRO\+\+\) needs CUDA.*set zero.{key}=false"):
        validate(cfg, 2, backend="gloo")
    from ultrascale.levers.deepspeed import build_ds_config

    d = validate(cfg, 2, backend="nccl")
    assert build_ds_config(cfg, d)["zero_optimization"][key] is True
