"""Held-out perplexity on the prepared data's validation split, counted in tokens.

Reported as the total next-token cross-entropy divided by the number of predicted tokens (so runs with
different batch sizes or shard counts compare exactly), and its exponential. Samples are packed and
already shuffled, so the first N samples are a fair, fixed subset when ``max_samples`` is set.
"""

from __future__ import annotations

import math
from os import PathLike

import numpy as np
import torch
import torch.nn.functional as F

from ultrascale.data.shards import open_split
from ultrascale.errors import DataError
from ultrascale.runtime.device import to_device


@torch.no_grad()
def loss_sums(model, input_ids: torch.Tensor) -> tuple[float, int]:
    """Summed next-token NLL (fp32 accumulation) and the number of predicted tokens in one batch."""
    logits = model(input_ids=input_ids).logits
    targets = input_ids[:, 1:]
    nll = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
    return float(nll), targets.numel()


@torch.no_grad()
def perplexity(
    model,
    data_path: str | PathLike,
    *,
    split: str = "validation",
    batch_size: int = 8,
    max_samples: int | None = None,
    shard: tuple[int, int] = (0, 1),
    verify: bool = True,
    progress: bool = False,
) -> dict:
    """``{"loss_per_token", "perplexity", "tokens", "samples"}`` over the split (or this rank's share of it).

    ``progress`` draws a bar over the batches (a 135M model on CPU takes minutes for 256 samples).

    ``shard=(rank, world)`` takes every world-th sample: ranks evaluate disjoint subsets, and summing
    ``loss_sum`` and ``tokens`` over ranks gives the same result as one rank evaluating everything.
    """
    from tqdm import tqdm

    reader = open_split(data_path, split, verify=verify)
    vocab = model.config.vocab_size
    n = len(reader) if max_samples is None else min(max_samples, len(reader))
    rank, world = shard
    indices = np.arange(rank, n, world)
    model.eval()
    device = next(model.parameters()).device  # the batches go where the model is (a GPU when eval.py has one)
    total, tokens = 0.0, 0
    starts = range(0, len(indices), batch_size)
    for i in tqdm(starts, desc="perplexity", unit="batch", mininterval=5.0, disable=not progress):
        ids = torch.from_numpy(reader.get(indices[i : i + batch_size]))
        if int(ids.max()) >= vocab:
            raise DataError(
                f"{data_path} holds token id {int(ids.max())} but the model's vocab_size is {vocab}: "
                "evaluate with the tokenizer/data the model was trained on"
            )
        s, t = loss_sums(model, to_device(ids, device))
        total += s
        tokens += t
    loss = total / max(tokens, 1)
    return {
        "loss_per_token": loss,
        "perplexity": math.exp(loss),
        "loss_sum": total,
        "tokens": tokens,
        "samples": len(indices),
    }


def reduce_across_ranks(result: dict) -> dict:
    """Combine per-rank :func:`perplexity` results (``shard=(rank, world)``) into the global one, on every rank.

    For evaluation inside training: each rank scores its share, then one all-reduce of two numbers.
    A no-op without an initialized process group.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return result
    from ultrascale.runtime.device import coll_tensor

    t = coll_tensor([result["loss_sum"], result["tokens"], result["samples"]], torch.float64)
    dist.all_reduce(t)
    loss = float(t[0]) / max(float(t[1]), 1.0)
    return {
        "loss_per_token": loss,
        "perplexity": math.exp(loss),
        "loss_sum": float(t[0]),
        "tokens": int(t[1]),
        "samples": int(t[2]),
    }
