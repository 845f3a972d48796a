"""The FIM run's engine, rebuilt on the ranks it trained on (run by tests/test_fim_tokens.py).

Usage: torchrun --nproc_per_node 2 tests/dist_scripts/fim_engine_logits.py RUN_DIR OUT PRETRAINED_DIR
Builds the engine from RUN_DIR's config.yaml as train.py does (ZeRO-3: partitioned under zero.Init, the pretrained
weights read module by module, the vocabulary grown at that read), checks the freshly built embedding and head
against PRETRAINED_DIR's tensors (old rows equal, new rows the mean of the old), then loads the run's checkpoint and
scores two validation samples that hold FIM ids. Rank 0 saves ``{ids, logits, built_rows_are_mean,
built_old_rows_equal}`` to OUT.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch


def main(run_dir: Path, out: Path, pretrained: Path) -> None:
    import deepspeed
    from omegaconf import OmegaConf
    from safetensors.torch import load_file

    from ultrascale.data.shards import open_split
    from ultrascale.levers.deepspeed import build_ds_config
    from ultrascale.levers.rules import validate
    from ultrascale.paths import resolve_path
    from ultrascale.runtime import dist
    from ultrascale.runtime.device import to_device
    from ultrascale.train import checkpoint
    from ultrascale.train.engine import build_engine

    dist.configure_env()
    dist.init_distributed()
    cfg = OmegaConf.load(run_dir / "config.yaml")
    d = validate(cfg, dist.world_size())
    engine, _ = build_engine(cfg, d, build_ds_config(cfg, d))
    base = load_file(pretrained / "model.safetensors")
    mean_ok = old_ok = True
    for param, key in ((engine.module.get_input_embeddings().weight, "model.embed_tokens.weight"),
                       (engine.module.get_output_embeddings().weight, "lm_head.weight")):  # fmt: skip
        assert hasattr(param, "ds_tensor"), "the model was not built partitioned (ZeRO-3)"
        with deepspeed.zero.GatheredParameters([param]):
            full, old = param.detach().clone(), base[key]
        n = old.shape[0]
        mean_ok &= full.shape[0] == n + 4 and torch.allclose(full[n:], old.mean(0).expand(4, -1), rtol=0, atol=1e-7)
        old_ok &= torch.equal(full[:n], old)
    tag_dir = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    checkpoint.load(engine, tag_dir, same_world=True)
    split = open_split(resolve_path(cfg.data.path), "validation")
    samples = split.get(np.arange(len(split)))
    fim_rows = [i for i in range(len(samples)) if (samples[i] >= n).any()][:2]
    ids = torch.from_numpy(samples[fim_rows].astype(np.int64))
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=to_device(ids, engine.device)).logits.float().cpu()
    if dist.is_rank0():
        torch.save({"ids": ids, "logits": logits, "built_rows_are_mean": mean_ok, "built_old_rows_equal": old_ok}, out)
    dist.barrier()
    dist.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
