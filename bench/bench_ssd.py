"""The anchor for ``python -m ultrascale.ssd``: TRL's ``SSDTrainer`` (``trl==1.15.0``) on a finished SSD round's
prompts, sampling settings, optimizer, schedule and optimizer steps, on this CPU; wall time side by side, and each
side's model saved for the same evaluation (``python -m ultrascale.ssd.evaluate``). Everything it matches is read
from the round's ``ssd_manifest.json`` and ``train_run/``. The two are different algorithms (ours samples once
from the frozen model, TRL on-policy): how they differ and how the batches are matched, bench/README.md, "SSD
against TRL's SSDTrainer".

    pip install trl==1.15.0 --no-deps     # make bench-ssd does this; it declares transformers>=4.56.2
    python bench/bench_ssd.py --run runs/ssd_smollm2_135m --out runs/trl_ssd_smollm2_135m [--json PATH]
    python bench/bench_ssd.py --run runs/ssd_smollm2_135m --table-only --compare runs/ssd_compare.json

``--compare`` adds the pass@1 of the models named ``ssd`` and ``trl`` in an evaluation's JSON to the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TRL_VERSION = "1.15.0"


def round_facts(run: Path) -> dict:
    """What the finished round did, from its own records: config, prompts, samples kept, steps and stage times."""
    from ultrascale.jsonio import read_json, read_jsonl

    top = read_json(run / "ssd_manifest.json")
    if top is None:
        raise SystemExit(f"error: {run}/ssd_manifest.json not found: run python -m ultrascale.ssd first")
    r0 = top["rounds"]["00"]
    missing = [s for s in ("problems", "sample", "sft_data", "finetune", "export") if s not in r0.get("done", [])]
    if missing:
        raise SystemExit(f"error: {run}: round 00 has not finished {missing}: run python -m ultrascale.ssd first")
    rnd = run / "round_00"
    prompts = [row["prompt"] for row in read_jsonl(rnd / "problems.jsonl")]
    return {"config": top["config"], "round": r0, "prompts": prompts, "steps": int(r0["finetune"]["steps"])}


def run_trl(facts: dict, out: Path, threads: int, seed: int) -> dict:
    """TRL's SSDTrainer with the round's settings; the time it spends generating is measured apart."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.ssd import SSDConfig, SSDTrainer

    if trl.__version__ != TRL_VERSION:
        raise SystemExit(f"error: trl {trl.__version__} is installed; the anchor is trl=={TRL_VERSION}")
    torch.set_num_threads(threads)
    cfg, ft, sp = facts["config"], facts["config"]["finetune"], facts["config"]["sample"]
    gen_s = [0.0]

    class Timed(SSDTrainer):
        def _generate_completion_ids(self, prompts):
            t0 = time.perf_counter()
            try:
                return super()._generate_completion_ids(prompts)
            finally:
                gen_s[0] += time.perf_counter() - t0

    from ultrascale.paths import resolve_path

    model_dir = str(resolve_path(cfg["start_model"]))
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # Ours packs samples into rows of sft.seq_len tokens, so its global batch (rows) holds ~2 samples per row; TRL's
    # batch counts prompts. Each prompt once in the same number of optimizer steps: len(prompts) / steps per step.
    micro = ft["micro_batch"] * ft["nproc"]
    accum = max(1, math.ceil(len(facts["prompts"]) / (facts["steps"] * micro)))
    args = SSDConfig(
        output_dir=str(out / "trl_run"),
        per_device_train_batch_size=micro,  # one process holds what our N ranks hold: the same global batch
        gradient_accumulation_steps=accum,
        max_steps=facts["steps"],
        learning_rate=ft["lr"],
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": ft["min_lr_ratio"]},
        warmup_steps=ft["warmup_steps"],
        weight_decay=ft["weight_decay"],
        adam_beta1=ft["betas"][0],
        adam_beta2=ft["betas"][1],
        optim="adamw_torch",
        temperature=sp["temperature"],
        top_k=sp["top_k"],
        top_p=sp["top_p"],
        max_completion_length=sp["max_new_tokens"],
        max_prompt_length=cfg["sft"]["seq_len"],
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=seed,
        use_cpu=True,
        bf16=False,
        dataloader_num_workers=0,
    )
    ds = Dataset.from_list([{"prompt": p} for p in facts["prompts"]])
    trainer = Timed(model=model, args=args, train_dataset=ds, processing_class=tok)
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    trainer.save_model(str(out / "model"))
    tok.save_pretrained(str(out / "model"))
    save_s = time.perf_counter() - t1
    logs = [h for h in trainer.state.log_history if "ssd/active_sample_ratio" in h]
    return {
        "prompts": len(facts["prompts"]),
        "samples": facts["steps"] * args.generation_batch_size,
        "kept_ratio": sum(h["ssd/active_sample_ratio"] for h in logs) / max(1, len(logs)),
        "mean_completion_tokens": sum(h["completions/mean_length"] for h in logs) / max(1, len(logs)),
        "optimizer_steps": trainer.state.global_step,
        "sample_s": round(gen_s[0], 1),
        "train_s": round(train_s - gen_s[0], 1),
        "export_s": round(save_s, 1),
        "total_s": round(train_s + save_s, 1),
        "losses": [h.get("ssd/cross_entropy_loss") for h in logs],
        "setup": {"trl": trl.__version__, "processes": 1, "threads": threads, "per_device_batch": micro,
                  "gradient_accumulation": accum, "steps_per_generation": args.steps_per_generation,
                  "generation_batch_size": args.generation_batch_size, "model": str(out / "model")},
    }  # fmt: skip


