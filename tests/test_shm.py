"""DeepSpeed's /dev/shm all-reduce buffers: a dead launch's are removed, a live one's are kept, whether its ranks
hold them open or only mapped (a rank holds both; the two checks are each tested alone here). The launches
themselves (every rank unlinks its own once all have mapped it) are checked in test_failures_dist.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from ultrascale.runtime import shm
from ultrascale.runtime.dist import free_port

# A stand-in for a rank that still uses a buffer: holds it open (``fd``), or only mapped with its descriptor closed
# (``map``: libc's mmap, as DeepSpeed's C++ calls it; Python's mmap would keep a duplicate descriptor open).
HOLD = """import ctypes, os, sys, time
fd = os.open(sys.argv[2], os.O_RDWR)
if sys.argv[1] == "map":
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    addr = libc.mmap(None, 4096, 3, 1, fd, 0)  # PROT_READ | PROT_WRITE, MAP_SHARED
    assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
    os.close(fd)
print("ready", flush=True)
time.sleep(600)
"""


def test_a_dead_launchs_buffers_are_removed_and_a_live_ones_kept():
    port = free_port()
    paths = {k: shm.SHM_DIR / f"{shm.PREFIX}{os.getuid()}_127.0.0.1_{port}_{i}"
             for i, k in enumerate(("dead", "fd", "map", "young"))}  # fmt: skip
    for p in paths.values():
        p.write_bytes(b"\0" * 4096)
    old = time.time() - 2 * shm.MIN_AGE_S
    for k in ("dead", "fd", "map"):
        os.utime(paths[k], (old, old))
    holders = [subprocess.Popen([sys.executable, "-c", HOLD, k, str(paths[k])], stdout=subprocess.PIPE, text=True)
               for k in ("fd", "map")]  # fmt: skip
    try:
        assert [h.stdout.readline().strip() for h in holders] == ["ready", "ready"]
        assert {shm.parse(p.name)["port"] for p in shm.buffers()} >= {port}
        removed = shm.remove_stale()
        assert paths["dead"] in removed and not paths["dead"].exists()
        assert all(paths[k].exists() for k in ("fd", "map")), removed  # live holders
        assert paths["young"].exists()  # just written: a launch may be reopening it
        for h in holders:
            h.kill()
            h.wait()
        assert set(shm.remove_stale(min_age_s=0)) >= {paths["fd"], paths["map"], paths["young"]}  # holders gone
    finally:
        for h in holders:
            h.kill()
            h.wait()
        for p in paths.values():
            p.unlink(missing_ok=True)


def test_a_buffer_name_is_parsed_and_other_files_are_not_buffers():
    assert shm.parse(f"{shm.PREFIX}0_127.0.0.1_29611_1") == {"uid": 0, "addr": "127.0.0.1", "port": 29611, "rank": 1}
    assert shm.parse("sem.deepspeed_lock") is None and shm.parse(f"{shm.PREFIX}x") is None
