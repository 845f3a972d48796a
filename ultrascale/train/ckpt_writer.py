"""Checkpoints that do not stall training: snapshot the state at the step boundary, write it in the background.

DeepSpeed 0.19.8's own overlapped writer (``DecoupledCheckpointEngine``) runs ``FastCheckpointEngine`` in a
spawned process, which writes through DeepNVMe's ``AsyncIOBuilder`` op: it needs libaio and a JIT build, and is
made for GPU pinned buffers. So this module plugs a :class:`~deepspeed.runtime.checkpoint_engine.checkpoint_engine.
CheckpointEngine` of our own into the engine (the interface DeepSpeed hands every state dict to, for every ZeRO
stage, the pipeline engine's layer files and MoE expert files alike):

- ``save()`` copies the state dict's tensors into host staging buffers (a device-to-host copy on GPU), so the
  training step that follows may change the live tensors, and queues the copy. The buffers are kept from one
  save to the next: copying into memory already touched is a memcpy (0.09 s for 0.8 GB here), while a fresh
  allocation pays a page fault per 4 KiB under memory pressure (3-7 s for SmolLM2-135M's 0.8 GB optimizer shard
  on this 2-core box: slower than the synchronous save it was meant to hide);
- one background thread per rank ``torch.save``\\ s the queue to disk and fsyncs each file;
- the trainer learns which checkpoint every rank has finished through the all-gather it makes each step anyway,
  and only then does rank 0 write the file list and move ``latest`` (:class:`ultrascale.train.checkpoint.
  Checkpointer`). A crash while the thread writes leaves the previous checkpoint as ``latest``.

The price is host memory for one snapshot (the checkpoint's size per rank), kept between saves; one save is in
flight at a time (a save waits for the previous one to be written, so the buffers are free again).
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine


def _clone(t: torch.Tensor) -> torch.Tensor:
    return t.to("cpu", copy=True) if t.device.type != "cpu" else t.clone()


def snapshot(obj: Any, memo: dict | None = None, copy: Callable[[torch.Tensor], torch.Tensor] = _clone) -> Any:
    """A copy of ``obj`` whose tensors live in their own host memory (a tensor met twice is copied once), made
    by ``copy``. Containers are rebuilt; anything else (numbers, strings, sizes, config objects) is kept as is."""
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            memo[id(obj)] = copy(obj.detach())
        return memo[id(obj)]
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


class BackgroundWriter(CheckpointEngine):
    """DeepSpeed's checkpoint engine interface, writing snapshots on a thread; loading is plain ``torch.load``."""

    def __init__(self) -> None:
        super().__init__()
        self.name = "ultrascale.BackgroundWriter"
        self._jobs: queue.Queue = queue.Queue()
        self._written = -1
        self._queued = -1
        self._error: BaseException | None = None
        self._write_s = 0.0
        self.snapshot_s = 0.0
        """Seconds the copies of the checkpoint in flight took (on the training thread)."""
        self._staging: dict[tuple[str, int], torch.Tensor] = {}
        self._done = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="ckpt-writer", daemon=True)
        self._thread.start()

    # ---- DeepSpeed's CheckpointEngine interface ---------------------------------------------------------
    def create(self, info: CheckpointCommitInfo) -> None:
        self.raise_if_failed()

    def save(self, state_dict: Any, path: str) -> None:
        t0 = time.perf_counter()
        self._jobs.put(("file", path, snapshot(state_dict, copy=self._stager(Path(path).name)), 0.0))
        self.snapshot_s += time.perf_counter() - t0

    def _stager(self, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """Copies into this file's staging buffers (by the tensor's place in the state dict, as every save of a
        run writes the same files with the same tensors); a buffer is (re)allocated when a shape changes."""
        order = itertools.count()
        gpu = torch.cuda.is_available()

        def copy(t: torch.Tensor) -> torch.Tensor:
            key = (name, next(order))
            buf = self._staging.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=gpu and t.is_cuda)
                self._staging[key] = buf
            return buf.copy_(t)

        return copy

    def load(self, path: str, map_location=None) -> Any:
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        return True

    def preserves_storage_sharing(self) -> bool:
        return False  # the snapshot copies each tensor on its own; DeepSpeed need not clone first

    # ---- ours ----------------------------------------------------------------------------------------------
    def put(self, path: str, obj: Any) -> None:
        """Queue one more file (already a private object, e.g. this rank's RNG state)."""
        self._jobs.put(("file", path, obj, 0.0))

    def begin(self, step: int, delay_s: float = 0.0) -> None:
        """Checkpoint ``step``'s files follow. ``delay_s`` (a planted slow disk, ``ULTRASCALE_INJECT=slow_ckpt@...``)
        is slept by the thread before it writes them."""
        self._queued = step
        self.snapshot_s = 0.0
        if delay_s:
            self._jobs.put(("sleep", None, None, delay_s))

    def mark(self, step: int) -> None:
        """Everything queued so far belongs to checkpoint ``step``: it counts as written once the thread gets here."""
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
