"""The chunked linear cross-entropy: same loss and gradients as the plain path, without the full logits."""

from __future__ import annotations

import copy
import inspect
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import FAST, check, launch, losses
from ultrascale.model.loss import default_chunk_tokens, install_fused_loss, linear_cross_entropy, resolve_impl


def _case(n=300, h=64, v=1000, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.05).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::7] = -100
    return hidden, weight, labels


def _reference(hidden, weight, labels, reduction="mean"):
    """The plain path in fp32: full logits, F.cross_entropy, autograd."""
    h = hidden.detach().float().requires_grad_()
    w = weight.detach().float().requires_grad_()
    loss = F.cross_entropy(h @ w.t(), labels, reduction=reduction)
    return (loss.detach(), *torch.autograd.grad(loss, (h, w)))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk", [7, 60, 300, 4096])  # does not divide N, divides it, equals it, exceeds it
def test_loss_and_grads_equal_the_plain_path(reduction, chunk):
    hidden, weight, labels = _case()
    ref, ref_h, ref_w = _reference(hidden, weight, labels, reduction)
    got = linear_cross_entropy(hidden, weight, labels, chunk_tokens=chunk, reduction=reduction)
    grad_h, grad_w = torch.autograd.grad(got, (hidden, weight))
    scale = 1.0 if reduction == "mean" else float((labels != -100).sum())  # a sum is that many times larger
    assert got.dtype == torch.float32 and abs(got.item() - ref.item()) <= 1e-5 * scale
    torch.testing.assert_close(grad_h, ref_h, rtol=0, atol=1e-5)
    torch.testing.assert_close(grad_w, ref_w, rtol=0, atol=1e-5)


def test_default_chunk_is_a_byte_budget_and_matches():
    assert (
        default_chunk_tokens(49_152) == 170
        and default_chunk_tokens(4096) == 2048
        and default_chunk_tokens(10**9) == 1
        and default_chunk_tokens(4096, cpu=True) == 128
        and default_chunk_tokens(10**9, cpu=True) == 1
    )
    hidden, weight, labels = _case(n=5000, v=2000)  # CPU default chunk 128: 40 chunks, the last one short
    ref, ref_h, ref_w = _reference(hidden, weight, labels)
    got = linear_cross_entropy(hidden, weight, labels)
    got.backward()
    assert abs(got.item() - ref.item()) <= 1e-5
    torch.testing.assert_close(hidden.grad, ref_h, rtol=0, atol=1e-5)
    torch.testing.assert_close(weight.grad, ref_w, rtol=0, atol=1e-5)


def test_backward_scales_by_grad_output_and_runs_once():
    """Loss scaling (fp16) and gradient accumulation multiply the loss: the stored gradients follow."""
    hidden, weight, labels = _case()
    _, ref_h, ref_w = _reference(hidden, weight, labels)
    loss = linear_cross_entropy(hidden, weight, labels, chunk_tokens=64)
    (loss * 3.0).backward(retain_graph=True)
    torch.testing.assert_close(hidden.grad, 3 * ref_h, rtol=0, atol=3e-5)
    torch.testing.assert_close(weight.grad, 3 * ref_w, rtol=0, atol=3e-5)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_bf16_inputs_take_bf16_gemms_and_an_fp32_softmax():
    """bf16 hidden/weight (precision=bf16): the GEMMs run in bf16, as HF's lm_head does in a bf16 model, so the
    loss is HF's (bf16 logits, fp32 cross-entropy) to 1e-5 and fp32 math on the same numbers to bf16 rounding;
    the gradients come back in bf16, to bf16's precision."""
    hidden, weight, labels = _case(dtype=torch.bfloat16)
    ref, ref_h, ref_w = _reference(hidden, weight, labels)
    hf = F.cross_entropy((hidden.detach() @ weight.detach().T).float(), labels)
    got = linear_cross_entropy(hidden, weight, labels, chunk_tokens=64)
    got.backward()
    assert got.dtype == torch.float32 and abs(got.item() - hf.item()) <= 1e-5
    assert got.item() != ref.item() and abs(got.item() - ref.item()) <= 1e-3 * abs(ref.item())
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    for got_g, ref_g in ((hidden.grad, ref_h), (weight.grad, ref_w)):  # bf16 rounding of the whole gradient
        assert float((got_g.float() - ref_g).norm() / ref_g.norm()) < 2**-7


