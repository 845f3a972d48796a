"""Every cross-group rule, in one place, checked before any model or engine is built.

Each rule raises :class:`ConfigError` with the key, the value and the fix, e.g.
``parallel.pp=2 needs zero.stage<=1 (got 3): use zero=stage1``. The planner reuses this module to
discard invalid layouts, so a layout it proposes is one ``train.py`` accepts.
"""

from __future__ import annotations

import inspect
from functools import cache
from typing import TYPE_CHECKING, Any

from ultrascale.config.topology import Topology
from ultrascale.errors import ConfigError
from ultrascale.levers.decide import Decisions, decide
from ultrascale.runtime.gpu import GpuInfo

if TYPE_CHECKING:
    from ultrascale.config.data import DataConfig
    from ultrascale.config.root import RootConfig
    from ultrascale.config.train import TrainConfig


@cache
def hf_config_keys(model_type: str) -> frozenset[str]:
    """Keys an HF config class understands: its __init__ arguments plus its default attributes."""
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.for_model(model_type, bos_token_id=None, eos_token_id=None)  # defaults may be out of vocab
    except ValueError:
        raise ConfigError(
            f"model.type={model_type!r} is not a transformers model type: use e.g. llama, qwen2, starcoder2, mixtral"
        ) from None
    keys = set(cfg.to_dict())
    for klass in type(cfg).__mro__:
        if "__init__" in vars(klass):
            keys |= set(inspect.signature(klass.__init__).parameters) - {"self", "kwargs"}
    keys |= set(getattr(type(cfg), "attribute_map", {}))
    if "rope_parameters" in keys:  # transformers 5 folds these legacy kwargs into rope_parameters
        keys |= {"rope_theta", "rope_scaling"}
    return frozenset(keys)


def _train_tools(t: TrainConfig) -> None:
    """The profiler window: a window that starts after the run ends would silently do nothing."""
    if t.profile_steps and t.profile_start >= t.steps:
        raise ConfigError(
            f"train.profile_start={t.profile_start} is not before train.steps={t.steps}: nothing would be profiled; "
            f"use train.profile_start={max(0, min(5, t.steps - 1))}"
        )


def model_dims(hf: Any) -> dict[str, int]:
    """Head count, kv heads, MLP width, layers, experts and context of an HF config (for divisibility rules)."""
    heads = getattr(hf, "num_attention_heads", 1)
    return {
        "heads": heads,
        "kv_heads": getattr(hf, "num_key_value_heads", None) or heads,
        "intermediate": getattr(hf, "intermediate_size", 0) or getattr(hf, "moe_intermediate_size", 0) or 0,
        "layers": getattr(hf, "num_hidden_layers", 1),
        "experts": getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", None) or 0,
        "max_pos": getattr(hf, "max_position_embeddings", 0) or 0,
    }


PARTITION_METHODS = ("parameters", "uniform")


def _parallel_combinations(cfg: RootConfig, topo: Topology, dims: dict[str, int]) -> None:
    """Pairs of levers DeepSpeed 0.19.8 cannot compose, and per-lever settings, each with its fix."""
    p = cfg.parallel
    moe = dims["experts"] > 0
    if p.pp > 1:
        if p.tp > 1:
            raise ConfigError(
                f"parallel.pp={p.pp} with parallel.tp={p.tp} is not supported: DeepSpeed AutoTP replaces the "
                "pipeline engine's process grid; use parallel.tp (inside a node) with ZeRO data parallel, or parallel.pp"
            )
        if moe:
            raise ConfigError(
                f"parallel.pp={p.pp} with a MoE model ({cfg.model.type}) is not supported: the router aux loss "
                "cannot cross pipeline stages; use parallel.ep with parallel.pp=1"
            )
        pc = p.pipeline
        method = str(pc.partition_method)
        if method not in PARTITION_METHODS and not method.startswith("type:"):
            raise ConfigError(
                f"parallel.pipeline.partition_method={method!r} is not one of {list(PARTITION_METHODS)} or "
                "'type:<regex>': use parameters"
            )
        gas = topo.grad_accum(cfg.data.micro_batch, cfg.data.global_batch)
        if pc.micro_batches is not None and pc.micro_batches != gas:
            want = pc.micro_batches * cfg.data.micro_batch * topo.dp
            raise ConfigError(
                f"parallel.pipeline.micro_batches={pc.micro_batches} but data.global_batch/(micro_batch*dp) gives "
                f"{gas}: set data.global_batch={want} (the pipeline runs one micro-batch per accumulation step)"
            )
    if p.sp > 1:
        if str(cfg.model.attn_implementation) == "eager":
            raise ConfigError(
                f"parallel.sp={p.sp} needs model.attn_implementation=sdpa (or flash_attention_2), not eager: "
                "Ulysses drops the 4-D mask and relies on is_causal"
            )
        if p.tp > 1:
            raise ConfigError(f"parallel.sp={p.sp} with parallel.tp={p.tp} is not supported: use one of them")
        if moe:
            raise ConfigError(
                f"parallel.sp={p.sp} with a MoE model ({cfg.model.type}) is not supported: use parallel.ep instead"
            )
    if moe and p.tp > 1:
        raise ConfigError(
            f"parallel.tp={p.tp} on a MoE model ({cfg.model.type}) is not supported (AutoEP refuses AutoTP "
            "groups): shard the experts with parallel.ep instead"
        )
    if p.ep > 1:
        from ultrascale.model.moe import AUTOEP_PRESETS

        if moe and cfg.model.type not in AUTOEP_PRESETS:
            raise ConfigError(
                f"parallel.ep={p.ep} needs a DeepSpeed AutoEP preset, but model.type={cfg.model.type} has none "
                f"(presets: {list(AUTOEP_PRESETS)}): use a mixtral/qwen3_moe-type model or parallel.ep=1"
            )


