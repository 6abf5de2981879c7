"""ScheduleEditor: the ipywidgets app — module tree | graph of one level | inspector, code panel below.

Data flows one way: the editor owns a meta-device copy of the model and a schedule on it; a click
calls a public primitive on ``editor.schedule`` (exactly what a person would type); the recorder
notifies the editor, which redraws from the schedule and the record. Typing on ``editor.schedule``
in a cell therefore shows up exactly as clicking does. The user's real model is never modified: it
is the source for Verify and Export.
"""

from __future__ import annotations

import atexit
import html
import logging
import threading
import weakref
from typing import Any

import ipywidgets as W
import networkx as nx
from torch import nn

from .. import check_primitive, module_state
from ..record import gc_deferred
from ..utils import to_meta
from .export_panel import ExportPanel
from .form_button import FormButton
from .graph_widget import GraphWidget
from .memory_panel import MemoryPanel, set_silently
from .persistence import serialized
from .schedule_panel import SchedulePanel
from .state import (
    ACTIVATIONS,
    EditorState,
    _running_loop,
)
from .style import folded_style, legend_html, module_style
from .verify_panel import VerifyPanel

_log = logging.getLogger("slapo_lab.editor")

SYNC_CHOICES = [
    ("fwd_post · all_reduce (after a row-parallel layer)", ("fwd_post", "all_reduce")),
    ("bwd_post · all_reduce (before a column-parallel layer)", ("bwd_post", "all_reduce")),
]


def _io_text(v) -> str:
    """``[{"name": "x", "shapes": [(8, 128)], "dtypes": ["float32"]}]`` → ``x 8×128 float32``."""
    if not isinstance(v, list):
        return str(v)
    parts = []
    for d in v:
        if isinstance(d, dict):
            shapes = "/".join("×".join(map(str, sh)) for sh in d.get("shapes", []))
            parts.append(
                " ".join(x for x in (str(d.get("name", "")), shapes, "/".join(d.get("dtypes", []))) if x)
            )
    return ", ".join(parts)


def _count(n: int) -> str:
    """``68976599040`` → ``69.0 B``, ``124439808`` → ``124.4 M``, ``6400`` → ``6,400``."""
    for size, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:,}"


_LIVE_CHECKS: weakref.WeakSet = weakref.WeakSet()  # editors whose live check may be running


