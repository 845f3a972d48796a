"""DeepSpeed's C++ ops a CPU run loads, built once at setup instead of inside the first run that needs them.

DeepSpeed JIT-compiles its ops on first use into ``TORCH_EXTENSIONS_DIR`` (``.cache/torch_extensions`` here): the
shared-memory all-reduce (``deepspeed_shm_comm``, loaded by every CPU process group) and the CPU Adam of
``zero.offload_optimizer=cpu`` (``cpu_adam``). On a 2-core box that is 40-70 s each, spent silently between a run's
first log line and its banner. ``make setup`` runs ``python -m ultrascale.runtime.ops`` once, so neither the first
``make demo`` nor the first test that trains pays it; a cache removed later is rebuilt on first use as before.
"""

from __future__ import annotations

import os
import sys
import time

CPU_OPS = ("ShareMemCommBuilder", "CPUAdamBuilder")
"""The op builders a CPU run loads (DeepSpeed's CPU accelerator names)."""


def build(names: tuple[str, ...] = CPU_OPS) -> list[tuple[str, float]]:
    """Build (or find already built) each op; (name, seconds) each. Only on the CPU accelerator: a GPU node builds
    its own CUDA ops against its own toolkit."""
    from ultrascale.runtime.dist import configure_env

    configure_env()  # the project-local TORCH_EXTENSIONS_DIR
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    out = []
    for name in names:
        t = time.perf_counter()
        builder = accel.create_op_builder(name)
        if builder is None or not builder.is_compatible():
            out.append((name, float("nan")))
            continue
        builder.load(verbose=False)
        out.append((name, time.perf_counter() - t))
    return out


def main() -> int:
    print(f"building DeepSpeed's CPU ops into {os.environ.get('TORCH_EXTENSIONS_DIR', '(default)')} (once) ...",
          flush=True)  # fmt: skip
    for name, s in build():
        print(f"  {name}: " + ("not compatible with this machine, skipped" if s != s else f"ready in {s:.1f} s"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
