"""Fill-in-the-middle evaluation: spans cut from held-out files, prompted with the tokenizer's FIM tokens, scored by
exact match and edit similarity.

The files are the corpus's *validation repositories* (the ``repos.json`` of the prepared dataset: whole
repositories no training sample came from), read as data prep reads them
(:func:`ultrascale.data.corpus.corpus_documents`). Each file, in a seeded order, gives one span of each kind, as
the FIM papers evaluate infilling (Bavarian et al. 2022; SantaCoder; StarCoder): ``single_line``, ``multi_line``
and ``random_span`` (:func:`cut`). The prompt is the one data prep trains, PSM or SPM, or ``l2r``, the prefix alone
(:func:`prompt`); completions come from the shared sampler, greedy (:func:`evaluate`), and are scored by exact
match and edit similarity (:func:`score`): a perfect model scores 1.0 on both, an empty completion 0.
"""

from __future__ import annotations

import logging
import random
import zlib
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from ultrascale.errors import ConfigError, DataError

log = logging.getLogger("ultrascale")

KINDS = ("single_line", "multi_line", "random_span")
MODES = ("psm", "spm", "l2r")
TOKEN_NAMES = (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"), ("<fim-prefix>", "<fim-suffix>", "<fim-middle>"))
"""StarCoder's (and data prep's) spelling, then SantaCoder's."""


@dataclass(frozen=True)
class Span:
    """One infilling problem: ``prefix + middle + suffix`` is the file's text around the span."""

    file: str
    kind: str
    prefix: str
    middle: str
    suffix: str


def fim_tokens(tokenizer, model: str = "the model") -> tuple[str, str, str]:
    """(prefix, suffix, middle) token strings of the tokenizer; one error line when it has none."""
    vocab = tokenizer.get_vocab()
    for names in TOKEN_NAMES:
        if all(n in vocab for n in names):
            return names
    raise ConfigError(
        f"{model} has no FIM tokens ({', '.join(TOKEN_NAMES[0])} or SantaCoder's {', '.join(TOKEN_NAMES[1])} are not in "
        "its vocabulary): it was not trained to fill in the middle; score it left to right with fim.modes=[l2r], or "
        "evaluate a model trained on data prep's FIM samples (fim.rate > 0)"
    )


def prompt(span: Span, mode: str, tokens: tuple[str, str, str] | None, context: int) -> str:
    """The text the sampler is given (special tokens spelled out: the tokenizer splits on them, so each piece is
    encoded on its own, as data prep encodes the pieces of a FIM sample).

    The layout is the one data prep trains (``data_prep/pack.py``): PSM ``<fim_prefix>P<fim_suffix>S<fim_middle>``,
    SPM ``<fim_prefix><fim_suffix>S<fim_middle>P`` (StarCoder's SPM, the prefix right before the middle), with
    SantaCoder's hyphenated token names also recognised; ``l2r`` gives the prefix alone, the left-to-right baseline
    a model without FIM tokens can still be scored on. Prefix and suffix are cut to ``context`` characters around
    the span (a CPU's prefill budget)."""
    pre, suf = span.prefix[-context:] if context else "", span.suffix[:context]
    if mode == "l2r":
        return pre
    p, s, m = tokens  # type: ignore[misc]
    return f"{p}{pre}{s}{suf}{m}" if mode == "psm" else f"{p}{s}{suf}{m}{pre}"


def _rng(seed: int, *key: str) -> random.Random:
    return random.Random(zlib.crc32("\0".join((str(seed), *key)).encode()))


def cut(text: str, path: str, kind: str, seed: int, max_lines: int = 6, max_span_chars: int = 120) -> Span | None:
    """One span of ``kind`` from a file (None when the file has nothing to cut), seeded by (seed, path, kind).

    ``single_line``: one non-blank line, its indentation included (SantaCoder's single-line infilling);
    ``multi_line``: a block of 2 to ``max_lines`` whole lines starting at a non-blank one; ``random_span``: a span
    of 1 to ``max_span_chars`` characters starting anywhere (random-span infilling)."""
    rng = _rng(seed, path, kind)
    if kind == "random_span":
        if len(text.strip()) < 2:
            return None
        for _ in range(16):  # a span of only whitespace tests nothing: draw again
            a = rng.randrange(len(text))
            b = min(len(text), a + rng.randint(1, max_span_chars))
            if text[a:b].strip():
                return Span(path, kind, text[:a], text[a:b], text[b:])
        return None
    lines = text.splitlines(keepends=True)
    starts = [i for i, ln in enumerate(lines) if len(ln.strip()) >= 2]
    if kind == "multi_line":
        starts = [i for i in starts if i + 1 < len(lines)]
    if not starts:
        return None
    i = rng.choice(starts)
    n = 1 if kind == "single_line" else rng.randint(2, min(max_lines, len(lines) - i))
    block = "".join(lines[i : i + n])
    middle = block.rstrip("\n")  # the newline that ends the block stays in the suffix
    before = "".join(lines[:i])
    return Span(path, kind, before, middle, block[len(middle) :] + "".join(lines[i + n :]))


def spans(documents: Sequence[dict], kinds: Sequence[str], files: int, seed: int, max_lines: int = 6,
          max_span_chars: int = 120) -> list[Span]:  # fmt: skip
    """Up to ``files`` documents in a seeded order (by path, so the corpus order does not matter), one span of each
    kind from each."""
    docs = sorted(documents, key=lambda d: d["path"])
    _rng(seed, "files").shuffle(docs)
    out = []
    for d in docs[:files]:
        for kind in kinds:
            s = cut(d["text"], d["path"], kind, seed, max_lines, max_span_chars)
            if s is not None:
                out.append(s)
    return out


def held_out_documents(data: str, corpus: str) -> list[dict]:
    """The files of ``data``'s validation repositories, read from ``corpus`` as data prep read it."""
    from omegaconf import OmegaConf

    from ultrascale.data.corpus import corpus_documents

    cfg = OmegaConf.create({"input": corpus, "train_repos_from": data, "held_out": True})
    docs = corpus_documents(cfg, Counter())
    if not docs:
        raise DataError(f"fim.data={data}: its repos.json has no validation repository with a file in "
                        f"fim.input={corpus}; was it prepared from that input?")  # fmt: skip
    return docs


# ---- scoring --------------------------------------------------------------------------------------------------
def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions), one row at a time."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def edit_similarity(pred: str, target: str) -> float:
    p, t = pred.strip(), target.strip()
    if not p and not t:
        return 1.0
    return 1.0 - levenshtein(p, t) / max(len(p), len(t))


