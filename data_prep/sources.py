"""Readers: turn an input (directory, JSONL, Parquet, ``save_to_disk`` folder, or the stdlib) into documents.

A document is a plain dict ``{id, text, repo, path, lang, license}``. Ids are stable (relative path or
``file:line``), so the reduce stages can sort by id and produce the same output whatever the task count.
Bad input is skipped and counted by reason; it never stops a run (unless ``strict``).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import sysconfig
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from data_prep.config import DataPrepConfig
from data_prep.licenses import detect_license_file, distribution_license, spdx_from_header
from ultrascale.errors import DataError

log = logging.getLogger("data_prep")

LICENSE_FILE_PREFIXES = ("license", "licence", "copying")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def site_packages_root() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def resolve_input(cfg: DataPrepConfig) -> tuple[str, Path]:
    """Return (source type, path); one clear DataError if the input does not exist or is not recognised."""
    kind = cfg.source.type
    if cfg.input == "stdlib" or kind == "stdlib":
        return "dir", stdlib_root()
    if cfg.input == "site-packages":
        return "site_packages", site_packages_root()
    path = Path(cfg.input).expanduser()
    if not path.exists():
        raise DataError(f"input={cfg.input} does not exist: pass a directory, a .jsonl/.parquet file, input=stdlib "
                        "or input=site-packages")  # fmt: skip
    if kind != "auto":
        return kind, path
    if path.is_dir():
        if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
            return "hf_disk", path
        return "dir", path
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz", ".json", ".ndjson")):
        return "jsonl", path
    if name.endswith(".parquet"):
        return "parquet", path
    raise DataError(f"input={cfg.input}: unknown file type; use a directory, .jsonl[.gz], .parquet or set source.type")


def _stable_key(seed: int, s: str) -> str:
    return hashlib.sha1(f"{seed}:{s}".encode()).hexdigest()


def language_of(path: str, ext_map: dict[str, str]) -> str | None:
    return ext_map.get(os.path.splitext(path)[1].lower())


def extension_map(cfg: DataPrepConfig) -> dict[str, str]:
    return {ext.lower(): lang for lang, exts in cfg.language.extensions.items() for ext in exts}


def walk_files(root: Path, exclude: list[str], counts: Counter) -> list[str]:
    """All regular files under root as sorted relative paths; symlink loops and unreadable dirs are counted."""
    out: list[str] = []
    seen_dirs: set[tuple[int, int]] = set()
    excl = set(exclude)

    def onerror(err: OSError) -> None:
        counts["unreadable_dir"] += 1

    for dirpath, dirnames, filenames in os.walk(root, followlinks=True, onerror=onerror):
        try:
            st = os.stat(dirpath)
        except OSError:
            counts["unreadable_dir"] += 1
            dirnames[:] = []
            continue
        key = (st.st_dev, st.st_ino)
        if key in seen_dirs:  # a symlink back into a directory already walked
            counts["symlink_loop"] += 1
            dirnames[:] = []
            continue
        seen_dirs.add(key)
        dirnames[:] = sorted(d for d in dirnames if d not in excl)
        for f in filenames:
            out.append(os.path.relpath(os.path.join(dirpath, f), root))
    return sorted(out)


def repo_of(rel: str, depth: int) -> str:
    parts = Path(rel).parts
    return "/".join(parts[:depth]) if len(parts) > depth else rel


def license_map(root: Path, files: list[str]) -> dict[str, str]:
    """Directory (relative, '' = root) -> SPDX id of the license file found there."""
    found: dict[str, str] = {}
    for rel in files:
        name = os.path.basename(rel).lower()
        if name.startswith(LICENSE_FILE_PREFIXES):
            try:
                with open(root / rel, "rb") as f:
                    text = f.read(200_000).decode("utf-8", errors="replace")
            except OSError:
                continue
            spdx = detect_license_file(text)
            if spdx:
                found.setdefault(os.path.dirname(rel), spdx)
    return found


def nearest_license(rel: str, lic: dict[str, str]) -> str | None:
    if rel in lic:  # a single-module distribution in site-packages, licensed by name
        return lic[rel]
    d = os.path.dirname(rel)
    while True:
        if d in lic:
            return lic[d]
        if not d:
            return None
        d = os.path.dirname(d)


def distribution_licenses(root: Path) -> dict[str, str]:
    """A site-packages directory's top-level entries -> the SPDX license of the distribution that installed them
    (its ``*.dist-info``: ``RECORD`` says which entries are its, ``METADATA`` and its license files say the
    license). Its license files sit beside the code, not in it, so the walk's own license map cannot see them."""
    found: dict[str, str] = {}
    for info in sorted(root.glob("*.dist-info")):
        try:
            meta = (info / "METADATA").read_text(encoding="utf-8", errors="replace")
            record = (info / "RECORD").read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        texts = []
        for f in sorted(p for p in info.rglob("*") if p.is_file() and p.name.lower().startswith(LICENSE_FILE_PREFIXES)):
            try:
                texts.append(f.read_text(encoding="utf-8", errors="replace")[:200_000])
            except OSError:
                continue
        spdx = distribution_license(meta, texts)
        if spdx is None:
            continue
        for line in record.splitlines():
            top = line.split(",", 1)[0].split("/", 1)[0]
            if top and not top.endswith((".dist-info", ".pth")) and ".." not in top and top != "__pycache__":
                found.setdefault(top, spdx)
    return found


