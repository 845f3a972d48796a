"""DeepSpeed checkpoint -> Hugging Face model directory, one tensor at a time.

    python -m ultrascale.export run_dir=runs/demo out=exports/demo [step=200] [dtype=bf16] [max_shard_size=2GB]

Writes ``config.json``, ``generation_config.json``, the tokenizer, and ``model-0000i-of-0000n.safetensors``
shards with ``model.safetensors.index.json``; ``AutoModelForCausalLM.from_pretrained(out)`` loads it.

Memory: DeepSpeed's ``zero_to_fp32`` concatenates every rank's flat fp32 partition for ZeRO-1/2 (the whole model
in RAM, twice for a moment). Here checkpoint files are memory-mapped, each tensor is gathered, cast and written
straight into its shard through a hand-written safetensors writer (the header is computed from shapes first),
then freed: anonymous memory peaks at about one tensor in two dtypes, and both are measured and returned. Where
each layout keeps its tensors: :func:`checkpoint_tensors`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from ultrascale.config.fields import num
from ultrascale.errors import CheckpointError, ConfigError, UltrascaleError

log = logging.getLogger("ultrascale")

SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
INDEX = "model.safetensors.index.json"


@dataclass
class ExportConfig:
    run_dir: str = "???"
    """Training run directory (config.yaml + checkpoints/)."""
    out: str = "???"
    """Output HF model directory (created; must be empty or absent unless overwrite=true)."""
    step: int | None = num(None, ge=0)
    """Checkpoint step to export; None = ``checkpoints/latest``."""
    dtype: str = "auto"
    """``auto`` (the training precision), fp32, bf16 or fp16."""
    max_shard_size: str = "2GB"
    """Largest safetensors shard (bytes, or with KB/MB/GB); peak RAM does not depend on it."""
    overwrite: bool = False
    """Replace an existing, non-empty ``out``."""


class _Memory:
    """Peak resident memory, split into anonymous (heap: what streaming bounds) and file-backed (mmap)."""

    def __init__(self) -> None:
        self.base = self.read()
        self.peak = dict(self.base)

    @staticmethod
    def read() -> dict[str, int]:
        vals = {}
        with open("/proc/self/status") as f:
            for ln in f:
                k, _, v = ln.partition(":")
                if k in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                    vals[k] = int(v.split()[0]) * 1024
        return vals

    def sample(self) -> None:
        for k, v in self.read().items():
            self.peak[k] = max(self.peak.get(k, 0), v)


def parse_size(text: str | int) -> int:
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?i?B?)\s*", str(text), re.IGNORECASE)
    if not m:
        raise ConfigError(f"max_shard_size={text!r} is not a size: use e.g. 500MB or 2GB")
    unit = m.group(2).upper().rstrip("B").rstrip("I")
    return int(float(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[unit])


def resolve_tag_dir(run_dir: Path, step: int | None) -> tuple[Path, dict]:
    """The complete checkpoint to export and its meta; verified file by file like a resume would be."""
    from ultrascale.train.checkpoint import tag_for, verify
    from ultrascale.train.rundir import LATEST

    ckpt = run_dir / "checkpoints"
    if step is None:
        latest = ckpt / LATEST
        if not latest.exists():
            raise CheckpointError(
                f"{latest} not found: {run_dir} has no complete checkpoint (train longer or set step=)"
            )
        tag_dir = ckpt / latest.read_text().strip()
    else:
        tag_dir = ckpt / tag_for(step)
        if not tag_dir.is_dir():
            have = sorted(p.name for p in ckpt.glob("step_*") if not p.name.endswith("_universal"))
            raise CheckpointError(f"step={step}: {tag_dir} does not exist (have: {have})")
    return tag_dir, verify(tag_dir)


def _load_run_config(run_dir: Path) -> DictConfig:
    path = run_dir / "config.yaml"
    if not path.exists():
        raise CheckpointError(f"{path} not found: run_dir={run_dir} is not a training run directory")
    return OmegaConf.load(path)


def _pipeline_tensors(tag_dir: Path, hf_config) -> dict[str, torch.Tensor]:
    """HF names for a PipelineModule checkpoint (one ``layer_XX-model_states.pt`` per layer).

    The layer list is ultrascale.model.pipeline's: 0 = EmbedPipe, 1..L = DecoderPipe(HF layer i-1),
    L+1 = NormPipe, L+2 = HeadPipe, or the tied EmbedPipe again (dropped: HF re-ties lm_head on load).
    """
    n = int(hf_config.num_hidden_layers)
    files = sorted(tag_dir.glob("layer_*-model_states.pt"))
    if any("-model_01-" in f.name for f in files):
        raise CheckpointError(f"{tag_dir} is pipeline + tensor parallel (model_01 layer files): not supported yet")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        idx = int(f.name.split("-")[0].removeprefix("layer_"))
        for key, tensor in torch.load(f, map_location="cpu", mmap=True, weights_only=True).items():
            if key.startswith("rotary."):
                continue  # rotary buffers, recomputed by the HF model
            if idx == 0 or idx == n + 1:
                name = f"model.{key}"  # embed_tokens.weight, norm.weight
            elif idx <= n:
                name = f"model.layers.{idx - 1}.{key.removeprefix('layer.')}"
            elif key == "lm_head.weight":
                name = key
            else:
                continue  # the tied head's copy of the embedding
            out[name] = tensor
    return out


class Lazy:
    """A tensor read only when called: its shape and dtype are known up front (for the safetensors header)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, read: Callable[[], torch.Tensor]):
        self.shape, self.dtype, self._read = tuple(shape), dtype, read

    def __call__(self) -> torch.Tensor:
        return self._read()


