"""Jail launcher for one untrusted program: run as ``python -I -S _jail.py SPEC_JSON`` by :mod:`sandbox`.

It is a separate, stdlib-only interpreter on purpose: namespaces and setuid are set up between fork and
exec, which is only safe in a single-threaded process (the evaluating process has torch's threads).

Layers, each enforced by the kernel rather than by Python:
- network: a fresh network namespace (only a down loopback), so no connect succeeds, not even to 127.0.0.1;
- filesystem: a private mount namespace where every mount is recursively read-only, plus a small tmpfs
  as the working directory: the program can write there and nowhere else, whatever its uid;
- processes: a fresh PID namespace whose init is the program; when it dies or is killed the kernel kills
  every descendant. It runs as an unprivileged uid of its own, so RLIMIT_NPROC (ignored for root)
  caps a fork bomb, and no other sandbox's processes count against it;
- resources: RLIMIT_AS, RLIMIT_CPU, RLIMIT_FSIZE (output files), RLIMIT_NOFILE, no core dumps.

Exit status: the program's own status; 125 with ``jail-setup-failed: ...`` on stderr if isolation could
not be established (the caller then refuses to run untrusted code).
"""

import ctypes
import ctypes.util
import json
import os
import platform
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
AT_FDCWD = -100
AT_RECURSIVE = 0x8000
MOUNT_ATTR_RDONLY = 0x1
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
SETUP_FAILED = 125

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.syscall.restype = ctypes.c_long


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
    enc = [None if x is None else str(x).encode() for x in (src, target, fstype)]
    _check(_libc.mount(enc[0], enc[1], enc[2], flags, None if data is None else data.encode()), f"mount {target}")


def _readonly_everything() -> None:
    """Recursively read-only and private: mount_setattr (Linux >= 5.12) in one call, else mount by mount."""
    nr = {"x86_64": 442, "aarch64": 442}.get(platform.machine())
    if nr is not None:
        attr = _MountAttr(MOUNT_ATTR_RDONLY, 0, MS_PRIVATE, 0)
        ret = _libc.syscall(nr, AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr))
        if ret == 0:
            return
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    keep = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}
    with open("/proc/self/mountinfo") as f:
        mounts = [(ln.split()[4], ln.split()[5]) for ln in f]
    for point, opts in mounts:
        point = point.encode().decode("unicode_escape")
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for name, bit in keep.items():
            if name in opts.split(","):
                flags |= bit
        try:
            _mount(None, point, None, flags, None)
        except OSError:
            if point == "/":
                raise


def _fail(msg: str) -> None:
    sys.stderr.write(f"jail-setup-failed: {msg}\n")
    sys.stderr.flush()
    os._exit(SETUP_FAILED)


def _limit(res: int, value: int) -> None:
    resource.setrlimit(res, (value, value))


def _child(spec: dict, uid: int) -> None:
    """PID 1 of the new namespace: private /proc, limits, drop to the sandbox uid, exec the program."""
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
    try:
        os.execve(python, [python, "-I", "-B", spec["program"]], env)
    except OSError as e:
        _fail(f"exec {python}: {e}")


def main() -> None:
    spec = json.loads(sys.argv[1])
    try:
        _check(
            _libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS),
            "unshare(mount, net, pid, ipc, uts namespaces) [needs root or CAP_SYS_ADMIN]",
        )
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
