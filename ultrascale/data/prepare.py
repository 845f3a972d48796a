"""Make sure prepared shards exist before training: rank 0 builds them, the other ranks wait.

A fresh checkout has no data; ``recipe=cpu_smoke`` must still run as-is. Preparing on every rank would
race on the same files, so rank 0 alone runs data prep and broadcasts the outcome (including an error,
so no rank is left waiting at a barrier for a rank that already failed).
"""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig

from ultrascale import dist
from ultrascale.config.compose import resolve_path
from ultrascale.data.shards import MANIFEST
from ultrascale.errors import DataError, UltrascaleError

log = logging.getLogger("ultrascale")


def ensure_prepared(data: DictConfig) -> Path:
    path = resolve_path(data.path)
    error = None
    if dist.is_rank0() and not (path / MANIFEST).exists():
        if not data.prepare_if_missing:
            error = f"data.path={path} has no {MANIFEST}: run `python -m data_prep output_dir={path}` first"
        else:
            log.info(f"{path / MANIFEST} not found: preparing it from source={data.prepare_source!r} (rank 0) ...")
            try:
                from data_prep.api import prepare

                prepare(
                    output_dir=str(path),
                    source=data.prepare_source,
                    seq_len=int(data.seq_len),
                    max_files=data.prepare_max_files,
                )
            except UltrascaleError as e:
                error = str(e)
    error = dist.broadcast_object(error)
    if error:
        raise DataError(error)
    return path
