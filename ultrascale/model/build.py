"""Build a stock ``transformers`` causal LM from the ``model`` config group, never touching a hub."""

from __future__ import annotations

import contextlib
import copy
import json
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ultrascale.errors import ConfigError
from ultrascale.paths import resolve_path

if TYPE_CHECKING:
    from ultrascale.config.model import ModelConfig


def build_hf_config(model_cfg: ModelConfig) -> Any:
    """HF config from ``model.type`` + ``model.config`` overrides, or from ``model.pretrained_path``.

    Built once per distinct model group and copied out (callers such as the MoE setup write to it): the
    planner validates thousands of layouts of one model.
    """
    from omegaconf import OmegaConf

    overrides = model_cfg.config
    if OmegaConf.is_config(overrides):
        overrides = OmegaConf.to_container(overrides, resolve=True)
    path = str(resolve_path(model_cfg.pretrained_path)) if model_cfg.pretrained_path else None
    key = (str(model_cfg.type), json.dumps(overrides or {}, sort_keys=True), path)
    return copy.deepcopy(_hf_config(*key))


@cache
def _hf_config(model_type: str, overrides_json: str, pretrained_path: str | None) -> Any:
    from transformers import AutoConfig

    overrides = json.loads(overrides_json)
    if pretrained_path:
        path = Path(pretrained_path)
        if not (path / "config.json").exists():
            raise ConfigError(
                f"model.pretrained_path={path} has no config.json: point it at a local HF model directory"
            )
        hf = AutoConfig.from_pretrained(str(path), local_files_only=True)
        for k, v in overrides.items():
            setattr(hf, k, v)
    else:
        try:
            hf = AutoConfig.for_model(model_type, **overrides)
        except ValueError as e:
            raise ConfigError(f"model.type={model_type!r} with model.config={overrides}: {e}") from None
    hf.use_cache = False  # training: the KV cache only costs memory
    return hf


def require_attn_kernel(attn: str) -> None:
    """A flash attention implementation is a package HF imports at build time; without it HF raises an
    ImportError deep in the build. Checked before anything is built, so it is one ``error:`` line naming the key."""
    if not attn.startswith("flash"):
        return
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

    if (is_flash_attn_3_available if attn == "flash_attention_3" else is_flash_attn_2_available)():
        return
    package = "flash-attn-3 (flash_attn_interface)" if attn == "flash_attention_3" else "flash-attn"
    raise ConfigError(
        f"model.attn_implementation={attn} needs the {package} package and a CUDA GPU on every rank: install it "
        "(pip install flash-attn --no-build-isolation) or set model.attn_implementation=sdpa (under Ulysses, sdpa "
        "lets packed documents attend to each other: data.document_masking turns off)"
    )


def build_model(
    model_cfg,
    seed: int,
    hf_config: Any = None,
    dtype: torch.dtype = torch.float32,
    zero3: dict | None = None,
    partitioned_experts: bool = False,
):
    """Built on CPU in ``dtype`` from ``hf_config`` (built from ``model_cfg`` when not given): a checkpoint's
    weights, or weights keyed by ``(seed, parameter name)`` (:mod:`ultrascale.model.init`), which every rank
    and every layout (whole, ZeRO-3 partitioned, pipeline stages) draws identically.

    ``zero3`` (the run's DeepSpeed JSON at stage 3): the model is partitioned from its first byte. It is built
    inside ``deepspeed.zero.Init`` without HF's initializer (which would gather every module whole on every rank
    only for the weights to be drawn again); then each rank draws its own slices, or reads them from the
    checkpoint one module at a time (:func:`ultrascale.model.weights.load_partitioned`: transformers' own ZeRO-3
    loader held more than the whole model per rank).

    ``partitioned_experts`` (ZeRO-1/2 with AutoEP; ``zero3`` then a stage-3 copy of the JSON for ``zero.Init``):
    built partitioned the same way, then every parameter outside the routed experts is made whole again
    (:func:`ultrascale.model.moe.gather_non_experts`: ZeRO-1/2 replicate them). The experts stay partitioned until
    AutoEP, inside ``deepspeed.initialize``, gathers one layer at a time and keeps this rank's 1/ep: no rank ever
    holds every expert, which is most of an MoE model (Mixtral-8x7B: 45 of 47B parameters).
    """
    from transformers import AutoModelForCausalLM

    hf = hf_config if hf_config is not None else build_hf_config(model_cfg)
    torch.manual_seed(model_cfg.init_seed if model_cfg.init_seed is not None else seed)
    kwargs = {"attn_implementation": str(model_cfg.attn_implementation), "dtype": dtype}
    if model_cfg.pretrained_path and zero3 is None and not grows_vocab(model_cfg, hf):
        return AutoModelForCausalLM.from_pretrained(
            str(resolve_path(model_cfg.pretrained_path)), config=hf, local_files_only=True, **kwargs
        )
    from transformers.initialization import no_init_weights

    with no_init_weights(), _zero3_init(zero3, hf):  # drawn (or read) once, below, by name, on every rank
        model = AutoModelForCausalLM.from_config(hf, **kwargs)
    model.tie_weights()  # skipped with the init: a tied head must be the embedding before it is drawn
    if model_cfg.pretrained_path:
        from ultrascale.model.weights import SafetensorsWeights, load_partitioned

        load_partitioned(model, SafetensorsWeights(resolve_path(model_cfg.pretrained_path), vocab=int(hf.vocab_size)))
    else:
        from ultrascale.model.init import init_model

        init_model(model, model_cfg.init_seed if model_cfg.init_seed is not None else seed)  # layout-independent
    if partitioned_experts:
        from ultrascale.model.moe import gather_non_experts

        gather_non_experts(model)
    return model


