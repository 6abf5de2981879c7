"""Per-module shard rules, per-rank attention head counts and tensor-parallel communication ops."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import ScheduleError
from .heads import register_attention_heads  # noqa: F401
from .rules import get_shard_rule, register_shard_rule  # noqa: F401
from .sync_ops import TPGroup, all_gather, all_reduce_backward, all_reduce_forward, reduce_scatter, scatter


# --- Slapo's sync ops (slapo.sharding), on a torch.distributed process group -------------------------------
def _tp_group(group: dist.ProcessGroup | TPGroup | None, what: str) -> TPGroup:
    """A :class:`TPGroup` for a Slapo-style ``group`` (a ProcessGroup, None for the default group, or a
    TPGroup); without an initialised process group: a simulated width-1 group (every op is the identity)."""
    if isinstance(group, TPGroup):
        return group
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ScheduleError(f"{what}() got a process group, but torch.distributed is not initialised.")
        return TPGroup(world_size=1, rank=0, group=None)
    pg = group if group is not None else dist.group.WORLD
    return TPGroup(world_size=dist.get_world_size(pg), rank=dist.get_rank(pg), group=pg)


def all_gather_forward_output(
    inp: torch.Tensor,
    dim: int,
    group: dist.ProcessGroup | TPGroup | None,
    tensor_parallel_output_grad: bool = True,
) -> torch.Tensor:
    """Forward: all-gather ``inp`` along ``dim`` (``[.., n, ..]`` -> ``[.., n * ws, ..]``); backward: split,
    or reduce-scatter when ``tensor_parallel_output_grad``. Source: Slapo 0.0.3 ``slapo/sharding/sync_ops.py``.

    Raises:
        ScheduleError: a process group while torch.distributed is not initialised.
    """
    return all_gather(inp, dim, _tp_group(group, "all_gather_forward_output"), tensor_parallel_output_grad)


def reduce_scatter_forward_output(
    inp: torch.Tensor, dim: int, group: dist.ProcessGroup | TPGroup | None
) -> torch.Tensor:
    """Forward: reduce-scatter along ``dim`` (``[.., n, ..]`` -> ``[.., n / ws, ..]``); backward: all-gather.
    Source: Slapo 0.0.3 ``slapo/sharding/sync_ops.py``.

    Raises:
        ScheduleError: a process group while torch.distributed is not initialised.
    """
    return reduce_scatter(inp, dim, _tp_group(group, "reduce_scatter_forward_output"))


def scatter_forward_output(
    inp: torch.Tensor, dim: int, group: dist.ProcessGroup | TPGroup | None
) -> torch.Tensor:
    """Forward: keep this rank's chunk along ``dim``; backward: all-gather. Source: Slapo 0.0.3
    ``slapo/sharding/sync_ops.py``.

    Raises:
        ScheduleError: a process group while torch.distributed is not initialised.
    """
    return scatter(inp, dim, _tp_group(group, "scatter_forward_output"))


def reduce_forward_output(inp: torch.Tensor, group: dist.ProcessGroup | TPGroup | None) -> torch.Tensor:
    """Forward: all-reduce (sum) ``inp`` (same shape); backward: identity. Source: Slapo 0.0.3
    ``slapo/sharding/sync_ops.py``.

    Raises:
        ScheduleError: a process group while torch.distributed is not initialised.
    """
    return all_reduce_forward(inp, _tp_group(group, "reduce_forward_output"))


def reduce_backward_grad(inp: torch.Tensor, group: dist.ProcessGroup | TPGroup | None) -> torch.Tensor:
    """Forward: identity (same shape); backward: all-reduce the gradient. Source: Slapo 0.0.3
    ``slapo/sharding/sync_ops.py``.

    Raises:
        ScheduleError: a process group while torch.distributed is not initialised.
    """
    return all_reduce_backward(inp, _tp_group(group, "reduce_backward_grad"))
