"""data_prep at scale: any task count writes the same bytes, a kill in any stage resumes to them, and the
Slurm chain (map, every reduce stage, the final merge) renders without sbatch and, replayed job by job, writes
them too. Plus the pieces that make that true: the pointwise shuffle, the streamed split, the keyed runs.

The reference is a run of test_data_prep's corpus with tasks=1 in one process.
"""

from __future__ import annotations

import gzip
import itertools
import json
import os
import re
import shutil
import stat
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from data_prep.pipeline import run
from data_prep.shuffle import permute
from data_prep.store import RepoTable, part_range, read_run, repo_part, write_run, write_table
from data_prep.work import STAGES
from tests.test_data_prep import FIXTURE, _cli, cfg_for, make_corpus


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """test_data_prep's corpus (every kind of bad input, a planted secret and HumanEval solution), one task."""
    root = tmp_path_factory.mktemp("dp_scale")
    corpus = make_corpus(root)
    return corpus, root / "out", run(cfg_for(corpus, root / "out"))


def outputs(out: Path) -> dict[str, bytes]:
    """Every file training or a person reads from a prepared dataset, by relative path."""
    names = ["manifest.json", "repos.json", "decontamination.jsonl", "tokenizer/tokenizer.json"]
    names += [str(p.relative_to(out)) for split in ("train", "validation") for p in sorted((out / split).glob("*.npy"))]
    return {n: (out / n).read_bytes() for n in names}


def test_four_tasks_on_two_workers_write_the_bytes_of_one_task(prepared, tmp_path):
    corpus, ref, _ = prepared
    out = tmp_path / "out"
    m = run(cfg_for(corpus, out, "executor.tasks=4", "executor.workers=2"))
    assert outputs(out) == outputs(ref)
    assert m == json.loads((ref / "manifest.json").read_text())
    records = [
        json.loads(p.read_text())
        for p in (out / "_work" / f"{STAGES.index('tokenize'):02d}_tokenize").glob("task_*.json")
    ]
    assert sorted(r["rank"] for r in records) == [0, 1, 2, 3]
    assert os.getpid() not in {r["pid"] for r in records}  # the tasks ran in the pool's worker processes


# Every stage, killed part way: half its units (or, for single steps, half its files) are on disk. Some kills
# land in pool workers (workers=2). The resume uses another task count than the killed run (units are buckets,
# partitions or shards, fixed by ``buckets``), except the map's: its units are its tasks' slices of the input
# files, so its outputs live in ``00_map_t<tasks>`` and a resume at another count starts the map over. The map
# is killed on one worker so that task 0 has finished when task 1 dies, and resumed at the same count.
KILLS = [
    ("map:1", 3, 1),
    ("license", 3, 1),
    ("signatures", 3, 1),
    ("near_dedup", 3, 2),
    ("cluster", 3, 1),
    ("split", 3, 1),
    ("clean", 3, 2),
    ("tokenizer", 3, 1),  # the clean stage's tokenizer task
    ("tokenize", 3, 1),
    ("pack", 3, 2),
    ("finalize", 3, 1),
]


def test_every_stage_has_a_kill_point():
    assert {k.split(":")[0] for k, _, _ in KILLS} == {*STAGES, "tokenizer"}


def finished_units(out: Path) -> dict[str, int]:
    """Every finished unit under ``_work/`` (its stats file, written last), with its mtime in ns."""
    return {str(p.relative_to(out)): p.stat().st_mtime_ns for p in sorted((out / "_work").rglob("unit_*.json"))}


def units_run(work: Path, since: float) -> list[int]:
    """The units this stage's tasks started after ``since`` did (a task's record lists them; a task that had
    finished before the kill is not started again, and keeps its old record)."""
    records = [json.loads(p.read_text()) for p in work.glob("task_t*_r*.json")]
    return sorted(u for r in records if r["start"] >= since for u in r["units"])