def grows_vocab(model_cfg: ModelConfig, hf: Any) -> bool:
    """Whether the run's vocabulary (``model.config.vocab_size``) is above the pretrained checkpoint's: the tokens
    data prep's ``tokenizer.add_fim`` appended. Such a model is built from its config and read tensor by tensor,
    the new rows of the embedding and head at the mean of the old (:mod:`ultrascale.model.weights`), under every
    ZeRO stage alike. A vocabulary below the checkpoint's would drop rows its tokenizer still emits: refused."""
    if not model_cfg.pretrained_path:
        return False
    path = str(resolve_path(model_cfg.pretrained_path))
    base = int(_hf_config(str(model_cfg.type), "{}", path).vocab_size)
    if int(hf.vocab_size) < base:
        raise ConfigError(f"model.config.vocab_size={hf.vocab_size} is below model.pretrained_path={path}'s {base}: a "
                          "pretrained vocabulary can grow (tokenizer.add_fim), not shrink; drop the override")  # fmt: skip
    return int(hf.vocab_size) > base


def zero_init_config(ds_config: dict) -> dict:
    """The run's DeepSpeed JSON as ``deepspeed.zero.Init`` needs it to partition a build: ZeRO-1/2 runs
    (``partitioned_experts``) build with a stage-3 copy; the engine itself keeps the run's stage."""
    zero = ds_config.get("zero_optimization", {})
    if zero.get("stage") == 3:
        return ds_config
    return {**ds_config, "zero_optimization": {"stage": 3}}


@contextlib.contextmanager
def _zero3_init(zero3: dict | None, hf: Any):
    """``deepspeed.zero.Init`` entered by us, with transformers told so (``set_zero3_state``): it then neither
    enters its own nor gathers every module for its initializer afterwards."""
    if zero3 is None:
        yield
        return
    import deepspeed
    import torch._dynamo  # noqa: F401  (zero.Init patches tensor creation: import before entering it)
    from transformers.modeling_utils import set_zero3_state
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    MODEL_FOR_CAUSAL_LM_MAPPING[type(hf)]  # import the model's module outside zero.Init, for the same reason
    with _no_zero_init_broadcast(), deepspeed.zero.Init(config_dict_or_path=zero3), set_zero3_state():
        yield


@contextlib.contextmanager
def _no_zero_init_broadcast():
    """Under ``zero.Init`` DeepSpeed 0.19.8 broadcasts every parameter from rank 0 as it is created, so that ranks
    agree on weights one process's RNG drew: the whole model through the network. Weights keyed by name are drawn
    identically on every rank right after (:func:`ultrascale.model.init.init_model`), so here a new parameter is
    only converted and partitioned."""
    try:
        from deepspeed.runtime.zero.partition_parameters import Init
    except ImportError:
        yield
        return
    original = Init._zero_init_param

    def partition_only(self, param):
        self._convert_to_deepspeed_param(param)
        param.partition()

    Init._zero_init_param = partition_only
    try:
        yield
    finally:
        Init._zero_init_param = original


def count_params(model_cfg: ModelConfig) -> dict[str, int]:
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


def load_pretrained(model_dir: str | Path, dtype: str | torch.dtype = "fp32", device: str | torch.device = "auto"):
    """An HF causal LM from a local directory, in eval mode, on ``device`` (``auto``: this rank's GPU when it
    has one, else the CPU: :func:`ultrascale.runtime.device.resolve`). Evaluation, SSD sampling, scoring and the
    mechanism study load through here, so none of them is left on the CPU of a GPU node."""
    from transformers import AutoModelForCausalLM

    from ultrascale.runtime.device import resolve

    dt = dtype if isinstance(dtype, torch.dtype) else torch_dtype(dtype)
    target = device if isinstance(device, torch.device) else resolve(device)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dt)
    return model.to(target).eval()
