"""A training step whose row is not logged reads nothing off the device but what the protocol needs (issue 46, part 3).

A GPU step is far shorter than a CPU step of the same job, so a device-to-host read the host waits for (``.item()``,
``float(t)``, ``.tolist()``, ``.cpu()``) costs a GPU run much more than this box shows. Two reads a step are the
protocol's and stay: the step's all-reduced loss, which the stability verdict judges before the update, and the
one copy of the all-gathered agreement (verdict, stop request, written checkpoint) every rank adopts. Everything
else (the gradient norm, the memory peak, MoE routing counts, timer events) is read only for a logged row.

CUDA does not run here, so the reads are counted where every kind of tensor goes through: ``torch.Tensor``'s
read methods and torch's functions that answer on the host, patched while ``train.py`` runs on 2 real CPU ranks,
counted when ultrascale's own code (the trainer and its helpers, not DeepSpeed or torch) calls them, per optimizer
step. A read hides in more than a named method: ``f"{loss:.4f}"`` is ``Tensor.__format__``, ``str(t)`` is
``__repr__``, ``np.asarray(t)`` is ``__array__``, ``torch.equal`` a bool, ``t.to("cpu")`` a copy; each is counted
(:func:`test_the_counter_sees_every_form_of_host_read`).
"""

from __future__ import annotations

import json
import runpy
import sys
import sysconfig
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

STEPS, LOG_INTERVAL = 6, 3
READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__", "__complex__",
         "__format__", "__repr__", "__array__", "__contains__", "equal", "allclose", "is_nonzero")  # fmt: skip
"""Every ``torch.Tensor`` method that hands a value to the host (on a GPU, a wait for the device). ``str(t)`` and
``print(t)`` reach ``__repr__`` (a tensor has no ``__str__``), ``np.asarray(t)`` and ``np.array(t)``
``__array__``, ``x in t`` ``__contains__``; ``Tensor.to`` is a read only to the host (:func:`_to_host`)."""
FUNCTIONS = ("equal", "allclose", "is_nonzero")
"""``torch``'s functions that answer a question about a tensor's values with a Python bool: a read like ``item``."""
STDLIB = Path(sysconfig.get_paths()["stdlib"]).resolve()
"""The standard library (not its ``site-packages``, where torch and DeepSpeed live outside a virtualenv)."""
PROTOCOL = {"ultrascale/train/step.py:wait __float__", "ultrascale/train/stability.py:agree tolist"}
"""The reads every step makes: the loss the verdict judges, and the agreement every rank adopts."""
HOST_SIDE = ("ultrascale/data/",)
"""The loader's tensors are host tensors by construction (built before ``to_device``): never a device read."""


@pytest.mark.dist
def test_an_unlogged_step_reads_only_the_loss_and_the_agreement(tiny_data, tmp_path):
    from tests.conftest import FAST, check, launch, metrics  # here: this file is also the torchrun worker's script

    out = tmp_path / "run"
    args = [*FAST, f"data.path={tiny_data}", f"output_dir={out}", f"train.steps={STEPS}",
            f"train.log_interval={LOG_INTERVAL}"]  # fmt: skip
    check(launch(["--worker", str(tmp_path), *args], script="tests/test_step_syncs.py", timeout=300))
    logged = {r["step"] for r in metrics(out) if "event" not in r and "loss" in r}
    assert logged == {3, 6}, logged
    for rank in (0, 1):
        reads = {int(k): Counter(v) for k, v in json.loads((tmp_path / f"reads.rank{rank}.json").read_text()).items()}
        assert sorted(reads) == list(range(1, STEPS + 1)), reads
        for step, sites in reads.items():
            if step in logged:  # a logged row reads its figures (the gradient norm at least)
                assert len(sites) > len(PROTOCOL), (rank, step, sites)
            else:
                assert sites == Counter(PROTOCOL), (rank, step, sites)


def _to_host(t, args: tuple, kwargs: dict) -> bool:
    """Whether ``t.to(*args, **kwargs)`` copies to the host: its target is the CPU, and either ``t`` sits on an
    accelerator or the call names the CPU as a string. On this box every tensor is on the CPU and so is the run's
    device, so ``t.to(self.device)`` or ``t.to(other.device)`` (a ``torch.device`` equal to the CPU) is a move to
    where the run computes, not a read; only ``"cpu"`` spelt out names the host whatever the run's device is."""
    import torch

    target = kwargs.get("device", args[0] if args else None)  # a device, a tensor to match, or a dtype
    if isinstance(target, torch.Tensor):
        target = target.device
    if isinstance(target, str):
        return torch.device(target).type == "cpu"
    return isinstance(target, torch.device) and target.type == "cpu" and t.device.type != "cpu"


