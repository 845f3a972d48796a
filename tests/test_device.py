"""Device placement, checked on a CPU box against a second device.

The first GPU run crashed at step 1: the trainer handed the engine the loader's CPU tensors. A run on two GPUs
would have crashed next on a collective built from Python floats (NCCL takes CUDA tensors only). Neither can
show on CPU, where CPU to CPU needs no move and gloo takes CPU tensors. These tests use TorchScript's ``lazy``
device as the stand-in: it runs on the CPU, holds real values, and refuses a CPU tensor beside its own exactly
as CUDA does, so a forgotten move raises here as it would on a GPU (tests/dist_scripts/device_guard.py has the
engine double and the planted-NCCL spy).
"""

from __future__ import annotations

import json
import re
import sys
from collections import namedtuple

import pytest
import torch

from tests.conftest import FAST, ROOT, check, launch
from ultrascale.data.loader import Batch
from ultrascale.errors import ConfigError
from ultrascale.runtime.device import coll_tensor, comm_device, resolve, to_device


@pytest.fixture(scope="module")
def lazy() -> torch.device:
    import torch._lazy
    import torch._lazy.ts_backend

    torch._lazy.ts_backend.init()
    return torch.device("lazy", 0)


def test_to_device_moves_every_tensor_of_a_batch_and_keeps_the_rest(lazy):
    b = Batch(torch.arange(6).reshape(2, 3), torch.ones(2, 3, dtype=torch.long), None)
    moved = to_device(b, lazy)
    assert isinstance(moved, Batch) and moved.position_ids is None
    assert moved.input_ids.device.type == moved.labels.device.type == "lazy"
    assert torch.equal(moved.input_ids.cpu(), b.input_ids)
    Pair = namedtuple("Pair", "a b")
    nested = to_device({"x": [torch.zeros(2), (torch.ones(1), 3)], "p": Pair(torch.ones(1), "s")}, lazy)
    assert nested["x"][0].device.type == nested["x"][1][0].device.type == nested["p"].a.device.type == "lazy"
    assert nested["x"][1][1] == 3 and isinstance(nested["p"], Pair) and nested["p"].b == "s"
    assert to_device(b, "cpu").input_ids is b.input_ids  # already there: no copy


def test_a_collective_tensor_follows_the_backend():
    assert comm_device() == torch.device("cpu")  # no process group: gloo's rules
    t = coll_tensor([1.0, 2.0], torch.float64)
    assert t.dtype == torch.float64 and t.device.type == "cpu" and t.tolist() == [1.0, 2.0]
    g = torch.ones(2, requires_grad=True) * 2
    assert not coll_tensor(g).requires_grad  # a value travels, not a graph


def test_the_runtime_takes_a_gpu_nodes_torch_and_says_which():
    from ultrascale.runtime.device import check_torch, runtime

    for ok in ("2.11.0+cu130", "2.13.0", "2.14.1", "3.0.0a0"):
        check_torch(ok)
    for old in ("2.10.1+cu128", "1.13.1"):
        with pytest.raises(ConfigError, match=rf"torch {re.escape(old)} is older than 2.11"):
            check_torch(old)
    assert runtime().startswith(f"torch {torch.__version__}")


def test_a_collective_under_nccl_is_built_on_the_current_cuda_device(monkeypatch):
    """comm_device's NCCL arm, which no other CPU test runs (the device guard plants comm_device itself): with
    ``get_backend`` planted as ``nccl`` and the current CUDA device as 3, a collective's tensors go to cuda:3,
    for the group asked about (a gloo group beside it stays on the CPU). The planted NCCL is strict: every
    collective raises, so comm_device cannot probe the group by communicating."""
    import torch.distributed as tdist

    from tests.dist_scripts.device_guard import refuse_unplanted

    nccl_group, gloo_group, asked = object(), object(), []

    def get_backend(group=None):
        asked.append(group)
        return "nccl" if group in (None, nccl_group) else "gloo"

    planted = {"is_available": lambda: True, "is_initialized": lambda: True, "get_backend": get_backend}
    for name, fn in (planted | refuse_unplanted(planted)).items():
        monkeypatch.setattr(tdist, name, fn)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert comm_device() == torch.device("cuda", 3)
    assert comm_device(nccl_group) == torch.device("cuda", 3)
    assert comm_device(gloo_group) == torch.device("cpu")
    assert asked == [None, nccl_group, gloo_group]
    with pytest.raises(AssertionError, match=r"planted NCCL: torch.distributed.all_to_all is not recorded"):
        tdist.all_to_all([], [])  # the strictness itself


