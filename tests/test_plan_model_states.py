"""Predicted model-state bytes per rank vs the real DeepSpeed engine's tensors, ZeRO 0-3 on 2 gloo ranks.

All ten scenarios (two sizes x four stages, plus accumulation at stages 1-2) share one torchrun launch; the script walks the
engine's partitions and optimizer state (tests/dist_scripts/plan_model_states.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import launch
from ultrascale.config.compose import compose
from ultrascale.cost.memory import model_state_bytes
from ultrascale.model.arch import arch_from_cfg
from ultrascale.plan.search import layout_from_cfg

COMMON = "precision=bf16 data.seq_len=32 data.micro_batch=2 data.global_batch=4 zero.reduce_bucket_size=500000"
MODELS = {
    "tiny": "model=tiny",
    "small": "model=tiny model.config.hidden_size=256 model.config.intermediate_size=688 "
    "model.config.num_hidden_layers=6 model.config.vocab_size=8192 model.config.tie_word_embeddings=false",
}
SCENARIOS = [f"{MODELS[m]} zero=stage{s} {COMMON}" for m in MODELS for s in range(4)]
IDS = [f"{m}-zero{s}" for m in MODELS for s in range(4)]
# Gradient accumulation: stage 1 keeps the full 16-bit gradient between boundaries, stage 2 only its partition.
SCENARIOS += [f"{MODELS['tiny']} zero=stage{s} {COMMON} data.global_batch=8" for s in (1, 2)]
IDS += ["tiny-zero1-ga2", "tiny-zero2-ga2"]


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], dict]:
    out = tmp_path_factory.mktemp("plan_ms") / "rows.jsonl"
    proc = launch([str(out), *SCENARIOS], script="tests/dist_scripts/plan_model_states.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for r in (0, 1) for line in Path(f"{out}.{r}").read_text().splitlines()]
    return {(row["scenario"], row["rank"]): row for row in rows}


@pytest.mark.dist
@pytest.mark.parametrize("scenario", SCENARIOS, ids=IDS)
def test_model_state_bytes_match_engine(measured: dict, scenario: str) -> None:
    cfg = compose(scenario.split())
    for rank in (0, 1):
        predicted = model_state_bytes(arch_from_cfg(cfg.model), layout_from_cfg(cfg, world=2), rank=rank)
        row = measured[(scenario, rank)]
        for term in ("params", "grads", "optimizer"):
            name = "small" if "hidden_size" in scenario else "tiny"
            print(
                f"PLAN-MS {name} zero{cfg.zero.stage} ga{cfg.data.global_batch // 4} rank{rank} {term} "
                f"predicted={predicted[term]:.0f} measured={row[term]}"
            )
            assert predicted[term] == pytest.approx(row[term], rel=0.01), term
