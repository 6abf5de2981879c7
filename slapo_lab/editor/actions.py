"""The editor's click actions without widgets: a primitive, "apply to all similar", a preset, "close open items".

:class:`Actions` is owned by :class:`~slapo_lab.editor.state.EditorState` (``state.actions``) and holds it. Each action
calls public primitives on the state's schedule (exactly what a person would type), as one recorded action (one Undo
removes it), all or nothing (:meth:`Actions.run`: a failure part-way rebuilds the schedule as it was), and says what
it did, or why nothing changed, in one sentence on the state's message line.
"""

from __future__ import annotations

import contextlib
import logging

from .. import check as check_module
from .. import check_primitive, presets
from ..errors import ScheduleError
from ..pipeline import suggest_cuts
from ..utils.collector import gc_paused
from .history import describe
from .similar import similar_gate, similar_paths

__all__ = ["Actions"]

_log = logging.getLogger("slapo_lab.editor")


def _sentence(err: BaseException) -> str:
    """A ScheduleError's own sentence, else the exception's type and text."""
    return str(err) if isinstance(err, ScheduleError) else f"{type(err).__name__}: {err}"


class Actions:
    """The click actions of one editor state.

    Args:
        state: the :class:`~slapo_lab.editor.state.EditorState` (its ``schedule``, selection, ``apply_to_similar``,
            its busy state, batching, messages and history).
    """

    def __init__(self, state) -> None:
        self.state = state

    def run(self, label: str | None, fn, working: str | None = None):
        """Run ``fn()`` as one user action: the busy state ("Working: …", buttons off), one redraw at the end,
        recorded as one action named ``label`` (one Undo removes it; None: ``fn`` records its own), all or
        nothing: if ``fn`` raises, the schedule is rebuilt as it was before and the exception propagates (the
        caller says it in one sentence). The garbage collector is paused meanwhile, and an action that leaves
        many objects (a preset) runs the full collection they make due before it returns
        (:func:`~slapo_lab.utils.collector.gc_paused`). Returns what ``fn`` returns."""
        st = self.state
        before = st.schedule.record.actions()
        n0 = len(st.schedule.record.calls)
        recording = st.schedule.record.action(label) if label is not None else contextlib.nullcontext()
        try:
            with gc_paused(settle=True), st._working(working or label or "working"), st._batch(), recording:
                return fn()
        except BaseException:
            if len(st.schedule.record.calls) != n0:  # part of it applied: undo that part
                st._rebuild(before)
            raise

    # ------------------------------------------------------------------ a primitive, on one module or all similar
    def apply(self, primitive: str, args: tuple, kwargs: dict, path: str | None) -> str | None:
        """Apply ``primitive(*args, **kwargs)`` to the selected module (or ``path``), or, when the state's
        ``apply_to_similar`` is set and no ``path`` is given, to every similar module (then reset); returns None
        or the one sentence shown (:meth:`EditorState.apply <slapo_lab.editor.state.EditorState.apply>`)."""
        st = self.state
        target = st.selected if path is None else path
        if not isinstance(target, str) or target not in st.schedule:
            return st._error(f"There is no module {target!r} in this model.")
        if not isinstance(primitive, str):
            return st._error(f"Unknown action {primitive!r}.")
        targets = [target]
        if path is None and st.apply_to_similar:
            st.apply_to_similar = False  # one action only: never carried over to the next click
            targets = st.similar(target)
            why = self._refused_by_any(targets, primitive, args, kwargs)
            if why:
                return st._error(f"Not applied to any of the {len(targets)} similar modules: {why}")
        label = f"{primitive} on {target}" + (
            f" and {len(targets) - 1} similar modules" if len(targets) > 1 else ""
        )
        n0 = len(st.schedule.record.calls)
        try:
            self.run(label, lambda: self._apply_each(targets, target, primitive, args, kwargs))
        except Exception as err:  # noqa: BLE001 - never let a click kill the kernel or lose the record
            if isinstance(err, (ScheduleError, AttributeError)):
                return st._error(str(err))
            _log.exception("primitive failed")
            return st._error(
                f"{primitive} failed unexpectedly ({type(err).__name__}: {err}); the schedule is unchanged."
            )
        if len(targets) > 1:  # say what the one action did, not only its last call
            n = len(st.schedule.record.calls) - n0
            st._info(
                f"Applied {primitive} to {len(targets)} similar modules, {targets[0]} to {targets[-1]} ({n} calls)."
            )
        return None

    def _refused_by_any(self, targets: list[str], primitive: str, args: tuple, kwargs: dict) -> str | None:
        """All or nothing: the first target's reason to refuse ``primitive`` (:func:`slapo_lab.check_primitive`), or
        None when every target takes it."""
        for t in targets:
            why = check_primitive(self.state.schedule[t], primitive, *args, **kwargs)
            if why:
                return why
        return None

    def _apply_each(self, targets: list[str], target: str, primitive: str, args: tuple, kwargs: dict) -> None:
        """Call ``primitive`` on each target; with several, gate the whole like a preset (:func:`similar_gate`,
        on the calls the clicked ``target`` recorded); raising takes the whole action back (:meth:`run`)."""
        sch = self.state.schedule
        n0 = len(sch.record.calls)
        ends = []
        for t in targets:
            getattr(sch[t], primitive)(*args, **kwargs)
            ends.append(len(sch.record.calls))
        if len(targets) > 1:
            calls = sch.record.calls
            i = targets.index(target) if target in targets else 0
            one = calls[(ends[i - 1] if i else n0) : ends[i]]
            why = similar_gate(self.state, target, len(targets), calls[:n0], calls[n0:], one)
            if why:
                raise ScheduleError(why)

    def similar(self, path: str) -> list[str]:
        """``path`` and its similar modules (:func:`slapo_lab.editor.similar.similar_paths`)."""
        return similar_paths(self.state.schedule, path)

    # ------------------------------------------------------------------ presets and the schedule check's fixes
    def apply_preset(self, name: str, k: int = 1) -> str | None:
        """Apply preset ``name`` (:meth:`EditorState.apply_preset <slapo_lab.editor.state.EditorState.apply_preset>`)
        as one action; returns None or the one-sentence reason nothing changed (with an Undo offered when an
        earlier action is in the way)."""
        st = self.state
        n0 = len(st.schedule.record.calls)
        try:
            notes = self.run(f"preset {name}", lambda: self._run_preset(name, k))
        except Exception as err:  # noqa: BLE001 - reported, never raised past this point
            msg = _sentence(err)
            conflict = "already sharded" in msg or "already cuts" in msg  # an earlier action is in the way
            return st._error(
                f"The {name} preset was not applied: {msg}", self.undo_offer() if conflict else None
            )
        n = len(st.schedule.record.calls) - n0
        done = (
            f"Preset {name} recorded {n} calls."
            if n
            else f"Preset {name} added nothing: the schedule has it all."
        )
        st._info(" ".join([done, *notes]))
        return None

    def _run_preset(self, name: str, k: int) -> list[str]:
        """Run preset ``name``; returns its notes (sentences on what it left as it was)."""
        sch = self.state.schedule
        if name in ("megatron", "megatron_sp", "hf_plan"):  # vocab parallel only with a vocabulary (not ViT)
            return presets.megatron_tp(
                sch,
                use_hf_plan=name == "hf_plan",
                sequence_parallel=name == "megatron_sp",
                vocab_parallel=presets.has_vocab_embedding(sch),
            ).notes
        if name == "checkpoint":
            return presets.checkpoint_blocks(sch, every=int(k)).notes
        if name != "stages":
            raise ScheduleError(
                f"unknown preset {name!r}; use megatron, megatron_sp, hf_plan, checkpoint or stages."
            )
        cuts = sch.metadata.primitives.get("cut_pipeline_stage") or []
        if cuts:
            raise ScheduleError(
                f"it places every cut itself, and the schedule already cuts after {', '.join(cuts)}; press "
                "Undo until those cuts are gone (or editor.clear() to start over), then apply it again"
            )
        suggest_cuts(sch, int(k), by="params", apply=True)
        return []

    def undo_offer(self):
        """``("Undo: <the last action>", undo)``, or None with nothing to undo."""
        actions = self.state.schedule.record.actions()
        return (f"Undo: {describe(actions[-1])}", self.state.undo) if actions else None

    def close_open_items(self) -> str | None:
        """Apply the calls the schedule check names until nothing is open, as one action
        (:func:`slapo_lab.close_open_items`); returns None or the one-sentence reason nothing changed."""
        st = self.state
        try:  # close_open_items records its calls as one action itself
            calls = self.run(
                None, lambda: check_module.close_open_items(st.schedule), working="closing the open items"
            )
        except Exception as err:  # noqa: BLE001 - never let a click kill the kernel or lose the record
            return st._error(f"The open items were not closed: {_sentence(err)}")
        st._info(
            f"Closed the open items with {len(calls)} call{'s' if len(calls) != 1 else ''}"
            + (" (one Undo removes them)." if calls else "; nothing was open.")
        )
        return None
