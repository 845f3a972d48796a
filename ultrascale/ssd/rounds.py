"""Rounds of self-distillation, each a chain of stages that a rerun skips once done.

Under ``<output_dir>``: ``ssd_manifest.json`` (config, baseline eval, finished stages per round),
``baseline/eval.json`` (HumanEval of the starting model) and one ``round_XX/`` per round with its
``manifest.json`` and each stage's output (the files: ultrascale/ssd/README.md, "What a round does").

Each stage writes its output atomically (a temporary name, then a rename) and is marked done in the round
manifest last, so a killed run leaves either a finished stage or one that reruns from scratch; a killed
finetune resumes from its newest checkpoint through train.py's own auto-resume. A stage remembers the
settings it ran with: rerunning a finished stage's directory with different settings is an error (the
outputs would mix two configurations), except for the evaluation, which is simply redone.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from ultrascale.config.convert import plain
from ultrascale.data.tokcheck import check_tokenizer
from ultrascale.errors import ConfigError, DataError
from ultrascale.jsonio import read_json, read_jsonl, write_json, write_jsonl
from ultrascale.paths import resolve_path
from ultrascale.ssd.config import STAGES, SSDConfig, Stage

log = logging.getLogger("ultrascale")

OUTPUTS = {
    Stage.problems: ["problems.jsonl"],
    Stage.sample: ["samples.jsonl", "kept.jsonl"],
    Stage.sft_data: ["sft_data"],
    Stage.finetune: ["train_run", "finetune.log"],
    Stage.export: ["model", "model_steps"],
    Stage.eval: ["eval", "eval.json"],
}
"""What each stage writes: a stage that (re)runs removes every later stage's outputs, which were made from
the old ones (above all train_run/, whose checkpoints train.py would otherwise resume on the new data)."""
REDO_ON_CHANGE = {Stage.eval}
"""Stages nothing else depends on: changed settings rerun them instead of refusing."""
TOP = "ssd_manifest.json"


def check_model_dir(path: Path, key: str) -> None:
    if not (path / "config.json").exists():
        raise ConfigError(f"{key}={path} has no config.json: point it at a local HF model directory")
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ConfigError(f"{key}={path} has no tokenizer: SSD samples and finetunes with the model's own tokenizer")


class Round:
    """One round's directory and manifest."""

    def __init__(self, run: SSDRun, index: int, input_model: Path):
        self.run, self.index, self.input_model = run, index, input_model
        self.dir = run.out / f"round_{index:02d}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.manifest_path = self.dir / "manifest.json"
        self.manifest = read_json(self.manifest_path, {}) or {
            "round": index,
            "input_model": str(input_model),
            "stages": {},
        }

    def settings(self, stage: Stage) -> dict:
        """What a stage's output depends on; a finished stage with other settings cannot be reused."""
        c = self.run.cfg
        per_stage = {
            Stage.problems: {"problems": c.problems},
            Stage.sample: {"sample": c.sample, "dtype": c.dtype, "input_model": str(self.input_model)},
            Stage.sft_data: {"sft": c.sft},
            Stage.finetune: {"finetune": c.finetune},
            Stage.export: {"export_dtype": c.finetune.export_dtype},
            Stage.eval: {"eval": c.eval},
        }[stage]
        return json.loads(json.dumps(plain(per_stage)))

    def done(self, stage: Stage) -> bool:
        entry = self.manifest["stages"].get(stage)
        if not entry or not entry.get("done"):
            return False
        now = self.settings(stage)
        if entry.get("settings") == now:
            return True
        changed = sorted(_diff(entry.get("settings", {}), now))
        if stage in REDO_ON_CHANGE:
            log.info(f"ssd: round {self.index} {stage} ran with other settings ({', '.join(changed)}): redoing it")
            return False
        raise ConfigError(
            f"{self.dir} finished stage {stage!r} with different settings ({', '.join(changed)}): rerun with the "
            f"original settings, use a new output_dir, or delete {self.dir} to redo the round"
        )

    def mark(self, stage: Stage, stats: dict, wall_s: float) -> None:
        """Record a finished stage: round manifest first, then the top-level summary."""
        self.manifest["stages"][stage] = {
            "done": True,
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "wall_s": round(wall_s, 1),
            "settings": self.settings(stage),
            **stats,
        }
        write_json(self.manifest_path, self.manifest)
        self.run.record_round(self)

    def path(self, name: str) -> Path:
        return self.dir / name

    def invalidate_after(self, stage: Stage) -> None:
        """Forget and delete every stage after ``stage``: they would be built on outputs about to change."""
        later = STAGES[STAGES.index(stage) + 1 :]
        stale = [s for s in later if s in self.manifest["stages"] or any(self.path(o).exists() for o in OUTPUTS[s])]
        if not stale:
            return
        log.info(f"ssd: round {self.index} {stage} reruns: removing the later stages {stale}")
        for s in stale:
            self.manifest["stages"].pop(s, None)
            for o in OUTPUTS[s]:
                if self.path(o).is_dir():
                    shutil.rmtree(self.path(o))
                else:
                    self.path(o).unlink(missing_ok=True)
        write_json(self.manifest_path, self.manifest)


