"""Tensor-parallel sync ops as ``torch.library`` custom ops, so they survive ``torch.export``.

The schedule's sync ops (:mod:`slapo_lab.sharding.sync_ops`) are ``torch.autograd.Function`` s that
call ``torch.distributed`` directly. ``torch.export`` traces through such functions and keeps only
their forward (the Megatron backward -- identity for ``g``, all-reduce for ``f`` -- would be lost),
and a collective on a fake tensor does not trace at all. While a pipeline is being exported,
:func:`exportable_sync_ops` swaps the module-level entry points (``all_reduce_forward``,
``all_reduce_backward``, ``all_gather``, ``reduce_scatter``, ``scatter``) for versions that call the
custom ops below. Each op names its process group by ``group_name`` (resolved with
``torch.distributed.distributed_c10d._resolve_process_group`` when it runs), has a fake
implementation for export and an autograd formula matching Megatron-LM's ``mappings.py``; the
exported stage graphs therefore run the real collectives, with the right backward, on the stage's
tensor-parallel group.

Sources: PyTorch's custom-op guide (``torch.library.custom_op``, ``register_fake``,
``register_autograd``); Megatron-LM ``megatron/core/tensor_parallel/mappings.py``.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from ..sharding import sync_ops
from ..sharding.sync_ops import TPGroup

_NS = "slapo_lab_pp"


def _group(name: str, ws: int, rank: int) -> TPGroup:
    return TPGroup(ws, rank, _resolve_process_group(name))


def _gather_shape(x: torch.Tensor, axis: int, ws: int) -> list[int]:
    shape = list(x.shape)
    shape[axis] *= ws
    return shape


def _split_shape(x: torch.Tensor, axis: int, ws: int) -> list[int]:
    shape = list(x.shape)
    shape[axis] //= ws
    return shape


# --- plain collectives (no autograd; used by the backward formulas) --------------------------------
@torch.library.custom_op(f"{_NS}::all_reduce", mutates_args=())
def _c_all_reduce(x: torch.Tensor, group_name: str, ws: int, rank: int) -> torch.Tensor:
    return sync_ops._all_reduce(x, _group(group_name, ws, rank)).clone()


@_c_all_reduce.register_fake
def _(x, group_name, ws, rank):
    return torch.empty_like(x)


@torch.library.custom_op(f"{_NS}::all_gather", mutates_args=())
def _c_all_gather(x: torch.Tensor, axis: int, group_name: str, ws: int, rank: int) -> torch.Tensor:
    return sync_ops._all_gather(x, axis, _group(group_name, ws, rank)).contiguous()


@_c_all_gather.register_fake
def _(x, axis, group_name, ws, rank):
    return x.new_empty(_gather_shape(x, axis, ws))


@torch.library.custom_op(f"{_NS}::reduce_scatter", mutates_args=())
def _c_reduce_scatter(x: torch.Tensor, axis: int, group_name: str, ws: int, rank: int) -> torch.Tensor:
    return sync_ops._reduce_scatter(x, axis, _group(group_name, ws, rank)).contiguous().clone()


@_c_reduce_scatter.register_fake
def _(x, axis, group_name, ws, rank):
    return x.new_empty(_split_shape(x, axis, ws))


@torch.library.custom_op(f"{_NS}::split", mutates_args=())
def _c_split(x: torch.Tensor, axis: int, group_name: str, ws: int, rank: int) -> torch.Tensor:
    return x.chunk(ws, dim=axis)[rank].contiguous().clone()


@_c_split.register_fake
def _(x, axis, group_name, ws, rank):
    return x.new_empty(_split_shape(x, axis, ws))


# --- differentiable ops (Megatron pairs) --------------------------------------------------------------
@torch.library.custom_op(f"{_NS}::all_reduce_fwd", mutates_args=())
def _d_all_reduce_fwd(x: torch.Tensor, group_name: str, ws: int, rank: int) -> torch.Tensor:
    """Forward: all-reduce (sum); backward: identity (Megatron's ``g``)."""
    return _c_all_reduce(x, group_name, ws, rank)


@_d_all_reduce_fwd.register_fake
def _(x, group_name, ws, rank):
    return torch.empty_like(x)


def _setup_ctx(ctx, inputs, output):
    ctx.args = inputs[1:]


def _bwd_identity(ctx, grad):
    return (grad,) + (None,) * len(ctx.args)


_d_all_reduce_fwd.register_autograd(_bwd_identity, setup_context=_setup_ctx)


@torch.library.custom_op(f"{_NS}::all_reduce_bwd", mutates_args=())
def _d_all_reduce_bwd(x: torch.Tensor, group_name: str, ws: int, rank: int) -> torch.Tensor:
    """Forward: identity; backward: all-reduce of the gradient (Megatron's ``f``)."""
    return x.clone()


@_d_all_reduce_bwd.register_fake
def _(x, group_name, ws, rank):
    return torch.empty_like(x)


def _bwd_all_reduce(ctx, grad):
    return (_c_all_reduce(grad.contiguous(), *ctx.args),) + (None,) * len(ctx.args)


_d_all_reduce_bwd.register_autograd(_bwd_all_reduce, setup_context=_setup_ctx)


@torch.library.custom_op(f"{_NS}::gather_fwd", mutates_args=())
def _d_all_gather(x: torch.Tensor, axis: int, tp_output_grad: bool, group_name: str, ws: int,
                  rank: int) -> torch.Tensor:
    """Forward: all-gather on ``axis``; backward: reduce-scatter (or split when not tp_output_grad)."""
    return _c_all_gather(x, axis, group_name, ws, rank)


@_d_all_gather.register_fake
def _(x, axis, tp_output_grad, group_name, ws, rank):
    return x.new_empty(_gather_shape(x, axis, ws))


def _bwd_all_gather(ctx, grad):
    axis, tpo, name, ws, rank = ctx.args
    g = grad.contiguous()
    out = _c_reduce_scatter(g, axis, name, ws, rank) if tpo else _c_split(g, axis, name, ws, rank)
    return out, None, None, None, None, None


_d_all_gather.register_autograd(_bwd_all_gather, setup_context=_setup_ctx)


@torch.library.custom_op(f"{_NS}::reduce_scatter_fwd", mutates_args=())
def _d_reduce_scatter(x: torch.Tensor, axis: int, group_name: str, ws: int, rank: int) -> torch.Tensor:
    """Forward: reduce-scatter on ``axis``; backward: all-gather."""
    return _c_reduce_scatter(x, axis, group_name, ws, rank)


@_d_reduce_scatter.register_fake
def _(x, axis, group_name, ws, rank):
    return x.new_empty(_split_shape(x, axis, ws))


def _bwd_gather(ctx, grad):
    axis, name, ws, rank = ctx.args
    return _c_all_gather(grad.contiguous(), axis, name, ws, rank), None, None, None, None


_d_reduce_scatter.register_autograd(_bwd_gather, setup_context=_setup_ctx)


@torch.library.custom_op(f"{_NS}::scatter_fwd", mutates_args=())
def _d_scatter(x: torch.Tensor, axis: int, group_name: str, ws: int, rank: int) -> torch.Tensor:
    """Forward: keep this rank's chunk on ``axis``; backward: all-gather."""
    return _c_split(x, axis, group_name, ws, rank)


@_d_scatter.register_fake
def _(x, axis, group_name, ws, rank):
    return x.new_empty(_split_shape(x, axis, ws))


_d_scatter.register_autograd(_bwd_gather, setup_context=_setup_ctx)


# --- the swap ---------------------------------------------------------------------------------------
def _live(g: TPGroup) -> bool:
    return g.group is not None and g.world_size > 1


def _gname(g: TPGroup) -> str:
    return g.group.group_name


@contextlib.contextmanager
def exportable_sync_ops():
    """Within the block, the schedule's sync ops call the custom ops above (when a group is live).

    Simulated groups (no process group) and width-1 groups keep the original functions, which are
    no-ops or shape-only then. The originals are restored on exit, also after an exception.
    """
    orig = {n: getattr(sync_ops, n) for n in
            ("all_reduce_forward", "all_reduce_backward", "all_gather", "reduce_scatter", "scatter")}

    def all_reduce_forward(x, g):
        if not _live(g):
            return orig["all_reduce_forward"](x, g)
        return _d_all_reduce_fwd(x, _gname(g), g.world_size, g.rank)

    def all_reduce_backward(x, g):
        if not _live(g):
            return orig["all_reduce_backward"](x, g)
        return _d_all_reduce_bwd(x, _gname(g), g.world_size, g.rank)

    def all_gather(x, axis, g, tensor_parallel_output_grad=True):
        if not _live(g):
            return orig["all_gather"](x, axis, g, tensor_parallel_output_grad)
        return _d_all_gather(x, axis % x.dim(), bool(tensor_parallel_output_grad), _gname(g), g.world_size, g.rank)

    def reduce_scatter(x, axis, g):
        if not _live(g):
            return orig["reduce_scatter"](x, axis, g)
        return _d_reduce_scatter(x, axis % x.dim(), _gname(g), g.world_size, g.rank)

    def scatter(x, axis, g):
        if not _live(g):
            return orig["scatter"](x, axis, g)
        return _d_scatter(x, axis % x.dim(), _gname(g), g.world_size, g.rank)

    new = {"all_reduce_forward": all_reduce_forward, "all_reduce_backward": all_reduce_backward,
           "all_gather": all_gather, "reduce_scatter": reduce_scatter, "scatter": scatter}
    for n, f in new.items():
        setattr(sync_ops, n, f)
    try:
        yield
    finally:
        for n, f in orig.items():
            setattr(sync_ops, n, f)


def is_distributed() -> bool:
    """True when ``torch.distributed`` is available and initialised."""
    return dist.is_available() and dist.is_initialized()
