"""Any stock HF decoder-only causal LM -> a DeepSpeed ``PipelineModule`` whose stages build only their own layers.

HF decoders share one skeleton: ``model.embed_tokens`` -> ``model.layers[i]`` (each taking hidden states,
a causal mask, position ids and the rotary ``(cos, sin)``) -> ``model.norm`` -> ``lm_head``. The model is
first built on the ``meta`` device (shapes only, no memory); each ``LayerSpec`` then materializes one of its
modules, and DeepSpeed calls only the specs of this rank's stage. A stage's weights are either initialized by
``(train.seed, HF name)`` (:mod:`ultrascale.model.init`, so they equal the unpipelined model's) or read, tensor
by tensor, from the ``model.pretrained_path`` safetensors named by its index: no rank ever holds another
stage's layers. Between stages only tensors may travel, so every decoder layer receives ``(hidden,
position_ids)`` and recomputes its rotary table and mask locally: both are cheap functions of the position ids,
far cheaper than sending them.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from ultrascale.errors import ConfigError
from ultrascale.model.init import init_named_modules
from ultrascale.model.weights import SafetensorsWeights

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


@dataclass(frozen=True)
class StageBuild:
    """How a stage makes its modules out of the meta skeleton: materialized on CPU, then initialized by
    ``(seed, HF name)`` with the model's own ``_init_weights``, or loaded from ``weights``. Buffers no checkpoint
    holds (the rotary table) are always computed."""

    init_fn: Callable[[nn.Module], None]
    seed: int
    weights: SafetensorsWeights | None = None

    def make(self, meta: nn.Module, name: str) -> nn.Module:
        module = copy.deepcopy(meta).to_empty(device="cpu")
        names = ((f"{name}.{n}" if n else name, m) for n, m in module.named_modules())
        if self.weights is None or not module.state_dict():
            init_named_modules(names, self.init_fn, self.seed)
        else:
            self.weights.load_into(module, name)
        return module


class EmbedPipe(nn.Module):
    """Stage entry: token ids -> (hidden, position_ids). Also the tied LM head (see ``tied_head``)."""

    def __init__(self, build: StageBuild, embed_tokens: nn.Embedding, dropout: float = 0.0):
        super().__init__()
        self.embed_tokens = build.make(embed_tokens, "model.embed_tokens")
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

    def __init__(self, build: StageBuild, layer: nn.Module, rotary: nn.Module, config, layer_idx: int):
        super().__init__()
        self.layer = build.make(layer, f"model.layers.{layer_idx}")
        self.rotary = build.make(rotary, "model.rotary_emb")  # buffers only (inv_freq): recomputed, never loaded
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
    def __init__(self, build: StageBuild, norm: nn.Module):
        super().__init__()
        self.norm = build.make(norm, "model.norm")

    def forward(self, inputs):
        return self.norm(inputs[0])


class HeadPipe(nn.Module):
    def __init__(self, build: StageBuild, lm_head: nn.Module):
        super().__init__()
        self.lm_head = build.make(lm_head, "lm_head")

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


def meta_skeleton(hf_config, attn_implementation: str) -> nn.Module:
    """The HF model on the ``meta`` device: every module's shape and class, no memory, no initialization."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn_implementation)


def _meta_params(spec) -> int:
    """Trainable parameters of the module a spec would build, counted on the meta modules it is built from."""
    seen: dict[int, nn.Parameter] = {}
    for arg in (*spec.module_args, *spec.module_kwargs.values()):
        if isinstance(arg, nn.Module):
            seen.update({id(p): p for p in arg.parameters() if p.requires_grad})
    return sum(p.numel() for p in seen.values())


@cache
def _stage_pipeline_class() -> type:
    from deepspeed.pipe import LayerSpec, PipelineModule

    class StagePipeline(PipelineModule):
        """``PipelineModule`` whose ``partition_method=parameters`` counts on the meta skeleton. DeepSpeed's own
        count (0.19.8 ``_count_layer_params``) builds every layer on every rank: each stage would read the whole
        pretrained checkpoint (or draw the whole initialization) just to count it, then throw it away."""

        def _count_layer_params(self) -> list[int]:
            def count(spec) -> int:
                if isinstance(spec, LayerSpec):
                    return _meta_params(spec)
                if isinstance(spec, nn.Module):
                    return sum(p.numel() for p in spec.parameters() if p.requires_grad)
                return 0

            return [count(spec) for spec in self._layer_specs]

    return StagePipeline


def build_pipeline(
    hf_config,
    model_cfg,
    seed: int,
    num_stages: int,
    partition_method: str,
    act_ckpt_interval: int,
    topology=None,
):
    """A PipelineModule whose stages build only their own layers. Collective (it builds the process grid)."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    from ultrascale.paths import resolve_path

    skel = meta_skeleton(hf_config, str(model_cfg.attn_implementation))
    embed, layers, norm, rotary, lm_head = _decoder_parts(skel)
    weights = (SafetensorsWeights(resolve_path(model_cfg.pretrained_path), vocab=int(hf_config.vocab_size))
               if model_cfg.pretrained_path else None)  # fmt: skip
    build = StageBuild(skel._init_weights, model_cfg.init_seed if model_cfg.init_seed is not None else seed, weights)
    config = skel.config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    dropout = float(getattr(config, "embedding_dropout", 0.0) or 0.0)
    if tied:
        specs = [TiedLayerSpec("embed", EmbedPipe, build, embed, dropout, tied_weight_attr="embed_tokens.weight")]
    else:
        specs = [LayerSpec(EmbedPipe, build, embed, dropout)]
    specs += [LayerSpec(DecoderPipe, build, layer, rotary, config, i) for i, layer in enumerate(layers)]
    specs.append(LayerSpec(NormPipe, build, norm))
    if tied:
        specs.append(
            TiedLayerSpec(
                "embed", EmbedPipe, build, embed, dropout, forward_fn=tied_head, tied_weight_attr="embed_tokens.weight"
            )
        )
    else:
        specs.append(LayerSpec(HeadPipe, build, lm_head))
    if partition_method == "uniform":
        # DeepSpeed's "uniform" balances *all* layers, embeddings and head included; balancing the
        # decoder layers is what users mean, and is what type:DecoderPipe does.
        partition_method = "type:DecoderPipe"
    kwargs = {"topology": topology} if topology is not None else {"num_stages": num_stages}
    return _stage_pipeline_class()(
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
