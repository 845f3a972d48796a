"""Every rank runs the same decisions (issue 46, 1.4), and the trainer applies the GPU ones it is handed (issue 54,
section 3, defects 2-4). Each rank validates before the process group exists and decides from its own GPU: the fused
loss's chunk and ``auto`` activation checkpointing read its free memory, and ranks running different recompute plans
hang ZeRO-3's gathers.

On a CPU none of this shows by itself: CPU ranks decide alike, staging there is pageable, and
``Checkpointer.prestage`` does nothing unless staging is pinned. So one 2-rank launch
(``tests/dist_scripts/decisions_agree.py``) runs the real ``train.py`` path, then ``ultrascale.train.memprobe``'s
probe, on a planted GPU node whose two devices read 70 and 6 GiB free, with the trainer's staging planted as
``tests/test_ckpt_slab.py`` plants it (the strict ``cudart`` recorder). It checks the wiring, not the helpers:
``agree_across_ranks`` in ``ultrascale/train/run.py`` and in ``ultrascale/train/memprobe.py``; the staging decision
``ultrascale/train/trainer.py`` hands its checkpointer (``staging=d.checkpoint_staging.value``); and the trainer's
``self.checkpointer.prestage(self.engine)`` after the first step, which keeps the pinning out of the first save's
measured stall."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import FAST, check, launch, metrics

GIB = 2**30
RUN = [*FAST, "train.steps=3", "train.checkpoint_interval=2",
       # the planted H100 would pick FlexAttention (on a CPU, its slow reference implementation) and CUDA-event
       # timing, which a CPU cannot record; every other decision is the GPU's
       "train.attention_kernel=sdpa", "train.step_breakdown=false"]  # fmt: skip


@pytest.fixture(scope="module")
def planted(tiny_data, tmp_path_factory) -> tuple[list[dict], list[dict], Path]:
    """(each rank's record of train.py, each rank's memprobe record, the run directory): one launch."""
    out = tmp_path_factory.mktemp("decisions")
    run = out / "run"
    check(launch([str(out), *RUN, f"data.path={tiny_data}", f"output_dir={run}"],
                 script="tests/dist_scripts/decisions_agree.py", timeout=300))  # fmt: skip
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    probes = [json.loads((out / f"mem.json.rank{r}").read_text()) for r in (0, 1)]
    return ranks, probes, run


@pytest.mark.dist
def test_train_py_and_memprobe_run_rank_0s_decisions_on_every_rank(planted):
    """Each rank reads its own device (LOCAL_RANK, not GPU 0: before ``set_device`` every rank's current device is
    GPU 0), so the two decide differently for 70 and 6 GiB free; the trainer ``train/run.py`` builds and the
    probe ``memprobe`` builds both run rank 0's (``agree_across_ranks``)."""
    (r0, r1), (m0, m1), _ = planted
    assert (r0["asked"], r1["asked"]) == ([0], [1]), (r0["asked"], r1["asked"])
    b0, b1 = r0["before"], r1["before"]
    assert b0["loss"] != b1["loss"], (b0, b1)  # the plant bites: 70 GiB free gives a larger chunk than 6
    assert r1["after"] == r0["after"] == b0, (r0["after"], r1["after"])
    assert r1["gpu_free_after"] == r0["gpu_free_after"] == 70 * GIB
    features = {k: v for k, v in b0.items() if k not in ("staging", "flat_batches")}
    assert m1["decisions"] == m0["decisions"] == features, (m0["decisions"], m1["decisions"])


@pytest.mark.dist
def test_the_trainer_hands_the_runs_pinned_staging_to_its_checkpointer(planted):
    """An nccl run's ``checkpoint_staging`` is ``pinned`` (``levers.decide.staging_mode``); ``Trainer`` passes that
    value on, and every save stages pinned and allocates nothing (the buffers exist before it)."""
    (r0, r1), _, run = planted
    assert r0["after"]["staging"] == [True, "pinned"]
    assert r0["handed"] == r1["handed"] == "pinned", (r0["handed"], r1["handed"])
    saves = [r for r in metrics(run) if r.get("event") == "checkpoint"]
    assert [(r["step"], r["staging"], r["staging_alloc_s"]) for r in saves] == [(2, "pinned", 0.0), (3, "pinned", 0.0)]


@pytest.mark.dist
def test_the_trainer_prestages_after_the_first_step_before_any_save(planted):
    """``Trainer._after_step`` calls ``Checkpointer.prestage`` after step 1: by the top of step 2, with nothing
    saved yet, the staging buffers are allocated and their one region registered. Without that call the first
    save would pre-stage inside its own measured stall."""
    (r0, r1), _, _ = planted
    for got in (r0["before_step_2"], r1["before_step_2"]):
        assert got["mode"] == "pinned" and got["saved"] == -1, got
        assert got["registers"] == 1 and got["allocations"] > 0, got
