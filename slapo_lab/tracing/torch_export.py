"""What ``torch.export`` is given and how its output is repaired (the fallback when ``torch.fx`` cannot
trace a module: transformers 5.x code unpacks shapes and takes ``**kwargs``).

* :func:`record_example_inputs` runs one forward pass and remembers every submodule's arguments, so that any
  submodule can be exported later (Slapo's ``tracer="pytorch"`` needs no inputs; ``torch.export`` does).
* The arguments of an export: the leaves whose call signature is preserved (:func:`_export_leaves`,
  :func:`_must_stay_leaf`), dynamic shapes (``Dim.AUTO``), keyword extras, concrete arguments.
* After ``torch.export.unflatten`` (PyTorch 2.13): the original parameter and buffer objects are put back
  (:func:`_restore_tensors`), and a mis-wired preserved call is found (:func:`_broken_call`) so that the
  export is retried.

The driver, ``_export_trace``, and the ``EXPORT_DYNAMIC_SHAPES`` switch live in :mod:`slapo_lab.tracing`.
"""

from __future__ import annotations

import contextlib
import inspect
import keyword

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.export import Dim

from ..errors import ScheduleError
from .base import (
    _DUMMY_KEY,
    _EXAMPLES_KEY,
    _detach,
    _is_builtin,
    _is_container,
    _is_separate_bias,
    _join,
    _normalize_inputs,
    _on_meta,
    _Opts,
    _short,
    _to_meta,
    _where,
    is_traced,
    needs_call,
)
from .graphs import _POSITIONAL


# ------------------------------------------------------------------------------------------------
# torch.export
# ------------------------------------------------------------------------------------------------
def _export_leaves(mod: nn.Module, rel: str, opts: _Opts) -> list[str]:
    leaves: list[str] = []

    def walk(m: nn.Module, qn: str) -> None:
        for name, child in m.named_children():
            cq = _join(qn, name)
            if _is_container(child):
                walk(child, cq)
            elif opts.true_leaf(child, _join(rel, cq)) or not opts.recursive:
                leaves.append(cq)
            else:
                walk(child, cq)

    walk(mod, "")
    return leaves


def _dynamic_shapes(mod: nn.Module, args: tuple, kwargs: dict):
    sig = inspect.signature(mod.forward)
    bound = sig.bind(*args, **kwargs)

    def spec(x):
        return pytree.tree_map(
            lambda t: (
                {i: Dim.AUTO for i in range(t.dim())} if isinstance(t, torch.Tensor) and t.dim() else None
            ),
            x,
        )

    def has_tensor(x) -> bool:
        return any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(x))

    # an argument without tensors gets None as a whole (a ``**kwargs`` dict of Nones would not match)
    return {name: spec(v) if has_tensor(v) else None for name, v in bound.arguments.items()}


@contextlib.contextmanager
def _named_extras(mod: nn.Module, kwargs: dict):
    """While exporting with dynamic shapes, give ``mod`` a ``forward`` that names the ``**kwargs`` entries of
    this call as keyword-only parameters (the same object, its class swapped for the duration): torch.export
    cannot match dynamic shapes to a ``**kwargs`` dict (its ``_get_range_constraints`` moves the entries to
    the top level, where ``_check_dynamic_shapes`` does not allow them)."""
    try:
        sig = inspect.signature(type(mod).forward)
    except (TypeError, ValueError):
        sig = None
    params = list(sig.parameters.values()) if sig is not None else []
    extras = [k for k in kwargs if k not in sig.parameters] if sig is not None else []
    if (
        not extras
        or any(p.kind == p.VAR_POSITIONAL for p in params)
        or not all(k.isidentifier() and not keyword.iskeyword(k) for k in extras)
    ):
        yield
        return
    cls = type(mod)
    named = [p for p in params[1:] if p.kind != p.VAR_KEYWORD]
    env = {"_orig_forward": cls.forward, "_defaults": {p.name: p.default for p in named}}
    head, call = ["self"], ["self"]
    kw_only = False
    for p in named:
        if p.kind == p.KEYWORD_ONLY and not kw_only:
            head.append("*")
            kw_only = True
        head.append(p.name if p.default is p.empty else f"{p.name}=_defaults[{p.name!r}]")
        call.append(f"{p.name}={p.name}" if p.kind != p.POSITIONAL_ONLY else p.name)
    if not kw_only:
        head.append("*")
    head += [f"{k}=None" for k in extras]
    call += [f"{k}={k}" for k in extras]
    exec(f"def forward({', '.join(head)}):\n    return _orig_forward({', '.join(call)})", env)  # noqa: S102
    mod.__class__ = type(cls.__name__, (cls,), {"forward": env["forward"], "__module__": cls.__module__})
    try:
        yield
    finally:
        mod.__class__ = cls


