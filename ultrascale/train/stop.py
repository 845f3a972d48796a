"""Stop on a signal, keep every step: SIGTERM, SIGINT or SIGUSR1 on any rank ends the run at a step boundary,
after a checkpoint of that step, with exit code 0.

Why a flag and not an exception: a signal arrives on one rank at an arbitrary point (Ctrl-C reaches every
process of the terminal's group, a scheduler's SIGTERM may reach one node first, Slurm's time-limit USR1 only
the batch script). Raising there would leave the other ranks waiting in a collective for a rank that is gone,
and the steps since the last periodic checkpoint would be lost. Instead the handler only records the signal;
the trainer sends the record through the all-gather it already makes for the stability verdict, so every rank
learns of it in the same step, finishes that step, saves and stops together.

A second signal during the save is reported and ignored: the save finishes and ``latest`` moves atomically
(a SIGKILL at that point leaves the previous checkpoint as ``latest``, so nothing is corrupted either way).

Who cannot send a signal to every rank (a Slurm batch script whose job steps run on other nodes, a driver
process, a user) writes the request file ``<output_dir>/STOP`` (its text, e.g. ``USR1``, names the cause);
rank 0 looks for it once per step and removes it once the run has stopped.

And a launcher that dies is a stop too: the ``deepspeed`` command does not forward SIGTERM on one node (it
dies of it and leaves its ``launch.py`` and the ranks running, unwatched), so each rank also checks, once per
step, that the launcher processes above it are still there.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
FILE_CODE = 1000
"""The agreement code for a stop asked through the request file (signal numbers are below it)."""
LAUNCHER_GONE = 1001
"""The agreement code for a stop because a launcher process above a rank exited."""
LAUNCHERS = ("deepspeed", "torchrun", "torch.distributed.run", "torch/distributed/run")


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
    """This process's pending stop: the first signal (or the request file) it saw, and how many more came."""

    def __init__(self, rank: int, request_file: Path | None = None):
        self.rank, self.request_file = rank, request_file
        self.code, self.repeats = 0, 0
        self.file_text = ""
        self._previous: dict[int, object] = {}
        self.launchers = launcher_ancestors()
        self.gone = ""

    def install(self) -> StopRequest:
        """Take over SIGTERM, SIGINT and SIGUSR1 (main thread only: Python delivers signals there)."""
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._on_signal)
        return self

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)  # type: ignore[arg-type]
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
                self.file_text = self.request_file.read_text().strip()[:40]
            except OSError:
                self.file_text = ""
            self.code = FILE_CODE
        return self.code

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
