"""The document stages, one unit of work each: read, license, signatures, dedup candidates, cluster, clean.

Each function does one unit (a map task, a repository partition, a document bucket, a key partition, or
the one cluster step) from its inputs under ``_work/`` and returns the unit's stats; the stage runner
(:mod:`data_prep.stages`) writes those last. Documents stay in their seeded document bucket from the map
to the end: per-repository decisions (license here, the split in :mod:`data_prep.split`) travel as small
tables keyed by repository, and dedup moves only keys and pairs, never documents.
"""

from __future__ import annotations

import gzip
import itertools
import json
import os
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from data_prep import dedup, licenses, pii
from data_prep.decontam import Decontaminator
from data_prep.filters import quality_reason
from data_prep.sources import iter_documents
from data_prep.store import (
    RepoTable,
    doc_bucket,
    load_npy,
    part_range,
    read_jsonl_gz,
    read_run,
    repo_key,
    repo_part,
    save_npy,
    write_jsonl_gz,
    write_run,
    write_table,
)
from data_prep.work import Ctx, add_stats, crash_hook, nbytes, stage_stats
from ultrascale.errors import DataError

DOC_FIELDS = ("id", "text", "repo", "path", "lang", "license")
KEY_DTYPE = np.dtype([("part", "<u4"), ("kind", "<u2"), ("key", "<u8"), ("row", "<u4")])
PAIR_DTYPE = np.dtype([("a", "<i8"), ("b", "<i8"), ("exact", "u1")])
REMOVED_DTYPE = np.dtype([("bucket", "<u4"), ("row", "<u4"), ("why", "u1")])
EXACT, NEAR = 1, 2
NEAR_REMOVED, EXACT_REMOVED = "near_removed.jsonl.gz", "exact_removed.jsonl.gz"


def _ref(bucket: int, rows: np.ndarray) -> np.ndarray:
    return (np.int64(bucket) << np.int64(32)) | rows.astype(np.int64)


def _gather(ctx: Ctx, suffix: str, refs: np.ndarray) -> np.ndarray:
    """Rows ``refs`` (``bucket << 32 | row``) of the signatures stage's per-bucket arrays ``b*<suffix>``."""
    buckets, rows = refs >> 32, refs & 0xFFFFFFFF
    got = []
    for b in np.unique(buckets).tolist():
        sel = np.flatnonzero(buckets == b)
        arr = ctx.once(f"{suffix}:{b}", lambda b=b: load_npy(ctx.work.bucket("signatures", b, suffix)))
        got.append((sel, np.asarray(arr[rows[sel]])))
    if not got:
        return None
    # The widest dtype of any bucket: ids are ``S<longest id in the bucket>``, and a narrower one would truncate.
    out = np.empty((len(refs), *got[0][1].shape[1:]), dtype=np.result_type(*(g.dtype for _, g in got)))
    for sel, g in got:
        out[sel] = g
    return out


# ------------------------------------------------------------------------------------------------- map


def map_unit(ctx: Ctx, rank: int) -> dict:
    """Read this task's share of the input, filter, hash, and scatter the documents into their buckets."""
    cfg, out = ctx.cfg, ctx.work.map_task(rank)
    out.mkdir(parents=True, exist_ok=True)
    counts: Counter = Counter()
    quality: Counter = Counter()
    files: dict[int, gzip.GzipFile] = {}
    repos: dict[str, set[str]] = defaultdict(set)
    n_read = n_kept = bytes_read = bytes_kept = 0
    with ExitStack() as stack:
        for doc in iter_documents(cfg, rank, ctx.world, counts, ctx.progress, ctx.work.dir("map") / "files.json"):
            n_read += 1
            nb = nbytes(doc["text"])
            bytes_read += nb
            if cfg.quality.enabled and (why := quality_reason(doc["text"], cfg.quality)):
                quality[why] += 1
                continue
            doc["sha256"] = dedup.content_hash(doc["text"])
            b = doc_bucket(cfg.seed, doc["id"], cfg.buckets)
            if b not in files:
                tmp = out / f".b{b:05d}.jsonl.gz.tmp"
                files[b] = stack.enter_context(gzip.open(tmp, "wt", encoding="utf-8", compresslevel=1))
            files[b].write(json.dumps(doc, ensure_ascii=False) + "\n")
            repos[doc["repo"]]
            if doc.get("license"):
                repos[doc["repo"]].add(doc["license"])
            n_kept += 1
            bytes_kept += nb
    for b in files:
        os.replace(out / f".b{b:05d}.jsonl.gz.tmp", out / f"b{b:05d}.jsonl.gz")
    crash_hook(f"map:{rank}")
    write_run(out / "repos", [(repo_key(cfg.seed, r), {"repo": r, "lic": sorted(lic)}) for r, lic in repos.items()])
    bad = {k: v for k, v in counts.items() if k not in ("files_seen", "files_language", "files_selected", "read_in")}
    return {
        "counts": dict(counts),
        "read": stage_stats(counts["read_in"], n_read, 0, bytes_read, **bad),
        "quality": stage_stats(n_read, n_kept, bytes_read, bytes_kept, **quality),
        "buckets": sorted(files),
    }


