"""The hardware tables: what each CPU and GPU lever is on the machine at hand, as pure functions of its record.

The attention block and the fused loss's chunk per CPU (:class:`~ultrascale.runtime.cpu.CpuInfo`), the chunk per
GPU and ``train.activation_checkpointing=auto`` per GPU (:class:`~ultrascale.runtime.gpu.GpuInfo`). Apart from
:mod:`ultrascale.levers.decide` because these are numbers measured per machine (``python
bench/bench_cpu_levers.py``; bench/README.md has each CPU's table), while decide says which feature runs and why
not; a planted record decides them in a test exactly as the real machine does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ultrascale.config.recompute import AC_MODES
from ultrascale.config.topology import Topology
from ultrascale.runtime.cpu import CpuInfo
from ultrascale.runtime.gpu import GpuInfo

if TYPE_CHECKING:
    from ultrascale.config.precision import PrecisionConfig
    from ultrascale.config.root import RootConfig

FLEX_MIN_CAPABILITY = (8, 0)
"""``train.attention_kernel=auto`` picks FlexAttention on CUDA GPUs from Ampere (sm_80) on: its Triton kernels are
built and tuned for them (bf16, their shared memory); older cards keep HF's sdpa."""


# --- The CPU levers: pure functions of the CPU's features (ultrascale.runtime.cpu.CpuInfo), measured per CPU by
# `python bench/bench_cpu_levers.py` (bench/README.md has each CPU's table). ---


def bf16_matmuls(precision: PrecisionConfig, cpu: CpuInfo | None) -> bool:
    """The forward's matmuls run in bf16 (16-bit weights, or autocast on a CPU that computes bf16 natively)."""
    p = precision
    return p.dtype == "bf16" or (p.autocast == "bf16" and (cpu is None or cpu.bf16_native or p.autocast_emulated))


BLOCKS_PER_ROW = {"fp32": 4, "bf16": 2}
"""Query blocks per row of the blocked attention, by the attention's matmul dtype. A block costs one SDPA call
and saves its share of the upper-triangle tiles; how many pay off depends on how cheap a tile is: 4 blocks (62.5 %
of the tiles) on fp32 FMA units, 2 (75 %) for bf16 on a matrix unit, whose tiles are ~5x cheaper. The measured
tables: bench/README.md, "The CPU levers, per CPU" (``python bench/bench_cpu_levers.py [--dtype bf16]``)."""
MIN_BLOCK = 64
"""Below this a block's SDPA call costs more than the tiles it skips on every CPU measured."""
CHUNK_LOGITS_CAP_MIB = 256
"""A chunk's fp32 logits never exceed this, whatever the matrix unit asks (1,024 x 49,152 is 192 MiB)."""


