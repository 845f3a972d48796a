"""Inference-aware budgeting (ultrascale/cost/budget.py, plan.py budget=...): the arithmetic against values worked
out by hand here, the optimum against a brute-force search, Sardana et al. 2024's own example, and the CLI."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from ultrascale.config.compose import compose
from ultrascale.cost.budget import (
    Costing,
    ScalingLaw,
    budget_from_cfg,
    chinchilla_for_loss,
    chinchilla_optimal,
    inference_aware_optimal,
    min_loss_at_cost,
)
from ultrascale.errors import ConfigError
from ultrascale.paths import PROJECT_ROOT

# Hoffmann et al. 2022, eq. 10 as printed; the same fit unrounded (TeX source, Besiroglu et al. 2024 eq. 4);
# Epoch AI's refit (Besiroglu et al. 2024 eq. 3).
PRINTED = ScalingLaw(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28, name="printed")
HOFFMANN = ScalingLaw(E=1.6934, A=406.4, B=410.7, alpha=0.3392, beta=0.2849, name="hoffmann")
BESIROGLU = ScalingLaw(E=1.8172, A=482.01, B=2085.43, alpha=0.3478, beta=0.3658, name="besiroglu")
GOPHER_FLOPS = 5.76e23  # Gopher's (and Chinchilla's) training budget


def test_chinchilla_closed_form_by_hand() -> None:
    # G = (alpha·A / (beta·B))^(1/(alpha+beta)) = (0.34·406.4 / (0.28·410.7))^(1/0.62) = (138.176/114.996)^1.6129
    #   = 1.2015722^1.6129 = 1.3447106
    # C/6 = 9.6e22;  N = G·(C/6)^(0.28/0.62) = 1.3447106 · 2.3938131e10 = 3.2189859e10
    #                D = (C/6)^(0.34/0.62) / G = 4.0103382e12 / 1.3447106 = 2.9823057e12
    # L = 1.69 + 406.4/N^0.34 + 410.7/D^0.28 = 1.69 + 0.1087249 + 0.1320232 = 1.9307481
    assert pytest.approx(1.3447106, rel=1e-7) == PRINTED.G
    p = chinchilla_optimal(PRINTED, GOPHER_FLOPS)
    assert p.params == pytest.approx(3.2189859e10, rel=1e-7)
    assert p.train_tokens == pytest.approx(2.9823057e12, rel=1e-7)
    assert p.loss == pytest.approx(1.9307481, rel=1e-7)
    assert p.train_flops == pytest.approx(GOPHER_FLOPS, rel=1e-12)
    assert p.tokens_per_param == pytest.approx(2.9823057e12 / 3.2189859e10, rel=1e-6)  # 92.6
    # The unrounded exponents put the optimum at 40.3 B params (59 tokens/param), Besiroglu's refit at 72.2 B (18.4).
    assert chinchilla_optimal(HOFFMANN, GOPHER_FLOPS).params == pytest.approx(4.0310e10, rel=1e-4)
    assert chinchilla_optimal(BESIROGLU, GOPHER_FLOPS).tokens_per_param == pytest.approx(18.39, rel=1e-3)


@pytest.mark.parametrize("law", [PRINTED, HOFFMANN, BESIROGLU], ids=lambda law: law.name)
def test_chinchilla_point_is_the_isoflop_minimum(law: ScalingLaw) -> None:
    """Independent of the closed form: every other (N, C/6N) on the same budget has a higher loss."""
    p = chinchilla_optimal(law, GOPHER_FLOPS)
    ns = p.params * np.exp(np.linspace(-1, 1, 2001))
    losses = [law.loss(n, GOPHER_FLOPS / (6 * n)) for n in ns]
    assert min(losses) >= p.loss - 1e-12
    assert ns[int(np.argmin(losses))] == pytest.approx(p.params, rel=1e-3)


def test_chinchilla_for_loss_inverts_the_budget() -> None:
    """The least-compute model for a loss is the Chinchilla point of the budget that reaches it."""
    for c in (1e20, GOPHER_FLOPS, 1e26):
        p = chinchilla_optimal(HOFFMANN, c)
        q = chinchilla_for_loss(HOFFMANN, p.loss)
        assert (q.params, q.train_tokens) == (
            pytest.approx(p.params, rel=1e-9),
            pytest.approx(p.train_tokens, rel=1e-9),
        )


def test_no_inference_is_the_chinchilla_point() -> None:
    p = chinchilla_optimal(HOFFMANN, GOPHER_FLOPS)
    q = inference_aware_optimal(HOFFMANN, p.loss, inference_tokens=0)
    assert q.params == pytest.approx(p.params, rel=1e-9) and q.train_tokens == pytest.approx(p.train_tokens, rel=1e-9)
    tiny = inference_aware_optimal(HOFFMANN, p.loss, inference_tokens=1.0)  # one token: the bisection path
    assert tiny.params == pytest.approx(p.params, rel=1e-6)


@pytest.mark.parametrize("law", [PRINTED, HOFFMANN, BESIROGLU], ids=lambda law: law.name)
@pytest.mark.parametrize("d_inf", [1e10, 2e12, 1e14])
def test_inference_aware_is_the_cheapest_point_at_that_loss(law: ScalingLaw, d_inf: float) -> None:
    """Brute force along the iso-loss curve: no N reaches the loss for less 6ND + 2N·D_inf, and it beats Chinchilla."""
    chin = chinchilla_optimal(law, GOPHER_FLOPS, d_inf)
    best = inference_aware_optimal(law, chin.loss, d_inf)
    assert law.loss(best.params, best.train_tokens) == pytest.approx(chin.loss, abs=1e-12)
    assert best.total_flops < chin.total_flops
    assert best.params < chin.params and best.train_tokens > chin.train_tokens
    n_min = (law.A / (chin.loss - law.E)) ** (1 / law.alpha)  # below this no amount of data reaches the loss
    ns = n_min * np.exp(np.linspace(1e-4, math.log(chin.params * 2 / n_min), 20001))
    ds = (law.B / (chin.loss - law.E - law.A / ns**law.alpha)) ** (1 / law.beta)
    totals = 6 * ns * ds + 2 * ns * d_inf
    assert totals.min() >= best.total_flops * (1 - 1e-12)
    assert ns[int(np.argmin(totals))] == pytest.approx(best.params, rel=2e-3)


def test_more_serving_means_a_smaller_model_trained_longer() -> None:
    loss = chinchilla_optimal(HOFFMANN, GOPHER_FLOPS).loss
    pts = [inference_aware_optimal(HOFFMANN, loss, d) for d in (0, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15)]
    assert all(a.params > b.params for a, b in itertools.pairwise(pts))
    assert all(a.train_tokens < b.train_tokens for a, b in itertools.pairwise(pts))
    assert pts[-1].tokens_per_param > 1000  # Sardana et al.: extreme ratios become optimal at very high demand


def test_paper_figure_1_example() -> None:
    """Sardana et al. 2024 (arXiv:2401.00448), Figure 1: a developer who would train a (Chinchilla-optimal) 13B
    model and expects 2 T tokens of inference "can reduce their total compute by 1.7e22 FLOPs (17%) by instead
    training a 7B model on more data". With the unrounded Hoffmann fit: 7.13 B, 1.63e22 FLOPs, 16.3 %."""
    s = HOFFMANN.alpha + HOFFMANN.beta
    budget_13b = 6 * (13e9 / HOFFMANN.G) ** (s / HOFFMANN.beta)  # invert N_opt = G·(C/6)^(beta/(alpha+beta))
    chin = chinchilla_optimal(HOFFMANN, budget_13b, inference_tokens=2e12)
    assert chin.params == pytest.approx(13e9, rel=1e-9)
    best = inference_aware_optimal(HOFFMANN, chin.loss, 2e12)
    saved = chin.total_flops - best.total_flops
    assert best.params == pytest.approx(7.13e9, rel=2e-3)  # paper: "7B"
    assert saved == pytest.approx(1.633e22, rel=2e-3)  # paper: 1.7e22
    assert saved / chin.total_flops == pytest.approx(0.163, abs=1e-3)  # paper: 17 %


