"""The GPU probe (bench/gpu_probe.py) on a CPU host: its plan is complete and fits the device tool's 8-minute
command, its runner turns a failed, a hung and an out-of-time step into rows instead of crashing, and a lever
whose key the schema lacks is reported as such. The GPU sections themselves run only on a GPU node."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from tests.conftest import ROOT
from tests.test_ckpt_staging import gpu_probe


def test_the_dry_run_lists_every_section_and_lever_with_a_limit(tmp_path):
    out = subprocess.run([sys.executable, "bench/gpu_probe.py", "--dry-run", "--work", str(tmp_path / "w")],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    probe = gpu_probe()
    text = out.stdout
    for section in probe.SECTIONS:
        assert f"[{section}]" in text, section
    for key, values in probe.LEVERS.items():
        for value in values:
            assert f"{key}={value} " in text, (key, value)
    assert "--no-index" in text and "--no-deps" in text and "bench/_trainer_loop.py" in text
    assert "bench/bench_generate.py" in text and "recipe=llama_1b_zero0" in text
    for s in range(4):
        assert f"zero=stage{s}" in text
    assert not (tmp_path / "w").exists()  # a dry run creates nothing
    assert probe.DEFAULT_BUDGET_S <= 480  # the device tool's command limit for the probe is 8 minutes


def test_sections_and_levers_narrow_the_plan_and_install_always_runs():
    probe = gpu_probe()
    plan = probe.Plan(ROOT / "w", ROOT / "wh", ["trainer"], {"train.compile": ("false",)})
    assert [s.section for s in plan.steps] == ["install", "install", "data", "trainer"]
    plan = probe.Plan(ROOT / "w", ROOT / "wh", ["levers"], {"train.compile": ("false",)})
    assert [s.name for s in plan.steps if s.section == "levers"] == ["train.compile=false"]


def test_a_failed_a_hung_and_an_out_of_time_step_are_rows(tmp_path):
    """Real subprocesses: one exits 3 with an ``error:`` line, one sleeps past its limit (killed with its process
    group), one is not started because the budget is spent; the probe still prints its table and writes JSON."""
    probe = gpu_probe()
    plan = probe.Plan(tmp_path, tmp_path / "wh", [], {})
    py, pidfile = sys.executable, tmp_path / "hung.pid"
    hang = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    plan.steps = [
        probe.Step("zero", "fails", [[py, "-c", "print('error: planted'); raise SystemExit(3)"]], 3),
        probe.Step("export", "hangs", [[py, "-c", hang]], 2),
        probe.Step("sampler", "never starts", [[py, "-c", "print('ran')"]], 60),
    ]
    result = probe.execute(plan, budget=8.0, out_json=tmp_path / "probe.json")
    rows = {r["name"]: r for r in result["rows"]}
    assert rows["fails"]["rc"] == 3 and "error: planted" in rows["fails"]["result"]
    assert rows["hangs"]["rc"] == 124 and "timed out" in rows["hangs"]["result"] and rows["hangs"]["seconds"] < 15
    assert rows["never starts"]["result"].startswith("skipped: out of time")
    pid = int(pidfile.read_text())
    try:
        os.kill(pid, 0)
        alive = True
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        alive = False
    assert not alive, "the hung step's process outlived its limit"
    assert json.loads((tmp_path / "probe.json").read_text())["rows"][0]["name"] == "fails"


def test_a_prerequisite_that_fails_skips_the_rest(tmp_path):
    probe = gpu_probe()
    plan = probe.Plan(tmp_path, tmp_path / "no_wheelhouse", ["trainer"], {})
    plan.steps = [*plan.steps[:1], probe.Step("trainer", "after", [[sys.executable, "-c", "pass"]], 10)]
    rows = probe.execute(plan, budget=60.0, out_json=None)["rows"]
    assert rows[0]["rc"] == 127 and "make wheelhouse" in rows[0]["result"]  # no wheels: the fix is named
    assert rows[1]["result"] == "skipped: the install or data step failed"


def test_a_lever_the_schema_lacks_is_a_row_not_a_crash():
    probe = gpu_probe()
    assert probe.missing_lever("train.checkpoint_staging", "pinned") is None
    assert probe.missing_lever("train.compile", "false") is None
    assert probe.missing_lever("train.no_such_lever", "on").startswith("key missing: train.no_such_lever")
    assert probe.missing_lever("train.checkpoint_staging", "locked").startswith("value missing")
    assert probe.missing_lever("train.compile", "maybe").startswith("value missing")
