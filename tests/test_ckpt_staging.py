"""Checkpoint staging (``train.checkpoint_staging``): the background writer's host buffers are allocated by the
first save and reused by every later one, each checkpoint's copies land before the thread reads them, and the
mode follows the device. On this CPU host ``auto`` and ``pinned`` stage into pageable memory (nothing to pin
for); the pinned DMA path itself runs only on CUDA, where ``make gpu-probe`` measures it against pageable."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import FAST, check, launch, metrics
from ultrascale.errors import ConfigError
from ultrascale.levers.decide import staging_mode
from ultrascale.train.ckpt_writer import BackgroundWriter, Staging


def gpu_probe():
    """bench/gpu_probe.py as a module (bench/ is scripts, not a package)."""
    import importlib.util
    import sys

    from tests.conftest import ROOT

    if "gpu_probe" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_probe", ROOT / "bench" / "gpu_probe.py")
        sys.modules["gpu_probe"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["gpu_probe"])
    return sys.modules["gpu_probe"]


def _save(writer: BackgroundWriter, step: int, state: dict, out) -> None:
    (out / f"s{step}").mkdir()
    writer.begin(step)
    writer.save(state, str(out / f"s{step}" / "model.pt"))
    writer.save({"m": state["opt"]}, str(out / f"s{step}" / "optim.pt"))
    writer.mark(step)
    writer.wait()


def test_the_second_save_allocates_nothing_and_writes_its_own_values(tmp_path):
    """Two files, tensors of three dtypes and a shared alias: the second save makes no allocation, fills the same
    buffers (same addresses, same bytes in all), and each checkpoint on disk holds its own step's values."""
    writer = BackgroundWriter("auto")
    w, b, opt = torch.zeros(300, 7), torch.zeros(5, dtype=torch.bfloat16), torch.zeros(64, dtype=torch.int64)
    state = {"w": w, "alias": w, "b": b, "opt": opt, "n": 3}
    _save(writer, 1, {**state}, tmp_path)
    first = {k: v.data_ptr() for k, v in writer.staging.buffers.items()}
    allocs, nbytes = writer.staging.allocations, writer.staging.nbytes
    assert allocs == 4 and nbytes == 300 * 7 * 4 + 5 * 2 + 64 * 8 * 2  # the alias is copied once; opt in 2 files
    for t in (w, b, opt):
        t.fill_(2)
    _save(writer, 2, {**state}, tmp_path)
    assert writer.staging.allocations == allocs and writer.staging.nbytes == nbytes
    assert {k: v.data_ptr() for k, v in writer.staging.buffers.items()} == first
    for step in (1, 2):
        got = torch.load(tmp_path / f"s{step}" / "model.pt")
        assert torch.equal(got["w"], torch.full((300, 7), 2.0 * (step - 1)))
        assert got["alias"] is got["w"] and got["n"] == 3
        assert torch.equal(torch.load(tmp_path / f"s{step}" / "optim.pt")["m"], torch.full((64,), 2 * (step - 1)))


def test_a_changed_shape_gets_a_new_buffer_and_nothing_else_does(tmp_path):
    writer = BackgroundWriter("pageable")
    _save(writer, 1, {"w": torch.ones(4), "opt": torch.ones(2)}, tmp_path)
    _save(writer, 2, {"w": torch.ones(6), "opt": torch.ones(2)}, tmp_path)
    assert writer.staging.allocations == 4  # w twice (4 then 6 elements); opt once in each of the two files
    assert torch.equal(torch.load(tmp_path / "s2" / "model.pt")["w"], torch.ones(6))


def test_nothing_reaches_the_writer_thread_before_the_checkpoint_is_marked(tmp_path):
    """The thread may read a staging buffer only after the checkpoint's copies have landed (on CUDA: the one
    synchronisation in ``mark``), so ``save`` holds its jobs back until then."""
    writer = BackgroundWriter()
    writer.begin(1)
    writer.save({"w": torch.ones(3)}, str(tmp_path / "a.pt"))
    writer.put(str(tmp_path / "rng.pt"), {"rng": 1})
    assert writer._jobs.qsize() == 0 and len(writer._held) == 2
    writer.mark(1)
    writer.wait()
    assert writer.written() == 1 and (tmp_path / "a.pt").exists() and (tmp_path / "rng.pt").exists()