# --------------------------------------------------------------------------------------------- license


def license_unit(ctx: Ctx, p: int) -> dict:
    """Decide the license of every repository in key range ``p`` from the license sets each map task saw."""
    cfg = ctx.cfg
    lo, hi = part_range(p, cfg.buckets)
    seen: dict[int, tuple[str, set[str]]] = {}
    for r in range(ctx.work.map_tasks):
        for key, row in read_run(ctx.work.map_task(r) / "repos", lo, hi):
            name, lic = seen.setdefault(key, (row["repo"], set()))
            if name != row["repo"]:
                raise DataError(f"repositories {name!r} and {row['repo']!r} share a 64-bit key: rename one")
            lic.update(row["lic"])
    allowed = {a.lower() for a in cfg.license.allow}
    keys = sorted(seen)
    reasons: list[str] = []
    codes = np.zeros(len(keys), dtype=np.uint32)  # 0 keeps the repository, k drops it for reasons[k - 1]
    for i, key in enumerate(keys):
        keep, why = licenses.decide(seen[key][1], allowed, cfg.license.unknown) if cfg.license.enabled else (True, "")
        if not keep:
            if why not in reasons:
                reasons.append(why)
            codes[i] = reasons.index(why) + 1
    write_table(ctx.work.part("license", p), np.array(keys, dtype=np.uint64), codes)
    return {"repos": len(keys), "dropped_repos": int((codes > 0).sum()), "reasons": reasons}


def _license_reasons(ctx: Ctx) -> dict[int, list[str]]:
    return {p: ctx.work.read_unit("license", p)["reasons"] for p in range(ctx.cfg.buckets)}


# ------------------------------------------------------------------------------------------ signatures


