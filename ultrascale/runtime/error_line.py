"""Which rank of a failed launch says its one ``error:`` line.

Every rank usually hits the same config or data error; one line is wanted, rank 0's. But the first rank to exit
makes the launcher SIGTERM the rest, so rank 0 must not be beaten to the exit, and a rank that waits for rank 0
must not die silently if rank 0 never speaks (it was killed, or its error was another). The ranks of one node
leave each other notes in a directory of their own launch (in the temp dir, keyed by the launcher's pid, the
master port and the restart count): ``passed``, the node's speaker (local rank 0; global rank 0 on the first
node) got through the checks every rank makes before the process group starts (composing, validating, the
preflight); ``said``, the error a rank printed. Who speaks when: :func:`wait_for_speaker`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

PRE_INIT_WAIT_S = 60.0
"""How long a rank that failed a check every rank makes waits for its speaker (who may be slow, not failing)."""
POST_INIT_WAIT_S = 5.0
"""After the process group started, the speaker may be waiting for this rank in a collective: the wait is short."""
PASSED, SAID = "passed", "said"


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def is_speaker() -> bool:
    """The rank that speaks for its node: local rank 0 (global rank 0 on the first node)."""
    return os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")) in ("0", "")


def launch_dir() -> Path | None:
    """This node's notes for this launch (None for a single process: nobody to agree with)."""
    if world_size() <= 1:
        return None
    env = os.environ
    restart = env.get("TORCHELASTIC_RESTART_COUNT") or env.get("ULTRASCALE_RESTART_COUNT") or "0"
    key = f"{os.getppid()}-{env.get('MASTER_PORT', '')}-{restart}"
    return Path(tempfile.gettempdir()) / f"ultrascale-{os.getuid()}" / "launches" / key


def note(name: str, text: str = "") -> None:
    """Leave a note for this launch's peers (atomically: a reader sees all of it or nothing)."""
    d = launch_dir()
    if d is None:
        return
    with contextlib.suppress(OSError):
        fresh = not d.exists()
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{name}.{os.getpid()}"
        tmp.write_text(text)
        os.replace(tmp, d / name)
        if fresh:
            _remove_dead_launches(d.parent)


def read(name: str) -> str | None:
    d = launch_dir()
    if d is None:
        return None
    try:
        return (d / name).read_text()
    except OSError:
        return None


def passed_checks() -> None:
    """The speaker is about to start the process group: every check the ranks share is behind it."""
    if is_speaker():
        note(PASSED)


def say(message: str, rank: int) -> None:
    """Print this rank's line for ``message`` (rank 0's without the rank), unless it was said already; note it."""
    if read(SAID) == message:
        return
    line = f"error: {message}" if rank == 0 else f"error: rank {rank}: {message}"
    print(line, file=sys.stderr, flush=True)
    note(SAID, message)


def wait_for_speaker(initialized: bool) -> bool:
    """A rank other than the speaker, holding an error: True once the speaker has said one (stay silent), False
    when this rank must speak (the speaker passed the checks this rank failed, a SIGTERM came, or time ran out).

    A rank that failed the shared checks while its speaker passed them has an error of its own: it speaks at
    once. Otherwise it waits until the speaker has said its line, or passed the checks, or the launcher SIGTERMs
    it (a peer exited), or the deadline passes; in the last three cases it says ``error: rank N: ...`` itself
    (:func:`say`: unless the same line was said meanwhile). A rank that finds its own error already said stays
    silent."""
    ended: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: ended.append(signum))
    try:
        deadline = time.monotonic() + (POST_INIT_WAIT_S if initialized else PRE_INIT_WAIT_S)
        while not ended and time.monotonic() < deadline:
            if read(SAID) is not None:
                return True
            if not initialized and read(PASSED) is not None:
                return False
            time.sleep(0.05)
        return read(SAID) is not None
    finally:
        signal.signal(signal.SIGTERM, previous)


def _remove_dead_launches(root: Path) -> None:
    """Notes of launches whose launcher is gone (each launch leaves a directory of a few bytes)."""
    for d in root.iterdir():
        pid = d.name.split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            for f in d.iterdir():
                f.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                d.rmdir()
        except PermissionError:
            continue
