"""What ``eval.py`` does: resolve the model, run the requested tasks, write and log the results.

A run's checkpoint is evaluated through the exporter (into a temporary HF directory), so evaluation
sees exactly the model a user would download, and there is one checkpoint reader, not two. The exporter is
handed in by the entry point (``eval.py``): export reads the trainer's checkpoints, a layer above eval.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from omegaconf import OmegaConf

from ultrascale.config.convert import plain
from ultrascale.data.sources import primary_path
from ultrascale.errors import ConfigError
from ultrascale.eval.config import EvalConfig, check
from ultrascale.jsonio import write_json, write_jsonl
from ultrascale.model.build import load_pretrained
from ultrascale.paths import resolve_path

log = logging.getLogger("ultrascale")

Exporter = Callable[..., dict]
"""``ultrascale.export.export``: ``(run_dir, out_dir, step=, dtype=)`` -> its stats (``out``, ``tag``, ...)."""


def _wandb_log(cfg: EvalConfig, results: dict, out_dir: Path) -> None:
    """Attach the numbers to the training run's wandb run (same id), or to a fresh one for model_dir."""
    flat = {f"eval/{task}/{k}": v for task, r in results["tasks"].items() for k, v in r.items() if _is_num(v)}
    if not flat:
        return
    import wandb

    kwargs: dict = {"mode": os.environ.get("WANDB_MODE", "offline"), "dir": str(out_dir), "project": "ultrascale"}
    if cfg.run_dir:
        run_dir = Path(cfg.run_dir)
        run_cfg = OmegaConf.load(run_dir / "config.yaml")
        id_file = run_dir / ".wandb_id"
        if not run_cfg.logger.wandb or run_cfg.logger.wandb_mode == "disabled":
            return  # the run was trained without wandb: do not start one just for its eval
        kwargs.update(dir=str(run_dir), project=run_cfg.logger.wandb_project, mode=run_cfg.logger.wandb_mode)
        if id_file.exists():
            kwargs.update(id=id_file.read_text().strip(), resume="allow")
    run = wandb.init(job_type="eval", **kwargs)
    step = results.get("step")
    run.log(flat, **({"step": step} if isinstance(step, int) else {}))
    for k, v in flat.items():
        run.summary[k] = v
    run.finish()


