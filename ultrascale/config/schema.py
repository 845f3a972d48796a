"""Typed schemas for every Hydra config group.

The YAML files under ``conf/`` hold values only; these dataclasses hold the shape. Hydra merges the
YAML onto them in struct mode, so a misspelt key or a wrong type fails at compose time with the full
key in the message instead of being silently ignored (the failure mode of untyped ``cfg.get`` configs).
Each field's docstring says why it exists and what it requires.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from ultrascale.config.fields import num


# Allowed choices are types: a value outside one fails at compose time with the key and the choices. StrEnum
# members compare equal to their strings and print as them, so YAML, JSON and messages read the same.
class CompileScope(StrEnum):
    model = "model"
    layers = "layers"


class CheckpointStaging(StrEnum):
    auto = "auto"
    pinned = "pinned"
    pageable = "pageable"


class AttentionKernel(StrEnum):
    auto = "auto"
    sdpa = "sdpa"
    blocks = "blocks"
    flex = "flex"


class LossKernel(StrEnum):
    auto = "auto"
    chunked = "chunked"
    liger = "liger"


class Precision(StrEnum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class Autocast(StrEnum):
    none = "none"
    bf16 = "bf16"


class OptimizerName(StrEnum):
    adamw = "adamw"
    muon = "muon"


class ScheduleName(StrEnum):
    cosine = "cosine"
    wsd = "wsd"
    constant = "constant"


class Offload(StrEnum):
    none = "none"
    cpu = "cpu"


class AttnImplementation(StrEnum):
    sdpa = "sdpa"
    eager = "eager"
    flash_attention_2 = "flash_attention_2"
    flash_attention_3 = "flash_attention_3"


class NonFinitePolicy(StrEnum):
    skip = "skip"
    rollback = "rollback"
    stop = "stop"


class SpikePolicy(StrEnum):
    none = "none"
    skip = "skip"
    lr_cut = "lr_cut"
    rollback = "rollback"


class WandbMode(StrEnum):
    offline = "offline"
    online = "online"
    disabled = "disabled"


class LauncherName(StrEnum):
    local = "local"
    deepspeed = "deepspeed"
    torchrun = "torchrun"
    slurm = "slurm"


class NodeLauncher(StrEnum):
    deepspeed = "deepspeed"
    torchrun = "torchrun"


class FinetuneMethod(StrEnum):
    none = "none"
    lora = "lora"
    qlora = "qlora"


@dataclass
class ModelConfig:
    type: str = "llama"
    """HF ``model_type`` (llama, qwen2, qwen3, mistral, starcoder2, mixtral, qwen3_moe, ...).
    Resolved through ``AutoConfig.for_model``, so any causal-LM architecture transformers ships works."""
    name: str = "tiny"
    """Human name of the shape, used in run names and logs."""
    config: dict[str, Any] = field(default_factory=dict)
    """Keyword overrides for the HF config class (hidden_size, num_hidden_layers, ...). Keys are checked
    against the config class at validation time, because HF configs accept unknown kwargs silently."""
    pretrained_path: str | None = None
    """Local HF model directory to start from (fine-tune / continued pretraining). Never a hub id:
    there is no hub access at run time."""
    attn_implementation: AttnImplementation = AttnImplementation.sdpa
    """``sdpa`` (fused, no s^2 activation term), ``eager`` (reference), or ``flash_attention_2`` on GPU."""
    init_seed: int | None = num(None, ge=0)
    """Seed for weight init; defaults to ``train.seed`` so every rank builds identical weights."""


@dataclass
class ZeroConfig:
    """DeepSpeed ``zero_optimization`` knobs, named exactly as DeepSpeed names them."""

    stage: int = num(1, ge=0, le=3)
    """0 = plain DDP-style data parallel; 1 shards optimizer state; 2 also gradients; 3 also weights.
    Rule of thumb: the lowest stage that fits is the fastest."""
    offload_optimizer: Offload = Offload.none
    """``none`` or ``cpu``: optimizer state and step on the host (ZeRO-Offload). Needs stage >= 1."""
    offload_param: Offload = Offload.none
    """``none`` or ``cpu``: parameters on the host between uses (ZeRO-Infinity style). Needs stage 3."""
    pin_memory: bool = False
    """Pinned host buffers speed up offload transfers on GPU; useless (and slow to allocate) on CPU."""
    overlap_comm: bool = True
    """Overlap gradient reduction with backward compute. Costs extra bucket memory (~4.5x reduce_bucket_size)."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced: less fragmentation at peak."""
    reduce_scatter: bool = True
    """Use reduce-scatter instead of all-reduce for gradient averaging (stage >= 2)."""
    reduce_bucket_size: int = num(50_000_000, ge=1)
    """Elements per gradient reduction bucket. Larger = fewer, bigger collectives; more memory."""
    allgather_bucket_size: int = num(50_000_000, ge=1)
    """Elements per all-gather bucket after the optimizer step (stage 1/2)."""
    round_robin_gradients: bool = False
    """Stage 1/2 with CPU offload: parallelise gradient copies to host across ranks."""
    stage3_prefetch_bucket_size: int = num(50_000_000, ge=0)
    """Stage 3: elements of upcoming parameters to prefetch (all-gather ahead of use)."""
    stage3_param_persistence_threshold: int = num(100_000, ge=0)
    """Stage 3: parameters smaller than this stay resident (not partitioned): saves many tiny gathers."""
    stage3_max_live_parameters: int = num(1_000_000_000, ge=1)
    """Stage 3: upper bound on gathered parameters alive at once; lower it if memory spikes."""
    stage3_max_reuse_distance: int = num(1_000_000_000, ge=0)
    """Stage 3: keep a gathered parameter if it is reused within this many parameters."""
    stage3_gather_16bit_weights_on_model_save: bool = False
    """Stage 3: also write a consolidated 16-bit state dict on save (costs a full gather)."""
    zero_hpz_partition_size: int = num(1, ge=1)
    """ZeRO++ hierarchical partitioning: secondary weight copy within groups of this many ranks (1 = off)."""
    zero_quantized_weights: bool = False
    """ZeRO++ qwZ: int8 weight all-gather. Needs CUDA kernels."""
    zero_quantized_gradients: bool = False
    """ZeRO++ qgZ: int4 gradient reduce-scatter. Needs CUDA kernels."""


