"""Tokenizer, tokenize and pack: from clean documents to the shuffled, packed shards training reads.

- tokenizer (one task of the clean stage): trains a byte-level BPE on a bounded prefix of the train split,
  streamed in (bucket, id) order; buckets are a seeded hash of the document id, so the prefix is a seeded
  sample.
- tokenize (per document bucket): FIM at prep time and token ids per split, documents joined with EOS,
  appended to the bucket's token stream. Nothing is padded here.
- pack (per output shard): the split's token stream is the buckets' streams end to end, cut every
  ``seq_len`` tokens; only the last sample is padded (with EOS), so no token is dropped and at most one
  sample per split holds padding. The samples are shuffled by a seeded permutation that each shard
  evaluates for its own positions (:mod:`data_prep.shuffle`), reading its samples from memory-mapped
  streams, so no process holds the split.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import ExitStack

import numpy as np

from data_prep.doc_stages import clean_text, removed_rows
from data_prep.pack import encode_docs
from data_prep.shuffle import permute
from data_prep.split import SPLITS, split_table
from data_prep.store import read_jsonl_gz, repo_key
from data_prep.tokenizer import EOS, FIM_TOKENS, add_special, copy_local, load_dir, load_local, save_hf, train_bpe
from data_prep.work import Ctx, crash_hook, nbytes
from ultrascale.data.shards import ShardWriter, token_dtype
from ultrascale.errors import DataError


def _split_of(ctx: Ctx, docs: list[dict]) -> list[str]:
    table = ctx.once("split_table", lambda: split_table(ctx))
    return [SPLITS[v] for v in table.lookup([repo_key(ctx.cfg.seed, d["repo"]) for d in docs]).tolist()]


def _batched(docs: Iterable[dict], size: int) -> Iterator[list[dict]]:
    chunk: list[dict] = []
    for d in docs:
        chunk.append(d)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def tokenizer_unit(ctx: Ctx, unit: int) -> dict:
    """Train the BPE on the train split's first ``tokenizer.train_max_bytes`` characters in (bucket, id) order.

    It runs as one task of the clean stage, beside the buckets' tasks: it takes documents after dedup and
    gives each sampled one the same redaction and decontamination clean does, so it trains on exactly the
    text clean writes, without waiting for it.
    """
    cfg, work = ctx.cfg, ctx.work
    tok_dir = work.out / "tokenizer"
    used = {"docs": 0, "chars": 0}
    added = None
    if cfg.tokenizer.path:
        load_local(cfg.tokenizer.path, fim=cfg.fim.rate > 0 and not cfg.tokenizer.add_fim)
        copy_local(cfg.tokenizer.path, tok_dir)
        if cfg.tokenizer.add_fim:
            added = grown_record(cfg.tokenizer.path, add_special(tok_dir, FIM_TOKENS))
    else:

        def train_texts() -> Iterator[str]:
            budget = cfg.tokenizer.train_max_bytes
            for b in range(cfg.buckets):
                gone = removed_rows(ctx, b)
                docs = (
                    d
                    for row, d in enumerate(read_jsonl_gz(work.bucket("signatures", b, ".jsonl.gz")))
                    if row not in gone
                )
                for chunk in _batched(docs, 256):
                    for d, split in zip(chunk, _split_of(ctx, chunk)):
                        if split != "train":
                            continue
                        text, _, contaminated = clean_text(ctx, d["text"])
                        if contaminated:
                            continue
                        if budget <= 0:
                            return
                        used["docs"] += 1
                        used["chars"] += len(text)
                        budget -= len(text)
                        yield text

        tok = train_bpe(train_texts(), cfg.tokenizer.vocab_size, cfg.tokenizer.min_frequency)
        crash_hook("tokenizer")
        save_hf(tok, tok_dir, cfg.pack.seq_len)
    sha = hashlib.sha256((tok_dir / "tokenizer.json").read_bytes()).hexdigest()
    return {"tokenizer_sha256": sha, "trained_on": used if not cfg.tokenizer.path else None, "added": added}


def grown_record(base: str, ids: dict[str, int]) -> dict:
    """The manifest's ``tokenizer_added``: which vocabulary the data's tokenizer grew from, and by which ids. A
    model of that vocabulary reads every other id as the data does, so the tokenizer check lets it through
    (:func:`ultrascale.data.tokcheck.check_tokenizer`) once its embedding has the new rows."""
    from ultrascale.data.tokcheck import read_vocab, vocab_sha256

    return {"base": base, "base_vocab_size": len(read_vocab(base) or {}), "base_vocab_sha256": vocab_sha256(base),
            "tokens": ids}  # fmt: skip


def _tokenizer(ctx: Ctx):
    def build():
        tok = load_dir(ctx.work.out / "tokenizer")
        eos = tok.token_to_id(EOS)
        if eos is None:
            raise DataError(f"tokenizer at {ctx.work.out / 'tokenizer'} has no {EOS} token")
        return tok, eos, token_dtype(tok.get_vocab_size(with_added_tokens=True))

    return ctx.once("tokenizer", build)


def tokenize_unit(ctx: Ctx, b: int) -> dict:
    """Bucket ``b``'s documents as one token stream per split (``b<bucket>.<split>.bin``)."""
    cfg, work = ctx.cfg, ctx.work
    tok, eos, dtype = _tokenizer(ctx)
    fim, batch = cfg.fim, cfg.pack.batch_docs
    paths = {s: work.bucket("tokenize", b, f".{s}.bin") for s in SPLITS}
    stats = {s: {"docs": 0, "bytes": 0, "doc_tokens": 0, "eos_tokens": 0, "fim": Counter()} for s in SPLITS}
    bufs: dict[str, list[dict]] = {s: [] for s in SPLITS}
    tail = np.array([eos], dtype=dtype).tobytes()
    with ExitStack() as stack:
        files = {s: stack.enter_context(open(p.with_name(f".{p.name}.tmp"), "wb")) for s, p in paths.items()}

        def flush(split: str) -> None:
            st, f = stats[split], files[split]
            for d, mode, ids in encode_docs(tok, bufs[split], cfg.seed, fim.rate, fim.spm_rate, fim.metadata, batch):
                f.write(ids.astype(dtype, copy=False).tobytes())
                f.write(tail)
                st["docs"] += 1
                st["bytes"] += nbytes(d["text"])
                st["doc_tokens"] += len(ids)
                st["eos_tokens"] += 1
                st["fim"][mode] += 1
            bufs[split] = []

        for chunk in _batched(read_jsonl_gz(ctx.work.bucket("clean", b, ".jsonl.gz")), batch):
            for d, split in zip(chunk, _split_of(ctx, chunk)):
                bufs[split].append(d)
                if len(bufs[split]) == batch:
                    flush(split)
        for s in SPLITS:
            flush(s)
    for p in paths.values():
        os.replace(p.with_name(f".{p.name}.tmp"), p)
    for st in stats.values():
        st["fim"] = dict(sorted(st["fim"].items()))
    return stats


