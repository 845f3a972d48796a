"""Typed schema for ``eval.py`` (primary config ``conf/eval.yaml``), registered in Hydra's ConfigStore.

Struct mode makes ``humaneval.limt=5`` fail at compose time with the key's name instead of silently
evaluating all 164 problems.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from hydra.core.config_store import ConfigStore

from ultrascale.config.fields import num
from ultrascale.config.precision import Autocast, Precision
from ultrascale.errors import ConfigError
from ultrascale.eval.infill import InfillBenchmark


class Task(StrEnum):
    perplexity = "perplexity"
    humaneval = "humaneval"
    fim = "fim"
    infill = "infill"


TASKS = tuple(Task)


@dataclass
class PerplexityConfig:
    split: str = "validation"
    """Split of the prepared data to score; ``validation`` is held out from training by data prep."""
    batch_size: int = num(8, ge=1)
    """Samples per forward pass; lower it for long sequences or big vocabularies (logits are [b, s, V])."""
    max_samples: int | None = num(None, ge=1)
    """Score only the first N samples (shuffled at prep time, so a fair subset); None = the whole split."""
    data_path: str | None = None
    """Prepared data directory; defaults to the run's ``data.path``. Required with ``model_dir=``."""


@dataclass
class HumanEvalConfig:
    limit: int | None = num(None, ge=1)
    """Evaluate the first N of the 164 problems (fixed order, so subsets compare across checkpoints)."""
    n_samples: int = num(1, ge=1)
    """Completions per problem. pass@k needs n_samples >= k; n_samples > k lowers the estimator's variance."""
    temperature: float = num(0.0, ge=0)
    """0 = greedy (the standard pass@1); pass@k with k > 1 needs sampling, e.g. 0.8 with n_samples=20."""
    top_p: float = num(0.95, gt=0, le=1)
    """Nucleus sampling cutoff (sampling only)."""
    top_k: int = num(0, ge=0)
    """Keep only the k most likely tokens before top-p (sampling only; 0 = off). Applied as HF does: temperature,
    then top-k, then top-p."""
    autocast: Autocast = Autocast.none
    """``bf16``: decode under bf16 autocast where the hardware computes bf16 natively (off elsewhere, with the
    reason in the log); ``none`` (default) decodes in the weights' dtype, token for token what HF generate gives."""
    draft: int = num(8, ge=0)
    """Greedy only: prompt-lookup draft tokens per row (copied from where the row's last n-gram occurred before
    in its prompt or completion), verified in one forward; the output stays greedy decoding's. 0 = off."""
    k: list[int] = num(default_factory=lambda: [1], ge=1)
    """The k values to report pass@k for; each must be <= n_samples."""
    max_new_tokens: int = num(256, ge=1)
    """Generation budget per completion; stop sequences usually end it far earlier."""
    batch_size: int = num(32, ge=1)
    """Rows the sampler keeps in flight (each prompt's n_samples take n rows; a finished row's slot is refilled):
    the weights are read once per step for all of them (`make bench-generate`)."""
    seed: int = num(1234, ge=0)
    """Seeds sampling, so a pass@k run is reproducible."""
    timeout_s: float = num(10.0, gt=0)
    """Wall-clock limit per test program in the sandbox."""
    memory_mb: int = num(1024, ge=16)
    """Address-space limit per test program."""
    workers: int = num(2, ge=1)
    """Test programs run at once (each in its own sandbox)."""
    heal_newline: bool = True
    """Generate after the prompt without its trailing newline and re-align the completion (what
    bigcode-evaluation-harness does by stripping prompts): tokenizers that merge a newline with the next
    line's indent otherwise read a bare newline as 'the body ends here' (SmolLM2-135M wrote empty bodies)."""


class FimKind(StrEnum):
    single_line = "single_line"
    multi_line = "multi_line"
    random_span = "random_span"


class FimMode(StrEnum):
    psm = "psm"
    spm = "spm"
    l2r = "l2r"


@dataclass
class FimConfig:
    """``tasks=[fim]``: fill-in-the-middle on held-out files (``ultrascale/eval/fim.py``)."""

    data: str | None = None
    """Prepared dataset whose ``repos.json`` names the validation repositories the files come from; defaults to
    the run's ``data.path``. Required with ``model_dir=``."""
    input: str = "stdlib"
    """The corpus ``data`` was prepared from (data prep's ``input``), where the files are read."""
    files: int = num(40, ge=1)
    """Held-out files (a seeded sample); each gives one span of every kind."""
    kinds: list[FimKind] = field(default_factory=lambda: list(FimKind))
    """Which spans: ``single_line``, ``multi_line``, ``random_span``."""
    modes: list[FimMode] = field(default_factory=lambda: [FimMode.psm, FimMode.spm])
    """Prompt orders: ``psm``, ``spm`` (need the tokenizer's FIM tokens), ``l2r`` (the prefix alone: the
    left-to-right baseline any model can be scored on)."""
    max_context_chars: int = num(1000, ge=0)
    """Characters of prefix before and of suffix after the span kept in the prompt."""
    max_lines: int = num(6, ge=2)
    """Longest ``multi_line`` span, in lines."""
    max_span_chars: int = num(120, ge=1)
    """Longest ``random_span``, in characters."""
    max_new_tokens: int = num(96, ge=1)
    """Generation budget per middle (EOS, and a newline for ``single_line``, end it sooner)."""
    batch_size: int = num(16, ge=1)
    """Rows the sampler keeps in flight."""
    seed: int = num(0, ge=0)
    """Seeds the file sample and the spans."""


