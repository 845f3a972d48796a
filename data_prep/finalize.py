"""The final merge: per-unit stats become ``manifest.json`` (written last), ``report.md`` and ``decontamination.jsonl``.

It reads only stats, the tokenizer and the per-bucket decontamination lists (merged in id order), so it
is cheap and runs as one task at the end of the chain, on Slurm as the last job.
"""

from __future__ import annotations

import heapq
import re
from collections import Counter
from pathlib import Path

from data_prep.config import config_hash
from data_prep.doc_stages import near_removed, near_removed_path
from data_prep.report import REPORT_ROWS, write_report
from data_prep.split import SPLITS
from data_prep.store import read_jsonl_gz
from data_prep.tokenizer import EOS, SPECIAL_TOKENS, load_dir
from data_prep.tokens import pack_units
from data_prep.work import STAGES, Ctx, add_stats, crash_hook, stage_stats
from ultrascale.data.shards import write_manifest
from ultrascale.data.tokcheck import VOCAB_KEY, vocab_sha256
from ultrascale.jsonio import read_json, write_jsonl

DOC_STAGES = ("license", "exact_dedup", "near_dedup", "pii", "decontam")


def _merge_map(ctx: Ctx) -> dict:
    merged: dict = {"counts": Counter(), "read": stage_stats(), "quality": stage_stats()}
    for r in range(ctx.work.map_tasks):
        st = ctx.work.read_unit("map", r)
        merged["counts"].update(st["counts"])
        add_stats(merged["read"], st["read"])
        add_stats(merged["quality"], st["quality"])
    return merged


def _stage_table(m: dict, stats: dict) -> dict:
    """Ordered stage -> {docs_in, docs_out, bytes_in, bytes_out, dropped} over the whole pipeline."""
    c = m["counts"]
    table = {}
    if "files_seen" in c:
        table["language"] = stage_stats(c["files_seen"], c["files_language"])
        table["sample"] = stage_stats(c["files_language"], c["files_selected"])
    table["read"] = m["read"]
    if c.get("language_unselected"):
        table["language"] = stage_stats(m["read"]["docs_out"] + c["language_unselected"], m["read"]["docs_out"])
    table["quality"] = m["quality"]
    for name in DOC_STAGES:
        table[name] = stats[name]
    return table


def task_records(ctx: Ctx) -> dict[str, list[dict]]:
    """Per stage, every task's record (seconds, peak RSS, units) in this ``_work/``."""
    out = {}
    for stage in STAGES:
        d = ctx.work.dir(stage)
        out[stage] = [read_json(p) for p in sorted(d.glob("task_*.json"))] if d.exists() else []
    return out


def _decontamination_list(ctx: Ctx) -> list[dict]:
    runs = [read_jsonl_gz(ctx.work.bucket("clean", b, ".decontam.jsonl.gz")) for b in range(ctx.cfg.buckets)]
    rows = list(heapq.merge(*runs, key=lambda r: r["id"]))
    write_jsonl(ctx.work.out / "decontamination.jsonl", rows)
    return rows


def _remove_stale_shards(out: Path, splits: dict) -> None:
    """Shards of an earlier, larger run of this output directory that the new manifest does not list."""
    for split in SPLITS:
        listed = {s["path"] for s in splits[split]["shards"]} | {
            s["loss_mask"]["path"] for s in splits[split]["shards"] if "loss_mask" in s
        }
        for p in (out / split).glob("*.npy"):
            if re.fullmatch(r"(shard|mask)_\d+\.npy", p.name) and f"{split}/{p.name}" not in listed:
                p.unlink()


def _added(ctx: Ctx) -> dict:
    """``tokenizer_added`` when ``tokenizer.add_fim`` grew the tokenizer (the clean stage's tokenizer unit says)."""
    from ultrascale.data.tokcheck import ADDED_KEY

    added = ctx.work.read_unit("clean", ctx.cfg.buckets).get("added")
    return {ADDED_KEY: added} if added else {}