def ours_row(facts: dict) -> dict:
    r0 = facts["round"]
    s = r0["sample"]
    walls = {k: r0[k]["wall_s"] for k in ("sample", "sft_data", "finetune", "export")}
    return {
        "prompts": len(facts["prompts"]),
        "samples": s["sampled"],
        "kept_ratio": s["kept"] / max(1, s["sampled"]),
        "optimizer_steps": facts["steps"],
        "sample_s": walls["sample"],
        "train_s": round(walls["sft_data"] + walls["finetune"], 1),
        "export_s": walls["export"],
        "total_s": round(sum(walls.values()), 1),
        "setup": {"processes": facts["config"]["finetune"]["nproc"], "threads": facts["config"]["threads"]},
    }


def pass_at_1(compare: Path | None) -> dict:
    """name -> (test pass@1, chosen setting, CI vs base) for each model of an evaluation's JSON."""
    if not compare:
        return {}
    res = json.loads(compare.read_text())
    he = res["sets"]["humaneval"]["models"]
    out = {}
    for name, m in he.items():
        vs = next((v for k, v in m.items() if k.startswith("vs_")), None)
        out[name] = {"test_pass@1": m["test_pass@1"], "setting": m["chosen_setting"]["name"],
                     "vs_base": vs}  # fmt: skip
    return out


def print_table(rows: dict[str, dict], scores: dict) -> None:
    print(f"\n{'side':<6}{'prompts':>8}{'samples':>9}{'kept':>7}{'steps':>7}{'sample s':>10}{'train s':>9}"
          f"{'export s':>10}{'total s':>9}  {'HumanEval test pass@1 (setting chosen on dev)'}")  # fmt: skip
    for side, r in rows.items():
        sc = scores.get("ssd" if side == "ours" else side)
        p = f"{sc['test_pass@1']:.4f} ({sc['setting']})" if sc else "-"
        print(f"{side:<6}{r['prompts']:>8}{r['samples']:>9}{r['kept_ratio']:>7.2f}{r['optimizer_steps']:>7}"
              f"{r['sample_s']:>10.1f}{r['train_s']:>9.1f}{r['export_s']:>10.1f}{r['total_s']:>9.1f}  {p}")  # fmt: skip
    if "ours" in rows and "trl" in rows:
        print(f"wall time trl / ours: {rows['trl']['total_s'] / rows['ours']['total_s']:.2f}x")
    if "base" in scores:
        print(f"base: {scores['base']['test_pass@1']:.4f} ({scores['base']['setting']})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, default=ROOT / "runs" / "ssd_smollm2_135m",
                    help="a finished python -m ultrascale.ssd output_dir (its round 00 is matched)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "trl_ssd_smollm2_135m",
                    help="where TRL's run and its model (out/model) go")  # fmt: skip
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads for TRL's one process")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--table-only", action="store_true", help="re-print from --json's earlier TRL row")
    ap.add_argument("--compare", type=Path, help="an evaluation's JSON: adds each side's pass@1")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "bench_ssd.json")
    a = ap.parse_args()
    facts = round_facts(a.run)
    rows = {"ours": ours_row(facts)}
    if a.table_only:
        if not a.json.exists():
            raise SystemExit(
                f"error: --table-only reads {a.json}, which does not exist: run without --table-only first"
            )
        rows["trl"] = json.loads(a.json.read_text())["trl"]
    else:
        print(f"trl SSDTrainer on {len(facts['prompts'])} prompts of {a.run}, {facts['steps']} optimizer steps ...",
              flush=True)  # fmt: skip
        rows["trl"] = run_trl(facts, a.out, a.threads, a.seed)
    scores = pass_at_1(a.compare)
    print_table(rows, scores)
    if a.json and not a.table_only:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({**rows, "pass@1": scores, "run": str(a.run)}, indent=2) + "\n")


if __name__ == "__main__":
    main()
