"""The Plan pane: the layout for the cluster shape, ranked, explained and applied by one click (issue 26).

Beside the cluster control (nodes x GPUs per node, which it plans for), the pane asks for a GPU profile
(:data:`slapo_lab.planner.DEVICES`), the sequence length, the global batch and the training dtype. "Plan" runs
:func:`slapo_lab.planner.auto_plan` through the state's :class:`~slapo_lab.editor.planning.PlanController` (in a
background thread inside a kernel, so no click waits for it) and draws the ranked table (layout, peak memory GiB of
the busiest rank, seconds per step, tokens/s per GPU, MFU) and the rejected layouts grouped by reason. "Apply"
records the chosen row through the state's undoable action path and hands its Export options to ``on_apply`` (the
editor fills its Export form). The pane holds the state; it inherits nothing from it.
"""

from __future__ import annotations

import html
import logging
import threading
from collections.abc import Callable

import ipywidgets as W

from ..planner import DEVICES
from ..utils.collector import running_loop
from .form_button import FormButton

__all__ = ["PlanPanel"]

_log = logging.getLogger("slapo_lab.editor")


class PlanPanel:
    """The Plan pane's widgets over ``state.planner``.

    Args:
        state: the :class:`~slapo_lab.editor.state.EditorState` (its ``planner``, ``cluster`` and action path).
        on_apply: called with :meth:`~slapo_lab.editor.planning.PlanController.export_kwargs` after a row was
            applied (the editor's Export form takes them).

    Attributes:
        box: the pane (an ``ipywidgets.VBox``), hidden inputs included.
    """

    def __init__(self, state, on_apply: Callable[[dict], None] | None = None) -> None:
        self.state = state
        self.on_apply = on_apply
        self._thread: threading.Thread | None = None
        req = state.planner.defaults()
        style = {"description_width": "initial"}
        self.gpu = W.Dropdown(
            options=list(DEVICES), value=req.gpu, description="GPU profile", style=style,
            layout=W.Layout(width="210px"),
        )  # fmt: skip
        self.seq_len = W.BoundedIntText(
            value=req.seq_len, min=1, max=10_000_000, description="seq length", style=style,
            layout=W.Layout(width="150px"),
        )  # fmt: skip
        self.batch = W.BoundedIntText(
            value=req.global_batch_size, min=1, max=10_000_000, description="batch per step", style=style,
            layout=W.Layout(width="170px"),
        )  # fmt: skip
        self.dtype = W.Dropdown(
            options=["bf16", "fp16", "fp32"], value=req.dtype, description="dtype", style=style,
            layout=W.Layout(width="120px"),
        )  # fmt: skip
        self.btn_plan = FormButton(
            [self.gpu, self.seq_len, self.batch, self.dtype],
            description="Plan",
            icon="calculator",
            tooltip="rank every TP x PP x DP / FSDP / ZeRO, checkpointing and micro-batch layout of this model "
            "on the cluster shape (slapo_lab.planner.auto_plan)",
        )
        self.btn_plan.on_click(lambda _: self.plan())
        self.status = W.HTML()
        self.status.add_class("slapo-plan-status")
        self.table = W.HTML()
        self.table.add_class("slapo-plan-table")
        self.row = W.Dropdown(options=[], description="row", style=style, layout=W.Layout(width="420px"))
        self.btn_apply = FormButton(
            [self.row],
            description="Apply",
            icon="check-square",
            disabled=True,
            tooltip="record this layout as primitive calls (one Undo removes them) and fill the Export form",
        )
        self.btn_apply.on_click(lambda _: self.apply())
        self.why_not = W.HTML()
        self.why_not.add_class("slapo-plan-why-not")
        self.box = W.VBox(
            [
                W.HTML("<b>Plan</b> (the layout for the cluster shape above: predicted memory and step time)"),
                W.HBox([self.gpu, self.seq_len, self.batch, self.dtype, self.btn_plan],
                       layout=W.Layout(flex_flow="row wrap")),
                self.status,
                self.table,
                W.HBox([self.row, self.btn_apply]),
                self.why_not,
            ]
        )  # fmt: skip
        self.box.add_class("slapo-plan")
        state.planner.listeners.append(self.refresh)

    # ------------------------------------------------------------------ actions
    def plan(self, wait: bool = False) -> None:
        """Plan for the state's cluster shape and the pane's inputs: in a background thread inside a kernel
        (``wait``: join it), here otherwise. The status line says what is under way or why it failed."""
        if self._thread is not None and self._thread.is_alive():
            self.status.value = "<i>Still planning the previous request…</i>"
            return
        shape = self.state.cluster
        request = {
            "nodes": shape.nodes,
            "gpus_per_node": shape.gpus_per_node,
            "gpu": self.gpu.value,
            "seq_len": int(self.seq_len.value),
            "global_batch_size": int(self.batch.value),
            "dtype": self.dtype.value,
        }
        self.btn_plan.disabled = True
        self.status.value = f"<i>Planning {html.escape(str(shape))} of {html.escape(self.gpu.value)}…</i>"
        if running_loop() is None:
            self._run(request)
            return
        self._thread = threading.Thread(target=self._run, args=(request,), daemon=True, name="slapo-plan")
        self._thread.start()
        if wait:
            self._thread.join()

    def wait(self, timeout: float = 120.0) -> bool:
        """Wait for a background plan; returns whether it is done within ``timeout`` seconds."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def _run(self, request: dict) -> None:
        try:
            self.state.planner.run(**request)  # its listeners redraw the table
        except Exception as err:  # noqa: BLE001 - the pane says it in one sentence, never raises into a click
            if not isinstance(err, ValueError):
                _log.warning("planning failed", exc_info=True)
            self.status.value = (
                f"<span class='slapo-err'>&#9888; {html.escape(str(err) or type(err).__name__)}</span>"
            )
        finally:
            self.btn_plan.disabled = False

    def apply(self) -> str | None:
        """Apply the chosen row (the state's message line says what happened); returns None or the sentence."""
        index = self.row.value
        if not isinstance(index, int):
            return self.state._error("Plan first, then choose a row of the ranked table to apply.")
        why = self.state.planner.apply(index)
        if why is None and self.on_apply is not None:
            self.on_apply(self.state.planner.export_kwargs())
        return why

    # ------------------------------------------------------------------ drawing
    def refresh(self) -> None:
        """Draw the controller's result: the status line, the ranked table, the row choice, the why-not list."""
        ctl = self.state.planner
        res = ctl.result
        if res is None:
            return
        req = ctl.request
        rows = ctl.rows()
        self.status.value = (
            f"<small>{res.priced:,} layouts considered, {res.costed:,} costed, {res.fitting:,} fit "
            f"({res.seconds:.2f} s) on {req.nodes} × {req.gpus_per_node} {html.escape(str(req.gpu))}, seq "
            f"{req.seq_len}, global batch {req.global_batch_size}, {req.dtype}.</small>"
            + (
                f" <b>Applied #{rows_index(ctl) + 1}.</b>"
                if ctl.chosen is not None and rows_index(ctl) is not None
                else ""
            )
        )
        self.table.value = table_html(rows)
        options = [(f"#{r['rank'] + 1}: {r['layout']}", r["rank"]) for r in rows]
        if list(self.row.options) != options:
            self.row.options = options
            self.row.value = options[0][1] if options else None
        self.btn_apply.disabled = not options
        self.why_not.value = why_not_html(ctl.why_not())


def rows_index(ctl) -> int | None:
    """The chosen candidate's row in the controller's table, or None."""
    if ctl.result is None or ctl.chosen is None:
        return None
    for i, e in enumerate(ctl.result.candidates):
        if e is ctl.chosen:
            return i
    return None


def table_html(rows: list[dict]) -> str:
    """The ranked table of :meth:`~slapo_lab.editor.planning.PlanController.rows` as HTML (numbers right-aligned);
    one sentence when no layout fits."""
    if not rows:
        return "<div class='slapo-plan-empty'>No layout fits: the list below says why each was refused.</div>"
    head = "".join(
        f"<th style='text-align:{a}'>{h}</th>"
        for h, a in (
            ("#", "right"),
            ("layout", "left"),
            ("peak GiB", "right"),
            ("step s", "right"),
            ("tokens/s/GPU", "right"),
            ("MFU", "right"),
        )
    )
    body = "".join(
        "<tr>"
        f"<td style='text-align:right'>{r['rank'] + 1}</td><td>{html.escape(r['layout'])}</td>"
        f"<td style='text-align:right'>{r['peak_gib']:.2f}</td>"
        f"<td style='text-align:right'>{r['step_s']:.3g}</td>"
        f"<td style='text-align:right'>{r['tokens_per_s_per_gpu']:,.0f}</td>"
        f"<td style='text-align:right'>{r['mfu']:.1%}</td>"
        "</tr>"
        for r in rows
    )
    pad = "<style>.slapo-plan-rows th, .slapo-plan-rows td {padding: 1px 8px}</style>"
    return f"{pad}<table class='slapo-plan-rows'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def why_not_html(groups: list[tuple[int, str]], shown: int = 6) -> str:
    """The rejected layouts grouped by reason (the ``shown`` most frequent, then how many kinds more)."""
    if not groups:
        return ""
    items = "".join(f"<li>{n:,} × {html.escape(s)}</li>" for n, s in groups[:shown])
    more = f"<li>… and {len(groups) - shown} more kinds</li>" if len(groups) > shown else ""
    return f"<details open><summary>Why not the others</summary><ul>{items}{more}</ul></details>"
