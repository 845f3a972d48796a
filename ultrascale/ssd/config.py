"""Typed schema for ``python -m ultrascale.ssd`` (primary config ``conf/ssd.yaml``), registered in the ConfigStore.

Struct mode makes ``sample.temprature=0.8`` fail at compose time with the key's name instead of silently
sampling at the default. Presets live in ``conf/ssd/`` (``ssd=tiny``, ``ssd=smollm2_135m``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from hydra.core.config_store import ConfigStore

from ultrascale.config.fields import num
from ultrascale.config.launcher import NodeLauncher
from ultrascale.config.precision import Precision
from ultrascale.config.problems import ProblemsConfig
from ultrascale.errors import ConfigError


class Stage(StrEnum):
    """A round's stages, in order: each resumes from the outputs of the ones before it."""

    problems = "problems"
    sample = "sample"
    sft_data = "sft_data"
    finetune = "finetune"
    export = "export"
    eval = "eval"


STAGES = tuple(Stage)


class Method(StrEnum):
    """What a round learns from (``method``).

    ``ssd``: the SSD paper's method (Zhang et al. 2026, "Embarrassingly Simple Self-Distillation Improves Code
    Generation", arXiv 2604.01193): sample from the model at a training temperature with top-k/top-p truncation,
    drop only empty responses and single-line stubs, and finetune on the raw samples. No tests, no execution.
    ``rft``: rejection-sampling finetuning: execute every sample against its problem's tests in the sandbox and
    finetune only on those that pass (needs problems with tests).
    """

    ssd = "ssd"
    rft = "rft"


@dataclass
class SampleConfig:
    n: int = num(1, ge=1)
    """Completions sampled per prompt from the round's input model (the paper: 1; ``method=rft`` wants several,
    since only the passing ones are kept)."""
    temperature: float = num(1.6, ge=0)
    """T_train, applied before the truncation (HF's order: temperature, then top-k, then top-p). The paper's
    Qwen3-4B-Instruct setting is 1.6 with top-k 20 and top-p 0.8. T = 1 without truncation gives a zero expected
    gradient (the samples are the model's own distribution): the run warns."""
    top_k: int = num(20, ge=0)
    """Keep the k most likely tokens (0 = off)."""
    top_p: float = num(0.8, gt=0, le=1)
    """Nucleus cutoff after top-k (1 = off)."""
    max_new_tokens: int = num(192, ge=1)
    """Generation budget per completion; the stop sequences (next top-level statement) usually end it sooner."""
    batch_size: int = num(32, ge=1)
    """Rows the sampler keeps in flight (each prompt's ``n`` samples take n rows, sharing one prefill)."""
    heal_newline: bool = True
    """Sample from the prompt without its trailing newline and re-align the completion to the full prompt.
    BPE tokenizers merge a newline with the next line's indentation (newline + 3 spaces is one SmolLM2 token),
    so a prompt ending in a bare newline token tells the model the next line starts at column 0: it writes a new
    top-level statement and the stop sequences leave an empty body (127 of 148 SmolLM2 samples without this).
    The kept completions are still trained after the full prompt, as HumanEval presents it."""
    extra_stops: list[str] = field(default_factory=lambda: ["```"])
    """Stop sequences added to HumanEval's for sampling: a code fence means the model has left the function
    (chat-tuned models close the 'code block' and explain it), so decoding further only costs time."""
    seed: int = num(1234, ge=0)
    """Seeds sampling (each batch gets seed + its index), so a round's samples are reproducible."""
    dedupe: bool = True
    """``rft``: keep one of several passing samples with the same AST (comments, spacing and docstrings ignored)."""
    max_kept_per_problem: int = num(4, ge=1)
    """``rft``: cap on kept samples per problem, so easy problems do not dominate the finetuning set."""
    timeout_s: float = num(5.0, gt=0)
    """``rft``: sandbox wall-clock limit per sample program."""
    memory_mb: int = num(1024, ge=16)
    """Sandbox address-space limit per sample program."""
    workers: int = num(2, ge=1)
    """Sample programs run at once (each in its own sandbox)."""


