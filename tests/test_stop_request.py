"""The STOP request file: one nobody answered (its writer, a driver Ctrl-C'd before the ranks started, died before
it could remove it) is removed when the next attempt starts, instead of stopping that attempt right after its
resume; one whose writer lives (a driver or a Slurm batch script waiting on the ranks) still stops the run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time

import pytest

from tests.conftest import FAST, check, launch, metrics


def _stops(out):
    return [r for r in metrics(out) if r.get("event") == "stop"]


@pytest.mark.parametrize("writer", ["dead", "unnamed", "alive"])
def test_a_stop_request_from_before_the_launch_stands_only_while_its_writer_lives(writer, tiny_data, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    if writer == "dead":
        gone = subprocess.Popen(["true"])
        gone.wait()
        text = f"SIGINT\nwriter: {socket.gethostname()} {gone.pid}\n"
    else:  # unnamed: a hand-written request (or one from before writers were named); alive: this test's process
        text = "SIGINT\n" if writer == "unnamed" else f"SIGINT\nwriter: {socket.gethostname()} {os.getpid()}\n"
    (out / "STOP").write_text(text)
    old = time.time() - 120
    os.utime(out / "STOP", (old, old))
    proc = check(launch([*FAST, "train.steps=2", f"data.path={tiny_data}", f"output_dir={out}"], nproc=0))
    summary = json.loads((out / "summary.json").read_text())
    assert not (out / "STOP").exists()
    if writer == "alive":  # the request stands: the run stops before its first step, with nothing lost
        assert summary["complete"] is False and [s["signal"] for s in _stops(out)] == ["SIGINT (via the STOP file)"]
        assert "nothing answered" not in proc.stderr
    else:
        assert summary["complete"] is True and not _stops(out), proc.stderr[-2000:]
        assert "a stop request (SIGINT, written" in proc.stderr and "nothing answered: removed" in proc.stderr
