"""The forward call order of a model's modules, recorded once on a meta copy.

A pipeline cut (``sch[p].cut_pipeline_stage()``) ends a stage right after module ``p`` returns (Slapo:
the marked module is the *last* module of its stage). Whether a set of cuts can be honoured depends
on the order the modules run in, which only a forward pass shows: a module that runs twice has two
"afters"; a cut right after another cut (nothing runs in between) leaves an empty stage; a module
that never runs has no "after" at all. :func:`call_order` records, on a meta-device copy of the model
(no tensor memory, no real compute), every module's entries and exits in execution order, together
with a running count of torch-level operations (``__torch_function__`` calls) so that "no work
between two cuts" can be told from "no module between two cuts".

The primitive calls :func:`check_cut` lazily; the order is cached on the schedule tree
(``sch._top.extra["pipeline_call_order"]``) and recomputed when the module tree changes.

Example inputs are found in this order: the ``example_inputs`` argument; ``set_example_inputs(sch,
inputs)`` (stored as ``sch._top.extra["example_inputs"]``); a Hugging Face model's ``dummy_inputs``
(the root's, or a descendant's ``input_ids`` fed to the root's ``input_ids`` / first parameter).
Without any, the call-order checks are skipped and ``build_pipeline`` checks the cuts instead.

It sits in the bottom layer (it imports only ``errors``, ``module_state`` and ``utils``): the split inference
(:mod:`slapo_lab.sharding.infer`), the pipeline primitive, the numeric check and :mod:`slapo_lab.pipeline` read
the example inputs and the call order from here.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .errors import ScheduleError
from .module_state import META_ATTR
from .utils import meta_copy, to_meta

_CACHE_KEY = "pipeline_call_order"
_INPUTS_KEY = "example_inputs"
#: ``extra`` key of the top schedule: the unscheduled model it was made from, with real weights, where the caller
#: gave one (:func:`slapo_lab.preset_check.set_reference`; the editor's user model).
REFERENCE_KEY = "numeric_reference"
#: ``extra`` key of the top schedule: the real values of the example inputs' integer tensors (token ids, masks;
#: at most :data:`MAX_KEPT_VALUES` elements each), which the numeric check runs on instead of random ids: a
#: multimodal model counts its placeholder tokens against its tower's output (:mod:`slapo_lab.multimodal_inputs`).
VALUES_KEY = "example_input_values"
MAX_KEPT_VALUES = 1 << 16


@dataclass
class CallOrder:
    """Module calls of one forward pass, in execution order.

    Attributes:
        calls: path -> list of ``(enter_seq, exit_seq, ops_at_enter, ops_at_exit)``, one per call;
            ``*_seq`` index a global event sequence, ``ops_*`` the number of torch-level ops run so far.
        n_ops: torch-level ops in the whole forward.
        error: why no order could be recorded ("" when it was).
    """

    calls: dict[str, list[tuple[int, int, int, int]]] = field(default_factory=dict)
    n_ops: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    def count(self, path: str) -> int:
        """How many times the module at ``path`` ran."""
        return len(self.calls.get(path, ()))

    def exit_point(self, path: str) -> tuple[int, int]:
        """``(exit_seq, ops_at_exit)`` of the module's (only) call."""
        c = self.calls[path][0]
        return c[1], c[3]


_BOOL = torch.Tensor.__bool__


