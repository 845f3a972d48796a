"""Every launch path on 2 real CPU ranks (gloo): deepspeed and torchrun launchers with Hydra overrides,
two "nodes" on loopback with --no_ssh, a -m sweep whose jobs are 2-rank launches, and a failing rank."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import FAST, ROOT, TEST_ENV, check, free_port, launch, losses
from tests.support import faults

pytestmark = pytest.mark.dist

STEPS = 4
BASE = [*FAST, f"train.steps={STEPS}"]


def _run_dir_checks(out, world: int = 2, sweep_job: bool = False) -> None:
    """Run-directory discipline: one config/metrics set, one log per rank named by rank, no Hydra dir."""
    assert (out / "config.yaml").is_file() and (out / "summary.json").is_file()
    assert sorted(p.name for p in (out / "logs").glob("rank*.log")) == [f"rank{r:05d}.log" for r in range(world)]
    for r in range(world):
        text = (out / "logs" / f"rank{r:05d}.log").read_text()
        assert f"[rank{r}]" in text and "accelerator: cpu" in text and f"rank {r} of {world}" in text
    if sweep_job:  # written once, by the sweep's driver process, not by the ranks
        assert sorted(p.name for p in (out / ".hydra").iterdir()) == ["config.yaml", "hydra.yaml", "overrides.yaml"]
    else:  # single runs compose directly: no per-rank Hydra output
        assert not (out / ".hydra").exists()
    summary = json.loads((out / "summary.json").read_text())
    if "replicas_agree" in summary:
        assert summary["replicas_agree"], summary


@pytest.fixture(scope="module")
def torchrun_run(tiny_data, tmp_path_factory):
    """The reference: torchrun, 1 node x 2 ranks."""
    out = tmp_path_factory.mktemp("torchrun") / "run"
    proc = check(launch([*BASE, f"data.path={tiny_data}", f"output_dir={out}"], launcher="torchrun", real=True))
    return out, proc


def test_torchrun(torchrun_run):
    out, proc = torchrun_run
    _run_dir_checks(out)
    assert sorted(losses(out)) == list(range(1, STEPS + 1))
    assert "device     cpu / gloo" in proc.stdout


def test_a_warm_launch_runs_as_torchrun_does(torchrun_run, tiny_data, tmp_path):
    """The suite's other launches fork their ranks from a warm server (tests/support/warm.py) instead of paying
    torchrun's and every rank's imports: the same config must give the run torchrun gives, to the last bit (the
    same losses, parameter digests and run directory), or every test that launches warm proves less than it says."""
    ref, _ = torchrun_run
    out = tmp_path / "run"
    proc = check(launch([*BASE, f"data.path={tiny_data}", f"output_dir={out}"]))
    _run_dir_checks(out)
    assert losses(out) == losses(ref)
    summary, reference = (json.loads((d / "summary.json").read_text()) for d in (out, ref))
    assert summary["param_digests"] == reference["param_digests"] and summary["world_size"] == 2
    assert "device     cpu / gloo" in proc.stdout and "warm launch" not in proc.stderr


def test_deepspeed_launcher_with_overrides(tiny_data, tmp_path):
    out = tmp_path / "run"
    args = [*BASE, f"data.path={tiny_data}", f"output_dir={out}", "zero=stage2", "optim.weight_decay=0.05"]
    proc = check(launch([*args, "launcher/env=nvlink"], launcher="deepspeed"))
    _run_dir_checks(out)
    cfg = (out / "config.yaml").read_text()
    assert "stage: 2" in cfg and "weight_decay: 0.05" in cfg
    assert json.loads((out / "ds_config.json").read_text())["zero_optimization"]["stage"] == 2
    # the network preset is exported and logged at start
    assert "env        ULTRASCALE_NET_PRESET=nvlink" in proc.stdout and "NCCL_P2P_LEVEL=NVL" in proc.stdout
    assert sorted(losses(out)) == list(range(1, STEPS + 1))


def test_two_nodes_on_loopback_no_ssh(tiny_data, tmp_path, torchrun_run):
    """Two `launch/node.sh` (deepspeed --no_ssh) processes of 1 rank each train the same run as torchrun's 1x2."""
    ref_out, _ = torchrun_run
    out = tmp_path / "run"
    port = free_port()
    args = ["train.py", *BASE, f"data.path={tiny_data}", f"output_dir={out}"]
    procs = {}
    for node in (1, 0):
        env = {**os.environ, **TEST_ENV, "NNODES": "2", "NODE_RANK": str(node), "GPUS_PER_NODE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHON": sys.executable}  # fmt: skip
        env.pop("DS_ACCELERATOR")  # nothing set: the CPU/gloo choice must be detected (and logged)
        with open(tmp_path / f"node{node}.out", "w") as log:  # files, not pipes: a full pipe would block a node
            cmd = ["bash", str(ROOT / "launch" / "node.sh"), *args]
            procs[node] = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
    try:
        for p in procs.values():
            p.wait(timeout=600)
    finally:
        for p in procs.values():
            if p.poll() is None:  # a hung node: stop its launcher and ranks too
                os.killpg(p.pid, signal.SIGKILL)
    for node, p in procs.items():
        text = (tmp_path / f"node{node}.out").read_text()
        assert p.returncode == 0, f"node {node} exit {p.returncode}:\n" + "\n".join(text.splitlines()[-40:])
        assert f"launch/node.sh: node {node}/2" in text
    _run_dir_checks(out)
    for r in range(2):
        assert (
            "accelerator: cpu (no GPU found, so DS_ACCELERATOR=cpu), comm backend gloo"
            in (out / "logs" / f"rank{r:05d}.log").read_text()
        )
    # both "nodes" took part in every step: the 2x1 run reproduces the 1x2 run's curve
    ref, got = losses(ref_out), losses(out)
    assert sorted(got) == sorted(ref)
    assert got == pytest.approx(ref, rel=1e-5)


