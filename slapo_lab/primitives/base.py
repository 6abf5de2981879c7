"""Primitive base class and registry.

Every schedule primitive (``shard``, ``sync``, ``checkpoint`` ...) is a subclass of
:class:`Primitive` registered with :func:`register_primitive`. ``Schedule.__getattr__`` looks the
name up here; calls go through one dispatch point (:meth:`Schedule._dispatch`) that validates,
applies and records them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ..errors import ScheduleError

_PRIMITIVES: dict[str, type[Primitive]] = {}


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
    def apply(sch, *args, **kwargs) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    @classmethod
    def check(cls, sch, *args, **kwargs) -> None:
        """Raise ScheduleError if ``apply`` with these arguments would fail; default: no checks."""
        return

    @classmethod
    def signature(cls) -> inspect.Signature:
        """The user-facing signature (``apply`` without its ``sch`` parameter)."""
        sig = inspect.signature(cls.apply)
        params = list(sig.parameters.values())[1:]
        return sig.replace(parameters=params)

    @classmethod
    def bind(cls, *args, **kwargs) -> inspect.BoundArguments:
        """Bind a call's arguments to the signature; a wrong call raises ScheduleError."""
        try:
            bound = cls.signature().bind(*args, **kwargs)
        except TypeError as err:
            raise ScheduleError(f"{cls.name}() was called with the wrong arguments: {err}.") from None
        return bound


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


def list_primitives(name_only: bool = True):
    """All registered primitives: a sorted list of names, or ``{name: class}`` if not ``name_only``."""
    if name_only:
        return sorted(_PRIMITIVES)
    return dict(_PRIMITIVES)


def get_primitive(name: str) -> type[Primitive] | None:
    """The primitive class registered under ``name``, or None."""
    return _PRIMITIVES.get(name)
