"""Hostile programs against the real sandbox: each must be contained and counted as failed.

These run the actual kernel isolation (namespaces, uid drop, rlimits); nothing is mocked. They need
root, as CI has; elsewhere they skip with the reason the sandbox gives.
"""

from __future__ import annotations

import socket
import textwrap
import threading

import pytest

from ultrascale.config.compose import PROJECT_ROOT
from ultrascale.eval.sandbox import Limits, SandboxUnavailable, check_available, processes_of, run_many, run_program

try:
    check_available()
    _why = ""
except SandboxUnavailable as e:
    _why = str(e)
pytestmark = pytest.mark.skipif(bool(_why), reason=_why)

FAST = Limits(timeout_s=3, cpu_s=3)


def test_ok_program_passes_and_failing_assert_fails():
    ok = run_program("assert sum(range(10)) == 45\nprint('fine')")
    assert ok.passed and ok.stdout.strip() == "fine"
    bad = run_program("assert 1 + 1 == 3")
    assert bad.status == "failed" and "AssertionError" in bad.stderr


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
