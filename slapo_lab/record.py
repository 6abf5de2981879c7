"""The recorded schedule: every successful primitive call, clicked or typed, as data.

A :class:`Call` is ``(path, primitive, args, kwargs)`` in canonical form (the primitive's signature
decides which leading parameters are positional), so ``shard("weight", 0)`` typed in a cell and the
editor's ``shard("weight", axis=0)`` record -- and render -- identically.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from torch import nn

from .errors import ScheduleError
from .primitives import get_primitive, list_primitives
from .primitives.base import register_fresh

if TYPE_CHECKING:
    from .schedule import Schedule

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
        return {
            "path": self.path,
            "primitive": self.primitive,
            "args": list(self.args),
            "kwargs": dict(self.kwargs),
        }

    @staticmethod
    def from_json(d: dict) -> Call:
        """The inverse of :meth:`to_json` (raises KeyError for a dict without path/primitive)."""
        return Call(d["path"], d["primitive"], tuple(d.get("args", ())), dict(d.get("kwargs", {})))

    def keep_pristine(self) -> Call:
        """Keep private copies of the ``nn.Module`` arguments (e.g. ``replace(new_module)``) as they are now.

        Call this *before* the primitive runs. The primitive puts a copy of a user's module into the
        model (:func:`slapo_lab.primitives.base.own_copy`), but the user may still change their object
        afterwards, and a call recorded while replaying holds the very copy that went into the model,
        which later primitives change in place (``shard`` slices its weight, ``replace`` moves hooks
        onto it); replaying that object would replay those later changes too. Returns ``self``;
        a no-op (no copy) when no argument is a module, or when a module cannot be deep-copied
        (then replay uses the object itself, as recorded).
        """
        if _has_module((self.args, self.kwargs)):
            try:
                object.__setattr__(self, "_pristine", _copy_modules((self.args, self.kwargs)))
            except Exception:  # noqa: BLE001, S110 - an uncopyable module must not make the primitive fail
                pass
        return self

    def replay_args(self) -> tuple[tuple, dict]:
        """``(args, kwargs)`` to replay this call with: fresh copies of the pristine module arguments.

        The copies belong to whoever replays them: a primitive handed one adopts it as is instead of
        copying it once more (see :func:`slapo_lab.primitives.base.take_fresh`; primitives copy every other
        module argument).
        """
        pristine = self.__dict__.get("_pristine")
        if pristine is None:
            return self.args, dict(self.kwargs)
        args, kwargs = _copy_modules(pristine, fresh=True)
        return tuple(args), dict(kwargs)


_SCALARS = frozenset({type(None), bool, int, float, str})


def _is_module(v: Any) -> bool:
    if type(v) in _SCALARS:  # the usual argument: no torch look-up
        return False
    return isinstance(v, nn.Module)


def _has_module(v: Any, depth: int = 0) -> bool:
    if depth > 50:
        return False
    if isinstance(v, (list, tuple, dict)):
        for x in v.values() if isinstance(v, dict) else v:
            if type(x) not in _SCALARS and _has_module(x, depth + 1):  # most arguments are scalars
                return True
        return False
    return _is_module(v)


def _copy_modules(v: Any, depth: int = 0, fresh: bool = False) -> Any:
    """``v`` with every ``nn.Module`` inside (lists, tuples, dicts) deep-copied; other values shared.

    ``fresh=True`` registers the copies for :func:`slapo_lab.primitives.base.take_fresh`.
    """
    if depth > 50:
        return v
    if isinstance(v, tuple):
        return tuple(_copy_modules(x, depth + 1, fresh) for x in v)
    if isinstance(v, list):
        return [_copy_modules(x, depth + 1, fresh) for x in v]
    if isinstance(v, dict):
        return {k: _copy_modules(x, depth + 1, fresh) for k, x in v.items()}
    if not _is_module(v):
        return v
    c = copy.deepcopy(v)
    if fresh:
        register_fresh(c)
    return c


class Action(NamedTuple):
    """One user action: a click, a preset, an "apply to all similar", or one typed call."""

    label: str
    calls: tuple


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
        self._listeners: list[Callable[[Recorder], None]] = []
        # (index of an action's first call, label; None: a typed line, labelled with its code)
        self._starts: list[tuple[int, str | None]] = []
        self._open: list[str] = []  # labels of the open ``action()`` blocks
        self._open_started = False  # the outermost open block has recorded a call

    @contextlib.contextmanager
    def action(self, label: str) -> Iterator[None]:
        """Group the calls recorded inside the block into one action (undo/redo pop whole actions).

        Nested blocks join the outermost one. A call recorded outside any block is an action of its
        own (one typed line). An empty block records nothing::

            with sch.record.action("Megatron TP preset"):
                sl.presets.megatron_tp(sch)
        """
        outer = not self._open
        self._open.append(str(label))
        if outer:
            self._open_started = False
        try:
            yield self
        finally:
            self._open.pop()
            if outer:
                self._open_started = False

    def actions(self) -> list[Action]:
        """The calls grouped into actions, oldest first (calls edited by hand count one action each).

        Linear in the number of calls and actions (a loaded file may hold one action per call).
        """
        n = len(self.calls)
        starts = [(i, lab, at) for at, (i, lab) in enumerate(self._starts) if 0 <= i < n]
        # ends[k]: the first later start beyond starts[k] (a next-greater scan), else the end of the record
        ends = [n] * len(starts)
        pending: list[int] = []
        for k, (j, _, _) in enumerate(starts):
            while pending and starts[pending[-1]][0] < j:
                ends[pending.pop()] = j
            pending.append(k)
        out: list[Action] = []
        pos = 0
        for k, (i, lab, at) in enumerate(starts):
            if i < pos:
                continue
            while pos < i:  # calls without a recorded start (appended to .calls by hand)
                out.append(Action(format_call(self.calls[pos]), (self.calls[pos],)))
                pos += 1
            if lab is None:  # a typed line: its code, kept for the next time
                lab = format_call(self.calls[i])
                self._starts[at] = (i, lab)
            end = ends[k]
            out.append(Action(lab, tuple(self.calls[i:end])))
            pos = end
        while pos < n:
            out.append(Action(format_call(self.calls[pos]), (self.calls[pos],)))
            pos += 1
        return out

    def __len__(self) -> int:
        return len(self.calls)

    def add_listener(self, fn: Callable[[Recorder], None]) -> None:
        """Call ``fn(recorder)`` after every change (listener errors are swallowed and logged)."""
        self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[Recorder], None]) -> None:
        """Stop calling ``fn`` (no error if it was not registered)."""
        if fn in self._listeners:
            self._listeners.remove(fn)

    def append(self, call: Call) -> None:
        """Record one successful call and notify the listeners (the schedule's dispatch point calls this)."""
        if not self._open:  # one typed line: labelled with its code when actions() is asked for
            self._starts.append((len(self.calls), None))
        elif not self._open_started:
            self._starts.append((len(self.calls), self._open[0]))
            self._open_started = True
        self.calls.append(call)
        self._notify()

    def _notify(self) -> None:
        if not self._listeners:
            return
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
    return json.dumps(
        {
            "schema": SCHEMA,
            "version": SCHEMA_VERSION,
            "meta": meta or {},
            "calls": [c.to_json() for c in calls],
        },
        indent=1,
    )


def replay(sch: Schedule, calls: Iterable[Call | dict]) -> None:
    """Apply ``calls`` (Call objects or their JSON dicts) to schedule ``sch`` in order.

    Only registered primitives are called (like :func:`slapo_lab.load_schedule`): every call is
    checked for a known primitive name, a string path and list/dict arguments before the first one
    is applied. Module arguments recorded with :meth:`Call.keep_pristine` are replayed as fresh
    copies of their state at record time.

    Raises:
        ScheduleError: a malformed call or an unknown primitive (nothing applied), or the error of
            the first call that fails (earlier calls stay applied).
    """
    checked = []
    for n, c in enumerate(calls, 1):
        if isinstance(c, dict):
            try:
                if not isinstance(c.get("args", []), (list, tuple)) or not isinstance(
                    c.get("kwargs", {}), dict
                ):
                    raise TypeError
                c = Call.from_json(c)
            except (KeyError, TypeError, ValueError):
                raise ScheduleError(f"Call {n} is not a {{path, primitive, args, kwargs}} object.") from None
        if not isinstance(c, Call) or not isinstance(c.path, str):
            raise ScheduleError(f"Call {n} is not a recorded call with a string path.")
        if not isinstance(c.primitive, str) or get_primitive(c.primitive) is None:
            raise ScheduleError(
                f"Call {n} (on {c.path!r}) names {c.primitive!r}, which is not a primitive; "
                f"known: {', '.join(list_primitives())}."
            )
        if not all(isinstance(k, str) for k in c.kwargs):
            raise ScheduleError(
                f"Call {n} (sch[{c.path!r}].{c.primitive}) has a keyword that is not a string."
            )
        checked.append(c)
    for c in checked:
        args, kwargs = c.replay_args()
        getattr(sch[c.path], c.primitive)(*args, **kwargs)
