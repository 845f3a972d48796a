"""Linear cross-entropy that never holds the ``[tokens, vocab]`` logits at once, and its hook into HF models.

At a 49k vocabulary the logits are the largest activation of a small model: 2,048 tokens x 49,152 x 4 bytes
is 384 MiB in fp32, and HF's plain path (``ForCausalLMLoss``) holds about three such buffers at its peak.
:func:`linear_cross_entropy` walks the tokens in chunks instead (how, and what it holds: its docstring);
:func:`install_fused_loss` makes a stock HF ``*ForCausalLM`` compute its training loss this way without changing
its class, parameters or behaviour without labels (generation and logit-wanting eval are untouched).

GPU: with ``impl="auto"`` on a CUDA tensor the Triton kernels of ``liger-kernel`` or ``cut-cross-entropy`` are
used where they import and run a trial row on that GPU (``kernel_unusable``). Those paths are written to the
libraries' documented APIs but are **not exercised on the CPU-only machine this module was developed and tested
on**; the chunked path is, and is what ``auto`` always picks on CPU.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100

CHUNK_BUDGET_BYTES = 32 * 2**20
"""A byte budget for one chunk's fp32 logits (the only vocab-sized buffer): 170 tokens at a 49k vocabulary,
inside the range where the loss's peak memory stays flat (bench/README.md, "The fused loss chunk")."""
CPU_MAX_CHUNK_TOKENS = 128
"""The CPU chunk with fp32 GEMMs: the start of the measured plateau of chunk sizes and the smallest logits buffer
on it (bench/README.md, "The fused loss chunk" and "The CPU levers, per CPU"). The run's chunk is decided per CPU
from it (``ultrascale.levers.hardware.cpu_loss_chunk``)."""

_IMPLS = ("auto", "chunked", "liger", "cce")

VERIFIED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "starcoder2", "smollm3", "phi3", "olmo2"})
"""Model types whose ``*ForCausalLM.forward`` in transformers 5.22 is exactly
``loss_function(lm_head(model(...).last_hidden_state), labels)``: no logit scaling, soft-capping, bias or extra loss
term. A fact of the HF code; the run's decision (``ultrascale.levers.decide.loss_unfit``) keeps others on HF's loss
rather than silently giving them a different one."""

LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_logits_scale")
"""Config attributes that change the logits between the head and the loss in some HF architectures."""


