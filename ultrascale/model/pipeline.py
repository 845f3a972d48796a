"""Any stock HF decoder-only causal LM -> a DeepSpeed ``PipelineModule``, with no model rewrite.

HF decoders share one skeleton: ``model.embed_tokens`` -> ``model.layers[i]`` (each taking hidden states,
a causal mask, position ids and the rotary ``(cos, sin)``) -> ``model.norm`` -> ``lm_head``. The pipeline
layers below wrap those very modules, so the pipelined model computes the same function with the same
weights as the unpipelined one (that is what the parity test checks). Between stages only tensors may
travel, so every decoder layer receives ``(hidden, position_ids)`` and recomputes its rotary table and
mask locally: both are cheap functions of the position ids, far cheaper than sending them.

Weights: the whole HF model is built once per rank from ``train.seed`` (so init is bit-identical to the
non-pipelined run), the stage keeps its own layers, and the rest is freed when this function returns.
That costs one full fp32 copy in host memory at build time; for a from-scratch run of a model that does
not fit in host memory, start from ``model.pretrained_path`` instead.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from ultrascale.errors import ConfigError

log = logging.getLogger("ultrascale")


def _mask_for(config, layer_idx: int, hidden: torch.Tensor, pos: torch.Tensor):
    """The attention mask HF's own model would pass this layer (None when SDPA can use is_causal)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        sliding = layer_types[layer_idx] == "sliding_attention"
    else:
        sliding = getattr(config, "sliding_window", None) is not None
    fn = create_sliding_window_causal_mask if sliding else create_causal_mask
    return fn(config=config, inputs_embeds=hidden, attention_mask=None, past_key_values=None, position_ids=pos)


class EmbedPipe(nn.Module):
    """Stage entry: token ids -> (hidden, position_ids). Also the tied LM head (see ``tied_head``)."""

    def __init__(self, embed_tokens: nn.Embedding, dropout: float = 0.0):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.dropout = dropout

    def forward(self, inputs):
        """``ids`` or ``(ids, position_ids)``: packed documents bring position ids that restart at each one,
        and the decoder layers then build the block-diagonal mask from them (see ``_mask_for``)."""
        ids, pos = inputs if isinstance(inputs, tuple) else (inputs, None)
        hidden = self.embed_tokens(ids)
        if self.dropout:
            hidden = F.dropout(hidden, p=self.dropout, training=self.training)
        if pos is None:
            pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand(ids.shape[0], -1).contiguous()
        return hidden, pos


def tied_head(embed: EmbedPipe, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head of a tied-embedding model: logits against the (pipeline-synchronised) embedding matrix."""
    return F.linear(hidden, embed.embed_tokens.weight)


class DecoderPipe(nn.Module):
    """One HF decoder layer, speaking tensors only: (hidden, position_ids) in and out."""

    def __init__(self, layer: nn.Module, rotary: nn.Module, config, layer_idx: int):
        super().__init__()
        self.layer = layer
        self.rotary = rotary  # buffers only (inv_freq); each stage recomputes cos/sin from position ids
        self.config = config
        self.layer_idx = layer_idx

    def forward(self, inputs):
        hidden, pos = inputs
        out = self.layer(
            hidden,
            attention_mask=_mask_for(self.config, self.layer_idx, hidden, pos),
            position_ids=pos,
            position_embeddings=self.rotary(hidden, pos),
        )
        return (out[0] if isinstance(out, tuple) else out), pos


class NormPipe(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, inputs):
        return self.norm(inputs[0])


class HeadPipe(nn.Module):
    def __init__(self, lm_head: nn.Module):
        super().__init__()
        self.lm_head = lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, mean over predicted tokens: the value HF's ``ForCausalLMLoss`` returns."""
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)).float(), labels[:, 1:].reshape(-1), ignore_index=-100
    )


def _decoder_parts(model) -> tuple:
    """(embed_tokens, layers, norm, rotary_emb, lm_head) of an HF causal LM, or a ConfigError naming what is missing."""
    body = getattr(model, "model", None)
    parts = {
        "model.embed_tokens": getattr(body, "embed_tokens", None),
        "model.layers": getattr(body, "layers", None),
        "model.norm": getattr(body, "norm", None),
        "model.rotary_emb": getattr(body, "rotary_emb", None),
        "lm_head": getattr(model, "lm_head", None),
    }
    missing = [k for k, v in parts.items() if v is None]
    if missing:
        raise ConfigError(
            f"parallel.pp>1: {type(model).__name__} has no {missing}, so it is not a standard HF decoder: "
            "use a Llama/Qwen2/Qwen3/Mistral/StarCoder2-type model or parallel.pp=1"
        )
    return tuple(parts.values())


def build_pipeline(model, num_stages: int, partition_method: str, act_ckpt_interval: int, topology=None):
    """Wrap an HF causal LM as a PipelineModule. Collective (PipelineModule builds the process grid)."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    embed, layers, norm, rotary, lm_head = _decoder_parts(model)
    config = model.config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    dropout = float(getattr(config, "embedding_dropout", 0.0) or 0.0)
    if tied:
        specs = [TiedLayerSpec("embed", EmbedPipe, embed, dropout, tied_weight_attr="embed_tokens.weight")]
    else:
        specs = [LayerSpec(EmbedPipe, embed, dropout)]
    specs += [LayerSpec(DecoderPipe, layer, rotary, config, i) for i, layer in enumerate(layers)]
    specs.append(LayerSpec(NormPipe, norm))
    if tied:
        specs.append(
            TiedLayerSpec(
                "embed", EmbedPipe, embed, dropout, forward_fn=tied_head, tied_weight_attr="embed_tokens.weight"
            )
        )
    else:
        specs.append(LayerSpec(HeadPipe, lm_head))
    if partition_method == "uniform":
        # DeepSpeed's "uniform" balances *all* layers, embeddings and head included; balancing the
        # decoder layers is what users mean, and is what type:DecoderPipe does.
        partition_method = "type:DecoderPipe"
    kwargs = {"topology": topology} if topology is not None else {"num_stages": num_stages}
    return PipelineModule(
        layers=specs,
        loss_fn=causal_lm_loss,
        partition_method=partition_method,
        activation_checkpoint_interval=act_ckpt_interval,
        checkpointable_layers=["DecoderPipe"],  # never checkpoint the embedding: its integer input has no grad
        **kwargs,
    )


def stage_summary(engine) -> str:
    """'stage 0/2: layers 0-3 (EmbedPipe, DecoderPipe x2), 1.2M params' for the banner."""
    module = engine.module
    parts = module.partitions()  # every stage's [start, stop) layer boundaries
    start, stop = parts[engine.stage_id], parts[engine.stage_id + 1]
    names = [type(f).__name__ if isinstance(f, nn.Module) else "TiedHead" for f in module.forward_funcs]
    counts: dict[str, int] = {}
    for n in names:
        counts[n] = counts.get(n, 0) + 1
    n_params = sum(p.numel() for p in module.parameters())
    kinds = ", ".join(f"{k} x{v}" if v > 1 else k for k, v in counts.items())
    return (
        f"stage {engine.stage_id}/{engine.num_stages}: layers {start}-{stop - 1} "
        f"({kinds}), {n_params / 1e6:.2f}M params on this stage"
    )
