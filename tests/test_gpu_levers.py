"""The GPU levers as pure functions of a planted GPU description (no GPU here): which card it is, the peak MFU
divides by, the fused loss's kernel and chunk, activation checkpointing from the planner's predicted memory, the
banner's GPU line; selective checkpointing itself on real models (the memory it keeps, the losses on 2 ranks);
and the ``mem_gb`` column's per-interval peak."""

from __future__ import annotations

import json
import sys
import weakref
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import check, launch
from ultrascale.config.recompute import checkpointing_mode
from ultrascale.errors import ConfigError
from ultrascale.levers.decide import decide
from ultrascale.levers.hardware import auto_checkpointing, gpu_loss_chunk
from ultrascale.runtime.gpu import GpuInfo, identify
from ultrascale.runtime.peak import gpu_peak, matmul_dtype

GIB = 2**30
MIB = 2**20


def planted(name: str, mib: int, capability: tuple[int, int], sms: int, count: int = 8) -> GpuInfo:
    """A GPU as torch describes it: the total nvidia-smi prints, half a GiB of it taken by the CUDA context."""
    return GpuInfo(name, mib * MIB, capability, count, mib * MIB - GIB // 2, sms)


H100 = planted("NVIDIA H100 80GB HBM3", 81559, (9, 0), 132)
H100_PCIE = planted("NVIDIA H100 PCIe", 81559, (9, 0), 114, 1)
H200 = planted("NVIDIA H200", 143771, (9, 0), 132)
A100 = planted("NVIDIA A100-SXM4-80GB", 81920, (8, 0), 108)
A100_40 = planted("NVIDIA A100-SXM4-40GB", 40960, (8, 0), 108)
L4 = planted("NVIDIA L4", 23034, (8, 9), 58, 1)
RTX4090 = planted("NVIDIA GeForce RTX 4090", 24564, (8, 9), 128, 1)
A10G = planted("NVIDIA A10G", 23028, (8, 6), 80, 1)


@pytest.mark.parametrize(
    "name, mib, sms, card",
    [
        ("NVIDIA H100 80GB HBM3", 81559, 132, "H100 SXM5 80GB"),
        ("NVIDIA H100 PCIe", 81559, 114, "H100 PCIe 80GB"),
        ("NVIDIA H100", 81559, 114, "H100 PCIe 80GB"),  # a bare name: the SMs tell
        ("NVIDIA H100", 81559, 132, "H100 SXM5 80GB"),  # 132 SMs and 80 GB: not the 94 GB NVL
        ("NVIDIA H100 NVL", 95830, 132, "H100 NVL 94GB"),
        ("NVIDIA H200", 143771, 132, "H200 SXM 141GB"),
        ("NVIDIA A100-SXM4-80GB", 81920, 108, "A100 SXM4 80GB"),
        ("NVIDIA A100-SXM4-40GB", 40960, 108, "A100 SXM4 40GB"),
        ("NVIDIA A100-PCIE-40GB", 40960, 108, "A100 PCIe 40GB"),
        ("NVIDIA L40S", 46068, 142, "L40S 48GB"),
        ("NVIDIA L4", 23034, 58, "L4 24GB"),
        ("NVIDIA GeForce RTX 4090", 24564, 128, "RTX 4090 24GB"),
        ("NVIDIA A10G", 23028, 80, None),  # AWS publishes no tensor-core rate for it
        ("NVIDIA GeForce RTX 4090 D", 24564, 114, None),  # 114 SMs: not the 4090 the name starts with
        ("NVIDIA H100", 0, 0, None),  # SXM5, PCIe or NVL, and nothing else to tell
        ("Some Future GPU", 81920, 200, None),
    ],
)
def test_the_card_is_told_by_name_sms_and_memory_or_said_unknown(name, mib, sms, card):
    got = identify(name, mib * MIB, sms)
    assert (got.card.name if got.card else None) == card, got.why
    assert got.why


@pytest.mark.parametrize(
    "gpu, dtype, tflops",
    [
        (H100, torch.bfloat16, 989.4),
        (H100_PCIE, torch.bfloat16, 756.5),  # not the SXM5's 989 that a substring match on "H100" gave
        (planted("NVIDIA H100", 81559, (9, 0), 114), torch.bfloat16, 756.5),
        (H100, torch.float16, 989.4),
        (H100, torch.float32, 66.9),  # fp32 weights without TF32 divide by the fp32 figure, not bf16's
        (H200, torch.bfloat16, 989.5),
        (A100, torch.bfloat16, 312.0),
        (A100, torch.float32, 19.5),
        (L4, torch.bfloat16, 121.0),
        (RTX4090, torch.bfloat16, 165.2),
        (A10G, torch.bfloat16, 0.0),
        (planted("Tesla V100-SXM2-32GB", 32510, (7, 0), 80), torch.bfloat16, 0.0),  # Volta: no bf16 tensor cores
    ],
)
def test_the_peak_follows_the_card_and_the_matmul_dtype(gpu, dtype, tflops):
    flops, src = gpu_peak(gpu, matmul_dtype(dtype, tf32=False))
    assert flops == pytest.approx(tflops * 1e12)
    assert ("MFU not reported" in src) == (tflops == 0.0), src
    if tflops:
        assert "datasheet" in src and matmul_dtype(dtype, False) in src


def test_tf32_and_a_mig_slice_take_their_own_figures():
    assert matmul_dtype(torch.float32, tf32=True) == "tf32" and matmul_dtype(torch.float32, tf32=False) == "fp32"
    assert gpu_peak(H100, "tf32")[0] == pytest.approx(494.7e12)
    mig = planted("NVIDIA H100 80GB HBM3 MIG 3g.40gb", 40192, (9, 0), 60, 1)
    flops, src = gpu_peak(mig, "bf16")
    assert flops == pytest.approx(989.4e12 * 60 / 132) and "MIG slice of H100 SXM5 80GB" in src


def test_a_planned_cluster_gets_the_cards_capability_and_its_own_memory():
    node = SimpleNamespace(gpu_memory_gib=141.0, reserved_gib=1.5, gpus_per_node=8)
    gpu = GpuInfo.from_cluster(node, "H200 SXM 141GB")
    assert (gpu.capability, gpu.sm_count, gpu.count) == ((9, 0), 132, 8)
    assert gpu.memory_bytes == 141 * GIB and gpu.free_bytes == int(139.5 * GIB)
    assert gpu.identified().card.name == "H200 SXM 141GB"
    assert GpuInfo.from_cluster(node, "NVIDIA H100 80GB HBM3").capability == (9, 0)  # a torch-style name too
    with pytest.raises(ValueError, match=r"unknown GPU card 'B9000'.*H100 SXM5 80GB"):
        GpuInfo.from_cluster(node, "B9000")
    assert "H200 SXM 141GB" in gpu.describe() and "sm_90" in gpu.describe()


@pytest.mark.parametrize(
    "gpu, at_128k, at_49k",
    [(H200, 4096, 8192), (H100, 2048, 4096), (A100, 2048, 4096), (A100_40, 1024, 2048), (L4, 512, 1024),
     (RTX4090, 512, 1024)],
    ids=["h200", "h100", "a100", "a100_40", "l4", "rtx4090"],
)  # fmt: skip
def test_the_loss_chunk_is_sized_from_free_hbm(gpu, at_128k, at_49k):
    """1/64 of the free memory for one chunk's fp32 logits, a power of two, at most 8,192: at vocab 128,256 the
    32 MiB budget it replaces gave 65 tokens a chunk on every card."""
    for vocab, want in ((128256, at_128k), (49152, at_49k)):
        chunk, why = gpu_loss_chunk(gpu, vocab)
        assert chunk == want, (gpu.name, vocab, chunk, why)
        assert 4 * chunk * vocab <= gpu.free_bytes / 64 and f"vocab {vocab:,}" in why
    assert gpu_loss_chunk(H200, 32000)[0] == 8192 and "capped at 8,192" in gpu_loss_chunk(H200, 32000)[1]
    assert "capped" not in gpu_loss_chunk(H200, 49152)[1]


def _llama_1b(*overrides: str):
    from ultrascale.config.compose import compose
    from ultrascale.config.topology import Topology
    from ultrascale.model.build import build_hf_config

    cfg = compose(["recipe=llama_1b_zero0", "train.activation_checkpointing=auto", *overrides])
    return cfg, Topology(world=1), build_hf_config(cfg.model)


@pytest.mark.parametrize(
    "gpu, mode",
    [(H200, "none"), (H100, "selective"), (A100, "selective"), (A100_40, "full"), (L4, "full"), (RTX4090, "full")],
    ids=["h200", "h100", "a100", "a100_40", "l4", "rtx4090"],
)
def test_auto_checkpointing_follows_the_planners_memory_on_each_gpu(gpu, mode):
    """llama_1b_zero0 (micro 8 x 4,096): ~82 GiB predicted without checkpointing, ~53 GiB selective, ~27 GiB
    full. The first that fits 90 % of the free memory wins; the banner's reason carries the figures."""
    cfg, topo, hf = _llama_1b()
    d = decide(cfg, topo, hf, "nccl", None, gpu)
    ac = d.activation_checkpointing
    assert ac.value == mode and ac.on == (mode != "none"), ac.why
    assert "the planner predicts none" in ac.why and gpu.identified().card.name in ac.why
    assert ("does not fit even so" in ac.why) == (gpu.free_bytes < 30 * GIB), ac.why
    assert d.fused_loss.value == gpu_loss_chunk(gpu, 128256)[0] and d.gpu is gpu


def test_auto_checkpointing_is_a_pure_rule_over_predicted_peaks():
    peaks = {"none": 75 * GIB, "selective": 50 * GIB, "full": 10 * GIB}  # H100: 71 GiB usable; H200: 126
    assert auto_checkpointing(peaks, H100)[0] == "selective"
    assert auto_checkpointing(peaks, H200)[0] == "none"
    assert auto_checkpointing(peaks, L4)[0] == "full"
    assert auto_checkpointing({"none": 75 * GIB, "full": 10 * GIB}, H100)[0] == "full"  # pp>1: no selective
    huge = {m: 900 * GIB for m in peaks}
    assert auto_checkpointing(huge, H200) == ("full", auto_checkpointing(huge, H200)[1])
    assert "does not fit even so" in auto_checkpointing(huge, H200)[1]


def test_auto_on_cpu_keeps_it_off_and_booleans_still_mean_full_and_none():
    from ultrascale.config.compose import compose
    from ultrascale.levers.rules import validate

    assert validate(compose([]), 1, backend="gloo").activation_checkpointing.value == "none"  # the default: auto
    for value, mode in (("true", "full"), ("false", "none"), ("selective", "selective"), ("full", "full")):
        d = validate(compose([f"train.activation_checkpointing={value}"]), 1, backend="gloo")
        assert d.activation_checkpointing.value == mode, value
    recipe = validate(compose(["recipe=starcoder2_3b_zero2"]), 8, backend="nccl")  # its YAML says `true`
    assert recipe.activation_checkpointing.value == "full"
    assert checkpointing_mode(True) == "full" and checkpointing_mode(False) == "none"
    with pytest.raises(ConfigError, match=r"train\.activation_checkpointing='selectve' is not one of auto, none"):
        validate(compose(["train.activation_checkpointing=selectve"]), 1, backend="gloo")
    with pytest.raises(ConfigError, match=r"selective is not available: the pipeline engine .*use full"):
        validate(compose(["train.activation_checkpointing=selective", "parallel.pp=2"]), 2, backend="gloo")


def test_auto_without_selective_where_it_cannot_run():
    from ultrascale.config.topology import Topology

    cfg, _, hf = _llama_1b()

    d = decide(cfg, Topology(world=2, pp=2), hf, "nccl", None, A100_40)
    assert d.activation_checkpointing.value in ("none", "full") and "selective" not in d.activation_checkpointing.why


def test_liger_where_importable_on_a_gpu_chunked_elsewhere(monkeypatch):
    from ultrascale.config.compose import compose
    from ultrascale.levers import decide as decide_mod
    from ultrascale.levers.rules import validate

    cfg, topo, hf = _llama_1b()
    here = decide(cfg, topo, hf, "nccl", None, H100)  # liger-kernel is not installed here
    assert here.loss_kernel.value == "chunked" and "pip install liger-kernel" in here.loss_kernel.why
    assert decide(cfg, topo, hf, "gloo", None).loss_kernel.value == "chunked"
    monkeypatch.setattr(decide_mod, "liger_unusable", lambda gpu: None)
    liger = decide(cfg, topo, hf, "nccl", None, H100)
    assert liger.loss_kernel.value == "liger" and liger.fused_loss.on and liger.fused_loss.value is None
    assert decide(cfg, topo, hf, "gloo", None).loss_kernel.value == "chunked"  # CPU: never liger
    forced = compose(["recipe=llama_1b_zero0", "train.loss_kernel=chunked"])
    assert decide(forced, topo, hf, "nccl", None, H100).loss_kernel.value == "chunked"
    monkeypatch.undo()
    with pytest.raises(ConfigError, match=r"train\.loss_kernel=liger needs CUDA"):
        validate(compose(["train.loss_kernel=liger"]), 1, backend="gloo")
    with pytest.raises(ConfigError, match=r"pip install liger-kernel"):
        validate(compose(["recipe=llama_1b_zero0", "train.loss_kernel=liger"]), 1, backend="nccl", gpu=H100)
    with pytest.raises(ConfigError, match=r"the fused loss is off"):
        validate(compose(["recipe=llama_1b_zero0", "train.loss_kernel=liger", "train.fused_loss=false"]), 1,
                 backend="nccl", gpu=H100)  # fmt: skip


def test_forcing_liger_without_the_package_is_one_error_line_before_anything_is_built():
    """The decision (_loss_kernel) refuses it, with liger_unusable's reason; install_fused_loss acts on the decision
    and no longer checks the package itself."""
    from ultrascale.config.compose import compose
    from ultrascale.levers.rules import validate

    with pytest.raises(ConfigError) as e:
        validate(compose(["recipe=llama_1b_zero0", "train.loss_kernel=liger"]), 1, backend="nccl", gpu=H100)
    assert str(e.value) == (
        "train.loss_kernel=liger cannot run: liger-kernel is not installed (pip install liger-kernel), or use "
        "train.loss_kernel=auto"
    )


def test_the_banner_names_the_gpu_and_each_levers_reason(tmp_path):
    from ultrascale.train.banner import banner

    cfg, topo, hf = _llama_1b()
    d = decide(cfg, topo, hf, "nccl", None, H100)
    text = banner(
        cfg,
        d,
        {},
        SimpleNamespace(n_params=1_235_814_400, n_trainable=None, extras={}),
        "H100 SXM5 80GB datasheet",
        tmp_path,
    )
    lines = {ln.split()[0]: ln for ln in text.splitlines()[1:] if ln.strip()}
    assert "NVIDIA H100 80GB HBM3 x8 (H100 SXM5 80GB; 79.6 GiB, 79.1 GiB free; sm_90, 132 SMs)" in lines["gpu"]
    assert "selective per-op" in lines["act-ckpt"] and "the planner predicts" in lines["act-ckpt"]
    assert "2048 tokens a chunk (1/64 of 79.1 GiB free" in lines["loss"] and "kernel: chunked" in lines["loss"]
    assert "act-ckpt=selective" in lines["model"]
    cpu = banner(
        cfg,
        decide(cfg, topo, hf, "gloo", None),
        {},
        SimpleNamespace(n_params=1, n_trainable=None, extras={}),
        "x",
        tmp_path,
    )
    assert "\n  gpu " not in cpu


# --- selective checkpointing on real models ---------------------------------------------------------------------


class _Alive(torch.utils._python_dispatch.TorchDispatchMode):
    """Every tensor an op creates, by weak reference: what is still alive after the forward is what the
    backward keeps (saved tensors, checkpoint inputs, the selective policy's cache) plus the outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.refs.append(weakref.ref(t))
        return out

    def bytes(self, exclude: set[int]) -> int:
        alive = {}
        for ref in self.refs:
            t = ref()
            if t is not None and t.untyped_storage().data_ptr() not in exclude:
                alive[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(alive.values())


@pytest.mark.parametrize("name", ["llama", "starcoder2", "mixtral"])
def test_selective_keeps_what_the_planner_counts(name):
    """Bytes the forward leaves alive under the selective policy (its cache of matmul and attention outputs, the
    layers' inputs, the head's log-softmax, the returned logits) against the planner's selective term; the
    same loss and gradients as no checkpointing, and between none and full in memory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.test_plan_activations import MODELS
    from ultrascale.cost.memory import Layout, activation_bytes
    from ultrascale.model.arch import arch_from_hf
    from ultrascale.model.recompute import enable_checkpointing

    model_type, kwargs = MODELS[name]
    hf = AutoConfig.for_model(model_type, **kwargs)
    ids = torch.randint(0, hf.vocab_size, (2, 256), generator=torch.Generator().manual_seed(0))
    measured, grads = {}, {}
    for mode in ("none", "selective"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(hf, attn_implementation="sdpa").to(torch.bfloat16).train()
        enable_checkpointing(model, mode)
        alive = _Alive()
        with alive:
            out = model(input_ids=ids, labels=ids)
        measured[mode] = alive.bytes({p.untyped_storage().data_ptr() for p in model.parameters()})
        out.loss.backward()
        grads[mode] = (out.loss.detach(), [p.grad.clone() for p in model.parameters()])
    lay = Layout(
        world=1, micro_batch=2, global_batch=2, seq_len=256, dtype="bf16", activation_checkpointing="selective"
    )
    logits = 2 * 256 * hf.vocab_size * 2  # bf16 logits the output returns (not a saved activation)
    predicted = activation_bytes(arch_from_hf(hf), lay)[0] + logits
    print(f"SELECTIVE {name} predicted={predicted:.0f} measured={measured['selective']} none={measured['none']}")
    assert predicted == pytest.approx(measured["selective"], rel=0.05)
    assert measured["selective"] < 0.75 * measured["none"]
    torch.testing.assert_close(grads["selective"][0], grads["none"][0])
    for a, b in zip(grads["selective"][1], grads["none"][1]):
        torch.testing.assert_close(a, b)


def test_selective_survives_compiled_layers():
    """``train.compile_scope=layers`` compiles each layer in place, inside HF's checkpoint, where Inductor's matmuls
    (``mm.out`` into its buffers) are out of the policy's reach: every matmul would be recomputed, as under full.
    So with compiled layers the checkpoint goes inside the layer's forward, where torch.compile traces it and
    applies the policy to the graph. The backward's saved tensors (no checkpoint frame hides them once compiled)
    lie between the layer inputs alone (full) and everything (none); the gradients are uncheckpointed eager's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ultrascale.model.recompute import enable_checkpointing

    hf = AutoConfig.for_model("llama", vocab_size=256, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                              num_attention_heads=8, num_key_value_heads=2, use_cache=False)  # fmt: skip
    ids = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(0))

    def run(mode: str, compiled: bool) -> tuple[int, torch.Tensor]:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(hf, attn_implementation="sdpa").train()
        enable_checkpointing(model, mode, compiled_layers=compiled)
        if compiled:
            for layer in model.model.layers:
                layer.compile()
        params, seen = {p.untyped_storage().data_ptr() for p in model.parameters()}, {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in params:
                seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return sum(seen.values()), torch.cat([p.grad.flatten() for p in model.parameters()])

    none, grads = run("none", False)  # eager: every saved tensor through the hooks
    full, _ = run("full", False)  # the layers' inputs (and the head), through the hooks
    selective, compiled_grads = run("selective", True)
    assert full < 0.5 * none and 1.5 * full < selective < none, (none, selective, full)
    torch.testing.assert_close(compiled_grads, grads, rtol=1e-4, atol=1e-6)


def test_the_planner_times_selective_between_none_and_full():
    from ultrascale.cost.memory import Layout, memory
    from ultrascale.cost.timing import step_time
    from ultrascale.model.arch import arch_from_hf

    _, _, hf = _llama_1b()
    arch, cluster = arch_from_hf(hf), SimpleNamespace(
        gpus_per_node=8, peak_tflops=989.0, matmul_efficiency=0.5, intra_node_gbps=450.0, inter_node_gbps=45.0,
        intra_node_latency_us=10.0, inter_node_latency_us=25.0, host_link_gbps=25.0)  # fmt: skip
    lays = {m: Layout(world=8, micro_batch=4, global_batch=64, seq_len=4096, activation_checkpointing=m)
            for m in ("none", "selective", "full")}  # fmt: skip
    t = {m: step_time(arch, lay, cluster).step for m, lay in lays.items()}
    mem = {m: memory(arch, lay).total for m, lay in lays.items()}
    assert t["none"] < t["selective"] < t["full"] and mem["none"] > mem["selective"] > mem["full"]
    assert Layout(world=1, activation_checkpointing=True).activation_checkpointing == "full"  # booleans still read


@pytest.mark.dist
def test_two_ranks_train_with_selective_checkpointing_like_without(tiny_data, tmp_path):
    """ZeRO-1 and ZeRO-3 on 2 ranks, the same seed and batches: selective checkpointing gives the losses of no
    checkpointing (and of full), the loss falls, and each mode really ran as itself: the backward recomputes the
    MLP's SiLU under selective and full (never without checkpointing) and the attention kernel only under full,
    whose output selective keeps."""
    out = tmp_path / "arms.json"
    base = ["logger=none", "data.seq_len=64", "data.micro_batch=2", "data.global_batch=8", "optim.lr=3e-3",
            "optim.sched.warmup_steps=2", "train.compile=false", "model.config.vocab_size=257",
            f"data.path={tiny_data}"]  # fmt: skip
    arms = {"none": "train.activation_checkpointing=none", "selective": "train.activation_checkpointing=selective",
            "full": "train.activation_checkpointing=true",
            "none_z3": "train.activation_checkpointing=none,zero=stage3",
            "selective_z3": "train.activation_checkpointing=selective,zero=stage3"}  # fmt: skip
    check(launch([str(out), "6", *(f"{k}={','.join([*base, v])}" for k, v in arms.items())],
                 script="tests/dist_scripts/checkpointing_modes.py"))  # fmt: skip
    got = json.loads(out.read_text())
    print(json.dumps(got, indent=1), file=sys.stderr)
    assert [got[a]["mode"] for a in arms] == ["none", "selective", "full", "none", "selective"]
    for arm, ref in (("selective", "none"), ("full", "none"), ("selective_z3", "none_z3")):
        want = got[ref]["losses"]
        assert want[-1] < want[0] - 0.5, want
        assert got[arm]["losses"] == pytest.approx(want, rel=1e-5, abs=1e-6), (arm, got[arm]["losses"], want)
    for arm, a in got.items():
        c, kind = a["counts"], a["mode"]
        assert (c.get("kept", 0) > 0 and c.get("dropped", 0) > 0) == (kind == "selective"), (arm, c)  # the policy ran
        assert (c.get("backward_silu", 0) > 0) == (kind != "none"), (arm, c)  # elementwise recomputed
        assert (c.get("backward_attention", 0) > 0) == (kind == "full"), (arm, c)  # selective kept attention


# --- the memory column ---------------------------------------------------------------------------------------------


def test_mem_gb_is_the_peak_of_its_interval_and_the_run_keeps_the_largest():
    """A 256 MiB tensor allocated and freed inside one interval shows in that interval's peak, not in the next
    one's (a running peak never reset showed it on every later row); the run-wide peak keeps it."""
    from ultrascale.train.metrics import MemoryMeter

    meter = MemoryMeter()
    if not meter.host_peak:
        pytest.skip(f"this OS keeps no resettable peak: {meter.kind}")
    assert "per logged interval" in meter.kind
    meter.reset()
    quiet = meter.peak_gb()
    big = torch.ones(64 * MIB)  # 256 MiB, touched
    del big
    spiked = meter.peak_gb()
    meter.reset()
    after = meter.peak_gb()
    assert spiked > quiet + 0.2 and after < spiked - 0.2, (quiet, spiked, after)
    assert meter.run_peak_gb == pytest.approx(spiked)


class _PlantedCuda:
    """``torch.cuda`` of a GPU rank as :class:`MemoryMeter` sees it: an allocator with a current and a peak
    allocation, every call recorded. Strict: any other attribute raises, so the meter cannot read a figure
    this double does not model (``memory_reserved``, ``mem_get_info``...) and pass with a real CPU answer."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.allocated = self.peak = 3 * 2**30

    def alloc(self, gib: float) -> None:
        self.allocated += int(gib * 2**30)
        self.peak = max(self.peak, self.allocated)

    def is_available(self) -> bool:
        return True

    def max_memory_allocated(self, device=None) -> int:
        self.calls.append("max_memory_allocated")
        return self.peak

    def reset_peak_memory_stats(self, device=None) -> None:
        self.calls.append("reset_peak_memory_stats")
        self.peak = self.allocated

    def __getattr__(self, name: str):
        raise AssertionError(f"torch.cuda.{name} is not planted")


class _TorchWith:
    """``torch`` with its ``cuda`` planted."""

    def __init__(self, cuda: _PlantedCuda) -> None:
        self.cuda = cuda

    def __getattr__(self, name: str):
        return getattr(torch, name)


def test_mem_gb_on_a_gpu_is_the_allocators_peak_of_its_interval(monkeypatch):
    """The meter's CUDA arm, which no CPU run reaches, against a planted ``torch.cuda``: a logged row reads
    ``max_memory_allocated`` (the interval's peak: a 2 GiB spike freed before the row shows), the reset after
    it makes the next row the next interval's peak (3 GiB, not the spike's 5), and the run keeps the 5."""
    from ultrascale.train import metrics

    cuda = _PlantedCuda()
    monkeypatch.setattr(metrics, "torch", _TorchWith(cuda))  # metrics' torch only: the rest of torch is real
    meter = metrics.MemoryMeter()
    assert meter.cuda and not meter.host_peak and "torch.cuda.max_memory_allocated" in meter.kind
    cuda.alloc(2)
    cuda.alloc(-2)  # freed before the row is written
    assert meter.peak_gb() == 5.0
    meter.reset()
    assert meter.peak_gb() == 3.0
    cuda.alloc(1)
    assert meter.peak_gb() == 4.0
    assert meter.run_peak_gb == 5.0
    assert cuda.calls == ["max_memory_allocated", "reset_peak_memory_stats", "max_memory_allocated",
                          "max_memory_allocated"]  # fmt: skip