def count_reads(root: Path, record: Callable[[str], None]) -> Callable[[], None]:
    """Patch every host read (:data:`READS`, :data:`FUNCTIONS`, ``Tensor.to`` to the host) so that one made by
    code under ``root`` calls ``record("path/under/root.py:function name")``; returns the undo.

    The reader is the first frame above the patch that is not code reading on its caller's behalf: the standard
    library (``logging`` formatting a ``%s`` argument) and numpy (converting one). A read made inside torch
    (``Tensor.__format__`` calling ``item``) is torch's, so a format counts once, as a format; torch's and
    DeepSpeed's own reads are theirs."""
    import functools

    import numpy
    import torch

    root, numpy_dir = root.resolve(), Path(numpy.__file__).resolve().parent

    @functools.cache
    def where(filename: str) -> Path | None:
        """The file a frame runs, or None for code that reads for its caller (and frozen ``<...>`` modules)."""
        path = Path(filename).resolve()
        stdlib = path.is_relative_to(STDLIB) and not {"site-packages", "dist-packages"} & set(path.parts)
        return None if filename.startswith("<") or stdlib or path.is_relative_to(numpy_dir) else path

    def note(name: str) -> None:
        frame = sys._getframe(2)  # note <- the patched read <- its caller
        while frame is not None and where(frame.f_code.co_filename) is None:
            frame = frame.f_back
        path = frame and where(frame.f_code.co_filename)
        if path and path.is_relative_to(root):
            record(f"{path.relative_to(root.parent).as_posix()}:{frame.f_code.co_name} {name}")

    def counting(original: Callable, name: str, when: Callable[..., bool] | None = None) -> Callable:
        def read(*args, **kwargs):
            out = original(*args, **kwargs)  # first: a refused call is no read (numpy retries ``__array__``)
            if when is None or when(args[0], args[1:], kwargs):
                note(name)
            return out

        return read

    undo = []
    for owner, names in ((torch.Tensor, READS), (torch, FUNCTIONS)):
        for name in names:
            undo.append((owner, name, owner.__dict__.get(name) if owner is torch.Tensor else getattr(owner, name)))
            setattr(owner, name, counting(getattr(owner, name), name))
    undo.append((torch.Tensor, "to", torch.Tensor.__dict__.get("to")))
    torch.Tensor.to = counting(torch.Tensor.to, "to", _to_host)

    def restore() -> None:
        for owner, name, original in reversed(undo):
            if original is None:
                delattr(owner, name)  # inherited from torch._C.TensorBase: the base's method shows again
            else:
                setattr(owner, name, original)

    return restore


def test_the_counter_sees_every_form_of_host_read(tmp_path):
    """Each way code reads a tensor on the host, called from a planted module, is one read; moves that are not
    reads (a dtype, the run's device) and reads torch makes inside another (``__format__`` calling ``item``) are
    none."""
    import io
    import logging

    import torch

    forms = [
        ("__format__", "f'{t:.4f}'"),
        ("__format__", "'{}'.format(t)"),
        ("__repr__", "str(t)"),
        ("__repr__", "logging.getLogger('planted').warning('loss %s', t)"),  # formatted by logging, for us
        ("to", "t.to('cpu')"),
        ("to", "t.to(device='cpu', copy=True)"),
        ("to", "t.to('cpu', torch.float64, False, True)"),
        ("equal", "torch.equal(t, u)"),
        ("equal", "t.equal(u)"),
        ("allclose", "torch.allclose(t, u)"),
        ("__array__", "np.asarray(t)"),
        ("__array__", "np.array(t, dtype=np.float64)"),
        ("__contains__", "1.0 in u"),
        ("__bool__", "bool(t > 0)"),
        ("__float__", "math.isfinite(t)"),
        ("item", "t.item()"),
        ("tolist", "u.tolist()"),
    ]
    moves = ["t.to(torch.float64)", "t.to(torch.float64, True, True)", "t.to(u.device)", "t.to(u, non_blocking=True)",
             "t.to(memory_format=torch.contiguous_format)", "f'{1.5:.4f}'", "t.detach() + 1"]  # fmt: skip
    site = tmp_path / "planted" / "site.py"
    site.parent.mkdir()
    lines = [f"def read_{i}(t, u):\n    {code}\n" for i, (_, code) in enumerate(forms)]
    site.write_text("import logging, math, numpy as np, torch\n" + "".join(lines) + f"def moves(t, u):\n    {moves}\n")
    planted: dict = {}
    exec(compile(site.read_text(), str(site), "exec"), planted)  # its frames' file is under tmp_path/planted
    t, u = torch.tensor(1.5), torch.tensor([1.5, 2.0])
    log = logging.getLogger("planted")
    log.propagate, handler = False, logging.StreamHandler(io.StringIO())  # one handler formats (pytest's would too)
    log.addHandler(handler)
    originals = (torch.equal, torch.Tensor.__format__, torch.Tensor.to, torch.Tensor.item)
    seen: list[str] = []
    restore = count_reads(site.parent, seen.append)
    try:
        for i, (name, code) in enumerate(forms):
            seen.clear()
            planted[f"read_{i}"](t, u)
            assert seen == [f"planted/site.py:read_{i} {name}"], (code, seen)
        seen.clear()
        planted["moves"](t, u)
        assert seen == [], seen
    finally:
        restore()
        log.removeHandler(handler)
        log.propagate = True
    assert (torch.equal, torch.Tensor.__format__, torch.Tensor.to, torch.Tensor.item) == originals
    assert "item" not in torch.Tensor.__dict__  # the base class's method again, not a copy of it


def _worker(where: Path, overrides: list[str]) -> None:
    """One rank: ``train.py`` as torchrun started it, with the host reads counted per optimizer step."""
    import ultrascale
    from ultrascale.train.trainer import Trainer

    step, reads = [0], {}

    def record(site: str) -> None:
        if step[0] and not site.startswith(HOST_SIDE):
            reads.setdefault(step[0], []).append(site)

    count_reads(Path(ultrascale.__file__).parent, record)
    train_step = Trainer.train_step

    def numbered(self, s: int):
        step[0] = s + 1  # as logged; the reads after train_step (recording, commits) count for the same step
        return train_step(self, s)

    Trainer.train_step = numbered
    sys.argv = ["train.py", *overrides]
    try:
        runpy.run_path("train.py", run_name="__main__")
    except SystemExit as e:
        if e.code:
            raise
    rank = int(__import__("os").environ["RANK"])
    (where / f"reads.rank{rank}.json").write_text(json.dumps(reads))


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(Path(sys.argv[2]), sys.argv[3:])
