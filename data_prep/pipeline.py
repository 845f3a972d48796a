"""The pipeline: a parallel map phase on datatrove executors, then a single-process reduce phase.

Map (per file, embarrassingly parallel; datatrove Local/Slurm/Ray executors shard it into ``tasks``):
read -> language -> quality -> content hash + MinHash signature. Each task writes one gzipped JSONL
atomically; datatrove marks it complete, so a rerun skips finished tasks.

Reduce (needs the whole corpus; one process): license (per repository) -> exact dedup -> near dedup
(LSH over the map's signatures) -> PII redaction -> decontamination -> split by repository ->
tokenizer -> FIM + tokenize + pack -> shuffle -> shards, manifest.json, report.md.
Every document stage checkpoints its output under ``_work/``; a rerun resumes after the last finished
one. Documents are sorted by id and every random choice is seeded by (seed, doc id), so a resumed run,
or one with a different task count, writes byte-identical shards and the same manifest.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import logging
import os
import shutil
import signal
import time
from collections import Counter
from pathlib import Path

import numpy as np
from datatrove.pipeline.base import PipelineStep
from omegaconf import OmegaConf

from data_prep import dedup, licenses, pii
from data_prep.config import DataPrepConfig
from data_prep.decontam import Decontaminator
from data_prep.filters import quality_reason
from data_prep.pack import encode_docs, pack
from data_prep.sources import iter_documents, resolve_input
from data_prep.tokenizer import EOS, SPECIAL_TOKENS, copy_local, load_dir, load_local, save_hf, train_bpe
from ultrascale.atomic import atomic_write_text
from ultrascale.data.shards import MANIFEST, ShardWriter, write_manifest
from ultrascale.errors import ConfigError, DataError

log = logging.getLogger("data_prep")

# Keys that change where or how fast the output is made, not what it is.
_NOT_HASHED = ("output_dir", "executor", "keep_work")


def to_cfg(cfg) -> DataPrepConfig:
    """Accept a DictConfig, a dict or a DataPrepConfig; always return the typed dataclass."""
    if isinstance(cfg, DataPrepConfig):
        return cfg
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataPrepConfig), cfg))


def config_hash(cfg: DataPrepConfig) -> str:
    d = OmegaConf.to_container(OmegaConf.structured(cfg))
    for k in _NOT_HASHED:
        d.pop(k, None)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def crash_hook(point: str) -> None:
    """Fault injection for the resume tests: ``DATA_PREP_CRASH_AT=point`` SIGKILLs this process here.

    When this process leads its process group (the tests start it with a new session), the whole group
    dies, like a job killed by Slurm: datatrove's Manager process must not outlive it.
    """
    if os.environ.get("DATA_PREP_CRASH_AT") == point:
        if os.getpgid(0) == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


def _stage(docs_in: int = 0, docs_out: int = 0, bytes_in: int = 0, bytes_out: int = 0, **dropped) -> dict:
    return {"docs_in": docs_in, "docs_out": docs_out, "bytes_in": bytes_in, "bytes_out": bytes_out, "dropped": dropped}


def _nbytes(docs: list[dict]) -> int:
    return sum(len(d["text"].encode("utf-8")) for d in docs)


def _write_jsonl_gz(path: Path, rows) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=1) as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def _read_jsonl_gz(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _write_json(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


# ----------------------------------------------------------------------------------------------- map phase


class MapTask(PipelineStep):
    """datatrove step: one task's share of files -> filtered docs with hash and signature, plus its stats."""

    name = "data_prep map"
    type = "🔻 - FILTER"

    def __init__(self, cfg: dict, out_dir: str, progress: bool = False):
        super().__init__()
        self.cfg_dict, self.out_dir, self.progress = cfg, out_dir, progress

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        crash_hook(f"map:{rank}")
        n_read, n_kept = run_map_task(to_cfg(self.cfg_dict), Path(self.out_dir), rank, world_size, self.progress)
        self.stat_update("docs_read", value=n_read)
        self.stat_update("docs_kept", value=n_kept)
        yield from ()