def default_chunk_tokens(vocab_size: int, budget_bytes: int = CHUNK_BUDGET_BYTES, cpu: bool = False) -> int:
    """Tokens per chunk so that one chunk's fp32 logits fit ``budget_bytes`` (and, on CPU, the cache)."""
    chunk = max(1, budget_bytes // (4 * vocab_size))
    return min(chunk, CPU_MAX_CHUNK_TOKENS) if cpu else chunk


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Loss and both gradients in one pass over the token chunks; backward only rescales.

    The gradients are produced in the forward (not recomputed in the backward) because the forward has the
    chunk's logits in hand: recomputing them would cost a second ``N x h x V`` matmul. They are held on
    ``ctx`` and consumed once; a second backward through the same graph is refused.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk, ignore_index, reduction, need_hidden_grad, need_weight_grad):
        # Inside the caller's autocast (precision.autocast=bf16), or over 16-bit weights, the three GEMMs take that
        # dtype, as every other matmul of the forward does (and HF's lm_head): on a CPU with AMX they were 40 % of a
        # bf16 step in fp32. The log-sum-exp, the softmax and both gradients' accumulation stay fp32.
        dev = hidden.device.type
        mm = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        if mm is None and hidden.dtype == weight.dtype == torch.bfloat16:
            mm = torch.bfloat16  # bf16 weights (precision=bf16): the head's GEMMs in bf16, as HF's lm_head
            # (fp16 keeps fp32 GEMMs: a CPU has no fast fp16 GEMM, and its loss scale wants fp32 partial sums)
        with torch.autocast(dev, enabled=False):
            return _ChunkedLinearCrossEntropy._forward(
                ctx, hidden, weight, labels, chunk, ignore_index, reduction, need_hidden_grad, need_weight_grad, mm
            )

    @staticmethod
    def _forward(ctx, hidden, weight, labels, chunk, ignore_index, reduction, need_hidden_grad, need_weight_grad,
                 mm=None):  # fmt: skip
        n = hidden.shape[0]
        # The head as the GEMMs take it, cast once a call: fp32 (no copy for fp32; bf16/fp16 heads upcast) or ``mm``.
        w = weight.float() if mm is None else weight.to(mm)
        h_dtype = torch.float32 if mm is None else mm
        valid_all = labels != ignore_index
        n_valid = valid_all.sum()
        # 'mean' divides by the number of targets; with none the loss is 0 and the gradients are zero (not NaN).
        scale = 1.0 / n_valid.clamp(min=1).float() if reduction == "mean" else torch.ones((), device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        # fp32 until the backward has applied grad_output: an fp16 loss scale must be applied before the cast
        # to fp16, or the small per-token gradients of a mean over many tokens underflow.
        grad_hidden = hidden.new_empty(hidden.shape, dtype=torch.float32) if need_hidden_grad else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight_grad else None
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            h = hidden[start:end].to(h_dtype)
            valid = valid_all[start:end]
            target = torch.where(valid, labels[start:end], 0)
            # One [c, V] fp32 buffer for the whole chunk: logits, then exp(logits - max), then the gradient.
            # (torch.logsumexp would allocate two more of its size.)
            logits = (h @ w.T).float()  # no copy in fp32
            row_max = logits.amax(dim=1, keepdim=True)
            picked = logits.gather(1, target[:, None])
            exps = logits.sub_(row_max).exp_()
            sums = exps.sum(dim=1, keepdim=True)
            lse = row_max + sums.log()
            total += ((lse - picked).squeeze(1) * valid).sum()
            if grad_hidden is None and grad_weight is None:
                continue
            # d(loss)/d(logits) = softmax - one_hot, times the reduction's scale; ignored rows are zero.
            row_scale = valid.float()[:, None] * scale
            grad_logits = exps.mul_(row_scale / sums)
            grad_logits[torch.arange(end - start, device=logits.device), target] -= row_scale.squeeze(1)
            g = grad_logits if mm is None else grad_logits.to(mm)
            if grad_hidden is not None:
                grad_hidden[start:end] = g @ w
            if grad_weight is not None:
                if mm is None:
                    grad_weight.addmm_(g.T, h)  # in place: no [V, h] temporary
                else:
                    grad_weight += g.T @ h  # the bf16 product summed in fp32
        ctx.grads = (grad_hidden, grad_weight)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return total * scale

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.grads is None:
            raise RuntimeError("linear_cross_entropy: backward ran twice; its gradients are consumed by the first")
        grads = ctx.grads
        ctx.grads = None
        # In place (the buffers are ours, used once), in fp32, then cast: grad_output is the fp16 loss scale
        # or a gradient-accumulation factor, or 1.
        out = [None if g is None else g.mul_(grad_output.float()).to(dt) for g, dt in zip(grads, ctx.dtypes)]
        return out[0], out[1], None, None, None, None, None, None


def _liger(hidden, weight, labels, ignore_index: int, reduction: str) -> torch.Tensor:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    out = liger_fused_linear_cross_entropy(hidden, weight, labels, ignore_index=ignore_index, reduction=reduction)
    return out[0] if isinstance(out, tuple) else out  # some releases also return the z-loss


def _cce(hidden, weight, labels, ignore_index: int, reduction: str) -> torch.Tensor:
    from cut_cross_entropy import linear_cross_entropy as cce

    return cce(hidden, weight, labels, ignore_index=ignore_index, reduction=reduction)


_GPU_PACKAGES = {"liger": ("liger_kernel", "liger-kernel"), "cce": ("cut_cross_entropy", "cut-cross-entropy")}
_KERNELS = {"liger": (_liger, "liger_kernel.transformers.functional"), "cce": (_cce, "cut_cross_entropy")}
"""Each GPU kernel's call and the module that call imports (what must import for it to run)."""
_VERDICTS: dict[tuple[str, str], str | None] = {}


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def kernel_unusable(impl: str, device: torch.device | str | None = None) -> str | None:
    """Why ``impl``'s (``liger``/``cce``) kernel cannot run in this process, or None where it can.

    Installed is not enough: a liger-kernel built for another Triton is found by ``find_spec``, then fails at its
    import or at its first kernel launch, which was step 1. So the module the loss calls is really imported and,
    given a CUDA ``device``, a one-row forward and backward runs there (Triton compiles its kernels then). The
    verdict is kept per process and device: a failed import is retried by Python on every ``import``, and the
    trial launch costs a compile."""
    key = (impl, "" if device is None else str(device))
    if key not in _VERDICTS:
        _VERDICTS[key] = _try_kernel(impl, None if device is None else torch.device(device))
    return _VERDICTS[key]


def _try_kernel(impl: str, device: torch.device | None) -> str | None:
    import contextlib
    import importlib

    module, package = _GPU_PACKAGES[impl]
    call, kernel_module = _KERNELS[impl]
    if not _importable(module):
        return f"{package} is not installed (pip install {package})"
    try:
        importlib.import_module(kernel_module)
    except Exception as e:  # any failure of a third-party import is a reason not to use it
        return f"{package} does not import here: {_first_line(e)}"
    if device is None:
        return None
    try:
        cuda = device.type == "cuda"
        with torch.cuda.device(device) if cuda else contextlib.nullcontext():  # not GPU 0's context: this rank's
            dtype = torch.bfloat16 if cuda and torch.cuda.is_bf16_supported() else torch.float32
            hidden = torch.randn(1, 64, device=device, dtype=dtype, requires_grad=True)
            weight = torch.randn(128, 64, device=device, dtype=dtype, requires_grad=True)
            call(hidden, weight, torch.tensor([3], device=device), IGNORE_INDEX, "mean").backward()
            if cuda:
                torch.cuda.synchronize(device)
    except Exception as e:  # a kernel that cannot compile or launch here, whatever it raises
        return f"{package}'s kernel fails on {device}: {_first_line(e)}"
    return None


def _first_line(e: BaseException) -> str:
    """An exception as one line (Triton's compile errors run to pages)."""
    line = next((x for x in str(e).splitlines() if x.strip()), "")
    return f"{type(e).__name__}: {line[:300]}"


def resolve_impl(impl: str, device: torch.device | str) -> str:
    """What ``impl`` means on ``device``: ``auto`` is liger, then cce, on CUDA where it runs
    (:func:`kernel_unusable`); chunked otherwise."""
    device = torch.device(device)
    if impl not in _IMPLS:
        raise ValueError(f"linear_cross_entropy: impl={impl!r} is not one of {', '.join(_IMPLS)}")
    if impl == "auto":
        if device.type == "cuda":
            for name in _GPU_PACKAGES:
                if kernel_unusable(name, device) is None:
                    return name
        return "chunked"
    if impl in _GPU_PACKAGES:
        module, package = _GPU_PACKAGES[impl]
        if device.type != "cuda":
            raise ValueError(f"linear_cross_entropy: impl={impl!r} needs CUDA tensors, got {device.type}; "
                             "use impl='chunked' or 'auto'")  # fmt: skip
        if not _importable(module):
            raise ValueError(f"linear_cross_entropy: impl={impl!r} needs `pip install {package}` (CUDA + Triton)")
        why = kernel_unusable(impl, device)
        if why:
            raise ValueError(f"linear_cross_entropy: impl={impl!r} cannot run: {why}; use impl='chunked' or 'auto'")
    return impl


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_tokens: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
    impl: str = "auto",
) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T, labels)`` in fp32 without ever holding the full logits.

    HF's plain path upcasts the logits to fp32, keeps their log-softmax from the forward to the backward and
    then allocates their gradient. Here each chunk's logits, log-sum-exp, loss and *gradients* are computed in
    the forward and the chunk's logits are dropped, so only the gradients w.r.t. the hidden states (``N x h``)
    and the head (``V x h``), in fp32, survive to the backward, which merely scales them by ``grad_output``.
    Peak extra memory is one chunk's logits (``chunk x V x 4`` bytes) plus those gradients; the cost is the
    head's gradient (``V x h x 4`` bytes), held from the forward to the backward. liger-kernel and
    cut-cross-entropy (``impl``) are not in requirements.txt: both need Triton and CUDA.

    hidden ``[N, h]`` (any float dtype, any strides), weight ``[V, h]``, labels ``[N]``: each row's own
    target, already shifted (``ignore_index`` = no target). ``reduction="mean"`` divides by the number of
    targets, like HF's default without ``num_items_in_batch``; ``"sum"`` is for callers that normalise
    across shards themselves. Unlike ``F.cross_entropy``, a batch with no targets gives 0 (and zero
    gradients), not NaN. ``chunk_tokens`` defaults to ``default_chunk_tokens(V)``.

    ``impl``: ``chunked`` (this module, any device), ``liger`` / ``cce`` (Triton kernels, CUDA only, not in
    requirements and not exercised on CPU) or ``auto`` (liger, then cce, on CUDA; chunked otherwise).
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"linear_cross_entropy: reduction={reduction!r}; use 'mean' or 'sum'")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} "
                         "must be [N, h] and [V, h]")  # fmt: skip
    labels = labels.reshape(-1)
    if labels.shape[0] != hidden.shape[0]:
        raise ValueError(f"linear_cross_entropy: {labels.shape[0]} labels for {hidden.shape[0]} rows of hidden")
    which = resolve_impl(impl, hidden.device)
    if which == "liger":
        return _liger(hidden, weight, labels, ignore_index, reduction)
    if which == "cce":
        return _cce(hidden, weight, labels, ignore_index, reduction)
    chunk = int(chunk_tokens) if chunk_tokens else default_chunk_tokens(weight.shape[0], cpu=not hidden.is_cuda)
    if chunk < 1:
        raise ValueError(f"linear_cross_entropy: chunk_tokens={chunk_tokens} must be >= 1")
    grad_on = torch.is_grad_enabled()
    return _ChunkedLinearCrossEntropy.apply(
        hidden,
        weight,
        labels.to(hidden.device),
        chunk,
        ignore_index,
        reduction,
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,
    )


