"""Do the data-parallel replicas hold the same model? A cheap end-of-run invariant check.

Replicas drifting apart (a non-deterministic op, a rank skipping a step, a bad reduce) is silent in the
loss curve until it is not. Each rank hashes its full parameters (ZeRO-3 gathers one tensor at a time,
so memory stays at one layer) and the data-parallel group compares the digests.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as tdist

from ultrascale.runtime.device import coll_tensor


def param_digest(module: torch.nn.Module, trainable: bool | None = None) -> str:
    """Digest of the replicated parameters (ZeRO-3 partitions gathered). Expert-parallel experts differ per
    rank by design: skipped. ``trainable``: only the parameters that train (True) or only the frozen ones (False:
    ``finetune=lora``'s base, which must come out of a run bit for bit as it went in)."""
    from deepspeed.moe.utils import is_moe_param

    h = hashlib.sha1()
    for name, p in module.named_parameters():
        if is_moe_param(p) or (trainable is not None and p.requires_grad != trainable):
            continue
        if hasattr(p, "ds_id"):  # a ZeRO-3 partition
            import deepspeed

            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                data = p.detach().float().cpu().contiguous()
        else:
            data = p.detach().float().cpu().contiguous()
        h.update(name.encode())
        h.update(data.numpy().tobytes())
    return h.hexdigest()[:16]


def replicas_agree(module: torch.nn.Module, group=None) -> tuple[bool, list[str], list[list[int]]]:
    """(every data-parallel group agrees, this rank's group's digests, every group's global ranks).
    Collective over the world.

    Each rank compares its digest within ``group`` (its data-parallel replicas: under pp or tp those are
    the ranks holding the same stage or shard), and the verdicts are all-reduced, so the answer covers every
    group, not only rank 0's. The groups come back too, because a group of one agrees with itself: a
    reader of the verdict can check that each group had the ``dp`` members it should.
    """
    digest = param_digest(module)
    if not tdist.is_initialized() or tdist.get_world_size() == 1:
        return True, [digest], [[0]]
    digests: list[str] = [""] * tdist.get_world_size(group)
    tdist.all_gather_object(digests, digest, group=group)
    agree = coll_tensor([int(all(d == digests[0] for d in digests))])
    tdist.all_reduce(agree, op=tdist.ReduceOp.MIN)
    mine = sorted(tdist.get_process_group_ranks(group)) if group is not None else list(range(tdist.get_world_size()))
    every: list = [None] * tdist.get_world_size()
    tdist.all_gather_object(every, mine)
    return bool(agree.item()), digests, [list(g) for g in sorted({tuple(g) for g in every})]
