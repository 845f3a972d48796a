"""data_prep on a real Ray cluster: a head started here on loopback (``ray start --head``), every stage run as Ray
tasks through ``python -m data_prep executor.type=ray executor.address=...``, and the head stopped afterwards,
failures included. The guarantees are the local executor's: the same bytes at any task count, and a kill (of a Ray
worker, or of the driver) that resumes to them, reusing every unit finished before it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from data_prep.stages import chain
from data_prep.work import STAGES
from tests.conftest import BIN, ROOT
from tests.test_data_prep import _cli, cfg_for, overrides
from tests.test_data_prep_scale import finished_units, outputs, prepared, units_run  # noqa: F401 (fixture)
from ultrascale.runtime.dist import free_port

SIGNATURES = f"{STAGES.index('signatures'):02d}_signatures"


@dataclass(frozen=True)
class Head:
    address: str
    logs: Path
    """The head's session logs: Ray names each process's log after it (``worker-<id>-<job>-<pid>.out``,
    ``python-core-driver-<job...>_<pid>.log``), which is the record of which processes were its workers."""

    def workers(self, job: str | None = None) -> set[int]:
        """Pids of the Ray workers this head started (those started for ``job``, a job id in hex)."""
        names = (p.name.removesuffix(".out").split("-") for p in self.logs.glob("worker-*.out"))
        return {int(n[3]) for n in names if job is None or n[2] == job}

    def driver_jobs(self) -> dict[int, str]:
        """Driver pid -> its job id, for every driver that joined this head."""
        ids = (
            p.stem.removeprefix("python-core-driver-").rsplit("_", 1) for p in self.logs.glob("python-core-driver-*")
        )
        return {int(pid): job[:8] for job, pid in ids}


def _processes_under(root: str) -> list[int]:
    """Pids whose command line names ``root`` (every process of a head started with ``--temp-dir=root``)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and root.encode() in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


@pytest.fixture(scope="module")
def ray_head():
    """A Ray head on loopback with 2 CPUs and its own temp dir, stopped at the end of the module whatever
    happened: ``ray start --block`` stops the processes it started when it gets SIGTERM (``ray stop`` would stop
    every Ray on the host, another user's included); anything of this head still alive is then killed by pid."""
    port, root = free_port(), tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths are limited
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    start = [str(BIN / "ray"), "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
             "--include-dashboard=false", "--disable-usage-stats", "--node-ip-address=127.0.0.1", f"--temp-dir={root}"]  # fmt: skip
    log = Path(root) / "start.log"
    with open(log, "w") as out:
        head = subprocess.Popen(start, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 120
        while "Ray runtime started" not in log.read_text():
            assert head.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        yield Head(f"127.0.0.1:{port}", Path(root) / "session_latest" / "logs")
    finally:
        head.terminate()
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            head.kill()
        for pid in _processes_under(root):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)


def _ray(corpus: Path, out: Path, address: str, *extra: str, crash: str | None = None, once: Path | None = None):
    if once is not None:
        os.environ["DATA_PREP_CRASH_ONCE"] = str(once)
    try:
        return _cli(corpus, out, crash, "executor.type=ray", f"executor.address={address}", "executor.progress=false",
                    *extra)  # fmt: skip
    finally:
        os.environ.pop("DATA_PREP_CRASH_ONCE", None)


