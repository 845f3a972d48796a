"""Pinned checkpoint staging on CUDA (issue 46, items 1 and 7), run on this CPU host with CUDA planted.

A page-lock per staged tensor failed on the GPU: small tensors (norms, Adam's step counters) share heap pages, a
page already registered answers ``cudaHostRegister`` with "already registered" (712), and the error left in
CUDA's last-error slot was raised by an unrelated kernel launch a few steps later. Staging now carves every
pinned buffer from one page-aligned slab registered once, and clears the last error when a register fails.

What a CPU cannot run is planted, strictly: ``torch.cuda.cudart()`` is a recorder that answers 712 to a range
whose pages overlap a registered one and fails on any call it does not know; every tensor is "on the device"
(``Staging.on_device``); the side stream's copies are plain copies that refuse a non-blocking copy into memory
no registration covers. The memory, the layout and (for the pre-staging) DeepSpeed's own state dicts are real.
"""

from __future__ import annotations

import itertools
import json
import logging
import sys
from pathlib import Path

import torch

PAGE = 4096
ALREADY_REGISTERED, NOT_REGISTERED = 712, 713


class StrictCudart:
    """``torch.cuda.cudart()`` as the driver answers it: a range sharing a page with a registered one is refused
    with 712 (left in the last-error slot, as CUDA does), unregistering an unknown pointer with 713."""

    def __init__(self, fail_with: int = 0) -> None:
        self.live: dict[int, int] = {}
        self.calls: list[tuple] = []
        self.last_error = 0
        self.fail_with = fail_with

    def _pages(self, ptr: int, size: int) -> range:
        return range(ptr // PAGE, -(-(ptr + size) // PAGE))

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", ptr, size, flags))
        err = self.fail_with
        if any(set(self._pages(ptr, size)) & set(self._pages(p, s)) for p, s in self.live.items()):
            err = ALREADY_REGISTERED
        if err:
            self.last_error = err
            return err
        self.live[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        if self.live.pop(ptr, None) is None:
            self.last_error = NOT_REGISTERED
            return NOT_REGISTERED
        return 0

    def cudaGetLastError(self) -> int:
        err, self.last_error = self.last_error, 0
        return err

    def registers(self) -> list[tuple]:
        return [c for c in self.calls if c[0] == "register"]

    def covers(self, t: torch.Tensor) -> bool:
        start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        return any(p <= start and end <= p + s for p, s in self.live.items())


class PlantedDma:
    """The side stream's copies, run as host copies: a non-blocking copy must land in registered memory (into
    pageable memory CUDA would make it a blocking copy through the bounce buffer)."""

    def __init__(self, cudart: StrictCudart) -> None:
        self.cudart, self.copies, self.syncs = cudart, 0, 0

    def fence(self) -> None:
        pass

    def copy(self, buf: torch.Tensor, t: torch.Tensor, non_blocking: bool) -> None:
        assert not non_blocking or self.cudart.covers(buf), "a non-blocking copy into unregistered memory"
        buf.copy_(t)
        self.copies += 1

    def sync(self) -> None:
        self.syncs += 1


def planted_staging(cudart: StrictCudart):
    from ultrascale.train.ckpt_writer import Staging

    st = Staging("pinned", cuda=True)
    st.on_device = lambda t: True
    st.dma = PlantedDma(cudart)
    return st


def smollm2_state() -> dict:
    """SmolLM2-135M's checkpoint as a ZeRO-0 bf16 run holds it (the project's model config, built by transformers
    on the meta device for its shapes): bf16 weights with the tied embedding once, 61 RMSNorm vectors, and torch
    Adam's state per parameter (fp32 moments, a 0-d fp32 step). Each tensor is a broadcast scalar (no memory of
    its own; its value its index), so only the staging holds the 1.35 GB."""
    from transformers import AutoModelForCausalLM

    from ultrascale.config.compose import compose
    from ultrascale.model.build import build_hf_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(build_hf_config(compose(["model=smollm2_135m"]).model))
    filled: dict[int, torch.Tensor] = {}

    def fill(shape, dtype, key) -> torch.Tensor:
        if key not in filled:
            filled[key] = torch.tensor(float(len(filled) % 251 + 1), dtype=dtype).expand(shape)
        return filled[key]

    module = {n: fill(p.shape, torch.bfloat16, id(p)) for n, p in model.state_dict(keep_vars=True).items()}
    params = list(dict.fromkeys(model.parameters()))
    state = {i: {"step": torch.tensor(7.0), "exp_avg": fill(p.shape, torch.float32, ("m", i)),
                 "exp_avg_sq": fill(p.shape, torch.float32, ("v", i))} for i, p in enumerate(params)}  # fmt: skip
    groups = [{"lr": 1e-3, "betas": (0.9, 0.95), "params": list(range(len(params)))}]
    return {"module": module, "optimizer": {"state": state, "param_groups": groups}, "global_steps": 7}


def test_a_smollm2_save_registers_one_page_aligned_region_covering_every_pinned_view(monkeypatch, caplog):
    from ultrascale.train.ckpt_writer import PIN_MIN_BYTES

    cudart = StrictCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    st = planted_staging(cudart)
    state = smollm2_state()
    with caplog.at_level(logging.WARNING, logger="ultrascale"):
        snap = st.stage("mp_rank_00_model_states.pt", state)
    st.sync()
    assert cudart.last_error == 0 and caplog.records == []
    (register,) = cudart.registers()  # exactly one region, page-aligned, a whole number of pages
    _, ptr, size, _ = register
    assert ptr % PAGE == 0 and size % PAGE == 0 and cudart.live == {ptr: size}

    pinned = [b for b in st.buffers.values() if b.numel() * b.element_size() >= PIN_MIN_BYTES]
    small = [b for b in st.buffers.values() if b.numel() * b.element_size() < PIN_MIN_BYTES]
    params = 30 * 9 + 2  # 7 projections and 2 norms a layer, the (tied) embedding, the final norm
    assert len(pinned) == 3 * (params - 61)  # each projection and the embedding, and their two moments
    assert len(small) == 3 * 61 + params  # each norm (bf16, 1 KB) and its moments; every step counter
    spans = sorted((b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in pinned)
    assert spans[0][0] >= ptr and spans[-1][1] <= ptr + size  # every pinned view inside the region ...
    assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans))  # ... and no two overlap
    assert all(s % 512 == 0 for s, _ in spans)
    assert not any(cudart.covers(b) for b in small)  # tiny tensors: ordinary memory, unpinned
    assert size - sum(e - s for s, e in spans) < 512 * len(spans) + PAGE  # padding only

    embed = snap["module"]["model.embed_tokens.weight"]
    assert snap["module"]["lm_head.weight"] is embed and cudart.covers(embed)  # tied: one buffer
    for name in ("model.layers.3.self_attn.k_proj.weight", "model.norm.weight"):
        assert torch.equal(snap["module"][name], state["module"][name])
    assert torch.equal(snap["optimizer"]["state"][5]["exp_avg_sq"], state["optimizer"]["state"][5]["exp_avg_sq"])

    before, ptrs = st.allocations, {k: b.data_ptr() for k, b in st.buffers.items()}
    st.stage("mp_rank_00_model_states.pt", state)  # the next save: same buffers, nothing registered
    assert len(cudart.registers()) == 1 and st.allocations == before
    assert {k: b.data_ptr() for k, b in st.buffers.items()} == ptrs and cudart.last_error == 0


def test_a_changed_layout_carves_one_new_slab_and_the_old_one_is_unregistered_once_dropped(monkeypatch):
    import gc

    cudart = StrictCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    st = planted_staging(cudart)
    snap = st.stage("a.pt", {"w": torch.ones(64, 1024), "b": torch.ones(8)})
    st.stage("b.pt", {"m": torch.ones(32, 1024)})  # a second file: one slab for both, re-carved
    first = cudart.registers()[0][1]
    assert len(cudart.registers()) == 2 and len(cudart.live) == 2  # the old slab is held by `snap` until written
    del snap
    gc.collect()
    assert list(cudart.live) == [cudart.registers()[1][1]] and ("unregister", first) in cudart.calls
    allocs = st.allocations
    snap = st.stage("a.pt", {"w": torch.full((64, 1024), 2.0), "b": torch.ones(8)})
    st.stage("b.pt", {"m": torch.ones(32, 1024)})
    assert (
        st.allocations == allocs
        and len(cudart.registers()) == 2
        and torch.equal(snap["w"], torch.full((64, 1024), 2.0))
    )
    st.stage("a.pt", {"w": torch.ones(128, 1024), "b": torch.ones(8)})  # a changed shape: one new slab
    assert len(cudart.registers()) == 3 and cudart.last_error == 0


def test_a_refused_page_lock_leaves_no_cuda_error_and_is_said_once(monkeypatch, caplog):
    """The driver refuses (out of lockable memory, or 712): the copies still land, in the same memory unpinned;
    CUDA's last-error slot is empty again (torch's next kernel-launch check would raise it), and one warning."""
    cudart = StrictCudart(fail_with=2)  # cudaErrorMemoryAllocation
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr("ultrascale.train.ckpt_writer._REGISTER_FAILED", [])
    st = planted_staging(cudart)
    with caplog.at_level(logging.WARNING, logger="ultrascale"):
        for n in (64, 128):
            snap = st.stage("a.pt", {"w": torch.full((n, 1024), 3.0)})
            assert cudart.last_error == 0 and torch.equal(snap["w"], torch.full((n, 1024), 3.0))
    assert len(cudart.registers()) == 2 and cudart.live == {}
    (said,) = [r.getMessage() for r in caplog.records if "cudaHostRegister" in r.getMessage()]
    assert said.endswith("failed (CUDA error 2); staging into the same memory unpinned (slower copies), CUDA's "
                         "last error cleared")  # fmt: skip


VENDORED = "/venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcudart-5e4c6f2a.so.13"
MAPS = f"""\
7f2a1c000000-7f2a1c1a2000 r-xp 00000000 fd:01 1311  /usr/lib/x86_64-linux-gnu/libc.so.6
7f2a1d000000-7f2a1d0b1000 r--p 00000000 fd:01 5678  {VENDORED}
7f2a1d0b1000-7f2a1d1c0000 r-xp 000b1000 fd:01 5678  {VENDORED}
7f2a1e000000-7f2a1e004000 r-xp 00000000 fd:01 9012  /opt/stubs/libcudart_stub.so
7ffd0a1f0000-7ffd0a211000 rw-p 00000000 00:00 0     [stack]
"""
"""A CUDA 13 process's maps: the runtime a pip wheel vendors, renamed by auditwheel (no ``libcudart.so`` in it)."""


def test_a_refused_page_lock_clears_the_error_through_a_vendored_libcudart(monkeypatch, tmp_path, caplog):
    """torch's own ``cudart()`` binds no ``cudaGetLastError`` (the recorder above does, so its tests never leave
    it), so the error is cleared through the libcudart the process has mapped, opened with ctypes: here a pip
    wheel's ``libcudart-<hash>.so.13`` in a planted maps file. ctypes opens only that path (dlopen of anything else
    fails), and the library's ``cudaGetLastError`` is the runtime's."""
    from ultrascale.train import ckpt_writer

    runtime = StrictCudart(fail_with=2)
    opened = []

    class TorchsCudart:  # what torch.cuda.cudart() binds of the runtime: no cudaGetLastError
        cudaHostRegister, cudaHostUnregister = runtime.cudaHostRegister, runtime.cudaHostUnregister

    class Library:
        def __init__(self, path: str) -> None:
            opened.append(path)
            if path != VENDORED:
                raise OSError(f"{path}: cannot open shared object file: No such file or directory")
            self.cudaGetLastError = lambda: runtime.cudaGetLastError()

    (tmp_path / "maps").write_text(MAPS)
    monkeypatch.setattr(ckpt_writer, "PROC_MAPS", str(tmp_path / "maps"))
    monkeypatch.setattr(ckpt_writer.ctypes, "CDLL", Library)
    monkeypatch.setattr(torch.cuda, "cudart", TorchsCudart)
    monkeypatch.setattr(ckpt_writer, "_REGISTER_FAILED", [])
    with caplog.at_level(logging.WARNING, logger="ultrascale"):
        snap = planted_staging(runtime).stage("a.pt", {"w": torch.full((64, 1024), 3.0)})
    assert torch.equal(snap["w"], torch.full((64, 1024), 3.0)) and len(runtime.registers()) == 1
    assert opened == [VENDORED] and runtime.last_error == 0, (opened, runtime.last_error)
    assert caplog.records[-1].getMessage().endswith("CUDA's last error cleared")


# ---- pre-staging: the buffers exist before the first save ---------------------------------------------------


def test_pinned_staging_is_allocated_before_the_first_save_which_allocates_nothing(tmp_path):
    """A real DeepSpeed engine (the smoke recipe, ZeRO-1: a model file and an optimizer file) after one step:
    ``Checkpointer.prestage`` fits the staging to both files and registers one region; the first save then
    allocates and registers nothing, its record says no allocation time, and what it wrote loads back."""
    from tests.conftest import check, launch

    out = tmp_path / "prestage.json"
    check(launch(["--worker", str(tmp_path), str(out)], nproc=1, script="tests/test_ckpt_slab.py", timeout=300))
    got = json.loads(out.read_text())
    assert got["before_prestage"] == {"allocations": 0, "buffers": 0, "registers": 0}
    pre, first, second = got["after_prestage"], got["after_first_save"], got["after_second_save"]
    assert pre["buffers"] > 0 and pre["registers"] == 1 and pre["live"] == 1 and pre["pinned"] > 0
    assert first == {**pre, "alloc_s": 0.0} and second == first  # nothing allocated or registered by a save
    assert got["files"] == ["mp_rank_00_model_states.pt", "rng_state_rank00000.pt",
                            "zero_pp_rank_0_mp_rank_00_optim_states.pt"]  # fmt: skip
    assert got["loaded"] and not got["layout_dir_left"]


def _worker(tmp: Path, out: Path) -> None:
    from ultrascale.config.compose import compose
    from ultrascale.levers.deepspeed import build_ds_config
    from ultrascale.levers.rules import validate
    from ultrascale.runtime import dist
    from ultrascale.train.checkpoint import LAYOUT_DIR, Checkpointer
    from ultrascale.train.engine import build_engine

    dist.configure_env()
    dist.init_distributed()
    cfg = compose(["recipe=cpu_smoke", "data.global_batch=4", "data.micro_batch=4"])
    d = validate(cfg, 1)
    engine, _ = build_engine(cfg, d, build_ds_config(cfg, d))
    ck = Checkpointer(tmp / "checkpoints", 1, 0, {}, background=True, staging="pinned")
    ck.attach(engine)
    cudart = StrictCudart()
    torch.cuda.cudart = lambda: cudart
    ck.writer.staging = st = planted_staging(cudart)

    def record(**extra) -> dict:
        return {"allocations": st.allocations, "buffers": len(st.buffers), "registers": len(cudart.registers()),
                **extra}  # fmt: skip

    got = {"before_prestage": record()}
    ids = torch.randint(0, d.hf_config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()  # the optimizer's moments exist from here
    ck.prestage(engine)

    def full(**extra) -> dict:
        return record(live=len(cudart.live), pinned=sum(map(cudart.covers, st.buffers.values())), **extra)

    got["after_prestage"] = full()
    for step, name in ((1, "after_first_save"), (2, "after_second_save")):
        ck.save(engine, step, {"data_offset": 0})
        ck.flush()
        got[name] = full(alloc_s=ck.staging_record()["staging_alloc_s"])
    tag = tmp / "checkpoints" / "step_00000002"
    got["files"] = sorted(p.name for p in tag.iterdir() if p.suffix == ".pt")
    engine.load_checkpoint(str(tag.parent), tag=tag.name)
    got["loaded"] = cudart.last_error == 0
    got["layout_dir_left"] = (tmp / "checkpoints" / LAYOUT_DIR).exists()
    out.write_text(json.dumps(got))
    engine.destroy()
    dist.shutdown()


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(Path(sys.argv[2]), Path(sys.argv[3]))
