"""The editor of slapo-lab: :class:`EditorState` (the state and its actions, no widgets) and
:class:`ScheduleEditor` (its JupyterLab widgets). The widgets are imported only when asked for, so that
``from slapo_lab.editor import EditorState`` needs no ipywidgets."""

from ..utils.collector import gc_deferred as _gc_deferred
from ..utils.collector import running_loop as _running_loop

# Importing the editor makes ~10^5 objects and no garbage (modules, classes, networkx, ipywidgets): no
# collection while they are made, and in a kernel the full collection they cause (0.1-0.2 s in a process that
# holds torch and transformers) runs a second after the cell, as the editor's constructor defers its own
with _gc_deferred(_running_loop()):
    from .state import EditorState

__all__ = ["EditorState", "GraphWidget", "ScheduleEditor"]


def __getattr__(name: str):
    if name == "ScheduleEditor":
        with _gc_deferred(_running_loop()):
            from .app import ScheduleEditor  # noqa: PLC0415 - ipywidgets loads only when the editor is asked for

        globals()["ScheduleEditor"] = ScheduleEditor  # asked once: later lookups find it without this hook
        return ScheduleEditor
    if name == "GraphWidget":
        from .graph_widget import GraphWidget  # noqa: PLC0415 - ipywidgets loads only when asked for

        return GraphWidget
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