def test_min_loss_at_cost_is_the_dual() -> None:
    """Spending the inference-aware point's total buys exactly its loss; spending Chinchilla's buys a lower one."""
    chin = chinchilla_optimal(HOFFMANN, GOPHER_FLOPS, 2e12)
    best = inference_aware_optimal(HOFFMANN, chin.loss, 2e12)
    dual = min_loss_at_cost(HOFFMANN, best.total_flops, 2e12)
    assert dual.params == pytest.approx(best.params, rel=1e-6) and dual.loss == pytest.approx(best.loss, abs=1e-12)
    better = min_loss_at_cost(HOFFMANN, chin.total_flops, 2e12)
    assert better.total_flops == pytest.approx(chin.total_flops, rel=1e-9) and better.loss < chin.loss


def test_slower_serving_weights_inference_flops() -> None:
    """GPU-hours: with serving at a lower MFU an inference FLOP costs train_mfu/inference_mfu training FLOPs,
    which is the same optimum as that many more tokens served, and a smaller model than the FLOP optimum."""
    cost = Costing(peak_flops=989e12, train_mfu=0.5, inference_mfu=0.2)
    assert cost.inference_weight == pytest.approx(2.5)
    loss = chinchilla_optimal(HOFFMANN, GOPHER_FLOPS).loss
    weighted = inference_aware_optimal(HOFFMANN, loss, 2e12, cost.inference_weight)
    assert weighted.params == pytest.approx(inference_aware_optimal(HOFFMANN, loss, 5e12).params, rel=1e-9)
    assert weighted.params < inference_aware_optimal(HOFFMANN, loss, 2e12).params
    # 5.76e23 FLOPs / (989e12 FLOP/s · 0.5 · 3600 s/h) = 323,559 GPU-hours
    assert cost.train_gpu_hours(chinchilla_optimal(HOFFMANN, GOPHER_FLOPS)) == pytest.approx(323559.1, rel=1e-6)


