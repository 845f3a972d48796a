"""The statistics behind an SSD before/after claim: a fixed dev/test split, per-problem scores, a paired bootstrap.

HumanEval has 164 problems, so a 2-point change in pass@1 is about three problems: noise of that size is easy to
read as a gain. Three habits keep the claim honest: settings are chosen on a ``dev`` half of the problems and
reported on the ``test`` half only (``split_dev_test``, ``choose_on_dev``, ``report_on_test``); scores are kept
per problem (``per_problem_pass_at_k``), because the uncertainty comes from which problems happened to be in the
benchmark; and the two models are compared with a *paired* bootstrap over problems (``paired_bootstrap``): both
see the same problems, and problem difficulty dominates the variance of either score, so resampling the
per-problem differences cancels it and leaves the variance of the change itself. ``compare_models`` chains all
three and states a verdict only where the interval excludes zero.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ultrascale.eval.passk import pass_at_k

NO_GAIN = "no measurable gain"
"""The verdict when the interval holds 0: a measured change, not a demonstrated one."""


def split_dev_test(task_ids: Sequence[str], seed: int = 0, dev_fraction: float = 0.5) -> dict[str, list[str]]:
    """Split problems once into ``dev`` (for choosing settings) and ``test`` (for reporting), by seed.

    Sorting before the seeded shuffle makes the split a function of the id *set* and the seed alone, so any
    run that loads the problems in any order, on any machine, lands on the same halves and its test numbers
    stay comparable with every other run's. Both halves come back sorted, as plain lists, to be written into
    a run's record as they are.
    """
    ids = [str(t) for t in task_ids]
    if len(set(ids)) != len(ids):
        dupes = sorted(t for t, n in Counter(ids).items() if n > 1)
        raise ValueError(f"duplicate task ids {dupes[:10]}: each problem must appear once to be split")
    if not 0.0 < dev_fraction < 1.0:
        raise ValueError(f"dev_fraction={dev_fraction} must lie strictly between 0 and 1: both halves need problems")
    if len(ids) < 2:
        raise ValueError(f"need at least 2 problems to split into dev and test, got {len(ids)}")
    order = sorted(ids)
    random.Random(seed).shuffle(order)
    n_dev = min(max(round(len(order) * dev_fraction), 1), len(order) - 1)
    return {"dev": sorted(order[:n_dev]), "test": sorted(order[n_dev:])}


def per_problem_pass_at_k(results: Mapping[str, Sequence[bool]], k: int = 1) -> dict[str, float]:
    """Unbiased pass@k of each problem, keyed by task id: the unit the bootstrap resamples.

    Keeping one score per problem (instead of the benchmark mean) is what lets the two models be paired on
    the same problem and lets dev and test be scored separately from one set of samples.
    """
    return {task: pass_at_k(len(samples), sum(bool(x) for x in samples), k) for task, samples in results.items()}


def _check_unique(problems: Sequence[str], what: str) -> list[str]:
    ids = list(problems)
    if not ids:
        raise ValueError(f"no {what} problems to score")
    if len(set(ids)) != len(ids):
        dupes = sorted(t for t, n in Counter(ids).items() if n > 1)
        raise ValueError(f"duplicate {what} problem ids {dupes[:10]}: a repeated problem would count twice")
    return ids


def _scores(scores: Mapping[str, float], problems: Sequence[str], name: str) -> np.ndarray:
    missing = [p for p in problems if p not in scores]
    if missing:
        raise ValueError(f"{name} has no score for {len(missing)} problem(s): {missing[:10]}")
    values = np.array([float(scores[p]) for p in problems], dtype=np.float64)
    if not np.all(np.isfinite(values)):
        bad = [p for p, v in zip(problems, values) if not np.isfinite(v)]
        raise ValueError(f"{name} has non-finite scores for {bad[:10]}")
    return values


def paired_bootstrap(
    a: Mapping[str, float],
    b: Mapping[str, float],
    problems: Sequence[str] | None = None,
    n_boot: int = 10000,
    seed: int = 0,
    level: float = 0.95,
) -> dict:
    """Percentile interval and two-sided p for ``mean(b) - mean(a)`` (``b`` the new model, ``a`` the baseline).

    Each resample draws problems with replacement and takes *both* models' scores on the drawn problems, so
    the per-problem difficulty they share cancels: a small change that holds on most problems is detected
    even when either model's own mean is far too noisy to separate them. ``problems`` defaults to the keys,
    which must then be the same in ``a`` and ``b``; it is sorted so the result depends only on the set of
    problems and the seed. ``p_value`` is the share of resampled differences at or beyond 0 on the side
    opposite the observed one, doubled and capped at 1; its resolution is ``1 / n_boot`` (0 means fewer
    than that). Every value is a plain float/int/bool, ready for a JSON record.
    """
    if problems is None:
        only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
        if only_a or only_b:
            raise ValueError(
                f"the two models were scored on different problems: only in a {only_a[:10]}, only in b {only_b[:10]}"
            )
        problems = list(a)
    ids = sorted(_check_unique(problems, "bootstrap"))
    if n_boot < 1:
        raise ValueError(f"n_boot={n_boot} must be at least 1")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level={level} must lie strictly between 0 and 1")
    diffs = _scores(b, ids, "b") - _scores(a, ids, "a")
    observed = float(diffs.mean())
    rng = np.random.default_rng(seed)
    index = rng.integers(0, len(ids), size=(n_boot, len(ids)))
    boot = diffs[index].mean(axis=1)
    alpha = 1.0 - level
    lo, hi = (float(x) for x in np.quantile(boot, [alpha / 2, 1 - alpha / 2]))
    if observed > 0:
        p = 2.0 * float(np.mean(boot <= 0))
    elif observed < 0:
        p = 2.0 * float(np.mean(boot >= 0))
    else:
        p = 1.0
    return {
        "diff": observed,
        "lo": lo,
        "hi": hi,
        "level": float(level),
        "n_problems": len(ids),
        "n_boot": int(n_boot),
        "seed": int(seed),
        "p_value": min(p, 1.0),
        "excludes_zero": bool(lo > 0 or hi < 0),
    }


def choose_on_dev(
    per_setting: Mapping[str, Mapping[str, float]],
    dev: Sequence[str],
    prefer: Callable[[str], Any] | None = None,
) -> tuple[str, float]:
    """The setting with the best mean score over the ``dev`` problems, and that dev score.

    Only dev problems are read, so the setting is picked without looking at the test half and the test
    number that follows is an unbiased estimate of the chosen setting (picking the best of several settings
    on the reporting set inflates it). Ties go to the smallest ``prefer(setting)`` (the caller's order of
    preference: greedy first, since it is one sample per problem and gives the same answer every time), then
    to the first name in sort order, so the choice never depends on dict order.
    """
    if not per_setting:
        raise ValueError("no settings to choose from")
    ids = _check_unique(dev, "dev")
    best: tuple[str, float] | None = None
    for setting in sorted(per_setting, key=lambda s: (prefer(s), s) if prefer else s):
        score = float(_scores(per_setting[setting], ids, f"setting {setting!r}").mean())
        if best is None or score > best[1]:
            best = (setting, score)
    assert best is not None
    return best


def report_on_test(per_setting: Mapping[str, Mapping[str, float]], chosen: str, test: Sequence[str]) -> float:
    """Mean score of the ``chosen`` setting over the ``test`` problems: the number to report.

    It takes the setting as given (from ``choose_on_dev``) and never compares settings, which is what keeps
    the test half out of the tuning.
    """
    if chosen not in per_setting:
        raise ValueError(f"setting {chosen!r} was not scored; scored settings: {sorted(per_setting)}")
    return float(_scores(per_setting[chosen], _check_unique(test, "test"), f"setting {chosen!r}").mean())


def verdict_of(ci: Mapping[str, float]) -> str:
    """``gain`` or ``loss`` only where the interval excludes zero; otherwise :data:`NO_GAIN`."""
    if ci["lo"] > 0:
        return "gain"
    if ci["hi"] < 0:
        return "loss"
    return NO_GAIN


def compare_models(
    base: Mapping[str, Mapping[str, float]],
    new: Mapping[str, Mapping[str, float]],
    split: dict,
    n_boot: int = 10000,
    seed: int = 0,
    level: float = 0.95,
) -> dict:
    """Before/after on held-out problems: each model tuned on dev independently, compared on test, paired.

    Each model gets its own best setting on dev, so neither is handicapped by the other's sampling settings
    (a finetuned model often prefers a different temperature). ``verdict`` is ``"gain"`` or ``"loss"`` only
    when the paired interval on test excludes 0, and ``"no measurable gain"`` otherwise, so a summary line
    cannot claim more than the interval supports.
    """
    dev, test = list(split["dev"]), list(split["test"])
    overlap = sorted(set(dev) & set(test))
    if overlap:
        raise ValueError(f"dev and test share {len(overlap)} problem(s) {overlap[:10]}: the test half must be unseen")
    base_setting, base_dev = choose_on_dev(base, dev)
    new_setting, new_dev = choose_on_dev(new, dev)
    ci = paired_bootstrap(base[base_setting], new[new_setting], problems=test, n_boot=n_boot, seed=seed, level=level)
    return {
        "base_setting": base_setting,
        "new_setting": new_setting,
        "base_dev": base_dev,
        "new_dev": new_dev,
        "base_test": report_on_test(base, base_setting, test),
        "new_test": report_on_test(new, new_setting, test),
        "ci": ci,
        "verdict": verdict_of(ci),
    }
