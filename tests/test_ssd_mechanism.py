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
    for r in filled:  # the paired change is the difference of the means (its SE: the test below)
        assert r["tail_diff"] == pytest.approx(r["tail_new"] - r["tail_base"], abs=1e-6) and r["tail_diff"] < 0
    same = binned(b, b)
    assert all(r["tail_diff"] == 0 and r["entropy_diff_se"] == 0 for r in same if r["positions"])
    assert plot(bins, tmp_path / "mechanism.png").stat().st_size > 10_000


def test_the_paired_standard_error_is_the_sample_sd_of_the_per_position_differences_over_root_n():
    """Pinned by hand: a bin's SE is stdev(new - base) / sqrt(n) over its positions (n - 1 in the variance), not
    the SE of two independent means (the positions are the same in both models, so their level cancels) and not
    the population SD; a bin of one position has no spread to measure and reports 0."""
    import math
    import statistics

    f = torch.tensor
    base = {"confidence": f([0.10, 0.15, 0.96, 0.97, 0.98, 0.50]), "entropy": f([1.0, 2.0, 0.10, 0.20, 0.40, 1.5]),
            "tail": f([0.30, 0.50, 0.010, 0.020, 0.040, 0.2])}  # fmt: skip
    new = {"confidence": base["confidence"], "entropy": f([1.1, 2.1, 0.10, 0.25, 0.30, 1.0]),
           "tail": f([0.25, 0.40, 0.008, 0.010, 0.045, 0.3])}  # fmt: skip
    rows = {r["lo"]: r for r in binned(base, new)}
    fork, lock, one = rows[0.0], rows[0.95], rows[0.4]
    assert (fork["positions"], lock["positions"], one["positions"]) == (2, 3, 1)
    by_hand = {  # (bin, key): the differences of its positions, typed out
        (0.0, "entropy"): [0.1, 0.1], (0.0, "tail"): [-0.05, -0.10],
        (0.95, "entropy"): [0.0, 0.05, -0.10], (0.95, "tail"): [-0.002, -0.010, 0.005],
    }  # fmt: skip
    for (lo, key), d in by_hand.items():
        assert rows[lo][f"{key}_diff"] == pytest.approx(statistics.fmean(d), abs=1e-6)
        assert rows[lo][f"{key}_diff_se"] == pytest.approx(statistics.stdev(d) / math.sqrt(len(d)), rel=1e-4, abs=1e-7)
    assert rows[0.0]["entropy_diff_se"] == pytest.approx(0.0, abs=1e-6)  # a constant shift is measured exactly
    assert rows[0.95]["entropy_diff_se"] == pytest.approx(0.04409585518440985, rel=1e-4)  # sqrt(0.005833/3)
    assert one["entropy_diff"] == pytest.approx(-0.5) and one["entropy_diff_se"] == 0.0 and one["tail_diff_se"] == 0.0
