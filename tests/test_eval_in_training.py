"""Evaluation during training, on 2 ranks through train.py.

Held-out loss is sharded over the ranks and all-reduced (token-weighted); HumanEval runs greedy on rank 0
in the sandbox on a BPE-tokenized corpus, and each completion's sandbox exit is kept beside the run. The
step breakdown with planted stalls is tested in tests/test_report.py.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import FAST, PY_ERROR, check, launch, metrics

pytestmark = pytest.mark.dist

PARTS = ("data_wait_s", "fwd_s", "bwd_s", "comm_s", "opt_s", "other_s")


@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory):
    """40 stdlib files through the real data prep (BPE with 512 tokens, seq 64): a few seconds."""
    from data_prep.api import prepare

    out = tmp_path_factory.mktemp("bpe") / "data"
    prepare(str(out), source="stdlib", seq_len=64, vocab_size=512, max_files=40)
    return out


# Planted stalls give two parts a size no bookkeeping hides (rows are rank 0's): the data wait we clock at step 3,
# and at step 4 rank 0's wait for rank 1 (asleep in its fetch) in the step's first blocking collective, the
# gradient reduce DeepSpeed clocks inside backward (our loss all-reduce only starts before it).
STALL_S = 0.2
STALLS = f"slow_data@3:0x{STALL_S},slow_data@4:1x{STALL_S}"


def test_eval_and_humaneval_during_training_runs_every_completion_in_the_sandbox(bpe_data, tmp_path):
    out = tmp_path / "run"
    check(launch([*FAST, f"data.path={bpe_data}", f"output_dir={out}", "train.steps=4", "train.eval_interval=2",
                  "train.eval_at_start=true", "train.eval_humaneval=2", "train.eval_humaneval_max_new_tokens=16"],
                 env={"ULTRASCALE_INJECT": STALLS}))  # fmt: skip
    rows = metrics(out)
    evals = [r for r in rows if r.get("event") == "eval"]
    # eval_at_start: the untrained model's held-out loss is the curve's before point, above the trained one's
    assert [e["step"] for e in evals] == [0, 2, 4]
    assert evals[0]["eval_loss"] > evals[-1]["eval_loss"], evals
    for e in evals:
        assert e["eval_perplexity"] == pytest.approx(math.exp(e["eval_loss"]), rel=1e-6) and e["eval_s"] > 0
        assert e["humaneval_problems"] == 2
        samples = [json.loads(x) for x in (out / "humaneval" / f"step_{e['step']:08d}.jsonl").read_text().splitlines()]
        assert [s["task_id"] for s in samples] == ["HumanEval/0", "HumanEval/1"]
        assert e["humaneval_pass@1"] == pytest.approx(sum(s["passed"] for s in samples) / 2)
        for s in samples:  # each program really ran: its exit status and the interpreter's own last words
            assert s["status"] in ("passed", "failed", "timeout") and s["passed"] == (s["status"] == "passed")
            if s["status"] == "failed":
                assert s["returncode"] not in (None, 0) and PY_ERROR.match(s["error"]), s
    steps = [r for r in rows if "event" not in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        # A part we clock ourselves also feeds the outer clock that other_s is measured by, so counted twice it
        # takes its double out of other_s and the parts still sum to step_s (the check below). The clocked parts
        # are disjoint stretches of the step: without other_s they cannot add up to more than step_s, and a
        # double-counted stall would.
        clocked = sum(r[p] for p in PARTS if p != "other_s")
        assert clocked <= 1.01 * r["step_s"] + 0.002, (clocked, r)
        # other_s is clocked on its own (the step's wall time outside every timed call), so the parts' sum
        # checks DeepSpeed's inner timers against our outer clock. Below it by what DeepSpeed does inside
        # backward/step but times in no part (~2 % here).
        total = sum(r[p] for p in PARTS)
        assert abs(total - r["step_s"]) <= 0.05 * r["step_s"] + 0.002, (total, r)
        assert r["fwd_s"] > 0 and r["bwd_s"] > 0 and r["opt_s"] > 0 and r["other_s"] > 0
    by_step = {r["step"]: r for r in steps}
    assert by_step[3]["data_wait_s"] >= STALL_S, by_step[3]  # the stalls landed in the parts they test
    assert by_step[4]["comm_s"] >= STALL_S / 2, by_step[4]


def test_humaneval_during_training_needs_a_tokenizer(tiny_data, tmp_path):
    proc = launch([*FAST, f"data.path={tiny_data}", f"output_dir={tmp_path / 'r'}", "train.steps=2",
                   "train.eval_humaneval=2"])  # fmt: skip
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "train.eval_humaneval=2 needs a tokenizer" in errors[0], proc.stderr[-2000:]


def test_an_ablation_scores_every_arm_on_one_held_out_split(bpe_data, tiny_data, tmp_path):
    """``data.eval_path``: a FIM arm trains on its own data and is scored on the FIM-free data's validation split,
    with the masking ``data.eval_document_masking`` fixes (here on, against training's off); ``data.final_eval_batches=0``
    reads the whole split after the last step, beside the curve's ``eval_loss``. Data whose tokenizer is not the
    training data's is refused in one line before anything is written."""
    from data_prep.api import prepare
    from ultrascale.data.shards import open_split

    fim = tmp_path / "fim"
    prepare(str(fim), source="stdlib", seq_len=64, max_files=30,
            overrides=["fim.rate=0.9", f"tokenizer.path={bpe_data / 'tokenizer'}"])  # fmt: skip
    plain_val, fim_val = (len(open_split(p, "validation", verify=False)) for p in (bpe_data, fim))
    assert plain_val != fim_val  # fewer files: the two validation splits differ in size, so which one was read shows
    out = tmp_path / "run"
    check(launch([*FAST, f"data.path={fim}", f"data.eval_path={bpe_data}", "data.document_masking=false",
                  "data.eval_document_masking=true", "data.final_eval_batches=0", f"output_dir={out}",
                  "train.steps=2", "train.eval_interval=1"]))  # fmt: skip
    evals = [r for r in metrics(out) if r.get("event") == "eval"]
    assert [e["step"] for e in evals] == [1, 2] and "eval_loss_final" not in evals[0]
    assert evals[-1]["eval_samples_final"] == plain_val and evals[-1]["eval_samples"] == 2 * 2 * 2
    assert math.isfinite(evals[-1]["eval_loss_final"]) and evals[-1]["eval_coverage"] == pytest.approx(8 / plain_val)
    proc = launch([*FAST, f"data.path={fim}", f"data.eval_path={tiny_data}", f"output_dir={tmp_path / 'bad'}",
                   "train.steps=2"])  # fmt: skip
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1 and "data.eval_path" in errors[0], proc.stderr[-2000:]
    assert not (tmp_path / "bad").exists()
