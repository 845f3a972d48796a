"""Per-rank memory: each term separately, in bytes, for one layout.

Model states follow what DeepSpeed 0.19 actually allocates (measured by ``tests/test_plan_model_states.py``
against the engine's own tensors), not the textbook alone; activations are counted tensor by tensor from what HF
decoder layers save for backward (``tests/test_plan_activations.py``). The per-stage table of model states and
the per-tensor activation formulas: ultrascale/plan/README.md, "The memory model".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cache

from ultrascale.config.recompute import checkpointing_mode
from ultrascale.model.arch import Arch
from ultrascale.model.flops import attention_span

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GIB = 2**30


@dataclass(frozen=True)
class Layout:
    """One candidate: everything the memory and time models read besides the model and cluster."""

    world: int
    tp: int = 1
    pp: int = 1
    sp: int = 1
    ep: int = 1
    zero_stage: int = 1
    offload_optimizer: bool = False
    offload_param: bool = False
    activation_checkpointing: str = "none"
    """``none``, ``selective`` or ``full`` (booleans mean full/none, as ``train.activation_checkpointing``)."""
    micro_batch: int = 1
    global_batch: int = 1
    seq_len: int = 2048
    dtype: str = "bf16"
    attn: str = "sdpa"
    overlap_comm: bool = True
    reduce_bucket_size: int = 50_000_000
    allgather_bucket_size: int = 50_000_000
    prefetch_bucket_size: int = 50_000_000
    persistence_threshold: int = 100_000
    fused_loss: bool = False
    """The chunked linear cross-entropy (``Decisions.fused_loss``): no [tokens, vocab] logits are kept."""
    loss_chunk_tokens: int = 0
    """Tokens per fused-loss chunk (0: chosen from the vocabulary, as the loss does)."""
    trainable_params: int | None = None
    """Parameters that train (``finetune=lora``: the adapters, ``ultrascale.model.adapters.planned_params``); only
    they have gradients, fp32 master copies and Adam moments. None: every parameter trains."""

    def __post_init__(self) -> None:
        mode = checkpointing_mode(self.activation_checkpointing)
        if mode == "auto":
            raise ValueError("Layout.activation_checkpointing=auto: decide it first (ultrascale.levers.decide)")
        object.__setattr__(self, "activation_checkpointing", mode)

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.sp)

    @property
    def recomputes(self) -> bool:
        """Activation checkpointing of either kind (a recompute pass in backward, one layer at a time)."""
        return self.activation_checkpointing != "none"

    @property
    def grad_accum(self) -> int:
        return max(1, self.global_batch // (self.micro_batch * self.dp))


@dataclass(frozen=True)
class Memory:
    """Bytes per rank on the accelerator, by term; ``host`` is what offload moves to CPU memory."""

    params: float
    grads: float
    optimizer: float
    step_transient: float
    activations: float
    activation_peak_extra: float
    buffers: float
    fragmentation: float
    reserved: float
    host: float

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return (
            self.model_states
            + max(self.step_transient, self.activations + self.activation_peak_extra)
            + self.buffers
            + self.fragmentation
            + self.reserved
        )

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "model_states": self.model_states, "total": self.total}


def rank_params(arch: Arch, lay: Layout) -> tuple[float, float]:
    """(dense, expert) parameters held by the heaviest rank before ZeRO: TP/PP divide, EP divides experts."""
    per_layer_dense = (arch.dense_params - arch.embed_params - arch.lm_head_params) / arch.layers
    per_layer_expert = arch.expert_params / arch.layers
    layers = -(-arch.layers // lay.pp)
    if lay.pp == 1:
        ends = arch.embed_params + arch.lm_head_params
    else:  # the heavier end stage: the input embedding (with a tied head) or an untied head
        ends = max(arch.embed_params, arch.lm_head_params)
    dense = (layers * per_layer_dense + ends) / lay.tp
    expert = layers * per_layer_expert / (lay.tp * lay.ep)
    return dense, expert


def zero_group(lay: Layout) -> int:
    """Ranks ZeRO shards over: dp, times sp because DeepSpeed partitions over the sequence-data-parallel group."""
    return lay.dp * lay.sp


def model_state_bytes(arch: Arch, lay: Layout, rank: int | None = None) -> dict[str, float]:
    """params / grads / optimizer / step_transient on the device, and host bytes, for ``rank`` of the ZeRO
    group (None: the heaviest rank)."""
    w = DTYPE_BYTES[lay.dtype]
    dense, expert = rank_params(arch, lay)
    psi = dense + expert
    n_dense, n_exp = zero_group(lay), max(1, zero_group(lay) // lay.ep)
    shard = dense / n_dense + expert / n_exp  # this rank's ZeRO partition
    master = 4  # DeepSpeed keeps an fp32 partition copy even when the weights are fp32 (stage >= 1)
    st = lay.zero_stage
    if lay.trainable_params is not None:  # adapters: the frozen base has weights only (tp = pp = ep = 1)
        return _adapter_state_bytes(lay, w, psi, shard, float(lay.trainable_params), arch)
    if st == 0:
        params, grads = w * psi, w * psi
        optim = (8 + (4 if w < 4 else 0)) * psi
        transient = 0.0
    else:
        if st == 3:
            persistent = _persistent_params(arch, lay)
            params = w * (shard + persistent)
        else:
            params = w * psi
        # Stage 1 reduces only at the accumulation boundary, so with grad_accum > 1 the full 16-bit gradient
        # accumulates in p.grad between boundaries; stage 2/3 reduce every micro-step into the partition.
        grads = w * psi if (st == 1 and lay.grad_accum > 1) else w * shard
        if st == 2 and lay.grad_accum > 1 and not lay.offload_optimizer:
            grads += w * partition_overhang(arch.param_sizes, n_dense * lay.tp * lay.pp, rank) / (lay.tp * lay.pp)
        optim = (master + 8) * shard
        transient = 4 * shard if w < 4 else 0.0
    host = 0.0
    if lay.offload_optimizer:
        host += optim + 4 * shard  # fp32 master + m + v, and the fp32 gradient partition, live on the host
        optim, transient = 0.0, 0.0
        grads = 0.0 if st >= 1 else grads
    if lay.offload_param and st == 3:
        host += params
        params = 0.0
    return {"params": params, "grads": grads, "optimizer": optim, "step_transient": transient, "host": host}


def _adapter_state_bytes(lay: Layout, w: int, psi: float, shard: float, t: float, arch: Arch) -> dict[str, float]:
    """:func:`model_state_bytes` when only ``t`` parameters (the adapters, on top of the model's ``psi``) train:
    every weight is held as usual
    (ZeRO-3 partitions the frozen base too), gradients and optimizer state exist for the ``t`` only, partitioned
    like a full run's (stage 1 holds the whole gradient between accumulation boundaries)."""
    n = zero_group(lay)
    st = lay.zero_stage
    params = w * (shard + t / n + _persistent_params(arch, lay)) if st == 3 else w * (psi + t)  # base + adapters
    if st == 0:
        grads, optim, transient = w * t, (8 + (4 if w < 4 else 0)) * t, 0.0
    else:
        grads = w * t if (st == 1 and lay.grad_accum > 1) else w * t / n
        optim, transient = 12 * t / n, (4 * t / n if w < 4 else 0.0)
    host = 0.0
    if lay.offload_optimizer:
        host, optim, transient = optim + 4 * t / n, 0.0, 0.0
        grads = 0.0 if st >= 1 else grads
    if lay.offload_param and st == 3:
        host, params = host + params, 0.0
    return {"params": params, "grads": grads, "optimizer": optim, "step_transient": transient, "host": host}


def checkpoint_staging_bytes(arch: Arch, lay: Layout) -> float:
    """Host bytes of the background checkpoint writer's staging copy on the heaviest rank (``train.checkpoint_async``,
    ``ultrascale/train/ckpt_writer.py``): everything that rank writes. Its optimizer partition (fp32 master, Adam m
    and v: 12 B a parameter of its shard; ZeRO-0: of every parameter, 8 B with fp32 weights), and on the rank that
    writes the module (data-parallel rank 0) the weights in their dtype, a tied embedding and head once (ZeRO-3:
    none: the module file holds empty placeholders, the weights travel as the fp32 partitions). Measured against
    the writer's own staging bytes by ``tests/test_plan_host.py``.

    Offloaded state counts like the rest, on top of :func:`model_state_bytes`' ``host``: it already lives in host
    memory, but the next step's CPU Adam updates it in place while the thread writes, so the writer needs its
    own copy (writing it where it lives would hold the next optimizer step for the whole write, the synchronous
    save's stall). ``train.checkpoint_async=false`` needs no copy."""
    w = DTYPE_BYTES[lay.dtype]
    dense, expert = rank_params(arch, lay)
    psi = dense + expert
    trainable = getattr(lay, "trainable_params", None)  # finetune=lora: only the adapters have optimizer state
    if lay.zero_stage == 0:
        return w * psi + (8 + (4 if w < 4 else 0)) * (psi if trainable is None else trainable)
    shard = dense / zero_group(lay) + expert / max(1, zero_group(lay) // lay.ep)
    shard = shard if trainable is None else trainable / zero_group(lay)
    weights = 0.0 if lay.zero_stage == 3 else w * psi
    return weights + 12 * shard


@cache
def partition_overhang(sizes: tuple[int, ...], n: int, rank: int | None = None) -> int:
    """Elements beyond its flat partition that a ZeRO-2 rank accumulates between boundaries.

    Between accumulation boundaries DeepSpeed keeps whole gradients of every parameter that touches the
    rank's partition, so a parameter straddling a boundary (often the embedding) is held in full by both
    neighbours. ``sizes`` are in flat-buffer (``model.parameters()``) order."""
    if n <= 1:
        return 0
    part = -(-sum(sizes) // n)
    over = []
    for r in range(n) if rank is None else [rank]:
        lo, hi, pos, held = r * part, (r + 1) * part, 0, 0
        for size in sizes:
            if pos < hi and pos + size > lo:
                held += size
            pos += size
        over.append(held - (min(hi, pos) - min(lo, pos)))
    return max(over)


def _persistent_params(arch: Arch, lay: Layout) -> float:
    """Stage 3 leaves small tensors (norms, biases) whole on every rank; count them per rank."""
    small = sum(n for n in arch.param_sizes if n < lay.persistence_threshold)
    return small / (lay.pp * lay.tp)


def activation_bytes_per_token_layer(arch: Arch, lay: Layout, mode: str | bool) -> float:
    """Bytes one token leaves saved for backward in one decoder layer under checkpointing ``mode``
    (none/selective/full; True/False mean full/none), before TP/SP division."""
    mode = checkpointing_mode(mode)
    e = DTYPE_BYTES[lay.dtype]
    h = arch.hidden
    if mode == "full":
        return e * h
    h_q = arch.heads * arch.head_dim
    kv = arch.kv_heads * arch.head_dim
    if mode == "selective":
        return e * h + _selective_matmul_bytes(arch, lay, e, h, h_q, kv)
    norm = (4 * h + 2 * e * h) if arch.rms_norm else 2 * e * h
    if lay.attn == "eager":
        soft = 4 + (e if e < 4 else 0)
        attn = 4 * e * h_q + soft * arch.heads * attention_span(arch, lay.seq_len)
    else:
        attn = e * (2 * h_q + 2 * kv) + 4 * arch.heads
    moe_share = arch.moe_layers / arch.layers
    dense_mlp = (4 * e if arch.gated_mlp else 2 * e) * arch.intermediate
    routed = arch.top_k * (2 * e * h + 4 * e * arch.moe_intermediate) + 4 * arch.experts + 24 * arch.top_k
    shared = 4 * e * arch.shared_intermediate
    mlp = moe_share * (routed + shared) + (1 - moe_share) * dense_mlp
    norm_share = norm * 2
    return (attn + mlp) / lay.tp + norm_share


def _selective_matmul_bytes(arch: Arch, lay: Layout, e: int, h: int, h_q: int, kv: int) -> float:
    """What per-op selective checkpointing keeps of a layer besides its input: the matmuls' and the attention
    kernel's outputs (``ultrascale.model.recompute.SAVE_OPS``: SDPA's, flash-attn's and FlexAttention's), per
    token. FlexAttention also keeps its fp32 row maxima, 4 bytes a head, not counted (under 1 % of a layer)."""
    attn = e * (h_q + 2 * kv) + e * h  # q, k, v projections and o_proj
    if lay.attn != "eager":  # the fused kernel's output and fp32 log-sum-exp; eager's bmm are recomputed
        attn += e * h_q + 4 * arch.heads
    moe_share = arch.moe_layers / arch.layers
    dense_mlp = e * ((2 if arch.gated_mlp else 1) * arch.intermediate + h)
    routed = e * arch.experts + arch.top_k * (2 * e * arch.moe_intermediate + e * h)
    shared = e * (2 * arch.shared_intermediate + h) if arch.shared_intermediate else 0.0
    mlp = moe_share * (routed + shared) + (1 - moe_share) * dense_mlp
    return (attn + mlp) / lay.tp


def head_bytes_per_token(arch: Arch, lay: Layout) -> float:
    """Final norm, ids and labels, and either the fp32 log-softmax over the vocabulary (plain loss) or the fp32
    gradient of the hidden state the fused loss computes in its forward and holds until backward."""
    e = DTYPE_BYTES[lay.dtype]
    h = arch.hidden
    norm = (4 * h + 2 * e * h) if arch.rms_norm else 2 * e * h
    if lay.fused_loss:
        return norm + 4 * h + 16
    return norm + 4 * arch.vocab / lay.tp + 16


def loss_transient_bytes(arch: Arch, lay: Layout, tokens: float) -> float:
    """The loss's largest short-lived buffer during backward: the logits' gradient over every token (plain
    loss), or one chunk's fp32 logits plus the head weight's fp32 gradient (fused loss)."""
    if lay.fused_loss:
        from ultrascale.model.loss import default_chunk_tokens

        chunk = lay.loss_chunk_tokens or default_chunk_tokens(arch.vocab)
        return 4 * min(chunk, tokens) * arch.vocab + 4 * arch.vocab * arch.hidden
    return tokens * (4 + DTYPE_BYTES[lay.dtype]) * arch.vocab / lay.tp


def activation_bytes(arch: Arch, lay: Layout) -> tuple[float, float]:
    """(saved-for-backward bytes at peak, extra transient bytes during backward) for the heaviest rank."""
    tokens = lay.micro_batch * lay.seq_len / lay.sp
    layers = -(-arch.layers // lay.pp)
    per_layer = activation_bytes_per_token_layer(arch, lay, lay.activation_checkpointing)
    in_flight = min(lay.pp, lay.grad_accum) if lay.pp > 1 else 1
    body = tokens * layers * per_layer * in_flight
    head = tokens * head_bytes_per_token(arch, lay)
    if lay.pp > 1:  # stage 0 holds the most micro-batches; the last stage holds the head for one
        saved = max(body, tokens * layers * per_layer + head)
    else:
        saved = body + head
    full_layer = tokens * activation_bytes_per_token_layer(arch, lay, "none")
    # the layer being recomputed holds what it had dropped (full: counted as the whole layer, its input included)
    recomputed = full_layer if lay.activation_checkpointing == "full" else full_layer - tokens * per_layer
    extra = max(recomputed if lay.recomputes else 0.0, loss_transient_bytes(arch, lay, tokens))
    return saved, extra


def buffer_bytes(arch: Arch, lay: Layout) -> float:
    """Communication buckets and ZeRO-3 prefetch/working set, sized from the DeepSpeed config."""
    w = DTYPE_BYTES[lay.dtype]
    psi = sum(rank_params(arch, lay))
    st = lay.zero_stage
    if st in (1, 2):
        ipg = (2 if lay.overlap_comm else 1) * min(lay.reduce_bucket_size, psi) * w
        return ipg + min(lay.allgather_bucket_size, psi) * w
    if st == 3:
        gathered = 2 * arch.max_layer_params / lay.tp * w  # the layer in use and the one being prefetched
        return min(lay.prefetch_bucket_size * w, gathered) + gathered / 2 + min(lay.reduce_bucket_size, psi) * w
    return min(lay.reduce_bucket_size, psi) * w if lay.dp > 1 else 0.0  # stage 0: DDP-style all-reduce bucket


BUILD_BYTES = 4
"""Models are built (and keyed-initialized or loaded) in fp32 on the host, whatever the training precision."""


def construction_bytes(arch: Arch, lay: Layout) -> float:
    """Host bytes a rank holds while its model is built or loaded (before ``deepspeed.initialize``).

    ZeRO-3: its partition of every tensor plus one whole tensor at a time (built partitioned; keyed init draws a
    tensor whole and keeps a slice). ZeRO-1/2 with expert parallelism: the routed experts the same way, the rest
    whole (made whole right after the build, as ZeRO-1/2 hold it), with its partitions until they are freed;
    AutoEP then gathers one layer's experts at a time inside ``deepspeed.initialize``. Pipeline: its stage's
    layers only (each stage builds its own). Otherwise, tensor parallelism included, the whole model: DeepSpeed
    0.19.8's AutoTP shards a model built whole, inside ``deepspeed.initialize``.
    """
    if lay.zero_stage < 3 and lay.ep > 1 and lay.pp == 1 and arch.expert_params:
        dense = arch.dense_params
        return BUILD_BYTES * (dense + (dense + arch.expert_params) / lay.world + max(arch.param_sizes))
    if lay.zero_stage == 3 and lay.pp == 1:
        dense, expert = rank_params(arch, Layout(world=lay.world, tp=1, pp=1, sp=lay.sp, ep=lay.ep))
        shard = dense / zero_group(lay) + expert / max(1, zero_group(lay) // lay.ep)
        return BUILD_BYTES * (shard + max(arch.param_sizes))
    if lay.pp > 1:
        dense, expert = rank_params(arch, Layout(world=lay.world, pp=lay.pp))
        return BUILD_BYTES * (dense + expert)
    return BUILD_BYTES * (arch.dense_params + arch.expert_params)


def host_step_bytes(arch: Arch, lay: Layout) -> float:
    """Host bytes of a CPU rank's model states between two steps (fp32 training on the CPU accelerator):
    parameters and the optimizer's state (fp32 master, Adam m and v), plus the gradient partition ZeRO-2/3 keep
    allocated between steps; ZeRO-0/1 free their gradients after the step. What ``python -m
    ultrascale.train.memprobe`` measures after one step (``make bench-scale``)."""
    ms = model_state_bytes(arch, Layout(**{**asdict(lay), "dtype": "fp32"}))
    keeps_grads = lay.zero_stage >= 2
    # Stage 3 also keeps two buffers of ``reduce_bucket_size`` elements that do not shrink with dp: its gradient
    # bucket (``torch.empty(reduce_bucket_size)``, DeepSpeed 0.19 stage3.py, contiguous_gradients) and the flat
    # copy the reduce-scatter makes of it, which the heap keeps. Measured on a 0.28B model (memprobe, after
    # one step): without them 1.30 GiB planned against 1.66-1.76 at dp=4; with them within 6 % at dp=2 and dp=4
    # and at bucket sizes 1.25e7 and 5e7.
    bucket = 2 * 4 * lay.reduce_bucket_size if lay.zero_stage == 3 else 0.0
    return ms["params"] + ms["optimizer"] + (ms["grads"] if keeps_grads else 0.0) + ms["host"] + bucket


def memory(arch: Arch, lay: Layout, fragmentation: float = 0.1, reserved: float = 0.0) -> Memory:
    """Every term for one rank. ``fragmentation`` is a fraction of the allocated peak kept as headroom
    (the caching allocator rarely packs perfectly); ``reserved`` is the runtime's own (CUDA context, NCCL)."""
    ms = model_state_bytes(arch, lay)
    act, act_extra = activation_bytes(arch, lay)
    buf = buffer_bytes(arch, lay)
    allocated = ms["params"] + ms["grads"] + ms["optimizer"] + max(ms["step_transient"], act + act_extra) + buf
    return Memory(
        params=ms["params"],
        grads=ms["grads"],
        optimizer=ms["optimizer"],
        step_transient=ms["step_transient"],
        activations=act,
        activation_peak_extra=act_extra,
        buffers=buf,
        fragmentation=fragmentation * allocated,
        reserved=reserved,
        host=ms["host"],
    )