@dataclass
class SFTConfig:
    seq_len: int = num(512, ge=2)
    """Packed row length of the finetuning set; a sample (prompt + completion + EOS) longer than this is dropped."""
    validation_fraction: float = num(0.1, ge=0, lt=1)
    """Share of problems whose kept samples form the validation split (at least one problem when two or more
    have kept samples; otherwise validation repeats train and the manifest says so)."""
    eos_token: str | None = None
    """Token appended after each completion and used as the document separator; null = the tokenizer's
    ``eos_token``, which is what the exported generation config stops at."""
    seed: int = num(0, ge=0)
    """Seeds the row order and the validation pick."""


@dataclass
class FinetuneConfig:
    launcher: NodeLauncher = NodeLauncher.torchrun
    """How ``train.py`` is started: ``torchrun`` or ``deepspeed`` (``train.py ... launcher=X`` spawns it)."""
    nproc: int = num(2, ge=1)
    """Ranks on this node (``launcher.nproc_per_node``)."""
    train_overrides: list[str] = field(default_factory=list)
    """Extra ``train.py`` overrides, applied before the ones SSD sets (e.g. ``[recipe=smollm2_135m_cpt]`` for
    its ZeRO stage, precision and logger). SSD always sets the model, data, steps, lr and output directory."""
    lr: float = num(2.0e-5, gt=0)
    """Peak learning rate: small, so a few hundred kept samples nudge the model rather than overwrite it."""
    epochs: float = num(2.0, gt=0)
    """Passes over the packed training rows; steps = ceil(epochs x rows / global_batch), clamped below."""
    min_steps: int = num(1, ge=1)
    """Fewest optimizer steps, however small the kept set."""
    max_steps: int = num(200, ge=1)
    """Most optimizer steps, however large the kept set."""
    micro_batch: int = num(2, ge=1)
    """Rows per rank per forward/backward."""
    global_batch: int = num(8, ge=1)
    """Rows per optimizer step (micro_batch x nproc x gradient accumulation)."""
    warmup_steps: int = num(2, ge=0)
    """Linear warmup steps (capped at steps - 1)."""
    min_lr_ratio: float = num(0.2, ge=0, le=1)
    """Cosine decay to ``lr x min_lr_ratio`` (the paper: 5e-6 to 1e-6, a ratio of 0.2)."""
    weight_decay: float = num(0.1, ge=0)
    """AdamW decoupled weight decay (the paper: 0.1)."""
    betas: list[float] = num(default_factory=lambda: [0.9, 0.95], ge=0, lt=1)
    """AdamW betas (the paper: 0.9, 0.95)."""
    keep_checkpoints: int = num(1, ge=1)
    """Checkpoints kept with ``checkpoint_interval``: several let an evaluation pick one on the dev split."""
    checkpoint_interval: int = num(0, ge=0)
    """Checkpoint every N steps so a killed finetune resumes mid-way (0 = only at the end; each checkpoint of
    a 135M model with Adam state is ~1.6 GB and ~7 s on CPU)."""
    export_dtype: Precision = Precision.fp32
    """dtype of the exported HF model: fp32, bf16 or fp16."""


@dataclass
class SSDEvalConfig:
    enabled: bool = True
    """Evaluate each round's exported model on HumanEval."""
    baseline: bool = True
    """Also evaluate the starting model once (``<output_dir>/baseline/``): the 'before' of the first round."""
    limit: int | None = num(None, ge=1)
    """First N HumanEval problems (null = all 164)."""
    max_new_tokens: int = num(256, ge=1)
    """Generation budget per HumanEval completion."""
    batch_size: int = num(32, ge=1)
    """Rows the sampler keeps in flight."""
    passk_samples: int = num(0, ge=0)
    """Sampled completions per problem for pass@k (0 = greedy pass@1 only; pass@k needs >= max(passk_k))."""
    passk_k: list[int] = num(default_factory=lambda: [1, 5], ge=1)
    """k values reported from the sampled completions."""
    temperature: float = num(0.8, gt=0)
    """Sampling temperature for pass@k."""
    workers: int = num(2, ge=1)
    """Test programs run at once."""


