"""Atomic file replacement: a reader sees the old file or the new one, never half of either.

Manifests, checkpoint pointers and shards are how a killed job tells finished work from unfinished,
so each is written to a temporary name, fsynced, and renamed into place.
"""

from __future__ import annotations

import os
from pathlib import Path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode())
