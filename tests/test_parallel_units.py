"""Single-process checks of the parallelism building blocks on real tiny HF models (no ranks needed)."""

from __future__ import annotations

import pytest
import torch

from ultrascale.model.pipeline import DecoderPipe, EmbedPipe, HeadPipe, NormPipe, causal_lm_loss, tied_head
from ultrascale.model.sequence import shard

SMALL = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    bos_token_id=0,
    eos_token_id=1,
)


@pytest.mark.parametrize(
    "model_type, extra",
    [
        ("llama", {"tie_word_embeddings": True}),
        ("qwen2", {}),
        ("qwen3", {}),
        ("mistral", {"sliding_window": 8}),  # window < seq: the sliding mask must reach every stage
        ("starcoder2", {"sliding_window": 8}),
    ],
)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_pipeline_layers_compute_the_hf_model(model_type, extra, attn, tmp_path):
    """Chaining the pipe layers (what the stages run), each made the way a stage makes it (from the meta
    skeleton, its tensors read by HF name from safetensors), gives HF's own logits and loss."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ultrascale.model.pipeline import StageBuild, meta_skeleton
    from ultrascale.model.weights import SafetensorsWeights

    cfg = AutoConfig.for_model(model_type, **SMALL, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    ref = model(input_ids=ids, labels=ids)
    skel = meta_skeleton(cfg, attn)
    build = StageBuild(skel._init_weights, seed=0, weights=SafetensorsWeights(tmp_path))
    embed = EmbedPipe(build, skel.model.embed_tokens).eval()
    x = embed(ids)
    for i, layer in enumerate(skel.model.layers):
        x = DecoderPipe(build, layer, skel.model.rotary_emb, skel.config, i).eval()(x)
    hidden = NormPipe(build, skel.model.norm)(x)
    if cfg.tie_word_embeddings:
        logits = tied_head(embed, hidden)
    else:
        logits = HeadPipe(build, skel.lm_head)(hidden)
    torch.testing.assert_close(logits, ref.logits, rtol=0, atol=1e-5)
    assert abs(float(causal_lm_loss(logits, ids).detach()) - float(ref.loss.detach())) < 1e-5


def test_sequence_shards_keep_every_target():
    """Labels are shifted before slicing: the shard boundary token is still predicted, the last is not."""
    from ultrascale.data.loader import make_batch

    ids = torch.arange(16).reshape(2, 8)
    parts = [shard(make_batch(ids.numpy(), None, None, False), sp=2, sp_rank=r) for r in range(2)]
    local = torch.cat([p[0] for p in parts], dim=1)
    pos = torch.cat([p[1] for p in parts], dim=1)
    labels = torch.cat([p[2] for p in parts], dim=1)
    assert torch.equal(local, ids)
    assert torch.equal(pos, torch.arange(8).expand(2, -1))
    assert torch.equal(labels[:, :-1], ids[:, 1:])
    assert (labels[:, -1] == -100).all()
    assert parts[0][2][0, -1] == ids[0, 4]  # rank 0's last position predicts rank 1's first token


def test_moe_stats_from_a_real_mixtral_forward():
    """Expert shares sum to 1 per layer, max/mean load >= 1, and the logged loss is HF's minus the aux term."""
    from omegaconf import OmegaConf
    from transformers import MixtralConfig, MixtralForCausalLM

    from ultrascale.model.moe import MoEStats, is_moe, prepare_moe

    cfg = MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0)
    torch.manual_seed(0)
    model = MixtralForCausalLM(cfg)
    assert is_moe(model)
    moe_cfg = OmegaConf.create({"aux_loss_coef": 0.05, "top_k": 2})
    desc = prepare_moe(model, moe_cfg, "4 experts per layer, replicated", leaf_modules=False)
    assert desc == "4 experts per layer, replicated, top-2, router aux loss x 0.05"
    stats = MoEStats(model, OmegaConf.create({"top_k": 2, "aux_loss_coef": 0.05, "capacity_factor": 1.0}))
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(2))
    out = model(input_ids=ids, labels=ids)
    lm = stats.observe(out)
    plain = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 97), ids[:, 1:].reshape(-1))
    assert abs(float(lm) - float(plain)) < 1e-5
    assert float(out.loss) > float(lm)  # the aux term is in what we backpropagate
    m = stats.flush()
    assert m["moe/aux_loss_coef"] == 0.05 and m["moe/aux_loss"] > 0
    for layer in range(2):
        assert sum(m[f"moe/L{layer}/e{e}"] for e in range(4)) == pytest.approx(1.0)
        assert m[f"moe/L{layer}/max_load"] >= 1.0
    assert 0.0 <= m["moe/over_capacity_frac"] < 1.0
    assert stats.flush() == {}  # flushed: the next step starts from zero
