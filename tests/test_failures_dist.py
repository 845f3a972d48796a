"""Failures on 2 real CPU ranks: a signal saves the current step and exits 0, a lost rank restarts by itself, a
kill during a background checkpoint write keeps the previous ``latest``, the Slurm script turns USR1 into a
checkpoint and a requeue, and a resume that would damage the run is refused before it writes a byte. Each
resumed run is compared with an uninterrupted one: losses to 1e-6 and the samples each rank read."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import BIN, FAST, ROOT, TEST_ENV, check, free_port, launch, losses, metrics
from tests.support import faults

pytestmark = pytest.mark.dist

STEPS = 14
BASE = [*FAST, f"train.steps={STEPS}", "train.checkpoint_interval=5", "train.log_interval=1"]
# A 4 s stall in step 7's data fetch on rank 0: a signal sent once step 6 is logged lands inside step 7, so the
# stop comes after step 7, between the checkpoints at 5 and 10.
STALL = "slow_data@7:0x4"


def _events(out: Path, kind: str) -> list[dict]:
    return [r for r in metrics(out) if r.get("event") == kind]


def _reads(trace_dir: Path) -> dict[int, list[list[int]]]:
    """Per rank, the sample indices of every micro-batch read, in reading order."""
    return {int(f.stem[4:]): [json.loads(ln)["indices"] for ln in f.read_text().splitlines()]
            for f in sorted(trace_dir.glob("rank*.jsonl"))}  # fmt: skip


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory) -> tuple[Path, Path]:
    """The uninterrupted run (torchrun, 2 ranks) and the samples it read."""
    root = tmp_path_factory.mktemp("reference")
    check(launch([*BASE, f"data.path={tiny_data}", f"output_dir={root / 'run'}"],
                 env={"ULTRASCALE_TRACE_SAMPLES": str(root / "trace")}))  # fmt: skip
    return root / "run", root / "trace"


def _assert_resumed_equals_reference(out: Path, trace: Path, reference: tuple[Path, Path]) -> None:
    ref_dir, ref_trace = reference
    ref, got = losses(ref_dir), losses(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-6, abs=1e-6), step
    assert _reads(trace) == _reads(ref_trace)  # every sample read once, in the same order, none lost or repeated


def _start(cmd: list[str], out: Path, env: dict | None = None) -> subprocess.Popen:
    """A command in its own process group (a terminal's foreground job), output to a file."""
    log = open(out.parent / f"{out.name}.log", "w")  # noqa: SIM115 (closed with the process)
    full = {**os.environ, **TEST_ENV, **(env or {})}
    return subprocess.Popen(cmd, cwd=ROOT, env=full, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for(pred, proc: subprocess.Popen, timeout: float = 300) -> None:
    t0 = time.time()
    while not pred():
        assert proc.poll() is None, "the run ended before the signal could be sent"
        assert time.time() - t0 < timeout, "timed out waiting for the run"
        time.sleep(0.1)


def _logged(out: Path, step: int):
    def pred() -> bool:
        try:
            return any(r["step"] >= step and "loss" in r for r in metrics(out))
        except (OSError, json.JSONDecodeError):
            return False

    return pred


def _wait_gone(out: Path, timeout: float = 120) -> None:
    """Until no process of this run (a rank, a launcher) is left."""
    t0 = time.time()
    while [p for p in psutil.process_iter(["cmdline"]) if f"output_dir={out}" in " ".join(p.info["cmdline"] or [])]:
        assert time.time() - t0 < timeout, "the run's processes did not exit"
        time.sleep(0.2)


def _log(out: Path) -> str:
    return (out.parent / f"{out.name}.log").read_text()


# ---- a signal keeps every step ---------------------------------------------------------------------------------


# The default suite keeps torchrun's Ctrl-C here and the bare `deepspeed` launcher's in the test after this one;
# the driver's and the runner's SIGTERM paths are `make test-all`'s (slow: ~45 s each on the 2-core CI box, whose
# 90-minute limit the suite came within 10 minutes of).
@pytest.mark.parametrize(
    "how",
    [
        pytest.param("driver-deepspeed-SIGTERM-then-SIGINT", marks=pytest.mark.slow),
        "torchrun-ctrl-c",
        pytest.param("deepspeed-runner-SIGTERM", marks=pytest.mark.slow),
    ],
)
def test_a_signal_saves_the_current_step_and_the_resume_equals_uninterrupted(how, tiny_data, reference, tmp_path):
    """Stopped mid-interval (after step 7; checkpoints every 5), the run saves step 7, writes a ``stop`` event and
    exits 0 (the launchers' own exit codes are theirs); rerun, it resumes at step 7 and equals the uninterrupted
    run sample for sample.

    - driver: ``python train.py launcher=deepspeed``, SIGTERM to it, then during the save SIGINT to the ranks'
      process group (a second signal reaches the ranks themselves while they write);
    - ``torchrun`` typed by hand and Ctrl-C (SIGINT to its whole process group; torchrun then forwards SIGTERM);
    - ``deepspeed`` typed by hand and SIGTERM to that command alone: it dies without forwarding it, and the ranks
      stop because their launcher is gone.
    """
    out, trace = tmp_path / "run", tmp_path / "trace"
    args = [*BASE, f"data.path={tiny_data}", f"output_dir={out}"]
    env = {"ULTRASCALE_TRACE_SAMPLES": str(trace), "ULTRASCALE_INJECT": STALL}
    if how.startswith("driver"):  # and a slow disk under step 7's checkpoint, so the second signal lands mid-save
        env["ULTRASCALE_INJECT"] = f"{STALL},slow_ckpt@7:0x3"
        cmd = [sys.executable, "train.py", *args, "launcher=deepspeed", "launcher.nproc_per_node=2"]
    elif how.startswith("torchrun"):
        cmd = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()), "train.py", *args]
    else:
        cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), "train.py", *args]
    proc = _start(cmd, out, env)
    _wait_for(_logged(out, 6), proc)
    if how.startswith("driver"):
        os.kill(proc.pid, signal.SIGTERM)
        _wait_for(lambda: any(r["step"] > 5 for r in _events(out, "checkpoint")), proc)  # the save has begun
        assert not (out / "STOPPED").exists()  # still writing step 7 (3 s slow disk)
        launcher = next(iter(psutil.Process(proc.pid).children()), None)
        if launcher is not None:
            os.killpg(launcher.pid, signal.SIGINT)  # the launcher's own group: the ranks get it while saving
        os.kill(proc.pid, signal.SIGINT)
    elif how.startswith("torchrun"):
        os.killpg(proc.pid, signal.SIGINT)
    else:
        os.kill(proc.pid, signal.SIGTERM)
    rc = proc.wait(timeout=300)
    _wait_gone(out)  # the raw deepspeed command dies of SIGTERM at once; its launch.py and ranks finish the save
    if how.startswith("driver"):
        assert rc == 0, _log(out)[-3000:]
        assert "stopped by SIGTERM with a checkpoint" in _log(out)
    (stop,) = _events(out, "stop")
    assert stop["step"] == 7 and stop["checkpoint"] == "step_00000007", _log(out)[-3000:]
    expected = {"driver": "SIGTERM (via the STOP file)", "torchrun": "SIGINT", "deepspeed": "launcher exit"}
    assert stop["signal"].startswith(expected[how.split("-")[0]]), stop
    assert (out / "checkpoints" / "latest").read_text() == "step_00000007"
    assert json.loads((out / "STOPPED").read_text())["step"] == 7 and not (out / "STOP").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["complete"] is False and summary["stopped_by"] == stop["signal"]
    check(launch(args, env={"ULTRASCALE_TRACE_SAMPLES": str(trace)}))
    assert not (out / "STOPPED").exists()
    (resume,) = _events(out, "resume")
    assert resume["from_step"] == 7 and resume["steps_lost"] == 0
    _assert_resumed_equals_reference(out, trace, reference)


