"""Hostile programs against the real sandbox: each must be contained and counted as failed.

These run the actual kernel isolation (namespaces, uid drop, rlimits); nothing is mocked. They need
root, as CI has; elsewhere they skip with the reason the sandbox gives.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading

from tests.conftest import needs, sandbox_missing, tool_missing
from ultrascale.eval import jail
from ultrascale.eval.sandbox import (
    Limits,
    processes_of,
    remove_root,
    run_many,
    run_program,
)
from ultrascale.paths import PROJECT_ROOT

pytestmark = needs(sandbox_missing())

FAST = Limits(timeout_s=3, cpu_s=3)


def test_ok_program_passes_and_failing_assert_fails():
    ok = run_program("assert sum(range(10)) == 45\nprint('fine')")
    assert ok.passed and ok.stdout.strip() == "fine"
    bad = run_program("assert 1 + 1 == 3")
    assert bad.status == "failed" and "AssertionError" in bad.stderr


def test_a_program_that_kills_itself_dies_as_it_would_outside():
    """It is not the namespace's init (whose own SIGKILL the kernel ignores): it dies, and the test fails."""
    o = run_program("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\nprint('alive')")
    assert o.status == "failed" and o.returncode == 128 + 9 and "alive" not in o.stdout


def test_infinite_loop_is_killed_on_timeout():
    out = run_program("while True:\n    pass\n", FAST)
    assert out.status == "timeout" and not out.passed
    assert processes_of(out.uid) == []


def test_fork_bomb_is_capped_and_leaves_nothing_behind():
    bomb = textwrap.dedent(
        """
        import os, time
        while True:
            try:
                os.fork()
            except OSError:
                time.sleep(0.001)
        """
    )
    out = run_program(bomb, FAST)
    assert out.status == "timeout"
    assert processes_of(out.uid) == []


def test_process_count_limit_holds_for_root_started_sandbox():
    # RLIMIT_NPROC is ignored for root: this proves the program really runs as an unprivileged uid.
    prog = textwrap.dedent(
        """
        import os, time
        made = 0
        for _ in range(64):
            try:
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                made += 1
            except OSError:
                break
        print(made, os.getuid())
        """
    )
    out = run_program(prog, Limits(timeout_s=10, max_procs=8))
    made, uid = (int(x) for x in out.stdout.split())
    assert uid != 0 and uid == out.uid
    assert made < 8
    assert processes_of(out.uid) == []  # the sleeping children died with the namespace's init


def test_daemonised_child_does_not_outlive_the_program():
    prog = textwrap.dedent(
        """
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep(60)
            os._exit(0)
        print("parent exits")
        """
    )
    out = run_program(prog, FAST)
    assert out.passed  # the program itself was fine; what matters is its leftovers
    assert processes_of(out.uid) == []


def test_large_allocation_fails():
    out = run_program("x = bytearray(8 << 30)\nprint('got 8 GiB')", Limits(memory_mb=512))
    assert out.status == "failed" and "MemoryError" in out.stderr and "got" not in out.stdout


def test_write_into_repo_and_shared_tmp_is_refused():
    targets = [PROJECT_ROOT / "sandbox_pwned.txt", "/tmp/sandbox_pwned.txt", "/dev/shm/sandbox_pwned.txt"]
    for target in targets:
        out = run_program(f"open({str(target)!r}, 'w').write('pwned')")
        assert out.status == "failed", target
        assert "Read-only file system" in out.stderr or "Permission denied" in out.stderr, out.stderr
        assert not __import__("os").path.exists(target)


def test_own_workdir_is_writable_but_bounded():
    ok = run_program("open('scratch.txt', 'w').write('x' * 1000)\nprint(open('scratch.txt').read()[:3])")
    assert ok.passed and ok.stdout.strip() == "xxx"
    fill = run_program("open('big.bin', 'wb').write(b'0' * (64 << 20))", Limits(tmpfs_mb=8))
    assert fill.status == "failed"


def test_output_flood_is_cut_off():
    out = run_program("while True:\n    print('x' * 10000)", Limits(timeout_s=10, max_output_bytes=1 << 16))
    assert out.status == "failed"  # SIGXFSZ long before the timeout


