"""The model as the sampler calls it (:class:`LM`): one forward over new positions of the rows in flight,
returning fp32 logits of the last positions. Where the logits are a plain head product it computes them itself
(:func:`plain_head`), the product the static step also needs."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from transformers.cache_utils import Cache


def plain_head(model) -> tuple[torch.nn.Module, torch.Tensor] | None:
    """The base model and head weight of a causal LM whose logits are ``hidden @ W^T`` and nothing else."""
    from ultrascale.model.attention import CAUSAL_MODEL_TYPES

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    base = getattr(model, "base_model", None)
    if getattr(model.config, "model_type", None) not in CAUSAL_MODEL_TYPES or base is None or base is model:
        return None
    if not isinstance(head, torch.nn.Linear) or head.bias is not None or hasattr(head.weight, "ds_id"):
        return None  # a bias, or a ZeRO-3 partitioned weight that only the module's hooks gather
    return base, head.weight


class LM:
    """A causal LM with what every forward of the sampler shares: its device, the token fed where a row has none
    (``pad``: left padding, finished rows, short drafts), the autocast setting, and the plain head if any."""

    def __init__(self, model, pad: int, autocast: tuple[str, torch.dtype] | None) -> None:
        self.model, self.pad, self.autocast = model, pad, autocast
        self.device = next(model.parameters()).device
        cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        self.layers = int(cfg.num_hidden_layers)
        self.head = plain_head(model)
        """(base model, head weight) where the logits are a plain product with the head (no bias, scale or
        softcap) and can be computed here; None: the model's own forward computes them."""

    @property
    def base(self) -> torch.nn.Module:
        return self.head[0]

    def autocast_ctx(self, **kw):
        return torch.autocast(*self.autocast, **kw) if self.autocast else nullcontext()

    def logits(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Cache, keep: int = 1):
        """The logits of the last ``keep`` positions of every row, fp32: [rows, vocab] for keep=1, else
        [rows, keep, vocab]."""
        with self.autocast_ctx():
            if self.head is None:
                out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                                 use_cache=True, logits_to_keep=keep)  # fmt: skip
                logits = out.logits[:, -keep:, :]
            else:
                h = self.head[0](input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                                 use_cache=True).last_hidden_state[:, -keep:, :]  # fmt: skip
                logits = self.head_logits(h.reshape(-1, h.shape[-1])).view(*h.shape[:2], -1)
        logits = logits.float()
        return logits[:, -1, :] if keep == 1 else logits

    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> fp32 [rows, vocab]. W @ h^T rather than h @ W^T: with a few rows, MKL's tall-skinny
        GEMM reads the 49k x 576 head 1.5-1.8x faster than F.linear's (bench/README.md)."""
        return torch.mm(self.head[1], h.t()).t().float()
