"""Run length in tokens (``train.tokens``): parsing, the steps it sets, and a resume under another global batch that
keeps the token count, the data position and the lr curve over tokens (``ultrascale/levers/length.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import check, launch, metrics, write_byte_dataset
from tests.support import faults
from ultrascale.config.compose import compose
from ultrascale.errors import CheckpointError, ConfigError
from ultrascale.levers import length


@pytest.mark.parametrize(
    ("text", "tokens"),
    [("20480", 20480), ("2B", 2 * 10**9), ("500M", 5 * 10**8), ("1.5T", 15 * 10**11), ("20k", 20000),
     ("2e9", 2 * 10**9), ("2000000000.0", 2 * 10**9), ("2_000_000", 2 * 10**6), ("3G", 3 * 10**9)],
)  # fmt: skip
def test_token_counts_parse_with_decimal_suffixes(text, tokens):
    assert length.parse_tokens(text) == tokens


@pytest.mark.parametrize("text", ["0", "1.5", "2X", "-5", "B", "", "1.2345K"])
def test_a_token_count_that_is_not_a_whole_positive_number_is_one_error(text):
    with pytest.raises(ConfigError, match=r"train.tokens=.* is not a whole number of tokens: use e.g."):
        length.parse_tokens(text)


def test_tokens_set_the_steps_and_win_over_train_steps():
    """cpu_smoke is 16 x 256 = 4,096 tokens a step and sets train.steps=60: tokens decide (rounding the last step
    up), the warmup in tokens converts, and validation (which resolves it) sees the derived steps."""
    from ultrascale.levers.rules import validate

    cfg = compose(["recipe=cpu_smoke", "train.tokens=20480", "train.steps=60", "optim.sched.warmup_tokens=8192"])
    validate(cfg, 2, backend="gloo")
    assert (cfg.train.steps, cfg.optim.sched.warmup_steps) == (5, 2)
    assert length.describe(cfg) == "20,480 tokens (train.tokens=20480) = 5 steps x 4,096 tokens/step"
    cfg = compose(["recipe=cpu_smoke", "train.tokens=20481"])
    length.resolve(cfg)
    assert cfg.train.steps == 6
    assert "the last step rounds up: 24,576 trained" in length.describe(cfg)
    cfg = compose(["recipe=cpu_smoke"])
    length.resolve(cfg)
    assert (
        cfg.train.steps == 60 and length.describe(cfg) == "60 steps (train.steps) x 4,096 tokens/step = 245,760 tokens"
    )
    with pytest.raises(ConfigError, match=r"train\.tokens=lots"):
        validate(compose(["recipe=cpu_smoke", "train.tokens=lots"]), 2, backend="gloo")


def test_tokens_trained_and_the_schedule_position_follow_the_batch_history():
    h = [length.Segment(0, 16, 256), length.Segment(2, 8, 256), length.Segment(5, 32, 256)]
    assert [length.tokens_at(h, s) for s in (0, 1, 2, 3, 5, 6)] == [0, 4096, 8192, 10240, 14336, 22528]
    assert length.schedule_position(h, 3, by_tokens=True) == 2.5
    assert length.schedule_position(h, 3, by_tokens=False) == 3
    assert length.schedule_position(h[:1], 3, by_tokens=True) == 3
    cfg = compose(["recipe=cpu_smoke", "data.global_batch=8"])
    assert length.continued(h[:1], 2, cfg.data) == h[:2]  # a new segment where the batch changed
    assert length.continued(h[:2], 4, cfg.data) == h[:2]  # none where it did not
    assert length.continued(h, 3, cfg.data) == h[:2]  # a rollback past a later change drops it


def _meta(step=2, gb=16, offset=0, tokens=20480, cursors=None, total=5, warmup=4) -> dict:
    return {"step": step, "data_offset": offset, "tag": f"step_{step:08d}",
            "data_cursors": cursors if cursors is not None else {"data": (step + offset) * gb},
            "length": {"tokens": tokens, "history": [[0, gb, 256]]},
            "schedule": {"total_steps": total, "warmup_steps": warmup}}  # fmt: skip


def test_a_resume_under_another_batch_keeps_the_tokens_and_pins_the_schedule():
    cfg = compose(["recipe=cpu_smoke", "train.tokens=20480", "data.global_batch=8"])
    length.resolve(cfg)
    notes = length.on_resume(cfg, _meta(), "step_00000002")
    # 2 steps of 4,096 done, 12,288 left at 2,048 a step: 6 more
    assert cfg.train.steps == 8 and (cfg.optim.sched.total_steps, cfg.optim.sched.warmup_steps) == (5, 4)
    assert "data.global_batch 16 -> 8 at step 2: train.tokens=20480 kept: 8,192 tokens trained" in notes[0]
    assert length.convert_offset(2, 0, 16, cfg.data, "t") == 2  # data step 2 + 2 of 8 samples = sample 32
    steps_cfg = compose(["recipe=cpu_smoke", "data.global_batch=8"])
    length.resolve(steps_cfg)
    assert "train.steps=60 kept" in length.on_resume(steps_cfg, _meta(tokens=None), "t")[0]
    assert steps_cfg.train.steps == 60
    same = compose(["recipe=cpu_smoke", "train.tokens=20480"])
    length.resolve(same)
    assert length.on_resume(same, _meta(), "t") == [] and same.train.steps == 5


def test_a_batch_change_the_data_cannot_follow_is_refused_in_one_line():
    cfg = compose(["recipe=cpu_smoke", "train.tokens=20480", "data.global_batch=24", "data.micro_batch=4"])
    with pytest.raises(CheckpointError, match=r"it had read 32 samples, not a whole number of 24-sample batches; "
                                              r"resume with data.global_batch=16"):  # fmt: skip
        length.on_resume(cfg, _meta(), "step_00000002")
    mixed = compose(["recipe=cpu_smoke", "data.global_batch=8"])
    with pytest.raises(CheckpointError, match=r"data mixture: each step's 16 samples were apportioned"):
        length.on_resume(mixed, _meta(cursors={"a": 20, "b": 12}), "step_00000002")
    old = _meta()
    del old["length"]  # a checkpoint from before the history: its batch is read from its one source's position
    with pytest.raises(CheckpointError, match="predates the batch history"):
        length.on_resume(compose(["recipe=cpu_smoke", "train.tokens=20480", "data.global_batch=8"]), old, "t")


# ---- 2 ranks ------------------------------------------------------------------------------------------------
ARGS = [
    "recipe=cpu_smoke",
    "logger=none",
    "train.eval_interval=0",
    "train.checkpoint_interval=0",
    "train.log_interval=1",
]


@pytest.fixture(scope="module")
def smoke_data(tmp_path_factory) -> Path:
    """Byte-level shards at cpu_smoke's seq_len (256): 4,096 tokens a step at its global batch of 16."""
    return write_byte_dataset(tmp_path_factory.mktemp("smoke256"), seq_len=256, max_files=12)


