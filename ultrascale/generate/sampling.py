"""How a row's next token is drawn: temperature, top-k, top-p in HF's order, then argmax (greedy) or a
Gumbel-max draw whose noise is a hash of (seed, prompt, sample, step, token). A sample depends on nothing that
shared its batch, and no probability leaves the device."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """What to sample. ``temperature`` 0 is greedy decoding; ``top_k`` 0 and ``top_p`` 1 turn those filters off."""

    n: int = 1
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    seed: int = 1234
    logprobs: bool = False
    """Return each sampled token's log-prob under ``logits / temperature`` (the full distribution, before top-k/p:
    what a policy-gradient loss scores, as TRL does) in ``Completion.logps``."""

    def __post_init__(self) -> None:
        if self.n < 1 or self.max_new_tokens < 1:
            raise ValueError(f"n={self.n} and max_new_tokens={self.max_new_tokens} must be at least 1")
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                f"temperature={self.temperature} >= 0, top_k={self.top_k} >= 0, 0 < top_p={self.top_p} <= 1"
            )
        if self.greedy and self.n > 1:
            raise ValueError("greedy decoding gives n identical samples: use n=1 or temperature > 0")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def process_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus), in HF's order and with its rules (top-p keeps at least one
    token, and keeps a token whose exclusion would drop the kept mass below ``top_p``). [rows, vocab] fp32."""
    scores = logits / temperature if temperature > 0 else logits
    if top_k:
        kth = torch.topk(scores, min(top_k, scores.shape[-1]), dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False, dim=-1)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - top_p)
        drop[..., -1:] = False
        scores = scores.masked_fill(drop.scatter(-1, order, drop), -math.inf)
    return scores


_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash finalizer (xor-shift, multiply, twice) in int64 arithmetic: inputs below 2^32 times a
    constant below 2^27 never overflow, so CPU and GPU give the same bits."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def row_key(seed: int, prompt: int, sample: int) -> int:
    """The 32-bit key of one sample's noise: a sample depends on (seed, prompt, sample) only."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{prompt}/{sample}".encode(), digest_size=4).digest(), "little")


def gumbel_noise(keys: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] standard Gumbel noise, a pure function of (row key, step, token id): counter-based like
    Philox, so no generator state lives anywhere, a CUDA graph can hold it, and a row's draw does not depend on
    which rows shared its step. 24-bit uniforms, as ``torch.rand`` draws float32."""
    row = _mix32((keys + steps * 0x9E3779B1) & _M32)
    tokens = _mix32(torch.arange(vocab, device=keys.device, dtype=torch.long))
    h = _mix32(row[:, None] ^ tokens[None, :])
    u = ((h >> 8).to(torch.float32) + 0.5) * 2.0**-24
    return -torch.log(-torch.log(u))


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, keys: torch.Tensor | None, steps: torch.Tensor | None
) -> torch.Tensor:
    """One token per row, on the logits' device: the argmax (greedy), or the Gumbel-max draw from the processed
    distribution (argmax of scores + Gumbel noise is an exact sample of softmax(scores)). No host round trip."""
    if params.greedy:
        return logits.argmax(dim=-1)
    scores = process_logits(logits, params.temperature, params.top_k, params.top_p)
    return (scores + gumbel_noise(keys, steps, scores.shape[-1])).argmax(dim=-1)


def pick_logps(logits: torch.Tensor, picks: torch.Tensor, params: SamplingParams) -> torch.Tensor | None:
    """The log-prob of each row's pick under ``logits / temperature`` (1 when greedy), fp32; None unless
    ``params.logprobs``."""
    if not params.logprobs:
        return None
    scale = params.temperature if params.temperature > 0 else 1.0
    return torch.log_softmax(logits.float() / scale, dim=-1).gather(-1, picks[:, None]).squeeze(-1)


def pick_tokens(logits: torch.Tensor, rows: Sequence, params: SamplingParams, pad: int) -> torch.Tensor:
    """The next token of every :class:`~ultrascale.generate.rows.Row` of a batch, drawn on the device
    (:func:`sample_tokens`, each row's noise keyed by its sample and step); finished rows get ``pad``."""
    keys = steps = None
    if not params.greedy:
        keys = torch.tensor([row.key for row in rows], device=logits.device)
        steps = torch.tensor([len(row.tokens) for row in rows], device=logits.device)
    picks = sample_tokens(logits, params, keys, steps)
    dead = [r for r, row in enumerate(rows) if row.done]
    if dead:
        picks[dead] = pad
    return picks
