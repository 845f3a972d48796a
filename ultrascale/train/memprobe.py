"""What setting a layout up costs in host memory, per rank, without training: build the engine exactly as
``train.py`` does (same overrides), write this rank's figures (``EngineInfo.memory``: the RSS peak while the
model is built or loaded, after engine setup, and after one optimizer step on random tokens, when the
optimizer's state exists) and the decisions it built with (rank 0's on every rank, as a run agrees them) to
``OUT.rankN``, and stop. ``bench/scale_memory.py`` and the construction-memory tests run it; so can a user about
to book a machine:

    torchrun --nproc_per_node 2 -m ultrascale.train.memprobe /tmp/mem.json recipe=starcoder2_7b_zero3 ...
"""

from __future__ import annotations

import json
import sys

from ultrascale.argv import ArgParser
from ultrascale.runtime import dist


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))


def one_step(engine, d, micro_batch: int, seq_len: int, vocab: int) -> None:
    """One optimizer step on random tokens, so the optimizer's state exists (Adam allocates it lazily)."""
    import torch

    g = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, vocab, (micro_batch, seq_len), generator=g).to(engine.device)
        for _ in range(engine.gradient_accumulation_steps())
    ]
    if d.pipeline:
        engine.train_batch(data_iter=iter([(b, b) for b in batches]))
        return
    for b in batches:
        engine.backward(engine(input_ids=b, labels=b).loss)
        engine.step()


def main(argv: list[str] | None = None) -> int:
    ap = ArgParser(prog="python -m ultrascale.train.memprobe", description=__doc__)
    ap.add_argument("out", help="path prefix: each rank writes OUT.rankN (JSON)")
    ap.add_argument("overrides", nargs="*", help="train.py overrides (key=value), e.g. recipe=starcoder2_7b_zero3")
    a = ap.parse_args(argv)
    from ultrascale.errors import UltrascaleError

    try:
        _probe(a.out, a.overrides)
    except UltrascaleError as e:
        if dist.rank() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


def _probe(out: str, overrides: list[str]) -> None:
    from ultrascale.config.compose import compose, typed
    from ultrascale.levers.deepspeed import build_ds_config
    from ultrascale.levers.rules import agree_across_ranks, validate
    from ultrascale.runtime import hostmem
    from ultrascale.train.engine import build_engine

    dist.configure_env()
    cfg = typed(compose(overrides))  # converted once, as run_app does for train.py
    d = validate(cfg, dist.world_size())
    dist.init_distributed()
    d = agree_across_ranks(d)
    engine, info = build_engine(cfg, d, build_ds_config(cfg, d))
    one_step(engine, d, cfg.data.micro_batch, cfg.data.seq_len, d.hf_config.vocab_size)
    hostmem.trim()  # the live tensors, not the free heap pages glibc keeps for later
    after_step = (_rss_kb() - info.memory["base_kb"]) / 2**20
    with open(f"{out}.rank{dist.rank()}", "w") as f:
        json.dump({"rank": dist.rank(), "stage": getattr(engine, "stage_id", 0), "n_params": info.n_params,
                   **info.memory, "after_step_gb": after_step,
                   "decisions": {k: [c.on, c.value] for k, c in d.features().items()}}, f, default=str)  # fmt: skip
    engine.destroy()
    del engine
    dist.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