def _set_path(root: nn.Module, path: str, value: nn.Module) -> None:
    *prefix, last = path.split(".")
    owner = root
    for atom in prefix:
        nxt = owner._modules.get(atom)
        if nxt is None:
            nxt = nn.Module()
            owner.add_module(atom, nxt)
        owner = nxt
    owner.add_module(last, value)


def _restore_tensors(um: nn.Module, mod: nn.Module, leaves: list[str]) -> None:
    """Put the original parameter and buffer objects back (unflatten clones them)."""
    inside = tuple(f"{leaf}." for leaf in leaves)
    for kind, items in (
        ("param", mod.named_parameters(remove_duplicate=False)),
        ("buffer", mod.named_buffers(remove_duplicate=False)),
    ):
        for name, t in items:
            if name.startswith(inside):
                continue
            prefix, _, fname = name.rpartition(".")
            try:
                owner = um.get_submodule(prefix) if prefix else um
                orig_owner = mod.get_submodule(prefix) if prefix else mod
            except AttributeError:
                continue
            if kind == "param":
                owner._buffers.pop(fname, None)
                owner._parameters[fname] = t
            else:
                owner._parameters.pop(fname, None)
                owner._buffers[fname] = t
                if fname in orig_owner._non_persistent_buffers_set:
                    owner._non_persistent_buffers_set.add(fname)


def _broken_call(um: nn.Module, leaf_mods: dict[str, nn.Module]) -> str | None:
    """The first submodule an unflattened graph calls with inputs it cannot take, or None; ``leaf_mods`` are
    the preserved leaves (path -> the original module that will take the call).

    ``torch.export.unflatten`` (PyTorch 2.13) mis-wires calls of preserved-signature leaves: with a leaf that
    reads a value cast in its parent (LlamaRMSNorm's ``hidden_states.to(float32)``) the child's graph gets
    placeholders (``to_6`` ...) its caller never passes; with dynamic shapes a leaf can be passed an extra
    input (GPT-2's ``Conv1D``).
    """
    for qn, owner in um.named_modules():
        graph = getattr(owner, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        for node in graph.nodes:
            if node.op != "call_module":
                continue
            path = _join(qn, node.target)
            try:
                sub = leaf_mods[path] if path in leaf_mods else owner.get_submodule(node.target)
            except AttributeError:
                continue
            sub_graph = getattr(sub, "graph", None)
            if path not in leaf_mods and isinstance(sub_graph, fx.Graph):
                placeholders = [n for n in sub_graph.nodes if n.op == "placeholder"]
                wanted = [n for n in placeholders if not n.args]
                ok = len(wanted) <= len(node.args) + len(node.kwargs) <= len(placeholders)
            else:
                try:
                    inspect.signature(sub.forward).bind(*node.args, **node.kwargs)
                    ok = True
                except TypeError:
                    ok = False
                except ValueError:  # no signature to check
                    ok = True
            if not ok:
                return _join(qn, node.target)
    return None


def _must_stay_leaf(m: nn.Module, rel: str, opts: _Opts) -> bool:
    """A leaf that must stay a module (not one kept whole only for its shard rule): a ``torch.nn`` layer, a
    user leaf, or a module with call state or a graph already."""
    if opts.user_leaf(m, rel) or needs_call(m) or is_traced(m) or _is_builtin(m):
        return True
    return _is_separate_bias(m) and not opts.flatten


def _with_concrete(mod: nn.Module, args: tuple, kwargs: dict, concrete: dict) -> tuple[tuple, dict]:
    """The example call with ``concrete`` values in place: an argument the call gives by position keeps its
    position (Slapo's ``concrete_args`` name every other forward parameter)."""
    try:
        pos = [p.name for p in inspect.signature(mod.forward).parameters.values() if p.kind in _POSITIONAL]
    except (TypeError, ValueError):
        pos = []
    args, kwargs = list(args), dict(kwargs)
    for name, value in concrete.items():
        i = pos.index(name) if name in pos else len(args)
        if i < len(args):
            args[i] = value
        else:
            kwargs[name] = value
    return tuple(args), kwargs


def _without_none_extras(mod: nn.Module, kwargs: dict) -> dict:
    """``kwargs`` without the ``None`` entries that only a ``**kwargs`` parameter takes (HF 5.x passes
    ``position_ids=None`` that way): a callee reads them with ``kwargs.get``, so absent is the same, and
    torch.export cannot match dynamic shapes to a ``**kwargs`` dict (``_get_range_constraints`` moves its
    entries to the top level)."""
    try:
        params = inspect.signature(mod.forward).parameters
    except (TypeError, ValueError):
        return kwargs
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params or v is not None}


