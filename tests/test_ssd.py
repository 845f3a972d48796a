"""Self-distillation (ultrascale/ssd): mining, sandbox filtering, the loss-masked SFT set, and a whole round.

Real parts throughout: problems are mined from a fixture module and checked in the kernel sandbox, the
tokenizer is a BPE trained here on stdlib sources, the finetune is ``train.py`` on 2 gloo ranks started by
the SSD entry point, and the eval is eval.py's HumanEval path.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sysconfig
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from tests.conftest import PY_ERROR, ROOT, needs, run_py, sandbox_missing
from tests.support import faults
from ultrascale.config.compose import compose
from ultrascale.config.problems import DENY_NAMES
from ultrascale.errors import ConfigError, DataError
from ultrascale.ssd.config import register_ssd_configs

FIXTURES = ROOT / "tests" / "fixtures" / "ssd"
PROBLEMS = FIXTURES / "problems.jsonl"
MINING = FIXTURES / "corpus" / "mining_sample.py"


needs_sandbox = needs(sandbox_missing())


def ssd_cfg(*overrides: str):
    register_ssd_configs()
    return compose(list(overrides), "ssd")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """Data prep's own BPE trainer on a few stdlib files, saved as an HF tokenizer directory."""
    from data_prep.tokenizer import save_hf, train_bpe

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:30]
    tok = train_bpe((f.read_text(errors="replace") for f in files), vocab_size=1024)
    out = tmp_path_factory.mktemp("ssd_tok") / "tokenizer"
    save_hf(tok, out, model_max_length=1024)
    return out


# ---- problems -------------------------------------------------------------------------------------------
@needs_sandbox
def test_mining_keeps_solvable_problems_and_counts_every_drop():
    from ultrascale.eval.problems import build

    problems, report = build(ssd_cfg(f"problems.input={MINING.parent}").problems)
    by_name = {p["entry_point"]: p for p in problems}
    assert sorted(by_name) == ["clamp", "scaled_sqrt", "triple"]
    # one drop per filter the fixture plants, each under its own reason
    for reason in ("unresolved_name", "denied_name", "relative_import", "humaneval_contaminated"):
        assert report[reason] == 1, (reason, report)
    assert report["tests_accept_stub"] == 1  # quiet(): its examples print nothing, so `return None` passes
    assert report["tests_accept_constant"] == 1  # memorisable(): `return 44` passes its one example
    assert report["reference_failed"] == 1  # wrong_example(): the documented output is wrong
    assert report["kept"] == 3
    # the helper a function needs is in its prompt, so the problem is self-contained
    prompt = by_name["scaled_sqrt"]["prompt"]
    assert "import math" in prompt and "_SCALE = 10" in prompt and "def _scaled(x):" in prompt
    assert prompt.rstrip().endswith('"""') and "return" not in prompt.split("def scaled_sqrt")[1]
    assert by_name["scaled_sqrt"]["reference"] == "    return _scaled(math.sqrt(x))\n"
    # a function tested only by module-level asserts gets them as its check()
    assert "assert triple(2) == 6" in by_name["triple"]["tests"]


def test_mining_without_helpers_drops_what_needs_them():
    from ultrascale.data.mine import MineOptions, mine_file

    counts: Counter = Counter()
    opts = MineOptions(include_helpers=False, deny=frozenset(DENY_NAMES))
    names = [p["entry_point"] for p in mine_file(MINING.read_text(), "m.py", opts, counts)]
    assert "scaled_sqrt" not in names and "clamp" in names
    assert counts["needs_module_helpers"] == 1


def test_humaneval_problem_is_decontaminated():
    from data_prep.decontam import Decontaminator
    from ultrascale.data.mine import MineOptions, mine_file

    mined = mine_file(MINING.read_text(), "m.py", MineOptions(deny=frozenset(DENY_NAMES)), Counter())
    p = next(p for p in mined if p["entry_point"] == "has_close_elements")
    det = Decontaminator(["humaneval"], None, 10, 0.5)
    assert det.match(p["prompt"] + p["reference"])[0] == "HumanEval/0"
    clamp = next(p for p in mined if p["entry_point"] == "clamp")
    assert det.match(clamp["prompt"] + clamp["reference"]) is None


