"""License detection (SPDX headers and license-file text) and the per-repository license filter.

Detection is keyword-based: a license file is matched by phrases that appear in the canonical text of
each license. That misses exotic licenses (they come out as unknown, handled by ``license.unknown``), but
it never needs a network or a large model.
"""

from __future__ import annotations

import re

SPDX_HEADER = re.compile(r"SPDX-License-Identifier:\s*([A-Za-z0-9.+\-]+(?:\s+(?:OR|AND|WITH)\s+[A-Za-z0-9.+\-]+)*)")

# (spdx, phrases that must all appear, lower-case). Order matters: the first match wins, and the PSF
# license comes first because its text discusses GPL compatibility.
_RULES: list[tuple[str, tuple[str, ...]]] = [
    ("PSF-2.0", ("python software foundation license",)),
    ("AGPL-3.0", ("gnu affero general public license",)),
    ("LGPL-3.0", ("gnu lesser general public license", "version 3")),
    ("LGPL-2.1", ("gnu lesser general public license", "version 2.1")),
    ("GPL-3.0", ("gnu general public license", "version 3")),
    ("GPL-2.0", ("gnu general public license", "version 2")),
    ("Apache-2.0", ("apache license", "version 2.0")),
    ("MPL-2.0", ("mozilla public license", "2.0")),
    ("BSD-3-Clause", ("redistribution and use in source and binary forms", "neither the name")),
    ("BSD-2-Clause", ("redistribution and use in source and binary forms",)),
    ("MIT", ("permission is hereby granted, free of charge",)),
    ("ISC", ("permission to use, copy, modify, and/or distribute this software for any purpose",)),
    ("Unlicense", ("this is free and unencumbered software released into the public domain",)),
    ("CC0-1.0", ("cc0 1.0 universal",)),
    ("Zlib", ("this software is provided 'as-is', without any express or implied",)),
]


def detect_license_file(text: str) -> str | None:
    low = " ".join(text.lower().split())
    for spdx, phrases in _RULES:
        if all(p in low for p in phrases):
            return spdx
    return None


def spdx_from_header(text: str) -> str | None:
    """An ``SPDX-License-Identifier`` in the first 2 KB wins over any license file."""
    m = SPDX_HEADER.search(text[:2048])
    return m.group(1) if m else None


_CLASSIFIERS = {
    "MIT License": "MIT",
    "MIT No Attribution License (MIT-0)": "MIT-0",
    "Apache Software License": "Apache-2.0",
    "BSD License": "BSD-3-Clause",
    "Python Software Foundation License": "PSF-2.0",
    "ISC License (ISCL)": "ISC",
    "The Unlicense (Unlicense)": "Unlicense",
    "Mozilla Public License 2.0 (MPL 2.0)": "MPL-2.0",
    "GNU General Public License v2 (GPLv2)": "GPL-2.0",
    "GNU General Public License v3 (GPLv3)": "GPL-3.0",
    "GNU Lesser General Public License v3 (LGPLv3)": "LGPL-3.0",
    "GNU Affero General Public License v3": "AGPL-3.0",
}
"""Trove ``License :: OSI Approved :: ...`` names -> SPDX (the classifier says "BSD" without its clauses: read as
BSD-3-Clause, the common one; a license file that says otherwise wins)."""


def distribution_license(metadata: str, license_texts: list[str]) -> str | None:
    """The SPDX expression of an installed distribution: its ``License-Expression`` (PEP 639), else its license
    files' text, else its ``License ::`` classifiers (every one, joined with AND), else a ``License:`` field that is
    a bare SPDX id. None when nothing says (``license.unknown`` decides)."""
    fields = [ln.split(":", 1) for ln in metadata.split("\n\n", 1)[0].splitlines() if ":" in ln]
    header = [(k.strip(), v.strip()) for k, v in fields]
    for k, v in header:
        if k == "License-Expression" and v:
            return v
    for text in license_texts:
        if spdx := detect_license_file(text):
            return spdx
    found = [_CLASSIFIERS[v.rsplit("::", 1)[-1].strip()] for k, v in header
             if k == "Classifier" and v.startswith("License ::") and v.rsplit("::", 1)[-1].strip() in _CLASSIFIERS]  # fmt: skip
    if found:
        return " AND ".join(sorted(set(found)))
    for k, v in header:
        if k == "License" and re.fullmatch(r"[A-Za-z0-9.+\-]+", v or ""):
            return v
    return None


def spdx_ids(expr: str) -> list[str]:
    return [t for t in re.split(r"\s+(?:OR|AND|WITH)\s+|[()]", expr) if t.strip()]


def decide(lics: set[str], allowed: set[str], unknown: str) -> tuple[bool, str]:
    """(keep, reason) for a repository whose files carry the license expressions ``lics`` (lower-case ``allowed``).

    Every expression must be allowed (an ``OR`` needs one allowed id); no license at all follows ``unknown``.
    """
    if not lics:
        return unknown == "keep", "unknown"
    bad = []
    for expr in sorted(lics):
        ids = spdx_ids(expr)
        ok = any(i.lower() in allowed for i in ids) if " OR " in expr else all(i.lower() in allowed for i in ids)
        if not ok:
            bad.append(expr)
    return not bad, ",".join(bad) if bad else ",".join(sorted(lics))