def select_files(cfg: DataPrepConfig, root: Path, counts: Counter,
                 site_packages: bool = False) -> tuple[list[str], dict[str, str]]:  # fmt: skip
    """Walk, select by language, sample ``max_files``; return (files, license map). Counts go to ``counts``.
    ``site_packages``: ``root`` is laid out as one, each top-level package licensed by its distribution."""
    files = walk_files(root, list(cfg.source.exclude), counts)
    lic = license_map(root, files)
    if site_packages:
        for top, spdx in distribution_licenses(root).items():
            lic.setdefault(top, spdx)
    ext_map = extension_map(cfg)
    if cfg.language.enabled:
        selected = [f for f in files if language_of(f, ext_map)]
    else:
        selected = list(files)
    counts["files_seen"], counts["files_language"] = len(files), len(selected)
    if cfg.source.max_files is not None and len(selected) > cfg.source.max_files:
        selected = sorted(sorted(selected, key=lambda f: _stable_key(cfg.seed, f))[: cfg.source.max_files])
    counts["files_selected"] = len(selected)
    return selected, lic


def read_text_file(path: Path, max_bytes: int, counts: Counter) -> str | None:
    """Read one file as UTF-8, or count why not: huge, empty, binary, non-UTF-8, unreadable, broken symlink."""
    try:
        st = path.stat()
    except OSError:
        counts["unreadable"] += 1  # broken symlink, permission, or vanished
        return None
    if st.st_size > max_bytes:
        counts["huge"] += 1
        return None
    try:
        data = path.read_bytes()
    except OSError:
        counts["unreadable"] += 1
        return None
    if not data.strip():
        counts["empty"] += 1
        return None
    if b"\x00" in data[:8192]:
        counts["binary"] += 1
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        counts["non_utf8"] += 1
        return None


def _listing(cfg: DataPrepConfig, root: Path, cache: Path | None,
             site_packages: bool = False) -> tuple[list[str], dict[str, str], Counter]:  # fmt: skip
    """The selected files, license map and walk counts; with ``cache``, the first task to finish the walk saves
    them there and later tasks read them (tasks racing at the start walk once each and agree)."""
    if cache is not None and cache.exists():
        saved = json.loads(cache.read_text())
        return saved["files"], saved["licenses"], Counter(saved["walk"])
    walk: Counter = Counter()
    files, lic = select_files(cfg, root, walk, site_packages)
    if cache is not None:
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"files": files, "licenses": lic, "walk": walk}))
        os.replace(tmp, cache)
    return files, lic, walk