def validate(cfg: RootConfig, world_size: int, backend: str | None = None, gpu: GpuInfo | None = None) -> Decisions:
    """Check the composed config against itself and the world size; return what the run does.

    Single keys (types, ranges, unknown keys) were checked when the config was composed
    (:mod:`ultrascale.config.fields`); these are the rules between keys, read against the run's
    :class:`Decisions` (built here, once). ``backend`` (``gloo``/``nccl``) defaults to this machine's, and then
    ``gpu`` to this machine's GPU (:func:`ultrascale.runtime.gpu.detect`); the planner passes its cluster's backend and,
    where it has one, the cluster's GPU (:meth:`ultrascale.runtime.gpu.GpuInfo.from_cluster`).
    """
    from ultrascale.levers.length import resolve as resolve_length

    resolve_length(cfg)  # train.tokens -> train.steps (and the warmup in tokens) before any rule reads them
    _train_tools(cfg.train)
    _mixture_rules(cfg.data, cfg.train.steps)
    if not str(cfg.train.resume).strip():
        raise ConfigError("train.resume is empty: use auto, never, or a checkpoint path")
    unknown = sorted(set(cfg.model.config) - hf_config_keys(cfg.model.type))
    if unknown:
        raise ConfigError(
            f"model.config has keys {unknown} that {cfg.model.type!r} configs do not know: check the spelling"
        )
    topo = _topology(cfg, world_size)
    from ultrascale.model.build import build_hf_config

    if backend is None:
        from ultrascale.runtime.dist import detect_backend

        backend = detect_backend()
        if backend == "nccl" and gpu is None:
            from ultrascale.runtime.dist import local_rank
            from ultrascale.runtime.gpu import detect as detect_gpu

            gpu = detect_gpu(local_rank())  # this rank's GPU: before set_device every rank's current one is GPU 0
    zq = [k for k in ("zero_quantized_weights", "zero_quantized_gradients") if getattr(cfg.zero, k)]
    if zq and backend == "gloo":
        raise ConfigError(
            f"zero.{zq[0]}=true (ZeRO++) needs CUDA: its quantization kernels do not exist for the CPU "
            f"accelerator: set zero.{zq[0]}=false here, or run on GPUs"
        )
    if cfg.precision.autocast != "none" and cfg.precision.dtype != "fp32":
        raise ConfigError(
            f"precision.autocast={cfg.precision.autocast} needs precision.dtype=fp32 (got {cfg.precision.dtype}): "
            "autocast computes in bf16 over fp32 weights; with 16-bit weights use precision.autocast=none"
        )
    hf = build_hf_config(cfg.model)
    cpu = None
    if backend == "gloo":
        from ultrascale.runtime.cpu import detect

        cpu = detect()
    _checkpointing_rules(cfg.train)
    d = decide(cfg, topo, hf, backend, cpu, gpu)
    if cfg.train.eval_fim and (d.zero_stage == 3 or max(d.topo.pp, d.topo.tp, d.topo.sp) > 1):
        raise ConfigError(f"train.eval_fim={cfg.train.eval_fim} needs zero.stage<=2 and parallel.pp=tp=sp=1 (rank 0 "
                          "generates alone with the whole model): use train.eval_fim=0 and eval.py tasks=[fim] on "
                          "the exported checkpoint")  # fmt: skip
    dims = model_dims(hf)
    _zero_rules(cfg, d)
    _finetune_rules(cfg, d, backend)
    _grpo_rules(cfg, d)
    _parallel_combinations(cfg, topo, dims)
    _layout_rules(cfg, d, dims)
    _host_build_rule(cfg, d)
    if dims["max_pos"] and cfg.data.seq_len > dims["max_pos"]:
        raise ConfigError(
            f"data.seq_len={cfg.data.seq_len} exceeds model max_position_embeddings={dims['max_pos']}: "
            "lower data.seq_len or raise model.config.max_position_embeddings"
        )
    return d


