"""The shape of an HF causal LM as the planner needs it: dimensions plus an exact parameter census.

Dimensions come from the HF config; parameter counts come from building the model on the ``meta``
device (no memory, no init) and classifying each tensor. Building beats re-deriving formulas per
architecture: biases, q/k norms, routers, shared experts and tied embeddings are counted exactly as
the model that ``train.py`` builds has them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ultrascale.config.model import ModelConfig

_EXPERT = re.compile(r"\.experts\.")  # fused or per-expert routed weights; not shared_experts
_LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass(frozen=True)
class Arch:
    """What the memory and time models read. Counts are elements, not bytes."""

    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    """Dense MLP width (0 for all-MoE models)."""
    gated_mlp: bool
    """SwiGLU-style (gate*up) MLP versus a plain 2-matrix GELU MLP (StarCoder2, GPT-2)."""
    vocab: int
    tied: bool
    sliding_window: int | None
    experts: int
    """Routed experts per MoE layer (0 = dense)."""
    top_k: int
    moe_intermediate: int
    shared_intermediate: int
    """Shared-expert MLP width (Qwen2-MoE style); 0 if none."""
    moe_layers: int
    total_params: int
    embed_params: int
    """Input embedding (a lookup: no matmul FLOPs)."""
    lm_head_params: int
    """Separate output projection; 0 when tied to the input embedding."""
    expert_params: int
    """Routed-expert weights across all layers: the only thing expert parallelism divides."""
    matmul_params: int
    """Weights that take part in a matmul per token, with routed experts at full size."""
    max_layer_params: int
    """Largest decoder layer (DeepSpeed's ZeRO-3 estimator wants it)."""
    layer_params: tuple[int, ...]
    """Parameters of each decoder layer, in order (pipeline stage balancing)."""
    param_sizes: tuple[int, ...]
    """Element count of every parameter tensor (ZeRO-3 persistence threshold)."""
    rms_norm: bool
    """RMSNorm (saves an fp32 copy of its input) versus LayerNorm (saves input and output)."""

    @property
    def dense_params(self) -> int:
        return self.total_params - self.expert_params

    @property
    def active_matmul_params(self) -> int:
        """Matmul weights one token touches: routed experts scaled by top_k / experts, plus the LM head."""
        routed = self.expert_params * self.top_k / self.experts if self.experts else 0
        lm_head = self.vocab * self.hidden  # tied or not, the logits matmul runs
        return int(self.matmul_params - self.expert_params - self.lm_head_params + routed + lm_head)


def _get(hf: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        v = getattr(hf, n, None)
        if v is not None:
            return v
    return default


def _census(hf: Any) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    embed = model.get_input_embeddings().weight
    out_emb = model.get_output_embeddings()
    head = out_emb.weight if out_emb is not None else None
    tied = head is None or head is embed
    total = expert = matmul = 0
    per_layer: dict[int, int] = {}
    for name, p in model.named_parameters():  # named_parameters() already deduplicates tied tensors
        n = p.numel()
        total += n
        if _EXPERT.search(name):
            expert += n
        if p.ndim >= 2 and p is not embed:
            matmul += n
        m = _LAYER.search(name)
        if m:
            per_layer[int(m.group(1))] = per_layer.get(int(m.group(1)), 0) + n
    names = [name for name, _ in model.named_parameters()]
    moe_layers = len({int(m.group(1)) for name in names if _EXPERT.search(name) and (m := _LAYER.search(name))})
    gated = any(re.search(r"mlp\..*(gate_proj|gate_up_proj|w3)", name) for name in names)
    layer_params = tuple(per_layer[i] for i in sorted(per_layer))
    return {
        "total_params": total,
        "embed_params": embed.numel(),
        "lm_head_params": 0 if tied else head.numel(),
        "expert_params": expert,
        "matmul_params": matmul,
        "max_layer_params": max(layer_params, default=0),
        "layer_params": layer_params,
        "moe_layers": moe_layers,
        "tied": tied,
        "gated_mlp": gated,
        "param_sizes": tuple(p.numel() for p in model.parameters()),
        "rms_norm": not any(re.search(r"layernorm\.bias|norm\.bias", name) for name in names),
    }


_ARCH_CACHE: dict[str, Arch] = {}


def _arch_from_hf(hf: Any) -> Arch:
    hidden = hf.hidden_size
    heads = hf.num_attention_heads
    experts = int(_get(hf, "num_local_experts", "num_experts", "n_routed_experts", default=0) or 0)
    census = _census(hf)
    return Arch(
        model_type=hf.model_type,
        hidden=hidden,
        layers=hf.num_hidden_layers,
        heads=heads,
        kv_heads=_get(hf, "num_key_value_heads", default=heads) or heads,
        head_dim=_get(hf, "head_dim", default=hidden // heads) or hidden // heads,
        intermediate=_get(hf, "intermediate_size", default=0) or 0,
        vocab=hf.vocab_size,
        sliding_window=_get(hf, "sliding_window", default=None) if getattr(hf, "use_sliding_window", True) else None,
        experts=experts,
        top_k=int(_get(hf, "num_experts_per_tok", "moe_top_k", default=0) or 0) if experts else 0,
        moe_intermediate=int(_get(hf, "moe_intermediate_size", "intermediate_size", default=0) or 0) if experts else 0,
        shared_intermediate=int(_get(hf, "shared_expert_intermediate_size", default=0) or 0),
        **census,
    )


def arch_from_hf(hf: Any) -> Arch:
    """Arch for an HF config object, cached on its full contents."""
    key = json.dumps(hf.to_dict(), sort_keys=True, default=str)
    if key not in _ARCH_CACHE:
        _ARCH_CACHE[key] = _arch_from_hf(hf)
    return _ARCH_CACHE[key]


def arch_from_cfg(model: ModelConfig) -> Arch:
    """Arch for a composed config's ``model`` group (the HF config the trainer builds, built once)."""
    from ultrascale.model.build import build_hf_config

    return arch_from_hf(build_hf_config(model))
