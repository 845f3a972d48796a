"""PII and secrets redaction: each match becomes a typed placeholder (``<EMAIL>``, ``<KEY>``, ...) and is counted.

Regexes follow BigCode's PII pipeline where it has one (emails, IPs, keys) and add private-key blocks
and passwords in assignments. Candidates for IP addresses are validated with :mod:`ipaddress`, so
version strings like ``1.2.3`` and slices like ``a[::2]`` are left alone.
"""

from __future__ import annotations

import ipaddress
import re
from collections import Counter

PLACEHOLDERS = {
    "email": "<EMAIL>",
    "ipv4": "<IP_ADDRESS>",
    "ipv6": "<IP_ADDRESS>",
    "key": "<KEY>",
    "private_key": "<PRIVATE_KEY>",
    "password": "<PASSWORD>",
}

_PRIVATE_KEY = re.compile(
    r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----.*?-----END (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----",
    re.DOTALL,
)
_EMAIL = re.compile(r"(?<![\w.+-])[A-Za-z0-9._%+-]+@(?:[A-Za-z0-9-]+\.)+[A-Za-z]{2,}(?![\w-])")
_KEY = re.compile(
    r"\b(?:"
    r"AKIA[0-9A-Z]{16}"  # AWS access key id
    r"|gh[pousr]_[A-Za-z0-9]{36,255}"  # GitHub tokens
    r"|github_pat_[A-Za-z0-9_]{50,255}"
    r"|xox[abposr]-[A-Za-z0-9-]{10,72}"  # Slack
    r"|AIza[0-9A-Za-z_\-]{35}"  # Google API key
    r"|sk-(?:proj-)?[A-Za-z0-9_\-]{32,}"  # OpenAI-style secret keys
    r"|sk_live_[0-9a-zA-Z]{24,}"  # Stripe
    r"|hf_[A-Za-z0-9]{34,}"  # Hugging Face
    r"|glpat-[A-Za-z0-9_\-]{20}"  # GitLab
    r"|eyJ[A-Za-z0-9_-]{10,}\.eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}"  # JWT
    r")"
)
# name = "value" where the name says it is a secret; the value must look like one (no spaces, >= 6 chars)
_PASSWORD = re.compile(
    r"(?i)(\b[\w.]*(?:password|passwd|pwd|secret|api_?key|access_?token|auth_?token)[\w.]*[\"']?\s*[:=]\s*)"
    r"([\"'])([^\"'\s]{6,})\2"
)
_IPV4 = re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?![\w.])")
# Cheap necessary conditions, checked before each detector: Python's regex engine tries every position of
# a pattern that opens with an assertion, so on code without a candidate most of the time went to finding
# nothing (the stdlib: 15.1 s -> see data_prep/README.md). Each prefilter can only miss text the detector
# itself would not change, so the output is identical.
_KEY_PREFIXES = (
    "AKIA",
    "ghp_",
    "gho_",
    "ghu_",
    "ghs_",
    "ghr_",
    "github_pat_",
    "xox",
    "AIza",
    "sk-",
    "sk_live_",
    "hf_",
    "glpat-",
    "eyJ",
)
_PASSWORD_WORDS = re.compile(r"(?i)password|passwd|pwd|secret|api_?key|access_?token|auth_?token")
_PASSWORD_ASCII = (
    "password",
    "passwd",
    "pwd",
    "secret",
    "apikey",
    "api_key",
    "accesstoken",
    "access_token",
    "authtoken",
    "auth_token",
)
_EMAIL_AT = re.compile(r"[A-Za-z0-9._%+-]@[A-Za-z0-9-]")
_IPV4_DOTS = re.compile(r"\d\.\d{1,3}\.\d{1,3}\.\d")
_IPV6_COLONS = re.compile(r"[0-9A-Fa-f]:[0-9A-Fa-f]{0,4}:")
_IPV6 = re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{1,4}:){1,7}:?(?:[0-9A-Fa-f]{1,4}:?){0,7}(?![\w:])")


def _sub_ip(pattern: re.Pattern, kind: str, text: str, counts: Counter) -> str:
    def repl(m: re.Match) -> str:
        s = m.group(0)
        if kind == "ipv6" and (s.count(":") < 2 or sum(1 for g in s.split(":") if g) < 3):
            return s
        try:
            ipaddress.ip_address(s)
        except ValueError:
            return s
        counts[kind] += 1
        return PLACEHOLDERS[kind]

    return pattern.sub(repl, text)


def _password_word(text: str) -> bool:
    """``_PASSWORD_WORDS.search(text)``; in C for ASCII text (a case-insensitive regex alternation tries every
    position). Non-ASCII text keeps the regex: under IGNORECASE 's' also matches 'ſ' (U+017F)."""
    if text.isascii():
        low = text.lower()
        return any(w in low for w in _PASSWORD_ASCII)
    return _PASSWORD_WORDS.search(text) is not None


def redact(text: str, kinds: list[str] | tuple[str, ...]) -> tuple[str, Counter]:
    """Return the redacted text and the number of redactions per kind."""
    counts: Counter = Counter()
    if "private_key" in kinds:
        text, n = _PRIVATE_KEY.subn(PLACEHOLDERS["private_key"], text)
        counts["private_key"] += n
    if "key" in kinds and any(p in text for p in _KEY_PREFIXES):
        text, n = _KEY.subn(PLACEHOLDERS["key"], text)
        counts["key"] += n
    if "password" in kinds and _password_word(text):
        text, n = _PASSWORD.subn(lambda m: f"{m.group(1)}{m.group(2)}{PLACEHOLDERS['password']}{m.group(2)}", text)
        counts["password"] += n
    if "email" in kinds and "@" in text and _EMAIL_AT.search(text):
        text, n = _EMAIL.subn(PLACEHOLDERS["email"], text)
        counts["email"] += n
    if "ipv4" in kinds and _IPV4_DOTS.search(text):
        text = _sub_ip(_IPV4, "ipv4", text, counts)
    if "ipv6" in kinds and ":" in text and _IPV6_COLONS.search(text):
        text = _sub_ip(_IPV6, "ipv6", text, counts)
    return text, +counts
