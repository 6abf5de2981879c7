"""ScheduleEditor: the ipywidgets app — module tree | graph of one level | inspector, code panel below.

Data flows one way: the editor owns a meta-device copy of the model and a schedule on it; a click
calls a public primitive on ``editor.schedule`` (exactly what a person would type); the recorder
notifies the editor, which redraws from the schedule and the record. Typing on ``editor.schedule``
in a cell therefore shows up exactly as clicking does. The user's real model is never modified: it
is the source for Verify and Export.

The editor assembles panels, each holding it rather than inheriting from it: :class:`GraphPanel` (tree, search,
breadcrumbs, graph, legend), :class:`InspectorPanel` (the selected module, action buttons and their reasons,
presets), :class:`SchedulePanel` (recorded calls, open items, undo / redo), :class:`MemoryPanel` (cluster, memory,
Plan), :class:`ExportPanel` and :class:`VerifyPanel`. The widget-free controllers belong to the state
(:class:`~slapo_lab.editor.state.EditorState`): ``background`` (:mod:`slapo_lab.editor.background`),
``export_form`` (:mod:`slapo_lab.editor.export_form`) and ``planner`` (:mod:`slapo_lab.editor.planning`). The
panels' widgets keep their old names on the editor (``_graph``, ``_tree``, ``_btn_shard`` ...).
"""

from __future__ import annotations

import html
import logging
import os
from typing import Any

import ipywidgets as W
import networkx as nx
from torch import nn

from ..utils.collector import gc_deferred, running_loop
from .export_panel import ExportPanel
from .graph_panel import GraphPanel
from .inspector_panel import SYNC_CHOICES, InspectorPanel
from .layout import panel_layout
from .memory_panel import MemoryPanel
from .persistence import serialized
from .schedule_panel import SchedulePanel
from .state import EditorState
from .style import folded_style, legend_html, module_style
from .verify_panel import VerifyPanel

_log = logging.getLogger("slapo_lab.editor")

__all__ = ["SYNC_CHOICES", "ScheduleEditor"]


def _count(n: int) -> str:
    """``68976599040`` → ``69.0 B``, ``124439808`` → ``124.4 M``, ``6400`` → ``6,400``."""
    for size, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:,}"


# The live numeric check's line: JupyterLab's theme colours (light and dark), with fallbacks outside it.
_NUMERIC_COLOURS = {
    "passed": "var(--jp-success-color1, #2e7d32)",
    "failed": "var(--jp-error-color1, #c62828)",
    "error": "var(--jp-error-color1, #c62828)",
}


