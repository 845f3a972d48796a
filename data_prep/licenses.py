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
