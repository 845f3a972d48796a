"""Failures without a cluster: what a checkpoint fixes on resume, the fallback past a truncated checkpoint, the
stop request, the background writer, threads per rank under each launcher, Young/Daly, and the README's
planted-fault example. The multi-rank paths are in ``test_failures_dist.py``."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT
from ultrascale.config.compose import compose
from ultrascale.errors import CheckpointError
from ultrascale.levers.rules import validate
from ultrascale.train import checkpoint
from ultrascale.train.resume import check_resume, checkpoint_meta

# ---- what a checkpoint fixes ---------------------------------------------------------------------------------


def _meta(overrides: list[str], world: int = 2, step: int = 40) -> dict:
    cfg = compose(["recipe=cpu_smoke", *overrides])
    return {**checkpoint_meta(cfg, validate(cfg, world)), "step": step}


def _check(overrides: list[str], meta: dict, world: int = 2, universal: bool = False) -> list[str]:
    cfg = compose(["recipe=cpu_smoke", *overrides])
    return check_resume(cfg, validate(cfg, world), meta, "step_00000040", universal)


@pytest.mark.parametrize(
    "saved, now, world, needle",
    [
        (["zero=stage3"], ["zero=stage1", "optim.lr=1e-2"], 2, "zero.stage=1 but checkpoint step_00000040 was saved with zero.stage=3"),
        ([], [], 1, "saved by 2 ranks (dp=2 tp=1 pp=1 sp=1 ep=1) and this run has 1"),
        (["parallel.pp=2"], [], 2, "train.universal_checkpoint=true"),
        ([], ["precision=bf16"], 2, "precision.dtype=bf16 but checkpoint step_00000040 was saved with precision.dtype=fp32"),
        ([], ["model.config.num_hidden_layers=6"], 2, "model.config.num_hidden_layers=6 but checkpoint"),
        ([], ["train.steps=80"], 2, "train.steps=80 changes the cosine schedule"),
        ([], ["optim.lr=1e-2"], 2, "optim.lr=0.01 changes the cosine schedule"),
    ],
    ids=["zero stage", "world size", "pipeline layout", "precision", "model shape", "schedule length", "peak lr"],
)  # fmt: skip
def test_a_resume_that_changes_what_the_checkpoint_fixes_is_refused_with_the_key(saved, now, world, needle):
    with pytest.raises(CheckpointError, match=re.escape(needle)) as e:
        _check(now, _meta(saved), world)
    assert "\n" not in str(e.value)


def test_the_schedule_error_names_the_fix_and_the_jump():
    """The reported trap: a longer train.steps silently moved step 45's lr (9.27e-4 on cpu_smoke's 60 steps)."""
    with pytest.raises(CheckpointError) as e:
        _check(["train.steps=80"], _meta(["train.steps=60"], step=44))
    msg = str(e.value)
    assert "optim.sched.total_steps=60" in msg and "train.allow_schedule_change=true" in msg
    assert "the lr at step 45 would jump from 9.266e-04 to 1.711e-03" in msg, msg


def test_allowed_changes_are_said_in_words():
    saved = _meta(["train.steps=60"], step=44)
    kept = _check(["train.steps=80", "optim.sched.total_steps=60"], saved)
    assert kept == [
        "train.steps 60 -> 80 with the schedule kept at 60 steps: steps past it run at its final lr 3.000e-04"
    ]
    accepted = _check(["train.steps=80", "train.allow_schedule_change=true"], saved)
    assert accepted == [
        "schedule changed at resume (train.steps 60 -> 80): lr at step 45 9.266e-04 -> 1.711e-03; "
        "accepted with train.allow_schedule_change=true"
    ]
    # a WSD run extended in its stable phase continues on the same lr: allowed, and said
    wsd = _meta(["train.steps=60", "optim.sched.name=wsd"], step=30)
    same = _check(["train.steps=100", "optim.sched.name=wsd"], wsd)
    assert "the lr at the resume step is unchanged" in same[-1]
    assert _check([], _meta([])) == []  # nothing changed, nothing said
    # universal checkpoints may change the layout; the model shape still may not change
    assert _check([], _meta([]), world=1, universal=True) == []
    with pytest.raises(CheckpointError, match="hidden_size"):
        _check(["model.config.hidden_size=256"], _meta([]), universal=True)


# ---- the checkpoint to resume from ----------------------------------------------------------------------------


def _fake_checkpoint(ckpt_dir: Path, step: int) -> Path:
    tag_dir = ckpt_dir / checkpoint.tag_for(step)
    tag_dir.mkdir(parents=True)
    (tag_dir / "model.pt").write_bytes(b"x" * 100)
    checkpoint.commit(ckpt_dir, tag_dir, {"step": step, "tag": tag_dir.name}, keep=0)
    return tag_dir


def test_a_truncated_latest_falls_back_to_the_newest_checkpoint_that_verifies(tmp_path):
    ckpt = tmp_path / "checkpoints"
    for step in (10, 20, 30):
        _fake_checkpoint(ckpt, step)
    assert checkpoint.find_resume(ckpt, "auto", False).name == "step_00000030"
    (ckpt / "step_00000030" / "model.pt").write_bytes(b"x" * 10)  # truncated: a disk that filled up
    (ckpt / "step_00000020" / "model.pt").unlink()  # and one with a file gone
    skipped: list[str] = []
    assert checkpoint.find_resume(ckpt, "auto", False, skipped).name == "step_00000010"
    assert skipped == [
        f"checkpoint {ckpt / 'step_00000030'} is truncated: model.pt has 10 bytes, expected 100",
        f"checkpoint {ckpt / 'step_00000020'} is truncated: model.pt is missing",
    ]
    with pytest.raises(CheckpointError, match="is truncated"):  # a checkpoint named explicitly is not second-guessed
        checkpoint.find_resume(ckpt, str(ckpt / "step_00000030"), False)
    (ckpt / "step_00000010" / "model.pt").unlink()
    with pytest.raises(CheckpointError, match="step_00000030 is truncated"):  # none verifies: latest's own error
        checkpoint.find_resume(ckpt, "auto", False)


# ---- the stop request -----------------------------------------------------------------------------------------


def test_a_signal_or_the_stop_file_becomes_a_stop_and_a_second_signal_only_counts(tmp_path, capfd):
    from ultrascale.train.stop import FILE_CODE, StopRequest

    before = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN under `nohup ... &`
    stop = StopRequest(0, tmp_path / "STOP").install()
    try:
        assert stop.local(check_file=True) == 0
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt: the save in progress must finish
        assert stop.local(check_file=True) == signal.SIGUSR1 and stop.repeats == 1
        assert stop.describe(stop.code) == "SIGUSR1"
        err = capfd.readouterr().err
        assert "SIGUSR1: finishing this step, then saving a checkpoint" in err and "already stopping" in err
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGINT) is before  # put back as it was found
    by_file = StopRequest(0, tmp_path / "STOP")
    (tmp_path / "STOP").write_text("USR1\n")
    assert by_file.local(check_file=False) == 0  # only rank 0 reads the file
    assert by_file.local(check_file=True) == FILE_CODE and by_file.describe(FILE_CODE) == "USR1 (via the STOP file)"
    by_file.consume_file()
    assert not (tmp_path / "STOP").exists()


# ---- the background writer ------------------------------------------------------------------------------------


def test_the_snapshot_is_a_copy_that_keeps_shared_tensors_shared():
    from ultrascale.train.ckpt_writer import snapshot

    w = torch.ones(3)
    state = {"a": w, "b": [w, torch.Size([3])], "c": (1, "x"), "d": {"e": torch.zeros(2)}}
    snap = snapshot(state)
    w.add_(1)  # the step after the save changes the live tensor
    assert torch.equal(snap["a"], torch.ones(3)) and snap["a"] is snap["b"][0]
    assert snap["b"][1] is state["b"][1] and snap["c"] is state["c"]


def test_the_writer_reuses_its_staging_buffers_from_one_save_to_the_next(tmp_path):
    """The second save of the same file copies into the first save's buffers (touched memory: a memcpy, not a page
    fault per 4 KiB), after the first was written; each file holds its own step's values."""
    from ultrascale.train.ckpt_writer import BackgroundWriter

    writer, w = BackgroundWriter(), torch.zeros(1000)
    ptrs = []
    for step in (1, 2):
        w.fill_(step)
        (tmp_path / f"s{step}").mkdir()
        writer.begin(step)
        writer.save({"w": w, "again": w}, str(tmp_path / f"s{step}" / "model.pt"))
        ptrs.append(writer.staging.buffers[("model.pt", 0)].data_ptr())
        writer.mark(step)
        writer.wait()
    assert ptrs[0] == ptrs[1] and len(writer.staging.buffers) == 1  # one buffer, reused; the alias copied once
    for step in (1, 2):
        got = torch.load(tmp_path / f"s{step}" / "model.pt")
        assert torch.equal(got["w"], torch.full((1000,), float(step))) and got["again"] is got["w"]


