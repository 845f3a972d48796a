"""LoRA (``finetune=lora``) on the real SmolLM2-135M, 2 CPU ranks under ZeRO-2 and ZeRO-3 with full activation
checkpointing, through ``train.py`` as a user runs it.

Each stage: the loss falls; the frozen base comes out bit for bit as it went in (the run's digest of its frozen
parameters at the start and the end, and the start's equals this process's digest of the base model with the
same adapters injected); the checkpoint holds the adapters and their optimizer state, not the base; a run
resumed from its step-3 checkpoint logs the uninterrupted run's losses to 1e-6. The ZeRO-2 run is then exported:
the merged model's logits equal those of ``PeftModel.from_pretrained(base, adapter)`` merged by peft to 1e-5
(and unmerged to 2e-4: fp32 summation order).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import check, launch, losses

pytestmark = pytest.mark.dist

STEPS, RESUME_AT = 6, 3
# The attention's query and value projections (LoRA's original targets), not the recipe's 7 per layer: under ZeRO-3
# each adapter Linear gets its own module hooks, and 210 of them made this the suite's slowest test (164 s).
TARGETS = "finetune.target_modules=[q_proj,v_proj]"


def lora_args(model: Path, data: Path, zero: str) -> list[str]:
    return [
        "recipe=smollm2_135m_lora", f"model.pretrained_path={model}", f"data.path={data}", f"zero={zero}",
        "data.seq_len=64", "data.micro_batch=2", "data.global_batch=4", f"train.steps={STEPS}",
        "train.log_interval=1", f"train.checkpoint_interval={RESUME_AT}", "train.eval_interval=0", "logger=none",
        "train.activation_checkpointing=full", "optim.lr=2e-3", "optim.sched.warmup_steps=1",
        "data.eval_batches=1", TARGETS,
    ]  # fmt: skip


QV_R16 = 30 * 16 * ((576 + 576) + (576 + 192))
"""SmolLM2-135M's LoRA parameters at r=16 on q_proj (576 -> 576) and v_proj (576 -> 192, 3 kv heads) in each of
its 30 layers: 921,600."""


def planned_trainable(model_dir: Path) -> int:
    """The planner's exact count for these adapters (``model/adapters.py``, from a meta-device model)."""
    from ultrascale.config.compose import compose
    from ultrascale.model.adapters import planned_trainable as planned

    cfg = compose(["recipe=smollm2_135m_lora", f"model.pretrained_path={model_dir}", TARGETS])
    return planned(cfg.model, cfg.finetune)


def optimizer_fp32_numel(ckpt: Path) -> int:
    """The elements of the fp32 master copy the optimizer steps, summed over the ranks' ZeRO partitions (less the
    alignment padding ZeRO-2 records): what the optimizer trains, whatever the model says is trainable."""
    total = 0
    for f in sorted(ckpt.glob("*optim_states.pt")):
        sd = torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        groups = sd.get("single_partition_of_fp32_groups", sd.get("fp32_flat_groups"))
        total += sum(t.numel() for t in groups) - sum(sd.get("group_paddings", [0]))
    return total


def base_digest(model_dir: Path) -> str:
    """The frozen parameters' digest of the base model with the recipe's adapters injected, computed here as the
    run computes it (the same names and order)."""
    from transformers import AutoModelForCausalLM

    from ultrascale.config.compose import compose
    from ultrascale.model.adapters import apply_lora
    from ultrascale.train.consistency import param_digest

    cfg = compose(["recipe=smollm2_135m_lora", f"model.pretrained_path={model_dir}", TARGETS])
    model = apply_lora(AutoModelForCausalLM.from_pretrained(str(model_dir)), cfg.finetune, 0)
    return param_digest(model, trainable=False)


class Runs:
    """Uninterrupted LoRA runs, one per ZeRO stage, each trained the first time a test asks for it."""

    def __init__(self, root: Path, model: Path, data: Path):
        self.root, self.model, self.data, self.done = root, model, data, {}

    def __getitem__(self, zero: str) -> Path:
        if zero not in self.done:
            out = self.root / zero
            check(launch([*lora_args(self.model, self.data, zero), f"output_dir={out}"]))
            self.done[zero] = out
        return self.done[zero]


