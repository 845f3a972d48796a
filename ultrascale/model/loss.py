"""The LM loss without the [tokens, vocab] logits: a chunked linear cross-entropy.

For a small model with a big vocabulary the logits are the largest activation of the step: SmolLM2-135M at
seq 2,048 and vocab 49,152 holds 2,048 x 49,152 fp32 logits (403 MB) plus their gradient (another 403 MB)
per sample, more than all its weights. The HF forward materialises them, upcasts them to fp32, and keeps
them for backward. Here the rows are walked in chunks: each chunk's logits are computed, turned into its
loss *and* its gradients (softmax minus one-hot, w.r.t. the hidden states and the head's weight) at once,
and freed, so only ``chunk x vocab`` logits ever exist. Backward then only scales the stored gradients.
The arithmetic is the same as ``F.cross_entropy(hidden @ weight.T, labels)`` (tests check 1e-5 in fp32).

On this CPU the chunked pass is also faster than the plain one (the chunk stays in cache; 256 tokens per
chunk measured best for vocab 4,096 and 49,152). On CUDA a fused kernel is the right tool: ``impl="auto"``
uses Liger-Kernel's fused linear cross-entropy, or Apple's Cut Cross-Entropy, when one is installed (neither
is a dependency: both need Triton). Those two paths were not run on this CPU-only machine.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
DEFAULT_CHUNK_TOKENS = 256
"""Rows per chunk: measured fastest on this CPU for vocab 4,096 and 49,152 (chunk x vocab x 4 bytes live)."""

IMPLS = ("auto", "chunked", "liger", "cce")


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk: int, ignore_index: int, reduction: str, with_grads: bool):
        n = hidden.shape[0]
        valid = labels != ignore_index
        n_valid = int(valid.sum())
        scale = 1.0 / n_valid if (reduction == "mean" and n_valid) else 1.0
        need_h = with_grads and ctx.needs_input_grad[0]
        need_w = with_grads and ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        targets = labels.clamp(min=0)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            vm = valid[s:e]
            if n_valid == 0:
                break
            hc = hidden[s:e]
            logits = (hc @ weight.t()).float()  # fp32 from here on, whatever the input dtype
            lse = torch.logsumexp(logits, dim=-1)
            tgt = logits.gather(1, targets[s:e, None]).squeeze(1)
            total += ((lse - tgt) * vm).sum()
            if need_h or need_w:
                p = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
                p[torch.arange(e - s, device=p.device), targets[s:e]] -= 1.0
                p.mul_(vm[:, None].to(p.dtype) * scale)
                if need_h:
                    grad_h[s:e] = (p.to(hidden.dtype) @ weight).to(hidden.dtype)
                if need_w:
                    grad_w.addmm_(p.t(), hc.float())
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return total * scale

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None
        gw = (grad_w * grad_out).to(ctx.weight_dtype) if grad_w is not None else None
        return gh, gw, None, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_tokens: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
    impl: str = "auto",
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against ``labels`` (already shifted), without full logits.

    hidden [N, h], weight [V, h], labels [N] with ``ignore_index`` for rows that have no target. ``mean``
    divides by the number of targets (HF's default), ``sum`` does not (sequence-parallel shards need it).
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction={reduction!r}: use 'mean' or 'sum'")
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: use one of {IMPLS}")
    gpu = _gpu_impl(impl, hidden)
    if gpu is not None:
        return gpu(hidden, weight, labels, ignore_index, reduction)
    chunk = int(chunk_tokens or DEFAULT_CHUNK_TOKENS)
    with_grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _ChunkedLinearCE.apply(hidden, weight, labels, chunk, ignore_index, reduction, with_grads)


def _gpu_impl(impl: str, hidden: torch.Tensor):
    """A fused CUDA kernel from an installed library, or None (CPU, or nothing installed)."""
    if impl == "chunked" or not hidden.is_cuda:
        if impl in ("liger", "cce") and not hidden.is_cuda:
            raise ValueError(f"impl={impl!r} needs CUDA tensors; on CPU use impl='chunked' (or 'auto')")
        return None
    if impl in ("auto", "liger"):
        try:
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
        except ImportError:
            if impl == "liger":
                raise ValueError("impl='liger' needs `pip install liger-kernel` (CUDA + Triton)") from None
        else:

            def liger(h, w, y, ignore, red):
                out = liger_fused_linear_cross_entropy(h, w, y, ignore_index=ignore, reduction=red)
                return out[0] if isinstance(out, tuple) else out  # some releases also return the z-loss

            return liger
    if impl in ("auto", "cce"):
        try:
            from cut_cross_entropy import linear_cross_entropy as cce
        except ImportError:
            if impl == "cce":
                raise ValueError("impl='cce' needs `pip install cut-cross-entropy` (CUDA + Triton)") from None
        else:
            return lambda h, w, y, ignore, red: cce(h, w, y, ignore_index=ignore, reduction=red)
    return None


def install_fused_loss(model, chunk_tokens: int | None = None, impl: str = "auto") -> bool:
    """Make an HF ``*ForCausalLM`` compute its training loss with :func:`linear_cross_entropy`.

    Only the instance's ``forward`` changes (DeepSpeed's engine calls ``module(**kwargs)``): the class, the
    state-dict keys and every call without ``labels`` (generation, evaluation that wants logits) stay as
    they were. Returns False for MoE models (their forward adds the router loss; keep the plain path).
    Raises ValueError for heads that are not a plain linear map (soft-capped or scaled logits, a bias).
    Under ZeRO-3 the head's weight is registered as an external parameter of the model, because the
    head module's own forward (where DeepSpeed would gather it) no longer runs.
    """
    from transformers.modeling_outputs import CausalLMOutputWithPast

    config = model.config
    if getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None):
        return False
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale"):
        value = getattr(config, attr, None)
        if value not in (None, 1, 1.0, False):
            raise ValueError(f"{type(model).__name__} transforms its logits ({attr}={value}); the fused loss would not")
    head = model.get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None:
        raise ValueError(f"{type(model).__name__} has no bias-free linear LM head")
    decoder = model.get_decoder()
    original = model.forward

    def forward(input_ids=None, attention_mask=None, position_ids=None, labels=None, **kwargs):
        if labels is None:
            return original(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        kwargs.pop("logits_to_keep", None)
        out = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        hidden = out.last_hidden_state
        targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]  # exactly HF's ForCausalLMLoss shift
        loss = linear_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]), head.weight, targets.reshape(-1), chunk_tokens=chunk_tokens, impl=impl
        )
        return CausalLMOutputWithPast(
            loss=loss, logits=None, hidden_states=out.hidden_states, attentions=out.attentions
        )

    model.forward = forward
    if hasattr(head.weight, "ds_id"):
        from deepspeed.runtime.zero import register_external_parameter

        register_external_parameter(model, head.weight)
    return True
