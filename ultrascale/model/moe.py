"""Mixture-of-experts on stock HF MoE models: expert parallelism, the router aux loss, load-balance metrics.

Expert parallelism is DeepSpeed AutoEP (the ``expert_parallel`` JSON section, see levers/deepspeed.py):
inside ``deepspeed.initialize`` it swaps each HF sparse-MoE block for an ``AutoEPMoELayer`` that keeps
num_experts/ep experts per rank and all-to-alls tokens to their experts; it also re-tags the expert
parameters for ZeRO and remaps our torch optimizer onto them (expert gradients are averaged over the
expert-data-parallel group, the rest over all of dp). AutoEP routing is dropless.

"Why is MoE slower than dense?" is mostly load imbalance: the busiest expert sets the pace of the
all-to-all and the expert matmuls. So every step we log, per MoE layer, each expert's share of the
routed tokens, the max/mean load ratio, and the fraction of assignments that a capacity-limited router
(``parallel.moe.capacity_factor``) would drop: the number to watch before turning dropping on.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as tdist

if TYPE_CHECKING:
    from ultrascale.config.parallel import MoEConfig

log = logging.getLogger("ultrascale")

# DeepSpeed 0.19.8 AutoEP presets, named by HF model_type (no qwen2_moe preset exists).
AUTOEP_PRESETS = ("mixtral", "qwen3_moe", "qwen3_5_moe", "deepseek_v2", "deepseek_v3", "minimax_m3")


def num_experts(config) -> int:
    return int(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0)


def is_moe(model) -> bool:
    config = getattr(model, "config", None)
    return config is not None and num_experts(config) > 0


def _sparse_blocks(model) -> list[torch.nn.Module]:
    """The HF sparse-MoE blocks (the modules that own a router and the experts)."""
    return [m for m in model.modules() if type(m).__name__.endswith("SparseMoeBlock")]


def prepare_moe(model, moe: MoEConfig, where: str, leaf_modules: bool) -> str:
    """Turn on HF's router aux loss with our coefficient; with ``leaf_modules`` (ZeRO-3, experts replicated)
    mark the sparse-MoE blocks as ZeRO-3 leaf modules. Returns the banner line.

    ZeRO-3 gathers parameters module by module as forward hooks fire; inside an MoE block only the
    experts that received tokens run, so ranks would wait on different gathers and hang. As a leaf,
    the whole block is gathered at once on every rank.
    """
    coef = float(moe.aux_loss_coef)
    model.config.output_router_logits = True
    model.config.router_aux_loss_coef = coef
    if hasattr(model, "router_aux_loss_coef"):  # HF copies it at __init__
        model.router_aux_loss_coef = coef
    leaf = ""
    if leaf_modules:
        from deepspeed.utils import set_z3_leaf_modules

        classes = sorted({type(b) for b in _sparse_blocks(model)}, key=lambda c: c.__name__)
        if classes:
            set_z3_leaf_modules(model, classes)
            leaf = f", ZeRO-3 leaf modules: {[c.__name__ for c in classes]}"
    k = int(getattr(model.config, "num_experts_per_tok", 0) or moe.top_k)
    return f"{where}, top-{k}, router aux loss x {coef:g}{leaf}"


def gather_non_experts(model) -> int:
    """A model built under ``zero.Init`` for a ZeRO-1/2 run with AutoEP: make every parameter outside the routed
    experts (``<SparseMoeBlock>.experts``) a whole, ordinary parameter again, one tensor at a time, and leave the
    experts partitioned for AutoEP, which gathers them one layer at a time inside ``deepspeed.initialize``
    (``deepspeed.moe.ep_repack``) and keeps this rank's. Tied parameters stay tied. Returns the parameters made
    whole.

    Collective: every rank gathers the same tensors in the same order."""
    import gc

    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    experts = {id(p) for block in _sparse_blocks(model) for p in getattr(block, "experts", block).parameters()}
    whole: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or id(p) in experts or not hasattr(p, "ds_id"):
                continue
            if id(p) not in whole:
                with GatheredParameters([p], modifier_rank=None):
                    whole[id(p)] = torch.nn.Parameter(p.data.detach().clone(), requires_grad=p.requires_grad)
            module._parameters[name] = whole[id(p)]
    gc.collect()  # ZeRO parameters hold reference cycles (DeepSpeed's own engine collects them the same way)
    return len(whole)


def deferred_optimizer(optimizer: torch.optim.Optimizer):
    """(factory, param groups) so DeepSpeed builds our optimizer *after* AutoEP swapped the expert params.

    ZeRO needs the expert parameters in their own ``moe`` param groups (they are reduced over the
    expert-data-parallel group, not all of dp), and those parameters only exist once AutoEP has replaced
    the HF blocks inside ``deepspeed.initialize``. DeepSpeed calls a callable optimizer with the remapped
    groups at that point; we split them and rebuild the same optimizer class with the same settings.
    """
    import inspect

    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    groups = [dict(g) for g in optimizer.param_groups]  # each group carries its own lr/betas/decay
    klass = type(optimizer)
    accepted = set(inspect.signature(klass.__init__).parameters)
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}  # torch adds internal keys

    def factory(params):
        return klass(split_params_into_different_moe_groups_for_optimizer(list(params)), **defaults)

    return factory, groups


def local_experts(module: torch.nn.Module) -> dict[str, list[int]]:
    """{AutoEP layer name: global expert ids held by this rank} (empty without expert parallelism)."""
    out = {}
    for name, m in module.named_modules():
        if type(m).__name__ == "AutoEPMoELayer":
            n = int(m.num_local_experts)
            out[name] = list(range(int(m.ep_rank) * n, (int(m.ep_rank) + 1) * n))
    return out


def shard_report(module: torch.nn.Module, group=None) -> dict:
    """Collective: per rank, the experts it holds and digests of its expert and non-expert parameters.

    Under expert parallelism the non-expert digests must agree across ranks (they are data parallel)
    while each rank holds a disjoint 1/ep of the experts: the end-of-run invariant the tests check.
    """
    import hashlib

    from deepspeed.moe.utils import is_moe_param

    digests = {"expert": hashlib.sha1(), "shared": hashlib.sha1()}
    for name, p in module.named_parameters():
        h = digests["expert" if is_moe_param(p) else "shared"]
        h.update(name.encode())
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    mine = {
        "experts": local_experts(module),
        "expert_digest": digests["expert"].hexdigest()[:16],
        "nonexpert_digest": digests["shared"].hexdigest()[:16],
    }
    ranks = [mine]
    if tdist.is_initialized() and tdist.get_world_size(group) > 1:
        ranks = [None] * tdist.get_world_size(group)
        tdist.all_gather_object(ranks, mine, group=group)
    return {
        "moe_local_experts": [r["experts"] for r in ranks],
        "moe_expert_digests": [r["expert_digest"] for r in ranks],
        "moe_nonexpert_digests": [r["nonexpert_digest"] for r in ranks],
        "moe_nonexpert_agree": all(r["nonexpert_digest"] == ranks[0]["nonexpert_digest"] for r in ranks),
    }


class MoEStats:
    """Accumulates routing statistics over the micro-batches since the last logged row; ``flush`` (for a logged row)
    reduces them over ranks."""

    def __init__(self, model, moe: MoEConfig):
        config = model.config
        self.num_experts = num_experts(config)
        self.top_k = int(getattr(config, "num_experts_per_tok", 0) or moe.top_k)
        self.coef = float(moe.aux_loss_coef)
        self.capacity_factor = float(moe.capacity_factor)
        self._reset()

    def _reset(self) -> None:
        self.counts: torch.Tensor | None = None  # [layers, experts] routed assignments
        self.over = torch.zeros(1, dtype=torch.float64)  # assignments over capacity
        self.aux = torch.zeros(1, dtype=torch.float64)
        self.n = 0

    def observe(self, out, record: bool = True) -> torch.Tensor:
        """Record one forward's routing; return the LM loss (HF's loss minus the weighted aux loss)."""
        aux = getattr(out, "aux_loss", None)
        lm = out.loss - self.coef * aux if aux is not None else out.loss
        logits = getattr(out, "router_logits", None)
        if not record or not logits:
            return lm
        with torch.no_grad():
            per_layer = []
            for layer_logits in logits:
                idx = layer_logits.detach().topk(self.top_k, dim=-1).indices.reshape(-1)
                per_layer.append(torch.bincount(idx, minlength=self.num_experts).double())
            counts = torch.stack(per_layer)
            tokens = logits[0].shape[0]
            capacity = math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)
            # accumulated where the router ran: no host sync per micro-batch, no CPU tensor beside a CUDA one
            self.over = self.over.to(counts.device) + (counts - capacity).clamp(min=0).sum()
            self.counts = counts if self.counts is None else self.counts + counts
            if aux is not None:
                self.aux = self.aux.to(counts.device) + aux.detach().double()
            self.n += 1
        return lm

    def flush(self) -> dict[str, float]:
        """Per-layer expert shares, max/mean load and over-capacity fraction, summed over all ranks."""
        if self.counts is None:
            return {}
        from ultrascale.runtime.device import coll_tensor

        # on the backend's device: NCCL reduces CUDA tensors only (the counts already are on a GPU run)
        counts, over, aux, n = (coll_tensor(t, torch.float64) for t in (self.counts, self.over, self.aux, [self.n]))
        if tdist.is_initialized() and tdist.get_world_size() > 1:
            for t in (counts, over, aux, n):
                tdist.all_reduce(t)
        self._reset()
        out: dict[str, float] = {"moe/aux_loss": float(aux / n), "moe/aux_loss_coef": self.coef}
        total = counts.sum(dim=1, keepdim=True).clamp(min=1)
        share = counts / total
        imbalance = counts.max(dim=1).values / (total.squeeze(1) / self.num_experts)
        for layer in range(counts.shape[0]):
            out[f"moe/L{layer}/max_load"] = float(imbalance[layer])
            for e in range(self.num_experts):
                out[f"moe/L{layer}/e{e}"] = float(share[layer, e])
        out["moe/max_load"] = float(imbalance.mean())
        out["moe/over_capacity_frac"] = float(over / counts.sum())
        out["moe/dropped_frac"] = 0.0  # AutoEP and HF routing are dropless: nothing is actually dropped
        return out