class _Probe:
    """Pickled by the writer thread inside ``torch.save``: records when its file is written (and, for the gate,
    holds the thread there until the test lets it go), then loads back as its name."""

    def __init__(self, name: str, log: list[str], gate: threading.Event | None = None):
        self.name, self.log, self.gate = name, log, gate

    def __reduce__(self):
        if self.gate is not None:
            assert self.gate.wait(60), "the test never released the writer"
        self.log.append(self.name)
        return (str, (self.name,))


def test_the_writer_writes_in_order_and_reports_a_failed_write(tmp_path):
    from ultrascale.train.ckpt_writer import BackgroundWriter

    writer, log, gate = BackgroundWriter(), [], threading.Event()
    writer.begin(5)
    writer.put(str(tmp_path / "gate.pt"), _Probe("gate", log, gate))  # the thread is held inside this write
    writer.save({"w": torch.arange(4), "probe": _Probe("a", log)}, str(tmp_path / "a.pt"))
    writer.put(str(tmp_path / "b.pt"), {"rng": 1, "probe": _Probe("b", log)})
    writer.mark(5)
    assert writer.written() == -1 and writer.pending() and log == []  # held: nothing written, nothing counted
    gate.set()
    writer.wait()
    assert writer.written() == 5 and not writer.pending()
    assert log == ["gate", "a", "b"]  # queue order, and every file of checkpoint 5 before it counts as written
    a, b = writer.load(str(tmp_path / "a.pt")), writer.load(str(tmp_path / "b.pt"))
    assert torch.equal(a["w"], torch.arange(4)) and a["probe"] == "a"
    assert b == {"rng": 1, "probe": "b"}
    writer.begin(6)
    writer.save({"w": torch.zeros(1)}, str(tmp_path / "missing_dir" / "c.pt"))
    writer.mark(6)
    with pytest.raises(CheckpointError, match=r"background checkpoint write failed: .*c\.pt"):
        writer.wait()


