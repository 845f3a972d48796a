"""DeepSpeed's shared-memory all-reduce buffers in ``/dev/shm``: what they are, which are dead, and removing them.

Under the ``deepspeed`` launcher (which sets ``LOCAL_SIZE``) every CPU rank creates
``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>`` (69 MB) when the process group starts, maps
every local peer's, and never unlinks any of them (DeepSpeed 0.19.8, ``ops/csrc/cpu/comm/shm.cpp``): each launch,
finished or killed, leaves 69 MB per rank in RAM-backed ``/dev/shm``, and fresh ports pile them up until the box
runs out of memory. Two remedies: :func:`release_own` (every rank, right after the process group starts) unlinks
each rank's own name once every peer has mapped it, so a launch leaves nothing behind; :func:`remove_stale` (at the
same point, and in the test suite's teardown) removes the buffers of launches from before that, or killed before it.
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

log = logging.getLogger("ultrascale")

SHM_DIR = Path("/dev/shm")
PREFIX = "deepspeed_allreduce_buffer_"
_NAME = re.compile(rf"^{PREFIX}(?P<uid>\d+)_(?P<addr>.*)_(?P<port>\d*)_(?P<rank>\d+)$")
MIN_AGE_S = 60.0
"""A buffer younger than this is never judged dead: a launch reusing a dead launch's address and port reopens its
files (``O_CREAT`` on an existing name), and in that instant nobody may hold them yet."""


def parse(name: str) -> dict | None:
    """``{"uid", "addr", "port", "rank"}`` of a buffer's file name (port and uid as ints), None for another file."""
    m = _NAME.match(name)
    if m is None:
        return None
    return {"uid": int(m["uid"]), "addr": m["addr"], "port": int(m["port"] or 0), "rank": int(m["rank"])}


def buffers(uid: int | None = None) -> list[Path]:
    """This user's buffers (``uid`` defaults to ours: another user's are not ours to judge or remove)."""
    uid = os.getuid() if uid is None else uid
    try:
        names = os.listdir(SHM_DIR)
    except OSError:  # no /dev/shm (not Linux): DeepSpeed's shm comm is not built there either
        return []
    return sorted(SHM_DIR / n for n in names if (p := parse(n)) is not None and p["uid"] == uid)


def held() -> set[str]:
    """Every ``/dev/shm`` path some live process holds open or mapped (the processes this user may read)."""
    out: set[str] = set()
    shm = f"{SHM_DIR}/"
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            for fd in os.scandir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(fd.path)
                except OSError:
                    continue
                if target.startswith(shm):
                    out.add(target)
            with open(f"/proc/{pid}/maps") as f:
                out.update(line[line.index(shm) :].strip() for line in f if shm in line)
        except OSError:  # gone meanwhile, or another user's
            continue
    return out


def remove_stale(min_age_s: float = MIN_AGE_S) -> list[Path]:
    """Remove this user's buffers that no live process holds (a dead launch's); returns what was removed.

    A buffer nobody holds open or mapped (``/proc/*/fd`` and ``/proc/*/maps``) belongs to a dead launch; one a
    live process holds is kept, whoever's it is."""
    found = buffers()
    if not found:
        return []
    live, now, removed = held(), time.time(), []
    for p in found:
        try:
            if str(p) in live or now - p.stat().st_mtime < min_age_s:
                continue
            p.unlink()
            removed.append(p)
        except OSError:  # removed by someone else meanwhile
            continue
    if removed:
        mb = 69 * len(removed)
        log.info(f"/dev/shm: removed {len(removed)} DeepSpeed all-reduce buffer(s) of dead launches (~{mb} MB)")
    return removed


def own_path() -> Path | None:
    """This rank's buffer, if DeepSpeed made one (deepspeed launcher: ``LOCAL_SIZE`` equals the world size)."""
    env = os.environ
    if not env.get("LOCAL_SIZE") or env.get("LOCAL_SIZE") != env.get("WORLD_SIZE"):
        return None
    name = f"{PREFIX}{os.getuid()}_{env.get('MASTER_ADDR', '')}_{env.get('MASTER_PORT', '')}_{env.get('RANK', '0')}"
    return SHM_DIR / name


def release_own(barrier) -> None:
    """Collective, once the process group is up: after ``barrier()`` every local rank has mapped every peer's
    buffer, so each unlinks its own name (the mappings stay valid, and the kernel frees the memory when the last
    rank exits, however it exits, a SIGKILL included); then dead launches' buffers go too."""
    own = own_path()
    if own is None:  # decided by the environment alone, so every rank takes the same branch into the barrier
        return
    barrier()
    own.unlink(missing_ok=True)
    if os.environ.get("LOCAL_RANK", "0") == "0":
        remove_stale()
