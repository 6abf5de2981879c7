"""The editor's state without widgets: the schedule, what is selected and shown, actions, history and messages.

:class:`EditorState` is everything :class:`~slapo_lab.editor.ScheduleEditor` does that does not need a
browser: select / open a level, apply a primitive or a preset as one action (all or nothing), undo / redo /
clear, the cluster shape and the TP degree, the schedule check, :meth:`EditorState.export` (the training script),
and the schedule file (:class:`~slapo_lab.editor.persistence.SchedulePersistence`). It imports no ipywidgets: a script, a test or
another front end drives it by calls and reads :attr:`EditorState.message`. The widget class subclasses it and
overrides the *hooks* (the methods documented "hook"), which draw what changed; here they do nothing. The work of
its actions is done by plain controllers it owns: :class:`~slapo_lab.editor.actions.Actions`,
:class:`~slapo_lab.editor.history.History`, :class:`~slapo_lab.editor.memory_pricer.MemoryPricer`, and the Export,
Verify, Plan and background controllers.

Data flows one way: an action calls public primitives on :attr:`EditorState.schedule` (exactly what a person
would type), the recorder notifies the state (:meth:`EditorState._on_record`), and the state asks its view to
redraw (:meth:`EditorState._refresh_all`) once the action, the cell or the click handler is done.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Any

from torch import nn

from .. import check as check_module
from .. import create_schedule
from ..call_order import set_example_inputs
from ..errors import ScheduleError
from ..parallel_dims import ParallelDims
from ..preset_check import set_reference
from ..record import format_call
from ..utils import meta_copy
from ..utils.collector import gc_paused, running_loop
from .actions import Actions
from .background import BackgroundChecks
from .cluster import ClusterShape, data_parallel
from .export_form import ExportForm
from .history import History
from .memory_pricer import ACTIVATIONS, MemoryPricer
from .persistence import SchedulePersistence, serialized
from .planning import PlanController
from .similar import similar_gate, similar_paths
from .verify_controller import VerifyController

__all__ = ["ACTIVATIONS", "EditorState", "similar_gate"]

_log = logging.getLogger("slapo_lab.editor")


class EditorState(SchedulePersistence):
    """The editor's state and actions, without widgets.

    Args:
        model: the model to schedule (any device; it is copied to the meta device, never modified).
        example_inputs: keyword arguments of one forward call, e.g. ``{"input_ids": ids}`` with ``ids``
            of shape ``(batch, seq)``; they let a cut be checked when it is made.
        world_size: the tensor-parallel degree to plan for (simulated: no process group needed).
        rank: the rank whose shard shapes are planned.
        factory: ``"package.module:function"`` that rebuilds the model (kept for the schedule file).
        schedule_file: a JSON schedule path kept in sync: restored (replayed) when the state is created, and
            rewritten after every change.

    Attributes:
        schedule: the :class:`~slapo_lab.Schedule` on the meta copy; type primitives on it freely.
        level: the module path whose children are shown ("" the model).
        selected: the selected module path ("" the model).
        expanded: the folded runs of repeated blocks that are shown unfolded.
        memory_plan: the :class:`~slapo_lab.plan.Plan` of the current schedule (per-rank memory per stage, for the
            dp and FSDP / ZeRO of :meth:`_plan_layout`), priced after every change (:meth:`price_memory`); None
            when it could not be priced (:attr:`memory_problem` says why).
        memory_problem: one sentence when the plan or its activation pass failed, else None.
        memory_pending: True while a whole-model activation pass runs in a kernel's background (the plan then
            holds no activations until it is done).
        planner: the Plan pane's :class:`~slapo_lab.editor.planning.PlanController` (``planner.run(...)``,
            ``planner.apply(i)``, ``planner.export_kwargs()``).
        background, export_form, verifier: the widget-free controllers: the debounced work after each change
            (:class:`~slapo_lab.editor.background.BackgroundChecks`), the export options' checks
            (:class:`~slapo_lab.editor.export_form.ExportForm`), what Verify runs
            (:class:`~slapo_lab.editor.verify_controller.VerifyController`).
        actions, history, memory: the controllers this state's methods delegate to: the click actions
            (:class:`~slapo_lab.editor.actions.Actions`), undo / redo / clear and the rebuild
            (:class:`~slapo_lab.editor.history.History`), the memory plan
            (:class:`~slapo_lab.editor.memory_pricer.MemoryPricer`).
        apply_to_similar: the next :meth:`apply` without ``path`` applies to every similar module (then resets),
            all or nothing, and gated like a preset (:func:`similar_gate`).
        resolve_label: the label of the action that resolves the last refusal ("" when none), run by
            :meth:`_resolve`.

    Raises:
        ScheduleError: if ``model`` is not an ``nn.Module`` or ``world_size`` is invalid.
    """

    apply_to_similar = False
    #: seconds of quiet after a change before the background work starts (a burst of clicks runs it once)
    BACKGROUND_DEBOUNCE = 0.6
    NUMERIC_DEBOUNCE = BACKGROUND_DEBOUNCE
    #: run the live numeric check in the background after each change (the widget editor's ``live_check``)
    live_check = False

    # a 70B meta copy is ~10^5 objects: a full collection meanwhile re-scans them all for nothing; the one they
    # bring on runs at the end (in a kernel, gc_deferred's, after the cell)
    @gc_paused(settle=True)
    def __init__(
        self,
        model: nn.Module,
        example_inputs: dict | None = None,
        world_size: int = 1,
        rank: int = 0,
        factory: str | None = None,
        schedule_file: str | None = None,
    ) -> None:
        self._setup(model, example_inputs, world_size, rank, factory)
        self._open_file(schedule_file)

    def _setup(self, model, example_inputs, world_size: int, rank: int, factory) -> None:
        """The state before anything is shown: the meta copy, its schedule, an empty history."""
        if not isinstance(model, nn.Module):
            raise ScheduleError(f"ScheduleEditor needs a torch.nn.Module, not a {type(model).__name__}.")
        self.model = model
        self.example_inputs = dict(example_inputs or {})
        self.factory = factory
        self.world_size = world_size
        self.rank = rank
        self._meta_model = meta_copy(model)
        self._lock = threading.RLock()  # see serialized: clicks arrive on another thread than cells
        self.history = History(self)  # undo / redo / clear and the rebuild they share (read by _on_record)
        self.schedule = create_schedule(self._meta_model, world_size=world_size, rank=rank)
        self._remember_inputs(self.schedule)
        self.schedule.record.add_listener(self._on_record)
        self.level = ""  # path whose children the graph shows
        self.selected = ""  # selected module path
        self.expanded: set[str] = set()
        self._busy = False
        self._pending = False
        self._flush_scheduled = False
        self._batch_depth = 0
        self._shown: tuple[str, bool] = ("", False)  # the message line: (text, is an error)
        self._stale_error = False
        self._resolver = None
        self.resolve_label = ""
        self._export_options = None
        self.numeric_report = None  # the live numeric check's report of the current schedule (the widget's)
        self._cluster = ClusterShape(1, max(1, world_size))  # one node of one replica: dp 1, as the form
        self._cluster_set = False  # dp follows the cluster only once the user sets its shape
        self.background = BackgroundChecks(self, ACTIVATIONS)  # the debounced thread after each change
        self.export_form = ExportForm(self)  # the export options' reading and checks (no widgets)
        self.verifier = VerifyController(self)  # what Verify runs: options, script, ranks and device
        self.planner = PlanController(self)  # the Plan pane's controller: auto_plan, the chosen layout, Apply
        self.memory = MemoryPricer(self)  # the per-rank memory of the current schedule (price_memory)
        self.actions = Actions(self)  # the click actions: a primitive, all similar, a preset, the open items

    def _open_file(self, schedule_file: str | None) -> None:
        """Restore ``schedule_file`` when it exists (else start empty and create it at the first change), then
        show everything for the first time."""
        self.schedule_file = schedule_file
        self._disk = None  # _file_stamp of schedule_file as this editor last read or wrote it
        self._file_problem: str | None = None  # a failed write or an outside change, shown with every message
        self._conflict = False  # the file changed outside this editor: autosave waits for the user's choice
        restored = None
        if schedule_file is not None and os.path.exists(schedule_file):
            restored = self.load(schedule_file)
        self._refresh_all(reset_view=True)
        if restored is not None:  # never autosave over a file that could not be restored
            self._keep_unrestorable(schedule_file, restored)
        elif schedule_file is not None and self.schedule.record.calls:
            self._info(f"Restored {len(self.schedule.record.calls)} recorded calls from {schedule_file}.")

    # ------------------------------------------------------------------ hooks: what a view draws (here: nothing)
    def _refresh_all(self, reset_view: bool = False) -> None:
        """Hook: the schedule changed (an action, a typed call, undo, a load): redraw everything. Here: price
        :attr:`memory_plan`."""
        self.price_memory()

    def _refresh_view(self, reset_view: bool = False) -> None:
        """Hook: only the navigation changed (selection, level, folding): redraw what shows it."""

    def _refresh_history(self) -> None:
        """Hook: the undo / redo stacks changed."""

    def _refresh_reasons(self) -> None:
        """Hook: the call order is known: redraw the action buttons' reasons (the cut button's)."""

    def _refresh_check(self) -> None:
        """Hook: the live numeric check finished: redraw the schedule check's open items."""

    def _show_numeric(self, phase: str, report=None) -> None:
        """Hook: the live numeric check's line: ``phase`` is ``"off"``, ``"waiting"`` (for the clicks to settle),
        ``"running"`` or ``"done"`` (with its :class:`~slapo_lab.numeric.NumericReport` ``report``)."""

    def numeric_check(self):
        """Run the numeric check now, in this thread, on the current schedule (what the live check shows):
        the recorded calls replayed on a shrunk copy of the model over ``world_size`` simulated ranks and
        compared with the unsharded copy (:func:`slapo_lab.numeric.numeric_check`,
        :meth:`BackgroundChecks.check_now <slapo_lab.editor.background.BackgroundChecks.check_now>`).

        Returns:
            The :class:`~slapo_lab.numeric.NumericReport` (also :attr:`numeric_report`, shown under the message
            line, and a failure is listed with the open items).
        """
        return self.background.check_now()

    def wait_background(self, timeout: float = 120.0) -> bool:
        """Wait until the background work after the last change is done (for scripts, tests and benchmarks);
        returns whether it finished within ``timeout`` seconds."""
        return self.background.wait(timeout)

    def _refresh_costs(self) -> None:
        """Hook: the plan's inputs (cluster shape, GPU) changed: redraw the memory view. Here: price
        :attr:`memory_plan`."""
        self.price_memory()

    def _plan_layout(self) -> tuple[int, str | None, str]:
        """Hook: ``(dp, shard, note)`` the memory plan prices. Without a form: dp fills the cluster shape once it
        is set (:meth:`set_cluster`), else 1; the last export's options say FSDP or a ZeRO stage
        (:meth:`MemoryPricer.default_layout <slapo_lab.editor.memory_pricer.MemoryPricer.default_layout>`)."""
        return self.memory.default_layout()

    def price_memory(self, defer_whole_pass: bool = False):
        """Price :attr:`memory_plan`: the per-rank memory of the schedule as it is now, for the dp and sharding of
        :meth:`_plan_layout` (:func:`slapo_lab.plan.plan`, activations as :data:`ACTIVATIONS` for the example
        inputs). A deep model's activation pass is composed from its distinct blocks and cached per block
        context, so a change prices in tens of milliseconds at 405B dims; a model without a stack of blocks
        runs a whole meta forward, which ``defer_whole_pass`` (a kernel) leaves to the background work
        (:attr:`memory_pending`, the plan then without activations). A failed activation pass prices the rest and
        says why in :attr:`memory_problem`; nothing raises (:meth:`MemoryPricer.price
        <slapo_lab.editor.memory_pricer.MemoryPricer.price>`).

        Returns:
            The :class:`~slapo_lab.plan.Plan`, or None when even the parameter count failed.
        """
        return self.memory.price(defer_whole_pass)

    @property
    def memory_plan(self):
        """The :class:`~slapo_lab.plan.Plan` of the last :meth:`price_memory` (see the class's attributes)."""
        return self.memory.plan

    @property
    def memory_problem(self) -> str | None:
        """One sentence when the plan or its activation pass failed, else None."""
        return self.memory.problem

    @property
    def memory_pending(self) -> bool:
        """True while a whole-model activation pass runs in a kernel's background work."""
        return self.memory.pending

    def _refresh_cluster(self) -> str | None:
        """Hook: the degrees or the cluster shape changed. Returns the sentence saying why the shape does not
        fit (data parallelism is then the largest that fits), or None."""
        return data_parallel(self._cluster, self.world_size, self.dims().pp)[1]

    def _show_message(self, text: str, error: bool) -> None:
        """Hook: show ``text`` on the message line ("" clears it), as a refusal when ``error``."""

    def _set_busy(self, busy: bool, restore: Any = None) -> Any:
        """Hook: an action starts (``busy``; returns what :meth:`_set_busy` needs to undo it) or ends (with
        that ``restore``): a view disables its action buttons meanwhile."""
        return None

    def _shown_paths(self) -> set[str]:
        """Hook: the module paths the current drawing shows (a selection among them keeps the level). Without
        a drawing: the children of :attr:`level`, and the blocks of a child that is a list of blocks (a graph
        shows ``encoder.layer.0`` … at level ``encoder``)."""
        node = self.schedule[self.level] if self.level in self.schedule else self.schedule[""]
        out = set()
        for child in node.child.values():
            out.add(child.path)
            if child.child and all(name.isdigit() for name in child.child):
                out.update(block.path for block in child.child.values())
        return out

    def _show_file_bar(self, show: bool) -> None:
        """Hook: show or hide the choice after an outside change of the schedule file (reload / keep mine /
        overwrite)."""

    def _set_form(self, remembered: dict | None, refresh: bool = True) -> None:
        """Hook: put a schedule file's remembered export options into the export form."""

    @property
    def cluster(self):
        """The :class:`~slapo_lab.editor.cluster.ClusterShape` planned for (:meth:`set_cluster`)."""
        return self._cluster

    @property
    def export_options(self) -> dict | None:
        """The last export's options: ``{"launcher": "torchrun", "script": "train.py", "options": {...}}``
        (the options as :meth:`export` took them, normalised); None before the first export. Restored from the
        ``schedule_file``'s meta."""
        return self._export_options

    @export_options.setter
    def export_options(self, value: dict | None) -> None:
        self._export_options = value

    def _show(self, text: str, error: bool) -> None:
        self._shown = (text, error)
        self._show_message(text, error)

    # ------------------------------------------------------------------ actions
    @property
    def code(self) -> str:
        """The recorded schedule as Python, one primitive call per line."""
        return self.schedule.record.code()

    @property
    def num_ranks(self) -> int:
        """Processes one replica needs: tensor-parallel width × pipeline stages."""
        return self.dims().replica

    def dims(self, dp: int = 1) -> ParallelDims:
        """The schedule's degrees with ``dp`` replicas: tp is the schedule's width, pp its stages (one per
        pipeline rank; cuts + 1)."""
        stages = len(self.schedule.metadata.primitives.get("cut_pipeline_stage", [])) + 1
        return ParallelDims(self.world_size, stages, dp)

    @property
    def message(self) -> str:
        """The text of the last status or error message shown ("" when none)."""
        return self._shown[0]

    @serialized
    def select(self, path: str) -> str | None:
        """Select the module at ``path`` (and show its parent's level); returns an error sentence or None."""
        if not isinstance(path, str) or path not in self.schedule:
            return self._error(f"There is no module {path!r} in this model.")
        self.selected = path
        node = self.schedule[path]
        shown = self._shown_paths()
        if path and path not in shown and self.level != path:  # stay on the level when it shows the module
            self.level = node.parent.path
        self._refresh_view()
        self._clear_stale_error()
        return None

    @serialized
    def open_level(self, path: str) -> str | None:
        """Show the children of ``path`` in the graph (descend one level); error sentence or None."""
        if not isinstance(path, str) or path not in self.schedule:
            return self._error(f"There is no module {path!r} in this model.")
        if not self.schedule[path].child:
            return self._error(f"{path or 'The root module'} has no submodules to open.")
        self.level = path
        self.selected = path
        self._refresh_view(reset_view=True)
        self._clear_stale_error()
        return None

    @serialized
    def collapse(self) -> None:
        """Fold expanded repeated blocks of the current level (and below) back into single nodes."""
        self.expanded = {k for k in self.expanded if not k.startswith(self.level)}
        self._refresh_view(reset_view=True)

    @serialized
    def apply(self, primitive: str, *args, path: str | None = None, **kwargs) -> str | None:
        """Apply ``primitive`` to the selected module (or ``path``), as a click does; with
        :attr:`apply_to_similar` and no ``path``, to every similar module, all or nothing
        (:meth:`Actions.apply <slapo_lab.editor.actions.Actions.apply>`).

        Returns:
            None on success (the call is recorded), else the one-sentence reason shown in the editor.
        """
        if self._busy:
            return self._error("Still applying the previous action; try again in a moment.")
        return self.actions.apply(primitive, args, kwargs, path)

    def _run_action(self, label: str | None, fn, working: str | None = None):
        """Run ``fn()`` as one user action, all or nothing (:meth:`Actions.run <slapo_lab.editor.actions.Actions.run>`)."""
        return self.actions.run(label, fn, working)

    def similar(self, path: str) -> list[str]:
        """``path`` and the modules of the same type at the same relative path in every repeated block
        (:func:`slapo_lab.editor.similar.similar_paths`): e.g. ``encoder.layer.0.attention.self.query`` → the
        ``query`` of every ``encoder.layer.i``."""
        return similar_paths(self.schedule, path)

    @serialized
    def apply_preset(self, name: str, k: int = 1) -> str | None:
        """Apply a preset through ordinary (recorded) primitive calls; all or nothing.

        Presets: ``"megatron"`` (column-parallel q/k/v and up projections, row-parallel output
        projections with the right syncs, vocab-parallel embeddings), ``"megatron_sp"`` (the same with
        Megatron sequence parallelism between the regions, checked as a whole), ``"hf_plan"`` (the config's
        ``base_model_tp_plan``), ``"checkpoint"`` (every ``k``-th block), ``"stages"`` (``k`` balanced
        pipeline stages by parameters). Returns None or the one-sentence reason nothing changed.
        """
        if self._busy:
            return self._error("Still applying the previous action; try again in a moment.")
        return self.actions.apply_preset(name, k)

    @serialized
    def undo(self) -> str | None:
        """Undo the last user action: a click, a preset, an "apply to all similar", a typed line.

        Rebuilds from a fresh meta copy of the original model and replays the earlier actions (module
        arguments such as ``replace``'s are replayed from copies taken before they entered the model).
        Returns None, or one sentence if there is nothing to undo (the schedule is then unchanged).
        """
        if self._busy:
            return self._error("Still applying the previous action; try again in a moment.")
        return self.history.undo()

    @serialized
    def redo(self) -> str | None:
        """Re-apply the last undone action; returns None or one sentence (nothing to redo, or why it failed).

        The action stays on the redo stack until it has been applied whole; a failure leaves the
        schedule as it was.
        """
        if self._busy:
            return self._error("Still applying the previous action; try again in a moment.")
        return self.history.redo()

    @serialized
    def clear(self) -> None:
        """Forget every recorded call (redo brings the actions back, one per redo)."""
        self.history.clear()

    def _rebuild(self, actions, autosave: bool = True) -> None:
        """Rebuild the schedule from a fresh meta copy, replaying ``actions``, all or nothing
        (:meth:`History.rebuild <slapo_lab.editor.history.History.rebuild>`)."""
        self.history.rebuild(actions, autosave)

    @property
    def _redo(self) -> list:
        """The undone actions, the next redo last (:attr:`History.redo_stack`)."""
        return self.history.redo_stack

    @property
    def _spare(self):
        """The meta copy made ahead for the next rebuild, or None (:attr:`History.spare`)."""
        return self.history.spare

    def _remember_inputs(self, sch) -> None:
        """Give a new schedule of this editor its lock (typed calls wait for a click's action: see
        :func:`_serialized`) and the example inputs, so that a cut is checked at click time."""
        sch.serialize_with(self._lock)
        set_reference(sch, self.model)  # presets check their calls against the user's unscheduled model
        if not self.example_inputs:
            return
        try:
            set_example_inputs(sch, self.example_inputs)
        except Exception as err:  # noqa: BLE001 - the cut check then happens at build time
            _log.warning("example inputs not usable for cut checks: %s", err)

    def _on_record(self, _rec) -> None:
        """A call was recorded (clicked or typed): redraw once the current cell / click / preset is done."""
        if not self.history.replaying:
            self._redo.clear()
        self._pending = True
        if self._batch_depth:
            return
        loop = running_loop()
        if loop is None:
            self._flush()
        elif not self._flush_scheduled:  # in a kernel: after the cell or the click handler returns
            self._flush_scheduled = True
            loop.call_soon(self._flush)

    @serialized
    def _flush(self) -> None:
        self._flush_scheduled = False
        if not self._pending:
            return
        self._pending = False
        try:
            self._autosave()
            self._refresh_all()
            last = self.schedule.record.calls[-1] if self.schedule.record.calls else None
            if last is not None:
                self._info(f"Applied {format_call(last)}")
        except Exception:  # noqa: BLE001 - the view must never break the engine
            _log.exception("editor refresh failed")

    @contextlib.contextmanager
    def _working(self, what: str):
        """A visible busy state while an action runs: 'Working: …' and the action buttons disabled."""
        before = self._shown
        self._busy = True
        restore = self._set_busy(True)
        self._info(f"Working: {what}…", transient=True)
        working = self._shown
        try:
            yield
        finally:
            self._busy = False
            self._set_busy(False, restore)
            self._refresh_history()
            if self._shown is working:  # the action said nothing of its own: put the line back
                self._show(*before)

    @contextlib.contextmanager
    def _batch(self):
        """Record many calls with one redraw at the end."""
        self._batch_depth += 1
        try:
            yield
        finally:
            self._batch_depth -= 1
            if not self._batch_depth:
                self._flush()

    def _info(self, text: str, transient: bool = False) -> None:
        """Show ``text`` as the status line; while the schedule file is not kept (a failed write or an
        outside change) the status says so too, so "Applied …" never hides it."""
        problem = None if transient else getattr(self, "_file_problem", None)
        if problem:
            self._error(f"{text.rstrip('.')}. {problem}")
            return
        self._offer(None)
        self._show(text, False)
        self._stale_error = False

    def _error(self, text: str, resolve: tuple[str, Any] | None = None) -> str:
        """Show ``text`` as a refusal; ``resolve`` = ``(label, action)`` offers the click that resolves it (a
        button beside the message)."""
        self._offer(resolve)
        self._show(text, True)
        self._stale_error = True
        return text

    def _offer(self, resolve: tuple[str, Any] | None) -> None:
        self._resolver = resolve[1] if resolve else None
        self.resolve_label = resolve[0] if resolve else ""

    def _resolve(self) -> None:
        action, self._resolver = self._resolver, None
        self._offer(None)
        if action is not None:
            action()

    def _clear_stale_error(self) -> None:
        """After the user moved on (selected or opened another module), an earlier error no longer
        applies: clear it, or show the schedule file's problem, which stays until it is resolved."""
        if not getattr(self, "_stale_error", False):
            return
        problem = getattr(self, "_file_problem", None)
        if problem:
            self._error(problem)
        else:
            self._show("", False)
        self._stale_error = False

    def check(self) -> list:
        """The schedule check's open items (:func:`slapo_lab.check_schedule`): what the tensor parallelism
        still lacks before the model equals the original, each a :class:`slapo_lab.Finding` with one
        sentence naming the call that closes it. Empty when nothing is open."""
        return check_module.check_schedule(self.schedule)  # looked up at each call (tests replace it)

    @serialized
    def close_open_items(self) -> str | None:
        """Apply the calls the schedule check names until nothing is open (the "close open items" button):
        one action, all or nothing (:func:`slapo_lab.close_open_items`). Returns None or the one-sentence
        reason nothing changed."""
        if self._busy:
            return self._error("Still applying the previous action; try again in a moment.")
        return self.actions.close_open_items()

    def _open_count(self) -> int:
        """How many open items the schedule check lists (0 if the check itself fails: it is advice)."""
        try:
            return len(self.check())
        except Exception:  # noqa: BLE001 - the check must never break an export or a Verify report
            _log.warning("schedule check failed", exc_info=True)
            return 0

    @serialized
    def set_cluster(self, nodes: int, gpus_per_node: int) -> str | None:
        """Plan for ``nodes`` x ``gpus_per_node`` GPUs: data parallelism fills the cluster with replicas of
        TP x PP GPUs (the export form's dp follows), and the header states the three degrees in words.

        Returns:
            None, or the one sentence saying why the shape does not fit (it is kept, dp the largest that fits).
        """
        try:
            shape = ClusterShape(nodes, gpus_per_node)
        except ValueError as err:
            return self._error(str(err))
        self._cluster, self._cluster_set = shape, True
        problem = self._refresh_cluster()
        self._refresh_costs()
        return self._error(problem) if problem else None

    @serialized
    def set_tp(self, degree: int) -> str | None:
        """Change the tensor-parallel degree: every recorded action replays at ``degree`` ranks (presets'
        choices included, as recorded), or, when one cannot, the schedule stays at its degree and the reason
        is said in one sentence (returned; :meth:`History.replay_at <slapo_lab.editor.history.History.replay_at>`).
        """
        if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
            return self._error(f"The tensor-parallel degree must be a positive whole number, not {degree!r}.")
        old = self.world_size
        if degree == old:
            return None
        if self._busy:
            return self._error("Still applying the previous action; try again in a moment.")
        return self.history.replay_at(degree)

    # ------------------------------------------------------------------ export
    @serialized
    def export(self, path: str, launcher: str = "torchrun", force: bool = False, **options) -> str:
        """Write the schedule as a launchable training script to ``path`` (the Export button); returns the
        absolute path written.

        The options become the script's defaults (``DEFAULTS``; its command line still overrides them);
        values equal to the script's own defaults are left out, so ``editor.export("train.py")`` writes a
        synthetic-data script with seeded random weights. The message line shows the path and the launch
        command for ``tp x pp x dp`` processes (``--device cuda`` where this machine has that many GPUs; else
        that and the CPU launch that runs here); the options are remembered (:attr:`export_options`, the
        form, and the ``schedule_file``'s meta).

        Args:
            path: the script file, e.g. ``"train_llama.py"`` (its folder must exist).
            launcher: ``"torchrun"`` or ``"deepspeed"``.
            force: write the script even when the numeric check marks the schedule ✗ (the live check's
                result, :attr:`numeric_report`, is reused when it is of this schedule; else the check runs).
            **options: any of :data:`slapo_lab.export.script.EXPORT_OPTIONS`:
                ``model_path`` (a Hugging Face directory with config.json and *.safetensors; None / "" =
                seeded random weights), ``tokenizer`` (a directory; default the model path), ``data``
                (``"synthetic"`` or an existing .txt / .jsonl / .parquet file or folder), ``eval_data``,
                ``seq_len`` (tokens, default the example inputs' sequence length), ``dp`` (replicas,
                default 1), ``fsdp`` (bool, shard over dp with FSDP2), ``zero`` (0 / 1 / 2, deepspeed only),
                ``checkpoint_dir``, ``checkpoint_every`` (steps), ``save_hf`` (a directory),
                ``global_batch_size`` (sequences per step, default the example batch, divisible by dp),
                ``micro_batch_size``, ``steps`` (default 10), ``lr``, ``bf16``, ``log_dir``. Relative paths
                are checked from the kernel's working directory and written as given.

        Raises:
            ExportError: (a ValueError) with one sentence and nothing written: an unknown option, a path
                that does not exist, a non-positive number, a global batch not divisible by dp, a ZeRO stage
                without deepspeed, a read-only folder, a model that cannot be rebuilt, a schedule the numeric
                check marks ✗ (without ``force``) ...
        """
        return self.export_form.export(path, launcher, force, options)

    def _launch_command(self, script, launcher: str, dp: int, gpus: int | None = None) -> str:
        """The one-node launch of ``script`` for ``tp x pp x dp`` processes (:meth:`ExportForm.launch_command`)."""
        return self.export_form.launch_command(script, launcher, dp, gpus)

    def _show_export(self, out, cmd: str) -> None:
        """Hook: show the written script and its launch command (the widget's export panel)."""
