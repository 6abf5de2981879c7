"""The schedule tree: one :class:`Schedule` node per module, mirroring the ``nn.Module`` hierarchy.

``create_schedule(model)`` builds it; ``sch["encoder.layer.0.attention"]`` walks it; primitive calls
(``sch[p].shard("weight", axis=0)``) go through one dispatch point that validates, applies and records
them (see :mod:`slapo_lab.record`). API and semantics follow Slapo's ``slapo.schedule`` (seed
``000_dd5d83f90250128c.txt``).
"""

from __future__ import annotations

import contextlib
import inspect
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .errors import ScheduleError
from .primitives import get_primitive, list_primitives
from .primitives.base import Primitive, named_refusal
from .record import Call, Recorder
from .sharding.sync_ops import TPGroup
from .tracing import TracingMixin, hides_children


@dataclass
class ScheduleMetadata:
    """Metadata of a schedule tree, kept on the top node (Slapo's ``ScheduleMetadata``).

    Attributes:
        tie_weights: tied parameter -> the other parameter objects it shares storage with.
        param_tags: free-form parameter tags (``annotate``).
        primitives: per-primitive data, e.g. ``primitives["cut_pipeline_stage"]`` = list of cut paths.
    """

    tie_weights: dict = field(default_factory=dict)
    param_tags: set = field(default_factory=set)
    primitives: dict = field(default_factory=lambda: {"cut_pipeline_stage": []})


class _TopState:
    """State shared by every node of one schedule tree."""

    def __init__(self, group, world_size: int, rank: int, simulated: bool) -> None:
        self.group = group
        self.world_size = world_size
        self.rank = rank
        self.simulated = simulated
        self.record = Recorder()
        self.metadata = ScheduleMetadata()
        self.extra: dict[str, Any] = {}
        self.lock = None  # see Schedule.serialize_with
        self.retired: str | None = None  # see Schedule.adopt_tree: why calls on this tree are refused


def _resolve_world(group, world_size: int | None, rank: int | None) -> tuple[Any, int, int, bool]:
    if dist.is_available() and dist.is_initialized():
        if world_size is not None and group is None and world_size != dist.get_world_size():
            raise ScheduleError(
                f"world_size={world_size} was given, but the initialised process group has "
                f"{dist.get_world_size()} ranks; pass group= for a subgroup or drop world_size."
            )
        g = group if group is not None else dist.group.WORLD
        return g, dist.get_world_size(g), dist.get_rank(g), False
    ws = 1 if world_size is None else world_size
    if not isinstance(ws, int) or isinstance(ws, bool) or ws < 1:
        raise ScheduleError(f"world_size must be a positive integer, not {world_size!r}.")
    r = 0 if rank is None else rank
    if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < ws:
        raise ScheduleError(f"rank must be an integer in [0, {ws}), not {rank!r}.")
    return None, ws, r, True