def agree_across_ranks(d: Decisions) -> Decisions:
    """Rank 0's decisions, on every rank (collective: every rank calls it once the process group exists).

    :func:`validate` runs before the process group (so a bad config is one error line before anything starts),
    each rank alone, and a GPU rank decides from what its own machine says: its GPU's free memory (the fused
    loss's chunk, ``auto`` activation checkpointing), whether liger-kernel runs there. Those readings differ
    between ranks (a neighbour's CUDA context, another node), and ranks running different recompute plans or
    chunks hang in ZeRO-3's gathers or train different models. So rank 0's record is broadcast and kept; a
    rank whose own differed says which decisions it gave up. ``hf_config`` stays each rank's own build of the
    same config."""
    from dataclasses import fields, replace

    from ultrascale.runtime import dist

    mine = {f.name: getattr(d, f.name) for f in fields(d) if f.name != "hf_config"}
    theirs = dist.broadcast_object(mine)
    if theirs is mine:
        return d
    differ = [k for k, v in mine.items() if k != "gpu" and v != theirs[k]]
    if differ:
        dist.log.warning(f"rank {dist.rank()} decided {', '.join(differ)} differently from rank 0 (its own GPU or "
                         f"environment read otherwise); rank 0's decisions are kept: "
                         + "; ".join(f"{k}: {getattr(theirs[k], 'why', theirs[k])}" for k in differ))  # fmt: skip
    return replace(d, **theirs)


def _checkpointing_rules(train: TrainConfig) -> None:
    """``train.activation_checkpointing`` is one of the modes (booleans mean full/none); whether the mode can run
    here is its decide function's (``levers.decide._activation_checkpointing``)."""
    from ultrascale.config.recompute import checkpointing_mode

    value = train.activation_checkpointing
    try:
        checkpointing_mode(value)
    except ValueError:
        raise ConfigError(
            f"train.activation_checkpointing={value!r} is not one of auto, none, selective, full "
            "(true/false mean full/none)"
        ) from None


def _mixture_rules(data: DataConfig, train_steps: int) -> None:
    """``data.sources`` and ``data.stages``: positive weights, known names, stage ends that move forward."""
    from ultrascale.data.sources import stage_end

    names = list(data.sources)
    for n in names:
        w = data.sources[n].weight
        if not w > 0:
            raise ConfigError(
                f"data.sources.{n}.weight={w} must be > 0: it is {n}'s share of the training samples; "
                f"drop the source, or give it a positive weight"
            )
    if not data.stages:
        return
    if not names:
        raise ConfigError(
            "data.stages needs data.sources: name the datasets, e.g. "
            "data.sources={code:{path:data/stdlib,weight:1}}, and refer to them by name in each stage's weights"
        )
    tokens_per_step, prev = int(data.global_batch) * int(data.seq_len), 0
    for i, st in enumerate(data.stages):
        key = f"data.stages[{i}]"
        if not st.weights:
            raise ConfigError(
                f"{key}.weights is empty: give each source read in the stage a weight, e.g. {{{names[0]}: 1}}"
            )
        for n, w in st.weights.items():
            if n not in names:
                raise ConfigError(
                    f"{key}.weights names {n!r}, which is not in data.sources ({', '.join(names)}): "
                    "check the spelling, or add it to data.sources"
                )
            if not w > 0:
                raise ConfigError(f"{key}.weights.{n}={w} must be > 0: leave {n} out of the stage to not read it there")
        if st.until_step is not None and st.until_tokens is not None:
            raise ConfigError(f"{key} sets both until_step and until_tokens: keep one")
        end = stage_end(st, tokens_per_step)
        if end is None:
            if i != len(data.stages) - 1:
                raise ConfigError(
                    f"{key} has no until_step or until_tokens but is not the last stage: only the last stage "
                    "runs to the end of the run"
                )
            continue
        if end <= prev:
            raise ConfigError(
                f"{key} ends at step {end}, not after the previous stage's end (step {prev}): stage ends must "
                f"increase (until_tokens counts {tokens_per_step:,} tokens per step)"
            )
        if i == len(data.stages) - 1 and end < train_steps:
            raise ConfigError(
                f"{key}, the last stage, ends at step {end} but train.steps={train_steps}: drop its "
                "until_step/until_tokens so it runs to the end, or add a stage after it"
            )
        prev = end


