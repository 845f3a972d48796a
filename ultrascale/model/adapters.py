"""LoRA adapters (Hugging Face ``peft``) over a built model, and the adapter's names in and out of checkpoints.

The engine gets the HF model with peft's LoRA layers injected in place (``get_peft_model(...).base_model.model``),
not the ``PeftModel`` wrapper: every lever that patches the HF model (the fused loss, the attention kernels,
activation checkpointing, regional compile, ZeRO-3's module hooks) then sees the module tree it knows, with
``q_proj`` now a ``lora.Linear`` holding ``base_layer``, ``lora_A.default`` and ``lora_B.default``. Only the
adapters (and ``finetune.modules_to_save``) keep ``requires_grad``, so ``param_groups`` hands only them to the
optimizer: only they get gradients, fp32 master copies and Adam moments under every ZeRO stage.

Checkpoints leave the frozen base out (``exclude_frozen_parameters``): it is rebuilt from ``model.pretrained_path``
at every start and never changes, so a checkpoint holds the adapter and its optimizer state (megabytes, not the
model), and the meta records the base's fingerprint so a resume over another base is refused.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ultrascale.errors import ConfigError

if TYPE_CHECKING:
    from ultrascale.config.finetune import FinetuneConfig
    from ultrascale.config.model import ModelConfig

ADAPTER = "default"
"""peft's adapter name: it appears in the trained model's parameter names (``lora_A.default.weight``)."""
ADAPTER_DIR = "adapter"
"""Export writes the adapter alone here, inside the merged model's directory."""


