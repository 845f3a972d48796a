"""Completions as the policy's forward reads them: each row its prompt's ids then the sampler's ids (``Completion.ids``,
never re-tokenized text), right-padded, and the flat positions whose next token is a completion token.

Right padding with no position offsets gives each row the positions it had when it was sampled (prompt from 0, no
left padding), so the forward's log-probs are those of the sampling run, token for token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ultrascale.train.grpo.loss import token_logps


@dataclass
class Packed:
    input_ids: torch.Tensor
    """[rows, longest prompt + completion], right-padded."""
    attention_mask: torch.Tensor
    where: torch.Tensor
    """[rows, width - 1] bool: position t predicts a completion token (input_ids[:, t + 1])."""
    targets: torch.Tensor
    """[tokens]: the completion tokens, row-major (the order of ``where``'s True entries)."""
    rows: torch.Tensor
    """[tokens]: the row (0..rows-1) each target belongs to."""

    def to(self, device: torch.device | str) -> Packed:
        return Packed(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.where, self.targets,
                                                 self.rows)))  # fmt: skip


def pack(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad: int) -> Packed:
    """One row per (prompt ids, completion ids) pair; a completion must have at least one token."""
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    n = len(prompts)
    ids = torch.full((n, width), pad, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    where = torch.zeros((n, width - 1), dtype=torch.bool)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, : len(p) + len(c)] = torch.tensor([*p, *c], dtype=torch.long)
        mask[i, : len(p) + len(c)] = 1
        where[i, len(p) - 1 : len(p) + len(c) - 1] = True
    rows = torch.arange(n)[:, None].expand(n, width - 1)[where]
    return Packed(ids, mask, where, ids[:, 1:][where], rows)


def completion_logps(forward: Callable[..., torch.Tensor], packed: Packed, temperature: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(log-probs, entropies) of every completion token, flat, under ``logits / temperature``. ``forward(input_ids,
    attention_mask)`` returns the logits [rows, width, vocab] (the engine, the bare module, the reference)."""
    logits = forward(input_ids=packed.input_ids, attention_mask=packed.attention_mask)
    return token_logps(logits[:, :-1][packed.where], packed.targets, temperature)
