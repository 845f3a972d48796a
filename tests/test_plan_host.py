"""Host memory per node, as the planner and the recipe headers state it: offloaded state plus the background
checkpoint writer's staging copy (``train.checkpoint_async``; issue 42 §6). The copy is what the writer really
allocates (a 2-rank run's own staging bytes), the search rejects a layout whose node cannot hold both, and a
recipe header that names a host RAM figure states the planner's parts and at least their sum."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.conftest import FAST, check, launch, metrics
from ultrascale.config.compose import compose, resolve
from ultrascale.cost.memory import GIB, checkpoint_staging_bytes
from ultrascale.levers.rules import validate
from ultrascale.model.arch import arch_from_hf
from ultrascale.plan import dryrun
from ultrascale.plan.search import decided, layout_from_cfg

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"


def _planned(recipe: str, *overrides: str):
    cfg = resolve(compose([f"recipe={recipe}", *overrides]))
    t = dryrun.target(cfg)
    d = validate(cfg, t.world, backend="nccl", gpu=t.gpu)
    return cfg, d, t


def _host_parts(recipe: str, *overrides: str) -> tuple[float, float, int]:
    """(offloaded GiB per GPU, staging GiB per GPU, GPUs per node) as the dry run counts them."""
    cfg, d, t = _planned(recipe, *overrides)
    m = dryrun.plan_memory(cfg, d, t)
    staging = checkpoint_staging_bytes(arch_from_hf(d.hf_config), dryrun.planned_layout(cfg, d))
    return m.host / GIB, (staging if cfg.train.checkpoint_async else 0.0) / GIB, t.cluster.gpus_per_node


HOST_RAM_RECIPES = ("starcoder2_15b_zero3_offload",)
"""The recipes whose header states the host RAM a node needs, named: a parametrization by a text match over the
headers would go silently empty when a header's wording changed."""
HOST_RAM = re.compile(r">= ?([\d,]+) GiB host RAM")


def _header(recipe: str) -> str:
    return "\n".join(ln for ln in (RECIPES_DIR / f"{recipe}.yaml").read_text().splitlines() if ln.startswith("#"))


def test_every_header_with_a_host_ram_figure_is_checked():
    stating = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml") if HOST_RAM.search(_header(p.stem)))
    assert HOST_RAM_RECIPES and stating == sorted(HOST_RAM_RECIPES), stating


@pytest.mark.parametrize("recipe", HOST_RAM_RECIPES)
def test_a_recipe_header_states_the_host_memory_the_planner_counts(recipe):
    header = _header(recipe)
    offload, staging, gpn = _host_parts(recipe)
    figure = HOST_RAM.search(header)
    assert figure, f"{recipe}'s header no longer states '>= N GiB host RAM'"
    stated = float(figure.group(1).replace(",", ""))
    assert stated >= (offload + staging) * gpn, (recipe, stated, offload, staging)
    assert f"~{offload * gpn:.0f} GiB" in header and "offloaded" in header, (recipe, round(offload * gpn))
    if staging or "checkpoint writer" in header:  # the copy is named with its size, and how to do without it
        assert f"~{staging * gpn:.0f} GiB" in header and "checkpoint_async=false" in header, round(staging * gpn)


def test_the_dry_run_and_the_search_count_the_writers_copy():
    """starcoder2_15b_zero3_offload: both parts in the dry run's host line; on a node of 300 GiB the planner's
    search rejects the layout because of the copy, and accepts it with train.checkpoint_async=false."""
    from ultrascale.config.search import SearchConfig
    from ultrascale.plan.search import evaluate

    offload, staging, gpn = _host_parts("starcoder2_15b_zero3_offload")
    assert offload * gpn < 300 < (offload + staging) * gpn
    cfg, d, t = _planned("starcoder2_15b_zero3_offload")
    line = dryrun.hbm_line(cfg, d, t)
    assert f"offloaded state {offload:.1f} + the background checkpoint writer's copy {staging:.1f}" in line, line
    small = OmegaConf.to_object(cfg.cluster)
    small.host_memory_gib, small.gpus_per_node = 300.0, gpn
    arch, lay = arch_from_hf(d.hf_config), decided(layout_from_cfg(cfg, t.world), d)
    got = evaluate(cfg, arch, lay, cluster=small, search=SearchConfig())
    assert got.rejected is not None and "checkpoint writer's copy does not fit" in got.rejected, got.rejected
    cfg.train.checkpoint_async = False
    assert evaluate(cfg, arch, lay, cluster=small, search=SearchConfig()).rejected is None


@pytest.mark.dist
@pytest.mark.parametrize("stage", [2, 3])
def test_the_planned_copy_is_what_the_writer_stages(stage, tmp_path, tiny_data):
    """Two CPU ranks, bf16, ZeRO-2 and ZeRO-3: rank 0's staging buffers (the checkpoint event's staging_gb, every
    tensor DeepSpeed hands the writer) are the planner's figure for that layout, within DeepSpeed's padding."""
    out = tmp_path / f"z{stage}"
    args = [*FAST, f"data.path={tiny_data}", f"output_dir={out}", "precision=bf16", f"zero=stage{stage}",
            "train.steps=2", "train.checkpoint_interval=2"]  # fmt: skip
    check(launch(args, nproc=2))
    staged = next(r["staging_gb"] for r in metrics(out) if r.get("event") == "checkpoint") * 1e9
    cfg = OmegaConf.load(out / "config.yaml")
    d = validate(cfg, 2)
    planned = checkpoint_staging_bytes(arch_from_hf(d.hf_config), decided(layout_from_cfg(cfg, 2), d))
    assert planned == pytest.approx(staged, rel=0.03), (planned, staged)
