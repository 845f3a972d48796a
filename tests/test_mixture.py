"""Data mixtures without ranks: the apportionment, the stage table, the order of samples, the config rules and the
resume check. The 2-rank runs (traces across a kill, a universal resume at another world size) are in
``test_mixture_dist.py``."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from omegaconf import OmegaConf

from tests.conftest import FAST, ROOT, TEST_ENV, run_py
from ultrascale.config.compose import compose
from ultrascale.data.loader import StepBatches
from ultrascale.data.mixture import QUANTUM, Mixture, Stage, quantize
from ultrascale.data.shards import open_split, write_samples
from ultrascale.data.sources import stages, tokens_per_source
from ultrascale.errors import CheckpointError, ConfigError

WEIGHTS = [(0.7, 0.3), (0.5, 0.3, 0.2), (0.05, 0.9, 0.05), (1 / 3, 1 / 3, 1 / 3), (0.013, 0.987)]


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("gb", [1, 8, 48])
def test_realized_shares_are_within_one_percent_of_the_weights(weights, gb):
    """Over 200 steps every source's share is within 1 % of its weight (absolute), and at every step within one
    sample of its target: what the apportionment promises, checked, not assumed."""
    m = Mixture([f"s{i}" for i in range(len(weights))], [50] * len(weights), [Stage(0, None, weights)], gb, seed=3)
    steps = 200
    cum = np.stack([m.cursors(t) for t in range(steps + 1)])
    assert (np.diff(cum, axis=0) >= 0).all() and (cum.sum(1) == np.arange(steps + 1) * gb).all()
    target = np.outer(np.arange(steps + 1) * gb, weights)
    assert np.abs(cum - target).max() < 1.0
    share = cum[-1] / cum[-1].sum()
    assert np.abs(share - np.asarray(weights)).max() <= 0.01, share


def test_weights_are_normalized_and_quantized_exactly():
    assert sum(quantize([7, 3])) == QUANTUM == sum(quantize([1 / 3] * 3))
    m = Mixture(["a", "b"], [10, 10], [Stage(0, None, (0.7, 0.3))], 10, 0)
    data = OmegaConf.create({"sources": {"a": {"path": "x", "weight": 7}, "b": {"path": "y", "weight": 3}},
                             "stages": [], "global_batch": 10, "seq_len": 4})  # fmt: skip
    assert stages(data, 100)[0].shares == pytest.approx((0.7, 0.3))
    assert tokens_per_source(data, 100) == {"a": 700 * 4, "b": 300 * 4}
    assert m.counts(0).tolist() == [7, 3]


@pytest.mark.parametrize("layout", [(1, 8), (2, 2), (4, 1), (2, 4)])
def test_a_step_reads_the_same_samples_whatever_the_layout(tiny_sources, layout):
    """dp x micro-batch: every rank's micro-batches of a step together are the step's G samples, source and row."""
    dp, mb = layout
    readers = [open_split(p, "train", verify=False) for p in tiny_sources.values()]
    m = Mixture(list(tiny_sources), [len(r) for r in readers], [Stage(0, None, (0.5, 0.3, 0.2))], 8, seed=11)
    for step in (0, 1, 7, 40):
        src, rows = m.slots(step)
        want = sorted(zip(src.tolist(), rows.tolist()))
        got = []
        for rank in range(dp):
            b = StepBatches(readers, mb, 8, rank, dp, 11, mixture=m)
            for micro in range(b.grad_accum):
                s, i = b.sources_and_indices(step, micro)
                got += list(zip(s.tolist(), i.tolist()))
        assert sorted(got) == want


def test_the_rows_read_are_the_rows_of_the_traced_sources(tiny_sources):
    """StepBatches.get gathers each slot from its own source's shards (the bytes, not only the indices)."""
    readers = [open_split(p, "train", verify=False) for p in tiny_sources.values()]
    m = Mixture(list(tiny_sources), [len(r) for r in readers], [Stage(0, None, (0.5, 0.3, 0.2))], 8, seed=1)
    b = StepBatches(readers, 4, 8, 1, 2, 1, mixture=m)
    src, idx = b.sources_and_indices(3, 0)
    batch = b.get(3, 0)
    for row, (s, i) in enumerate(zip(src, idx)):
        assert np.array_equal(batch.input_ids[row].numpy(), readers[s].get(np.array([i]))[0])