def test_fp16_loss_scale_is_applied_before_the_cast():
    """fp16 with a small head: the unscaled per-token gradients (~1e-7) would be fp16 subnormals; scaled by a
    loss scale of 2**16 first, as the plain path's autograd does, they keep fp16's relative precision."""
    hidden, weight, labels = _case(dtype=torch.float16)
    with torch.no_grad():
        weight.mul_(1e-3)
    _, ref_h, ref_w = _reference(hidden, weight, labels)
    assert ref_h.abs().max() < 1e-5  # tiny next to fp16's smallest normal (6.1e-5)
    (linear_cross_entropy(hidden, weight, labels, chunk_tokens=64) * 2.0**16).backward()
    assert hidden.grad.dtype == torch.float16
    torch.testing.assert_close(hidden.grad.float(), ref_h * 2.0**16, rtol=2**-10, atol=1e-3)
    torch.testing.assert_close(weight.grad.float(), ref_w * 2.0**16, rtol=2**-10, atol=1e-3)


def test_all_targets_ignored_is_zero_not_nan():
    for reduction in ("mean", "sum"):
        hidden, weight, labels = _case()
        labels[:] = -100
        loss = linear_cross_entropy(hidden, weight, labels, chunk_tokens=64, reduction=reduction)
        loss.backward()
        assert loss.item() == 0.0 and not hidden.grad.any() and not weight.grad.any()


def test_no_grad_frozen_weight_frozen_hidden_and_strided_input():
    hidden, weight, labels = _case()
    ref, ref_h, ref_w = _reference(hidden, weight, labels)
    with torch.no_grad():
        assert abs(float(linear_cross_entropy(hidden, weight, labels, chunk_tokens=64)) - ref.item()) <= 1e-5
    frozen_w = weight.detach()
    linear_cross_entropy(hidden, frozen_w, labels, chunk_tokens=64).backward()
    torch.testing.assert_close(hidden.grad, ref_h, rtol=0, atol=1e-5)
    frozen_h = hidden.detach()
    linear_cross_entropy(frozen_h, weight, labels, chunk_tokens=64).backward()
    torch.testing.assert_close(weight.grad, ref_w, rtol=0, atol=1e-5)
    # Non-contiguous: every other row of a wider buffer, and a transposed weight.
    wide = torch.randn(600, 64, requires_grad=True)
    strided = wide[::2]
    weight_t = weight.detach().t().contiguous().t().requires_grad_()
    assert not strided.is_contiguous() and not weight_t.is_contiguous()
    ref2, ref2_h, ref2_w = _reference(strided, weight_t, labels)
    got = linear_cross_entropy(strided, weight_t, labels, chunk_tokens=64)
    got.backward()
    assert abs(got.item() - ref2.item()) <= 1e-5
    torch.testing.assert_close(wide.grad[::2], ref2_h, rtol=0, atol=1e-5)
    torch.testing.assert_close(weight_t.grad, ref2_w, rtol=0, atol=1e-5)


def test_bad_arguments_are_refused():
    hidden, weight, labels = _case()
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(hidden, weight, labels, reduction="none")
    with pytest.raises(ValueError, match="labels"):
        linear_cross_entropy(hidden, weight, labels[:-1])
    with pytest.raises(ValueError, match="impl"):
        linear_cross_entropy(hidden, weight, labels, impl="triton")
    with pytest.raises(ValueError, match="CUDA"):  # the Triton kernels are never picked for CPU tensors
        linear_cross_entropy(hidden, weight, labels, impl="liger")
    assert resolve_impl("auto", "cpu") == "chunked"


# ---------------------------------------------------------------------------------------------------------------
# install_fused_loss on real HF models built from config


def _tiny(model_type, tied, vocab=500):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, vocab_size=vocab, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               tie_word_embeddings=tied, use_cache=False, bos_token_id=0, eos_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def _inputs(vocab=500, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, 40), generator=g)
    labels = ids.clone()
    labels[:, :5] = -100  # a masked prompt
    pos = torch.cat([torch.arange(25), torch.arange(15)]).repeat(2, 1)  # two packed documents per row
    return ids, labels, pos


@pytest.mark.parametrize(("model_type", "tied"), [("llama", True), ("llama", False), ("qwen2", False),
                                                  ("starcoder2", True)])  # fmt: skip
