"""Warm ranks: the suite's launches forked from one process that has already imported torch, DeepSpeed and
transformers, instead of a fresh interpreter per rank paying those imports again.

Why: a tiny 2-rank run spends about 17 s from ``torchrun`` to exit on this 2-core box, and about 10 s of it is
imports (torchrun's own, then every rank's). The suite launches a few hundred such runs. Here a
``multiprocessing`` forkserver imports the heavy modules once per pytest session; each rank is forked from it,
gets the environment ``torchrun`` would give it (``RANK``, ``WORLD_SIZE``, ``MASTER_PORT``, the
``TORCHELASTIC_*`` names), and runs ``train.py`` (or the test's script) as ``__main__``, exactly as the
interpreter would: ``sys.argv``, ``sys.path[0]``, exit codes, atexit handlers, tracebacks on stderr. The
ranks form a real gloo process group and run the real code; what is replaced is the launcher's agent, and
``launch()`` keeps its contract (a ``CompletedProcess`` with both ranks' output, torchrun's exit status:
1 when a rank fails, after the others are stopped as torchrun stops them).

What stays a real launch (``tests/conftest.launch(real=True)``, or everything with
``ULTRASCALE_TESTS_REAL_LAUNCH=1``): the launcher tests themselves (``torchrun``, ``deepspeed``, Slurm), and a
launch whose environment changes what the interpreter does at start-up (``PYTHONPATH``'s sitecustomize,
``LD_PRELOAD``, another accelerator): a forked rank would not see it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REAL_ENV = "ULTRASCALE_TESTS_REAL_LAUNCH"
"""Set to 1 to launch every test run through the real ``torchrun``/``python`` (slower; the launchers' own tests
always do)."""

PRELOAD = ["tests.support.warm_preload"]
"""Imported once, in the forkserver, before any rank is forked (its docstring says what and why)."""

STARTUP_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "LD_PRELOAD", "LD_LIBRARY_PATH", "DS_ACCELERATOR",
               "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "TORCH_EXTENSIONS_DIR")  # fmt: skip
"""Environment read when the interpreter or a preloaded module starts: a launch that changes one from the
forkserver's value cannot be forked and runs for real."""

STOP_GRACE_S = 30.0
"""torchrun's grace between SIGTERM and SIGKILL when it stops the other ranks of a failed group."""

_CTX: list = []
_SERVER_ENV: dict[str, str] = {}


def _context():
    """The forkserver context, its server started now (with the project root importable, so the preload is found
    whatever directory pytest was started from)."""
    if not _CTX:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        root = str(Path(__file__).resolve().parents[2])
        saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, saved]))
        try:
            _SERVER_ENV.update(os.environ)
            if saved is None:
                _SERVER_ENV.pop("PYTHONPATH")
            else:
                _SERVER_ENV["PYTHONPATH"] = saved
            multiprocessing.forkserver.ensure_running()
        finally:
            if saved is None:
                os.environ.pop("PYTHONPATH")
            else:
                os.environ["PYTHONPATH"] = saved
        _CTX.append(ctx)
    return _CTX[0]


def can_fork(env: dict[str, str]) -> str:
    """'' where a launch with ``env`` can be forked from the warm server; otherwise why it must run for real."""
    if os.environ.get(REAL_ENV) == "1":
        return f"{REAL_ENV}=1"
    server = _SERVER_ENV or os.environ
    changed = [k for k in STARTUP_ENV if env.get(k) != server.get(k)]
    return f"the launch sets {', '.join(changed)}, read at interpreter start-up" if changed else ""


def _rank_main(script: str, module: str | None, argv: list[str], env: dict[str, str], cwd: str, out: str,
               err: str) -> None:  # fmt: skip
    """One rank, in the forked child: the interpreter's own start and end around ``script`` run as __main__."""
    import atexit
    import runpy
    import threading
    import traceback

    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    sys.argv = [script if module is None else "-m", *argv]  # run_module puts the module's path in argv[0]
    sys.path[0] = str(Path(cwd, script).resolve().parent) if module is None else cwd
    code: int = 0
    try:
        if module is None:
            runpy.run_path(script, run_name="__main__")
        else:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 128 + signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    try:  # the interpreter's shutdown: non-daemon threads, then atexit handlers, then the streams
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code & 0xFF)


def launch(cmd: list[str], script: str, argv: list[str], nproc: int, env: dict[str, str], cwd: Path,
           timeout: float, torchrun: bool, module: str | None = None) -> subprocess.CompletedProcess:  # fmt: skip
    """``nproc`` ranks of ``script`` forked warm (``nproc=0``: one plain process, as ``python script``), with
    torchrun's environment and exit status when ``torchrun``. ``cmd`` is the command this stands for."""
    from ultrascale.runtime.dist import free_port

    ctx = _context()
    world = max(nproc, 1)
    port = str(free_port())
    with tempfile.TemporaryDirectory(prefix="warm_launch_") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        procs = []
        for rank in range(world):
            rank_env = dict(env)
            if torchrun:
                rank_env.update(
                    RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_NAME="default",
                    LOCAL_WORLD_SIZE=str(world), WORLD_SIZE=str(world), GROUP_WORLD_SIZE="1",
                    ROLE_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                    TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="none",
                    TORCHELASTIC_USE_AGENT_STORE="False",
                    TORCH_NCCL_ASYNC_ERROR_HANDLING=env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
                )  # fmt: skip
            p = ctx.Process(target=_rank_main, args=(script, module, argv, rank_env, str(cwd), out, err))
            p.start()
            procs.append(p)
        rc = _wait(procs, timeout, torchrun, err)

        def read(path: str) -> str:
            with open(path, errors="replace") as f:
                return f.read()

        stdout, stderr = read(out) if os.path.exists(out) else "", read(err) if os.path.exists(err) else ""
    if rc is None:
        raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(cmd, rc, stdout, stderr)


def _wait(procs: list, timeout: float, torchrun: bool, err: str) -> int | None:
    """Wait for the ranks as torchrun's agent does: the first failure stops the others (SIGTERM, then SIGKILL
    after torchrun's grace) and the launch exits 1. None when ``timeout`` passed (every rank is killed)."""
    deadline = time.monotonic() + timeout
    pending = {p.sentinel: p for p in procs}
    failed: list[tuple[int, int]] = []
    stop_by: float | None = None
    while pending:
        now = time.monotonic()
        if now >= deadline:
            for p in pending.values():
                p.kill()
            for p in procs:
                p.join()
            return None
        wait_s = deadline - now if stop_by is None else max(0.0, min(deadline, stop_by) - now)
        for s in multiprocessing.connection.wait(list(pending), timeout=wait_s):
            p = pending.pop(s)
            p.join()
            if p.exitcode != 0:
                failed.append((procs.index(p), p.exitcode))
        if failed and torchrun and stop_by is None and pending:
            for p in pending.values():
                p.terminate()
            stop_by = time.monotonic() + STOP_GRACE_S
        if stop_by is not None and time.monotonic() >= stop_by:
            for p in pending.values():
                p.kill()
    if not failed:
        return 0
    if not torchrun:
        return failed[0][1]  # a signal: negative, as subprocess reports it
    with open(err, "a") as f:  # torchrun's summary of the failed group (its ChildFailedError), without a traceback
        for rank, code in failed:
            f.write(f"warm launch: rank {rank} (local_rank: {rank}) exitcode: {code}\n")
    return 1
