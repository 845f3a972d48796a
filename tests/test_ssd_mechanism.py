"""The SSD mechanism measurement (ultrascale/ssd/mechanism.py) on a tiny real model: per-position statistics are
right, the bins compare the same positions before and after, and sharpening shows up as less tail mass."""

from __future__ import annotations

import pytest
import torch

from ultrascale.ssd.mechanism import binned, plot, position_stats


def _tiny(seed: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).eval()


def test_position_stats_are_the_distributions_top1_entropy_and_tail():
    model = _tiny(0)
    rows = [torch.randint(0, 64, (12,)) for _ in range(3)]
    st = position_stats(model, rows, top_k=5)
    assert st["confidence"].shape == (3 * 11,)  # every predicted position of every row
    logits = model(input_ids=rows[0][None]).logits[0, 0].float()
    p = logits.softmax(-1)
    assert torch.isclose(st["confidence"][0], p.max())
    assert torch.isclose(st["entropy"][0], -(p * p.log()).sum(), atol=1e-5)
    assert torch.isclose(st["tail"][0], 1 - p.topk(5).values.sum(), atol=1e-6)


def test_a_sharpened_model_has_less_tail_mass_in_every_bin_and_the_plot_is_written(tmp_path):
    base = _tiny(0)
    sharp = _tiny(0)
    with torch.no_grad():  # the same model at a lower temperature: every distribution sharper, same ranking
        sharp.lm_head.weight.mul_(3.0)
    rows = [torch.randint(0, 64, (24,)) for _ in range(6)]
    b, n = position_stats(base, rows, 5), position_stats(sharp, rows, 5)
    bins = binned(b, n)
    assert sum(r["positions"] for r in bins) == 6 * 23
    filled = [r for r in bins if r["positions"]]
    assert filled and all(r["tail_new"] < r["tail_base"] and r["entropy_new"] < r["entropy_base"] for r in filled)
    for r in filled:  # the paired change is the difference of the means, with a standard error beside it
        assert r["tail_diff"] == pytest.approx(r["tail_new"] - r["tail_base"], abs=1e-6) and r["tail_diff"] < 0
        assert r["tail_diff_se"] >= 0 and r["entropy_diff_se"] >= 0
    same = binned(b, b)
    assert all(r["tail_diff"] == 0 and r["entropy_diff_se"] == 0 for r in same if r["positions"])
    assert plot(bins, tmp_path / "mechanism.png").stat().st_size > 10_000