def test_ctrl_c_under_the_bare_deepspeed_launcher_with_wandb_on_keeps_its_step(tiny_data, reference, tmp_path):
    """Ctrl-C in the terminal of ``deepspeed --num_gpus 2 train.py`` with the default loggers (offline wandb and
    TensorBoard on): SIGINT reaches the whole process group, and DeepSpeed's launch.py answers it by SIGTERMing each
    rank and all its children, which killed wandb's service under rank 0, so the stop's first log raised and
    ``latest`` stayed at step 5. The stop must commit step 7, keep logging to wandb, exit with no ``error:`` line,
    leave no shared-memory buffer behind, and resume into the uninterrupted run."""
    from tests.wandb_files import read_run
    from ultrascale.runtime import shm

    out, trace = tmp_path / "run", tmp_path / "trace"
    args = [*(a if a != "logger=none" else "logger=default" for a in BASE), f"data.path={tiny_data}",
            f"output_dir={out}"]  # fmt: skip
    port = free_port()
    cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(port), "train.py", *args]
    proc = _start(cmd, out, {"ULTRASCALE_TRACE_SAMPLES": str(trace), "ULTRASCALE_INJECT": STALL})
    _wait_for(_logged(out, 6), proc)
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal does: the runner, launch.py and both ranks
    proc.wait(timeout=300)
    _wait_gone(out)
    log = _log(out)
    assert (out / "checkpoints" / "latest").read_text() == "step_00000007", log[-3000:]
    (stop,) = _events(out, "stop")
    assert stop["step"] == 7 and stop["signal"] == "SIGINT" and stop["checkpoint"] == "step_00000007", stop
    assert not [ln for ln in log.splitlines() if ln.startswith("error:")], log[-3000:]
    assert log.index("checkpoint step_00000007") < log.index("step      7 |"), log[-3000:]  # views held for the save
    steps = {row.get("_step") for row in read_run(out)["history"] if "train/loss" in row}
    assert 7 in steps, sorted(steps)  # wandb kept its curve through the stop: its service outlived the teardown
    assert not [p for p in shm.buffers() if shm.parse(p.name)["port"] == port]
    check(launch(args, launcher="deepspeed", env={"ULTRASCALE_TRACE_SAMPLES": str(trace)}))
    (resume,) = _events(out, "resume")
    assert resume["from_step"] == 7 and resume["steps_lost"] == 0
    _assert_resumed_equals_reference(out, trace, reference)


