"""Module and graph replacement: ``replace``, ``replace_all``, ``fuse``, ``decompose``.

Semantics follow Slapo (``slapo/primitives/replace.py``, ``fusion.py``; ``slapo.op.LinearWithSeparateBias``):

* ``replace(new_module)`` swaps the module at this path (the path stays; the schedule's children
  are re-mirrored from the new module);
* ``replace(new_module_or_fn, target_ops=subgraph)`` replaces a subgraph found with ``find()`` in a
  traced graph by one call (one subgraph = vertical fusion, several = horizontal fusion: the new
  module returns one result per subgraph);
* ``replace(fn, target_ops=(path, node))`` swaps the function of one ``call_function`` node;
* ``fuse(subgraph)`` turns a found subgraph into one module (a ``GraphModule`` of its nodes,
  compiled with ``torch.compile`` by default);
* ``decompose()`` turns an ``nn.Linear`` into :class:`LinearWithSeparateBias`.

Everything is validated before the first change; every refusal is a :class:`ScheduleError` with one
sentence.

Unlike Slapo, which puts the very object passed in into the model, a module (or tensor) passed to
``replace`` -- or returned by ``replace_all``'s ``make_mod_fn`` -- is deep-copied first
(:func:`~slapo_lab.primitives.base.own_copy`; anything already in the model, such as the old module's
parameters, is shared, not copied): later primitives change the model in place (``shard`` slices a
weight), and they must never change an object the user holds. ``replace`` returns the copy in the model.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..errors import ScheduleError
from ..module_state import peek_meta
from ..tracing import (
    edit_graph,
    needs_call,
    orig_class,
    refresh,
)
from .base import Primitive, own_copy, register_primitive
from .subgraphs import (
    SubgraphPlan,
    TargetOps,
    apply_subgraphs,
    as_subgraphs,
    check_call_signature,
    check_fresh_module,
    check_function_for_node,
    check_fusion_hooks,
    check_module_swap,
    check_name,
    check_whole_module,
    fn_signature,
    forward_signature,
    function_call_kwargs,
    is_function,
    move_hooks,
    place_of,
    plan_subgraphs,
    subgraph_module,
    swap_module,
    unique_name,
)

if TYPE_CHECKING:
    from ..schedule import Schedule


class LinearWithSeparateBias(nn.Linear):
    """An ``nn.Linear`` that adds its bias as a separate op: ``F.linear(x, weight) + bias``.

    Shapes: ``x`` ``(*, in_features)`` -> ``(*, out_features)``. Same parameters (names and objects)
    as the Linear it replaces, so shard rules for ``nn.Linear`` apply; traced with ``flatten=True``
    the bias add shows as its own node, ready to be fused with what follows (e.g. a GELU).
    Slapo's ``slapo.op.LinearWithSeparateBias``.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out = F.linear(input, self.weight)
        return out + self.bias if self.bias is not None else out