def bitsandbytes_missing() -> str | None:
    """Why bitsandbytes cannot be used (None: it is importable). Not in requirements.txt: it is for GPUs."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return "it is not installed"
    return None


def lora_config(f: Any, base_path: str | None = None):
    """peft's ``LoraConfig`` for the ``finetune`` group (``base_path`` goes into the saved adapter's config)."""
    from peft import LoraConfig

    targets = [str(t) for t in f.target_modules]
    return LoraConfig(
        r=int(f.r),
        lora_alpha=float(f.alpha),
        lora_dropout=float(f.dropout),
        target_modules="all-linear" if targets == ["all-linear"] else targets,
        modules_to_save=[str(m) for m in f.modules_to_save] or None,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_path,
    )


def apply_lora(model: torch.nn.Module, f: Any, seed: int) -> torch.nn.Module:
    """Inject LoRA layers into ``model`` in place and freeze everything else; returns the HF model to train.

    The A matrices are drawn from ``seed`` inside a forked RNG, so every rank and every ZeRO stage starts from the
    same adapters and the run's own random stream is untouched; B starts at zero, so the first forward is the
    base model's. Under ZeRO-3 the base arrives partitioned; the new adapter tensors are whole until
    ``deepspeed.initialize`` partitions them.

    ``enable_input_require_grads``: with the embedding frozen, the decoder layers' inputs carry no gradient, and
    ZeRO-3's module backward hooks count only inputs that require one (``ds_grads_remaining``, DeepSpeed#7203,
    #7615). Making the embedding's output require grad (a few bytes a token) gives every layer the input a fully
    trained model gives it, as axolotl and TRL do. Measured here: with DeepSpeed 0.19.8 (which keeps frozen
    parameters gathered through a checkpoint's recompute, #8148) and our non-reentrant checkpointing, the ZeRO-3 +
    full-checkpointing test also passes without it (same losses, exact resume); it stays as the guard for the
    hooks' bookkeeping, not as a proven fix.
    """
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(f.init_seed if f.init_seed is not None else seed))
        try:
            peft_model = get_peft_model(model, lora_config(f))
        except ValueError as e:  # peft's message names the modules it could not find
            first = str(e).strip().splitlines()[0]
            raise ConfigError(
                f"finetune.target_modules={list(f.target_modules)}: {first}; name Linear layers of "
                f"{type(model).__name__} (e.g. q_proj,v_proj) or [all-linear]"
            ) from None
    inner = peft_model.base_model.model
    inner.enable_input_require_grads()
    return inner


def count_params(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters of a built model (ZeRO-3 partitions counted whole, tied weights once)."""
    unique = {id(p): p for p in model.parameters()}.values()
    n = lambda p: getattr(p, "ds_numel", p.numel())  # noqa: E731
    return sum(n(p) for p in unique if p.requires_grad), sum(n(p) for p in unique)


@cache
def _planned(hf_json: str, targets: tuple[str, ...], r: int, saved: tuple[str, ...]) -> tuple[int, int]:
    from transformers import AutoConfig, AutoModelForCausalLM

    d = __import__("json").loads(hf_json)
    hf = AutoConfig.for_model(d.pop("model_type"), **d)

    class _F:
        pass

    f = _F()
    f.r, f.alpha, f.dropout, f.init_seed = r, 2 * r, 0.0, 0
    f.target_modules, f.modules_to_save = list(targets), list(saved)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
        model = apply_lora(model, f, 0)
    return count_params(model)


def planned_params(hf_config: Any, f: Any) -> tuple[int, int]:
    """(trainable, total) parameters that ``finetune`` gives this model, from a model built on the meta device
    (no memory; for the banner's savings line, the dry run and the planner)."""
    return _planned(hf_config.to_json_string(use_diff=False), tuple(str(t) for t in f.target_modules), int(f.r),
                    tuple(str(m) for m in f.modules_to_save))  # fmt: skip


def planned_trainable(model: ModelConfig, finetune: FinetuneConfig | None) -> int | None:
    """Trainable parameters of a model under ``finetune`` (None: ``finetune=none``, every parameter trains)."""
    if finetune is None or str(finetune.method) == "none":
        return None
    from ultrascale.model.build import build_hf_config

    return planned_params(build_hf_config(model), finetune)[0]


def base_fingerprint(model_dir: str | Path) -> str:
    """A cheap identity of the base model a checkpoint's adapter belongs to: per weight file, its name, size and
    the first and last MiB of its bytes (the safetensors header names every tensor and its offsets; the ends hold
    real weights), plus config.json. Hashing a 70B base whole at every start would take minutes; a different
    model or a re-quantised import differs in these."""
    d = Path(model_dir)
    h = hashlib.sha256()
    for p in sorted([*d.glob("*.safetensors"), d / "config.json"]):
        if not p.is_file():
            continue
        size = p.stat().st_size
        h.update(f"{p.name}\0{size}\0".encode())
        with open(p, "rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(size - (1 << 20))
                h.update(fh.read())
    return h.hexdigest()[:16]


def meta_record(model: ModelConfig, finetune: FinetuneConfig | None) -> dict | None:
    """What a checkpoint records about its adapters (None for a full fine-tune): a resume must match it."""
    f = finetune
    if f is None or str(f.method) == "none":
        return None
    from ultrascale.paths import resolve_path

    base = resolve_path(model.pretrained_path)
    return {"method": str(f.method), "r": int(f.r), "alpha": float(f.alpha),
            "target_modules": [str(t) for t in f.target_modules],
            "modules_to_save": [str(m) for m in f.modules_to_save],
            "base": str(base), "base_fingerprint": base_fingerprint(base)}  # fmt: skip


# --- names: the trained model's state dict (HF names with peft's insertions) -> HF names and peft's file names ---

LORA_A, LORA_B = f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight"
BASE = ".base_layer."
SAVED, ORIGINAL = f".modules_to_save.{ADAPTER}.", ".original_module."


def hf_name(name: str) -> str | None:
    """The HF parameter a trained-model tensor becomes in the merged model (None: it merges into another one, or
    is dropped: an adapter factor, or a ``modules_to_save`` module's frozen original)."""
    if name.endswith((LORA_A, LORA_B)) or ORIGINAL in name:
        return None
    return name.replace(BASE, ".").replace(SAVED, ".")


def adapter_file_name(name: str) -> str | None:
    """The key ``PeftModel.from_pretrained`` reads for a trained-model tensor (None: not part of the adapter)."""
    if name.endswith((LORA_A, LORA_B)):
        return "base_model.model." + name.replace(f".{ADAPTER}.", ".")
    if SAVED in name:
        return "base_model.model." + name.replace(SAVED, ".modules_to_save.")
    return None


def merged_weight(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``W + scale * B @ A`` in fp32 (what ``merge_and_unload`` computes for a plain Linear)."""
    return base.float() + scale * (b.float() @ a.float())


def check_finetune_resume(saved: dict | None, now: dict | None, tag: str) -> None:
    """Raise when this run's adapters cannot continue the checkpoint's: another method, rank or targets (the
    saved tensors would not fit), or another base model under the same adapter."""
    from ultrascale.errors import CheckpointError

    was = (saved or {}).get("method", "none")
    method = (now or {}).get("method", "none")
    if was != method:
        raise CheckpointError(
            f"finetune={method} but checkpoint {tag} was trained with finetune={was}: resume with finetune={was}, or "
            f"start from its export (python -m ultrascale.export) in a new output_dir"
        )
    if saved is None or now is None:
        return
    for key in ("r", "alpha", "target_modules", "modules_to_save"):
        if saved.get(key) != now.get(key):
            raise CheckpointError(
                f"finetune.{key}={now.get(key)} but checkpoint {tag} holds adapters with {key}={saved.get(key)}: "
                f"resume with finetune.{key}={saved.get(key)}"
            )
    if saved.get("base_fingerprint") not in (None, now.get("base_fingerprint")):
        raise CheckpointError(
            f"model.pretrained_path={now.get('base')} is not the base model checkpoint {tag}'s adapter was trained "
            f"on ({saved.get('base')}, fingerprint {saved.get('base_fingerprint')} vs "
            f"{now.get('base_fingerprint')}): point model.pretrained_path at that model"
        )


def build_quantized(model_cfg: ModelConfig, hf_config: Any) -> torch.nn.Module:
    """QLoRA's base: ``model.pretrained_path`` loaded as 4-bit NF4 with double quantization and bf16 compute
    (bitsandbytes, on this rank's GPU), made ready for adapter training (norms in fp32, inputs that carry a
    gradient). Validation let this run only with CUDA and bitsandbytes installed."""
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from ultrascale.paths import resolve_path

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(
        str(resolve_path(model_cfg.pretrained_path)), config=hf_config, quantization_config=quant,
        attn_implementation=str(model_cfg.attn_implementation), device_map={"": int(os.environ.get("LOCAL_RANK", 0))},
        local_files_only=True, dtype=torch.bfloat16,
    )  # fmt: skip
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def _read(entry: Any) -> torch.Tensor:
    return entry() if callable(entry) else entry


def export_sources(source: dict, f: Any, base_dir: Path, expected: dict[str, tuple[int, ...]],
                   lazy: Callable) -> tuple[dict, dict]:  # fmt: skip
    """(merged, adapter) for :func:`ultrascale.export.export` from a LoRA run's checkpoint tensors (``source``:
    trained-model names, tensors or lazy readers).

    ``merged``: every HF name of the model -> a lazy tensor: ``W + alpha/r * B @ A`` for an adapted Linear's
    weight, a ``modules_to_save`` copy for its module, else the base weight, read from the checkpoint or, when the
    frozen base was left out of it, from ``model.pretrained_path`` one tensor at a time. Nothing is materialized
    here, so the exporter's one-tensor-at-a-time memory bound holds for the merge too (``lazy``: the exporter's
    ``Lazy(shape, dtype, read)``). ``adapter``: peft's file names -> the adapter's tensors, what
    ``PeftModel.from_pretrained`` reads."""
    from ultrascale.model.weights import SafetensorsWeights

    scale = float(f.alpha) / int(f.r)
    base = SafetensorsWeights(base_dir)

    def from_base(name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(base.files[name], "pt") as fh:
            return fh.get_tensor(name)

    merged: dict[str, Any] = {}
    for name, shape in expected.items():
        mod, _, leaf = name.rpartition(".")
        found = next((c for c in (f"{mod}{SAVED}{leaf}", f"{mod}{BASE}{leaf}", name) if c in source), None)
        if found is None and name not in base.files:
            continue  # left to the exporter's missing-tensor error
        read = (lambda e=source[found]: _read(e)) if found else (lambda n=name: from_base(n))
        a, b = source.get(f"{mod}{LORA_A}"), source.get(f"{mod}{LORA_B}")
        if leaf == "weight" and a is not None and b is not None:  # an adapted Linear: merge B @ A into it
            merged[name] = lazy(shape, torch.float32, lambda r=read, a=a, b=b: merged_weight(r(), _read(a), _read(b),
                                                                                              scale))  # fmt: skip
        else:
            merged[name] = lazy(shape, torch.float32, read)
    adapter = {key: _read(v) for n, v in source.items() if (key := adapter_file_name(n)) is not None}
    return merged, adapter


def write_adapter(adapter: dict, f: Any, base_dir: Path, out: Path) -> Path:
    """The adapter alone, as peft saves it: ``adapter_config.json`` and ``adapter_model.safetensors``, loadable
    with ``PeftModel.from_pretrained(base, out)`` over the base model it was trained on."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().float().contiguous() for k, v in adapter.items()}, str(out / "adapter_model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    cfg = lora_config(f, base_path=str(base_dir))
    cfg.save_pretrained(str(out))
    return out
