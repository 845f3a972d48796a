"""Every model-parallel layout also trains with data parallelism, as real runs use them: 4 CPU ranks each.

pp=2 x dp=2, tp=2 x dp=2 and sp=2 x dp=2 under ZeRO-1, ep=2 x dp=2 under ZeRO-2, through the real
``train.py``. Each trains (the loss falls), the replicas that must agree do (every rank's data-parallel group,
checked on every rank, not only rank 0's), a run killed mid-way resumes to the uninterrupted run's losses, and
the dense layouts compute what the plain 1-rank model computes on the same global batches (the samples of a
step do not depend on dp, see ``ultrascale/data/loader.py``).
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import FAST, check, launch, losses, metrics
from tests.support import faults

pytestmark = pytest.mark.dist

STEPS = 5
BASE = [*FAST, "model.config.vocab_size=257", "data.micro_batch=2", "data.global_batch=8", f"train.steps={STEPS}",
        "train.checkpoint_interval=2", "train.keep_checkpoints=0"]  # fmt: skip
LAYOUTS = {
    "pp2_dp2": ["parallel=pp2", "zero=stage1"],
    "tp2_dp2": ["parallel=tp2", "zero=stage1"],
    "sp2_dp2": ["parallel=sp2", "zero=stage1"],
    "ep2_dp2": ["model=tiny_moe", "parallel=ep2", "zero=stage2"],
}
TOL = 1e-4


@pytest.fixture(scope="module")
def plain(tiny_data, tmp_path_factory):
    """The 1-rank run of the dense model on the same global batches: what the dense layouts must compute."""
    out = tmp_path_factory.mktemp("plain") / "run"
    check(launch([*BASE, f"data.path={tiny_data}", f"output_dir={out}"], nproc=0, launcher="python"))
    return losses(out)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_with_data_parallelism_trains_agrees_and_resumes_after_a_kill(name, tiny_data, tmp_path, plain):
    args = [*BASE, *LAYOUTS[name], f"data.path={tiny_data}"]
    ref = tmp_path / "uninterrupted"
    check(launch([*args, f"output_dir={ref}"], nproc=4))
    curve = losses(ref)
    assert curve[STEPS] < curve[1] - 0.3, f"{name}: loss did not fall: {curve}"
    summary = json.loads((ref / "summary.json").read_text())
    # The ranks that must hold the same weights: dp x sp (Ulysses ranks replicate the model; ZeRO shards over
    # both), and under ep all dp ranks too (the digests skip the experts).
    dp = summary["topology"]["dp"] * summary["topology"]["sp"]
    groups = summary["replica_groups"]  # a group of one agrees with itself: check each has its dp members first
    assert sorted(r for g in groups for r in g) == [0, 1, 2, 3] and all(len(g) == dp for g in groups), groups
    assert len(summary["param_digests"]) == dp
    assert summary["world_size"] == 4 and summary["replicas_agree"] is True, summary["param_digests"]
    if name == "ep2_dp2":  # ep re-slices the 4 data-parallel ranks: 2 expert groups, each replicated twice
        assert summary["topology"]["dp"] == 4 and summary["topology"]["ep"] == 2
        assert summary["moe_nonexpert_agree"], summary["moe_nonexpert_digests"]
        experts = summary["moe_expert_digests"]
        assert sorted(experts.count(e) for e in set(experts)) == [2, 2], experts  # replicas agree, groups differ
    else:
        assert summary["topology"]["dp"] == 2
        diffs = {s: abs(curve[s] - plain[s]) for s in plain}
        assert max(diffs.values()) <= TOL, f"{name} vs the 1-rank model: {diffs}"
    killed = tmp_path / "killed"
    args = [*args, faults.SYNC_SAVES]  # step 2's checkpoint is `latest` before step 3 starts
    proc = launch([*args, f"output_dir={killed}"], nproc=4, env=faults.env(kill_at="3"))
    assert proc.returncode != 0 and (killed / "checkpoints" / "latest").read_text() == "step_00000002"
    check(launch([*args, f"output_dir={killed}"], nproc=4))
    assert json.loads((killed / "summary.json").read_text())["resumed_from"] == 2
    # only the rows the resumed run wrote (after its resume event), not the killed run's own steps 1-2
    rows = metrics(killed)
    (at,) = [i for i, r in enumerate(rows) if r.get("event") == "resume"]
    resumed = {r["step"]: r["loss"] for r in rows[at + 1 :] if "loss" in r and "event" not in r}
    assert sorted(resumed) == list(range(3, STEPS + 1)), resumed
    for step, loss in resumed.items():
        assert loss == pytest.approx(curve[step], rel=1e-6, abs=1e-6), (name, step)