# ---- threads per rank ------------------------------------------------------------------------------------------

# A planted CPU: 16 logical CPUs, 2 SMT threads a core, so 8 physical cores and a share of 4 for each of 2 ranks.
# On a 2-core box the share is 1, the same number as a user's OMP_NUM_THREADS=1: that could not tell torchrun's
# default (which must be overridden) from the user's choice (which must win).
_THREADS = (
    "import ultrascale.runtime.cpu as c; c.detect = lambda: c.CpuInfo(cpus=16, threads_per_core=2); "
    "from ultrascale.runtime.dist import cpu_threads; print(cpu_threads()[0])"
)


# A GPU rank on the same planted CPU: init_distributed with the backend planted as nccl and the process group as
# already joined; torch.cuda.set_device is a recorder that must be called once, with LOCAL_RANK.
_NCCL_THREADS = (
    "import os, torch, torch.distributed as td, ultrascale.runtime.cpu as c, ultrascale.runtime.dist as d; "
    "c.detect = lambda: c.CpuInfo(cpus=16, threads_per_core=2); d.select_accelerator = lambda: 'nccl'; "
    "td.is_initialized = lambda: True; calls = []; torch.cuda.set_device = calls.append; "
    "assert d.init_distributed() == 'nccl' and calls == [int(os.environ['LOCAL_RANK'])], calls; "
    "print(torch.get_num_threads())"
)


def _threads(env: dict[str, str], parent_env: dict[str, str], script: str = _THREADS) -> int:
    """cpu_threads() (or what ``script`` prints) in a rank on the planted CPU whose parent (a stand-in launcher)
    was started with ``parent_env`` and set ``env`` for the rank, as torchrun and the deepspeed launcher do."""
    child = f"import os, subprocess, sys; sys.exit(subprocess.run([sys.executable, '-c', {script!r}], env={{**os.environ, **{env!r}}}).returncode)"
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE", "LOCAL_SIZE")}
    out = subprocess.run([sys.executable, "-c", child], env={**base, **parent_env}, cwd=ROOT, capture_output=True, text=True, check=True)  # fmt: skip
    return int(out.stdout.strip())


