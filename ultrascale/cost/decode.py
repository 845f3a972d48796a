"""The decode cost model: how long the sampler takes to write a GRPO step's completions on a GPU, and so what share
of the step generation is.

Writing one token for a batch of rows reads every weight once and each row's KV cache so far, and does two FLOPs per
matmul weight per row plus the attention over the context. At the batch sizes rollouts use (tens of rows), the reads
set the time: a decode step is a roofline, the slower of its bytes against the card's memory bandwidth and its FLOPs
against the matmul rate, plus a fixed floor for launching the step's kernels. Prefill is the same model over a
prompt's tokens at once (FLOP-bound), once per prompt: the sampler copies a prompt's prefilled rows to its
``num_generations`` samples rather than recomputing them.

The figures are estimates from datasheets, to be replaced by the GPU probe's GRPO row (``bench/gpu_probe.py``):
:data:`BW_EFFICIENCY` and :data:`FLOOR_S_PER_LAYER` say what they assume.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ultrascale.cost.memory import DTYPE_BYTES
from ultrascale.model.arch import Arch

BW_EFFICIENCY = 0.7
"""Share of the datasheet memory bandwidth a decode step's reads reach: skinny GEMMs streaming weights reach
70-80 % of HBM peak on Hopper (vLLM and TensorRT-LLM's decode roofline reports); the lower end, for an eager model."""
FLOOR_S_PER_LAYER = 1.5e-5
"""Fixed time per decoder layer per decode step: ~10 kernels a layer replayed from a CUDA graph (the sampler's static
path on a GPU) at ~1.5 us each. Dominates for a model as small as SmolLM2-135M; an estimate until the probe measures."""


@dataclass(frozen=True)
class DecodeRate:
    """What a decode step runs against on one device."""

    bytes_per_s: float
    flops_per_s: float
    floor_s: float
    """Fixed time per decode step (kernel launches), whatever the batch."""

    @staticmethod
    def of_card(hbm_tbps: float, tflops: float, matmul_efficiency: float, layers: int) -> DecodeRate:
        """A GPU's rate from its datasheet bandwidth and matmul peak, the cluster's matmul efficiency and the model's
        depth (the launch floor)."""
        return DecodeRate(
            hbm_tbps * 1e12 * BW_EFFICIENCY, tflops * 1e12 * matmul_efficiency, layers * FLOOR_S_PER_LAYER
        )


@dataclass(frozen=True)
class Decode:
    """Seconds to generate one batch's completions."""

    prefill_s: float
    decode_s: float
    tokens: int
    """Tokens generated (rows x new tokens)."""
    bound: str
    """What most decode steps wait on: ``memory``, ``compute`` or ``launch`` (the floor)."""

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else math.inf


def weight_bytes(arch: Arch, dtype: str) -> float:
    """Bytes a decode step reads of the weights: all of them but the input embedding (a lookup of a few rows),
    which a tied head reads whole. Routed experts count whole (a batch of rows reaches most of them)."""
    read = arch.total_params - (0 if arch.tied else arch.embed_params)
    return read * DTYPE_BYTES[dtype]


def kv_bytes_per_token(arch: Arch, dtype: str) -> float:
    """K and V of one token across the layers."""
    return 2 * arch.layers * arch.kv_heads * arch.head_dim * DTYPE_BYTES[dtype]


def generate_time(arch: Arch, rows: int, prompts: int, prompt_len: int, new_tokens: int, dtype: str,
                  rate: DecodeRate) -> Decode:  # fmt: skip
    """``rows`` completions of ``prompts`` prompts (``rows / prompts`` samples each) of ``prompt_len`` tokens, each
    ``new_tokens`` long, decoded together."""
    w, kv = weight_bytes(arch, dtype), kv_bytes_per_token(arch, dtype)
    matmul = 2 * arch.active_matmul_params
    attn = 2 * arch.layers * arch.heads * arch.head_dim  # QK^T and AV: FLOPs per row per context position / 2

    def ctx(c: int) -> int:
        return min(c, arch.sliding_window) if arch.sliding_window else c

    prefill_flops = prompts * (matmul * prompt_len + attn * prompt_len * ctx(prompt_len))
    prefill = max(prefill_flops / rate.flops_per_s, w / rate.bytes_per_s) + rate.floor_s
    total, bound = 0.0, {"memory": 0, "compute": 0, "launch": 0}
    for k in range(new_tokens):
        c = ctx(prompt_len + k)
        mem = (w + rows * c * kv) / rate.bytes_per_s
        fl = rows * (matmul + 2 * attn * c) / rate.flops_per_s
        total += max(mem, fl) + rate.floor_s
        bound[max((("memory", mem), ("compute", fl), ("launch", rate.floor_s)), key=lambda x: x[1])[0]] += 1
    return Decode(prefill, total, rows * new_tokens, max(bound, key=bound.get))


@dataclass(frozen=True)
class RolloutPlan:
    """One rank's generation in a GRPO step: its completions in sampler waves of ``batch`` rows."""

    prompts: int
    """This rank's prompts a step (``prompts_per_step / dp``)."""
    generations: int
    batch: int
    """The sampler's rows at once (``grpo.sampler_batch_size``, at least ``num_generations``)."""
    prompt_len: int
    completion_len: int


def rollout_time(arch: Arch, plan: RolloutPlan, dtype: str, rate: DecodeRate) -> Decode:
    """A rank's generation for one step: ``ceil(rows / batch)`` waves, each of whole groups, at full length (the
    bound: completions that stop early shorten it, and the sampler refills their rows)."""
    rows = plan.prompts * plan.generations
    per_wave = max(plan.batch // plan.generations, 1) * plan.generations
    waves = -(-rows // per_wave)
    one = generate_time(arch, min(per_wave, rows), min(per_wave, rows) // plan.generations, plan.prompt_len,
                        plan.completion_len, dtype, rate)  # fmt: skip
    return Decode(one.prefill_s * waves, one.decode_s * waves, rows * plan.completion_len, one.bound)


def replica_bytes(arch: Arch, dtype: str, rows: int, context: int) -> float:
    """What generating under ZeRO-3 holds beside the training state: the whole model (the rollout replica) and the
    KV cache of ``rows`` rows of ``context`` tokens."""
    return arch.total_params * DTYPE_BYTES[dtype] + rows * context * kv_bytes_per_token(arch, dtype)


def gather_bytes(arch: Arch, dtype: str, whole: bool) -> float:
    """The transient of refreshing the replica from ZeRO-3's partitions: the whole model gathered at once, or the
    largest unit gathered when it goes a decoder layer at a time (the embedding and head are one unit)."""
    if whole:
        return arch.total_params * DTYPE_BYTES[dtype]
    rest = arch.total_params - sum(arch.layer_params)
    return max(max(arch.layer_params, default=0), rest) * DTYPE_BYTES[dtype]