def signatures_unit(ctx: Ctx, b: int) -> dict:
    """Gather bucket ``b`` from every map task, apply the license verdicts, and emit its dedup keys.

    Writes the kept documents in id order (their row numbers are how later stages name them), their ids,
    content hashes and MinHash signatures as arrays, and one record per dedup key (the content hash, and
    each LSH band key) tagged with the key's partition.
    """
    cfg, work = ctx.cfg, ctx.work
    docs: list[dict] = []
    for r in range(work.map_tasks):
        f = work.map_task(r) / f"b{b:05d}.jsonl.gz"
        if f.exists():
            docs.extend(read_jsonl_gz(f))
    docs.sort(key=lambda d: d["id"])
    for x, y in itertools.pairwise(docs):
        if x["id"] == y["id"]:
            raise DataError(f"two input files give the document id {x['id']!r}: rename one of them")
    lic_stats = stage_stats(len(docs), 0, sum(nbytes(d["text"]) for d in docs), 0)
    if cfg.license.enabled and docs:
        table = ctx.once("license", lambda: RepoTable(lambda p: work.part("license", p), cfg.buckets))
        reasons = ctx.once("license_reasons", lambda: _license_reasons(ctx))
        keys = [repo_key(cfg.seed, d["repo"]) for d in docs]
        codes = table.lookup(keys)
        kept = []
        for d, key, code in zip(docs, keys, codes.tolist()):
            if code:
                why = reasons[repo_part(key, cfg.buckets)][code - 1]
                lic_stats["dropped"][why] = lic_stats["dropped"].get(why, 0) + 1
            else:
                kept.append(d)
        docs = kept
    lic_stats["docs_out"] = len(docs)
    lic_stats["bytes_out"] = sum(nbytes(d["text"]) for d in docs)
    by_license = Counter(d.get("license") or "unknown" for d in docs)

    write_jsonl_gz(work.bucket("signatures", b, ".jsonl.gz"), ({k: d[k] for k in DOC_FIELDS} for d in docs))
    ids = [d["id"].encode("utf-8") for d in docs]
    save_npy(work.bucket("signatures", b, ".ids.npy"), np.array(ids, dtype=f"S{max(map(len, ids), default=1)}"))
    sha = np.frombuffer(b"".join(bytes.fromhex(d["sha256"]) for d in docs), dtype=np.uint8).reshape(-1, 32)
    save_npy(work.bucket("signatures", b, ".sha.npy"), sha)
    rows = np.arange(len(docs), dtype=np.uint32)
    parts = [np.zeros(0, dtype=KEY_DTYPE)]
    if cfg.exact_dedup.enabled and docs:
        k = sha[:, :8].copy().view(">u8").ravel().astype(np.uint64)
        parts.append(_records(k, np.zeros(len(docs), dtype=np.uint16), rows, cfg.buckets))
    if cfg.near_dedup.enabled:
        nd = cfg.near_dedup
        hasher = ctx.once("minhash", lambda: dedup.MinHasher(nd.num_perm, nd.ngram))
        sigs = hasher.signatures([d["text"] for d in docs])
        save_npy(work.bucket("signatures", b, ".sig.npy"), sigs)
        bands, r = dedup.bands_rows(nd.threshold, nd.num_perm, nd.bands)
        if docs:
            keys = dedup.band_keys(sigs, bands, r)
            kind = np.broadcast_to(np.arange(1, bands + 1, dtype=np.uint16), keys.shape)
            parts.append(_records(keys.ravel(), kind.ravel(), np.repeat(rows, bands), cfg.buckets))
    recs = np.concatenate(parts)
    recs.sort(order=["part", "kind", "key", "row"])
    save_npy(work.bucket("signatures", b, ".keys.npy"), recs)
    # Repository sizes for the split: per repository here, per row for the cluster step to take off.
    rkeys = [repo_key(cfg.seed, d["repo"]) for d in docs]
    chars = [len(d["text"]) for d in docs]
    save_npy(work.bucket("signatures", b, ".rkey.npy"), np.array(rkeys, dtype=np.uint64))
    save_npy(work.bucket("signatures", b, ".chars.npy"), np.array(chars, dtype=np.int64))
    sizes: dict[int, list] = {}
    for d, key, n in zip(docs, rkeys, chars):
        sizes.setdefault(key, [d["repo"], 0])[1] += n
    write_run(work.bucket("signatures", b, ".repos"), [(k, {"repo": r, "chars": n}) for k, (r, n) in sizes.items()])
    return {"license": lic_stats, "kept_by_license": dict(by_license), "docs": len(docs)}


def _records(keys: np.ndarray, kind: np.ndarray, rows: np.ndarray, parts: int) -> np.ndarray:
    rec = np.empty(len(keys), dtype=KEY_DTYPE)
    rec["part"] = keys % np.uint64(parts)
    rec["kind"], rec["key"], rec["row"] = kind, keys, rows
    return rec


# ------------------------------------------------------------------------------------- dedup candidates


def near_dedup_unit(ctx: Ctx, p: int) -> dict:
    """Key partition ``p``: documents sharing a content hash or an LSH band key, confirmed, as pairs.

    Exact pairs are confirmed on the whole sha256, near pairs on the whole signature (estimated Jaccard
    >= ``near_dedup.threshold``). Each bucket's records of this partition are one slice of its sorted file.
    """
    cfg, work = ctx.cfg, ctx.work
    chunks = []
    for b in range(cfg.buckets):
        recs = load_npy(work.bucket("signatures", b, ".keys.npy"))
        if not len(recs):
            continue
        i, j = np.searchsorted(recs["part"], [p, p + 1])
        if j > i:
            c = np.asarray(recs[i:j])
            chunks.append((c["kind"].astype(np.int64), c["key"], _ref(b, c["row"])))
    kind, key, ref = (np.concatenate(x) for x in zip(*chunks)) if chunks else (np.zeros(0, np.int64),) * 3
    out = [np.zeros(0, dtype=PAIR_DTYPE)]
    exact = kind == 0
    cand_exact = dedup.candidate_pairs(kind[exact], key[exact].astype(np.uint64), ref[exact])
    if len(cand_exact):
        same = (_gather(ctx, ".sha.npy", cand_exact[:, 0]) == _gather(ctx, ".sha.npy", cand_exact[:, 1])).all(axis=1)
        out.append(_pairs(cand_exact[same], 1))
    cand_near = dedup.candidate_pairs(kind[~exact], key[~exact].astype(np.uint64), ref[~exact])
    if len(cand_near):
        ok = dedup.confirm(
            _gather(ctx, ".sig.npy", cand_near[:, 0]),
            _gather(ctx, ".sig.npy", cand_near[:, 1]),
            cfg.near_dedup.threshold,
        )
        out.append(_pairs(cand_near[ok], 0))
    pairs = np.concatenate(out)
    save_npy(work.part("near_dedup", p, ".npy"), pairs)
    return {
        "records": len(ref),
        "exact_candidates": len(cand_exact),
        "near_candidates": len(cand_near),
        "exact_pairs": int(pairs["exact"].sum()),
        "near_pairs": int((pairs["exact"] == 0).sum()),
    }


