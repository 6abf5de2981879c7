"""Slapo's ``Print`` debugging op (Slapo 0.0.3 ``slapo/op/utils.py``)."""

from __future__ import annotations

import torch


class Print(torch.nn.Module):
    """Print at run time inside a traced graph, returning ``out`` unchanged (any shape).

    ``self.print(out, "x=", x)`` prints ``x=`` and ``x`` when the model runs; the printed values are passed
    as arguments (not pre-formatted), so a traced graph keeps them as inputs. Marked untraceable
    (``traceable = False``): tracing keeps it as one call.
    """

    def __init__(self):
        super().__init__()
        self.traceable = False

    def forward(self, out, *values, sep=" ", end="\n", file=None, flush=True):
        print(*values, sep=sep, end=end, file=file, flush=flush)
        return out