def _cfg(*overrides: str):
    return compose(["cluster=h100_8x", *overrides], "plan")


def test_conf_fits_and_gpu_hour_budget() -> None:
    assert not _cfg().budget.enabled  # default: plan.py plans layouts as before
    bp = budget_from_cfg(_cfg("budget=hoffmann", "budget.train_flops=5.76e23", "budget.inference_tokens=2e12"))
    assert bp.law == HOFFMANN
    assert bp.costing.train_mfu == bp.costing.inference_mfu == 0.55  # cluster.matmul_efficiency
    assert bp.chinchilla.train_flops == pytest.approx(GOPHER_FLOPS, rel=1e-12)
    b = budget_from_cfg(_cfg("budget=besiroglu", "budget.train_flops=1e24")).law
    assert b == BESIROGLU
    # 294,144.68 GPU-hours x 3600 s x 989e12 FLOP/s x 0.55 = 5.76e23 FLOPs: the same plan as the FLOP budget
    by_hours = budget_from_cfg(
        _cfg("budget=hoffmann", "budget.train_gpu_hours=294144.68241566", "budget.inference_tokens=2e12")
    )
    assert by_hours.same_loss.params == pytest.approx(bp.same_loss.params, rel=1e-9)
    by_loss = budget_from_cfg(
        _cfg("budget=hoffmann", f"budget.target_loss={bp.chinchilla.loss!r}", "budget.inference_tokens=2e12")
    )
    assert by_loss.chinchilla.params == pytest.approx(bp.chinchilla.params, rel=1e-9)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            [],
            r"^budget: set exactly one of budget.train_flops, budget.train_gpu_hours, budget.target_loss \(got none\)",
        ),
        (["budget.train_flops=1e23", "budget.target_loss=2.0"], r"\(got train_flops, target_loss\)"),
        (
            ["budget.target_loss=1.5"],
            r"^budget.target_loss=1.5 is not above the fit's irreducible loss budget.law.E=1.6934",
        ),
        (["budget.train_flops=-1"], r"^budget.train_flops=-1.0 is out of range: it must be > 0"),
        (
            ["budget.train_flops=1e23", "budget.inference_mfu=55"],
            r"^budget.inference_mfu=55.0 is out of range: it must be > 0 and <= 1",
        ),
        (["budget.train_flops=1e23", "budget.inference_tokens=-5"], r"^budget.inference_tokens=-5.0 is out of range"),
        (["budget.train_flops=1e23", "budget.law.beta=0"], r"^budget.law.beta=0.0 is out of range: it must be > 0"),
        (["budget.train_flops=1e23", "cluster.peak_tflops=0"], r"^cluster.peak_tflops=0.0 is out of range"),
        (["budget.train_flops=1e23", "plot=x.png"], r"^plot=x.png draws layouts, and budget mode plans none"),
    ],
)
def test_bad_inputs_are_one_line_config_errors(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        budget_from_cfg(_cfg("budget=hoffmann", *overrides))
    assert "\n" not in str(e.value)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "plan.py", *args], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120
    )