def test_stage_boundaries_are_exact_and_until_tokens_rounds_up_to_a_step():
    data = OmegaConf.create({
        "sources": {"a": {"path": "x", "weight": 1}, "b": {"path": "y", "weight": 1}},
        "stages": [{"until_step": 5, "until_tokens": None, "weights": {"a": 1}, "lr": "schedule"},
                   {"until_step": None, "until_tokens": 7 * 8 * 4 + 1, "weights": {"a": 1, "b": 1}, "lr": "schedule"},
                   {"until_step": None, "until_tokens": None, "weights": {"b": 1}, "lr": "linear_to_zero"}],
        "global_batch": 8, "seq_len": 4})  # fmt: skip
    table = stages(data, 20)
    assert [(s.start, s.end) for s in table] == [(0, 5), (5, 8), (8, None)]
    m = Mixture(["a", "b"], [100, 100], table, 8, 0)
    assert [m.counts(t).tolist() for t in (0, 4)] == [[8, 0], [8, 0]]
    assert [m.counts(t).tolist() for t in (5, 6, 7)] == [[4, 4]] * 3
    assert [m.counts(t).tolist() for t in (8, 19)] == [[0, 8], [0, 8]]
    assert m.cursors(8).tolist() == [40 + 12, 12]
    # the annealing stage: 1 at its first step, falling to 0 at the end of the run (step 20)
    assert m.lr_factor(7, 20) == 1.0 and m.lr_factor(8, 20) == 1.0
    assert m.lr_factor(14, 20) == pytest.approx(0.5) and m.lr_factor(19, 20) == pytest.approx(1 / 12)


def test_a_small_source_repeats_each_epoch_in_a_new_order_and_says_how_often():
    m = Mixture(["big", "small"], [1000, 7], [Stage(0, None, (0.5, 0.5))], 4, seed=2)
    seen = np.concatenate([m.slots(t)[1][m.slots(t)[0] == 1] for t in range(7)])  # 14 reads of a 7-row source
    assert len(seen) == 14 and sorted(seen[:7]) == list(range(7)) and sorted(seen[7:]) == list(range(7))
    assert not np.array_equal(seen[:7], seen[7:])
    assert m.epochs(7).tolist() == [14 / 1000, 2.0]


