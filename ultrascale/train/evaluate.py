"""Evaluation during training: held-out loss over the first ``data.eval_batches`` micro-batches per data-parallel
rank of the validation split (the same samples each time; the row says how many and which share of the split),
and greedy HumanEval and FIM on rank 0. The evaluator decides when it is due, so the training loop stays a loop."""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from ultrascale.data.loader import eval_batches
from ultrascale.jsonio import write_jsonl
from ultrascale.runtime import dist
from ultrascale.runtime.device import coll_tensor
from ultrascale.train.preflight import humaneval_tokenizer


def eager(compiled: bool):
    """Evaluation and generation run eagerly: their shapes differ from training's and would recompile."""
    return torch.compiler.set_stance("force_eager") if compiled else contextlib.nullcontext()


def eval_tokenizer(train: Any, data_path: Path) -> Any:
    """The tokenizer for in-training HumanEval and FIM on rank 0 (None elsewhere or when off). Collective."""
    n = train.eval_humaneval or train.eval_fim
    if not n:
        return None
    tokenizer, error = None, None
    if dist.is_rank0():
        from transformers import AutoTokenizer

        from ultrascale.errors import UltrascaleError

        try:  # the sandbox was checked before the run started; the data may have been prepared since
            tokenizer = AutoTokenizer.from_pretrained(str(humaneval_tokenizer(data_path, n)))
        except UltrascaleError as e:
            error = e
    error = dist.broadcast_object(error)
    if error is not None:
        raise error
    return tokenizer


def eval_masking(data: Any, training: bool) -> bool:
    """Document masking of the held-out loss: ``data.eval_document_masking`` when set (one protocol for the arms
    of an ablation), else as training."""
    fixed = getattr(data, "eval_document_masking", None)  # a run's config.yaml from before the key has none
    return training if fixed is None else bool(fixed)