def cpu_attn_block(cpu: CpuInfo, seq_len: int, bf16: bool) -> tuple[int, str]:
    """(query block of the blocked causal SDPA for rows holding several documents, why): ``seq_len`` over the
    blocks per row that pay off for the attention's matmul dtype on this CPU (one-document rows always take
    SDPA's causal kernel, which skips the upper tiles itself)."""
    native = bf16 and cpu.bf16_native
    n = BLOCKS_PER_ROW["bf16" if native else "fp32"]
    block = max(MIN_BLOCK, -(-seq_len // n))
    unit = f"bf16 on {cpu.matrix_unit}" if native else "fp32"
    return block, f"{n} blocks a row: the attention's matmuls run {unit} on this CPU"


def cpu_loss_chunk(cpu: CpuInfo, vocab: int, bf16: bool) -> tuple[int, str]:
    """(tokens per chunk of the fused loss, why). Every chunk pays one pass over the head's gradient (``V x h``,
    fp32, plus its bf16 product under autocast) besides its GEMMs, so the faster the GEMMs run, the more tokens a
    chunk needs for that pass to stay small: 128 with fp32 GEMMs, 8x that where autocast puts them on a bf16
    matrix unit (~5x the fp32 GEMM rate), capped so one chunk's fp32 logits stay within 256 MiB. The measured
    tables: bench/README.md, "The CPU levers, per CPU"."""
    from ultrascale.model.loss import CPU_MAX_CHUNK_TOKENS

    native = bf16 and cpu.bf16_native
    want = CPU_MAX_CHUNK_TOKENS * (8 if native else 1)
    cap = max(16, CHUNK_LOGITS_CAP_MIB * 2**20 // (4 * vocab))
    chunk = min(want, 1 << (cap.bit_length() - 1))
    unit = f"bf16 GEMMs on {cpu.matrix_unit}" if native else "fp32 GEMMs"
    capped = f", capped by the {CHUNK_LOGITS_CAP_MIB} MiB logits budget at vocab {vocab:,}" if chunk < want else ""
    return chunk, f"{unit}{capped}"


# --- The GPU levers: pure functions of the GPU (ultrascale.runtime.gpu.GpuInfo: name, memory, capability), so a planted
# description decides them in a test exactly as the real card does on a GPU node. ---

GPU_LOSS_FRACTION = 64
"""One chunk's fp32 logits get 1/64 of the GPU's free memory: 1.2 GiB on an 80 GB card (2,048 tokens at vocab
128,256), 0.34 GiB on a 24 GB one (512): each chunk's GEMM is thick enough to fill a GPU's tensor cores (the
fixed budget this replaced: bench/README.md, "The fused loss chunk")."""
GPU_MAX_CHUNK_TOKENS = 8192
"""Past this a chunk's GEMM ([chunk, h] x [h, V]) is long past filling the GPU; more only holds more memory."""
AC_HEADROOM = 0.10
"""``auto`` activation checkpointing keeps 10 % of the GPU's free memory unplanned (NCCL buffers, the caching
allocator's slack), on top of the planner's own fragmentation term."""


def gpu_loss_chunk(gpu: GpuInfo, vocab: int) -> tuple[int, str]:
    """(tokens per chunk of the fused loss, why): the largest power of two whose fp32 logits fit 1/64 of the GPU's
    free memory, at most 8,192 tokens."""
    budget = gpu.available_bytes // GPU_LOSS_FRACTION
    fit = max(1, budget // (4 * vocab))
    pow2 = 1 << (fit.bit_length() - 1)
    chunk = min(GPU_MAX_CHUNK_TOKENS, pow2)
    free = "free" if gpu.free_bytes is not None else "total"
    capped = f", capped at {GPU_MAX_CHUNK_TOKENS:,}" if chunk < pow2 else ""
    return chunk, (f"1/{GPU_LOSS_FRACTION} of {gpu.available_bytes / 2**30:.1f} GiB {free} on the GPU for one "
                   f"chunk's fp32 logits at vocab {vocab:,}{capped}")  # fmt: skip


def auto_checkpointing(peaks: dict[str, float], gpu: GpuInfo) -> tuple[str, str]:
    """(mode, why) for ``auto``: the first of none, selective, full (those in ``peaks``: the planner's predicted
    peak bytes per GPU for each) that fits the GPU's free memory less 10 %; full if none fits."""
    usable = gpu.available_bytes * (1 - AC_HEADROOM)
    said = []
    for mode in (m for m in AC_MODES if m in peaks):
        said.append(f"{mode} {peaks[mode] / 2**30:.1f} GiB")
        if peaks[mode] <= usable:
            break
    else:
        mode = "full"
    card = gpu.identified().card
    where = f"{usable / 2**30:.1f} GiB usable (90 % of {gpu.available_bytes / 2**30:.1f} GiB " \
            f"{'free' if gpu.free_bytes is not None else 'total'} on {card.name if card else gpu.name})"  # fmt: skip
    fits = "fits" if peaks.get(mode, float("inf")) <= usable else "does not fit even so"
    return mode, f"auto: the planner predicts {', '.join(said)} per GPU; {where}: {mode} {fits}"


def predicted_peaks(cfg: RootConfig, topo: Topology, hf_config: Any, fused_loss: bool, chunk_tokens: int | None,
                    modes: tuple[str, ...]) -> dict[str, float]:  # fmt: skip
    """The planner's (:mod:`ultrascale.cost.memory`) peak bytes per GPU of this run under each checkpointing mode
    (``cfg``: the whole tree, as the planner's layout reads it)."""
    from dataclasses import replace

    from ultrascale.cost.layout import layout_from_cfg
    from ultrascale.cost.memory import memory
    from ultrascale.model.arch import arch_from_hf

    arch = arch_from_hf(hf_config)
    lay = replace(layout_from_cfg(cfg, topo.world), zero_stage=int(cfg.zero.stage), fused_loss=fused_loss,
                  loss_chunk_tokens=chunk_tokens or 0)  # fmt: skip
    return {m: memory(arch, replace(lay, activation_checkpointing=m)).total for m in modes}
