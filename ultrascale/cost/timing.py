"""Per-step time for one layout: compute, each strategy's communication over the link it really uses,
the pipeline bubble, offload traffic, and how much of it overlaps.

Collective costs use NCCL's bus-bandwidth convention, so a cluster's ``*_gbps`` are what nccl-tests
reports: an all-reduce of S bytes over n ranks takes 2·S·(n-1)/n / busbw, a reduce-scatter or all-gather
S·(n-1)/n / busbw, an all-to-all S·(n-1)/n / busbw. Placement is the usual one: TP innermost (inside a
node), then SP, then DP/EP, then PP outermost; a group whose ranks span nodes runs at the inter-node rate.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ultrascale.cost.memory import DTYPE_BYTES, Layout, rank_params, zero_group
from ultrascale.model.arch import Arch
from ultrascale.model.flops import flops_per_token

CPU_ADAM_PARAMS_PER_S = 1.0e9
"""DeepSpeedCPUAdam throughput per rank (AVX-512, ~1 B params/s); bounds the offloaded optimizer step."""
SELECTIVE_RECOMPUTE = 0.1
"""Selective (per-op) checkpointing recomputes a layer's norms, RoPE, activation and residual adds, not its
matmuls or attention: counted as 10 % of a forward. An estimate (those kernels are memory-bound, and their share
of a forward falls as the model widens and torch.compile fuses them), to be replaced by the GPU probe's
measurement of the activation-checkpointing lever."""


@dataclass(frozen=True)
class Timing:
    """Seconds per optimizer step, by term; ``exposed`` terms are what is left after overlap."""

    compute: float
    recompute: float
    dp_comm: float
    dp_exposed: float
    tp_comm: float
    sp_comm: float
    ep_comm: float
    pp_p2p: float
    pp_bubble: float
    offload: float
    step: float
    tokens_per_s: float
    mfu: float
    bottleneck: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _span_nodes(group: int, stride: int, gpus_per_node: int) -> bool:
    """Whether a group of ``group`` ranks placed ``stride`` apart crosses a node boundary."""
    return group > 1 and group * stride > gpus_per_node


def _bw(cluster: Any, inter: bool) -> tuple[float, float]:
    """(bytes/s, latency s) of the link a group uses."""
    if inter:
        return cluster.inter_node_gbps * 1e9, cluster.inter_node_latency_us * 1e-6
    return cluster.intra_node_gbps * 1e9, cluster.intra_node_latency_us * 1e-6


def bubble_fraction(pp: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Idle share of a 1F1B pipeline step: (p-1)/(m+p-1), divided by v when interleaved."""
    if pp <= 1:
        return 0.0
    return (pp - 1) / virtual_stages / (micro_batches + (pp - 1) / virtual_stages)