# -------------------------------------------------------------------------------------------------- pack


def pack_plan(ctx: Ctx) -> dict:
    """Per split: each bucket's stream length, their offsets, and the samples and shards they make."""
    cfg = ctx.cfg
    seq, per_shard = cfg.pack.seq_len, cfg.pack.samples_per_shard
    st = [ctx.work.read_unit("tokenize", b) for b in range(cfg.buckets)]
    plan = {}
    for s in SPLITS:
        lengths = np.array([x[s]["doc_tokens"] + x[s]["eos_tokens"] for x in st], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        n = -(-int(offsets[-1]) // seq)
        if n == 0:
            raise DataError(f"split {s!r} is empty for input={cfg.input}: add data or lower pack.seq_len")
        plan[s] = {"offsets": offsets, "samples": n, "shards": -(-n // per_shard), "tokens": int(offsets[-1])}
    return plan


def pack_units(ctx: Ctx) -> list[tuple[str, int]]:
    plan = ctx.once("pack_plan", lambda: pack_plan(ctx))
    return [(s, i) for s in SPLITS for i in range(plan[s]["shards"])]


def _streams(ctx: Ctx, split: str, dtype) -> list[np.ndarray | None]:
    def build():
        out = []
        for b in range(ctx.cfg.buckets):
            p = ctx.work.bucket("tokenize", b, f".{split}.bin")
            out.append(np.memmap(p, dtype=dtype, mode="r") if p.stat().st_size else None)
        return out

    return ctx.once(f"streams:{split}", build)


def gather_samples(streams: list, offsets: np.ndarray, starts: np.ndarray, seq: int, eos: int, dtype) -> np.ndarray:
    """Samples [len(starts), seq] of the buckets' streams laid end to end; past the end, EOS."""
    total = int(offsets[-1])
    out = np.full((len(starts), seq), eos, dtype=dtype)
    first = np.searchsorted(offsets, starts, side="right") - 1
    last = np.searchsorted(offsets, np.minimum(starts + seq, total) - 1, side="right") - 1
    inside = (first == last) & (starts + seq <= total)
    for b in np.unique(first[inside]).tolist():
        sel = np.flatnonzero(inside & (first == b))
        idx = (starts[sel] - offsets[b])[:, None] + np.arange(seq)
        out[sel] = streams[b][idx]
    for k in np.flatnonzero(~inside).tolist():  # crosses a bucket boundary, or holds the padded tail
        pos, end = int(starts[k]), min(int(starts[k]) + seq, total)
        while pos < end:
            b = int(np.searchsorted(offsets, pos, side="right") - 1)
            take = min(end, int(offsets[b + 1])) - pos
            out[k, pos - starts[k] : pos - starts[k] + take] = streams[b][pos - offsets[b] : pos - offsets[b] + take]
            pos += take
    return out


def pack_unit(ctx: Ctx, u: int) -> dict:
    """Output shard ``u``: its positions of the seeded permutation, gathered, written atomically."""
    cfg, work = ctx.cfg, ctx.work
    split, s = pack_units(ctx)[u]
    plan = ctx.once("pack_plan", lambda: pack_plan(ctx))[split]
    tok, eos, dtype = _tokenizer(ctx)
    seq, per_shard, n = cfg.pack.seq_len, cfg.pack.samples_per_shard, plan["samples"]
    positions = np.arange(s * per_shard, min((s + 1) * per_shard, n), dtype=np.int64)
    source = permute(positions, n, cfg.seed, split)
    samples = gather_samples(_streams(ctx, split, dtype), plan["offsets"], source * seq, seq, eos, dtype)
    tmp = work.dir("pack") / f".{split}_{s:05d}"
    shutil.rmtree(tmp, ignore_errors=True)
    w = ShardWriter(tmp, split, seq, tok.get_vocab_size(with_added_tokens=True), per_shard)
    w.add(samples)
    entry = w.close()["shards"][0]
    final = work.out / split / f"shard_{s:05d}.npy"
    final.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp / entry["path"], final)
    shutil.rmtree(tmp, ignore_errors=True)
    entry["path"] = f"{split}/{final.name}"
    return {"split": split, "shard": s, "entry": entry}