def _topology(cfg: RootConfig, world_size: int) -> Topology:
    """The layout the degrees give on ``world_size`` ranks, once they divide it and the batch divides dp."""
    p = cfg.parallel
    model_par = p.tp * p.pp * p.sp
    if world_size % model_par:
        raise ConfigError(
            f"parallel.tp*pp*sp={p.tp}*{p.pp}*{p.sp}={model_par} does not divide the world size {world_size}: "
            f"launch a multiple of {model_par} ranks or lower the degrees"
        )
    topo = Topology(world=world_size, tp=p.tp, pp=p.pp, sp=p.sp, ep=p.ep)
    mb, gb = cfg.data.micro_batch, cfg.data.global_batch
    if gb % (mb * topo.dp):
        raise ConfigError(
            f"data.global_batch={gb} is not divisible by data.micro_batch*dp={mb}*{topo.dp}={mb * topo.dp}: "
            f"use data.global_batch={max(1, round(gb / (mb * topo.dp))) * mb * topo.dp}"
        )
    return topo


def _host_build_rule(cfg: RootConfig, d: Decisions) -> None:
    """A run on a declared cluster whose model build cannot fit a node's host memory: every rank of a node builds
    at once (the planner's construction peak, ``ultrascale.cost.memory.construction_bytes``), so the node would
    run out of memory before the first step. ZeRO-3 and pipeline stages build partitioned; ZeRO-0/1/2 build the
    whole model (AutoEP runs their routed experts partitioned), as does tensor parallelism."""
    c = cfg.cluster
    if c is None:
        return
    from ultrascale.cost.memory import GIB, Layout, construction_bytes
    from ultrascale.model.arch import arch_from_hf

    t = d.topo
    lay = Layout(world=t.world, tp=t.tp, pp=t.pp, sp=t.sp, ep=t.ep, zero_stage=d.zero_stage)
    per_rank = construction_bytes(arch_from_hf(d.hf_config), lay)
    launched = cfg.launcher.nproc_per_node * cfg.launcher.nnodes == t.world  # else the planner's full nodes
    ranks = min(int(cfg.launcher.nproc_per_node if launched else c.gpus_per_node), t.world)
    if per_rank * ranks > float(c.host_memory_gib) * GIB:
        raise ConfigError(
            f"building the model takes ~{per_rank / GIB:.1f} GiB of host memory per rank x {ranks} ranks per node "
            f"(launcher.nproc_per_node, cluster.gpus_per_node) = {per_rank * ranks / GIB:.0f} GiB > cluster.host_memory_gib="
            f"{float(c.host_memory_gib):g} (cluster={c.name}): zero.stage={d.zero_stage} builds the whole model on "
            "every rank; use zero=stage3 (built partitioned), parallel.pp>1 (each stage builds its own layers), or "
            "fewer ranks per node"
        )


def _zero_rules(cfg: RootConfig, d: Decisions) -> None:
    """ZeRO stage against offload, the optimizer and ZeRO++."""
    z, stage = cfg.zero, d.zero_stage
    if z.offload_optimizer != "none" and stage == 0:
        raise ConfigError("zero.offload_optimizer=cpu needs zero.stage>=1 (got 0): use zero=stage2_offload")
    if z.offload_param != "none" and stage != 3:
        raise ConfigError(f"zero.offload_param=cpu needs zero.stage=3 (got {stage}): use zero=stage3_offload")
    if cfg.optim.name == "muon" and stage == 3:
        raise ConfigError("optim=muon needs zero.stage<=2 (got 3): Muon needs whole matrices; use zero=stage2")
    if cfg.optim.name == "muon" and cfg.optim.grad_clip > 0:
        # DeepSpeed's ZeRO-1/2 orthogonalises Muon's matrices before the global norm (stage_1_and_2.py: "the clip
        # covers the orthogonalized gradient"): an orthogonalised matrix has norm ~sqrt(min(rows, cols)), so the
        # global norm is set by the shapes (61-65 at every logged step of model=tiny, whatever the loss), and a
        # clip of 1 shrinks every Muon step by that factor. Found by the Muon-vs-AdamW lr sweep (README "Ablations").
        raise ConfigError(
            f"optim=muon with optim.grad_clip={cfg.optim.grad_clip}: DeepSpeed clips Muon's orthogonalised update, not "
            "the gradient, and its norm is set by the matrices' shapes (about 64 for model=tiny at every step), so "
            "every Muon step would shrink by that factor; set optim.grad_clip=0 (optim=muon's default)"
        )
    if cfg.optim.name == "muon" and z.offload_optimizer != "none":
        raise ConfigError("optim=muon does not support zero.offload_optimizer=cpu: use zero=stage2")
    if (z.zero_quantized_weights or z.zero_quantized_gradients) and stage != 3:
        raise ConfigError(f"zero.zero_quantized_* (ZeRO++) needs zero.stage=3 (got {stage}): use zero=stage3")


