"""What a GRPO step generates on, and what the planner predicts of it, without ranks.

- The decode cost model: a decode step is the slower of its reads (weights + KV cache) against the bandwidth and its
  FLOPs against the matmul rate, plus a launch floor; prefill is paid once per prompt, not once per sample.
- ZeRO-3's rollout replica: refreshed whole or a decoder layer at a time, both equal to the merged LoRA policy; the
  planner picks layer-at-a-time when the whole gather does not fit and refuses a forced mode that cannot fit.
- The dry run of the GRPO recipe on a GPU cluster prints the predicted generation share.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.conftest import SMOLLM2
from ultrascale.config.compose import compose
from ultrascale.cost.decode import (
    DecodeRate,
    RolloutPlan,
    generate_time,
    kv_bytes_per_token,
    rollout_time,
    weight_bytes,
)
from ultrascale.errors import ConfigError
from ultrascale.levers.rules import validate
from ultrascale.model.arch import arch_from_hf
from ultrascale.runtime.gpu import GpuInfo

RECIPE = ["recipe=smollm2_135m_grpo", f"model.pretrained_path={SMOLLM2}"]


def _llama(layers: int = 4, tied: bool = True):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)  # fmt: skip


def test_a_decode_step_is_the_slower_of_its_reads_and_its_flops_plus_the_floor() -> None:
    arch = arch_from_hf(_llama())
    w, kv = weight_bytes(arch, "bf16"), kv_bytes_per_token(arch, "bf16")
    assert w == arch.total_params * 2  # tied: the head reads the embedding whole
    assert weight_bytes(arch_from_hf(_llama(tied=False)), "bf16") < arch_from_hf(_llama(tied=False)).total_params * 2
    assert kv == 2 * 4 * 2 * 16 * 2
    slow_mem = DecodeRate(bytes_per_s=1e6, flops_per_s=1e18, floor_s=0.0)
    one = generate_time(arch, rows=1, prompts=1, prompt_len=10, new_tokens=1, dtype="bf16", rate=slow_mem)
    assert one.bound == "memory" and one.decode_s == pytest.approx((w + 10 * kv) / 1e6)
    slow_flops = DecodeRate(bytes_per_s=1e18, flops_per_s=1e9, floor_s=0.0)
    assert generate_time(arch, 64, 8, 10, 4, "bf16", slow_flops).bound == "compute"
    floor = DecodeRate(1e18, 1e18, floor_s=1e-3)
    d = generate_time(arch, 8, 1, 10, 5, "bf16", floor)
    assert d.bound == "launch" and d.decode_s == pytest.approx(5e-3, rel=1e-6)
    # longer contexts read more cache: a later token costs more when memory-bound
    assert generate_time(arch, 8, 1, 500, 1, "bf16", slow_mem).decode_s > one.decode_s


def test_prefill_is_paid_once_per_prompt_and_waves_are_whole_groups() -> None:
    arch = arch_from_hf(_llama())
    rate = DecodeRate(1e18, 1e12, 0.0)
    four = generate_time(arch, rows=32, prompts=4, prompt_len=100, new_tokens=1, dtype="fp32", rate=rate)
    one = generate_time(arch, rows=8, prompts=1, prompt_len=100, new_tokens=1, dtype="fp32", rate=rate)
    assert four.prefill_s == pytest.approx(4 * one.prefill_s)  # G samples share their prompt's prefill
    plan = RolloutPlan(prompts=4, generations=8, batch=20, prompt_len=100, completion_len=16)
    r = rollout_time(arch, plan, "fp32", rate)  # 20 rows hold 2 whole groups: 2 waves of 16 rows
    wave = generate_time(arch, 16, 2, 100, 16, "fp32", rate)
    assert r.seconds == pytest.approx(2 * wave.seconds) and r.tokens == 4 * 8 * 16


def _gpu(gib: float) -> GpuInfo:
    return GpuInfo.from_cluster(SimpleNamespace(gpu_memory_gib=gib), "H100 SXM5 80GB")


def test_the_planner_gathers_the_replica_whole_when_it_fits_and_a_layer_at_a_time_when_not() -> None:
    z3 = [*RECIPE, "zero=stage3"]
    d = validate(compose(RECIPE), 2)
    assert d.rollout_weights.value == "module"
    assert validate(compose(z3), 2).rollout_weights.value == "whole"  # 0.5 GiB of fp32 weights on this host
    from ultrascale.cost.decode import gather_bytes, replica_bytes
    from ultrascale.cost.layout import layout_from_cfg
    from ultrascale.cost.memory import GIB, memory

    cfg = compose(z3)
    arch = arch_from_hf(d.hf_config)
    train = memory(arch, layout_from_cfg(cfg, 2)).total
    rep = replica_bytes(arch, "fp32", 16, 512)
    between = (train + rep + gather_bytes(arch, "fp32", whole=False) + 1e6) / GIB  # fits a layer, not the whole
    d_gpu = validate(cfg, 2, backend="nccl", gpu=_gpu(between))
    assert d_gpu.rollout_weights.value == "layer" and "the whole gather does not fit" in d_gpu.rollout_weights.why
    with pytest.raises(ConfigError) as e:
        validate(compose([*z3, "grpo.rollout_gather=whole"]), 2, backend="nccl", gpu=_gpu(between))
    assert "grpo.rollout_gather=whole under zero.stage=3 does not fit" in str(e.value)
    assert "grpo.rollout_gather=layer" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"grpo\.rollout_gather=layer under zero\.stage=3 does not fit"):
        validate(compose([*z3, "grpo.rollout_gather=layer"]), 2, backend="nccl", gpu=_gpu(train / GIB))


@pytest.mark.parametrize("layerwise", [False, True])
def test_the_replica_is_the_merged_lora_policy_gathered_whole_or_a_layer_at_a_time(layerwise: bool) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from ultrascale.train.grpo.rollout import Replica, _units

    torch.manual_seed(0)
    policy = get_peft_model(LlamaForCausalLM(_llama()), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for n, p in policy.named_parameters():
        if "lora_B" in n:
            p.data.normal_()  # a trained adapter: B != 0, so a missing merge shows
    rep = Replica(policy, layerwise=layerwise)
    ids = torch.randint(0, 1000, (2, 12))
    with torch.no_grad():
        want = policy(input_ids=ids).logits
        assert (want - policy.get_base_model().__class__(policy.config)(input_ids=ids).logits).abs().max() > 1e-3
        assert (rep.model(input_ids=ids).logits - want).abs().max() < 1e-5
        for n, p in policy.named_parameters():
            if "lora_A" in n:
                p.data.add_(1.0)  # the next step's adapter
        rep.sync(policy)
        assert (rep.model(input_ids=ids).logits - policy(input_ids=ids).logits).abs().max() < 1e-5
    units = _units([n for n, _ in policy.get_base_model().named_parameters()], layerwise)
    assert len(units) == (1 + 4 if layerwise else 1)


def test_the_dry_run_of_the_grpo_recipe_on_gpus_predicts_the_generation_share() -> None:
    from ultrascale.plan.dryrun import dry_run_text

    text = dry_run_text(compose([*RECIPE, "cluster=h100_8x", "precision=bf16"]))
    section = text.split("== GRPO step ==")[1].split("==")[0]
    assert "rollouts on the engine's module" in section
    assert "generation share" in section and "decode" in section and "tokens/s per GPU" in section
    assert "HumanEval dev prompts" in section
    cpu = dry_run_text(compose(RECIPE)).split("== GRPO step ==")[1].split("==")[0]
    assert "measured: gen_s" in cpu