def test_installed_on_hf_models_matches_the_stock_forward(model_type, tied):
    stock = _tiny(model_type, tied)
    fused = copy.deepcopy(stock)
    keys = list(fused.state_dict())
    install_fused_loss(fused, chunk_tokens=24)
    assert list(fused.state_dict()) == keys and type(fused) is type(stock)
    assert (fused.get_output_embeddings().weight is fused.get_input_embeddings().weight) is tied
    ids, labels, pos = _inputs()
    a = stock(input_ids=ids, labels=labels, position_ids=pos)
    b = fused(input_ids=ids, labels=labels, position_ids=pos)
    assert b.logits is None and abs(a.loss.item() - b.loss.item()) < 1e-5
    # position_ids reach the decoder: without them (0..39 per row) the loss is a different number
    assert abs(b.loss.item() - fused(input_ids=ids, labels=labels).loss.item()) > 1e-4
    fused.zero_grad()
    a.loss.backward()
    b.loss.backward()
    for (name, p), q in zip(stock.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-5, msg=name)
    with torch.no_grad():  # without labels: the stock forward, logits and all
        torch.testing.assert_close(fused(input_ids=ids).logits, stock(input_ids=ids).logits, rtol=0, atol=0)


def test_installed_forward_keeps_hf_semantics():
    """num_items_in_batch, shift_labels, positional input_ids, return_dict=False, generate, deepcopy and
    gradient checkpointing behave as in the stock model."""
    stock = _tiny("llama", False)
    fused = copy.deepcopy(stock)
    install_fused_loss(fused, chunk_tokens=16)
    ids, labels, _ = _inputs()
    with torch.no_grad():
        for kw in ({"num_items_in_batch": torch.tensor(50)}, {"shift_labels": labels.roll(-2, dims=1)}):
            a = stock(input_ids=ids, labels=None if "shift_labels" in kw else labels, **kw)
            b = fused(input_ids=ids, labels=labels, **kw)
            if "shift_labels" in kw:  # HF computes no loss without labels; compare against its loss function
                a_loss = stock.loss_function(a.logits, labels, vocab_size=500, **kw)
            else:
                a_loss = a.loss
            assert abs(a_loss.item() - b.loss.item()) < 1e-5, kw
        assert abs(fused(ids, labels=labels).loss.item() - stock(ids, labels=labels).loss.item()) < 1e-5
        loss, logits = fused(input_ids=ids, labels=labels, return_dict=False)[:2]  # tuples: the stock path
        assert logits.shape == (2, 40, 500) and abs(loss.item() - stock(ids, labels=labels).loss.item()) < 1e-5
        assert inspect.signature(fused.forward) == inspect.signature(stock.forward)
        gen = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(fused.generate(ids[:, :8], **gen), stock.generate(ids[:, :8], **gen))
    twin = copy.deepcopy(fused)  # the copy's forward runs the copy, not the original
    assert twin.forward.__self__ is twin
    with torch.no_grad():
        twin.model.norm.weight.mul_(2)
        assert abs(twin(ids, labels=labels).loss.item() - fused(ids, labels=labels).loss.item()) > 1e-4
    install_fused_loss(fused)  # re-installing keeps the stock forward underneath
    assert fused.forward._ultrascale_plain is type(fused).forward
    for model in (stock, fused):  # activation checkpointing (train.activation_checkpointing) recomputes the decoder
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    a, b = stock(ids, labels=labels).loss, fused(ids, labels=labels).loss
    a.backward()
    b.backward()
    assert abs(a.item() - b.item()) < 1e-5
    for (name, p), q in zip(stock.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
def test_torch_compile_of_the_installed_forward():
    """train.compile + train.fused_loss: dynamo traces the chunk loop and the autograd.Function (minutes on CPU)."""
    stock = _tiny("llama", True)
    fused = copy.deepcopy(stock)
    install_fused_loss(fused, chunk_tokens=24)
    ids, labels, pos = _inputs()
    compiled = torch.compile(fused)
    for _ in range(2):  # the second call runs the cached graph
        fused.zero_grad()
        loss = compiled(input_ids=ids, labels=labels, position_ids=pos).loss
        loss.backward()
    ref = stock(input_ids=ids, labels=labels, position_ids=pos).loss
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-5
    for (name, p), q in zip(stock.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-5, msg=name)


def test_models_whose_loss_differs_stay_on_hf_cross_entropy():
    """The run's decision (levers.decide.loss_unfit) keeps them on HF's loss and says why in the banner: the fused
    path would silently drop the router loss or the logit transform. install_fused_loss acts on that decision."""
    from transformers import AutoConfig

    from ultrascale.config.compose import compose
    from ultrascale.config.topology import Topology
    from ultrascale.levers.decide import decide

    small = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2)  # fmt: skip
    cases = {
        "MoE: the forward adds the router loss": AutoConfig.for_model("mixtral", num_local_experts=2, **small),
        "gemma2 sets final_logit_softcapping=30.0": AutoConfig.for_model("gemma2", head_dim=8, **small),
        "granite sets logits_scaling=4.0": AutoConfig.for_model("granite", logits_scaling=4.0, **small),
        "model_type 'gpt2' is not verified": AutoConfig.for_model("gpt2", n_embd=32, n_layer=1, n_head=4),
        None: AutoConfig.for_model("llama", **small),  # the control: a verified plain-head model takes it
    }
    cfg = compose(["train.fused_loss=true"])
    for why, hf in cases.items():
        d = decide(cfg, Topology(world=1), hf, "gloo", None)
        if why is None:
            assert d.fused_loss.on and d.loss_kernel.value == "chunked", d.fused_loss
        else:
            assert not d.fused_loss.on and d.fused_loss.why.startswith(f"plain HF cross-entropy ({why}"), d.fused_loss
            assert not d.loss_kernel.on and d.loss_kernel.why == "off (no fused loss)"


