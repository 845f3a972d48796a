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


@pytest.mark.parametrize("policy", ["skip", "rollback", "stop"])
def test_every_nonfinite_policy_is_the_action_for_nan_and_inf(policy):
    m = _monitor(nonfinite=policy, spike="none")
    for x in (float("nan"), math.inf, -math.inf):
        assert (m.judge(x).action, m.judge(x).reason) == (policy, "nonfinite"), x
    assert (m.nonfinite_grad().action, m.nonfinite_grad().reason) == (policy, "nonfinite")
    assert m.judge(2.0).action == "ok"


@pytest.mark.parametrize("policy", ["none", "skip", "lr_cut", "rollback"])
def test_every_spike_policy_is_the_action_for_a_spike_and_only_for_one(policy):
    m = _monitor(spike=policy, spike_min_history=3)
    assert m.judge(1e6).action == "ok"  # not armed until spike_min_history accepted steps
    for x in (2.0, 2.1, 1.9, 2.0):
        m.record(m.judge(x), x, 1)
    assert m.judge(2.05).action == "ok" and m.judge(1.0).action == "ok"  # a falling loss is no spike
    spike = m.judge(9.0)
    if policy == "none":
        assert (spike.action, spike.reason) == ("ok", "")
    else:
        assert (spike.action, spike.reason) == (policy, "spike") and spike.zscore > 6
    assert m.judge(float("nan")).action == "skip"  # the nonfinite policy is independent of the spike policy


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
    assert apply_lr(opt, 4, cfg.optim.sched, cfg.train.steps) == pytest.approx(0.5)
    assert apply_lr(opt, 50, cfg.optim.sched, cfg.train.steps, factor=0.5) == pytest.approx(0.5)
    assert opt.param_groups[1]["lr"] == pytest.approx(0.25)


def _agree_worker(rank: int, port: int, verdicts: list, out: str) -> None:
    import torch.distributed as tdist

    from ultrascale.train.stability import Verdict, agree

    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    got = [agree(Verdict(*v)).verdict for v in verdicts[rank]]
    torch.save([(g.action, g.reason, g.zscore) for g in got], f"{out}/rank{rank}.pt")
    tdist.destroy_process_group()


@pytest.mark.dist
def test_ranks_that_disagree_adopt_the_strongest_action_with_its_own_reason(tmp_path):
    import torch.multiprocessing as mp

    from ultrascale.runtime.dist import free_port

    verdicts = [
        [("ok", "", 0.5), ("skip", "nonfinite", None), ("lr_cut", "spike", 7.0), ("ok", "", None)],  # rank 0
        [("rollback", "spike", 9.0), ("rollback", "spike", 9.5), ("ok", "", 0.1), ("ok", "", 0.2)],  # rank 1
    ]
    mp.spawn(_agree_worker, args=(free_port(), verdicts, str(tmp_path)), nprocs=2, join=True)
    want = [("rollback", "spike", 9.0), ("rollback", "spike", 9.5), ("lr_cut", "spike", 7.0), ("ok", "", None)]
    for rank in range(2):
        assert torch.load(tmp_path / f"rank{rank}.pt") == want, rank


def test_monitor_state_round_trips_with_its_spike_window():
    m = _monitor(spike_min_history=3)
    for x in (2.0, 2.1, 1.9):
        m.record(m.judge(x), x, 1)
    m.record(m.judge(float("nan")), float("nan"), 2)
    fresh = _monitor(spike_min_history=3)
    assert fresh.judge(9.0).action == "ok"  # no history yet: not armed
    fresh.load_state(m.state())
    assert fresh.judge(9.0).action == "skip" and fresh.skips == 1
    assert fresh.state() == m.state() | {"consecutive": 0}
