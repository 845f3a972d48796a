"""The SSD statistics layer (ultrascale/eval/stats.py) on planted per-problem results with known answers.

Every plant is built so that the tempting wrong implementation fails: an unseeded or order-dependent split,
a setting tuned on test, an unpaired bootstrap, an interval or p-value off by the tail convention.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from ultrascale.eval.passk import pass_at_k
from ultrascale.eval.stats import (
    choose_on_dev,
    compare_models,
    paired_bootstrap,
    per_problem_pass_at_k,
    report_on_test,
    split_dev_test,
)

IDS = [f"HumanEval/{i}" for i in range(164)]
N_BOOT = 4000  # enough for the tolerances below, small enough to stay well under a second per call


def _normal_ci(a: dict[str, float], b: dict[str, float], z: float = 1.959964) -> tuple[float, float, float]:
    """Observed paired difference and its normal-approximation interval (what the bootstrap should approach)."""
    d = np.array([b[t] - a[t] for t in IDS])
    se = d.std() / math.sqrt(len(d))
    return float(d.mean()), float(d.mean() - z * se), float(d.mean() + z * se)


def _planted_gain() -> tuple[dict[str, float], dict[str, float]]:
    """Base solves 30 % of the problems; new solves those plus 20 % more."""
    base = {t: 1.0 if i < 49 else 0.0 for i, t in enumerate(IDS)}
    new = {t: 1.0 if i < 49 + 33 else 0.0 for i, t in enumerate(IDS)}
    return base, new


# --- the dev/test split ----------------------------------------------------------------------------------------


def test_split_is_seeded_order_independent_disjoint_covering_and_half_half():
    split = split_dev_test(IDS, seed=0)
    assert split == split_dev_test(IDS, seed=0)
    shuffled = list(IDS)
    random.Random(123).shuffle(shuffled)
    assert split == split_dev_test(shuffled, seed=0)
    assert split == split_dev_test(list(reversed(IDS)), seed=0)
    assert split != split_dev_test(IDS, seed=1)

    dev, test = split["dev"], split["test"]
    assert type(dev) is list and type(test) is list
    assert not set(dev) & set(test)
    assert sorted(dev + test) == sorted(IDS)
    assert len(dev) == len(test) == 82
    # a real shuffle, not the first half of the sorted ids
    assert dev != sorted(IDS)[:82]


def test_split_odd_count_and_fraction():
    odd = split_dev_test([*IDS, "extra"], seed=3)
    assert abs(len(odd["dev"]) - len(odd["test"])) <= 1
    quarter = split_dev_test(IDS, seed=0, dev_fraction=0.25)
    assert len(quarter["dev"]) == 41 and len(quarter["test"]) == 123


def test_split_rejects_duplicates_and_bad_fraction():
    with pytest.raises(ValueError, match="HumanEval/3"):
        split_dev_test([*IDS, "HumanEval/3"])
    with pytest.raises(ValueError, match="dev_fraction"):
        split_dev_test(IDS, dev_fraction=1.0)


# --- per-problem scores ------------------------------------------------------------------------------------------


def test_per_problem_pass_at_1_is_c_over_n():
    results = {
        "p0": [True, False, False, False],
        "p1": [False] * 5,
        "p2": [True] * 3,
        "p3": [True, False, True, True, False, False, True, False, False, False],
    }
    scores = per_problem_pass_at_k(results)
    assert scores == pytest.approx({"p0": 1 / 4, "p1": 0.0, "p2": 1.0, "p3": 4 / 10}, abs=1e-12)
    # k > 1 goes through the unbiased estimator, not the pass rate
    assert per_problem_pass_at_k(results, k=2)["p3"] == pytest.approx(pass_at_k(10, 4, 2))
    assert per_problem_pass_at_k(results, k=2)["p3"] != pytest.approx(0.4)


# --- the paired bootstrap ---------------------------------------------------------------------------------------


def test_planted_gain_excludes_zero():
    base, new = _planted_gain()
    ci = paired_bootstrap(base, new, n_boot=N_BOOT)
    assert ci["diff"] == pytest.approx(33 / 164)
    assert 0 < ci["lo"] < ci["diff"] < ci["hi"]
    assert ci["excludes_zero"] is True
    assert ci["p_value"] < 0.001
    assert ci["n_problems"] == 164 and ci["n_boot"] == N_BOOT and ci["level"] == 0.95


def test_identical_models_give_zero_and_no_measurable_gain():
    scores = {t: (i % 7) / 6 for i, t in enumerate(IDS)}
    ci = paired_bootstrap(scores, dict(scores), n_boot=N_BOOT)
    assert ci["diff"] == 0.0
    assert ci["lo"] <= 0.0 <= ci["hi"]
    assert ci["excludes_zero"] is False
    assert ci["p_value"] == 1.0
    same = {"greedy": scores, "T=0.8": {t: v / 2 for t, v in scores.items()}}
    assert compare_models(same, same, split_dev_test(IDS), n_boot=N_BOOT)["verdict"] == "no measurable gain"


def test_swapping_models_flips_the_sign():
    base, new = _planted_gain()
    forward = paired_bootstrap(base, new, n_boot=N_BOOT, seed=5)
    backward = paired_bootstrap(new, base, n_boot=N_BOOT, seed=5)
    assert backward["diff"] == pytest.approx(-forward["diff"])
    assert backward["lo"] == pytest.approx(-forward["hi"])
    assert backward["hi"] == pytest.approx(-forward["lo"])
    assert backward["p_value"] == forward["p_value"]


def test_interval_and_p_value_match_the_normal_approximation():
    # 20 problems only the new model solves, 8 only the base solves: z ~ 2.3, a borderline but real gain
    base = {t: 1.0 if 20 <= i < 28 else 0.0 for i, t in enumerate(IDS)}
    new = {t: 1.0 if i < 20 else 0.0 for i, t in enumerate(IDS)}
    diff, lo, hi = _normal_ci(base, new)
    ci = paired_bootstrap(base, new, n_boot=10000)
    half = hi - diff
    assert ci["diff"] == pytest.approx(diff)
    # a 90 % interval (or one of the tails swapped) would be off by ~16 % of the half-width
    assert ci["lo"] == pytest.approx(lo, abs=0.08 * half)
    assert ci["hi"] == pytest.approx(hi, abs=0.08 * half)
    z = diff / (half / 1.959964)
    assert ci["p_value"] == pytest.approx(math.erfc(z / math.sqrt(2)), abs=0.006)  # two-sided ~0.021
    narrower = paired_bootstrap(base, new, n_boot=10000, level=0.8)
    assert ci["lo"] < narrower["lo"] < narrower["hi"] < ci["hi"]


def test_pairing_detects_a_small_consistent_gain_that_unpaired_cannot():
    # problem difficulty dominates: base scores spread over [0, 0.9]; new adds 0.05 on two problems in three
    base = {t: 0.9 * ((37 * i) % 164) / 163 for i, t in enumerate(IDS)}
    new = {t: base[t] + (0.05 if i % 3 else 0.0) for i, t in enumerate(IDS)}
    paired = paired_bootstrap(base, new, n_boot=N_BOOT)
    assert paired["diff"] == pytest.approx(0.05 * 109 / 164)
    assert paired["excludes_zero"] is True and paired["lo"] > 0.02

    # the same data resampled as two independent samples: the shared difficulty no longer cancels
    rng = np.random.default_rng(0)
    a, b = np.array([base[t] for t in IDS]), np.array([new[t] for t in IDS])
    ia, ib = rng.integers(0, 164, (N_BOOT, 164)), rng.integers(0, 164, (N_BOOT, 164))
    unpaired_lo, unpaired_hi = np.quantile(b[ib].mean(1) - a[ia].mean(1), [0.025, 0.975])
    assert unpaired_lo < 0 < unpaired_hi
    assert paired["hi"] - paired["lo"] < (unpaired_hi - unpaired_lo) / 5


def test_result_depends_on_the_problem_set_not_its_order():
    base, new = _planted_gain()
    ci = paired_bootstrap(base, new, problems=IDS, n_boot=N_BOOT)
    assert ci == paired_bootstrap(base, new, problems=list(reversed(IDS)), n_boot=N_BOOT)
    assert ci == paired_bootstrap(dict(reversed(base.items())), new, n_boot=N_BOOT)


def test_missing_problem_ids_are_named():
    base, new = _planted_gain()
    del new["HumanEval/7"]
    with pytest.raises(ValueError, match="HumanEval/7"):
        paired_bootstrap(base, new)
    with pytest.raises(ValueError, match="HumanEval/7"):
        paired_bootstrap(base, new, problems=IDS)
    with pytest.raises(ValueError, match="HumanEval/200"):
        paired_bootstrap(base, base, problems=[*IDS, "HumanEval/200"])
    with pytest.raises(ValueError, match="HumanEval/7"):
        choose_on_dev({"greedy": new}, IDS)


# --- choosing on dev, reporting on test ------------------------------------------------------------------------


def _dev_vs_test_settings(split: dict[str, list[str]]) -> dict[str, dict[str, float]]:
    """'T=0.2' is best on dev; 'T=1.0' is best on test and best overall: only a test-tuned choice picks it."""
    dev = set(split["dev"])
    return {
        "T=0.2": {t: 0.6 if t in dev else 0.2 for t in IDS},
        "T=1.0": {t: 0.4 if t in dev else 0.9 for t in IDS},
        "greedy": {t: 0.3 for t in IDS},
    }


def test_choose_on_dev_ignores_the_test_half():
    split = split_dev_test(IDS, seed=0)
    settings = _dev_vs_test_settings(split)
    chosen, dev_score = choose_on_dev(settings, split["dev"])
    assert (chosen, dev_score) == ("T=0.2", pytest.approx(0.6))
    assert report_on_test(settings, chosen, split["test"]) == pytest.approx(0.2)
    assert report_on_test(settings, "T=1.0", split["test"]) == pytest.approx(0.9)  # better, but not chosen
    with pytest.raises(ValueError, match="T=9"):
        report_on_test(settings, "T=9", split["test"])


def test_choose_on_dev_breaks_ties_by_name():
    flat = {t: 0.5 for t in IDS}
    assert choose_on_dev({"T=0.8": flat, "T=0.6": flat}, IDS)[0] == "T=0.6"
    assert choose_on_dev({"T=0.6": flat, "T=0.8": flat}, IDS)[0] == "T=0.6"


def test_compare_models_tunes_each_model_on_dev_and_reports_on_test():
    split = split_dev_test(IDS, seed=0)
    test = set(split["test"])
    base_gain, new_gain = _planted_gain()
    base = {"greedy": base_gain, "T=0.8": {t: v / 2 for t, v in base_gain.items()}}
    new = {"ckpt=step_40/T=0.6": new_gain, **_dev_vs_test_settings(split)}
    out = compare_models(base, new, split, n_boot=N_BOOT)
    assert out["base_setting"] == "greedy"
    # on dev the gain checkpoint (~0.5) loses to 'T=0.2' (0.6), though it beats it on test: dev decides
    new_dev_gain = np.mean([new_gain[t] for t in split["dev"]])
    assert new_dev_gain < 0.6
    assert np.mean([new_gain[t] for t in test]) > 0.2
    assert out["new_setting"] == "T=0.2" and out["new_dev"] == pytest.approx(0.6)
    assert out["new_test"] == pytest.approx(0.2)
    assert out["base_test"] == pytest.approx(np.mean([base_gain[t] for t in test]))
    assert out["ci"]["n_problems"] == len(test)
    assert out["ci"]["diff"] == pytest.approx(out["new_test"] - out["base_test"])


def test_compare_models_verdicts():
    split = split_dev_test(IDS, seed=0)
    base_gain, new_gain = _planted_gain()
    base, new = {"greedy": base_gain}, {"greedy": new_gain}
    gain = compare_models(base, new, split, n_boot=N_BOOT)
    assert gain["verdict"] == "gain" and gain["ci"]["lo"] > 0
    assert compare_models(new, base, split, n_boot=N_BOOT)["verdict"] == "loss"
    with pytest.raises(ValueError, match="unseen"):
        compare_models(base, new, {"dev": IDS[:100], "test": IDS[90:]}, n_boot=N_BOOT)