@dataclass
class InfillConfig:
    """``tasks=[infill]``: HumanEval-Infilling (``ultrascale/eval/infill.py``), scored by execution in the sandbox."""

    benchmark: InfillBenchmark = InfillBenchmark["single-line"]
    """``single-line`` (1,033 tasks), ``multi-line`` (5,815): the FIM paper's sets; ``random-span`` (1,640): ours."""
    mode: FimMode = FimMode.psm
    """``psm``, ``spm`` (the tokenizer's FIM tokens, data prep's layout) or ``l2r`` (the prompt alone, the suffix
    appended: the left-to-right baseline)."""
    limit: int | None = num(None, ge=1)
    """Evaluate the first N tasks (the reference's order: problem by problem), so subsets compare."""
    n_samples: int = num(1, ge=1)
    """Completions per task; pass@k needs n_samples >= k."""
    temperature: float = num(0.0, ge=0)
    """0 = greedy (pass@1); pass@k with k > 1 needs sampling, e.g. 0.8 with n_samples=20."""
    top_p: float = num(0.95, gt=0, le=1)
    """Nucleus sampling cutoff (sampling only)."""
    k: list[int] = num(default_factory=lambda: [1], ge=1)
    """The k values to report pass@k for; each must be <= n_samples."""
    max_new_tokens: int = num(128, ge=1)
    """Generation budget per middle (EOS, a single line's newline, a top-level statement in l2r end it sooner)."""
    batch_size: int = num(16, ge=1)
    """Rows the sampler keeps in flight."""
    seed: int = num(1234, ge=0)
    """Seeds sampling."""
    span_seed: int = num(0, ge=0)
    """``random-span`` only: the seed its spans are drawn with (``python -m ultrascale.eval.infill write --seed``)."""
    timeout_s: float = num(10.0, gt=0)
    """Wall-clock limit per test program in the sandbox."""
    memory_mb: int = num(1024, ge=16)
    """Address-space limit per test program."""
    workers: int = num(2, ge=1)
    """Test programs run at once (each in its own sandbox)."""


@dataclass
class EvalConfig:
    run_dir: str | None = None
    """A training run directory (config.yaml + checkpoints/): evaluates its checkpoint ``step``."""
    step: int | None = num(None, ge=0)
    """Checkpoint step inside run_dir; None = the newest complete one (``checkpoints/latest``)."""
    model_dir: str | None = None
    """Any local HF model directory instead of a run (an export, an imported GGUF, ...)."""
    tokenizer_dir: str | None = None
    """Tokenizer directory; defaults to model_dir, or to the run's prepared-data tokenizer."""
    tasks: list[Task] = field(default_factory=lambda: list(TASKS))
    """Which evaluations to run: any of ``perplexity``, ``humaneval``, ``fim``, ``infill``."""
    output_dir: str | None = None
    """Where eval_results.json goes; defaults to ``<run_dir>/eval/<tag>`` or ``<model_dir>/eval``."""
    dtype: Precision = Precision.fp32
    """Evaluation precision: fp32 (exact, CPU-friendly), bf16 or fp16."""
    device: str = "auto"
    """Where the model runs: ``auto`` (this process's GPU when it has one, ``cuda:LOCAL_RANK``; else the CPU),
    ``cpu``, ``cuda`` or ``cuda:N``. A GPU node evaluates on its GPU without being told."""
    wandb: bool = True
    """Log the results to the run's wandb run (same id as training, offline unless configured)."""
    perplexity: PerplexityConfig = field(default_factory=PerplexityConfig)
    humaneval: HumanEvalConfig = field(default_factory=HumanEvalConfig)
    fim: FimConfig = field(default_factory=FimConfig)
    infill: InfillConfig = field(default_factory=InfillConfig)


def check(cfg: EvalConfig) -> None:
    """The rules between eval's keys, each failing with the key, the value and the fix."""
    if bool(cfg.run_dir) == bool(cfg.model_dir):
        raise ConfigError("give exactly one of run_dir=DIR (a training run) or model_dir=DIR (an HF model directory)")
    for task in ("humaneval", "infill"):
        if task in cfg.tasks:
            _check_sampling(task, getattr(cfg, task))
    if "perplexity" in cfg.tasks and cfg.model_dir and not cfg.perplexity.data_path:
        raise ConfigError("perplexity with model_dir= needs perplexity.data_path=DIR (a prepared dataset)")
    if "fim" in cfg.tasks and cfg.model_dir and not cfg.fim.data:
        raise ConfigError("fim with model_dir= needs fim.data=DIR (a prepared dataset: its validation repositories' "
                          "files are the held-out files)")  # fmt: skip


def _check_sampling(key: str, node: HumanEvalConfig | InfillConfig) -> None:
    """pass@k's rules for a task that samples ``n_samples`` completions (``humaneval``, ``infill``)."""
    if node.temperature <= 0 and node.n_samples != 1:
        raise ConfigError(
            f"{key}.n_samples={node.n_samples} with temperature=0: greedy samples are identical; "
            f"set {key}.temperature=0.8 (sampling) or n_samples=1"
        )
    too_big = [k for k in node.k if k > node.n_samples]
    if too_big:
        raise ConfigError(f"{key}.k={list(node.k)} needs n_samples >= {max(too_big)}: raise {key}.n_samples")


def register_eval_configs() -> None:
    ConfigStore.instance().store(name="eval_schema", node=EvalConfig)
