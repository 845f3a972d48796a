"""Checkpoints that do not stall training: snapshot the state at the step boundary, write it in the background.

DeepSpeed 0.19.8's own overlapped writer (``DecoupledCheckpointEngine``) runs ``FastCheckpointEngine`` in a
spawned process, which writes through DeepNVMe's ``AsyncIOBuilder`` op: it needs libaio and a JIT build, and is
made for GPU pinned buffers. So this module plugs a :class:`~deepspeed.runtime.checkpoint_engine.checkpoint_engine.
CheckpointEngine` of our own into the engine (the interface DeepSpeed hands every state dict to, for every ZeRO
stage, the pipeline engine's layer files and MoE expert files alike):

- ``save()`` copies the state dict's tensors into host staging buffers (:class:`Staging`), so the training step
  that follows may change the live tensors. The buffers are allocated at the first save and reused by every
  later one: copying into memory already touched is a memcpy (0.09 s for 0.8 GB here), while a fresh
  allocation pays a page fault per 4 KiB under memory pressure (3-7 s for SmolLM2-135M's 0.8 GB optimizer shard
  on this 2-core box: slower than the synchronous save it was meant to hide). On CUDA they are pinned
  (``train.checkpoint_staging``): the copies run as non-blocking device-to-host DMA on a side stream at the
  link's speed, with one synchronisation per checkpoint, where a copy into pageable memory goes through the
  driver's bounce buffer one chunk at a time (the first GPU run: 17 GB at ~1.9 GB/s, a 9.2 s stall);
- one background thread per rank ``torch.save``\\ s the queue to disk and fsyncs each file;
- the trainer learns which checkpoint every rank has finished through the all-gather it makes each step anyway,
  and only then does rank 0 write the file list and move ``latest`` (:class:`ultrascale.train.checkpoint.
  Checkpointer`). A crash while the thread writes leaves the previous checkpoint as ``latest``.

The price is host memory for one snapshot (the checkpoint's size per rank, offloaded optimizer state included:
the next step's CPU Adam updates it in place, so it is copied like the rest), kept between saves; one save is in
flight at a time (a save waits for the previous one to be written, so the buffers are free again).
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

log = logging.getLogger("ultrascale")
STAGING_MODES = ("auto", "pinned", "pageable")


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


def staging_mode(requested: str, cuda: bool | None = None) -> str:
    """``train.checkpoint_staging`` as it runs here: ``auto`` is pinned where CUDA is, pageable elsewhere; pinned
    without CUDA is pageable too (there is no DMA engine to pin for)."""
    if requested not in STAGING_MODES:
        raise ValueError(f"checkpoint staging {requested!r}: expected one of {', '.join(STAGING_MODES)}")
    cuda = torch.cuda.is_available() if cuda is None else cuda
    return "pinned" if requested in ("auto", "pinned") and cuda else "pageable"


def _pin(buf: torch.Tensor) -> torch.Tensor:
    """Page-lock ``buf`` in place for DMA (exactly its size: torch's pinned allocator rounds every block up to a
    power of two, ~1.5x the host memory for a checkpoint of a few large flat tensors). Its pages are touched
    first by a multi-threaded fill, so the driver's single-threaded registration only locks them. Falls back to
    torch's pinned allocator if the driver refuses."""
    nbytes = buf.numel() * buf.element_size()
    if nbytes == 0:
        return buf
    buf.view(-1).view(torch.uint8).zero_()
    cudart = torch.cuda.cudart()
    ptr = buf.data_ptr()
    if int(cudart.cudaHostRegister(ptr, nbytes, 0)) != 0:
        log.warning(f"checkpoint staging: cudaHostRegister of {nbytes / 1e9:.2f} GB failed; torch's pinned allocator")
        return torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True)
    weakref.finalize(buf, cudart.cudaHostUnregister, ptr)
    return buf


class Staging:
    """Host buffers for a checkpoint's tensors, allocated at the first save and reused by every later one.

    A buffer is keyed by its file's name and the tensor's place in that file's state dict (every save of a run
    writes the same files with the same tensors); it is reallocated only when that tensor's shape or dtype
    changes. ``pinned`` (CUDA): buffers for device tensors are page-locked and filled by non-blocking copies on
    a side stream, which ``sync()`` waits for once per checkpoint; host tensors (offloaded state) get ordinary
    buffers, as pinning does nothing for a host-to-host copy. ``pageable``: ordinary buffers, blocking copies.
    """

    def __init__(self, mode: str = "auto") -> None:
        self.mode = staging_mode(mode)
        self.buffers: dict[tuple[str, int], torch.Tensor] = {}
        self.allocations = 0
        """Buffers allocated so far (a save that allocates nothing leaves it unchanged)."""
        self.allocate_s = 0.0
        """Seconds spent allocating (and pinning) buffers, all saves together."""
        self._stream: Any = None
        self._fence = False
        self._copying = False

    @property
    def nbytes(self) -> int:
        """Host bytes the staging buffers hold."""
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def copier(self, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """The ``copy`` for :func:`snapshot` of the file ``name``: fills that file's buffers in state-dict order."""
        order = itertools.count()
        self._fence = True  # this file's state dict was computed by work queued after the last file's copies

        def copy(t: torch.Tensor) -> torch.Tensor:
            key = (name, next(order))
            pinned = self.mode == "pinned" and t.is_cuda
            buf = self.buffers.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                t0 = time.perf_counter()
                buf = torch.empty(t.shape, dtype=t.dtype)
                buf = _pin(buf) if pinned else buf
                self.buffers[key] = buf
                self.allocations += 1
                self.allocate_s += time.perf_counter() - t0
            if not pinned:
                return buf.copy_(t)
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=t.device)
            if self._fence:  # the state is final once the work queued before this save() has run
                self._stream.wait_stream(torch.cuda.current_stream(t.device))
                self._fence, self._copying = False, True
            with torch.cuda.stream(self._stream):
                buf.copy_(t, non_blocking=True)
            t.record_stream(self._stream)  # a temporary of DeepSpeed's state dict is not reused before it is read
            return buf

        return copy

    def sync(self) -> None:
        """Wait for the copies queued since the last call (the one synchronisation of a pinned checkpoint)."""
        if self._copying:
            self._stream.synchronize()
            self._copying = False


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
        self._done = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="ckpt-writer", daemon=True)
        self._thread.start()

    # ---- DeepSpeed's CheckpointEngine interface ---------------------------------------------------------
    def create(self, info: CheckpointCommitInfo) -> None:
        self.raise_if_failed()

    def save(self, state_dict: Any, path: str) -> None:
        t0 = time.perf_counter()
        self._held.append(("file", path, snapshot(state_dict, copy=self.staging.copier(Path(path).name)), 0.0))
        self.snapshot_s += time.perf_counter() - t0

    def load(self, path: str, map_location=None) -> Any:
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        return True

    def preserves_storage_sharing(self) -> bool:
        return False  # the snapshot copies each tensor on its own; DeepSpeed need not clone first

    # ---- ours ----------------------------------------------------------------------------------------------
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