@dataclass
class PrecisionConfig:
    dtype: Precision = Precision.fp32
    """``fp32``, ``bf16`` (no loss scaling needed; the default on Ampere+), or ``fp16`` (dynamic loss scale)."""
    autocast: Autocast = Autocast.none
    """``bf16`` (with ``dtype=fp32``): the forward runs under ``torch.autocast`` in bf16 (matmuls and attention in
    bf16, norms and the loss in fp32) while weights, gradients and Adam stay fp32: the speed of bf16 kernels
    without bf16 master weights. On a CPU it needs native bf16 (AVX-512 BF16 or AMX; the banner says why it is
    off otherwise). `python bench/levers.py --levers autocast_bf16` measures it."""
    autocast_emulated: bool = False
    """Run ``autocast`` even on a CPU without native bf16, where torch emulates it (slower than fp32): to check
    a run's bf16 numerics on such a machine before booking one that has it, never for speed."""
    initial_scale_power: int = num(16, ge=0, le=32)
    """fp16 only: the dynamic loss scale starts at 2**this."""
    loss_scale_window: int = num(1000, ge=1)
    """fp16 only: steps without overflow before the scale is raised."""
    hysteresis: int = num(2, ge=1)
    """fp16 only: overflows tolerated before the scale is lowered."""
    min_loss_scale: float = num(1.0, gt=0)
    """fp16 only: floor for the dynamic loss scale."""


@dataclass
class SchedConfig:
    name: ScheduleName = ScheduleName.cosine
    """``cosine`` (linear warmup then cosine to min_lr), ``wsd`` (warmup-stable-decay: flat, then a short
    decay, so a run can be extended or branched from any stable-phase checkpoint), or ``constant``."""
    warmup_steps: int = num(100, ge=0)
    """Linear warmup from 0; protects Adam's early, badly estimated second moments."""
    warmup_tokens: str | None = None
    """The warmup in tokens (``50M``, ``20480``): sets ``warmup_steps`` to the steps that train this many, so the
    warmup keeps its length when the batch changes. Null: ``warmup_steps`` as given."""
    min_lr_ratio: float = num(0.1, ge=0, le=1)
    """Final lr as a fraction of optim.lr."""
    decay_fraction: float = num(0.2, ge=0, le=1)
    """WSD only: the last fraction of train.steps spent decaying."""
    total_steps: int | None = num(None, ge=1)
    """Schedule length; defaults to train.steps. Set it to keep the schedule fixed when extending a run."""


@dataclass
class OptimConfig:
    name: OptimizerName = OptimizerName.adamw
    """``adamw`` or ``muon`` (DeepSpeed's MuonWithAuxAdam: Muon on 2-D hidden matrices, Adam on the rest;
    ZeRO stage <= 2 because Muon needs whole, unflattened matrices)."""
    lr: float = num(3e-4, gt=0)
    """Peak learning rate reached after warmup."""
    weight_decay: float = num(0.1, ge=0)
    """Decoupled weight decay, applied to matrices only: never to norms, biases or (optionally) embeddings."""
    decay_embeddings: bool = True
    """Whether embedding/unembedding matrices get weight decay."""
    betas: list[float] = num(default_factory=lambda: [0.9, 0.95], ge=0, lt=1)
    """Adam betas; 0.95 for beta2 is the usual LLM choice for stability."""
    eps: float = num(1e-8, gt=0)
    """Adam epsilon."""
    grad_clip: float = num(1.0, ge=0)
    """Global gradient-norm clip (DeepSpeed ``gradient_clipping``); 0 disables it."""
    torch_adam: bool = True
    """Use torch's AdamW inside DeepSpeed instead of JIT-compiling FusedAdam/CPUAdam (minutes on first use).
    Offload always uses DeepSpeedCPUAdam regardless, because that is what makes offload fast."""
    fused: bool = True
    """torch AdamW's fused kernel (``fused=True``: one kernel for all parameters instead of a loop of small
    ops); it exists on CPU and CUDA for fp32/bf16/fp16. Same math as the unfused step."""
    momentum: float = num(0.95, ge=0, lt=1)
    """Muon only: Nesterov momentum."""
    muon_lr: float | None = num(None, gt=0)
    """Muon only: lr for the Muon half (matrices); the Adam half uses optim.lr."""
    sched: SchedConfig = field(default_factory=SchedConfig)


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
    eval_batches: int = num(4, ge=1)
    """Held-out micro-batches per rank per evaluation."""
    verify_checksums: bool = True
    """Check every shard's sha256 against the manifest before training (catches corrupt copies)."""
    document_masking: bool = True
    """Padding-free packing done right: position ids restart after every EOS, attention does not cross a
    document boundary, and a document's first token is not a target. sdpa/eager get a block-diagonal mask
    from transformers (built from the position ids); flash_attention_2 gets the micro-batch as one row so
    its varlen kernel sees the boundaries. False trains packed rows as one long text (cross-document
    attention), which is what most recipe repos do."""


