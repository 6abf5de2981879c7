"""Tracing by need, and finding nodes and subgraphs in the traced graphs.

Slapo (``slapo.schedule.Schedule.trace`` / ``trace_until`` / ``find_node`` / ``find_subgraph`` /
``find``; seed ``000_dd5d83f90250128c.txt``, and ``slapo/tracer.py``, ``slapo/pattern.py``) traces
modules with ``torch.fx``. On PyTorch 2.13 + transformers 5.x, ``torch.fx.symbolic_trace`` still
traces small submodules (``BertIntermediate``, ``GPT2MLP``, ``LlamaMLP``) but fails on every full
HF model and on their attention and decoder layers (``**kwargs``, unpacked shapes). So
:meth:`TracingMixin.trace` tries ``torch.fx`` first and falls back to ``torch.export.export``
(``strict=False``) + ``torch.export.unflatten``, which needs example inputs: pass ``example_inputs=``,
or call :func:`record_example_inputs` once, which runs one forward pass and remembers every submodule's
arguments, so any submodule can be exported on demand. Slapo's ``tracer="pytorch"`` without either
records a HuggingFace model's ``dummy_inputs`` (``use_cache=False``) and exports shape-generic
(``Dim.AUTO``).

What tracing does to the schedule (paths never change):

* ``sch.mod`` becomes a ``torch.fx.GraphModule`` (:class:`TracedGraphModule`, named after the class it
  replaces), registered on the parent with ``setattr``; the schedule's children are re-mirrored. Under
  torch.export every unflattened level becomes one: the root takes the original module's call (its
  arguments by position or keyword, defaults left out; :class:`_CallInfo`), the levels below take flat
  tensors from the root's graph (they cannot be swapped for a module of the original signature).
* ``flatten=True`` inlines every non-leaf submodule into one graph (fx, or the torch.export hierarchy
  inlined); as in Slapo, the inlined submodules are then no schedule nodes (``sch.get_module`` still
  reaches them, the leaves are ``call_module`` nodes with dotted targets).
* Parameters and buffers stay the same tensor objects (``torch.export.unflatten`` clones them; the
  originals are put back).
* *Leaf* modules are kept as they are (the same objects, with their ``_slapo_meta`` state and hooks)
  and appear as ``call_module`` nodes: ``torch.nn`` layers, layers with a shard rule (HF ``Conv1D``,
  norms, ``nn.Linear`` subclasses), modules that already carry a hook-based primitive (sync,
  checkpoint, fork_rng, a sharded forward), modules that are already traced, and ``leaf_modules``.
  Under ``torch.export`` leaves are exported with ``preserve_module_call_signature`` and swapped back,
  so they keep their call convention (and can be replaced later). Where ``torch.export.unflatten``
  (PyTorch 2.13) mis-wires a preserved call (LlamaRMSNorm, GPT-2's ``Conv1D`` under dynamic shapes),
  the export is retried with static shapes, then with only the leaves that must stay modules.
* A ``torch.export`` graph is specialised to the module's train/eval mode and to the non-tensor
  arguments; with the user's inputs (unless :data:`EXPORT_DYNAMIC_SHAPES` is set) to their shapes too.
  The traced root checks its inputs and raises one sentence on another shape or non-tensor value.

Graph queries return Slapo's types: :meth:`~TracingMixin.find_node` a list of
``(parent path, fx.Node)``, :meth:`~TracingMixin.find_subgraph` a list of subgraphs, each a list of
``(parent path, fx.Node)`` in graph order; the parent path is relative to the schedule node the
query was called on (``""`` for the node itself).

The package: this module holds the drivers (``_fx_trace``, ``_export_trace``) and :class:`TracingMixin`;
:mod:`~slapo_lab.tracing.base` the options and leaf rules, :mod:`~slapo_lab.tracing.graphs` the graph module
types and graph edits, :mod:`~slapo_lab.tracing.torch_export` the export's arguments and repairs and
:func:`record_example_inputs`, :mod:`~slapo_lab.tracing.patterns` the pattern matcher.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import types
import warnings
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from ..errors import ScheduleError
from .base import (
    _DUMMY_KEY,
    _compile_regex,
    _fetch,
    _interp_types,
    _is_container,
    _is_direct_child,
    _join,
    _make_opts,
    _mark_orig,
    _on_meta,
    _Opts,
    _short,
    _to_meta,
    _Tracer,
    _where,
)
from .base import _EXAMPLES_KEY as _EXAMPLES_KEY
from .base import call_module as call_module
from .base import is_traced as is_traced
from .base import needs_call as needs_call
from .base import orig_class as orig_class
from .graphs import HOOK_DICTS as HOOK_DICTS
from .graphs import TracedGraphModule as TracedGraphModule
from .graphs import (
    _CallInfo,
    _flat_containers,
    _flatten_export,
    _meta_vals,
    _simplify_pytree_calls,
    _to_graph_modules,
)
from .graphs import edit_graph as edit_graph
from .graphs import hides_children as hides_children
from .graphs import lost_call_signature as lost_call_signature
from .graphs import refresh as refresh
from .patterns import ModulePattern as ModulePattern
from .patterns import Pattern as Pattern
from .patterns import _find_subgraphs, _graph_owners, _pattern_nodes, _trace_pattern
from .patterns import op_key as op_key
from .torch_export import (
    _broken_call,
    _dynamic_shapes,
    _export_leaves,
    _must_stay_leaf,
    _named_extras,
    _restore_tensors,
    _set_path,
    _with_concrete,
    _without_none_extras,
)
from .torch_export import record_example_inputs as record_example_inputs

log = logging.getLogger("slapo_lab")

__all__ = ["ModulePattern", "Pattern", "TracingMixin", "call_module", "is_traced", "record_example_inputs"]

#: Export tensor dimensions as ``Dim.AUTO`` (dynamic where the code allows). Off by default: it makes
#: ``torch.export`` 2-5x slower, and a static export fails loudly (an input-shape check in the
#: unflattened module) when called with other shapes.
EXPORT_DYNAMIC_SHAPES = False


# ------------------------------------------------------------------------------------------------
# The drivers: torch.fx, then torch.export
# ------------------------------------------------------------------------------------------------
def _fx_trace(mod: nn.Module, rel: str, opts: _Opts) -> fx.GraphModule:
    """Trace ``mod`` (at ``rel`` below the traced root) with torch.fx; raises whatever fx raises."""

    def is_leaf(m: nn.Module, qn: str) -> bool:
        if opts.true_leaf(m, _join(rel, qn)):
            return True
        return not opts.flatten and _is_direct_child(mod, qn)

    tracer = _Tracer(is_leaf)
    graph = tracer.trace(mod, concrete_args=opts.concrete_args if rel == "" else None)
    name = orig_class(mod).__name__
    if opts.flatten:
        gm = TracedGraphModule(mod, graph, class_name=name)
        _flat_containers(gm, {id(m) for m in mod.modules()})
    else:
        root: dict[str, Any] = {}
        for node in graph.nodes:
            if node.op not in ("call_module", "get_attr") or node.target in root:
                continue
            obj = _fetch(mod, node.target)
            if (
                node.op == "call_module"
                and opts.recursive
                and not opts.true_leaf(obj, _join(rel, node.target))
            ):
                obj = _trace_child(obj, _join(rel, node.target), opts)
            root[node.target] = obj
        gm = TracedGraphModule(root, graph, class_name=name)
    _mark_orig(gm, mod)
    return gm


def _trace_child(mod: nn.Module, rel: str, opts: _Opts) -> nn.Module:
    """Trace a child during a recursive trace; a child that cannot be traced stays as it is."""
    try:
        return _fx_trace(mod, rel, opts)
    except Exception as fx_err:  # noqa: BLE001 - any tracing failure keeps the child eager
        example = opts.example_for(rel) if opts.tracer == "auto" else None
        if example is not None:
            try:
                return _export_trace(mod, rel, opts, example)
            except Exception as ex_err:  # noqa: BLE001
                log.debug("%s stays untraced: fx: %s; export: %s", rel, _short(fx_err), _short(ex_err))
                return mod
        log.debug("%s stays untraced: fx: %s", rel, _short(fx_err))
        return mod


def _export(mod: nn.Module, args: tuple, kwargs: dict, leaves: list[str], dynamic: bool = False):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dyn = None
        if dynamic or EXPORT_DYNAMIC_SHAPES:
            try:
                with _named_extras(mod, kwargs):
                    dyn = _dynamic_shapes(mod, args, kwargs)
            except Exception:  # noqa: BLE001 - no signature to bind: export static shapes
                dyn = None
        if dyn is not None:
            try:
                with _named_extras(mod, kwargs):
                    return torch.export.export(
                        mod,
                        args,
                        kwargs,
                        dynamic_shapes=dyn,
                        strict=False,
                        preserve_module_call_signature=tuple(leaves),
                    )
            except Exception as err:  # noqa: BLE001 - retry with static shapes, which reports the real error
                log.debug("dynamic-shape export failed (%s); retrying with static shapes", _short(err))
        return torch.export.export(
            mod, args, kwargs, strict=False, preserve_module_call_signature=tuple(leaves)
        )


def _export_unflatten(
    mod: nn.Module, args: tuple, kwargs: dict, leaves: list[str], dynamic: bool
) -> nn.Module:
    """``torch.export.unflatten`` of ``mod`` exported on ``(args, kwargs)`` with ``leaves`` preserved."""
    ep = _export(mod, args, kwargs, leaves, dynamic=dynamic)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with contextlib.redirect_stdout(io.StringIO()):  # unflatten prints "Checking mutability ..."
            return torch.export.unflatten(ep)


def _export_trace(mod: nn.Module, rel: str, opts: _Opts, example: tuple) -> fx.GraphModule:
    """Export ``mod`` with torch.export, unflatten it, put leaves and tensors back and turn every graph into a
    :class:`TracedGraphModule` (the root a :class:`_CallGraphModule`); ``flatten=True`` then inlines them all
    into the root's graph."""
    args, kwargs = _export_inputs(mod, rel, opts, example)
    um, leaves = _unflatten_wired(mod, rel, opts, args, kwargs)
    signature = um.module_call_graph[0].signature
    reordered = {k: kwargs[k] for k in signature.in_spec.child(1).context} if kwargs else kwargs
    flat_with_path, _ = pytree.tree_flatten_with_path((tuple(args), reordered))
    placeholders = [n for n in um.graph.nodes if n.op == "placeholder"]
    call = _CallInfo(orig_class(mod).__name__, mod, signature.in_spec, flat_with_path, placeholders)
    for qn in leaves:
        _set_path(um, qn, mod.get_submodule(qn))
    _restore_tensors(um, mod, leaves)
    _tidy_graphs(um, set(leaves))
    gm = _to_graph_modules(um, mod, leaves, call, signature.out_spec)
    if opts.flatten:
        gm = _flatten_export(gm, mod, leaves)
    _mark_orig(gm, mod)
    return gm


