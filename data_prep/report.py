"""``report.md``: the human-readable account of a prep run (the manifest is the machine-readable one)."""

from __future__ import annotations

from pathlib import Path


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f}"


def write_report(out: Path, manifest: dict, details: dict, seconds: float) -> None:
    lines = [
        f"# Data prep report: `{out}`",
        "",
        f"Config hash `{manifest['config_hash']}`, seed {manifest['seed']}, seq_len {manifest['seq_len']}, "
        f"vocab {manifest['vocab_size']}, reduce phase {seconds:.1f} s.",
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
    nd = details.get("near_dedup", {}).get("removed", [])
    if nd:
        lines += ["", "## Near duplicates removed", "", "| removed | kept |", "|---|---|"]
        lines += [f"| {r['id']} | {r['kept']} |" for r in nd[:200]]
        if len(nd) > 200:
            lines.append(f"| ... {len(nd) - 200} more | |")
    lic = manifest.get("license", {}).get("kept_by_license", {})
    if lic:
        lines += ["", "## Licenses kept", "", ", ".join(f"{k}: {v}" for k, v in lic.items())]
    if manifest.get("bad_input"):
        lines += ["", "## Bad input skipped", "", ", ".join(f"{k}: {v}" for k, v in manifest["bad_input"].items())]
    (out / "report.md").write_text("\n".join(lines) + "\n")