def _is_num(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def table(results: dict) -> str:
    """The eval table `make demo` ends with."""
    rows = [("model", str(results["model"]))]
    ppl = results["tasks"].get("perplexity")
    if ppl:
        rows += [
            ("perplexity", f"{ppl['perplexity']:.3f}"),
            ("loss / token", f"{ppl['loss_per_token']:.4f}"),
            ("tokens scored", f"{ppl['tokens']:,}"),
        ]
    he = results["tasks"].get("humaneval")
    if he:
        rows += [(k, f"{v:.4f}") for k, v in he.items() if k.startswith("pass@")]
        rows.append(("humaneval problems", f"{he['problems']} x {he['n_samples']} sample(s), T={he['temperature']}"))
    fim = results["tasks"].get("fim")
    if fim:
        rows += [(f"fim {k.removesuffix('/exact_match')} exact match", f"{v:.4f}  (edit sim "
                  f"{fim[k.replace('exact_match', 'edit_similarity')]:.4f}, n={fim[k.replace('exact_match', 'n')]})")
                 for k, v in fim.items() if k.endswith("/exact_match")]  # fmt: skip
        rows.append(("fim held-out files", f"{fim['files']} files, {fim['spans']} spans"))
    inf = results["tasks"].get("infill")
    if inf:
        rows += [(f"infill {k}", f"{v:.4f}") for k, v in inf.items() if k.startswith("pass@")]
        rows.append(("infill exact match", f"{inf['exact_match']:.4f}"))
        rows.append(("infill tasks", f"{inf['benchmark']} {inf['mode']}: {inf['tasks']} of {inf['of']} x "
                     f"{inf['n_samples']} sample(s), T={inf['temperature']}"))  # fmt: skip
    w = max(len(r[0]) for r in rows)
    return "\n".join(f"{a:<{w}}  {b}" for a, b in rows)


def run(cfg: EvalConfig, export: Exporter | None = None) -> dict:
    """Evaluate; write ``eval_results.json`` (and HumanEval samples) to the output dir; return the results.
    ``export`` turns ``run_dir``'s checkpoint into an HF directory; needed only with ``run_dir``."""
    from transformers import AutoTokenizer

    from ultrascale.data.shards import load_manifest
    from ultrascale.data.tokcheck import check_tokenizer
    from ultrascale.eval import humaneval
    from ultrascale.eval.perplexity import perplexity
    from ultrascale.eval.sandbox import Limits, check_available

    check(cfg)
    fim_docs = None
    if "fim" in cfg.tasks:  # the held-out files are read before any model is exported or loaded
        from ultrascale.eval import fim

        run_data = primary_path(OmegaConf.load(resolve_path(cfg.run_dir) / "config.yaml").data) if cfg.run_dir else None
        fim_docs = fim.held_out_documents(str(cfg.fim.data or run_data), cfg.fim.input)
    if "humaneval" in cfg.tasks or "infill" in cfg.tasks:
        check_available()  # a machine that cannot sandbox says so before any model is exported or loaded
    results: dict = {"tasks": {}}
    with ExitStack() as stack:
        if cfg.run_dir:
            run_dir = resolve_path(cfg.run_dir)
            if export is None:
                raise TypeError("eval.run.run with run_dir needs export=ultrascale.export.export (eval.py passes it)")
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="ultrascale-eval-"))
            stats = export(run_dir, Path(tmp) / "model", step=cfg.step, dtype="fp32")
            model_dir = Path(stats["out"])
            run_cfg = OmegaConf.load(run_dir / "config.yaml")
            data_path = resolve_path(cfg.perplexity.data_path or primary_path(run_cfg.data))
            results.update(model=f"{run_dir} @ {stats['tag']}", step=int(stats["tag"].split("_")[-1]))
            out_dir = resolve_path(cfg.output_dir) if cfg.output_dir else run_dir / "eval" / stats["tag"]
            tok_dir = cfg.tokenizer_dir or model_dir
        else:
            model_dir = resolve_path(cfg.model_dir)
            if not (model_dir / "config.json").exists():
                raise ConfigError(f"model_dir={model_dir} has no config.json: point it at a local HF model directory")
            data_path = resolve_path(cfg.perplexity.data_path) if cfg.perplexity.data_path else None
            results["model"] = str(model_dir)
            out_dir = resolve_path(cfg.output_dir) if cfg.output_dir else model_dir / "eval"
            tok_dir = cfg.tokenizer_dir or model_dir
        if "perplexity" in cfg.tasks:  # the data's ids must be the model's tokens: checked before it loads
            model_key = "tokenizer_dir" if cfg.tokenizer_dir else ("model_dir" if cfg.model_dir else "run_dir's export")
            data_key = "perplexity.data_path" if cfg.perplexity.data_path else "data.path of run_dir"
            check_tokenizer(data_path, data_key, resolve_path(tok_dir), model_key)
        model = load_pretrained(model_dir, str(cfg.dtype), str(cfg.device))
        log.info(f"eval: {model_dir} on {model.device} ({cfg.dtype})")
        tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
        if "fim" in cfg.tasks and any(str(m) != "l2r" for m in cfg.fim.modes):
            fim.fim_tokens(tokenizer, str(results["model"]))  # a model without them: one line before any task runs
        if "infill" in cfg.tasks and str(cfg.infill.mode) != "l2r":
            from ultrascale.eval.fim import fim_tokens

            fim_tokens(tokenizer, str(results["model"]))
        if "perplexity" in cfg.tasks:
            load_manifest(data_path)  # fail with the data error before loading anything heavier
            p = cfg.perplexity
            results["tasks"]["perplexity"] = perplexity(
                model, data_path, split=p.split, batch_size=p.batch_size, max_samples=p.max_samples, progress=True
            )
            results["tasks"]["perplexity"]["data_path"] = str(data_path)
        if "humaneval" in cfg.tasks:
            h = cfg.humaneval
            he = humaneval.evaluate(
                model,
                tokenizer,
                limit=h.limit,
                n_samples=h.n_samples,
                temperature=h.temperature,
                top_p=h.top_p,
                top_k=h.top_k,
                autocast=str(h.autocast),
                draft=h.draft,
                ks=list(h.k),
                max_new_tokens=h.max_new_tokens,
                batch_size=h.batch_size,
                seed=h.seed,
                limits=Limits(timeout_s=h.timeout_s, memory_mb=h.memory_mb),
                workers=h.workers,
                heal_newline=h.heal_newline,
                progress=True,
            )
            samples = he.pop("samples")
            results["tasks"]["humaneval"] = he
        if "fim" in cfg.tasks:
            f = cfg.fim
            problems = fim.spans(fim_docs, [str(k) for k in f.kinds], f.files, f.seed, f.max_lines, f.max_span_chars)
            res = fim.evaluate(model, tokenizer, problems, modes=[str(m) for m in f.modes],
                               max_context_chars=f.max_context_chars, max_new_tokens=f.max_new_tokens,
                               batch_size=f.batch_size, model_name=str(results["model"]), progress=True)  # fmt: skip
            fim_samples = res.pop("samples")
            results["tasks"]["fim"] = res
        if "infill" in cfg.tasks:
            from ultrascale.eval import infill

            i = cfg.infill
            res = infill.evaluate(model, tokenizer, benchmark=str(i.benchmark), mode=str(i.mode), limit=i.limit,
                                  n_samples=i.n_samples, temperature=i.temperature, top_p=i.top_p, ks=list(i.k),
                                  max_new_tokens=i.max_new_tokens, batch_size=i.batch_size, seed=i.seed,
                                  span_seed=i.span_seed, limits=Limits(timeout_s=i.timeout_s, memory_mb=i.memory_mb),
                                  workers=i.workers, model_name=str(results["model"]), progress=True)  # fmt: skip
            infill_samples = res.pop("samples")
            results["tasks"]["infill"] = res
    out_dir.mkdir(parents=True, exist_ok=True)
    if "humaneval" in cfg.tasks:
        write_jsonl(out_dir / "humaneval_samples.jsonl", samples)
    if "fim" in cfg.tasks:
        write_jsonl(out_dir / "fim_samples.jsonl", fim_samples)
    if "infill" in cfg.tasks:  # {task_id, completion, ...}: what `python -m ultrascale.eval.infill score` reads
        write_jsonl(out_dir / "infill_samples.jsonl", infill_samples)
    results["config"] = plain(cfg)
    write_json(out_dir / "eval_results.json", results)
    print(table(results) + f"\nwrote {out_dir / 'eval_results.json'}", flush=True)
    if cfg.wandb:
        _wandb_log(cfg, results, out_dir)
    return results