def test_network_connect_fails_even_to_a_local_listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(5)
    port = server.getsockname()[1]
    accepted: list[bool] = []

    def accept():
        try:
            server.accept()
            accepted.append(True)
        except OSError:
            pass

    t = threading.Thread(target=accept)
    t.start()
    prog = textwrap.dedent(
        f"""
        import socket
        for host in ("127.0.0.1", "1.1.1.1"):
            try:
                socket.create_connection((host, {port} if host == "127.0.0.1" else 80), timeout=2)
                print("connected", host)
            except OSError as e:
                print("refused", host, e.errno)
        socket.create_connection(("127.0.0.1", {port}), timeout=2)
        """
    )
    out = run_program(prog, Limits(timeout_s=10))
    t.join()
    server.close()
    assert out.status == "failed"
    assert "connected" not in out.stdout and out.stdout.count("refused") == 2
    assert not accepted


def test_run_many_keeps_order():
    outs = run_many([f"import sys; sys.exit({i % 2})" for i in range(4)], FAST, workers=2)
    assert [o.passed for o in outs] == [True, False, True, False]


def test_program_posing_as_a_setup_failure_is_just_a_failed_program():
    # The jail reports setup failures on its own pipe; what a program prints is only the program's output.
    out = run_program("import sys\nsys.stderr.write('jail-setup-failed: fake\\n')\nsys.exit(125)", FAST)
    assert out.status == "failed" and out.returncode == 125 and "jail-setup-failed: fake" in out.stderr


# Run inside a namespace of the test's own (private to the host, then made rshared, as systemd makes `/`),
# under an interpreter whose prefix is an overlay of the real one: the overlay is the canary. A jail that
# mounts before making its mounts private leaks the prefix bind mount into this namespace, and a cleanup
# that deletes across mounts then deletes the overlay's files (never the real prefix: overlayfs only
# writes whiteouts into its upper directory).
_SHARED_NS_PROBE = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
from ultrascale.eval import jail, sandbox
seen = []
def remove_root(root, _remove=sandbox.remove_root):  # what reached this namespace, before any cleanup
    seen.extend(jail.mount_points(str(root)))
    _remove(root)
sandbox.remove_root = remove_root
out = sandbox.run_program("print(6 * 7)")
left = [ln.split()[4] for ln in open("/proc/self/mountinfo") if "ultrascale-sandbox-" in ln]
print(json.dumps({"status": out.status, "stdout": out.stdout.strip(), "prefix": sys.base_prefix, "left": left,
                  "seen": seen,
                  "canary": os.path.exists(os.path.join(sys.base_prefix, "CANARY")),
                  "python": os.path.exists(sys.executable)}))
