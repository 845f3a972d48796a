"""The on-disk contract between ``data_prep`` (writer) and training/eval (reader).

A prepared dataset is a directory::

    manifest.json                 format, seq_len, dtype, tokenizer path, per-split shard list + sha256
    tokenizer/                    an HF tokenizer directory (AutoTokenizer loads it)
    train/shard_00000.npy ...     uint16/uint32 arrays of shape [num_samples, seq_len]
    train/mask_00000.npy ...      optional: bool loss masks of supervised data (True = a training target)
    validation/shard_00000.npy

Samples are already packed and globally shuffled, so the reader is a memory-map and an index (:class:`SplitReader`),
and everything is plain numpy + json so that a shard written on one machine reads on any other.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ultrascale.atomic import atomic_write_text
from ultrascale.errors import DataError

FORMAT = "ultrascale-packed-v1"
MANIFEST = "manifest.json"


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 halves disk and page-cache use for vocabularies that fit (StarCoder's 49k does)."""
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


class ShardWriter:
    """Write fixed-length samples of one split into ``.npy`` shards of at most ``samples_per_shard``.

    Shards are written to a temporary name and renamed, so a killed writer never leaves a shard that
    looks complete. Call :meth:`close` to flush the last shard; it returns the split's manifest entry.
    """

    def __init__(
        self, out_dir: str | os.PathLike, split: str, seq_len: int, vocab_size: int, samples_per_shard: int = 8192
    ):
        self.root = Path(out_dir)
        self.split = split
        self.seq_len = seq_len
        self.dtype = token_dtype(vocab_size)
        self.samples_per_shard = samples_per_shard
        (self.root / split).mkdir(parents=True, exist_ok=True)
        self._buf: list[np.ndarray] = []
        self._mask_buf: list[np.ndarray] = []
        self._buffered = 0
        self._masked: bool | None = None  # decided by the first add(): a split is all masked or all unmasked
        self.shards: list[dict] = []

    def add(self, samples: np.ndarray, loss_mask: np.ndarray | None = None) -> None:
        samples = np.asarray(samples)
        if samples.ndim != 2 or samples.shape[1] != self.seq_len:
            raise ValueError(f"samples must be [n, {self.seq_len}], got {list(samples.shape)}")
        if loss_mask is not None:
            loss_mask = np.asarray(loss_mask, dtype=bool)
            if loss_mask.shape != samples.shape:
                raise ValueError(
                    f"loss_mask must have the samples' shape {list(samples.shape)}, got {list(loss_mask.shape)}"
                )
        if self._masked is None:
            self._masked = loss_mask is not None
        elif self._masked != (loss_mask is not None):
            raise ValueError(f"split {self.split!r}: give a loss_mask with every add() or with none")
        while len(samples):
            take = min(len(samples), self.samples_per_shard - self._buffered)
            self._buf.append(samples[:take].astype(self.dtype, copy=False))
            if loss_mask is not None:
                self._mask_buf.append(loss_mask[:take])
                loss_mask = loss_mask[take:]
            self._buffered += take
            samples = samples[take:]
            if self._buffered == self.samples_per_shard:
                self._flush()

    def _save(self, rel: str, arr: np.ndarray) -> str:
        """Write one array atomically (temp name, fsync, rename); returns its sha256."""
        path = self.root / rel
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            np.save(f, arr)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return sha256_file(path)

    def _flush(self) -> None:
        if not self._buffered:
            return
        arr = np.concatenate(self._buf, axis=0)
        idx = len(self.shards)
        entry: dict = {"path": f"{self.split}/shard_{idx:05d}.npy", "num_samples": int(arr.shape[0])}
        if self._masked:  # the mask lands first: a shard entry never points at a missing mask
            mrel = f"{self.split}/mask_{idx:05d}.npy"
            entry["loss_mask"] = {"path": mrel, "sha256": self._save(mrel, np.concatenate(self._mask_buf, axis=0))}
        entry["sha256"] = self._save(entry["path"], arr)
        self.shards.append(entry)
        self._buf, self._mask_buf, self._buffered = [], [], 0

    def close(self) -> dict:
        self._flush()
        n = sum(s["num_samples"] for s in self.shards)
        return {"shards": self.shards, "num_samples": n, "num_tokens": n * self.seq_len}