class _OpCounter(TorchFunctionMode):
    """Counts torch-level calls; a data-dependent ``if t:`` on a one-element meta tensor is taken as True
    (meta tensors have no values; HF's ``if (mask == 0).all():`` fast paths then take the usual branch)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (
            func is _BOOL
            and args
            and isinstance(args[0], torch.Tensor)
            and args[0].is_meta
            and args[0].numel() == 1
        ):
            return True
        self.n += 1
        return func(*args, **(kwargs or {}))


def _strip_schedule(model: nn.Module) -> None:
    """Remove what primitives installed (instance forwards, hooks): call order does not depend on them,
    and their collectives must not run on meta tensors."""
    for m in model.modules():
        m._forward_hooks.clear()
        m._forward_pre_hooks.clear()
        for d in (
            "_forward_hooks_with_kwargs",
            "_forward_hooks_always_called",
            "_forward_pre_hooks_with_kwargs",
        ):
            if hasattr(m, d):
                getattr(m, d).clear()
        if META_ATTR in m.__dict__ and "forward" in m.__dict__:
            del m.__dict__["forward"]


def _split_inputs(example_inputs) -> tuple[tuple, dict]:
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    raise ScheduleError(
        "example_inputs must be a dict of keyword arguments, a tuple of positional arguments "
        f"or one tensor, not a {type(example_inputs).__name__}."
    )


def dummy_inputs(model: nn.Module):
    """Example inputs guessed for a Hugging Face model (or a wrapper around one), or None."""
    d = getattr(model, "dummy_inputs", None)
    if isinstance(d, dict) and d:
        return dict(d)
    ids = None
    for m in model.modules():
        d = getattr(m, "dummy_inputs", None) if m is not model else None
        if isinstance(d, dict) and isinstance(d.get("input_ids"), torch.Tensor):
            ids = d["input_ids"]
            break
    if ids is None:
        return None
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.name == "input_ids" for p in params):
        return {"input_ids": ids}
    if params and params[0].kind in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    ):
        return (ids,)
    return None


def _signature(model: nn.Module) -> tuple:
    return tuple(id(m) for m in model.modules())


def record_call_order(
    model: nn.Module,
    example_inputs=None,
    *,
    args: tuple = (),
    kwargs: dict | None = None,
    copied: bool = False,
    cancelled=None,
) -> CallOrder:
    """Run ``model`` once on a meta copy with module hooks and return its :class:`CallOrder`.

    Inputs: ``example_inputs`` (a tuple of positional tensors, a dict of keyword tensors, or one
    tensor), or ``args`` / ``kwargs``. ``copied``: ``model`` is already a meta copy this call may change
    (hooks, stripped schedule forwards). ``cancelled``: a ``threading.Event`` that stops the forward at the
    next module once set (the order then has an error). Never raises for a model that fails on meta tensors:
    the failure is returned in ``.error``.
    """
    order = CallOrder()
    try:
        if example_inputs is not None:
            args, kwargs = _split_inputs(example_inputs)
        kwargs = dict(kwargs or {})
        copy = model if copied else meta_copy(model)
        _strip_schedule(copy)
        names: dict[int, list[str]] = {}
        for name, m in copy.named_modules(remove_duplicate=False):
            names.setdefault(id(m), []).append(name)
        counter = _OpCounter()
        seq = [0]
        open_calls: dict[int, list[tuple[int, int]]] = {}

        def pre(mod, a):
            if cancelled is not None and cancelled.is_set():
                raise RuntimeError("cancelled")
            open_calls.setdefault(id(mod), []).append((seq[0], counter.n))
            seq[0] += 1

        def post(mod, a, out):
            s0, o0 = open_calls[id(mod)].pop()
            for n in names[id(mod)]:
                order.calls.setdefault(n, []).append((s0, seq[0], o0, counter.n))
            seq[0] += 1

        done = set()
        for m in copy.modules():
            if id(m) in done:
                continue
            done.add(id(m))
            m.register_forward_pre_hook(pre)
            m.register_forward_hook(post)
        with torch.no_grad(), counter:
            copy(*to_meta(args), **to_meta(kwargs))
        order.n_ops = counter.n
    except Exception as err:  # noqa: BLE001 - any failure means "order unknown"
        order.calls.clear()
        order.error = f"{type(err).__name__}: {err}".splitlines()[0][:300]
    return order


def set_example_inputs(sch, example_inputs) -> None:
    """Remember example inputs for the schedule tree (stored as meta tensors, and the values of small integer
    tensors: :data:`VALUES_KEY`).

    They are used to record the forward call order that ``cut_pipeline_stage`` checks against.
    """
    _split_inputs(example_inputs)  # type check
    top = sch._top
    top.extra[_INPUTS_KEY] = to_meta(example_inputs)
    top.extra[VALUES_KEY] = {
        k: v.detach().clone()
        for k, v in (example_inputs.items() if isinstance(example_inputs, dict) else ())
        if isinstance(v, torch.Tensor)
        and not v.is_meta
        and not v.is_floating_point()
        and v.numel() <= MAX_KEPT_VALUES
    }
    top.extra.pop(_CACHE_KEY, None)


def cached_call_order(sch) -> CallOrder | None:
    """The :class:`CallOrder` :func:`call_order` would return without running the model, or None when it
    would have to record it first (a meta forward: about a second at 80 layers)."""
    root = sch.get_top_schedule().mod
    cached = sch._top.extra.get(_CACHE_KEY)
    if cached is not None and cached[0] == (_signature(root), "default"):
        return cached[1]
    return None


def record_for_cache(sch, lock, cancelled=None) -> bool:
    """Record :func:`call_order`'s order and cache it, for a background thread: the schedule's state is read
    under ``lock`` (the editor's), the meta copy and the forward run without it (no click waits for them), and
    the order is cached only if the schedule still has the modules read (a copy a click changed is dropped).

    Args:
        sch: any node of the schedule.
        lock: held while reading the schedule's state and while caching.
        cancelled: a ``threading.Event``; once set, the forward stops at the next module.

    Returns:
        True when a new order was cached (False: cached already, no inputs to run, cancelled, or stale).
    """
    with lock:
        if cached_call_order(sch) is not None:
            return False
        top = sch._top
        root = sch.get_top_schedule().mod
        inputs = top.extra.get(_INPUTS_KEY)
        if inputs is None:
            inputs = dummy_inputs(root)
        if inputs is None:
            return False
        key = (_signature(root), "default")
    try:  # without the lock, so that no click waits for it: a copy torn by a click is discarded below
        copy = meta_copy(root)
    except Exception:  # noqa: BLE001 - a click changed the modules while they were copied
        return False
    order = record_call_order(copy, inputs, copied=True, cancelled=cancelled)
    if cancelled is not None and cancelled.is_set():
        return False
    with lock:
        if _signature(root) != key[0]:
            return False
        top.extra[_CACHE_KEY] = (key, order)
    return True


def call_order(sch, example_inputs=None) -> CallOrder:
    """The cached :class:`CallOrder` of the schedule's root module (recorded on first use)."""
    root = sch.get_top_schedule().mod
    top = sch._top
    sig = _signature(root)
    inputs = example_inputs
    if inputs is None:
        inputs = top.extra.get(_INPUTS_KEY)
    if inputs is None:
        inputs = dummy_inputs(root)
    key = (sig, id(inputs) if example_inputs is not None else "default")
    cached = top.extra.get(_CACHE_KEY)
    if cached is not None and cached[0] == key:
        return cached[1]
    if inputs is None:
        order = CallOrder(error="no example inputs (use slapo_lab.pipeline.set_example_inputs(sch, inputs))")
    else:
        order = record_call_order(root, inputs)
    if example_inputs is None:
        top.extra[_CACHE_KEY] = (key, order)
    return order


def _runs_twice_message(path: str, order: CallOrder) -> str:
    parts = path.split(".")
    outer = path
    for i in range(1, len(parts)):
        anc = ".".join(parts[:i])
        if order.count(anc) > 1:
            outer = anc
            break
    n = order.count(path)
    if outer != path:
        return (
            f"Cannot cut a pipeline stage after {path}: it sits inside {outer}, which runs "
            f"{order.count(outer)} times in one forward pass, so the cut would have {n} places; "
            f"cut after {outer} or outside it."
        )
    return (
        f"Cannot cut a pipeline stage after {path}: it runs {n} times in one forward pass, so the cut "
        "would have several places; cut after a module that runs once."
    )


def stage_ops(cuts: list[str], order: CallOrder) -> tuple[list[str], list[int]]:
    """Cuts sorted by forward order and the number of torch-level ops in each resulting stage."""
    pts = sorted((order.exit_point(p), p) for p in cuts)
    ops, prev = [], 0
    for (_, o), _p in pts:
        ops.append(o - prev)
        prev = o
    ops.append(order.n_ops - prev)
    return [p for _, p in pts], ops


def check_cuts(cuts: list[str], order: CallOrder, new: str | None = None) -> None:
    """Raise ScheduleError if the cuts (with ``new`` added) cannot be honoured under ``order``.

    Raises:
        ScheduleError: a cut module runs more than once or never, or a stage would be empty.
    """
    if not order.ok:
        return
    all_cuts = list(cuts) + ([new] if new is not None else [])
    for p in all_cuts:
        n = order.count(p)
        if n == 0:
            raise ScheduleError(
                f"Cannot cut a pipeline stage after {p}: it does not run in the forward pass "
                "with the example inputs, so there is no point after it."
            )
        if n > 1:
            raise ScheduleError(_runs_twice_message(p, order))
    sorted_cuts, ops = stage_ops(all_cuts, order)
    for i, k in enumerate(ops):
        if k:
            continue
        what = new or (sorted_cuts[i] if i < len(sorted_cuts) else sorted_cuts[-1])
        if i == 0:
            raise ScheduleError(
                f"Cutting after {what} would leave the first pipeline stage empty: no operation "
                f"runs up to and including {sorted_cuts[0]}."
            )
        if i == len(sorted_cuts):
            raise ScheduleError(
                f"Cutting after {what} would leave the last pipeline stage empty: nothing runs "
                f"after {sorted_cuts[-1]}."
            )
        raise ScheduleError(
            f"Cutting after {what} would leave an empty pipeline stage: nothing runs between the "
            f"end of {sorted_cuts[i - 1]} and the end of {sorted_cuts[i]}."
        )


def check_cut(sch) -> None:
    """The call-order checks of ``sch.cut_pipeline_stage()`` (used by the primitive).

    Raises:
        ScheduleError: see :func:`check_cuts`.
    """
    order = call_order(sch)
    check_cuts(list(sch.metadata.primitives["cut_pipeline_stage"]), order, new=sch.path)
