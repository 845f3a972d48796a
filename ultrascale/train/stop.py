"""Stop on a signal, keep every step: SIGTERM, SIGINT or SIGUSR1 on any rank ends the run at a step boundary,
after a checkpoint of that step, with exit code 0.

Why a flag and not an exception: a signal arrives on one rank at an arbitrary point (Ctrl-C reaches every
process of the terminal's group, a scheduler's SIGTERM may reach one node first, Slurm's time-limit USR1 only
the batch script). Raising there would leave the other ranks waiting in a collective for a rank that is gone,
and the steps since the last periodic checkpoint would be lost. Instead the handler only records the signal;
the trainer sends the record through the all-gather it already makes for the stability verdict, so every rank
learns of it in the same step, finishes that step, saves and stops together. The request file, the watchdog of a
rank stuck in a collective and the launcher check: :class:`StopRequest`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
FILE_CODE = 1000
"""The agreement code for a stop asked through the request file (signal numbers are below it)."""
LAUNCHER_GONE = 1001
"""The agreement code for a stop because a launcher process above a rank exited."""
LAUNCHERS = ("deepspeed", "torchrun", "torch.distributed.run", "torch/distributed/run")
WRITER = "writer:"
"""The request file's line naming who asked: ``writer: HOST PID``."""


def write_request(path: Path, cause: str) -> None:
    """Ask the run in ``path``'s directory to stop at its next step: the cause, then this process as the writer
    (while the writer lives, the request stands even if it predates the ranks; see ``drop_stale_request``)."""
    path.write_text(f"{cause}\n{WRITER} {socket.gethostname()} {os.getpid()}\n")


def _writer_alive(text: str) -> bool | None:
    """True/False when the request names a writer on this host that is alive/gone; None when it cannot be told
    (no writer line, or another host's)."""
    for line in text.splitlines():
        host, _, pid = line.removeprefix(WRITER).strip().partition(" ")
        if not line.startswith(WRITER) or not pid.strip().isdigit() or host != socket.gethostname():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # alive, another user's
            pass
        return True
    return None


def signal_name(code: int) -> str:
    if code == FILE_CODE:
        return "STOP file"
    if code == LAUNCHER_GONE:
        return "launcher exit"
    try:
        return signal.Signals(code).name
    except ValueError:
        return f"signal {code}"


