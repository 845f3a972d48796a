"""``train.checkpoint_interval=auto`` (issue 54, section 2): the interval a run measures on its first save.

The arithmetic is one function, ``cost/save_interval.from_saves``, which the dry run (a run's measured saves in
its metrics) and the trainer's ``train/checkpoint.AutoInterval`` (its own first save) both call. The units here
check it, the key's composition and the checkpointer's schedule in one process; one 2-rank run and its resume
check the trainer's path: the measured save, the ranks' agreement on the slowest rank's figures, saves on the
interval, the record in the checkpoint, and a resume that keeps it instead of measuring again.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from tests.conftest import FAST, check, launch, metrics
from ultrascale.config.compose import compose, typed
from ultrascale.cost.save_interval import AUTO_FIRST_SAVE_STEP, from_saves, lost_share, node_mtbf, young_daly
from ultrascale.errors import ConfigError
from ultrascale.train.checkpoint import INTERVAL_KEY, AutoInterval, Checkpointer, read_meta


def test_the_interval_from_measured_saves_is_young_daly_floored_at_one_write_and_one_step():
    # 4 nodes of 100 h: a job MTBF of 25 h; a 2 s stall gives sqrt(2 x 2 x 90,000) = 600 s = 600 one-second steps
    adv = from_saves(5e9, stall_s=2.0, write_s=10.0, step_s=1.0, nodes=4, node_mtbf_h=100.0)
    assert adv.mtbf_h == 25.0 and adv.interval_s == pytest.approx(600.0) and adv.interval_steps == 600
    assert (adv.save_share, adv.rework_share) == pytest.approx(lost_share(600.0, 2.0, 90_000.0, 10.0))
    assert adv.stall_s == 2.0 and adv.write_s == 10.0 and adv.bytes_per_node == 5e9
    slow_disk = from_saves(5e9, stall_s=2.0, write_s=1_000.0, step_s=1.0, nodes=4, node_mtbf_h=100.0)
    assert slow_disk.interval_steps == 1_000  # never a save while the previous one is being written
    slow_step = from_saves(5e9, stall_s=2.0, write_s=10.0, step_s=5_000.0, nodes=4, node_mtbf_h=100.0)
    assert slow_step.interval_steps == 1  # never less than a step
    assert from_saves(5e9, 2.0, 10.0, 7.0, 4, 100.0).interval_steps == round(young_daly(2.0, 90_000.0) / 7.0)


def test_the_dry_run_reads_a_runs_measured_saves_through_the_same_function(tmp_path):
    """``plan/dryrun.checkpoint_line`` of a run that has saved: the interval is ``from_saves`` of its median step,
    stall and write, on the node MTBF ``train.node_mtbf_hours`` states (the key ``auto`` reads too)."""
    from ultrascale.levers.rules import validate
    from ultrascale.plan.dryrun import checkpoint_line

    rows = [{"step": s, "loss": 1.0, "step_s": t} for s, t in ((1, 9.0), (2, 2.0), (3, 2.0))]
    rows += [{"step": 3, "event": "checkpoint", "checkpoint_s": 0.5}, {"step": 4, "event": "checkpoint_written",
                                                                        "write_s": 30.0}]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = typed(compose([f"output_dir={tmp_path}", "train.node_mtbf_hours=2", "train.checkpoint_interval=auto"]))
    line = checkpoint_line(cfg, validate(cfg, 1))
    expect = from_saves(1.0, stall_s=0.5, write_s=30.0, step_s=2.0, nodes=1, node_mtbf_h=2.0).interval_steps
    assert expect == round(math.sqrt(2 * 0.5 * 7200) / 2.0) == 42
    assert f"suggested train.checkpoint_interval={expect} " in line, line
    assert f"save after step {AUTO_FIRST_SAVE_STEP}" in line and "node MTBF 2 h: train.node_mtbf_hours" in line


def test_auto_composes_and_validates_and_a_bad_interval_names_the_key():
    from ultrascale.levers.rules import validate

    cfg = typed(compose(["train.checkpoint_interval=auto"]))
    assert cfg.train.checkpoint_interval == "auto" and cfg.train.node_mtbf_hours is None
    validate(cfg, 1)
    assert typed(compose(["train.checkpoint_interval=7"])).train.checkpoint_interval == 7
    for bad in ("-1", "often"):
        with pytest.raises(ConfigError, match=rf"train.checkpoint_interval={bad} is out of range: it must be >= 0 "
                                              r"\(a number of steps\), or auto"):  # fmt: skip
            compose([f"train.checkpoint_interval={bad}"])
    with pytest.raises(ConfigError, match=r"train.node_mtbf_hours=0.0 is out of range: it must be > 0"):
        compose(["train.node_mtbf_hours=0"])
    cluster = compose(["cluster=h100_8x"]).cluster
    assert node_mtbf(3.0, cluster) == (3.0, "train.node_mtbf_hours")
    assert node_mtbf(None, cluster)[0] == cluster.node_mtbf_hours and "cluster=h100_8x" in node_mtbf(None, cluster)[1]
    assert node_mtbf(None, None) == (5000.0, "the cluster default; train.node_mtbf_hours=H states this machine's")


def test_auto_saves_to_measure_then_on_the_multiples_of_the_slowest_ranks_interval():
    """One process, no engine: before the measurement only its step (and the last) is due; every rank's
    figures give one interval (the slowest rank's write here); a resume adopts a recorded interval and measures
    again only when the checkpoint records none."""
    auto = AutoInterval(node_mtbf_h=1e-6, mtbf_from="train.node_mtbf_hours", nodes=1, run_steps=20)
    ck = Checkpointer(Path("/nonexistent"), 0, 0, {}, auto=auto)
    assert [s for s in range(1, 21) if ck.due(s, 20)] == [AUTO_FIRST_SAVE_STEP, 20]
    record = auto.decide(3, [(0.01, 0.1, 1.0, 2e6), (0.01, 4.2, 1.0, 0.0)])  # rank 1's disk is slow
    ck._use(record)
    assert record["steps"] == 4 and record["write_s"] == 4.2 and ck.meta[INTERVAL_KEY] is record
    assert [s for s in range(1, 21) if ck.due(s, 20)] == [4, 8, 12, 16, 20]
    assert "saves after every multiple of 4 steps" in auto.describe()
    short = AutoInterval(1e-6, "x", 1, run_steps=6)
    short.decide(3, [(0.01, 10.0, 1.0, 2e6)])
    assert "exceeds this run: its next save on it would follow step 10, past train.steps=6" in short.describe()
    fresh = AutoInterval(1e-6, "x", 1, 20)
    fresh.adopt(None, 10, "step_00000010")
    assert fresh.record is None and fresh.measure_at == 10 + AUTO_FIRST_SAVE_STEP
    fresh.adopt(record, 13, "step_00000013")
    assert fresh.record == record and "kept from step_00000013" in fresh.plan()


AUTO_RUN = [*FAST, "train.checkpoint_interval=auto", "train.node_mtbf_hours=1e-6", "train.keep_checkpoints=0"]
PLANTED = "slow_data@2x1.5,slow_data@3x1.5,slow_ckpt@3:1x4"
"""Steps 2 and 3 (the measured step time) take 1.5 s more; rank 1 alone writes the measured checkpoint 4 s late
(its background thread sleeps: rank 0's own write stays fast). With a 3.6 ms job MTBF Young/Daly is a few
milliseconds, so one write (4 s, rank 1's) over one step (~1.6 s) gives the interval: 2 or 3 steps."""


def _interval_lines(run: Path, rank: int) -> list[str]:
    text = (run / "logs" / f"rank{rank:05d}.log").read_text()
    return re.findall(r"checkpoint interval: auto = .*", text)


def _saved(run: Path) -> list[int]:
    return [r["step"] for r in metrics(run) if r.get("event") == "checkpoint"]


@pytest.mark.dist
def test_auto_measures_the_first_save_agrees_on_the_slowest_rank_saves_on_it_and_a_resume_keeps_it(tiny_data,
                                                                                                   tmp_path):  # fmt: skip
    run = tmp_path / "run"
    args = [*AUTO_RUN, f"data.path={tiny_data}", f"output_dir={run}"]
    check(launch([*args, "train.steps=9"], env={"ULTRASCALE_INJECT": PLANTED}, timeout=300))
    (r0,), (r1,) = _interval_lines(run, 0), _interval_lines(run, 1)
    assert r0.split(" [rank")[0] == r1.split(" [rank")[0], (r0, r1)  # both ranks chose one interval
    rec = read_meta(run / "checkpoints" / "step_00000009")[INTERVAL_KEY]
    n = rec["steps"]
    assert rec["measured_after_step"] == AUTO_FIRST_SAVE_STEP and rec["step_s_from"] == "median of steps 2-3"
    assert rec["write_s"] >= 4.0, rec  # rank 1's slow disk, taken by rank 0 as well
    assert rec["node_mtbf_h"] == 1e-6 and rec["nodes"] == 1 and rec["bytes"] > 1e6
    assert n == from_saves(rec["bytes"], rec["stall_s"], rec["write_s"], rec["step_s"], 1, 1e-6).interval_steps
    assert n >= 2, f"the planted step (1.5 s) and write (4 s) should give 2-3 steps: {rec}"
    assert f"auto = {n} step(s): measured on the save after step 3" in r0
    assert read_meta(run / "checkpoints" / "step_00000003")[INTERVAL_KEY] == rec  # the measured one records it
    assert _saved(run) == sorted({3, *range(n * (3 // n + 1), 10, n), 9}), (_saved(run), n)

    check(launch([*args, "train.steps=14", "train.allow_schedule_change=true"], timeout=300))
    kept = [_interval_lines(run, r)[1:] for r in (0, 1)]
    assert all(len(k) == 1 and f"auto = {n} step(s), kept from step_00000009" in k[0] for k in kept), kept
    assert read_meta(run / "checkpoints" / "step_00000014")[INTERVAL_KEY] == rec  # not measured again
    assert [s for s in _saved(run) if s > 9] == sorted({*range(n * (9 // n + 1), 15, n), 14}), (_saved(run), n)
