"""Which of a run's defaults an ablation settled, at what proxy size, and what it found: the dry run's
``== settled by ablation ==`` section, so a user scaling a recipe up knows what was measured and what was not.

Each :class:`Ablation` names the config key it tested, its arms, and the report JSON that
``python -m ultrascale.report.ablation ... --json`` wrote for it (``docs/results/ablation_*.json``, committed with
the README's "Ablations" section). The verdict is read from that JSON, never typed here: the arm's seed-paired
95 % interval excludes zero (one arm better) or includes it (the proxy could not tell them apart).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ultrascale.paths import PROJECT_ROOT

PROXY = (
    "ablate_tiny (a 1.26M-parameter Llama pretrained from scratch on 3.0M tokens of stdlib code on a 2-core CPU box; "
    "fine-tuning a pretrained model was not ablated)"
)


@dataclass(frozen=True)
class Ablation:
    key: str
    """The config key the arms differ in, as the dry run names it."""
    name: str
    result: str
    """The report JSON, relative to the project root."""
    arm: str
    """The arm compared against the baseline, as the JSON names it."""
    value: Callable[[Any], str]
    """The run's own setting of the key, as shown."""


# fmt: off
ABLATIONS = (
    Ablation("optim.name", "Muon against AdamW, each at its tuned lr, one cosine schedule",
             "docs/results/ablation_optim.json", "optim=muon optim.muon_lr=0.1",
             lambda c: str(c.optim.name)),
    Ablation("data (FIM rate)", "FIM for free: D0 against D50 (FIM on half the documents), scored left to right",
             "docs/results/ablation_fim.json", "data=ablate_d50",
             lambda c: str(c.data.path)),
    Ablation("data.document_masking", "document masking against plain causal attention over the packed row",
             "docs/results/ablation_masking.json", "data.document_masking=false",
             lambda c: str(c.data.document_masking).lower()),
)
# fmt: on


def verdict(a: Ablation, root: Path = PROJECT_ROOT) -> str:
    """One line from the ablation's report JSON: the arm's paired difference and what its interval says."""
    path = root / a.result
    if not path.exists():
        return f"not yet measured ({a.result} missing)"
    res = json.loads(path.read_text())
    comp = next((c for c in res["comparisons"] if c["arm"].lower() == a.arm.lower()), None)  # Hydra's True/true
    if comp is None or comp.get("ci95") is None:
        return f"no interval in {a.result} for {a.arm}"
    lo, hi = comp["ci95"]
    diff = f"{a.arm} vs {res['baseline']}: held-out loss {comp['diff_mean']:+.4f} [{lo:+.4f}, {hi:+.4f}], " \
           f"{comp['n_pairs']} seed pairs"  # fmt: skip
    if hi < 0:
        return f"{diff}: the arm is better"
    if lo > 0:
        return f"{diff}: the baseline is better"
    return f"{diff}: the interval includes zero, the proxy could not tell them apart"


def evidence_lines(cfg: Any, root: Path = PROJECT_ROOT) -> list[str]:
    """The dry run's section: each tested lever with the run's own setting and the ablation's verdict, then what
    no ablation here has tested."""
    lines = [f'proxy: {PROXY}; README "Ablations" has each table, figure and command']
    for a in ABLATIONS:
        lines.append(f"{a.key:<22} {a.value(cfg)} here; {a.name}: {verdict(a, root)}")
    lines.append("not tested by ablation: batch, schedule shape, width and depth, precision, seq_len; the lrs were "
                 "tuned at the proxy's size only (re-tune them at this one)")  # fmt: skip
    return lines