def _export_inputs(mod: nn.Module, rel: str, opts: _Opts, example: tuple) -> tuple[tuple, dict]:
    """The ``(args, kwargs)`` to export ``mod`` on: the recorded ``example`` with the root's concrete
    arguments, on ``meta`` for a meta module, without ``None`` extras for dynamic shapes."""
    args, kwargs = example
    if rel == "" and opts.concrete_args:
        args, kwargs = _with_concrete(mod, args, kwargs, opts.concrete_args)
    if _on_meta(mod):
        args, kwargs = _to_meta((args, kwargs))
    if opts.dynamic:
        kwargs = _without_none_extras(mod, kwargs)
    return args, kwargs


def _unflatten_wired(
    mod: nn.Module, rel: str, opts: _Opts, args: tuple, kwargs: dict
) -> tuple[Any, list[str]]:
    """``(unflattened export, the leaves it preserves)``, tried until torch.export.unflatten wires every call
    right (see :func:`_broken_call`): static shapes, then fewer preserved leaves (only those that must stay
    modules).

    Raises:
        ScheduleError: when every attempt mis-wires a call (naming it).
    """
    leaves = _export_leaves(mod, rel, opts)
    needed = [q for q in leaves if _must_stay_leaf(mod.get_submodule(q), _join(rel, q), opts)]
    attempts = [(leaves, opts.dynamic), (leaves, False), (needed, opts.dynamic), (needed, False)]
    tried, broken = [], None
    for attempt in attempts:
        if attempt in tried:
            continue
        tried.append(attempt)
        um = _export_unflatten(mod, args, kwargs, *attempt)
        broken = _broken_call(um, {q: mod.get_submodule(q) for q in attempt[0]})
        if broken is None:
            return um, attempt[0]
        log.debug("unflatten mis-wired the call of %s; exporting again", broken)
    raise ScheduleError(
        f"torch.export.unflatten calls {broken} with inputs its forward does not take (a PyTorch bug "
        "with preserved module signatures); pass it in leaf_modules or trace a module below it."
    )


