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
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import itertools
import keyword
import logging
import operator
import re
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo

from .errors import ScheduleError
from .module_state import META_ATTR, peek_meta

log = logging.getLogger("slapo_lab")

__all__ = ["ModulePattern", "Pattern", "TracingMixin", "call_module", "is_traced", "record_example_inputs"]

_EXAMPLES_KEY = (
    "module_example_inputs"  # per-module (args, kwargs); the model's own inputs live under "example_inputs"
)
_DUMMY_KEY = "example_inputs_are_dummies"  # recorded from a HF model's dummy_inputs: export shape-generic
_TRACERS = ("auto", "fx", "export")

#: Export tensor dimensions as ``Dim.AUTO`` (dynamic where the code allows). Off by default: it makes
#: ``torch.export`` 2-5x slower, and a static export fails loudly (an input-shape check in the
#: unflattened module) when called with other shapes.
EXPORT_DYNAMIC_SHAPES = False


# ------------------------------------------------------------------------------------------------
# Patterns
# ------------------------------------------------------------------------------------------------
class Pattern(nn.Module):
    """A subgraph pattern written as a module (Slapo's ``slapo.pattern.Pattern``).

    Subclass it and write ``forward`` with the ops to look for; submodules are matched by type
    (``nn.Linear`` matches a ``call_module`` of a Linear *and* a functional ``linear``), and a
    :class:`ModulePattern` matches a ``call_module`` whose target matches its regex::

        class LinearGelu(sl.Pattern):
            def __init__(self):
                super().__init__()
                self.fc = sl.ModulePattern(r"dense")
            def forward(self, x):
                return F.gelu(self.fc(x))

        sch["encoder.layer.0.intermediate"].find(LinearGelu())
    """

    def forward(self, *args):  # pragma: no cover - always overridden
        raise NotImplementedError("a Pattern subclass must define forward()")


class ModulePattern(nn.Module):
    """A pattern leaf that matches a ``call_module`` node whose target matches regex ``name``.

    Raises:
        ScheduleError: if ``name`` is not a string or not a valid regular expression.
    """

    def __init__(self, name: str) -> None:
        super().__init__()
        _compile_regex(name, "ModulePattern")
        self.name = name

    def forward(self, *args):  # never run: it is a leaf of the pattern graph
        raise NotImplementedError("ModulePattern is only for patterns passed to find()")


def call_module(regex: str, *args):
    """Inside a pattern function: a ``call_module`` node whose target matches ``regex``.

    ``sch.find(lambda x: F.gelu(sl.call_module(r"dense", x)))`` (Slapo's ``slapo.pattern.call_module``).
    """
    for a in args:
        if isinstance(a, fx.Proxy):
            return a.tracer.create_proxy("call_function", call_module, (regex, *args), {})
    raise ScheduleError(
        "call_module() only describes a node inside a pattern passed to find() or find_subgraph()."
    )


# ------------------------------------------------------------------------------------------------
# Small helpers
# ------------------------------------------------------------------------------------------------
def _compile_regex(regex: Any, what: str):
    if not isinstance(regex, str):
        raise ScheduleError(f"{what} takes a regular expression string, not {type(regex).__name__}.")
    try:
        return re.compile(regex)
    except re.error as err:
        raise ScheduleError(f"{regex!r} is not a valid regular expression ({err}).") from None


def _join(prefix: str, name: str) -> str:
    if not prefix:
        return name
    return f"{prefix}.{name}" if name else prefix


def _where(sch) -> str:
    return f"{sch.path or 'the root module'} ({type(sch.mod).__name__})"


def _short(err: Any, limit: int = 160) -> str:
    """The first line of an exception message, shortened, without a trailing period."""
    text = str(err).strip()
    line = text.splitlines()[0].strip() if text else type(err).__name__
    if len(line) > limit:
        line = line[: limit - 1].rstrip() + "…"
    return line.rstrip(".")


def _fetch(mod: nn.Module, target: str):
    obj = mod
    for atom in target.split("."):
        obj = getattr(obj, atom)
    return obj


def _interp_types() -> tuple[type, ...]:
    from torch.export.unflatten import InterpreterModule, UnflattenedModule

    return (InterpreterModule, UnflattenedModule)


def is_traced(mod: nn.Module) -> bool:
    """Whether ``mod`` is a traced module with an ``fx.Graph`` (fx ``GraphModule`` or torch.export's)."""
    if isinstance(mod, fx.GraphModule):
        return True
    return isinstance(mod, _interp_types()) and isinstance(getattr(mod, "graph", None), fx.Graph)


def orig_class(mod: nn.Module) -> type:
    """The class a traced module stands for (its own class for an untraced module)."""
    cls = getattr(type(mod), "_slapo_orig_class", None)
    if cls is None and isinstance(mod, fx.GraphModule):
        cls = mod.meta.get("slapo_orig_class")
    return cls or type(mod)


def _is_container(mod: nn.Module) -> bool:
    return isinstance(mod, (nn.ModuleList, nn.ModuleDict)) and not isinstance(mod, nn.Sequential)


def _is_builtin(mod: nn.Module) -> bool:
    mname = type(mod).__module__
    return (
        mname.startswith(("torch.nn", "torch.ao.nn"))
        and not isinstance(mod, nn.Sequential)
        and not _is_container(mod)
    )


_CALL_STATE = ("syncs", "hooks", "checkpoint", "fork_rng", "partial_reducers")


def needs_call(mod: nn.Module) -> list[str]:
    """Schedule state of ``mod`` that only works when the module itself is called (hooks, a wrapped forward)."""
    meta = peek_meta(mod)
    if not meta:
        return []
    found = [k for k in _CALL_STATE if meta.get(k)]
    if meta.get("impl") is not None:
        found.append("a sharded forward")
    return found