def test_cli_prints_the_table(tmp_path) -> None:
    proc = _run(
        "budget=hoffmann",
        "budget.train_flops=5.76e23",
        "budget.inference_tokens=2e12",
        "budget.usd_per_gpu_hour=2.5",
        f"output_json={tmp_path}/budget.json",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads((tmp_path / "budget.json").read_text())
    assert doc["chinchilla"]["train_flops"] == pytest.approx(GOPHER_FLOPS, rel=1e-12)
    assert doc["same_loss"]["params"] == pytest.approx(3.03e10, rel=2e-3) and doc["saving"] == pytest.approx(
        0.032, abs=1e-3
    )
    out = proc.stdout
    assert "fit hoffmann: L = 1.6934 + 406.4/N^0.3392 + 410.7/D^0.2849" in out
    rows = {line[:28].strip(): line[28:].split() for line in out.splitlines() if line[:28].strip()}
    assert rows["params N"] == ["40.3", "B", "30.3", "B", "30.9", "B"]
    assert rows["loss"][0] == rows["loss"][1] == "1.9184" and float(rows["loss"][2]) < 1.9184
    assert rows["training FLOPs"][0] == "5.760e+23"
    assert rows["total GPU-hours"][0] == rows["total GPU-hours"][2] == "376,486"  # same total cost, by construction
    assert rows["total $ at $2.5/GPU-h"][0] == "$941,214"  # 376,485.6 GPU-h x $2.5
    assert "3.2% less total cost" in out
    assert "layouts" not in out  # budget mode does not run the layout search


def test_cli_bad_input_is_one_line() -> None:
    proc = _run("budget=hoffmann", "budget.inference_tokens=2e12")
    assert proc.returncode == 2
    assert (
        proc.stderr.startswith("error: budget: set exactly one of budget.train_flops") and proc.stderr.count("\n") == 1
    )


def test_table_without_serving_says_chinchilla_is_optimal() -> None:
    from ultrascale.plan.report import budget_table

    out = budget_table(budget_from_cfg(_cfg("budget=besiroglu", "budget.target_loss=2.1")))
    rows = {line[:28].strip(): line[28:].split() for line in out.splitlines() if line[:28].strip()}
    assert rows["params N"] == ["13.4", "B"] * 3 and rows["tokens per param D/N"] == ["20.0"] * 3
    assert "the Chinchilla point is already the cheapest" in out
