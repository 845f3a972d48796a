"""A before/after a reviewer would accept: settings chosen on dev, reported on test, a paired bootstrap CI.

``python -m ultrascale.ssd.evaluate`` (this module's :func:`main`) scores any models on HumanEval, split once
by seed into a dev half and a test half (recorded in the output), and optionally on a second set: problems
with tests mined from the corpus's *validation* repositories, which no SSD prompt comes from. For each model,
every candidate checkpoint x decoding setting of the grid (greedy, and each T_eval with and without the
truncation) is scored on the dev half by the unbiased per-problem pass@1; the best on dev is scored on the test
half; each model after the first is compared with the first on the test half by a paired bootstrap over
problems (:mod:`ultrascale.eval.stats`): an interval that holds 0 is reported as "no measurable gain". Nothing is
tuned on the test half: the test half is generated only for the chosen setting.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from ultrascale.eval.stats import choose_on_dev, paired_bootstrap, per_problem_pass_at_k, split_dev_test, verdict_of

log = logging.getLogger("ultrascale")


@dataclass(frozen=True)
class Setting:
    """One decoding setting of the T_eval grid; ``temperature`` 0 is greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def name(self) -> str:
        if self.temperature <= 0:
            return "greedy"
        return f"T={self.temperature:g},top_k={self.top_k},top_p={self.top_p:g}"


def grid(temperatures: Sequence[float], top_k: int, top_p: float) -> list[Setting]:
    """Greedy, then each T_eval without truncation and with the (top_k, top_p) truncation: the paper decodes its
    SSD models at a separate evaluation temperature with the training truncation, and the base model deserves the
    same search."""
    out = [Setting()]
    for t in temperatures:
        out.append(Setting(float(t), 0, 1.0))
        if top_k or top_p < 1:
            out.append(Setting(float(t), int(top_k), float(top_p)))
    return out


Scorer = Callable[[str, list[dict], Setting, int], dict[str, float]]
"""(model_dir, problems, setting, n samples) -> per-problem pass@1."""


def completion_stops(chat: bool = False, fence: bool = False) -> tuple[str, ...]:
    """Where a completion ends: HumanEval's next top-level statement, and a code fence for a chat prompt or when
    asked (``fence``). A chat-tuned model asked in plain completion writes the body, then closes its 'code block'
    and explains it; without the fence stop that prose is scored as Python (a SyntaxError), which measures the
    format and not the code. bigcode-evaluation-harness stops HumanEval at a fence for the same reason."""
    from ultrascale.data.instruct_format import FENCE
    from ultrascale.eval.humaneval import STOP_SEQUENCES

    return (*STOP_SEQUENCES, FENCE) if chat or fence else STOP_SEQUENCES


def sandbox_scorer(max_new_tokens: int = 256, batch_size: int = 32, seed: int = 1234, workers: int = 2,
                   device: str = "auto", chat: bool = False, fence: bool = False) -> Scorer:  # fmt: skip
    """Generate with the project's sampler and run every completion in the kernel sandbox (HumanEval's programs
    for HumanEval problems, SSD's for mined ones). Models are loaded once and kept while their candidates are
    scored. ``chat``: each model is asked in its own chat template, the answer prefilled up to the body
    (:func:`ultrascale.data.instruct_format.chat_prompt`, the instruction set's own turns), and a closing code
    fence ends the body; the program scored is still the problem's prompt + the body. ``fence``: a fence ends
    a plain completion too (:func:`completion_stops`)."""
    from ultrascale.data.instruct_format import chat_prompt
    from ultrascale.eval.humaneval import check_program, generate
    from ultrascale.eval.sandbox import Limits, run_many

    cache: dict[str, tuple] = {}

    def score(model_dir: str, problems: list[dict], setting: Setting, n: int) -> dict[str, float]:
        from transformers import AutoTokenizer

        from ultrascale.model.build import load_pretrained

        if model_dir not in cache:
            cache.clear()  # one model in memory at a time
            model = load_pretrained(model_dir, "fp32", device)
            cache[model_dir] = (model, AutoTokenizer.from_pretrained(model_dir))
        model, tok = cache[model_dir]
        greedy = setting.temperature <= 0
        n = 1 if greedy else n
        prompts = [chat_prompt(tok, p["prompt"]) if chat else p["prompt"] for p in problems]
        completions = generate(model, tok, prompts, n_samples=n, temperature=setting.temperature,
                               top_k=setting.top_k, top_p=setting.top_p, max_new_tokens=max_new_tokens,
                               batch_size=batch_size, seed=seed,
                               stops=completion_stops(chat, fence))  # fmt: skip
        programs = [check_program({"prompt": p["prompt"], "test": p.get("test", p.get("tests")),
                                   "entry_point": p["entry_point"]}, c) for p, cs in zip(problems, completions)
                    for c in cs]  # fmt: skip
        outcomes = run_many(programs, Limits(), workers=workers)
        passed = {p["task_id"]: [o.passed for o in outcomes[i * n : (i + 1) * n]] for i, p in enumerate(problems)}
        return per_problem_pass_at_k(passed, k=1)

    return score