@atexit.register
def _stop_live_checks() -> None:
    """At interpreter exit, cancel every live numeric check and wait (briefly) for its threads: a daemon
    thread killed inside a collective aborts the process ("terminate called without an active exception")."""
    for ed in list(_LIVE_CHECKS):
        ed._numeric_cancel.set()
        timer = ed._numeric_timer
        if timer is not None:
            timer.cancel()
            timer.join(10.0)


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
        with gc_deferred(_running_loop()):
            self._init(model, example_inputs, world_size, rank, factory, schedule_file, live_check)

    def _init(self, model, example_inputs, world_size, rank, factory, schedule_file, live_check) -> None:
        import os

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
        self._numeric_gen = 0  # bumped by every schedule change: an older check's result is dropped
        self._numeric_cancel = threading.Event()
        self._numeric_timer: threading.Timer | None = None
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
        returns its number of rows.
        """
        raw = (text or "").strip()
        text = raw.lower()
        self._searching = bool(text)
        opts = (
            self._tree_visible()
            if not text
            else [
                (f"{path or '(model)'} · {label.rsplit(' · ', 1)[-1]}", path)
                for label, path in self._all_tree_options
                if text in label.lower() or text in path.lower()
            ]
        )
        keep = self.selected if any(p == self.selected for _, p in opts) else None
        set_silently(self._tree, self._on_tree, options=opts, value=keep)
        none = bool(text) and not opts
        self._tree.layout.display = "none" if none else None
        self._search_info.value = f"No module matches '{html.escape(raw)}'." if none else ""
        hits = {p for _, p in opts} if text else set()
        inside = {".".join(p.split(".")[:i]) for p in hits for i in range(1, p.count(".") + 1)}

        def shows_match(_token: str, node: Any) -> bool:  # re-applied to every redraw of the graph
            G = getattr(self, "_last_graph", None)
            data = G.nodes[node] if G is not None and node in G else {}
            if data.get("kind") not in ("module", "folded"):
                return False
            members = data.get("members") or [data.get("path", node)]
            return any(m in hits or m in inside for m in members)

        self._graph.highlight(shows_match if hits else None)
        return len(opts)

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
        self._tree_rows = self._tree_rows_of_schedule()
        self._tree = W.Select(options=self._tree_visible(), rows=30, layout=W.Layout(width="100%"))
        self._tree.observe(self._on_tree, names="value")
        self._search = W.Text(placeholder="search name or type", layout=W.Layout(width="100%"))
        self._search.observe(lambda ch: self.search(ch["new"]), names="value")
        self._search_info = W.HTML()  # "No module matches 'xyz'." instead of an empty tree
        self._search_info.add_class("slapo-search-info")
        self._crumbs = W.HBox(layout=W.Layout(flex_flow="row wrap"))
        self._graph = GraphWidget(height="600px", layout=W.Layout(width="100%"))
        self._graph.on_node_click(lambda tok, path: self._on_node_click(path))
        self._graph.on_node_dblclick(lambda tok, path: self._on_node_dblclick(path))
        self._graph.on_error(self._error)
        self._graph.on_action(self._on_browser_action)  # keys, context menus, command palette
        self._graph.on_panel(self._on_panel_answer)
        self._search.add_class("slapo-search")
        self._inspector = W.HTML()
        self._param = W.Dropdown(description="tensor", layout=W.Layout(width="95%"))
        self._axis = W.Dropdown(description="axis", options=[0, 1], layout=W.Layout(width="95%"))
        self._param.observe(lambda ch: self._update_axes(), names="value")
        self._sync = W.Dropdown(options=SYNC_CHOICES, description="sync", layout=W.Layout(width="95%"))
        self._similar = W.Checkbox(
            value=False,
            description="apply to all similar",
            indent=False,
            tooltip="also apply to the modules of the same type at the same relative "
            "path in every repeated block",
        )
        # each click carries the page's values of the choices it reads (FormButton: never a stale choice)
        self._btn_shard = FormButton(
            [self._param, self._axis, self._similar],
            description="shard",
            icon="cut",
            tooltip="shard(tensor, axis)",
        )
        self._btn_sync = FormButton([self._sync, self._similar], description="sync", icon="exchange")
        self._btn_ckpt = FormButton([self._similar], description="checkpoint", icon="history")
        self._btn_cut = FormButton([self._similar], description="cut pipeline stage", icon="scissors")
        for b in (self._btn_shard, self._btn_sync, self._btn_ckpt, self._btn_cut):
            b.layout = W.Layout(width="95%")
        self._btn_shard.on_click(lambda _: self._on_shard())
        self._btn_sync.on_click(
            lambda _: self.apply("sync", mode=self._sync.value[0], sync_op_or_fn=self._sync.value[1])
        )
        self._btn_ckpt.on_click(lambda _: self.apply("checkpoint"))
        self._btn_cut.on_click(lambda _: self.apply("cut_pipeline_stage"))
        self._reasons = W.HTML()
        self._similar_info = W.HTML()
        actions = W.VBox(
            [
                self._param,
                self._axis,
                self._btn_shard,
                self._sync,
                self._btn_sync,
                self._btn_ckpt,
                self._btn_cut,
                self._similar,
                self._similar_info,
                self._reasons,
            ]
        )
        self._preset = W.Dropdown(
            options=[
                ("Megatron tensor parallelism (every block)", "megatron"),
                ("HF base_model_tp_plan (from the config)", "hf_plan"),
                ("checkpoint every k-th block", "checkpoint"),
                ("cut into N balanced pipeline stages", "stages"),
            ],
            description="preset",
            layout=W.Layout(width="95%"),
        )
        self._preset_k = W.BoundedIntText(
            value=1, min=1, max=4096, description="k / N", layout=W.Layout(width="95%")
        )
        self._btn_preset = FormButton(
            [self._preset, self._preset_k],
            description="apply preset",
            icon="magic",
            layout=W.Layout(width="95%"),
        )
        self._btn_preset.on_click(lambda _: self.apply_preset(self._preset.value, self._preset_k.value))
        self._memory = MemoryPanel(
            self, layout=self._plan_layout, set_dp=self._set_form_dp, on_apply=self._fill_form_from_plan
        )
        m = self._memory  # the widgets' old names on the editor (the tests and the panel view read them)
        self._gpu, self._nodes, self._gpn, self._tp = m.gpu, m.nodes, m.gpn, m.tp
        self._cluster_info, self._costs, self._costs_text = m.cluster_info, m.costs, m.costs_text
        self._plan_panel, self._costs_box = m.plan, m.box
        narrow = {"description_width": "48px"}
        for w in (self._param, self._axis, self._sync, self._preset, self._preset_k):
            w.style = narrow
        left = W.VBox(
            [W.HTML("<b>Modules</b>"), self._search, self._search_info, self._tree],
            layout=W.Layout(width="22%"),
        )
        self._legend = W.HTML()
        self._legend.add_class("slapo-legend")
        center = W.VBox([self._crumbs, self._graph, self._legend], layout=W.Layout(width="48%"))
        right = W.VBox(
            [
                W.HTML("<b>Inspector</b>"),
                self._inspector,
                actions,
                W.HTML("<b>Presets</b>"),
                self._preset,
                self._preset_k,
                self._btn_preset,
            ],
            layout=W.Layout(width="30%"),
        )
        self._body = W.HBox([left, center, right], layout=W.Layout(width="100%"))
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
        self._inspector.add_class("slapo-inspector")
        self._tree.add_class("slapo-tree")
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

    def _tree_rows_of_schedule(self) -> list[tuple[str, int, str, bool]]:
        """Every module as a tree row ``(path, depth, "name · Type", has children)``, in tree order."""
        rows = []
        for path, node in self.schedule.named_schedules():
            depth = path.count(".") + 1 if path else 0
            rows.append(
                (path, depth, (node.name or "(model)") + f" · {type(node.mod).__name__}", bool(node.child))
            )
        return rows

    @property
    def _all_tree_options(self) -> list[tuple[str, str]]:
        """Every module as an indented ``(label, path)`` row, unfolded (what search filters)."""
        return [(("\u2003" * depth) + text, path) for path, depth, text, _ in self._tree_rows]

    def _tree_visible(self) -> list[tuple[str, str]]:
        """The tree as shown: a module's children are listed only while it is open, and the open modules are
        the selected one, the level the graph shows, and their ancestors (selecting a row opens it, selecting
        an ancestor folds the rest away). A 70B model shows ~90 rows instead of ~1,000. ▸ marks a closed module
        with submodules, ▾ an open one."""
        open_ = {""}
        for path in (self.selected, self.level):
            parts = path.split(".") if path else []
            open_.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        out = []
        for path, depth, text, has_children in self._tree_rows:
            parent = path.rsplit(".", 1)[0] if "." in path else ""
            if path and parent not in open_:
                continue
            mark = ("\u25be " if path in open_ else "\u25b8 ") if has_children else ""
            out.append((("\u2003" * depth) + mark + text, path))
        return out

    def _refresh_tree(self) -> None:
        """Show the collapsed tree for the current selection (unless a search lists its matches)."""
        if getattr(self, "_searching", False):
            return
        opts = self._tree_visible()
        if list(self._tree.options) != opts:
            keep = self.selected if any(p == self.selected for _, p in opts) else None
            set_silently(self._tree, self._on_tree, options=opts, value=keep)

    # ------------------------------------------------------------------ events

    def _on_tree(self, change) -> None:
        path = change["new"]
        if path is None or path == self.selected:
            return
        self.select(path)

    @serialized
    def _on_node_click(self, path: str) -> None:
        path = self._resolve_node(path)
        if path is None:
            return
        self.select(path)

    @serialized
    def _on_node_dblclick(self, path: str) -> None:
        """Unfold a folded run of repeated blocks, or open a module's level; busy state meanwhile."""
        folded = self._is_folded(path)
        target = path if folded else self._resolve_node(path)
        if target is None or not (folded or self.schedule[target].child):
            return
        what = f"unfolding {target}" if folded else f"opening {target}"
        try:
            with self._working(what):
                if folded:
                    self.expanded.add(target)
                    self._refresh_view(reset_view=True)
                else:
                    self.open_level(target)
        except Exception as err:  # noqa: BLE001 - never let a double-click kill the kernel
            _log.exception("double-click failed")
            if folded:
                self.expanded.discard(target)
            self._error(
                f"Could not show {target}: drawing the graph failed ({type(err).__name__}); "
                "the schedule is unchanged."
            )

    def _on_shard(self) -> None:
        if self._param.value is None:
            self._error(
                f"{self.selected or 'The root module'} ({type(self.schedule[self.selected].mod).__name__}) "
                "has no parameters or buffers of its own to shard; select one of its submodules."
            )
            return
        self.apply("shard", self._param.value, axis=self._axis.value)

    # ------------------------------------------------------------------ helpers
    def _is_folded(self, node_path: str) -> bool:
        G = getattr(self, "_last_graph", None)
        if G is not None and node_path in G:
            return G.nodes[node_path].get("kind") == "folded"
        return False

    def _resolve_node(self, node_path: str) -> str | None:
        """Map a graph node (module path, folded range 'a.b.0-11', input/output) to a module path."""
        if node_path in self.schedule:
            return node_path
        if self._is_folded(node_path):
            first = self._last_graph.nodes[node_path].get("path")
            if first in self.schedule:
                return first
        return None

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
        G = self._last_graph
        return {d.get("path", n) for n, d in G.nodes(data=True)} if G is not None else set()

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
        if not self.example_inputs:
            self._flow_error = "No example inputs were given, so the graph shows modules without dataflow."
            return
        try:
            from ..graph import record_dataflow

            # the schedule's meta copy, before any primitive touched it (one copy fewer at start-up)
            from ..graph.dataflow import DataflowError

            try:
                self._flow = record_dataflow(self._meta_model, to_meta(self.example_inputs))
            except DataflowError:  # a data-dependent `if t.all():` on meta (HF's packed-sequence check with
                # use_cache=False): record again guessing True; the guesses are listed in flow.assumptions
                self._flow = record_dataflow(self._meta_model, to_meta(self.example_inputs), assume_bool=True)
                where = ", ".join(sorted({path or "the model" for path, _ in self._flow.assumptions})[:3])
                self._flow_error = (
                    f"The dataflow was recorded by assuming that a data-dependent condition in {where} "
                    "is true (meta tensors have no values), so the edges there show that branch only."
                )
            if getattr(self._flow, "fallback", ""):
                self._flow_error = f"The dataflow was {self._flow.fallback.rstrip('.')}."
        except Exception as err:  # noqa: BLE001 - reported, never raised past this point
            self._flow = None
            reason = str(err).splitlines()[0][:200].rstrip(".")
            self._flow_error = (
                "The dataflow could not be recorded, so the graph shows modules without edges and "
                f"every action still works: {reason}."
            )

    def _level_graph(self) -> nx.DiGraph:
        if self._flow is not None:
            try:
                return self._flow.level_graph(self.level, expanded=frozenset(self.expanded))
            except Exception as err:  # noqa: BLE001 - fall back to the plain tree level
                _log.warning("level_graph failed: %s", err)
        G = nx.DiGraph()
        node = self.schedule[self.level]
        for name, child in node.child.items():
            G.add_node(
                child.path,
                path=child.path,
                label=f"{name}\n{type(child.mod).__name__}",
                type=type(child.mod).__name__,
                kind="module",
                params=sum(p.numel() for p in child.mod.parameters()),
            )
        return G

    def _style(self, path: str, stage_of: dict[str, int] | None = None) -> dict[str, Any]:
        """Look of one module (:func:`slapo_lab.editor.style.module_style`)."""
        return module_style(self.schedule, path, stage_of)

    def _folded_style(self, members: list[str], stage_of: dict[str, int] | None) -> dict[str, Any]:
        """A folded run's look (:func:`slapo_lab.editor.style.folded_style`)."""
        return folded_style(self.schedule, members, stage_of)

    def _refresh_graph(self, reset_view: bool = False) -> None:
        from ..graph import render_svg
        from ..graph.dataflow import per_rank_edges

        G = self._level_graph()
        # edge labels: the shapes this rank sees after sharding (e.g. 2×16×64→32 after a column split)
        per_rank_edges(
            G, self.world_size, lambda p: self.schedule[p].mod if p in self.schedule else None, module_state
        )
        self._last_graph = G
        stage_of = None
        if self.schedule.metadata.primitives.get("cut_pipeline_stage"):
            try:
                from ..call_order import cached_call_order
                from ..plan import stage_assignment

                # by when modules run, once the forward's order is known (never recorded just for this)
                stage_of = stage_assignment(self.schedule, cached_call_order(self.schedule)).stage_of
            except Exception:  # noqa: BLE001 - a stale cut: show no bands rather than fail the view
                stage_of = None
        styles = {}
        for n, data in G.nodes(data=True):
            kind = data.get("kind")
            if kind in ("input", "output"):
                continue
            members = [m for m in (data.get("members") or [data.get("path", n)]) if m in self.schedule]
            data["params_rank"] = sum(p.numel() for m in members for p in self.schedule[m].mod.parameters())
            if kind == "folded":
                st = self._folded_style(list(data.get("members") or []), stage_of)
            else:
                st = self._style(data.get("path", n), stage_of)
            if st:  # no selection here: the browser draws it, so a click never reruns graphviz
                styles[n] = st
        key = (self.level, tuple(G.nodes), tuple(G.edges), repr(sorted(styles.items())))
        if key != self._rendered_key or reset_view:  # redraw only what is visible and changed
            svg, node_ids = render_svg(G, styles, token_prefix=self._graph.next_token_prefix())
            self._graph.set_graph(svg, node_ids, reset_view=reset_view)
            self._rendered_key = key
        inverse = {p: t for t, p in self._graph.node_ids.items()}
        self._graph.selected = inverse.get(self.selected, "")
        self._legend.value = self._legend_html(stage_of)

    def _legend_html(self, stage_of) -> str:
        return legend_html(stage_of)

    def _refresh_crumbs(self) -> None:
        key = (self.level, any(k.startswith(self.level) for k in self.expanded))
        if key == getattr(self, "_crumbs_key", None):
            return
        self._crumbs_key = key
        parts = self.level.split(".") if self.level else []
        buttons = []
        acc = ""
        b = W.Button(description=type(self.model).__name__, layout=W.Layout(width="auto"))
        b.on_click(lambda _: self.open_level(""))
        buttons.append(b)
        for part in parts:
            acc = f"{acc}.{part}" if acc else part
            b = W.Button(description=part, layout=W.Layout(width="auto"))
            b.on_click(lambda _, p=acc: self.open_level(p))
            buttons.append(b)
        if any(k.startswith(self.level) for k in self.expanded):
            fold = W.Button(
                description="fold repeats",
                icon="compress",
                layout=W.Layout(width="auto"),
                tooltip="fold expanded repeated blocks back into one node",
            )
            fold.on_click(lambda _: self.collapse())
            buttons.append(fold)
        self._crumbs.children = buttons

    def _refresh_inspector(self) -> None:
        node = self.schedule[self.selected]
        mod = node.mod
        rows = []
        tensors = [(n, t, "param") for n, t in mod.named_parameters(recurse=False)] + [
            (n, t, "buffer") for n, t in mod.named_buffers(recurse=False)
        ]
        for n, t, _kind in tensors:
            full = tuple(getattr(t, "orig_shape", t.shape))
            local = tuple(t.shape)
            axis = getattr(t, "shard_axis", None)
            rows.append(
                f"<tr><td>{html.escape(n)}</td><td>{'×'.join(map(str, full)) or 'scalar'}</td>"
                f"<td>{'×'.join(map(str, local)) or 'scalar'}</td><td>{'' if axis is None else axis}</td></tr>"
            )
        total = sum(p.numel() for p in mod.parameters())
        table = (
            (
                "<table class='slapo-params'><tr><th>tensor</th><th>global</th>"
                f"<th>rank {self.rank}</th><th>axis</th></tr>" + "".join(rows) + "</table>"
            )
            if rows
            else "<i>no parameters of its own</i>"
        )
        flow = ""
        if self._flow is not None:
            try:
                info = self._flow.module_info(self.selected)
                ins = info.get("inputs") or info.get("input_shapes")
                outs = info.get("outputs") or info.get("output_shapes")
                if ins or outs:
                    flow = (
                        f"<div class='slapo-io'>in: {html.escape(_io_text(ins))}<br>"
                        f"out: {html.escape(_io_text(outs))}</div>"
                    )
            except Exception:  # noqa: BLE001 - reported, never raised past this point
                flow = ""
        meta = module_state(mod) or {}
        state = []
        if meta.get("checkpoint"):
            state.append("checkpointed")
        if meta.get("cut"):
            state.append("ends a pipeline stage")
        for mode, op in meta.get("syncs", []):
            state.append(f"sync {mode} {op}")
        self._inspector.value = (
            f"<div><b>{html.escape(self.selected or '(model)')}</b><br>{html.escape(type(mod).__name__)} · "
            f"{total:,} parameters (this rank)</div>{table}{flow}"
            + (f"<div>{html.escape(', '.join(state))}</div>" if state else "")
        )
        names = [n for n, _, _ in tensors]
        shard_display = None if names else "none"
        for w in (self._param, self._axis, self._btn_shard):
            w.layout.display = shard_display
        self._param.options = names
        if names:
            self._param.value = "weight" if "weight" in names else names[0]
        self._update_axes()

    def _update_axes(self) -> None:
        node = self.schedule[self.selected]
        name = self._param.value
        t = None
        if name is not None:
            t = dict(node.mod.named_parameters(recurse=False)).get(name)
            if t is None:
                t = dict(node.mod.named_buffers(recurse=False)).get(name)
        dims = list(range(t.dim())) if t is not None and t.dim() else [0]
        self._axis.options = dims
        self._axis.value = 0 if 0 in dims else dims[0]
        self._refresh_reasons()

    def _refresh_reasons(self) -> None:
        node = self.schedule[self.selected]
        reasons = {}
        if self._param.value is None:
            reasons[self._btn_shard] = f"{self.selected or 'The root module'} has no parameters of its own."
        else:
            reasons[self._btn_shard] = check_primitive(
                node, "shard", self._param.value, axis=self._axis.value
            )
        mode, op = self._sync.value
        reasons[self._btn_sync] = check_primitive(node, "sync", mode=mode, sync_op_or_fn=op)
        reasons[self._btn_ckpt] = check_primitive(node, "checkpoint")
        from ..call_order import cached_call_order

        if _running_loop() is not None and cached_call_order(self.schedule) is None:
            reasons[self._btn_cut] = (
                None  # recorded in the background (a kernel): the button checks when clicked
            )
        else:
            reasons[self._btn_cut] = check_primitive(node, "cut_pipeline_stage")
        lines = []
        for btn, why in reasons.items():
            btn.tooltip = why or ""
            btn.button_style = "" if why else "primary"
            if why:
                lines.append(f"<li><b>{html.escape(btn.description)}</b>: {html.escape(why)}</li>")
        # Buttons stay clickable: a click on an invalid action explains itself in the message line.
        self._reasons.value = f"<ul class='slapo-reasons'>{''.join(lines)}</ul>" if lines else ""
        self._sync_action_reasons()

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
        loop = _running_loop()
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
    #: seconds of quiet after a change before the background work starts (a burst of clicks runs it once)
    BACKGROUND_DEBOUNCE = 0.6
    NUMERIC_DEBOUNCE = BACKGROUND_DEBOUNCE

    def numeric_check(self):
        """Run the numeric check now, in this thread, on the current schedule (what the live check shows):
        the recorded calls replayed on a shrunk copy of the model over ``world_size`` simulated ranks and
        compared with the unsharded copy (:func:`slapo_lab.numeric.numeric_check`).

        Returns:
            The :class:`~slapo_lab.numeric.NumericReport` (also shown under the message line, and a failure is
            listed with the open items).
        """
        with self._lock:
            self._numeric_gen += 1
            gen, calls = self._numeric_gen, list(self.schedule.record.calls)
        return self._run_numeric(gen, calls, threading.Event())

    def wait_background(self, timeout: float = 120.0) -> bool:
        """Wait until the background work after the last change is done (for scripts, tests and benchmarks);
        returns whether it finished within ``timeout`` seconds."""
        timer = self._numeric_timer
        if timer is None:
            return True
        timer.join(timeout)
        return not timer.is_alive()

    def _schedule_background(self) -> None:
        """After every change: cancel the background work under way, and :attr:`BACKGROUND_DEBOUNCE` seconds
        after the last change run, in one daemon thread, in order and each cancelled by the next change: in a
        kernel, the forward call order (the cut button's reason) and the activation pass (the memory view),
        each a meta forward of every layer; then the live numeric check; then, in a kernel, the spare meta copy
        the next undo starts from (:meth:`~slapo_lab.editor.state.EditorState._make_spare`). One thread, one at
        a time: they never compete with each other, and a burst of clicks runs them once."""
        self._numeric_gen += 1
        self._numeric_cancel.set()
        if self._numeric_timer is not None:
            self._numeric_timer.cancel()
        self.numeric_report = None
        kernel = _running_loop() is not None
        numeric = bool(self.live_check and self.example_inputs)
        if not numeric:
            self._numeric_box.value = ""
        if not (numeric or kernel):
            return
        self._numeric_cancel = cancel = threading.Event()
        if numeric:
            self._numeric_box.value = (
                "<div class='slapo-numeric slapo-numeric-running'>Numeric check: waiting for the clicks to "
                "settle…</div>"
            )
        self._numeric_timer = threading.Timer(
            self.BACKGROUND_DEBOUNCE,
            self._background,
            args=(self._numeric_gen, list(self.schedule.record.calls), cancel, kernel, numeric),
        )
        self._numeric_timer.daemon = True
        self._numeric_timer.start()
        _LIVE_CHECKS.add(self)

    def _background(
        self, gen: int, calls: list, cancel: threading.Event, kernel: bool, numeric: bool
    ) -> None:
        from ..activation_cache import profile_for_cache
        from ..call_order import record_for_cache

        try:
            if kernel and record_for_cache(self.schedule, self._lock, cancel):
                with self._lock:
                    if self.selected in self.schedule and not self._busy:
                        self._refresh_reasons()
            if (
                kernel
                and self.example_inputs
                and not cancel.is_set()
                and profile_for_cache(self.schedule, self.example_inputs, self._lock, ACTIVATIONS, cancel)
            ):
                with self._lock:
                    self._refresh_costs()
        except Exception as err:  # noqa: BLE001 - background work is advice: it must never break the editor
            _log.warning("background work failed: %s: %s", type(err).__name__, err)
        if numeric and not cancel.is_set():
            self._run_numeric(gen, calls, cancel)
        if kernel and not cancel.is_set():
            try:  # last: the next undo replays onto it instead of copying the model first
                self._make_spare()
            except Exception as err:  # noqa: BLE001 - the rebuild then copies the model itself
                _log.warning("no spare copy for undo: %s: %s", type(err).__name__, err)

    def _run_numeric(self, gen: int, calls: list, cancel: threading.Event):
        from ..numeric import numeric_check

        if gen == self._numeric_gen:
            self._numeric_box.value = (
                f"<div class='slapo-numeric slapo-numeric-running'>Numeric check: running on {self.world_size} "
                f"simulated rank{'s' if self.world_size > 1 else ''}…</div>"
            )
        try:
            report = numeric_check(self.model, calls, self.world_size, self.example_inputs, cancelled=cancel)
        except Exception as err:  # noqa: BLE001 - the live check is advice: it must never break the editor
            _log.warning("numeric check could not run: %s: %s", type(err).__name__, err)
            from ..numeric import NumericReport

            report = NumericReport("skipped", f"The numeric check could not run: {type(err).__name__}: {err}")
        if gen != self._numeric_gen or cancel.is_set():
            return report  # the schedule changed meanwhile: a newer check shows its own result
        self.numeric_report = report
        mark = {"passed": "&#10003;", "failed": "&#10007;", "error": "&#10007;"}.get(report.status, "&#8226;")
        colour = _NUMERIC_COLOURS.get(report.status, "var(--jp-ui-font-color2, #616161)")
        self._numeric_box.value = (
            f"<div class='slapo-numeric slapo-numeric-{report.status}' style='color: {colour}' title='a shrunk "
            f"copy, simulated ranks: Verify is the full proof'>{mark} {html.escape(report.message)} "
            f"<small>({report.seconds:.1f} s)</small></div>"
        )
        with self._lock:
            self._refresh_check()  # a failure is an open item; a pass clears the previous one
        return report

    def _refresh_history(self) -> None:
        """Undo is enabled only with something to undo, Redo only with something to redo."""
        self._schedule_panel.refresh_history()

    def _prefetch_checks(self) -> float:
        """Record the forward call order that the cut checks (and the cut button's reason) need, so the
        first navigation does not pay for it; a no-op when it is cached. Returns seconds spent."""
        import time

        from ..call_order import call_order

        t0 = time.perf_counter()
        try:
            call_order(self.schedule)
        except Exception as err:  # noqa: BLE001 - the check then runs (and explains itself) on the first cut
            _log.warning("call order not recorded ahead: %s", err)
        return time.perf_counter() - t0

    def _refresh_view(self, reset_view: bool = False) -> None:
        """Redraw after navigation (selection, level, folding): nothing that depends only on the schedule."""
        self._refresh_crumbs()
        self._refresh_graph(reset_view=reset_view)
        self._refresh_inspector()
        n_sim = len(self.similar(self.selected)) if self.selected else 1
        self._similar_info.value = f"<small>{n_sim} similar modules</small>" if n_sim > 1 else ""
        self._refresh_tree()
        if self._tree.value != self.selected and any(p == self.selected for _, p in self._tree.options):
            set_silently(self._tree, self._on_tree, value=self.selected)
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
        if panel is not None:
            return panel
        left, center, right = self._body.children[:3]
        presets = (self._preset, self._preset_k, self._btn_preset)
        inspector = W.VBox(
            [
                c
                for c in right.children
                if all(c is not p for p in presets) and not (isinstance(c, W.HTML) and "Presets" in c.value)
            ]
        )
        graph_column = W.VBox([c for c in center.children if c is not self._legend])  # the legend is a pane
        body = W.HBox([left, graph_column, inspector], layout=W.Layout(width="100%"))
        body.add_class("slapo-panel-body")
        hint = W.HTML(
            "<span title='keyboard shortcuts (click the graph or the tree first)'><kbd>?</kbd> keys</span>"
        )
        hint.add_class("slapo-keys-hint")
        # Export in the toolbar opens the Export pane (its form and its own Export button): one Export button,
        # shown once, and the options it writes are in sight when it is pressed
        to_export = W.Button(
            description="Export…",
            icon="download",
            tooltip="open the Export pane: the script's options (model, data, parallelism, steps) and its Export",
        )
        to_export.add_class("slapo-to-export")
        toolbar = W.HBox(
            [
                self._btn_undo,
                self._btn_redo,
                self._preset,
                self._preset_k,
                self._btn_preset,
                to_export,
                self._btn_verify,
                self._btn_cancel,
                self._progress,
                self._phase,
                hint,
            ],
            layout=W.Layout(width="100%"),
        )
        toolbar.add_class("slapo-toolbar")
        status = W.VBox([self._message_row, self._numeric_box, self._file_bar])
        status.add_class("slapo-panel-status")
        panes = W.Accordion(
            children=[
                W.VBox([self._check, self._coverage, self._btn_fix, self._code]),
                self._costs_box,
                self._export_box,
                W.VBox([self._log]),
                self._legend,
            ],
            titles=(
                "Schedule (recorded calls)",
                "Memory per rank",
                "Export a training run",
                "Verify log",
                "Legend",
            ),
            selected_index=None,
        )
        panes.add_class("slapo-panes")
        to_export.on_click(lambda _: setattr(panes, "selected_index", 2))
        panel = W.VBox([self._header, toolbar, status, body, panes], layout=W.Layout(width="100%"))
        panel.add_class("slapo-editor")
        panel.add_class("slapo-panel")
        self._panel = panel
        return panel

    def _on_panel_answer(self, opened: bool, reason: str) -> None:
        if opened:
            self._info(reason or "Opened the editor in a panel beside the notebook (the cell's view stays).")
        else:
            self._error(reason or "JupyterLab could not open the editor panel.")

    def _sync_action_reasons(self) -> None:
        """Send the selected module's per-action reasons (the buttons' tooltips) to the browser's context
        menus and keys: action -> "" when it applies, else the one sentence why not."""
        sel = self.selected
        node = self.schedule[sel]
        name = sel or "The root module"
        n_similar = len(self.similar(sel)) if sel else 1
        reasons = {
            "checkpoint": self._btn_ckpt.tooltip,
            "cut": self._btn_cut.tooltip,
            "shard": self._btn_shard.tooltip,
            "sync": self._btn_sync.tooltip,
            "open": "" if node.child else f"{name} has no submodules to open.",
            "up": "" if self.level else "The graph already shows the top level of the model.",
            "similar": ""
            if n_similar > 1
            else f"{name} has no modules of the same type at the same place in other repeated blocks.",
        }
        mode, op = self._sync.value
        op_name = op if isinstance(op, str) else getattr(op, "__name__", "fn")
        labels = {
            "shard": f"Shard {self._param.value} on axis {self._axis.value}"
            if self._param.value is not None
            else "Shard…",
            "sync": f"Sync {op_name} ({mode})",
            "similar": f"Select similar ({n_similar} modules)" if n_similar > 1 else "Select similar",
        }
        self._graph.set_action_reasons(sel, reasons, labels)

    @serialized
    def _on_browser_action(self, action: str, token: str | None, path: str | None) -> None:
        """Run one browser action (keyboard shortcut, context menu, command palette) with the same public
        methods as the editor's buttons; anything that does not apply is one sentence in the message line."""
        try:
            if action == "undo":
                self.undo()
            elif action == "redo":
                self.redo()
            elif action == "panel":
                self.open_panel()
            elif action == "up":
                self._go_up()
            elif action == "open":
                if path is not None:
                    self._on_node_dblclick(path)
                elif not self.schedule[self.selected].child:
                    self._error(f"{self.selected or 'The root module'} has no submodules to open.")
                else:
                    self.open_level(self.selected)
            else:
                if path is not None:
                    target = self._resolve_node(path)
                    if target is None:
                        self._error(f"{path} is not a module: there is nothing to {action} there.")
                        return
                    if target != self.selected:
                        self.select(target)
                if action == "select":
                    return
                if action == "similar":
                    self._select_similar()
                elif action == "checkpoint":
                    self.apply("checkpoint")
                elif action == "cut":
                    self.apply("cut_pipeline_stage")
                elif action == "shard":
                    self._on_shard()
                elif action == "sync":
                    self.apply("sync", mode=self._sync.value[0], sync_op_or_fn=self._sync.value[1])
        except Exception as err:  # noqa: BLE001 - a key press must never break the kernel
            _log.exception("browser action failed")
            self._error(
                f"The {action} action failed ({type(err).__name__}: {err}); the schedule is unchanged."
            )

    def _go_up(self) -> None:
        """Show the parent level of the graph and select the module whose level it was (Backspace)."""
        if not self.level:
            self._error("The graph already shows the top level of the model.")
            return
        came_from = self.level
        self.open_level(came_from.rsplit(".", 1)[0] if "." in came_from else "")
        self.select(came_from)

    def _select_similar(self) -> None:
        """Highlight the modules similar to the selected one and tick "apply to all similar" for the next action."""
        found = self.similar(self.selected) if self.selected else [self.selected]
        if len(found) < 2:
            self._error(
                f"{self.selected or 'The root module'} has no modules of the same type at the same place in "
                "other repeated blocks."
            )
            return
        self._graph.highlight(found, centre=False)
        self._similar.value = True
        self._info(
            f"Selected {len(found)} similar modules ({found[0]} … {found[-1]}); the next action applies to all of them."
        )