def _diff(a: dict, b: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += _diff(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}: {va!r} -> {vb!r}")
    return out


class SSDRun:
    def __init__(self, cfg: SSDConfig):
        self.cfg = cfg
        self.out = resolve_path(cfg.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.top_path = self.out / TOP
        self.top = read_json(self.top_path, {}) or {"rounds": {}, "baseline": None}
        self.top["config"] = plain(cfg)

    def record_round(self, rnd: Round) -> None:
        stages = rnd.manifest["stages"]
        entry = {
            "dir": str(rnd.dir),
            "input_model": str(rnd.input_model),
            "done": [s for s in STAGES if stages.get(s, {}).get("done")],
        }
        for s in STAGES:
            if s in stages:
                entry[s] = {k: v for k, v in stages[s].items() if k not in ("settings", "done", "finished_at")}
        self.top["rounds"][f"{rnd.index:02d}"] = entry
        write_json(self.top_path, self.top)

    def stage(self, rnd: Round, name: Stage, fn: Callable[[], dict]) -> None:
        if rnd.done(name):
            log.info(f"ssd: round {rnd.index} {name}: done, skipping")
            return
        log.info(f"ssd: round {rnd.index} {name}: running")
        rnd.invalidate_after(name)
        t0 = time.perf_counter()
        stats = fn()
        rnd.mark(name, stats, time.perf_counter() - t0)
        log.info(f"ssd: round {rnd.index} {name}: done in {time.perf_counter() - t0:.1f}s {_short(stats)}")

    # ---- the stages --------------------------------------------------------------------------------------
    def _problems(self, rnd: Round) -> dict:
        from ultrascale.config.problems import ProblemSource
        from ultrascale.eval.problems import build
        from ultrascale.ssd.config import Method

        if rnd.index > 0:  # later rounds revisit the same problems with a better model (STaR / ReST style)
            first = self.out / "round_00" / "problems.jsonl"
            shutil.copyfile(first, rnd.path("problems.jsonl.tmp"))
            rnd.path("problems.jsonl.tmp").replace(rnd.path("problems.jsonl"))
            return {"count": len(read_jsonl(first)), "from": str(first)}
        if self.cfg.method == Method.ssd:  # prompts only: no tests, no reference checked in the sandbox
            from ultrascale.data.prompts import build_prompts, jsonl_prompts

            if self.cfg.problems.source == ProblemSource.jsonl:
                problems, report = jsonl_prompts(self.cfg.problems)  # decontaminated like the corpus's
            else:
                problems, report = build_prompts(self.cfg.problems)
        else:
            problems, report = build(self.cfg.problems)
        write_jsonl(rnd.path("problems.jsonl"), problems)
        return {"count": len(problems), "report": report}

    def _sample(self, rnd: Round) -> dict:
        from ultrascale.ssd.config import Method
        from ultrascale.ssd.sample import generate_all, kept_records, select, select_raw

        problems = read_jsonl(rnd.path("problems.jsonl"))
        raw = self.cfg.method == Method.ssd
        completions, timing = generate_all(
            rnd.input_model, problems, self.cfg.sample, self.cfg.dtype, details=raw, device=str(self.cfg.device)
        )
        if raw:  # the paper's filter: empty responses and single-line stubs, nothing executed
            rows, stats = select_raw(problems, completions)
        else:
            rows, stats = select(problems, completions, self.cfg.sample)
        write_jsonl(rnd.path("samples.jsonl"), rows)
        write_jsonl(rnd.path("kept.jsonl"), kept_records(problems, rows))
        return {**stats, **timing}

    def _sft(self, rnd: Round) -> dict:
        from ultrascale.ssd.sft import build

        kept = read_jsonl(rnd.path("kept.jsonl"))
        if not kept and self.cfg.method == "ssd":
            s = rnd.manifest["stages"][Stage.sample]
            raise DataError(
                f"round {rnd.index}: all {s['sampled']} samples were empty or single-line stubs "
                f"({rnd.path('samples.jsonl')}): nothing to finetune on; check the prompts and sample.max_new_tokens"
            )
        if not kept:
            s = rnd.manifest["stages"][Stage.sample]
            raise DataError(
                f"round {rnd.index}: none of the {s['candidates']} samples passed its tests "
                f"({rnd.path('samples.jsonl')} has each one's error): nothing to finetune on. Sample more "
                "(sample.n, sample.temperature), add solutions (extra_candidates in a problems.jsonl), or start "
                "from a stronger model (start_model=<a CPT export>)"
            )
        return build(kept, rnd.input_model, rnd.path("sft_data"), self.cfg.sft, self.cfg.sample.heal_newline)

    def _finetune(self, rnd: Round) -> dict:
        from ultrascale.ssd.finetune import finished, require_finished, run_train, steps_for, train_overrides

        rows = rnd.manifest["stages"][Stage.sft_data]["train_rows"]
        steps = steps_for(rows, self.cfg.finetune)
        run_dir = rnd.path("train_run")
        args = train_overrides(
            self.cfg.finetune, rnd.input_model, rnd.path("sft_data"), run_dir, steps, self.cfg.sft.seq_len
        )
        # in-process and before train.py's ranks start: the same refusal train.py's preflight makes, cheaper
        check_tokenizer(rnd.path("sft_data"), "sft_data", rnd.input_model, f"round {rnd.index}'s input model")
        if finished(run_dir, steps):
            log.info(f"ssd: {run_dir} already holds step {steps}: not relaunching")
        else:
            run_train(args, rnd.path("finetune.log"))
            require_finished(run_dir, steps)
        summary = read_json(run_dir / "summary.json", {})
        keep = ("final_loss", "eval_loss", "tokens_per_s", "resumed_from")
        numbers = {k: summary[k] for k in keep if isinstance(summary.get(k), int | float) and math.isfinite(summary[k])}
        return {"steps": steps, "rows": rows, "command": "python train.py " + " ".join(args), **numbers}

    def _export(self, rnd: Round) -> dict:
        from ultrascale.ssd.finetune import export_checkpoints, export_model

        stats = export_model(rnd.path("train_run"), rnd.path("model"), self.cfg.finetune.export_dtype)
        if self.cfg.finetune.keep_checkpoints > 1:  # the earlier checkpoints too: candidates to choose on dev
            stats["candidates"] = [*export_checkpoints(rnd.path("train_run"), rnd.path("model_steps"),
                                                       self.cfg.finetune.export_dtype), str(rnd.path("model"))]  # fmt: skip
        return stats

    def _eval(self, rnd: Round) -> dict:
        from ultrascale.ssd.evaluate import humaneval

        result = humaneval(rnd.path("model"), rnd.path("eval"), self.cfg.eval)
        write_json(rnd.path("eval.json"), result)
        return _scores(result)

    def baseline(self, model: Path) -> None:
        """HumanEval of the starting model, once (redone only if the eval settings change)."""
        from ultrascale.ssd.evaluate import humaneval

        settings = json.loads(json.dumps(plain(self.cfg.eval)))
        prev = self.top.get("baseline")
        if prev and prev.get("settings") == settings and prev.get("model") == str(model):
            log.info("ssd: baseline eval: done, skipping")
            return
        log.info(f"ssd: baseline eval of {model}: running")
        result = humaneval(model, self.out / "baseline" / "eval", self.cfg.eval)
        write_json(self.out / "baseline" / "eval.json", result)
        self.top["baseline"] = {"model": str(model), "settings": settings, **_scores(result)}
        write_json(self.top_path, self.top)

    def run(self) -> dict:
        from ultrascale.eval.sandbox import check_available
        from ultrascale.ssd.config import Method, check, zero_signal

        cfg = self.cfg
        check(cfg)
        model = resolve_path(cfg.start_model)
        check_model_dir(model, "start_model")
        if cfg.method == Method.rft or cfg.eval.enabled:
            check_available()  # these stages run model-written code: refuse before any work
        if cfg.method == Method.ssd and zero_signal(cfg.sample):
            log.warning(
                "ssd: warning: sample.temperature=1 with sample.top_k=0 and sample.top_p=1 samples the model's own "
                "distribution, which the SSD paper shows gives zero expected gradient: set a training temperature "
                "and truncation (e.g. sample.temperature=1.6 sample.top_k=20 sample.top_p=0.8)"
            )
        log.info(
            f"ssd: method={cfg.method} ({'raw samples, nothing executed' if cfg.method == Method.ssd else 'samples executed, passing ones kept'})"
        )
        if cfg.threads:
            import torch

            torch.set_num_threads(int(cfg.threads))
        start = model
        for r in range(cfg.rounds):
            rnd = Round(self, r, model)
            steps = {
                Stage.problems: lambda rnd=rnd: self._problems(rnd),
                Stage.sample: lambda rnd=rnd: self._sample(rnd),
                Stage.sft_data: lambda rnd=rnd: self._sft(rnd),
                Stage.finetune: lambda rnd=rnd: self._finetune(rnd),
                Stage.export: lambda rnd=rnd: self._export(rnd),
                Stage.eval: lambda rnd=rnd: self._eval(rnd),
            }
            for name in STAGES:
                if name == Stage.eval and not cfg.eval.enabled:
                    continue
                if name == Stage.eval and r == 0 and cfg.eval.baseline:
                    self.baseline(start)  # the 'before', scored just before the first 'after'
                self.stage(rnd, name, steps[name])
                if name == cfg.stop_after and r == cfg.rounds - 1:
                    log.info(f"ssd: stopping after {name} (stop_after={name}); rerun without it to go on")
                    print(summary_table(self.top), flush=True)
                    return self.top
            model = rnd.path("model")
        print(summary_table(self.top), flush=True)
        return self.top


def _scores(result: dict) -> dict:
    g, s = result["greedy"], result.get("sampled")
    out = {"pass@1_greedy": g["pass@1"], "humaneval_problems": g["problems"], "eval_wall_s": result["wall_s"]}
    if s:
        out.update({f"{k}_sampled": v for k, v in s.items() if k.startswith("pass@")})
        out["sampled_n"] = s["n_samples"]
    return out


def _short(stats: dict) -> str:
    keys = (
        "count",
        "candidates",
        "kept",
        "model_pass_rate",
        "samples",
        "train_rows",
        "steps",
        "final_loss",
        "model_mb",
    )
    shown = {k: stats[k] for k in keys if k in stats}
    shown.update({k: v for k, v in stats.items() if k.startswith("pass@")})
    return json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in shown.items()})


