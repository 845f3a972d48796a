"""The GRPO learning figure: per step, each seed's reward (and each reward function's), ``frac_reward_zero_std``
and completion length, from the runs' ``metrics.jsonl``; plus the HumanEval test-half result when given.

    python bench/plot_grpo_learning.py runs/grpo_s1 runs/grpo_s2 --eval runs/grpo_eval.json \\
        --png docs/figures/grpo_learning.png --json docs/results/grpo_learning.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def series(run: Path) -> list[dict]:
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    by_step = {r["step"]: r for r in rows if "reward" in r}  # a resumed step's row replaces the killed one's
    return [by_step[s] for s in sorted(by_step)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--eval", type=Path, default=None, help="python -m ultrascale.ssd.evaluate --out JSON")
    ap.add_argument("--png", type=Path, required=True)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = {str(r): series(r) for r in a.runs}
    keys = ["reward", *sorted({k for rows in data.values() for r in rows for k in r if k.startswith("rewards/")}),
            "frac_reward_zero_std", "completion_length", "truncated_frac"]  # fmt: skip
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, rows in data.items():
        steps = [r["step"] for r in rows]
        label = Path(name).name
        for k in keys:
            if k.startswith("reward"):
                axes[0].plot(steps, [r.get(k) for r in rows], label=f"{label} {k}", lw=1.2)
        axes[1].plot(steps, [r["frac_reward_zero_std"] for r in rows], label=label)
        axes[2].plot(steps, [r["completion_length"] for r in rows], label=f"{label} mean length")
        axes[2].plot(steps, [128 * r["truncated_frac"] for r in rows], ls=":", label=f"{label} truncated x 128")
    axes[0].set_title("reward per step (mean over the step's completions)")
    axes[1].set_title("frac_reward_zero_std (groups with no signal)")
    axes[2].set_title("completion tokens")
    for ax in axes:
        ax.set_xlabel("step")
        ax.legend(fontsize=6)
    fig.tight_layout()
    a.png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.png, dpi=110)
    out = {"runs": {n: [{k: r.get(k) for k in ("step", *keys, "loss", "step_s", "gen_s", "reward_s")} for r in rows]
                    for n, rows in data.items()}}  # fmt: skip
    if a.eval and a.eval.exists():
        out["humaneval_test"] = json.loads(a.eval.read_text())
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    for n, rows in data.items():
        first, last = rows[: len(rows) // 3], rows[-(len(rows) // 3) :]
        mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
        print(f"{Path(n).name}: {len(rows)} steps; reward first third {mean(first, 'reward'):.3f} -> last third "
              f"{mean(last, 'reward'):.3f}; frac_reward_zero_std {mean(first, 'frac_reward_zero_std'):.2f} -> "
              f"{mean(last, 'frac_reward_zero_std'):.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