def score(rows: Sequence[tuple[Span, str, str]]) -> dict:
    """``rows``: (span, mode, completion). Exact match and edit similarity per ``kind/mode`` and overall.

    Exact match of the middle with surrounding whitespace stripped, and edit similarity
    ``1 - levenshtein(pred, target) / max(len)`` on the same strings (CodeXGLUE's line-level "Edit Sim" as a
    fraction)."""
    groups: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for span, mode, pred in rows:
        em = float(pred.strip() == span.middle.strip())
        es = edit_similarity(pred, span.middle)
        groups[f"{span.kind}/{mode}"].append((em, es))
        groups[f"all/{mode}"].append((em, es))
    out: dict = {}
    for key, vals in sorted(groups.items()):
        out[f"{key}/exact_match"] = sum(v[0] for v in vals) / len(vals)
        out[f"{key}/edit_similarity"] = sum(v[1] for v in vals) / len(vals)
        out[f"{key}/n"] = len(vals)
    return out


def middle_loss(model, tokenizer, problems: Sequence[Span], mode: str, context: int = 1000) -> dict:
    """The model's mean cross-entropy (nats per token) of each span's middle given its prompt in ``mode``, per kind
    and overall: the FIM-mode loss, which moves with training long before exact match leaves zero on a small
    model. The middle is encoded on its own, as data prep encodes a FIM sample's pieces, and in ``psm``/``spm``
    followed by EOS (data prep ends a FIM middle with it: a model that infills must also stop); in ``l2r`` the
    prefix alone is the prompt and the middle is followed by nothing (the file goes on)."""
    import torch

    tokens = fim_tokens(tokenizer) if mode != "l2r" else None
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    device = next(model.parameters()).device
    with torch.no_grad():
        for span in problems:
            ids = tokenizer(prompt(span, mode, tokens, context), add_special_tokens=False).input_ids
            target = tokenizer(span.middle, add_special_tokens=False).input_ids
            if mode != "l2r":
                target = [*target, tokenizer.eos_token_id]
            if not target or not ids:
                continue
            x = torch.tensor([ids + target], device=device)
            logits = model(input_ids=x).logits[0, len(ids) - 1 : -1].float()
            nll = torch.nn.functional.cross_entropy(logits, x[0, len(ids) :], reduction="sum")
            for key in (f"{span.kind}/{mode}", f"all/{mode}"):
                sums[key][0] += float(nll)
                sums[key][1] += len(target)
    return {f"{k}/middle_loss": v[0] / v[1] for k, v in sorted(sums.items()) if v[1]}


