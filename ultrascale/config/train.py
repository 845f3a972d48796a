"""``conf/train/``: the run's length, evals, checkpoints and the training levers (compile, kernels,
recompute). Each lever's ``auto`` is decided in ``ultrascale/levers/decide.py``."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from ultrascale.config.fields import RANGE, Range, num

AUTO = "auto"


@dataclass(frozen=True)
class StepsOrAuto(Range):
    """A step count in range, or ``auto``: checked when the config is composed (``config/fields.check``), so
    ``train.checkpoint_interval=-1`` or ``=often`` fails there naming the key, as an int field's bound does."""

    def holds(self, v: Any) -> bool:
        return v == AUTO or (isinstance(v, int) and super().holds(v))

    def __str__(self) -> str:
        return f"{super().__str__()} (a number of steps), or {AUTO}"


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
    checkpoint_interval: int | str = field(default=50, metadata={RANGE: StepsOrAuto(ge=0)})
    """Save a checkpoint every N steps (0 = only at the end). ``auto``: the run measures its first save, the one
    after step 3 (``cost/save_interval.AUTO_FIRST_SAVE_STEP``; steps 2-3 give the step time, step 1 carries the
    warm-up) with its stall, size and, in the background, its write waited for; every rank takes the slowest
    rank's figures, and the interval is Young/Daly's sqrt(2 x stall x job MTBF) from them and
    ``train.node_mtbf_hours`` (at least one write and one step; ``cost/save_interval.from_saves``). It is logged
    with the figures, recorded in every later checkpoint's ``ultrascale_meta.json``, and a resume keeps it. Saves
    fall on its multiples; a short run's interval may exceed the run (the log says so), leaving the final save."""
    node_mtbf_hours: float | None = num(None, gt=0)
    """Mean time between failures of one node, in hours, for ``checkpoint_interval=auto`` (the job's is this over
    the nodes). Unset: the run's ``cluster.node_mtbf_hours`` when it names a cluster (GPU recipes do), else the
    cluster default, 5,000 h (Llama 3's fleet: ``config/cluster.py``). Set it to state this machine's; a tiny
    value gives a short interval (the tests plant one). The dry run's suggested interval reads it too."""
    eval_at_start: bool = False
    """Evaluate once before the first step of a run that starts from step 0 (not on a resume), logged at step 0:
    the before point of the held-out curve, which a fine-tune's figure needs (HF Trainer's ``eval_on_start``)."""
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
    copies through the driver's bounce buffer. ``auto``: pinned where there is a device to pin for (the rule is
    ``staging_mode`` in ``ultrascale/levers/decide.py``). Pinned memory cannot be swapped: it is the checkpoint's
    size per rank of locked host RAM (`python bench/checkpoint_stall.py --staging` measures both)."""
    log_interval: int = num(1, ge=1)
    """Log metrics every N steps."""
    seed: int = num(1234, ge=0)
    """Seeds weight init, data order and dropout. Same seed + same data = same run."""
    resume: str = "auto"
    """``auto`` (resume from the newest complete checkpoint in output_dir if any), ``never``, or a path."""
    activation_checkpointing: str = "auto"
    """Trade compute for activation memory (``ultrascale/model/recompute.py``). ``full``: each decoder layer is
    recomputed from its input in backward (a layer keeps only its input; one more forward). ``selective``:
    per-op, as torchtitan does: the matmuls' and the attention kernel's outputs are kept and norms, RoPE,
    activations and residual adds recomputed (a few elementwise kernels of recompute). ``none``: off. ``auto``
    (default): the least recompute whose predicted peak (``ultrascale/cost/memory.py``) fits the GPU's free memory,
    off on a CPU; the rule and its margin live in ``ultrascale/levers/``, and the banner prints the figures.
    ``true``/``false`` mean full/none."""
    universal_checkpoint: bool = False
    """Load checkpoints in DeepSpeed universal format (resume on a different world size / parallel layout)."""
    allow_schedule_change: bool = False
    """Resume even when ``optim.lr``, ``optim.sched.*`` or ``train.steps`` give the next update another lr than
    the schedule the checkpoint was on (the jump is logged). Off: such a resume is refused with the key and the
    fix, because a silently reshaped curve (a longer cosine) is a different run under the same name."""
    compile: bool = True
    """``torch.compile`` the model (``train.compile_scope``): fused elementwise kernels (norms, RoPE, SwiGLU),
    fewer passes over memory. On by default because a training run is long (`python bench/levers.py --levers
    compile`; figures in bench/README.md); the price is a compile inside the first step (logged), so short runs
    (demo, tests, SSD finetunes) set it false. The run's decisions (``ultrascale/levers/decide.py``) turn it off
    where it cannot run, and the banner says why."""
    compile_scope: CompileScope = CompileScope.layers
    """What ``train.compile`` compiles. ``layers`` (default): each decoder layer in place (regional compilation);
    the layers share one compiled graph, so the first step compiles one layer instead of tracing all of them.
    ``model``: the whole forward as one graph (DeepSpeed's ``engine.compile()``, fusing into the head and loss
    too). A compile-time trade at the same step rate (`python bench/levers.py --levers compile_layers`; figures in
    bench/README.md)."""
    fused_loss: bool = True
    """Compute the LM loss with a chunked linear cross-entropy (``ultrascale/model/loss.py``): the
    [tokens, vocab] logits never exist at once, which at a 49k vocabulary is the largest activation of a
    small model. Same loss and gradients as the plain path. Where it cannot run (the rule is in
    ``ultrascale/levers/decide.py``) the plain path is kept and the banner says why."""
    loss_chunk_tokens: int = num(0, ge=0)
    """Tokens per chunk of the chunked fused loss; 0: decided from the machine and the vocabulary by the rule in
    ``ultrascale/levers/`` (the banner prints the chunk and why)."""
    attention_kernel: AttentionKernel = AttentionKernel.auto
    """The attention kernel of training with ``model.attn_implementation=sdpa``. Packed rows holding several
    documents need attention that stops at each boundary; HF's sdpa spells that as a dense ``[b, 1, s, s]`` mask,
    which keeps SDPA off its FlashAttention kernel on a GPU (``ultrascale/model/flex.py`` says what it cost). ``flex``:
    FlexAttention with a block mask built once per forward from the position ids (causal AND same document AND
    the model's sliding window; ``ultrascale/model/flex.py``): tiles across documents and above the diagonal are
    skipped, no mask is materialized; one-document rows and decoding keep SDPA. ``blocks``: causal SDPA in query
    blocks (``train.attn_block_size``). ``sdpa``: HF's as configured. ``auto``: flex on a GPU that runs it when
    documents are masked, on a CPU the blocks for multi-document rows and SDPA's causal kernel for one-document
    rows (the rule and when each kernel cannot run are in ``ultrascale/levers/decide.py``; the banner says which
    and why). Forcing ``flex`` on a CPU trains through its slow reference implementation, for checking."""
    loss_kernel: LossKernel = LossKernel.auto
    """The fused loss's kernel (``train.fused_loss``). ``chunked``: ours (``ultrascale/model/loss.py``), any
    device, ``train.loss_chunk_tokens`` a chunk. ``liger``: liger-kernel's Triton fused linear cross-entropy (CUDA,
    ``pip install liger-kernel``; not in requirements.txt). ``auto``: liger on a GPU where it works, chunked
    otherwise (the rule is in ``ultrascale/levers/decide.py``; the banner says which and why)."""
    attn_block_size: int | None = num(None, ge=0)
    """With ``model.attn_implementation=sdpa``: run causal attention in query blocks of this many tokens, each
    block attending only to keys up to its own end, so the tiles the causal mask forbids are never computed
    (``ultrascale/model/attention.py``; same output as sdpa; `make bench-attention`). Unset (auto): on CPU, a
    block size decided from this CPU's matrix unit by the rule in ``ultrascale/levers/`` (measured by `python
    bench/bench_cpu_levers.py`); HF's sdpa on GPU, where it is not measured; a number forces it; 0 = off. Rows
    holding one document always take SDPA's causal kernel. The banner says when it is off and why."""
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