@pytest.mark.parametrize("tasks", [2, 3])
def test_ray_writes_the_bytes_of_one_local_task(prepared, ray_head, tmp_path, tasks):  # noqa: F811
    corpus, ref, _ = prepared
    out = tmp_path / "out"
    proc = _ray(corpus, out, ray_head.address, f"executor.tasks={tasks}", "executor.workers=-1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert outputs(out) == outputs(ref)  # shards, tokenizer, repos.json, decontamination list, manifest (stage stats)
    records = [json.loads(p.read_text()) for p in (out / "_work" / SIGNATURES).glob("task_*.json")]
    assert sorted(r["rank"] for r in records) == list(range(tasks))
    pids = {r["pid"] for r in records}  # they ran in this head's worker processes, not in the driver
    assert pids <= ray_head.workers() and not pids & set(ray_head.driver_jobs()), (pids, ray_head.logs)


def test_a_killed_ray_worker_is_run_again_and_reuses_the_units_it_finished(prepared, ray_head, tmp_path):  # noqa: F811
    """The fault point SIGKILLs the worker process after its first unit of the signatures stage; Ray runs the task
    again in another worker, which skips that unit (its stats keep their mtime) and finishes the rest."""
    corpus, ref, _ = prepared
    out, once = tmp_path / "out", tmp_path / "fired"
    proc = _ray(corpus, out, ray_head.address, "executor.tasks=3", "executor.workers=1", crash="signatures",
                once=once)  # fmt: skip
    assert once.exists(), "the fault point did not fire"
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert outputs(out) == outputs(ref)
    records = {r["rank"]: r for r in (json.loads(p.read_text()) for p in (out / "_work" / SIGNATURES).glob("task_*"))}
    units = sorted(int(p.stem.split("_")[1]) for p in (out / "_work" / SIGNATURES).glob("unit_*.json"))
    ran = sorted(u for r in records.values() for u in r["units"])
    (skipped,) = sorted(set(units) - set(ran))  # the one unit the killed worker finished, not done again
    stats = out / "_work" / SIGNATURES / f"unit_{skipped:05d}.json"
    killed = next(r for r in records.values() if r["units"] and r["units"][0] == skipped + 1)  # its task's rerun
    assert stats.stat().st_mtime < killed["start"], "the reused unit was written again by the retry"


def test_a_killed_driver_resumes_to_the_same_bytes_and_starts_fewer_tasks(prepared, ray_head, tmp_path):  # noqa: F811
    """SIGKILL the driver once the signatures stage has finished a unit; Ray ends the job's tasks. The next run
    keeps every finished unit (same mtime), starts only the tasks that were not complete, and writes the bytes."""
    corpus, ref, _ = prepared
    out = tmp_path / "out"
    extra = ["executor.type=ray", f"executor.address={ray_head.address}", "executor.progress=false", "executor.tasks=3",
             "executor.workers=1"]  # fmt: skip
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    driver = subprocess.Popen([sys.executable, "-m", "data_prep", *overrides(corpus, out, *extra)], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
    deadline = time.time() + 240
    while not list((out / "_work" / SIGNATURES).glob("unit_*.json")) and time.time() < deadline:
        assert driver.poll() is None, driver.stderr.read()[-3000:]
        time.sleep(0.05)
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    job = ray_head.driver_jobs()[driver.pid]
    workers = ray_head.workers(job)  # the processes Ray started for the dead driver's tasks
    assert workers, f"no worker of job {job} in {sorted(p.name for p in ray_head.logs.iterdir())}"
    deadline = time.time() + 60
    while alive := [pid for pid in workers if _running(pid)]:  # Ray ends a dead driver's tasks
        assert time.time() < deadline, f"the dead driver's workers {alive} were still running after 60 s"
        time.sleep(0.05)
    assert not (out / "manifest.json").exists()
    before = finished_units(out)  # final: no process of the dead driver is left to write
    since = time.time()
    proc = _ray(corpus, out, ray_head.address, "executor.tasks=3", "executor.workers=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert outputs(out) == outputs(ref)
    after = finished_units(out)
    assert {k: after.get(k) for k in before} == before, "a unit finished before the kill was done again"
    cfg = cfg_for(corpus, out, "executor.tasks=3")
    fresh = sum(n for _, n in chain(cfg))
    started = [json.loads(p.read_text()) for p in (out / "_work").glob("*/task_t*_r*.json")]
    resumed = [r for r in started if r["start"] >= since]
    assert 0 < len(resumed) < fresh, (len(resumed), fresh)
    assert not {u for r in resumed if r["stage"] == "signatures" for u in r["units"]} & {
        int(Path(k).stem.split("_")[1]) for k in before if SIGNATURES in k
    }
    assert units_run(out / "_work" / SIGNATURES, since)


@pytest.mark.parametrize("address", ["127.0.0.1:1", "ray://127.0.0.1:1"])
def test_an_address_nobody_answers_is_one_error_naming_it_with_nothing_written(prepared, tmp_path, address):  # noqa: F811
    corpus, _, _ = prepared
    out = tmp_path / "out"
    proc = _ray(corpus, out, address)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: no Ray cluster answers at executor.address={address}")
    assert "Traceback" not in proc.stderr and not out.exists()
