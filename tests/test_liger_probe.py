"""liger-kernel is chosen for what it does here, not for being found (issue 46, 1.3): a liger-kernel built against
another Triton is found by ``find_spec`` and then fails at its import or its first launch, which was step 1 of the
run. Planted ``liger_kernel`` packages on ``sys.path`` stand in for the real one (a CPU cannot run its Triton
kernels); everything else (the decisions, validation, the loss's dispatch) is the real code."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ultrascale.errors import ConfigError
from ultrascale.levers.decide import decide
from ultrascale.model import loss
from ultrascale.runtime.gpu import GpuInfo

GIB = 2**30
H100 = GpuInfo("NVIDIA H100 80GB HBM3", 81559 * 2**20, (9, 0), 8, 80 * GIB, 132)
BROKEN = "raise ImportError(\"planted: cannot import name 'libdevice' from 'triton.language.extra'\")"


@pytest.fixture
def plant(tmp_path, monkeypatch):
    """``plant(init, functional)``: a ``liger_kernel`` package with those module bodies first on ``sys.path``,
    a fresh verdict cache; the planted modules leave ``sys.modules`` afterwards."""
    monkeypatch.setattr(loss, "_VERDICTS", {}, raising=False)

    def make(init: str, functional: str = "") -> Path:
        pkg = tmp_path / "liger_kernel"
        (pkg / "transformers").mkdir(parents=True)
        (pkg / "__init__.py").write_text(f"from pathlib import Path\nwith open({str(tmp_path / 'imports')!r}, 'a') "
                                         f"as f:\n    f.write('x')\n{init}\n")  # fmt: skip
        (pkg / "transformers" / "__init__.py").write_text("")
        (pkg / "transformers" / "functional.py").write_text(functional)
        monkeypatch.syspath_prepend(str(tmp_path))
        return tmp_path / "imports"

    yield make
    for name in [m for m in sys.modules if m == "liger_kernel" or m.startswith("liger_kernel.")]:
        del sys.modules[name]


def _llama_1b(*overrides: str):
    from ultrascale.config.compose import compose
    from ultrascale.config.topology import Topology
    from ultrascale.model.build import build_hf_config

    cfg = compose(["recipe=llama_1b_zero0", *overrides])
    return cfg, Topology(world=1), build_hf_config(cfg.model)


def test_auto_takes_the_chunked_loss_when_liger_does_not_import(plant):
    """Found but failing at import: ``auto`` keeps the chunked loss and says why, naming the import error; the
    import is tried once per process (Python would rerun a failed import every time)."""
    imports = plant(BROKEN)
    cfg, topo, hf = _llama_1b()
    for _ in range(2):
        d = decide(cfg, topo, hf, "nccl", None, H100)
        assert d.loss_kernel.value == "chunked" and d.fused_loss.on and d.fused_loss.value, d.loss_kernel
        assert "liger-kernel does not import" in d.loss_kernel.why, d.loss_kernel.why
        assert "cannot import name 'libdevice'" in d.loss_kernel.why, d.loss_kernel.why
    assert imports.read_text() == "x"
    assert loss.resolve_impl("auto", "cuda:0") == "chunked"  # the loss's own dispatch agrees


def test_forcing_a_liger_that_does_not_import_is_one_error_line(plant):
    from ultrascale.config.compose import compose
    from ultrascale.levers.rules import validate

    plant(BROKEN)
    with pytest.raises(ConfigError) as e:
        validate(compose(["recipe=llama_1b_zero0", "train.loss_kernel=liger"]), 1, backend="nccl", gpu=H100)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("train.loss_kernel=liger cannot run: liger-kernel does not import"), msg
    assert "cannot import name 'libdevice'" in msg and msg.endswith("or use train.loss_kernel=auto"), msg
    with pytest.raises(ValueError, match=r"impl='liger' cannot run: liger-kernel does not import here: ImportError"):
        loss.resolve_impl("liger", "cuda:0")


def test_a_liger_whose_kernel_fails_its_trial_row_is_not_used(plant):
    """Imports, then fails at the kernel (as a Triton compile error would): the one-row trial on the device says
    so in one line. The trial runs where the GPU is this machine's (``GpuInfo.index``: ``detect``'s), and a
    planned cluster's GPU gets the import check only."""
    plant("", "def liger_fused_linear_cross_entropy(*a, **k):\n"
              "    raise RuntimeError('planted: PassManager::run failed\\n  long MLIR dump')\n")  # fmt: skip
    assert loss.kernel_unusable("liger") is None  # imports
    why = loss.kernel_unusable("liger", "cpu")  # the trial row (on the CPU here: the planted kernel is Python)
    assert why == "liger-kernel's kernel fails on cpu: RuntimeError: planted: PassManager::run failed", why


def test_a_working_liger_passes_its_trial_row(plant):
    plant("", "import torch.nn.functional as F\nCALLS = []\n"
              "def liger_fused_linear_cross_entropy(h, w, y, ignore_index=-100, reduction='mean'):\n"
              "    CALLS.append((tuple(h.shape), tuple(w.shape), y.tolist(), reduction))\n"
              "    return F.cross_entropy(h @ w.T, y, ignore_index=ignore_index, reduction=reduction)\n")  # fmt: skip
    assert loss.kernel_unusable("liger", "cpu") is None
    from liger_kernel.transformers.functional import CALLS as calls

    assert len(calls) == 1 and calls[0][0][0] == 1, calls  # one row, once: the verdict is cached
    assert loss.kernel_unusable("liger", "cpu") is None and len(calls) == 1


def test_the_trial_runs_on_this_ranks_gpu_only(monkeypatch):
    """``decide`` hands the loss module the device the GPU description was read from, or none."""
    from ultrascale.levers import decide as decide_mod

    asked = []
    monkeypatch.setattr(loss, "kernel_unusable", lambda impl, device=None: asked.append((impl, device)) or None)
    cfg, topo, hf = _llama_1b()
    from dataclasses import replace

    assert decide(cfg, topo, hf, "nccl", None, replace(H100, index=3)).loss_kernel.value == "liger"
    assert decide_mod.liger_unusable(H100) is None
    assert asked == [("liger", "cuda:3"), ("liger", None)]
    assert decide(_llama_1b("train.loss_kernel=chunked")[0], topo, hf, "nccl", None, H100).loss_kernel.value == (
        "chunked"
    )
    assert len(asked) == 2  # chunked asked for: liger is not even tried
