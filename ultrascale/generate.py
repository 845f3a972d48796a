"""One sampler for every place the project generates code: HumanEval (``eval.py`` and during training) and the
sampling stage of self-distillation.

Plain batched HF ``generate`` spends most of a CPU's time where the work is not: it re-decodes every row at
every step to look for stop strings, re-allocates the KV cache at every step (``torch.cat`` of every layer's
keys and values), prefills each of the n samples of a prompt separately, pads a batch to its longest prompt,
and keeps a finished row in the batch until the whole batch is done. This sampler, in the shape of gpt-fast:

- **prefill once per prompt**: the n samples of a prompt share its prefill; their KV rows are copies;
- **a KV cache that is written in place**: each layer's keys and values live in a buffer sized for the batch's
  longest possible sequence, written at the next position every step (:class:`SlotLayer`);
- **continuous batching**: a row that finishes (stop sequence, EOS, length) leaves the batch at once, and new
  prompts, prefilled together, take the free slots; prompts are taken in length order so a prefill group and
  the cache columns are mostly real tokens, and columns no row needs any more are cut off;
- **stop checks on the new text of unfinished rows only**;
- **sampling as HF applies it**: temperature, then top-k, then top-p, from a generator per sample seeded by
  (seed, prompt, sample), so a sample does not depend on what else shared its batch.

Greedy output is HF ``generate``'s: the same model forward, the same argmax. A token can differ only where two
candidates' logits are closer than floating-point reordering (another batch composition, another padding) can
separate: ``bench/bench_generate.py`` counts those near-ties.

On CUDA the same code runs on the model's device. vLLM is a faster engine there; it is not a dependency and is
not used here.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DynamicLayer

log = logging.getLogger("ultrascale")


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
                f"filled {100 * self.batch_fill:.0f} %, padding {100 * self.pad_share:.1f} % of the positions processed")  # fmt: skip


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


class SlotLayer(DynamicLayer):
    """One layer's keys and values for the rows in flight, written in place into a buffer that already has room for
    every token the batch can still generate (HF's ``DynamicLayer`` concatenates, re-allocating the whole cache at
    every step). ``keys``/``values`` are views of the filled part."""

    def __init__(self) -> None:
        super().__init__()
        self.k_buf: torch.Tensor | None = None
        self.v_buf: torch.Tensor | None = None
        self.length = 0
        self.room = 0

    def reserve(self, room: int) -> None:
        """Make sure ``room`` more positions fit (set before a prefill or a merge)."""
        self.room = room

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        end = self.length + q
        if self.k_buf is None or end > self.k_buf.shape[-2] or self.k_buf.shape[0] != key_states.shape[0]:
            cap = end + max(self.room, 1)
            k = key_states.new_empty((*key_states.shape[:2], cap, key_states.shape[-1]))
            v = value_states.new_empty((*value_states.shape[:2], cap, value_states.shape[-1]))
            if self.k_buf is not None and self.length:
                k[:, :, : self.length] = self.k_buf[:, :, : self.length]
                v[:, :, : self.length] = self.v_buf[:, :, : self.length]
            self.k_buf, self.v_buf = k, v
        self.k_buf[:, :, self.length : end] = key_states
        self.v_buf[:, :, self.length : end] = value_states
        self.length = end
        self.keys, self.values = self.k_buf[:, :, :end], self.v_buf[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def rebuild(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Replace the contents with ``k``/``v`` [rows, heads, length, dim], keeping ``room`` free positions."""
        n = k.shape[-2]
        self.k_buf = k.new_empty((*k.shape[:2], n + max(self.room, 1), k.shape[-1]))
        self.v_buf = v.new_empty((*v.shape[:2], n + max(self.room, 1), v.shape[-1]))
        self.k_buf[:, :, :n], self.v_buf[:, :, :n] = k, v
        self.length = n
        self.keys, self.values = self.k_buf[:, :, :n], self.v_buf[:, :, :n]
        self.is_initialized = True


def new_cache(layers: int) -> Cache:
    return Cache(layers=[SlotLayer() for _ in range(layers)])