def _has_shard_rule(mod: nn.Module) -> bool:
    from .sharding.rules import _DEFAULT, get_shard_rule

    return get_shard_rule(mod) is not _DEFAULT


def _is_separate_bias(mod: nn.Module) -> bool:
    return type(mod).__name__ == "LinearWithSeparateBias" and type(mod).__module__.startswith("slapo_lab")


def _is_direct_child(root: nn.Module, qn: str) -> bool:
    """Whether ``qn`` is called directly by ``root`` (every module between them is a ModuleList/Dict)."""
    parts = qn.split(".")
    obj = root
    for atom in parts[:-1]:
        obj = getattr(obj, atom, None)
        if obj is None or not _is_container(obj):
            return False
    return True


# ------------------------------------------------------------------------------------------------
# Options
# ------------------------------------------------------------------------------------------------
@dataclass
class _Opts:
    root: nn.Module
    root_path: str
    recursive: bool
    flatten: bool
    tracer: str
    concrete_args: dict | None
    examples: dict  # absolute path -> (args, kwargs)
    explicit: tuple | None  # (args, kwargs) for the root
    leaf_paths: set = field(default_factory=set)
    leaf_names: set = field(default_factory=set)
    leaf_types: tuple = ()
    dummy_inputs: bool = False  # tracer="pytorch": may record a HF model's dummy_inputs for torch.export
    dynamic: bool = False  # export with dynamic shapes (the examples are a HF model's dummy inputs)

    def user_leaf(self, mod: nn.Module, rel: str) -> bool:
        if rel in self.leaf_paths:
            return True
        cls = orig_class(mod)
        if cls.__name__ in self.leaf_names:
            return True
        return bool(self.leaf_types) and issubclass(cls, self.leaf_types)

    def true_leaf(self, mod: nn.Module, rel: str) -> bool:
        """A module kept as it is (a ``call_module`` node), never traced into."""
        if self.user_leaf(mod, rel) or needs_call(mod) or is_traced(mod):
            return True
        if _is_separate_bias(mod):
            return not self.flatten  # flatten inlines it so that its bias add shows in the graph
        return _is_builtin(mod) or _has_shard_rule(mod)

    def example_for(self, rel: str):
        if rel == "" and self.explicit is not None:
            return self.explicit
        return self.examples.get(_join(self.root_path, rel))


def _normalize_inputs(inputs: Any, what: str) -> tuple[tuple, dict]:
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    if isinstance(inputs, dict):
        if not all(isinstance(k, str) for k in inputs):
            raise ScheduleError(f"{what} as a dict must map argument names (strings) to values.")
        return (), dict(inputs)
    if (
        isinstance(inputs, tuple)
        and len(inputs) == 2
        and isinstance(inputs[0], (tuple, list))
        and isinstance(inputs[1], dict)
    ):
        return tuple(inputs[0]), dict(inputs[1])
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    raise ScheduleError(
        f"{what} must be a tensor, a tuple of positional arguments, a dict of keyword arguments or an "
        f"(args, kwargs) pair, not {type(inputs).__name__}."
    )


def _on_meta(mod: nn.Module) -> bool:
    for t in itertools.chain(mod.parameters(), mod.buffers()):
        return t.device.type == "meta"
    return False


def _to_meta(tree):
    return pytree.tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, tree)


def _detach(tree):
    return pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, tree)


def _leaf_spec(opts: _Opts, top: nn.Module, leaf_modules, where: str) -> None:
    if leaf_modules is None:
        return
    if isinstance(leaf_modules, (str, type)):
        leaf_modules = [leaf_modules]
    if not isinstance(leaf_modules, (list, tuple, set)):
        raise ScheduleError(
            f"leaf_modules must be a list of module paths, class names or classes, not "
            f"{type(leaf_modules).__name__}."
        )
    names = {orig_class(m).__name__ for m in top.modules()}
    types_ = []
    for entry in leaf_modules:
        if isinstance(entry, type):
            if not issubclass(entry, nn.Module):
                raise ScheduleError(f"leaf_modules entry {entry.__name__} is not an nn.Module class.")
            types_.append(entry)
        elif isinstance(entry, str):
            try:
                sub = top.get_submodule(entry) if entry else None
            except AttributeError:
                sub = None
            if sub is not None:
                _add_leaf_path(opts, sub, entry)
            elif entry in names:
                opts.leaf_names.add(entry)
            else:
                raise ScheduleError(
                    f"leaf_modules entry {entry!r} names no submodule path or module class under {where}."
                )
        else:
            raise ScheduleError(f"leaf_modules entries must be paths, class names or classes, not {entry!r}.")
    opts.leaf_types = tuple(types_)


def _add_leaf_path(opts: _Opts, mod: nn.Module, path: str) -> None:
    if _is_container(mod):  # a ModuleList is never called: its elements are the leaves
        for name, child in mod.named_children():
            _add_leaf_path(opts, child, f"{path}.{name}")
    else:
        opts.leaf_paths.add(path)


_VAR_POS, _VAR_KW = inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD


def _make_opts(sch, recursive, flatten, leaf_modules, tracer, concrete_args, example_inputs) -> _Opts:
    where = _where(sch)
    if not isinstance(recursive, bool):
        raise ScheduleError(f"recursive must be True or False, not {recursive!r}.")
    if not isinstance(flatten, bool):
        raise ScheduleError(f"flatten must be True or False, not {flatten!r}.")
    # Slapo's tracer="pytorch": fx where it can, else torch.export -- on a HuggingFace model with its
    # dummy_inputs recorded as example inputs when none were (Slapo's own tracer made up HF inputs too)
    slapo_pytorch = tracer == "pytorch"
    if slapo_pytorch:
        tracer = "auto"
    if tracer == "huggingface":
        raise ScheduleError(
            "tracer='huggingface' is gone (transformers 5 has no transformers.utils.fx); "
            "use tracer='export' or 'auto'."
        )
    if tracer not in _TRACERS:
        raise ScheduleError(f"Unknown tracer {tracer!r}; use one of {', '.join(_TRACERS)}.")
    if flatten and not recursive:
        raise ScheduleError("flatten=True inlines every submodule, so it needs recursive=True.")
    if concrete_args is not None:
        if not isinstance(concrete_args, dict) or not all(isinstance(k, str) for k in concrete_args):
            raise ScheduleError("concrete_args must be a dict from forward() argument names to values.")
        try:
            params = inspect.signature(type(sch.mod).forward).parameters
        except (TypeError, ValueError):
            params = None
        # Slapo's recipe ({p.name: p.default for the other parameters}) also names required and
        # */** parameters, with the value inspect.Parameter.empty: those are not concrete values
        concrete_args = {
            k: v
            for k, v in concrete_args.items()
            if v is not inspect.Parameter.empty
            and not (params is not None and k in params and params[k].kind in (_VAR_POS, _VAR_KW))
        }
        if params is not None and not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            unknown = sorted(set(concrete_args) - set(params))
            if unknown:
                raise ScheduleError(
                    f"concrete_args names {', '.join(unknown)}, which {type(sch.mod).__name__}."
                    f"forward() does not take."
                )
    explicit = None
    if example_inputs is not None:
        explicit = _normalize_inputs(example_inputs, "example_inputs")
        if _on_meta(sch.mod):
            explicit = _to_meta(explicit)
    opts = _Opts(
        root=sch.mod,
        root_path=sch.path,
        recursive=recursive,
        flatten=flatten,
        tracer=tracer,
        concrete_args=dict(concrete_args) if concrete_args else None,
        examples=sch._top.extra.get(_EXAMPLES_KEY, {}),
        explicit=explicit,
        dummy_inputs=slapo_pytorch,
        dynamic=bool(sch._top.extra.get(_DUMMY_KEY)),
    )
    _leaf_spec(opts, sch.mod, leaf_modules, where)
    state = needs_call(sch.mod)
    if state and not is_traced(sch.mod):
        raise ScheduleError(
            f"{where} already carries {', '.join(state)}, which would be lost by tracing it; trace it before "
            "applying those primitives, or trace its parent (it stays a leaf there)."
        )
    return opts


# ------------------------------------------------------------------------------------------------
# torch.fx
# ------------------------------------------------------------------------------------------------
class _Tracer(fx.Tracer):
    def __init__(self, is_leaf: Callable[[nn.Module, str], bool]) -> None:
        super().__init__()
        self._is_leaf = is_leaf

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return self._is_leaf(m, module_qualified_name)


def _reorder_like(new: nn.Module, orig: nn.Module) -> None:
    """Give ``new``'s submodules (recursively, where names match) the order they have in ``orig``."""
    if new is orig:
        return
    rank = {name: i for i, name in enumerate(orig._modules)}
    items = sorted(new._modules.items(), key=lambda kv: rank.get(kv[0], len(rank)))
    new._modules.clear()
    new._modules.update(items)
    for name, child in items:
        o = orig._modules.get(name)
        if child is not None and o is not None:
            _reorder_like(child, o)


def _mark_orig(gm: nn.Module, mod: nn.Module) -> None:
    _reorder_like(gm, mod)
    originals = {id(m) for m in mod.modules()}
    for m in gm.modules():  # modules tracing created (graph modules, containers) take the mode over
        if id(m) not in originals:
            m.training = mod.training
    if isinstance(gm, fx.GraphModule):
        gm.meta["slapo_orig_class"] = orig_class(mod)
    meta = peek_meta(mod)
    if meta is not None and META_ATTR not in gm.__dict__:
        gm.__dict__[META_ATTR] = meta  # data-only state (sharded tensors, cut) stays with the path


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
    from torch.export import Dim

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


def _simplify_pytree_calls(owner: nn.Module) -> None:
    """Remove the pytree (un)flattening that torch.export puts around preserved-signature calls.

    ``getitem(getitem(tree_unflatten([a, b], spec), 0), 1)`` becomes ``b`` and
    ``getitem(tree_flatten_spec(y, leaf_spec), 0)`` becomes ``y``, so a leaf's ``call_module`` node
    consumes and feeds the neighbouring ops directly (and patterns match across it).
    """
    graph = owner.graph

    class _Leaf:
        __slots__ = ("i",)

        def __init__(self, i: int) -> None:
            self.i = i

    def replace_uses(node: fx.Node, value: Any) -> None:
        if isinstance(value, fx.Node):
            node.replace_all_uses_with(value)
            return
        for user in list(node.users):
            user.args = fx.node.map_aggregate(user.args, lambda a: value if a is node else a)
            user.kwargs = fx.node.map_aggregate(user.kwargs, lambda a: value if a is node else a)

    def plain(x: Any) -> bool:  # a builtin container of leaves: can be written as a graph argument
        if isinstance(x, _Leaf) or x is None:
            return True
        if type(x) in (tuple, list):
            return all(plain(v) for v in x)
        if type(x) is dict:
            return all(isinstance(k, str) and plain(v) for k, v in x.items())
        return False

    def build(x: Any, flat: list) -> Any:
        if isinstance(x, _Leaf):
            return flat[x.i]
        if type(x) in (tuple, list):
            return type(x)(build(v, flat) for v in x)
        if type(x) is dict:
            return {k: build(v, flat) for k, v in x.items()}
        return x

    def resolve(node: fx.Node, struct: Any, flat: list) -> None:
        for user in list(node.users):
            if user.op != "call_function" or user.target is not operator.getitem or user.args[0] is not node:
                continue
            try:
                sub = struct[user.args[1]]
            except (KeyError, IndexError, TypeError):
                continue
            if isinstance(sub, _Leaf):
                replace_uses(user, flat[sub.i])
            else:
                resolve(user, sub, flat)
                if user.users and plain(sub):
                    replace_uses(user, build(sub, flat))

    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if (
            node.target is pytree.tree_unflatten
            and len(node.args) == 2
            and isinstance(node.args[1], fx.Node)
            and node.args[1].op == "get_attr"
            and isinstance(node.args[0], (list, tuple))
        ):
            spec = _fetch(owner, node.args[1].target)
            flat = list(node.args[0])
            try:
                struct = pytree.tree_unflatten([_Leaf(i) for i in range(len(flat))], spec)
            except Exception as err:  # noqa: BLE001 - leave this call's plumbing as torch.export wrote it
                log.debug("kept tree_unflatten %s: %s", node.name, _short(err))
                continue
            resolve(node, struct, flat)
            changed = True
        elif (
            getattr(node.target, "__name__", "") == "tree_flatten_spec"
            and len(node.args) == 2
            and isinstance(node.args[0], fx.Node)
            and node.args[0].op == "call_module"
            and isinstance(node.args[1], fx.Node)
            and node.args[1].op == "get_attr"
        ):
            spec = _fetch(owner, node.args[1].target)
            if spec.is_leaf():
                for user in list(node.users):
                    if user.target is operator.getitem and user.args[1] == 0:
                        user.replace_all_uses_with(node.args[0])
                changed = True
    if not changed:
        return
    # Drop what became dead (only pure pytree plumbing: getitem, tree_* and their spec get_attrs).
    removable = {operator.getitem, pytree.tree_unflatten}
    for node in reversed(list(graph.nodes)):
        if node.users:
            continue
        if (
            node.op == "call_function"
            and (node.target in removable or getattr(node.target, "__name__", "") == "tree_flatten_spec")
        ) or (node.op == "get_attr" and node.target.startswith("_spec_")):
            graph.erase_node(node)