# ------------------------------------------------------------------------------------------------
# Example inputs
# ------------------------------------------------------------------------------------------------
def record_example_inputs(sch, inputs) -> dict[str, tuple[tuple, dict]]:
    """Run one forward pass of ``sch.mod`` and remember every submodule's call arguments.

    Forward-pre hooks capture each submodule's ``(args, kwargs)`` at its first call (before any
    schedule hook changes them); they are stored per path on the schedule tree, so that
    :meth:`TracingMixin.trace` can export any submodule on demand. If the model is on the ``meta``
    device, tensors in ``inputs`` are moved to ``meta`` first (no memory, no compute). Record before
    sharding: recorded shapes are the unsharded ones.

    Args:
        sch: a schedule node (usually the root).
        inputs: what ``sch.mod`` takes: a tensor, a tuple of positional arguments, a dict of keyword
            arguments (``{"input_ids": ids, "use_cache": False}``) or an ``(args, kwargs)`` pair.

    Returns:
        dict: path -> ``(args, kwargs)`` of every module that ran (a view of the stored record).

    Raises:
        ScheduleError: for malformed ``inputs`` or when the forward pass fails.
    """
    args, kwargs = _normalize_inputs(inputs, "inputs")
    mod = sch.mod
    if _on_meta(mod):
        args, kwargs = _to_meta((args, kwargs))
    names: dict[int, list[str]] = {}
    for qn, m in mod.named_modules(remove_duplicate=False):
        names.setdefault(id(m), []).append(_join(sch.path, qn))
    captured: dict[str, tuple[tuple, dict]] = {}
    seen: set[int] = set()
    handles = []

    def hook(m, a, k):
        if id(m) not in seen:
            seen.add(id(m))
            for path in names.get(id(m), ()):
                captured[path] = _detach((tuple(a), dict(k)))

    try:
        for m in {id(m): m for m in mod.modules()}.values():
            handles.append(m.register_forward_pre_hook(hook, with_kwargs=True, prepend=True))
        with torch.no_grad():
            mod(*args, **kwargs)
    except Exception as err:
        raise ScheduleError(f"Running {_where(sch)} on the example inputs failed: {_short(err)}.") from err
    finally:
        for h in handles:
            h.remove()
    sch._top.extra.pop(_DUMMY_KEY, None)  # the user's inputs: exports specialise to their shapes
    store = sch._top.extra.setdefault(_EXAMPLES_KEY, {})
    store.update(captured)
    return store
