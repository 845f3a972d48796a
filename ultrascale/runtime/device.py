"""Where tensors live: the device a rank computes on, micro-batches moved there, collectives' tensors placed where
the communication backend takes them.

Why one module: the first GPU run crashed at step 1 because the trainer handed the engine the loader's CPU
tensors, and every run on two or more GPUs would have crashed next on a collective built from a Python float
(NCCL takes CUDA tensors only). On a CPU box both mistakes are invisible: CPU to CPU needs no move and gloo takes
CPU tensors. So every input path calls :func:`to_device` and every collective's tensor comes from
:func:`coll_tensor`, and the CPU tests check both against a second device (``tests/test_device.py``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, TypeVar

import torch

from ultrascale.errors import ConfigError

T = TypeVar("T")
MIN_TORCH = (2, 11)
"""The oldest torch the project runs on: a GPU node keeps the torch it has (the first one had 2.11 with CUDA 13),
and everything else installs around it (``make wheelhouse``). CI pins 2.13.0."""


def check_torch(version: str | None = None) -> None:
    """Refuse, in one line, a torch older than :data:`MIN_TORCH` (FlexAttention block masks, ``set_stance``
    and the checkpoint APIs used here are not all there before it)."""
    v = version or torch.__version__
    parts = tuple(int(p) for p in v.split("+")[0].split(".")[:2] if p.isdigit())
    if parts < MIN_TORCH:
        raise ConfigError(f"torch {v} is older than {'.'.join(map(str, MIN_TORCH))}, the oldest this project runs on: "
                          f"install torch>={'.'.join(map(str, MIN_TORCH))}")  # fmt: skip


def accelerator() -> tuple[bool, str]:
    """Whether this process may use a CUDA device, and why not: the one place that reads ``DS_ACCELERATOR`` and
    CUDA (``DS_ACCELERATOR=cpu`` keeps a GPU machine on the CPU path). The backend (``dist``), where tensors go and
    pinned memory all follow from it."""
    if os.environ.get("DS_ACCELERATOR") == "cpu":
        return False, "DS_ACCELERATOR=cpu from the environment"
    if not torch.cuda.is_available():
        return False, "no GPU found"
    return True, "CUDA"


def accelerator_usable() -> bool:
    """A CUDA device this process may use (:func:`accelerator`)."""
    return accelerator()[0]


def compute_device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` where a GPU is usable, the CPU otherwise."""
    if accelerator_usable():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def resolve(spec: str | None) -> torch.device:
    """A device from a config value: ``auto`` (or None) is :func:`compute_device`; anything else is a torch
    device string (``cpu``, ``cuda``, ``cuda:1``), refused in one line when this machine does not have it."""
    if spec in (None, "", "auto"):
        return compute_device()
    try:
        device = torch.device(str(spec))
    except RuntimeError as e:
        raise ConfigError(f"device={spec!r} is not a torch device ({e}): use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device={spec}: this machine has no usable CUDA device: use device=auto or cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(
                f"device={spec}: this machine has {torch.cuda.device_count()} CUDA device(s): use cuda:0..."
                f"cuda:{torch.cuda.device_count() - 1}"
            )
    return device


def to_device(obj: T, device: torch.device | str) -> T:
    """``obj`` with every tensor in it on ``device``: a tensor, a dict, list or tuple of them, or a dataclass
    (a :class:`~ultrascale.data.loader.Batch`); anything else is returned as it is.

    Copies to a CUDA device are non-blocking: from pinned host memory (the loader pins on CUDA, see
    :func:`pin`) they overlap with the compute already queued; the stream orders them before any kernel that
    reads them, so no synchronisation is needed."""
    device = torch.device(device)
    non_blocking = device.type == "cuda"

    def move(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x if x.device == device else x.to(device, non_blocking=non_blocking)
        if isinstance(x, dict):
            return {k: move(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            moved = [move(v) for v in x]
            return type(x)(*moved) if hasattr(x, "_fields") else type(x)(moved)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return dataclasses.replace(x, **{f.name: move(getattr(x, f.name)) for f in dataclasses.fields(x)})
        return x

    return move(obj)


def pin(t: torch.Tensor) -> torch.Tensor:
    """``t`` in page-locked memory where a CUDA device will read it (a non-blocking copy needs it to be truly
    asynchronous); unchanged on a CPU-only run, where pinning buys nothing."""
    return t.pin_memory() if accelerator_usable() and t.device.type == "cpu" else t


def comm_device(group: Any = None) -> torch.device:
    """The device a collective's tensors must be on for ``group``'s backend: the current CUDA device for NCCL
    (which accepts nothing else), the CPU for gloo (and without a process group)."""
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized() and str(tdist.get_backend(group)) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def coll_tensor(data: Any, dtype: torch.dtype | None = None, group: Any = None) -> torch.Tensor:
    """A tensor for a collective over ``group``, on the device its backend takes (:func:`comm_device`): from
    Python numbers, or a tensor moved there (detached: what travels is a value, not a graph)."""
    device = comm_device(group)
    if isinstance(data, torch.Tensor):
        return data.detach().to(device=device, dtype=dtype or data.dtype)
    return torch.tensor(data, dtype=dtype).to(device)


def runtime() -> str:
    """The runtime in one line for the banner: torch (and its CUDA build) and the device this rank uses."""
    cuda = torch.version.cuda
    line = f"torch {torch.__version__}" + (f" (CUDA {cuda})" if cuda else " (CPU build)")
    device = compute_device()
    if device.type == "cuda":
        line += f", {torch.cuda.get_device_name(device)}"
    return line
