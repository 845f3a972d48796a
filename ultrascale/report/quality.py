"""``python -m ultrascale.report.quality``: the figure a fine-tuning result is read from: training and held-out loss
against tokens trained, beside HumanEval pass@1 of each exported checkpoint against the same tokens.

A before/after number alone cannot tell an undertrained recipe from one that overfits or one whose loss falls
without the benchmark moving; the two panels on one token axis can. The pass@1 points come from
``python -m ultrascale.ssd.evaluate --out`` (its dev-half grid: every candidate checkpoint, the base at 0 tokens),
each checkpoint placed by the step ``python -m ultrascale.export`` recorded in its ``ultrascale_export.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ultrascale.atomic import atomic_write_bytes
from ultrascale.errors import ConfigError, DataError, UltrascaleError
from ultrascale.report.load import Run, load_run


def tokens_per_step(run: Run) -> int:
    """The run's tokens per optimizer step: its config's batch, else ``summary.json``'s tokens over steps."""
    gb, seq = run.cfg("data.global_batch"), run.cfg("data.seq_len")
    if gb and seq:
        return int(gb) * int(seq)
    s = run.summary
    if s.get("tokens") and s.get("steps"):
        return round(s["tokens"] / s["steps"])
    raise DataError(f"{run.path}: neither config.yaml nor summary.json gives the tokens per step")


def checkpoint_step(model_dir: str) -> int | None:
    """The training step an exported model was taken at (None for a model that is not an export: the base)."""
    meta = Path(model_dir) / "ultrascale_export.json"
    return int(json.loads(meta.read_text())["step"]) if meta.exists() else None


def pass_at_1_points(result: dict, per_step: int, set_name: str = "humaneval") -> dict[str, list[tuple[int, float]]]:
    """Per model of an evaluate result: (tokens trained, greedy dev pass@1) for each candidate, sorted by tokens;
    the base model's candidates sit at 0."""
    models = result["sets"][set_name]["models"]
    out: dict[str, list[tuple[int, float]]] = {}
    for name, m in models.items():
        pts = []
        for key, score in m["dev_grid"].items():
            cand, setting = key.split("|", 1)
            if setting != "greedy":
                continue
            step = checkpoint_step(cand)
            pts.append((0 if step is None else step * per_step, score))
        out[name] = sorted(pts)
    return out


def loss_points(run: Run, per_step: int) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(tokens trained, loss) of the logged steps and of the held-out evals (eval events, step 0 where the run
    evaluated at start), on one tokens axis."""
    train = [(r["step"] * per_step, r["loss"]) for r in run.curve() if "loss" in r]
    held = [(r["step"] * per_step, r["eval_loss"]) for r in run.eval_curve()]
    return train, held


def prompt_label(result: dict) -> str:
    """How the models were asked and where their completions ended, from an evaluate result: ``chat prompt``,
    ``plain prompt``, or ``plain prompt + fence stop`` (``--stop-fence``)."""
    prompt = result.get("prompt", "plain")
    fenced = prompt == "plain" and any(s.strip() == "```" for s in result.get("stops", ()))
    return f"{prompt} prompt" + (" + fence stop" if fenced else "")


def draw(run_dir: Path, evals: list[Path], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import io

    import matplotlib.pyplot as plt

    run = load_run(run_dir)  # one clear line for a missing dir or metrics; after a rollback the last row wins
    per_step = tokens_per_step(run)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5.5))
    train, held = loss_points(run, per_step)
    if train:
        left.plot(*zip(*train), lw=1.2, label="training loss")
    if held:
        left.plot(*zip(*held), "o-", lw=1.5, label="held-out loss")
    left.set(title=f"loss ({run_dir.name})", xlabel="tokens trained", ylabel="loss")
    left.grid(alpha=0.3)
    left.legend()
    for path in evals:
        result = json.loads(path.read_text())
        he = result["sets"]["humaneval"]
        base, *rest = list(he["models"])
        points = pass_at_1_points(result, per_step)
        prompt = prompt_label(result)
        for name in rest:
            pts = points[base][:1] + points[name]  # the base at 0 tokens, then each checkpoint
            m = he["models"][name]
            vs = m.get(f"vs_{base}", {})
            label = (f"{name}, {prompt}: dev pass@1 (test {m['test_pass@1']:.3f} vs base "
                     f"{he['models'][base]['test_pass@1']:.3f}, diff {vs.get('diff', 0):+.3f} "
                     f"[{vs.get('lo', 0):+.3f}, {vs.get('hi', 0):+.3f}])")  # fmt: skip
            right.plot(*zip(*pts), "o-", lw=1.5, label=label)
    right.set(title=f"HumanEval pass@1, greedy, dev half ({len(he['split']['dev'])} problems)",
              xlabel="tokens trained", ylabel="pass@1")  # fmt: skip
    right.grid(alpha=0.3)
    right.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14))  # below: the curves stay visible
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, buf.getvalue())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ultrascale.report.quality", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--run", type=Path, required=True, help="the fine-tuning run's output_dir (metrics.jsonl)")
    ap.add_argument("--eval", type=Path, action="append", required=True,
                    help="an `ultrascale.ssd.evaluate --out` JSON whose candidates are the run's exports (repeat)")  # fmt: skip
    ap.add_argument("--out", type=Path, required=True, help="the PNG to write")
    a = ap.parse_args(argv)
    try:
        for p in a.eval:
            if not p.exists():
                raise ConfigError(f"--eval {p}: no such file (an `ultrascale.ssd.evaluate --out` JSON)")
        print(f"wrote {draw(a.run, a.eval, a.out)}")
    except UltrascaleError as e:
        print(f"error: {e}", flush=True)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