@dataclass
class _Row:
    prompt: int
    sample: int
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    checked: int = 0
    """Characters of the decoded text already searched for stop sequences."""
    done: bool = False


class Sampler:
    """Generation for a causal LM and its tokenizer: ``batch_size`` rows in flight (the KV cache holds them and the
    weights are read once per step for all of them), refilled as rows finish."""

    def __init__(self, model, tokenizer, batch_size: int = 32, refill_at: float = 0.75, autocast: str = "none"):
        self.model, self.tokenizer, self.batch_size = model, tokenizer, int(batch_size)
        self.refill_at = refill_at
        """Refill when the rows in flight drop below this share of ``batch_size`` (a prefill is a rebuild of the
        cache: doing it for every single free slot would cost more than the slot is worth)."""
        self.autocast, self.autocast_why = decide_autocast(model, autocast)
        """``(device_type, dtype)`` to run the forward under ``torch.autocast``, or None, and why."""
        cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        self.layers = int(cfg.num_hidden_layers)
        eos = model.generation_config.eos_token_id if getattr(model, "generation_config", None) else None
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos = set(eos if isinstance(eos, list | tuple) else [eos]) - {None}
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(self.eos), 0)
        self.device = next(model.parameters()).device
        self.stats = GenerationStats()

    # ---- the model ---------------------------------------------------------------------------------------------
    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Cache) -> torch.Tensor:
        ctx = torch.autocast(*self.autocast) if self.autocast else _null()
        with ctx:
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                             use_cache=True, logits_to_keep=1)  # fmt: skip
        return out.logits[:, -1, :].float()

    # ---- one call --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self, prompts: Sequence[str], params: SamplingParams, progress: bool = False
    ) -> list[list[Completion]]:
        """``params.n`` completions for each prompt, in prompt order."""
        from tqdm import tqdm

        t0 = self._t0 = time.perf_counter()
        self.model.eval()
        ids = [self.tokenizer(p, add_special_tokens=False)["input_ids"] or [self.pad] for p in prompts]
        pending = deque(sorted(range(len(prompts)), key=lambda i: len(ids[i])))  # similar lengths prefill together
        results: list[list[Completion | None]] = [[None] * params.n for _ in prompts]
        cap = max(self.batch_size, params.n)
        st = self.stats = GenerationStats(prompts=len(prompts), capacity=cap)
        bar = tqdm(total=len(prompts), desc="generate", unit="prompt", disable=not progress, mininterval=2.0)
        left = {i: params.n for i in range(len(prompts))}
        batch: _Batch | None = None
        while pending or (batch is not None and batch.alive()):
            alive = batch.alive() if batch is not None else 0
            if pending and alive <= self.refill_at * cap:  # free slots: prefill the next prompts into them
                new = self._prefill(self._take(pending, cap - alive, params.n), ids, params)
                self._advance(new, new.last, params, results, left, bar)
                batch = self._merge(batch, new, params)
                continue
            if batch.dead() * 4 > len(batch.rows):  # finished rows cost compute: let them go
                batch = self._compact(batch, params)
            self._step(batch, params, results, left, bar)
        bar.close()
        st.completions = sum(len(r) for r in results)
        st.seconds = time.perf_counter() - t0
        return results  # type: ignore[return-value]

    def _step(self, b: _Batch, params: SamplingParams, results, left, bar) -> None:
        """One decode step for every row of the batch (finished rows are fed a pad token until compaction)."""
        st = self.stats
        st.decode_steps += 1
        st.row_steps += b.alive()
        st.cache_cells += b.mask.numel()
        st.cache_pad += int((b.mask == 0).sum())
        b.mask = torch.cat([b.mask, b.mask.new_ones(len(b.rows), 1)], dim=1)
        logits = self._forward(b.last[:, None], b.mask, b.pos[:, None], b.cache)
        b.pos = b.pos + 1
        b.last = self._pick(logits, b.rows, params)
        self._advance(b, b.last, params, results, left, bar)

    def _take(self, pending: deque, slots: int, n: int) -> list[int]:
        """The next prompts (in length order) whose n samples fit the free slots (at least one prompt)."""
        group = [pending.popleft()]
        while pending and (len(group) + 1) * n <= slots:
            group.append(pending.popleft())
        return group

    def _prefill(self, group: list[int], ids: list[list[int]], params: SamplingParams) -> _Batch:
        """Prefill ``group``'s prompts together (left-padded), once per prompt; then one row per sample, each with
        the first token drawn from the prefill's logits."""
        st, t0 = self.stats, time.perf_counter()
        longest = max(len(ids[i]) for i in group)
        tokens = torch.full((len(group), longest), self.pad, dtype=torch.long)
        mask = torch.zeros((len(group), longest), dtype=torch.long)
        for r, i in enumerate(group):
            tokens[r, longest - len(ids[i]) :] = torch.tensor(ids[i])
            mask[r, longest - len(ids[i]) :] = 1
        tokens, mask = tokens.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = new_cache(self.layers)
        for layer in cache.layers:
            layer.reserve(params.max_new_tokens + 1)
        logits = self._forward(tokens, mask, pos, cache)
        st.prefill_tokens += tokens.numel()
        st.prefill_pad += int((mask == 0).sum())
        if params.n > 1:  # the samples of a prompt share its prefill: copy its rows, not its compute
            rep = torch.arange(len(group), device=self.device).repeat_interleave(params.n)
            for layer in cache.layers:
                layer.rebuild(layer.keys[rep], layer.values[rep])
            mask, pos, logits = mask[rep], pos[rep], logits[rep]
        rows = [_Row(i, s, self._generator(params, i, s)) for i in group for s in range(params.n)]
        b = _Batch(cache, mask, pos[:, -1] + 1, None, rows)
        b.last = self._pick(logits, rows, params)
        st.prefill_s += time.perf_counter() - t0
        return b

    @staticmethod
    def _generator(params: SamplingParams, prompt: int, sample: int) -> torch.Generator | None:
        if params.greedy:
            return None
        g = torch.Generator()
        g.manual_seed((params.seed * 1_000_003 + prompt) * 1_009 + sample)
        return g

    def _pick(self, logits: torch.Tensor, rows: list[_Row], params: SamplingParams) -> torch.Tensor:
        """The next token of every row: the argmax (greedy), or a draw from the processed distribution with the
        row's own generator (finished rows get a pad token)."""
        if params.greedy:
            picks = logits.argmax(dim=-1)
        else:
            probs = process_logits(logits, params.temperature, params.top_k, params.top_p).softmax(dim=-1).cpu()
            picks = torch.tensor([int(torch.multinomial(probs[r], 1, generator=row.generator)) if not row.done
                                  else self.pad for r, row in enumerate(rows)], device=logits.device)  # fmt: skip
        dead = [r for r, row in enumerate(rows) if row.done]
        if dead:
            picks[dead] = self.pad
        return picks

    def _advance(self, b: _Batch, picks: torch.Tensor, params, results, left, bar) -> None:
        """Append each unfinished row's new token; finish rows on EOS, a stop sequence or the length limit."""
        for row, tok in zip(b.rows, picks.tolist()):
            if row.done:
                continue
            row.tokens.append(tok)
            finish, text = None, None
            if tok in self.eos:
                finish, text = "eos", self._decode(row.tokens[:-1])
            elif params.stop:
                text = self._decode(row.tokens)
                start = max(0, row.checked - max(len(s) for s in params.stop) + 1)
                hits = [i for i in (text.find(s, start) for s in params.stop) if i >= 0]
                if hits:
                    finish, text = "stop", text[: min(hits)]
                row.checked = len(text)
            if finish is None and len(row.tokens) >= params.max_new_tokens:
                finish, text = "length", text if text is not None else self._decode(row.tokens)
            if finish is not None:
                row.done = True
                results[row.prompt][row.sample] = Completion(text, len(row.tokens), finish, tuple(row.tokens))
                self.stats.tokens += len(row.tokens)
                left[row.prompt] -= 1
                if not left[row.prompt]:
                    bar.update(1)
                    bar.set_postfix(tok_s=f"{self.stats.tokens / max(time.perf_counter() - self._t0, 1e-9):.0f}")

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    # ---- the batch -----------------------------------------------------------------------------------------------
    def _compact(self, b: _Batch, params: SamplingParams) -> _Batch | None:
        """Only the unfinished rows stay; key columns none of them attends to (left padding) are cut off."""
        keep = [r for r, row in enumerate(b.rows) if not row.done]
        if not keep:
            return None
        idx = torch.tensor(keep, device=self.device)
        mask = b.mask[idx]
        first = int(mask.any(dim=0).nonzero()[0])  # the first column a remaining row attends to
        for layer in b.cache.layers:
            layer.reserve(params.max_new_tokens + 1)
            layer.rebuild(layer.keys[idx, :, first:], layer.values[idx, :, first:])
        return _Batch(b.cache, mask[:, first:], b.pos[idx], b.last[idx], [b.rows[r] for r in keep])

    def _merge(self, cur: _Batch | None, new: _Batch, params: SamplingParams) -> _Batch | None:
        """The unfinished rows in flight and of a freshly prefilled group as one batch: the shorter side's keys are
        left-padded (masked) to the longer's length. One rebuild of the cache."""
        cur = self._compact(cur, params) if cur is not None else None
        new = self._compact(new, params) if any(r.done for r in new.rows) else new
        if cur is None or new is None:
            return cur or new
        a, b = cur.mask.shape[1], new.mask.shape[1]
        width = max(a, b)

        def padded(t: torch.Tensor, n: int) -> torch.Tensor:  # [rows, heads, n, dim] -> [rows, heads, width, dim]
            return torch.cat([t.new_zeros((*t.shape[:2], width - n, t.shape[-1])), t], dim=2) if n < width else t

        for layer, other in zip(cur.cache.layers, new.cache.layers):
            layer.reserve(params.max_new_tokens + 1)
            layer.rebuild(torch.cat([padded(layer.keys, a), padded(other.keys, b)]),
                          torch.cat([padded(layer.values, a), padded(other.values, b)]))  # fmt: skip
        pad = torch.nn.functional.pad
        mask = torch.cat([pad(cur.mask, (width - a, 0)), pad(new.mask, (width - b, 0))])
        return _Batch(cur.cache, mask, torch.cat([cur.pos, new.pos]), torch.cat([cur.last, new.last]),
                      cur.rows + new.rows)  # fmt: skip


