"""Checkpoints that do not stall training: snapshot the state at the step boundary, write it in the background.

DeepSpeed 0.19.8's own overlapped writer (``DecoupledCheckpointEngine``) writes through DeepNVMe's ``AsyncIOBuilder``
op in a spawned process: it needs libaio and a JIT build, and is made for GPU pinned buffers. So this module plugs a
checkpoint engine of our own into the engine (:class:`BackgroundWriter`; DeepSpeed hands it every state dict, for
every ZeRO stage, the pipeline engine's layer files and MoE expert files alike). ``save()`` copies the tensors into
host staging buffers allocated once and reused (:class:`Staging`), so the next step may change the live tensors;
one background thread per rank writes the queue with ``torch.save`` and fsyncs each file; rank 0 moves ``latest``
only once every rank has finished (:class:`ultrascale.train.checkpoint.Checkpointer`), so a crash while the thread
writes leaves the previous checkpoint as ``latest``. The price is host memory for one snapshot per rank, kept
between saves; one save is in flight at a time. Why the buffers are reused and pinned: bench/README.md,
"bench/checkpoint_stall.py".
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import math
import mmap
import os
import queue
import re
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from ultrascale.levers.decide import staging_mode

log = logging.getLogger("ultrascale")


def _clone(t: torch.Tensor) -> torch.Tensor:
    return t.to("cpu", copy=True) if t.device.type != "cpu" else t.clone()


def _alias_key(t: torch.Tensor) -> tuple:
    """Equal for two tensors that read the same elements of the same memory (empty ones: by identity)."""
    if t.numel() == 0:
        return ("empty", id(t))
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def snapshot(obj: Any, memo: dict | None = None, copy: Callable[[torch.Tensor], torch.Tensor] = _clone) -> Any:
    """A copy of ``obj`` whose tensors live in their own host memory, made by ``copy``. A tensor met twice is
    copied once, and so is a second view of the same memory: ``module.state_dict()`` hands a tied embedding and
    head as two detached tensors of one parameter (262M parameters of Llama-3.2-1B, 0.5 GB of bf16 copied and
    written twice otherwise). Containers are rebuilt; anything else (numbers, strings, sizes, config objects) is
    kept as is."""
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        key = _alias_key(obj)
        if key not in memo:
            memo[key] = copy(obj.detach())
        return memo[key]
    if isinstance(obj, dict):
        out = {} if type(obj) is dict else type(obj)()
        for k, v in obj.items():
            out[k] = snapshot(v, memo, copy)
        return out
    if isinstance(obj, list):
        return [snapshot(v, memo, copy) for v in obj]
    if isinstance(obj, tuple):
        items = [snapshot(v, memo, copy) for v in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj  # nothing mutable inside (torch.Size, plain tuples): keep its type
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    return obj


PAGE = mmap.PAGESIZE
VIEW_ALIGN = 512
"""Where each pinned buffer starts inside its slab: a multiple of 512 bytes (a DMA engine's preferred alignment and
a multiple of every dtype's size), so at most 511 bytes of padding a buffer; the padding is never written."""
PIN_MIN_BYTES = 64 * 1024
"""Device tensors below 64 KiB are staged into ordinary memory, unpinned: norms, biases, Adam's step counters,
O(layers) of them. Their copy is bound by its fixed ~10 us latency, not by bandwidth (64 KiB through the driver's
bounce buffer at ~2 GB/s is ~30 us, pinned ~3 us), so pinning them would save well under a millisecond a
checkpoint while every one of them would sit in the slab's layout. Projections (SmolLM2-135M's smallest, k/v
in bf16, is 221 KB; Llama-3.2-1B's 2 MiB) and the flat optimizer partitions are all above it."""


def _is_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


_REGISTER_FAILED: list[str] = []
"""The first failed page-lock's message: said once a process."""


PROC_MAPS = "/proc/self/maps"
"""Where the process's mapped files are listed (a test plants its own)."""
_CUDART_FILE = re.compile(r"libcudart(?:-[0-9A-Za-z]+)?\.so(?:\.[0-9]+)*")
"""A CUDA runtime's file name: ``libcudart.so.12`` as the toolkit and the ``nvidia-cuda-runtime`` wheels name it,
and ``libcudart-<hash>.so.13`` as auditwheel renames the copy a wheel vendors (a plain ``"libcudart.so" in line``
never matched that one). Not ``libcudart_static`` or a ``.so.12.bak``."""


def _libcudart(name: str) -> Callable[[], int] | None:
    """``name`` from the libcudart this process has loaded (torch's ``cudart()`` binds no ``cudaGetLastError``):
    found in ``/proc/self/maps`` so ctypes opens that same library, whose per-thread error slot torch reads."""
    paths = set()
    try:
        with open(PROC_MAPS) as f:
            for line in f:
                parts = line.rstrip("\n").split(maxsplit=5)  # address perms offset dev inode path (spaces and all)
                if len(parts) == 6 and _CUDART_FILE.fullmatch(os.path.basename(parts[5])):
                    paths.add(parts[5])
    except OSError:
        return None
    for path in sorted(paths):
        try:
            fn = getattr(ctypes.CDLL(path), name)
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        return fn
    return None


def _clear_last_error(cudart: Any) -> bool:
    """Reset CUDA's last-error slot after a failed runtime call we handled: a failed ``cudaHostRegister`` leaves
    its error there, and torch's next kernel-launch check (``cudaGetLastError``) raises it as if that kernel had
    failed. Returns whether it could."""
    get = getattr(cudart, "cudaGetLastError", None) or _libcudart("cudaGetLastError")
    if get is None:
        return False
    get()
    return True


def _page_lock(ptr: int, nbytes: int, owner: Any) -> bool:
    """``cudaHostRegister`` the page-aligned range ``[ptr, ptr + nbytes)``, unregistered when ``owner`` is
    collected (after every view of it). On failure: CUDA's last error cleared, one warning, False (the caller
    stages into the same memory unpinned: the copies then go through the driver's bounce buffer)."""
    cudart = torch.cuda.cudart()
    err = int(cudart.cudaHostRegister(ptr, nbytes, 0))
    if err == 0:
        weakref.finalize(owner, cudart.cudaHostUnregister, ptr).atexit = False  # exit releases it with the context
        return True
    cleared = _clear_last_error(cudart)
    if not _REGISTER_FAILED:
        _REGISTER_FAILED.append(f"error {err}")
        log.warning(f"checkpoint staging: cudaHostRegister of {nbytes / 1e9:.2f} GB failed (CUDA error {err}); "
                    "staging into the same memory unpinned (slower copies), "
                    + ("CUDA's last error cleared" if cleared else "CUDA's last error could not be cleared"))  # fmt: skip
    return False


class _Slab:
    """One block of host memory that every pinned staging buffer is carved from, page-locked by ONE
    ``cudaHostRegister``. A register per tensor failed on the second small one: small tensors share heap pages,
    and a page already registered answers "already registered" (712), an error torch's next kernel launch then
    raised. The block is an anonymous mmap (page-aligned, its size a whole number of pages, no page shared with
    any other allocation). Each buffer is a separate tensor over its own bytes, not a view of one big tensor:
    ``torch.save`` writes a view's whole storage, and refuses one storage read as two dtypes."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = _round_up(max(nbytes, 1), PAGE)
        self._array = np.frombuffer(mmap.mmap(-1, self.nbytes), dtype=np.uint8)
        whole = torch.from_numpy(self._array)
        self.ptr = whole.data_ptr()
        whole.zero_()  # touched by torch's threads, so the driver's single-threaded registration only locks pages
        self.pinned = _page_lock(self.ptr, self.nbytes, self._array)

    def view(self, offset: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return torch.from_numpy(self._array[offset : offset + n]).view(dtype).view(shape)


class _SideStream:
    """Device-to-host copies on a side stream: the first copy of each file waits for the work queued before the
    save (the state is final then), and ``sync`` waits for all of them, once per checkpoint."""

    def __init__(self) -> None:
        self._stream: Any = None
        self._fence = False
        self._copying = False

    def fence(self) -> None:
        """The next file's state dict was computed by work queued after the previous file's copies."""
        self._fence = True

    def copy(self, buf: torch.Tensor, t: torch.Tensor, non_blocking: bool) -> None:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=t.device)
        if self._fence:
            self._stream.wait_stream(torch.cuda.current_stream(t.device))
            self._fence, self._copying = False, True
        with torch.cuda.stream(self._stream):
            buf.copy_(t, non_blocking=non_blocking)
        t.record_stream(self._stream)  # a temporary of DeepSpeed's state dict is not reused before it is read

    def sync(self) -> None:
        if self._copying:
            self._stream.synchronize()
            self._copying = False


class Staging:
    """Host buffers for a checkpoint's tensors, allocated before (or at) the first save and reused by every later
    one.

    A buffer is keyed by its file's name and the tensor's place in that file's state dict (every save of a run
    writes the same files with the same tensors); it is reallocated only when that tensor's shape or dtype
    changes. ``pinned`` (CUDA): device tensors of at least :data:`PIN_MIN_BYTES` are staged into one page-locked
    slab (:class:`_Slab`) for every file, carved at :data:`VIEW_ALIGN` offsets and filled by non-blocking copies
    on a side stream, which ``sync()`` waits for once per checkpoint; a changed layout re-carves a new slab (the
    old one is unregistered once the snapshots that hold it are written). Smaller device tensors and host
    tensors (offloaded state: pinning does nothing for a host-to-host copy) get ordinary buffers. ``pageable``:
    ordinary buffers, blocking copies. Offloaded optimizer state is staged like the rest: the next step's CPU Adam
    updates it in place. The buffers are allocated on CUDA after the first step
    (:meth:`ultrascale.train.checkpoint.Checkpointer.prestage`), elsewhere by the first save.

    Whether a tensor is on the device (``on_device``) and how it is copied there (``dma``) are attributes, so a
    CPU test can plant CUDA-ness and run the pinned layout.
    """

    def __init__(self, mode: str = "auto", cuda: bool | None = None) -> None:
        self.mode = staging_mode(mode, torch.cuda.is_available() if cuda is None else cuda)
        self.buffers: dict[tuple[str, int], torch.Tensor] = {}
        self.allocations = 0
        """Allocations so far (a slab counts once, an ordinary buffer once); a save that allocates nothing leaves
        it unchanged."""
        self.allocate_s = 0.0
        """Seconds spent allocating (and pinning) buffers, all saves together."""
        self.on_device: Callable[[torch.Tensor], bool] = _is_cuda
        self.dma: Any = _SideStream()
        self.slab: _Slab | None = None
        self._layout: dict[tuple[str, int], tuple[int, tuple, torch.dtype]] = {}
        """The current slab's buffers: key -> (offset, shape, dtype)."""
        self._wanted: dict[tuple[str, int], tuple[tuple, torch.dtype]] = {}
        """The pinned buffers the files saved so far need: key -> (shape, dtype)."""

    @property
    def nbytes(self) -> int:
        """Host bytes the staging buffers hold."""
        return sum(_nbytes(b) for b in self.buffers.values())

    def _pins(self, t: torch.Tensor) -> bool:
        return self.mode == "pinned" and self.on_device(t) and _nbytes(t) >= PIN_MIN_BYTES

    def reserve(self, name: str, state_dict: Any, carve: bool = True) -> None:
        """Make the buffers of the file ``name`` fit ``state_dict`` (nothing to do once they do): walked once
        without copying, so a slab is carved for the whole file, not grown tensor by tensor. ``carve=False``
        leaves the slab to :meth:`carve`, so a dry run of several files carves one slab for all of them."""
        t0, before = time.perf_counter(), self.allocations
        tensors: list[torch.Tensor] = []
        snapshot(state_dict, copy=lambda t: tensors.append(t) or t)
        pinned: dict[tuple[str, int], tuple[tuple, torch.dtype]] = {}
        for i, t in enumerate(tensors):
            key = (name, i)
            if self._pins(t):
                pinned[key] = (tuple(t.shape), t.dtype)
                continue
            buf = self.buffers.get(key)
            if buf is None or key in self._layout or buf.shape != t.shape or buf.dtype != t.dtype:
                self._layout.pop(key, None)
                self.buffers[key] = torch.empty(t.shape, dtype=t.dtype)
                self.allocations += 1
        self._wanted = {**{k: v for k, v in self._wanted.items() if k[0] != name}, **pinned}
        if self.allocations != before:
            self.allocate_s += time.perf_counter() - t0
        if carve:
            self.carve()

    def carve(self) -> None:
        """A new slab when the pinned layout the files want differs from the current slab's, each buffer at a
        :data:`VIEW_ALIGN` offset. The old slab's buffers stay valid for the snapshots that hold them; it is
        unregistered and unmapped once those are written and dropped."""
        if self._wanted == {k: (shape, dtype) for k, (_, shape, dtype) in self._layout.items()}:
            return
        t0 = time.perf_counter()
        layout, end = {}, 0
        for key, (shape, dtype) in self._wanted.items():
            layout[key] = (end, shape, dtype)
            end = _round_up(end + math.prod(shape) * torch.empty((), dtype=dtype).element_size(), VIEW_ALIGN)
        for key in self._layout.keys() - layout.keys():  # gone from the files: nothing keeps the old slab for it
            del self.buffers[key]
        self.slab = _Slab(end) if layout else None
        for key, (offset, shape, dtype) in layout.items():
            self.buffers[key] = self.slab.view(offset, shape, dtype)
        self._layout = layout
        self.allocations += 1 if layout else 0
        self.allocate_s += time.perf_counter() - t0

    def stage(self, name: str, state_dict: Any) -> Any:
        """A snapshot of ``state_dict`` (the file ``name``) in this staging's buffers: copied now, or on CUDA
        queued to land by :meth:`sync`."""
        self.reserve(name, state_dict)
        order = itertools.count()
        self.dma.fence()

        def copy(t: torch.Tensor) -> torch.Tensor:
            key = (name, next(order))
            buf = self.buffers[key]
            if self.mode == "pinned" and self.on_device(t):
                self.dma.copy(buf, t, non_blocking=key in self._layout and self.slab.pinned)
            else:
                buf.copy_(t)
            return buf

        return snapshot(state_dict, copy=copy)

    def sync(self) -> None:
        """Wait for the copies queued since the last call (the one synchronisation of a pinned checkpoint)."""
        self.dma.sync()