def _tidy_graphs(um: nn.Module, leaf_set: set[str]) -> None:
    """Make every unflattened graph but the leaves' deep-copyable, without the pytree plumbing around
    preserved calls, and regenerate its code (dropping references to the cloned tensors)."""
    interp = _interp_types()
    for qn, sub in list(um.named_modules()):
        if not isinstance(sub, interp) or qn in leaf_set:
            continue
        if isinstance(getattr(sub, "graph", None), fx.Graph):
            _meta_vals(sub.graph)
            _simplify_pytree_calls(sub)
            sub.finalize()


def _trace_until_paths(paths: Any, kwargs: dict[str, Any]) -> list[str]:
    """``trace_until``'s ``paths`` as a list, checked with its keyword arguments.

    Raises:
        ScheduleError: for paths that are not a path or a non-empty list of them, or an unknown keyword.
    """
    if isinstance(paths, str):
        paths = [paths]
    if not isinstance(paths, (list, tuple)) or not paths or not all(isinstance(p, str) for p in paths):
        raise ScheduleError("trace_until() takes a module path or a non-empty list of module paths.")
    allowed = {"tracer", "leaf_modules", "concrete_args", "example_inputs"}
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        raise ScheduleError(
            f"trace_until() does not take {', '.join(unknown)}; it takes {', '.join(sorted(allowed))}."
        )
    return list(paths)


