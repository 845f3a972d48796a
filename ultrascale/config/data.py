"""``conf/data/``: the prepared data a run reads, its mixture and stages, and the batch sizes."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from omegaconf import MISSING

from ultrascale.config.fields import num


class StageLr(StrEnum):
    schedule = "schedule"
    linear_to_zero = "linear_to_zero"


@dataclass
class SourceConfig:
    path: str = MISSING
    """A directory produced by ``python -m data_prep``. Every source must share one tokenizer, seq_len and
    special tokens (prepare the second with ``tokenizer.path=<first>/tokenizer``)."""
    weight: float = 1.0
    """Share of training samples (tokens: every sample is seq_len tokens). Weights need not sum to 1: they are
    normalized, and the banner prints the result. Must be > 0."""


@dataclass
class StageConfig:
    until_step: int | None = None
    """The stage ends before this optimizer step (exclusive). One of until_step / until_tokens ends every stage
    but the last, which runs to the end of the run."""
    until_tokens: int | None = None
    """The stage ends once this many training tokens have been read (rounded up to a whole step)."""
    weights: dict[str, float] = field(default_factory=dict)
    """Source name -> weight for this stage; a source not named here is not read in it."""
    lr: StageLr = StageLr.schedule
    """``schedule``: the run's lr schedule; ``linear_to_zero``: the schedule's lr times a factor falling from 1 at
    the stage's first step to 0 at its end (a SmolLM3-style annealing stage)."""


@dataclass
class DataConfig:
    path: str = "data/stdlib"
    """Directory produced by ``python -m data_prep`` (manifest.json + shards). Relative paths resolve
    against the project root. The one-source shorthand: ignored when ``data.sources`` is set."""
    sources: dict[str, SourceConfig] = field(default_factory=dict)
    """Name -> {path, weight}: train on a weighted mixture of prepared datasets, e.g.
    ``data.sources={code:{path:data/stdlib,weight:0.7},docs:{path:data/docs,weight:0.3}}``. The order of samples
    is a pure function of (seed, weights, step) whatever the number of ranks, so resumes read exactly what the
    uninterrupted run would have. A source smaller than its share repeats (its epochs are logged and warned)."""
    stages: list[StageConfig] = field(default_factory=list)
    """Staged mixtures (SmolLM3-style): ``[{until_step: 800, weights: {code: 0.7, docs: 0.3}}, {weights: {code: 1},
    lr: linear_to_zero}]``. Empty: one stage with the sources' weights. Needs ``data.sources``."""
    seq_len: int = num(256, ge=2)
    """Tokens per sample; must equal the prepared shards' seq_len."""
    micro_batch: int = num(4, ge=1)
    """Samples per rank per forward/backward (DeepSpeed train_micro_batch_size_per_gpu)."""
    global_batch: int = num(16, ge=1)
    """Samples per optimizer step across all data-parallel ranks; must be micro_batch * dp * k."""
    prepare_if_missing: bool = True
    """If ``path`` is the built-in corpus (``data/stdlib``) and has no manifest, rank 0 prepares it from this
    Python's standard library while the other ranks wait. Any other missing path is an error naming it and the
    ``python -m data_prep`` command that prepares it: a typo must not train on the stdlib."""
    prepare_max_files: int = num(400, ge=1)
    """Cap on stdlib source files when preparing the built-in corpus on demand (keeps the first run to seconds)."""
    eval_batches: int = num(4, ge=0)
    """Held-out micro-batches per rank per evaluation (the first ones in file order, the same every time). 0: the
    whole validation split, each rank a strided share; a rank's short last micro-batch is filled with rows that
    are not targets, so every rank runs the same forwards (ZeRO-3 gathers in each)."""
    final_eval_batches: int | None = num(None, ge=0)
    """Held-out micro-batches per rank of the eval after the last step, logged as ``eval_loss_final`` beside the
    usual ``eval_loss`` (which stays on ``data.eval_batches``, so the curve is one sample set). 0: the whole
    validation split, what an ablation's final loss is read on (``python -m ultrascale.report.ablation``).
    Unset: no second pass."""
    eval_path: str | None = None
    """The prepared directory whose validation split the held-out loss reads; unset: each source's own. An
    ablation sets it so that every arm is scored on the same targets: a FIM arm's left-to-right loss is read on
    the FIM-free data's validation split (data prep applies FIM to validation too). It must share the training
    data's tokenizer and seq_len (prepare it with ``tokenizer.path=<data>/tokenizer``)."""
    eval_document_masking: bool | None = None
    """Document masking of the held-out loss; unset: as training (``data.document_masking``). Masking drops each
    document's first target, so arms that train with and without it are scored on different targets unless
    this fixes one protocol for both (``recipes/ablate_tiny.yaml`` sets true)."""
    verify_checksums: bool = True
    """Check every shard's sha256 against the manifest before training (catches corrupt copies)."""
    document_masking: bool = True
    """Padding-free packing done right: position ids restart after every EOS, attention does not cross a
    document boundary, and a document's first token is not a target. sdpa/eager get a block-diagonal mask
    from transformers (built from the position ids); flash_attention_2 gets the micro-batch as one row so
    its varlen kernel sees the boundaries. False trains packed rows as one long text (cross-document
    attention), which is what most recipe repos do."""