def _meta_vals(graph: fx.Graph) -> None:
    """Turn torch.export's FakeTensor ``node.meta["val"]`` into ``meta`` tensors (same shape, dtype and
    strides), so that the traced module can be deep-copied (``Verify`` copies the model)."""

    def conv(t):
        if isinstance(t, torch.Tensor) and type(t) is not torch.Tensor and type(t) is not nn.Parameter:
            try:
                return torch.empty_strided(
                    [int(s) for s in t.shape], [int(s) for s in t.stride()], dtype=t.dtype, device="meta"
                )
            except Exception:  # noqa: BLE001 - symbolic sizes: drop
                return None
        return t

    for node in graph.nodes:
        if "val" in node.meta:
            node.meta["val"] = pytree.tree_map(conv, node.meta["val"])


# ------------------------------------------------------------------------------------------------
# fx.GraphModules out of torch.export
# ------------------------------------------------------------------------------------------------
#: The ``nn.Module`` dicts of plain (non-state) hooks: moved with a module that is swapped or traced.
HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
)


_STATE_KEYS = frozenset(
    {
        "training",
        "_parameters",
        "_buffers",
        "_non_persistent_buffers_set",
        "_modules",
        "_is_full_backward_hook",
        *HOOK_DICTS,
    }
)


class TracedGraphModule(fx.GraphModule):
    """The ``fx.GraphModule`` that :meth:`TracingMixin.trace` puts at a traced path (named after the class it
    stands for).

    ``fx.GraphModule.__deepcopy__`` rebuilds a copy from what the graph references only: children no node
    calls, the module's own hooks (the schedule's syncs on a traced module) and instance attributes such as
    ``_slapo_meta`` would be lost, and containers on dotted targets would become plain modules. This copy
    keeps them all (``Verify`` and the numeric check deep-copy scheduled models).
    """

    def __deepcopy__(self, memo):
        for (
            val
        ) in self.__dict__.values():  # immutable pytree specs (_in_spec, _spec_0 ...): shared, not copied
            if isinstance(val, pytree.TreeSpec):
                memo[id(val)] = val
        res = super().__deepcopy__(memo)
        for key, val in self.__dict__.items():
            if key in _STATE_KEYS or key not in res.__dict__:
                res.__dict__[key] = copy.deepcopy(val, memo)
        return res


class _CallCodeGen(_PyTreeCodeGen):
    """Code generation for the root of a torch.export trace: ``forward(self, *args, **kwargs)`` takes the
    call the original module took and flattens it as export did (:meth:`_CallInfo.flatten`)."""

    def gen_fn_def(self, free_vars, maybe_return_annotation, *, expanded_def=False):
        names = [v.split(":")[0].split("=")[0].split("#")[0].strip() for v in free_vars]
        names = [n for n in names if n and n != "self"]
        code = f"def {self._func_name}(self, *args, **kwargs){maybe_return_annotation}:"
        if names:
            return code + f"\n    {', '.join(names)}, = self._slapo_flat_inputs(args, kwargs)"
        return code + "\n    self._slapo_flat_inputs(args, kwargs)"

    def __deepcopy__(self, memo):  # immutable (its pytree specs included): copies share it
        return self


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


