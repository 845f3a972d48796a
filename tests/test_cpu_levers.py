"""The CPU levers are pure functions of the CPU's detected features: planted feature sets, no machine needed.

Each CPU below is a real one's ``/proc/cpuinfo`` and sysfs cache figures (abridged to the flags that matter):
the Sapphire/Emerald Rapids Xeon with AMX this project was profiled on, an AMD Zen 4 (AVX-512 BF16, no AMX),
an Ice Lake Xeon (AVX-512, no bf16) and an AVX2-only Zen 3. That the levers *keep the losses* is tested where
each lever lives: tests/test_attention.py (blocked attention = sdpa), tests/test_loss.py (every chunk = the
plain loss) and tests/test_levers_dist.py (2 ranks, lever on against off).
"""

from __future__ import annotations

import pytest

from ultrascale.levers.decide import decide
from ultrascale.levers.hardware import cpu_attn_block, cpu_loss_chunk
from ultrascale.runtime.cpu import CpuInfo, parse_cpuinfo, threads_per_rank

SPR = CpuInfo("GenuineIntel", "Intel(R) Xeon(R) Processor", 6, 207, 2,
              frozenset({"avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8"}),
              48, 2048, 307200, 2, 1)  # fmt: skip
ZEN4 = CpuInfo("AuthenticAMD", "AMD EPYC 9R14", 25, 17, 1,
               frozenset({"avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni"}), 32, 1024, 32768, 2, 1)  # fmt: skip
ICX = CpuInfo("GenuineIntel", "Intel(R) Xeon(R) Processor", 6, 106, 6, frozenset({"avx2", "fma", "avx512f"}),
              48, 1280, 55296, 16, 2)  # fmt: skip
ZEN3 = CpuInfo("AuthenticAMD", "AMD EPYC 7R13", 25, 1, 1, frozenset({"avx2", "fma"}), 32, 512, 32768, 8, 2)


def test_matrix_units_and_fingerprints_tell_cpus_with_one_name_apart():
    assert SPR.amx and SPR.bf16_native and "AMX" in SPR.matrix_unit
    assert not ZEN4.amx and ZEN4.bf16_native and ZEN4.matrix_unit == "AVX-512 BF16"
    assert not ICX.bf16_native and ICX.vector_bits == 512 and "no native bf16" in ICX.matrix_unit
    assert not ZEN3.bf16_native and ZEN3.vector_bits == 256
    # the same "model name" (a cloud VM's generic one) but different CPUs: the peak cache must not mix them
    assert SPR.model_name == ICX.model_name and SPR.fingerprint() != ICX.fingerprint()
    assert SPR.fingerprint() == "GenuineIntel 6/207/2 amx_bf16 amx_tile avx512_bf16 avx512f avx512_vnni avx2 fma"


def test_parse_cpuinfo_reads_the_first_processor():
    text = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu avx2 amx_bf16\n\nprocessor\t: 1\nflags\t: fpu\n"
    info = parse_cpuinfo(text)
    assert info["vendor_id"] == "GenuineIntel" and info["flags"].split() == ["fpu", "avx2", "amx_bf16"]


def test_threads_are_the_physical_cores_per_rank_and_the_users_omp_wins():
    assert threads_per_rank(SPR, 2) == (1, "2 cores / 2 local rank(s)")
    assert threads_per_rank(SPR, 1)[0] == 2
    # SMT: 16 CPUs are 8 cores; two ranks get 4 threads each, not 8 that fight over each core's FMA units
    n, why = threads_per_rank(ICX, 2)
    assert n == 4 and "8 physical cores" in why and "2 SMT" in why
    assert threads_per_rank(ZEN3, 4)[0] == 1
    # more ranks than physical cores: the logical CPUs are shared out instead (never 0 threads)
    assert threads_per_rank(ZEN3, 8)[0] == 1 and threads_per_rank(ICX, 16)[0] == 1
    assert threads_per_rank(ICX, 2, omp="3") == (3, "OMP_NUM_THREADS=3 from the environment")


@pytest.mark.parametrize(
    "cpu, blocks, chunks",
    [(SPR, (512, 1024), (128, 1024)), (ZEN4, (512, 1024), (128, 1024)), (ICX, (512, 512), (128, 128)),
     (ZEN3, (512, 512), (128, 128))],
    ids=["spr", "zen4", "icx", "zen3"],
)  # fmt: skip
def test_every_cpu_gets_a_block_and_a_chunk_with_its_reason(cpu, blocks, chunks):
    """Seq 2,048, (fp32, bf16 matmuls): 4 blocks of 512 a row in fp32; 2 of 1,024 where the CPU computes bf16
    natively, and fp32's levers where it would emulate it. A CPU left without blocks (0) is a failure here."""
    for bf16, block_want, chunk_want in zip((False, True), blocks, chunks):
        block, why = cpu_attn_block(cpu, 2048, bf16)
        assert block == block_want and why.startswith(f"{2048 // block_want} blocks a row"), (bf16, block, why)
        chunk, why = cpu_loss_chunk(cpu, 49152, bf16)
        assert chunk == chunk_want and why, (bf16, chunk, why)