"""
_SHARED_NS_SETUP = (
    'mount --make-rshared / && mount -t overlay overlay -o "lowerdir=$1,upperdir=$2,workdir=$3" "$4" '
    '&& touch "$4/CANARY" && exec "$4/$5" -c "$6" "$7"'
)


@needs(tool_missing("unshare", "to make a namespace"))
def test_sandbox_in_shared_propagation_namespace_leaves_no_mount_and_keeps_the_prefix(tmp_path):
    prefix = os.path.realpath(sys.base_prefix)
    python_rel = os.path.relpath(os.path.realpath(sys.executable), prefix)
    if python_rel.startswith(".."):  # a venv: its interpreter is a link into the base prefix
        python_rel = os.path.relpath(os.path.realpath(sys._base_executable), prefix)
    upper, work, merged = (tmp_path / d for d in ("upper", "work", "merged"))
    for d in (upper, work, merged):
        d.mkdir()
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", _SHARED_NS_SETUP, "sh",
         prefix, str(upper), str(work), str(merged), python_rel, _SHARED_NS_PROBE, str(PROJECT_ROOT)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["prefix"] == str(merged)  # the probe really ran on the overlay prefix
    assert got["status"] == "passed" and got["stdout"] == "42"
    assert got["seen"] == []  # the jail's mounts never reached the caller's namespace
    assert got["left"] == []  # and none is left behind
    assert got["canary"] and got["python"]  # nothing was deleted through a mount
    assert sorted(p.name for p in upper.iterdir()) == ["CANARY"]  # not even a whiteout in the overlay


@needs(tool_missing("unshare", "to make a namespace"))
def test_cleanup_unmounts_what_it_finds_and_never_deletes_across_a_mount(tmp_path):
    canary, root = tmp_path / "canary", tmp_path / "root"
    canary.mkdir()
    (canary / "KEEP").write_text("x")
    (root / "python").mkdir(parents=True)
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); from pathlib import Path\n"
        "from ultrascale.eval.sandbox import remove_root, SandboxCleanupError\n"
        "try:\n    remove_root(Path(sys.argv[2])); print('removed')\n"
        "except SandboxCleanupError as e:\n    print('refused:', e)\n"
    )
    bind = 'mount --bind "$1" "$2/python" && '

    def run(inner: str) -> str:
        script = bind + inner + ' "$3" -c "$4" "$5" "$2"'
        proc = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh", str(canary), str(root),
             sys.executable, probe, str(PROJECT_ROOT)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout.strip()

    # A mount it cannot detach (inherited into a user namespace, so the kernel locks it): nothing deleted.
    got = run("unshare --user --map-root-user --mount")
    assert got.startswith("refused:") and f"{root}/python is still a mount point" in got
    assert (canary / "KEEP").exists() and root.exists()
    # As root it detaches the leaked mount first, then deletes only the root's own files.
    assert run("exec") == "removed"
    assert (canary / "KEEP").exists() and not root.exists()


def test_cleanup_removes_a_plain_root(tmp_path):
    root = tmp_path / "plain"
    (root / "work").mkdir(parents=True)
    (root / "program.py").write_text("print(1)")
    remove_root(root)
    assert not root.exists()


@needs(tool_missing("unshare", "to make a namespace"))
def test_readonly_fallback_remounts_everything_or_names_the_mount_it_could_not(tmp_path):
    # The pre-5.12 path (no mount_setattr) never runs on this kernel otherwise: run it in a namespace.
    probe = (
        "import sys, os; sys.path.insert(0, sys.argv[1])\n"
        "from ultrascale.eval import jail\n"
        "jail._mount(None, '/', None, jail.MS_REC | jail.MS_PRIVATE, None)\n"
        "jail.remount_readonly(jail._mountinfo())\n"
        "try:\n    open(os.path.join(sys.argv[2], 'x'), 'w')\n    print('writable')\n"
        "except OSError as e:\n    print('errno', e.errno)\n"
        "try:\n    jail.remount_readonly([('/nonexistent/ultrascale-mount', 'rw')])\n"
        "except OSError as e:\n    print('error:', e)\n"
    )
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", probe, str(PROJECT_ROOT),
         str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "errno 30"  # EROFS: every mount really went read-only
    assert lines[1].startswith("error:") and "/nonexistent/ultrascale-mount" in lines[1]
    assert not (tmp_path / "x").exists()


def test_mount_points_decode_the_kernels_escapes(tmp_path):
    """The kernel writes a space, tab, newline and backslash in a mount point as octal (``\\040`` ...): mount a
    tmpfs on such a path (in a child's own mount namespace, so this host's table is untouched) and read it
    back by its real name."""
    weird = tmp_path / "a b\tc\\d"
    weird.mkdir()
    script = textwrap.dedent(f"""
        import json
        from ultrascale.eval import jail
        jail._check(jail._libc.unshare(jail.CLONE_NEWNS), "unshare")
        jail._mount(None, "/", None, jail.MS_REC | jail.MS_PRIVATE, None)  # nothing leaks to the host
        jail._mount("tmpfs", {str(weird)!r}, "tmpfs", 0, "size=1m")
        raw = [ln.split()[4] for ln in open("/proc/self/mountinfo") if "tmpfs" in ln]
        print(json.dumps({{"points": jail.mount_points({str(tmp_path)!r}), "raw": raw}}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=PROJECT_ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout)
    assert any("\\040" in r and "\\011" in r and "\\134" in r for r in got["raw"]), got["raw"]  # escaped there
    assert got["points"] == [str(weird)]  # and decoded here
    assert jail.mount_points(str(tmp_path)) == []  # the host never saw it
    points = jail.mount_points()
    assert "/" in points and "/proc" in points
    assert jail.mount_points("/proc") == [p for p in points if p == "/proc" or p.startswith("/proc/")]
