"""``report.md``: the human-readable account of a prep run (the manifest is the machine-readable one)."""

from __future__ import annotations

from pathlib import Path

from data_prep.work import WHERE
from ultrascale.atomic import atomic_write_text

REPORT_ROWS = 50  # near-duplicate removals listed in report.md; the full list is the cluster step's file


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f}"


def _where_it_ran(records: dict[str, list[dict]]) -> tuple[list[str], float]:
    """The per-stage table (tasks, units, task-seconds, peak RSS of its processes) and the wall span."""
    lines = [
        "## Where it ran",
        "",
        "| stage | partitioned over | tasks | units | task-seconds | peak RSS per process (MB) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    starts, ends = [], []
    for stage, recs in records.items():
        if not recs:
            continue
        starts += [r["start"] for r in recs]
        ends += [r["end"] for r in recs]
        lines.append(
            f"| {stage} | {WHERE[stage]} | {len({(r['world'], r['rank']) for r in recs})} | "
            f"{sum(len(r['units']) for r in recs)} | {sum(r['seconds'] for r in recs):.1f} | "
            f"{max(r['peak_rss_mb'] for r in recs):.0f} |"
        )
    return lines, (max(ends) - min(starts)) if starts else 0.0


def write_report(out: Path, manifest: dict, details: dict, records: dict[str, list[dict]]) -> None:
    where, wall = _where_it_ran(records)
    lines = [
        f"# Data prep report: `{out}`",
        "",
        f"Config hash `{manifest['config_hash']}`, seed {manifest['seed']}, seq_len {manifest['seq_len']}, "
        f"vocab {manifest['vocab_size']}, {manifest['buckets']} buckets; stages ran {wall:.1f} s "
        "(first task start to last task end, this run and any it resumed).",
        "",
        "## Stages",
        "",
        "| stage | docs in | docs out | MB in | MB out | dropped |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, st in manifest["stages"].items():
        dropped = ", ".join(f"{k}={v}" for k, v in sorted(st["dropped"].items()) if v) or "-"
        lines.append(
            f"| {name} | {st['docs_in']} | {st['docs_out']} | {_mb(st['bytes_in'])} | {_mb(st['bytes_out'])} | {dropped} |"
        )
    lines += ["", "## Splits (by repository)", "", "| split | repos | docs | doc tokens | samples | tokens | FIM |"]
    lines.append("|---|---:|---:|---:|---:|---:|---|")
    for split, p in manifest["pack"].items():
        fim = ", ".join(f"{k}={v}" for k, v in p["fim"].items())
        lines.append(
            f"| {split} | {p['repos']} | {p['docs']} | {p['doc_tokens']} | {p['samples']} | "
            f"{p['samples'] * manifest['seq_len']} | {fim} |"
        )
    pii = manifest.get("pii", {})
    lines += ["", "## PII and secrets", ""]
    red = pii.get("redactions", {})
    lines.append(
        (", ".join(f"{k}: {v}" for k, v in red.items()) or "none found")
        + f" (in {pii.get('docs_redacted', 0)} documents)"
    )
    dec = manifest["decontamination"]
    lines += ["", "## Decontamination", ""]
    lines.append(
        f"Benchmarks checked: {dec['benchmarks'] or 'none'}; unavailable: {dec['unavailable'] or 'none'}; "
        f"removed {dec['removed']} documents."
    )
    removed = details.get("decontam", {}).get("removed", [])
    if removed:
        lines += ["", "| document | benchmark item | n-gram overlap |", "|---|---|---:|"]
        lines += [f"| {r['id']} | {r['benchmark_item']} | {r['overlap']:.2f} |" for r in removed]
    nd = details.get("near_dedup", {})
    total = nd.get("removed_total", 0)
    if total:
        head = nd["removed"][:REPORT_ROWS]
        lines += [
            "",
            "## Near duplicates removed",
            "",
            f"Removed: {total}; "
            + (f"the first {len(head)} by id below. " if len(head) < total else "all below. ")
            + (
                f"The full list ({{id, kept}} rows, id order): `{nd['removed_list']}`."
                if nd.get("removed_list")
                else "The full list was in `_work/`, deleted at the end (keep_work=false)."
            ),
            "",
            "| removed | kept |",
            "|---|---|",
        ]
        lines += [f"| {r['id']} | {r['kept']} |" for r in head]
    lic = manifest.get("license", {}).get("kept_by_license", {})
    if lic:
        lines += ["", "## Licenses kept", "", ", ".join(f"{k}: {v}" for k, v in lic.items())]
    if manifest.get("bad_input"):
        lines += ["", "## Bad input skipped", "", ", ".join(f"{k}: {v}" for k, v in manifest["bad_input"].items())]
    lines += ["", *where]
    atomic_write_text(out / "report.md", "\n".join(lines) + "\n")