_FINGERPRINTS: dict[tuple, str] = {}


def model_fingerprint(model_dir: str | Path) -> str:
    """sha256 over a model directory's files (weights, config, tokenizer): what decides its completions.

    The score cache is keyed by it, not by the path or the files' names, sizes and times: a copy of a model
    elsewhere is the same model, and a directory retrained in place is another one even when its files keep
    their sizes and modification times (``cp -p``, ``rsync -a``, a restored backup). Hashed once per process per
    file state (the change time moves on every write, ``utime`` included).
    """
    d = Path(model_dir)
    files = sorted(f for f in d.iterdir() if f.is_file()) if d.is_dir() else []
    state = tuple((f.name, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) for f in files for st in [f.stat()])
    memo = (str(d.resolve()), state)
    if memo not in _FINGERPRINTS:
        h = hashlib.sha256()
        for f in files:
            h.update(f.name.encode() + b"\0")
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 24):
                    h.update(chunk)
            h.update(b"\0")
        _FINGERPRINTS[memo] = h.hexdigest()
    return _FINGERPRINTS[memo]


def cached(scorer: Scorer, path: Path, tag: str = "") -> Scorer:
    """``scorer`` with its results kept in a JSON-lines file, one line per (model content, problems, setting, n):
    an evaluation killed after hours resumes where it stopped, and a later run with one more model re-scores only
    that model. The model is keyed by :func:`model_fingerprint`, so a retrained directory never hits a stale line
    and a copy of a scored model is not scored twice; a line torn by a kill is ignored."""
    store: dict[str, dict[str, float]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
                store[row["key"]] = row["scores"]
            except (json.JSONDecodeError, KeyError, TypeError):
                continue

    def key(model_dir: str, problems: list[dict], setting: Setting, n: int) -> str:
        ids = hashlib.sha256("\n".join(p["task_id"] for p in problems).encode()).hexdigest()[:16]
        n = 1 if setting.temperature <= 0 else n
        return json.dumps([model_fingerprint(model_dir), ids, setting.name, n, tag])

    def score(model_dir: str, problems: list[dict], setting: Setting, n: int) -> dict[str, float]:
        k = key(model_dir, problems, setting, n)
        if k in store:
            log.info(f"compare: {model_dir} {setting.name} n={n}: from {path}")
            return store[k]
        store[k] = scorer(model_dir, problems, setting, n)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps({"key": k, "scores": store[k]}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return store[k]

    return score


def evaluate_set(
    problems: list[dict],
    models: dict[str, list[str]],
    settings: list[Setting],
    scorer: Scorer,
    n_dev: int,
    n_test: int,
    seed: int = 0,
    n_boot: int = 10000,
) -> dict:
    """One problem set: the split, each model's dev grid and choice, its test score, and each model against the
    first (the base) by a paired bootstrap on the test half."""
    by_id = {p["task_id"]: p for p in problems}
    split = split_dev_test(list(by_id), seed=seed)
    dev, test = [by_id[t] for t in split["dev"]], [by_id[t] for t in split["test"]]
    out: dict = {"split": split, "n_dev": n_dev, "n_test": n_test, "models": {}}
    test_scores: dict[str, dict[str, float]] = {}
    for name, candidates in models.items():
        t0 = time.perf_counter()
        per_setting = {}
        for cand in candidates:
            for s in settings:
                per_setting[f"{cand}|{s.name}"] = scorer(cand, dev, s, n_dev)
                log.info(f"compare: {name} {cand} {s.name}: dev pass@1 {_mean(per_setting[f'{cand}|{s.name}']):.4f}")
        chosen, dev_score = choose_on_dev(per_setting, split["dev"], prefer=_preference(candidates, settings))
        cand, setting_name = chosen.split("|", 1)
        setting = next(s for s in settings if s.name == setting_name)
        test_scores[name] = scorer(cand, test, setting, n_test)
        out["models"][name] = {
            "candidates": list(candidates),
            "chosen_checkpoint": cand,
            "chosen_setting": asdict(setting) | {"name": setting.name},
            "dev_pass@1": dev_score,
            "test_pass@1": _mean(test_scores[name]),
            "dev_grid": {k: _mean(v) for k, v in per_setting.items()},
            "wall_s": round(time.perf_counter() - t0, 1),
        }
    names = list(models)
    for name in names[1:]:
        ci = paired_bootstrap(
            test_scores[names[0]], test_scores[name], problems=split["test"], n_boot=n_boot, seed=seed
        )
        out["models"][name]["vs_" + names[0]] = {**ci, "verdict": verdict_of(ci)}
    return out


def _preference(candidates: Sequence[str], settings: Sequence[Setting]) -> Callable[[str], tuple[int, int, int]]:
    """The order ties on dev are broken in: greedy first (one sample per problem, and the same answer on every run:
    a sampled setting that only ties it is not worth n times the generation), then the grid's order, then the
    candidates' order as listed. With every dev score 0 (a weak model on a hard set) this picks greedy, not
    whichever setting's name sorts first."""
    rank = {s.name: i for i, s in enumerate(settings)}
    order = {c: i for i, c in enumerate(candidates)}

    def key(name: str) -> tuple[int, int, int]:
        cand, setting = name.split("|", 1)
        return (0 if setting == Setting().name else 1, rank[setting], order[cand])

    return key


def _mean(scores: dict[str, float]) -> float:
    return sum(scores.values()) / len(scores) if scores else 0.0


def table(result: dict, runs: dict[str, dict] | None = None) -> str:
    """Base, SSD and RFT side by side: per problem set, each model's chosen setting, pass@1 on test and the CI of
    its difference to the base; with ``runs`` (each model's ``ssd_manifest.json``) also its prompts, samples, kept
    and wall time per stage."""
    lines = []
    for set_name, r in result["sets"].items():
        n_test = len(r["split"]["test"])
        lines.append(f"{set_name}: dev {len(r['split']['dev'])} / test {n_test} problems (seed {result['seed']}); "
                     f"n_dev {r['n_dev']}, n_test {r['n_test']} samples per problem at a sampled setting, 1 at greedy")  # fmt: skip
        w = max(10, *(len(n) + 2 for n in r["models"]))  # a long model name keeps its column
        lines.append(f"  {'model':<{w}}{'checkpoint':<28}{'setting':<30}{'dev':>7}{'test':>7}  diff vs base [95% CI]")
        for name, m in r["models"].items():
            vs = next((v for k, v in m.items() if k.startswith("vs_")), None)
            ci = f"{vs['diff']:+.4f} [{vs['lo']:+.4f}, {vs['hi']:+.4f}] {vs['verdict']}" if vs else "(base)"
            ckpt = Path(m["chosen_checkpoint"]).name or m["chosen_checkpoint"]
            lines.append(f"  {name:<{w}}{ckpt[:27]:<28}{m['chosen_setting']['name']:<30}{m['dev_pass@1']:>7.4f}"
                         f"{m['test_pass@1']:>7.4f}  {ci}")  # fmt: skip
    for name, top in (runs or {}).items():
        r0 = (top.get("rounds") or {}).get("00", {})
        s = r0.get("sample", {})
        walls = {k: r0[k].get("wall_s") for k in ("problems", "sample", "sft_data", "finetune", "export") if k in r0}
        lines.append(f"{name}: prompts {r0.get('problems', {}).get('count', '-')}, samples "
                     f"{s.get('sampled', s.get('candidates', '-'))}, kept {s.get('kept', '-')}, wall s {walls}")  # fmt: skip
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m ultrascale.ssd.evaluate`` (also what a recipe header's command is checked
    against, ``tests/test_recipe_commands.py``)."""
    ap = argparse.ArgumentParser(
        prog="python -m ultrascale.ssd.evaluate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: python -m ultrascale.ssd.evaluate --model base=models/smollm2-135m "
        "--model ssd=runs/ssd_smollm2_135m/round_00/model --out runs/ssd_compare.json",
    )
    ap.add_argument("--model", action="append", required=True, metavar="NAME=DIR[,DIR...]",
                    help="a model and its candidate checkpoints (HF directories); the first --model is the base")  # fmt: skip
    ap.add_argument("--run", action="append", default=[], metavar="NAME=OUTPUT_DIR",
                    help="an SSD output_dir whose ssd_manifest.json gives NAME's prompts, samples, kept, stage times")  # fmt: skip
    ap.add_argument("--temperatures", type=float, nargs="*", default=[0.2, 0.6, 1.1],
                    help="T_eval grid (given with no value: greedy only, e.g. to choose among checkpoints cheaply)")  # fmt: skip
    ap.add_argument("--top-k", type=int, default=20, help="truncation tried with each T_eval (0 = off)")
    ap.add_argument("--top-p", type=float, default=0.8, help="truncation tried with each T_eval (1 = off)")
    ap.add_argument("--n-dev", type=int, default=4, help="samples per problem for the dev grid")
    ap.add_argument("--n-test", type=int, default=10, help="samples per problem on the test half (>= 10)")
    ap.add_argument("--limit", type=int, default=None, help="first N HumanEval problems (default all 164)")
    ap.add_argument("--heldout", metavar="DATA_DIR", help="also the tested problems mined from this prepared "
                    "dataset's validation repositories (its repos.json)")  # fmt: skip
    ap.add_argument("--sets", nargs="+", choices=["humaneval", "heldout"],
                    help="which problem sets to score (default: humaneval, and heldout when --heldout is given)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0, help="the dev/test split and the bootstrap")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--device", default="auto", help="where the models run: auto (the GPU when there is one), cpu, "
                    "cuda, cuda:N")  # fmt: skip
    ap.add_argument("--chat", action="store_true", help="ask each model in its chat template, as "
                    "data_prep.instruct's set asks (the answer prefilled up to the body): for chat models")  # fmt: skip
    ap.add_argument("--stop-fence", action="store_true", help="also end a plain completion at a code fence (```), "
                    "as bigcode-evaluation-harness does: a chat-tuned model closes its 'code block' after the body "
                    "and explains it, and that prose would be scored as Python (always on with --chat)")  # fmt: skip
    ap.add_argument("--out", type=Path, help="write the result as JSON")
    ap.add_argument("--cache", type=Path, help="scores kept per (model, problems, setting, n), so a killed or "
                    "extended evaluation resumes (default: OUT's name + .scores.jsonl)")  # fmt: skip
    return ap


def main(argv: Sequence[str] | None = None) -> dict:
    a = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    from ultrascale.eval.humaneval import load_problems
    from ultrascale.eval.sandbox import check_available

    models = {}
    for spec in a.model:
        name, _, dirs = spec.partition("=")
        models[name] = [d for d in dirs.split(",") if d]
    a.sets = a.sets or (["humaneval", "heldout"] if a.heldout else ["humaneval"])
    if "heldout" in a.sets and not a.heldout:
        raise SystemExit("error: --sets heldout needs --heldout DATA_DIR (the prepared corpus it is mined from)")
    if "heldout" in a.sets:
        check_heldout(a.heldout, ssd_runs(models, a.run))  # before any work: a mismatch is one line
    check_available()
    sets = {"humaneval": load_problems(a.limit)} if "humaneval" in a.sets else {}
    if "heldout" in a.sets:
        sets["heldout"] = heldout_problems(a.heldout)
    settings = grid(a.temperatures, a.top_k, a.top_p)
    fence = a.stop_fence and not a.chat  # a chat prompt always stops at the fence
    scorer = sandbox_scorer(max_new_tokens=a.max_new_tokens, device=a.device, chat=a.chat, fence=fence)
    cache = a.cache or (a.out.with_name(a.out.stem + ".scores.jsonl") if a.out else None)
    if cache:
        tag = f"max_new_tokens={a.max_new_tokens}" + (",chat" if a.chat else "") + (",fence" if fence else "")
        scorer = cached(scorer, cache, tag=tag)
    result = {"seed": a.seed, "grid": [s.name for s in settings], "prompt": "chat" if a.chat else "plain",
              "stops": list(completion_stops(a.chat, fence)), "sets": {}}  # fmt: skip
    for name, problems in sets.items():
        result["sets"][name] = evaluate_set(problems, models, settings, scorer, a.n_dev, a.n_test, seed=a.seed)
    runs = {}
    for spec in a.run:
        name, _, d = spec.partition("=")
        runs[name] = json.loads((Path(d) / "ssd_manifest.json").read_text())
    print(table(result, runs), flush=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def ssd_runs(models: dict[str, list[str]], run_specs: Sequence[str]) -> dict[str, Path]:
    """Every SSD output directory in the comparison: each ``--run``, and the run each candidate was exported by
    (``<output_dir>/round_XX/model`` or ``.../model_steps/step_N``, found by its ``ssd_manifest.json``)."""
    out: dict[str, Path] = {}
    for spec in run_specs:
        name, _, d = spec.partition("=")
        out[f"--run {name}"] = Path(d)
    for name, candidates in models.items():
        for cand in candidates:
            run = next((p for p in Path(cand).resolve().parents[:3] if (p / "ssd_manifest.json").exists()), None)
            if run is not None and run not in out.values():
                out[f"--model {name} ({cand})"] = run
    return out


def check_heldout(data_dir: str, runs: dict[str, Path]) -> None:
    """Refuse a held-out score that is not held out: each run must have taken its prompts from the *train* split of
    the same prepared dataset (``problems.train_repos_from``) that ``--heldout`` mines the validation split of.
    A run with it unset took prompts from every repository, the held-out ones included; a run on another dataset
    held out other repositories. Two paths with the same ``repos.json`` are the same split."""
    from ultrascale.errors import ConfigError
    from ultrascale.paths import resolve_path

    want = resolve_path(data_dir)
    for label, run in runs.items():
        manifest = run / "ssd_manifest.json"
        if not manifest.exists():
            raise ConfigError(f"{label}: {manifest} not found: point it at an SSD output_dir")
        got = (json.loads(manifest.read_text()).get("config") or {}).get("problems", {}).get("train_repos_from")
        if not got:
            raise ConfigError(
                f"--heldout {data_dir}: {label} ran with problems.train_repos_from=null, so its prompts came from "
                f"every repository, the held-out ones included: rerun it with problems.train_repos_from={data_dir}, "
                "or leave out --heldout"
            )
        have = resolve_path(got)
        split_files = (have / "repos.json", want / "repos.json")
        same = have.resolve() == want.resolve() or (
            all(f.exists() for f in split_files) and split_files[0].read_bytes() == split_files[1].read_bytes()
        )
        if not same:
            raise ConfigError(
                f"--heldout {data_dir} is not the split {label} trained on (problems.train_repos_from={got}): "
                f"pass --heldout {got}"
            )


def heldout_problems(data_dir: str) -> list[dict]:
    """Problems with tests (doctests and asserts, references checked in the sandbox) mined from the stdlib
    repositories that data prep put in ``data_dir``'s *validation* split: code no SSD prompt comes from."""
    from ultrascale.config.compose import compose
    from ultrascale.eval.problems import build
    from ultrascale.ssd.config import register_ssd_configs

    register_ssd_configs()
    cfg = compose(["method=rft", f"problems.train_repos_from={data_dir}", "problems.held_out=true",
                   "problems.max_problems=null"], "ssd").problems  # fmt: skip
    problems, _ = build(cfg)
    return problems
