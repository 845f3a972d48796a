"""A real 1-rank run checked for device placement against a second device (run by tests/test_device.py).

Usage: python tests/dist_scripts/device_guard.py OUT OVERRIDES...

Why: CPU to CPU needs no move and gloo takes CPU tensors, so on a CPU box a missing ``.to(device)`` or a
collective built from Python floats passes every test and crashes the first GPU run. This script builds the run
as train.py does (compose, validate, decide, preflight, a real DeepSpeed engine, the trainer's setup), then
checks it against ``lazy``: TorchScript's lazy-tensor device, which runs on the CPU, holds real values, and
refuses a CPU tensor beside its own exactly as CUDA does. Two doubles stand in for the GPU:

- **the engine double** declares ``lazy`` as its device and records the device of every tensor handed to its
  forward, then runs the real engine on the same values (the CPU's copy);
- **planted NCCL**: ``torch.distributed`` reports backend ``nccl`` and world 2, ``ultrascale.runtime.device.comm_device``
  answers ``lazy`` (the stand-in for ``cuda:LOCAL_RANK``), and every collective records its tensors' devices and
  acts as two identical ranks would (a sum doubles, a min/max/broadcast keeps, a gather repeats); any other
  collective raises (:func:`refuse_unplanted`), so none can slip past the record on the real gloo group.

The real engine's own calls (backward, step, timers) run with the real process group. Writes OUT (JSON): every
forward input's and collective tensor's device, per path, and the paths that raised.
"""

from __future__ import annotations

import contextlib
import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch
import torch._lazy
import torch._lazy.ts_backend
import torch.distributed as tdist

LAZY = torch.device("lazy", 0)
COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_coalesced",
               "all_gather_object", "_all_gather_base", "reduce", "reduce_scatter", "reduce_scatter_tensor",
               "_reduce_scatter_base", "broadcast", "broadcast_object_list", "gather", "gather_object", "scatter",
               "scatter_object_list", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
               "send_object_list", "recv_object_list", "batch_isend_irecv", "barrier", "monitored_barrier")  # fmt: skip
"""Every collective of ``torch.distributed``: a planted NCCL answers for all of them (see :func:`refuse_unplanted`)."""


def refuse_unplanted(planted: dict, seen: Callable[[str], None] | None = None) -> dict:
    """A raising stand-in for every collective ``planted`` does not plant (``seen`` is told its name first, so
    a caller that swallows the error is still caught). Without it, a collective the spy does not record would
    run on the real (gloo, CPU) process group and pass with a CPU tensor, the very mistake the spy is there to
    catch."""

    def refuse(name: str):
        def raise_(*args, **kwargs):
            if seen is not None:
                seen(name)
            raise AssertionError(f"planted NCCL: torch.distributed.{name} is not recorded: plant it in "
                                 "tests/dist_scripts/device_guard.py (PlantedNccl.install)")  # fmt: skip

        return raise_

    return {n: refuse(n) for n in COLLECTIVES if n not in planted and hasattr(tdist, n)}


class PlantedNccl:
    """``torch.distributed`` as a 2-rank NCCL job sees it, recording the device of every collective's tensor."""

    def __init__(self, record: list) -> None:
        self.record, self.active, self.saved = record, False, {}

    def _tensors(self, name: str, args) -> None:
        for a in args:
            for t in a if isinstance(a, list) else [a]:
                if isinstance(t, torch.Tensor):
                    self.record.append({"op": name, "device": t.device.type})

    def install(self) -> None:
        import ultrascale.runtime.device as device

        def all_reduce(t, op=None, group=None, async_op=False):
            self._tensors("all_reduce", [t])
            if op in (None, tdist.ReduceOp.SUM):
                t.mul_(2)
            return SimpleNamespace(wait=lambda: None) if async_op else None

        def all_gather(rows, t, group=None, async_op=False):
            self._tensors("all_gather", [rows, t])
            for r in rows:
                r.copy_(t)

        def broadcast(t, src=0, group=None, async_op=False):
            self._tensors("broadcast", [t])

        def all_gather_object(out, obj, group=None):  # torch moves the pickles itself (current device)
            for i in range(len(out)):
                out[i] = obj

        planted = {"all_reduce": all_reduce, "all_gather": all_gather, "broadcast": broadcast,
                   "all_gather_object": all_gather_object, "get_world_size": lambda group=None: 2,
                   "get_backend": lambda group=None: "nccl", "get_rank": lambda group=None: 0,
                   "is_initialized": lambda: True, "barrier": lambda *a, **k: None,
                   "get_process_group_ranks": lambda group: [0, 1]}  # fmt: skip
        unplanted = lambda name: self.record.append({"op": name, "device": "not recorded"})  # noqa: E731
        planted |= refuse_unplanted(planted, unplanted)  # strict: a collective it does not record fails its path
        self.saved = {k: getattr(tdist, k) for k in planted} | {"comm_device": device.comm_device}
        self.planted = planted | {"comm_device": lambda group=None: LAZY}
        self.on()

    def _set(self, table: dict) -> None:
        import ultrascale.runtime.device as device

        for k, v in table.items():
            setattr(device if k == "comm_device" else tdist, k, v)

    def on(self) -> None:
        self._set(self.planted)

    @contextlib.contextmanager
    def real(self):
        """The real process group, for the engine's own work (it is the black box under test's neighbour)."""
        self._set(self.saved)
        try:
            yield
        finally:
            self.on()

    def uninstall(self) -> None:
        self._set(self.saved)


