"""What ``replace``, ``replace_all`` and ``fuse`` (``primitives/replace.py``) share: the checks of a new module's or
function's call signature, swapping a module at a path, and the mechanics of subgraph replacement -- finding a found
subgraph's owner, inputs and result, moving the replaced modules' hooks, rewriting the graph and pruning what is
left. Every check raises :class:`~slapo_lab.errors.ScheduleError` with one sentence before anything changes.
"""

from __future__ import annotations

import inspect
import keyword
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

from torch import fx, nn

from ..errors import ScheduleError
from ..module_state import module_meta, peek_meta
from ..tracing import (
    _EXAMPLES_KEY,
    HOOK_DICTS,
    edit_graph,
    is_traced,
    lost_call_signature,
    needs_call,
    orig_class,
    refresh,
    set_child,
)

if TYPE_CHECKING:
    from ..schedule import Schedule

#: What ``find()`` returns and ``target_ops=`` takes: a ``(path, node)`` pair, one subgraph (a list of pairs)
#: or a list of subgraphs.
TargetOps: TypeAlias = (
    tuple[str, fx.Node] | Sequence[tuple[str, fx.Node]] | Sequence[Sequence[tuple[str, fx.Node]]]
)
#: Which hooks of which module move to a fusing module: ``[(module, kinds)]`` (see :func:`check_fusion_hooks`).
HookMoves: TypeAlias = list[tuple[nn.Module, list[str]]]


def place_of(sch: Schedule) -> str:
    """The schedule's module path for a sentence (``"the root module"`` for the root)."""
    return sch.path or "the root module"


# ------------------------------------------------------------------------------------------------
# Signatures
# ------------------------------------------------------------------------------------------------
def forward_signature(mod: nn.Module) -> inspect.Signature | None:
    """``forward``'s signature without ``self`` (the class's forward: primitives may wrap the instance's)."""
    try:
        sig = inspect.signature(type(mod).forward)
    except (TypeError, ValueError):
        return None
    return sig.replace(parameters=list(sig.parameters.values())[1:])


def fn_signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    """``inspect.signature(fn)``, or None for a callable without one (a builtin)."""
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _sig_text(owner: str, sig: inspect.Signature | None) -> str:
    return f"{owner}{sig if sig is not None else '(...)'}"


def _calls_compatible(old: inspect.Signature, new: inspect.Signature) -> bool:
    """Whether ``new`` accepts every call ``old`` requires (its required arguments) and needs no more."""
    P = inspect.Parameter
    pos = [
        p
        for p in old.parameters.values()
        if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD) and p.default is P.empty
    ]
    kw = {p.name: None for p in old.parameters.values() if p.kind == P.KEYWORD_ONLY and p.default is P.empty}
    try:
        new.bind(*range(len(pos)), **kw)
    except TypeError:
        return False
    return True


def _check_module_signature(sch, new: nn.Module) -> None:
    old = sch.mod
    new_sig = forward_signature(new)
    if new_sig is None:
        return
    recorded = sch._top.extra.get(_EXAMPLES_KEY, {}).get(sch.path)
    old_sig = forward_signature(old)
    old_txt = _sig_text(f"{orig_class(old).__name__}.forward", old_sig)
    new_txt = _sig_text(f"{type(new).__name__}.forward", new_sig)
    if recorded is not None:  # the real call is known: it must bind
        args, kwargs = recorded
        try:
            new_sig.bind(*args, **kwargs)
        except TypeError as err:
            raise ScheduleError(
                f"{new_txt} cannot take the call {place_of(sch)} receives ({len(args)} positional, keywords "
                f"{', '.join(kwargs) or 'none'}: {err}), unlike {old_txt}."
            ) from None
    for owner_path, node in _graph_calls(sch):  # traced ancestors call it with these arguments
        try:
            new_sig.bind(*node.args, **node.kwargs)
        except TypeError as err:
            raise ScheduleError(
                f"{new_txt} cannot take the call {node.name} in the traced graph of {owner_path or 'the root'} "
                f"makes ({len(node.args)} positional, keywords {', '.join(node.kwargs) or 'none'}: {err})."
            ) from None
    if old_sig is not None and not _calls_compatible(old_sig, new_sig):
        raise ScheduleError(f"{new_txt} does not take the same required arguments as {old_txt}.")