class _CallInfo:
    """How the root of a torch.export trace was called: the input tree (``in_spec``), each flat input's
    shape (None for a dynamic dimension) or non-tensor value, and the original ``forward`` signature, so
    that a call written differently (positional for keyword, defaults left out) is accepted and anything
    the graph was not specialised for is refused in one sentence. Immutable; copies share it."""

    def __init__(self, name: str, mod: nn.Module, in_spec, flat_with_path, placeholders) -> None:
        self.name = name
        self.in_spec = in_spec
        self.n_args = self.kw_names = None
        if (
            in_spec.type is tuple
            and in_spec.num_children == 2
            and in_spec.child(0).type is tuple
            and in_spec.child(1).type is dict
        ):
            self.n_args = in_spec.child(0).num_children
            self.kw_names = list(in_spec.child(1).context)
        self.checks: list[tuple[str, str, Any]] = []
        for (path, value), node in zip(flat_with_path, placeholders, strict=False):
            where = pytree.keystr(path)
            val = node.meta.get("val")
            if isinstance(value, torch.Tensor):
                shape = getattr(val, "shape", value.shape)
                dims = tuple(d if isinstance(d, int) else None for d in shape)
                self.checks.append((where, "tensor", dims))
            else:
                self.checks.append((where, "value", value))
        self.sig = None
        try:
            sig = inspect.signature(mod.forward)
        except (TypeError, ValueError):
            sig = None
        if sig is not None and self.n_args is not None:
            pos = [p.name for p in sig.parameters.values() if p.kind in _POSITIONAL]
            if self.n_args <= len(pos):
                self.sig, self.pos = sig, pos
                self.var_kw = next((p.name for p in sig.parameters.values() if p.kind == p.VAR_KEYWORD), None)

    def __deepcopy__(self, memo):
        return self

    def _structure(self, args: tuple, kwargs: dict):
        if self.n_args is None:
            return (tuple(args), dict(kwargs)) if kwargs else tuple(args)
        if (
            len(args) == self.n_args
            and len(kwargs) == len(self.kw_names)
            and all(k in kwargs for k in self.kw_names)
        ):
            return tuple(args), {k: kwargs[k] for k in self.kw_names}
        if self.sig is None:
            raise TypeError(
                f"{self.name} was traced for a call with {self.n_args} positional argument(s) and keywords "
                f"{', '.join(self.kw_names) or 'none'}, not {len(args)} and {', '.join(kwargs) or 'none'}."
            )
        try:
            bound = self.sig.bind(*args, **kwargs)
        except TypeError as err:
            raise TypeError(f"{self.name}.forward cannot take this call: {err}.") from None
        bound.apply_defaults()
        values = dict(bound.arguments)
        extra = dict(values.pop(self.var_kw, None) or {}) if self.var_kw else {}
        extra = {k: v for k, v in extra.items() if v is not None or k in self.kw_names}  # None = absent
        new_args = tuple(values.pop(n) for n in self.pos[: self.n_args])
        new_kwargs = {}
        for k in self.kw_names:
            if k in values:
                new_kwargs[k] = values.pop(k)
            elif k in extra:
                new_kwargs[k] = extra.pop(k)
            else:
                raise TypeError(
                    f"{self.name} was traced with the keyword {k}, which this call does not pass."
                )
        for k, v in values.items():
            default = self.sig.parameters[k].default
            if v is not default and (isinstance(v, torch.Tensor) or v != default):
                raise TypeError(
                    f"{self.name} was traced with {k} left at its default, so it cannot take {k}={_short(repr(v), 60)}."
                )
        if extra:
            raise TypeError(
                f"{self.name} was traced without the keyword(s) {', '.join(extra)}, which this call passes."
            )
        return new_args, new_kwargs

    def flatten(self, args: tuple, kwargs: dict) -> list:
        """The flat graph inputs of a call ``(args, kwargs)``.

        Raises:
            TypeError: a call the traced graph cannot take (arguments it was not traced with).
            RuntimeError: an input of another shape, or another non-tensor value, than at tracing.
        """
        tree = self._structure(args, kwargs)
        flat, spec = pytree.tree_flatten_with_path(tree)
        if spec != self.in_spec:
            raise TypeError(
                f"{self.name} was traced for inputs structured as {self.in_spec}, not {spec}; trace it again "
                "with these inputs."
            )
        for (_, value), (where, kind, want) in zip(flat, self.checks, strict=False):
            if kind == "tensor":
                if not isinstance(value, torch.Tensor) or value.dim() != len(want):
                    got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                    raise RuntimeError(
                        f"Expected input at {where} to be a {len(want)}-d tensor, but got {got}."
                    )
                for j, d in enumerate(want):
                    if d is not None and value.shape[j] != d:
                        raise RuntimeError(
                            f"Expected input at {where}.shape[{j}] to be equal to {d}, but got {value.shape[j]} "
                            f"({self.name} was traced by torch.export for fixed shapes; trace it again for others)."
                        )
            elif isinstance(value, torch.Tensor) or type(value) is not type(want) or value != want:
                raise RuntimeError(
                    f"Expected input at {where} to be {_short(repr(want), 60)}, but got {_short(repr(value), 60)} "
                    f"({self.name} is specialised to the non-tensor inputs it was traced with)."
                )
        return [v for _, v in flat]


class _CallGraphModule(TracedGraphModule):
    """The root of a torch.export trace: takes the original module's call (see :class:`_CallInfo`)."""

    def _slapo_flat_inputs(self, args, kwargs):
        return self.meta["slapo_call"].flatten(args, kwargs)


def _merge_state(gm: nn.Module, m: nn.Module) -> None:
    """Give ``gm`` the children, parameters and buffers of ``m`` (same objects, ``m``'s order) that
    ``fx.GraphModule`` did not copy, and ``m``'s containers in place of the plain ones it made."""
    for key in ("_modules", "_parameters", "_buffers"):
        mine, theirs = getattr(gm, key), getattr(m, key)
        merged = dict(theirs)
        for k, v in mine.items():
            merged.setdefault(k, v)
        mine.clear()
        mine.update(merged)
    gm._non_persistent_buffers_set |= m._non_persistent_buffers_set
    gm.training = m.training


def _no_self_names(graph: fx.Graph) -> None:
    """Rename nodes called ``self`` (a call of a child named ``self``, e.g. BERT's ``attention.self``): in
    generated code the variable would shadow the module."""
    for n in graph.nodes:
        if n.name == "self":
            n._rename("self_out")


def _graph_module(m: nn.Module, name: str, cls: type = TracedGraphModule) -> fx.GraphModule:
    _no_self_names(m.graph)
    gm = cls(m, m.graph, class_name=name)
    _merge_state(gm, m)
    return gm