# ---- the task -------------------------------------------------------------------------------------------------
def evaluate(model, tokenizer, problems: Sequence[Span], *, modes: Sequence[str] = ("psm", "spm"),
             max_context_chars: int = 1000, max_new_tokens: int = 96, batch_size: int = 16,
             model_name: str = "the model", progress: bool = False, loss: bool = True) -> dict:  # fmt: skip
    """Generate a middle for every (span, mode), greedy, and score. Returns the scores and ``samples``.

    Completions come from the shared sampler (:func:`ultrascale.eval.humaneval.generate`) and end at the model's EOS
    (data prep ends a FIM document's middle with it), and for ``single_line`` also at the first newline. A model
    whose tokenizer lacks the FIM tokens is refused in one line for ``psm``/``spm``. ``loss``: also each mode's
    :func:`middle_loss` (``KIND/MODE/middle_loss``), one forward a span."""
    from ultrascale.eval.humaneval import generate

    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ConfigError(f"fim.modes has {bad}: choose from {list(MODES)}")
    tokens = fim_tokens(tokenizer, model_name) if any(m != "l2r" for m in modes) else None
    if not problems:
        raise DataError("fim: no span to evaluate (the held-out files are empty)")
    jobs = [(s, m) for m in modes for s in problems]
    prompts = [prompt(s, m, tokens, max_context_chars) for s, m in jobs]
    outs = [""] * len(jobs)
    for healed in (False, True):
        # An l2r prompt is plain text ending where the span starts, for a line at a line start: healed as HumanEval's
        # prompts are (humaneval.heal: a bare newline token tells a byte-level BPE model the next line starts at
        # column 0). Its single line then begins with the newline it gave back, so it ends at the next one, cut
        # below. The sentinel modes end in <fim_middle> or SPM's prefix, each piece encoded on its own as data prep
        # trains them: no boundary to heal, and a single line stops at its first newline.
        idx = [i for i, (_, m) in enumerate(jobs) if (m == "l2r") == healed]
        if not idx:
            continue
        stops = [("\n",) if jobs[i][0].kind == "single_line" and not healed else () for i in idx]
        got = generate(model, tokenizer, [prompts[i] for i in idx], max_new_tokens=max_new_tokens,
                       batch_size=batch_size, stops=(), heal_newline=healed, progress=progress, extra_stops=stops)  # fmt: skip
        for i, cs in zip(idx, got):
            outs[i] = cs[0].split("\n", 1)[0] if healed and jobs[i][0].kind == "single_line" else cs[0]
    rows = [(s, m, c) for (s, m), c in zip(jobs, outs)]
    result = score(rows)
    for m in modes if loss else ():
        result.update(middle_loss(model, tokenizer, problems, m, max_context_chars))
    result.update(files=len({s.file for s in problems}), spans=len(problems), modes=list(modes))
    log.info("fim: " + ", ".join(f"{k} {v:.3f}" for k, v in result.items() if k.startswith("all/")
                                   and k.endswith(("exact_match", "edit_similarity"))))  # fmt: skip
    result["samples"] = [{"file": s.file, "kind": s.kind, "mode": m, "middle": s.middle, "completion": c,
                          "exact_match": c.strip() == s.middle.strip()} for s, m, c in rows]  # fmt: skip
    return result
