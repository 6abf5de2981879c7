"""Primitive base class and registry.

Every schedule primitive (``shard``, ``sync``, ``checkpoint`` ...) is a subclass of
:class:`Primitive` registered with :func:`register_primitive`. ``Schedule.__getattr__`` looks the
name up here; calls go through one dispatch point (:meth:`Schedule._dispatch`) that validates,
applies and records them.
"""

from __future__ import annotations

import copy
import inspect
import re
import sys
import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, overload

import torch
from torch import nn

from ..errors import ScheduleError

if TYPE_CHECKING:
    from ..schedule import Schedule

_PRIMITIVES: dict[str, type[Primitive]] = {}
# apply function -> (its signature without ``sch``, the plan of :func:`_fast_bind` or None)
_SIGNATURES: dict[Callable, tuple[inspect.Signature, tuple | None]] = {}


def _signature_entry(apply: Callable) -> tuple[inspect.Signature, tuple | None]:
    entry = _SIGNATURES.get(apply)
    if entry is None:
        full = inspect.signature(apply)
        sig = full.replace(parameters=list(full.parameters.values())[1:])
        entry = _SIGNATURES[apply] = (sig, _bind_plan(sig))
    return entry


def _bind_plan(sig: inspect.Signature) -> tuple | None:
    """``(names, set of names, required names, name of **kwargs or None)`` when every parameter is
    positional-or-keyword, save an optional last ``**kwargs`` (every primitive's shape), else None."""
    names: list[str] = []
    required = set()
    varkw = None
    for p in sig.parameters.values():
        if p.kind is p.POSITIONAL_OR_KEYWORD and varkw is None:
            names.append(p.name)
            if p.default is p.empty:
                required.add(p.name)
        elif p.kind is p.VAR_KEYWORD:
            varkw = p.name
        else:
            return None
    return tuple(names), frozenset(names), frozenset(required), varkw


def _fast_bind(
    sig: inspect.Signature, plan: tuple, args: tuple, kwargs: dict
) -> inspect.BoundArguments | None:
    """What ``sig.bind(*args, **kwargs)`` returns, in a fraction of its time, for a call that binds;
    None for anything else (too many arguments, one given twice or unknown, a required one missing),
    so that ``Signature.bind`` raises its own error."""
    names, known, required, varkw = plan
    if len(args) > len(names):
        return None
    arguments = dict(zip(names, args, strict=False))
    extra = {}
    for k, v in kwargs.items():
        if k in arguments:
            return None
        if k in known:
            arguments[k] = v
        elif varkw is not None:
            extra[k] = v
        else:
            return None
    if not required <= arguments.keys():
        return None
    if kwargs:  # in parameter order, as Signature.bind lists them
        arguments = {n: arguments[n] for n in names if n in arguments}
        if extra:
            arguments[varkw] = extra
    return inspect.BoundArguments(sig, arguments)