@dataclass
class LoggerConfig:
    console: bool = True
    """Rank-0 console line every train.log_interval steps."""
    tensorboard: bool = True
    """TensorBoard event files under ``<output_dir>/tensorboard``."""
    wandb: bool = True
    """Weights & Biases run (rank 0 only)."""
    wandb_mode: WandbMode = WandbMode.offline
    """``offline`` (default: no network needed; ``wandb sync`` later), ``online`` or ``disabled``."""
    wandb_project: str = "ultrascale"
    """wandb project name."""
    wandb_group: str | None = None
    """wandb group; sweeps set it to the sweep name so jobs plot together."""
    wandb_entity: str | None = None
    """wandb entity (team); None uses the default."""
    run_name: str | None = None
    """Run name; defaults to the output directory's name."""
    plot: bool = True
    """Write ``curves.png`` (loss, lr, tokens/s, memory) at the end and at every checkpoint."""


@dataclass
class TrainConfig:
    steps: int = num(100, ge=1)
    """Optimizer steps to run (each consumes data.global_batch samples). Replaced by the steps ``train.tokens``
    gives when that is set."""
    tokens: str | None = None
    """Run length in tokens: ``2B``, ``500M``, ``20480`` (decimal suffixes K/M/B/T). When set it decides the length:
    ``train.steps`` becomes the steps that train at least this many (each ``data.global_batch x data.seq_len``
    tokens; the last one rounds up), the lr schedule follows, and the banner prints both. A resume under another
    ``data.global_batch`` keeps the count: it runs the steps the rest takes, on the same lr curve over tokens
    (``ultrascale/levers/length.py``)."""
    eval_interval: int = num(50, ge=0)
    """Evaluate held-out loss every N steps (0 = only at the end)."""
    checkpoint_interval: int = num(50, ge=0)
    """Save a checkpoint every N steps (0 = only at the end)."""
    final_eval: bool = True
    """Evaluate after the last step even when ``eval_interval`` does not land on it. False (benchmarks such as
    bench/gpu_probe.py, which time steps and not the end of a run): only the interval's evals run."""
    final_save: bool = True
    """Save after the last step even when ``checkpoint_interval`` does not land on it. False (benchmarks that
    do not measure the save: a 1B model's is 17 GB): only the interval's saves and a stop's save run."""
    param_digest: bool = True
    """At the end of the run, hash every parameter on each rank and check that the data-parallel replicas agree
    (``replicas_agree`` in summary.json). False: skipped, the summary says ``replicas_agree: null``; for
    benchmarks, where it is a whole-model device-to-host copy that measures nothing (at world size 1 it
    compares a replica with itself)."""
    keep_checkpoints: int = num(2, ge=0)
    """Newest complete checkpoints to keep on disk (0 = keep all)."""
    checkpoint_async: bool = True
    """Save without stalling training: the state is copied to host memory at the step boundary and written by a
    background thread while the next steps run; ``latest`` moves once every rank has written it, so a crash
    mid-write leaves the previous checkpoint as ``latest``. Costs one checkpoint's size of host memory while
    it is written. False: every rank writes before the step after it starts (`make bench-checkpoint`)."""
    checkpoint_staging: CheckpointStaging = CheckpointStaging.auto
    """Where the background writer's snapshot lands (``ultrascale/train/ckpt_writer.py``). ``pinned``: page-locked
    host buffers, allocated at the first save and reused by every later one, filled by non-blocking device-to-host
    DMA on a side stream with one synchronisation per checkpoint. ``pageable``: ordinary reused buffers, blocking
    copies through the driver's bounce buffer: the first GPU run's 17 GB took 9.2 s that way (~1.9 GB/s).
    ``auto``: pinned on CUDA, pageable on a CPU (nothing to pin for). Pinned memory cannot be swapped: it is the
    checkpoint's size per rank of locked host RAM (`python bench/checkpoint_stall.py --staging`)."""
    log_interval: int = num(1, ge=1)
    """Log metrics every N steps."""
    seed: int = num(1234, ge=0)
    """Seeds weight init, data order and dropout. Same seed + same data = same run."""
    resume: str = "auto"
    """``auto`` (resume from the newest complete checkpoint in output_dir if any), ``never``, or a path."""
    activation_checkpointing: str = "auto"
    """Trade compute for activation memory (``ultrascale/model/recompute.py``). ``full``: each decoder layer is
    recomputed from its input in backward (a layer keeps only its input, e·s·b·h; one more forward, ~30 % more
    compute). ``selective``: per-op, as torchtitan does: the matmuls' and the attention kernel's outputs are kept
    and norms, RoPE, activations and residual adds recomputed (about half a layer's activations on a Llama shape,
    a few elementwise kernels of recompute; pp=tp=sp=ep=1). ``none``: off. ``auto`` (default): on a GPU, none if
    the planner's predicted peak (``ultrascale/cost/memory.py``) fits 90 % of the GPU's free memory, else
    selective if that fits, else full, with the figures in the banner; on CPU off, as before. ``true``/``false``
    mean full/none."""
    universal_checkpoint: bool = False
    """Load checkpoints in DeepSpeed universal format (resume on a different world size / parallel layout)."""
    allow_schedule_change: bool = False
    """Resume even when ``optim.lr``, ``optim.sched.*`` or ``train.steps`` give the next update another lr than
    the schedule the checkpoint was on (the jump is logged). Off: such a resume is refused with the key and the
    fix, because a silently reshaped curve (a longer cosine) is a different run under the same name."""
    compile: bool = True
    """``torch.compile`` the model (``train.compile_scope``): fused elementwise kernels (norms, RoPE, SwiGLU),
    fewer passes over memory. On by default because a training run is long (1.040x per step, `python
    bench/levers.py --levers compile`; history in bench/README.md); the price is a compile inside the first step
    (~10-35 s for the tiny model on CPU, logged), so short runs (demo, tests, SSD finetunes) set it false. The
    run's decisions turn it off, with the reason, for pp>1, tp/sp/ep>1, MoE and ZeRO-3."""
    compile_scope: CompileScope = CompileScope.layers
    """What ``train.compile`` compiles. ``layers`` (default): each decoder layer in place (regional compilation);
    the layers share one compiled graph, so the first step compiles one layer instead of tracing all of them.
    ``model``: the whole forward as one graph (DeepSpeed's ``engine.compile()``, fusing into the head and loss
    too). SmolLM2-135M on 2 CPU ranks: first step after 136 s (layers) vs 641 s (model) at the same step rate
    (`python bench/levers.py --levers compile_layers`; details in bench/README.md)."""
    fused_loss: bool = True
    """Compute the LM loss with a chunked linear cross-entropy (``ultrascale/model/loss.py``): the
    [tokens, vocab] logits never exist at once, which at a 49k vocabulary is the largest activation of a
    small model. Same loss and gradients as the plain path. Dense HF decoders with pp=1 and sp=1; MoE models
    keep the plain path (their forward adds the router loss) and the banner says so."""
    loss_chunk_tokens: int = num(0, ge=0)
    """Tokens per chunk of the chunked fused loss; 0: decided from the machine (CPU: 128 with fp32 GEMMs, 1,024
    where autocast puts them on a bf16 matrix unit, within a 256 MiB logits budget; GPU: the power of two whose
    fp32 logits fit 1/64 of the GPU's free memory, at most 8,192: 2,048 at vocab 128k on an 80 GB card;
    ``ultrascale/levers/decide.py``)."""
    attention_kernel: AttentionKernel = AttentionKernel.auto
    """The attention kernel of training with ``model.attn_implementation=sdpa``. Packed rows holding several
    documents need attention that stops at each boundary; HF's sdpa spells that as a dense ``[b, 1, s, s]`` mask,
    which keeps SDPA off its FlashAttention kernel on a GPU (17.5 % MFU on the first H200 run). ``flex``:
    FlexAttention with a block mask built once per forward from the position ids (causal AND same document AND
    the model's sliding window; ``ultrascale/model/flex.py``): tiles across documents and above the diagonal are
    skipped, no mask is materialized; one-document rows and decoding keep SDPA. ``blocks``: causal SDPA in query
    blocks (``train.attn_block_size``). ``sdpa``: HF's as configured. ``auto``: flex on CUDA GPUs of compute
    capability 8.0+ when documents are masked; on CPU the blocks for multi-document rows and SDPA's causal
    kernel for one-document rows (torch 2.13 has no CPU FlexAttention backward: forcing ``flex`` on a CPU trains
    through its slow reference implementation, for checking). Causal text decoders with pp=1 and sp=1."""
    loss_kernel: LossKernel = LossKernel.auto
    """The fused loss's kernel (``train.fused_loss``). ``chunked``: ours (``ultrascale/model/loss.py``), any
    device, ``train.loss_chunk_tokens`` a chunk. ``liger``: liger-kernel's Triton fused linear cross-entropy (CUDA,
    ``pip install liger-kernel``; not in requirements.txt). ``auto``: liger on a GPU where it is importable,
    chunked otherwise."""
    attn_block_size: int | None = num(None, ge=0)
    """With ``model.attn_implementation=sdpa``: run causal attention in query blocks of this many tokens, each
    block attending only to keys up to its own end, so the tiles the causal mask forbids are never computed
    (``ultrascale/model/attention.py``; same output as sdpa; 1.065x fwd+bwd compiled, `make bench-attention`).
    Unset (auto): on CPU, the sequence over the blocks per row that pay off on this CPU's matrix unit (4 with fp32
    matmuls, 2 with bf16 on AMX/AVX-512 BF16: ``ultrascale/levers/decide.py``, `python bench/bench_cpu_levers.py`);
    HF's sdpa on GPU, where it is not measured; a number forces it; 0 = off. Rows holding one document always
    take SDPA's causal kernel.
    Causal text decoders with pp=1 and sp=1; the banner says when it is off and why."""
    overlap_loss_reduce: bool = True
    """Start the all-reduce of the step's loss (which the stability checks judge) before the last backward and
    wait for it after, so the ranks' wait for each other hides behind the backward. The same verdicts, lr and
    losses either way (`python bench/levers.py --levers overlap_reduce`)."""
    step_breakdown: bool = True
    """Record where each step's time goes (data wait, forward, backward, communication, optimizer) from
    DeepSpeed's own engine timers (``wall_clock_breakdown``): host clocks on CPU, CUDA events on GPU."""
    eval_humaneval: int = num(0, ge=0)
    """At every eval_interval also run greedy HumanEval pass@1 on the first N problems on rank 0, in the
    sandbox (0 = off). Needs a prepared dataset with a tokenizer, zero.stage<=2 and pp=tp=1."""
    eval_humaneval_max_new_tokens: int = num(128, ge=1)
    """Generation budget per HumanEval completion during training (stop sequences usually end it sooner)."""
    eval_fim: int = num(0, ge=0)
    """At every eval_interval also score fill-in-the-middle (PSM, greedy, one span of each kind per file) on this
    many held-out files of the data's validation repositories, on rank 0 (0 = off; ``ultrascale/eval/fim.py``):
    ``fim_exact_match`` and ``fim_edit_similarity`` in the eval row. Needs data prepared with FIM (its tokenizer's
    FIM tokens), zero.stage<=2 and pp=tp=sp=1."""
    eval_fim_input: str = "stdlib"
    """The corpus ``data.path`` was prepared from (data prep's ``input``): where ``eval_fim`` reads its files."""
    profile_steps: int = num(0, ge=0)
    """Record a ``torch.profiler`` trace of this many steps on every rank (0 = off): ``profile/rankNNNNN.txt``
    ranks the operators by self time, ``.trace.json`` opens in Perfetto. For when the step breakdown shows a
    phase larger than it should be and the question is which operator."""
    profile_start: int = num(5, ge=0)
    """Steps to run before the profiled window (counted from the start or resume of the run), so warm-up and
    the compile stay out of it."""


