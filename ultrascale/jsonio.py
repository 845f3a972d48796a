"""JSON and JSON-lines files: read leniently where absence is normal, write atomically everywhere.

Manifests, summaries, status files and metrics are how a killed or finished job tells the next one what
happened, so every writer here replaces the file in one step (:mod:`ultrascale.atomic`) and every reader
names the file and line it could not parse.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ultrascale.atomic import atomic_write_text
from ultrascale.errors import DataError


def read_json(path: str | os.PathLike, default: Any = None) -> Any:
    """The file's JSON, or ``default`` when it does not exist; a corrupt file is a DataError naming it."""
    path = Path(path)
    if not path.exists():
        return default
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not valid JSON ({e}): delete or restore it") from None


def write_json(path: str | os.PathLike, obj: Any, indent: int | None = 2, sort_keys: bool = False) -> None:
    """``obj`` as JSON and a newline; ``indent=None`` writes one line."""
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=sort_keys) + "\n")


def iter_jsonl(path: str | os.PathLike, what: str = "object") -> Iterator[tuple[int, Any]]:
    """(line number, value) for every non-blank line, 1-based as an editor shows it; a corrupt line is a DataError
    naming ``file line N`` and what each line should hold, so a large file is fixed without bisecting it."""
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path} line {n} is not valid JSON ({e}): one {what} per line; fix or delete it"
                ) from None


def read_jsonl(path: str | os.PathLike) -> list[Any]:
    """Every non-blank line's value; a corrupt line is a DataError naming the file and the line."""
    return [row for _, row in iter_jsonl(path)]


def write_jsonl(path: str | os.PathLike, rows: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