def run_map_task(cfg: DataPrepConfig, out: Path, rank: int, world: int, progress: bool) -> tuple[int, int]:
    counts: Counter = Counter()
    quality: Counter = Counter()
    a, b = dedup.permutations(cfg.near_dedup.num_perm)
    kept, n_read, bytes_read, bytes_kept = [], 0, 0, 0
    for doc in iter_documents(cfg, rank, world, counts, progress):
        n_read += 1
        nb = len(doc["text"].encode("utf-8"))
        bytes_read += nb
        if cfg.quality.enabled and (why := quality_reason(doc["text"], cfg.quality)):
            quality[why] += 1
            continue
        doc["sha256"] = dedup.content_hash(doc["text"])
        if cfg.near_dedup.enabled:
            sig = dedup.minhash(doc["text"], cfg.near_dedup.ngram, a, b)
            doc["sig"] = base64.b64encode(sig.tobytes()).decode()
        bytes_kept += nb
        kept.append(doc)
    bad = {k: v for k, v in counts.items() if k not in ("files_seen", "files_language", "files_selected", "read_in")}
    stats = {
        "counts": dict(counts),
        "read": _stage(counts["read_in"], n_read, 0, bytes_read, **bad),
        "quality": _stage(n_read, len(kept), bytes_read, bytes_kept, **quality),
    }
    out.mkdir(parents=True, exist_ok=True)
    _write_jsonl_gz(out / f"docs_{rank:05d}.jsonl.gz", kept)
    _write_json(out / f"stats_{rank:05d}.json", stats)
    return n_read, len(kept)


def run_map(cfg: DataPrepConfig, work: Path) -> Path:
    """Run (or finish) the map phase with the configured executor; return the folder of task outputs."""
    ex = cfg.executor
    out = work / f"map_t{ex.tasks}"
    logs = work / f"map_t{ex.tasks}_logs"
    step = MapTask(OmegaConf.to_container(OmegaConf.structured(cfg)), str(out), ex.progress)
    if ex.type == "local":
        from datatrove.executor import LocalPipelineExecutor

        LocalPipelineExecutor(
            [step], tasks=ex.tasks, workers=ex.workers, logging_dir=str(logs), start_method="spawn"
        ).run()
    elif ex.type == "ray":
        try:
            from datatrove.executor import RayPipelineExecutor
        except ImportError as e:
            raise ConfigError(f"executor.type=ray needs ray installed ({e}): pip install ray, or use local") from None
        RayPipelineExecutor([step], tasks=ex.tasks, workers=ex.workers, logging_dir=str(logs)).run()
    else:
        raise ConfigError(f"executor.type={ex.type} is not one of local, ray, slurm")
    missing = [r for r in range(ex.tasks) if not (out / f"stats_{r:05d}.json").exists()]
    if missing:
        raise DataError(f"map tasks {missing} did not finish; see {logs}/logs and re-run to resume")
    return out


def submit_slurm(cfg: DataPrepConfig, work: Path):
    """Submit map (``tasks`` array jobs) and reduce (1 job, after map) to Slurm; returns the reduce executor."""
    from datatrove.executor import SlurmPipelineExecutor

    ex = cfg.executor
    common = {"time": ex.time, "partition": ex.partition, "cpus_per_task": ex.cpus_per_task}
    plain = OmegaConf.to_container(OmegaConf.structured(cfg))
    map_exec = SlurmPipelineExecutor(
        [MapTask(plain, str(work / f"map_t{ex.tasks}"), False)],
        tasks=ex.tasks,
        logging_dir=str(work / f"map_t{ex.tasks}_logs"),
        job_name="data_prep_map",
        **common,
    )
    reduce_exec = SlurmPipelineExecutor(
        [ReduceTask(plain)],
        tasks=1,
        logging_dir=str(work / "reduce_logs"),
        job_name="data_prep_reduce",
        depends=map_exec,
        **common,
    )
    return reduce_exec


