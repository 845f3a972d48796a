"""Ulysses sequence parallelism for stock HF models (DeepSpeed's ALST integration).

Each rank of an sp group holds s/sp consecutive tokens of the same samples. Inside attention DeepSpeed's
``UlyssesSPAttentionHF`` all-to-alls from "my tokens, all heads" to "all tokens, my heads", runs the
model's own attention kernel, and all-to-alls back; everything else (MLP, norms, the LM head) is
token-local. So activation memory per rank falls by sp while the model code stays untouched.

The loss is the piece HF cannot do for us: with only a shard of tokens, a rank's mean cross-entropy is
not the sample's. Each rank computes its shard's *sum*; the sp group all-reduces sums and token counts,
which gives exactly the full-sequence mean to log, so sp=2 reproduces the sp=1 run (see ``sp_loss`` for
what is backpropagated).
"""

from __future__ import annotations

import torch
import torch.distributed as tdist
import torch.nn.functional as F

from ultrascale.config.topology import Topology


def enable_ulysses(model, attn_implementation: str, sp: int, micro_batch: int, seq_len: int):
    """Swap the model's attention for the Ulysses wrapper; returns the mpu for ``deepspeed.initialize``.

    The sp groups are consecutive ranks (rank // sp is the data-parallel index): see ``dp_rank``.
    """
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    return UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model,
        core_attn_implementation=attn_implementation,
        sequence_parallel_size=sp,
        micro_batch_size=micro_batch,
        seq_length=seq_len,
        seq_length_is_variable=False,  # packed shards: every batch is exactly seq_len
    )


def dp_rank(rank: int, topo: Topology) -> int:
    """Data-parallel index of a global rank: ranks of one sp group read the same samples."""
    return rank // topo.sp


def sp_group():
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    return parallel_state_sp.get_sequence_parallel_group()


def shard(batch, sp: int, sp_rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids, position ids, next-token labels) of this rank's s/sp slice of a ``Batch``.

    Labels are shifted on the *full* sequence before slicing, so the token at a shard boundary is still
    predicted (by the previous shard's last position); the final position has no target (-100). Position
    ids come from the batch (they restart at document boundaries when document masking is on), because
    Ulysses all-gathers them to rebuild the full sequence's rotary positions.
    """
    ids = batch.input_ids
    b, s = ids.shape
    labels = F.pad(batch.labels[:, 1:], (0, 1), value=-100)
    pos = batch.position_ids
    if pos is None:
        pos = torch.arange(s, device=ids.device).unsqueeze(0).expand(b, -1)
    chunk = s // sp
    sl = slice(sp_rank * chunk, (sp_rank + 1) * chunk)
    return ids[:, sl].contiguous(), pos[:, sl].contiguous(), labels[:, sl].contiguous()


def sp_loss(engine, batch, group, sp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss to backpropagate, full-sequence mean loss to log) from this rank's shard.

    DeepSpeed reduces gradients over data-parallel replicas by *averaging* but over the sp ranks of a
    replica by *summing* (ZeRO divides by dp, not dp*sp). So each rank backpropagates only its own share,
    shard_sum / total_tokens: the sp ranks' gradients then add up to the gradient of the full-sequence mean.
    (A differentiable all-gather of the shard losses would count every shard sp times.)
    """
    local_ids, pos, labels = shard(batch, sp, tdist.get_rank(group))
    logits = engine(input_ids=local_ids, position_ids=pos).logits
    loss_sum = F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
    totals = torch.stack([loss_sum.detach(), (labels != -100).sum().to(loss_sum.dtype)])
    tdist.all_reduce(totals, group=group)
    return loss_sum / totals[1], totals[0] / totals[1]