@dataclass
class _Batch:
    """The rows in flight: their KV cache, attention mask over its columns, next position, last token."""

    cache: Cache
    mask: torch.Tensor
    pos: torch.Tensor
    last: torch.Tensor | None
    rows: list[_Row]

    def alive(self) -> int:
        return sum(not r.done for r in self.rows)

    def dead(self) -> int:
        return sum(r.done for r in self.rows)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def decide_autocast(model, asked: str = "none") -> tuple[tuple[str, torch.dtype] | None, str]:
    """Whether the forward runs under bf16 autocast, decided once as training decides ``precision.autocast``: only
    when asked (``bf16``; it changes greedy tokens against fp32, so it is never the default), and only where the
    hardware computes bf16 natively (a CUDA GPU with bf16, a CPU with AVX-512 BF16 or AMX). (setting, why)."""
    from ultrascale.dist import cpu_bf16_native

    param = next(model.parameters())
    if asked in (None, "none"):
        return None, "off (autocast=none: fp32 decoding, the same tokens as HF generate)"
    if asked != "bf16":
        raise ValueError(f"autocast={asked!r}: choose none or bf16")
    if param.dtype != torch.float32:
        return None, f"off: the weights are already {param.dtype}"
    if param.device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return ("cuda", torch.bfloat16), "bf16 (the GPU computes bf16 natively)"
        return None, "off: this GPU has no native bf16"
    if cpu_bf16_native():
        return ("cpu", torch.bfloat16), "bf16 (this CPU has AVX-512 BF16/AMX)"
    return None, "off: this CPU has no AVX-512 BF16 or AMX (bf16 would be emulated, slower than fp32)"
