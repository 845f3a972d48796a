"""``conf/finetune/``: adapters (LoRA, QLoRA) over a pretrained model."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from ultrascale.config.fields import num


class FinetuneMethod(StrEnum):
    none = "none"
    lora = "lora"
    qlora = "qlora"


@dataclass
class FinetuneConfig:
    """Adapters over a pretrained model (``finetune=lora``), with Hugging Face ``peft``: the base weights stay
    frozen and only the low-rank updates train, so only they get gradients and optimizer state. The model to
    start from is ``model.pretrained_path``. ``ultrascale/model/adapters.py`` applies it; export writes the merged
    model and the adapter alone."""

    method: FinetuneMethod = FinetuneMethod.none
    """``none``: every parameter trains. ``lora``: LoRA adapters on ``target_modules``. ``qlora``: LoRA over a 4-bit
    NF4 base (bitsandbytes' CUDA kernels: a GPU with ``pip install bitsandbytes``; zero.stage<=2)."""
    r: int = num(16, ge=1)
    """Rank of each update ``B @ A`` (A: r x in, B: out x r). Adapter parameters grow linearly with it."""
    alpha: float = num(32.0, gt=0)
    """The update is scaled by alpha / r, so the step size does not change when r does (keep alpha = 2r)."""
    dropout: float = num(0.05, ge=0, lt=1)
    """Dropout on the adapter's input (the frozen path has none)."""
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Module names (the last part of the dotted name, as peft matches them) whose Linear layers get adapters;
    ``[all-linear]``: every Linear but the output head. Defaults cover a Llama/Qwen/Mistral decoder's attention
    and MLP (QLoRA's finding: adapters on every matmul beat attention-only at the same budget)."""
    modules_to_save: list[str] = field(default_factory=list)
    """Modules trained in full beside the adapters (e.g. ``[norm]``); a copy of each is saved with the adapter."""
    init_seed: int | None = num(None, ge=0)
    """Seed of the adapters' initial A matrices (B starts at zero, so the model starts as the base); defaults to
    ``train.seed``. Every rank and every ZeRO stage draws the same."""
