"""A staged three-source mixture on 2 CPU ranks through train.py: what was read (traced, not computed from the
offsets), a kill in the middle of a stage resumed across the stage boundary, and a universal checkpoint resumed on
one rank. Every check compares what the ranks really read (``ULTRASCALE_TRACE_SAMPLES``) with what was asked."""

from __future__ import annotations

import json
import shutil
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from tests.conftest import FAST, check, launch, losses, metrics
from tests.support import faults
from tests.wandb_files import read_run
from ultrascale.config.compose import compose
from ultrascale.train.optim import lr_multiplier

pytestmark = pytest.mark.dist

STEPS, BOUNDARY, GB, SEQ = 12, 6, 8, 64
WEIGHTS0 = {"top": 5, "email": 3, "json": 2}
WEIGHTS1 = {"top": 1, "email": 1}


def _args(sources: dict[str, Path]) -> list[str]:
    srcs = ",".join(f"{n}:{{path:{p},weight:1}}" for n, p in sources.items())
    w0 = ",".join(f"{n}:{w}" for n, w in WEIGHTS0.items())
    w1 = ",".join(f"{n}:{w}" for n, w in WEIGHTS1.items())
    return [*FAST, f"data.sources={{{srcs}}}", f"data.stages=[{{until_step:{BOUNDARY},weights:{{{w0}}}}},"
            f"{{weights:{{{w1}}},lr:linear_to_zero}}]", f"train.steps={STEPS}", "train.checkpoint_interval=4",
            "train.keep_checkpoints=0", f"optim.sched.total_steps={STEPS}", f"train.eval_interval={BOUNDARY}"]  # fmt: skip


