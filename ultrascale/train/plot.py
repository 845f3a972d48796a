"""``curves.png``: loss, lr, throughput and memory on one page, for people who would rather look than read."""

from __future__ import annotations

from pathlib import Path


def plot_curves(history: list[dict], out_path: Path, title: str = "") -> Path | None:
    rows = [r for r in history if "loss" in r]
    if len(rows) < 2:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    ax = axes[0][0]
    ax.plot(steps, [r["loss"] for r in rows], label="train", lw=1.2)
    ev = [r for r in history if "eval_loss" in r]
    if ev:
        ax.plot([r["step"] for r in ev], [r["eval_loss"] for r in ev], "o-", label="held-out", lw=1.5)
    ax.set_title("loss")
    ax.set_xlabel("step")
    ax.legend()
    ax.grid(alpha=0.3)
    panels = [
        (axes[0][1], "lr", "learning rate", None),
        (axes[1][0], "tokens_per_s", "tokens/s (job)", "mfu"),
        (axes[1][1], "mem_gb", "memory per rank (GiB)", "grad_norm"),
    ]
    for ax, key, name, twin_key in panels:
        ax.plot(steps, [r.get(key, float("nan")) for r in rows], lw=1.2, color="C0")
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if twin_key and any(twin_key in r for r in rows):
            tw = ax.twinx()
            tw.plot(steps, [r.get(twin_key, float("nan")) for r in rows], lw=0.8, color="C3", alpha=0.7)
            tw.set_ylabel(twin_key, color="C3")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path