def finalize_unit(ctx: Ctx, unit: int) -> dict:
    cfg, work = ctx.cfg, ctx.work
    B = cfg.buckets
    map_stats = _merge_map(ctx)
    stats = {name: stage_stats() for name in DOC_STAGES}
    kept_by_license: Counter = Counter()
    redactions: Counter = Counter()
    docs_redacted = 0
    decontam_info: dict = {"benchmarks": {}, "unavailable": []}
    for b in range(B):
        sig = work.read_unit("signatures", b)
        add_stats(stats["license"], sig["license"])
        kept_by_license.update(sig["kept_by_license"])
        cl = work.read_unit("clean", b)
        for name in ("exact_dedup", "near_dedup", "pii", "decontam"):
            add_stats(stats[name], cl[name])
        redactions.update(cl["redactions"])
        docs_redacted += cl["docs_redacted"]
        if cfg.decontam.enabled:
            decontam_info = {"benchmarks": cl["decontam_available"], "unavailable": cl["decontam_unavailable"]}
    cluster = work.read_unit("cluster", 0)
    split = work.read_unit("split", 0)["splits"]
    decon = _decontamination_list(ctx)
    details = {
        "license": {"kept_by_license": dict(sorted(kept_by_license.items()))},
        "near_dedup": {
            "bands": cluster["bands"],
            "rows": cluster["rows"],
            # The report shows the count and the first rows; the full list stays on disk, never in memory.
            "removed": near_removed(ctx, REPORT_ROWS),
            "removed_total": cluster["near"],
            "removed_list": near_removed_path(ctx).relative_to(work.out).as_posix() if cfg.keep_work else None,
        },
        "pii": {"redactions": dict(sorted(redactions.items())), "docs_redacted": docs_redacted},
        "decontam": {**decontam_info, "removed": decon},
    }
    for name, key in (("license", "license"), ("near_dedup", "near_dedup"), ("pii", "pii"), ("decontam", "decontam")):
        if not getattr(cfg, key).enabled:
            details[name] = {"skipped": True}
    for name in ("exact_dedup",):
        if not cfg.exact_dedup.enabled:
            details[name] = {"skipped": True}

    tok = load_dir(work.out / "tokenizer")
    vocab = tok.get_vocab_size(with_added_tokens=True)
    seq = cfg.pack.seq_len
    entries: dict[str, list[dict]] = {s: [] for s in SPLITS}
    for u in range(len(pack_units(ctx))):
        st = work.read_unit("pack", u)
        entries[st["split"]].append(st["entry"])
    splits_entry, pack_stats = {}, {}
    for s in SPLITS:
        n = sum(e["num_samples"] for e in entries[s])
        splits_entry[s] = {"shards": entries[s], "num_samples": n, "num_tokens": n * seq}
        per = [work.read_unit("tokenize", b)[s] for b in range(B)]
        doc_tokens, eos_tokens = sum(p["doc_tokens"] for p in per), sum(p["eos_tokens"] for p in per)
        fim: Counter = Counter()
        for p in per:
            fim.update(p["fim"])
        pack_stats[s] = {
            "docs": sum(p["docs"] for p in per),
            "repos": split[s]["repos"],
            "bytes": sum(p["bytes"] for p in per),
            "doc_tokens": doc_tokens,
            "eos_tokens": eos_tokens,
            "pad_tokens": n * seq - doc_tokens - eos_tokens,
            "samples": n,
            "fim": dict(sorted(fim.items())),
        }
    manifest = {
        "seq_len": seq,
        "vocab_size": vocab,
        "eos_token_id": tok.token_to_id(EOS),
        "tokenizer": "tokenizer",
        "splits": splits_entry,
        "config_hash": config_hash(cfg),
        "seed": cfg.seed,
        "buckets": B,
        "special_tokens": {t: tok.token_to_id(t) for t in SPECIAL_TOKENS},
        **_added(ctx),
        VOCAB_KEY: vocab_sha256(work.out / "tokenizer"),
        "fim": {
            "applied": "prep_time",
            "rate": cfg.fim.rate,
            "spm_rate": cfg.fim.spm_rate,
            "metadata": cfg.fim.metadata,
        },
        "stages": _stage_table(map_stats, stats),
        "bad_input": {k: v for k, v in map_stats["read"]["dropped"].items() if v},
        "quality_dropped": map_stats["quality"]["dropped"],
        "pii": details["pii"],
        "near_dedup": {k: v for k, v in details["near_dedup"].items() if not k.startswith("removed")},
        "decontamination": {
            "benchmarks": decontam_info["benchmarks"],
            "unavailable": decontam_info["unavailable"],
            "removed": len(decon),
            "list": "decontamination.jsonl",
        },
        "license": details["license"],
        "pack": pack_stats,
        "tokens": {s: pack_stats[s]["samples"] * seq for s in pack_stats},
        "repo_split": "repos.json",
    }
    write_report(work.out, manifest, details, task_records(ctx))
    _remove_stale_shards(work.out, splits_entry)
    crash_hook("finalize")
    write_manifest(work.out, manifest)
    return {"samples": {s: splits_entry[s]["num_samples"] for s in SPLITS}}