# ------------------------------------------------------------------------------------------------
# Primitives
# ------------------------------------------------------------------------------------------------
@register_primitive()
class ReplacePrimitive(Primitive):
    """Replace this module, a found subgraph, or a found function call (Slapo's ``replace``).

    * ``replace(new_module)``: the module at this path becomes ``new_module``; its ``forward`` must take
      the same required arguments as the old one (and the recorded call, if example inputs were
      recorded). Plain hooks move to the new module; the path, parameter tags and a pipeline cut stay.
    * ``replace(new_module_or_fn, target_ops=subgraph, name=None, concrete_args=None)``: the subgraph
      (``find()`` output, in a traced graph under this node) becomes one call taking the subgraph's
      external inputs in graph order plus ``concrete_args`` as keywords; several subgraphs become one
      call whose i-th result replaces subgraph i (horizontal fusion). The module is registered under
      ``name`` (default: its class name) numbered as Slapo does -- ``Identity_0``, ``Identity_1`` ...,
      ``name="test"`` gives ``test_0`` -- next to the graph's other submodules; modules only the subgraph
      called are removed. Plain hooks move as in Slapo: the first module's forward-pre and backward hooks
      and the last module's forward hooks go to the new module.
    * ``replace(fn, target_ops=(path, node))``: a ``call_function`` node calls ``fn`` with the same
      arguments; a keyword ``fn`` does not take is dropped when it holds the old function's default
      (``F.relu(x, inplace=False)`` -> ``fn(x)``).

    ``new_module`` is deep-copied before it enters the model (so is every tensor in
    ``concrete_args``), on any device: later primitives (``shard``, ``sync``, hooks moved over by a
    replacement) change the copy, never the object you hold; use the returned module (or
    ``sch[path].mod``) to reach the one in the model. Modules, parameters and buffers the new module
    shares with the model (a wrapper around the old module, ``new.weight = old.weight``) stay shared.
    A module that cannot be deep-copied enters the model itself, with a warning. A function is used
    as is (not copied), tensors it closes over included; nothing here changes it.

    Returns:
        The new module as it is in the model (a copy of ``new_module``), or the new ``fx.Node`` for a
        function.

    Raises:
        ScheduleError: a class instead of an instance, a module already in the model, incompatible
            signatures (both named), malformed or stale ``target_ops``, a subgraph with several
            results, a bad ``name``, a hook that the new module could not keep (see above), a module carrying hook-based primitives, or an export-traced
            submodule that lost its call signature.
    """

    name = "replace"
    positional = 1

    @classmethod
    def check(
        cls,
        sch: Schedule,
        new_mod_or_func: nn.Module | Callable[..., Any],
        target_ops: TargetOps | None = None,
        name: str | None = None,
        concrete_args: dict[str, Any] | None = None,
    ) -> SubgraphPlan | None:
        if concrete_args is not None and (
            not isinstance(concrete_args, dict) or not all(isinstance(k, str) for k in concrete_args)
        ):
            raise ScheduleError("concrete_args must be a dict from argument names to values.")
        if target_ops is None:
            check_whole_module(sch, new_mod_or_func, name, concrete_args)
            return None
        if isinstance(new_mod_or_func, type):
            raise ScheduleError(
                f"replace() takes a module instance, not the class {new_mod_or_func.__name__}."
            )
        if not isinstance(new_mod_or_func, nn.Module) and not is_function(new_mod_or_func):
            raise ScheduleError(
                f"replace() takes an nn.Module or a function, not {type(new_mod_or_func).__name__}."
            )
        subs = as_subgraphs(target_ops)
        if is_function(new_mod_or_func) and len(subs) == 1 and len(subs[0]) == 1:
            return check_function_for_node(sch, new_mod_or_func, target_ops, subs[0][0][1], concrete_args)
        if isinstance(new_mod_or_func, nn.Module):
            check_fresh_module(sch, new_mod_or_func, name)
        plan = plan_subgraphs(sch, target_ops)
        if isinstance(new_mod_or_func, nn.Module):
            label = f"{type(new_mod_or_func).__name__}.forward"
            check_call_signature(forward_signature(new_mod_or_func), label, plan, concrete_args)
            check_fusion_hooks(plan.owner, target_ops)
        else:
            label = getattr(new_mod_or_func, "__name__", "the function")
            check_call_signature(fn_signature(new_mod_or_func), label, plan, concrete_args)
        return plan

    @staticmethod
    def apply(
        sch: Schedule,
        new_mod_or_func: nn.Module | Callable[..., Any],
        target_ops: TargetOps | None = None,
        name: str | None = None,
        concrete_args: dict[str, Any] | None = None,
    ) -> nn.Module | fx.Node:
        plan = ReplacePrimitive.check(sch, new_mod_or_func, target_ops, name, concrete_args)
        subs = as_subgraphs(target_ops) if plan is not None else None
        # the model gets its own copies: later primitives must not change the user's objects
        new_mod_or_func, concrete_args = own_copy(sch, (new_mod_or_func, concrete_args), "replace()")
        if plan is None:
            return swap_module(sch, new_mod_or_func)
        if is_function(new_mod_or_func) and len(subs) == 1 and len(subs[0]) == 1:
            node = subs[0][0][1]
            graph = edit_graph(plan.owner)
            kwargs = function_call_kwargs(new_mod_or_func, node, concrete_args)
            with graph.inserting_after(node):
                call = graph.call_function(new_mod_or_func, node.args, kwargs)
            node.replace_all_uses_with(call)
            graph.erase_node(node)
            refresh(plan.owner)
            return call
        if isinstance(new_mod_or_func, nn.Module):
            name = unique_name(plan.owner, name or type(new_mod_or_func).__name__)
            move_hooks(check_fusion_hooks(plan.owner, target_ops), new_mod_or_func)
            apply_subgraphs(sch, plan, new_mod_or_func, name, concrete_args)
            return new_mod_or_func
        return apply_subgraphs(sch, plan, new_mod_or_func, None, concrete_args)


