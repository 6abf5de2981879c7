"""All-or-nothing changes to a schedule: :func:`atomic` and the :class:`Snapshot` it restores.

Presets (:mod:`slapo_lab.presets`), the preset gate's trial runs (:mod:`slapo_lab.preset_check`) and
``check.close_open_items`` make many primitive calls that must apply together or not at all. This sits in the
engine layer, beside the schedule and the record it captures, so each of them asks it without importing the
others.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict

from .module_state import ModuleMeta


def _copy_containers(v, depth: int = 0):
    """``v`` with its dicts / lists / sets copied (recursively, a
    :class:`~slapo_lab.module_state.ModuleMeta`'s fields too); tensors, modules, functions and hook handles are
    shared: the state a primitive changes in place is the containers, never those objects."""
    if depth > 8:
        return v
    if type(v) in (dict, OrderedDict):
        return type(v)((k, _copy_containers(x, depth + 1)) for k, x in v.items())
    if type(v) is list:
        return [_copy_containers(x, depth + 1) for x in v]
    if type(v) is set:
        return set(v)
    if type(v) is ModuleMeta:  # a module's schedule state: its containers, as those of a dict
        return v.copy_containers(lambda x: _copy_containers(x, depth + 1))
    return v


class Snapshot:
    """Everything a primitive may change, captured without copying a tensor (see :func:`atomic`)."""

    def __init__(self, sch) -> None:
        top = sch.get_top_schedule()
        self.top = top
        self.modules = []
        self.tensors = []
        seen: set[int] = set()
        for mod in top.mod.modules():
            if id(mod) in seen:
                continue
            seen.add(id(mod))
            self.modules.append((mod, _copy_containers(mod.__dict__)))
            for t in list(mod._parameters.values()) + list(mod._buffers.values()):
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    self.tensors.append((t, dict(t.__dict__)))
        self.nodes = [
            (node, dict(node.__dict__), OrderedDict(node.child)) for _, node in top.named_schedules()
        ]
        state = top._top
        self.state = {k: v for k, v in state.__dict__.items() if k != "record"}
        self.metadata = _copy_containers(dict(state.metadata.__dict__))
        self.extra = dict(state.extra)
        rec = state.record
        self.record = {k: _copy_containers(v) for k, v in rec.__dict__.items() if k != "_listeners"}
        self.n_calls = len(rec.calls)

    def restore(self) -> None:
        for mod, d in self.modules:
            mod.__dict__.clear()
            mod.__dict__.update(d)
        for t, d in self.tensors:
            for k in [k for k in t.__dict__ if k not in d]:
                del t.__dict__[k]
            t.__dict__.update(d)
        for node, d, child in self.nodes:
            node.__dict__.clear()
            node.__dict__.update(d)
            node.__dict__["child"] = child
        state = self.top._top
        state.__dict__.update(self.state)
        state.metadata.__dict__.clear()
        state.metadata.__dict__.update(self.metadata)
        state.extra.clear()
        state.extra.update(self.extra)
        state.extra.pop("owners", None)  # rebuilt on the next look-up
        rec = state.record
        changed = len(rec.calls) != self.n_calls
        for k, v in self.record.items():
            rec.__dict__[k] = v
        if changed:
            rec._notify()


@contextlib.contextmanager
def atomic(sch):
    """All or nothing: if the block raises, the schedule tree, its modules and the record are put back.

    Presets make many primitive calls; one that fails midway (block 2 of 24 ...) would otherwise leave the
    calls before it applied. On entry this captures, without copying any tensor, what primitives change:
    every module's ``__dict__`` (parameters, buffers, hooks, ``_slapo_meta``, feature counts, an installed
    ``forward``), every parameter's annotations (``shard_axis``, ``sequence_parallel`` ...), every schedule
    node, the tree's metadata and the record. Primitives replace tensors rather than write into them, so
    restoring those containers restores the model exactly. On an exception the state is restored, record
    listeners are notified once, and the exception propagates. Nested blocks join the outermost one
    (one capture per preset, however many helpers it calls).

    Raises:
        whatever the block raises (after restoring).
    """
    extra = sch.get_top_schedule()._top.extra
    if extra.get("atomic_open"):
        yield
        return
    snap = Snapshot(sch)
    extra["atomic_open"] = True
    try:
        yield
    except BaseException:
        snap.restore()
        raise
    finally:
        extra.pop("atomic_open", None)