# ------------------------------------------------------------------------------------------------
# The mixin
# ------------------------------------------------------------------------------------------------
def set_child(parent: nn.Module, name: str, new: nn.Module) -> None:
    """``setattr(parent, name, new)``; a torch.export parent regenerates its code, which holds references."""
    setattr(parent, name, new)
    if isinstance(parent, _interp_types()) and is_traced(parent):
        parent.finalize()


def _move_plain_hooks(old: nn.Module, new: nn.Module) -> None:
    """Hooks registered on the module (not by a primitive: those refuse tracing) stay at its path (Slapo)."""
    if new is old:
        return
    for attr in HOOK_DICTS:
        src = getattr(old, attr, None)
        if src:
            getattr(new, attr).update(src)
            src.clear()
    if new._backward_hooks:
        new._is_full_backward_hook = old._is_full_backward_hook


def _dummy_examples(sch) -> bool:
    """Record example inputs from a HuggingFace model's ``dummy_inputs`` (token ids, with ``use_cache=False``
    where the model takes it), so that torch.export can trace a submodule fx cannot (transformers 5.x code
    unpacks shapes and ``**kwargs``) without the user passing inputs; False where the root is not such a model
    or the forward fails. The exports that use them are shape-generic (``Dim.AUTO``)."""
    top = sch.get_top_schedule()
    dummy = getattr(type(top.mod), "dummy_inputs", None)
    if dummy is None or not isinstance(dummy, property) or _EXAMPLES_KEY in sch._top.extra:
        return False
    try:
        inputs = dict(top.mod.dummy_inputs)
    except Exception:  # noqa: BLE001 - a model without usable dummies: no fallback
        return False
    if not inputs or not all(isinstance(v, torch.Tensor) for v in inputs.values()):
        return False
    try:
        takes_cache_flag = "use_cache" in inspect.signature(top.mod.forward).parameters
    except (TypeError, ValueError):
        takes_cache_flag = False
    if takes_cache_flag:  # a graph cannot grow a key/value cache object: trace the call without one
        inputs["use_cache"] = False
    try:
        record_example_inputs(top, inputs)
        sch._top.extra[_DUMMY_KEY] = True
    except ScheduleError as err:
        log.debug("dummy inputs did not run: %s", err)
        return False
    return True