def _graph_calls(sch):
    """``(ancestor path, call_module node)`` for every traced ancestor's call of ``sch``'s module."""
    rel, anc = sch.name, sch.parent
    while anc is not None:
        if is_traced(anc.mod):
            for node in anc.mod.graph.nodes:
                if node.op == "call_module" and node.target == rel:
                    yield anc.path, node
        rel = f"{anc.name}.{rel}" if anc.name else rel
        anc = anc.parent


# ------------------------------------------------------------------------------------------------
# Whole-module replacement
# ------------------------------------------------------------------------------------------------
def check_module_swap(sch: Schedule, new: Any) -> None:
    """Validate replacing ``sch.mod`` by module ``new`` (raises ScheduleError)."""
    where = place_of(sch)
    if isinstance(new, type):
        raise ScheduleError(
            f"replace() takes a module instance, not the class {new.__name__}; call it first."
        )
    if not isinstance(new, nn.Module):
        raise ScheduleError(f"replace() takes an nn.Module or a function, not {type(new).__name__}.")
    if new is sch.mod:
        raise ScheduleError(f"{where} would be replaced by itself.")
    top = sch.get_top_schedule().mod
    for qn, m in top.named_modules():
        if m is new:
            raise ScheduleError(
                f"The new module is already in the model at {qn or 'the root'}; pass a fresh module."
            )
    if lost_call_signature(sch.mod):
        raise ScheduleError(
            f"{where} was traced by torch.export as part of its parent, which does not keep its call signature; "
            "trace the parent with this path in leaf_modules (or replace before tracing) to replace it."
        )
    state = needs_call(sch.mod)
    if state:
        raise ScheduleError(
            f"{where} already carries {', '.join(state)}; replace it before applying those primitives."
        )
    _check_module_signature(sch, new)


def swap_module(sch: Schedule, new: nn.Module) -> nn.Module:
    """Put ``new`` at ``sch``'s path (no checks, no record): move plain hooks, keep parameter tags
    and the pipeline cut, re-mirror the children."""
    old = sch.mod
    for attr in HOOK_DICTS:
        src = getattr(old, attr, None)
        if src:
            getattr(new, attr).update(src)
            src.clear()
    tags = sch.metadata.param_tags
    if tags:
        new_params = dict(new.named_parameters())
        for pname, p in old.named_parameters():
            q = new_params.get(pname)
            if q is not None and q is not p:
                for k in tags:
                    if k in p.__dict__ and k not in q.__dict__:
                        setattr(q, k, p.__dict__[k])
    meta = peek_meta(old)
    if meta and meta.cut:
        module_meta(new).cut = True
    new.train(old.training)
    if sch.parent is not None:
        set_child(sch.parent.mod, sch.name, new)
    sch.mod = new
    sch._rebuild_children()
    return new


# ------------------------------------------------------------------------------------------------
# Subgraph replacement
# ------------------------------------------------------------------------------------------------
def _is_pair(x) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], fx.Node)


def as_subgraphs(target_ops: TargetOps) -> list[list[tuple[str, fx.Node]]]:
    """Normalise what ``find()`` returns: a pair, one subgraph (a list of pairs) or a list of subgraphs."""
    if _is_pair(target_ops):
        return [[target_ops]]
    if isinstance(target_ops, (list, tuple)) and target_ops:
        if all(_is_pair(x) for x in target_ops):
            return [list(target_ops)]
        if all(isinstance(x, (list, tuple)) and x and all(_is_pair(y) for y in x) for x in target_ops):
            return [list(x) for x in target_ops]
    raise ScheduleError(
        "target_ops must be what find() returns: a (path, node) pair, a list of them (one subgraph) or a "
        "non-empty list of such lists."
    )


@dataclass
class SubgraphPlan:
    owner_path: str  # relative to the schedule node replace() was called on
    owner: nn.Module
    subgraphs: list[list[fx.Node]]
    outs: list[fx.Node]
    inputs: list[fx.Node]
    order: dict
    anchor: tuple[str, fx.Node]