class ScheduleEditor(EditorState, W.VBox):
    """A visual schedule editor for ``model``: the widgets over an :class:`~slapo_lab.editor.state.EditorState`
    (the state and its actions, which need no browser), which draw what its hooks say changed.

    Args:
        model: the model to schedule (any device; it is copied to the meta device, never modified).
        example_inputs: keyword arguments of one forward call, e.g. ``{"input_ids": ids}`` with ``ids``
            of shape ``(batch, seq)``; used for dataflow edges and shapes, Verify and Export.
        world_size: the tensor-parallel width to plan for (simulated: no process group needed).
        rank: the rank whose shard shapes are shown.
        factory: ``"package.module:function"`` that rebuilds the model, for Export when the model is
            not a transformers model built from a config.
        schedule_file: a JSON schedule path kept in sync with the editor: restored (replayed) when the
            editor is created — so re-running the cell after a kernel restart brings the work back —
            and rewritten after every change.
        live_check: after every change (debounced, in a background thread, cancelled by the next change),
            run the schedule numerically on a shrunk copy of the model over simulated ranks and show ✓ or ✗
            with the worst difference and the first module that differs
            (:func:`slapo_lab.numeric.numeric_check`); needs ``example_inputs``. Default: on, unless the
            environment sets ``SLAPO_LAB_LIVE_CHECK=0``.

    Attributes:
        schedule: the :class:`~slapo_lab.Schedule` on the meta copy; type primitives on it freely.
        code: the recorded calls as Python text.
        export_options: the last export's launcher, script and options (see :meth:`export`), or None.

    Raises:
        ScheduleError: if ``model`` is not an ``nn.Module`` or ``world_size`` is invalid.
    """

    def __init__(
        self,
        model: nn.Module,
        example_inputs: dict | None = None,
        world_size: int = 1,
        rank: int = 0,
        factory: str | None = None,
        schedule_file: str | None = None,
        live_check: bool | None = None,
    ) -> None:
        # the meta copy, the dataflow and the widgets are ~10^5 objects and no garbage: no collection while they
        # are made, and in a kernel the full collection they cause runs a second after the cell, not inside it
        with gc_deferred(running_loop()):
            self._init(model, example_inputs, world_size, rank, factory, schedule_file, live_check)

    def _init(self, model, example_inputs, world_size, rank, factory, schedule_file, live_check) -> None:
        self._setup(model, example_inputs, world_size, rank, factory)
        self._flow = None
        self._flow_error = ""
        self._rendered_key = None
        self._last_graph = None
        self._panels_pending = False  # code, open items and memory are redrawn once the action returned
        self.live_check = (
            os.environ.get("SLAPO_LAB_LIVE_CHECK", "1") != "0" if live_check is None else live_check
        )
        self.numeric_report = None  # the last live check's NumericReport for the current schedule
        self._build_widgets()
        W.VBox.__init__(
            self,
            children=[
                self._header,
                self._body,
                self._message_row,
                self._numeric_box,
                self._file_bar,
                self._costs_box,
                self._code_box,
            ],
            layout=W.Layout(width="100%"),
        )
        self.add_class("slapo-editor")
        self._record_flow()
        self._open_file(schedule_file)

    # ------------------------------------------------------------------ public API

    def search(self, text: str) -> int:
        """Filter the module tree to names or types containing ``text`` (case-insensitive); returns matches.

        Matches are listed by full module path (``encoder.layer.0.intermediate · BertIntermediate``);
        the graph highlights every node that is or contains a match and centres the first one; no
        match shows one sentence instead of an empty tree. An empty ``text`` restores the (collapsed) tree and
        returns its number of rows (:meth:`GraphPanel.run_search <slapo_lab.editor.graph_panel.GraphPanel.run_search>`).
        """
        return self._graph_panel.run_search(text)

    def verify(self, device: str = "cuda", timeout: float = 600.0, wait: bool = False):
        """Run the schedule under Verify in a torchrun subprocess (the "Verify on GPU" button): see
        :meth:`slapo_lab.editor.verify_panel.VerifyPanel.run`, which documents the arguments and the result."""
        return self._verify.run(device, timeout, wait)

    def cancel_verify(self) -> bool:
        """Cancel a running Verify; returns whether one was running."""
        return self._verify.cancel()

    def verify_log(self) -> list[str]:
        """Every output line of the last (or current) Verify run, warnings included (the panel hides them)."""
        return self._verify.lines()

    @property
    def _runner(self):
        """The Verify panel's runner (None before the first run)."""
        return self._verify.runner

    @_runner.setter
    def _runner(self, value) -> None:
        self._verify.runner = value

    @property
    def _log_lines(self) -> list[str]:
        """The visible log of the last Verify (no warnings)."""
        return self._verify.log_lines

    # ------------------------------------------------------------------ the export form (ExportPanel)
    def _show_export(self, out, cmd: str) -> None:
        self._export.show_export(out, cmd)

    def _set_form(self, remembered: dict | None, refresh: bool = True) -> None:
        """Show ``remembered`` (``export_options``) in the form (:meth:`ExportPanel.set_form`)."""
        self._export.set_form(remembered, refresh)

    def _form_options(self) -> tuple[str, str, dict]:
        """``(launcher, script path, options)`` read off the form (:meth:`ExportPanel.form_options`)."""
        return self._export.form_options()

    def _plan_layout(self) -> tuple[int, str | None, str]:
        """``(dp, shard, note)`` for the memory plan, from the form (:meth:`ExportPanel.plan_layout`)."""
        return self._export.plan_layout()

    def _fill_form_from_plan(self, options: dict) -> None:
        """An applied plan's options into the form (:meth:`ExportPanel.fill_from_plan`)."""
        self._export.fill_from_plan(options)

    # ------------------------------------------------------------------ widgets
    def _build_widgets(self) -> None:
        name = type(self.model).__name__
        nparams = sum(p.numel() for p in self.model.parameters())
        self._numeric_box = W.HTML()
        self._header_base = f"<b>slapo-lab</b> · {html.escape(name)} · {_count(nparams)} parameters · "
        self._header = W.HTML(self._header_base)
        self._graph_panel = g = GraphPanel(self)
        # the panels' widgets under their old names on the editor (the tests and the panel view read them)
        self._tree, self._search, self._search_info, self._crumbs = g.tree, g.search, g.search_info, g.crumbs
        self._graph, self._legend = g.graph, g.legend
        self._inspector_panel = i = InspectorPanel(self)
        self._inspector, self._param, self._axis, self._sync = i.inspector, i.param, i.axis, i.sync
        self._similar, self._reasons, self._similar_info = i.similar, i.reasons, i.similar_info
        self._btn_shard, self._btn_sync, self._btn_ckpt, self._btn_cut = (
            i.btn_shard,
            i.btn_sync,
            i.btn_ckpt,
            i.btn_cut,
        )
        self._preset, self._preset_k, self._btn_preset = i.preset, i.preset_k, i.btn_preset
        self._memory = MemoryPanel(
            self, layout=self._plan_layout, set_dp=self._set_form_dp, on_apply=self._fill_form_from_plan
        )
        m = self._memory  # the widgets' old names on the editor (the tests and the panel view read them)
        self._gpu, self._nodes, self._gpn, self._tp = m.gpu, m.nodes, m.gpn, m.tp
        self._cluster_info, self._costs, self._costs_text = m.cluster_info, m.costs, m.costs_text
        self._plan_panel, self._costs_box = m.plan, m.box
        self._body = W.HBox([g.left, g.center, i.box], layout=W.Layout(width="100%"))
        self._message = W.HTML()
        self._message.add_class("slapo-message")
        # the click that resolves a refusal, when there is one (e.g. "Undo: preset megatron")
        self._btn_resolve = W.Button(layout=W.Layout(display="none", width="auto"), icon="reply")
        self._btn_resolve.on_click(lambda _: self._resolve())
        self._message_row = W.HBox([self._message, self._btn_resolve], layout=W.Layout(width="100%"))
        self._btn_reload = W.Button(description="reload file", icon="refresh", tooltip="editor.reload_file()")
        self._btn_mine = W.Button(
            description="keep mine as new file", icon="copy", tooltip="editor.keep_mine()"
        )
        self._btn_overwrite = W.Button(
            description="overwrite file",
            icon="save",
            tooltip="editor.overwrite_file()",
            button_style="danger",
        )
        self._btn_reload.on_click(lambda _: self.reload_file())
        self._btn_mine.on_click(lambda _: self.keep_mine())
        self._btn_overwrite.on_click(lambda _: self.overwrite_file())
        self._file_bar = W.HBox(
            [self._btn_reload, self._btn_mine, self._btn_overwrite], layout=W.Layout(display="none")
        )
        self._file_bar.add_class("slapo-file-bar")
        self._export = f = ExportPanel(self)
        # the form's widgets under their old names on the editor (the tests and the panel view read them)
        self._export_box, self._export_path, self._btn_export, self._export_info = (
            f.box,
            f.export_path,
            f.btn_export,
            f.export_info,
        )
        self._form_fields, self._f_launcher, self._f_fsdp, self._f_zero = (
            f.fields,
            f.f_launcher,
            f.f_fsdp,
            f.f_zero,
        )
        self._f_model, self._f_tokenizer, self._f_data, self._f_seq = (
            f.f_model,
            f.f_tokenizer,
            f.f_data,
            f.f_seq,
        )
        self._f_dp, self._f_batch, self._f_micro, self._f_steps = f.f_dp, f.f_batch, f.f_micro, f.f_steps
        self._f_ckpt, self._f_ckpt_every, self._f_save_hf = f.f_ckpt, f.f_ckpt_every, f.f_save_hf
        self._verify = v = VerifyPanel(self)
        self._btn_verify, self._btn_cancel, self._progress, self._phase, self._log = (
            v.btn_verify,
            v.btn_cancel,
            v.progress,
            v.phase,
            v.log,
        )
        self._schedule_panel = sp = SchedulePanel(self)
        self._code, self._check, self._coverage = sp.code, sp.open_items, sp.coverage
        self._btn_fix, self._btn_undo, self._btn_redo = sp.btn_fix, sp.btn_undo, sp.btn_redo
        self._code_box = W.VBox(
            [
                W.HTML(
                    "<b>Schedule</b> (recorded calls — typing on <code>editor.schedule</code> lands here too)"
                ),
                self._check,
                self._coverage,
                self._btn_fix,
                self._code,
                W.HBox([self._btn_undo, self._btn_redo]),
                self._export_box,
                W.HBox([self._btn_verify, self._btn_cancel, self._progress, self._phase]),
                self._log,
            ]
        )

    @property
    def _tree_rows(self) -> list[tuple[str, int, str, bool]]:
        """Every module as a tree row ``(path, depth, "name · Type", has children)`` (the graph panel's)."""
        return self._graph_panel.tree_rows

    @property
    def _all_tree_options(self) -> list[tuple[str, str]]:
        """Every module as an indented ``(label, path)`` row, unfolded (what search filters)."""
        return self._graph_panel.all_tree_options()

    def _tree_visible(self) -> list[tuple[str, str]]:
        """The tree as shown (:meth:`GraphPanel.tree_visible`)."""
        return self._graph_panel.tree_visible()

    def _refresh_tree(self) -> None:
        self._graph_panel.refresh_tree()

    # ------------------------------------------------------------------ events (the graph and inspector panels)
    def _on_tree(self, change) -> None:
        self._graph_panel.on_tree(change)

    @serialized
    def _on_node_click(self, path: str) -> None:
        path = self._resolve_node(path)
        if path is None:
            return
        self.select(path)

    @serialized
    def _on_node_dblclick(self, path: str) -> None:
        """Unfold a folded run of repeated blocks, or open a module's level (:meth:`GraphPanel.on_node_dblclick`)."""
        self._graph_panel.on_node_dblclick(path)

    def _on_shard(self) -> None:
        self._inspector_panel.on_shard()

    def _is_folded(self, node_path: str) -> bool:
        return self._graph_panel.is_folded(node_path)

    def _resolve_node(self, node_path: str) -> str | None:
        """Map a graph node (module path, folded range 'a.b.0-11', input/output) to a module path."""
        return self._graph_panel.resolve_node(node_path)

    # ------------------------------------------------------------------ the state's hooks, drawn
    def _show_message(self, text: str, error: bool) -> None:
        if not text:
            self._message.value = ""
        elif error:
            self._message.value = f"<div class='slapo-msg slapo-err'>&#9888; {html.escape(text)}</div>"
        else:
            self._message.value = f"<div class='slapo-msg slapo-ok'>{html.escape(text)}</div>"

    def _offer(self, resolve: tuple[str, Any] | None) -> None:
        super()._offer(resolve)
        self._btn_resolve.description = self.resolve_label
        self._btn_resolve.layout.display = "" if resolve else "none"

    def _action_buttons(self) -> list:
        return [
            self._btn_shard,
            self._btn_sync,
            self._btn_ckpt,
            self._btn_cut,
            self._btn_preset,
            self._btn_fix,
            self._btn_undo,
            self._btn_redo,
        ]

    def _set_busy(self, busy: bool, restore: Any = None) -> Any:
        """The action buttons are disabled while an action runs, then put back as they were."""
        buttons = self._action_buttons()
        if busy:
            was = [b.disabled for b in buttons]
            for b in buttons:
                b.disabled = True
            return was
        for b, w in zip(buttons, restore or [], strict=False):
            b.disabled = w
        return None

    def _shown_paths(self) -> set[str]:
        return self._graph_panel.shown_paths()

    def _show_file_bar(self, show: bool) -> None:
        self._file_bar.layout.display = "flex" if show else "none"

    @property
    def apply_to_similar(self) -> bool:
        """The "apply to all similar" tick (see :class:`~slapo_lab.editor.state.EditorState`)."""
        return bool(self._similar.value)

    @apply_to_similar.setter
    def apply_to_similar(self, value: bool) -> None:
        self._similar.value = bool(value)

    def _record_flow(self) -> None:
        self._graph_panel.record_flow()

    def _level_graph(self) -> nx.DiGraph:
        """The graph of the level shown (:meth:`GraphPanel.level_graph`)."""
        return self._graph_panel.level_graph()

    def _style(self, path: str, stage_of: dict[str, int] | None = None) -> dict[str, Any]:
        """Look of one module (:func:`slapo_lab.editor.style.module_style`)."""
        return module_style(self.schedule, path, stage_of)

    def _folded_style(self, members: list[str], stage_of: dict[str, int] | None) -> dict[str, Any]:
        """A folded run's look (:func:`slapo_lab.editor.style.folded_style`)."""
        return folded_style(self.schedule, members, stage_of)

    def _refresh_graph(self, reset_view: bool = False) -> None:
        self._graph_panel.refresh_graph(reset_view)

    def _legend_html(self, stage_of) -> str:
        return legend_html(stage_of)

    def _refresh_crumbs(self) -> None:
        self._graph_panel.refresh_crumbs()

    def _refresh_inspector(self) -> None:
        self._inspector_panel.refresh()

    def _update_axes(self) -> None:
        self._inspector_panel.update_axes()

    def _refresh_reasons(self) -> None:
        self._inspector_panel.refresh_reasons()

    def _refresh_code(self) -> None:
        """The code panel (:meth:`SchedulePanel.refresh_code`)."""
        self._schedule_panel.refresh_code()

    def _refresh_costs(self) -> None:
        """The memory view (:meth:`MemoryPanel.refresh_costs`)."""
        self._memory.refresh_costs()

    def _refresh_check(self) -> None:
        """The open items above the code panel (:meth:`SchedulePanel.refresh_check`)."""
        self._schedule_panel.refresh_check()

    # ------------------------------------------------------------------ the cluster shape

    def _refresh_cluster(self) -> str | None:
        """The header's degrees, the TP choices, the cluster line and (once the user set the shape) the form's
        dp; returns the sentence saying why the shape does not fit, or None."""
        degrees, problem = self._memory.refresh_cluster()
        self._header.value = self._header_base + html.escape(degrees) + f" (planning for rank {self.rank})"
        return problem

    def _set_form_dp(self, dp: int) -> None:
        """The cluster shape's data-parallel degree into the Export form."""
        if str(self._f_dp.value).strip() != str(dp):
            self._f_dp.value = str(dp)

    def _refresh_all(self, reset_view: bool = False) -> None:
        """Redraw after the schedule changed: the view first; the code panel, the schedule check and the costs
        right after the action returns in a kernel (:meth:`_refresh_panels`, so a click's colours and message
        reach the browser without waiting for them), at once outside one."""
        self.numeric_report = None  # the last live check was of another schedule
        self._refresh_cluster()
        loop = running_loop()
        if loop is None:
            self._refresh_panels()
        elif not self._panels_pending:
            self._panels_pending = True
            loop.call_soon(self._idle_panels)
        self._refresh_view(reset_view)
        self._refresh_history()
        self._schedule_background()

    def _refresh_panels(self) -> None:
        """The panels that read the whole schedule: code (folded), open items, coverage and memory."""
        self._refresh_code()
        self._refresh_check()
        self._refresh_costs()

    def _idle_panels(self) -> None:
        self._panels_pending = False
        try:
            with self._lock:
                self._refresh_panels()
        except Exception:  # noqa: BLE001 - the view must never break the engine
            _log.exception("editor panels refresh failed")

    # ------------------------------------------------------------------ background work and the live check
    def _schedule_background(self) -> None:
        """After every change: the background work (:meth:`BackgroundChecks.schedule
        <slapo_lab.editor.background.BackgroundChecks.schedule>`; in a kernel also the call order, the
        activations and the spare copy)."""
        self.background.schedule(kernel=running_loop() is not None)

    def _show_numeric(self, phase: str, report=None) -> None:
        """The live numeric check's line under the message line (JupyterLab's theme colours)."""
        if phase == "off":
            self._numeric_box.value = ""
        elif phase == "waiting":
            self._numeric_box.value = (
                "<div class='slapo-numeric slapo-numeric-running'>Numeric check: waiting for the clicks to "
                "settle…</div>"
            )
        elif phase == "running":
            self._numeric_box.value = (
                f"<div class='slapo-numeric slapo-numeric-running'>Numeric check: running on {self.world_size} "
                f"simulated rank{'s' if self.world_size > 1 else ''}…</div>"
            )
        else:
            mark = {"passed": "&#10003;", "failed": "&#10007;", "error": "&#10007;"}.get(
                report.status, "&#8226;"
            )
            colour = _NUMERIC_COLOURS.get(report.status, "var(--jp-ui-font-color2, #616161)")
            self._numeric_box.value = (
                f"<div class='slapo-numeric slapo-numeric-{report.status}' style='color: {colour}' title='a "
                f"shrunk copy, simulated ranks: Verify is the full proof'>{mark} {html.escape(report.message)} "
                f"<small>({report.seconds:.1f} s)</small></div>"
            )

    def _refresh_history(self) -> None:
        """Undo is enabled only with something to undo, Redo only with something to redo."""
        self._schedule_panel.refresh_history()

    def _prefetch_checks(self) -> float:
        """Record the forward call order the cut checks need ahead (:meth:`BackgroundChecks.prefetch
        <slapo_lab.editor.background.BackgroundChecks.prefetch>`); returns seconds spent."""
        return self.background.prefetch()

    def _refresh_view(self, reset_view: bool = False) -> None:
        """Redraw after navigation (selection, level, folding): nothing that depends only on the schedule."""
        self._refresh_crumbs()
        self._refresh_graph(reset_view=reset_view)
        self._refresh_inspector()
        self._inspector_panel.refresh_similar()
        self._refresh_tree()
        self._graph_panel.show_selected()
        if self._flow_error and not self.message:
            self._info(self._flow_error)

    # ------------------------------------------------------------------ panel, keys and context menus (issue 17)
    def open(self) -> str | None:
        """Open this editor as a JupyterLab panel beside the notebook (see :meth:`open_panel`).

        ipywidgets also calls ``open()`` to create the widget's comm while it is constructed; that use
        (no comm yet) still does exactly that.
        """
        if getattr(self, "comm", None) is None:
            return super().open()
        return self.open_panel()

    def open_panel(self) -> str | None:
        """Show the editor in a JupyterLab main-area panel split to the right of the notebook, full height.

        The panel is another view of :meth:`panel_view` (the same child widgets as the cell's view, laid
        out tree | graph | inspector under a toolbar): same kernel, same schedule; the cell's view stays.
        Returns None once the request is sent (the panel's answer shows in the message line), else one
        sentence why no panel can be opened (e.g. no JupyterLab front end: a plain Python process).
        """
        try:
            problem = self._graph.open_panel(self.panel_view().model_id)
        except Exception as err:  # noqa: BLE001 - never raise from a convenience call
            _log.exception("open_panel failed")
            problem = f"The panel could not be requested ({type(err).__name__}: {err})."
        if problem is not None:
            return self._error(f"{problem.rstrip('.')}; display the editor in a cell instead.")
        self._info("Opening the editor in a panel beside the notebook…", transient=True)
        return None

    def panel_view(self) -> W.VBox:
        """The editor's widgets arranged for a full-height panel (built once, then reused).

        The SAME child widgets as the cell's view: a toolbar (Undo, Redo, preset, Export, Verify, progress),
        the message line, then the module tree | graph | inspector, and the schedule, memory, export, Verify-log
        and legend panes in an Accordion (collapsed). ``editor.open()`` shows it in JupyterLab.
        """
        panel = getattr(self, "_panel", None)
        if panel is None:
            self._panel = panel = panel_layout(self)
        return panel

    def _on_panel_answer(self, opened: bool, reason: str) -> None:
        self._graph_panel.on_panel_answer(opened, reason)

    def _sync_action_reasons(self) -> None:
        self._inspector_panel.sync_action_reasons()

    @serialized
    def _on_browser_action(self, action: str, token: str | None, path: str | None) -> None:
        """Run one browser action (keys, context menus, palette): :meth:`GraphPanel.on_browser_action`."""
        self._graph_panel.on_browser_action(action, token, path)

    def _go_up(self) -> None:
        self._graph_panel.go_up()

    def _select_similar(self) -> None:
        self._inspector_panel.select_similar()