def test_a_device_the_machine_lacks_is_one_line(monkeypatch):
    """``auto`` is this machine's answer: ``cuda:LOCAL_RANK`` where a GPU is usable (not under the tests'
    ``DS_ACCELERATOR=cpu``), the CPU otherwise; a CUDA device this machine lacks is one line."""
    import os

    usable = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR") != "cpu"
    local = int(os.environ.get("LOCAL_RANK", 0)) % max(torch.cuda.device_count(), 1)
    assert resolve("auto") == (torch.device("cuda", local) if usable else torch.device("cpu"))
    assert resolve("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="is not a torch device"):
        resolve("gpu0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU machine, planted on any machine
    with pytest.raises(ConfigError, match=r"device=cuda:1: this machine has no usable CUDA device"):
        resolve("cuda:1")


def test_auto_takes_this_ranks_gpu_where_one_is_usable(monkeypatch):
    """The CUDA arm of ``auto`` on a planted 2-GPU machine: rank LOCAL_RANK's GPU (wrapped onto the GPUs there
    are), the CPU under ``DS_ACCELERATOR=cpu`` or without CUDA; ``cuda:N`` checked against the count."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    for rank, want in (("0", 0), ("1", 1), ("3", 1)):
        monkeypatch.setenv("LOCAL_RANK", rank)
        assert resolve("auto") == resolve(None) == torch.device("cuda", want), rank
    assert resolve("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match=r"device=cuda:2: this machine has 2 CUDA device\(s\): use cuda:0...cuda:1"):
        resolve("cuda:2")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert resolve("auto") == torch.device("cpu")
    monkeypatch.delenv("DS_ACCELERATOR")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve("auto") == torch.device("cpu")


@pytest.mark.dist
def test_every_input_and_collective_reaches_the_engines_device(tiny_data, tmp_path):
    """The trainer's paths (train step, eval, pipeline inputs and judge, replica check, MoE statistics, perplexity
    and peak reductions) against an engine on a second device and a planted NCCL backend: every forward input is
    on the engine's device and every collective's tensor on the backend's. On the code before the fix, the batch
    reached the engine on the CPU and six collectives were built on the CPU."""
    out = tmp_path / "guard.json"
    args = [*FAST, f"data.path={tiny_data}", f"output_dir={tmp_path / 'run'}", "train.steps=2", "zero=stage1"]
    check(launch([str(out), *args], nproc=0, script=str(ROOT / "tests" / "dist_scripts" / "device_guard.py")))
    report = json.loads(out.read_text())
    assert not report["errors"], report["errors"]
    paths = report["paths"]
    for name in ("train_step", "eval", "pipe_inputs"):
        assert paths[name]["inputs"], f"{name}: the engine saw no input"
    for name, seen in paths.items():
        wrong = [r for r in seen["inputs"] + seen["collectives"] if r["device"] != "lazy"]
        assert not wrong, f"{name}: placed on the wrong device: {wrong}"
    for name in ("train_step", "eval", "pipeline_judge", "replica_check", "moe_stats", "perplexity_reduce",
                 "peak_reduce"):  # fmt: skip
        assert paths[name]["collectives"], f"{name}: no collective recorded (the planted NCCL did not see it)"


def test_perplexity_runs_where_the_model_is(lazy, tiny_data):
    """eval.py's perplexity on a model on the second device equals the CPU's (the batches follow the model)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ultrascale.eval.perplexity import perplexity

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    model = LlamaForCausalLM(cfg)
    on_cpu = perplexity(model, tiny_data, batch_size=4, max_samples=8, verify=False)
    on_lazy = perplexity(model.to(lazy), tiny_data, batch_size=4, max_samples=8, verify=False)
    assert on_lazy["tokens"] == on_cpu["tokens"]
    assert on_lazy["loss_per_token"] == pytest.approx(on_cpu["loss_per_token"], rel=1e-5)


def test_the_mechanism_scores_where_the_model_is(lazy):
    from transformers import LlamaConfig, LlamaForCausalLM

    from ultrascale.ssd.mechanism import position_stats

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))  # fmt: skip
    rows = [torch.randint(0, 64, (12,)) for _ in range(2)]
    ref = position_stats(model, rows)
    got = position_stats(model.to(lazy), rows)
    assert torch.allclose(got["entropy"].cpu(), ref["entropy"], atol=1e-5)


