"""The FLOP rate MFU divides by: a GPU's datasheet figure for the run's matmul dtype, or a CPU rank's measured,
calibrated GEMM rate.

A GPU's figure is its card's dense (no 2:4 sparsity) tensor-core peak for the dtype the matmuls run in, from
:data:`ultrascale.runtime.gpu.CARDS`: bf16/fp16 for 16-bit weights or autocast, TF32 for fp32 weights where torch
lets matmuls use it, plain fp32 otherwise. A card the table does not know gets no MFU, rather than a borrowed
number. A CPU has no datasheet peak a run can reach, so MFU there is ``achieved / calibrated``: what a large, long
GEMM reaches per rank with the run's threads while every rank of the node runs it at once, stored per CPU, dtype,
threads and ranks in ``$ULTRASCALE_CACHE_DIR/peak_flops.json`` so a machine measures it once (why not a quick
matmul at start-up: bench/README.md, "The CPU peak MFU divides by"). To measure it again, on a quiet machine:

    torchrun --nproc_per_node 2 -m ultrascale.runtime.peak --remeasure
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch

from ultrascale.argv import ArgParser
from ultrascale.runtime.gpu import GpuInfo

GEMM_N = 2048
"""fp32 2048^3: ~17 GFLOP per product, 0.1-0.5 s on one core: far past cache effects, long enough to time."""


def cache_path() -> Path:
    from ultrascale.paths import PROJECT_ROOT

    return Path(os.environ.get("ULTRASCALE_CACHE_DIR") or PROJECT_ROOT / ".cache" / "ultrascale") / "peak_flops.json"


def cpu_model() -> str:
    """The CPU's name and fingerprint (family/model/stepping and matrix flags): a cloud VM's ``model name`` alone
    ("Intel(R) Xeon(R) Processor") is the same for CPUs whose GEMM rates differ several-fold, and keying the stored
    peak by it alone reused one CPU's peak on another."""
    from ultrascale.runtime.cpu import detect

    c = detect()
    return f"{c.model_name} [{c.fingerprint()}]"


