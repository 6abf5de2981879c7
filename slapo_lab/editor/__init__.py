"""Editor widgets of slapo-lab (JupyterLab)."""

from .graph_widget import GraphWidget
from .app import ScheduleEditor

__all__ = ["GraphWidget", "ScheduleEditor"]
