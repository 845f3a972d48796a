"""Document-masked causal attention through FlexAttention: block-sparse tiles, no dense ``s x s`` mask.

Why: a packed row holding several documents must not attend across a document boundary. HF's ``sdpa`` path
spells that out as a dense ``[b, 1, s, s]`` mask, and with an explicit mask SDPA cannot run its FlashAttention
kernel (what that cost on a GPU: bench/README.md). FlexAttention takes a ``BlockMask`` instead (per 128 x 128
tile: skipped, full, or partial with a ``mask_mod`` evaluated in the kernel), so the tiles above the diagonal and
across documents are never computed and no mask is ever read. The mask is HF's own, built once per forward as a
``BlockMask`` (:func:`flex_mask`, which also routes what is not a full causal square to SDPA).

On CUDA FlexAttention runs compiled. On CPU torch's compiled flex kernel is inference-only, so where gradients
are needed it runs FlexAttention's reference implementation (:func:`flex`): slower than SDPA there, where
``train.attention_kernel=auto`` keeps the blocked SDPA (``ultrascale/model/attention.py``). The lever is for GPUs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import _ignore_causal_mask_sdpa, causal_mask_function, prepare_padding_mask, sdpa_mask

NAME = "ultrascale_flex"
"""The HF attention-implementation name the model is switched to at train time (``install_flex_attention``)."""


def flex_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any = 0,
    kv_offset: Any = 0,
    mask_function: Callable = causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    device: torch.device | str = "cpu",
    **kwargs,
) -> BlockMask | torch.Tensor | None:
    """HF's ``AttentionMaskInterface`` signature: a BlockMask for a full square, else what ``sdpa`` would get.

    The mask is HF's own (``transformers.masking_utils``): causal (or sliding-window causal) AND same document, a
    document being a run of position ids that count up by one (``find_packed_sequence_indices``; the loader
    restarts them after every EOS). HF builds the model's masks once per forward in ``create_causal_mask`` and
    hands them to every layer, so registering this as our implementation's mask builder makes that one mask a
    ``BlockMask``: one per forward (per mask type, for models mixing sliding and full layers), not one per layer.
    We do not reuse HF's ``flex_attention_mask`` (it always compiles ``create_block_mask``, 18 s per shape on a
    CPU) nor its ``flex_attention_forward`` (it cannot train on CPU, and it copies the kv heads out whenever the
    query head count is not a power of two, e.g. SmolLM2's 9 over 3, where FlexAttention's ``enable_gqa`` shares
    them).

    Routing (:func:`flex_attention_forward` follows the type of what it is given): a full causal square with
    document boundaries (training, eval perplexity): a BlockMask -> FlexAttention; a one-document row without
    padding: no mask -> SDPA's causal kernel (FlashAttention on a GPU; nothing to skip that the causal kernel
    does not skip already); everything else (decoding with a KV cache, ``q_len != kv_len``, padded prompts):
    HF's sdpa mask and sdpa."""
    square = q_length == kv_length and _zero(q_offset) and _zero(kv_offset)
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if not square or (padding is not None and not bool(padding.all())):
        return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                         local_size=local_size, allow_is_causal_skip=allow_is_causal_skip, device=device,
                         **kwargs)  # fmt: skip
    if allow_is_causal_skip and _ignore_causal_mask_sdpa(None, q_length, kv_length, 0, 0, local_size):
        return None  # one document a row (HF found no restart in the position ids): SDPA's causal kernel
    return block_mask(mask_function, batch_size, q_length, kv_length, torch.device(device))


def _zero(offset: Any) -> bool:
    """A plain 0 (a static cache's offset is a tensor: a decode call, never a square)."""
    return isinstance(offset, int) and offset == 0


def block_mask(mask_function: Callable, batch: int, q_len: int, kv_len: int, device: torch.device) -> BlockMask:
    """The BlockMask of ``mask_function(b, h, q, kv)``, per row (documents differ between rows), shared by heads.

    Compiled on CUDA, where uncompiled it would materialize ``b x s x s`` booleans to find the tiles; eager on a
    CPU, where the compile costs ~18 s per shape and CPU rows are short."""
    return create_block_mask(mask_function, B=batch, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=device,
                             _compile=device.type == "cuda")  # fmt: skip


def flex_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: BlockMask | torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention-interface signature; query ``[b, h, s, d]``, key/value ``[b, h_kv, s, d]``."""
    if not isinstance(attention_mask, BlockMask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    extra = [k for k in ("softcap", "position_bias", "s_aux") if kwargs.get(k) is not None]
    if dropout or extra:
        raise ValueError(f"FlexAttention here takes plain causal attention, not {extra or 'attention dropout'}: "
                         "use train.attention_kernel=sdpa for this model")  # fmt: skip
    return flex(query, key, value, attention_mask, scaling).transpose(1, 2).contiguous(), None


def flex(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: BlockMask, scale: float | None = None
) -> torch.Tensor:
    """FlexAttention of ``[b, h, s, d]`` queries over ``[b, h_kv, s, d]`` keys/values (GQA without copies).

    Devices (torch 2.13): on CUDA FlexAttention runs compiled (``torch.compile(flex_attention)``, or inlined into
    the compiled decoder layer) and the BlockMask comes from a compiled ``create_block_mask``. On CPU torch's
    compiled flex kernel is inference-only ("FlexAttention does not support backward on CPU"), so where gradients
    are needed the CPU runs FlexAttention's reference implementation (its higher-order op in eager: flex's own
    math and backward, the scores of a row materialized; what PyTorch's tests hold the GPU kernel against). That
    keeps the mask, the routing and GQA tested against masked SDPA in CI."""
    grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    if grad and query.device.type == "cpu":
        return _reference(query, key, value, mask, scale)
    fn = flex_attention if torch.compiler.is_compiling() else _compiled()  # a compiled layer inlines it
    return fn(query, key, value, block_mask=mask, scale=scale, enable_gqa=query.shape[1] != key.shape[1])


@functools.cache
def _compiled() -> Callable:
    """One compiled FlexAttention for the process (uncompiled it is the unfused reference)."""
    return torch.compile(flex_attention)


def _score(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    return score


@torch.compiler.disable
def _reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: BlockMask, scale: float | None):
    """FlexAttention's reference (eager higher-order op) with autograd, for training on a CPU: torch's public
    ``flex_attention`` refuses inputs that need gradients there. GQA is the op's own (kv head ``h // G``)."""
    from torch._higher_order_ops.flex_attention import flex_attention as flex_op

    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return flex_op(query, key, value, _score, mask.as_tuple(), scale, {})[0]


def implementation_name() -> str:
    """Register (idempotent) and return the HF attention-implementation name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, flex_attention_forward)
    AttentionMaskInterface.register(NAME, flex_mask)
    return NAME


def install_flex_attention(model) -> None:
    """Switch the built model to FlexAttention for packed rows, as decided (``ultrascale.levers.decide``: a causal
    ``sdpa`` decoder; the decision says why not, this only acts on it)."""
    model.set_attn_implementation(implementation_name())
