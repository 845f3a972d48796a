"""The forward under ``torch.autocast`` over fp32 weights (``precision.autocast``).

DeepSpeed's bf16 mode keeps bf16 weights and gradients with fp32 master copies in the optimizer. Autocast is
the other trade: weights, gradients and Adam's state stay fp32 (nothing to re-cast after a step, no bf16
rounding of updates), and only the forward's matmuls and attention run in bf16, the backward following the
forward's dtypes. On a CPU with native bf16 (AVX-512 BF16, AMX) those kernels are what is worth having;
``python bench/levers.py --levers autocast_bf16`` measures it. Whether it is on was decided once
(:func:`ultrascale.levers.decide._autocast`); this module only applies it.
"""

from __future__ import annotations

import functools

import torch

DTYPES = {"bf16": torch.bfloat16}


def install_autocast(model: torch.nn.Module, device_type: str, dtype: str) -> None:
    """Run ``model``'s forward (as patched so far: the fused loss, for one) under ``torch.autocast``.

    Only the instance's ``forward`` is replaced, as the fused loss does: DeepSpeed's engine, ``generate`` and
    ``nn.Module.__call__`` all call it, the parameters and ``state_dict`` keys are unchanged, and layers
    compiled in place (``train.compile_scope=layers``) are traced with the autocast state they run under.
    """
    inner = model.forward
    cast = DTYPES[dtype]

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        with torch.autocast(device_type=device_type, dtype=cast):
            return inner(*args, **kwargs)

    model.forward = forward
