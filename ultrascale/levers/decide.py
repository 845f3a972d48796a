"""What this run does, decided once: the layout, the ZeRO stage and every feature, each with its reason.

Validation, the DeepSpeed JSON builder, the engine builder, the banner, the trainer and the planner all
read the :class:`Decisions` record this module returns instead of re-deriving a rule from the config, so a
feature's "why not" is written in exactly one place (here) and a setting reaches the code that acts on it
by one road. No ``torch.distributed`` and no I/O but two readings :func:`decide` names; the accelerator is an
argument (``select_accelerator`` tells it for this machine, the planner passes the cluster's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ultrascale.config.recompute import AC_MODES, checkpointing_mode
from ultrascale.config.topology import Topology
from ultrascale.levers.hardware import (
    BLOCKS_PER_ROW,
    FLEX_MIN_CAPABILITY,
    MIN_BLOCK,
    auto_checkpointing,
    bf16_matmuls,
    cpu_attn_block,
    cpu_loss_chunk,
    gpu_loss_chunk,
    predicted_peaks,
)
from ultrascale.runtime.cpu import CpuInfo
from ultrascale.runtime.gpu import GpuInfo

if TYPE_CHECKING:
    import torch

    from ultrascale.config.data import DataConfig
    from ultrascale.config.precision import PrecisionConfig
    from ultrascale.config.root import RootConfig
    from ultrascale.config.train import TrainConfig


@dataclass(frozen=True)
class Choice:
    """One feature: on or off, the value it runs with, and the reason, in words for the banner."""

    on: bool
    why: str
    value: Any = None


@dataclass(frozen=True)
class Decisions:
    topo: Topology
    """The layout: world, dp, tp, pp, sp, ep."""
    zero_stage: int
    """What ``zero_optimization.stage`` is (the one place a consumer reads it from)."""
    zero3_init: Choice
    """Build the model partitioned (transformers' ``HfDeepSpeedConfig`` -> ``deepspeed.zero.Init``)."""
    optimizer_owner: Choice
    """``value``: ``torch`` (we build AdamW with decay groups and hand it over) or ``deepspeed`` (the JSON's)."""
    fused_loss: Choice
    """``value``: chunk tokens (None: chosen from the vocabulary at install)."""
    loss_kernel: Choice
    """``value``: the fused loss's implementation, ``chunked`` (ours, any device) or ``liger`` (liger-kernel's
    Triton fused linear cross-entropy, CUDA); off when the fused loss is."""
    activation_checkpointing: Choice
    """``value``: ``none``, ``selective`` (per-op: matmul and attention outputs saved, the rest recomputed) or
    ``full`` (each decoder layer recomputed from its input)."""
    attention: Choice
    """``value`` when on: the query block (int) of the blocked causal SDPA, or ``"flex"`` (FlexAttention)."""
    compile: Choice
    document_masking: Choice
    flat_batches: bool
    """Feed each micro-batch as one row (varlen flash attention sees document boundaries that way)."""
    step_breakdown: Choice
    """DeepSpeed's engine timers (``wall_clock_breakdown``)."""
    overlap_loss_reduce: Choice
    """The stability checks' loss all-reduce started before the last backward, waited for after it."""
    autocast: Choice
    """``value``: (device type, dtype) of the forward's autocast over fp32 weights, e.g. ``("cpu", "bf16")``."""
    moe: Choice
    """``value``: experts per MoE layer (0 for a dense model)."""
    moe_leaf_modules: bool
    """ZeRO-3 gathers each sparse-MoE block whole (set_z3_leaf_modules): experts replicated under ZeRO-3."""
    hf_config: Any = field(compare=False, repr=False, default=None)
    """The HF config the model is built from, built once."""
    gpu: GpuInfo | None = field(compare=False, default=None)
    """The GPU the levers were decided for (this rank's, or a planned cluster's); None on CPU ranks."""
    finetune: Choice = Choice(False, "full: every parameter trains (finetune=none)", "none")
    """``value``: ``none``, ``lora`` or ``qlora`` (``finetune.method``): adapters over a frozen pretrained model."""
    checkpoint_staging: Choice = Choice(False, "pageable (train.checkpoint_async=false)", "pageable")
    """``value``: where the background checkpoint writer's snapshot lands, ``pinned`` or ``pageable``
    (``train.checkpoint_staging``); off when checkpoints are written on the training thread."""
    rollout_weights: Choice = Choice(False, "no rollouts (grpo is off)", None)
    """GRPO: what the sampler generates with, ``value`` ``module`` (ZeRO-0/1/2: the engine's own module),
    ``whole`` or ``layer`` (ZeRO-3: a replica refreshed once a step from the partitions, gathered whole or a decoder
    layer at a time; ``grpo.rollout_gather``)."""

    @property
    def pipeline(self) -> bool:
        return self.topo.pp > 1

    def features(self) -> dict[str, Choice]:
        """Every on/off feature by name, for the banner and the dry run."""
        return {
            "loss": self.fused_loss,
            "ce kernel": self.loss_kernel,
            "act-ckpt": self.activation_checkpointing,
            "attention": self.attention,
            "compile": self.compile,
            "packing": self.document_masking,
            "timing": self.step_breakdown,
            "autocast": self.autocast,
            "zero3 init": self.zero3_init,
            "optimizer": self.optimizer_owner,
            "moe": self.moe,
            "finetune": self.finetune,
            **({"rollouts": self.rollout_weights} if self.rollout_weights.value else {}),
        }


def decide(cfg: RootConfig, topo: Topology, hf_config: Any, backend: str, cpu: CpuInfo | None = None,
           gpu: GpuInfo | None = None) -> Decisions:  # fmt: skip
    """The run's decisions from a validated config, its topology, the HF config, ``gloo``/``nccl`` and, for CPU
    ranks, the CPU (:func:`ultrascale.runtime.cpu.detect`; the CPU levers are pure functions of it). ``cpu=None``: a GPU,
    or a CPU whose features are unknown (the levers then keep their measured-elsewhere defaults and say so).
    ``gpu``: the GPU of an ``nccl`` run (:func:`ultrascale.runtime.gpu.detect`, or a planned cluster's
    :meth:`~ultrascale.runtime.gpu.GpuInfo.from_cluster`); the GPU levers are pure functions of it, and ``gpu=None``
    keeps their GPU-less defaults. Read from the environment: whether liger-kernel runs (only for a GPU, and only
    with ``train.loss_kernel`` auto or liger: :func:`liger_unusable`), and the host's memory for a GRPO run under
    ZeRO-3 on CPU ranks (:func:`_rollout_weights`)."""
    from ultrascale.model.moe import num_experts

    stage = cfg.zero.stage
    experts = num_experts(hf_config)
    attn = str(cfg.model.attn_implementation)
    gpu = gpu if backend == "nccl" else None
    attention = _attention(cfg, topo, hf_config, attn, backend, cpu, gpu)
    doc = _document_masking(cfg.data, topo, attn, flex=attention.value == "flex")
    fused = _fused_loss(cfg, topo, hf_config, backend, cpu, gpu)
    kernel = _loss_kernel(cfg.train, fused, gpu, backend)
    if kernel.value == "liger":
        fused = Choice(True, "fused linear cross-entropy (no [tokens, vocab] logits; train.fused_loss)", None)
    return Decisions(
        topo=topo,
        zero_stage=stage,
        zero3_init=_partitioned_build(stage, topo, experts),
        optimizer_owner=_optimizer_owner(cfg),
        fused_loss=fused,
        loss_kernel=kernel,
        activation_checkpointing=_activation_checkpointing(cfg, topo, hf_config, backend, gpu, fused),
        attention=attention,
        compile=_compile(cfg.train, topo, stage, experts),
        document_masking=doc,
        flat_batches=doc.on and attn.startswith("flash"),
        step_breakdown=_step_breakdown(cfg.train, topo, backend),
        overlap_loss_reduce=_overlap_loss_reduce(cfg.train, topo),
        autocast=_autocast(cfg.precision, topo, backend, cpu),
        moe=Choice(experts > 0, _moe_why(experts, topo), experts),
        moe_leaf_modules=experts > 0 and stage == 3 and topo.ep == 1,
        hf_config=hf_config,
        gpu=gpu,
        finetune=_finetune(cfg),
        checkpoint_staging=_checkpoint_staging(cfg.train, backend),
        rollout_weights=_rollout_weights(cfg, topo, hf_config, gpu),
    )


def _rollout_weights(cfg: RootConfig, topo: Topology, hf_config: Any, gpu: GpuInfo | None) -> Choice:
    """``grpo.rollout_gather``: under ZeRO-3 the sampler generates on a plain replica refreshed once a step (never a
    gather per generated token). Gathering the whole model at once is one collective but holds the gathered model
    beside the replica for a moment; a decoder layer at a time holds one layer. ``auto`` takes whole when the
    planner's memory model (:mod:`ultrascale.cost.decode`, :mod:`ultrascale.cost.memory`) fits the training state,
    the replica with its KV cache and the whole gather in the GPU's memory (CPU ranks: the host's, shared by the
    node's ranks); a mode that cannot fit is refused here with what to change."""
    g = getattr(cfg, "grpo", None)
    if g is None:
        return Choice(False, "no rollouts (grpo is off)", None)
    stage = int(cfg.zero.stage)
    if stage < 3:
        return Choice(True, f"the engine's module (ZeRO-{stage}: every rank holds the whole model; LoRA in the "
                            "forward)", "module")  # fmt: skip
    from ultrascale.config.grpo import RolloutGather
    from ultrascale.cost.decode import gather_bytes, replica_bytes
    from ultrascale.cost.layout import layout_from_cfg
    from ultrascale.cost.memory import DTYPE_BYTES, GIB, memory
    from ultrascale.model.arch import arch_from_hf

    arch = arch_from_hf(hf_config)
    lay = layout_from_cfg(cfg, topo.world)
    dtype = str(cfg.precision.dtype)
    train = memory(arch, lay).total
    if g.beta > 0 and getattr(getattr(cfg, "finetune", None), "method", "none") == "none":
        train += arch.total_params * DTYPE_BYTES[dtype] / topo.dp  # the frozen reference, partitioned
    replica = replica_bytes(arch, dtype, max(g.sampler_batch_size, g.num_generations), cfg.data.seq_len)
    if gpu is not None:
        cap = float(gpu.available_bytes)
        where = f"the GPU's {cap / GIB:.1f} GiB"
    else:
        import psutil

        ranks = max(1, min(int(cfg.launcher.nproc_per_node), topo.world))
        cap = psutil.virtual_memory().total / ranks
        where = f"this host's memory / {ranks} rank(s), {cap / GIB:.1f} GiB"
    need = {w: train + replica + gather_bytes(arch, dtype, whole=w == "whole") for w in ("whole", "layer")}
    said = (f"training state {train / GIB:.2f} + replica and KV cache {replica / GIB:.2f} + gather "
            f"{{:.2f}} GiB of {where}")  # fmt: skip
    asked = RolloutGather(g.rollout_gather)
    fits = {w: need[w] <= cap for w in need}
    mode = ("whole" if fits["whole"] else "layer") if asked == RolloutGather.auto else asked.value
    line = said.format((need[mode] - train - replica) / GIB)
    if not fits[mode]:
        from ultrascale.errors import ConfigError

        raise ConfigError(f"grpo.rollout_gather={asked.value} under zero.stage=3 does not fit: {line}: use more "
                          "ranks, zero.offload_optimizer=cpu, a smaller grpo.sampler_batch_size or data.seq_len"
                          + ("" if mode == "layer" else ", or grpo.rollout_gather=layer"))  # fmt: skip
    how = {"whole": "gathered whole", "layer": "gathered a decoder layer at a time"}[mode]
    why = f"grpo.rollout_gather={asked.value}"
    if asked == RolloutGather.auto:
        why += ": the whole gather fits" if mode == "whole" else ": the whole gather does not fit"
    return Choice(True, f"a replica refreshed once a step from the ZeRO-3 partitions, {how} ({why}; {line})", mode)


def _finetune(cfg: RootConfig) -> Choice:
    """``finetune.method``: what trains. Validation refuses what cannot run (no pretrained model, pp/tp/sp/ep>1,
    QLoRA without CUDA and bitsandbytes); this only says what runs."""
    f = getattr(cfg, "finetune", None)
    method = str(f.method) if f is not None else "none"
    if method == "none":
        return Choice(False, "full: every parameter trains (finetune=none)", "none")
    targets = ",".join(str(t) for t in f.target_modules)
    saved = f", {','.join(str(m) for m in f.modules_to_save)} trained in full" if f.modules_to_save else ""
    base = "frozen 4-bit NF4 base (bitsandbytes)" if method == "qlora" else "frozen base"
    return Choice(True, f"{method}: r={f.r} alpha={f.alpha:g} dropout={f.dropout:g} on {targets}{saved}; {base} "
                        f"from {cfg.model.pretrained_path}: only adapter weights get gradients and optimizer state "
                        f"(finetune={method})", method)  # fmt: skip


STAGING_MODES = ("auto", "pinned", "pageable")


def staging_mode(requested: str, cuda: bool) -> str:
    """``train.checkpoint_staging`` as it runs: ``auto`` is pinned where CUDA is, pageable elsewhere; pinned
    without CUDA is pageable too (there is no DMA engine to pin for). The run's decision asks it with the
    backend (:func:`_checkpoint_staging`); :class:`ultrascale.train.ckpt_writer.Staging` with the device at hand."""
    if requested not in STAGING_MODES:
        raise ValueError(f"checkpoint staging {requested!r}: expected one of {', '.join(STAGING_MODES)}")
    return "pinned" if requested in ("auto", "pinned") and cuda else "pageable"


def _checkpoint_staging(train: TrainConfig, backend: str) -> Choice:
    """``train.checkpoint_staging`` on this run's device (an ``nccl`` run has CUDA)."""
    requested = str(train.checkpoint_staging)
    mode = staging_mode(requested, cuda=backend == "nccl")
    if not train.checkpoint_async:
        return Choice(False, f"{mode}, unused: every rank writes on the training thread (train.checkpoint_async=false)",
                      mode)  # fmt: skip
    how = "page-locked buffers, non-blocking copies" if mode == "pinned" else "ordinary buffers, blocking copies"
    return Choice(True, f"{mode} host buffers for the background writer ({how}; train.checkpoint_staging="
                        f"{requested})", mode)  # fmt: skip


def _partitioned_build(stage: int, topo: Topology, experts: int) -> Choice:
    """Which parameters are built partitioned (``deepspeed.zero.Init``); ``value``: ``all`` (ZeRO-3) or
    ``experts`` (ZeRO-1/2 with AutoEP: only the routed experts, which AutoEP gathers one layer at a time and keeps
    this rank's 1/ep of; the rest is made whole right after the build, as ZeRO-1/2 hold it)."""
    if stage == 3:
        return Choice(True, "ZeRO-3: every rank builds only its shard", "all")
    if experts and topo.ep > 1 and topo.pp == 1:
        return Choice(True, f"the routed experts only: built partitioned over the {topo.world} ranks, then AutoEP "
                            f"gathers one layer at a time and keeps this rank's {experts // topo.ep} of {experts}; "
                            f"the dense part is made whole after the build (ZeRO-{stage} replicates it)",
                      "experts")  # fmt: skip
    return Choice(False, f"ZeRO-{stage}: every rank builds the whole model (ZeRO-{stage} holds the weights whole)")


def _optimizer_owner(cfg: RootConfig) -> Choice:
    o = cfg.optim
    if o.name == "muon":
        return Choice(True, "DeepSpeed's MuonWithAuxAdam (optim=muon)", "deepspeed")
    if cfg.zero.offload_optimizer != "none":
        return Choice(True, "DeepSpeedCPUAdam (zero.offload_optimizer=cpu: the step runs on the host)", "deepspeed")
    if not o.torch_adam:
        return Choice(True, "DeepSpeed's AdamW (optim.torch_adam=false)", "deepspeed")
    fused = ", fused" if o.fused else ""
    return Choice(True, f"torch AdamW{fused}, no decay on norms/biases", "torch")


def _fused_loss(cfg: RootConfig, topo: Topology, hf_config: Any, backend: str, cpu: CpuInfo | None,
                gpu: GpuInfo | None = None) -> Choice:  # fmt: skip
    if not cfg.train.fused_loss:
        return Choice(False, "plain HF cross-entropy (train.fused_loss=false)")
    if topo.pp > 1:
        return Choice(False, "plain HF cross-entropy (the pipeline's last stage computes its own loss)")
    if topo.sp > 1:
        return Choice(False, "plain HF cross-entropy (sequence parallelism sums per-shard losses itself)")
    if topo.tp > 1:
        return Choice(False, "plain HF cross-entropy (AutoTP shards the LM head)")
    if why := loss_unfit(hf_config):
        return Choice(False, f"plain HF cross-entropy ({why})")
    what = "chunked linear cross-entropy (no [tokens, vocab] logits; train.fused_loss)"
    if cfg.train.loss_chunk_tokens:
        return Choice(True, f"{what}, {cfg.train.loss_chunk_tokens} tokens a chunk (train.loss_chunk_tokens)",
                      int(cfg.train.loss_chunk_tokens))  # fmt: skip
    if backend == "gloo" and cpu is not None:
        chunk, why = cpu_loss_chunk(cpu, int(hf_config.vocab_size), bf16_matmuls(cfg.precision, cpu))
        return Choice(True, f"{what}, {chunk} tokens a chunk ({why})", chunk)
    if gpu is not None:
        chunk, why = gpu_loss_chunk(gpu, int(hf_config.vocab_size))
        return Choice(True, f"{what}, {chunk} tokens a chunk ({why})", chunk)
    from ultrascale.model.loss import CHUNK_BUDGET_BYTES

    return Choice(True, f"{what}, chunk from the vocabulary's {CHUNK_BUDGET_BYTES >> 20} MiB logit budget", None)


def loss_unfit(hf_config: Any) -> str | None:
    """Why a model's loss is not cross-entropy of its plain head's output, which the fused path computes (None: it
    is). From ``model/loss.py``'s facts; ``install_fused_loss`` acts on this decision and checks none of it."""
    from ultrascale.model.loss import LOGIT_TRANSFORMS, VERIFIED_MODEL_TYPES
    from ultrascale.model.moe import num_experts

    if num_experts(hf_config):
        return "MoE: the forward adds the router loss"
    for key in LOGIT_TRANSFORMS:
        if (value := getattr(hf_config, key, None)) not in (None, 1):
            return f"{hf_config.model_type} sets {key}={value}, which changes the logits the loss sees"
    if hf_config.model_type not in VERIFIED_MODEL_TYPES:
        return (f"model_type {hf_config.model_type!r} is not verified to compute cross-entropy of its plain "
                f"lm_head output (verified: {', '.join(sorted(VERIFIED_MODEL_TYPES))})")  # fmt: skip
    return None


def _attention(cfg: RootConfig, topo: Topology, hf_config: Any, attn: str, backend: str, cpu: CpuInfo | None,
               gpu: GpuInfo | None = None) -> Choice:  # fmt: skip
    """``train.attention_kernel``; ``value``: the blocked SDPA's query block (int) or ``"flex"``. Reads the GPU
    only through ``gpu.capability``. A forced kernel that cannot run raises (:func:`_refuse_forced_attention`);
    ``auto`` falls back with the reason."""
    kernel = str(cfg.train.attention_kernel)
    configured = f"HF {attn} as configured"
    if kernel in ("flex", "blocks"):
        _refuse_forced_attention(cfg, topo, hf_config, attn, kernel)
    if kernel == "sdpa":
        return Choice(False, f"{configured} (train.attention_kernel=sdpa)")
    if kernel == "flex":
        return _flex(cfg.data, backend, "train.attention_kernel=flex")
    if kernel == "auto" and backend != "gloo" and not cfg.train.attn_block_size:
        why = _flex_unfit(cfg.data, topo, hf_config, attn, gpu)
        if why:
            return Choice(False, f"{configured} ({why})")
        major, minor = tuple(gpu.capability)
        return _flex(cfg.data, backend, f"train.attention_kernel=auto: CUDA, sm_{major}{minor}, documents masked")
    return _blocks(cfg, topo, hf_config, attn, backend, cpu, forced=kernel == "blocks")


def _flex(data: DataConfig, backend: str, reason: str) -> Choice:
    why = (f"FlexAttention where a row holds several documents (block mask from the position ids, built once per "
           f"forward; no dense s x s mask; {reason}); one-document rows and decoding take SDPA")  # fmt: skip
    if not data.document_masking:
        why += " (data.document_masking=false: no row has document boundaries, so every row does)"
    if backend == "gloo":
        why += ("; on CPU it trains through FlexAttention's reference implementation (torch has no CPU backward "
                "kernel): for checking, slower than the blocks")  # fmt: skip
    return Choice(True, why, "flex")


def attention_unfit(hf_config: Any, attn: str) -> str | None:
    """Why a model cannot run the blocked attention or FlexAttention (None: it can). Both keep HF's masks exactly
    only for causal decoders whose masks come from HF's causal (or sliding-window) mask builder
    (:data:`ultrascale.model.attention.CAUSAL_MODEL_TYPES`, a fact of the model code); the installers act on this
    decision and check nothing themselves."""
    from ultrascale.model.attention import CAUSAL_MODEL_TYPES

    if attn != "sdpa":
        return f"model.attn_implementation={attn}; the blocks and FlexAttention replace sdpa only"
    if hf_config.model_type not in CAUSAL_MODEL_TYPES:
        return f"model_type {hf_config.model_type!r} is not in the causal-mask list of ultrascale/model/attention.py"
    return None


def _refuse_forced_attention(cfg: RootConfig, topo: Topology, hf_config: Any, attn: str, kernel: str) -> None:
    """A forced ``train.attention_kernel`` (flex, blocks) on a run that cannot take it: ``auto`` falls back by
    itself with the reason in the banner, but a kernel the user named must run or say why not."""
    from ultrascale.errors import ConfigError
    from ultrascale.model.attention import CAUSAL_MODEL_TYPES

    key = f"train.attention_kernel={kernel}"
    fix = "use train.attention_kernel=auto"
    if topo.pp > 1:
        raise ConfigError(
            f"{key} needs parallel.pp=1 (got {topo.pp}): the pipeline stages build their own masks; {fix}"
        )
    if topo.sp > 1:
        raise ConfigError(f"{key} needs parallel.sp=1 (got {topo.sp}): Ulysses wraps the attention core; {fix}")
    if attn != "sdpa":
        raise ConfigError(
            f"{key} replaces model.attn_implementation=sdpa (got {attn}): set model.attn_implementation=sdpa, or {fix}"
        )
    if hf_config.model_type not in CAUSAL_MODEL_TYPES:
        raise ConfigError(
            f"{key} needs a causal text decoder (one of {sorted(CAUSAL_MODEL_TYPES)}), got model.type="
            f"{cfg.model.type}: {fix}"
        )
    if kernel == "blocks" and cfg.train.attn_block_size == 0:
        raise ConfigError(
            f"{key} with train.attn_block_size=0 asks for blocks of nothing: unset train.attn_block_size or set a size"
        )
    dropout = float(getattr(hf_config, "attention_dropout", 0.0) or 0.0)
    if kernel == "flex" and dropout > 0:
        raise ConfigError(
            f"{key} has no attention dropout (model.config.attention_dropout={dropout}): set it to 0, or {fix}"
        )


def _flex_unfit(data: DataConfig, topo: Topology, hf_config: Any, attn: str, gpu: GpuInfo | None) -> str | None:
    """Why ``auto`` keeps HF's sdpa on a GPU (None: FlexAttention fits)."""
    if topo.pp > 1:
        return "the pipeline stages build their own masks"
    if topo.sp > 1:
        return "Ulysses wraps the attention core"
    why = attention_unfit(hf_config, attn)
    if why:
        return why
    if not data.document_masking:
        return "data.document_masking=false: no document boundaries to mask, SDPA's causal kernel is FlashAttention"
    if gpu is None:
        return "no GPU description: FlexAttention is chosen by the GPU's compute capability"
    major, minor = tuple(gpu.capability)
    if (major, minor) < FLEX_MIN_CAPABILITY:
        return f"{gpu.name} is sm_{major}{minor}: FlexAttention's kernels want sm_80 or later"
    return None


def _blocks(cfg: RootConfig, topo: Topology, hf_config: Any, attn: str, backend: str, cpu: CpuInfo | None,
            forced: bool) -> Choice:  # fmt: skip
    """The causal SDPA by query blocks (``train.attention_kernel=blocks``, and ``auto`` on a CPU)."""
    block = cfg.train.attn_block_size
    configured = f"HF {attn} as configured"
    reason = "train.attn_block_size"
    if block is None:
        if backend != "gloo" and not forced:
            return Choice(False, f"{configured} (train.attn_block_size unset: the blocks are measured on CPU only)")
        if backend == "gloo":
            block, reason = cpu_attn_block(cpu or CpuInfo(), int(cfg.data.seq_len), bf16_matmuls(cfg.precision, cpu))
        else:
            n = BLOCKS_PER_ROW["fp32"]
            block, reason = max(MIN_BLOCK, -(-int(cfg.data.seq_len) // n)), f"train.attention_kernel=blocks, {n} a row"
    if not block:
        return Choice(False, f"{configured} (train.attn_block_size=0)")
    if topo.pp > 1:
        return Choice(False, f"{configured} (the pipeline stages build their own masks; train.attn_block_size unused)")
    if topo.sp > 1:
        return Choice(False, f"{configured} (Ulysses wraps the attention core; train.attn_block_size unused)")
    why = attention_unfit(hf_config, attn)
    if why:
        return Choice(False, f"{configured} ({why})")
    return Choice(True, f"causal SDPA in query blocks of {block} where a row holds several documents (upper-triangle "
                        f"tiles skipped; {reason}); one-document rows take SDPA's causal kernel", block)  # fmt: skip


def _compile(train: TrainConfig, topo: Topology, stage: int, experts: int) -> Choice:
    if not train.compile:
        return Choice(False, "off (train.compile=false)")
    if topo.pp > 1:
        return Choice(False, "off (not with the pipeline engine; eager)")
    if topo.tp > 1 or topo.sp > 1 or topo.ep > 1:
        return Choice(False, "off (not with AutoTP/Ulysses/AutoEP module rewrites; eager)")
    if experts:
        return Choice(False, "off (MoE routing is data-dependent; eager)")
    if stage == 3:
        return Choice(False, "off (ZeRO-3's per-module gather hooks would split the graph; eager)")
    scope = str(train.compile_scope)
    what = "each decoder layer (one shared graph)" if scope == "layers" else "the whole model"
    return Choice(True, f"torch.compile (inductor) of {what} at the first step (train.compile_scope={scope})", scope)


def _document_masking(data: DataConfig, topo: Topology, attn: str, flex: bool = False) -> Choice:
    """Ulysses discards 4-D masks, so with sp>1 only flash attention keeps documents apart."""
    if not data.document_masking:
        return Choice(False, "off: packed rows are one text (data.document_masking=false)")
    if topo.sp > 1 and not attn.startswith("flash"):
        return Choice(False, f"off: Ulysses sp={topo.sp} drops {attn} masks (use flash_attention_2 for it)")
    how = "varlen kernel, micro-batch as one row" if attn.startswith("flash") else f"{attn} block-diagonal mask"
    if flex:
        how = "FlexAttention block mask, no dense s x s mask"
    return Choice(True, f"on: positions restart at EOS, no cross-document attention ({how})")


def _overlap_loss_reduce(train: TrainConfig, topo: Topology) -> Choice:
    if not train.overlap_loss_reduce:
        return Choice(False, "loss all-reduce before the last backward (train.overlap_loss_reduce=false)")
    if topo.pp > 1:
        return Choice(False, "the pipeline judges its last stages' loss inside train_batch, before the update")
    return Choice(True, "loss all-reduce overlapped with the last backward")


def _autocast(p: PrecisionConfig, topo: Topology, backend: str, cpu: CpuInfo | None) -> Choice:
    bf16_native = cpu is None or cpu.bf16_native  # cpu=None: a GPU
    if p.autocast == "none":
        if backend == "gloo" and cpu is not None and cpu.bf16_native and p.dtype == "fp32":
            return Choice(False, f"off (precision.autocast=none): this CPU has {cpu.matrix_unit}, which "
                                 "precision.autocast=bf16 puts the matmuls on")  # fmt: skip
        return Choice(False, "off (precision.autocast=none)")
    if topo.pp > 1:
        return Choice(False, "off: the pipeline engine runs its stages' forwards itself (pp>1)")
    if not bf16_native and not p.autocast_emulated:
        return Choice(False, "off: this CPU has no native bf16 (AVX-512 BF16 or AMX): torch would emulate it, "
                             "slower than fp32 (precision.autocast_emulated=true runs it anyway)")  # fmt: skip
    device = "cpu" if backend == "gloo" else "cuda"
    why = f"{p.autocast} autocast of the forward on {device}, fp32 weights, gradients and Adam"
    if not bf16_native:
        why += " (emulated: this CPU has no native bf16, slower than fp32; precision.autocast_emulated=true)"
    return Choice(True, why, (device, str(p.autocast)))


def _step_breakdown(train: TrainConfig, topo: Topology, backend: str) -> Choice:
    """``value``: how DeepSpeed's engine timers are read. On a GPU they are CUDA events, and DeepSpeed reads every
    one (a wait on its end event) after every micro-step; ``events`` reads them only for a logged row
    (:class:`ultrascale.train.breakdown.StepBreakdown`)."""
    if not train.step_breakdown:
        return Choice(False, "off (train.step_breakdown=false): data wait and step time only")
    if topo.pp > 1:  # DeepSpeed 0.19.8: the pipeline's backward restarts a micro timer the base engine started
        return Choice(False, "data wait and step time only (the pipeline engine cannot run DeepSpeed's timers)")
    if backend == "nccl":
        return Choice(True, "on (DeepSpeed engine timers as CUDA events, read only for a logged row: one wait for "
                            f"that step's update every train.log_interval={train.log_interval} steps, no "
                            "synchronisation in the steps between)", "events")  # fmt: skip
    return Choice(True, "on (DeepSpeed engine timers, host clocks)", "host")


def _moe_why(experts: int, topo: Topology) -> str:
    if not experts:
        return "dense model"
    if topo.ep > 1:
        return f"AutoEP ep={topo.ep}: {experts // topo.ep} of {experts} experts per rank"
    return f"{experts} experts per layer, replicated"


def liger_unusable(gpu: GpuInfo) -> str | None:
    """Why liger-kernel cannot run for ``gpu`` (None: it can): not installed, its import fails, or (a GPU of this
    machine, ``gpu.index`` set) a one-row trial fails there. Read from the environment once per process
    (:func:`ultrascale.model.loss.kernel_unusable`); a planned cluster's GPU gets the import check only."""
    from ultrascale.model.loss import kernel_unusable

    return kernel_unusable("liger", None if gpu.index is None else f"cuda:{gpu.index}")


def _loss_kernel(train: TrainConfig, fused: Choice, gpu: GpuInfo | None, backend: str) -> Choice:
    """``train.loss_kernel``: liger-kernel's fused linear cross-entropy where it runs on a GPU (``auto``) or is
    asked for; our chunked one otherwise, with liger's reason (:func:`liger_unusable`, asked only here). A named
    ``liger`` that cannot run is one error line; ``auto`` falls back by itself."""
    from ultrascale.errors import ConfigError

    want = str(train.loss_kernel)
    if want == "liger" and backend == "gloo":
        raise ConfigError(
            "train.loss_kernel=liger needs CUDA (liger-kernel's kernels are Triton): use train.loss_kernel=auto "
            "or chunked on CPU"
        )
    if not fused.on:
        if want == "liger":
            raise ConfigError(f"train.loss_kernel=liger is the fused loss's kernel, but the fused loss is off: "
                              f"{fused.why}; use train.loss_kernel=auto")  # fmt: skip
        return Choice(False, "off (no fused loss)", None)
    if want == "chunked":
        return Choice(True, "chunked (train.loss_kernel=chunked)", "chunked")
    if gpu is None:
        if want == "liger":  # a planned cluster without a GPU description: as configured
            return Choice(True, "liger-kernel's Triton fused linear cross-entropy (train.loss_kernel=liger)", "liger")
        return Choice(True, "chunked (auto: liger-kernel runs on CUDA only)", "chunked")
    why = liger_unusable(gpu)
    if why is None:
        return Choice(True, f"liger-kernel's Triton fused linear cross-entropy (train.loss_kernel={want})", "liger")
    if want == "liger":
        raise ConfigError(f"train.loss_kernel=liger cannot run: {why}, or use train.loss_kernel=auto")
    return Choice(True, f"chunked (auto: {why})", "chunked")


def selective_unavailable(topo: Topology) -> str | None:
    """Why per-op selective checkpointing cannot run with this layout (None: it can). The pipeline engine
    checkpoints whole layers itself; under AutoTP, Ulysses and AutoEP the layers' collectives sit between the
    saved matmuls, a combination not tested here."""
    if topo.pp > 1:
        return "the pipeline engine checkpoints whole layers (pp>1)"
    if topo.tp > 1 or topo.sp > 1 or topo.ep > 1:
        return "not with AutoTP/Ulysses/AutoEP (tp/sp/ep>1): their collectives inside a layer are untested under it"
    return None


def _activation_checkpointing(cfg: RootConfig, topo: Topology, hf_config: Any, backend: str, gpu: GpuInfo | None,
                              fused: Choice) -> Choice:  # fmt: skip
    """``train.activation_checkpointing``: a forced mode that cannot run here is refused (selective where its
    per-op policy cannot run); ``auto`` sizes it from the GPU's memory and skips what cannot run."""
    mode = checkpointing_mode(cfg.train.activation_checkpointing)
    unfit = selective_unavailable(topo) if mode == "selective" else None
    if unfit:
        from ultrascale.errors import ConfigError

        raise ConfigError(f"train.activation_checkpointing=selective is not available: {unfit}; use full (or auto)")
    what = {"none": "off", "selective": "selective per-op: matmul and attention outputs saved, norms and "
            "activations recomputed", "full": "full: each decoder layer recomputed from its input in backward"}  # fmt: skip
    if mode != "auto":
        return Choice(mode != "none", f"{what[mode]} (train.activation_checkpointing={mode})", mode)
    if backend == "gloo":
        return Choice(False, "off (train.activation_checkpointing=auto decides from a GPU's memory; a CPU run "
                             "keeps it off: set selective or full to trade compute for memory)", "none")  # fmt: skip
    if gpu is None:
        return Choice(False, "off (train.activation_checkpointing=auto: no GPU described to size it for)", "none")
    modes = tuple(m for m in AC_MODES if m != "selective" or not selective_unavailable(topo))
    mode, why = auto_checkpointing(predicted_peaks(cfg, topo, hf_config, fused.on, fused.value, modes), gpu)
    return Choice(mode != "none", f"{what[mode]} ({why})", mode)


# ---- generation (ultrascale/generate/): asked once per Sampler, not part of a training run's Decisions ----------
STATIC_CHOICES = ("auto", "on", "eager", "off")


def decide_autocast(model: Any, asked: str = "none") -> tuple[tuple[str, torch.dtype] | None, str]:
    """Whether the sampler's forward runs under bf16 autocast, decided once as training decides
    ``precision.autocast``: only when asked (``bf16``; it changes greedy tokens against fp32, so it is never the
    default), and only where the hardware computes bf16 natively (a CUDA GPU with bf16, a CPU with AVX-512 BF16
    or AMX). (setting, why)."""
    import torch

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


def decide_static(device: torch.device, asked: str, plain_head: bool, sdpa: bool) -> tuple[bool, bool, str]:
    """The sampler's (static cache on, CUDA graphs on, why), decided once per sampler.

    ``auto``: on CUDA both (the step is launch-bound there); on CPU neither, since a CPU has no launches to save
    and the dynamic path's prompt-lookup drafting decodes several tokens per step (``make bench-generate``
    measures both). ``on``: the static cache, with graphs where CUDA is. ``eager``: the static cache, no graphs.
    The static step computes the head itself and hands SDPA a boolean mask, so it needs both."""
    if asked not in STATIC_CHOICES:
        raise ValueError(f"static={asked!r}: choose one of {', '.join(STATIC_CHOICES)}")
    if asked == "off":
        return False, False, "off (static=off)"
    if not (plain_head and sdpa):
        return False, False, ("off: the static step needs a causal LM whose logits are a plain head product "
                              "and SDPA attention (the dynamic path serves this model)")  # fmt: skip
    cuda = device.type == "cuda"
    if asked == "eager":
        return True, False, "static cache, eager steps (static=eager)"
    if cuda:
        return True, True, "static cache + CUDA graphs per power-of-two bucket (decoding is launch-bound on a GPU)"
    if asked == "on":
        return True, False, "static cache, eager steps (CPU: no CUDA graphs)"
    return False, False, ("off on CPU: no kernel launches to save, and the dynamic path drafts several tokens "
                          "per step (static=on runs the static cache here)")  # fmt: skip
