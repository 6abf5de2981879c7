"""Finding nodes and subgraphs in traced graphs: Slapo's pattern language and its matcher.

A pattern is a function or a :class:`Pattern` module (Slapo's ``slapo/pattern.py``: ``Pattern``,
``ModulePattern``, ``call_module``); it is traced with ``torch.fx`` (:func:`_trace_pattern`) and matched
against every graph below the schedule node (:func:`_find_subgraphs`: the first pattern operation anchors a
match, each next one must be a user of the nodes already matched, found by backtracking). Nodes compare by
:func:`op_key`: a module call and its functional form match (``nn.Linear`` and ``F.linear``, transformers'
``GELUActivation`` and ``F.gelu``), operators and their ``torch`` functions too.
"""

from __future__ import annotations

import operator
import re
import types
from typing import Any

import torch
from torch import fx, nn

from ..errors import ScheduleError
from .base import _compile_regex, _fetch, _is_builtin, _short, _Tracer, call_module, is_traced, orig_class


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
        return _module_key(node, owner)
    if node.op == "call_function":
        return _function_key(node)
    if node.op == "call_method":
        return _op_name(node.target)
    return None


def _module_key(node: fx.Node, owner: nn.Module) -> Any:
    """:func:`op_key` of a ``call_module`` node: the op its (original) class computes, or the class."""
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


def _function_key(node: fx.Node) -> Any:
    """:func:`op_key` of a ``call_function`` node: an operator's or aten op's name, or the function's."""
    t = node.target
    if t is call_module:
        return ("module_regex", node.args[0])
    if t in _OPERATORS:
        return _OPERATORS[t]
    if isinstance(t, torch._ops.OpOverload):
        return _op_name(t.overloadpacket.__name__)
    name = getattr(t, "__name__", None)
    return _op_name(name) if name else ("function", t)


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
