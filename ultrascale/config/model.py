"""``conf/model/``: which architecture and shape to build, and where pretrained weights come from."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from ultrascale.config.fields import num


class AttnImplementation(StrEnum):
    sdpa = "sdpa"
    eager = "eager"
    flash_attention_2 = "flash_attention_2"
    flash_attention_3 = "flash_attention_3"


@dataclass
class ModelConfig:
    type: str = "llama"
    """HF ``model_type`` (llama, qwen2, qwen3, mistral, starcoder2, mixtral, qwen3_moe, ...).
    Resolved through ``AutoConfig.for_model``, so any causal-LM architecture transformers ships works."""
    name: str = "tiny"
    """Human name of the shape, used in run names and logs."""
    config: dict[str, Any] = field(default_factory=dict)
    """Keyword overrides for the HF config class (hidden_size, num_hidden_layers, ...). Keys are checked
    against the config class at validation time, because HF configs accept unknown kwargs silently."""
    pretrained_path: str | None = None
    """Local HF model directory to start from (fine-tune / continued pretraining). Never a hub id:
    there is no hub access at run time."""
    attn_implementation: AttnImplementation = AttnImplementation.sdpa
    """``sdpa`` (fused, no s^2 activation term), ``eager`` (reference), or ``flash_attention_2`` on GPU."""
    init_seed: int | None = num(None, ge=0)
    """Seed for weight init; defaults to ``train.seed`` so every rank builds identical weights."""