def _to_graph_modules(um: nn.Module, mod: nn.Module, leaves: list[str], call: _CallInfo, out_spec):
    """Turn an unflattened export (``InterpreterModule`` s under an ``UnflattenedModule``) into
    :class:`TracedGraphModule` s, bottom up; the root becomes a :class:`_CallGraphModule`. Non-root graphs
    take flat tensors (``meta["slapo_flat_call"]``): they cannot be swapped for a module of the original
    call signature."""
    leaf_set = set(leaves)
    interp = _interp_types()
    done: dict[int, nn.Module] = {}

    def orig_name(qn: str, m: nn.Module) -> str:
        try:
            return orig_class(mod.get_submodule(qn)).__name__
        except AttributeError:
            return type(m).__name__

    def convert(m: nn.Module, qn: str) -> nn.Module:
        if id(m) in done:
            return done[id(m)]
        for name, child in list(m._modules.items()):
            cq = _join(qn, name)
            if child is None or cq in leaf_set:
                continue
            new = convert(child, cq)
            if new is not child:
                m._modules[name] = new
        new = m
        if m is not um and isinstance(m, interp) and isinstance(getattr(m, "graph", None), fx.Graph):
            new = _graph_module(m, orig_name(qn, m))
            new.meta["slapo_flat_call"] = True
            try:
                new.meta["slapo_orig_class"] = orig_class(mod.get_submodule(qn))
            except AttributeError:
                pass
        done[id(m)] = new
        return new

    convert(um, "")
    um.graph._codegen = _CallCodeGen(_PyTreeInfo([], call.in_spec, out_spec))
    gm = _graph_module(um, orig_class(mod).__name__, _CallGraphModule)
    gm.meta["slapo_call"] = call
    return gm


def _replace_uses(node: fx.Node, value: Any) -> None:
    if isinstance(value, fx.Node):
        node.replace_all_uses_with(value)
        return
    for user in list(node.users):
        user.args = fx.node.map_aggregate(user.args, lambda a: value if a is node else a)
        user.kwargs = fx.node.map_aggregate(user.kwargs, lambda a: value if a is node else a)


def _inline_call(graph: fx.Graph, call: fx.Node, sub: fx.GraphModule) -> None:
    """Put the nodes of ``sub``'s graph in place of ``call`` (a ``call_module`` of ``sub``); their
    ``get_attr`` / ``call_module`` targets get the call's target as prefix."""
    prefix = call.target
    env: dict[fx.Node, Any] = {}
    args = list(call.args)
    out: Any = None
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    for i, ph in enumerate(placeholders):
        if i < len(args):
            env[ph] = args[i]
        elif ph.target in call.kwargs:
            env[ph] = call.kwargs[ph.target]
        elif ph.args:
            env[ph] = ph.args[0]
        else:
            raise ScheduleError(
                f"{prefix} cannot be inlined: its call gives no value for its input {ph.target}."
            )
    with graph.inserting_before(call):
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                out = fx.node.map_arg(n.args[0], lambda a: env[a])
                continue
            new = graph.node_copy(n, lambda a: env[a])
            if n.op in ("get_attr", "call_module"):
                new.target = f"{prefix}.{n.target}"
            env[n] = new
    if isinstance(out, (tuple, list)):
        for user in list(call.users):
            if (
                user.op == "call_function"
                and user.target is operator.getitem
                and user.args[0] is call
                and isinstance(user.args[1], int)
            ):
                _replace_uses(user, out[user.args[1]])
                graph.erase_node(user)
        if call.users:
            with graph.inserting_before(call):
                agg = graph.call_function(type(out), (list(out),))
            call.replace_all_uses_with(agg)
    else:
        _replace_uses(call, out)
    graph.erase_node(call)


def _flat_containers(gm: nn.Module, originals: set[int]) -> None:
    """Mark the plain modules ``fx.GraphModule`` made to hold a flat graph's dotted targets: they are never
    called, and the schedule does not mirror what they hold (Slapo: after ``flatten=True`` the inlined
    submodules are no longer schedule nodes; ``get_module`` still reaches them)."""
    for m in gm.modules():
        if type(m) is nn.Module and id(m) not in originals:
            m.__dict__[_FLAT_CONTAINER] = True


_FLAT_CONTAINER = "_slapo_flat_container"


def hides_children(mod: nn.Module) -> bool:
    """Whether ``mod`` is a container of a flattened graph, whose children are not schedule nodes."""
    return bool(mod.__dict__.get(_FLAT_CONTAINER))


def lost_call_signature(mod: nn.Module) -> bool:
    """Whether ``mod`` is a graph that torch.export traced as part of its parent, which takes flat tensors
    instead of the original module's call."""
    if isinstance(mod, fx.GraphModule):
        return bool(mod.meta.get("slapo_flat_call"))
    return isinstance(mod, _interp_types()[:1])


def _flatten_export(gm: fx.GraphModule, mod: nn.Module, leaves: list[str]) -> fx.GraphModule:
    """Inline every non-leaf graph of a hierarchical export into the root graph (``flatten=True``)."""
    leaf_set = set(leaves)
    graph = gm.graph
    changed = True
    while changed:
        changed = False
        for node in list(graph.nodes):
            if node.op != "call_module" or node.target in leaf_set:
                continue
            sub = gm.get_submodule(node.target)
            if isinstance(sub, fx.GraphModule) and sub is not gm:
                _inline_call(graph, node, sub)
                changed = True
    graph.lint()
    _no_self_names(graph)
    flat = _CallGraphModule(gm, graph, class_name=type(gm).__name__)
    flat.meta["slapo_call"] = gm.meta["slapo_call"]
    flat.training = gm.training
    _flat_containers(flat, {id(m) for m in mod.modules()} | {id(m) for m in gm.modules()})
    return flat