def summary_table(top: dict) -> str:
    """Before/after at a glance: what the closing note of a run reports."""
    lines = [
        f"{'':<10} {'problems':>8} {'samples':>8} {'passed':>7} {'kept':>5} {'steps':>5} {'pass@1':>7} {'wall_s':>8}"
    ]
    b = top.get("baseline")
    if b:
        lines.append(
            f"{'baseline':<10} {'':>8} {'':>8} {'':>7} {'':>5} {'':>5} {b['pass@1_greedy']:>7.4f} {b['eval_wall_s']:>8}"
        )
    for r, e in sorted(top["rounds"].items()):
        s, ft, ev = e.get("sample", {}), e.get("finetune", {}), e.get("eval", {})
        wall = sum(e.get(k, {}).get("wall_s", 0) for k in STAGES)
        p1 = f"{ev['pass@1_greedy']:.4f}" if "pass@1_greedy" in ev else "-"
        lines.append(
            f"{'round ' + r:<10} {e.get('problems', {}).get('count', '-'):>8} {s.get('candidates', '-'):>8} "
            f"{(s['model_passed'] + s.get('provided_passed', 0)) if 'model_passed' in s else '-':>7} "
            f"{s.get('kept', '-'):>5} "
            f"{ft.get('steps', '-'):>5} {p1:>7} {round(wall, 1):>8}"
        )
    he = (top.get("baseline") or {}).get("humaneval_problems")
    if he:
        lines.append(f"pass@1: greedy HumanEval on {he} problems")
    return "\n".join(lines)
