"""Everything a run needs that can be checked before anything is written, on every rank.

A run that fails after it has created its directory leaves a ``config.yaml``, a ``ds_config.json`` and an
empty ``checkpoints/`` behind, and the next attempt with the same ``output_dir`` looks like a resume. So the
data (present and matching, or preparable), the model source, the checkpoint a resume would load and what
in-training HumanEval needs are all checked here, read-only, before the first byte; ``dry_run`` prints the
same lines.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ultrascale.data.prepare import check_prepared
from ultrascale.data.shards import MANIFEST, load_manifest
from ultrascale.data.sources import primary_path, sources
from ultrascale.data.tokcheck import pretrained_dir
from ultrascale.errors import DataError
from ultrascale.levers.decide import Decisions
from ultrascale.levers.length import on_resume
from ultrascale.model.build import build_hf_config
from ultrascale.paths import resolve_path
from ultrascale.train import checkpoint
from ultrascale.train.resume import check_resume

if TYPE_CHECKING:
    from ultrascale.config.data import DataConfig
    from ultrascale.config.root import RootConfig
    from ultrascale.config.train import TrainConfig


@dataclass(frozen=True)
class Preflight:
    notes: dict[str, str]
    """{what: finding}, printed by the dry run."""
    data_checked: bool
    """The prepared data existed and was checked (hashed) here, so setup need not do it again."""
    resume_from: Path | None = None
    """The verified checkpoint the run continues from (None: a fresh start)."""
    skipped: tuple[str, ...] = ()
    """Newer checkpoints passed over because they did not verify (truncated, incomplete), with the reason."""
    changes: tuple[str, ...] = ()
    """Allowed differences between this config and the checkpoint's run, in words."""


def preflight(cfg: RootConfig, d: Decisions) -> Preflight:
    """What was checked; raises the user error that would otherwise come mid-setup, after files were written.

    That includes a resume this config cannot continue (another layout, ZeRO stage, precision, model shape or a
    schedule that jumps): :func:`ultrascale.train.resume.check_resume` refuses it here, so the run directory's
    ``config.yaml`` and ``ds_config.json`` still describe the run that made the checkpoint."""
    hf = build_hf_config(cfg.model)  # a missing model.pretrained_path fails here
    dry = bool(cfg.dry_run)
    if cfg.grpo is not None:  # problems, not shards; the sandbox checked before any model is built
        data_checked, found = True, {"data": grpo_check(cfg)}
    else:
        data_checked = all((s.path / MANIFEST).exists() for s in sources(cfg.data))
        found = {"data": check_prepared(cfg.data, hf.vocab_size, dry_run=dry, model_dir=pretrained_dir(cfg.model))}
    if cfg.model.pretrained_path:
        found["weights"] = f"from {cfg.model.pretrained_path}"
    ckpt_dir = resolve_path(cfg.output_dir) / "checkpoints"
    skipped: list[str] = []
    tag_dir = checkpoint.find_resume(ckpt_dir, str(cfg.train.resume), cfg.train.universal_checkpoint, skipped)
    found["resume"] = f"from {tag_dir}" if tag_dir else "fresh start (no checkpoint to resume)"
    changes: list[str] = []
    if tag_dir is not None:
        meta = checkpoint.read_meta(tag_dir)
        changes = on_resume(cfg, meta, tag_dir.name)  # another global batch: refused, or the length adjusted first
        changes += check_resume(cfg, d, meta, tag_dir.name, cfg.train.universal_checkpoint)
    if skipped:
        found["resume"] += f" (skipped: {'; '.join(skipped)})"
    if changes:
        found["resume"] += f"; {'; '.join(changes)}"
    n = cfg.train.eval_humaneval
    if n:
        from ultrascale.eval.sandbox import check_available

        data = primary_path(cfg.data)
        if (data / MANIFEST).exists():
            humaneval_tokenizer(data, n)
        check_available()
        found["humaneval"] = f"greedy pass@1 on {n} problems at every eval, in the sandbox"
    if cfg.train.eval_fim:
        found["fim"] = fim_check(cfg.train, cfg.data)
    return Preflight(found, data_checked, tag_dir, tuple(skipped), tuple(changes))


def grpo_check(cfg: RootConfig) -> str:
    """A GRPO run's data line: the problems it samples, its reward functions (imported now: a bad dotted path is
    one line here), and the sandbox the execution reward needs (refused in one line without root/CAP_SYS_ADMIN)."""
    from ultrascale.train.grpo import rewards

    g, p = cfg.grpo, cfg.problems
    rewards.load(g.reward_funcs, g)
    if not cfg.dry_run:
        rewards.require_sandbox(g.reward_funcs)
    where = {"humaneval": f"HumanEval {p.split} half (split seed {p.split_seed})", "jsonl": f"{p.jsonl}"}
    return (
        f"problems: {where.get(str(p.source), f'mined from {p.input}')}; rewards {list(g.reward_funcs)}, "
        f"sandbox timeout {g.reward_timeout_s:g}s"
    )


def humaneval_tokenizer(data: Path, n: int) -> Path:
    """The prepared data's tokenizer directory, which in-training HumanEval decodes with."""
    tok_dir = data / str(load_manifest(data)["tokenizer"])
    if not (tok_dir / "tokenizer.json").exists():
        raise DataError(
            f"train.eval_humaneval={n} needs a tokenizer, but {data} has none at {tok_dir} "
            "(byte-level data?): prepare data with data_prep or set train.eval_humaneval=0"
        )
    return tok_dir


def fim_check(train: TrainConfig, data_cfg: DataConfig) -> str:
    """In-training FIM (``train.eval_fim``): the data's tokenizer has FIM tokens and its validation repositories
    have files in ``train.eval_fim_input``; refused in one line before anything is written."""
    from transformers import AutoTokenizer

    from ultrascale.eval import fim

    n, data = train.eval_fim, primary_path(data_cfg)
    if not (data / MANIFEST).exists():
        return f"FIM exact match on {n} held-out files at every eval (checked once {data} is prepared)"
    tok = AutoTokenizer.from_pretrained(str(humaneval_tokenizer(data, n)))
    fim.fim_tokens(tok, f"train.eval_fim={n}: the tokenizer of {data}")
    docs = fim.held_out_documents(str(data), train.eval_fim_input)
    return f"FIM exact match (PSM, greedy) on {min(n, len(docs))} held-out files at every eval, on rank 0"