def edit_graph(owner: nn.Module) -> fx.Graph:
    """``owner.graph``, made ready for edits (an export module's graph points at its generated code)."""
    graph = owner.graph
    if not isinstance(owner, fx.GraphModule):
        graph.owning_module = owner
    return graph


def refresh(owner: nn.Module) -> None:
    """Regenerate a traced module's code after its graph changed."""
    owner.graph.lint()
    if isinstance(owner, fx.GraphModule):
        owner.recompile()
    elif hasattr(owner, "finalize"):
        owner.finalize()


def _export_unflatten(
    mod: nn.Module, args: tuple, kwargs: dict, leaves: list[str], dynamic: bool
) -> nn.Module:
    """``torch.export.unflatten`` of ``mod`` exported on ``(args, kwargs)`` with ``leaves`` preserved."""
    ep = _export(mod, args, kwargs, leaves, dynamic=dynamic)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with contextlib.redirect_stdout(io.StringIO()):  # unflatten prints "Checking mutability ..."
            return torch.export.unflatten(ep)


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


def _export_trace(mod: nn.Module, rel: str, opts: _Opts, example: tuple) -> fx.GraphModule:
    """Export ``mod`` with torch.export, unflatten it, put leaves and tensors back and turn every graph into a
    :class:`TracedGraphModule` (the root a :class:`_CallGraphModule`); ``flatten=True`` then inlines them all
    into the root's graph."""
    args, kwargs = example
    if rel == "" and opts.concrete_args:
        args, kwargs = _with_concrete(mod, args, kwargs, opts.concrete_args)
    if _on_meta(mod):
        args, kwargs = _to_meta((args, kwargs))
    if opts.dynamic:
        kwargs = _without_none_extras(mod, kwargs)
    leaves = _export_leaves(mod, rel, opts)
    # torch.export.unflatten can mis-wire calls (see _broken_call): fall back to static shapes, then to fewer
    # preserved leaves (only those that must stay modules)
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
            leaves = attempt[0]
            break
        log.debug("unflatten mis-wired the call of %s; exporting again", broken)
    if broken is not None:
        raise ScheduleError(
            f"torch.export.unflatten calls {broken} with inputs its forward does not take (a PyTorch bug "
            "with preserved module signatures); pass it in leaf_modules or trace a module below it."
        )
    signature = um.module_call_graph[0].signature
    reordered = {k: kwargs[k] for k in signature.in_spec.child(1).context} if kwargs else kwargs
    flat_with_path, _ = pytree.tree_flatten_with_path((tuple(args), reordered))
    placeholders = [n for n in um.graph.nodes if n.op == "placeholder"]
    call = _CallInfo(orig_class(mod).__name__, mod, signature.in_spec, flat_with_path, placeholders)
    for qn in leaves:
        _set_path(um, qn, mod.get_submodule(qn))
    _restore_tensors(um, mod, leaves)
    leaf_set = set(leaves)
    interp = _interp_types()
    for qn, sub in list(um.named_modules()):
        if not isinstance(sub, interp) or qn in leaf_set:
            continue
        if isinstance(getattr(sub, "graph", None), fx.Graph):
            _meta_vals(sub.graph)
            _simplify_pytree_calls(sub)
            sub.finalize()  # regenerate its code, dropping references to the cloned tensors
    gm = _to_graph_modules(um, mod, leaves, call, signature.out_spec)
    if opts.flatten:
        gm = _flatten_export(gm, mod, leaves)
    _mark_orig(gm, mod)
    return gm


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


# ------------------------------------------------------------------------------------------------
# Pattern matching
# ------------------------------------------------------------------------------------------------
_MODULE_OPS: list[tuple[type, str]] = [
    (nn.Linear, "linear"),
    (nn.Conv1d, "conv1d"),
    (nn.Conv2d, "conv2d"),
    (nn.Conv3d, "conv3d"),
    (nn.LayerNorm, "layer_norm"),
    (nn.GroupNorm, "group_norm"),
    (nn.RMSNorm, "rms_norm"),
    (nn.modules.batchnorm._BatchNorm, "batch_norm"),
    (nn.Embedding, "embedding"),
    (nn.Dropout, "dropout"),
    (nn.GELU, "gelu"),
    (nn.ReLU, "relu"),
    (nn.SiLU, "silu"),
    (nn.Tanh, "tanh"),
    (nn.Sigmoid, "sigmoid"),
    (nn.Softmax, "softmax"),
    (nn.LogSoftmax, "log_softmax"),
    (nn.LeakyReLU, "leaky_relu"),
    (nn.ELU, "elu"),
    (nn.Mish, "mish"),
    (nn.Hardswish, "hardswish"),
    (nn.ReLU6, "relu6"),
    (nn.Identity, "identity"),
]
# transformers' activation modules that compute exactly the torch functional of that name
_HF_ACTIVATIONS = {"GELUActivation": "gelu", "SiLUActivation": "silu"}
_OPERATORS = {
    operator.add: "add",
    operator.iadd: "add",
    operator.sub: "sub",
    operator.isub: "sub",
    operator.mul: "mul",
    operator.imul: "mul",
    operator.truediv: "div",
    operator.itruediv: "div",
    operator.floordiv: "floor_divide",
    operator.matmul: "matmul",
    operator.neg: "neg",
    operator.pow: "pow",
    operator.getitem: "getitem",
}


def _op_name(name: str) -> str:
    return name.lstrip("_") or name