def test_one_source_is_the_order_the_loader_always_had():
    """data.path as one source: the per-epoch permutation seeded by (seed, epoch), consumed G at a time."""
    n, gb, seed = 37, 8, 5
    m = Mixture.single(n, gb, seed)
    for step in (0, 3, 4, 20):
        pos = np.arange(step * gb, (step + 1) * gb)
        want = [np.random.default_rng([seed, int(p // n)]).permutation(n)[p % n] for p in pos]
        assert m.slots(step)[1].tolist() == want


def test_positions_recomputed_from_scratch_equal_the_ones_reached_step_by_step():
    st = [Stage(0, 30, (0.6, 0.4, 0.0)), Stage(30, None, (0.2, 0.3, 0.5))]
    walked = Mixture("abc", [9, 9, 9], st, 12, 0)
    for t in range(60):
        walked.slots(t)
    fresh = Mixture("abc", [9, 9, 9], st, 12, 0)
    assert fresh.cursors(47).tolist() == walked.cursors(47).tolist()
    assert [fresh.slots(47)[i].tolist() for i in (0, 1)] == [walked.slots(47)[i].tolist() for i in (0, 1)]


# ----------------------------------------------------------------------------- config rules, in one line

SOURCES = "data.sources={a:{path:data/a,weight:0.7},b:{path:data/b,weight:0.3}}"


@pytest.mark.parametrize(
    "override, needle",
    [
        ("data.sources.b.weight=0", "data.sources.b.weight=0.0 must be > 0"),
        ("data.sources.b.weight=-1", "data.sources.b.weight=-1.0 must be > 0"),
        ("data.stages=[{until_step:5,weights:{a:1,c:1}},{weights:{a:1}}]", "data.stages[0].weights names 'c'"),
        ("data.stages=[{until_step:5,weights:{a:1,b:0}},{weights:{a:1}}]", "data.stages[0].weights.b=0.0 must be > 0"),
        ("data.stages=[{weights:{a:1}},{weights:{b:1}}]", "data.stages[0] has no until_step"),
        ("data.stages=[{until_step:5,weights:{a:1}},{until_step:5,weights:{b:1}}]", "data.stages[1] ends at step 5"),
        ("data.stages=[{until_step:5,weights:{a:1}}]", "the last stage, ends at step 5 but train.steps=100"),
    ],
)
def test_mixture_rules_name_the_key(override, needle):
    from ultrascale.levers.rules import validate

    with pytest.raises(ConfigError) as e:
        validate(compose([SOURCES, override, "output_dir=/tmp/unused"]), 1)
    assert needle in str(e.value), str(e.value)


def test_stages_need_sources():
    from ultrascale.levers.rules import validate

    with pytest.raises(ConfigError, match=r"data\.stages needs data\.sources"):
        validate(compose(["data.stages=[{weights:{a:1}}]", "output_dir=/tmp/unused"]), 1)


def test_a_resume_refuses_a_mixture_that_changed_before_the_checkpoint():
    from ultrascale.levers.rules import validate
    from ultrascale.train.resume import check_resume

    base = [SOURCES, "output_dir=/tmp/unused", "train.steps=20", "data.global_batch=8", "data.micro_batch=8"]
    cfg = compose(base)
    d = validate(cfg, 1)
    meta = {"step": 6, "data_offset": 0, "data_cursors": {"a": 34, "b": 14}}  # 48 samples at 0.7/0.3
    assert check_resume(cfg, d, meta, "step_00000006", False) == []
    other = compose([*base, "data.sources.b.weight=0.5"])
    with pytest.raises(CheckpointError, match=r"had read 34 samples of source 'a' by data step 6"):
        check_resume(other, validate(other, 1), meta, "step_00000006", False)
    # changing the mixture only after the checkpoint is a new stage, and passes
    later = compose([*base, "data.stages=[{until_step:6,weights:{a:0.7,b:0.3}},{weights:{b:1}}]"])
    assert check_resume(later, validate(later, 1), meta, "step_00000006", False) == []


# ----------------------------------------------------------------------------- through train.py


def _train(args, tmp_path):
    return run_py(["train.py", *FAST, *args], timeout=300)


def _one_error_nothing_written(proc, out, needle):
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "[WARNING]" not in ln]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert needle in lines[0], lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not out.exists()


def test_a_tokenizer_mismatch_is_one_error_naming_both_sources(tiny_sources, tmp_path):
    other = tmp_path / "other_eos"
    arr = np.arange(64 * 40).reshape(40, 64) % 256
    write_samples(other, {"train": [arr], "validation": [arr[:16]]}, seq_len=64, vocab_size=257, eos_token_id=0,
                  tokenizer="tokenizer")  # fmt: skip
    out = tmp_path / "run"
    sources = f"data.sources={{top:{{path:{tiny_sources['top']},weight:1}},other:{{path:{other},weight:1}}}}"
    proc = _train([sources, "model=tiny", f"output_dir={out}", "train.steps=2"], tmp_path)
    _one_error_nothing_written(proc, out, f"data.sources.other ({other}) has eos_token_id=0 but data.sources.top")


@pytest.mark.parametrize(
    "override, needle",
    [
        ("data.sources.json.weight=0", "data.sources.json.weight=0.0 must be > 0"),
        ("data.stages=[{until_step:2,weights:{top:1}},{weights:{jsn:1}}]", "data.stages[1].weights names 'jsn'"),
    ],
)
def test_bad_weights_and_unknown_names_are_one_error_with_nothing_written(tiny_sources, tmp_path, override, needle):
    out = tmp_path / "run"
    srcs = ",".join(f"{n}:{{path:{p},weight:1}}" for n, p in tiny_sources.items())
    proc = _train([f"data.sources={{{srcs}}}", override, "model=tiny", f"output_dir={out}", "train.steps=4"], tmp_path)
    _one_error_nothing_written(proc, out, needle)


def test_dry_run_prints_the_stage_table_and_tokens_per_source(tiny_sources, tmp_path):
    srcs = ",".join(f"{n}:{{path:{p},weight:{w}}}" for (n, p), w in zip(tiny_sources.items(), (5, 3, 2)))
    stages_ = "data.stages=[{until_step:10,weights:{top:5,email:3,json:2}},{weights:{top:1},lr:linear_to_zero}]"
    proc = _train([f"data.sources={{{srcs}}}", stages_, "model=tiny", f"output_dir={tmp_path / 'x'}",
                   "train.steps=20", "dry_run=true"], tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "stage 0: steps 0-10 (5,120 tokens): top 50.0%, email 30.0%, json 20.0%" in proc.stdout
    assert "stage 1: steps 10-20 (5,120 tokens): top 100.0%, lr linear_to_zero" in proc.stdout
    assert "top        7,680 tokens over 20 steps (75.0%)" in proc.stdout
    assert "json       1,024 tokens over 20 steps (10.0%)" in proc.stdout
    assert not (tmp_path / "x").exists()


def test_the_planner_prints_the_tokens_each_source_gives():
    env = {**os.environ, **TEST_ENV}
    proc = subprocess.run([sys.executable, "plan.py", "model=tiny", "cluster=cpu_local", "search.enabled=false",
                           "data.sources={a:{path:x,weight:3},b:{path:y,weight:1}}", "train.steps=50",
                           "data.stages=[{until_tokens:100000,weights:{a:1}},{weights:{a:1,b:1}}]"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "stage 0: steps 0-25 (102,400 tokens): a 100.0%" in proc.stdout  # 100,000 tokens round up to 25 steps
    assert "b          51,200 tokens over 50 steps (25.0%)" in proc.stdout