def plan_subgraphs(sch: Schedule, target_ops: TargetOps) -> SubgraphPlan:
    """Validate found subgraphs for replacement by one call (raises ScheduleError)."""
    subs = as_subgraphs(target_ops)
    nodes = [n for sub in subs for _, n in sub]
    graph = nodes[0].graph
    if any(n.graph is not graph for n in nodes):
        raise ScheduleError(
            "The nodes in target_ops come from different graphs; one replacement works inside one graph."
        )
    if any(getattr(n, "_erased", False) for n in nodes):
        raise ScheduleError(
            "Some nodes in target_ops were removed by an earlier replacement; call find() again."
        )
    owner_path, owner = _graph_owner(sch, graph)
    if len(set(nodes)) != len(nodes):
        raise ScheduleError("A node appears twice in target_ops; subgraphs must not overlap.")
    for n in nodes:
        if n.op not in ("call_module", "call_function", "call_method"):
            raise ScheduleError(f"target_ops may only hold operations, not the {n.op} node {n.name}.")
    order = {n: i for i, n in enumerate(graph.nodes)}
    all_nodes = set(nodes)
    groups, outs, inputs = [], [], []
    for sub in subs:
        group = sorted((n for _, n in sub), key=order.__getitem__)
        outs.append(_subgraph_result(group))
        _collect_inputs(group, all_nodes, inputs)
        groups.append(group)
    anchor = _anchor(all_nodes, inputs, outs, order)
    return SubgraphPlan(owner_path, owner, groups, outs, inputs, order, anchor)


def _graph_owner(sch: Schedule, graph: fx.Graph) -> tuple[str, nn.Module]:
    """``(path relative to sch, module)`` of the traced module under ``sch`` whose graph is ``graph``.

    Raises:
        ScheduleError: when no traced module under ``sch`` holds it.
    """
    for qn, m in sch.mod.named_modules():
        if getattr(m, "graph", None) is graph and is_traced(m):
            return qn, m
    raise ScheduleError(
        f"The nodes in target_ops are not in a traced graph under {place_of(sch)}; call replace() on the "
        "schedule you called find() on (or on an ancestor)."
    )


def _subgraph_result(group: list[fx.Node]) -> fx.Node:
    """The one node of ``group`` (in graph order) whose value is used outside it.

    Raises:
        ScheduleError: when none or several are.
    """
    members = set(group)
    out = [n for n in group if any(u not in members for u in n.users)]
    if not out:
        raise ScheduleError(f"The subgraph {', '.join(n.name for n in group)} has no result used outside it.")
    if len(out) > 1:
        raise ScheduleError(
            f"The subgraph {', '.join(n.name for n in group)} has {len(out)} results used outside it "
            f"({', '.join(n.name for n in out)}); one call can stand for one result per subgraph."
        )
    return out[0]


def _collect_inputs(group: list[fx.Node], all_nodes: set[fx.Node], inputs: list[fx.Node]) -> None:
    """Append to ``inputs`` the nodes outside every subgraph that ``group`` reads, in first-use order.

    Raises:
        ScheduleError: when ``group`` reads another subgraph's node (subgraphs feeding each other).
    """
    members = set(group)
    for n in group:
        for a in n.all_input_nodes:
            if a in members:
                continue
            if a in all_nodes:
                raise ScheduleError(
                    f"Subgraphs that feed each other ({a.name} -> {n.name}) cannot be fused horizontally."
                )
            if a not in inputs:
                inputs.append(a)


def _anchor(
    all_nodes: set[fx.Node], inputs: list[fx.Node], outs: list[fx.Node], order: dict[fx.Node, int]
) -> tuple[str, fx.Node]:
    """Where the one call goes: ``("before", first node)`` when every input is computed by then, else
    ``("after", last input)``.

    Raises:
        ScheduleError: when a result is used before that point.
    """
    first = min(all_nodes, key=order.__getitem__)
    last_in = max((order[a] for a in inputs), default=-1)
    anchor = ("before", first) if last_in < order[first] else ("after", max(inputs, key=order.__getitem__))
    pos = order[first] - 0.5 if anchor[0] == "before" else last_in + 0.5
    for out in outs:
        for u in out.users:
            if u not in all_nodes and order[u] < pos:
                raise ScheduleError(
                    f"The subgraphs cannot become one call: {u.name} uses {out.name} before input "
                    f"{anchor[1].name} is computed."
                )
    return anchor