def test_install_refuses_only_what_it_cannot_run_and_leaves_the_model_untouched():
    stock = _tiny("llama", False)
    stock.lm_head = torch.nn.Linear(64, 500, bias=True)  # a head the fused forward's ``hidden @ weight.T`` drops
    with pytest.raises(ValueError, match="llama's output head is Linear with a bias, not a bias-free Linear"):
        install_fused_loss(stock)
    with pytest.raises(ValueError, match="chunk_tokens=0 must be >= 1"):
        install_fused_loss(_tiny("llama", False), chunk_tokens=0)
    with pytest.raises(ValueError, match="impl='triton' is not one of"):
        install_fused_loss(_tiny("llama", False), impl="triton")
    assert "forward" not in stock.__dict__


# ---------------------------------------------------------------------------------------------------------------
# DeepSpeed, 2 ranks


@pytest.mark.dist
def test_deepspeed_zero1_zero3_fused_equals_plain(tmp_path):
    """Real deepspeed.initialize on 2 gloo ranks (tests/dist_scripts/fused_loss_zero.py): the ZeRO-3 head weight
    is partitioned and gathered for the fused loss through its external-parameter registration."""
    out = tmp_path / "rows"
    check(launch([str(out)], script="tests/dist_scripts/fused_loss_zero.py"))
    rows = [json.loads(line) for r in (0, 1) for line in Path(f"{out}.{r}").read_text().splitlines()]
    for r in (0, 1):  # every ZeRO-3 engine and process group is gone before interpreter exit (no SIGABRT there)
        assert json.loads(Path(f"{out}.{r}.exit").read_text()) == {"gloo_threads_after_shutdown": []}
    runs = {(r["stage"], r["tied"], r["mode"], r["rank"]): r for r in rows}
    assert len(runs) == 2 * 10
    for (stage, tied, mode, rank), row in runs.items():
        if mode == "plain":
            continue
        plain = runs[(stage, tied, "plain", rank)]
        assert row["losses"] == pytest.approx(plain["losses"], abs=1e-5), (stage, tied, mode, rank)
        assert row["grad_norms"] == pytest.approx(plain["grad_norms"], abs=1e-5), (stage, tied, mode, rank)
        assert row["losses"][-1] < row["losses"][0] - 0.1, "the loss must fall"
        if stage == 3:
            assert row["head_partitioned"] and row["head_registered"], (stage, tied, mode, rank)


@pytest.mark.dist
def test_trainer_zero3_fused_equals_plain(tiny_data, tmp_path):
    """Through train.py: train.fused_loss on and off give the same loss curve at ZeRO-3."""
    runs = {}
    for fused in ("true", "false"):
        out = tmp_path / f"fused_{fused}"
        check(launch([*FAST, "zero=stage3", f"train.fused_loss={fused}", f"data.path={tiny_data}",
                      f"output_dir={out}", "train.steps=4"]))  # fmt: skip
        runs[fused] = losses(out)
    for step, ref in runs["false"].items():
        assert runs["true"][step] == pytest.approx(ref, abs=1e-5), step
    assert runs["true"][4] < runs["true"][1]