def test_decide_takes_the_cpus_levers_and_names_them_in_the_banner():
    from ultrascale.config.compose import compose
    from ultrascale.config.topology import Topology
    from ultrascale.model.build import build_hf_config

    cfg = compose(["model=smollm2_135m", "data.seq_len=2048"])
    hf, topo = build_hf_config(cfg.model), Topology(world=2)
    for cpu in (SPR, ZEN4, ICX, ZEN3):
        d = decide(cfg, topo, hf, "gloo", cpu)
        chunk, _ = cpu_loss_chunk(cpu, hf.vocab_size, False)
        block, _ = cpu_attn_block(cpu, 2048, False)
        assert (chunk, block) == (128, 512)  # fp32 matmuls (no autocast) on every one of these CPUs
        assert d.fused_loss.value == chunk and f"{chunk} tokens a chunk" in d.fused_loss.why
        assert d.attention.on and d.attention.value == block and f"query blocks of {block}" in d.attention.why
    # a number in the config is the user's, whatever the CPU
    forced = decide(compose(["model=smollm2_135m", "train.loss_chunk_tokens=96", "train.attn_block_size=32"]),
                    topo, hf, "gloo", SPR)  # fmt: skip
    assert forced.fused_loss.value == 96 and forced.attention.value == 32
    # a GPU keeps HF's sdpa and the chunk from the logit budget
    gpu = decide(cfg, topo, hf, "nccl", None)
    assert not gpu.attention.on and gpu.fused_loss.value is None
    # the bf16 hint: only where the CPU has the units
    assert "AMX" in decide(cfg, topo, hf, "gloo", SPR).autocast.why
    assert "precision.autocast=bf16 puts" not in decide(cfg, topo, hf, "gloo", ICX).autocast.why


def test_the_rules_give_each_matrix_unit_its_measured_best():
    """The figures bench_cpu_levers measured (bench/README.md): fp32 matmuls: 4 blocks a row, chunk 128; bf16 on
    AMX: 2 blocks, chunk 1,024; a CPU that would emulate bf16 keeps fp32's levers (its autocast is off)."""
    assert cpu_attn_block(SPR, 2048, False)[0] == 512 and cpu_attn_block(SPR, 2048, True)[0] == 1024
    assert cpu_attn_block(ZEN4, 256, False)[0] == 64  # the Zen 4's measured best at seq 256
    assert cpu_attn_block(ZEN3, 2048, True)[0] == 512 and cpu_attn_block(ICX, 2048, True)[0] == 512
    assert cpu_attn_block(SPR, 128, True)[0] == 64  # never below MIN_BLOCK
    assert cpu_loss_chunk(SPR, 49152, False)[0] == 128 and cpu_loss_chunk(ZEN4, 49152, False)[0] == 128
    assert cpu_loss_chunk(SPR, 49152, True)[0] == 1024 and cpu_loss_chunk(ZEN4, 49152, True)[0] == 1024
    assert cpu_loss_chunk(ICX, 49152, True)[0] == 128  # no native bf16
    chunk, why = cpu_loss_chunk(SPR, 152064, True)  # a Qwen-size vocabulary: the logits budget caps it
    assert chunk == 256 and "256 MiB" in why and chunk * 152064 * 4 <= 256 * 2**20


def test_decide_gives_autocast_runs_the_bf16_levers_only_where_the_cpu_computes_bf16():
    from ultrascale.config.compose import compose
    from ultrascale.config.topology import Topology
    from ultrascale.model.build import build_hf_config

    cfg = compose(["model=smollm2_135m", "data.seq_len=2048", "precision.autocast=bf16"])
    hf, topo = build_hf_config(cfg.model), Topology(world=2)
    amx = decide(cfg, topo, hf, "gloo", SPR)
    assert amx.autocast.on and amx.fused_loss.value == 1024 and amx.attention.value == 1024
    assert "AMX" in amx.fused_loss.why and "2 blocks a row" in amx.attention.why
    icx = decide(cfg, topo, hf, "gloo", ICX)  # autocast off here (emulated), so fp32's levers
    assert not icx.autocast.on and icx.fused_loss.value == 128 and icx.attention.value == 512


def test_the_stored_peak_is_keyed_by_the_fingerprint_not_the_name(monkeypatch):
    """Two VMs both saying "Intel(R) Xeon(R) Processor" (one with AMX, one without) must not share a calibration:
    the one taken on the AMX box would make every MFU of the other box read wrong."""
    import torch

    import ultrascale.runtime.cpu
    from ultrascale.runtime.peak import _key

    keys = {}
    for name, cpu in (("spr", SPR), ("icx", ICX)):
        monkeypatch.setattr(ultrascale.runtime.cpu, "detect", lambda cpu=cpu: cpu)
        keys[name] = _key(torch.float32, 1, 2)
    assert keys["spr"] != keys["icx"] and SPR.fingerprint() in keys["spr"]