def _tp_tensors(tag_dir: Path, tp: int, shapes: dict[str, tuple[int, ...]]) -> dict[str, Lazy | torch.Tensor]:
    """HF names for an AutoTP checkpoint: every tp rank's ``mp_rank_XX_model_states.pt`` holds its shard of each
    Linear (column-parallel: split on dim 0; row-parallel: dim 1) and a copy of everything else. Each full
    tensor is put together from the memory-mapped shards only when it is written, one at a time."""
    parts = []
    for r in range(tp):
        path = tag_dir / f"mp_rank_{r:02d}_model_states.pt"
        if not path.exists():
            raise CheckpointError(f"{path} is missing: the tensor-parallel checkpoint is incomplete (tp={tp})")
        parts.append(dict(torch.load(path, map_location="cpu", mmap=True, weights_only=False)["module"]))
    out: dict[str, Lazy | torch.Tensor] = {}
    for name, first in parts[0].items():
        full = shapes.get(name)
        if full is None or tuple(first.shape) == tuple(full):
            out[name] = first  # replicated on every tp rank (or not a model tensor: left to the name check)
            continue
        dims = [d for d in range(first.dim()) if first.shape[d] * tp == full[d]]
        if len(dims) != 1:
            raise CheckpointError(f"{tag_dir}: cannot tell how {name} {tuple(first.shape)} is split over tp={tp} "
                                  f"(full shape {tuple(full)})")  # fmt: skip
        shards = [p[name] for p in parts]
        out[name] = Lazy(full, first.dtype, lambda shards=shards, d=dims[0]: torch.cat(shards, dim=d))
    return out


def checkpoint_tensors(
    tag_dir: Path, zero_stage: int, hf_config=None, tp: int = 1, shapes: dict | None = None
) -> dict[str, Callable[[], torch.Tensor] | torch.Tensor]:
    """Name -> tensor (ZeRO 0-2, pipeline: memory-mapped) or lazy reader (ZeRO-3, tensor parallel). Nothing is
    materialized here.

    ZeRO-0/1/2 keep the full (training-precision) weights in ``mp_rank_00_model_states.pt``; ZeRO-3 keeps only
    fp32 partitions in the optimizer files, gathered lazily via DeepSpeed's ``GatheredTensor``; pipeline-parallel
    checkpoints keep one file per layer, mapped back to HF names; tensor-parallel (AutoTP) checkpoints keep one
    file per tp rank, and each sharded tensor is concatenated from the memory-mapped shards when it is written."""
    if any(tag_dir.glob("layer_*-model_states.pt")):
        return _pipeline_tensors(tag_dir, hf_config)
    if tp > 1:
        return _tp_tensors(tag_dir, tp, shapes or {})
    if zero_stage <= 2:
        path = tag_dir / "mp_rank_00_model_states.pt"
        if not path.exists():
            raise CheckpointError(f"{path} is missing: the checkpoint is incomplete")
        sd = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
        return dict(sd["module"])
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    lazy = get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name, lazy_mode=True)
    return {k: (v if isinstance(v, torch.Tensor) else v.contiguous) for k, v in lazy.items()}


