"""Generation, in gpt-fast's reading shape with vLLM's continuous batching: :class:`Sampler` is the entry;
:mod:`.prefill`, :mod:`.decode` (one step), :mod:`.scheduler` (refill and compaction), :mod:`.draft`
(prompt-lookup drafting) and :mod:`.static` (static cache and CUDA graphs) each read alone. Greedy output is
HF ``generate``'s: the same model, the same argmax; a token can differ only at a near-tie that floating-point
reordering separates (``bench/bench_generate.py`` counts them). Each lever is measured in bench/README.md
(``make bench-generate``). vLLM is not a dependency and is not used.
"""

from ultrascale.generate.output import Completion, GenerationStats
from ultrascale.generate.sampler import ADD_SPECIAL_TOKENS, Sampler
from ultrascale.generate.sampling import SamplingParams

__all__ = ["ADD_SPECIAL_TOKENS", "Completion", "GenerationStats", "Sampler", "SamplingParams"]
