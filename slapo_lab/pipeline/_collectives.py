"""Tensor-parallel collectives while a pipeline is exported: nothing to swap any more.

``torch.export`` needs collectives that trace on fake tensors and keep their Megatron backward. The
schedule's sync ops (:mod:`slapo_lab.sharding.sync_ops`) are now ``torch.library`` custom ops with fake
implementations and autograd formulas on every live group, in eager runs, under ``torch.compile`` and under
``torch.export`` alike; that module is their one home. Until then this module held a second copy of them and
swapped it in for the export; :func:`exportable_sync_ops` stays as the (now empty) block that callers open
around an export.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist


@contextlib.contextmanager
def exportable_sync_ops():
    """Within the block, the schedule's sync ops are exportable: they always are now (see the module
    docstring), so the block changes nothing; it is kept for its callers."""
    yield


def is_distributed() -> bool:
    """True when ``torch.distributed`` is available and initialised."""
    return dist.is_available() and dist.is_initialized()
