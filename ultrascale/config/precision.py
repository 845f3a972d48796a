"""``conf/precision/``: the training dtype, autocast and fp16's loss scaling."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from ultrascale.config.fields import num


class Precision(StrEnum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class Autocast(StrEnum):
    none = "none"
    bf16 = "bf16"


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
