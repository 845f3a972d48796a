"""Selective activation checkpointing keeps FlexAttention's output (issue 46, 1.5): the policy compares op objects,
and FlexAttention is a higher-order op (``torch.ops.higher_order.flex_attention``), which a list of aten names
missed, so every backward ran flex's forward again. And under the checkpoint's dispatch mode the compiled
FlexAttention kernel still runs, not the unfused path that materializes the scores."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from ultrascale.model import flex, recompute

FLEX = torch.ops.higher_order.flex_attention


class OpsRun(TorchDispatchMode):
    """Records every op, higher-order ones included, that runs while it is active."""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _documents(b, h, q, kv):
    return (q >= kv) & (q // 96 == kv // 96)  # two documents of 96 tokens a row


def _inputs(seq: int, heads: int = 4, kv_heads: int = 2, dim: int = 16, grad: bool = True):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, n, seq, dim, generator=g).requires_grad_(grad) for n in (heads, kv_heads, kv_heads)]


def _masked_sdpa(q, k, v):
    s = q.shape[2]
    i = torch.arange(s)
    dense = _documents(None, None, i[:, None], i[None, :])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)


def _selective(fn, *args, policy=recompute.selective_policy):
    return checkpoint(fn, *args, use_reentrant=False, context_fn=partial(recompute.selective_context, policy))


def test_selective_checkpointing_keeps_flexattentions_output():
    """With gradients (FlexAttention's reference op on a CPU, dispatched as the higher-order op a GPU's eager
    model dispatches too): the policy's verdict on the op object is MUST_SAVE, the backward runs flex's backward
    and never its forward again, and the gradients are those of an unchecked run."""
    q, k, v = _inputs(192)
    mask = flex.block_mask(_documents, 1, 192, 192, torch.device("cpu"))
    verdicts = []

    def recorded(ctx, func, *a, **kw):
        verdict = recompute.selective_policy(ctx, func, *a, **kw)
        verdicts.append((func, verdict))
        return verdict

    out = _selective(lambda q, k, v: flex.flex(q, k, v, mask), q, k, v, policy=recorded)
    assert (FLEX, CheckpointPolicy.MUST_SAVE) in verdicts, verdicts
    backward = OpsRun()
    with backward:
        out.square().sum().backward()
    assert FLEX not in backward.ops, "flex's forward ran again in the backward"
    assert torch.ops.higher_order.flex_attention_backward in backward.ops
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    flex.flex(q, k, v, mask).square().sum().backward()
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(got, want)


def test_compiled_flexattention_runs_under_the_selective_checkpoint(monkeypatch):
    """Without gradients (torch's CPU flex kernel is inference-only) under the selective checkpoint's forward
    dispatch mode and policy: the compiled kernel runs. Had the checkpoint's dispatch mode made torch.compile skip the frame, flex would
    run unfused (warning so) and dispatch as an eager op the policy sees; neither happens, the reference path is
    never taken, and the result is masked SDPA's."""
    import torch.nn.attention.flex_attention as flex_api

    def no_reference(*a, **kw):
        raise AssertionError("the reference FlexAttention ran")

    monkeypatch.setattr(flex, "_reference", no_reference)
    warned = []
    monkeypatch.setattr(flex_api, "_warn_once", lambda *a, **kw: warned.append(kw.get("warning_id", a)))
    seen = []

    def recorded(ctx, func, *a, **kw):
        seen.append(func)
        return recompute.selective_policy(ctx, func, *a, **kw)

    q, k, v = _inputs(192, heads=6, kv_heads=3, dim=8, grad=False)
    mask = flex.block_mask(_documents, 1, 192, 192, torch.device("cpu"))
    forward_mode, _ = recompute.selective_context(recorded)  # what a checkpointed forward runs under
    with torch.no_grad(), forward_mode:  # (checkpoint() itself enters it only with gradients)
        out = flex.flex(q, k, v, mask)
    assert not warned, warned
    assert FLEX not in seen, "FlexAttention ran as an eager op"
    torch.testing.assert_close(out, _masked_sdpa(q, k, v), atol=2e-5, rtol=1e-4)