class Primitive:
    """A schedule primitive.

    Subclasses set ``name`` and implement :meth:`apply` (``apply(sch, *args, **kwargs)``), which must
    raise :class:`~slapo_lab.errors.ScheduleError` *before* mutating anything when the call cannot
    apply. ``validate`` may be overridden to check without applying (the editor uses it to disable
    buttons with a reason); by default it is the argument-checking part of ``apply`` when the
    subclass splits it out as ``check``.

    Attributes:
        name: the method name on a schedule node.
        positional: how many leading parameters are rendered positionally in recorded code
            (``shard("weight", axis=0)`` has 1, ``sync(mode=..., sync_op_or_fn=...)`` has 0).
        recordable: whether a successful call is appended to the record.
    """

    name: str = ""
    positional: int = 0
    recordable: bool = True

    @staticmethod
    def apply(sch: Schedule, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    @classmethod
    def check(cls, sch: Schedule, *args: Any, **kwargs: Any) -> None:
        """Raise ScheduleError if ``apply`` with these arguments would fail; default: no checks."""
        return

    @classmethod
    def signature(cls) -> inspect.Signature:
        """The user-facing signature (``apply`` without its ``sch`` parameter).

        Computed once per ``apply`` function: ``inspect.signature`` costs tens of microseconds, and
        every call asks three times (bound when a file is validated and when it runs, then recorded).
        """
        return _signature_entry(cls.apply)[0]

    @classmethod
    def bind(cls, *args: Any, **kwargs: Any) -> inspect.BoundArguments:
        """Bind a call's arguments to the signature; a wrong call raises ScheduleError."""
        sig, plan = _signature_entry(cls.apply)
        if plan is not None:
            bound = _fast_bind(sig, plan, args, kwargs)
            if bound is not None:
                return bound
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as err:
            raise ScheduleError(f"{cls.name}() was called with the wrong arguments: {err}.") from None
        return bound


def named_refusal(err: ScheduleError, sch: Schedule, primitive: str) -> ScheduleError:
    """``err`` as a sentence that names the module it refuses: a refusal whose text does not name the node's
    path (``"bwd_post supports only all_reduce (got all_gather)."``) becomes ``"sync() on
    model.layers.0.self_attn.q_proj: bwd_post supports only all_reduce (got all_gather)."``; one that names it
    already, or a subclass of :class:`ScheduleError` (which may carry more), is returned as it is."""
    text = str(err)
    path = getattr(sch, "path", "")
    where = path or f"the root module ({type(sch.mod).__name__})"
    names_it = re.search(rf"(?<![\w.]){re.escape(path)}(?!\w)", text) if path else "root" in text
    if type(err) is not ScheduleError or names_it:
        return err
    named = ScheduleError(f"{primitive}() on {where}: {text}")
    named.__cause__ = err.__cause__
    return named


def register_primitive() -> Callable[[type[Primitive]], type[Primitive]]:
    """Class decorator registering a :class:`Primitive` subclass under its ``name``.

    Raises:
        ValueError: if the class has no name or the name is taken.
    """

    def deco(cls: type[Primitive]) -> type[Primitive]:
        if not cls.name:
            raise ValueError(f"primitive class {cls.__name__} has no name")
        if cls.name in _PRIMITIVES and _PRIMITIVES[cls.name] is not cls:
            raise ValueError(f"a primitive named {cls.name!r} is already registered")
        _PRIMITIVES[cls.name] = cls
        return cls

    return deco


@overload
def list_primitives(name_only: Literal[True] = ...) -> list[str]: ...
@overload
def list_primitives(name_only: Literal[False]) -> dict[str, type[Primitive]]: ...
def list_primitives(name_only: bool = True) -> list[str] | dict[str, type[Primitive]]:
    """All registered primitives: a sorted list of names, or ``{name: class}`` if not ``name_only``."""
    if name_only:
        return sorted(_PRIMITIVES)
    return dict(_PRIMITIVES)


def get_primitive(name: str) -> type[Primitive] | None:
    """The primitive class registered under ``name``, or None."""
    return _PRIMITIVES.get(name)


def check_primitive(sch: Schedule, primitive: str, *args: Any, **kwargs: Any) -> str | None:
    """Whether ``sch.<primitive>(*args, **kwargs)`` would apply: None if yes, else the error sentence.

    Nothing is changed or recorded.
    """
    prim = get_primitive(primitive)
    if prim is None:
        return f"Unknown primitive {primitive!r}; primitives: {', '.join(list_primitives())}."
    try:
        bound = prim.bind(*args, **kwargs)
        prim.check(sch, *bound.args, **bound.kwargs)
    except ScheduleError as err:
        return str(named_refusal(err, sch, primitive))
    return None


#: Module copies made by :meth:`slapo_lab.record.Call.replay_args` that no user holds: id -> the copy (held
#: weakly).
_FRESH: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def register_fresh(obj: Any) -> None:
    """Note ``obj`` as a copy that no user holds (:meth:`slapo_lab.record.Call.replay_args` made it for a
    replay), so the primitive it is handed to adopts it as is (:func:`take_fresh`); held weakly."""
    _FRESH[id(obj)] = obj


def take_fresh(obj: Any) -> bool:
    """Whether ``obj`` is a copy :func:`register_fresh` noted (then it is forgotten: the caller, a primitive
    putting it into a model, owns it and need not copy it again)."""
    if _FRESH.get(id(obj)) is obj:
        del _FRESH[id(obj)]
        return True
    return False


def _model_memo(sch: Schedule) -> dict:
    """A ``copy.deepcopy`` memo that maps every module, parameter and buffer of ``sch``'s model to
    itself, so a copy shares what is already in the model instead of duplicating it."""
    top = sch.get_top_schedule().mod
    memo: dict = {}
    for m in top.modules():
        memo[id(m)] = m
        for t in list(m._parameters.values()) + list(m._buffers.values()):
            if t is not None:
                memo[id(t)] = t
    return memo


def _user_stacklevel() -> int:
    """``stacklevel`` for ``warnings.warn`` called by this module's caller: the first frame outside
    ``slapo_lab`` (the user's line that called the primitive)."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_globals.get("__name__", "").startswith("slapo_lab"):
        frame, level = frame.f_back, level + 1
    return level


def own_copy(sch: Schedule, value: Any, what: str) -> Any:
    """``value`` with every ``nn.Module`` and ``torch.Tensor`` in it deep-copied (also inside plain
    lists, tuples and dicts, which are rebuilt only when they hold one), for a primitive to put into
    the model of ``sch``: later primitives change what is in the model in place (``shard`` slices a
    weight, ``replace`` moves hooks), and that must never change an object the user holds.

    One ``copy.deepcopy`` memo serves the whole value, and it maps everything already in the model
    (modules, parameters, buffers) to itself: a new module that wraps a module of the model or reuses
    its parameters (``new.weight = old.weight``) shares them with the model, as before, and tensors
    shared by two new modules stay shared. Works on any device (``meta`` included). A module copy
    that :meth:`slapo_lab.record.Call.replay_args` made for a replay is owned already and taken as is.
    An object that cannot be deep-copied (e.g. it holds a lock) is used itself, with a warning naming
    ``what`` (the primitive), so the primitive still applies. Other values are returned unchanged.
    """
    if value is None or type(value) in (bool, int, float, str):  # the usual argument: nothing to do
        return value
    memo: dict | None = None

    def leaf(v: Any) -> Any:
        nonlocal memo
        if not isinstance(v, (nn.Module, torch.Tensor)) or take_fresh(v):
            return v
        if memo is None:
            memo = _model_memo(sch)
        try:
            return copy.deepcopy(v, memo)
        except Exception as err:  # noqa: BLE001 - an uncopyable object must not make the primitive fail
            memo = None  # may hold parts of the failed copy
            warnings.warn(
                f"{what}: the {type(v).__name__} passed in could not be copied ({type(err).__name__}: "
                f"{err}); the object itself enters the model, so later primitives change it in place.",
                UserWarning,
                stacklevel=_user_stacklevel(),
            )
            return v

    def walk(v: Any, depth: int) -> Any:
        if depth > 50:
            return v
        if type(v) in (tuple, list):
            items = [walk(x, depth + 1) for x in v]
            same = all(a is b for a, b in zip(items, v, strict=False))
            return v if same else type(v)(items)  # a container without modules or tensors: itself
        if type(v) is dict:
            items = {k: walk(x, depth + 1) for k, x in v.items()}
            return v if all(items[k] is x for k, x in v.items()) else items
        return leaf(v)

    return walk(value, 0)