def _install(sch, new: nn.Module) -> None:
    """Put ``new`` at ``sch``'s path (parent attribute and ``sch.mod``) and re-mirror the children."""
    if sch.parent is not None:
        set_child(sch.parent.mod, sch.name, new)
    sch.mod = new
    sch._top.extra.pop("owners", None)  # the tied-tensor owner index (schedule.py) may point at old modules
    sch._rebuild_children()


class TracingMixin:
    """Schedule methods for tracing and pattern finding (Slapo's ``trace``, ``trace_until``, ``find`` ...)."""

    def record_example_inputs(self, inputs) -> dict:
        """Method form of :func:`record_example_inputs` (``sch.record_example_inputs(inputs)``)."""
        return record_example_inputs(self, inputs)

    def trace(
        self,
        recursive: bool = True,
        flatten: bool = False,
        leaf_modules=None,
        tracer: str = "auto",
        concrete_args: dict | None = None,
        example_inputs=None,
    ) -> nn.Module:
        """Trace this node's module into a graph, in place (Slapo's ``Schedule.trace``).

        ``torch.fx.symbolic_trace`` is tried first (``tracer="fx"`` or ``"auto"``); where it fails,
        ``torch.export.export`` + ``torch.export.unflatten`` (``"export"`` or ``"auto"``), which needs
        example inputs (``example_inputs`` or :func:`record_example_inputs`). Tracing an already traced
        module returns it unchanged. See the module docstring for what stays a leaf.

        Args:
            recursive: fx: also trace each non-leaf child into its own graph (a child that cannot be
                traced stays as it is); export: unflatten the whole hierarchy. With False every child
                stays a leaf.
            flatten: inline every non-leaf submodule into one graph (fx, or torch.export's hierarchy
                inlined); the inlined submodules are then no schedule nodes (Slapo).
            leaf_modules: submodule paths (relative to this node), class names or classes that must
                not be traced into.
            tracer: ``"auto"`` (fx, then export), ``"fx"`` or ``"export"``; Slapo's ``"pytorch"`` is
                ``"auto"`` that, on a HuggingFace model without recorded inputs, first records the model's
                ``dummy_inputs`` (one forward pass) so torch.export can stand in where fx fails.
            concrete_args: fx: values that specialise forward arguments; export: values put into the
                example call (by position where the call passes that argument by position).
            example_inputs: inputs of this module for torch.export: a tensor, a tuple of positional
                arguments, a dict of keyword arguments or an ``(args, kwargs)`` pair. Defaults to the
                arguments recorded by :func:`record_example_inputs` for this path.

        Returns:
            The traced module, now at this path: an ``fx.GraphModule`` (:class:`TracedGraphModule`).

        Raises:
            ScheduleError: for bad arguments, a module carrying hook-based primitives, or when no
                tracer succeeds ("X cannot be traced: fx says ...; torch.export says ...").
        """
        opts = _make_opts(self, recursive, flatten, leaf_modules, tracer, concrete_args, example_inputs)
        if is_traced(self.mod):
            return self.mod
        gm = _trace_module(self, opts)
        _move_plain_hooks(self.mod, gm)
        _install(self, gm)
        return gm

    def trace_until(self, paths, **kwargs) -> nn.Module:
        """Trace the root and every module down to ``paths``, whose children stay leaves (Slapo's
        ``trace_until``; e.g. ``trace_until("encoder.layer")`` before cutting pipeline stages).

        Args:
            paths: a path or a list of paths (from the root).
            **kwargs: ``tracer``, ``leaf_modules`` (added to the children), ``concrete_args``,
                ``example_inputs`` of :meth:`trace`.

        Returns:
            The traced root module.

        Raises:
            ScheduleError: when not called on the root, for unknown paths or arguments, when the root is
                already traced without reaching a path, or when tracing fails.
        """
        if self.parent is not None:
            raise ScheduleError(
                f"trace_until() traces from the root; call it on the root schedule, not on {self.path}."
            )
        paths = _trace_until_paths(paths, kwargs)
        for p in paths:
            if p == "":
                raise ScheduleError(
                    "trace_until('') names the root itself; use trace(recursive=False) instead."
                )
            self[p]  # raises a ScheduleKeyError naming what exists
        if is_traced(self.mod):
            for p in paths:
                self._check_traced_down_to(p)
            return self.mod
        leaves = list(kwargs.pop("leaf_modules", None) or [])
        if isinstance(leaves, (str, type)):
            leaves = [leaves]
        for p in paths:
            leaves += [f"{p}.{c}" for c in self[p].child]
        return self.trace(recursive=True, flatten=False, leaf_modules=leaves, **kwargs)

    def _check_traced_down_to(self, p: str) -> None:
        """Raise ScheduleError unless the traced root's graphs reach down to path ``p``."""
        parts = p.split(".")
        for i in range(len(parts) + 1):
            m = self.get_module(".".join(parts[:i]))
            if not (is_traced(m) or _is_container(m) or (i == len(parts) and not list(m.children()))):
                raise ScheduleError(
                    f"The root is already traced but {'.'.join(parts[:i])} is not, so trace_until({p!r}) "
                    "cannot reach it; trace_until() must come before tracing the root."
                )

    # --- finding -----------------------------------------------------------------------------
    def _ensure_traced(self) -> None:
        if not is_traced(self.mod):
            self.trace()

    def find_node(self, regex_or_pattern_fn) -> list[tuple[str, fx.Node]]:
        """Find nodes in this module's traced graphs (Slapo's ``find_node``); traces by need.

        Args:
            regex_or_pattern_fn: a regular expression matched (``re.match``) against the targets of
                ``call_module`` nodes, or a predicate ``lambda node: ...`` tried on every node.

        Returns:
            list of ``(parent path, fx.Node)``, the parent path relative to this node, in graph order.

        Raises:
            ScheduleError: for a bad regex or argument, a predicate that raises, or when tracing fails.
        """
        if isinstance(regex_or_pattern_fn, str):
            rx = _compile_regex(regex_or_pattern_fn, "find_node")

            def pred(n: fx.Node) -> bool:
                return n.op == "call_module" and rx.match(n.target) is not None
        elif callable(regex_or_pattern_fn) and not isinstance(regex_or_pattern_fn, (type, nn.Module)):
            fn = regex_or_pattern_fn

            def pred(n: fx.Node) -> bool:
                try:
                    return bool(fn(n))
                except Exception as err:  # noqa: BLE001
                    raise ScheduleError(
                        f"The node predicate raised {type(err).__name__} on node {n.name}: {_short(err)}."
                    ) from None
        else:
            raise ScheduleError(
                f"find_node() takes a regular expression or a predicate on fx nodes, not {type(regex_or_pattern_fn).__name__}."
            )
        self._ensure_traced()
        return [(qn, n) for qn, owner in _graph_owners(self.mod) for n in owner.graph.nodes if pred(n)]

    def find_subgraph(self, pattern_fn) -> list[list[tuple[str, fx.Node]]]:
        """Find every occurrence of a subgraph pattern (Slapo's ``find_subgraph``); traces by need.

        The pattern (a function or a :class:`Pattern`) is traced with torch.fx; its first operation
        anchors the search and each next operation must consume the nodes matched for its inputs.
        Operations compare by a normalised name (``F.gelu`` = ``aten.gelu`` = ``nn.GELU`` = HF
        ``GELUActivation``), ``call_module`` of other classes by class, :class:`ModulePattern` and
        :func:`call_module` by a regex on the target, constant arguments by value. Matches do not overlap.

        Args:
            pattern_fn: e.g. ``lambda x: F.gelu(sl.call_module("dense", x))`` or a ``Pattern`` instance.

        Returns:
            list of subgraphs, each a list of ``(parent path, fx.Node)`` in graph order.

        Raises:
            ScheduleError: for a pattern that is not a function/Pattern or cannot be traced, or when
                tracing this module fails.
        """
        pgm = _trace_pattern(pattern_fn)
        _pattern_nodes(pgm)  # a pattern without operations is refused before tracing anything
        self._ensure_traced()
        return _find_subgraphs(_graph_owners(self.mod), pgm)

    def find(self, regex_or_pattern_fn):
        """Slapo's dispatcher: a string is a ``call_module`` regex (:meth:`find_node`); a function or
        a :class:`Pattern` is a subgraph pattern (:meth:`find_subgraph`). For a node predicate use
        :meth:`find_node` directly.

        Raises:
            ScheduleError: for any other argument, and as the two methods do.
        """
        if isinstance(regex_or_pattern_fn, str):
            return self.find_node(regex_or_pattern_fn)
        if isinstance(regex_or_pattern_fn, (types.FunctionType, Pattern)):
            return self.find_subgraph(regex_or_pattern_fn)
        raise ScheduleError(
            f"find() takes a regular expression, a pattern function or a Pattern, not {type(regex_or_pattern_fn).__name__}."
        )