# ---- a lost rank restarts by itself ----------------------------------------------------------------------------


@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_a_killed_rank_restarts_the_job_which_finishes_like_the_uninterrupted_run(launcher, tiny_data, reference,
                                                                                  tmp_path):  # fmt: skip
    """SIGKILL of rank 1 at step 8 with ``launcher.max_restarts=1``: the launch restarts by itself (torchrun's
    --max-restarts; the driver's loop for the deepspeed launcher), resumes from step 5 and finishes; the
    restart and the 2 steps it lost are in metrics.jsonl and the comb report."""
    out, trace = tmp_path / "run", tmp_path / "trace"
    args = [*BASE, f"data.path={tiny_data}", f"output_dir={out}", f"launcher={launcher}", "launcher.max_restarts=1",
            faults.SYNC_SAVES]  # step 5's checkpoint is `latest` before the kill  # fmt: skip
    proc = launch(args, nproc=0, env={**faults.env(kill_at="7:1"), "ULTRASCALE_TRACE_SAMPLES": str(trace)})
    check(proc)
    (resume,) = _events(out, "resume")
    assert resume["restart"] == 1 and resume["from_step"] == 5 and resume["steps_lost"] == 2, resume
    summary = json.loads((out / "summary.json").read_text())
    assert summary["complete"] is True and summary["resumed_from"] == 5
    ref_dir, ref_trace = reference
    ref, got = losses(ref_dir), losses(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-6, abs=1e-6), step
    reads, ref_reads = _reads(trace), _reads(ref_trace)
    gas = len(ref_reads[0]) // STEPS
    for rank in ref_reads:  # the first attempt read steps 1-7 (rank 0 maybe part of 8), the restart 6-14
        assert reads[rank][-(STEPS - 5) * gas :] == ref_reads[rank][5 * gas :]
    report = (out / "report.md").read_text()
    assert "restart" in report and "2 steps lost" in report, report
    if launcher == "deepspeed":  # its shm all-reduce buffers (69 MB a rank): neither the killed launch nor the
        from ultrascale.runtime import shm  # finished one leaves them in /dev/shm

        launches = [ln.split() for ln in (out / "launcher.log").read_text().splitlines() if ln.startswith("$ ")]
        ports = {int(cmd[cmd.index("--master_port") + 1]) for cmd in launches}
        assert len(ports) == 2 and not [p for p in shm.buffers() if shm.parse(p.name)["port"] in ports]


