"""The editor's full-height JupyterLab panel: the same widgets as the cell's view, laid out for a main-area panel.

:func:`panel_layout` arranges an editor's widgets (no copies: a widget shows in both views) as a toolbar (Undo,
Redo, preset, Export, Verify, progress), the status lines, the module tree | graph | inspector, and the schedule,
memory, export, Verify-log and legend panes in a collapsed Accordion.
:meth:`~slapo_lab.editor.app.ScheduleEditor.panel_view` builds it once; ``editor.open()`` shows it.
"""

from __future__ import annotations

import ipywidgets as W

__all__ = ["panel_layout"]


def panel_layout(ed) -> W.VBox:
    """The panel view of the :class:`~slapo_lab.editor.app.ScheduleEditor` ``ed`` (a new ``ipywidgets.VBox``
    with the classes ``slapo-editor`` and ``slapo-panel``, over ``ed``'s own widgets)."""
    left, center, right = ed._body.children[:3]
    presets = (ed._preset, ed._preset_k, ed._btn_preset)
    inspector = W.VBox(
        [
            c
            for c in right.children
            if all(c is not p for p in presets) and not (isinstance(c, W.HTML) and "Presets" in c.value)
        ]
    )
    graph_column = W.VBox([c for c in center.children if c is not ed._legend])  # the legend is a pane
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
            ed._btn_undo,
            ed._btn_redo,
            ed._preset,
            ed._preset_k,
            ed._btn_preset,
            to_export,
            ed._btn_verify,
            ed._btn_cancel,
            ed._progress,
            ed._phase,
            hint,
        ],
        layout=W.Layout(width="100%"),
    )
    toolbar.add_class("slapo-toolbar")
    status = W.VBox([ed._message_row, ed._numeric_box, ed._file_bar])
    status.add_class("slapo-panel-status")
    panes = W.Accordion(
        children=[
            W.VBox([ed._check, ed._coverage, ed._btn_fix, ed._code]),
            ed._costs_box,
            ed._export_box,
            W.VBox([ed._log]),
            ed._legend,
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
    panel = W.VBox([ed._header, toolbar, status, body, panes], layout=W.Layout(width="100%"))
    panel.add_class("slapo-editor")
    panel.add_class("slapo-panel")
    return panel
