"""The ``fx.GraphModule`` types tracing produces, and the graph edits made on them.

* :class:`TracedGraphModule` (a deep copy keeps hooks, ``_slapo_meta`` and children no node calls) and the
  torch.export root that keeps the original call (:class:`_CallInfo`, :class:`_CallCodeGen`).
* :func:`_to_graph_modules` turns ``torch.export.unflatten``'s ``InterpreterModule`` hierarchy
  (PyTorch 2.13, ``torch/export/unflatten.py``) into such graph modules; :func:`_flatten_export` inlines it
  (``flatten=True``); :func:`_simplify_pytree_calls` folds the pytree flatten/unflatten calls export leaves
  around a preserved call back into plain arguments.
* :func:`edit_graph` / :func:`refresh`: how primitives change a traced graph and recompile it.

The tracing algorithm is described in :mod:`slapo_lab.tracing`.
"""

from __future__ import annotations

import copy
import inspect
import logging
import operator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo

from ..errors import ScheduleError
from .base import _fetch, _interp_types, _join, _short, orig_class

log = logging.getLogger("slapo_lab")


def _simplify_pytree_calls(owner: nn.Module) -> None:
    """Remove the pytree (un)flattening that torch.export puts around preserved-signature calls.

    ``getitem(getitem(tree_unflatten([a, b], spec), 0), 1)`` becomes ``b`` and
    ``getitem(tree_flatten_spec(y, leaf_spec), 0)`` becomes ``y``, so a leaf's ``call_module`` node
    consumes and feeds the neighbouring ops directly (and patterns match across it).
    """
    changed = False
    for node in list(owner.graph.nodes):
        if node.op != "call_function":
            continue
        if _is_unflatten_call(node):
            changed = _fold_unflatten(owner, node) or changed
        elif _is_flatten_spec_call(node):
            changed = _fold_flatten_spec(owner, node) or changed
    if changed:
        _drop_dead_pytree_nodes(owner.graph)


class _Leaf:
    """Leaf ``i`` of a flat list, in the structure a pytree spec unflattens it to."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


def _plain(x: Any) -> bool:
    """Whether ``x`` is a builtin container of leaves, which can be written as a graph argument."""
    if isinstance(x, _Leaf) or x is None:
        return True
    if type(x) in (tuple, list):
        return all(_plain(v) for v in x)
    if type(x) is dict:
        return all(isinstance(k, str) and _plain(v) for k, v in x.items())
    return False


def _build(x: Any, flat: list) -> Any:
    """The structure ``x`` with each leaf replaced by its value in ``flat``."""
    if isinstance(x, _Leaf):
        return flat[x.i]
    if type(x) in (tuple, list):
        return type(x)(_build(v, flat) for v in x)
    if type(x) is dict:
        return {k: _build(v, flat) for k, v in x.items()}
    return x


def _resolve_getitems(node: fx.Node, struct: Any, flat: list) -> None:
    """Replace the ``getitem`` users of ``node`` (whose value has the structure ``struct`` of leaves of
    ``flat``) by the leaf or plain container they pick, recursively."""
    for user in list(node.users):
        if user.op != "call_function" or user.target is not operator.getitem or user.args[0] is not node:
            continue
        try:
            sub = struct[user.args[1]]
        except (KeyError, IndexError, TypeError):
            continue
        if isinstance(sub, _Leaf):
            _replace_uses(user, flat[sub.i])
        else:
            _resolve_getitems(user, sub, flat)
            if user.users and _plain(sub):
                _replace_uses(user, _build(sub, flat))


def _is_get_attr(x: Any) -> bool:
    return isinstance(x, fx.Node) and x.op == "get_attr"


def _is_unflatten_call(node: fx.Node) -> bool:
    """``tree_unflatten([a, b, ...], <spec attribute>)``."""
    return (
        node.target is pytree.tree_unflatten
        and len(node.args) == 2
        and _is_get_attr(node.args[1])
        and isinstance(node.args[0], (list, tuple))
    )


def _is_flatten_spec_call(node: fx.Node) -> bool:
    """``tree_flatten_spec(<a call_module's result>, <spec attribute>)``."""
    return (
        getattr(node.target, "__name__", "") == "tree_flatten_spec"
        and len(node.args) == 2
        and isinstance(node.args[0], fx.Node)
        and node.args[0].op == "call_module"
        and _is_get_attr(node.args[1])
    )


def _fold_unflatten(owner: nn.Module, node: fx.Node) -> bool:
    """Make the ``getitem`` users of a ``tree_unflatten`` call read its flat arguments; whether it could."""
    spec = _fetch(owner, node.args[1].target)
    flat = list(node.args[0])
    try:
        struct = pytree.tree_unflatten([_Leaf(i) for i in range(len(flat))], spec)
    except Exception as err:  # noqa: BLE001 - leave this call's plumbing as torch.export wrote it
        log.debug("kept tree_unflatten %s: %s", node.name, _short(err))
        return False
    _resolve_getitems(node, struct, flat)
    return True


def _fold_flatten_spec(owner: nn.Module, node: fx.Node) -> bool:
    """Make ``getitem(tree_flatten_spec(y, leaf_spec), 0)`` read ``y``; whether the spec was a leaf."""
    spec = _fetch(owner, node.args[1].target)
    if not spec.is_leaf():
        return False
    for user in list(node.users):
        if user.target is operator.getitem and user.args[1] == 0:
            user.replace_all_uses_with(node.args[0])
    return True


def _drop_dead_pytree_nodes(graph: fx.Graph) -> None:
    """Erase what became dead, only pure pytree plumbing: getitem, tree_* and their spec get_attrs."""
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
        new_kwargs = self._traced_keywords(values, extra)
        self._check_defaults_left(values)
        if extra:
            raise TypeError(
                f"{self.name} was traced without the keyword(s) {', '.join(extra)}, which this call passes."
            )
        return new_args, new_kwargs

    def _traced_keywords(self, values: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
        """The traced keywords, taken out of the bound ``values`` or the ``**kwargs`` ``extra``; raises
        TypeError for one the call does not pass."""
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
        return new_kwargs

    def _check_defaults_left(self, values: dict[str, Any]) -> None:
        """Raise TypeError for a parameter of ``values`` (those the trace did not take) not at its default."""
        for k, v in values.items():
            default = self.sig.parameters[k].default
            if v is not default and (isinstance(v, torch.Tensor) or v != default):
                raise TypeError(
                    f"{self.name} was traced with {k} left at its default, so it cannot take {k}={_short(repr(v), 60)}."
                )

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
    env = _inline_inputs(call, sub)
    out: Any = None
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
        _inline_results(graph, call, out)
    else:
        _replace_uses(call, out)
    graph.erase_node(call)


def _inline_inputs(call: fx.Node, sub: fx.GraphModule) -> dict[fx.Node, Any]:
    """``sub``'s placeholders -> what ``call`` passes them (positionally, by keyword, or their defaults).

    Raises:
        ScheduleError: for an input the call gives no value for.
    """
    env: dict[fx.Node, Any] = {}
    args = list(call.args)
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
                f"{call.target} cannot be inlined: its call gives no value for its input {ph.target}."
            )
    return env


def _inline_results(graph: fx.Graph, call: fx.Node, out: tuple | list) -> None:
    """Make the users of ``call`` read the inlined results ``out``: each ``getitem`` the element it picks, any
    other use one rebuilt container."""
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