def test_every_launcher_gives_each_rank_its_share_of_the_cores():
    # the deepspeed launcher says LOCAL_SIZE (not LOCAL_WORLD_SIZE) and sets no OMP_NUM_THREADS
    assert _threads({"LOCAL_SIZE": "2"}, {}) == 4
    # torchrun says LOCAL_WORLD_SIZE and sets OMP_NUM_THREADS=1 itself when the user did not: overridden
    assert _threads({"LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "x"}, {}) == 4
    # a user's own OMP_NUM_THREADS wins under every launcher, 1 included
    assert _threads({"LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "x"},
                    {"OMP_NUM_THREADS": "1"}) == 1  # fmt: skip
    assert _threads({"LOCAL_SIZE": "2", "OMP_NUM_THREADS": "3"}, {"OMP_NUM_THREADS": "3"}) == 3


def test_a_gpu_rank_gets_its_share_of_the_cores_too():
    """torchrun's OMP_NUM_THREADS=1 left a GPU rank's host work (the 1B init, the bf16 cast, checkpoint staging)
    on one core: an nccl rank takes its share like a CPU rank, and a user's own setting still wins."""
    torchrun = {"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1", "OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "x"}
    assert _threads(torchrun, {}, _NCCL_THREADS) == 4
    assert _threads(torchrun, {"OMP_NUM_THREADS": "1"}, _NCCL_THREADS) == 1


# ---- how often to checkpoint -----------------------------------------------------------------------------------


def test_young_daly_interval_and_the_time_it_loses():
    from ultrascale.cost.save_interval import advise, checkpoint_bytes, lost_share, young_daly

    mtbf = 24 * 3600.0
    tau = young_daly(60.0, mtbf)
    assert tau == pytest.approx(math.sqrt(2 * 60 * 86400)) == pytest.approx(3219.9, abs=0.1)
    save, rework = lost_share(tau, 60.0, mtbf)
    assert save == pytest.approx(rework) == pytest.approx(60 / tau)  # at the optimum the two losses are equal
    assert save + rework == pytest.approx(math.sqrt(2 * 60 / mtbf))
    off = [sum(lost_share(t, 60.0, mtbf)) for t in (tau / 2, tau * 2)]
    assert min(off) > save + rework  # and it is the minimum
    assert checkpoint_bytes(1e9, 2, 1) == 14e9 and checkpoint_bytes(1e9, 4, 0) == 12e9
    # 100 GB a node at 2 GB/s: a 50 s stall synchronously; a 10 GB snapshot at 25 GB/s in the background
    sync = advise(100e9, 10e9, step_s=2.0, nodes=100, node_mtbf_h=5000, storage_gbps=2.0, copy_gbps=25.0,
                  background=False)  # fmt: skip
    assert sync.stall_s == pytest.approx(50.0) and sync.mtbf_h == pytest.approx(50.0)
    assert sync.interval_steps == round(young_daly(50.0, 50 * 3600) / 2.0)
    bg = advise(100e9, 10e9, step_s=2.0, nodes=100, node_mtbf_h=5000, storage_gbps=2.0, copy_gbps=25.0,
                background=True)  # fmt: skip
    assert bg.stall_s == pytest.approx(0.4) and bg.interval_steps < sync.interval_steps
    assert bg.interval_s >= bg.write_s  # never faster than one write in flight
    assert bg.save_share + bg.rework_share < sync.save_share + sync.rework_share


# ---- the README's planted faults fire --------------------------------------------------------------------------


def test_the_readme_fault_example_fires_both_faults():
    """The README's ``ULTRASCALE_INJECT`` example on its recipe: the NaN is skipped, and the spike lands after the
    detector has its history (a spike at step 9 never fired: the detector waits for 20 accepted steps)."""
    from ultrascale.train.stability import FaultInjector, StabilityMonitor

    line = next(ln for ln in (ROOT / "README.md").read_text().splitlines() if "ULTRASCALE_INJECT=" in ln)
    spec, recipe = re.search(r"ULTRASCALE_INJECT=(\S+) .*?(recipe=\w+)", line).groups()
    cfg = compose([recipe])
    os.environ["ULTRASCALE_INJECT"] = spec
    try:
        injectors = {r: FaultInjector(r) for r in (0, 1)}
    finally:
        del os.environ["ULTRASCALE_INJECT"]
    monitor, fired = StabilityMonitor(cfg.stability), []
    for step in range(1, cfg.train.steps + 1):
        base = 8.3 * math.exp(-step / 25) + 5.8 + 0.05 * math.sin(step)  # cpu_smoke's curve, roughly, with noise
        factors = [f for f in (injectors[r].factor(step) for r in (0, 1)) if f is not None]
        loss = sum(base * f for f in factors) / 2 + base * (2 - len(factors)) / 2 if factors else base
        verdict = monitor.judge(loss)
        if verdict.action != "ok":
            fired.append((step, verdict.reason))
        monitor.record(verdict, loss, step)
    assert fired == [(4, "nonfinite"), (int(re.search(r"spike@(\d+)", spec).group(1)), "spike")], fired