class StopRequest:
    """This process's pending stop: the first signal (or the request file) it saw, and how many more came.

    A second signal during the save is reported and ignored: the save finishes and ``latest`` moves atomically
    (a SIGKILL at that point leaves the previous checkpoint as ``latest``, so nothing is corrupted either way).

    Who cannot send a signal to every rank (a Slurm batch script whose job steps run on other nodes, a driver
    process, a user) writes the request file ``<output_dir>/STOP`` (its first line, e.g. ``USR1``, names the
    cause; a ``writer: HOST PID`` line names who asked); rank 0 looks for it once per step and removes it once the
    run has stopped. A request nobody answered must not stop the next attempt right after its resume
    (:meth:`drop_stale_request`).

    A rank can only act on a signal at a step boundary; one stuck in a collective whose peer died (a killed
    rank: gloo, DeepSpeed's shared-memory all-reduce and NCCL all wait for it) never gets there. So the first
    signal also starts a watchdog thread (woken through ``signal.set_wakeup_fd``, which the C-level handler
    writes even while the main thread is blocked in C++): if the rank makes no progress for ``30 s + 3 x its
    longest step`` after the signal, it exits at once with code 1 and a line saying why, keeping the newest
    complete checkpoint, so a launcher restarts the job in seconds instead of waiting out its shutdown timeout.

    And a launcher that dies is a stop too: the ``deepspeed`` command does not forward SIGTERM on one node (it
    dies of it and leaves its ``launch.py`` and the ranks running, unwatched), so each rank also checks, once per
    step, that the launcher processes above it are still there (:func:`launcher_ancestors`)."""

    def __init__(self, rank: int, request_file: Path | None = None):
        self.rank, self.request_file = rank, request_file
        self.code, self.repeats = 0, 0
        self.file_text = ""
        self._previous: dict[int, object] = {}
        self.launchers = launcher_ancestors()
        self.gone = ""
        self._beat = time.monotonic()
        self._longest: float | None = None
        self._settled = False
        self._paused = 0

    def install(self) -> StopRequest:
        """Take over SIGTERM, SIGINT and SIGUSR1 (main thread only: Python delivers signals there); rank 0 also
        removes a stale request file (before any rank can read it: only rank 0 reads it)."""
        if self.rank == 0:
            self.drop_stale_request()
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._on_signal)
            read, write = os.pipe()
            os.set_blocking(write, False)
            self._previous_wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
            threading.Thread(target=self._watchdog, args=(read,), name="stop-watchdog", daemon=True).start()
        return self

    def beat(self, step_s: float | None = None) -> None:
        """The main thread made progress (a step, a part of the save); ``step_s`` sizes the watchdog's grace."""
        self._beat = time.monotonic()
        if step_s:
            self._longest = max(self._longest or 0.0, float(step_s))

    def settle(self) -> None:
        """The stop is done (checkpoint saved), or training is over: the watchdog has nothing left to guard."""
        self._settled = True

    @contextlib.contextmanager
    def unguarded(self):
        """A stretch where a rank may legitimately wait long without a step (an evaluation: rank 0 generates
        HumanEval while the others wait in a collective): the watchdog does not judge it."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self.beat()

    def _watchdog(self, fd: int) -> None:
        try:  # the C handler writes each handled signal's number here; wait for one of ours
            while os.read(fd, 1)[0] not in SIGNALS:
                pass
        except OSError:
            return
        since = time.monotonic()
        while not self._settled:
            time.sleep(0.5)
            if self._longest is None or self._paused:  # start-up, a first-step compile, an eval: the launcher decides
                continue
            grace = 30.0 + 3.0 * self._longest
            quiet = time.monotonic() - max(self._beat, since)
            if quiet > grace and not self._settled:
                os.write(2, (f"rank {self.rank}: no progress {quiet:.0f}s after a stop signal (a collective whose peer "
                             "is gone never returns): exiting without a new checkpoint; the newest complete one is "
                             "kept\n").encode())  # fmt: skip
                os._exit(1)

    def restore(self) -> None:
        self._settled = True
        for s, handler in self._previous.items():
            signal.signal(s, handler)  # type: ignore[arg-type]
        if self._previous:
            signal.set_wakeup_fd(self._previous_wakeup)
        self._previous.clear()

    def _on_signal(self, signum: int, _frame) -> None:
        # os.write, not logging or print: the interrupted code may hold their locks
        name = signal.Signals(signum).name
        if self.code:
            self.repeats += 1
            msg = (f"rank {self.rank}: {name} again: already stopping (the checkpoint is being written and `latest` "
                   "moves only once it is complete; SIGKILL aborts and keeps the previous checkpoint)\n")  # fmt: skip
        else:
            self.code = signum
            msg = f"rank {self.rank}: {name}: finishing this step, then saving a checkpoint and stopping\n"
        if self.rank == 0 or not self.repeats:
            os.write(2, msg.encode())

    def local(self, check_file: bool) -> int:
        """The code this rank brings to the agreement: a signal number, :data:`FILE_CODE`, :data:`LAUNCHER_GONE`
        or 0."""
        if not self.code:
            for pid, name in self.launchers:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    self.code, self.gone = LAUNCHER_GONE, f"{name} (pid {pid})"
                    os.write(2, f"rank {self.rank}: {self.gone} exited: saving a checkpoint and stopping\n".encode())
                    break
                except PermissionError:
                    continue
        if not self.code and check_file and self.request_file is not None and self.request_file.exists():
            try:
                self.file_text = (self.request_file.read_text().strip().splitlines() or [""])[0][:40]
            except OSError:
                self.file_text = ""
            self.code = FILE_CODE
        return self.code

    def drop_stale_request(self) -> str | None:
        """Rank 0, before any step: remove a request file written before this launch began (the outermost launcher
        above this rank, or this process) whose writer is gone or unnamed; it asked an earlier attempt to stop and
        nothing answered it. A request whose writer lives (a driver whose Ctrl-C came before the ranks started, a
        Slurm batch script's USR1) still stands. Returns what was removed, said on stderr."""
        f = self.request_file
        if f is None:
            return None
        try:
            written, text = f.stat().st_mtime, f.read_text()
        except OSError:
            return None
        alive = _writer_alive(text)  # None with a writer line: another host's writer, which cannot be judged here
        if written >= launch_started() - 1.0 or alive or (alive is None and WRITER in text):
            return None
        cause = (text.strip().splitlines() or ["(empty)"])[0][:40]
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(written))
        why = f"{f}: a stop request ({cause}, written {when}) from before this launch that nothing answered: removed"
        f.unlink(missing_ok=True)
        print(f"rank {self.rank}: {why}", file=sys.stderr, flush=True)
        return why

    def consume_file(self) -> None:
        """Rank 0, after the stop is done: the request is answered (a requeued job must not stop again)."""
        if self.request_file is not None:
            self.request_file.unlink(missing_ok=True)

    def describe(self, code: int) -> str:
        if code == FILE_CODE and self.file_text:
            return f"{self.file_text} (via the STOP file)"
        if code == LAUNCHER_GONE and self.gone:
            return f"launcher exit: {self.gone}"
        return signal_name(code)


def launch_started() -> float:
    """When this launch began: the start of the outermost launcher above this rank, else of this process."""
    try:
        import psutil

        pid = (launcher_ancestors() or [(os.getpid(), "")])[-1][0]
        return psutil.Process(pid).create_time()
    except Exception:  # no /proc, or the launcher exited meanwhile: only a named, living writer keeps a request
        return time.time()


def launcher_ancestors(depth: int = 3) -> list[tuple[int, str]]:
    """(pid, name) of the launcher processes directly above this one (deepspeed's runner and ``launch.py``,
    torchrun, the ``train.py launcher=...`` driver), nearest first; empty under plain ``python``."""
    try:
        import psutil

        out, proc = [], psutil.Process().parent()
        while proc is not None and len(out) < depth:
            cmd = " ".join(proc.cmdline())
            name = next((k for k in LAUNCHERS if k in cmd), None)
            if name is None:
                break
            out.append((proc.pid, name))
            proc = proc.parent()
        return out
    except Exception:  # no /proc, a process gone mid-walk: nothing to watch
        return []