@dataclass
class StabilityConfig:
    """What a run does by itself about a bad step, so a week-long job survives a spike or a NaN unattended.

    Every decision is taken from the all-reduced step loss and grad norm and then all-reduced again, so all
    ranks act identically. Each event is a row in metrics.jsonl (``event``), a console line, a wandb/TensorBoard
    point under ``stability/`` and an entry in the report."""

    nonfinite: NonFinitePolicy = NonFinitePolicy.skip
    """A NaN/inf loss or gradient norm: ``skip`` (no optimizer update; the data position still advances),
    ``rollback`` (reload the last checkpoint and skip the data since it) or ``stop`` (end with an error).
    The bad update is never applied in any case."""
    spike: SpikePolicy = SpikePolicy.skip
    """A loss spike (see spike_zscore): ``none``, ``skip`` (drop this step's update), ``lr_cut`` (apply it with
    lr x lr_cut_factor and keep the cut for lr_cut_steps) or ``rollback`` (last checkpoint, skip the data
    window from it to the spike). ``skip`` needs parallel.pp=1 (the pipeline updates inside train_batch)."""
    spike_zscore: float = num(6.0, gt=0)
    """A step is a spike when its loss exceeds the mean of the recent window by this many standard deviations.
    One-sided: a loss that falls fast is progress, not a spike."""
    spike_window: int = num(50, ge=1)
    """Accepted (non-skipped) steps in the moving window of losses the z-score is measured against."""
    spike_min_history: int = num(20, ge=1)
    """No spike detection until the window holds this many steps (early losses fall too fast to be a baseline)."""
    spike_min_rel_std: float = num(0.02, ge=0)
    """Floor on the window's standard deviation as a fraction of its mean loss, so a flat stretch of the
    curve (or a short window) does not turn ordinary noise into a 'spike'."""
    lr_cut_factor: float = num(0.5, gt=0, le=1)
    """``spike=lr_cut``: multiply the scheduled lr by this factor..."""
    lr_cut_steps: int = num(100, ge=1)
    """...for this many steps after the spike."""
    max_consecutive: int = num(5, ge=1)
    """End the run with an error after this many bad steps in a row (skips and rollbacks without a clean
    step between them): something is persistently broken and a human should look."""
    max_rollbacks: int = num(10, ge=0)
    """End the run with an error after this many rollbacks in total."""