class Evaluator:
    """Held-out loss (token-weighted, all-reduced) every ``interval`` steps and at the last one, plus
    HumanEval pass@1 on the first ``humaneval`` problems when a tokenizer is given (rank 0 generates)."""

    def __init__(self, trainer: Any, interval: int, humaneval: int, tokenizer: Any, out: Path):
        self.t, self.interval, self.humaneval, self.tokenizer, self.out = (
            trainer,
            int(interval),
            humaneval,
            tokenizer,
            out,
        )
        self._fim_spans = None  # the held-out spans, cut once (rank 0)

    def due(self, step: int, last_step: int) -> bool:
        return step == last_step or bool(self.interval and step % self.interval == 0)

    @torch.no_grad()
    def run(self, step: int, final: bool = False) -> dict:
        """The held-out loss on ``data.eval_batches`` (and, after the last step with ``data.final_eval_batches``
        set, again on that many: ``eval_loss_final``), then HumanEval and FIM where they are on."""
        t, t0 = self.t, time.perf_counter()
        data, splits = t.cfg.data, t.val_splits
        loss, totals, rows = self._held_out(int(data.eval_batches))
        # The same first data.eval_batches x micro_batch x dp samples of the validation split every time: say how
        # much of it that is (all of it only when the split is that small, or data.eval_batches=0).
        size = sum(len(v) for v in splits.values())
        samples = size if not data.eval_batches else rows * t.topo.dp
        result = {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0)), "eval_samples": samples,
                  "eval_coverage": samples / max(size, 1)}  # fmt: skip
        if len(splits) > 1:  # a mixture: each source's held-out loss (token-weighted over the same samples)
            for name, (lsum, n) in zip(splits, totals.tolist()):
                src_loss = lsum / n if n else float("nan")
                result[f"eval/{name}/loss"] = src_loss
                result[f"eval/{name}/perplexity"] = math.exp(min(src_loss, 50.0))
        final_batches = getattr(data, "final_eval_batches", None)
        if final and final_batches is not None:
            result["eval_loss_final"], _, rows = self._held_out(int(final_batches))
            result["eval_samples_final"] = size if not final_batches else rows * t.topo.dp
        if self.humaneval:
            result.update(self._humaneval(step))
        if t.cfg.train.eval_fim:
            result.update(self._fim(step))
        t.breakdown.reset_engine_timers()
        result["eval_s"] = time.perf_counter() - t0
        return result

    def _held_out(self, batches: int) -> tuple[float, torch.Tensor, int]:
        """(token-weighted loss over every source, per-source [loss sum, targets], this rank's rows) on the first
        ``batches`` micro-batches per rank of each validation split (0: all of it), all-reduced. Collective."""
        t = self.t
        data, splits = t.cfg.data, t.val_splits
        totals = torch.zeros(len(splits), 2, dtype=torch.float64)  # per source: sum of per-token losses, targets
        masking, rows = eval_masking(data, t.decisions.document_masking.on), 0
        t.engine.eval()
        with eager(t.decisions.compile.on):
            for i, split in enumerate(splits.values()):
                for b in eval_batches(split, data.micro_batch, batches, t.dp_rank, t.topo.dp, t.eos, masking):
                    rows += b.input_ids.shape[0]
                    if t.decisions.pipeline:
                        loss = t.engine.eval_batch(iter([t.pipe_inputs(b)]), num_micro_batches=1)
                    else:
                        loss = t.loss(b.flattened() if t.decisions.flat_batches else b, train=False)[1]
                    if b.num_targets:  # a whole-split eval's filler micro-batch has none (its loss is 0/0)
                        totals[i] += torch.tensor([float(loss) * b.num_targets, b.num_targets], dtype=torch.float64)
        t.engine.train()
        if tdist.is_initialized() and tdist.get_world_size() > 1:
            on_comm = coll_tensor(totals)  # NCCL reduces CUDA tensors only
            tdist.all_reduce(on_comm)
            totals = on_comm.cpu()
        total = totals.sum(0)
        return (float(total[0] / total[1]) if total[1] else float("nan")), totals, rows

    def _humaneval(self, step: int) -> dict:
        """Greedy pass@1 generated on rank 0 (the others wait); every completion and how it ended in the
        sandbox goes to ``humaneval/step_XXXXXXXX.jsonl``: what the model wrote is worth more than the number."""

        def run(model) -> tuple[Any, list]:
            from ultrascale.eval.humaneval import evaluate

            res = evaluate(model, self.tokenizer, limit=self.humaneval,
                           max_new_tokens=self.t.cfg.train.eval_humaneval_max_new_tokens)  # fmt: skip
            return res["pass@1"], res["samples"]

        return {"humaneval_pass@1": self._generate_on_rank0("humaneval", step, run),
                "humaneval_problems": self.humaneval}  # fmt: skip

    def _fim(self, step: int) -> dict:
        """FIM exact match and edit similarity (PSM, greedy) on ``train.eval_fim`` held-out files, generated on rank 0
        (the others wait); the same spans every time, every completion in ``fim/step_XXXXXXXX.jsonl``."""

        def run(model) -> tuple[Any, list]:
            from ultrascale.data.sources import primary_path
            from ultrascale.eval import fim

            train = self.t.cfg.train
            if self._fim_spans is None:
                docs = fim.held_out_documents(str(primary_path(self.t.cfg.data)), train.eval_fim_input)
                self._fim_spans = fim.spans(docs, fim.KINDS, train.eval_fim, seed=0)
            res = fim.evaluate(model, self.tokenizer, self._fim_spans, modes=("psm",), max_new_tokens=48)
            scores = {"fim_exact_match": res["all/psm/exact_match"],
                      "fim_edit_similarity": res["all/psm/edit_similarity"],
                      "fim_middle_loss": res["all/psm/middle_loss"]}  # fmt: skip
            return scores, res["samples"]

        scores = self._generate_on_rank0("fim", step, run)
        return {**(scores or {}), "fim_files": self.t.cfg.train.eval_fim}

    def _generate_on_rank0(self, name: str, step: int, run) -> Any:
        """``run(model) -> (result, samples)`` on rank 0 (the one holding the tokenizer) with the KV cache on and
        eagerly; the samples go to ``<name>/step_XXXXXXXX.jsonl``; the model is put back to training; every rank
        gets the result (None where there is no tokenizer). Collective."""
        result = None
        if self.tokenizer is not None:
            from ultrascale.train.checkpoint import tag_for

            model = self.t.engine.module
            use_cache, model.config.use_cache = model.config.use_cache, True  # generation wants its KV cache
            try:
                with eager(self.t.decisions.compile.on):
                    result, samples = run(model)
                path = self.out / name / f"{tag_for(step)}.jsonl"
                path.parent.mkdir(exist_ok=True)
                write_jsonl(path, samples)
            finally:
                model.config.use_cache = use_cache
                model.train()
        return dist.broadcast_object(result)