@pytest.mark.parametrize(("crash", "tasks", "workers"), KILLS, ids=[k for k, _, _ in KILLS])
def test_kill_during_a_stage_resumes_to_the_same_bytes(prepared, tmp_path, crash, tasks, workers):
    """Same bytes, and a real resume: no unit finished before the kill runs again (its stats keep their
    mtime, and the resumed tasks' records list only the rest), so a resume that wiped ``_work/`` would fail."""
    corpus, ref, _ = prepared
    out = tmp_path / "out"
    killed = _cli(corpus, out, crash, f"executor.tasks={tasks}", f"executor.workers={workers}")
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not (out / "manifest.json").exists()
    stage = {"tokenizer": "clean"}.get(crash.split(":")[0], crash.split(":")[0])
    work = out / "_work" / (f"00_map_t{tasks}" if stage == "map" else f"{STAGES.index(stage):02d}_{stage}")
    assert work.exists(), f"the kill came before stage {stage} started"
    before = finished_units(out)
    mine = {int(Path(k).stem.split("_")[1]) for k in before if Path(k).parent.name == work.name}
    if crash not in ("cluster", "split", "finalize", "tokenizer"):  # single steps: killed inside their one unit
        assert mine, f"no unit of {stage} finished before the kill: the resume would prove nothing"
    if stage != "map":
        assert any(Path(k).parent.name != work.name for k in before), "no earlier stage's units on disk"
    resume_tasks = tasks if stage == "map" else 2
    since = time.time()
    done = _cli(corpus, out, None, f"executor.tasks={resume_tasks}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert outputs(out) == outputs(ref)
    after = finished_units(out)
    assert {k: after.get(k) for k in before} == before, "a unit finished before the kill was done again"
    ran = units_run(work, since)
    every = {int(Path(k).stem.split("_")[1]) for k in after if Path(k).parent.name == work.name}
    assert not mine & set(ran) and sorted(ran) == sorted(every - mine), (mine, ran, every)


def test_pool_executor_runs_each_task_once_in_the_pool_without_a_manager_process(tmp_path, monkeypatch):
    """The local executor keeps datatrove's tasks, logs and completion markers but no Manager server process
    (each of its six calls a task waited for a time slice on busy cores)."""
    import multiprocess

    from data_prep.local_executor import PoolExecutor

    def no_manager(*_a, **_k):
        raise AssertionError("a Manager process was started")

    monkeypatch.setattr(multiprocess, "Manager", no_manager)
    seen = tmp_path / "seen"
    seen.mkdir()

    def step(_data, rank: int, world_size: int):
        (seen / f"{rank}_{world_size}_{os.getpid()}").touch()
        return []

    logs = tmp_path / "logs"
    PoolExecutor([step], tasks=6, workers=2, logging_dir=str(logs), start_method="fork").run()
    runs = [p.name.split("_") for p in seen.iterdir()]
    assert sorted(int(r) for r, _, _ in runs) == list(range(6)) and {w for _, w, _ in runs} == {"6"}
    assert str(os.getpid()) not in {pid for _, _, pid in runs} and len({pid for _, _, pid in runs}) <= 2
    assert sorted(os.listdir(logs / "completions")) == [f"{r:05d}" for r in range(6)]
    assert (logs / "stats.json").exists() and len(list((logs / "logs").glob("task_*.log"))) == 6
    (logs / "completions" / "00003").unlink()
    shutil.rmtree(seen)
    seen.mkdir()
    PoolExecutor([step], tasks=6, workers=2, logging_dir=str(logs), start_method="fork").run()
    assert [p.name.split("_")[0] for p in seen.iterdir()] == ["3"]  # a rerun runs only the unfinished task


# ------------------------------------------------------------------------------------------------ Slurm


def _stack_parquet(root: Path) -> Path:
    """The fixture corpus as The Stack lays it out: Parquet files of rows with content, path, repository, licenses."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = sorted(p for p in FIXTURE.rglob("*.py"))
    rows = [
        {
            "content": p.read_text(),
            "path": str(p.relative_to(FIXTURE)),
            "repo_name": p.relative_to(FIXTURE).parts[0],
            "detected_licenses": ["GPL-3.0-only"] if "gpl" in str(p) else ["MIT", "PSF-2.0"],
        }
        for p in files
    ]
    for i in range(3):
        (root / f"part{i}").mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist(rows[i::3]), root / f"part{i}" / f"train-{i:05d}.parquet")
    return root


def _fake_slurm_bin(tmp_path: Path) -> Path:
    """``scontrol`` is all a job needs from Slurm here (datatrove expands the node list with it)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho localhost\n")
    (bin_dir / "scontrol").chmod(stat.S_IRWXU)
    return bin_dir


def test_slurm_chain_renders_without_sbatch_and_replays_to_the_local_bytes(tmp_path, monkeypatch):
    import dill

    data = _stack_parquet(tmp_path / "stack")
    cols = ["source.type=parquet", "source.repo_column=repo_name", "source.license_column=detected_licenses"]
    ref = tmp_path / "local"
    run(cfg_for(data, ref, *cols))
    out = tmp_path / "slurm"
    monkeypatch.setenv("PATH", f"{_fake_slurm_bin(tmp_path)}:{os.environ['PATH']}")
    assert shutil.which("sbatch") is None
    assert run(cfg_for(data, out, *cols, "executor.type=slurm", "executor.tasks=2", "executor.partition=cpu")) == {}

    slurm = out / "_work" / "slurm"
    lines = (slurm / "submit.sh").read_text().splitlines()
    jobs = [ln for ln in lines if ln.startswith("J") and "merge_stats" not in ln]
    assert len(jobs) == len(STAGES)
    chain = []
    for i, (stage, line) in enumerate(zip(STAGES, jobs)):
        var, script = line.split("=", 1)[0], Path(re.search(r"(\S+\.sbatch)", line).group(1))
        assert script.name.endswith(f"data_prep_{stage}.sbatch"), line
        text = script.read_text()
        tasks = {"cluster": 1, "split": 1, "finalize": 1, "clean": 3}.get(stage, 2)  # clean: + the tokenizer
        assert f"#SBATCH --array=0-{tasks - 1}\n" in text and "#SBATCH --partition=cpu" in text
        assert ("--dependency=afterok:$" + chain[-1][0] in line) if i else ("--dependency" not in line)
        pik = text.split("launch_pickled_pipeline ")[1].split()[0]
        chain.append((var, pik, tasks))
    assert "manifest.json" not in os.listdir(out)
    assert not [p.name for p in slurm.glob("*.sbatch") if "$J" in p.read_text()]  # sbatch does not expand those

    # submit.sh, replayed against an sbatch that hands out job ids: each stage waits for the one before.
    fake = tmp_path / "sbatch_bin"
    fake.mkdir()
    (fake / "sbatch").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/sbatch.log\nwc -l < {tmp_path}/sbatch.log\n')
    (fake / "sbatch").chmod(stat.S_IRWXU)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}
    subprocess.run(["bash", str(slurm / "submit.sh")], env=env, check=True, capture_output=True)
    calls = (tmp_path / "sbatch.log").read_text().splitlines()
    stage_calls = [(i + 1, c) for i, c in enumerate(calls) if "merge_stats" not in c]
    assert all(c.split()[-1].endswith(f"data_prep_{s}.sbatch") for s, (_, c) in zip(STAGES, stage_calls))
    assert len(stage_calls) == len(STAGES)
    for (prev_id, _), (_, call) in itertools.pairwise(stage_calls):
        assert f"--dependency=afterok:{prev_id} " in call, call

    # Replay the chain job by job, each array task as Slurm would start it.
    monkeypatch.setenv("SLURM_NODELIST", "localhost")
    monkeypatch.setenv("RUN_OFFSET", "0")
    for _, pik, tasks in chain:
        for task in range(tasks):
            monkeypatch.setenv("SLURM_ARRAY_TASK_ID", str(task))
            with open(pik, "rb") as f:
                dill.load(f).run()
    assert outputs(out) == outputs(ref)
    m = json.loads((ref / "manifest.json").read_text())
    assert m["stages"]["license"]["dropped"] == {"GPL-3.0-only": 1}
    assert m["stages"]["read"]["docs_in"] == len(list(FIXTURE.rglob("*.py")))


