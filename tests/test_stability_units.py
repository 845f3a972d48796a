"""Bad-step policies in isolation: the spike z-score, verdicts per policy, the caps, fault specs and the lr."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from ultrascale.config.compose import compose
from ultrascale.train.optim import apply_lr
from ultrascale.train.stability import SpikeDetector, StabilityMonitor, StepGate, TrainingHealthError, parse_faults


def _monitor(**overrides) -> StabilityMonitor:
    cfg = compose([f"stability.{k}={v}" for k, v in overrides.items()])
    return StabilityMonitor(cfg.stability)


def test_zscore_is_one_sided_with_a_relative_floor():
    d = SpikeDetector(window=10, min_history=3, min_rel_std=0.02)
    assert d.zscore(5.0) is None  # not enough history
    for x in (4.0, 4.0, 4.0):
        d.accept(x)
    assert d.zscore(4.0) == 0.0
    assert d.zscore(3.0) < 0  # a falling loss is progress, not a spike
    assert d.zscore(4.8) == pytest.approx(0.8 / (0.02 * 4.0))  # flat window: the 2 % floor sets the scale


def test_policies_map_to_actions():
    m = _monitor(spike_min_history=3)
    assert m.judge(float("nan")).action == "skip" and m.judge(math.inf).reason == "nonfinite"
    for x in (2.0, 2.1, 1.9, 2.0):
        m.record(m.judge(x), x, 1)
    assert m.judge(2.05).action == "ok"
    spike = m.judge(9.0)
    assert (spike.action, spike.reason) == ("skip", "spike") and spike.zscore > 6
    assert _monitor(spike="lr_cut", spike_min_history=1).judge(1.0).action == "ok"
    assert _monitor(nonfinite="rollback").judge(float("nan")).action == "rollback"
    assert _monitor(spike="none").judge(1e9).action == "ok"


def test_consecutive_bad_steps_end_the_run_and_a_clean_step_resets():
    m = _monitor(max_consecutive=3)
    bad = m.judge(float("nan"))
    m.record(bad, float("nan"), 1)
    m.record(bad, float("nan"), 2)
    m.record(m.judge(2.0), 2.0, 3)  # clean: the count starts again
    m.record(bad, float("nan"), 4)
    m.record(bad, float("nan"), 5)
    with pytest.raises(TrainingHealthError, match=r"3 bad steps in a row .* stability\.max_consecutive=3"):
        m.record(bad, float("nan"), 6)


def test_stop_policy_raises_before_the_update_is_applied():
    m = _monitor(nonfinite="stop")
    with pytest.raises(TrainingHealthError, match=r"stability\.nonfinite=stop"):
        m.record(m.judge(float("inf")), float("inf"), 7)


def test_lr_cut_window():
    m = _monitor(spike="lr_cut", lr_cut_factor=0.25, lr_cut_steps=3)
    m.start_lr_cut(10)
    assert [m.lr_factor(s) for s in (9, 10, 12, 13)] == [1.0, 0.25, 0.25, 1.0]


def test_fault_specs():
    f = parse_faults("nan@5:1, spike@12x7.5")
    assert [(x.kind, x.step, x.rank) for x in f] == [("nan", 5, 1), ("spike", 12, 0)] and f[1].factor == 7.5
    with pytest.raises(ValueError, match="unknown fault"):
        parse_faults("boom@3")


def test_gate_vetoes_the_update_and_leaves_the_optimizer_state_untouched():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1)
    gate = StepGate(opt)
    p.grad = torch.ones(3)
    gate.arm(True)
    opt.step()
    assert gate.vetoed and torch.equal(p.detach(), torch.ones(3)) and not opt.state
    gate.arm(False)
    opt.step()
    assert not gate.vetoed and not torch.equal(p.detach(), torch.ones(3))


def test_apply_lr_follows_the_step_and_keeps_each_groups_peak():
    cfg = OmegaConf.create(
        {
            "train": {"steps": 100},
            "optim": {
                "sched": {
                    "name": "constant",
                    "warmup_steps": 10,
                    "min_lr_ratio": 0.1,
                    "decay_fraction": 0.2,
                    "total_steps": None,
                }
            },
        }
    )
    p1, p2 = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.AdamW([{"params": [p1], "lr": 1.0}, {"params": [p2], "lr": 0.5}])
    assert apply_lr(opt, 4, cfg) == pytest.approx(0.5)
    assert apply_lr(opt, 50, cfg, factor=0.5) == pytest.approx(0.5)
    assert opt.param_groups[1]["lr"] == pytest.approx(0.25)