def test_sweep_jobs_are_multirank_launches(tiny_data, tmp_path):
    sweep = tmp_path / "zero_sweep"
    args = ["-m", "zero=stage1,stage2", "launcher=deepspeed", "launcher.nproc_per_node=2",
            f"hydra.sweep.dir={sweep}", f"data.path={tiny_data}", *BASE]  # fmt: skip
    proc = check(launch(args, launcher="python"))
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [j.name for j in jobs] == ["0", "1"]
    for job, stage in zip(jobs, (1, 2)):
        assert "deepspeed --num_gpus 2 --master_port" in (job / "launcher.log").read_text()
        _run_dir_checks(job, sweep_job=True)
        cfg = (job / "config.yaml").read_text()
        assert f"stage: {stage}" in cfg and f"output_dir: {job}" in cfg
        assert "wandb_group: zero_sweep" in cfg and f"run_name: zero_sweep-{job.name}" in cfg
    with open(sweep / "sweep_summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["job"], r["overrides"], r["status"]) for r in rows] == [
        ("0", "zero=stage1", "done"),
        ("1", "zero=stage2", "done"),
    ]
    for r, job in zip(rows, jobs):
        assert float(r["final_loss"]) == pytest.approx(json.loads((job / "summary.json").read_text())["final_loss"])
        assert float(r["tokens_per_s"]) > 0
    assert "sweep summary" in proc.stdout and "zero=stage2" in proc.stdout.split("sweep summary")[-1]


def test_failing_rank_stops_the_job(tiny_data, tmp_path):
    """Rank 1 raises at its first step while rank 0 waits in a collective: the launcher stops both, the
    message names rank 1 and the error, and nothing hangs (launch() would time out)."""
    out = tmp_path / "run"
    args = [*BASE, f"data.path={tiny_data}", f"output_dir={out}", "launcher=torchrun", "launcher.nproc_per_node=2"]
    proc = launch(args, launcher="python", env=faults.env(raise_on_rank=1), timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-3000:]
    log1 = out / "logs" / "rank00001.log"
    assert "error: rank 1 failed: RuntimeError: injected failure on rank 1 at step 0" in text, text[-3000:]
    assert f"(traceback in {log1})" in text
    assert "Traceback" in log1.read_text() and "injected failure" in log1.read_text()
    assert "error: torchrun exited with code" in text  # the driver's closing line
    assert not (out / "summary.json").exists()


def test_failing_rank_zero_under_deepspeed(tiny_data, tmp_path):
    """The same under the deepspeed launcher, with rank 0 (the one that logs to the console) failing."""
    out = tmp_path / "run"
    args = [*BASE, f"data.path={tiny_data}", f"output_dir={out}"]
    proc = launch(args, launcher="deepspeed", env=faults.env(raise_on_rank=0), timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-3000:]
    log0 = out / "logs" / "rank00000.log"
    assert (
        f"error: rank 0 failed: RuntimeError: injected failure on rank 0 at step 0 (ULTRASCALE_RAISE_ON_RANK=0) (traceback in {log0})"
        in text
    ), text[-3000:]
    assert "injected failure" in log0.read_text()