@dataclass
class SSDConfig:
    start_model: str = "models/smollm2-135m"
    """Starting HF model directory (an import such as ``models/smollm2-135m``, or a CPT export); it must hold
    its tokenizer. Round r + 1 starts from round r's export."""
    output_dir: str = "runs/ssd"
    """Where rounds, manifests and models go. Rerunning with the same directory continues where it stopped."""
    method: Method = Method.ssd
    """``ssd`` (default): the paper's self-distillation, raw samples, nothing executed; ``rft``: execute every
    sample against its tests and keep only the passing ones (rejection-sampling finetuning)."""
    rounds: int = num(1, ge=1)
    """Sample -> execute -> filter -> finetune -> export -> eval cycles."""
    stop_after: Stage | None = None
    """Stop the run after this stage of the last round (``problems``, ``sample``, ``sft_data``, ``finetune``,
    ``export``): e.g. ``sample`` to look at pass rates before paying for a finetune. A rerun without it goes on."""
    threads: int | None = num(None, ge=1)
    """``torch.set_num_threads`` for sampling and HumanEval generation, which run in this one process (the
    finetune's ranks are separate processes); null keeps torch's default (``OMP_NUM_THREADS``)."""
    dtype: Precision = Precision.fp32
    """Precision for sampling (fp32 is exact and not slower on CPUs without AMX)."""
    device: str = "auto"
    """Where sampling runs: ``auto`` (the GPU when the machine has one, else the CPU), ``cpu``, ``cuda``, ``cuda:N``.
    The finetune is train.py's own ranks and evaluation is eval.py's ``device``."""
    problems: ProblemsConfig = field(default_factory=ProblemsConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    eval: SSDEvalConfig = field(default_factory=SSDEvalConfig)


def zero_signal(sample: SampleConfig) -> bool:
    """T = 1 with no truncation samples the model's own distribution: training on it has zero expected gradient
    (the paper's analysis), so a round would spend its compute to change nothing."""
    return abs(float(sample.temperature) - 1.0) < 1e-9 and int(sample.top_k) == 0 and float(sample.top_p) >= 1.0


def check(cfg: SSDConfig) -> None:
    """The rules between SSD's keys: fail at start-up, not after an hour of sampling and finetuning."""
    s, e, f = cfg.sample, cfg.eval, cfg.finetune
    if s.temperature <= 0 and s.n > 1:
        raise ConfigError(f"sample.n={s.n} with sample.temperature={s.temperature}: greedy samples are identical; "
                          "sample at a temperature > 0 (e.g. 0.8)")  # fmt: skip
    if e.passk_samples and max(e.passk_k) > e.passk_samples:
        raise ConfigError(
            f"eval.passk_k={list(e.passk_k)} needs eval.passk_samples >= {max(e.passk_k)}: raise passk_samples"
        )
    if e.passk_samples and e.temperature <= 0:
        raise ConfigError(f"eval.temperature={e.temperature}: pass@k needs sampling (e.g. 0.8)")
    per_step = f.micro_batch * f.nproc  # train.py would refuse it only after loading the model
    if f.global_batch % per_step:
        raise ConfigError(
            f"finetune.global_batch={f.global_batch} is not a multiple of finetune.micro_batch x finetune.nproc "
            f"= {per_step}: set finetune.global_batch={per_step * max(1, f.global_batch // per_step)}"
        )


def register_ssd_configs() -> None:
    ConfigStore.instance().store(name="ssd_schema", node=SSDConfig)
