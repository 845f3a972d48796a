"""A tokenizer-free dataset of real code: stdlib source bytes (ids 0-255) + EOS (256), packed.

Tests and benchmarks need real text in the real shard format in well under a second, without
training a BPE; byte-level ids give exactly that through the same writer data_prep uses.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

from ultrascale.data.shards import write_samples

BYTE_VOCAB = 257  # 256 byte values + EOS
EOS = 256


def byte_samples(seq_len: int, max_files: int = 60, max_bytes: int = 30_000, pattern: str = "*.py") -> np.ndarray:
    """The standard library's own ``pattern`` files as bytes, EOS-separated, packed into [n, seq_len]
    (another ``pattern``, e.g. ``json/*.py``, gives another corpus: a second source of a mixture)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob(pattern))[:max_files]
    toks: list[int] = []
    for f in files:
        toks.extend(f.read_bytes()[:max_bytes])
        toks.append(EOS)
    n = len(toks) // seq_len
    return np.asarray(toks[: n * seq_len], dtype=np.int64).reshape(n, seq_len)


def write_byte_dataset(out: Path, seq_len: int = 64, val_fraction: float = 0.05, **kw) -> Path:
    arr = byte_samples(seq_len, **kw)
    n_val = max(16, int(len(arr) * val_fraction))
    write_samples(
        out,
        {"train": [arr[n_val:]], "validation": [arr[:n_val]]},
        seq_len=seq_len,
        vocab_size=BYTE_VOCAB,
        eos_token_id=EOS,
        tokenizer="tokenizer",
    )
    return out
