"""Tracing by need, and finding nodes and subgraphs in the traced graphs.

Slapo (``slapo.schedule.Schedule.trace`` / ``trace_until`` / ``find_node`` / ``find_subgraph`` /
``find``; seed ``000_dd5d83f90250128c.txt``, and ``slapo/tracer.py``, ``slapo/pattern.py``) traces
modules with ``torch.fx``. On PyTorch 2.13 + transformers 5.x, ``torch.fx.symbolic_trace`` still
traces small submodules (``BertIntermediate``, ``GPT2MLP``, ``LlamaMLP``) but fails on every full
HF model and on their attention and decoder layers. So :meth:`TracingMixin.trace` tries ``torch.fx``
first and falls back to ``torch.export.export`` + ``torch.export.unflatten``, which needs example
inputs: pass ``example_inputs=``, or call :func:`record_example_inputs` once, which runs one forward
pass and remembers every submodule's arguments, so any submodule can be exported on demand.

What tracing does to the schedule (paths never change):

* ``sch.mod`` becomes the traced module (a ``torch.fx.GraphModule``, or for ``torch.export`` an
  ``UnflattenedModule`` whose submodules are ``InterpreterModule`` s, renamed after the classes they
  replace), registered on the parent with ``setattr``; the schedule's children are re-mirrored.
* Parameters and buffers stay the same tensor objects (``torch.export.unflatten`` clones them; the
  originals are put back).
* *Leaf* modules are kept as they are (the same objects, with their ``_slapo_meta`` state and hooks)
  and appear as ``call_module`` nodes: ``torch.nn`` layers, layers with a shard rule (HF ``Conv1D``,
  norms, ``nn.Linear`` subclasses), modules that already carry a hook-based primitive (sync,
  checkpoint, fork_rng, a sharded forward), modules that are already traced, and ``leaf_modules``.
  Under ``torch.export`` leaves are exported with ``preserve_module_call_signature`` and swapped back,
  so they keep their call convention (and can be replaced later); non-leaf submodules become
  ``InterpreterModule`` s that take flat tensors.
* A ``torch.export`` graph is specialised to the module's train/eval mode, to the non-tensor
  arguments and (unless :data:`EXPORT_DYNAMIC_SHAPES` is set) to the example input shapes; the
  unflattened module checks its input shapes and raises on a mismatch.

Graph queries return Slapo's types: :meth:`~TracingMixin.find_node` a list of
``(parent path, fx.Node)``, :meth:`~TracingMixin.find_subgraph` a list of subgraphs, each a list of
``(parent path, fx.Node)`` in graph order; the parent path is relative to the schedule node the
query was called on (``""`` for the node itself).
"""

from __future__ import annotations

import copy
import inspect
import itertools
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

from .errors import ScheduleError
from .module_state import META_ATTR, peek_meta

log = logging.getLogger("slapo_lab")

__all__ = ["ModulePattern", "Pattern", "TracingMixin", "call_module", "is_traced", "record_example_inputs"]

_EXAMPLES_KEY = (
    "module_example_inputs"  # per-module (args, kwargs); the model's own inputs live under "example_inputs"
)
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
    if flatten and tracer == "export":
        raise ScheduleError(
            "flatten=True is only supported by the fx tracer; torch.export keeps the hierarchy."
        )
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
        gm = fx.GraphModule(mod, graph, class_name=name)
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
        gm = fx.GraphModule(root, graph, class_name=name)
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

    return {name: spec(v) for name, v in bound.arguments.items()}


def _export(mod: nn.Module, args: tuple, kwargs: dict, leaves: list[str]):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dyn = None
        if EXPORT_DYNAMIC_SHAPES:
            try:
                dyn = _dynamic_shapes(mod, args, kwargs)
            except Exception:  # noqa: BLE001 - no signature to bind: export static shapes
                dyn = None
        if dyn is not None:
            try:
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


_RENAMED: dict[tuple[type, type], type] = {}


def _renamed(base: type, orig: type) -> type:
    key = (base, orig)
    cls = _RENAMED.get(key)
    if cls is None:
        ns = {"_slapo_orig_class": orig, "__module__": base.__module__}
        if base.__name__ == "UnflattenedModule":
            ns["__deepcopy__"] = _deepcopy_unflattened
        cls = type(orig.__name__, (base,), ns)
        cls.__qualname__ = orig.__qualname__
        _RENAMED[key] = cls
    return cls


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