def _trace_module(sch, opts: _Opts) -> nn.Module:
    where = _where(sch)
    fx_err = ex_err = None
    if opts.tracer in ("fx", "auto"):
        try:
            return _fx_trace(sch.mod, "", opts)
        except Exception as err:  # noqa: BLE001
            fx_err = _short(err)
    if opts.tracer in ("export", "auto"):
        example = opts.example_for("")
        if example is None and opts.dummy_inputs and _dummy_examples(sch):
            opts.examples = sch._top.extra.get(_EXAMPLES_KEY, {})
            opts.dynamic = True
            example = opts.example_for("")
        if example is None:
            ex_err = (
                "it needs example inputs: pass example_inputs= or call "
                "record_example_inputs(sch, inputs) first"
            )
        else:
            try:
                return _export_trace(sch.mod, "", opts, example)
            except Exception as err:  # noqa: BLE001
                ex_err = _short(err)
    if fx_err is not None and ex_err is not None:
        raise ScheduleError(f"{where} cannot be traced: fx says {fx_err}; torch.export says {ex_err}.")
    if fx_err is not None:
        raise ScheduleError(f"{where} cannot be traced by torch.fx: {fx_err}.")
    raise ScheduleError(f"{where} cannot be traced by torch.export: {ex_err}.")