def _shape_dtype(entry) -> tuple[tuple[int, ...], torch.dtype]:
    if isinstance(entry, torch.Tensor | Lazy):
        return tuple(entry.shape), entry.dtype
    gathered = entry.__self__  # GatheredTensor.contiguous bound method
    return tuple(gathered.shape), gathered.dtype


class SafetensorsShardWriter:
    """Write one safetensors file tensor by tensor: header first (from shapes), then raw bytes in order."""

    def __init__(self, path: Path, plan: list[tuple[str, tuple[int, ...], torch.dtype]]):
        header, offset = {}, 0
        for name, shape, dtype in plan:
            n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {
                "dtype": SAFETENSORS_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + n],
            }
            offset += n
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.expected = {name: (tuple(shape), dtype) for name, shape, dtype in plan}
        self.order = [name for name, _, _ in plan]
        self.f = open(path, "wb")  # noqa: SIM115 - closed by close(), after the streamed writes
        self.f.write(len(raw).to_bytes(8, "little") + raw)
        self.nbytes = offset

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if name != self.order.pop(0) or (tuple(tensor.shape), tensor.dtype) != self.expected[name]:
            raise RuntimeError(f"safetensors writer got {name} {tuple(tensor.shape)} out of plan")
        t = tensor.detach().contiguous().reshape(-1)
        self.f.write(memoryview(t.view(torch.uint8).numpy()) if t.numel() else b"")

    def close(self) -> None:
        if self.order:
            raise RuntimeError(f"shard closed with tensors still unwritten: {self.order[:3]}")
        self.f.close()


