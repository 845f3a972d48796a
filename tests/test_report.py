"""The comb report on synthetic but realistic metrics.jsonl files: planted stalls must be named, with their step
window; rollbacks, resumes and missing optional keys must not confuse it; bad input is one ``error:`` line."""

from __future__ import annotations

import json
import math
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ultrascale.errors import DataError
from ultrascale.report import analyze, load_run, write_report
from ultrascale.report.__main__ import main
from ultrascale.report.markdown import render

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def synth(
    run_dir: Path,
    *,
    steps: int = 600,
    interval: int = 5,
    stall: tuple[int, int] | None = (400, 10**9),
    stall_s: float = 0.2,
    speed: float = 1.0,
    comm: bool = True,
    throughput: bool = True,
    ckpt_every: int = 150,
    ckpt_s: float = 1.5,
    eval_every: int = 100,
    rollback_at: int | None = None,
    resume_at: int | None = None,
    seed: int = 0,
) -> Path:
    """Write a run directory the way the trainer does: a step row every ``interval`` steps, events in between.

    A step is ~0.3 s (fwd 0.08, bwd 0.16, comm 0.02, opt 0.03, data 0.002, rest other) scaled by 1/speed;
    inside ``stall`` (steps a < s <= b) the data wait grows by ``stall_s``. The first step of each segment
    carries a 5 s compile. A rollback at ``rollback_at`` goes back to the previous checkpoint and replays.
    """
    rng = random.Random(seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    t, s, warm, rolled, resumed, last_ckpt = 0.0, 0, True, False, False, 0
    while s < steps:
        s += 1
        jit = lambda v: v * (1 + 0.1 * (rng.random() - 0.5)) / speed  # noqa: E731
        parts = {"data_wait_s": jit(0.002), "fwd_s": jit(0.08), "bwd_s": jit(0.16), "opt_s": jit(0.03)}
        if comm:
            parts["comm_s"] = jit(0.02)
        if warm:
            parts["fwd_s"] += 5.0
            warm = False
        if stall and stall[0] < s <= stall[1]:
            parts["data_wait_s"] += stall_s * (1 + 0.1 * (rng.random() - 0.5))
        other = jit(0.01)
        step_s = sum(parts.values()) + other
        t += step_s
        if s % interval == 0:
            loss = 2.0 + 6.0 * math.exp(-s / 150) + 0.05 * rng.random()
            row = {"step": s, "time_s": round(t, 4), "loss": loss, "lr": 3e-3, "grad_norm": 1.0 + rng.random()}
            if throughput:
                row.update(tokens_per_s=4096 / step_s, tflops=0.5 / step_s, mfu=0.1 / step_s, mem_gb=1.5)
            row.update(step_s=step_s, other_s=other, **parts, epoch=s / 1000, data_wait=parts["data_wait_s"] / step_s)
            rows.append(row)
        if s == 123:
            rows.append({"step": s, "time_s": t, "event": "skip", "reason": "spike", "loss": 40.0, "zscore": 9.1})
        if s == 200:
            rows.append(
                {"step": s, "time_s": t, "event": "lr_cut", "factor": 0.5, "until_step": 300, "reason": "spike"}
            )
        if eval_every and s % eval_every == 0:
            t += 0.8
            rows.append({"step": s, "time_s": t, "event": "eval", "eval_loss": 2.5 + 6.0 * math.exp(-s / 150),
                         "eval_perplexity": 20.0, "eval_s": 0.8})  # fmt: skip
        if ckpt_every and s % ckpt_every == 0:
            t += ckpt_s
            last_ckpt = s
            rows.append({"step": s, "time_s": t, "event": "checkpoint", "checkpoint_s": ckpt_s})
        if rollback_at is not None and s == rollback_at and not rolled:
            rolled = True
            rows.append({"step": s, "time_s": t, "event": "rollback", "reason": "nonfinite", "to_step": last_ckpt,
                         "skip_from": last_ckpt, "skip_to": s + 1})  # fmt: skip
            s = last_ckpt
        if resume_at is not None and s == resume_at and not resumed:
            resumed, t, warm = True, 0.0, True
            rows.append({"step": s, "time_s": 0.5, "event": "resume", "from_step": s})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def _sum_row(md: str) -> list[float]:
    """The printed sums of the breakdown's share columns (percent)."""
    line = next(ln for ln in md.splitlines() if ln.startswith("| **sum**"))
    return [float(v) for v in re.findall(r"\*\*([\d.]+) %\*\*", line)]


def _md(run: Path) -> str:
    """report.md's text without drawing the PNG (the tests that check the picture call write_report)."""
    return render([analyze(load_run(run))])


def _png_ok(path: Path) -> None:
    import matplotlib.image as mpimg

    assert path.read_bytes()[:8] == PNG_MAGIC
    h, w = mpimg.imread(path).shape[:2]
    assert h > 500 and w > 500


def test_names_planted_data_wait_stall_and_where_it_starts(tmp_path):
    run = synth(tmp_path / "stall", rollback_at=None)
    md_path, png = write_report([run])
    md = md_path.read_text()
    assert md_path == run / "report.md" and png == run / "report.png"
    assert "**Largest stall: data wait" in md
    assert "after step 400" in md
    sums = _sum_row(md)
    assert len(sums) == 2 and all(abs(v - 100) < 5 for v in sums)
    _png_ok(png)
    a = analyze(load_run(run))
    assert abs(a.breakdown.total - 1) < 0.05
    win = a.largest.window
    assert (win.kind, win.first) == ("after", 400)
    # ~0.2 s on a ~0.5 s step after the change, a few ms before it
    assert 0.3 < win.share_in < 0.5 and win.share_out < 0.02
    # step 1's 5 s compile is in no row (only every 5th step is logged): it is billed outside the steps
    outside = next(s for s in a.stalls if s.key == "outside")
    assert 5.0 < outside.seconds < 6.0 and "before the first logged step" in outside.sentence()
    start = next(t for t in a.comb if t.kind == "start")  # drawn as its own bar at the head of the comb
    assert start.pos == 0 and 4.8 < start.seconds < 5.2


def test_stall_window_in_the_middle_and_steady_runs(tmp_path):
    mid = analyze(load_run(synth(tmp_path / "mid", stall=(200, 300), stall_s=0.5, ckpt_every=0)))
    w = mid.largest.window
    assert (mid.largest.key, w.kind, w.first, w.last) == ("data_wait_s", "between", 205, 300)
    assert "from step 205 to step 300" in mid.largest.sentence()

    flat = analyze(load_run(synth(tmp_path / "flat", steps=100, stall=None, ckpt_every=0, eval_every=0, interval=1)))
    by_key = {s.key: s for s in flat.stalls}
    assert by_key["opt_s"].window.kind == "throughout"
    assert "throughout" in by_key["opt_s"].sentence()
    # step 1 is logged here: the steady breakdown leaves its 5 s compile out, the all-steps one does not,
    # and the excess is billed as warm-up rather than as forward compute
    assert flat.steady.mean["fwd_s"] < 0.1 < flat.all.mean["fwd_s"]
    assert flat.largest.key == "warmup" and 4.9 < flat.largest.seconds < 5.1
    assert "at step 1 vs 0.3" in flat.largest.sentence()
    assert abs(flat.all.total - 1) < 0.05 and abs(flat.steady.total - 1) < 0.05


def test_checkpoint_time_is_a_stall_between_steps(tmp_path):
    run = synth(tmp_path / "ckpt", stall=None, ckpt_every=100, ckpt_s=10.0, eval_every=0)
    a = analyze(load_run(run))
    assert a.largest.key == "checkpoint"
    assert "checkpointing took" in a.largest.sentence() and "6 saves, 10.0 s each" in a.largest.sentence()
    assert "**Largest stall: checkpointing took" in _md(run)


def test_rollback_replays_steps_curves_keep_the_last_row(tmp_path):
    run = synth(tmp_path / "rb", rollback_at=290)
    r = load_run(run)
    a = analyze(r)
    logged = [t.step for t in a.comb if t.kind == "step"]
    assert len(logged) == 600 // 5 + 140 // 5  # steps 155..290 logged twice (file order keeps both)
    curve = r.curve()
    assert [c["step"] for c in curve] == sorted({c["step"] for c in curve}) and len(curve) == 120
    replay = [row for row in r.step_rows if row["step"] == 200]
    assert curve[[c["step"] for c in curve].index(200)] is replay[-1]
    assert a.steps_run == 600 + 140  # the replayed steps were run (and billed) twice
    md = _md(run)
    assert re.search(r"\| 290 \| rollback \| nonfinite \| .*to_step=150", md)
    assert re.search(r"\| 123 \| skip \| spike \| .*zscore=9\.1", md)
    assert re.search(r"\| 200 \| lr_cut \| spike \|", md)
    assert "**Largest stall: data wait" in md and "after step 400" in md


def test_resume_restarts_the_clock_and_warms_up_again(tmp_path):
    run = synth(tmp_path / "res", resume_at=300, stall=None)
    a = analyze(load_run(run))
    rows = load_run(run).rows
    i = next(k for k, r in enumerate(rows) if r.get("event") == "resume")
    assert math.isclose(a.wall_s, max(r["time_s"] for r in rows[:i]) + max(r["time_s"] for r in rows[i:]))
    assert a.resumes == 1
    assert sum(1 for t in a.comb if t.kind == "step" and not t.steady) == 2  # first row of each segment
    md = _md(run)
    assert "over 2 segments (1 resume)" in md and "| resume |" in md


def test_missing_optional_keys_and_files(tmp_path):
    run = synth(tmp_path / "bare", comm=False, throughput=False, ckpt_every=0, eval_every=0)
    md_path, png = write_report([run])
    md = md_path.read_text()
    assert "| communication |" not in md and "Communication was not measured" in md
    assert "No throughput columns" not in md  # step time is still there
    assert "| tokens/s |" not in md
    assert all(abs(v - 100) < 5 for v in _sum_row(md))
    _png_ok(png)


def test_breakdown_off_rows_have_no_compute_and_other_is_no_stall(tmp_path):
    """train.step_breakdown=false (or a pipeline run): only data wait, comm and step time are in the rows."""
    run = synth(tmp_path / "off", stall=(400, 10**9), ckpt_every=0, eval_every=0)
    path = run / "metrics.jsonl"
    rows = [json.loads(ln) for ln in path.read_text().splitlines()]
    for r in rows:
        if "event" not in r:
            r["other_s"] = r["step_s"] - r["data_wait_s"] - r["comm_s"]
            for k in ("fwd_s", "bwd_s", "opt_s"):
                del r[k]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    a = analyze(load_run(run))
    assert a.parts == ("data_wait_s", "comm_s", "other_s") and a.compute_frac is None
    assert a.largest.key == "data_wait_s" and a.largest.window.first == 400
    assert "other_s" not in {s.key for s in a.stalls}
    md = write_report([run])[0].read_text()
    assert "were not timed in this run" in md and all(abs(v - 100) < 5 for v in _sum_row(md))


def test_rows_from_before_the_breakdown_still_report(tmp_path):
    """Legacy rows (no step_s, only the data_wait fraction) give a report without a breakdown, not a crash."""
    run = tmp_path / "legacy"
    run.mkdir()
    rows = [
        {"step": 5, "time_s": 1.0, "loss": 8.0, "tokens_per_s": 100.0, "data_wait": 0.01},
        {"step": 10, "time_s": 2.0, "loss": 7.0, "tokens_per_s": 110.0},
        {"step": 10, "time_s": 2.5, "event": "checkpoint", "checkpoint_s": 0.5},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    md_path, png = write_report([run])
    md = md_path.read_text()
    assert "No step breakdown in these rows" in md and "(2 logged rows)" in md
    assert "**Largest stall: checkpointing took 20 % of wall time (1 save, 0.5 s each)" in md
    _png_ok(png)


def test_header_from_config_summary_and_checkpoint_meta(tmp_path):
    run = synth(tmp_path / "hdr")
    (run / "config.yaml").write_text(
        "model: {type: llama, name: tiny}\nzero: {stage: 2, offload_optimizer: cpu, offload_param: none}\n"
        "precision: {dtype: bf16}\ndata: {micro_batch: 4, global_batch: 16, seq_len: 256}\n"
        "train: {steps: 600, log_interval: 5}\n"
    )
    ck = run / "checkpoints"
    (ck / "step_00000600").mkdir(parents=True)
    (ck / "latest").write_text("step_00000600")
    (ck / "step_00000600" / "ultrascale_meta.json").write_text(
        json.dumps({"world_size": 2, "topology": {"world": 2, "tp": 1, "pp": 1, "sp": 1, "ep": 1, "dp": 2}})
    )
    md = _md(run)
    assert "| model | tiny (llama) |" in md
    assert "| ZeRO | stage 2 (optimizer offload to cpu) |" in md
    assert "| world | 2 ranks (dp=2 tp=1 pp=1 sp=1 ep=1) |" in md
    assert "micro 4 × accum 2 × dp 2 = global 16 samples × seq 256 = 4,096 tokens/step" in md
    assert "| steps | 600 of 600 (120 logged rows, every 5) |" in md
    (run / "config.yaml").write_text("model: [unclosed\n")  # an unreadable config only blanks the header
    assert "| model |" not in _md(run)


def test_two_runs_side_by_side(tmp_path):
    a = synth(tmp_path / "a" / "run", stall=(400, 10**9))
    b = synth(tmp_path / "b" / "run", stall=None, speed=1.5, seed=1)
    md_path, png = write_report([a, b])
    assert md_path.parent == tmp_path / "a" / "compare_run_vs_run"
    md = md_path.read_text()
    head = re.search(
        r"\*\*b/run is (1\.\d\d)× as fast as a/run\*\* \(steady mean tokens/s: b/run ([\d,]+) vs a/run ([\d,]+)\)", md
    )
    assert head, md[:400]
    fast, slow = (float(x.replace(",", "")) for x in head.groups()[1:])
    assert fast > slow and float(head.group(1)) == pytest.approx(fast / slow, abs=0.01)  # each number by its run
    assert "## Side by side" in md and "## a/run" in md and "## b/run" in md
    line = next(ln for ln in md.splitlines() if ln.startswith("| largest stall |"))
    assert "data wait" in line and "after step 400" in line
    assert md.count("| **sum** |") == 2
    _png_ok(png)


def test_cli_writes_report_and_prints_the_stall(tmp_path, capsys):
    run = synth(tmp_path / "cli")
    assert main([f"run_dir={run}", f"out={tmp_path / 'o'}"]) == 0
    out = capsys.readouterr().out
    assert "largest stall: data wait" in out and "after step 400" in out
    assert (tmp_path / "o" / "report.md").exists() and (tmp_path / "o" / "report.png").exists()
    other = synth(tmp_path / "cli2", steps=100, stall=None)
    assert main([f"run_dir=[{run},{other}]", f"out={tmp_path / 'c'}"]) == 0
    assert "## cli2" in (tmp_path / "c" / "report.md").read_text()
    assert main(["--help"]) == 0 and "run_dir=[A,B]" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["run_dir=/nonexistent/run"], "run_dir /nonexistent/run does not exist"),
        ([], "run_dir= is required"),
        (["run_dirr=x"], "unknown argument 'run_dirr'"),
        (["runs/x"], "is not key=value"),
    ],
)
def test_cli_errors_are_one_line(capsys, args, needle):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and err.count("\n") == 1


