"""Plan a training layout before booking the cluster: per-rank memory, step time, and the fastest layout that fits.

python plan.py model=llama3_8b cluster=h100_8x data.seq_len=8192 data.global_batch=64
python plan.py model=starcoder2_15b cluster=h100_8x cluster.nodes=4 output_json=runs/plan/sc2.json plot=sc2.png
python plan.py model=tiny cluster=cpu_local search.enabled=false zero=stage3   # explain one layout
python plan.py budget=hoffmann budget.train_flops=5.76e23 budget.inference_tokens=2e12  # size for serving
python plan.py --help                                                          # groups and keys
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ultrascale.cli import run_app
from ultrascale.errors import ConfigError

if TYPE_CHECKING:
    from ultrascale.config.root import PlanRootConfig


def main(cfg: PlanRootConfig) -> list:
    from ultrascale.cost.cluster import resolve_cluster
    from ultrascale.model.arch import arch_from_cfg
    from ultrascale.plan.report import (
        checkpoint_advice,
        header,
        override_line,
        plot,
        rejection_summary,
        table,
        write_json,
    )
    from ultrascale.plan.search import plan

    resolve_cluster(cfg.cluster)
    if cfg.budget.enabled:  # model size and tokens for a budget + serving volume, instead of layouts
        from ultrascale.cost.budget import budget_from_cfg
        from ultrascale.plan.report import budget_table, write_budget_json

        bp = budget_from_cfg(cfg)
        print(budget_table(bp))
        if cfg.output_json:
            write_budget_json(cfg.output_json, bp)
            print(f"wrote {cfg.output_json}")
        return []
    arch = arch_from_cfg(cfg.model)
    cands = plan(cfg)
    fits = [c for c in cands if c.fits]
    print(header(cfg, arch))
    from ultrascale.plan.dryrun import mixture_lines

    if mix := mixture_lines(cfg):  # what each source gives over train.steps (nothing for one source)
        print("\n".join(mix))
    print(f"{len(cands)} layouts: {len(fits)} fit, {len(cands) - len(fits)} dropped")
    print(table(cands, cfg.top_n))
    if len(fits) < len(cands):
        print("dropped (commonest reasons):\n" + rejection_summary(cands))
    if not fits:  # before any file is written: a plan that found nothing writes nothing
        raise ConfigError(
            f"no layout of {cfg.model.name} fits {cfg.cluster.nodes}x{cfg.cluster.gpus_per_node} x "
            f"{cfg.cluster.gpu_memory_gib:g} GiB: add nodes (cluster.nodes), enable search.offload, or lower "
            "data.seq_len / data.micro_batch"
        )
    print("\nbest:\n  " + override_line(cfg, fits[0]))
    print(checkpoint_advice(cfg, arch, fits[0]))
    if cfg.output_json:
        write_json(cfg.output_json, cfg, arch, cands)
        print(f"wrote {cfg.output_json}")
    if cfg.plot:
        plot(cfg.plot, cfg, cands, cfg.top_n)
        print(f"wrote {cfg.plot}")
    return cands


if __name__ == "__main__":
    raise SystemExit(run_app("plan", main, help_text=__doc__))