def write_manifest(out_dir: str | os.PathLike, manifest: dict) -> Path:
    """Write ``manifest.json`` last and atomically: its presence is what marks a dataset complete."""
    for key in ("seq_len", "vocab_size", "eos_token_id", "tokenizer", "splits"):
        if key not in manifest:
            raise ValueError(f"manifest is missing required key {key!r}")
    manifest = {"format": FORMAT, **manifest}
    manifest.setdefault("dtype", token_dtype(manifest["vocab_size"]).name)
    path = Path(out_dir) / MANIFEST
    atomic_write_text(path, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return path


def write_samples(
    out_dir: str | os.PathLike,
    splits: dict[str, Iterable[np.ndarray]],
    *,
    seq_len: int,
    vocab_size: int,
    eos_token_id: int,
    tokenizer: str,
    extra: dict | None = None,
    loss_masks: dict[str, Iterable[np.ndarray]] | None = None,
) -> dict:
    """Write whole splits and the manifest in one call (tests, small corpora, supervised sets).

    ``loss_masks[split]``, if given, yields bool arrays parallel to ``splits[split]`` (True = a target).
    """
    entries = {}
    for split, chunks in splits.items():
        w = ShardWriter(out_dir, split, seq_len, vocab_size)
        masks = iter(loss_masks[split]) if loss_masks and split in loss_masks else None
        for c in chunks:
            w.add(c, next(masks) if masks is not None else None)
        entries[split] = w.close()
    manifest = {
        "seq_len": seq_len,
        "vocab_size": vocab_size,
        "eos_token_id": eos_token_id,
        "tokenizer": tokenizer,
        "splits": entries,
        **(extra or {}),
    }
    write_manifest(out_dir, manifest)
    return manifest


@dataclass
class SplitReader:
    """Random access to the samples of one split, across shards, through memory maps."""

    root: Path
    name: str
    seq_len: int
    arrays: list[np.ndarray]
    offsets: np.ndarray  # cumulative sample counts, len(arrays)+1
    masks: list[np.ndarray] | None = None  # loss masks parallel to ``arrays`` (supervised data only)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def has_loss_mask(self) -> bool:
        return self.masks is not None

    def _gather(self, arrays: list[np.ndarray], indices: np.ndarray, dtype) -> np.ndarray:
        out = np.empty((len(indices), self.seq_len), dtype=dtype)
        shard_ids = np.searchsorted(self.offsets, indices, side="right") - 1
        for i, (g, s) in enumerate(zip(indices, shard_ids)):
            out[i] = arrays[s][g - self.offsets[s]]
        return out

    def get(self, indices: np.ndarray) -> np.ndarray:
        """Gather samples by global index into one int64 array [len(indices), seq_len]."""
        return self._gather(self.arrays, indices, np.int64)

    def get_loss_mask(self, indices: np.ndarray) -> np.ndarray | None:
        """The samples' loss masks (bool [len(indices), seq_len]; True = a target), or None if unmasked.

        Loss masks exist for supervised data (prompt + completion), where the prompt must be read but not
        learned; pretraining corpora have none and every token is a target. A shard's mask is listed in its
        manifest entry (``loss_mask``) with its own sha256, so it is verified and versioned with the tokens."""
        return None if self.masks is None else self._gather(self.masks, indices, bool)


def load_manifest(path: str | os.PathLike) -> dict:
    root = Path(path)
    mpath = root / MANIFEST
    if not root.exists():
        raise DataError(
            f"data path {root} does not exist: run `python -m data_prep output_dir={root}` or set data.path"
        )
    if not mpath.exists():
        raise DataError(
            f"{mpath} not found: {root} is not a prepared dataset (or its preparation did not finish); "
            f"run `python -m data_prep output_dir={root}`"
        )
    try:
        manifest = json.loads(mpath.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{mpath} is not valid JSON ({e}): re-run data prep for {root}") from None
    if manifest.get("format") != FORMAT:
        raise DataError(f"{mpath} has format {manifest.get('format')!r}, expected {FORMAT!r}: re-run data prep")
    return manifest


def open_split(path: str | os.PathLike, split: str, verify: bool = True) -> SplitReader:
    """Open one split, checking shape, size and (optionally) sha256 of every shard against the manifest."""
    root = Path(path)
    manifest = load_manifest(root)
    if split not in manifest["splits"]:
        raise DataError(f"{root / MANIFEST} has no split {split!r} (has: {sorted(manifest['splits'])})")
    seq_len = int(manifest["seq_len"])
    shards = manifest["splits"][split]["shards"]
    arrays, masks, counts = [], [], [0]
    for shard in shards:
        arr = _load_array(root, shard["path"], shard["sha256"], verify, [shard["num_samples"], seq_len])
        arrays.append(arr)
        counts.append(counts[-1] + arr.shape[0])
        if "loss_mask" in shard:
            m = shard["loss_mask"]
            masks.append(_load_array(root, m["path"], m["sha256"], verify, [shard["num_samples"], seq_len]))
    if counts[-1] == 0:
        raise DataError(f"split {split!r} in {root} has no samples: the corpus is too small for seq_len={seq_len}")
    if masks and len(masks) != len(arrays):
        raise DataError(f"{root / MANIFEST}: only some shards of split {split!r} have a loss_mask: re-run data prep")
    return SplitReader(root, split, seq_len, arrays, np.asarray(counts, dtype=np.int64), masks or None)


def _load_array(root: Path, rel: str, sha256: str, verify: bool, shape: list[int]) -> np.ndarray:
    """Memory-map one shard (or mask) file, checking presence, checksum and shape against the manifest."""
    spath = root / rel
    if not spath.exists():
        raise DataError(f"shard {spath} listed in the manifest is missing: re-run data prep for {root}")
    if verify and sha256_file(spath) != sha256:
        raise DataError(f"shard {spath} is corrupt (sha256 differs from manifest.json): re-run data prep for {root}")
    try:
        arr = np.load(spath, mmap_mode="r")
    except (ValueError, OSError, EOFError) as e:
        raise DataError(f"shard {spath} is truncated or not a .npy file ({e}): re-run data prep for {root}") from None
    if list(arr.shape) != shape:
        raise DataError(
            f"shard {spath} has shape {list(arr.shape)}, manifest says {shape}: re-run data prep for {root}"
        )
    return arr
