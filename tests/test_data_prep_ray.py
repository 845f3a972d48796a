"""data_prep on a real Ray cluster: a head started here on loopback (``ray start --head``), every stage run as Ray
tasks through ``python -m data_prep executor.type=ray executor.address=...``, and the head stopped afterwards,
failures included. The guarantees are the local executor's: the same bytes at any task count, and a kill (of a Ray
worker, or of the driver) that resumes to them, reusing every unit finished before it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data_prep.stages import chain
from data_prep.work import STAGES
from tests.conftest import BIN, ROOT
from tests.test_data_prep import _cli, cfg_for, overrides
from tests.test_data_prep_scale import finished_units, outputs, prepared, units_run  # noqa: F401 (fixture)
from ultrascale.dist import free_port

SIGNATURES = f"{STAGES.index('signatures'):02d}_signatures"


@pytest.fixture(scope="module")
def ray_head():
    """A Ray head on loopback with 2 CPUs; stopped at the end of the module whatever happened."""
    port = free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    start = [str(BIN / "ray"), "start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
             "--disable-usage-stats", "--node-ip-address=127.0.0.1"]  # fmt: skip
    proc = subprocess.run(start, env=env, capture_output=True, text=True, timeout=120)
    try:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([str(BIN / "ray"), "stop", "--force"], env=env, capture_output=True, timeout=120)


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
    proc = _ray(corpus, out, ray_head, f"executor.tasks={tasks}", "executor.workers=-1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert outputs(out) == outputs(ref)  # shards, tokenizer, repos.json, decontamination list, manifest (stage stats)
    records = [json.loads(p.read_text()) for p in (out / "_work" / SIGNATURES).glob("task_*.json")]
    assert sorted(r["rank"] for r in records) == list(range(tasks))
    assert not {r["pid"] for r in records} & {os.getpid()}  # they ran in Ray's worker processes


def test_a_killed_ray_worker_is_run_again_and_reuses_the_units_it_finished(prepared, ray_head, tmp_path):  # noqa: F811
    """The fault point SIGKILLs the worker process after its first unit of the signatures stage; Ray runs the task
    again in another worker, which skips that unit (its stats keep their mtime) and finishes the rest."""
    corpus, ref, _ = prepared
    out, once = tmp_path / "out", tmp_path / "fired"
    proc = _ray(corpus, out, ray_head, "executor.tasks=3", "executor.workers=1", crash="signatures", once=once)
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
    extra = ["executor.type=ray", f"executor.address={ray_head}", "executor.progress=false", "executor.tasks=3",
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
    time.sleep(3)  # Ray ends a dead driver's tasks; give a task in flight the time to be stopped
    assert not (out / "manifest.json").exists()
    before = finished_units(out)
    time.sleep(1)
    assert finished_units(out) == before, "tasks of the dead driver were still writing"
    since = time.time()
    proc = _ray(corpus, out, ray_head, "executor.tasks=3", "executor.workers=1")
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