def gemm_rate(dtype: torch.dtype = torch.float32, n: int = GEMM_N, warmup_s: float = 1.0,
              measure_s: float = 3.0) -> dict:  # fmt: skip
    """Steady-state GEMM FLOP/s of this process on its current torch threads: median of per-product windows
    (at least 5, each in ``rates``) after ``warmup_s`` of untimed products, with their spread (a reading is only
    as good as its windows agree)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < warmup_s:
        torch.mm(a, b)
    rates: list[float] = []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < measure_s or len(rates) < 5:
        t = time.perf_counter()
        torch.mm(a, b)
        rates.append(2 * n**3 / (time.perf_counter() - t))
    return {"flops": statistics.median(rates), "min": min(rates), "max": max(rates), "windows": len(rates),
            "rates": rates}  # fmt: skip


def _key(dtype: torch.dtype, threads: int, local_ranks: int) -> str:
    return f"{cpu_model()} | {str(dtype).removeprefix('torch.')} | {threads} threads x {local_ranks} ranks"


def _load() -> dict:
    try:
        return json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _all_ranks(value: float, op: str) -> float:
    """``value`` reduced over every rank (min or mean), or itself without a process group."""
    import torch.distributed as tdist

    if not (tdist.is_available() and tdist.is_initialized()):
        return value
    from ultrascale.runtime.device import coll_tensor

    t = coll_tensor([value], torch.float64)
    tdist.all_reduce(t, op=tdist.ReduceOp.MIN if op == "min" else tdist.ReduceOp.SUM)
    return float(t) if op == "min" else float(t) / tdist.get_world_size()


def cpu_peak(dtype: torch.dtype = torch.float32, remeasure: bool = False) -> tuple[float, str]:
    """(FLOP/s per rank, description). Collective when a process group is up: every rank calls it, and either
    every rank reads the stored figure or every rank measures at once (a rank whose cache lacks it makes all
    measure, so no rank waits on a collective the others skip)."""
    from ultrascale.runtime.dist import local_world_size

    local = local_world_size()
    key = _key(dtype, torch.get_num_threads(), local)
    stored = _load().get(key)
    if _all_ranks(0.0 if remeasure or stored is None else 1.0, "min") and stored is not None:
        return float(
            stored["flops"]
        ), f"{stored['flops'] / 1e9:.1f} GFLOP/s per rank: {key} (calibrated {stored['measured']})"
    _all_ranks(0.0, "min")  # a barrier: the ranks start the GEMM together
    got = gemm_rate(dtype)
    flops = _all_ranks(got["flops"], "mean")
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        from ultrascale.jsonio import write_json

        cache = _load()
        cache[key] = {"flops": flops, "measured": time.strftime("%Y-%m-%d"), "gemm_n": GEMM_N,
                      "window_min": got["min"], "window_max": got["max"], "windows": got["windows"]}  # fmt: skip
        cache_path().parent.mkdir(parents=True, exist_ok=True)
        write_json(cache_path(), cache)
    return flops, f"{flops / 1e9:.1f} GFLOP/s per rank: {key} (calibrated now)"


def matmul_dtype(dtype: torch.dtype, tf32: bool) -> str:
    """The datasheet column a GPU's matmuls in ``dtype`` run at: bf16, fp16, or fp32 weights as TF32 (when torch
    allows it) or as plain fp32."""
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    return "tf32" if tf32 else "fp32"


def gpu_peak(gpu: GpuInfo, column: str) -> tuple[float, str]:
    """(peak FLOP/s of this GPU for matmuls in ``column`` (bf16/fp16/tf32/fp32), where it came from); 0 with the
    reason where the card or its figure is unknown. A MIG slice gets its share of the card by SMs."""
    ident = gpu.identified()
    card = ident.card
    if card is None:
        return 0.0, f"{gpu.name}: no datasheet peak ({ident.why}): MFU not reported"
    tflops = card.tflops.get(column)
    if not tflops:
        return 0.0, f"{card.name} has no {column} tensor-core figure on its datasheet: MFU not reported"
    share = f" x {ident.share:.2f} of its SMs" if ident.share < 1 else ""
    return tflops * 1e12 * ident.share, (f"{card.name} datasheet, {column} dense {tflops:g} TFLOP/s{share} "
                                         f"({ident.why}; {card.source})")  # fmt: skip


def device_peak_flops(dtype: torch.dtype = torch.float32, gpu: GpuInfo | None = None) -> tuple[float, str]:
    """(peak FLOP/s per rank for matmuls in ``dtype``, where it came from); 0 where unknown (MFU is then not
    reported). On CUDA, ``gpu`` (default: this rank's) is looked up in the datasheet table; fp32 counts as TF32
    when torch lets matmuls use it."""
    if torch.cuda.is_available():
        from ultrascale.runtime.gpu import detect

        return gpu_peak(gpu or detect(), matmul_dtype(dtype, torch.backends.cuda.matmul.allow_tf32))
    return cpu_peak_for(dtype)


def cpu_peak_for(dtype: torch.dtype) -> tuple[float, str]:
    """A CPU's peak for a run whose matmuls are in ``dtype``: the bf16 GEMM's where the CPU multiplies bf16 natively
    (AMX, AVX-512 BF16), else the fp32 GEMM's (fp16 is not a CPU path). Emulated bf16 converts to fp32 and
    multiplies there, so fp32 is the most this CPU's FMA units do; calibrating the emulated GEMM instead measured
    0.3 GFLOP/s on an AVX2 EPYC, took over 5 minutes at start-up (at least six 2048^3 products of ~57 s each),
    and put MFU at 900 % (the run's attention and loss GEMMs stay fp32)."""
    from ultrascale.runtime.cpu import detect

    if dtype != torch.bfloat16:
        return cpu_peak(torch.float32)
    cpu = detect()
    if cpu.bf16_native:
        return cpu_peak(torch.bfloat16)
    flops, src = cpu_peak(torch.float32)
    return flops, f"{src}; the fp32 rate: bf16 is emulated on this CPU ({cpu.matrix_unit})"


def main() -> None:
    ap = ArgParser(prog="python -m ultrascale.runtime.peak", description=__doc__)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--remeasure", action="store_true", help="measure again and store the new figure")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if "WORLD_SIZE" in os.environ:  # under torchrun: the ranks measure together and store their mean
        import torch.distributed as tdist

        tdist.init_process_group("gloo")
    _, src = cpu_peak(getattr(torch, a.dtype), remeasure=a.remeasure)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{src}; stored in {cache_path()}")
    if "WORLD_SIZE" in os.environ:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
