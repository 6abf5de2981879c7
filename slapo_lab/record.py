"""The recorded schedule: every successful primitive call, clicked or typed, as data.

A :class:`Call` is ``(path, primitive, args, kwargs)`` in canonical form (the primitive's signature
decides which leading parameters are positional), so ``shard("weight", 0)`` typed in a cell and the
editor's ``shard("weight", axis=0)`` record -- and render -- identically.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

SCHEMA = "slapo-lab/schedule"
SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Call:
    """One recorded primitive call: ``sch[path].<primitive>(*args, **kwargs)``."""

    path: str
    primitive: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        """A JSON-able dict; raises TypeError naming the value if an argument is not JSON-able."""
        for v in (*self.args, *self.kwargs.values()):
            _check_jsonable(v, f'sch["{self.path}"].{self.primitive}')
        return {"path": self.path, "primitive": self.primitive, "args": list(self.args), "kwargs": dict(self.kwargs)}

    @staticmethod
    def from_json(d: dict) -> "Call":
        """The inverse of :meth:`to_json` (raises KeyError for a dict without path/primitive)."""
        return Call(d["path"], d["primitive"], tuple(d.get("args", ())), dict(d.get("kwargs", {})))


def _check_jsonable(v: Any, where: str) -> None:
    if v is None or isinstance(v, (bool, int, float, str)):
        return
    if isinstance(v, (list, tuple)):
        for x in v:
            _check_jsonable(x, where)
        return
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        for x in v.values():
            _check_jsonable(x, where)
        return
    raise TypeError(f"{where} has an argument of type {type(v).__name__} that cannot be saved as JSON")


def pystr(s: str) -> str:
    """A Python string literal for ``s`` (``repr``-safe), double-quoted when that needs no escaping."""
    r = repr(s)
    if '"' not in s and "'" not in s:
        r = '"' + r[1:-1] + '"'
    return r


def _literal(v: Any) -> str:
    if isinstance(v, str):
        return pystr(v)
    if callable(v) and not isinstance(v, type):
        name = getattr(v, "__qualname__", None) or type(v).__name__
        return f"<{name}>"
    return repr(v)


def format_call(call: Call, var: str = "sch") -> str:
    """One line of Python: ``sch["a.b"].shard("weight", axis=0)``.

    The path and every argument are rendered as literals (``repr``), so no module name can inject code.
    """
    parts = [_literal(a) for a in call.args] + [f"{k}={_literal(v)}" for k, v in call.kwargs.items()]
    return f"{var}[{pystr(call.path)}].{call.primitive}({', '.join(parts)})"


class Recorder:
    """The ordered list of successful primitive calls of one schedule tree, with listeners."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self._listeners: list[Callable[["Recorder"], None]] = []

    def __len__(self) -> int:
        return len(self.calls)

    def add_listener(self, fn: Callable[["Recorder"], None]) -> None:
        """Call ``fn(recorder)`` after every change (listener errors are swallowed and logged)."""
        self._listeners.append(fn)

    def remove_listener(self, fn) -> None:
        """Stop calling ``fn`` (no error if it was not registered)."""
        if fn in self._listeners:
            self._listeners.remove(fn)

    def append(self, call: Call) -> None:
        """Record one successful call and notify the listeners (the schedule's dispatch point calls this)."""
        self.calls.append(call)
        self._notify()

    def _notify(self) -> None:
        import logging

        for fn in list(self._listeners):
            try:
                fn(self)
            except Exception:  # a view must never break the engine
                logging.getLogger("slapo_lab").exception("record listener failed")

    def code(self, var: str = "sch") -> str:
        """All calls as Python text, one line each."""
        return "\n".join(format_call(c, var) for c in self.calls)

    def to_json(self) -> list[dict]:
        """Every call as a JSON-able dict (raises TypeError naming a non-JSON argument)."""
        return [c.to_json() for c in self.calls]


def dumps(calls: list[Call], meta: dict | None = None) -> str:
    """Serialise calls to the versioned JSON schedule format."""
    return json.dumps({"schema": SCHEMA, "version": SCHEMA_VERSION, "meta": meta or {},
                       "calls": [c.to_json() for c in calls]}, indent=1)


def replay(sch, calls) -> None:
    """Apply ``calls`` (Call objects or their JSON dicts) to schedule ``sch`` in order.

    Raises:
        ScheduleError: from the first call that fails (earlier calls stay applied).
    """
    for c in calls:
        if isinstance(c, dict):
            c = Call.from_json(c)
        getattr(sch[c.path], c.primitive)(*c.args, **c.kwargs)