def _pairs(p: np.ndarray, exact: int) -> np.ndarray:
    out = np.empty(len(p), dtype=PAIR_DTYPE)
    out["a"], out["b"], out["exact"] = p[:, 0], p[:, 1], exact
    return out


# ------------------------------------------------------------------------------------------- cluster


def cluster_unit(ctx: Ctx, unit: int) -> dict:
    """Join every confirmed pair; in each cluster keep the lowest document id, say why the others go.

    A document identical to a lower id is removed as an exact duplicate (what exact dedup before near
    dedup would do); every other non-kept member is a near duplicate of the cluster's kept document.
    Only pairs come here, never documents.
    """
    cfg, work = ctx.cfg, ctx.work
    pairs = np.concatenate(
        [np.zeros(0, dtype=PAIR_DTYPE)] + [np.load(work.part("near_dedup", p, ".npy")) for p in range(cfg.buckets)]
    )
    nodes, idx = np.unique(np.stack([pairs["a"], pairs["b"]], axis=1), return_inverse=True)
    idx = idx.reshape(-1, 2)
    # Ids as one fixed-width bytes array, not Python strings; UTF-8 byte order is code point order, so a
    # stable argsort is ``sorted(ids)``.
    ids = _gather(ctx, ".ids.npy", nodes) if len(nodes) else np.zeros(0, dtype="S1")
    by_id = np.argsort(ids, kind="stable")
    rank = np.empty(len(nodes), dtype=np.int64)
    rank[by_id] = np.arange(len(nodes))
    exact_root = dedup.clusters(idx[pairs["exact"] == 1], rank)
    root = dedup.clusters(idx, rank)
    me = np.arange(len(nodes))
    why = np.where(exact_root != me, EXACT, np.where(root != me, NEAR, 0)).astype(np.uint8)
    gone = why > 0
    removed = np.empty(int(gone.sum()), dtype=REMOVED_DTYPE)
    removed["bucket"], removed["row"], removed["why"] = nodes[gone] >> 32, nodes[gone] & 0xFFFFFFFF, why[gone]
    removed.sort(order=["bucket", "row"])
    save_npy(work.dir("cluster") / "removed.npy", removed)
    crash_hook("cluster")
    gone_refs = nodes[gone]
    taken: Counter = Counter()
    if len(gone_refs):
        for key, n in zip(
            _gather(ctx, ".rkey.npy", gone_refs).tolist(), _gather(ctx, ".chars.npy", gone_refs).tolist()
        ):
            taken[key] -= n
    write_run(work.dir("cluster") / "removed_repos", [(k, {"chars": n}) for k, n in taken.items()])
    # The full lists ({id, kept}, in id order) stream to disk, one row at a time: never a list in memory.
    n_near = write_jsonl_gz(work.dir("cluster") / NEAR_REMOVED, _removals(ids, by_id, why, NEAR, root))
    n_exact = write_jsonl_gz(work.dir("cluster") / EXACT_REMOVED, _removals(ids, by_id, why, EXACT, exact_root))
    nd = cfg.near_dedup
    bands, rows = dedup.bands_rows(nd.threshold, nd.num_perm, nd.bands)
    return {
        "pairs": len(pairs),
        "documents": len(nodes),
        "exact": n_exact,
        "near": n_near,
        "bands": bands,
        "rows": rows,
    }


def _removals(ids: np.ndarray, by_id: np.ndarray, why: np.ndarray, kind: int, kept: np.ndarray) -> Iterator[dict]:
    """``{id, kept}`` for every node removed as ``kind``, in id order, made one at a time."""
    sel = by_id[why[by_id] == kind]
    for start in range(0, len(sel), 1 << 16):
        for i in sel[start : start + (1 << 16)].tolist():
            yield {"id": ids[i].decode("utf-8"), "kept": ids[kept[i]].decode("utf-8")}