def op_key(node: fx.Node, owner: nn.Module):
    """A normalised key for what ``node`` computes, so that ``F.gelu``, ``aten.gelu.default``,
    ``nn.GELU`` and HF's ``GELUActivation`` all read ``"gelu"``; None for non-compute nodes.
    A ``call_module`` of an unmapped class is keyed by its (original) class."""
    if node.op == "call_module":
        try:
            m = _fetch(owner, node.target)
        except AttributeError:
            return None
        if isinstance(m, ModulePattern):
            return ("module_regex", m.name)
        cls = orig_class(m)
        for t, key in _MODULE_OPS:
            if issubclass(cls, t):
                return key
        return _HF_ACTIVATIONS.get(cls.__name__, ("module", cls))
    if node.op == "call_function":
        t = node.target
        if t is call_module:
            return ("module_regex", node.args[0])
        if t in _OPERATORS:
            return _OPERATORS[t]
        if isinstance(t, torch._ops.OpOverload):
            return _op_name(t.overloadpacket.__name__)
        name = getattr(t, "__name__", None)
        return _op_name(name) if name else ("function", t)
    if node.op == "call_method":
        return _op_name(node.target)
    return None


_SCALARS = (bool, int, float, str)


def _node_matches(p: fx.Node, pkey, c: fx.Node, ckey) -> bool:
    if isinstance(pkey, tuple) and pkey and pkey[0] == "module_regex":
        return c.op == "call_module" and re.match(pkey[1], c.target) is not None
    if ckey is None or pkey != ckey:
        return False
    if p.op != "call_module" and c.op != "call_module":
        args = p.args[1:] if p.op == "call_function" and p.target is call_module else p.args
        for i, a in enumerate(args):  # constant arguments must agree (Slapo)
            if isinstance(a, _SCALARS) and (i >= len(c.args) or c.args[i] != a):
                return False
    return True


def _trace_pattern(pattern) -> fx.GraphModule:
    if isinstance(pattern, Pattern):
        tracer = _Tracer(lambda m, qn: isinstance(m, ModulePattern) or _is_builtin(m))
        try:
            graph = tracer.trace(pattern)
        except Exception as err:  # noqa: BLE001
            raise ScheduleError(
                f"The pattern {type(pattern).__name__} could not be traced by torch.fx: {_short(err)}."
            ) from None
        return fx.GraphModule(pattern, graph)
    if isinstance(pattern, types.FunctionType):
        try:
            return fx.symbolic_trace(pattern)
        except ScheduleError:
            raise
        except Exception as err:  # noqa: BLE001
            raise ScheduleError(
                f"The pattern function could not be traced by torch.fx: {_short(err)}."
            ) from None
    raise ScheduleError(
        f"A subgraph pattern must be a function (e.g. a lambda) or a Pattern instance, not {type(pattern).__name__}."
    )


def _graph_owners(mod: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(qn, m) for qn, m in mod.named_modules() if is_traced(m)]


def _pattern_nodes(pgm: fx.GraphModule) -> list[fx.Node]:
    pnodes = [n for n in pgm.graph.nodes if n.op in ("call_module", "call_function", "call_method")]
    if not pnodes:
        raise ScheduleError("The pattern has no operation to look for (it only returns its inputs).")
    return pnodes


def _find_subgraphs(owners, pgm: fx.GraphModule) -> list[list[tuple[str, fx.Node]]]:
    pnodes = _pattern_nodes(pgm)
    pkeys = {p: op_key(p, pgm) for p in pnodes}
    results: list[list[tuple[str, fx.Node]]] = []
    claimed: set[fx.Node] = set()
    for pname, owner in owners:
        _match_graph(pname, owner, pnodes, pkeys, claimed, results)
    return results


def _match_graph(
    pname: str, owner: nn.Module, pnodes: list, pkeys: dict, claimed: set, results: list
) -> None:
    """Append every non-overlapping match of the pattern in ``owner``'s graph to ``results``.

    The first pattern operation anchors a match; each next one must be a user of every node already
    matched for its inputs (or, with no matched input, any node), found by backtracking.
    """
    nodes = [n for n in owner.graph.nodes if n.op in ("call_module", "call_function", "call_method")]
    order = {n: i for i, n in enumerate(owner.graph.nodes)}
    keys = {n: op_key(n, owner) for n in nodes}

    def extend(j: int, mapping: dict) -> bool:
        if j == len(pnodes):
            return True
        p = pnodes[j]
        ins = [mapping[a] for a in p.all_input_nodes if a in mapping]
        if ins:
            cands = [u for u in ins[0].users if u in keys and all(u in i.users for i in ins[1:])]
        else:
            cands = nodes
        used = set(mapping.values())
        for c in cands:
            if c in used or c in claimed or not _node_matches(p, pkeys[p], c, keys[c]):
                continue
            mapping[p] = c
            if extend(j + 1, mapping):
                return True
            del mapping[p]
        return False

    for c in nodes:
        if c in claimed or not _node_matches(pnodes[0], pkeys[pnodes[0]], c, keys[c]):
            continue
        mapping = {pnodes[0]: c}
        if extend(1, mapping):
            found = sorted(mapping.values(), key=order.__getitem__)
            claimed.update(found)
            results.append([(pname, n) for n in found])


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
        for p in paths:
            if p == "":
                raise ScheduleError(
                    "trace_until('') names the root itself; use trace(recursive=False) instead."
                )
            self[p]  # raises a ScheduleKeyError naming what exists
        if is_traced(self.mod):
            for p in paths:
                parts = p.split(".")
                for i in range(len(parts) + 1):
                    m = self.get_module(".".join(parts[:i]))
                    if not (is_traced(m) or _is_container(m) or (i == len(parts) and not list(m.children()))):
                        raise ScheduleError(
                            f"The root is already traced but {'.'.join(parts[:i])} is not, so trace_until({p!r}) "
                            "cannot reach it; trace_until() must come before tracing the root."
                        )
            return self.mod
        leaves = list(kwargs.pop("leaf_modules", None) or [])
        if isinstance(leaves, (str, type)):
            leaves = [leaves]
        for p in paths:
            leaves += [f"{p}.{c}" for c in self[p].child]
        return self.trace(recursive=True, flatten=False, leaf_modules=leaves, **kwargs)

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