@dataclass
class PipelineConfig:
    micro_batches: int | None = num(None, ge=1)
    """Micro-batches per pipeline step; defaults to gradient accumulation steps. More = smaller bubble
    (p-1)/(m+p-1)."""
    partition_method: str = "parameters"
    """``parameters`` (balance parameter counts), ``uniform`` (balance layer counts), or ``type:<regex>``."""
    activation_checkpoint_interval: int = num(0, ge=0)
    """Checkpoint every N layers inside each stage (0 = off)."""


@dataclass
class MoEConfig:
    num_experts: int = num(8, ge=1)
    """Experts per MoE layer (HF MoE models read it from their own config; this is for the DeepSpeed MoE swap)."""
    top_k: int = num(2, ge=1)
    """Experts each token is routed to."""
    capacity_factor: float = num(1.25, gt=0)
    """Expert capacity = capacity_factor * tokens * top_k / num_experts; overflow tokens are dropped."""
    aux_loss_coef: float = num(0.01, ge=0)
    """Weight of the router load-balancing loss added to the LM loss."""
    drop_tokens: bool = True
    """Drop tokens over capacity (fixed shapes, faster) instead of padding capacity to the max load."""


@dataclass
class ParallelConfig:
    tp: int = num(1, ge=1)
    """Tensor-parallel degree (DeepSpeed AutoTP). Keep it inside a node: it all-reduces twice per layer."""
    pp: int = num(1, ge=1)
    """Pipeline-parallel stages. Needs zero.stage <= 1."""
    sp: int = num(1, ge=1)
    """Sequence-parallel degree (Ulysses all-to-all). Must divide the attention head count."""
    ep: int = num(1, ge=1)
    """Expert-parallel degree for MoE models. Must divide dp and the expert count."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)


@dataclass
class SlurmConfig:
    """What ``launch/slurm`` writes into the sbatch header. GPUs per node and nodes come from the launcher."""

    partition: str | None = None
    """``#SBATCH --partition``; None uses the cluster's default partition."""
    account: str | None = None
    """``#SBATCH --account`` to charge; None uses your default account."""
    qos: str | None = None
    """``#SBATCH --qos``; None uses the partition's default."""
    time: str = "24:00:00"
    """Wall-clock limit (``HH:MM:SS`` or ``D-HH:MM:SS``). Requeue plus auto-resume continues past it."""
    cpus_per_task: int = num(16, ge=1)
    """CPU cores per node for the one launcher task (its ranks and their data loading share them)."""
    mem: str | None = None
    """``#SBATCH --mem`` per node (e.g. ``0`` = all of it); None uses the partition's default."""
    constraint: str | None = None
    """``#SBATCH --constraint`` node features (e.g. ``h100``); None accepts any node."""
    job_name: str | None = None
    """Job name in ``squeue``; None uses the run directory's name."""
    node_launcher: NodeLauncher = NodeLauncher.deepspeed
    """Per-node launcher started by ``srun``: ``deepspeed`` (``--no_ssh --node_rank``) or ``torchrun``."""
    requeue: bool = True
    """Near the time limit (and after a preemption's SIGTERM) the run saves a checkpoint at its next step and
    stops, and the batch script requeues the job, which resumes from that checkpoint."""
    signal_lead_s: int = num(300, ge=0)
    """Seconds before the time limit at which Slurm sends USR1 to the batch script (``--signal=B:USR1@N``): enough
    for one step plus one checkpoint save."""
    extra: list[str] = field(default_factory=list)
    """Further ``#SBATCH`` options, verbatim (e.g. ``["--exclusive", "--reservation=big"]``)."""
    submit: bool = True
    """``launcher=slurm`` runs ``sbatch`` on the written script; false only writes it (and prints the command)."""


