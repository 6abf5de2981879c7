"""The editor's memory-and-plan panel: the cluster control, the memory view per rank, and the Plan pane.

:class:`MemoryPanel` holds the editor (the :class:`~slapo_lab.editor.state.EditorState` it draws) and inherits
nothing from it. The cluster control (nodes, GPUs per node, the GPU's memory, the TP degree) calls the state's
``set_cluster`` / ``set_tp``; the memory view prices the schedule with :func:`slapo_lab.plan.plan` for the dp, FSDP
or ZeRO the Export form shows (``layout()``, the form's reading); the Plan pane is :class:`PlanPanel`.
"""

from __future__ import annotations

import html
import logging
from collections.abc import Callable

import ipywidgets as W

from ..utils.collector import running_loop
from .cluster import data_parallel, degrees_text, tp_choices
from .costs import GPU_SIZES, cost_chart_svg, cost_summary, memory_failure
from .plan_panel import PlanPanel

__all__ = ["MemoryPanel", "set_silently"]

_log = logging.getLogger("slapo_lab.editor")


def set_silently(widget, handler, **traits) -> None:
    """Set ``traits`` on ``widget`` in the given order (``options`` before ``value``) without calling its value
    observer ``handler``: the editor's own change, not the user's."""
    widget.unobserve(handler, names="value")
    try:
        for name, value in traits.items():
            setattr(widget, name, value)
    finally:
        widget.observe(handler, names="value")


class MemoryPanel:
    """The cluster control, the memory view and the Plan pane.

    Args:
        editor: the editor (its state: ``schedule``, ``cluster``, ``world_size``, ``set_cluster``, ``set_tp``,
            ``example_inputs``, ``price_memory`` and ``memory_plan``, the lock).
        layout: returns ``(dp, shard, note)`` from the Export form (``note``: HTML saying when dp is unreadable).
        set_dp: puts the data-parallel degree the cluster shape gives into the Export form.
        on_apply: the Plan pane's Apply hands the plan's Export options to it.

    Attributes:
        box: the panel (``ipywidgets.VBox``); gpu, nodes, gpn, tp: the cluster control's widgets;
        cluster_info, costs_text, costs: its lines and the chart; plan: the :class:`PlanPanel`.
    """

    def __init__(
        self,
        editor,
        layout: Callable[[], tuple[int, str | None, str]],
        set_dp: Callable[[int], None],
        on_apply: Callable[[dict], None],
    ) -> None:
        self.editor = editor
        self.layout = layout
        self.set_dp = set_dp
        self.gpu = W.Dropdown(
            options=list(GPU_SIZES.items()), value=80e9, description="GPU", layout=W.Layout(width="320px")
        )
        self.gpu.observe(lambda ch: self.refresh_costs(), names="value")
        self.nodes = W.BoundedIntText(
            value=1, min=1, max=100_000, description="nodes", layout=W.Layout(width="140px")
        )
        self.gpn = W.BoundedIntText(
            value=editor.cluster.gpus_per_node,
            min=1,
            max=1024,
            description="GPUs/node",
            layout=W.Layout(width="170px"),
        )
        self.tp = W.Dropdown(
            options=tp_choices(editor.cluster, editor.world_size),
            value=editor.world_size,
            description="TP",
            layout=W.Layout(width="120px"),
        )
        for w in (self.nodes, self.gpn, self.tp):
            w.style = {"description_width": "initial"}
        self.nodes.observe(self.on_cluster, names="value")
        self.gpn.observe(self.on_cluster, names="value")
        self.tp.observe(self.on_tp, names="value")
        self.cluster_info = W.HTML()
        self.plan = PlanPanel(editor, on_apply=on_apply)
        self.costs = W.HTML()
        self.costs_text = W.HTML()
        self.box = W.VBox(
            [
                W.HTML(
                    "<b>Memory per rank</b> (parameters, gradients, Adam states, "
                    "activations of one micro-batch; dp, FSDP and ZeRO as set in the Export "
                    "form)"
                ),
                W.HBox([self.nodes, self.gpn, self.gpu, self.tp]),
                self.cluster_info,
                self.plan.box,
                self.costs_text,
                self.costs,
            ]
        )

    # ------------------------------------------------------------------ the cluster control
    def on_cluster(self, _change=None) -> None:
        self.editor.set_cluster(int(self.nodes.value), int(self.gpn.value))

    def on_tp(self, change) -> None:
        if change["new"] != self.editor.world_size:
            self.editor.set_tp(int(change["new"]))

    def refresh_cluster(self) -> tuple[str, str | None]:
        """The TP choices, the cluster line and (once the user set the shape) the form's dp.

        Returns:
            ``(degrees, problem)``: the three degrees in words (the header shows them) and the sentence saying
            why the shape does not fit, or None.
        """
        ed = self.editor
        shape = ed.cluster
        pp = ed.dims().pp
        dp, problem = data_parallel(shape, ed.world_size, pp)
        for w, v in ((self.nodes, shape.nodes), (self.gpn, shape.gpus_per_node)):
            if w.value != v:
                set_silently(w, self.on_cluster, value=v)
        if ed._cluster_set:
            self.set_dp(dp)
        dp_form, shard, _ = self.layout()
        degrees = degrees_text(ed.world_size, pp, dp_form, shard)
        choices = tp_choices(shape, ed.world_size)
        if list(self.tp.options) != choices or self.tp.value != ed.world_size:
            set_silently(self.tp, self.on_tp, options=choices, value=ed.world_size)
        self.cluster_info.value = (
            f"<small>{html.escape(str(shape))}: {html.escape(degrees)}"
            + (f" — {html.escape(problem)}" if problem else "")
            + "</small>"
        )
        return degrees, problem

    # ------------------------------------------------------------------ the memory view
    def refresh_costs(self) -> None:
        """The memory line and chart of the state's :attr:`~slapo_lab.editor.state.EditorState.memory_plan`, priced
        here for the dp / FSDP / ZeRO chosen in the export form. A failure shows one sentence (what failed, where,
        why), never an exception's text (that goes to the log); the rest of the view is unaffected."""
        ed = self.editor
        _, _, note = self.layout()
        kernel = running_loop() is not None
        pl = ed.price_memory(defer_whole_pass=kernel)
        # a model without a stack of blocks needs a whole meta forward: in a kernel the background runs it
        if ed.memory_pending:
            note += " <i>(activations: being estimated…)</i>"
        elif ed.memory_problem and pl is not None:
            note = f" <i>— {html.escape(ed.memory_problem)}</i>"
        elif ed.example_inputs:
            note += " <small>(activations: what autograd saves, attention as flash-attention SDPA)</small>"
        if pl is None:
            self.costs.value = ""
            self.costs_text.value = html.escape(ed.memory_problem or "Memory plan unavailable.")
            return
        try:
            gpu = float(self.gpu.value)
            self.costs_text.value = html.escape(cost_summary(pl, gpu)) + note
            self.costs.value = cost_chart_svg(pl, gpu)
        except Exception as err:  # noqa: BLE001 - reported, never raised past this point
            _log.warning("memory view failed", exc_info=True)
            self.costs.value = ""
            self.costs_text.value = html.escape(memory_failure(err, "Memory plan unavailable"))
