"""The :class:`Sampler`: one generation entry for every place the project generates code (HumanEval in
``eval.py`` and during training, SSD's sampling stage). It decides once how to run (autocast, static cache,
graphs), switches the model to the decoding attention, and hands the prompts to one of two schedulers: the
dynamic path (:func:`~ultrascale.generate.scheduler.run_dynamic`) or the static one
(:class:`~ultrascale.generate.static.StaticDecoder`)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

import torch

from ultrascale.generate.attention import decode_attention, decode_attention_fits
from ultrascale.generate.forward import LM
from ultrascale.generate.output import Completion, GenerationStats
from ultrascale.generate.rows import Collector
from ultrascale.generate.sampling import SamplingParams
from ultrascale.generate.scheduler import run_dynamic
from ultrascale.generate.static import StaticDecoder
from ultrascale.levers.decide import decide_autocast, decide_static

ADD_SPECIAL_TOKENS = False
"""How prompts are tokenized, here and on HF's side of ``bench/bench_generate.py``."""


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
        self.model, self.tokenizer, self.batch_size = model, tokenizer, int(batch_size)
        self.draft, self.draft_budget, self.prefill_tokens = int(draft), int(draft_budget), int(prefill_tokens)
        """Prompt-lookup drafting (greedy only): up to ``draft`` tokens per row, verified in one forward; rows x
        (1 + drafts) stays within ``draft_budget`` positions (:func:`~ultrascale.generate.draft.draft_step`). 0:
        off. Prefill groups stay within ``prefill_tokens`` positions."""
        self.refill_at = refill_at
        """Refill when the rows in flight drop below this share of ``batch_size``."""
        self.autocast, self.autocast_why = decide_autocast(model, autocast)
        """``(device_type, dtype)`` to run the forward under ``torch.autocast``, or None, and why."""
        eos = model.generation_config.eos_token_id if getattr(model, "generation_config", None) else None
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos = set(eos if isinstance(eos, list | tuple) else [eos]) - {None}
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(self.eos), 0)
        self.lm = LM(model, self.pad, self.autocast)
        self.stats = GenerationStats()
        on, graphs, self._static_why = decide_static(
            self.lm.device, static, self.lm.head is not None, decode_attention_fits(model)
        )
        self.static_decoder = StaticDecoder(self.lm, graphs, self._static_why, sync_every) if on else None
        """The static KV cache and CUDA graphs for decoding steps; None: the dynamic path."""

    @property
    def static(self) -> bool:
        return self.static_decoder is not None

    @property
    def graphs(self) -> bool:
        return self.static_decoder is not None and self.static_decoder.graphs

    @property
    def static_why(self) -> str:
        return self.static_decoder.why if self.static_decoder is not None else self._static_why

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
        stops = [tuple(params.stop) + tuple(extra_stops[i] if extra_stops else ()) for i in range(len(prompts))]
        with decode_attention(self.model):
            return self._generate(prompts, params, progress, stops)

    def encode(self, prompt: str) -> list[int]:
        """A prompt's token ids as the sampler feeds them: no special tokens (a BOS the model was not trained to
        see mid-file would change every completion; the bench tokenizes HF's side the same way)."""
        return self.tokenizer(prompt, add_special_tokens=ADD_SPECIAL_TOKENS)["input_ids"] or [self.pad]

    def _generate(self, prompts: Sequence[str], params: SamplingParams, progress: bool,
                  stops: list[tuple[str, ...]]) -> list[list[Completion]]:  # fmt: skip
        from tqdm import tqdm

        t0 = time.perf_counter()
        self.model.eval()
        ids = [self.encode(p) for p in prompts]
        pending = deque(sorted(range(len(prompts)), key=lambda i: len(ids[i])))  # similar lengths prefill together
        cap = max(self.batch_size, params.n)
        st = self.stats = GenerationStats(prompts=len(prompts), capacity=cap)
        bar = tqdm(total=len(prompts), desc="generate", unit="prompt", disable=not progress, mininterval=2.0)
        collect = Collector(self.tokenizer, self.eos, stops, params, st, bar, t0)
        if self.static_decoder is not None:
            self.static_decoder.run(ids, pending, params, collect, cap, self.refill_at, self.prefill_tokens)
        else:
            run_dynamic(self.lm, ids, pending, params, collect, cap, self.refill_at, self.prefill_tokens,
                        self.draft, self.draft_budget)  # fmt: skip
        bar.close()
        st.completions = sum(len(r) for r in collect.results)
        st.seconds = time.perf_counter() - t0
        return collect.results  # type: ignore[return-value]
