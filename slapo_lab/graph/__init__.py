"""Module tree and per-level dataflow of a PyTorch model as networkx graphs, rendered by graphviz.

```python
flow = record_dataflow(model, {"input_ids": ids})     # one forward pass (meta model + meta inputs)
G = flow.level_graph("encoder", expanded={"encoder.layer.0-11"})
svg, node_ids = render_svg(G, {"encoder.layer.0": {"fill": "#ffd8a8", "badges": ["TP"]}})
tree = module_tree(model)                              # no forward needed
```
"""

from .dataflow import INPUT_PREFIX, OUTPUT_NODE, Dataflow, DataflowError, record_dataflow, shape_str
from .render import (
    RenderError,
    clear_layout_cache,
    layout_cache_info,
    legend_svg,
    render_svg,
)
from .tree import module_tree

__all__ = [
    "INPUT_PREFIX",
    "OUTPUT_NODE",
    "Dataflow",
    "DataflowError",
    "RenderError",
    "clear_layout_cache",
    "layout_cache_info",
    "legend_svg",
    "module_tree",
    "record_dataflow",
    "render_svg",
    "shape_str",
]