# ---- a kill during the background write ------------------------------------------------------------------------


def test_a_kill_during_the_background_write_keeps_the_previous_latest_and_resumes_exactly(tiny_data, reference,
                                                                                          tmp_path):  # fmt: skip
    """Step 10's checkpoint is still being written (a 60 s slow disk planted in rank 0's writer thread) when rank
    0 is killed at step 12: ``latest`` stays step 5, step 10's files have no meta, and the resume from 5 equals the
    uninterrupted run."""
    out, trace = tmp_path / "run", tmp_path / "trace"
    args = [*BASE, f"data.path={tiny_data}", f"output_dir={out}"]
    killed = launch(args, env={"ULTRASCALE_INJECT": "slow_ckpt@10:0x60", **faults.env(kill_at="12"),
                               "ULTRASCALE_TRACE_SAMPLES": str(trace)})  # fmt: skip
    assert killed.returncode != 0, "the fault hook did not kill the run"
    assert (out / "checkpoints" / "latest").read_text() == "step_00000005"
    assert (out / "checkpoints" / "step_00000010").is_dir()
    assert not (out / "checkpoints" / "step_00000010" / "ultrascale_meta.json").exists()
    before = {r["step"] for r in _events(out, "checkpoint")}
    assert {5, 10} <= before and max(r["checkpoint_s"] for r in _events(out, "checkpoint")) < 30  # no stall
    check(launch(args, env={"ULTRASCALE_TRACE_SAMPLES": str(tmp_path / "trace2")}))
    (resume,) = _events(out, "resume")
    assert resume["from_step"] == 5 and resume["steps_lost"] == 7
    ref_dir, ref_trace = reference
    ref, got = losses(ref_dir), losses(out)
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-6, abs=1e-6), step
    assert (out / "checkpoints" / "latest").read_text() == f"step_{STEPS:08d}"
    killed_reads, resumed, ref_reads = _reads(trace), _reads(tmp_path / "trace2"), _reads(ref_trace)
    gas = len(ref_reads[0]) // STEPS
    for rank in ref_reads:  # steps 1-5 as read before the kill, then the resume reads steps 6-14 and nothing else
        assert killed_reads[rank][: 5 * gas] + resumed[rank] == ref_reads[rank], rank


# ---- Slurm: USR1 before the time limit -> checkpoint -> requeue -----------------------------------------------

_SRUN = """#!/bin/bash
# srun stand-in: drop srun's own options and run the task here (one node)
while [[ $1 == --* ]]; do shift; done
exec "$@"
"""
_SCONTROL = """#!/bin/bash
# scontrol stand-in: this host for 'show hostnames', and a record of every requeue
case "$1" in
  show) echo localhost ;;
  requeue) echo "requeue $2" >> "$SCONTROL_LOG" ;;
esac
"""