def test_the_staging_mode_follows_the_device():
    assert staging_mode("auto", cuda=True) == "pinned" and staging_mode("auto", cuda=False) == "pageable"
    assert staging_mode("pinned", cuda=True) == "pinned" and staging_mode("pinned", cuda=False) == "pageable"
    assert staging_mode("pageable", cuda=True) == "pageable"
    assert Staging("pinned").mode == ("pinned" if torch.cuda.is_available() else "pageable")
    with pytest.raises(ValueError, match="expected one of auto, pinned, pageable"):
        staging_mode("locked", cuda=True)


def test_the_staging_is_the_runs_decision():
    """The rule runs once, in the levers: the run's Decisions carry the mode for its device (an nccl run has CUDA).
    That the trainer hands that value to its checkpointer, and pre-stages the pinned buffers after the first step,
    is checked on the trainer's own path by tests/test_decisions_agree.py (a planted GPU node, pinned staging
    against test_ckpt_slab's strict cudart recorder)."""
    from ultrascale.config.compose import compose
    from ultrascale.levers.decide import decide
    from ultrascale.levers.rules import validate

    cfg = compose([])
    d = validate(cfg, 1, backend="gloo")
    assert d.checkpoint_staging.value == "pageable"  # a CPU run: nothing to pin for
    assert d.checkpoint_staging.on == bool(cfg.train.checkpoint_async)
    gpu = decide(cfg, d.topo, d.hf_config, "nccl", None, None)
    assert gpu.checkpoint_staging.value == "pinned" and "train.checkpoint_staging=auto" in gpu.checkpoint_staging.why
    pageable = compose(["train.checkpoint_staging=pageable"])
    assert decide(pageable, d.topo, d.hf_config, "nccl").checkpoint_staging.value == "pageable"
    sync = compose(["train.checkpoint_async=false"])
    assert not decide(sync, d.topo, d.hf_config, "nccl").checkpoint_staging.on


def test_checkpoint_staging_is_a_typed_key():
    from ultrascale.config.compose import compose

    assert compose(["train.checkpoint_staging=pageable"]).train.checkpoint_staging == "pageable"
    with pytest.raises(ConfigError, match="checkpoint_staging"):
        compose(["train.checkpoint_staging=locked"])


def test_train_py_stages_once_and_reuses_the_buffers_across_saves(tmp_path, tiny_data):
    """A real run (one rank, DeepSpeed's own state dicts): the first save's checkpoint event records the staging
    it allocated, the later ones none, with the same bytes; the probe's summary reads the same events."""
    out = tmp_path / "run"
    args = [*FAST, f"data.path={tiny_data}", f"output_dir={out}", "train.steps=6", "train.checkpoint_interval=2"]
    check(launch(args, nproc=1))
    saves = [r for r in metrics(out) if r.get("event") == "checkpoint"]
    assert len(saves) == 3 and {r["staging"] for r in saves} == {"pageable"}
    assert saves[0]["staging_alloc_s"] > 0 and [r["staging_alloc_s"] for r in saves[1:]] == [0.0, 0.0]
    assert saves[0]["staging_gb"] > 0 and len({r["staging_gb"] for r in saves}) == 1

    s = gpu_probe().train_summary(metrics(out))
    assert s["steps"] == 6 and len(s["stall_s"]) == 3 and s["staging"] == "pageable"
    assert s["staging_alloc_s"][1:] == [0.0, 0.0]


def test_two_views_of_one_parameter_are_staged_and_written_once(tmp_path):
    """A tied embedding and head come out of ``state_dict()`` as two detached tensors of one parameter: one buffer,
    and the file keeps them one storage. A slice of it is a copy of its own; empty placeholders stay apart."""
    emb = torch.nn.Parameter(torch.randn(50, 8))
    state = {"embed": emb.detach(), "head": emb.detach(), "row": emb.detach()[3], "a": torch.empty(0),
             "b": torch.empty(0, 2)}  # fmt: skip
    writer = BackgroundWriter()
    writer.begin(1)
    writer.save(state, str(tmp_path / "model.pt"))
    writer.mark(1)
    writer.wait()
    assert writer.staging.allocations == 4 and writer.staging.nbytes == (50 * 8 + 8) * 4
    got = torch.load(tmp_path / "model.pt")
    assert got["embed"].data_ptr() == got["head"].data_ptr() and torch.equal(got["head"], emb.detach())
    assert torch.equal(got["row"], emb.detach()[3]) and got["b"].shape == (0, 2)
