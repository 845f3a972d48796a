"""The GPU probe (bench/gpu_probe.py) on a CPU host: its plan is complete, names what each step measures and fits
the device tool's 8-minute command (the rest as further calls), its runner turns a failed, a hung and an
out-of-time step into rows instead of crashing, leaves no process of a step behind (setsid'd grandchildren
included), writes its JSON after every step, and a lever whose key the schema lacks is reported as such. The GPU
sections themselves run only on a GPU node."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT
from tests.test_ckpt_staging import gpu_probe


def test_the_dry_run_lists_every_section_and_lever_with_a_limit(tmp_path):
    """With a budget that holds everything, one call's plan has every section and lever row."""
    out = subprocess.run([sys.executable, "bench/gpu_probe.py", "--dry-run", "--work", str(tmp_path / "w"),
                          "--budget", "100000"], cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    probe = gpu_probe()
    text = out.stdout
    for section in probe.SECTIONS:
        assert f"[{section}]" in text, section
    for key, values in probe.LEVERS.items():
        for value in values:
            assert f"{key}={value} " in text, (key, value)
    assert "--worker install" in text and "bench/_trainer_loop.py" in text
    assert "bench/bench_generate.py" in text and "recipe=llama_1b_zero0" in text
    for s in range(4):
        assert f"zero=stage{s}" in text
    assert not (tmp_path / "w").exists()  # a dry run creates nothing
    assert probe.DEFAULT_BUDGET_S <= 470  # the device tool's command limit for the probe is 8 minutes


def test_the_default_plan_fits_its_budget_names_its_figures_and_prints_the_rest_as_calls(tmp_path):
    """The first call: versions and smoke test, llama_1b (MFU, stall), the sampler, in that order, within 470 s;
    what does not fit is printed as further calls whose sections and levers cover everything, each within budget.
    The probe's own timing runs switch off the final eval, the final save and the parameter digest."""
    out = subprocess.run([sys.executable, "bench/gpu_probe.py", "--dry-run", "--work", str(tmp_path / "w")],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    m = re.fullmatch(r"planned: (\d+) s of the (\d+) s budget", lines[-1])
    assert m and int(m[1]) <= int(m[2]) <= 470, lines[-1]
    steps = [ln for ln in lines if re.match(r"\s*\d+\. \[", ln)]
    order = list(dict.fromkeys(re.search(r"\[(\w+)\]", ln)[1] for ln in steps))
    assert order == ["install", "data", "llama_1b", "sampler"]
    assert "smoke test" in steps[2] and "flex_attention" in steps[2]
    llama = next(ln for ln in steps if "[llama_1b]" in ln)
    assert "MFU" in llama and "stall" in llama and "tokens/s" in llama
    sampler = next(ln for ln in steps if "[sampler]" in ln)
    assert "speed ratio" in sampler and "identity" in sampler and "near ties" in sampler
    assert "train.final_eval=false" in out.stdout and "train.final_save=false" in out.stdout
    assert "train.param_digest=false" in out.stdout
    calls = re.findall(r"call (\d+): python bench/gpu_probe.py (--sections \S+(?: --levers \S+)?)  "
                       r"\(planned (\d+) s\)", out.stdout)  # fmt: skip
    assert calls and calls[0][0] == "2" and "--sections trainer" in calls[0][1]
    assert all(int(total) <= 470 for _, _, total in calls)
    probe = gpu_probe()
    covered = {s for _, args, _ in calls for s in args.split()[1].split(",")} | set(order)
    assert covered == set(probe.SECTIONS)
    assert {k for _, args, _ in calls if "--levers" in args for k in args.split()[3].split(",")} == set(probe.LEVERS)
    for _, args, total in calls:  # each printed call, run as printed, plans what the dry run said
        again = subprocess.run([sys.executable, "bench/gpu_probe.py", "--dry-run", *args.split()], cwd=ROOT,
                               capture_output=True, text=True, timeout=60)  # fmt: skip
        assert again.stdout.strip().splitlines()[-1] == f"planned: {total} s of the 470 s budget"
        if args.startswith("--sections trainer"):  # the run it compares with comes along
            assert "[llama_1b]" in again.stdout and "[trainer]" in again.stdout


def test_sections_and_levers_narrow_the_plan_and_install_always_runs():
    probe = gpu_probe()
    plan = probe.Plan(ROOT / "w", ROOT / "wh", ["trainer"], {"train.compile": ("false",)})
    # the trainer brings the llama_1b run it compares with (its train step only)
    assert [s.section for s in plan.steps] == ["install", "install", "install", "data", "llama_1b", "trainer"]
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
    fail = [sys.executable, "-c", "print('error: planted install failure'); raise SystemExit(1)"]
    plan.steps = [probe.Step("install", "install", [fail], 10),
                  probe.Step("trainer", "after", [[sys.executable, "-c", "pass"]], 10)]  # fmt: skip
    rows = probe.execute(plan, budget=60.0, out_json=None)["rows"]
    assert rows[0]["rc"] == 1 and "planted install failure" in rows[0]["result"]
    assert rows[1]["result"] == "skipped: the install or data step failed"


def test_without_a_wheelhouse_the_install_names_the_make_command_or_uses_this_python(tmp_path, monkeypatch, capsys):
    """The default wheelhouse is the running Python's; missing, a Python that imports every requirement (this
    venv) installs nothing and says so, and one that does not gets the command that builds the wheelhouse."""
    probe = gpu_probe()
    v = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert probe.default_wheelhouse() == ROOT / "wheelhouse" / f"py{v}"
    probe.w_install(str(tmp_path / f"py{v}"), str(tmp_path / "site"))
    got = json.loads(capsys.readouterr().out)
    assert got["installed"] == 0 and "already imports every requirement" in got["skipped"]
    monkeypatch.setattr(probe, "REQUIRED", (*probe.REQUIRED, "no_such_module_planted"))
    with pytest.raises(SystemExit):
        probe.w_install(str(tmp_path / f"py{v}"), str(tmp_path / "site"))
    err = capsys.readouterr().out
    assert err.startswith("error:") and f"make wheelhouse PY_VERSION={v}" in err and "no_such_module_planted" in err


def test_the_smoke_test_names_a_missing_compiler_and_python_h(tmp_path, monkeypatch):
    """Planted: no compiler on PATH and an include dir without Python.h; each is named with its package."""
    import shutil
    import sysconfig

    probe = gpu_probe()
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    paths = sysconfig.get_paths()
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {**paths, "include": str(tmp_path)})
    missing = probe.toolchain_missing("cpu")
    assert any("C compiler" in m for m in missing) and any("C++ compiler" in m for m in missing)
    assert any("Python.h" in m and "-dev" in m for m in missing)
    assert not any("C++" in m for m in probe.toolchain_missing("cuda"))  # Triton needs C only


def test_the_json_is_written_after_every_step_with_the_logs_beside_it(tmp_path):
    """A probe killed mid-run has kept its finished rows: the second step reads the JSON the first left."""
    probe = gpu_probe()
    out_json = tmp_path / "out" / "gpu_probe.json"
    plan = probe.Plan(tmp_path / "work", tmp_path / "wh", [], {})
    copy = f"import shutil; shutil.copy({str(out_json)!r}, {str(tmp_path / 'seen.json')!r})"
    plan.steps = [probe.Step("data", "first", [[sys.executable, "-c", "print('one')"]], 20),
                  probe.Step("llama_1b", "second", [[sys.executable, "-c", copy]], 20)]  # fmt: skip
    probe.execute(plan, budget=60.0, out_json=out_json)
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert [r["name"] for r in seen["rows"]] == ["first"] and seen["complete"] is False
    assert json.loads(out_json.read_text())["complete"] is True
    logs = sorted(p.name for p in (tmp_path / "out" / "gpu_probe_logs").iterdir())
    assert len(logs) == 2 and not (tmp_path / "work" / "logs").exists()


GRANDCHILD = """
import os, signal, sys, time
os.setsid()  # a session of its own, as torchrun's workers have: a signal to the step's group misses it
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # and it does not stop on SIGTERM
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(300)
"""
PARENT = """
import os, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
while not os.path.exists(sys.argv[2]):
    time.sleep(0.05)
if sys.argv[3] == "hang":
    time.sleep(300)
"""
RUN_PROBE = """
import importlib.util, json, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("gpu_probe", sys.argv[1])
probe = importlib.util.module_from_spec(spec)
sys.modules["gpu_probe"] = probe
spec.loader.exec_module(probe)
probe.GRACE_S = 1.0
work, steps = Path(sys.argv[2]), json.loads(sys.argv[3])
plan = probe.Plan(work, work / "wh", [], {})
plan.steps = [probe.Step("zero", name, [cmd], limit) for name, cmd, limit in steps]
probe.execute(plan, budget=20.0, out_json=work / "probe.json")
"""
# The budget: the first section's GPU check imports torch inside it (4 s on a loaded 2-core box, where 6 s left the
# "hangs" step no time and the test failed); the "hangs" step needs 3 s left, and "never starts" (60 s) must find
# under the probe's 30 s floor, which 20 s minus the two steps' ~6 s always is.


def test_a_step_out_of_time_leaves_no_process_behind(tmp_path):
    """Real process trees, the probe in its own process with a budget too short for its steps: one step's
    grandchild calls setsid and ignores SIGTERM while its parent hangs past the limit; another's parent exits
    at once and orphans such a grandchild. When the probe has ended, neither grandchild is alive."""
    import psutil

    py = sys.executable
    hang, orphan = tmp_path / "hang.pid", tmp_path / "orphan.pid"
    steps = [["orphans", [py, "-c", PARENT, GRANDCHILD, str(orphan), "exit"], 2],
             ["hangs", [py, "-c", PARENT, GRANDCHILD, str(hang), "hang"], 3],
             ["never starts", [py, "-c", "pass"], 60]]  # fmt: skip
    proc = subprocess.run([py, "-c", RUN_PROBE, str(ROOT / "bench" / "gpu_probe.py"), str(tmp_path),
                           json.dumps(steps)], capture_output=True, text=True, timeout=90)  # fmt: skip
    pids = [int(p.read_text()) for p in (orphan, hang) if p.exists()]
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
                os.kill(pid, signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(pids) == 2, proc.stdout
    rows = {r["name"]: r for r in json.loads((tmp_path / "probe.json").read_text())["rows"]}
    assert rows["hangs"]["rc"] == 124 and rows["orphans"]["rc"] == 0
    assert rows["never starts"]["result"].startswith("skipped: out of time")
    assert not alive, f"processes a step started outlived the probe: {alive}"


def test_a_lever_the_schema_lacks_is_a_row_not_a_crash():
    probe = gpu_probe()
    assert probe.missing_lever("train.checkpoint_staging", "pinned") is None
    assert probe.missing_lever("train.compile", "false") is None
    assert probe.missing_lever("train.no_such_lever", "on").startswith("key missing: train.no_such_lever")
    assert probe.missing_lever("train.checkpoint_staging", "locked").startswith("value missing")
    assert probe.missing_lever("train.compile", "maybe").startswith("value missing")


def test_a_run_can_skip_the_final_eval_save_and_digest(tmp_path, tiny_data):
    """The switches the probe's timing runs set (train.final_eval/final_save/param_digest=false): 3 steps with a
    save every 2 leave step 2's checkpoint and no step-3 save, no eval row, and no digest in the summary."""
    from tests.conftest import FAST, check, launch, metrics

    out = tmp_path / "run"
    check(launch([*FAST, f"data.path={tiny_data}", f"output_dir={out}", "train.steps=3", "train.checkpoint_interval=2",
                  "train.final_eval=false", "train.final_save=false", "train.param_digest=false"], nproc=1))  # fmt: skip
    rows = metrics(out)
    assert [r["step"] for r in rows if r.get("event") == "checkpoint"] == [2]
    assert not [r for r in rows if "eval_loss" in r] and len([r for r in rows if "loss" in r]) == 3
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["replicas_agree"] is None and summary["param_digests"] is None


def test_the_anchor_feeds_trainer_the_document_positions_and_labels_train_py_trains_on(tiny_data):
    """The Trainer side of the probe's ratio (bench/_trainer_loop.py, ``+like``) reads the same rows with the
    position ids that restart after each EOS (HF builds its document mask from them) and each document's first
    token not a target, equal to train.py's batches (``make_batch``)."""
    import importlib.util

    import numpy as np

    from ultrascale.data.loader import make_batch
    from ultrascale.data.shards import load_manifest, open_split

    spec = importlib.util.spec_from_file_location("_trainer_loop", ROOT / "bench" / "_trainer_loop.py")
    loop = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loop)
    split = open_split(tiny_data, "train", verify=False)
    eos = int(load_manifest(tiny_data)["eos_token_id"])
    rows = loop.PackedRows(split, eos=eos)
    ids = split.get(np.arange(len(split)))
    i = next(i for i in range(len(split)) if (ids[i, 1:-1] == eos).any())  # a row with a boundary inside
    want = make_batch(ids[i : i + 1], None, eos, True)
    got = rows[i]
    assert got["position_ids"].tolist() == want.position_ids[0].tolist() and got["position_ids"].min() == 0
    assert (got["position_ids"] == 0).sum() >= 2  # the document mask has a boundary to apply
    assert got["labels"].tolist() == want.labels[0].tolist() and (got["labels"] == -100).any()
    assert "position_ids" not in loop.PackedRows(split)[i]  # without eos: the plain rows, as train_overhead has


def test_a_step_kills_only_what_it_started_not_its_callers_other_children(tmp_path):
    """The probe collects its own descendants after a step (orphans re-parented to it), but a process its caller
    had started before the step (pytest's torch.compile workers, here a sleeping child that ignores SIGTERM) is
    not the step's: it must outlive the probe, and a step that exits at once must not wait out a kill grace."""
    probe = gpu_probe()
    bystander = subprocess.Popen(
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"]
    )
    try:
        time.sleep(0.5)
        plan = probe.Plan(tmp_path, tmp_path / "wh", [], {})
        plan.steps = [probe.Step("zero", "quick", [[sys.executable, "-c", "print('done')"]], 30)]
        rows = probe.execute(plan, budget=60.0, out_json=None)["rows"]
        assert rows[0]["rc"] == 0 and rows[0]["seconds"] < 5, rows[0]
        assert bystander.poll() is None, "the probe killed a process its caller had started before the step"
    finally:
        bystander.kill()
        bystander.wait()
