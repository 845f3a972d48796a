"""One sampler for every place the project generates code: HumanEval (``eval.py`` and during training) and the
sampling stage of self-distillation.

Plain batched HF ``generate`` spends most of a CPU's time where the work is not: it keeps a finished row in the
batch until the whole batch is done, pads a batch to its longest prompt, prefills each of the n samples of a
prompt separately, concatenates the KV cache into a new tensor at every step, copies every layer's cache to the
query heads' count for SDPA (``repeat_kv``), and (HumanEval's old stopping criterion) re-decodes every row at
every step. This sampler, in the shape of gpt-fast and vLLM's scheduler, measured lever by lever in
bench/README.md (``make bench-generate``):

- **continuous batching**: a row that finishes (stop sequence, EOS, length) leaves the batch, and new prompts
  take the free slots; prompts are taken in length order and prefilled in groups of similar length;
- **prefill once per prompt**: the n samples of a prompt share its prefill; their KV rows are copies;
- **a KV cache written in place** (:class:`SlotLayer`), and **grouped-query attention in the kernel** for
  decoding steps (:func:`decode_attn_forward`);
- **stop checks on the new text of unfinished rows only**;
- **prompt-lookup drafting** (greedy): each row proposes the tokens that followed the last occurrence of its
  latest n-gram in its prompt or completion, one forward verifies them all, and the row keeps the drafted tokens
  greedy decoding would have chosen plus the model's next one. Code repeats its names and lines, so on the
  long-tailed rows that hold a batch open most drafts are kept;
- **sampling as HF applies it, on the device**: temperature, then top-k, then top-p, then a Gumbel-max draw whose
  noise is a hash of (seed, prompt, sample, step, token) (:func:`sample_tokens`): a sample does not depend on
  what else shared its batch, and no probability leaves the device;
- **a static KV cache and CUDA graphs** (:mod:`ultrascale.static_decode`, decided by
  :func:`~ultrascale.static_decode.decide_static`): on a GPU each row owns a slot of a cache allocated once, the
  one-token decoding step is replayed as a captured graph per power-of-two bucket of rows, and the host reads the
  new tokens back once every few steps. On CPU (no launches to save) the dynamic path above is the default.

Greedy output is HF ``generate``'s: the same model, the same argmax. A token can differ only where two
candidates' logits are closer than floating-point reordering (another batch composition, another padding, a
verify-forward of several positions) can separate: ``bench/bench_generate.py`` counts those near-ties.

On CUDA the same code runs on the model's device; the graph capture is the one part CI cannot run (no GPU), its
static step runs eagerly on CPU in the tests. vLLM is not a dependency and is not used.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections import deque
from collections.abc import Sequence
from contextlib import nullcontext
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
    logits: torch.Tensor, params: SamplingParams, keys: torch.Tensor, steps: torch.Tensor
) -> torch.Tensor:
    """One token per row, on the logits' device: the argmax (greedy), or the Gumbel-max draw from the processed
    distribution (argmax of scores + Gumbel noise is an exact sample of softmax(scores)). No host round trip."""
    if params.greedy:
        return logits.argmax(dim=-1)
    scores = process_logits(logits, params.temperature, params.top_k, params.top_p)
    return (scores + gumbel_noise(keys, steps, scores.shape[-1])).argmax(dim=-1)


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
    key: int
    """The sample's noise key (:func:`row_key`); its step is ``len(tokens)``."""
    tokens: list[int] = field(default_factory=list)
    checked: int = 0
    """Characters of the decoded text already searched for stop sequences."""
    done: bool = False
    prompt_ids: list[int] = field(default_factory=list)


