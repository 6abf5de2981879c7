"""The editor's schedule-and-check panel: the open items of the schedule check, the coverage line, "close open
items", the recorded calls (folded as the exported script writes them), Undo and Redo.

:class:`SchedulePanel` holds the editor (the :class:`~slapo_lab.editor.state.EditorState` whose schedule it shows)
and inherits nothing from it: the buttons call the state's ``undo`` / ``redo`` / ``close_open_items``.
"""

from __future__ import annotations

import html
import logging

import ipywidgets as W

from ..check import Finding, coverage_findings
from ..export.fold import schedule_lines
from ..record import format_call
from .highlight import highlight_python

__all__ = ["PANEL_FOLD_CALLS", "PANEL_LINES", "SchedulePanel"]

_log = logging.getLogger("slapo_lab.editor")

# The code panel shows at most PANEL_LINES lines (the last ones); above PANEL_FOLD_CALLS recorded calls it
# does not fold repeats into loops (that reads every call on every redraw) and shows the last calls as typed.
PANEL_LINES = 1_000
PANEL_FOLD_CALLS = 5_000


class SchedulePanel:
    """The open items, the coverage line, the code panel, Undo and Redo.

    Args:
        editor: the editor (its state: ``schedule``, ``check``, ``numeric_report``, the undo / redo stacks).

    Attributes:
        open_items, coverage, code: the HTML lines; btn_fix, btn_undo, btn_redo: the buttons.
    """

    def __init__(self, editor) -> None:
        self.editor = editor
        self.code = W.HTML()
        self.code.add_class("slapo-code")
        self.btn_undo = W.Button(description="Undo", icon="undo")
        self.btn_redo = W.Button(description="Redo", icon="repeat")
        self.btn_undo.on_click(lambda _: editor.undo())
        self.btn_redo.on_click(lambda _: editor.redo())
        self.open_items = W.HTML()
        self.open_items.add_class("slapo-check")
        self.coverage = W.HTML()  # "Kept whole on every rank: …" (check_schedule's "replicated" finding)
        self.coverage.add_class("slapo-coverage")
        self.btn_fix = W.Button(
            description="close open items",
            icon="wrench",
            tooltip="apply the calls the schedule check names, as one action (one Undo removes it)",
            layout=W.Layout(display="none"),
        )
        self.btn_fix.on_click(lambda _: editor.close_open_items())

    def refresh_code(self) -> None:
        """The code panel: the recorded calls with repeats over layers folded into ``for`` loops, exactly
        as the exported script writes them (:func:`slapo_lab.export.fold.schedule_lines`); ``editor.code``
        keeps one line per call."""
        self.code.value = highlight_python(self.panel_code())

    def panel_code(self) -> str:
        calls = list(self.editor.schedule.record.calls)
        if not calls:
            return "# no primitives yet: click a module, then an action — or type on editor.schedule"
        if len(calls) > PANEL_FOLD_CALLS:  # a huge record: its last calls as typed, in bounded time
            return "\n".join(
                [f"# {len(calls):,} recorded calls, the last {PANEL_LINES:,} shown (editor.code: all)"]
                + [format_call(c) for c in calls[-PANEL_LINES:]]
            )
        try:
            lines = schedule_lines(calls)
        except Exception as err:  # noqa: BLE001 - an unexportable argument: show the calls one per line
            _log.warning("code panel folding failed: %s", err)
            lines = [format_call(c) for c in calls]
        head = []
        if len(lines) != len(calls):
            head = [f"# {len(calls):,} recorded calls, repeats folded into loops (editor.code: one per line)"]
        if len(lines) > PANEL_LINES:  # each line new to the highlighter costs it about 0.15 ms
            head.append(f"# … {len(lines) - PANEL_LINES:,} lines before these not shown (editor.code: all)")
            lines = lines[-PANEL_LINES:]
        return "\n".join(head + lines)

    def refresh_check(self) -> None:
        """The open items above the code panel (at most four sentences, then a count); hidden when none."""
        try:
            found = self.editor.check()
        except Exception:  # noqa: BLE001 - the view must never break the engine
            _log.warning("schedule check failed", exc_info=True)
            found = []
        self.btn_fix.layout.display = "" if found else "none"
        rep = self.editor.numeric_report
        if not found and rep is not None and rep.status in ("failed", "error"):
            found = [Finding(rep.module, "numeric", rep.message)]
        self.refresh_coverage()
        if not found:
            self.open_items.value = ""
            return
        items = "".join(f"<li>{html.escape(f.message)}</li>" for f in found[:4])
        more = (
            f"<li>… and {len(found) - 4} more (<code>editor.check()</code> lists them all)</li>"
            if len(found) > 4
            else ""
        )
        self.open_items.value = (
            f"<div class='slapo-check-box'><b>{len(found)} open item{'s' if len(found) > 1 else ''}"
            "</b>: the model is not yet the original model split across ranks (Verify would "
            f"fail):<ul>{items}{more}</ul></div>"
        )

    def refresh_coverage(self) -> None:
        """One line under the open items naming the dense layers kept whole while others are sharded (right,
        but neither their memory nor their compute is split); empty when none."""
        try:
            found = coverage_findings(self.editor.schedule)
        except Exception:  # noqa: BLE001 - advice only: the view must never break the engine
            _log.warning("coverage check failed", exc_info=True)
            found = []
        self.coverage.value = (
            f"<div class='slapo-coverage-line' style='color: var(--jp-ui-font-color2, #616161)'><b>Note:</b> "
            f"{html.escape(found[0].message)} Verify passes; their memory and compute are not split.</div>"
            if found
            else ""
        )

    def refresh_history(self) -> None:
        """Undo is enabled only with something to undo, Redo only with something to redo."""
        if not self.editor._busy:
            self.btn_undo.disabled = not self.editor.schedule.record.calls
            self.btn_redo.disabled = not self.editor._redo