def _finetune_rules(cfg: RootConfig, d: Decisions, backend: str) -> None:
    """``finetune=lora|qlora``: adapters need trained weights to adapt, a layout peft's layers survive, and (QLoRA)
    bitsandbytes' CUDA kernels."""
    method = d.finetune.value
    if method in (None, "none"):
        return
    key = f"finetune={method}"
    if method == "qlora" and backend == "gloo":  # first: nothing else the user fixes would make it run here
        raise ConfigError(
            "finetune=qlora needs a CUDA GPU: bitsandbytes' 4-bit kernels do not run on the CPU accelerator; use "
            "finetune=lora here (the same adapters over a full-precision base), or run on GPUs"
        )
    if not cfg.model.pretrained_path:
        raise ConfigError(
            f"{key} needs model.pretrained_path (got null): adapters on randomly initialised weights train a "
            "low-rank update of noise; set model.pretrained_path=models/smollm2-135m (a local HF directory), or "
            "use finetune=none to train every weight"
        )
    topo = d.topo
    for lever, n, why in (("pp", topo.pp, "the pipeline engine builds its stages from the layer list itself"),
                          ("tp", topo.tp, "AutoTP shards nn.Linear by name and would split peft's wrapped layers"),
                          ("sp", topo.sp, "Ulysses with adapters is untested here"),
                          ("ep", topo.ep, "AutoEP swaps the MoE blocks that adapters wrap")):  # fmt: skip
        if n > 1:
            raise ConfigError(f"{key} needs parallel.{lever}=1 (got {n}): {why}; use ZeRO data parallel "
                              f"(zero=stage3 partitions the frozen base too)")  # fmt: skip
    if cfg.optim.name == "muon":
        raise ConfigError(f"{key} with optim=muon is not supported (Muon orthogonalises whole matrices, not "
                          "low-rank factors): use optim=adamw")  # fmt: skip
    if not cfg.finetune.target_modules:
        raise ConfigError(f"{key} with finetune.target_modules=[] adapts nothing: name the Linear layers to adapt, "
                          "e.g. finetune.target_modules=[q_proj,v_proj]")  # fmt: skip
    if method != "qlora":
        return
    if d.zero_stage == 3:
        raise ConfigError("finetune=qlora needs zero.stage<=2 (got 3): ZeRO-3 would partition the packed 4-bit "
                          "weights; use zero=stage2 (the frozen 4-bit base is small: 0.5 bytes a parameter)")  # fmt: skip
    from ultrascale.model.adapters import bitsandbytes_missing

    if why := bitsandbytes_missing():
        raise ConfigError(f"finetune=qlora needs bitsandbytes ({why}): pip install bitsandbytes, or use finetune=lora")


