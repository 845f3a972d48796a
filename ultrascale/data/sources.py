"""The run's data as named sources and stages: ``data.sources``/``data.stages``, or ``data.path`` as one source.

Everything that reads data asks here (the trainer, preflight, the dry run, eval and export), so the one-source
shorthand and a mixture go through the same code: a mixture of one is the loader's order from before mixtures.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ultrascale.data.mixture import Mixture, Stage
from ultrascale.data.shards import MANIFEST, load_manifest
from ultrascale.errors import DataError
from ultrascale.paths import resolve_path

SHORTHAND = "data"
"""The name of the one source ``data.path`` stands for."""


@dataclass(frozen=True)
class Source:
    name: str
    path: Path
    weight: float


def is_mixture(data: Any) -> bool:
    return bool(getattr(data, "sources", None))  # a run's config.yaml from before mixtures has no key


def sources(data: Any) -> list[Source]:
    """The sources in declaration order (the order of the mixture's columns everywhere)."""
    if not is_mixture(data):
        return [Source(SHORTHAND, resolve_path(data.path), 1.0)]
    return [Source(str(n), resolve_path(s.path), float(s.weight)) for n, s in data.sources.items()]


def primary_path(data: Any) -> Path:
    """The first source: its tokenizer is the run's (every source shares it)."""
    return sources(data)[0].path


def stage_end(st: Any, tokens_per_step: int) -> int | None:
    """The data step a stage ends before (``until_tokens`` rounds up to a whole step), or None."""
    if st.until_step is not None:
        return int(st.until_step)
    if st.until_tokens is not None:
        return math.ceil(int(st.until_tokens) / tokens_per_step)
    return None


def stages(data: Any, train_steps: int) -> list[Stage]:
    """The stage table over the sources (a single stage of the sources' weights when ``data.stages`` is empty).
    The last stage runs on past its end: a rollback's skipped window can push data steps past ``train.steps``."""
    srcs = sources(data)
    names = [s.name for s in srcs]
    tokens_per_step = int(data.global_batch) * int(data.seq_len)
    if not getattr(data, "stages", None):
        total = math.fsum(s.weight for s in srcs)
        return [Stage(0, None, tuple(s.weight / total for s in srcs))]
    out, start = [], 0
    for i, st in enumerate(data.stages):
        end = stage_end(st, tokens_per_step)
        last = i == len(data.stages) - 1 or (end is not None and end >= train_steps)
        w = [float(st.weights.get(n, 0.0)) for n in names]
        total = math.fsum(w)
        out.append(Stage(start, None if last else end, tuple(x / total for x in w), str(st.lr)))
        if last:
            break
        start = end
    return out


def mixture(data: Any, sizes: list[int], seed: int, train_steps: int) -> Mixture:
    """The run's :class:`Mixture` over splits of ``sizes`` rows (one per source)."""
    if not is_mixture(data):
        return Mixture.single(sizes[0], int(data.global_batch), seed)
    names = [s.name for s in sources(data)]
    return Mixture(names, sizes, stages(data, train_steps), int(data.global_batch), seed)


def stage_table(data: Any, train_steps: int) -> list[str]:
    """The stages in words, one line each: steps, tokens, shares and the lr rule (banner and dry run)."""
    names = [s.name for s in sources(data)]
    tps = int(data.global_batch) * int(data.seq_len)
    lines = []
    for i, st in enumerate(stages(data, train_steps)):
        end = st.end if st.end is not None else train_steps
        mix = ", ".join(f"{n} {w:.1%}" for n, w in zip(names, st.shares) if w > 0)
        lr = "" if st.lr == "schedule" else f", lr {st.lr}"
        lines.append(f"stage {i}: steps {st.start}-{end} ({(end - st.start) * tps:,} tokens): {mix}{lr}")
    return lines


def cursors(data: Any, data_step: int, train_steps: int) -> dict[str, int]:
    """Samples each source has given before ``data_step``: a function of the weights and stages alone (the
    sources' sizes only choose rows), so the config answers it without opening any data."""
    names = [s.name for s in sources(data)]
    m = mixture(data, [1] * len(names), 0, train_steps)
    return {n: int(c) for n, c in zip(names, m.cursors(data_step))}


def tokens_per_source(data: Any, train_steps: int) -> dict[str, int]:
    """Training tokens each source gives over the run's ``train_steps`` (the apportionment, not an estimate)."""
    return {n: c * int(data.seq_len) for n, c in cursors(data, train_steps, train_steps).items()}


def _tokenizer_digest(path: Path, manifest: dict) -> str | None:
    tok = path / str(manifest.get("tokenizer") or "tokenizer") / "tokenizer.json"
    return hashlib.sha256(tok.read_bytes()).hexdigest()[:12] if tok.exists() else None


def eval_path(data: Any) -> Path | None:
    """``data.eval_path`` resolved, or None when the held-out loss reads each source's own validation split."""
    p = getattr(data, "eval_path", None)  # a run's config.yaml from before the key has none
    return resolve_path(p) if p else None


def check_eval_source(data: Any, dry_run: bool = False) -> str | None:
    """``data.eval_path`` is prepared and shares the training data's tokenizer and seq_len; one line saying what
    it holds, or None when unset. Its targets score every arm, so a mismatch is an error naming the key. A
    ``dry_run`` notes a missing one, as it notes a missing training corpus."""
    path = eval_path(data)
    if path is None:
        return None
    if not (path / MANIFEST).exists():
        same = path == primary_path(data)  # the training data itself: no tokenizer to share yet
        tok = "" if same else f" tokenizer.path={primary_path(data)}/tokenizer"
        why = (f"data.eval_path={data.eval_path} has no {MANIFEST}: prepare it with `python -m data_prep "
               f"output_dir={data.eval_path}{tok} ...` or unset the key")  # fmt: skip
        if dry_run:
            return f"held-out split not here: a real run stops with: {why}"
        raise DataError(why)
    first = sources(data)[0]
    if (first.path / MANIFEST).exists():
        _agree(f"data.{'sources.' + first.name if is_mixture(data) else 'path'}", first.path, "data.eval_path", path)
    m = load_manifest(path)
    return f"held-out loss on {path}'s validation split ({m['pack']['validation']['samples']:,} samples)"


def _agree(first_key: str, first_path: Path, key: str, path: Path) -> None:
    """The data at ``path`` (config ``key``) was packed with ``first_path``'s tokenizer, seq_len, EOS and special
    tokens, or one DataError naming both."""
    ref, m = load_manifest(first_path), load_manifest(path)
    for k in ("seq_len", "vocab_size", "eos_token_id", "special_tokens"):
        if m.get(k) != ref.get(k):
            raise DataError(
                f"{key} ({path}) has {k}={m.get(k)} but {first_key} ({first_path}) has {k}={ref.get(k)}: every "
                f"source must share one tokenizer and seq_len; prepare it with `python -m data_prep "
                f"tokenizer.path={first_path}/tokenizer pack.seq_len={ref.get('seq_len')} ...`"
            )
    a, b = _tokenizer_digest(first_path, ref), _tokenizer_digest(path, m)
    if a != b:
        raise DataError(
            f"{key} ({path}) was tokenized with another tokenizer than {first_key} ({first_path}) (tokenizer.json "
            f"sha256 {b} vs {a}): prepare it with `python -m data_prep tokenizer.path={first_path}/tokenizer ...`"
        )


def check_agree(data: Any) -> None:
    """Every prepared source shares the first one's tokenizer, seq_len, EOS and special tokens: token ids from two
    vocabularies in one batch would train the model on nonsense, silently. One error names both sources."""
    srcs = [s for s in sources(data) if (s.path / MANIFEST).exists()]
    for s in srcs[1:]:
        _agree(f"data.sources.{srcs[0].name}", srcs[0].path, f"data.sources.{s.name}", s.path)