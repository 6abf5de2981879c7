"""The editor of slapo-lab: :class:`EditorState` (the state and its actions, no widgets) and
:class:`ScheduleEditor` (its JupyterLab widgets). The widgets are imported only when asked for, so that
``from slapo_lab.editor import EditorState`` needs no ipywidgets."""

from .state import EditorState

__all__ = ["EditorState", "GraphWidget", "ScheduleEditor"]


def __getattr__(name: str):
    if name == "ScheduleEditor":
        from .app import ScheduleEditor  # noqa: PLC0415 - ipywidgets loads only when the editor is asked for

        return ScheduleEditor
    if name == "GraphWidget":
        from .graph_widget import GraphWidget  # noqa: PLC0415 - ipywidgets loads only when asked for

        return GraphWidget
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
