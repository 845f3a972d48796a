"""Weights that depend on the seed and the parameter's name, not on how the model is laid out.

A model built whole on one rank, partitioned from its first byte under ZeRO-3, or built stage by stage by a
pipeline must start from the same weights: that is what lets every layout be checked against the plain run,
and what makes the seed mean something. HF's initializer draws from one global RNG stream in module order, so
the values depend on which modules a process builds. Here each module is initialized by the model's own
``_init_weights`` (so every architecture keeps its distributions) from an RNG seeded by ``(seed, module name)``.
Names are HF's (``model.layers.3.mlp.up_proj``), whatever wrapper holds the module.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterable

import torch
from torch import nn


def keyed_seed(seed: int, name: str) -> int:
    """A 63-bit seed from the run's seed and a module's HF name."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def _clear_hf_flags(module: nn.Module) -> None:
    """transformers' init functions skip tensors marked initialized; these are about to be re-initialized."""
    for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
        if t is not None and hasattr(t, "_is_hf_initialized"):
            del t._is_hf_initialized
    if hasattr(module, "_is_hf_initialized"):
        del module._is_hf_initialized


@torch.no_grad()
def init_named_modules(
    modules: Iterable[tuple[str, nn.Module]],
    init_fn: Callable[[nn.Module], None],
    seed: int,
    gather: Callable[[list[nn.Parameter]], contextlib.AbstractContextManager] | None = None,
) -> int:
    """Initialize each module's own parameters and buffers with ``init_fn`` (an HF model's ``_init_weights``)
    from an RNG keyed by ``(seed, name)``; returns how many modules were initialized.

    A module whose parameters all belong to a module initialized before it (a tied LM head) is skipped, so a
    tied weight is drawn once, by its first owner. ``gather`` wraps each module's initialization (ZeRO-3:
    :func:`zero3_local`, so one module at a time is whole on a rank).
    """
    seen: set[int] = set()
    done = 0
    for name, module in modules:
        params = list(module.parameters(recurse=False))
        if params and all(id(p) in seen for p in params):
            continue
        seen.update(id(p) for p in params)
        _clear_hf_flags(module)
        with torch.random.fork_rng(devices=[]), gather(params) if gather and params else contextlib.nullcontext():
            torch.manual_seed(keyed_seed(seed, name))
            init_fn(module)
        done += 1
    return done


@contextlib.contextmanager
def zero3_local(params: list[nn.Parameter]):
    """Initialize a module's ZeRO-3 parameters without gathering them: every rank draws the whole tensors from
    the same keyed RNG into temporaries, and keeps its own slice in its partition (``ds_tensor``), laid out as
    DeepSpeed lays it (``partition_numel`` elements from ``rank * partition_numel``). A rank holds one module's
    tensors at a time, and nothing is communicated. Parameters with a secondary (hpZ) copy are gathered instead."""
    import torch.distributed as tdist

    if any(getattr(p, "ds_secondary_tensor", None) is not None for p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            yield
        return
    saved = [p.data for p in params]
    for p in params:
        p.data = torch.empty(p.ds_shape, dtype=p.ds_tensor.dtype, device=p.ds_tensor.device)
    try:
        yield
        for p in params:
            part, size = p.ds_tensor, p.ds_tensor.ds_numel
            start = size * tdist.get_rank(group=p.ds_process_group)
            count = max(0, min(size, p.ds_numel - start))
            if count:
                part.data.narrow(0, 0, count).copy_(p.data.reshape(-1).narrow(0, start, count))
    finally:
        for p, data in zip(params, saved):
            p.data = data


def init_model(model: nn.Module, seed: int) -> int:
    """Re-initialize a whole HF ``PreTrainedModel`` (built whole or under ZeRO-3) by name; returns module count."""
    partitioned = any(hasattr(p, "ds_id") for p in model.parameters())
    return init_named_modules(model.named_modules(), model._init_weights, seed, zero3_local if partitioned else None)