def check_call_signature(
    sig: inspect.Signature | None, label: str, plan: SubgraphPlan, concrete_args: dict[str, Any] | None
) -> None:
    """Refuse (ScheduleError) a replacement whose signature ``sig`` cannot take the subgraph's inputs plus
    ``concrete_args``; ``label`` names it in the sentence."""
    if sig is None:
        return
    try:
        sig.bind(*plan.inputs, **(concrete_args or {}))
    except TypeError:
        extra = f" and concrete_args {', '.join(concrete_args)}" if concrete_args else ""
        raise ScheduleError(
            f"{_sig_text(label, sig)} cannot take the subgraph's {len(plan.inputs)} input(s) "
            f"({', '.join(a.name for a in plan.inputs) or 'none'}){extra}; adjust it or pass concrete_args."
        ) from None


def unique_name(owner: nn.Module, base: str) -> str:
    """``base_0``, ``base_1``, ...: the first not yet an attribute of ``owner`` (Slapo's
    ``_get_unique_module_name`` in Slapo 0.0.3 ``slapo/primitives/replace.py``: a given name is numbered too)."""
    i = 0
    while hasattr(owner, f"{base}_{i}"):
        i += 1
    return f"{base}_{i}"


_FWD_PRE = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs")
_FWD_POST = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")
_BWD = ("_backward_pre_hooks", "_backward_hooks")
_KIND_ATTRS = {"fwd_pre": _FWD_PRE, "fwd_post": _FWD_POST, "bwd_post": _BWD}


def _has(mod: nn.Module, attrs) -> bool:
    """Whether ``mod`` has a hook in the dicts ``attrs`` (the with-kwargs / always-called sets only flag hooks)."""
    return any(getattr(mod, a, None) for a in attrs if not a.endswith(("_with_kwargs", "_always_called")))


def move_hooks(moves: HookMoves, new: nn.Module) -> None:
    """Copy the hooks :func:`check_fusion_hooks` picked onto ``new`` (the old modules keep theirs)."""
    for old, kinds in moves:
        for kind in kinds:
            for attr in _KIND_ATTRS[kind]:
                src = getattr(old, attr, None)
                if src:
                    getattr(new, attr).update(src)
        if "bwd_post" in kinds and old._backward_hooks:
            new._is_full_backward_hook = old._is_full_backward_hook


def check_fusion_hooks(owner: nn.Module, target_ops: TargetOps) -> HookMoves:
    """Which plain hooks of the modules a replaced subgraph calls move to the new module (Slapo's
    ``transfer_hooks_for_fusion``, Slapo 0.0.3 ``slapo/utils/common.py``): ``[(module, kinds)]`` with kinds
    among ``"fwd_pre"``, ``"fwd_post"``, ``"bwd_post"``.

    One subgraph: the first module's forward-pre and backward hooks and the last module's forward hooks move.

    Raises:
        ScheduleError: a hook that would be lost -- any hook in horizontal fusion (several subgraphs), a forward
            hook on the first module (or a forward-pre / backward hook on the last) of several, any hook on a
            module in between.
    """
    subs = as_subgraphs(target_ops)
    if len(subs) > 1:
        _refuse_hooks_in_horizontal_fusion(owner, subs)
        return []
    moves: HookMoves = []
    nodes = [n for _, n in subs[0]]
    for i, node in enumerate(nodes):
        m = _called_module(owner, node)
        if m is not None:
            kinds = _hook_kinds_kept(m, node, first=i == 0, last=i == len(nodes) - 1)
            if kinds:
                moves.append((m, kinds))
    return moves