@dataclass
class LauncherConfig:
    name: LauncherName = LauncherName.local
    """How a run is started: ``local`` (this process, or whatever launcher already started it),
    ``deepspeed``/``torchrun`` (spawn a multi-rank launcher for the run, or per Hydra ``-m`` job), or ``slurm``
    (write ``<output_dir>/sbatch.sh`` and submit it)."""
    nproc_per_node: int = num(2, ge=1)
    """Ranks per node when this tool spawns the launcher (GPUs per node on a GPU cluster)."""
    nnodes: int = num(1, ge=1)
    """Nodes when this tool spawns the launcher. More than one needs ``launcher.hostfile`` or ``launcher=slurm``."""
    master_port: int | None = num(None, ge=1, le=65535)
    """Rendezvous TCP port on the first node. None picks one: a free port for local launches, and
    20000 + job id % 20000 on Slurm (two jobs sharing a node must not collide)."""
    hostfile: str | None = None
    """DeepSpeed hostfile (``host slots=N`` lines; ``python -m launch.hostfile`` writes one) for multi-node
    ``launcher=deepspeed``; the launcher reaches the other nodes with pdsh/ssh."""
    max_restarts: int = num(0, ge=0)
    """Start a failed launch again (a rank killed, out of memory, a lost node) up to this many times; it resumes
    from the newest complete checkpoint. torchrun: its ``--max-restarts``; deepspeed: the driver (``python
    train.py launcher=deepspeed``) loops; Slurm: the batch script loops over ``srun``. A config error (exit 2)
    is not retried."""
    stop_timeout_s: int = num(300, ge=1)
    """Seconds a launcher gives the ranks to save and exit after it forwards a stop signal (torchrun's
    ``--shutdown-timeout``), before it kills them; size it to a checkpoint save."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment presets (NCCL etc.) exported to every rank and logged at start. ``launcher/env=<fabric>``
    picks a preset; a single key is overridden with ``launcher.env.NCCL_DEBUG=INFO``."""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    """Slurm batch-script settings for ``launcher=slurm``."""


