"""liger-kernel is chosen for what it does here, not for being found (issue 46, 1.3): a liger-kernel built against
another Triton is found by ``find_spec`` and then fails at its import or its first launch, which was step 1 of the
run. Planted ``liger_kernel`` packages on ``sys.path`` stand in for the real one (a CPU cannot run its Triton
kernels); everything else (the decisions, validation, the loss's dispatch) is the real code. The trial row's CUDA
side (the rank's device context, the dtype, the synchronize) runs against a planted strict ``torch.cuda``."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

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


# ---- the trial row on a CUDA device, against a strict planted torch.cuda -------------------------------------------
ILLEGAL = "CUDA error: an illegal memory access was encountered"


class StrictCuda:
    """``torch.cuda`` of a node whose rank holds GPU 3 while GPU 0 is current, as at a rank's start. It records
    each call with the device current at that moment; the planted kernel launches on the current device, as Triton
    does (a tensor of another GPU is an error there), and a failure it plants stays pending on the stream until a
    ``synchronize``, as an illegal memory access does: the launch itself returns."""

    def __init__(self, bf16: bool, fail_async: bool = False) -> None:
        self.bf16, self.fail_async = bf16, fail_async
        self.current, self.pending = 0, None
        self.calls: list[tuple] = []

    @contextlib.contextmanager
    def device(self, device):
        index = torch.device(device).index
        before, self.current = self.current, index
        self.calls.append(("enter", index))
        try:
            yield
        finally:
            self.current = before
            self.calls.append(("exit", index))

    def is_bf16_supported(self, including_emulation: bool = True) -> bool:
        self.calls.append(("is_bf16_supported", self.current))
        return self.bf16

    def synchronize(self, device=None) -> None:
        index = self.current if device is None else torch.device(device).index
        self.calls.append(("synchronize", index))
        if self.pending is not None:
            error, self.pending = self.pending, None
            raise RuntimeError(error)

    def launch(self, name: str, *tensors: torch.Tensor) -> None:
        """One kernel launch on the current device: its tensors must live there."""
        devices = {t.planted_device for t in tensors}
        self.calls.append((name, self.current, *sorted(str(d) for d in devices), *{str(t.dtype) for t in tensors}))
        if devices != {torch.device("cuda", self.current)}:
            raise ValueError(f"Pointer argument cannot be accessed from Triton: tensors on {devices}, "
                             f"launch on cuda:{self.current}")  # fmt: skip
        if name == "backward" and self.fail_async:
            self.pending = ILLEGAL


class CudaTorch:
    """``torch`` as ``ultrascale.model.loss`` sees it on that node: ``torch.cuda`` is the strict fake, and a tensor
    made on a CUDA device is a host tensor marked with that device (what the kernel checks)."""

    def __init__(self, cuda: StrictCuda) -> None:
        self.cuda = cuda

    def __getattr__(self, name: str):
        return getattr(torch, name)

    def _on(self, t: torch.Tensor, device, requires_grad: bool = False) -> torch.Tensor:
        t.planted_device = torch.device(device)
        return t.requires_grad_(requires_grad)

    def randn(self, *shape, device=None, dtype=None, requires_grad=False) -> torch.Tensor:
        return self._on(torch.randn(*shape, dtype=dtype), device, requires_grad)

    def tensor(self, data, device=None, dtype=None) -> torch.Tensor:
        return self._on(torch.tensor(data, dtype=dtype), device)


class _PlantedKernel(torch.autograd.Function):
    """liger's fused linear cross-entropy as two launches (forward, backward) on the strict fake."""

    @staticmethod
    def forward(ctx, cuda, hidden, weight, labels):
        cuda.launch("forward", hidden, weight, labels)
        ctx.cuda, ctx.device = cuda, hidden.planted_device
        ctx.save_for_backward(hidden, weight, labels)
        return F.cross_entropy(hidden.float() @ weight.float().T, labels)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, labels = ctx.saved_tensors
        for t in (hidden, weight, labels):
            t.planted_device = ctx.device
        ctx.cuda.launch("backward", hidden, weight, labels)
        return None, torch.zeros_like(hidden), torch.zeros_like(weight), None


@pytest.fixture
def on_gpu3(plant, monkeypatch):
    """``cuda(bf16, fail_async)``: the strict fake installed as ``loss``'s ``torch.cuda`` and a planted liger whose
    kernel launches on it."""
    plant("", "KERNEL = []\ndef liger_fused_linear_cross_entropy(h, w, y, ignore_index=-100, reduction='mean'):\n"
              "    return KERNEL[0](h, w, y)\n")  # fmt: skip

    def make(bf16: bool = True, fail_async: bool = False) -> StrictCuda:
        from liger_kernel.transformers import functional

        cuda = StrictCuda(bf16, fail_async)
        monkeypatch.setattr(loss, "torch", CudaTorch(cuda))
        functional.KERNEL[:] = [lambda h, w, y: _PlantedKernel.apply(cuda, h, w, y)]
        return cuda

    return make


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16_gpu", "fp32_gpu"])
def test_the_trial_row_runs_in_the_ranks_device_context_in_its_dtype_and_synchronizes(on_gpu3, bf16):
    """The rank's GPU (cuda:3), not GPU 0 that is current at start: the bf16 question is asked of it, its forward
    and backward launch there with every tensor there, in bf16 where it has bf16 (fp32 where not), then its stream
    is synchronized, and GPU 0 is current again afterwards."""
    cuda = on_gpu3(bf16=bf16)
    assert loss.kernel_unusable("liger", "cuda:3") is None, cuda.calls
    dtype = "torch.bfloat16" if bf16 else "torch.float32"
    # the labels are int64 wherever the row runs: the kernel's dtypes are {hidden/weight's, int64}
    launches = [c for c in cuda.calls if c[0] in ("forward", "backward")]
    assert [(c[0], c[1], c[2]) for c in launches] == [("forward", 3, "cuda:3"), ("backward", 3, "cuda:3")], cuda.calls
    assert all(set(c[3:]) == {dtype, "torch.int64"} for c in launches), launches
    assert ("is_bf16_supported", 3) in cuda.calls and ("is_bf16_supported", 0) not in cuda.calls, cuda.calls
    order = [c[0] for c in cuda.calls if c[0] != "is_bf16_supported"]
    assert order == ["enter", "forward", "backward", "synchronize", "exit"], cuda.calls
    assert ("synchronize", 3) in cuda.calls and cuda.current == 0


def test_a_kernel_failing_after_its_launch_is_caught_at_the_synchronize(on_gpu3):
    """An asynchronous failure (an illegal access in the backward kernel) returns from the launch and surfaces only
    at the stream's synchronize: without it the row would pass and the run would die at step 1."""
    cuda = on_gpu3(fail_async=True)
    why = loss.kernel_unusable("liger", "cuda:3")
    assert why == f"liger-kernel's kernel fails on cuda:3: RuntimeError: {ILLEGAL}", (why, cuda.calls)
    assert loss.resolve_impl("auto", "cuda:3") == "chunked"  # the verdict is kept: auto takes the chunked loss
