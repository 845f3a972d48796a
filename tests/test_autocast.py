"""``precision.autocast=bf16``: the forward's matmuls run in bf16 over fp32 weights, gradients and Adam (the
fused loss's GEMMs too, its softmax in fp32), and it is off, with the reason, where the CPU would only emulate
bf16."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import FAST, check, launch, losses
from ultrascale.model.autocast import install_autocast
from ultrascale.model.loss import install_fused_loss
from ultrascale.runtime.cpu import detect


def _tiny(seed: int = 0):
    from ultrascale.model.build import build_model

    cfg = OmegaConf.create({"type": "llama", "name": "t", "pretrained_path": None, "init_seed": None,
                            "attn_implementation": "sdpa",
                            "config": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                                       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                       "max_position_embeddings": 128}})  # fmt: skip
    return build_model(cfg, seed=seed)


def _step(model, ids):
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("fused", [False, True], ids=["plain_loss", "fused_loss"])
def test_bf16_matmuls_over_fp32_weights_give_the_fp32_loss_and_gradients(fused):
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    ref, cast = _tiny(), _tiny()
    if fused:
        install_fused_loss(ref, chunk_tokens=32)
        install_fused_loss(cast, chunk_tokens=32)
    install_autocast(cast, "cpu", "bf16")
    seen = []
    cast.model.layers[0].mlp.up_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    ref_loss, ref_grads = _step(ref, ids)
    loss, grads = _step(cast, ids)
    assert seen == [torch.bfloat16]  # the Linear really ran in bf16
    assert loss.dtype == torch.float32 and all(p.dtype == torch.float32 for p in cast.parameters())
    assert all(g.dtype == torch.float32 for g in grads.values())
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-2)  # bf16 rounding, not a different loss
    for name, g in grads.items():
        cos = torch.nn.functional.cosine_similarity(g.flatten(), ref_grads[name].flatten(), dim=0)
        assert cos > 0.98, (name, float(cos))


def test_the_fused_loss_follows_autocast_like_hfs_head():
    """Under autocast the chunked loss's GEMMs run in bf16 (HF's lm_head does under autocast), its softmax and
    accumulation in fp32: loss and gradients are those of HF's autocast path (bf16 logits, fp32 cross-entropy),
    fp32 in dtype, and not fp32's bits (the bf16 GEMM really ran)."""
    from ultrascale.model.loss import linear_cross_entropy

    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(96, 64, generator=g), torch.randn(512, 64, generator=g) * 0.05
    labels = torch.randint(0, 512, (96,), generator=g)

    def run(fused: bool, cast: bool):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cast):
            if fused:
                loss = linear_cross_entropy(h, w, labels, chunk_tokens=32)
            else:
                loss = torch.nn.functional.cross_entropy((h @ w.T).float(), labels)
        loss.backward()
        return loss, h.grad, w.grad

    fp32, hf_cast, ours = run(True, False), run(False, True), run(True, True)
    assert all(t.dtype == torch.float32 for t in ours)
    assert float(ours[0]) != float(fp32[0]) and float(ours[0]) == pytest.approx(float(fp32[0]), rel=1e-2)
    torch.testing.assert_close(ours[0], hf_cast[0], rtol=1e-5, atol=1e-6)
    for mine, ref in zip(ours[1:], hf_cast[1:]):
        torch.testing.assert_close(mine, ref, rtol=2e-2, atol=2e-4)
    # bf16 weights (precision=bf16, no autocast): the same bf16 GEMMs, gradients returned in the weights' dtype
    h16, w16 = hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    loss16 = linear_cross_entropy(h16, w16, labels, chunk_tokens=32)
    loss16.backward()
    assert loss16.dtype == torch.float32 and h16.grad.dtype == w16.grad.dtype == torch.bfloat16
    ref16 = torch.nn.functional.cross_entropy((h16.detach() @ w16.detach().T).float(), labels)
    torch.testing.assert_close(loss16.detach(), ref16, rtol=1e-5, atol=1e-6)


def test_off_where_the_cpu_has_no_native_bf16_and_refused_over_16_bit_weights():
    from ultrascale.config.compose import compose
    from ultrascale.config.topology import Topology
    from ultrascale.errors import ConfigError
    from ultrascale.levers.decide import decide
    from ultrascale.levers.rules import validate
    from ultrascale.model.build import build_hf_config
    from ultrascale.runtime.cpu import CpuInfo

    amx, zen3 = CpuInfo(flags=frozenset({"amx_bf16", "avx512f"})), CpuInfo(flags=frozenset({"avx2", "fma"}))
    cfg = compose(["precision.autocast=bf16"])
    hf, topo = build_hf_config(cfg.model), Topology(world=1)
    assert decide(cfg, topo, hf, "gloo", amx).autocast.on
    off = decide(cfg, topo, hf, "gloo", zen3).autocast
    assert not off.on and "no native bf16" in off.why
    emulated = decide(compose(["precision.autocast=bf16", "precision.autocast_emulated=true"]), topo, hf, "gloo",
                      zen3).autocast  # fmt: skip
    assert emulated.on and emulated.value == ("cpu", "bf16") and "emulated" in emulated.why
    with pytest.raises(ConfigError, match=r"precision\.autocast=bf16 needs precision\.dtype=fp32"):
        validate(compose(["precision=bf16", "precision.autocast=bf16"]), 1)


def _autocast_line(proc) -> str:
    """The banner's autocast decision, as rank 0 printed it."""
    return next(ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip().startswith("autocast "))


@pytest.mark.dist
def test_two_ranks_train_under_autocast_like_fp32(tiny_data, tmp_path):
    """ZeRO-1 on 2 ranks. Autocast on (natively, or emulated where the CPU has no bf16): the banner says so, the
    losses are not fp32's bits (it really ran in bf16) yet follow them and fall; the ranks agree (``check``).
    On a CPU without native bf16 the plain request must be off, say why, and train fp32's exact losses."""
    native = detect().bf16_native
    runs, lines = {}, {}
    arms = {"fp32": [], "autocast": ["precision.autocast=bf16"]}
    if not native:
        arms["emulated"] = ["precision.autocast=bf16", "precision.autocast_emulated=true"]
    for name, extra in arms.items():
        out = tmp_path / name
        proc = check(launch([*FAST, "model.config.vocab_size=257", f"data.path={tiny_data}", f"output_dir={out}",
                             "train.steps=8", *extra]))  # fmt: skip
        runs[name], lines[name] = losses(out), _autocast_line(proc)
    assert "off (precision.autocast=none)" in lines["fp32"], lines
    assert ("precision.autocast=bf16 puts the matmuls on" in lines["fp32"]) == native, lines  # the hint, where it helps
    on = "autocast" if native else "emulated"
    assert "bf16 autocast of the forward on cpu" in lines[on], lines
    if not native:
        assert "off: this CPU has no native bf16" in lines["autocast"], lines
        assert runs["autocast"] == runs["fp32"], runs  # off means off: fp32, bit for bit
    assert runs[on][8] < runs[on][1] - 0.3, runs
    assert runs[on] != runs["fp32"], "the bf16 run gave fp32's exact losses: autocast did not run"
    for step, ref in runs["fp32"].items():
        assert runs[on][step] == pytest.approx(ref, rel=2e-2), (step, runs)