@pytest.mark.dist
def test_train_tokens_20480_on_cpu_smoke_runs_exactly_5_steps(smoke_data, tmp_path):
    out = tmp_path / "run"
    proc = check(launch([*ARGS, f"data.path={smoke_data}", "train.tokens=20480", f"output_dir={out}"]))
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["steps"], summary["tokens"], summary["asked_tokens"]) == (5, 20480, 20480)
    assert [r["step"] for r in metrics(out) if "loss" in r] == [1, 2, 3, 4, 5]
    assert "length     20,480 tokens (train.tokens=20480) = 5 steps x 4,096 tokens/step" in proc.stdout + proc.stderr


def _reads(trace: Path, gb: int, before: int | None = None) -> dict[int, int]:
    """{sample position: row} of every read in a trace (data step x its global batch + slot), up to ``before``."""
    got = {}
    for f in trace.glob("rank*.jsonl"):
        rank = int(f.stem[4:])
        for line in f.read_text().splitlines():
            r = json.loads(line)
            if before is not None and r["data_step"] >= before:
                continue
            start = r["data_step"] * gb + r["micro"] * 4 * 2 + rank * 4  # micro 4, dp 2
            for i, row in enumerate(r["indices"]):
                assert got.setdefault(start + i, row) == row, "a sample position read twice with other rows"
    return got


@pytest.mark.dist
def test_a_resume_under_half_the_global_batch_keeps_tokens_data_and_lr_curve(smoke_data, tmp_path):
    """train.tokens=20480 at 16 x 256 a step, killed at step 3 with step 2 saved, resumed at 8 a step: 6 more steps
    (8,192 + 6 x 2,048 = 20,480), the data goes on from sample 32 with nothing read twice or skipped, and each
    resumed step's lr is the schedule at the tokens trained before it (in 4,096-token steps: 2, 2.5, 3, ...)."""
    from ultrascale.data.mixture import Mixture
    from ultrascale.data.shards import open_split
    from ultrascale.train.optim import lr_multiplier

    out, t1, t2 = tmp_path / "run", tmp_path / "trace1", tmp_path / "trace2"
    args = [
        *ARGS,
        f"data.path={smoke_data}",
        "train.tokens=20480",
        f"output_dir={out}",
        "train.checkpoint_interval=2",
        "train.checkpoint_async=false",
    ]
    killed = launch(args, env={**faults.env(kill_at="3"), "ULTRASCALE_TRACE_SAMPLES": str(t1)})
    assert killed.returncode != 0 and (out / "checkpoints" / "latest").read_text() == "step_00000002"
    proc = check(launch([*args, "data.global_batch=8"], env={"ULTRASCALE_TRACE_SAMPLES": str(t2)}))
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["resumed_from"], summary["steps"], summary["tokens"]) == (2, 8, 20480)
    assert "data.global_batch 16 -> 8 at step 2: train.tokens=20480 kept" in proc.stdout + proc.stderr
    # the data: samples 0-31 at 16 a step, then 32-79 at 8 a step (data steps 4-9), the single source's order
    first, then = _reads(t1, 16, before=2), _reads(t2, 8)
    assert sorted(first) == list(range(32)) and sorted(then) == list(range(32, 80))
    n = len(open_split(smoke_data, "train", verify=False))
    order = Mixture.single(n, 16, 1234)._run(0, 0, 80)
    assert [({**first, **then})[i] for i in range(80)] == order.tolist()
    # the lr: the 5-step schedule (warmup clamped to 4) read at the tokens trained, in 4,096-token steps
    sched = type("S", (), {"name": "cosine", "warmup_steps": 10, "min_lr_ratio": 0.1, "decay_fraction": 0.2,
                           "total_steps": None})()  # fmt: skip
    lrs = {r["step"]: r["lr"] for r in metrics(out) if "loss" in r}
    for step in range(3, 9):  # logged 1-based: step s ran optimizer step s-1, after 8,192 + (s-3) x 2,048 tokens
        at = (8192 + (step - 3) * 2048) / 4096
        assert lrs[step] == pytest.approx(3e-3 * lr_multiplier(at, sched, 5), rel=1e-9), step
    assert np.isclose(lrs[8], 3e-3 * lr_multiplier(4.5, sched, 5))