def test_the_slurm_script_turns_usr1_into_a_checkpoint_and_a_requeue(tiny_data, reference, tmp_path):
    """The rendered sbatch script, run by bash with stand-ins for srun and scontrol: USR1 (what Slurm sends
    ``signal_lead_s`` before the time limit) makes the run save its current step and stop; the script requeues the
    job and exits 0; the requeued job (the same script again) resumes and equals the uninterrupted run."""
    from launch.slurm import render_sbatch
    from ultrascale.config.compose import compose

    out, trace = tmp_path / "run", tmp_path / "trace"
    overrides = [*BASE, f"data.path={tiny_data}", "launcher=slurm", "launcher.nproc_per_node=2",
                 f"launcher.master_port={free_port()}", f"output_dir={out}"]  # fmt: skip
    script = tmp_path / "sbatch.sh"
    script.write_text(render_sbatch(compose(overrides), overrides))
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, text in (("srun", _SRUN), ("scontrol", _SCONTROL)):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    env = {"PATH": f"{stubs}:{BIN}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "localhost",
           "SLURM_NNODES": "1", "SCONTROL_LOG": str(tmp_path / "scontrol.log"), "PYTHON": sys.executable,
           "ULTRASCALE_TRACE_SAMPLES": str(trace), "ULTRASCALE_INJECT": STALL}  # fmt: skip
    proc = _start(["bash", str(script)], out, env)
    _wait_for(_logged(out, 6), proc)
    os.kill(proc.pid, signal.SIGUSR1)  # --signal=B:USR1 reaches the batch shell only
    assert proc.wait(timeout=300) == 0, _log(out)[-3000:]
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    (stop,) = _events(out, "stop")
    assert stop["step"] == 7 and stop["signal"] == "USR1 (via the STOP file)"
    assert (out / "checkpoints" / "latest").read_text() == "step_00000007" and not (out / "STOP").exists()
    env.pop("ULTRASCALE_INJECT")
    requeued = subprocess.run(["bash", str(script)], cwd=ROOT, env={**os.environ, **TEST_ENV, **env,
                                                                   "SLURM_RESTART_COUNT": "1"},
                              capture_output=True, text=True, timeout=600)  # fmt: skip
    assert requeued.returncode == 0, (requeued.stdout + requeued.stderr)[-3000:]
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"  # finished: not requeued again
    (resume,) = _events(out, "resume")
    assert resume["from_step"] == 7 and resume["requeue"] == 1
    _assert_resumed_equals_reference(out, trace, reference)


# ---- a resume never damages the run ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def zero3_run(tiny_data, tmp_path_factory) -> tuple[Path, list[str]]:
    out = tmp_path_factory.mktemp("zero3") / "run"
    args = [*FAST, "train.steps=4", "train.checkpoint_interval=2", "zero=stage3", f"data.path={tiny_data}",
            f"output_dir={out}"]  # fmt: skip
    check(launch(args))
    return out, args


TRAPS = [
    ("zero stage and lr", ["zero=stage1", "optim.lr=1e-2"], 2, "zero.stage=1 but checkpoint step_00000004 was saved with zero.stage=3"),
    ("one rank", [], 1, "saved by 2 ranks"),
    ("schedule length", ["train.steps=6"], 2, "train.steps=6 changes the cosine schedule"),
    ("model shape", ["model.config.num_hidden_layers=3"], 2, "model.config.num_hidden_layers=3"),
]  # fmt: skip


@pytest.mark.parametrize("name, extra, nproc, needle", TRAPS, ids=[t[0] for t in TRAPS])
def test_a_resume_trap_is_one_error_line_and_leaves_the_run_record_untouched(name, extra, nproc, needle, zero3_run):
    out, args = zero3_run
    record = {p: (out / p).read_bytes() for p in ("config.yaml", "ds_config.json", "metrics.jsonl")}
    attempts = sorted(p.name for p in (out / "attempts").iterdir())
    proc = launch([*args, *extra], nproc=nproc if nproc > 1 else 0)  # one rank: plain python
    assert proc.returncode == (2 if nproc == 1 else 1), proc.stdout[-2000:] + proc.stderr[-2000:]  # torchrun: 1
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], proc.stderr[-3000:]
    if "Traceback" in proc.stderr:  # torchrun's own report of a worker that exited 2; none through our code
        assert "ChildFailedError" in proc.stderr and "ultrascale/" not in proc.stderr, proc.stderr[-3000:]
    assert {p: (out / p).read_bytes() for p in record} == record
    assert sorted(p.name for p in (out / "attempts").iterdir()) == attempts  # refused before anything was written