# --------------------------------------------------------------------------------------------------------------
# HF integration


def _check_structure(model) -> None:
    """Raise ValueError unless the built ``model`` has what the fused forward calls: a bias-free Linear head whose
    output HF's ``ForCausalLMLoss`` takes, and the base decoder. Whether the model type's loss is that at all is
    the run's decision (``ultrascale.levers.decide.loss_unfit``), made from its config before the build."""
    config = model.config
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        raise ValueError(f"{config.model_type}'s output head is {type(head).__name__}"
                         f"{' with a bias' if isinstance(head, torch.nn.Linear) else ''}, not a bias-free Linear")  # fmt: skip
    from transformers.loss.loss_utils import ForCausalLMLoss

    if getattr(model, "_loss_function", ForCausalLMLoss) is not ForCausalLMLoss:
        raise ValueError(
            f"{config.model_type} has a custom loss_function; the fused loss only replaces ForCausalLMLoss"
        )
    if not hasattr(model, model.base_model_prefix):
        raise ValueError(f"{type(model).__name__} has no base decoder at .{model.base_model_prefix}")


def _fused_forward(self, plain: Callable, sig: inspect.Signature, chunk_tokens: int | None, impl: str, args, kwargs):
    """HF ``*ForCausalLM.forward`` with the loss computed by ``linear_cross_entropy`` and no logits returned."""
    bound = sig.bind(self, *args, **kwargs)
    a = dict(bound.arguments)
    a.pop("self", None)
    for name, p in sig.parameters.items():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            a.update(a.pop(name, {}))
    labels = a.pop("labels", None)
    return_dict = a.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    if labels is None or not return_dict or a.get("logits_to_keep") not in (None, 0):
        # No loss wanted (generation, logit eval), a tuple output, or a sliced head: the stock forward.
        return plain(self, *args, **kwargs)
    a.pop("logits_to_keep", None)
    shift_labels = a.pop("shift_labels", None)
    num_items_in_batch = a.pop("num_items_in_batch", None)
    ignore_index = a.pop("ignore_index", IGNORE_INDEX)
    outputs = getattr(self, self.base_model_prefix)(**a)
    hidden = outputs.last_hidden_state
    if shift_labels is None:  # exactly HF's ForCausalLMLoss: pad with ignore_index, then drop the first
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    head = self.get_output_embeddings().weight
    flat = hidden.reshape(-1, hidden.shape[-1])
    targets = shift_labels.reshape(-1).to(hidden.device)
    if num_items_in_batch is None:
        loss = linear_cross_entropy(flat, head, targets, chunk_tokens=chunk_tokens, ignore_index=ignore_index,
                                    impl=impl)  # fmt: skip
    else:  # HF's fixed_cross_entropy: sum over this micro-batch divided by the caller's token count
        loss = linear_cross_entropy(flat, head, targets, chunk_tokens=chunk_tokens, ignore_index=ignore_index,
                                    reduction="sum", impl=impl)  # fmt: skip
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(
        loss=loss,
        logits=None,
        past_key_values=getattr(outputs, "past_key_values", None),
        hidden_states=getattr(outputs, "hidden_states", None),
        attentions=getattr(outputs, "attentions", None),
    )