class ReduceTask(PipelineStep):
    """datatrove step wrapping the reduce phase, so a Slurm job can run it after the map array."""

    name = "data_prep reduce"
    type = "🫂 - DEDUP"

    def __init__(self, cfg: dict):
        super().__init__()
        self.cfg_dict = cfg

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        cfg = to_cfg(self.cfg_dict)
        work = Path(cfg.output_dir) / "_work"
        reduce(cfg, work, work / f"map_t{cfg.executor.tasks}")
        yield from ()


def load_map(map_dir: Path, tasks: int) -> tuple[list[dict], dict]:
    docs: list[dict] = []
    merged: dict = {"counts": Counter()}
    for r in range(tasks):
        docs += _read_jsonl_gz(map_dir / f"docs_{r:05d}.jsonl.gz")
        st = json.loads((map_dir / f"stats_{r:05d}.json").read_text())
        merged["counts"].update(st["counts"])
        for name in ("read", "quality"):
            cur = merged.setdefault(name, _stage())
            for k in ("docs_in", "docs_out", "bytes_in", "bytes_out"):
                cur[k] += st[name][k]
            for k, v in st[name]["dropped"].items():
                cur["dropped"][k] = cur["dropped"].get(k, 0) + v
    docs.sort(key=lambda d: d["id"])
    ids = [d["id"] for d in docs]
    if len(set(ids)) != len(ids):
        raise DataError(f"duplicate document ids in {map_dir}: two input files share a name; rename one")
    return docs, merged


# -------------------------------------------------------------------------------------------- reduce stages


def stage_license(docs: list[dict], cfg: DataPrepConfig) -> tuple[list[dict], dict, dict]:
    decisions = licenses.repo_decisions(docs, list(cfg.license.allow), cfg.license.unknown)
    kept = [d for d in docs if decisions[d["repo"]][0]]
    dropped = Counter(decisions[d["repo"]][1] for d in docs if not decisions[d["repo"]][0])
    by_license = Counter(d.get("license") or "unknown" for d in kept)
    st = _stage(len(docs), len(kept), _nbytes(docs), _nbytes(kept), **dropped)
    return kept, st, {"kept_by_license": dict(sorted(by_license.items()))}


def stage_exact(docs: list[dict], cfg: DataPrepConfig) -> tuple[list[dict], dict, dict]:
    seen: set[str] = set()
    kept = []
    for d in docs:
        if d["sha256"] not in seen:
            seen.add(d["sha256"])
            kept.append(d)
    st = _stage(len(docs), len(kept), _nbytes(docs), _nbytes(kept), duplicate=len(docs) - len(kept))
    return kept, st, {}