def _meta_vals(graph: fx.Graph, keep_placeholders: bool = False) -> None:
    """Turn torch.export's FakeTensor ``node.meta["val"]`` into ``meta`` tensors (same shape, dtype and
    strides), so that the traced module can be deep-copied (``Verify`` copies the model). The root's
    placeholders keep theirs: the unflattened module checks its input shapes against them."""

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
        if "val" in node.meta and not (keep_placeholders and node.op == "placeholder"):
            node.meta["val"] = pytree.tree_map(conv, node.meta["val"])


def _deepcopy_unflattened(self, memo):
    """``__deepcopy__`` of a renamed ``UnflattenedModule``: FakeTensors cannot be copied, so the
    input placeholders' ``val`` (shape checks) are shared with the copy instead."""
    placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
    saved = [n.meta.pop("val", None) for n in placeholders]
    try:
        copied = copy._reconstruct(self, memo, *self.__reduce_ex__(4))
    finally:
        for n, v in zip(placeholders, saved):
            if v is not None:
                n.meta["val"] = v
    for n, v in zip([n for n in copied.graph.nodes if n.op == "placeholder"], saved):
        if v is not None:
            n.meta["val"] = v
    return copied


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


def _export_trace(mod: nn.Module, rel: str, opts: _Opts, example: tuple) -> nn.Module:
    """Export ``mod`` with torch.export, unflatten it and put leaves and tensors back."""
    args, kwargs = example
    if rel == "" and opts.concrete_args:
        kwargs = {**kwargs, **opts.concrete_args}
    if _on_meta(mod):
        args, kwargs = _to_meta((args, kwargs))
    leaves = _export_leaves(mod, rel, opts)
    ep = _export(mod, args, kwargs, leaves)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        um = torch.export.unflatten(ep)
    del ep
    for qn in leaves:
        _set_path(um, qn, mod.get_submodule(qn))
    _restore_tensors(um, mod, leaves)
    leaf_set = set(leaves)
    interp = _interp_types()
    for qn, sub in list(um.named_modules()):
        if not isinstance(sub, interp) or qn in leaf_set:
            continue
        if isinstance(getattr(sub, "graph", None), fx.Graph):
            _meta_vals(sub.graph, keep_placeholders=sub is um)
            _simplify_pytree_calls(sub)
            sub.finalize()  # regenerate its code, dropping references to the cloned tensors
        try:
            orig = mod.get_submodule(qn) if qn else mod
        except AttributeError:
            continue
        if type(sub) in interp:
            sub.__class__ = _renamed(type(sub), orig_class(orig))
    _mark_orig(um, mod)
    return um


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


_PLAIN_HOOKS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
)


def _move_plain_hooks(old: nn.Module, new: nn.Module) -> None:
    """Hooks registered on the module (not by a primitive: those refuse tracing) stay at its path (Slapo)."""
    if new is old:
        return
    for attr in _PLAIN_HOOKS:
        src = getattr(old, attr, None)
        if src:
            getattr(new, attr).update(src)
            src.clear()
    if new._backward_hooks:
        new._is_full_backward_hook = old._is_full_backward_hook


def _dummy_examples(sch) -> bool:
    """Record example inputs from a HuggingFace model's ``dummy_inputs`` (token ids), so that torch.export can
    trace a submodule fx cannot (transformers 5.x code unpacks shapes and ``**kwargs``) without the user
    passing inputs; False where the root is not such a model or the forward fails."""
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
        record_example_inputs(top, inputs)
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
            flatten: fx only: inline every non-leaf submodule into one graph.
            leaf_modules: submodule paths (relative to this node), class names or classes that must
                not be traced into.
            tracer: ``"auto"`` (fx, then export), ``"fx"`` or ``"export"``; Slapo's ``"pytorch"`` is
                ``"auto"`` that, on a HuggingFace model without recorded inputs, first records the model's
                ``dummy_inputs`` (one forward pass) so torch.export can stand in where fx fails.
            concrete_args: fx: values that specialise forward arguments; export: extra keyword inputs.
            example_inputs: inputs of this module for torch.export: a tensor, a tuple of positional
                arguments, a dict of keyword arguments or an ``(args, kwargs)`` pair. Defaults to the
                arguments recorded by :func:`record_example_inputs` for this path.

        Returns:
            The traced module, now at this path: an ``fx.GraphModule`` or an ``UnflattenedModule``.

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
        if opts.flatten:
            ex_err = "flatten=True needs the fx tracer"
        else:
            example = opts.example_for("")
            if example is None and opts.dummy_inputs and _dummy_examples(sch):
                opts.examples = sch._top.extra.get(_EXAMPLES_KEY, {})
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