def _grpo_rules(cfg: RootConfig, d: Decisions) -> None:
    """What the GRPO objective needs of the other groups: whole problems per rank, a batch that is the step's
    completions, a stability policy an RL loss does not trip, a model with a tokenizer, one replica per rank."""
    g = cfg.grpo
    if g is None:
        return
    topo, want = d.topo, g.prompts_per_step * g.num_generations
    if max(topo.pp, topo.tp, topo.sp) > 1 or d.moe.on:
        raise ConfigError(f"grpo needs parallel.pp=tp=sp=1 and no expert parallelism (got pp={topo.pp} tp={topo.tp} "
                          f"sp={topo.sp}): each rank generates with its whole replica; use zero=stage3 to shard")  # fmt: skip
    if g.prompts_per_step % topo.dp:
        raise ConfigError(f"grpo.prompts_per_step={g.prompts_per_step} must be a multiple of the data-parallel size "
                          f"{topo.dp} (each rank samples whole groups): use grpo.prompts_per_step="
                          f"{-(-g.prompts_per_step // topo.dp) * topo.dp}")  # fmt: skip
    if cfg.data.global_batch != want:
        raise ConfigError(f"grpo: data.global_batch={cfg.data.global_batch} must be grpo.prompts_per_step x "
                          f"grpo.num_generations = {want} (one optimizer step over the step's completions): "
                          f"set data.global_batch={want}")  # fmt: skip
    if cfg.stability.spike != "none":
        raise ConfigError(f"grpo needs stability.spike=none (got {cfg.stability.spike}): a policy-gradient loss is "
                          "centred on 0 and changes sign, so a z-score against its mean flags ordinary steps: "
                          "use stability=rl")  # fmt: skip
    evals = [
        k
        for k in ("eval_interval", "eval_at_start", "final_eval", "eval_humaneval", "eval_fim")
        if getattr(cfg.train, k)
    ]
    if evals:
        raise ConfigError(f"grpo: train.{evals[0]}={getattr(cfg.train, evals[0])} evaluates held-out data a GRPO run "
                          "does not read: set train.eval_interval=0 train.final_eval=false and score the run with "
                          "python -m ultrascale.ssd.evaluate (HumanEval's test half, paired CI)")  # fmt: skip
    if not cfg.model.pretrained_path:
        raise ConfigError("grpo needs model.pretrained_path (a model directory with its tokenizer): the sampler "
                          "decodes completions and the rewards read text")  # fmt: skip
    if g.reward_weights is not None and len(g.reward_weights) != len(g.reward_funcs):
        raise ConfigError(f"grpo.reward_weights has {len(g.reward_weights)} weights for {len(g.reward_funcs)} "
                          f"grpo.reward_funcs {list(g.reward_funcs)}: give one weight per function, or null")  # fmt: skip


def _layout_rules(cfg: RootConfig, d: Decisions, dims: dict[str, int]) -> None:
    """Each parallel degree against the ZeRO stage and the model's shape."""
    p, topo, stage = cfg.parallel, d.topo, d.zero_stage
    if p.pp > 1:
        if stage > 1:
            raise ConfigError(f"parallel.pp={p.pp} needs zero.stage<=1 (got {stage}): use zero=stage1")
        if p.pp > dims["layers"]:
            raise ConfigError(f"parallel.pp={p.pp} exceeds the model's {dims['layers']} layers: lower parallel.pp")
        if p.sp > 1:
            raise ConfigError(f"parallel.pp={p.pp} with parallel.sp={p.sp} is not supported: use one of them")
        if cfg.optim.name == "muon":
            raise ConfigError("parallel.pp>1 with optim=muon is not supported: use optim=adamw")
    if p.tp > 1:
        if stage > 2:
            raise ConfigError(
                f"parallel.tp={p.tp} needs zero.stage<=2 (got {stage}): DeepSpeed AutoTP training "
                f"refuses ZeRO-3; use zero=stage2"
            )
        for name, n in (("attention heads", dims["heads"]), ("kv heads", dims["kv_heads"]),
                        ("intermediate_size", dims["intermediate"])):  # fmt: skip
            if n and n % p.tp:
                raise ConfigError(f"parallel.tp={p.tp} does not divide the model's {name} ({n}): pick a tp that does")
    if p.sp > 1:
        if dims["heads"] % p.sp:
            raise ConfigError(
                f"parallel.sp={p.sp} does not divide the model's attention heads ({dims['heads']}): pick an sp that does"
            )
        if cfg.data.seq_len % p.sp:
            raise ConfigError(
                f"parallel.sp={p.sp} does not divide data.seq_len={cfg.data.seq_len}: pick an sp that does"
            )
    if p.ep > 1:
        if topo.dp % p.ep:
            raise ConfigError(f"parallel.ep={p.ep} does not divide dp={topo.dp}: use an ep that divides the dp degree")
        if not dims["experts"]:
            raise ConfigError(
                f"parallel.ep={p.ep} needs a MoE model, but model.type={cfg.model.type} has no experts: "
                "use model=tiny_moe or parallel.ep=1"
            )
        if dims["experts"] % p.ep:
            raise ConfigError(
                f"parallel.ep={p.ep} does not divide the model's {dims['experts']} experts: pick an ep that does"
            )
