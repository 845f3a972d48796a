"""The paper's mechanism, measured: do "lock" positions get sharper while "fork" positions keep their diversity?

The SSD paper explains its gain by the truncated, temperature-scaled samples: at a *lock* (one right token and a
long tail of distractors) training on truncated samples moves mass from the tail to the head, while at a *fork*
(several good continuations) the raised temperature keeps them all. On held-out code, for every position, this
module computes under the base and the new model the entropy of the next-token distribution (nats) and the
probability mass outside the top-k (the tail the truncation cuts), averaged per bin of the base model's top-1
probability. Locks are the high-confidence bins: the tail mass there should drop. Forks are the low-confidence
bins: the entropy there should stay.

    python -m ultrascale.ssd.mechanism --base DIR --new DIR --data DIR    # JSON and one plot, mechanism.png
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 0.95, 0.99, 1.0001)
"""Base top-1 probability bins: finer near 1, where most positions of code are."""


@torch.no_grad()
def position_stats(model, rows: Iterable[torch.Tensor], top_k: int = 20) -> dict[str, torch.Tensor]:
    """Per predicted position of every row: top-1 probability, entropy and mass outside the top-k (fp32)."""
    conf, ent, tail = [], [], []
    model.eval()
    device = next(model.parameters()).device
    for ids in rows:
        logits = model(input_ids=ids[None].to(device)).logits[0, :-1].float()
        logp = logits.log_softmax(-1)
        p = logp.exp()
        conf.append(p.max(-1).values)
        ent.append(-(p * logp).sum(-1))
        tail.append(1.0 - p.topk(min(top_k, p.shape[-1]), dim=-1).values.sum(-1))
    return {"confidence": torch.cat(conf), "entropy": torch.cat(ent), "tail": torch.cat(tail)}


def binned(base: dict[str, torch.Tensor], new: dict[str, torch.Tensor], bins: Sequence[float] = BINS) -> list[dict]:
    """Mean entropy and tail mass before and after, per bin of the *base* model's confidence (the same positions
    in both models, so a bin compares like with like)."""
    out = []
    b = torch.bucketize(base["confidence"], torch.tensor(bins[1:-1]), right=True)
    for i in range(len(bins) - 1):
        m = b == i
        n = int(m.sum())
        row = {"lo": bins[i], "hi": min(bins[i + 1], 1.0), "positions": n}
        if n:
            row.update({f"{key}_{side}": float(d[key][m].mean()) for side, d in (("base", base), ("new", new))
                        for key in ("entropy", "tail")})  # fmt: skip
            for key in ("entropy", "tail"):  # the paired change and its standard error over the bin's positions
                diff = (new[key][m] - base[key][m]).double()
                row[f"{key}_diff"] = float(diff.mean())
                row[f"{key}_diff_se"] = float(diff.std() / n**0.5) if n > 1 else 0.0
        out.append(row)
    return out


def held_out_rows(data_dir: Path, max_rows: int, split: str = "validation") -> list[torch.Tensor]:
    """Token rows of a prepared dataset's held-out split (the model's own tokenizer, as data prep wrote them)."""
    import numpy as np

    from ultrascale.data.shards import open_split

    ds = open_split(data_dir, split)
    return list(torch.as_tensor(ds.get(np.arange(min(max_rows, len(ds)))), dtype=torch.long))


def plot(rows: list[dict], out: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["positions"]]
    labels = [f"{r['lo']:.2f}-{r['hi']:.2f}\n{r['positions']:,}" for r in rows]
    x = range(len(rows))
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5), sharex=True)
    for col, key, name in ((0, "tail", "mass outside the top-k"), (1, "entropy", "entropy (nats)")):
        ax = axes[0][col]
        ax.plot(x, [r[f"{key}_base"] for r in rows], "o-", label="base")
        ax.plot(x, [r[f"{key}_new"] for r in rows], "s-", label="after SSD")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend()
        # The change is often far smaller than the level: drawn apart, with 2 standard errors over positions
        # (positions of one row are correlated, so read the bars as a lower bound on the noise).
        ax = axes[1][col]
        diffs = [r[f"{key}_diff"] for r in rows]
        ax.bar(x, diffs, yerr=[2 * r[f"{key}_diff_se"] for r in rows], capsize=3,
               color=["tab:green" if d < 0 else "tab:red" for d in diffs])  # fmt: skip
        ax.axhline(0, color="black", lw=0.8)
        ax.set_title(f"change in {name} (after - base, +-2 SE)")
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set_xlabel("base model's top-1 probability (positions)  <- forks | locks ->")
        ax.grid(alpha=0.3)
    fig.suptitle(title or "SSD mechanism on held-out code")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m ultrascale.ssd.mechanism", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--base", required=True, help="the model before (HF directory)")
    ap.add_argument("--new", required=True, help="the model after (HF directory)")
    ap.add_argument("--data", required=True, help="a prepared dataset in the models' tokenizer (its validation split)")
    ap.add_argument("--rows", type=int, default=16, help="held-out rows to score")
    ap.add_argument("--top-k", type=int, default=20, help="the truncation's k (the tail is the mass outside it)")
    ap.add_argument("--out", type=Path, default=Path("mechanism"), help="directory for mechanism.json and .png")
    ap.add_argument("--device", default="auto", help="where the models run: auto (the GPU when there is one), cpu, "
                    "cuda, cuda:N")  # fmt: skip
    ap.add_argument("--title", default="", help="the plot's title (default: 'SSD mechanism on held-out code')")
    a = ap.parse_args(argv)
    from ultrascale.model.build import load_pretrained

    rows = held_out_rows(Path(a.data), a.rows)
    stats = {}
    for side, d in (("base", a.base), ("new", a.new)):
        model = load_pretrained(d, "fp32", a.device)
        stats[side] = {k: v.cpu() for k, v in position_stats(model, rows, a.top_k).items()}
        del model
    result = {"base": a.base, "new": a.new, "data": a.data, "rows": len(rows), "top_k": a.top_k,
              "bins": binned(stats["base"], stats["new"])}  # fmt: skip
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "mechanism.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result["bins"], a.out / "mechanism.png", a.title)
    for r in result["bins"]:
        if r["positions"]:
            print(f"{r['lo']:.2f}-{r['hi']:.2f} {r['positions']:>7} tail {r['tail_base']:.4f} -> {r['tail_new']:.4f}"
                  f" ({r['tail_diff']:+.5f} +-{2 * r['tail_diff_se']:.5f})  entropy {r['entropy_base']:.3f} -> "
                  f"{r['entropy_new']:.3f} ({r['entropy_diff']:+.4f} +-{2 * r['entropy_diff_se']:.4f})")  # fmt: skip
    return result


if __name__ == "__main__":
    main()
