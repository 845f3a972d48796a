"""Every rank runs the same decisions (issue 46, 1.4). Each rank validates before the process group exists and
decides from its own GPU: the fused loss's chunk and ``auto`` activation checkpointing read its free memory, and
ranks running different recompute plans hang ZeRO-3's gathers. Two real CPU ranks on a planted GPU node."""

from __future__ import annotations

import json

import pytest

from tests.conftest import check, launch


@pytest.mark.dist
def test_two_ranks_with_different_free_memory_run_rank_0s_decisions(tmp_path):
    """Each rank reads its own device (LOCAL_RANK, not GPU 0: before ``set_device`` every rank's current device
    is GPU 0), so the two decide differently for 70 and 6 GiB free; once the group exists both run rank 0's."""
    out = tmp_path / "decisions.json"
    check(launch([str(out)], script="tests/dist_scripts/decisions_agree.py", timeout=300))
    r0, r1 = json.loads(out.read_text())
    assert (r0["asked"], r1["asked"]) == ([0], [1]), (r0["asked"], r1["asked"])
    b0, b1 = r0["before"], r1["before"]
    assert b0["act-ckpt"][2] != b1["act-ckpt"][2] and b0["loss"][2] != b1["loss"][2], (b0, b1)  # the plant bites
    assert r1["after"] == r0["after"] == b0, (r0["after"], r1["after"])
    assert r1["gpu_free_after"] == r0["gpu_free_after"] == 70 * 2**30