def _hf_names(hf_config) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """The model's expected state-dict keys with their shapes, and the tied ones HF leaves out of its files."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    keys = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tied: set[str] = set()
    if getattr(hf_config, "tie_word_embeddings", False):
        tk = getattr(model, "_tied_weights_keys", None) or {}
        tied = set(tk.keys() if isinstance(tk, dict) else tk)
    return keys, tied


def export(
    run_dir: str | os.PathLike,
    out: str | os.PathLike,
    step: int | None = None,
    dtype: str = "auto",
    max_shard_size: str | int = "2GB",
    overwrite: bool = False,
) -> dict:
    """Export one checkpoint of a run to an HF directory; returns sizes and measured peak memory."""
    from transformers import AutoTokenizer, GenerationConfig

    from ultrascale.data.shards import load_manifest
    from ultrascale.data.sources import primary_path
    from ultrascale.model.build import build_hf_config

    run_dir, out = Path(run_dir), Path(out)
    cfg = _load_run_config(run_dir)
    tag_dir, meta = resolve_tag_dir(run_dir, step)
    if dtype == "auto":
        dtype = cfg.precision.dtype
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype} is not one of auto, {', '.join(DTYPES)}")
    target = DTYPES[dtype]
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise ConfigError(f"out={out} exists and is not empty: choose another directory or pass overwrite=true")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)

    hf = build_hf_config(cfg.model)
    expected, tied = _hf_names(hf)
    zero_stage = int(meta["zero_stage"])  # the run's record, saved with every checkpoint
    if zero_stage == 3:
        import deepspeed.utils.zero_to_fp32  # noqa: F401  imported before the baseline: code is not data
    mem = _Memory()  # from here on, memory is the checkpoint's tensors, not imports
    tp = int(meta.get("topology", {}).get("tp", 1))
    source = checkpoint_tensors(tag_dir, zero_stage, hf, tp=tp, shapes=expected)
    finetune = cfg.get("finetune")
    adapter_dir = None
    if finetune is not None and str(finetune.method) != "none":  # LoRA: merge the adapters, and write them alone
        from ultrascale.model.adapters import ADAPTER_DIR, export_sources, write_adapter
        from ultrascale.paths import resolve_path

        base_dir = resolve_path(cfg.model.pretrained_path)
        source, adapter = export_sources(source, finetune, base_dir, expected, Lazy)
        adapter_dir = write_adapter(adapter, finetune, base_dir, out / ADAPTER_DIR)
        del adapter
    names = [n for n in source if n not in tied]
    missing = set(expected) - tied - set(names)
    extra = set(names) - set(expected)
    if missing or extra:
        raise CheckpointError(
            f"{tag_dir} does not match model {cfg.model.name!r}: missing {sorted(missing)[:5]}, unexpected "
            f"{sorted(extra)[:5]}: was it written by a different model config?"
        )
    plan = []
    for n in names:
        shape, src_dtype = _shape_dtype(source[n])
        plan.append((n, shape, target if src_dtype.is_floating_point else src_dtype))

    limit = parse_size(max_shard_size)
    shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
    size = 0
    for entry in plan:
        nbytes = math.prod(entry[1]) * torch.empty((), dtype=entry[2]).element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        writer = SafetensorsShardWriter(out / fname, shard)
        for name, _, dt in shard:
            entry = source.pop(name)
            tensor = entry() if callable(entry) else entry
            writer.write(name, tensor.to(dt))
            del tensor, entry
            mem.sample()
            weight_map[name] = fname
        writer.close()
        total += writer.nbytes
    source.clear()
    (out / INDEX).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n"
    )

    hf.use_cache = True  # inference default; training had switched it off
    hf.architectures = [_architecture(hf)]
    hf.dtype = dtype_name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[target]
    hf.save_pretrained(out)
    from ultrascale.paths import resolve_path

    if cfg.get("grpo") is not None:  # a GRPO run read no shards: its tokenizer is the pretrained model's
        tok_dir = resolve_path(cfg.model.pretrained_path)
    else:
        data_path = primary_path(cfg.data)  # every source shares its tokenizer
        tok_dir = data_path / load_manifest(data_path)["tokenizer"]
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    tok.save_pretrained(out)
    GenerationConfig(
        bos_token_id=tok.bos_token_id if tok.bos_token_id is not None else hf.bos_token_id,
        eos_token_id=tok.eos_token_id if tok.eos_token_id is not None else hf.eos_token_id,
        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
        max_new_tokens=256,
    ).save_pretrained(out)
    (out / "ultrascale_export.json").write_text(
        json.dumps(
            {
                "run_dir": str(run_dir.resolve()),
                "tag": tag_dir.name,
                "step": meta.get("step"),
                "zero_stage": zero_stage,
                "dtype": dtype_name,
                "adapter": str(adapter_dir) if adapter_dir else None,
            },
            indent=1,
        )
        + "\n"
    )
    mem.sample()
    mb = 1 << 20
    stats = {
        "out": str(out),
        "tag": tag_dir.name,
        "zero_stage": zero_stage,
        "dtype": dtype_name,
        "tensors": len(weight_map),
        "adapter": str(adapter_dir) if adapter_dir else None,
        "shards": len(shards),
        "model_mb": total / mb,
        "largest_tensor_mb": max(math.prod(s) * torch.empty((), dtype=d).element_size() for _, s, d in plan) / mb,
        "peak_rss_mb": mem.peak["VmHWM"] / mb,
        "peak_rss_growth_mb": (mem.peak["VmHWM"] - mem.base["VmRSS"]) / mb,
        "peak_anon_growth_mb": (mem.peak["RssAnon"] - mem.base["RssAnon"]) / mb,
        "peak_file_mapped_mb": mem.peak["RssFile"] / mb,
    }
    return stats


def _architecture(hf) -> str:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping[type(hf)].__name__


def main(argv: list[str] | None = None) -> int:
    from ultrascale.config.describe import help_if_asked

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    if (rc := help_if_asked(None, argv, __doc__, cfg=OmegaConf.structured(ExportConfig))) is not None:
        return rc
    try:
        try:
            args = OmegaConf.merge(OmegaConf.structured(ExportConfig), OmegaConf.from_dotlist(argv))
            run_dir, out = args.run_dir, args.out
        except Exception as e:
            usage = "usage `python -m ultrascale.export run_dir=DIR out=DIR [step=N]`"
            raise ConfigError(f"{str(e).splitlines()[0]}: {usage}") from None
        stats = export(run_dir, out, args.step, args.dtype, args.max_shard_size, args.overwrite)
    except UltrascaleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"exported {stats['tag']} (ZeRO-{stats['zero_stage']}) -> {stats['out']}: {stats['tensors']} tensors, "
        f"{stats['shards']} shard(s), {stats['model_mb']:.1f} MB {stats['dtype']}; peak RSS growth "
        f"{stats['peak_rss_growth_mb']:.1f} MB (anonymous {stats['peak_anon_growth_mb']:.1f} MB)\n"
        f"load it: AutoModelForCausalLM.from_pretrained({stats['out']!r}); AutoTokenizer.from_pretrained({stats['out']!r})"
        + (
            f"\nthe adapter alone (merged into the model above): PeftModel.from_pretrained(base, {stats['adapter']!r})"
            if stats["adapter"]
            else ""
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