class LazyEngine:
    """A DeepSpeed engine double on a second device: records where every forward input is, then runs the real
    engine on the CPU copy of the same values."""

    def __init__(self, real, nccl: PlantedNccl, record: list) -> None:
        self._real, self._nccl, self._record = real, nccl, record
        self.device = LAZY

    def __call__(self, *args, **kwargs):
        cpu = {}
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                self._record.append({"input": k, "device": v.device.type})
                v = v.cpu()
            cpu[k] = v
        for a in args:
            if isinstance(a, torch.Tensor):
                self._record.append({"input": "positional", "device": a.device.type})
        with self._nccl.real():
            return self._real(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args], **cpu)

    def backward(self, loss, *a, **k):
        with self._nccl.real():
            return self._real.backward(loss, *a, **k)

    def step(self, *a, **k):
        with self._nccl.real():
            return self._real.step(*a, **k)

    def __getattr__(self, name):
        return getattr(self._real, name)


def main() -> None:
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    torch._lazy.ts_backend.init()
    from ultrascale.config.compose import compose, typed
    from ultrascale.config.convert import plain
    from ultrascale.levers.rules import validate
    from ultrascale.runtime import dist
    from ultrascale.train.preflight import preflight
    from ultrascale.train.run import prepare_run_dir
    from ultrascale.train.step import StepState
    from ultrascale.train.trainer import Trainer

    cfg = typed(compose(overrides))
    d = validate(cfg, 1)
    found = preflight(cfg, d)
    dist.init_distributed()
    run_dir = Path(cfg.output_dir)
    trainer = Trainer(cfg, d, run_dir, plain(cfg), found)
    prepare_run_dir(cfg, run_dir, trainer.ds_config)
    trainer.setup()

    report: dict = {"paths": {}, "errors": {}}
    nccl = PlantedNccl([])
    real_engine = trainer.engine
    trainer.engine = LazyEngine(real_engine, nccl, [])

    def path(name: str, fn) -> None:
        """Run one code path with fresh records; keep what its inputs and collectives were placed on."""
        inputs, colls = [], []
        trainer.engine._record, nccl.record = inputs, colls
        try:
            fn()
        except Exception as e:  # a device mismatch raises: that is a finding, not a crash of the probe
            report["errors"][name] = f"{type(e).__name__}: {e}"[:400]
            traceback.print_exc()
        report["paths"][name] = {"inputs": inputs, "collectives": colls}

    nccl.install()
    try:
        path("train_step", lambda: trainer.train_step(0))
        path("eval", lambda: trainer.evaluator.run(1))
        path("pipe_inputs", lambda: _pipe_inputs(trainer, report))
        path("pipeline_judge", lambda: _pipeline_judge(trainer, StepState))
        path("replica_check", lambda: _replicas(trainer))
        path("moe_stats", _moe_stats)
        path("perplexity_reduce", _perplexity_reduce)
        path("peak_reduce", _peak_reduce)
    finally:
        nccl.uninstall()
        trainer.engine = real_engine
    out.write_text(json.dumps(report, indent=1))
    trainer.close()
    dist.shutdown()


def _pipe_inputs(trainer, report: dict) -> None:
    batch = trainer.batches.get(0, 0)
    inputs, labels = trainer.pipe_inputs(batch)
    for t in (*(inputs if isinstance(inputs, tuple) else (inputs,)), labels):
        trainer.engine._record.append({"input": "pipe", "device": t.device.type})


def _pipeline_judge(trainer, step_state) -> None:
    """The pipeline's judge (last stages hold the loss), its all-reduce under planted NCCL."""
    real = trainer.engine._real
    trainer.engine.__dict__.update(is_last_stage=lambda: True, total_loss=torch.tensor(2.0))
    try:
        trainer.stepper.judge_pipeline(step_state(0, None))
    finally:
        for k in ("is_last_stage", "total_loss"):
            trainer.engine.__dict__.pop(k)
    assert trainer.engine._real is real


def _replicas(trainer) -> None:
    from ultrascale.train.consistency import replicas_agree

    replicas_agree(trainer.engine.module, None)


def _moe_stats() -> None:
    """Routing statistics of a forward that ran on the device: accumulated there, reduced on the comm device."""
    from ultrascale.model.moe import MoEStats

    model = SimpleNamespace(config=SimpleNamespace(num_local_experts=4, num_experts_per_tok=2, model_type="mixtral"))
    stats = MoEStats(model, SimpleNamespace(top_k=2, aux_loss_coef=0.01, capacity_factor=1.25))
    logits = tuple(torch.randn(16, 4).to(LAZY) for _ in range(2))
    out = SimpleNamespace(loss=torch.tensor(3.0).to(LAZY), aux_loss=torch.tensor(1.5).to(LAZY), router_logits=logits)
    stats.observe(out)
    stats.flush()


def _perplexity_reduce() -> None:
    from ultrascale.eval.perplexity import reduce_across_ranks

    reduce_across_ranks({"loss_sum": 10.0, "tokens": 5, "samples": 1})


def _peak_reduce() -> None:
    from ultrascale.runtime.peak import _all_ranks

    _all_ranks(1.0, "min")


if __name__ == "__main__":
    main()
