"""Editor widgets of slapo-lab (JupyterLab)."""

from .app import ScheduleEditor
from .graph_widget import GraphWidget

__all__ = ["GraphWidget", "ScheduleEditor"]
