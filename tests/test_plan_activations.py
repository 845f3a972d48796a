"""Predicted activation bytes vs the bytes autograd really saves for backward, on real HF models (CPU, bf16).

Measured with ``torch.autograd.graph.saved_tensors_hooks``, deduplicated by storage, parameters excluded:
that is exactly the memory backward keeps alive. Reentrant checkpointing saves each layer's input through
the same hooks, so the checkpointed case is measured the same way.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ultrascale.cost.memory import Layout, activation_bytes
from ultrascale.model.arch import arch_from_hf

MODELS = {
    "llama": (
        "llama",
        dict(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=352,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        ),
    ),
    "starcoder2": (
        "starcoder2",
        dict(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            use_bias=True,
            sliding_window=None,
            bos_token_id=0,
            eos_token_id=0,
        ),
    ),
    "mixtral": (
        "mixtral",
        dict(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
    ),
}


def saved_bytes(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """Bytes of distinct storages autograd saves for backward in one forward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen.setdefault(st.data_ptr(), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    return sum(seen.values())


@pytest.mark.parametrize("ckpt", [False, True], ids=["full", "ckpt"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("seq_len", [64, 256])
@pytest.mark.parametrize("name", list(MODELS))
def test_activation_bytes_match_saved_tensors(name: str, seq_len: int, attn: str, ckpt: bool) -> None:
    model_type, kwargs = MODELS[name]
    hf = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf, attn_implementation=attn).to(torch.bfloat16).train()
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ids = torch.randint(0, hf.vocab_size, (2, seq_len))
    measured = saved_bytes(model, ids)
    lay = Layout(
        world=1, micro_batch=2, global_batch=2, seq_len=seq_len, dtype="bf16", attn=attn, activation_checkpointing=ckpt
    )
    predicted, _ = activation_bytes(arch_from_hf(hf), lay)
    print(f"PLAN-ACT {name} s={seq_len} {attn} ckpt={ckpt} predicted={predicted:.0f} measured={measured}")
    assert predicted == pytest.approx(measured, rel=0.10)