# ------------------------------------------------------------------------------------------------ units


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097])
def test_pointwise_shuffle_is_a_seeded_bijection(n):
    p = permute(np.arange(n), n, seed=0, salt="train")
    assert sorted(p.tolist()) == list(range(n))
    halves = np.concatenate([permute(np.arange(n // 2), n, 0, "train"), permute(np.arange(n // 2, n), n, 0, "train")])
    assert np.array_equal(halves, p)  # any slice of positions, evaluated alone, agrees
    if n >= 64:
        assert not np.array_equal(p, permute(np.arange(n), n, 1, "train"))
        assert not np.array_equal(p, permute(np.arange(n), n, 0, "validation"))
        assert abs(np.corrcoef(np.arange(n), p)[0, 1]) < 0.2


def _split_in_memory(sizes: dict[str, int], fraction: float, seed: int) -> dict[str, str]:
    """The split as the single-process pipeline computed it (its split_by_repo), kept here as the reference."""
    import hashlib

    total = sum(sizes.values())
    order = sorted(sizes, key=lambda r: hashlib.sha1(f"{seed}:{r}".encode()).hexdigest())
    target, val, out = fraction * total, 0, {}
    for r in order:
        if val < target and val + sizes[r] <= 1.5 * target:
            out[r] = "validation"
            val += sizes[r]
        else:
            out[r] = "train"
    if fraction > 0 and not any(s == "validation" for s in out.values()) and len(order) > 1:
        out[min(order, key=lambda r: sizes[r])] = "validation"
    return out


@pytest.mark.parametrize(("n_repos", "fraction", "buckets"), [(200, 0.05, 8), (40, 0.2, 3), (5, 0.01, 4), (2, 0.5, 1)])
def test_streamed_split_equals_the_in_memory_split(tmp_path, n_repos, fraction, buckets):
    from data_prep.config import to_cfg
    from data_prep.split import split_unit
    from data_prep.store import repo_key
    from data_prep.work import Ctx, Work

    rng = np.random.default_rng(n_repos)
    sizes = {f"repo{i}": int(rng.pareto(1.2) * 1000) + 1 for i in range(n_repos)}
    cfg = to_cfg(
        {"output_dir": str(tmp_path), "buckets": buckets, "seed": 3, "split": {"validation_fraction": fraction}}
    )
    work = Work(cfg)
    for stage in ("signatures", "cluster", "split"):
        work.dir(stage).mkdir(parents=True)
    for b in range(buckets):  # a repository's files are spread over buckets: split each size in parts
        rows = [(repo_key(3, r), {"repo": r, "chars": s // buckets + (b < s % buckets)}) for r, s in sizes.items()]
        write_run(work.bucket("signatures", b, ".repos"), [x for x in rows if x[1]["chars"]])
    # The cluster step takes off what the duplicates held: some of one repository, all of another.
    taken = {"repo0": sizes["repo0"] // 2, "repo1": sizes["repo1"]} if n_repos > 2 else {}
    write_run(work.dir("cluster") / "removed_repos", [(repo_key(3, r), {"chars": -n}) for r, n in taken.items()])
    net = {r: n - taken.get(r, 0) for r, n in sizes.items() if n - taken.get(r, 0) > 0}
    split_unit(Ctx(cfg, work), 0)
    expected = _split_in_memory(net, fraction, 3)
    assert json.loads((tmp_path / "repos.json").read_text()) == expected
    assert (tmp_path / "repos.json").read_text() == json.dumps(expected, indent=2, sort_keys=True) + "\n"


def test_keyed_runs_read_by_range_and_tables_look_up_by_partition(tmp_path):
    rng = np.random.default_rng(0)
    keys = [int(k) * 2 + 1 for k in rng.integers(0, 2**63, size=500, dtype=np.int64)]
    write_run(tmp_path / "run", [(k, {"k": str(k)}) for k in keys])
    parts = 7
    got = [kr for p in range(parts) for kr in read_run(tmp_path / "run", *part_range(p, parts))]
    assert [k for k, _ in got] == sorted(keys) and all(r["k"] == str(k) for k, r in got)
    for p in range(parts):
        mine = sorted(k for k in keys if repo_part(k, parts) == p)
        write_table(
            tmp_path / f"t{p}", np.array(mine, dtype=np.uint64), np.array([k % 5 for k in mine], dtype=np.uint8)
        )
    table = RepoTable(lambda p: tmp_path / f"t{p}", parts)
    assert table.lookup(keys).tolist() == [k % 5 for k in keys]
    with pytest.raises(KeyError):
        table.lookup([keys[0] + 1])


def test_cluster_streams_removals_in_id_order_with_whole_ids(tmp_path):
    """Ids are gathered at the widest bucket's width (a narrower first bucket must not cut the others'), the
    lowest id of a cluster is kept, and the removal lists stream to disk in id order."""
    from data_prep.config import to_cfg
    from data_prep.doc_stages import PAIR_DTYPE, cluster_unit, near_removed
    from data_prep.store import save_npy
    from data_prep.work import Ctx, Work

    cfg = to_cfg({"output_dir": str(tmp_path), "buckets": 2})
    work = Work(cfg)
    for stage in ("signatures", "near_dedup", "cluster"):
        work.dir(stage).mkdir(parents=True)
    ids = {0: ["zz/a.py", "b.py"], 1: ["a/very/long/path/name.py", "a/very/long/path/name_copy.py", "c.py"]}
    for b, names in ids.items():
        save_npy(work.bucket("signatures", b, ".ids.npy"), np.array([n.encode() for n in names]))
        save_npy(work.bucket("signatures", b, ".rkey.npy"), np.arange(len(names), dtype=np.uint64))
        save_npy(work.bucket("signatures", b, ".chars.npy"), np.ones(len(names), dtype=np.int64))

    def pairs(*rows):
        return np.array([((ba << 32) | ra, (bb << 32) | rb, ex) for (ba, ra), (bb, rb), ex in rows], dtype=PAIR_DTYPE)

    save_npy(work.part("near_dedup", 0, ".npy"), pairs(((0, 0), (1, 1), 0), ((1, 0), (1, 1), 0)))
    save_npy(work.part("near_dedup", 1, ".npy"), pairs(((0, 1), (1, 2), 1)))
    ctx = Ctx(cfg, work)
    st = cluster_unit(ctx, 0)
    assert (st["near"], st["exact"]) == (2, 1)
    assert near_removed(ctx) == [
        {"id": "a/very/long/path/name_copy.py", "kept": "a/very/long/path/name.py"},
        {"id": "zz/a.py", "kept": "a/very/long/path/name.py"},
    ]
    assert near_removed(ctx, 1) == near_removed(ctx)[:1]
    with gzip.open(work.dir("cluster") / "exact_removed.jsonl.gz", "rt") as f:
        assert [json.loads(line) for line in f] == [{"id": "c.py", "kept": "b.py"}]


def _word_shingles(text: str, n: int) -> frozenset:
    """Word n-grams as tuples of the words themselves (no hashing): a word is a run of ASCII letters, digits,
    ``_`` or non-ASCII bytes, the pipeline's definition; a text shorter than n words is one shingle."""
    words = re.findall(rb"[0-9A-Za-z_\x80-\xff]+", text.encode("utf-8"))
    if len(words) < n:
        return frozenset([tuple(words)])
    return frozenset(tuple(words[i : i + n]) for i in range(len(words) - n + 1))


def test_distributed_near_dedup_stages_remove_what_exact_jaccard_removes(tmp_path):
    """The pipeline's own signatures -> near_dedup -> cluster stages (3 tasks, 32 buckets, 32 key partitions)
    against an independent reference: exact Jaccard of every pair of the documents that reached them, on
    word 5-grams taken from the text (no MinHash, no LSH, no hashing), union-find, lowest id kept. Near
    copies of 7 files and an exact copy are planted; no pair lies within 0.06 of the threshold (about 3 standard
    errors of a 256-slot MinHash estimate there), so the estimate cannot flip a verdict: they must agree."""
    corpus = make_corpus(tmp_path)
    picked = sorted(p for p in corpus.rglob("*.py") if p.parent.name in ("mathutils", "textutils"))[:7]
    for k, src in enumerate(picked):
        text = src.read_text()
        mid = len(text) // 2
        edit = text[:mid] + f"\n# local change {k}: keep the old behaviour\n" + text[mid:]
        (src.parent / f"{src.stem}_near.py").write_text(edit + "\n# vendored copy\n")
    shutil.copy(picked[0], picked[0].parent / f"{picked[0].stem}_exact.py")
    out = tmp_path / "out"
    run(cfg_for(corpus, out, "executor.tasks=3", "executor.workers=2"))
    work = out / "_work"
    docs = {}
    for f in sorted((work / f"{STAGES.index('signatures'):02d}_signatures").glob("b*.jsonl.gz")):
        with gzip.open(f, "rt", encoding="utf-8") as fh:
            docs.update((d["id"], d["text"]) for d in map(json.loads, fh))
    ids = sorted(docs)
    shingles = [_word_shingles(docs[i], 5) for i in ids]
    threshold = 0.85
    parent = list(range(len(ids)))

    def root(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    gray = []
    for a, b in itertools.combinations(range(len(ids)), 2):
        jac = len(shingles[a] & shingles[b]) / len(shingles[a] | shingles[b])
        if abs(jac - threshold) < 0.06:
            gray.append((ids[a], ids[b], round(jac, 3)))
        if jac >= threshold or docs[ids[a]] == docs[ids[b]]:
            ra, rb = root(a), root(b)
            parent[max(ra, rb)] = min(ra, rb)  # ids are sorted: the lower index is the lower id, kept
    assert not gray, f"pairs too close to the threshold for an exact comparison: {gray}"
    expected = {ids[i]: ids[root(i)] for i in range(len(ids)) if root(i) != i}
    removed = {}
    for name in ("exact_removed.jsonl.gz", "near_removed.jsonl.gz"):
        with gzip.open(work / f"{STAGES.index('cluster'):02d}_cluster" / name, "rt", encoding="utf-8") as fh:
            removed.update((r["id"], r["kept"]) for r in map(json.loads, fh))
    assert len(expected) >= 9, expected  # the 8 planted copies and the fixture's own forks
    assert removed == expected