def iter_dir(
    cfg: DataPrepConfig,
    root: Path,
    rank: int,
    world: int,
    counts: Counter,
    progress: bool = False,
    listing: Path | None = None,
    site_packages: bool = False,
) -> Iterator[dict]:
    files, lic, walk = _listing(cfg, root, listing, site_packages)
    if rank == 0:  # every task sees the same walk: only task 0 reports it
        counts.update(walk)
    ext_map = extension_map(cfg)
    mine = files[rank::world]
    counts["read_in"] += len(mine)
    if progress:
        from tqdm import tqdm

        mine = tqdm(mine, desc=f"read task {rank}", position=rank, leave=False, mininterval=1.0)
    for rel in mine:
        text = read_text_file(root / rel, cfg.source.max_file_bytes, counts)
        if text is None:
            continue
        yield {
            "id": rel,
            "text": text,
            "repo": repo_of(rel, cfg.source.repo_depth),
            "path": rel,
            "lang": language_of(rel, ext_map) or "unknown",
            "license": spdx_from_header(text) or nearest_license(rel, lic),
        }


def _row_doc(cfg: DataPrepConfig, row: dict, doc_id: str, ext_map: dict[str, str]) -> dict | None:
    text = row.get(cfg.source.content_column)
    if not isinstance(text, str):
        return None
    path = row.get(cfg.source.path_column)
    path = path if isinstance(path, str) else doc_id
    repo = row.get(cfg.source.repo_column)
    lic = row.get(cfg.source.license_column)
    if isinstance(lic, list | tuple):  # The Stack's ``detected_licenses``: every license found in the repository
        lic = " AND ".join(str(x) for x in lic) or None
    return {
        "id": doc_id,
        "text": text,
        "repo": repo if isinstance(repo, str) else path,
        "path": path,
        "lang": language_of(path, ext_map) or "unknown",
        "license": (lic if isinstance(lic, str) else None) or spdx_from_header(text),
        "_has_path": isinstance(row.get(cfg.source.path_column), str),
    }


def iter_jsonl(cfg: DataPrepConfig, path: Path, rank: int, world: int, counts: Counter) -> Iterator[dict]:
    """One file: every task scans it and parses its lines (``lineno % world``). A directory: whole files per task.

    Ids are ``<file>:<line>`` with the file relative to ``input``, so two files with one name cannot collide.
    Not datatrove's ``JsonlReader``, and not for speed: with orjson (not a dependency here) it read the same 1,999
    documents (25.8 MB, .jsonl.gz) in 0.088-0.114 s against 0.113 s for this (`python bench/bench_data_scale.py
    --skip-pipeline --repeat 2`), but it shards whole files only (not one file's lines) and drops the rest of a
    file at its first non-UTF-8 line, where this skips and counts each bad line.
    """
    ext_map = extension_map(cfg)
    if path.is_dir():
        files = sorted(path.rglob("*.jsonl*"))[rank::world]
        names, mine = [str(f.relative_to(path)) for f in files], lambda lineno: True
    else:
        files, names, mine = [path], [path.name], lambda lineno: (lineno - 1) % world == rank
    for fp, name in zip(files, names):
        opener = gzip.open if fp.name.endswith(".gz") else open
        with opener(fp, "rt", encoding="utf-8", errors="strict") as f:
            lineno = 0
            while True:
                try:
                    line = f.readline()
                except UnicodeDecodeError:
                    lineno += 1
                    if mine(lineno):
                        _bad_line(cfg, fp, lineno, "not UTF-8", counts)
                    continue
                if not line:
                    break
                lineno += 1
                if not mine(lineno) or not line.strip():
                    continue
                counts["read_in"] += 1
                try:
                    row = json.loads(line)
                    if not isinstance(row, dict):
                        raise ValueError("not a JSON object")
                except ValueError as e:
                    _bad_line(cfg, fp, lineno, str(e), counts)
                    continue
                doc = _row_doc(cfg, row, f"{name}:{lineno:09d}", ext_map)
                if doc is None:
                    _bad_line(cfg, fp, lineno, f"no string column {cfg.source.content_column!r}", counts)
                    continue
                yield doc


def _bad_line(cfg: DataPrepConfig, fp: Path, lineno: int, why: str, counts: Counter) -> None:
    if cfg.source.strict:
        raise DataError(f"{fp}:{lineno}: malformed JSONL line ({why}); fix it or set source.strict=false to skip")
    counts["malformed_line"] += 1
    log.warning("%s:%d: skipping malformed JSONL line (%s)", fp, lineno, why)