def test_corrupt_metrics_names_file_and_line(tmp_path, capsys):
    run = synth(tmp_path / "bad", steps=50)
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:2]) + '{"step": 11, "time_s": 3.0, "loss": \n' + "".join(lines[2:]))
    assert main([f"run_dir={run}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path} line 3 is not valid JSON")
    path.write_text('{"loss": 1.0}\n')
    with pytest.raises(DataError, match="line 1 is not a metrics row"):
        load_run(run)
    (run / "metrics.jsonl").unlink()
    with pytest.raises(DataError, match=r"metrics\.jsonl not found"):
        load_run(run)
    path.write_text(json.dumps({"step": 0, "time_s": 0.1, "event": "resume", "from_step": 0}) + "\n")
    with pytest.raises(DataError, match="has no step rows"):
        load_run(run)


def test_partial_last_line_is_dropped_with_a_note(tmp_path):
    run = synth(tmp_path / "live", steps=100)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 105, "time_s": 40.0, "lo')  # a run killed mid-write
    r = load_run(run)
    assert r.curve()[-1]["step"] == 100 and "partial last line" in r.notes[0]
    assert "> dropped a partial last line" in _md(run)


def test_entry_point_runs_as_a_module(tmp_path):
    """The real ``python -m`` path: exit 2 and one error line for a missing run dir, 0 and files for a run."""
    p = subprocess.run([sys.executable, "-m", "ultrascale.report", f"run_dir={tmp_path / 'nope'}"],
                       capture_output=True, text=True)  # fmt: skip
    assert p.returncode == 2 and p.stderr.startswith("error: run_dir") and "Traceback" not in p.stderr
    run = synth(tmp_path / "mod", steps=100)
    p = subprocess.run([sys.executable, "-m", "ultrascale.report", f"run_dir={run}"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert (run / "report.md").exists() and (run / "report.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.dist
def test_real_run_books_planted_stalls_in_their_own_parts_and_names_the_largest(tiny_data, tmp_path):
    """End to end: a real 2-rank cpu_smoke run with a slow data fetch planted at steps 4-9 on rank 0 and a slow
    checkpoint after step 6, then ``python -m ultrascale.report``: each delay lands in its own part (not in
    ``other_s``, not in a step), and the report names the data wait as the largest stall, where it happens."""
    from tests.conftest import FAST, check, launch

    run = tmp_path / "cpu_smoke"
    data_delay, ckpt_delay, slow = 0.8, 1.5, range(4, 10)
    plant = ",".join([*(f"slow_data@{s}:0x{data_delay}" for s in slow), f"slow_ckpt@6x{ckpt_delay}"])
    check(launch(["recipe=cpu_smoke", *FAST, f"data.path={tiny_data}", f"output_dir={run}", "train.steps=12",
                  "train.log_interval=1", "train.eval_interval=6", "train.checkpoint_interval=6",
                  "train.checkpoint_async=false"],  # the planted slow disk stalls a synchronous save
                 env={"ULTRASCALE_INJECT": plant}))  # fmt: skip
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = {r["step"]: r for r in rows if "event" not in r}
    clean = [r["data_wait_s"] for s, r in steps.items() if s not in slow]
    for s in slow:
        r = steps[s]
        assert data_delay <= r["data_wait_s"] < data_delay + max(clean) + 0.2, r  # the delay, all of it, here
        assert r["other_s"] < data_delay / 2 and r["fwd_s"] + r["bwd_s"] + r["opt_s"] < data_delay, r
    assert max(clean) < data_delay / 4
    (ckpt,) = [r for r in rows if r.get("event") == "checkpoint" and r["step"] == 6]
    assert ckpt["checkpoint_s"] >= ckpt_delay
    assert all(steps[s]["step_s"] < ckpt_delay for s in (6, 7))  # not inside the steps around the save

    (run / "report.md").unlink()  # the trainer wrote one at the end; the CLI must write it again
    out = subprocess.run([sys.executable, "-m", "ultrascale.report", f"run_dir={run}"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    md = (run / "report.md").read_text()
    a = analyze(load_run(run))
    assert a.largest.key == "data_wait_s", [(s.key, s.seconds) for s in a.stalls]
    assert (a.largest.window.first, a.largest.window.last) == (slow[0], slow[-1])
    assert a.largest.seconds >= len(slow) * data_delay
    assert f"**Largest stall: {a.largest.sentence()}.**" in md, md[:2000]
    ranked = {s.key: s.seconds for s in a.stalls}
    assert ranked["checkpoint"] >= ckpt_delay  # the save is its own stall, ranked with its planted time
    assert (run / "report.png").read_bytes()[:8] == PNG_MAGIC


def test_the_quality_figure_places_each_checkpoint_by_the_tokens_it_trained(tmp_path):
    """``python -m ultrascale.report.quality``: a checkpoint's pass@1 sits at its export's step x the run's tokens
    per step, the base at 0; loss and pass@1 share that axis, and the PNG is written."""
    from ultrascale.report.load import load_run
    from ultrascale.report.quality import loss_points, main, pass_at_1_points, prompt_label

    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"tokens": 60 * 4096, "steps": 60}))
    # As the trainer writes them: held-out evals are event rows (step 0 with train.eval_at_start), and a step
    # rolled back and run again is logged twice (its eval too): the last row wins.
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        {"step": 0, "time_s": 0.5, "event": "eval", "eval_loss": 0.95}, {"step": 5, "time_s": 1.0, "loss": 1.0},
        {"step": 20, "time_s": 4.0, "loss": 0.7}, {"step": 20, "time_s": 4.5, "event": "eval", "eval_loss": 0.99},
        {"step": 20, "time_s": 5.0, "event": "checkpoint"}, {"step": 20, "time_s": 6.0, "loss": 0.72},
        {"step": 20, "time_s": 6.5, "event": "eval", "eval_loss": 0.9}, {"step": 40, "time_s": 8.0, "loss": 0.6})))  # fmt: skip
    train, held = loss_points(load_run(run), 4096)
    assert train == [(5 * 4096, 1.0), (20 * 4096, 0.72), (40 * 4096, 0.6)]
    assert held == [(0, 0.95), (20 * 4096, 0.9)]
    assert prompt_label({"prompt": "chat", "stops": ["\ndef ", "```"]}) == "chat prompt"
    assert prompt_label({"prompt": "plain", "stops": ["\ndef ", "```"]}) == "plain prompt + fence stop"
    assert prompt_label({"prompt": "plain"}) == "plain prompt"
    cands = []
    for step in (40, 20):  # listed out of order: the points come sorted by tokens
        d = tmp_path / f"hf_{step}"
        d.mkdir()
        (d / "ultrascale_export.json").write_text(json.dumps({"step": step, "tag": f"step_{step:08d}"}))
        cands.append(str(d))
    grid = {f"{cands[0]}|greedy": 0.10, f"{cands[1]}|greedy": 0.05, f"{cands[1]}|T=0.2": 0.5}
    result = {"prompt": "chat", "sets": {"humaneval": {"split": {"dev": ["a"] * 82, "test": ["b"] * 82}, "models": {
        "base": {"dev_grid": {"models/base|greedy": 0.07}, "test_pass@1": 0.07},
        "sft": {"dev_grid": grid, "test_pass@1": 0.1, "vs_base": {"diff": 0.03, "lo": -0.01, "hi": 0.07}}}}}}  # fmt: skip
    (tmp_path / "eval.json").write_text(json.dumps(result))
    pts = pass_at_1_points(result, 4096)
    assert pts == {"base": [(0, 0.07)], "sft": [(20 * 4096, 0.05), (40 * 4096, 0.10)]}  # greedy only, by tokens
    out = tmp_path / "fig" / "q.png"
    assert main(["--run", str(run), "--eval", str(tmp_path / "eval.json"), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["--run", str(tmp_path / "nope"), "--eval", str(tmp_path / "eval.json"), "--out", str(out)]) == 2
