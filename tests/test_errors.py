"""Bad inputs end in one clear ``error:`` line naming the key or file and the fix: no traceback soup."""

from __future__ import annotations

import json
import shutil

from tests.conftest import FAST, check, launch


def _one_clean_error(proc, *needles: str) -> str:
    assert proc.returncode == 2, f"exit code {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    assert "Traceback" not in proc.stderr + proc.stdout
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    for n in needles:
        assert n in errors[0], errors[0]
    return errors[0]


def test_misspelt_override():
    _one_clean_error(launch(["optim.lrr=1e-3"], nproc=0), "optim.lrr", "spelling")


def test_global_batch_not_divisible():
    _one_clean_error(
        launch(["data.global_batch=10", "dry_run=true"], nproc=0),
        "data.global_batch=10",
        "use data.global_batch=",
    )


def test_missing_data_path(tmp_path):
    _one_clean_error(
        launch(
            [
                *FAST,
                f"data.path={tmp_path / 'nowhere'}",
                "data.prepare_if_missing=false",
                f"output_dir={tmp_path / 'run'}",
            ],
            nproc=0,
        ),
        "nowhere",
        "python -m data_prep",
    )


def test_corrupt_shard(tiny_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    shard = data / json.loads((data / "manifest.json").read_text())["splits"]["train"]["shards"][0]["path"]
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x5A
    shard.write_bytes(bytes(raw))
    _one_clean_error(
        launch([*FAST, f"data.path={data}", f"output_dir={tmp_path / 'run'}"], nproc=0),
        "shard_00000.npy is corrupt",
    )


def test_truncated_checkpoint(tiny_data, tmp_path):
    out = tmp_path / "run"
    args = [*FAST, f"data.path={tiny_data}", f"output_dir={out}"]
    check(launch([*args, "train.steps=2"], nproc=0))
    tag = out / "checkpoints" / "step_00000002"
    victim = next(p for p in sorted(tag.iterdir()) if p.name.endswith("optim_states.pt"))
    victim.write_bytes(victim.read_bytes()[:100])
    line = _one_clean_error(launch([*args, "train.steps=4"], nproc=0), "truncated", victim.name)
    assert "delete" in line


def test_help_lists_groups_keys_and_their_docs():
    proc = check(launch(["recipe=cpu_smoke", "--help"], nproc=0))
    for text in ("stage3_offload", "recipe ", "dry_run = False", "train.steps = 60", "zero.overlap_comm = True",
                 "Overlap gradient reduction with backward compute"):  # fmt: skip
        assert text in proc.stdout, text


def test_tokenizer_larger_than_model_vocab(tiny_data, tmp_path):
    _one_clean_error(
        launch(
            [*FAST, f"data.path={tiny_data}", "model.config.vocab_size=200", f"output_dir={tmp_path / 'run'}"], nproc=0
        ),
        "tokenized with 257 tokens",
        "model.config.vocab_size=200",
    )