def test_jsonl_problems_are_validated(tmp_path):
    from ultrascale.eval.problems import load_jsonl

    rows = load_jsonl(PROBLEMS, Counter())
    assert [r["task_id"] for r in rows][:2] == ["planted/add", "planted/is_even"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(PROBLEMS.read_text().splitlines()[0] + "\n{not json\n")
    with pytest.raises(DataError, match=r"bad.jsonl line 2 is not valid JSON"):
        load_jsonl(bad, Counter())
    bad.write_text(json.dumps({"task_id": "x", "prompt": "def f():\n", "tests": "assert True", "entry_point": "f"}))
    with pytest.raises(DataError, match=r"bad.jsonl line 1: tests must define check\(candidate\)"):
        load_jsonl(bad, Counter())


def test_config_typo_fails_at_compose():
    with pytest.raises(ConfigError, match=r"sample\.temprature"):
        ssd_cfg("sample.temprature=0.5")
    assert ssd_cfg("ssd=smollm2_135m").problems.train_repos_from == "data/stdlib_smollm2"
    from ultrascale.ssd.config import check

    for preset in sorted((ROOT / "conf" / "ssd").glob("*.yaml")):  # every preset composes and passes the rules
        check(ssd_cfg(f"ssd={preset.stem}"))
    assert ssd_cfg("ssd=smollm2_135m_rft").method == "rft" and ssd_cfg("ssd=smollm2_135m").method == "ssd"


def test_entry_point_errors_are_one_line_and_help_lists_the_keys(tmp_path):
    bad = _ssd(["finetune.global_batch=7", f"output_dir={tmp_path}"])
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip() == (
        "error: finetune.global_batch=7 is not a multiple of finetune.micro_batch x finetune.nproc = 4: "
        "set finetune.global_batch=4"
    )
    helped = _ssd(["--help", "ssd=tiny"])
    assert helped.returncode == 0 and "sample.heal_newline = True" in helped.stdout
    assert "problems.source = 'jsonl'" in helped.stdout  # the preset's values, not the schema defaults


# ---- sampling and filtering -------------------------------------------------------------------------------
def test_normalized_ignores_comments_spacing_and_docstrings():
    from ultrascale.ssd.sample import normalized

    p = {"prompt": 'def add(a, b):\n    """Sum."""\n', "entry_point": "add"}
    a = normalized(p, "    return a + b\n")
    assert a == normalized(p, "    # add them\n    return a+b  # done\n")
    assert a != normalized(p, "    return b + a\n")


def test_heal_and_unheal_the_prompt_boundary():
    from ultrascale.eval.humaneval import heal, unheal

    prompt = 'def f():\n    """Doc."""\n'
    healed, k = heal(prompt)
    assert healed + "\n" == prompt and k == 1
    generated = (
        "\n    return 1\n"  # after the healed prompt the model writes the newline itself (merged with the indent)
    )
    assert healed + generated == prompt + unheal(generated, k)
    assert unheal("", k) == ""  # stopped at once (a new top-level statement): still an empty body


@needs_sandbox
def test_select_keeps_passing_dedupes_caps_and_marks_provided():
    from ultrascale.eval.problems import load_jsonl
    from ultrascale.ssd.sample import kept_records, select

    add, is_even = load_jsonl(PROBLEMS, Counter())[:2]
    completions = [
        ["    return a + b\n", "    # same program\n    return a+b\n", "    return a - b\n", "    return b + a\n"],
        ["    return n % 2 == 0\n"],
    ]
    cfg = ssd_cfg("sample.max_kept_per_problem=1").sample
    rows, stats = select([add, is_even], completions, cfg)
    reasons = [(r["task_id"], r["source"], r["reason"]) for r in rows]
    assert reasons == [
        ("planted/add", "model", "kept"),
        ("planted/add", "model", "duplicate"),
        ("planted/add", "model", "failed"),
        ("planted/add", "model", "cap"),
        ("planted/add", "provided", "duplicate"),  # the provided solution is the same program as sample 0
        ("planted/is_even", "model", "kept"),
        ("planted/is_even", "provided", "failed"),  # the planted wrong solution is rejected by the tests
    ]
    assert rows[2]["error"].startswith("AssertionError")
    assert stats["kept"] == 2 and stats["model_kept"] == 2 and stats["provided_passed"] == 1
    kept = kept_records([add, is_even], rows)
    assert [k["completion"] for k in kept] == ["    return a + b\n", "    return n % 2 == 0\n"]
    assert kept[0]["prompt"] == add["prompt"]


def test_the_papers_filter_drops_only_empty_and_stub_responses_and_executes_nothing(monkeypatch):
    """method=ssd: no sandbox (a call would fail the test), a wrong sample is kept, empty and single-line stubs are
    dropped and counted, a real one-line body is kept, a truncated and an unparsable sample are counted and kept."""
    import ultrascale.ssd.sample as sample
    from ultrascale.eval.problems import load_jsonl

    def no_sandbox(*a, **k):
        raise AssertionError("method=ssd executed a sample")

    monkeypatch.setattr(sample, "verdicts", no_sandbox)
    add, is_even = load_jsonl(PROBLEMS, Counter())[:2]
    c = lambda text, finish="stop": {"text": text, "finish": finish, "tokens": 5}  # noqa: E731
    completions = [
        [c("    return a - b\n"), c("\n   \n"), c("    pass\n"), c("    # todo\n    ...\n"), c("    return a + b")],
        [c("    if n:\n        return (n %\n", "length"), c("    raise NotImplementedError\n")],
    ]
    rows, stats = sample.select_raw([add, is_even], completions)
    assert [r["reason"] for r in rows] == ["kept", "empty", "stub", "stub", "kept", "kept", "stub"]
    assert rows[0]["kept"] and "return a - b" in rows[0]["completion"]  # wrong (a - b), kept: no correctness filter
    assert stats == {**stats, "sampled": 7, "kept": 3, "dropped_empty": 1, "dropped_stub": 3, "truncated": 1,
                     "no_code": 1, "executed": 0}  # fmt: skip
    assert rows[5].get("no_code") and rows[5]["finish"] == "length"
    kept = sample.kept_records([add, is_even], rows)
    assert [k["completion"] for k in kept] == [
        "    return a - b\n",
        "    return a + b",
        "    if n:\n        return (n %\n",
    ]


def test_ssd_is_the_default_method_and_warns_at_the_zero_signal_setting():
    from ultrascale.ssd.config import Method, zero_signal

    cfg = ssd_cfg()
    assert cfg.method == Method.ssd and cfg.sample.n == 1
    assert (cfg.sample.temperature, cfg.sample.top_k, cfg.sample.top_p) == (1.6, 20, 0.8)  # the paper's Table 3
    assert not zero_signal(cfg.sample)
    assert zero_signal(ssd_cfg("sample.temperature=1.0", "sample.top_k=0", "sample.top_p=1.0").sample)
    assert not zero_signal(ssd_cfg("sample.temperature=1.0", "sample.top_k=0", "sample.top_p=0.95").sample)
    with pytest.raises(ConfigError, match="method"):
        ssd_cfg("method=rejection")


# ---- the finetuning set -----------------------------------------------------------------------------------
def test_sft_sample_masks_the_prompt_and_appends_eos(tokenizer_dir):
    from transformers import AutoTokenizer

    from ultrascale.ssd.sft import encode, eos_id

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    eos = eos_id(tok)
    prompt, completion = 'def add(a, b):\n    """Sum."""\n', "    return a + b\n"
    ids, mask = encode(tok, prompt, completion, eos)
    n_prompt = len(tok(prompt.rstrip("\n"), add_special_tokens=False)["input_ids"])
    assert not mask[:n_prompt].any() and mask[n_prompt:].all()
    assert ids[-1] == eos and mask[-1]  # the model learns to stop
    assert tok.decode(ids[:-1]) == prompt + completion
    assert tok.decode(ids[n_prompt:-1]) == "\n" + completion  # the healed newline is the body's first target
    # the sample is the text tokenized as one document: newline + indent is one token here, as in generation,
    # not the prompt's bare newline token followed by an indent token
    assert ids[:-1].tolist() == tok(prompt + completion, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids[n_prompt : n_prompt + 1]) == "\n   "
    raw, raw_mask = encode(tok, prompt, completion, eos, heal_newline=False)  # sampled without healing: as is
    assert tok.decode(raw[~raw_mask]) == prompt and tok.decode(raw[raw_mask][:-1]) == completion
    with pytest.raises(DataError, match=r"sft\.eos_token"):
        eos_id(tok, "<no such token>")


def test_the_finetuning_prompt_is_what_the_sampler_prefills(tiny_start_model):
    """Train and eval split a sample at the same token: the prompt ids of a finetuning sample are the ids the
    sampler feeds the model (recorded from the model's own forward). Before, SFT encoded the prompt with its
    bare trailing newline token, which generation (healed) never conditions on."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ultrascale.eval.humaneval import generate
    from ultrascale.ssd.sft import encode, eos_id

    model = AutoModelForCausalLM.from_pretrained(str(tiny_start_model), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(tiny_start_model))
    prompt = 'def add(a, b):\n    """Return the sum of a and b."""\n'
    fed: list[list[int]] = []
    hook = model.model.register_forward_pre_hook(lambda m, a, kw: fed.append(kw["input_ids"][0].tolist()),
                                                 with_kwargs=True)  # fmt: skip
    try:
        [[completion]] = generate(model, tok, [prompt], max_new_tokens=6, stops=())
    finally:
        hook.remove()
    ids, mask = encode(tok, prompt, completion, eos_id(tok))
    assert fed and ids[~mask].tolist() == fed[0]  # the prefill: the sample's prompt, token for token
    assert tok.decode(ids[:-1]) == prompt + completion  # and the text is the program that was sampled


def test_sft_build_packs_masked_rows_the_loader_turns_into_labels(tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    from ultrascale.data.loader import IGNORE, make_batch
    from ultrascale.data.shards import load_manifest, open_split
    from ultrascale.ssd.sft import build

    prompts = {f"t{i}": f'def f{i}(x):\n    """Return x plus {i}."""\n' for i in range(4)}
    records = [{"task_id": t, "prompt": p, "completion": f"    return x + {t[1:]}\n"} for t, p in prompts.items()]
    records.append({"task_id": "t0", "prompt": prompts["t0"], "completion": "    y = x\n    return y + 0\n"})
    cfg = ssd_cfg("sft.seq_len=64", "sft.validation_fraction=0.25").sft
    stats = build(records, tokenizer_dir, tmp_path / "sft", cfg)
    assert stats["samples"] == 5 and stats["validation_problems"] == 1 and stats["train_problems"] == 3
    manifest = load_manifest(tmp_path / "sft")
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "sft" / manifest["tokenizer"]))
    eos = manifest["eos_token_id"]
    targets = []
    for split in ("train", "validation"):
        reader = open_split(tmp_path / "sft", split)
        assert reader.has_loss_mask
        idx = np.arange(len(reader))
        ids, mask = reader.get(idx), reader.get_loss_mask(idx)
        batch = make_batch(ids, mask, eos, document_masking=True)
        for row, m, labels in zip(ids, mask, batch.labels.numpy()):
            assert ((labels != IGNORE) == m).all()  # every target is a completion or its EOS; prompts are -100
            text = tok.decode(row[m])  # completions (each followed by its EOS), in row order
            targets += [(split, t) for t in text.split(tok.eos_token) if t]
            pad = np.flatnonzero(m)[-1] + 1
            assert (row[pad:] == eos).all() and not m[pad:].any()  # the row's tail is EOS padding, no loss
    train = {t for s, t in targets if s == "train"}
    val = {t for s, t in targets if s == "validation"}
    assert len(targets) == 5 and not train & val
    assert "\n    y = x\n    return y + 0\n" in (train | val)  # the targets start at the healed newline


def test_finetune_steps_and_command_line():
    from ultrascale.ssd.finetune import steps_for, train_overrides

    cfg = ssd_cfg("finetune.epochs=2", "finetune.global_batch=8", "finetune.max_steps=5").finetune
    assert [steps_for(r, cfg) for r in (1, 8, 12, 100)] == [1, 2, 3, 5]
    args = train_overrides(cfg, Path("/m"), Path("/d"), Path("/r"), 3, 128)
    assert "~model" in args and "model.pretrained_path=/m" in args and "data.prepare_if_missing=false" in args
    # the paper's optimizer: AdamW (0.9, 0.95), weight decay 0.1, cosine to lr x 0.2 (5e-6 -> 1e-6)
    assert {"optim.betas=[0.9,0.95]", "optim.weight_decay=0.1", "optim.sched.min_lr_ratio=0.2"} <= set(args)
    assert args[-2:] == ["launcher=torchrun", "launcher.nproc_per_node=2"]


def test_a_finetune_stopped_by_a_signal_is_not_done(tmp_path):
    """train.py exits 0 after a Ctrl-C or a STOP file with its checkpoint saved: the stage must not count as done
    (it would export step 3 of 4 as the round's model); it is one error line naming the checkpoint and the fix."""
    from ultrascale.ssd.finetune import FinetuneFailed, require_finished

    run = tmp_path / "train_run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_00000003")
    (run / "STOPPED").write_text("{}")
    with pytest.raises(FinetuneFailed, match=r"ended before step 4 \(stopped by a signal or a STOP file\); newest "
                       r"checkpoint step_00000003 .* run the same command again to resume it"):  # fmt: skip
        require_finished(run, 4)
    (run / "checkpoints" / "latest").write_text("step_00000004")
    require_finished(run, 4)


def test_a_rerun_stage_removes_the_later_stages_built_on_it(tmp_path):
    from ultrascale.ssd.rounds import OUTPUTS, STAGES, Round, SSDRun

    rnd = Round(SSDRun(ssd_cfg(f"output_dir={tmp_path}")), 0, tmp_path / "model_in")
    for stage in STAGES:
        rnd.manifest["stages"][stage] = {"done": True}
        for o in OUTPUTS[stage]:
            if "." in o:
                rnd.path(o).write_text("x")
            else:
                (rnd.path(o) / "x").mkdir(parents=True)
    rnd.invalidate_after("sft_data")
    assert list(rnd.manifest["stages"]) == ["problems", "sample", "sft_data"]
    assert rnd.path("kept.jsonl").exists() and rnd.path("sft_data").exists()
    assert not rnd.path("train_run").exists() and not rnd.path("model").exists() and not rnd.path("eval.json").exists()
    assert json.loads(rnd.manifest_path.read_text())["stages"].keys() == {"problems", "sample", "sft_data"}


# ---- one whole round on 2 ranks ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_start_model(tokenizer_dir, tmp_path_factory) -> Path:
    """conf/model/tiny (random init, vocab 4096) saved as an HF directory with the BPE tokenizer beside it."""
    from ultrascale.model.build import build_model

    out = tmp_path_factory.mktemp("ssd_start") / "model"
    build_model(compose([], "train").model, seed=0).save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


def _ssd(args: list[str], extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return run_py(["-m", "ultrascale.ssd", *args], env=extra_env, timeout=600)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.dist
@needs_sandbox
def test_tiny_round_end_to_end_then_resume(tiny_start_model, tmp_path):
    from ultrascale.data.shards import open_split
    from ultrascale.ssd.rounds import STAGES

    out = tmp_path / "ssd"
    args = ["ssd=tiny", "method=rft", f"start_model={tiny_start_model}", f"problems.jsonl={PROBLEMS}",
            f"output_dir={out}"]  # fmt: skip
    proc = _ssd(args)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rnd = out / "round_00"

    samples = _rows(rnd / "samples.jsonl")
    model_rows = [r for r in samples if r["source"] == "model"]
    assert len(model_rows) == 4 * 2  # n=2 completions for each of the 4 problems, every one executed
    for r in samples:  # every candidate really ran in the sandbox; a failure carries the interpreter's last words
        assert r["status"] in ("passed", "failed", "timeout") and r["passed"] == (r["status"] == "passed"), r
        if not r["passed"]:
            assert r["reason"] == r["status"] and (r["error"] == "timeout" or PY_ERROR.match(r["error"])), r
    planted = {(r["task_id"], r["source"]): r for r in samples}
    good, bad = planted[("planted/add", "provided")], planted[("planted/is_even", "provided")]
    assert good["passed"] and good["kept"]  # the planted correct solution is kept...
    assert not bad["passed"] and not bad["kept"] and bad["reason"] == "failed"  # ...the planted wrong one is not
    kept = _rows(rnd / "kept.jsonl")
    assert any(k["task_id"] == "planted/add" and k["source"] == "provided" for k in kept)
    assert len(kept) == sum(r["kept"] for r in samples)

    assert open_split(rnd / "sft_data", "train").has_loss_mask
    summary = json.loads((rnd / "train_run" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["replicas_agree"]  # 2 ranks, finetuned from the start model
    run_cfg = OmegaConf.load(rnd / "train_run" / "config.yaml")
    assert run_cfg.model.pretrained_path == str(tiny_start_model) and run_cfg.data.path == str(rnd / "sft_data")
    assert (rnd / "model" / "config.json").exists() and (rnd / "model" / "tokenizer.json").exists()
    for ev in (rnd / "eval.json", out / "baseline" / "eval.json"):
        greedy = json.loads(ev.read_text())["greedy"]
        executed = _rows(ev.parent / "eval" / "greedy" / "humaneval_samples.jsonl")
        assert greedy["problems"] == 2 and [r["task_id"] for r in executed] == ["HumanEval/0", "HumanEval/1"]
        assert greedy["pass@1"] == pytest.approx(sum(r["passed"] for r in executed) / 2)
        for r in executed:
            assert r["passed"] or (r["returncode"] not in (None, 0) and PY_ERROR.match(r["error"])), r
    top = json.loads((out / "ssd_manifest.json").read_text())
    assert top["rounds"]["00"]["done"] == list(STAGES)
    assert top["rounds"]["00"]["sample"]["kept"] == len(kept)

    # A rerun finds every stage done and does nothing: no sampling, no launcher, the same files.
    before = (rnd / "samples.jsonl").stat().st_mtime_ns
    again = _ssd(args)
    assert again.returncode == 0, again.stderr[-2000:]
    log = again.stdout + again.stderr
    assert "baseline eval: done, skipping" in log
    assert all(f"round 0 {s}: done, skipping" in log for s in STAGES)
    assert "launching:" not in log and (rnd / "samples.jsonl").stat().st_mtime_ns == before

    # Killed after the export: the rerun redoes only what was not marked done.
    manifest = json.loads((rnd / "manifest.json").read_text())
    del manifest["stages"]["eval"]
    (rnd / "manifest.json").write_text(json.dumps(manifest))
    third = _ssd(args)
    assert third.returncode == 0, third.stderr[-2000:]
    log = third.stdout + third.stderr
    assert "round 0 export: done, skipping" in log and "round 0 eval: running" in log
    assert json.loads((out / "ssd_manifest.json").read_text())["rounds"]["00"]["done"] == list(STAGES)

    # Changed eval settings redo only the evaluations (nothing depends on them): here sampled pass@k as well.
    passk = _ssd([*args, "eval.passk_samples=2", "eval.passk_k=[1,2]"])
    assert passk.returncode == 0, passk.stderr[-2000:]
    log = passk.stdout + passk.stderr
    assert "round 0 finetune: done, skipping" in log and "baseline eval of" in log and "launching:" not in log
    sampled = json.loads((rnd / "eval.json").read_text())["sampled"]
    assert sampled["n_samples"] == 2 and {"pass@1", "pass@2"} <= sampled.keys()

    # Settings that would mix two configurations in one directory are refused with the key that changed.
    changed = _ssd([*args, "sample.n=3"])
    assert changed.returncode == 2 and "sample.n: 2 -> 3" in changed.stderr


@pytest.mark.dist
def test_a_prompts_only_jsonl_runs_a_round_of_the_papers_method(tiny_start_model, tmp_path):
    """method=ssd (the default) on prompts without tests: sampled, filtered without execution, finetuned on 2
    ranks and exported; the sample stage's manifest carries the paper's counts and no sandbox is needed."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in (
        "def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n",
        "def is_even(n):\n    \"\"\"True if n is even.\"\"\"\n",
        "class Stack:\n    def push(self, item):\n        \"\"\"Put item on top.\"\"\"\n")))  # fmt: skip
    out = tmp_path / "ssd"
    args = ["ssd=tiny", f"start_model={tiny_start_model}", f"problems.jsonl={prompts}", f"output_dir={out}",
            "eval.enabled=false", "sample.max_new_tokens=24", "finetune.checkpoint_interval=1",
            "finetune.keep_checkpoints=2", "finetune.min_steps=3"]  # fmt: skip
    proc = _ssd(args)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rnd = out / "round_00"
    stats = json.loads((rnd / "manifest.json").read_text())["stages"]["sample"]
    assert {"sampled", "kept", "dropped_empty", "dropped_stub", "truncated", "no_code", "executed"} <= stats.keys()
    assert stats["sampled"] == 3 * 2 and stats["executed"] == 0  # ssd=tiny samples n=2 per prompt
    assert stats["kept"] == stats["sampled"] - stats["dropped_empty"] - stats["dropped_stub"]
    samples = _rows(rnd / "samples.jsonl")
    assert all("status" not in r for r in samples)  # nothing ran in a sandbox
    assert (rnd / "model" / "config.json").exists()
    assert "method=ssd" in proc.stdout + proc.stderr
    # two checkpoints kept: the earlier one is exported too, a candidate for the evaluation to choose on dev
    export = json.loads((rnd / "manifest.json").read_text())["stages"]["export"]
    steps = json.loads((rnd / "manifest.json").read_text())["stages"]["finetune"]["steps"]
    assert export["candidates"] == [str(rnd / "model_steps" / f"step_{steps - 1:08d}"), str(rnd / "model")]
    assert (rnd / "model_steps" / f"step_{steps - 1:08d}" / "config.json").exists()

    # Killed in the finetune (rank 0 SIGKILLed after 2 of its 3 steps): one error line; the rerun keeps the samples,
    # resumes train.py from its newest checkpoint and ends with the uninterrupted run's weights.
    killed = tmp_path / "killed"
    kargs = [*args[:3], f"output_dir={killed}", *args[4:]]
    dead = _ssd(kargs, faults.env(kill_at="2"))
    assert dead.returncode != 0 and "finetune (train.py) failed" in dead.stderr, (dead.stdout + dead.stderr)[-3000:]
    krnd = killed / "round_00"
    latest = (krnd / "train_run" / "checkpoints" / "latest").read_text().strip()
    assert latest in ("step_00000001", "step_00000002") and not (krnd / "model").exists()
    sampled_at = (krnd / "samples.jsonl").stat().st_mtime_ns
    resumed = _ssd(kargs)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    log = resumed.stdout + resumed.stderr
    assert "round 0 sample: done, skipping" in log and (krnd / "samples.jsonl").stat().st_mtime_ns == sampled_at
    assert json.loads((krnd / "manifest.json").read_text())["stages"]["finetune"]["resumed_from"] == int(latest[5:])
    from safetensors.torch import load_file

    def weights(model_dir: Path) -> dict:
        return {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(f).items()}

    want, got = weights(rnd / "model"), weights(krnd / "model")
    assert want
    assert want.keys() == got.keys() and all(np.array_equal(want[k].numpy(), got[k].numpy()) for k in want)


@needs_sandbox
def test_the_comparison_runs_on_real_models_and_reports_an_identical_pair_as_no_gain(tiny_start_model, tmp_path):
    """python -m ultrascale.ssd.evaluate end to end: real generation, the sandbox, the split, the grid, the CI. The
    identical pair is a copy at its own path, and a third model has other weights: the score cache is keyed by
    content, so the copy is served the base's scores (the same bytes) and the other model is generated, never
    handed the scores of a model scored before it."""
    from ultrascale.model.build import build_model
    from ultrascale.ssd.compare import model_fingerprint

    copy, other = tmp_path / "copy", tmp_path / "other"
    shutil.copytree(tiny_start_model, copy)
    build_model(compose([], "train").model, seed=1).save_pretrained(other)
    for f in tiny_start_model.iterdir():  # the same tokenizer beside other weights
        if not (other / f.name).exists():
            shutil.copy(f, other / f.name)
    out = tmp_path / "compare.json"
    proc = run_py(["-m", "ultrascale.ssd.evaluate", "--model", f"base={tiny_start_model}", "--model",
                   f"same={copy}", "--model", f"other={other}", "--limit", "6", "--temperatures", "0.8", "--n-dev",
                   "1", "--n-test", "2", "--max-new-tokens", "8", "--out", str(out)], timeout=600)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    r = json.loads(out.read_text())["sets"]["humaneval"]
    assert len(r["split"]["dev"]) == 3 and len(r["split"]["test"]) == 3
    assert set(r["models"]["base"]["dev_grid"]) == {f"{tiny_start_model}|{s}" for s in
                                                    ("greedy", "T=0.8,top_k=0,top_p=1", "T=0.8,top_k=20,top_p=0.8")}  # fmt: skip
    vs = r["models"]["same"]["vs_base"]
    assert vs["diff"] == 0 and vs["verdict"] == "no measurable gain"
    assert "no measurable gain" in proc.stdout
    fp = {m: model_fingerprint(d) for m, d in (("base", tiny_start_model), ("same", copy), ("other", other))}
    assert fp["same"] == fp["base"] != fp["other"]
    keys = [
        json.loads(json.loads(line)["key"]) for line in (tmp_path / "compare.scores.jsonl").read_text().splitlines()
    ]
    assert sorted(k[0] for k in keys) == sorted([fp["base"]] * 4 + [fp["other"]] * 4)  # 3 dev settings + test each
    log = proc.stdout + proc.stderr
    assert f"compare: {copy} greedy n=1: from" in log and f"compare: {other} " not in log  # other: never a hit