def test_a_slow_rank_0_still_says_the_error_once(zero3_run):
    """Rank 1 holds the same refusal long before rank 0 gets to print it (planted: rank 0 waits 2 s): rank 1
    must not exit first, or the launcher kills rank 0 mid-wait and no error line is printed at all."""
    from ultrascale.cli import DELAY_RANK0_ERROR_ENV

    _, args = zero3_run
    proc = launch([*args, "zero=stage1"], env={DELAY_RANK0_ERROR_ENV: "2"})
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: zero.stage=1 but checkpoint"), proc.stderr[-3000:]


@pytest.mark.parametrize("rank0", ["slow", "killed"])
def test_rank_1_failing_first_still_gives_the_one_error_line(rank0, zero3_run):
    """Rank 1 holds the refusal first. ``slow``: rank 0 gets to the same one 8 s later (past any fixed grace): its
    line, without a rank, is the one printed. ``killed``: rank 0 is SIGKILLed before it can say it (as an
    out-of-memory kill would; 3 s late, so rank 1 has failed by then) and torchrun SIGTERMs rank 1: rank 1 must say
    ``error: rank 1: ...``, not die silently."""
    from ultrascale.cli import DELAY_RANK0_ERROR_ENV, KILL_RANK0_ERROR_ENV

    _, args = zero3_run
    env = {DELAY_RANK0_ERROR_ENV: "8"} if rank0 == "slow" else {DELAY_RANK0_ERROR_ENV: "3", KILL_RANK0_ERROR_ENV: "1"}
    proc = launch([*args, "zero=stage1"], env=env)
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    want = "error: zero.stage=1 but checkpoint" if rank0 == "slow" else "error: rank 1: zero.stage=1 but checkpoint"
    assert len(errors) == 1 and errors[0].startswith(want), proc.stderr[-3000:]


def test_an_attempt_that_fails_after_its_checks_keeps_the_run_record_and_its_own_config(zero3_run, tmp_path):
    """A checkpoint whose bytes are garbage at the recorded size passes the checks and fails inside DeepSpeed:
    the run's config.yaml still describes the run that made the checkpoint; the attempt's config sits in
    attempts/NNN. The allowed change it made (more steps, schedule kept) is said in the resume event when a good
    checkpoint loads."""
    import shutil

    src, args = zero3_run
    out = tmp_path / "copy"
    shutil.copytree(src, out)
    args = [a for a in args if not a.startswith("output_dir=")] + [f"output_dir={out}"]
    before = (out / "config.yaml").read_bytes()
    states = next((out / "checkpoints" / "step_00000004").glob("*model_states.pt"))
    states.write_bytes(b"\0" * states.stat().st_size)
    proc = launch([*args, "train.steps=6", "optim.sched.total_steps=4"])
    assert proc.returncode != 0 and "error: rank" in proc.stderr
    assert (out / "config.yaml").read_bytes() == before
    newest = sorted((out / "attempts").iterdir())[-1]
    assert "steps: 6" in (newest / "config.yaml").read_text()
    shutil.rmtree(out / "checkpoints" / "step_00000004")  # latest gone: the newest checkpoint that verifies is 2
    check(launch([*args, "train.steps=6", "optim.sched.total_steps=4"]))
    (resume,) = [r for r in _events(out, "resume") if r.get("skipped")]
    assert resume["from_step"] == 2 and "step_00000004 does not exist" in resume["skipped"]
    assert "train.steps 4 -> 6 with the schedule kept at 4 steps" in resume["changes"]
    assert "steps: 6" in (out / "config.yaml").read_text()  # promoted once its checkpoint loaded
