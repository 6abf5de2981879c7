"""What every part of tracing stands on: the keys the schedule keeps example inputs under, the helpers that
tell a leaf module from one to trace into, the trace options (:class:`_Opts`, built by :func:`_make_opts` from
:meth:`~slapo_lab.tracing.TracingMixin.trace`'s arguments), and the ``torch.fx`` tracer that keeps leaves.

``call_module`` is the marker node of Slapo's pattern language (``slapo/pattern.py``): it lives here because
the fx and torch.export paths also write it into traced graphs for a leaf called through a dotted target.
The tracing algorithm itself is described in :mod:`slapo_lab.tracing`.
"""

from __future__ import annotations

import inspect
import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.export.unflatten import InterpreterModule, UnflattenedModule

from ..errors import ScheduleError
from ..module_state import META_ATTR, peek_meta
from ..sharding.rules import _DEFAULT, get_shard_rule

_EXAMPLES_KEY = (
    "module_example_inputs"  # per-module (args, kwargs); the model's own inputs live under "example_inputs"
)
_DUMMY_KEY = "example_inputs_are_dummies"  # recorded from a HF model's dummy_inputs: export shape-generic
_TRACERS = ("auto", "fx", "export")


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


def needs_call(mod: nn.Module) -> list[str]:
    """Schedule state of ``mod`` that only works when the module itself is called (hooks, a wrapped forward)."""
    meta = peek_meta(mod)
    if not meta:
        return []
    state = {
        "syncs": meta.syncs,
        "hooks": meta.hooks,
        "checkpoint": meta.checkpoint,
        "fork_rng": meta.fork_rng,
        "partial_reducers": meta.partial_reducers,
    }
    found = [k for k, v in state.items() if v]
    if meta.impl is not None:
        found.append("a sharded forward")
    return found


def _has_shard_rule(mod: nn.Module) -> bool:
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
            _add_leaf_name(opts, top, entry, names, where)
        else:
            raise ScheduleError(f"leaf_modules entries must be paths, class names or classes, not {entry!r}.")
    opts.leaf_types = tuple(types_)


def _add_leaf_name(opts: _Opts, top: nn.Module, entry: str, names: set[str], where: str) -> None:
    """Add the ``leaf_modules`` string ``entry``: a submodule path of ``top``, else a class name among
    ``names``; raises ScheduleError for neither."""
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


def _add_leaf_path(opts: _Opts, mod: nn.Module, path: str) -> None:
    if _is_container(mod):  # a ModuleList is never called: its elements are the leaves
        for name, child in mod.named_children():
            _add_leaf_path(opts, child, f"{path}.{name}")
    else:
        opts.leaf_paths.add(path)


_VAR_POS, _VAR_KW = inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD


def _concrete_values(mod: nn.Module, concrete_args: Any) -> dict[str, Any]:
    """The concrete values of ``trace(concrete_args=...)`` for ``mod``'s forward.

    Slapo's recipe (``{p.name: p.default for the other parameters}``) also names required and ``*``/``**``
    parameters, with the value ``inspect.Parameter.empty``: those are not concrete values and are dropped.

    Raises:
        ScheduleError: for a value that is not a dict with string keys, or a name the forward does not take.
    """
    if not isinstance(concrete_args, dict) or not all(isinstance(k, str) for k in concrete_args):
        raise ScheduleError("concrete_args must be a dict from forward() argument names to values.")
    try:
        params = inspect.signature(type(mod).forward).parameters
    except (TypeError, ValueError):
        params = None
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
                f"concrete_args names {', '.join(unknown)}, which {type(mod).__name__}.forward() does not take."
            )
    return concrete_args


def _tracer_choice(tracer: Any) -> tuple[str, bool]:
    """``(the tracer to use, whether it is Slapo's "pytorch")`` for ``trace(tracer=...)``.

    Slapo's ``tracer="pytorch"``: fx where it can, else torch.export -- on a HuggingFace model with its
    dummy_inputs recorded as example inputs when none were (Slapo's own tracer made up HF inputs too).

    Raises:
        ScheduleError: for ``"huggingface"`` (gone with transformers 5) or an unknown tracer.
    """
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
    return tracer, slapo_pytorch


def _make_opts(sch, recursive, flatten, leaf_modules, tracer, concrete_args, example_inputs) -> _Opts:
    where = _where(sch)
    if not isinstance(recursive, bool):
        raise ScheduleError(f"recursive must be True or False, not {recursive!r}.")
    if not isinstance(flatten, bool):
        raise ScheduleError(f"flatten must be True or False, not {flatten!r}.")
    tracer, slapo_pytorch = _tracer_choice(tracer)
    if flatten and not recursive:
        raise ScheduleError("flatten=True inlines every submodule, so it needs recursive=True.")
    if concrete_args is not None:
        concrete_args = _concrete_values(sch.mod, concrete_args)
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