@register_primitive()
class ReplaceAllPrimitive(Primitive):
    """Replace every submodule of ``target_type`` (this node included) with ``make_mod_fn(path, module)``
    (Slapo's ``replace_all``). ``path`` is relative to this node; a match inside another match is left
    to the outer replacement. As with ``replace``, the returned modules are deep-copied (together, so
    what they share stays shared; what they share with the model, e.g. the old module's parameters,
    is not copied) before they enter the model, so a module ``make_mod_fn`` hands out that the user
    still holds is never changed by later primitives.

    Returns:
        list[str]: the replaced paths (from the root).

    Raises:
        ScheduleError: a ``target_type`` that is not a module class, a ``make_mod_fn`` that is not
            callable, raises or returns a non-module, no submodule of that type, or any replacement
            ``replace()`` would refuse (checked for all before the first swap).
    """

    name = "replace_all"
    positional = 2

    @staticmethod
    def _targets(sch, target_type):
        found = []
        for rel, sub in sch.named_schedules():
            if isinstance(sub.mod, target_type) and not any(
                rel.startswith(f"{r}.") or r == "" for r, _ in found
            ):
                found.append((rel, sub))
        return found

    @classmethod
    def check(
        cls,
        sch: Schedule,
        target_type: type[nn.Module] | tuple[type[nn.Module], ...],
        make_mod_fn: Callable[[str, nn.Module], nn.Module],
    ) -> list[tuple[str, Schedule]]:
        types_ = target_type if isinstance(target_type, tuple) else (target_type,)
        if not types_ or not all(isinstance(t, type) and issubclass(t, nn.Module) for t in types_):
            raise ScheduleError(
                f"replace_all() takes an nn.Module class (or a tuple of them), not {target_type!r}."
            )
        if not callable(make_mod_fn):
            raise ScheduleError("make_mod_fn must be a callable (path, module) -> new module.")
        targets = cls._targets(sch, types_)
        if not targets:
            names = ", ".join(t.__name__ for t in types_)
            raise ScheduleError(f"No module of type {names} under {place_of(sch)}.")
        return targets

    @staticmethod
    def apply(
        sch: Schedule,
        target_type: type[nn.Module] | tuple[type[nn.Module], ...],
        make_mod_fn: Callable[[str, nn.Module], nn.Module],
    ) -> list[str]:
        targets = ReplaceAllPrimitive.check(sch, target_type, make_mod_fn)
        news = []
        for rel, sub in targets:
            try:
                new = make_mod_fn(rel, sub.mod)
            except Exception as err:
                raise ScheduleError(
                    f"make_mod_fn failed for {sub.path or 'the root'}: {type(err).__name__}: {err}."
                ) from err
            if not isinstance(new, nn.Module):
                raise ScheduleError(
                    f"make_mod_fn returned a {type(new).__name__} for {sub.path or 'the root'}, not an nn.Module."
                )
            if any(new is n for n in news):
                raise ScheduleError(
                    "make_mod_fn returned the same module object twice; return a fresh module per path."
                )
            check_module_swap(sub, new)
            news.append(new)
        news = own_copy(sch, news, "replace_all()")
        for (_, sub), new in zip(targets, news, strict=False):
            swap_module(sub, new)
        return [sub.path for _, sub in targets]


_COMPILERS = (None, "torch.compile", "TorchScript")