def _called_module(owner: nn.Module, node: fx.Node) -> nn.Module | None:
    """The submodule of ``owner`` a ``call_module`` node calls, or None."""
    if node.op != "call_module":
        return None
    try:
        return owner.get_submodule(node.target) if isinstance(owner, nn.Module) else None
    except AttributeError:
        return None


def _refuse_hooks_in_horizontal_fusion(owner: nn.Module, subs: list[list[tuple[str, fx.Node]]]) -> None:
    """Raise ScheduleError for a module with a hook in one of several subgraphs (none could be kept)."""
    for sub in subs:
        for _, node in sub:
            m = _called_module(owner, node)
            if m is not None and (_has(m, _FWD_PRE) or _has(m, _FWD_POST) or _has(m, _BWD)):
                raise ScheduleError(
                    f"{node.target} carries hooks, which cannot be kept when several subgraphs become one "
                    "call (horizontal fusion); remove them first."
                )


def _hook_kinds_kept(m: nn.Module, node: fx.Node, first: bool, last: bool) -> list[str]:
    """The kinds of ``m``'s hooks that move to the new module: forward-pre and backward hooks of the first
    op, forward hooks of the last.

    Raises:
        ScheduleError: for a hook elsewhere (the new module could not keep it).
    """
    kinds = []
    if _has(m, _FWD_PRE) or _has(m, _BWD):
        if not first:
            raise ScheduleError(
                f"{node.target} has a forward-pre or backward hook but is not the first op of the subgraph; "
                "the new module could not keep it."
            )
        kinds += ["fwd_pre", "bwd_post"]
    if _has(m, _FWD_POST):
        if not last:
            raise ScheduleError(
                f"{node.target} has a forward hook but is not the last op of the subgraph; the new module "
                "could not keep it."
            )
        kinds.append("fwd_post")
    return kinds


def check_name(name: Any) -> None:
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        raise ScheduleError(f"A module name must be a Python identifier without dots, not {name!r}.")


def apply_subgraphs(
    sch: Schedule,
    plan: SubgraphPlan,
    new: nn.Module | Callable[..., Any],
    name: str | None,
    concrete_args: dict[str, Any] | None,
) -> fx.Node:
    """Replace the planned subgraphs by one ``call_module(name)`` (``new`` a module) or
    ``call_function(new)`` node; prune what became unused; refresh code and schedule."""
    owner, graph = plan.owner, edit_graph(plan.owner)
    is_module = isinstance(new, nn.Module)
    if is_module:
        owner.add_module(name, new)
    where, node = plan.anchor
    ctx = graph.inserting_before(node) if where == "before" else graph.inserting_after(node)
    with ctx:
        if is_module:
            call = graph.call_module(name, tuple(plan.inputs), dict(concrete_args or {}))
        else:
            call = graph.call_function(new, tuple(plan.inputs), dict(concrete_args or {}))
    if len(plan.outs) == 1:
        plan.outs[0].replace_all_uses_with(call)
    else:
        prev = call
        for i, out in enumerate(plan.outs):
            with graph.inserting_after(prev):
                item = graph.call_function(operator.getitem, (call, i))
            out.replace_all_uses_with(item)
            prev = item
    erased = sorted((n for g in plan.subgraphs for n in g), key=plan.order.__getitem__, reverse=True)
    targets = {n.target for n in erased if n.op == "call_module"}
    for n in erased:
        graph.erase_node(n)
    _prune_modules(owner, targets)
    refresh(owner)
    (sch[plan.owner_path] if plan.owner_path else sch)._rebuild_children()
    return call


def _prune_modules(owner: nn.Module, targets: set[str]) -> None:
    """Delete submodules that only the erased nodes called (Slapo: ``delete_all_unused_submodules``)."""
    used = [n.target for n in owner.graph.nodes if n.op in ("call_module", "get_attr")]
    for t in targets:
        if any(u == t or u.startswith(t + ".") for u in used):
            continue
        prefix, _, last = t.rpartition(".")
        try:
            parent = owner.get_submodule(prefix) if prefix else owner
        except AttributeError:
            continue
        if last in parent._modules:
            del parent._modules[last]


