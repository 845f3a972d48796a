"""Build a stock ``transformers`` causal LM from the ``model`` config group, never touching a hub."""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from ultrascale.errors import ConfigError


def build_hf_config(model_cfg: DictConfig):
    """HF config from ``model.type`` + ``model.config`` overrides, or from ``model.pretrained_path``."""
    from transformers import AutoConfig

    overrides = OmegaConf.to_container(model_cfg.config, resolve=True) if model_cfg.config else {}
    if model_cfg.pretrained_path:
        path = Path(model_cfg.pretrained_path)
        if not (path / "config.json").exists():
            raise ConfigError(
                f"model.pretrained_path={path} has no config.json: point it at a local HF model directory"
            )
        hf = AutoConfig.from_pretrained(str(path), local_files_only=True)
        for k, v in overrides.items():
            setattr(hf, k, v)
    else:
        hf = AutoConfig.for_model(model_cfg.type, **overrides)
    hf.use_cache = False  # training: the KV cache only costs memory
    return hf


def build_model(model_cfg: DictConfig, seed: int, dtype: torch.dtype = torch.float32):
    """Identical weights on every rank (same seed), built on CPU in ``dtype``."""
    from transformers import AutoModelForCausalLM

    hf = build_hf_config(model_cfg)
    torch.manual_seed(model_cfg.init_seed if model_cfg.init_seed is not None else seed)
    kwargs = {"attn_implementation": model_cfg.attn_implementation, "dtype": dtype}
    if model_cfg.pretrained_path:
        model = AutoModelForCausalLM.from_pretrained(
            str(model_cfg.pretrained_path), config=hf, local_files_only=True, **kwargs
        )
    else:
        model = AutoModelForCausalLM.from_config(hf, **kwargs)
    return model


def count_params(model_cfg: DictConfig) -> dict[str, int]:
    """Parameter counts without allocating weights (meta device), for dry runs of 15B shapes on a laptop."""
    from transformers import AutoModelForCausalLM

    hf = build_hf_config(model_cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    seen: set[int] = set()
    total = embed = 0
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        if "embed" in name or "lm_head" in name:
            embed += p.numel()
    return {"total": total, "embedding": embed, "non_embedding": total - embed}


def torch_dtype(name: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