class Schedule(TracingMixin):
    """A node of the schedule tree (Slapo's ``Schedule``).

    Attributes:
        mod: the module this node schedules.
        name: its attribute name in the parent ("" for the root).
        path: dotted path from the root ("" for the root).
        parent: the parent node, or None.
        child: ``OrderedDict`` name -> child ``Schedule``.

    Primitive calls are attribute look-ups resolved against the registry
    (:func:`slapo_lab.list_primitives`); each raises :class:`ScheduleError` with one clear sentence
    when it cannot apply, before changing anything.
    """

    def __init__(
        self,
        mod: nn.Module,
        name: str = "",
        path: str = "",
        parent: Schedule | None = None,
        group: dist.ProcessGroup | None = None,
        _top: _TopState | None = None,
        world_size: int | None = None,
        rank: int | None = None,
    ) -> None:
        if not isinstance(mod, nn.Module):
            raise ScheduleError(f"A schedule needs a torch.nn.Module, not a {type(mod).__name__}.")
        if _top is None:
            g, ws, r, sim = _resolve_world(group, world_size, rank)
            _top = _TopState(g, ws, r, sim)
        self.__dict__["_top"] = _top
        self.mod = mod
        self.name = name
        self.path = path
        self.parent = parent
        self.child: OrderedDict[str, Schedule] = OrderedDict()
        for cname, cmod in () if hides_children(mod) else mod.named_children():
            cpath = f"{path}.{cname}" if path else cname
            self.child[cname] = Schedule(cmod, cname, cpath, self, _top=_top)

    # --- shared state -------------------------------------------------------------------------
    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group (None when simulated)."""
        return self._top.group

    @property
    def world_size(self) -> int:
        """Tensor-parallel width this schedule slices for."""
        return self._top.world_size

    @property
    def rank(self) -> int:
        """This process's rank within :attr:`group` (or the simulated rank)."""
        return self._top.rank

    @property
    def simulated(self) -> bool:
        """True when there is no process group: primitives slice, syncs only change shapes."""
        return self._top.simulated

    @property
    def tp(self) -> TPGroup:
        """The tensor-parallel group handed to the sync ops."""
        return TPGroup(self.world_size, self.rank, self.group)

    @property
    def record(self) -> Recorder:
        """The recorder of the whole tree."""
        return self._top.record

    @property
    def metadata(self) -> ScheduleMetadata:
        """The tree's :class:`ScheduleMetadata`."""
        return self._top.metadata

    # --- navigation ---------------------------------------------------------------------------
    def __getitem__(self, path: str) -> Schedule:
        """The node at dotted ``path`` relative to this one (``"encoder.layer.0"``; "" is self).

        Raises:
            KeyError (a ScheduleError): with one sentence naming the missing part and what exists.
        """
        if not isinstance(path, str):
            raise ScheduleError(f"A schedule path must be a string like 'encoder.layer.0', not {path!r}.")
        if path == "":
            return self
        with self._top.lock or contextlib.nullcontext():  # not half-way through a UI's adopt_tree
            return self._walk(path)

    def _walk(self, path: str) -> Schedule:
        node = self
        for part in path.split("."):
            if part not in node.child:
                where = node.path or "the root module"
                names = ", ".join(list(node.child)[:8]) or "none"
                raise ScheduleKeyError(
                    f"No module {path!r} in the schedule: {where} has no child {part!r} (its children: {names})."
                )
            node = node.child[part]
        return node

    def __contains__(self, path: str) -> bool:
        try:
            self[path]
        except ScheduleError:
            return False
        return True

    def named_schedules(self, prefix: str = "") -> Iterator[tuple[str, Schedule]]:
        """Yield ``(path, node)`` for this node and every descendant, depth first."""
        yield prefix, self
        for name, sub in self.child.items():
            yield from sub.named_schedules(f"{prefix}.{name}" if prefix else name)

    def get_top_schedule(self) -> Schedule:
        """The root node of this tree."""
        node = self
        while node.parent is not None:
            node = node.parent
        return node

    def serialize_with(self, lock: contextlib.AbstractContextManager | None) -> None:
        """Run every primitive call on this schedule tree under ``lock`` (or none, with None).

        For a UI that applies calls from another thread than the user's code: JupyterLab 4.4+ with
        ipykernel 7 delivers widget messages on a comm thread while cells run on the main thread. The
        UI holds the same re-entrant lock (a ``threading.RLock``) for a whole action, so a call typed
        meanwhile waits and is recorded after the action, never inside it.
        """
        self._top.lock = lock

    def adopt_tree(self, other: Schedule) -> None:
        """Make this root node stand for ``other``'s tree from now on, so that handles to it stay valid.

        A UI that rebuilds a schedule (undo replays the earlier calls on a fresh copy of the model) keeps
        the root object users hold (``sch = editor.schedule``): this root takes ``other``'s module,
        children, record and metadata. Every other node of the old tree (``layer = sch["encoder.layer.0"]``
        taken before) is retired: a primitive called on it raises :class:`ScheduleError` with one
        sentence saying to take the node again, so a call never lands on a model that is no longer
        shown, recorded or exported.

        Args:
            other: the root of the new tree (built with :func:`create_schedule`).

        Raises:
            ScheduleError: if this node or ``other`` is not a root.
        """
        if self.parent is not None or other.parent is not None:
            raise ScheduleError("adopt_tree() takes the root nodes of two schedule trees.")
        old = self._top
        state = dict(other.__dict__)
        for key in [k for k in self.__dict__ if k not in state]:
            del self.__dict__[key]
        self.__dict__.update(state)  # one dict update: a reader on another thread sees old or new
        for sub in self.child.values():
            sub.parent = self
        if old is not self._top:
            old.retired = (
                "it belongs to a schedule the editor has rebuilt since (undo, redo, load or clear); take "
                "it again from the current schedule, e.g. editor.schedule[path]"
            )

    def get_module(self, name: str) -> nn.Module:
        """The module at ``name`` relative to this node: its schedule node's module, or (Slapo's
        ``get_module``) a submodule without a node of its own, such as one inlined by ``trace(flatten=True)``.

        Raises:
            KeyError (a ScheduleError): with one sentence naming the missing part and what exists.
        """
        try:
            return self[name].mod
        except ScheduleKeyError:
            try:
                return self.mod.get_submodule(name)
            except AttributeError:
                pass
            raise

    def _rebuild_children(self) -> None:
        """Re-mirror the children after a primitive replaced modules below this node."""
        self._top.extra.pop("owners", None)  # the tied-tensor owner index may be stale now
        self.child = OrderedDict()
        for cname, cmod in () if hides_children(self.mod) else self.mod.named_children():
            cpath = f"{self.path}.{cname}" if self.path else cname
            self.child[cname] = Schedule(cmod, cname, cpath, self, _top=self._top)

    def __repr__(self) -> str:
        return f"Schedule(path={self.path!r}, module={type(self.mod).__name__}, world_size={self.world_size})"

    # --- primitives ---------------------------------------------------------------------------
    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        prim = get_primitive(name)
        if prim is None:
            raise AttributeError(
                f"Schedule has no primitive or attribute {name!r}; primitives: {', '.join(list_primitives())}."
            )

        def call(*args, **kwargs):
            return self._dispatch(prim, args, kwargs)

        call.__name__ = name
        call.__doc__ = prim.__doc__
        return call

    def owners_of(self, tensor: torch.Tensor) -> list[tuple[nn.Module, str]]:
        """Every (module, attribute name) in this tree holding exactly ``tensor`` (tied weights).

        Backed by an index of the whole tree, built once and dropped whenever a primitive that may
        change the module structure runs; entries are re-checked on every look-up.
        """
        top = self._top
        root = self.get_top_schedule().mod
        idx = top.extra.get("owners")
        if idx is None or top.extra.get("owners_root") is not root:
            idx = {}
            seen = set()
            for mod in root.modules():
                if id(mod) in seen:
                    continue
                seen.add(id(mod))
                for n, t in list(mod._parameters.items()) + list(mod._buffers.items()):
                    if t is not None:
                        idx.setdefault(id(t), (t, []))[1].append((mod, n))
            top.extra["owners"], top.extra["owners_root"] = idx, root
        entry = idx.get(id(tensor))
        owners = []
        if entry is not None and entry[0] is tensor:
            owners = [(m, n) for m, n in entry[1] if m._parameters.get(n, m._buffers.get(n)) is tensor]
        if not owners:  # stale (the model was edited by hand): rebuild once
            top.extra.pop("owners", None)
            if entry is not None:
                return param_owners(root, tensor)
            owners = param_owners(root, tensor)
        return owners

    def _note_replaced(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """Keep the owner index current after a primitive swapped ``old`` for ``new`` in place."""
        idx = self._top.extra.get("owners")
        if idx is not None and id(old) in idx:
            _, owners = idx.pop(id(old))
            idx[id(new)] = (new, owners)

    _STRUCTURE_SAFE = frozenset({"shard", "sync", "checkpoint", "cut_pipeline_stage", "fork_rng", "annotate"})

    def _dispatch(self, prim, args: tuple, kwargs: dict):
        """The one dispatch point: bind, apply (which validates first), record on success (under the
        tree's lock, if :meth:`serialize_with` set one)."""
        with self._top.lock or contextlib.nullcontext():
            if self._top.retired:
                where = f"sch[{self.path!r}]" if self.path else "this schedule"
                raise ScheduleError(f"{prim.name}() on {where} was refused: {self._top.retired}.")
            try:
                bound = prim.bind(*args, **kwargs)
                if prim.name not in self._STRUCTURE_SAFE:
                    self._top.extra.pop("owners", None)
                # module arguments are copied before they enter the model (later primitives mutate them)
                call = _canonical_call(self.path, prim, bound).keep_pristine() if prim.recordable else None
                result = prim.apply(self, *bound.args, **bound.kwargs)
            except ScheduleError as err:  # every refusal names its module
                named = named_refusal(err, self, prim.name)
                if named is err:
                    raise
                raise named from None
            if call is not None:
                self.record.append(call)
            return result


class ScheduleKeyError(ScheduleError, KeyError):
    """A path that is not in the schedule tree (both a ScheduleError and a KeyError)."""

    def __str__(self) -> str:  # KeyError would add quotes
        return self.args[0]


def _canonical_call(path: str, prim: type[Primitive], bound: inspect.BoundArguments) -> Call:
    args, kwargs = [], {}
    for i, (pname, param) in enumerate(prim.signature().parameters.items()):
        if pname not in bound.arguments:
            continue
        value = bound.arguments[pname]
        if param.kind == inspect.Parameter.VAR_KEYWORD:
            kwargs.update(value)
        elif param.kind == inspect.Parameter.VAR_POSITIONAL:
            args.extend(value)
        elif i < prim.positional and not kwargs:
            args.append(value)
        else:
            kwargs[pname] = value
    return Call(path, prim.name, tuple(args), kwargs)


def create_schedule(
    root: nn.Module,
    name: str = "",
    path: str = "",
    parent: Schedule | None = None,
    group: dist.ProcessGroup | None = None,
    **kwargs: int | None,
) -> Schedule:
    """Create a schedule for ``root`` that preserves the module hierarchy.

    Args:
        root: the model to schedule (on any device, including ``meta``).
        group: the process group; None means the default group when ``torch.distributed`` is
            initialised, or simulated planning otherwise.
        world_size: (keyword) simulated tensor-parallel width when no process group is initialised.
        rank: (keyword) the simulated rank (default 0).

    Returns:
        Schedule: the root node.

    Raises:
        ScheduleError: for a non-module root, a bad world size or rank, or a world size that
            contradicts the initialised process group.
    """
    unknown = set(kwargs) - {"world_size", "rank"}
    if unknown:
        raise ScheduleError(f"create_schedule() got unknown keyword arguments: {', '.join(sorted(unknown))}.")
    return Schedule(
        root, name, path, parent, group, world_size=kwargs.get("world_size"), rank=kwargs.get("rank")
    )


def param_owners(top: nn.Module, tensor: torch.Tensor) -> list[tuple[nn.Module, str]]:
    """Every (module, attribute name) under ``top`` that holds exactly ``tensor`` (tied weights)."""
    owners = []
    seen = set()
    for mod in top.modules():
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        for n, p in list(mod._parameters.items()) + list(mod._buffers.items()):
            if p is tensor:
                owners.append((mod, n))
    return owners
