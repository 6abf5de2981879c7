"""The editor's history without widgets: undo, redo, clear, and the rebuild from a fresh meta copy they share.

:class:`History` is owned by :class:`~slapo_lab.editor.state.EditorState` (``state.history``) and holds it. The
recorded actions are the history (:meth:`slapo_lab.record.Record.actions`); undo and clear rebuild the schedule from a
fresh meta copy of the user's model and replay the actions kept (:meth:`History.rebuild`), redo replays an undone
action onto the schedule. The redo stack is :attr:`History.redo_stack`; the meta copy made ahead in a kernel's
background work is :attr:`History.spare`. What changed is drawn through the state's hooks (``_refresh_all``,
``_refresh_history``) and said on its message line.
"""

from __future__ import annotations

import logging

from .. import create_schedule
from ..errors import ScheduleError
from ..record import Action, format_call
from ..utils import meta_copy
from ..utils.collector import gc_paused

__all__ = ["History", "describe"]

_log = logging.getLogger("slapo_lab.editor")


def describe(action) -> str:
    """``shard on a.b`` / ``preset megatron (1125 calls)``: an :class:`~slapo_lab.record.Action`'s label and, when it
    holds more than one call, how many."""
    n = len(action.calls)
    return action.label + (f" ({n} calls)" if n > 1 else "")


class History:
    """Undo / redo / clear of one editor state.

    Args:
        state: the :class:`~slapo_lab.editor.state.EditorState` (its ``schedule``, ``model``, ``world_size``,
            ``rank``, selection, and its busy state, messages and hooks).

    Attributes:
        redo_stack: the undone :class:`~slapo_lab.record.Action` s, the next redo last.
        spare: a meta copy of the model made ahead for the next rebuild (:meth:`make_spare`), or None.
        replaying: True while a redo replays (the recorder's listener must not clear the redo stack then).
    """

    def __init__(self, state) -> None:
        self.state = state
        self.redo_stack: list = []
        self.spare = None
        self.replaying = False

    def undo(self) -> str | None:
        """Undo the last action (:meth:`EditorState.undo <slapo_lab.editor.state.EditorState.undo>`); returns None
        or the one sentence shown."""
        st = self.state
        actions = st.schedule.record.actions()
        if not actions:
            return st._error("Nothing to undo: the schedule is empty.")
        last = actions[-1]
        try:
            with st._working(f"undoing {last.label}"):
                self.rebuild(actions[:-1])
        except Exception as err:  # noqa: BLE001 - reported, never raised past this point
            _log.exception("undo failed")
            return st._error(
                f"Could not undo {last.label} ({type(err).__name__}: {err}); the schedule is unchanged."
            )
        self.redo_stack.append(last)
        st._refresh_history()
        st._info(f"Undid {describe(last)}.")
        return None

    def redo(self) -> str | None:
        """Re-apply the last undone action (:meth:`EditorState.redo <slapo_lab.editor.state.EditorState.redo>`);
        returns None or the one sentence shown. The action leaves the redo stack only once applied whole."""
        from .. import replay  # noqa: PLC0415 - looked up at each call: tests replace slapo_lab.replay

        st = self.state
        if not self.redo_stack:
            return st._error("Nothing to redo.")
        act = self.redo_stack[-1]
        self.replaying = True
        try:
            st._run_action(act.label, lambda: replay(st.schedule, act.calls), working=f"redoing {act.label}")
        except Exception as err:  # noqa: BLE001 - reported, never raised past this point
            return st._error(
                f"Could not redo {act.label}: {str(err).rstrip('.')}; the schedule is unchanged."
            )
        finally:
            self.replaying = False
        self.redo_stack.pop()
        st._refresh_history()
        st._info(f"Redid {describe(act)}.")
        return None

    def clear(self) -> None:
        """Forget every recorded call; redo brings the actions back, one per redo."""
        st = self.state
        actions = st.schedule.record.actions()
        n = len(st.schedule.record.calls)
        with st._working("clearing the schedule"):
            self.rebuild([])
        self.redo_stack.extend(reversed(actions))
        st._refresh_history()
        st._info(f"Cleared {n} recorded calls.")

    def replay_at(self, degree: int) -> str | None:
        """Replay every recorded action at tensor-parallel ``degree`` (the state's ``world_size`` then; its rank
        kept when below ``degree``, else 0); when one cannot replay, the schedule stays whole at its degree.
        Returns None or the one sentence shown."""
        st = self.state
        old, old_rank = st.world_size, st.rank
        n = len(st.schedule.record.calls)
        st.world_size = degree
        st.rank = old_rank if old_rank < degree else 0
        try:
            with st._working(f"replaying {n} calls at TP {degree}"):
                self.rebuild(st.schedule.record.actions())
        except Exception as err:  # noqa: BLE001 - the schedule stays whole at its degree
            st.world_size, st.rank = old, old_rank
            st._refresh_cluster()
            msg = str(err) if isinstance(err, ScheduleError) else f"{type(err).__name__}: {err}"
            return st._error(f"The schedule stays at TP {old}: at TP {degree} {msg[:1].lower() + msg[1:]}")
        st._info(f"Replayed {n} recorded call{'s' if n != 1 else ''} at TP {degree} (was TP {old}).")
        return None

    # a replay allocates a few acyclic objects per call: collecting meanwhile re-scans the heap; the fresh meta
    # copy's objects bring a full collection on, run at the end rather than in a click after it
    @gc_paused(settle=True)
    def rebuild(self, actions, autosave: bool = True) -> None:
        """Fresh meta copy + schedule, replaying ``actions`` (:class:`~slapo_lab.record.Action` s, or plain calls:
        one action each). Only once every call has replayed does the root object ``state.schedule`` adopt the new
        tree (:meth:`~slapo_lab.Schedule.adopt_tree`), so an error or a KeyboardInterrupt part-way leaves the
        schedule as it was, and ``sch = editor.schedule`` taken earlier stays valid."""
        from .. import replay  # noqa: PLC0415 - looked up at each call: tests replace slapo_lab.replay

        st = self.state
        old = st.schedule
        meta = self.take_spare()
        sch = create_schedule(meta, world_size=st.world_size, rank=st.rank)
        st._remember_inputs(sch)
        for act in actions:
            if not isinstance(act, Action):
                act = Action(format_call(act), (act,))
            with sch.record.action(act.label):
                replay(sch, act.calls)
        old.record.remove_listener(st._on_record)
        old.adopt_tree(sch)  # `sch = editor.schedule` taken before stays valid; older sub-nodes are refused
        st._meta_model = meta
        old.record.add_listener(st._on_record)
        for path in (st.selected, st.level):
            if path not in sch:
                st.selected = st.level = ""
        st._refresh_all()
        if autosave:
            st._autosave()

    def take_spare(self):
        """A fresh meta copy of the model for a rebuild: the spare one made ahead (:meth:`make_spare`, in a kernel's
        background work) when there is one, else one made now (0.1-0.3 s at 70B: a third of an undo)."""
        spare, self.spare = self.spare, None
        return spare if spare is not None else meta_copy(self.state.model)

    def make_spare(self) -> None:
        """Make the meta copy the next undo, clear or TP change starts from, unless one is ready (run it off the
        click path: the copy reads only the user's model, which the editor never changes)."""
        if self.spare is None:
            self.spare = meta_copy(self.state.model)