@dataclass
class FinetuneConfig:
    """Adapters over a pretrained model (``finetune=lora``), with Hugging Face ``peft``: the base weights stay
    frozen and only the low-rank updates train, so only they get gradients and optimizer state. The model to
    start from is ``model.pretrained_path``. ``ultrascale/model/adapters.py`` applies it; export writes the merged
    model and the adapter alone."""

    method: FinetuneMethod = FinetuneMethod.none
    """``none``: every parameter trains. ``lora``: LoRA adapters on ``target_modules``. ``qlora``: LoRA over a 4-bit
    NF4 base (bitsandbytes' CUDA kernels: a GPU with ``pip install bitsandbytes``; zero.stage<=2)."""
    r: int = num(16, ge=1)
    """Rank of each update ``B @ A`` (A: r x in, B: out x r). Adapter parameters grow linearly with it."""
    alpha: float = num(32.0, gt=0)
    """The update is scaled by alpha / r, so the step size does not change when r does (keep alpha = 2r)."""
    dropout: float = num(0.05, ge=0, lt=1)
    """Dropout on the adapter's input (the frozen path has none)."""
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Module names (the last part of the dotted name, as peft matches them) whose Linear layers get adapters;
    ``[all-linear]``: every Linear but the output head. Defaults cover a Llama/Qwen/Mistral decoder's attention
    and MLP (QLoRA's finding: adapters on every matmul beat attention-only at the same budget)."""
    modules_to_save: list[str] = field(default_factory=list)
    """Modules trained in full beside the adapters (e.g. ``[norm]``); a copy of each is saved with the adapter."""
    init_seed: int | None = num(None, ge=0)
    """Seed of the adapters' initial A matrices (B starts at zero, so the model starts as the base); defaults to
    ``train.seed``. Every rank and every ZeRO stage draws the same."""


@dataclass
class RootConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    stability: StabilityConfig = field(default_factory=StabilityConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    """``finetune=lora``: train adapters over ``model.pretrained_path`` instead of every weight."""
    output_dir: str = MISSING
    """Run directory: config, metrics, checkpoints and logs. Re-running with the same one auto-resumes."""
    dry_run: bool = False
    """Print the resolved DeepSpeed JSON, topology, parameter counts and tokens per step; do not train."""
    cluster: ClusterConfig | None = None
    """The hardware a dry run speaks for (``cluster=h100_8x``; each GPU recipe names its own): its GPU decisions,
    HBM per GPU and predicted step time, with ``launcher.nnodes`` x ``launcher.nproc_per_node`` of its nodes'
    GPUs. null: this machine. A real run reads the machine it runs on, whatever this says."""


@dataclass
class ClusterConfig:
    """The hardware a plan is for. Bandwidths are achieved bus bandwidths per GPU (what NCCL's busbw reports),
    not marketing peaks, because the time model divides bytes by them directly."""

    name: str = "h100_8x"
    """Preset name, shown in the plan's header."""
    card: str | None = "H100 SXM5 80GB"
    """The GPU, as a row of ``ultrascale.runtime.gpu.CARDS`` (or a torch device name): its compute capability and SMs
    decide the GPU levers (attention and loss kernels, activation checkpointing) a dry run states for it
    (``ultrascale.runtime.gpu.GpuInfo.from_cluster``). null: the ranks are CPUs (``cpu_local``)."""
    gpus_per_node: int = num(8, ge=1)
    """Accelerators per node: tensor parallelism stays inside one (it all-reduces twice per layer)."""
    nodes: int = num(1, ge=1)
    """Nodes; world size = gpus_per_node * nodes."""
    gpu_memory_gib: float = num(80.0, gt=0)
    """Device memory per accelerator (GiB) that a layout's peak must fit under."""
    reserved_gib: float = num(1.0, ge=0)
    """Memory the runtime takes before training allocates anything (CUDA context, NCCL/communicator buffers)."""
    host_memory_gib: float = num(2048.0, gt=0)
    """Host memory per node (GiB): ZeRO-Offload state must fit here, shared by the node's ranks."""
    peak_tflops: float = num(989.0, gt=0)
    """Dense 16-bit peak per accelerator (TFLOP/s); MFU is measured against it."""
    matmul_efficiency: float = num(0.55, gt=0, le=1)
    """Achieved fraction of peak for a training step's mix of matmuls and elementwise kernels."""
    intra_node_gbps: float = num(450.0, gt=0)
    """Achieved all-reduce bus bandwidth inside a node (GB/s per GPU; NVLink 4 ~ 450-480)."""
    inter_node_gbps: float = num(45.0, gt=0)
    """Achieved bus bandwidth across nodes (GB/s per GPU; 400 Gb/s InfiniBand per GPU ~ 45)."""
    host_link_gbps: float = num(25.0, gt=0)
    """Host<->device copy bandwidth (GB/s) used by offload."""
    intra_node_latency_us: float = num(10.0, ge=0)
    """Per-collective latency inside a node."""
    inter_node_latency_us: float = num(25.0, ge=0)
    """Per-collective latency across nodes."""
    measure_peak: bool = False
    """Measure ``peak_tflops`` on this machine at plan time (a timed matmul); for ``cluster=cpu_local``."""
    node_mtbf_hours: float = num(5000.0, gt=0)
    """Mean time between failures of one node (GPU, host, link); a job on N nodes fails N times as often. Llama 3
    405B's pretraining saw 466 interruptions in 54 days on 2,000 8-GPU nodes: about 5,600 hours a node. Sets the
    suggested checkpoint interval (Young/Daly)."""
    storage_write_gbps: float = num(2.0, gt=0)
    """Checkpoint write rate of one node to the shared file system (GB/s), all its ranks together."""


@dataclass
class SearchConfig:
    """What the planner enumerates. Every combination is validated with the same rules as ``train.py``."""

    enabled: bool = True
    """False: evaluate only the layout given by the parallel/zero/data/train groups (explain one config)."""
    zero_stages: list[int] = num(default_factory=lambda: [0, 1, 2, 3], ge=0, le=3)
    """ZeRO stages to try."""
    offload: bool = True
    """Also try optimizer (stage>=1) and parameter (stage 3) offload to the host."""
    recompute: list[str] = field(default_factory=lambda: ["none", "selective", "full"])
    """Activation checkpointing modes to try (``train.activation_checkpointing``: none, selective, full;
    true/false mean full/none). Selective is tried only where it can run (pp=tp=sp=ep=1)."""
    micro_batches: list[int] = num(default_factory=lambda: [1, 2, 4, 8], ge=1)
    """Micro-batch sizes to try; each must divide global_batch / dp."""
    tp: list[int] = num(default_factory=lambda: [1, 2, 4, 8], ge=1)
    """Tensor-parallel degrees to try (capped at gpus_per_node)."""
    pp: list[int] = num(default_factory=lambda: [1, 2, 4, 8], ge=1)
    """Pipeline degrees to try."""
    sp: list[int] = num(default_factory=lambda: [1, 2, 4, 8], ge=1)
    """Ulysses sequence-parallel degrees to try."""
    ep: list[int] = num(default_factory=lambda: [1, 2, 4, 8], ge=1)
    """Expert-parallel degrees to try (MoE models only)."""
    fragmentation: float = num(0.10, ge=0)
    """Headroom, as a fraction of the allocated peak, for allocator fragmentation."""
    overlap: float = num(0.8, ge=0, le=1)
    """Fraction of overlappable communication (DP/ZeRO buckets, prefetch) hidden behind compute."""
    recompute_overhead: float = num(1.0, ge=0)
    """Extra forward passes per step with activation checkpointing (1.0 = one full recompute)."""


@dataclass
class ScalingLawConfig:
    """A fitted Chinchilla loss surface L(N, D) = E + A/N^alpha + B/D^beta (N parameters, D training tokens).
    The fit decides the answer, so it is a config choice: ``budget=hoffmann`` or ``budget=besiroglu``."""

    name: str = "hoffmann"
    """Which fit, shown in the budget table."""
    E: float = num(1.6934, ge=0)
    """Irreducible loss (nats/token on the fit's data): no model reaches it."""
    A: float = num(406.4, gt=0)
    """Coefficient of the parameter term A/N^alpha."""
    B: float = num(410.7, gt=0)
    """Coefficient of the data term B/D^beta."""
    alpha: float = num(0.3392, gt=0)
    """Parameter exponent."""
    beta: float = num(0.2849, gt=0)
    """Data exponent."""


@dataclass
class BudgetConfig:
    """Inference-aware sizing (Sardana et al. 2024): the model size and training tokens that reach a loss for the
    least training + serving cost, printed beside the Chinchilla point. Give exactly one of ``train_flops``,
    ``train_gpu_hours`` or ``target_loss``; the first two set the loss bar as what Chinchilla would reach."""

    enabled: bool = False
    """Print the budget table instead of planning layouts (``budget=hoffmann|besiroglu`` turn it on)."""
    law: ScalingLawConfig = field(default_factory=ScalingLawConfig)
    """The loss surface both optima are read from."""
    train_flops: float | None = num(None, gt=0)
    """Training compute budget (FLOPs, 6·N·D): the bar is the loss of Chinchilla's model for it."""
    train_gpu_hours: float | None = num(None, gt=0)
    """Training budget in GPU-hours on ``cluster`` (at ``cluster.peak_tflops`` x the training MFU)."""
    target_loss: float | None = num(None, gt=0)
    """The loss to reach directly; must be above ``law.E``."""
    inference_tokens: float = num(0.0, ge=0)
    """Tokens served over the model's life (prompt + generated), each costing 2·N FLOPs."""
    train_mfu: float | None = num(None, gt=0, le=1)
    """Training MFU for GPU-hours; null = ``cluster.matmul_efficiency``."""
    inference_mfu: float | None = num(None, gt=0, le=1)
    """Serving MFU; null = the training MFU. Lower it (decoding is memory-bound) and inference FLOPs cost more,
    which shifts the optimum to smaller models: the optimum minimises GPU-hours, not FLOPs."""
    usd_per_gpu_hour: float | None = num(None, gt=0)
    """Price of one GPU-hour: adds a dollar row; null = no dollars."""


@dataclass
class PlanRootConfig(RootConfig):
    """Root for ``plan.py``: the training groups (the layout and model) plus the cluster and search."""

    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    top_n: int = num(10, ge=1)
    """Rows in the printed ranking."""
    output_json: str | None = None
    """Write the full result (every layout, its terms and any rejection reason) to this path."""
    plot: str | None = None
    """Write a PNG of the top layouts' memory breakdown against the GPU limit, with predicted tokens/s."""
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    """Inference-aware model size and training tokens for a budget and a serving volume (``budget=hoffmann``)."""


def register_configs() -> None:
    """Register the root schema so ``conf/train.yaml`` can start its defaults list with it."""
    cs = ConfigStore.instance()
    cs.store(name="ultrascale_schema", node=RootConfig)
    cs.store(name="ultrascale_plan_schema", node=PlanRootConfig)
