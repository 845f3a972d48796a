"""The train/validation split by repository, streamed: no process holds the repository list.

Repositories are taken in seeded-hash order (their 64-bit key) and fill validation up to
``split.validation_fraction`` of the characters after dedup, skipping any that would overshoot 1.5x the
target; if none fits, the smallest goes. Every bucket wrote its repositories' sizes sorted by key, so a
k-way merge of those runs visits each repository once, in order, holding one row per bucket. The split is
decided after dedup and before PII and decontamination, so the tokenizer can train while clean runs. Three passes over
the runs (totals, does any repository fit, then write) keep the decision identical to doing it in memory.
The verdicts are written per repository partition (a table the tokenize stage looks repositories up in)
and ``repos.json`` is merged from per-partition runs sorted by name.
"""

from __future__ import annotations

import heapq
import json
import os
from collections.abc import Iterator

import numpy as np

from data_prep.store import RepoTable, read_run, repo_part, write_table
from data_prep.work import Ctx, crash_hook
from ultrascale.errors import DataError

TRAIN, VALIDATION = 0, 1
SPLITS = ("train", "validation")


def repos_in_order(ctx: Ctx) -> Iterator[tuple[int, str, int]]:
    """(key, repository, characters) for every repository with a document left after dedup, in key order.

    Each bucket's signatures stage wrote its repositories' sizes sorted by key, and the cluster step wrote
    what the removed duplicates took off them (a negative size, no name); a k-way merge adds them up.
    """
    runs = [read_run(ctx.work.bucket("signatures", b, ".repos")) for b in range(ctx.cfg.buckets)]
    runs.append(read_run(ctx.work.dir("cluster") / "removed_repos"))
    cur: list | None = None
    for key, row in heapq.merge(*runs, key=lambda kr: kr[0]):
        if cur is not None and cur[0] == key:
            cur[1] = cur[1] or row.get("repo")
            cur[2] += row["chars"]
            continue
        if cur is not None and cur[2] > 0:
            yield cur[0], cur[1], cur[2]
        cur = [key, row.get("repo"), row["chars"]]
    if cur is not None and cur[2] > 0:
        yield cur[0], cur[1], cur[2]


def _assign(ctx: Ctx, target: float, fallback: tuple[int, str] | None) -> Iterator[tuple[int, str, int, int]]:
    val = 0
    for key, repo, size in repos_in_order(ctx):
        if fallback is not None:
            split = VALIDATION if (key, repo) == fallback else TRAIN
        elif val < target and val + size <= 1.5 * target:
            split, val = VALIDATION, val + size
        else:
            split = TRAIN
        yield key, repo, size, split


def split_unit(ctx: Ctx, unit: int) -> dict:
    cfg, work = ctx.cfg, ctx.work
    total = count = 0
    smallest: tuple[int, int, str] | None = None
    for key, repo, size in repos_in_order(ctx):
        total, count = total + size, count + 1
        if smallest is None or size < smallest[0]:
            smallest = (size, key, repo)
    if count == 0:
        raise DataError(f"no documents survived the filters for input={cfg.input}: see {work.root} stage stats")
    fraction = cfg.split.validation_fraction
    target = fraction * total
    fits = any(s == VALIDATION for *_, s in _assign(ctx, target, None))
    fallback = None
    if fraction > 0 and not fits:
        if count < 2:
            raise DataError(
                f"input={cfg.input} has a single repository ({smallest[2]}): the split is by repository, "
                "so it needs at least two (lower source.repo_depth or add repositories)"
            )
        fallback = (smallest[1], smallest[2])

    parts = cfg.buckets
    # One partition's rows at a time: repositories come in key order and partitions are key ranges, so
    # partition p is complete (and flushed, then cleared) before the first repository of p + 1 arrives.
    names: list[tuple[str, str]] = []
    stats = {s: {"repos": 0, "chars": 0} for s in SPLITS}
    keys: list[int] = []
    vals: list[int] = []
    p_cur = 0

    def flush(p: int) -> None:
        write_table(work.part("split", p), np.array(keys, dtype=np.uint64), np.array(vals, dtype=np.uint8))
        _write_names(work.part("split", p, ".names.jsonl"), sorted(names))
        keys.clear(), vals.clear(), names.clear()

    for key, repo, size, split in _assign(ctx, target, fallback):
        p = repo_part(key, parts)
        while p_cur < p:
            flush(p_cur)
            p_cur += 1
        keys.append(key)
        vals.append(split)
        names.append((repo, SPLITS[split]))
        stats[SPLITS[split]]["repos"] += 1
        stats[SPLITS[split]]["chars"] += size
    while p_cur < parts:
        flush(p_cur)
        p_cur += 1
    crash_hook("split")
    _write_repos_json(ctx)
    return {"splits": stats, "repos": count, "chars": total, "fallback": fallback is not None}


def _write_names(path, rows: list[tuple[str, str]]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        for repo, split in rows:
            f.write(json.dumps([repo, split]) + "\n")
    os.replace(tmp, path)


def _write_repos_json(ctx: Ctx) -> None:
    """``repos.json`` (repository -> split, sorted by name), merged from the per-partition runs, atomically.

    Byte-for-byte what ``json.dumps(mapping, indent=2, sort_keys=True)`` writes, without the mapping.
    """

    def run(p: int):
        with open(ctx.work.part("split", p, ".names.jsonl")) as f:
            for line in f:
                yield tuple(json.loads(line))

    out = ctx.work.out / "repos.json"
    tmp = out.with_name(f".{out.name}.tmp")
    with open(tmp, "w") as f:
        first = True
        for repo, split in heapq.merge(*(run(p) for p in range(ctx.cfg.buckets))):
            f.write(("{\n" if first else ",\n") + f"  {json.dumps(repo)}: {json.dumps(split)}")
            first = False
        f.write("{}\n" if first else "\n}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)


def split_table(ctx: Ctx) -> RepoTable:
    """Repository key -> TRAIN / VALIDATION, as the split stage wrote it."""
    return RepoTable(lambda p: ctx.work.part("split", p), ctx.cfg.buckets)