class Sampler:
    """Generation for a causal LM and its tokenizer: ``batch_size`` rows in flight (the KV cache holds them and the
    weights are read once per step for all of them), refilled as rows finish."""

    def __init__(
        self,
        model,
        tokenizer,
        batch_size: int = 32,
        refill_at: float = 0.75,
        autocast: str = "none",
        draft: int = 8,
        draft_budget: int = 32,
        prefill_tokens: int = 2048,
        static: str = "auto",
        sync_every: int = 0,
    ):
        from ultrascale.static_decode import SYNC_EVERY_CUDA, decide_static

        self.model, self.tokenizer, self.batch_size = model, tokenizer, int(batch_size)
        self.draft, self.draft_budget, self.prefill_tokens = int(draft), int(draft_budget), int(prefill_tokens)
        """Prompt-lookup drafting (greedy only): up to ``draft`` tokens per row, copied from where the row's last
        n-gram occurred before in its prompt or completion, verified in one forward; rows x (1 + drafts) stays
        within ``draft_budget`` positions, where a forward still costs about what one token does. 0: off."""
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
        self.head = _plain_head(model)
        """(base model, head weight) where the logits are a plain product with the head (no bias, scale or
        softcap) and can be computed here; None: the model's own forward computes them."""
        self.static, self.graphs, self.static_why = decide_static(
            self.device, static, self.head is not None, decode_attention(model).on
        )
        """The static KV cache and CUDA graphs for decoding steps (:mod:`ultrascale.static_decode`), and why."""
        self.sync_every = int(sync_every) or (SYNC_EVERY_CUDA if self.device.type == "cuda" else 1)
        """Static path: decoding steps between host reads of the new tokens (a CPU reads its own memory: 1)."""
        self._slots = None
        self._graphs = None

    # ---- the model ---------------------------------------------------------------------------------------------
    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Cache, keep: int = 1):
        """The logits of the last ``keep`` positions of every row, fp32: [rows, vocab] for keep=1, else
        [rows, keep, vocab]."""
        ctx = torch.autocast(*self.autocast) if self.autocast else nullcontext()
        with ctx:
            if self.head is None:
                out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                                 use_cache=True, logits_to_keep=keep)  # fmt: skip
                logits = out.logits[:, -keep:, :]
            else:
                h = self.head[0](input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                                 use_cache=True).last_hidden_state[:, -keep:, :]  # fmt: skip
                logits = self._head_logits(h.reshape(-1, h.shape[-1])).view(*h.shape[:2], -1)
        logits = logits.float()
        return logits[:, -1, :] if keep == 1 else logits

    def _head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> fp32 [rows, vocab]. W @ h^T rather than h @ W^T: with a few rows, MKL's tall-skinny
        GEMM reads the 49k x 576 head 1.5-1.8x faster than F.linear's (bench/README.md)."""
        return torch.mm(self.head[1], h.t()).t().float()

    # ---- one call --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[str],
        params: SamplingParams,
        progress: bool = False,
        extra_stops: Sequence[Sequence[str]] | None = None,
    ) -> list[list[Completion]]:
        """``params.n`` completions for each prompt, in prompt order. ``extra_stops[i]``: stop sequences for prompt
        i on top of ``params.stop`` (a method's body ends where the class's next member starts)."""
        with decode_attention(self.model):
            self._stops = [
                tuple(params.stop) + tuple(extra_stops[i] if extra_stops else ()) for i in range(len(prompts))
            ]
            return self._generate(prompts, params, progress)

    def encode(self, prompt: str) -> list[int]:
        """A prompt's token ids as the sampler feeds them: no special tokens (a BOS the model was not trained to
        see mid-file would change every completion; the bench tokenizes HF's side the same way)."""
        return self.tokenizer(prompt, add_special_tokens=ADD_SPECIAL_TOKENS)["input_ids"] or [self.pad]

    def _generate(self, prompts: Sequence[str], params: SamplingParams, progress: bool) -> list[list[Completion]]:
        from tqdm import tqdm

        t0 = self._t0 = time.perf_counter()
        self.model.eval()
        ids = [self.encode(p) for p in prompts]
        pending = deque(sorted(range(len(prompts)), key=lambda i: len(ids[i])))  # similar lengths prefill together
        results: list[list[Completion | None]] = [[None] * params.n for _ in prompts]
        cap = max(self.batch_size, params.n)
        st = self.stats = GenerationStats(prompts=len(prompts), capacity=cap)
        bar = tqdm(total=len(prompts), desc="generate", unit="prompt", disable=not progress, mininterval=2.0)
        left = {i: params.n for i in range(len(prompts))}
        if self.static:
            self._generate_static(ids, pending, params, results, left, bar)
            bar.close()
            st.completions = sum(len(r) for r in results)
            st.seconds = time.perf_counter() - t0
            return results  # type: ignore[return-value]
        batch: _Batch | None = None
        while pending or (batch is not None and batch.alive()):
            alive = batch.alive() if batch is not None else 0
            if pending and alive <= self.refill_at * cap:  # free slots: prefill the next prompts into them
                st.refills += int(alive > 0)
                news = []
                for group in self._groups(self._take(pending, cap - alive, params.n), ids):
                    news.append(self._prefill(group, ids, params))
                    self._advance(news[-1], news[-1].last, params, results, left, bar)
                batch = self._merge([batch, *news], params)
                continue
            if batch.dead() * 4 > len(batch.rows) or batch.holes * 2 > batch.mask.shape[1]:
                batch = self._compact(batch, params)  # finished rows and rejected drafts cost compute: drop them
            if not (params.greedy and self.draft and self._draft_step(batch, params, results, left, bar)):
                self._step(batch, params, results, left, bar)
        bar.close()
        st.completions = sum(len(r) for r in results)
        st.seconds = time.perf_counter() - t0
        return results  # type: ignore[return-value]

    # ---- the static path (ultrascale/static_decode.py) ------------------------------------------------------------
    def _static_slots(self, slots: int, width: int):
        """The static cache for ``slots`` rows of ``width`` columns: the one already allocated where it is large
        enough (its captured graphs stay valid), else a new one (and new graphs)."""
        from ultrascale.static_decode import StaticSlots

        if self._slots is None or not self._slots.fits(self.layers, slots, width, self.device):
            self._slots = StaticSlots(self.layers, slots, width, self.device)
            self._graphs = None
        return self._slots

    def _static_step(self, slots, rows: int, width: int) -> torch.Tensor:
        """The logits of one decoding step of the first ``rows`` slots: a CUDA graph's replay, or the same step
        run eagerly over the columns in use. A capture that fails falls back to eager steps, with a warning."""
        if self.graphs:
            from ultrascale.static_decode import DecodeGraphs

            if self._graphs is None:
                ctx = torch.autocast(*self.autocast, cache_enabled=False) if self.autocast else None
                self._graphs = DecodeGraphs(
                    lambda b: slots.forward(self.head[0], self._head_logits, b, slots.width), ctx
                )
            try:
                captured = len(self._graphs.graphs)
                out = self._graphs(rows)
                self.stats.graphs += len(self._graphs.graphs) - captured
                return out
            except RuntimeError as e:  # a kernel or a host read inside HF's forward that a graph cannot hold
                log.warning(f"static decode: CUDA graph capture failed ({str(e).splitlines()[0]}); eager steps")
                self.graphs, self.static_why = False, f"static cache, eager steps (graph capture failed: {e})"
        ctx = torch.autocast(*self.autocast) if self.autocast else nullcontext()
        with ctx:
            return slots.forward(self.head[0], self._head_logits, rows, width)

    def _generate_static(self, ids: list[list[int]], pending: deque, params: SamplingParams, results, left,
                         bar) -> None:  # fmt: skip
        """Decoding over the static cache: rows own slots; a refill prefills the next prompts (eagerly, as
        always) and loads their rows into free slots; once nothing is pending, live rows are compacted into the
        lowest slots whenever that shrinks the bucket the step runs for. The new tokens come back to the host once
        per window of ``sync_every`` steps (never past a row's length limit), where stops are checked."""
        from ultrascale.static_decode import bucket, round_up

        st = self.stats
        cap = max(self.batch_size, params.n)
        width = round_up(max(max(map(len, ids)) + params.max_new_tokens, self.sync_every) + 1, 64)
        slots = self._static_slots(bucket(cap), width)
        slots.free(list(range(slots.slots)))  # a reused cache: no slot keeps a column from the last call
        rows: list[_Row | None] = [None] * slots.slots
        while pending or any(r is not None for r in rows):
            live = [s for s, r in enumerate(rows) if r is not None]
            if pending and len(live) <= min(self.refill_at * cap, cap - params.n):  # a prompt's n rows fit
                st.refills += int(bool(live))
                free = [s for s in range(cap) if rows[s] is None]
                for group in self._groups(self._take(pending, len(free), params.n), ids):
                    b = self._prefill(group, ids, params)
                    self._advance(b, b.last, params, results, left, bar)
                    keep = [r for r, row in enumerate(b.rows) if not row.done]
                    if not keep:
                        continue
                    dst = [free.pop(0) for _ in keep]
                    kept = [b.rows[r] for r in keep]
                    slots.load(dst, b.cache, keep, [len(row.prompt_ids) for row in kept], b.last[keep],
                               [row.key for row in kept], [len(row.tokens) for row in kept])  # fmt: skip
                    for d, row in zip(dst, kept):
                        rows[d] = row
                continue
            if not pending and bucket(len(live)) < bucket(live[-1] + 1):
                slots.move(live, list(range(len(live))))
                rows = [rows[s] for s in live] + [None] * (slots.slots - len(live))
                live = list(range(len(live)))
                st.compactions += 1
            n = bucket(live[-1] + 1)
            window = min(self.sync_every, min(params.max_new_tokens - len(rows[s].tokens) for s in live))
            picks = []
            for _ in range(window):
                cols = slots.width if self.graphs else max(slots.host_lens[:n]) + 1
                logits = self._static_step(slots, n, cols)
                picks.append(sample_tokens(logits, params, slots.keys[:n], slots.steps[:n]))
                st.decode_steps += 1
                st.row_steps += len(live)
                st.buckets[n] = st.buckets.get(n, 0) + 1
                st.cache_cells += n * cols
                st.cache_pad += sum(cols - 1 - slots.host_lens[s] for s in range(n))
                slots.advance(n, picks[-1])
            tokens = torch.stack(picks, dim=1).tolist()  # the window's one read back to the host
            st.host_reads += 1
            for s in live:
                for tok in tokens[s]:
                    if self._advance_row(rows[s], tok, params, results, left, bar):
                        rows[s] = None
                        break
            if dead := [s for s in range(n) if rows[s] is None]:
                slots.free(dead)

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

    def _draft_step(self, b: _Batch, params: SamplingParams, results, left, bar) -> bool:
        """One forward that verifies each row's prompt-lookup draft: the row keeps the drafted tokens up to the
        first one greedy decoding would not have chosen, plus the model's own token after them, so the output is
        greedy decoding's. Rejected drafts stay in the cache as masked columns (holes) until compaction. False
        (nothing done) when no row has a draft or the batch is too full for drafts to pay."""
        alive = b.alive()
        k = min(self.draft, self.draft_budget // max(alive, 1) - 1)
        if k < 1:
            return False
        drafts = [[] if row.done else _lookup(row.prompt_ids, row.tokens, k) for row in b.rows]
        q = 1 + max(len(d) for d in drafts)
        if q == 1:
            return False
        rows, width = len(b.rows), b.mask.shape[1]
        ids = torch.full((rows, q), self.pad, dtype=torch.long)
        new = torch.zeros((rows, q), dtype=b.mask.dtype)
        ids[:, 0], new[:, 0] = b.last.cpu(), 1
        for r, d in enumerate(drafts):
            if d:
                ids[r, 1 : 1 + len(d)] = torch.tensor(d)
                new[r, 1 : 1 + len(d)] = 1
        st = self.stats
        st.decode_steps += 1
        st.row_steps += alive
        st.cache_cells += b.mask.numel() + (q - 1) * rows
        st.cache_pad += int((b.mask == 0).sum())
        b.mask = torch.cat([b.mask, new.to(self.device)], dim=1)
        pos = b.pos[:, None] + torch.arange(q, device=self.device)
        targets = self._forward(ids.to(self.device), b.mask, pos, b.cache, keep=q).argmax(dim=-1).tolist()
        st.host_reads += 1
        step_pos, last = b.pos.tolist(), b.last.tolist()
        for r, (row, d) in enumerate(zip(b.rows, drafts)):
            if row.done:
                step_pos[r] += 1
                continue
            m = next((j for j, tok in enumerate(d) if tok != targets[r][j]), len(d))
            st.drafted += len(d)
            st.accepted += m
            if q - 1 > m:  # the rejected drafts' columns (and a shorter draft's padding) are holes from now on
                b.mask[r, width + 1 + m :] = 0
                b.holes_by_row[r] += q - 1 - m
            step_pos[r] += m + 1
            last[r] = targets[r][m]
            for tok in [*d[:m], targets[r][m]]:
                if self._advance_row(row, tok, params, results, left, bar):
                    break
        b.pos = torch.tensor(step_pos, device=self.device)
        b.last = torch.tensor(last, device=self.device)
        return True

    def _groups(self, prompts: list[int], ids: list[list[int]]) -> list[list[int]]:
        """Prefill groups of prompts in length order, each within ``prefill_tokens`` positions once left-padded
        to its longest: one group of 32 HumanEval prompts of 50 to 500 tokens would be half padding."""
        groups: list[list[int]] = []
        for i in sorted(prompts, key=lambda i: len(ids[i])):
            if groups and (len(groups[-1]) + 1) * len(ids[i]) <= self.prefill_tokens:
                groups[-1].append(i)
            else:
                groups.append([i])
        return groups

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
        rows = [_Row(i, s, row_key(params.seed, i, s), prompt_ids=ids[i]) for i in group for s in range(params.n)]
        b = _Batch(cache, mask, pos[:, -1] + 1, None, rows)
        b.last = self._pick(logits, rows, params)
        st.prefill_s += time.perf_counter() - t0
        return b

    def _pick(self, logits: torch.Tensor, rows: list[_Row], params: SamplingParams) -> torch.Tensor:
        """The next token of every row, drawn on the device (:func:`sample_tokens`; finished rows get a pad)."""
        keys = steps = None
        if not params.greedy:
            keys = torch.tensor([row.key for row in rows], device=logits.device)
            steps = torch.tensor([len(row.tokens) for row in rows], device=logits.device)
        picks = sample_tokens(logits, params, keys, steps)
        dead = [r for r, row in enumerate(rows) if row.done]
        if dead:
            picks[dead] = self.pad
        return picks

    def _advance(self, b: _Batch, picks: torch.Tensor, params, results, left, bar) -> None:
        """Append each unfinished row's new token; finish rows on EOS, a stop sequence or the length limit."""
        self.stats.host_reads += 1
        for row, tok in zip(b.rows, picks.tolist()):
            if not row.done:
                self._advance_row(row, tok, params, results, left, bar)

    def _advance_row(self, row: _Row, tok: int, params, results, left, bar) -> bool:
        """Append ``tok`` to ``row``; True when that finished it."""
        row.tokens.append(tok)
        finish, text = None, None
        if tok in self.eos:
            finish, text = "eos", self._decode(row.tokens[:-1])
        elif stops := self._stops[row.prompt]:
            text = self._decode(row.tokens)
            start = max(0, row.checked - max(len(s) for s in stops) + 1)
            hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
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
        return finish is not None

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    # ---- the batch -----------------------------------------------------------------------------------------------
    def _compact(self, b: _Batch, params: SamplingParams) -> _Batch | None:
        """Only the unfinished rows stay; key columns none of them attends to (left padding) are cut off, and
        rejected drafts' holes squeezed out (each row's kept columns, in order, left-padded to the longest)."""
        keep = [r for r, row in enumerate(b.rows) if not row.done]
        if not keep:
            return None
        self.stats.compactions += 1
        idx = torch.tensor(keep, device=self.device)
        mask = b.mask[idx]
        if any(b.holes_by_row[r] for r in keep):
            counts = mask.sum(dim=1)
            width = int(counts.max())
            # for each row, the kept columns in order, right-aligned: a stable sort puts the masked ones first
            order = torch.sort(mask, dim=1, stable=True).indices[:, -width:]
            for layer in b.cache.layers:
                layer.reserve(params.max_new_tokens + 1)
                gather = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
                layer.rebuild(layer.keys[idx].gather(2, gather), layer.values[idx].gather(2, gather))
            mask = (torch.arange(width, device=self.device)[None, :] >= (width - counts)[:, None]).to(mask.dtype)
            return _Batch(b.cache, mask, b.pos[idx], b.last[idx], [b.rows[r] for r in keep])
        first = int(mask.any(dim=0).nonzero()[0])  # the first column a remaining row attends to
        for layer in b.cache.layers:
            layer.reserve(params.max_new_tokens + 1)
            layer.rebuild(layer.keys[idx, :, first:], layer.values[idx, :, first:])
        return _Batch(b.cache, mask[:, first:], b.pos[idx], b.last[idx], [b.rows[r] for r in keep])

    def _merge(self, batches: list[_Batch | None], params: SamplingParams) -> _Batch | None:
        """The unfinished rows of several batches (the one in flight, freshly prefilled groups) as one batch: each
        side's keys are left-padded (masked) to the longest. One rebuild of the cache."""
        parts = [b if not (b.holes or any(r.done for r in b.rows)) else self._compact(b, params)
                 for b in batches if b is not None]  # fmt: skip
        parts = [b for b in parts if b is not None]
        if len(parts) < 2:
            return parts[0] if parts else None
        width = max(b.mask.shape[1] for b in parts)

        def padded(t: torch.Tensor) -> torch.Tensor:  # [rows, heads, n, dim] -> [rows, heads, width, dim]
            n = t.shape[2]
            return torch.cat([t.new_zeros((*t.shape[:2], width - n, t.shape[-1])), t], dim=2) if n < width else t

        cache = parts[0].cache
        for li, layer in enumerate(cache.layers):
            keys = torch.cat([padded(b.cache.layers[li].keys) for b in parts])
            values = torch.cat([padded(b.cache.layers[li].values) for b in parts])
            layer.reserve(params.max_new_tokens + 1)
            layer.rebuild(keys, values)
        pad = torch.nn.functional.pad
        mask = torch.cat([pad(b.mask, (width - b.mask.shape[1], 0)) for b in parts])
        return _Batch(cache, mask, torch.cat([b.pos for b in parts]), torch.cat([b.last for b in parts]),
                      [r for b in parts for r in b.rows])  # fmt: skip


@dataclass
class _Batch:
    """The rows in flight: their KV cache, attention mask over its columns, next position, last token."""

    cache: Cache
    mask: torch.Tensor
    pos: torch.Tensor
    last: torch.Tensor | None
    rows: list[_Row]
    holes_by_row: list[int] = field(default_factory=list)
    """Masked columns left inside each row by rejected drafts."""

    def __post_init__(self) -> None:
        self.holes_by_row = self.holes_by_row or [0] * len(self.rows)

    @property
    def holes(self) -> int:
        return max(self.holes_by_row, default=0)

    def alive(self) -> int:
        return sum(not r.done for r in self.rows)

    def dead(self) -> int:
        return sum(r.done for r in self.rows)


def _plain_head(model) -> tuple[torch.nn.Module, torch.Tensor] | None:
    """The base model and head weight of a causal LM whose logits are ``hidden @ W^T`` and nothing else."""
    from ultrascale.model.attention import CAUSAL_MODEL_TYPES

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    base = getattr(model, "base_model", None)
    if getattr(model.config, "model_type", None) not in CAUSAL_MODEL_TYPES or base is None or base is model:
        return None
    if not isinstance(head, torch.nn.Linear) or head.bias is not None or hasattr(head.weight, "ds_id"):
        return None  # a bias, or a ZeRO-3 partitioned weight that only the module's hooks gather
    return base, head.weight


ADD_SPECIAL_TOKENS = False
"""How prompts are tokenized, here and on HF's side of ``bench/bench_generate.py``."""

DECODE_QUERIES = 16
"""Calls with at most this many new positions per row (decoding, draft verification) take the GQA path."""


def decode_attn_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kw):
    """SDPA with the key/value heads shared in the kernel (``enable_gqa``) for decoding steps. HF's ``sdpa`` copies
    every layer's whole KV cache to the query heads' count (``repeat_kv``) when there is a mask, which is every
    step of a left-padded batch: 3x the cache read and a copy, 20x slower at 8 rows x 400 keys (bench/README.md).
    Prefill (many queries, HF's causal mask) goes to HF's own path."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q = query.shape[2]
    if q > DECODE_QUERIES or (attention_mask is None and q > 1) or kw.get("position_bias") is not None or kw.get("softcap") is not None:  # fmt: skip
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kw)
    gqa = query.shape[1] != key.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                                           enable_gqa=gqa)  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


DECODE_ATTENTION = "ultrascale_decode"


class decode_attention:
    """Switch a causal ``sdpa`` decoder (HF's, or training's blocked one) to :func:`decode_attn_forward` while
    generating, and back afterwards: the in-training eval generates with the model being trained."""

    def __init__(self, model) -> None:
        from ultrascale.model.attention import CAUSAL_MODEL_TYPES

        self.model = model
        self.before = getattr(model.config, "_attn_implementation", None)
        ok = self.before == "sdpa" or str(self.before).startswith("ultrascale_sdpa_blocks")
        self.on = ok and getattr(model.config, "model_type", None) in CAUSAL_MODEL_TYPES

    def __enter__(self):
        if self.on:
            from transformers import AttentionInterface
            from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

            AttentionInterface.register(DECODE_ATTENTION, decode_attn_forward)
            AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)
            self.model.set_attn_implementation(DECODE_ATTENTION)
        return self

    def __exit__(self, *exc):
        if self.on:
            self.model.set_attn_implementation(self.before)
        return False


def _lookup(prompt: list[int], tokens: list[int], k: int, max_ngram: int = 3) -> list[int]:
    """Prompt-lookup drafting (Saxena, 2023; HF's ``prompt_lookup_num_tokens``): the up-to-``k`` tokens that
    followed the most recent earlier occurrence of the sequence's last n-gram (longest n first), in the prompt and
    the completion so far. Code repeats its names and its lines, so the copy is often what the model writes."""
    seq = prompt + tokens
    end = len(seq)
    for n in range(min(max_ngram, end - 1), 0, -1):
        tail = seq[end - n :]
        for start in range(end - n - 1, -1, -1):
            if seq[start : start + n] == tail:
                return seq[start + n : start + n + k]
    return []


def decide_autocast(model, asked: str = "none") -> tuple[tuple[str, torch.dtype] | None, str]:
    """Whether the forward runs under bf16 autocast, decided once as training decides ``precision.autocast``: only
    when asked (``bf16``; it changes greedy tokens against fp32, so it is never the default), and only where the
    hardware computes bf16 natively (a CUDA GPU with bf16, a CPU with AVX-512 BF16 or AMX). (setting, why)."""
    from ultrascale.runtime.cpu import detect

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
    if detect().bf16_native:
        return ("cpu", torch.bfloat16), "bf16 (this CPU has AVX-512 BF16/AMX)"
    return None, "off: this CPU has no AVX-512 BF16 or AMX (bf16 would be emulated, slower than fp32)"