def subgraph_module(plan: SubgraphPlan, name: str) -> fx.GraphModule:
    """A ``GraphModule`` computing one planned subgraph: inputs -> its result (Slapo's ``_construct_fx_graph``)."""
    owner = plan.owner
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in plan.inputs:
        env[a] = graph.placeholder(a.name)
    root: dict[str, Any] = {}
    for n in plan.subgraphs[0]:
        env[n] = graph.node_copy(n, lambda x: env[x])
        if n.op == "call_module" and n.target not in root:
            root[n.target] = owner.get_submodule(n.target)
    graph.output(env[plan.outs[0]])
    gm = fx.GraphModule(root, graph, class_name=name)
    gm.training = owner.training
    return gm


def function_call_kwargs(
    fn: Callable[..., Any], node: fx.Node, concrete_args: dict[str, Any] | None
) -> dict | None:
    """The keywords ``fn`` is called with in place of ``node``'s function, or None if it cannot take the call.

    ``node``'s arguments plus ``concrete_args``; keywords ``fn`` does not accept are dropped when they hold the
    old function's default (fx records ``F.relu(x, inplace=False)``, which ``identity(x)`` can stand for, as
    Slapo allows).
    """
    kwargs = {**node.kwargs, **(concrete_args or {})}
    sig = fn_signature(fn)
    if sig is None:
        return kwargs
    try:
        sig.bind(*node.args, **kwargs)
        return kwargs
    except TypeError:
        pass
    old = fn_signature(node.target) if callable(node.target) else None
    P = inspect.Parameter
    if old is None or any(p.kind == P.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    kept = {}
    for k, v in kwargs.items():
        param = old.parameters.get(k)
        is_default = (
            k in node.kwargs
            and k not in (concrete_args or {})
            and param is not None
            and param.default is not P.empty
            and type(param.default) is type(v)
            and param.default == v
        )
        if k in sig.parameters or not is_default:
            kept[k] = v
    try:
        sig.bind(*node.args, **kept)
    except TypeError:
        return None
    return kept


def is_function(x: object) -> bool:
    """A plain callable: not a module, not a class."""
    return callable(x) and not isinstance(x, (nn.Module, type))


def check_whole_module(
    sch: Schedule, new: Any, name: str | None, concrete_args: dict[str, Any] | None
) -> None:
    """Validate ``replace(new)`` without ``target_ops``: a module for this path (raises ScheduleError)."""
    if is_function(new):
        raise ScheduleError("A function can only replace a found node or subgraph: pass target_ops=.")
    if name is not None and name != sch.name:
        raise ScheduleError(
            f"name= only names a module replacing a subgraph; {place_of(sch)} keeps its path when replaced."
        )
    if concrete_args:
        raise ScheduleError("concrete_args only applies when replacing a subgraph (target_ops=).")
    check_module_swap(sch, new)


def check_function_for_node(
    sch: Schedule,
    fn: Callable[..., Any],
    target_ops: TargetOps,
    node: fx.Node,
    concrete_args: dict[str, Any] | None,
) -> SubgraphPlan:
    """Validate a function replacing the one found ``node``: a ``call_function`` whose arguments it takes
    (raises ScheduleError)."""
    plan = plan_subgraphs(sch, target_ops)
    if node.op != "call_function":
        raise ScheduleError(
            f"A function can replace a call_function node, but {node.name} is a {node.op}; replace "
            "the module at its path instead."
        )
    if function_call_kwargs(fn, node, concrete_args) is None:
        sig = fn_signature(fn)
        raise ScheduleError(
            f"{_sig_text(getattr(fn, '__name__', 'the function'), sig)} cannot take the "
            f"arguments of {node.name} ({len(node.args)} positional, keywords "
            f"{', '.join(node.kwargs) or 'none'})."
        )
    return plan


def check_fresh_module(sch: Schedule, new: nn.Module, name: str | None) -> None:
    """Raise ScheduleError for a new module already in the model, or a bad ``name``."""
    if new is sch.mod or any(m is new for m in sch.get_top_schedule().mod.modules()):
        raise ScheduleError("The new module is already in the model; pass a fresh module.")
    if name is not None:
        check_name(name)