def step_time(
    arch: Arch,
    lay: Layout,
    cluster: Any,
    overlap: float = 0.8,
    recompute_overhead: float = 1.0,
    achieved_tflops: float | None = None,
) -> Timing:
    """Predict one optimizer step. ``achieved_tflops`` overrides peak x efficiency (e.g. a measured value)."""
    w = DTYPE_BYTES[lay.dtype]
    gpn = cluster.gpus_per_node
    world, ga = lay.world, lay.grad_accum
    tokens = lay.global_batch * lay.seq_len
    model_flops = flops_per_token(arch, lay.seq_len) * tokens
    rate = (achieved_tflops or cluster.peak_tflops * cluster.matmul_efficiency) * 1e12
    compute = model_flops / (world * rate)
    forwards = {"none": 0.0, "selective": SELECTIVE_RECOMPUTE, "full": 1.0}[lay.activation_checkpointing]
    recompute = compute / 3 * recompute_overhead * forwards  # a forward is a third of forward + backward
    fwd_bwd = compute + recompute

    # --- data parallel / ZeRO: the per-rank model slice, over the dp x sp group (strided by tp) ---
    dense, expert = rank_params(arch, lay)
    psi_bytes = (dense + expert) * w
    n = zero_group(lay)  # gradients are averaged over dp x sp (SP ranks hold different tokens)
    bw, lat = _bw(cluster, _span_nodes(n, lay.tp, gpn))
    frac = (n - 1) / n
    if lay.zero_stage == 0:
        dp_comm = 2 * psi_bytes * frac / bw  # one all-reduce at the accumulation boundary
    elif lay.zero_stage == 1:
        dp_comm = 2 * psi_bytes * frac / bw  # reduce-scatter at the accumulation boundary, all-gather after the step
    elif lay.zero_stage == 2:
        dp_comm = (ga + 1) * psi_bytes * frac / bw  # reduce-scatter every micro-step, all-gather after the step
    else:
        dp_comm = 3 * ga * psi_bytes * frac / bw  # gather fwd, gather bwd, reduce-scatter, every micro-step
    if n > 1:
        dp_comm += ga * lat * max(1, psi_bytes / w / lay.reduce_bucket_size)
    # Buckets overlap with backward (and ZeRO-3 prefetch with forward); the final all-gather mostly does not.
    window = fwd_bwd * (1.0 if lay.zero_stage == 3 else 2 / 3)
    dp_exposed = max(dp_comm * (1 - overlap), dp_comm - overlap * window)

    # --- tensor parallel: 2 all-reduces per layer forward, 2 backward (+2 when recomputing), intra-node ---
    layers = -(-arch.layers // lay.pp)
    act = lay.micro_batch * lay.seq_len / lay.sp * arch.hidden * w
    tp_comm = 0.0
    if lay.tp > 1:
        bw, lat = _bw(cluster, _span_nodes(lay.tp, 1, gpn))
        n_ar = layers * (4 + (2 if lay.activation_checkpointing == "full" else 0)) * ga
        tp_comm = n_ar * (2 * act * (lay.tp - 1) / lay.tp / bw + lat)

    # --- Ulysses SP: all-to-all of q, k, v and the output, forward and backward ---
    sp_comm = 0.0
    if lay.sp > 1:
        bw, lat = _bw(cluster, _span_nodes(lay.sp, lay.tp, gpn))
        kv = arch.kv_heads * arch.head_dim / arch.hidden
        per_layer = (2 + 2 * kv) * act * (lay.sp - 1) / lay.sp / lay.tp
        sp_comm = layers * ga * 2 * (per_layer / bw + 4 * lat)

    # --- EP: dispatch + combine all-to-all per MoE layer, forward and backward ---
    ep_comm = 0.0
    if lay.ep > 1 and arch.experts:
        bw, lat = _bw(cluster, _span_nodes(lay.ep, lay.tp * lay.sp, gpn))
        moe_layers = -(-arch.moe_layers // lay.pp)
        per = arch.top_k * act * (lay.ep - 1) / lay.ep
        ep_comm = moe_layers * ga * 4 * (per / bw + lat)

    # --- PP: activations to the next stage forward, gradients back; plus the bubble ---
    pp_p2p = pp_bubble = 0.0
    if lay.pp > 1:
        bw, lat = _bw(cluster, _span_nodes(lay.pp, world // lay.pp, gpn))
        pp_p2p = 2 * ga * (act / bw + lat)
        pp_bubble = (fwd_bwd + tp_comm + sp_comm + ep_comm) * (lay.pp - 1) / ga

    # --- offload: gradients to the host, updated weights back, and the CPU optimizer step ---
    offload = 0.0
    shard = dense / n + expert / max(1, n // lay.ep) if lay.zero_stage else dense + expert
    if lay.offload_optimizer:
        offload += shard * (4 + w) / (cluster.host_link_gbps * 1e9) + shard / CPU_ADAM_PARAMS_PER_S
    if lay.offload_param:
        offload += 2 * ga * shard * w / (cluster.host_link_gbps * 1e9)

    step = fwd_bwd + dp_exposed + tp_comm + sp_comm + ep_comm + pp_p2p + pp_bubble + offload
    terms = {
        "compute": fwd_bwd,
        "dp_comm": dp_exposed,
        "tp_comm": tp_comm,
        "sp_comm": sp_comm,
        "ep_comm": ep_comm,
        "pp_p2p": pp_p2p,
        "pp_bubble": pp_bubble,
        "offload": offload,
    }
    bottleneck = max(terms, key=terms.get)
    return Timing(
        compute=compute,
        recompute=recompute,
        dp_comm=dp_comm,
        dp_exposed=dp_exposed,
        tp_comm=tp_comm,
        sp_comm=sp_comm,
        ep_comm=ep_comm,
        pp_p2p=pp_p2p,
        pp_bubble=pp_bubble,
        offload=offload,
        step=step,
        tokens_per_s=tokens / step,
        mfu=model_flops / (step * world * cluster.peak_tflops * 1e12),
        bottleneck=bottleneck,
    )
