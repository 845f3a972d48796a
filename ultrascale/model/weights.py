"""An HF safetensors checkpoint read tensor by tensor, by name, through its index: what a pipeline stage and a
ZeRO-3 rank load instead of the whole model.

``from_pretrained`` under transformers' ZeRO-3 integration peaks above the whole model on every rank while
loading. Read one module's tensors at a time into a model built partitioned, each rank keeping only its slice,
the same load peaks at the rank's shard plus one tensor (the figures: bench/README.md, "bench/scale_memory.py").

A model whose vocabulary grew past the checkpoint's (``model.config.vocab_size`` above its ``config.json``'s, for
the tokens data prep's ``tokenizer.add_fim`` appends) reads the old rows of the embedding and the head as they are
and starts each new row at the mean of the old ones (:func:`grow_rows`), in every layout: whole, ZeRO-3
partitioned and pipeline stages all read through here.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from torch import nn

from ultrascale.errors import ConfigError
from ultrascale.model.init import zero3_local


def grow_rows(old: torch.Tensor, rows: int) -> torch.Tensor:
    """``old`` with rows appended up to ``rows``, each the mean of the old rows (taken in fp32).

    The mean, not HF's draw around it (``resize_token_embeddings(mean_resizing=True)``) nor a fresh init: a new
    token's logit then starts at the average logit, so it neither dominates the softmax nor is unreachable
    (Hewitt, "Initializing new word embeddings for pretrained language models", 2021); and a mean is the same on
    every rank and in every layout, with no RNG to agree on."""
    mean = old.float().mean(dim=0, keepdim=True).to(old.dtype)
    return torch.cat([old, mean.expand(rows - old.shape[0], *old.shape[1:])])


class SafetensorsWeights:
    """Tensors of an HF checkpoint directory by name, read one at a time from the file the index names.

    ``vocab``: the model's vocabulary size; a checkpoint tensor with fewer rows than that where the model's has
    ``vocab`` rows (the embedding, the head) is grown by :func:`grow_rows`."""

    def __init__(self, model_dir: Path, vocab: int | None = None):
        self.dir = model_dir
        self.vocab = vocab
        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            self.files = {k: model_dir / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        elif (model_dir / "model.safetensors").exists():
            from safetensors import safe_open

            with safe_open(model_dir / "model.safetensors", "pt") as f:
                self.files = dict.fromkeys(f.keys(), model_dir / "model.safetensors")
        else:
            raise ConfigError(f"model.pretrained_path={model_dir} has no model.safetensors(.index.json): "
                              "the pipeline reads safetensors checkpoints (export or re-save the model)")  # fmt: skip

    def _fit(self, key: str, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        """``src`` as ``dst``'s shape takes it: as it is, or grown to the model's vocabulary."""
        if src.shape == dst.shape:
            return src
        if self.vocab and dst.shape[0] == self.vocab > src.shape[0] and src.shape[1:] == dst.shape[1:]:
            return grow_rows(src, self.vocab)
        raise ConfigError(f"model.pretrained_path={self.dir}: tensor {key!r} is {tuple(src.shape)}, the model's is "
                          f"{tuple(dst.shape)} (a different architecture, or model.config overrides its shape?)")  # fmt: skip

    def load_into(self, module: nn.Module, prefix: str) -> None:
        """Copy ``prefix.<name>`` into each of ``module``'s persistent tensors (no other tensor is read)."""
        from safetensors import safe_open

        wanted = {f"{prefix}.{n}": t for n, t in module.state_dict(keep_vars=True).items()}
        missing = [k for k in wanted if k not in self.files]
        if missing:
            raise ConfigError(
                f"model.pretrained_path={self.dir} has no tensor {missing[0]!r} (a different architecture?)"
            )
        by_file: dict[Path, list[str]] = {}
        for key in wanted:
            by_file.setdefault(self.files[key], []).append(key)
        with torch.no_grad():
            for path, keys in by_file.items():
                with safe_open(path, "pt") as f:
                    for key in keys:
                        wanted[key].copy_(self._fit(key, f.get_tensor(key), wanted[key]))

    def load_own(self, module: nn.Module, name: str) -> None:
        """Copy ``name.<tensor>`` into ``module``'s own parameters and persistent buffers (not its children's)."""
        from safetensors import safe_open

        own = dict(module.named_parameters(prefix=name, recurse=False))
        persistent = {n for n, _ in module.named_buffers(recurse=False)} - module._non_persistent_buffers_set
        own.update({f"{name}.{n}" if name else n: b for n, b in module.named_buffers(recurse=False) if n in persistent})
        missing = [k for k in own if k not in self.files]
        if missing:
            raise ConfigError(
                f"model.pretrained_path={self.dir} has no tensor {missing[0]!r} (a different architecture?)"
            )
        with torch.no_grad():
            for key, tensor in own.items():
                with safe_open(self.files[key], "pt") as f:
                    tensor.copy_(self._fit(key, f.get_tensor(key), tensor))


@torch.no_grad()
def load_partitioned(model: nn.Module, weights: SafetensorsWeights) -> int:
    """Load a model built under ZeRO-3 (``zero.Init``) from ``weights``, one module at a time: every rank reads
    the module's tensors whole into temporaries and keeps its own slice (:func:`ultrascale.model.init.zero3_local`),
    so a rank holds its shard plus one module's tensors and nothing is communicated. A tied weight is read once,
    by its first owner. A model built whole (a grown vocabulary outside ZeRO-3) is read in place the same way.
    Returns the number of modules loaded."""
    seen: set[int] = set()
    done = 0
    for name, module in model.named_modules():
        params = list(module.parameters(recurse=False))
        if params and all(id(p) in seen for p in params):
            continue  # a tied head: its weight came with the embedding
        seen.update(id(p) for p in params)
        if not params and not module._buffers:
            continue
        with zero3_local(params) if params and hasattr(params[0], "ds_tensor") else contextlib.nullcontext():
            weights.load_own(module, name)
        done += 1
    return done
