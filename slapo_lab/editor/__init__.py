"""Editor widgets of slapo-lab (JupyterLab)."""

from .graph_widget import GraphWidget

__all__ = ["GraphWidget"]