@register_primitive()
class FusePrimitive(Primitive):
    """Fuse one found subgraph into a single module (Slapo's ``fuse``, vertical fusion).

    The module is a ``GraphModule`` (class name ``name``) of the subgraph's nodes, sharing the
    submodules they call; it takes the subgraph's external inputs in graph order and returns its
    result. ``compiler="torch.compile"`` (default) compiles it with ``nn.Module.compile()`` (lazily, at
    the first call); ``None`` leaves it uncompiled. ``"TorchScript"`` (Slapo's default, deprecated in
    PyTorch 2.x) is mapped to ``torch.compile`` with a ``FutureWarning``. The module is registered as
    ``name`` numbered as Slapo does (``FusedModule_0``, ``FusedModule_1`` ...) in the graph's owner.

    Returns:
        The fused module.

    Raises:
        ScheduleError: an unknown compiler or bad name, anything but exactly one subgraph of two or more
            nodes, or a subgraph ``replace()`` would refuse.
    """

    name = "fuse"
    positional = 1

    @classmethod
    def check(
        cls,
        sch: Schedule,
        subgraph: TargetOps,
        compiler: str | None = "torch.compile",
        name: str = "FusedModule",
    ) -> SubgraphPlan:
        if compiler not in _COMPILERS:
            raise ScheduleError(f"Unknown compiler {compiler!r}; use 'torch.compile' or None.")
        check_name(name)
        subs = as_subgraphs(subgraph)
        if len(subs) != 1 or len(subs[0]) < 2:
            raise ScheduleError(
                f"fuse() fuses one subgraph of two or more nodes (vertical fusion), not {len(subs)} subgraph(s) "
                f"of {', '.join(str(len(s)) for s in subs)} node(s)."
            )
        return plan_subgraphs(sch, subgraph)

    @staticmethod
    def apply(
        sch: Schedule, subgraph: TargetOps, compiler: str | None = "torch.compile", name: str = "FusedModule"
    ) -> fx.GraphModule:
        plan = FusePrimitive.check(sch, subgraph, compiler, name)
        if compiler == "TorchScript":
            warnings.warn(
                "fuse(compiler='TorchScript'): TorchScript is deprecated in PyTorch 2.x; using "
                "torch.compile instead.",
                FutureWarning,
                stacklevel=3,
            )
            compiler = "torch.compile"
        uname = unique_name(plan.owner, name)
        fused = subgraph_module(plan, name)
        if compiler == "torch.compile":
            fused.compile()
        apply_subgraphs(sch, plan, fused, uname, None)
        return fused


@register_primitive()
class DecomposePrimitive(Primitive):
    """Turn this ``nn.Linear`` into :class:`LinearWithSeparateBias` (Slapo's ``decompose``): the same
    weight and bias objects, but the bias is added as a separate op. Must come before ``shard``.

    Raises:
        ScheduleError: if the module is not an ``nn.Linear``, is already decomposed, has no bias, has a
            sharded weight or bias, or carries hook-based primitives.
    """

    name = "decompose"
    positional = 0

    @classmethod
    def check(cls, sch: Schedule) -> None:
        mod, where = sch.mod, place_of(sch)
        if isinstance(mod, LinearWithSeparateBias):
            raise ScheduleError(f"{where} is already decomposed.")
        if not isinstance(mod, nn.Linear):
            raise ScheduleError(
                f"decompose() applies to an nn.Linear, but {where} is a {orig_class(mod).__name__}."
            )
        if mod.bias is None:
            raise ScheduleError(f"{where} has no bias to separate.")
        meta = peek_meta(mod)
        sharded = meta.sharded if meta else {}
        if (
            sharded
            or getattr(mod.weight, "shard_axis", None) is not None
            or getattr(mod.bias, "shard_axis", None) is not None
        ):
            raise ScheduleError(f"{where} is already sharded; decompose() must come before shard().")
        state = needs_call(mod)
        if state:
            raise ScheduleError(
                f"{where} already carries {', '.join(state)}; decompose it before those primitives."
            )

    @staticmethod
    def apply(sch: Schedule) -> nn.Module:
        DecomposePrimitive.check(sch)
        old = sch.mod
        with torch.device("meta"):
            new = LinearWithSeparateBias(old.in_features, old.out_features, bias=True)
        new.weight = old.weight
        new.bias = old.bias
        return swap_module(sch, new)
