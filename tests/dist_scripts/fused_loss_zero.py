"""2-rank DeepSpeed runs of a tiny Llama with and without the fused loss (run by tests/test_loss.py).

Usage: torchrun --nproc_per_node 2 tests/dist_scripts/fused_loss_zero.py OUT
For ZeRO-1 and ZeRO-3, tied and untied head, each rank trains 3 steps (fp32, gloo, torch AdamW) of the
same model on one rank-specific batch three ways: the stock HF loss; ``install_fused_loss`` before
``deepspeed.initialize`` (ZeRO-3: the model is built partitioned under ``HfDeepSpeedConfig``, as
ultrascale/train/engine.py does); and, at ZeRO-3, on a model built whole and partitioned by
``deepspeed.initialize``, installed before it or on ``engine.module`` after it. Every rank
appends one JSON line per run to ``OUT.<rank>``: the losses, the global gradient norms, and (ZeRO-3)
whether the head weight was partitioned and registered as an external parameter of the model.
"""

from __future__ import annotations

import json
import sys

import deepspeed
import torch
import torch._dynamo  # zero.Init patches tensor creation: dynamo and the model module must be imported first
import torch.distributed as dist
import transformers.models.llama.modeling_llama  # noqa: F401
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations import HfDeepSpeedConfig

from ultrascale.model.loss import install_fused_loss
from ultrascale.runtime.dist import gloo_threads, shutdown

STEPS = 3
CHUNK = 24  # 64 tokens per micro-batch: three chunks, the last one short
WHOLE = ("fused_before_partition", "fused_after_init")  # built unpartitioned; deepspeed.initialize partitions


def ds_config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10_000,
        "wall_clock_breakdown": False,
    }


def build(stage: int, tied: bool, zero_init: bool = True) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tied, use_cache=False, bos_token_id=0, eos_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    keep_alive = (
        HfDeepSpeedConfig(ds_config(stage)) if stage == 3 and zero_init else None
    )  # transformers holds a weakref
    model = LlamaForCausalLM(cfg)
    del keep_alive
    return model


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank-specific batch, trained on every step so the loss must fall."""
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, 384, (2, 32), generator=g)
    labels = ids.clone()
    labels[:, :4] = -100  # a masked prompt
    return ids, labels


def run(stage: int, tied: bool, mode: str, rank: int) -> dict:
    model = build(stage, tied, zero_init=mode not in WHOLE)
    head = model.get_output_embeddings().weight
    if mode in ("fused", "fused_before_partition"):
        install_fused_loss(model, chunk_tokens=CHUNK)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(stage))
    if mode == "fused_after_init":
        install_fused_loss(engine.module, chunk_tokens=CHUNK)
    losses, norms = [], []
    ids, labels = batch(rank)
    for _ in range(STEPS):
        out = engine(input_ids=ids, labels=labels)
        if mode != "plain":
            assert out.logits is None, "the fused path must not build logits"
        engine.backward(out.loss)
        engine.step()
        losses.append(float(out.loss))
        norms.append(float(engine.get_global_grad_norm()))
    registered = hasattr(head, "ds_id") and id(head) in getattr(engine.module, "_external_params", {})
    row = {"stage": stage, "tied": tied, "mode": mode, "rank": rank, "losses": losses, "grad_norms": norms,
           "head_partitioned": hasattr(head, "ds_id"), "head_registered": registered}  # fmt: skip
    engine.destroy()
    return row


def main() -> None:
    out_path = sys.argv[1]
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    scenarios = [(s, t, m) for s in (3, 1) for t in (False, True) for m in ("plain", "fused")]
    scenarios += [(3, False, "fused_before_partition"), (3, False, "fused_after_init")]
    with open(f"{out_path}.{rank}", "w") as f:
        for stage, tied, mode in scenarios:
            f.write(json.dumps(run(stage, tied, mode, rank)) + "\n")
            f.flush()
    shutdown()  # what train.py does: no process group may be left for interpreter exit to destroy
    with open(f"{out_path}.{rank}.exit", "w") as f:
        f.write(json.dumps({"gloo_threads_after_shutdown": gloo_threads()}) + "\n")


if __name__ == "__main__":
    main()