def _reads(trace_dir: Path) -> dict[int, list[tuple[str, int]]]:
    """data step -> the (source, row) pairs every rank read in it, from the ranks' trace files."""
    out: dict[int, list] = defaultdict(list)
    for f in sorted(trace_dir.glob("rank*.jsonl")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            out[r["data_step"]] += list(zip(r["sources"], r["indices"]))
    return dict(out)


@pytest.fixture(scope="module")
def uninterrupted(tiny_sources, tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    out, trace = root / "run", root / "trace"
    args = _args(tiny_sources)
    dashboards = ["logger.tensorboard=true", "logger.wandb=true", "logger.wandb_mode=offline"]
    check(launch([*args, f"output_dir={out}", *dashboards], env={"ULTRASCALE_TRACE_SAMPLES": str(trace)}))
    return out, _reads(trace), args


def test_a_staged_mixture_reads_what_each_stage_asks(uninterrupted):
    out, reads, _ = uninterrupted
    assert sorted(reads) == list(range(STEPS)) and all(len(v) == GB for v in reads.values())
    for stage, (lo, hi, weights) in enumerate([(0, BOUNDARY, WEIGHTS0), (BOUNDARY, STEPS, WEIGHTS1)]):
        total = sum(weights.values())
        assert {s for t in range(lo, hi) for s, _ in reads[t]} == set(weights), stage
        for u in range(1, hi - lo + 1):  # within one sample of the asked share after each step of the stage
            counts = Counter(s for t in range(lo, lo + u) for s, _ in reads[t])
            for name, w in weights.items():
                assert abs(counts[name] - u * GB * w / total) < 1, (stage, u, name, counts)
    assert len(set(reads[0]) | set(reads[1])) == 2 * GB  # no row twice within an epoch
    rows = {r["step"]: r for r in metrics(out) if "loss" in r}
    ls = [rows[s]["loss"] for s in sorted(rows)]
    assert sum(ls[-2:]) / 2 < sum(ls[:2]) / 2 - 0.3, ls
    # the dashboards' data/ group is what was read: tokens per source, the in-stage share against the asked one
    seen = Counter(s for t in range(STEPS) for s, _ in reads[t])
    last = rows[STEPS]
    for name in WEIGHTS0:
        assert last[f"data/{name}/tokens"] == seen[name] * SEQ
    assert last["data/stage"] == 1 and last["data/top/asked"] == 0.5 and last["data/top/share"] == 0.5
    assert rows[BOUNDARY]["data/stage"] == 0 and rows[BOUNDARY]["data/json/asked"] == pytest.approx(0.2)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = EventAccumulator(str(out / "tensorboard")).Reload().Tags()["scalars"]
    assert {"data/top/tokens", "data/json/share", "data/email/asked", "data/stage", "eval/json/loss"} <= set(tags)
    wandb_keys = {k for row in read_run(out)["history"] for k in row}
    assert {"data/top/tokens", "data/json/share", "data/email/asked", "eval/email/perplexity"} <= wandb_keys
    # the annealing stage: the schedule's lr times a factor that falls to 0 at the end of the run
    sched = compose([*uninterrupted[2], "output_dir=unused"]).optim
    for step in (BOUNDARY + 1, STEPS):  # metrics rows are 1-based, the schedule's steps 0-based
        factor = (STEPS - (step - 1)) / (STEPS - BOUNDARY)
        want = sched.lr * lr_multiplier(step - 1, sched.sched, STEPS) * factor
        assert rows[step]["lr"] == pytest.approx(want, rel=1e-6), step
    evals = [r for r in metrics(out) if r.get("event") == "eval"]
    assert len(evals) == 2 and all(f"eval/{n}/loss" in e for e in evals for n in WEIGHTS0)
    assert evals[1]["eval/top/loss"] < evals[0]["eval/top/loss"]


def test_summary_data_mix_is_the_count_of_the_traced_samples(uninterrupted):
    out, reads, _ = uninterrupted
    seen = Counter(s for t in range(STEPS) for s, _ in reads[t])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data_mix"] == {n: seen[n] / (STEPS * GB) for n in WEIGHTS0}
    assert summary["data_cursors"] == dict(seen)
    report = (out / "report.md").read_text()  # the comb report's mixture table counts the same samples
    for name in WEIGHTS0:
        assert f"| {name} | {seen[name] * SEQ:,} | {seen[name] / (STEPS * GB):.1%} |" in report, report
    assert "stage 0 from step 1, stage 1 from step 7" in report and (out / "report.png").stat().st_size > 0
    meta = json.loads((out / "checkpoints" / "step_00000004" / "ultrascale_meta.json").read_text())
    assert meta["data_cursors"] == dict(Counter(s for t in range(4) for s, _ in reads[t]))


def test_a_kill_mid_stage_resumes_to_the_same_samples_across_the_stage_boundary(uninterrupted, tmp_path):
    ref_dir, ref_reads, args = uninterrupted
    out = tmp_path / "killed"
    args = [*args, faults.SYNC_SAVES]  # step 4's checkpoint is `latest` before step 5 starts
    killed = launch([*args, f"output_dir={out}"], env={**faults.env(kill_at="5"),
                                                       "ULTRASCALE_TRACE_SAMPLES": str(tmp_path / "t1")})  # fmt: skip
    assert killed.returncode != 0, "the fault hook did not kill the run"
    assert (out / "checkpoints" / "latest").read_text() == "step_00000004"
    check(launch([*args, f"output_dir={out}"], env={"ULTRASCALE_TRACE_SAMPLES": str(tmp_path / "t2")}))
    resumed = _reads(tmp_path / "t2")
    assert sorted(resumed) == list(range(4, STEPS))  # steps 4 and 5 again (after the checkpoint), then on
    for t in resumed:  # each rank read exactly the rows the uninterrupted run read, stage 0 and stage 1
        assert resumed[t] == ref_reads[t], t
    ref, got = losses(ref_dir), losses(out)
    assert sorted(got) == sorted(ref)
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-6, abs=1e-6), step
    assert (
        json.loads((out / "summary.json").read_text())["data_mix"]
        == json.loads((ref_dir / "summary.json").read_text())["data_mix"]
    )


def test_a_universal_checkpoint_resumes_on_one_rank_at_every_sources_position(uninterrupted, tmp_path):
    ref_dir, ref_reads, args = uninterrupted
    src = tmp_path / "src"
    shutil.copytree(ref_dir / "checkpoints", src)
    from ultrascale.train.checkpoint import to_universal

    to_universal(src / "step_00000004")
    out = tmp_path / "one_rank"
    check(launch([*args, f"output_dir={out}", f"train.resume={src / 'step_00000004'}",
                  "train.universal_checkpoint=true"], nproc=0, env={"ULTRASCALE_TRACE_SAMPLES": str(tmp_path / "t")}))  # fmt: skip
    resumed = _reads(tmp_path / "t")
    assert sorted(resumed) == list(range(4, STEPS))
    for t in resumed:  # one rank, four micro-batches: the same samples per step, split differently
        assert sorted(resumed[t]) == sorted(ref_reads[t]), t
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from"] == 4 and summary["world_size"] == 1
    assert summary["data_cursors"] == json.loads((ref_dir / "summary.json").read_text())["data_cursors"]
    ref, got = losses(ref_dir), losses(out)
    for step in got:
        assert got[step] == pytest.approx(ref[step], abs=2e-4), step