def stage_near(docs: list[dict], cfg: DataPrepConfig) -> tuple[list[dict], dict, dict]:
    nd = cfg.near_dedup
    if not docs:
        return docs, _stage(), {}
    sigs = np.stack([np.frombuffer(base64.b64decode(d["sig"]), dtype=np.uint32) for d in docs])
    keep, roots = dedup.near_duplicates(sigs, nd.threshold, nd.bands)
    kept = []
    removed = []
    for i, d in enumerate(docs):
        d.pop("sig", None)
        if keep[i]:
            kept.append(d)
        else:
            removed.append({"id": d["id"], "kept": docs[roots[i]]["id"]})
    bands, rows = (nd.bands, nd.num_perm // nd.bands) if nd.bands else dedup.optimal_bands(nd.threshold, nd.num_perm)
    st = _stage(len(docs), len(kept), _nbytes(docs), _nbytes(kept), near_duplicate=len(removed))
    return kept, st, {"bands": bands, "rows": rows, "removed": removed}


def stage_pii(docs: list[dict], cfg: DataPrepConfig) -> tuple[list[dict], dict, dict]:
    total: Counter = Counter()
    docs_with = 0
    b_in = _nbytes(docs)
    for d in docs:
        d["text"], c = pii.redact(d["text"], list(cfg.pii.kinds))
        total.update(c)
        docs_with += bool(c)
    st = _stage(len(docs), len(docs), b_in, _nbytes(docs))
    return docs, st, {"redactions": dict(sorted(total.items())), "docs_redacted": docs_with}


def stage_decontam(docs: list[dict], cfg: DataPrepConfig) -> tuple[list[dict], dict, dict]:
    dc = cfg.decontam
    det = Decontaminator(list(dc.benchmarks), dc.mbpp_path, dc.ngram, dc.min_overlap)
    kept, removed = [], []
    for d in docs:
        m = det.match(d["text"])
        if m:
            removed.append({"id": d["id"], "repo": d["repo"], "benchmark_item": m[0], "overlap": m[1]})
        else:
            kept.append(d)
    st = _stage(len(docs), len(kept), _nbytes(docs), _nbytes(kept), contaminated=len(removed))
    return kept, st, {"benchmarks": det.available, "unavailable": det.unavailable, "removed": removed}


REDUCE_STAGES = [
    ("license", "license", stage_license),
    ("exact_dedup", "exact_dedup", stage_exact),
    ("near_dedup", "near_dedup", stage_near),
    ("pii", "pii", stage_pii),
    ("decontam", "decontam", stage_decontam),
]


def run_doc_stages(cfg: DataPrepConfig, work: Path, map_dir: Path) -> tuple[list[dict], dict, dict]:
    """Run the reduce document stages, each checkpointed; resume after the last finished one."""
    stats: dict = {}
    details: dict = {}
    done = [
        i
        for i, (name, _, _) in enumerate(REDUCE_STAGES)
        if (work / f"{i:02d}_{name}.json").exists() and (work / f"{i:02d}_{name}.jsonl.gz").exists()
    ]
    last = -1
    while last + 1 in done:
        last += 1
    if last < 0:
        docs, map_stats = load_map(map_dir, cfg.executor.tasks)
        _write_json(work / "map_stats.json", map_stats)
    else:
        map_stats = json.loads((work / "map_stats.json").read_text())
        docs = _read_jsonl_gz(work / f"{last:02d}_{REDUCE_STAGES[last][0]}.jsonl.gz")
    for i, (name, key, fn) in enumerate(REDUCE_STAGES):
        ck = work / f"{i:02d}_{name}.json"
        if i <= last:
            saved = json.loads(ck.read_text())
            stats[name], details[name] = saved["stats"], saved["details"]
            continue
        crash_hook(name)
        if getattr(cfg, key).enabled:
            docs, st, det = fn(docs, cfg)
        else:
            nb = _nbytes(docs)
            st, det = _stage(len(docs), len(docs), nb, nb), {"skipped": True}
            if name == "near_dedup":
                for d in docs:
                    d.pop("sig", None)
        _write_jsonl_gz(work / f"{i:02d}_{name}.jsonl.gz", docs)
        _write_json(ck, {"stats": st, "details": det})
        stats[name], details[name] = st, det
        log.info("stage %-12s %6d -> %6d docs", name, st["docs_in"], st["docs_out"])
    return docs, {"map": map_stats, **stats}, details


def split_by_repo(docs: list[dict], fraction: float, seed: int) -> dict[str, str]:
    """repo -> split. Repos in seeded-hash order fill validation up to ``fraction`` of the bytes."""
    size: Counter = Counter()
    for d in docs:
        size[d["repo"]] += len(d["text"])
    total = sum(size.values())
    order = sorted(size, key=lambda r: hashlib.sha1(f"{seed}:{r}".encode()).hexdigest())
    target, val, out = fraction * total, 0, {}
    for r in order:
        if val < target and val + size[r] <= 1.5 * target:
            out[r] = "validation"
            val += size[r]
        else:
            out[r] = "train"
    if fraction > 0 and not any(s == "validation" for s in out.values()) and len(order) > 1:
        smallest = min(order, key=lambda r: size[r])
        out[smallest] = "validation"
    return out


# ------------------------------------------------------------------------------------------------- reduce


def reduce(cfg: DataPrepConfig, work: Path, map_dir: Path) -> dict:
    t0 = time.time()
    out = Path(cfg.output_dir)
    docs, stats, details = run_doc_stages(cfg, work, map_dir)
    if not docs:
        raise DataError(f"no documents survived the filters for input={cfg.input}: see {work} stage stats")

    repo_split = split_by_repo(docs, cfg.split.validation_fraction, cfg.seed)
    if cfg.split.validation_fraction > 0 and "validation" not in repo_split.values():
        raise DataError(
            f"input={cfg.input} has a single repository ({next(iter(repo_split))}): the split is by repository, "
            "so it needs at least two (lower source.repo_depth or add repositories)"
        )
    _write_json(out / "repos.json", dict(sorted(repo_split.items())))
    by_split: dict[str, list[dict]] = {"train": [], "validation": []}
    for d in docs:
        by_split[repo_split[d["repo"]]].append(d)

    crash_hook("tokenizer")
    tok_dir = out / "tokenizer"
    tok_done = work / "tokenizer.done"
    if not tok_done.exists():
        if cfg.tokenizer.path:
            load_local(cfg.tokenizer.path, fim=cfg.fim.rate > 0)
            copy_local(cfg.tokenizer.path, tok_dir)
        else:
            texts, budget = [], cfg.tokenizer.train_max_bytes
            for d in by_split["train"]:
                if budget <= 0:
                    break
                texts.append(d["text"])
                budget -= len(d["text"])
            save_hf(train_bpe(texts, cfg.tokenizer.vocab_size, cfg.tokenizer.min_frequency), tok_dir, cfg.pack.seq_len)
        tok_done.write_text(hashlib.sha256((tok_dir / "tokenizer.json").read_bytes()).hexdigest())
    tok = load_dir(tok_dir)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    eos = tok.token_to_id(EOS)
    if eos is None:
        raise DataError(f"tokenizer at {tok_dir} has no {EOS} token")

    crash_hook("pack")
    seq_len = cfg.pack.seq_len
    splits_entry, pack_stats = {}, {}
    for split in ("train", "validation"):
        sdir = out / split
        shutil.rmtree(sdir, ignore_errors=True)
        modes: Counter = Counter()
        tok_lists = []
        for _d, mode, ids in encode_docs(
            tok, by_split[split], cfg.seed, cfg.fim.rate, cfg.fim.spm_rate, cfg.fim.metadata, cfg.pack.batch_docs
        ):
            modes[mode] += 1
            tok_lists.append(ids)
        samples, n_real, n_pad = pack(tok_lists, eos, seq_len)
        perm = np.random.default_rng([cfg.seed, 1 if split == "train" else 2]).permutation(len(samples))
        w = ShardWriter(out, split, seq_len, vocab, cfg.pack.samples_per_shard)
        w.add(samples[perm])
        splits_entry[split] = w.close()
        pack_stats[split] = {
            "docs": len(by_split[split]),
            "repos": len({d["repo"] for d in by_split[split]}),
            "bytes": _nbytes(by_split[split]),
            "doc_tokens": n_real - len(tok_lists),
            "eos_tokens": len(tok_lists),
            "pad_tokens": n_pad,
            "samples": len(samples),
            "fim": dict(sorted(modes.items())),
        }
        if len(samples) == 0:
            raise DataError(f"split {split!r} is empty for input={cfg.input}: add data or lower pack.seq_len")

    decon = details.get("decontam", {}).get("removed", [])
    _write_jsonl_gz(work / "decontamination.jsonl.gz", decon)
    (out / "decontamination.jsonl").write_text("".join(json.dumps(r) + "\n" for r in decon))
    manifest = {
        "seq_len": seq_len,
        "vocab_size": vocab,
        "eos_token_id": eos,
        "tokenizer": "tokenizer",
        "splits": splits_entry,
        "config_hash": config_hash(cfg),
        "seed": cfg.seed,
        "special_tokens": {t: tok.token_to_id(t) for t in SPECIAL_TOKENS},
        "fim": {
            "applied": "prep_time",
            "rate": cfg.fim.rate,
            "spm_rate": cfg.fim.spm_rate,
            "metadata": cfg.fim.metadata,
        },
        "stages": _stage_table(stats),
        "bad_input": {k: v for k, v in stats["map"]["read"]["dropped"].items() if v},
        "quality_dropped": stats["map"]["quality"]["dropped"],
        "pii": details.get("pii", {}),
        "near_dedup": {k: v for k, v in details.get("near_dedup", {}).items() if k != "removed"},
        "decontamination": {
            "benchmarks": details.get("decontam", {}).get("benchmarks", {}),
            "unavailable": details.get("decontam", {}).get("unavailable", []),
            "removed": len(decon),
            "list": "decontamination.jsonl",
        },
        "license": details.get("license", {}),
        "pack": pack_stats,
        "tokens": {s: pack_stats[s]["samples"] * seq_len for s in pack_stats},
        "repo_split": "repos.json",
    }
    from data_prep.report import write_report

    write_report(out, manifest, details, time.time() - t0)
    return json.loads(write_manifest(out, manifest).read_text())


def _stage_table(stats: dict) -> dict:
    """Ordered stage -> {docs_in, docs_out, bytes_in, bytes_out, dropped} over the whole pipeline."""
    m = stats["map"]
    c = m["counts"]
    table = {}
    if "files_seen" in c:
        table["language"] = _stage(c["files_seen"], c["files_language"])
        table["sample"] = _stage(c["files_language"], c["files_selected"])
    table["read"] = m["read"]
    if c.get("language_unselected"):
        table["language"] = _stage(m["read"]["docs_out"] + c["language_unselected"], m["read"]["docs_out"])
    table["quality"] = m["quality"]
    for name, _, _ in REDUCE_STAGES:
        table[name] = stats[name]
    return table


def run(cfg) -> dict:
    """Prepare ``cfg.output_dir`` (resuming if possible); return the manifest. Idempotent for a finished run."""
    cfg = to_cfg(cfg)
    resolve_input(cfg)  # a missing input fails before anything is written
    if cfg.pack.seq_len < 2:
        raise ConfigError(f"pack.seq_len={cfg.pack.seq_len}: use at least 2")
    if not 0 <= cfg.fim.rate <= 1 or not 0 <= cfg.fim.spm_rate <= 1:
        raise ConfigError(f"fim.rate={cfg.fim.rate}, fim.spm_rate={cfg.fim.spm_rate}: both must be in [0, 1]")
    if cfg.license.unknown not in ("keep", "drop"):
        raise ConfigError(f"license.unknown={cfg.license.unknown}: use keep or drop")
    out = Path(cfg.output_dir)
    h = config_hash(cfg)
    mpath = out / MANIFEST
    if mpath.exists():
        try:
            old = json.loads(mpath.read_text())
        except json.JSONDecodeError:
            old = {}
        if old.get("config_hash") == h:
            log.info("%s is complete for this config (hash %s): nothing to do", out, h)
            return old
        mpath.unlink()  # a different config: the old dataset stops being complete right now
    work = out / "_work"
    hfile = work / "config_hash"
    if work.exists() and (not hfile.exists() or hfile.read_text() != h):
        log.info("config changed: discarding %s", work)
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    hfile.write_text(h)
    (work / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    if cfg.executor.type == "slurm":
        submit_slurm(cfg, work).run()
        log.info("submitted map and reduce jobs to Slurm; %s/manifest.json appears when they finish", out)
        return {}
    map_dir = run_map(cfg, work)
    manifest = reduce(cfg, work, map_dir)
    if not cfg.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return manifest
