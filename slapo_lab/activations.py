"""The activation passes: one forward of a (scheduled) model on meta tensors that counts activation bytes.

Two ways, both in training mode, both retried under ``FakeTensorMode`` when the forward reads a tensor value:

* :func:`estimate_activations` -- the outputs of every leaf module and the inputs of every module, under
  ``torch.no_grad`` (one pass serves every checkpoint variant; it undercounts what non-leaf modules save);
* :func:`saved_activations` -- what autograd really saves, through ``torch.autograd.graph.saved_tensors_hooks``,
  one count per storage (equal to the bytes measured on real tensors).

Scaled dot-product attention runs as the flash-attention kernel a real run uses (:class:`FlashSDPA`,
:data:`ATTENTION_KERNEL`). :mod:`slapo_lab.plan` turns these profiles into per-stage bytes, and
:mod:`slapo_lab.activation_cache` caches them per schedule state and composes a deep model's pass from its
distinct blocks.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode

from .errors import ScheduleError
from .random import observe_selective_saves
from .utils import iter_tensors as _tensors  # one walker for nested tensors
from .utils import meta_copy, to_meta

__all__ = [
    "ATTENTION_KERNEL",
    "ActivationProfile",
    "FlashSDPA",
    "SavedProfile",
    "estimate_activations",
    "saved_activations",
]


@dataclass
class ActivationProfile:
    """What one meta forward pass recorded (independent of checkpoints and cuts).

    Attributes:
        leaf_out: leaf module path -> list of ``(tensor id, numel, element size, is floating)`` of its
            outputs (all calls).
        mod_in: module path -> the same for its tensor inputs (all calls).
        batch: the batch size (dim 0 of the first tensor input), or None.
        seconds: wall time of the forward pass.
        fake: whether the pass ran under ``FakeTensorMode`` (needed by models whose forward
            inspects tensor values, e.g. Hugging Face's packed-sequence check).
    """

    leaf_out: dict[str, list[tuple[int, int, int, bool]]] = field(default_factory=dict)
    mod_in: dict[str, list[tuple[int, int, int, bool]]] = field(default_factory=dict)
    batch: int | None = None
    seconds: float = 0.0
    fake: bool = False


def _first_batch(inputs: Any) -> int | None:
    for t in _tensors(inputs):
        return int(t.shape[0]) if t.dim() else None
    return None


def _call_model(model: nn.Module, inputs: Any):
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _meta_pass_inputs(model: nn.Module, example_inputs: Any):
    """(meta model, meta inputs, id(module) -> first path) for a recording pass (copies real models)."""
    if any(not t.is_meta for t in list(model.parameters()) + list(model.buffers())):
        model = meta_copy(model)
    path_of: dict[int, str] = {}
    for path, m in model.named_modules(remove_duplicate=False):
        path_of.setdefault(id(m), path)
    return model, to_meta(example_inputs), path_of


#: The attention kernel the activation passes assume: what one ``scaled_dot_product_attention`` keeps for backward.
ATTENTION_KERNEL = (
    "flash attention (SDPA) without attention dropout: q, k, v, the output and the log-sum-exp, no sequence x "
    "sequence matrix; with attention dropout the math kernel (as on CPU), which saves the probabilities"
)


class FlashSDPA(TorchFunctionMode):
    """Run ``torch.nn.functional.scaled_dot_product_attention`` on meta tensors as the flash-attention kernel
    real runs use (``aten._scaled_dot_product_flash_attention_for_cpu``; CUDA's flash kernel saves the same)
    when there is no attention dropout:
    on meta, SDPA otherwise takes the math path, which saves two batch x heads x seq x seq matrices that a
    real run never holds, an error that grows with the sequence length (:data:`ATTENTION_KERNEL`). Grouped
    query attention (``enable_gqa``) keeps k and v at their own head count, as the kernel does."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is not F.scaled_dot_product_attention or not args or not args[0].is_meta:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        bound = dict(zip(names, args, strict=False))
        bound.update(kwargs)
        q, k, v = bound["query"], bound["key"], bound["value"]
        if q.dim() != 4 or float(bound.get("dropout_p") or 0.0) > 0.0:  # CPU's flash kernel has no dropout
            return func(*args, **kwargs)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q,
            k,
            v,
            float(bound.get("dropout_p") or 0.0),
            bool(bound.get("is_causal") or False),
            attn_mask=bound.get("attn_mask"),
            scale=bound.get("scale"),
        )[0]


def _hook_every_module(model: nn.Module, enter: Any, leave: Any, handles: list, modes: list) -> None:
    """Put every module of ``model`` (once each) in training mode and hook ``enter`` / ``leave`` around its
    forward; the hook handles and the former modes go to ``handles`` and ``modes`` as they are made (so a
    failure half-way leaves nothing to restore unknown)."""
    seen: set[int] = set()
    for m in model.modules():
        if id(m) in seen:
            continue
        seen.add(id(m))
        modes.append((m, m.training))
        m.training = True
        handles.append(m.register_forward_pre_hook(enter, with_kwargs=True, prepend=True))
        handles.append(m.register_forward_hook(leave, with_kwargs=True))


def _note_failed_module(err: BaseException, model: nn.Module, mod: nn.Module) -> None:
    """Note on ``err`` the path of ``mod`` (the innermost module whose forward was open when it was raised)."""
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    with contextlib.suppress(AttributeError):  # exceptions without a __dict__
        err._slapo_failed_in = names.get(id(mod), "")


def _hooked_pass(model: nn.Module, inputs: Any, pre, post, fake: bool, context, cancelled=None) -> float:
    """One forward in training mode with ``pre``/``post`` hooks on every module, inside ``context``
    (and ``FakeTensorMode`` if ``fake``); hooks and modes are restored. Returns seconds."""
    handles, modes = [], []
    running: list[nn.Module] = []  # modules whose forward is open: the last one is where a failure is

    def enter(mod, args, kwargs):
        if cancelled is not None and cancelled.is_set():
            raise RuntimeError("cancelled")
        running.append(mod)
        return pre(mod, args, kwargs)

    def leave(mod, args, kwargs, out):
        if running and running[-1] is mod:
            running.pop()
        return post(mod, args, kwargs, out)

    try:
        _hook_every_module(model, enter, leave, handles, modes)
        t0 = time.perf_counter()
        with (
            context,
            FlashSDPA(),
            FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext(),
        ):
            _call_model(model, inputs)
        return time.perf_counter() - t0
    except Exception as err:
        if running:
            _note_failed_module(err, model, running[-1])
        raise
    finally:
        for h in handles:
            h.remove()
        for m, mode in modes:
            m.training = mode


def estimate_activations(model: nn.Module, example_inputs: Any, cancelled=None) -> ActivationProfile:
    """Run one forward pass of ``model`` on meta tensors and record tensor bytes per module.

    Every leaf module's outputs and every module's tensor inputs are recorded with an identity, so
    that a tensor counted twice (a checkpointed block's input is the previous block's output) is
    summed once. The pass runs under ``torch.no_grad`` in training mode (dropout active; every
    module's mode is restored afterwards). A model with real weights is copied to meta first
    (:func:`slapo_lab.utils.meta_copy`); a meta model runs as is. If the forward reads a tensor value
    (``.item()``, ``bool(t)``), the pass is retried under ``FakeTensorMode``, which Hugging Face
    models treat as tracing.

    Args:
        model: the (scheduled) model; sync hooks of a simulated schedule keep per-rank shapes.
        example_inputs: dict of keyword arguments, tuple of positional arguments, or one tensor; any
            device (converted to meta).
        cancelled: a ``threading.Event``; once set, the pass stops at the next module (ScheduleError).

    Returns:
        ActivationProfile.

    Raises:
        ScheduleError: when the forward pass fails (one sentence with the original error).
    """
    model, inputs, path_of = _meta_pass_inputs(model, example_inputs)
    leaves = {id(m) for m in model.modules() if not m._modules}

    def run(fake: bool) -> ActivationProfile:
        prof = ActivationProfile(batch=_first_batch(inputs), fake=fake)
        ids: dict[int, int] = {}
        keep: list[torch.Tensor] = []  # keep ids unique while the pass runs

        def items(x) -> list[tuple[int, int, int, bool]]:
            out = []
            for t in _tensors(x):
                tid = ids.get(id(t))
                if tid is None:
                    tid = ids[id(t)] = len(ids)
                    keep.append(t)
                out.append((tid, t.numel(), t.element_size(), t.is_floating_point()))
            return out

        def pre(mod, args, kwargs):
            prof.mod_in.setdefault(path_of[id(mod)], []).extend(items((args, kwargs)))

        def post(mod, args, kwargs, out):
            if id(mod) in leaves:
                inputs_ids = {id(t) for t in _tensors((args, kwargs))}
                got = [
                    it for t, it in zip(_tensors(out), items(out), strict=False) if id(t) not in inputs_ids
                ]
                prof.leaf_out.setdefault(path_of[id(mod)], []).extend(got)

        prof.seconds = _hooked_pass(model, inputs, pre, post, fake, torch.no_grad(), cancelled)
        return prof

    return _run_with_fallback(run)


def _fail_sentence(err: Exception) -> str:
    msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    where = getattr(err, "_slapo_failed_in", None)
    where = f" in {where}" if where else (" in the model itself" if where == "" else "")
    return f"The meta forward pass for the activation estimate failed{where} ({type(err).__name__}: {msg})."


def _pass_error(err: Exception) -> ScheduleError:
    """The ScheduleError for a failed activation pass; ``.module`` is the path of the innermost module
    that was running (``""`` for the root, None when unknown)."""
    out = ScheduleError(_fail_sentence(err))
    out.module = getattr(err, "_slapo_failed_in", None)
    return out


@dataclass
class SavedProfile:
    """Tensors autograd saved for backward during one meta forward (see :func:`saved_activations`).

    Attributes:
        items: one ``(module path, bytes, element size, is floating)`` per unique storage, attributed to
            the innermost module running when it was first saved ("" = the root, outside every child).
        batch / seconds / fake: as in :class:`ActivationProfile`.
    """

    items: list[tuple[str, int, int, bool]] = field(default_factory=list)
    batch: int | None = None
    seconds: float = 0.0
    fake: bool = False


def saved_activations(
    model: nn.Module,
    example_inputs: Any,
    cancelled=None,
    after: Callable[[str], str] | None = None,
) -> SavedProfile:
    """Count the bytes autograd saves for backward in one forward pass on meta tensors.

    The forward runs with gradients enabled, in training mode, under
    ``torch.autograd.graph.saved_tensors_hooks``; every saved tensor's storage is counted once
    (views of one storage share it; storages of parameters and buffers are not activations). A
    checkpointed module saves only its inputs (and, under ``checkpoint(policy="selective")``, the outputs its policy
    keeps, told by :func:`slapo_lab.random.observe_selective_saves`), exactly as in a real run, so this matches what
    ``saved_tensors_hooks`` measures on real tensors (the engine benchmark checks it on BERT-base).
    Costs one meta forward with autograd recording (slower than :func:`estimate_activations`, and
    checkpoint changes need a new pass).

    Args:
        model / example_inputs / cancelled: as :func:`estimate_activations`.
        after: where a tensor saved after module ``path`` returned (and before the next module starts) is
            attributed: ``after(path)``; None keeps ``path`` (the module that just returned).

    Raises:
        ScheduleError: as :func:`estimate_activations`.
    """
    model, inputs, path_of = _meta_pass_inputs(model, example_inputs)
    weights = {t.untyped_storage()._cdata for t in list(model.parameters()) + list(model.buffers())}

    def run(fake: bool) -> SavedProfile:
        prof = SavedProfile(batch=_first_batch(inputs), fake=fake)
        where = [""]
        seen: dict[int, int] = {}  # storage -> index in prof.items
        keep: list[Any] = []

        def pack(t):
            st = t.untyped_storage()
            key = st._cdata
            if key in weights:
                return t
            i = seen.get(key)
            nbytes = st.nbytes()
            if i is None:
                seen[key] = len(prof.items)
                keep.append(st)
                prof.items.append((where[0], nbytes, t.element_size(), t.is_floating_point()))
            elif nbytes > prof.items[i][1]:
                path, _, esize, is_float = prof.items[i]
                prof.items[i] = (path, nbytes, esize, is_float)
            return t

        def pre(mod, args, kwargs):
            p = path_of[id(mod)]
            if p:
                where[0] = p

        def post(mod, args, kwargs, out):
            p = path_of[id(mod)]
            if p:
                where[0] = after(p) if after is not None else p

        grad_ctx = contextlib.ExitStack()
        grad_ctx.enter_context(torch.enable_grad())
        grad_ctx.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        grad_ctx.enter_context(observe_selective_saves(pack))  # what checkpoint(policy="selective") keeps
        prof.seconds = _hooked_pass(model, inputs, pre, post, fake, grad_ctx, cancelled)
        return prof

    return _run_with_fallback(run)


def _run_with_fallback(run):
    try:
        return run(False)
    except Exception as first:
        text = str(first)
        if "meta" not in text and "data-dependent" not in text.lower():
            raise _pass_error(first) from first
        try:
            return run(True)
        except Exception as err:
            raise _pass_error(err) from err