class BackgroundWriter(CheckpointEngine):
    """DeepSpeed's checkpoint engine interface, writing snapshots on a thread; loading is plain ``torch.load``."""

    def __init__(self, staging: str = "auto") -> None:
        super().__init__()
        self.name = "ultrascale.BackgroundWriter"
        self._jobs: queue.Queue = queue.Queue()
        self._written = -1
        self._queued = -1
        self._error: BaseException | None = None
        self._write_s = 0.0
        self.snapshot_s = 0.0
        """Seconds the copies of the checkpoint in flight took (on the training thread)."""
        self.staging = Staging(staging)
        self._held: list[tuple] = []
        """Jobs whose copies may still be in flight: queued for the thread once :meth:`mark` has synchronised."""
        self._layout_only = False
        self._done = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="ckpt-writer", daemon=True)
        self._thread.start()

    # ---- DeepSpeed's CheckpointEngine interface ---------------------------------------------------------
    def create(self, info: CheckpointCommitInfo) -> None:
        self.raise_if_failed()

    def save(self, state_dict: Any, path: str) -> None:
        if self._layout_only:
            self.staging.reserve(Path(path).name, state_dict, carve=False)
            return
        t0 = time.perf_counter()
        self._held.append(("file", path, self.staging.stage(Path(path).name, state_dict), 0.0))
        self.snapshot_s += time.perf_counter() - t0

    def load(self, path: str, map_location=None) -> Any:
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        return True

    def preserves_storage_sharing(self) -> bool:
        return False  # the snapshot copies each tensor on its own; DeepSpeed need not clone first

    # ---- ours ----------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def layout_only(self):
        """DeepSpeed's saves inside this only fit the staging buffers to their files (:meth:`Staging.reserve`):
        nothing is copied, queued or written. A dry run of a checkpoint, so its buffers exist before the first
        real one (:meth:`ultrascale.train.checkpoint.Checkpointer.prestage`)."""
        self._layout_only = True
        try:
            yield
        finally:
            self._layout_only = False
        self.staging.carve()

    def put(self, path: str, obj: Any) -> None:
        """Queue one more file (already a private object, e.g. this rank's RNG state)."""
        self._held.append(("file", path, obj, 0.0))

    def begin(self, step: int, delay_s: float = 0.0) -> None:
        """Checkpoint ``step``'s files follow. ``delay_s`` (a planted slow disk, ``ULTRASCALE_INJECT=slow_ckpt@...``)
        is slept by the thread before it writes them."""
        self._queued = step
        self.snapshot_s = 0.0
        if delay_s:
            self._held.append(("sleep", None, None, delay_s))

    def mark(self, step: int) -> None:
        """Everything saved since :meth:`begin` belongs to checkpoint ``step``: once its copies have landed (one
        synchronisation, counted in ``snapshot_s``) the thread writes it, and it counts as written once the
        thread gets past it."""
        t0 = time.perf_counter()
        self.staging.sync()
        self.snapshot_s += time.perf_counter() - t0
        for job in self._held:
            self._jobs.put(job)
        self._held = []
        self._jobs.put(("mark", None, step, 0.0))

    def written(self) -> int:
        """The newest checkpoint step this rank has completely written (-1: none yet)."""
        self.raise_if_failed()
        return self._written

    def pending(self) -> bool:
        return self._queued > self._written

    def wait(self, beat: Callable[[], None] | None = None) -> float:
        """Block until every queued file is written; returns the seconds waited (the stall it caused). ``beat``
        is called every second meanwhile (a long write is progress, not a hang)."""
        t0 = time.perf_counter()
        with self._done:
            while not self._done.wait_for(lambda: self._error is not None or self._written >= self._queued, 1.0):
                if beat is not None:
                    beat()
        self.raise_if_failed()
        return time.perf_counter() - t0

    def take_write_s(self) -> float:
        """Seconds the thread spent writing since the last call (the write the stall no longer contains)."""
        s, self._write_s = self._write_s, 0.0
        return s

    def raise_if_failed(self) -> None:
        if self._error is not None:
            from ultrascale.errors import CheckpointError

            raise CheckpointError(f"background checkpoint write failed: {self._error}") from None

    def _run(self) -> None:
        while True:
            kind, path, obj, delay = self._jobs.get()
            try:
                t0 = time.perf_counter()
                if kind == "sleep":
                    time.sleep(delay)
                    continue
                if kind == "mark":
                    with self._done:
                        self._written = obj
                        self._done.notify_all()
                    continue
                with open(path, "wb") as f:
                    torch.save(obj, f)
                    f.flush()
                    os.fsync(f.fileno())
                self._write_s += time.perf_counter() - t0
            except BaseException as e:  # kept and raised on the training thread
                with self._done:
                    self._error = RuntimeError(f"{path}: {type(e).__name__}: {e}")
                    self._done.notify_all()
                return
            finally:
                del obj
