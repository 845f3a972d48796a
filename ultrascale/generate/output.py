"""What a ``generate`` call hands back: each sample's :class:`Completion`, and the :class:`GenerationStats` that
say where the time and the padding went (``make bench-generate`` and the eval log print its line)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Completion:
    text: str
    """The generated text, cut at the first stop sequence (the stop itself excluded)."""
    tokens: int
    """Tokens generated for it, the one that completed the stop sequence or was EOS included."""
    finish: str
    """Why it ended: ``stop`` (a stop sequence), ``eos`` or ``length`` (``max_new_tokens``)."""
    ids: tuple[int, ...] = ()
    """The generated token ids, as many as ``tokens``."""
    logps: tuple[float, ...] = ()
    """With ``SamplingParams.logprobs``: each id's log-prob under ``logits / temperature`` as it was sampled."""


@dataclass
class GenerationStats:
    prompts: int = 0
    completions: int = 0
    tokens: int = 0
    seconds: float = 0.0
    prefill_s: float = 0.0
    prefill_tokens: int = 0
    prefill_pad: int = 0
    """Padding positions in prefill groups (left padding to the group's longest prompt)."""
    decode_steps: int = 0
    row_steps: int = 0
    """Sum over decode steps of the rows in the batch (what the weights' reads were shared by)."""
    cache_cells: int = 0
    cache_pad: int = 0
    """Key positions attended over in decode steps, and how many of them were padding."""
    capacity: int = 0
    drafted: int = 0
    accepted: int = 0
    """Prompt-lookup draft tokens proposed and accepted (greedy)."""
    refills: int = 0
    """Prefills of new prompts into a batch that still had rows in flight."""
    compactions: int = 0
    """Finished rows (and rejected drafts' columns) squeezed out of the cache, or, on the static path, live rows
    moved into the lowest slots so that a smaller bucket's step serves them."""
    host_reads: int = 0
    """Times the new tokens were read back to the host (once per step, or once per ``sync_every`` steps)."""
    buckets: dict[int, int] = field(default_factory=dict)
    """Static path: decoding steps per bucket (rows the step computes)."""
    graphs: int = 0
    """Static path: CUDA graphs captured (one per bucket used, reused across ``generate`` calls)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def pad_share(self) -> float:
        """Share of the positions the model processed (prefill tokens and attended cache keys) that were padding."""
        total = self.prefill_tokens + self.cache_cells
        return (self.prefill_pad + self.cache_pad) / total if total else 0.0

    @property
    def batch_fill(self) -> float:
        return self.row_steps / (self.decode_steps * self.capacity) if self.decode_steps and self.capacity else 0.0

    def line(self) -> str:
        return (f"generated {self.tokens:,} tokens for {self.completions} completions of {self.prompts} prompts in "
                f"{self.seconds:.1f}s = {self.tokens_per_s:,.1f} tokens/s (prefill {self.prefill_s:.1f}s); batch slots "
                f"filled {100 * self.batch_fill:.0f} %, padding {100 * self.pad_share:.1f} % of the positions processed"
                + (f"; prompt-lookup drafts {self.accepted:,}/{self.drafted:,} accepted" if self.drafted else "")
                + (f"; static cache, steps per bucket {dict(sorted(self.buckets.items()))}, {self.graphs} CUDA "
                   f"graph(s), {self.host_reads} host reads" if self.buckets else ""))  # fmt: skip
