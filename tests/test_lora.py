"""``finetune=lora|qlora`` without a launch: the typed group, validation's one-line errors, the planner's memory
for adapters, and what the dry run and ``python train.py`` say."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest

from tests.conftest import run_py
from ultrascale.config.compose import compose
from ultrascale.errors import ConfigError
from ultrascale.levers.rules import validate


def test_the_finetune_group_is_typed():
    cfg = compose(["finetune=lora", "finetune.r=8", "finetune.target_modules=[q_proj,v_proj]"])
    assert cfg.finetune.method == "lora" and cfg.finetune.r == 8 and list(cfg.finetune.target_modules) == [
        "q_proj", "v_proj"]  # fmt: skip
    assert compose([]).finetune.method == "none"
    with pytest.raises(ConfigError, match=r"finetune\.rank"):
        compose(["finetune=lora", "finetune.rank=8"])
    with pytest.raises(ConfigError, match="lorra"):
        compose(["finetune.method=lorra"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model=smollm2_135m"], "finetune=lora needs model.pretrained_path (got null)"),
        (["parallel=pp2"], "finetune=lora needs parallel.pp=1 (got 2)"),
        (["parallel=tp2", "zero=stage2"], "finetune=lora needs parallel.tp=1 (got 2)"),
        (["optim=muon"], "finetune=lora with optim=muon is not supported"),
        (["finetune.target_modules=[]"], "adapts nothing"),
    ],
)
def test_validation_refuses_what_adapters_cannot_run(smollm2_135m, overrides, message):
    base = ["recipe=smollm2_135m_lora", f"model.pretrained_path={smollm2_135m}"]
    if overrides[0] == "model=smollm2_135m":
        base = ["finetune=lora"]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(compose([*base, *overrides]), 2, backend="gloo")


def test_qlora_on_cpu_is_one_error_line(smollm2_135m):
    cmd = [sys.executable, "train.py", "recipe=smollm2_135m_lora", "finetune=qlora",
           f"model.pretrained_path={smollm2_135m}", "output_dir=/tmp/never"]  # fmt: skip
    proc = run_py(cmd[1:], env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "finetune=qlora needs a CUDA GPU" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_planner_counts_gradients_and_adam_for_the_adapters_only(smollm2_135m):
    from ultrascale.cost.memory import model_state_bytes
    from ultrascale.model.adapters import planned_params
    from ultrascale.model.arch import arch_from_cfg
    from ultrascale.model.build import build_hf_config
    from ultrascale.plan.search import layout_from_cfg

    cfg = compose(["recipe=smollm2_135m_lora", f"model.pretrained_path={smollm2_135m}"])
    trainable, total = planned_params(build_hf_config(cfg.model), cfg.finetune)
    # rank 16 on q,k,v,o (576x576, 576x192 twice, 576x576) and gate, up, down (576x1536 thrice), 30 layers
    per_layer = 16 * ((576 + 576) * 2 + (576 + 192) * 2 + (576 + 1536) * 3)
    assert trainable == 30 * per_layer == 4_884_480
    assert total == 134_515_008 + trainable
    arch = arch_from_cfg(cfg.model)
    for stage in (0, 1, 2, 3):
        lay = replace(layout_from_cfg(cfg, 2), zero_stage=stage, global_batch=4)  # dp 2 x micro 2: no accumulation
        assert lay.trainable_params == trainable
        lora, full = model_state_bytes(arch, lay), model_state_bytes(arch, replace(lay, trainable_params=None))
        n = 1 if stage == 0 else 2
        assert lora["optimizer"] == pytest.approx((8 if stage == 0 else 12) * trainable / n)
        assert lora["grads"] == pytest.approx(4 * trainable / n)
        assert full["optimizer"] > 20 * lora["optimizer"]
        weights = 4 * (arch.total_params + trainable)
        assert lora["params"] == pytest.approx(weights if stage < 3 else full["params"] + 4 * trainable / 2)


def test_dry_run_prints_trainable_params_and_the_saving(smollm2_135m):
    cmd = [sys.executable, "train.py", "recipe=smollm2_135m_lora", f"model.pretrained_path={smollm2_135m}",
           "dry_run=true"]  # fmt: skip
    proc = run_py(cmd[1:], env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "trainable 4.88M of 139.40M params (3.50%)" in proc.stdout, proc.stdout[-3000:]
    assert "for a full fine-tune: saves" in proc.stdout
    assert "finetune   on  lora: r=16 alpha=32" in proc.stdout