def iter_parquet(cfg: DataPrepConfig, path: Path, rank: int, world: int, counts: Counter) -> Iterator[dict]:
    """Parquet through datatrove's ``ParquetReader``: whole files per task (its ``get_shard``), read in batches.

    A directory of Parquet files (The Stack's layout: content, path, repository name, licenses per row) is
    the input that scales: no task reads another's files. Ids are ``<file>:<row>`` with the file relative
    to ``input`` (the row counts the file's documents with text).
    """
    import pyarrow.parquet as pq
    from datatrove.pipeline.readers import ParquetReader

    folder, glob = (path, "**/*.parquet") if path.is_dir() else (path.parent, path.name)
    ext_map = extension_map(cfg)
    col = cfg.source.content_column

    def adapter(reader, row: dict, source: str, index: int) -> dict:
        counts["read_in"] += 1
        doc = _row_doc(cfg, row, f"{source}:{index:09d}", ext_map)
        if doc is None:
            counts["malformed_row"] += 1
            return {"text": ""}  # no text: the reader skips it
        if not doc["text"].strip():
            counts["empty"] += 1
            return {"text": ""}
        text, doc_id = doc.pop("text"), doc.pop("id")
        return {"text": text, "id": doc_id, "metadata": doc}

    reader = ParquetReader(str(folder), glob_pattern=glob, adapter=adapter, text_key=col, batch_size=256)
    reader._empty_warning = True  # rows without text are counted above, not warned about per file
    shard = reader.data_folder.get_shard(rank, world, recursive=True, glob_pattern=glob) or []
    for rel in shard:
        with reader.data_folder.open(rel, "rb") as f:
            try:
                names = pq.read_schema(f).names
            except Exception as e:
                raise DataError(f"{folder / rel}: not a readable Parquet file ({e})") from None
        if col not in names:
            raise DataError(f"{folder / rel} has no column {col!r} (has {names}): set source.content_column")
        for d in reader.read_file(rel):
            yield {"id": d.id, "text": d.text, **{k: v for k, v in d.metadata.items() if k != "file_path"}}


def iter_hf_disk(cfg: DataPrepConfig, path: Path, rank: int, world: int, counts: Counter) -> Iterator[dict]:
    from datasets import DatasetDict, load_from_disk

    ds = load_from_disk(str(path))
    parts = [(k, ds[k]) for k in sorted(ds)] if isinstance(ds, DatasetDict) else [("data", ds)]
    ext_map = extension_map(cfg)
    for name, d in parts:
        if cfg.source.content_column not in d.column_names:
            raise DataError(
                f"{path} has no column {cfg.source.content_column!r} (has {d.column_names}): set source.content_column"
            )
        for i in range(rank, len(d), world):
            counts["read_in"] += 1
            doc = _row_doc(cfg, d[i], f"{name}:{i:09d}", ext_map)
            if doc is None:
                counts["malformed_row"] += 1
                continue
            yield doc


def iter_documents(
    cfg: DataPrepConfig,
    rank: int = 0,
    world: int = 1,
    counts: Counter | None = None,
    progress: bool = False,
    listing: Path | None = None,
) -> Iterator[dict]:
    """Documents of map task ``rank`` of ``world`` (files or rows modulo world, or whole files of a directory of
    JSONL/Parquet). ``listing`` caches a directory input's walk for the other tasks."""
    counts = counts if counts is not None else Counter()
    kind, path = resolve_input(cfg)
    if kind in ("dir", "site_packages"):
        yield from iter_dir(cfg, path, rank, world, counts, progress, listing, site_packages=kind == "site_packages")
        return
    readers = {"jsonl": iter_jsonl, "parquet": iter_parquet, "hf_disk": iter_hf_disk}
    if kind not in readers:
        raise DataError(f"source.type={kind} is not one of auto, dir, site_packages, jsonl, parquet, hf_disk, stdlib")
    for doc in readers[kind](cfg, path, rank, world, counts):
        if cfg.language.enabled and doc.pop("_has_path") and doc["lang"] == "unknown":
            counts["language_unselected"] += 1
            continue
        doc.pop("_has_path", None)
        yield doc
