"""The chunked linear cross-entropy: same loss and gradients as the plain path, without the full logits."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import FAST, check, launch, losses
from ultrascale.model.loss import install_fused_loss, linear_cross_entropy


def _case(n=300, h=64, v=1000, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.05).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::7] = -100
    return hidden, weight, labels


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk", [7, 64, 300, 4096])  # does not divide N, divides it, equals it, exceeds it
def test_loss_and_grads_equal_the_plain_path(reduction, chunk):
    hidden, weight, labels = _case()
    ref = F.cross_entropy(hidden @ weight.t(), labels, reduction=reduction)
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    got = linear_cross_entropy(hidden, weight, labels, chunk_tokens=chunk, reduction=reduction)
    grads = torch.autograd.grad(got, (hidden, weight))
    scale = 1.0 if reduction == "mean" else float((labels != -100).sum())  # sums are N times larger
    assert abs(float(got) - float(ref)) <= 1e-5 * scale
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_bf16_inputs_accumulate_in_fp32():
    """bf16 hidden/weight: the chunk's logits are upcast, so the loss matches an fp32 reference to bf16 precision."""
    hidden, weight, labels = _case(dtype=torch.bfloat16)
    ref = F.cross_entropy(hidden.float() @ weight.float().t(), labels)
    got = linear_cross_entropy(hidden, weight, labels)
    assert got.dtype == torch.float32 and abs(float(got) - float(ref)) < 2e-2
    got.backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16


def test_all_targets_ignored_is_zero_not_nan():
    hidden, weight, labels = _case()
    labels[:] = -100
    loss = linear_cross_entropy(hidden, weight, labels)
    loss.backward()
    assert float(loss) == 0.0 and not hidden.grad.any() and not weight.grad.any()


def test_no_grad_and_frozen_weight():
    hidden, weight, labels = _case()
    with torch.no_grad():
        assert float(linear_cross_entropy(hidden, weight, labels)) == pytest.approx(
            float(F.cross_entropy(hidden @ weight.t(), labels)), abs=1e-5
        )
    weight.requires_grad_(False)
    linear_cross_entropy(hidden, weight, labels).backward()
    assert hidden.grad is not None and weight.grad is None


@pytest.mark.parametrize(("model_type", "tied"), [("llama", True), ("llama", False), ("qwen2", False),
                                                  ("starcoder2", True)])  # fmt: skip
def test_installed_on_hf_models_matches_the_stock_forward(model_type, tied):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                               use_cache=False, bos_token_id=0, eos_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(cfg)
    fused = copy.deepcopy(stock)
    keys = list(fused.state_dict())
    assert install_fused_loss(fused) is True
    assert list(fused.state_dict()) == keys and type(fused) is type(stock)
    ids = torch.randint(0, 500, (2, 40))
    labels = ids.clone()
    labels[:, :5] = -100  # a masked prompt
    pos = torch.arange(40).repeat(2, 1)
    a, b = stock(input_ids=ids, labels=labels, position_ids=pos), fused(input_ids=ids, labels=labels, position_ids=pos)
    assert b.logits is None and abs(float(a.loss) - float(b.loss)) < 1e-5
    a.loss.backward()
    b.loss.backward()
    for (name, p), q in zip(stock.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-5, msg=name)
    with torch.no_grad():  # without labels: the stock forward, logits and all
        torch.testing.assert_close(fused(input_ids=ids).logits, stock(input_ids=ids).logits, rtol=0, atol=0)


def test_moe_and_softcapped_heads_keep_the_plain_path():
    from transformers import AutoConfig, AutoModelForCausalLM

    moe = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "mixtral", vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1))  # fmt: skip
    assert install_fused_loss(moe) is False
    capped = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "gemma2", vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8))  # fmt: skip
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        install_fused_loss(capped)


@pytest.mark.dist
def test_zero3_two_ranks_fused_equals_plain(tiny_data, tmp_path):
    """ZeRO-3 partitions the head's weight; registered as external, it is gathered for the fused loss."""
    runs = {}
    for fused in ("true", "false"):
        out = tmp_path / f"fused_{fused}"
        check(launch([*FAST, "zero=stage3", f"train.fused_loss={fused}", f"data.path={tiny_data}",
                      f"output_dir={out}", "train.steps=4"]))  # fmt: skip
        runs[fused] = losses(out)
    for step, ref in runs["false"].items():
        assert runs["true"][step] == pytest.approx(ref, abs=1e-5), step
    assert runs["true"][4] < runs["true"][1]