def install_fused_loss(model, chunk_tokens: int | None = None, impl: str = "auto") -> None:
    """Make ``model(..., labels=...)`` compute its loss with ``linear_cross_entropy``.

    Only the instance's ``forward`` is replaced (DeepSpeed's engine and ``nn.Module.__call__`` call
    ``self.forward``), so the class, the parameters and ``state_dict`` keys are unchanged, and ``deepcopy``
    gives a copy that is patched the same way. With labels the output has ``loss`` and ``logits=None``;
    without labels (generation, eval that wants logits), with ``return_dict=False`` or with
    ``logits_to_keep`` the stock forward runs. Labels are shifted exactly as HF's ``ForCausalLMLoss`` does
    (``shift_labels`` and ``num_items_in_batch`` are honoured the same way).

    This acts on a decision made before the model was built: whether the model's loss is cross-entropy of its
    plain head at all (no MoE router loss, logit soft-capping or scaling; a verified type) is
    ``ultrascale.levers.decide.loss_unfit``'s, and whether a ``liger``/``cce`` kernel runs here is
    ``decide._loss_kernel``'s (a forced one that cannot is refused there; the call checks again, at its first
    step). Raises ValueError, leaving the model untouched, only for arguments it cannot take (an unknown
    ``impl``, ``chunk_tokens < 1``) or a built model without what the fused forward calls (a bias-free Linear
    head, HF's ``ForCausalLMLoss``, the base decoder).

    ZeRO-3: the head weight is partitioned and gathered only when the ``lm_head`` module runs, which this
    path bypasses; it is registered as an external parameter of ``model`` so DeepSpeed gathers it for the
    top module's forward and backward. Install on the model built under ``HfDeepSpeedConfig``/``zero.Init``
    (as ultrascale/train/engine.py does) or on ``engine.module`` after ``deepspeed.initialize``; both are
    tested on 2 ranks. (Installed on a whole model that ``deepspeed.initialize`` then partitions, it also
    works: DeepSpeed 0.19.8's parameter getter gathers and registers a parameter read outside its module.)
    """
    _check_structure(model)
    if impl not in _IMPLS:
        raise ValueError(f"install_fused_loss: impl={impl!r} is not one of {', '.join(_IMPLS)}")
    if chunk_tokens is not None and int(chunk_tokens) < 1:
        raise ValueError(f"install_fused_loss: chunk_tokens={chunk_tokens} must be >= 1 (or None for the default)")
    current = model.__dict__.get("forward")
    if current is None:
        plain = type(model).forward
    elif isinstance(current, types.MethodType) and current.__self__ is model:
        plain = getattr(current.__func__, "_ultrascale_plain", current.__func__)  # re-install: keep the original
    else:
        raise ValueError(f"model.forward was already replaced by {current!r}; install the fused loss first")
    sig = inspect.signature(plain)

    def forward(self, *args, **kwargs):
        return _fused_forward(self, plain, sig, chunk_tokens, impl, args, kwargs)

    forward.__signature__ = sig  # generate() reads the forward's parameters (logits_to_keep, position_ids)
    forward.__doc__ = plain.__doc__
    forward._ultrascale_plain = plain
    weight = model.get_output_embeddings().weight
    if hasattr(weight, "ds_id"):
        import deepspeed

        deepspeed.zero.register_external_parameter(model, weight)
    # A method bound to this instance (not a closure over it), so deepcopy rebinds it to the copy.
    model.forward = types.MethodType(forward, model)