@pytest.fixture(scope="module")
def runs(smollm2_135m, smollm2_data, tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("lora"), smollm2_135m, smollm2_data)


@pytest.mark.parametrize("zero", ["stage2", "stage3"])
def test_lora_trains_only_the_adapters_and_resumes_exactly(runs, zero, smollm2_135m, smollm2_data, tmp_path):
    run = runs[zero]
    ref = losses(run)
    assert sorted(ref) == list(range(1, STEPS + 1))
    first, last = (ref[1] + ref[2]) / 2, (ref[STEPS - 1] + ref[STEPS]) / 2
    assert last < first - 0.05, f"loss did not fall: {ref}"
    s = json.loads((run / "summary.json").read_text())
    assert s["finetune"] == "lora" and s["trainable_params"] == planned_trainable(smollm2_135m) == QV_R16, s
    assert s["frozen_digest_start"] == s["frozen_digest_end"] == base_digest(smollm2_135m), "the base changed"
    # the checkpoint holds the adapters and their optimizer state, not the 0.54 GB base
    ckpt = run / "checkpoints" / f"step_{RESUME_AT:08d}"
    assert sum(p.stat().st_size for p in ckpt.iterdir()) < 0.2 * (smollm2_135m / "model.safetensors").stat().st_size
    meta = json.loads((ckpt / "ultrascale_meta.json").read_text())
    assert meta["finetune"]["method"] == "lora" and meta["finetune"]["r"] == 16
    assert optimizer_fp32_numel(ckpt) == QV_R16, "the optimizer's fp32 partitions hold more than the adapters"

    resumed = tmp_path / "resumed"
    check(launch([*lora_args(smollm2_135m, smollm2_data, zero), f"output_dir={resumed}", f"train.resume={ckpt}"]))
    got = losses(resumed)
    assert sorted(got) == list(range(RESUME_AT + 1, STEPS + 1))
    for step, loss in got.items():  # fp32, same ranks, data and RNG: the uninterrupted curve
        assert loss == pytest.approx(ref[step], rel=1e-6, abs=1e-6), (step, got, ref)


def test_a_resume_with_another_finetune_is_refused_in_one_line(runs, smollm2_135m, smollm2_data, tmp_path):
    ckpt = runs["stage2"] / "checkpoints" / f"step_{RESUME_AT:08d}"
    args = [*lora_args(smollm2_135m, smollm2_data, "stage2"), f"output_dir={tmp_path / 'x'}", f"train.resume={ckpt}"]
    for change, said in (("finetune=none", "finetune=none but checkpoint step_00000003 was trained with "
                                            "finetune=lora: resume with finetune=lora"),
                         ("finetune.r=8", "finetune.r=8 but checkpoint step_00000003 holds adapters with r=16")):  # fmt: skip
        proc = launch([*args, change])
        lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("error:")]
        assert proc.returncode != 0 and len(lines) == 1 and said in lines[0], (lines, proc.stderr[-3000:])


def test_merged_export_equals_the_adapter_model(runs, smollm2_135m, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ultrascale.export import export

    out = tmp_path / "hf"
    stats = export(runs["stage2"], out)
    assert stats["adapter"] == str(out / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    base = AutoModelForCausalLM.from_pretrained(str(smollm2_135m)).eval()
    with torch.no_grad():
        ids = torch.randint(0, 49152, (2, 48), generator=torch.Generator().manual_seed(0))
        base_logits = base(ids).logits
        adapted = PeftModel.from_pretrained(base, str(out / "adapter")).eval()
        unmerged, got = adapted(ids).logits, merged(ids).logits
        want = adapted.merge_and_unload()(ids).logits  # peft's own merge of the adapter it loaded
    assert (unmerged - base_logits).abs().max() > 1e-3, "the adapter did not load (or never trained)"
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # unmerged, W x + s B (A x) sums in another order than (W + s B A) x: fp32 rounding only, far below the
    # adapter's own effect (> 1e-3 above; a wrong alpha/r or a missing module moves logits by whole units)
    torch.testing.assert_close(got, unmerged, rtol=0, atol=2e-4)
