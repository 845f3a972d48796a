"""Selective activation checkpointing keeps FlexAttention's output (issue 46, 1.5): the policy compares op objects,
and FlexAttention is a higher-order op (``torch.ops.higher_order.flex_attention``), which a list of aten names
missed, so every backward ran flex's forward again. And under the checkpoint's dispatch mode the compiled
FlexAttention kernel still runs, not the unfused path that materializes the scores. Under torch.compile with
gradients (issue 54) a compiled layer's backward runs neither the attention's nor a matmul's forward again."""

from __future__ import annotations

import json
import sys
from functools import partial

import torch
import torch.nn.functional as F
from torch._prims.rng_prims import run_with_rng_state
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from ultrascale.model import flex, recompute

FLEX = torch.ops.higher_order.flex_attention


class OpsRun(TorchDispatchMode):
    """Records every op, higher-order ones included, that runs while it is active; an op a compiled backward
    recomputes under its forward's random state (``run_with_rng_state``: SDPA may drop out) as the op itself."""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(args[1] if func is run_with_rng_state else func)
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


SDPA_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def test_a_compiled_layers_backward_runs_neither_the_attentions_nor_a_matmuls_forward_again(monkeypatch):
    """Selective checkpointing under torch.compile with gradients, wired as ``train.compile_scope=layers`` wires it
    (``enable_checkpointing(compiled_layers=True)``: the checkpoint inside each compiled layer's forward). The
    policy is asked while the layer is traced, of ``aten.mm.default`` and the attention op (not of the ``mm.out``
    calls of Inductor's generated code, which it cannot keep), and keeps them; the compiled backward then runs the
    attention's backward once and its forward never, and its GEMMs are the gradients alone (two per linear: the
    layer's 7 and the head). The gradients are those of the eager model without checkpointing.

    Compiled with ``aot_eager_decomp_partition``: Inductor's decompositions and min-cut partitioner (which applies
    the policy's tags to the joint graph) with eager kernels in place of generated code, so the backward's ops pass
    the dispatcher and are counted (Inductor's C++ build alone takes ~15 s here). What a CPU cannot show (Inductor's
    generated code, CUDA's SDPA kernels, compiled FlexAttention with gradients, which torch refuses on a CPU) the
    GPU probe's ``recompute`` section measures (``python bench/gpu_probe.py --dry-run``)."""
    from torch._dynamo.backends.registry import lookup_backend
    from transformers import AutoConfig, AutoModelForCausalLM

    policy, verdicts, graphs = recompute.selective_policy, [], []

    def recorded(ctx, func, *a, **kw):
        verdict = policy(ctx, func, *a, **kw)
        verdicts.append((func, verdict))
        return verdict

    def backend(gm, example_inputs):  # what was compiled: one graph, the checkpoint in it
        graphs.append(gm)
        return lookup_backend("aot_eager_decomp_partition")(gm, example_inputs)

    monkeypatch.setattr(recompute, "selective_policy", recorded)
    hf = AutoConfig.for_model("llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1, use_cache=False)  # fmt: skip
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(AutoModelForCausalLM.from_config(hf, attn_implementation="sdpa").train())
    compiled, eager = models
    recompute.enable_checkpointing(compiled, "selective", compiled_layers=True)
    compiled.model.layers[0].compile(backend=backend, fullgraph=True)
    loss = compiled(input_ids=ids, labels=ids).loss
    (graph,) = graphs
    tagged = [n for n in graph.graph.nodes if n.target is torch.ops.higher_order.tag_activation_checkpoint]
    assert tagged, "the checkpoint is outside the compiled graph: the policy would meet Inductor's mm.out"
    backward = OpsRun()
    with backward:
        loss.backward()
    assert backward.ops.count(SDPA_CPU.default) == 0, "the attention's forward ran again in the backward"
    assert backward.ops.count(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default) == 1
    assert backward.ops.count(torch.ops.aten.mm.default) == 2 * (7 + 1), "a matmul's forward ran again"
    kept = {func for func, verdict in verdicts if verdict == CheckpointPolicy.MUST_SAVE}
    assert kept == {torch.ops.aten.mm.default, SDPA_CPU.default}, verdicts
    eager(input_ids=ids, labels=ids).loss.backward()
    for (name, got), want in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(got.grad, want.grad, msg=name)


def test_the_gpu_probe_measures_what_a_cpu_cannot_show_and_says_so_in_its_plan(tmp_path):
    """Inductor's generated code, CUDA's attention kernels and compiled FlexAttention with gradients: the probe's
    ``recompute`` section counts the attention's forward in each compiled backward, and its plan says why it is
    the GPU's to measure. A re-run reads RE-RUN in its row."""
    from tests.test_ckpt_staging import gpu_probe

    probe = gpu_probe()
    (step,) = [s for s in probe.Plan(tmp_path, tmp_path, ["recompute"], {}).steps if s.section == "recompute"]
    assert step.cmds == [[sys.executable, probe.__file__, "--worker", "recompute"]]
    assert "a CPU cannot show this" in step.measures and "FlexAttention with gradients" in step.measures
    row = {"kernel": "flex", "device": "cuda", "seconds": 9.0, "graphs": 1, "checkpoint_in_graph": True,
           "kept": ["flex_attention", "mm"], "attention": "flex_attention", "attention_forward_in_backward": 1,
           "attention_backward_in_backward": 1, "mm_in_backward": 14, "mm_gradients": 14}  # fmt: skip
    res = {"tails": ['{"device": "cuda", "rows": [' + json.dumps(row) + "]}"]}
    (parsed,) = probe.p_recompute(step, res, {})
    assert parsed["result"].startswith("RE-RUN: flex_attention forward 1x in the compiled backward"), parsed
    res = {"tails": ['{"rows": [' + json.dumps({**row, "attention_forward_in_backward": 0}) + "]}"]}
    assert probe.p_recompute(step, res, {})[0]["result"].startswith("kept: "), res