def test_loaders_of_eval_and_ssd_take_the_gpu_a_node_has():
    """eval.py, SSD sampling, scoring and the mechanism study load through one function whose default is the
    machine's GPU, and each exposes the choice (a CPU box: the CPU)."""
    import inspect

    from ultrascale.eval.config import EvalConfig
    from ultrascale.model.build import load_pretrained
    from ultrascale.ssd import compare, mechanism, sample
    from ultrascale.ssd.config import SSDConfig

    assert EvalConfig().device == "auto" and SSDConfig().device == "auto"
    assert inspect.signature(load_pretrained).parameters["device"].default == "auto"
    for module in (compare, mechanism, sample):
        src = inspect.getsource(module)
        assert "load_pretrained(" in src and "AutoModelForCausalLM.from_pretrained(" not in src, module.__name__


def test_eval_py_runs_on_the_device_it_is_given(lazy, tmp_path):
    """``python eval.py model_dir=... device=...``: the model and the perplexity batches on that device. Equal
    losses alone would pass a model left on the CPU (the batches follow the model), so a global forward hook
    records where every Linear of the forward ran."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import write_byte_dataset
    from tests.test_eval import make_tokenizer
    from ultrascale.config.compose import compose, typed
    from ultrascale.eval.config import register_eval_configs
    from ultrascale.eval.run import run

    data = write_byte_dataset(tmp_path / "data", seq_len=32, max_files=2)
    torch.manual_seed(0)
    model_dir = tmp_path / "model"
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(model_dir)  # fmt: skip
    make_tokenizer(model_dir, vocab=257)  # the byte data's vocabulary size (eval checks the data's against it)
    register_eval_configs()
    over = [f"model_dir={model_dir}", "tasks=[perplexity]", f"perplexity.data_path={data}", "wandb=false",
            "perplexity.max_samples=4", f"output_dir={tmp_path / 'eval'}"]  # fmt: skip
    ran_on: list[str] = []

    def where(module, args, output):  # every Linear's output: where its matmul ran
        if isinstance(module, torch.nn.Linear):
            ran_on.append(output.device.type)

    hook = torch.nn.modules.module.register_module_forward_hook(where)
    try:
        on_lazy = run(typed(compose([*over, "device=lazy"], "eval")))["tasks"]["perplexity"]
        lazy_ran, ran_on[:] = ran_on[:], []
        on_cpu = run(typed(compose([*over, "device=cpu"], "eval")))["tasks"]["perplexity"]
    finally:
        hook.remove()
    assert lazy_ran and set(lazy_ran) == {"lazy"}, f"device=lazy: the forward ran on {sorted(set(lazy_ran))}"
    assert ran_on and set(ran_on) == {"cpu"}
    assert on_lazy["loss_per_token"] == pytest.approx(on_cpu["loss_per_token"], rel=1e-5)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