def near_removed_path(ctx: Ctx) -> Path:
    """The cluster step's full list of near-duplicate removals (``{id, kept}`` rows, gzipped JSONL, id order)."""
    return ctx.work.dir("cluster") / NEAR_REMOVED


def near_removed(ctx: Ctx, limit: int | None = None) -> list[dict]:
    """The first ``limit`` near-duplicate removals in id order (all with None), read from disk."""
    with gzip.open(near_removed_path(ctx), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in itertools.islice(f, limit)]


# --------------------------------------------------------------------------------------------- clean


def removed_rows(ctx: Ctx, b: int) -> dict[int, int]:
    """Row -> EXACT or NEAR for bucket ``b``'s documents the cluster step removed."""
    removed = ctx.once("removed", lambda: load_npy(ctx.work.dir("cluster") / "removed.npy"))
    i, j = np.searchsorted(removed["bucket"], [b, b + 1])
    return dict(zip(removed["row"][i:j].tolist(), removed["why"][i:j].tolist()))


def decontaminator(ctx: Ctx) -> Decontaminator | None:
    dc = ctx.cfg.decontam
    if not dc.enabled:
        return None
    return ctx.once("decontam", lambda: Decontaminator(list(dc.benchmarks), dc.mbpp_path, dc.ngram, dc.min_overlap))


def clean_text(ctx: Ctx, text: str) -> tuple[str, Counter, tuple[str, float] | None]:
    """(redacted text, redactions by kind, the benchmark item it contains or None): what clean does to a kept
    document, and what the tokenizer's sample goes through too."""
    counts: Counter = Counter()
    if ctx.cfg.pii.enabled:
        text, counts = pii.redact(text, list(ctx.cfg.pii.kinds))
    det = decontaminator(ctx)
    return text, counts, det.match(text) if det else None


def clean_unit(ctx: Ctx, b: int) -> dict:
    """Bucket ``b``: drop the dedup removals, redact PII, drop contaminated files; count what each did."""
    cfg, work = ctx.cfg, ctx.work
    gone = removed_rows(ctx, b)
    det = decontaminator(ctx)
    exact, near, pii_st, dec_st = stage_stats(), stage_stats(), stage_stats(), stage_stats()
    redactions: Counter = Counter()
    docs_redacted = 0
    contaminated: list[dict] = []

    def kept_docs():
        nonlocal docs_redacted
        for row, d in enumerate(read_jsonl_gz(work.bucket("signatures", b, ".jsonl.gz"))):
            nb = nbytes(d["text"])
            why = gone.get(row, 0)
            add_stats(exact, stage_stats(1, why != EXACT, nb, nb * (why != EXACT)))
            if why == EXACT:
                continue
            add_stats(near, stage_stats(1, why != NEAR, nb, nb * (why != NEAR)))
            if why == NEAR:
                continue
            d["text"], c, m = clean_text(ctx, d["text"])
            redactions.update(c)
            docs_redacted += bool(c)
            nb_out = nbytes(d["text"])
            add_stats(pii_st, stage_stats(1, 1, nb, nb_out))
            add_stats(dec_st, stage_stats(1, m is None, nb_out, nb_out * (m is None)))
            if m:
                contaminated.append({"id": d["id"], "repo": d["repo"], "benchmark_item": m[0], "overlap": m[1]})
                continue
            yield d

    write_jsonl_gz(work.bucket("clean", b, ".jsonl.gz"), kept_docs())
    if cfg.exact_dedup.enabled:  # a stage that is off passes everything and reports no reasons
        exact["dropped"] = {"duplicate": exact["docs_in"] - exact["docs_out"]}
    if cfg.near_dedup.enabled:
        near["dropped"] = {"near_duplicate": near["docs_in"] - near["docs_out"]}
    if det:
        dec_st["dropped"] = {"contaminated": len(contaminated)}
    write_jsonl_gz(work.bucket("clean", b, ".decontam.jsonl.gz"), contaminated)
    return {
        "exact_dedup": exact,
        "near_dedup": near,
        "pii": pii_st,
        "decontam": dec_st,
        "redactions": dict(redactions),
        "docs_redacted": docs_redacted,
        "docs": dec_st["docs_out"],
        "decontam_available": det.available if det else {},
        "decontam_unavailable": det.unavailable if det else [],
    }
