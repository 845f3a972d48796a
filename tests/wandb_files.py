"""Read an offline wandb run file (``run-*.wandb``) without a network or a wandb server.

wandb 0.31 no longer ships a Python reader. The file is a LevelDB-style log: a 7-byte header (``:W&B``, a
2-byte magic, a version byte) and then 32 KiB blocks of records, each ``crc32c(4) length(2, LE) type(1)
payload``, where type FULL=1 or FIRST/MIDDLE/LAST=2/3/4 pieces of one protobuf ``Record``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
HEADER = 7


def records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    if not data.startswith(b":W&B"):
        raise ValueError(f"{path} is not a wandb run file")
    pos, pending = HEADER, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        payload = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending += payload
        if kind in (1, 4):  # FULL or LAST: a whole record
            rec = pb.Record()
            rec.ParseFromString(pending)
            pending = b""
            yield rec


def read_run(run_dir: Path) -> dict:
    """{"group", "config" (dict), "history" (list of {key: value})} of the offline run under ``run_dir``."""
    (path,) = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))[-1:]
    out: dict = {"group": None, "config": {}, "history": []}
    for rec in records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out["group"] = rec.run.run_group
            out["config"].update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
        elif kind == "config":
            out["config"].update({i.key: json.loads(i.value_json) for i in rec.config.update})
        elif kind == "history":
            out["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    return out
