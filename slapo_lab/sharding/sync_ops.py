"""Tensor-parallel communication as autograd functions (Megatron-LM style).

Forward/backward pairs follow Megatron-LM's ``megatron/core/tensor_parallel/mappings.py``:

=====================  ======================  ==========================================
op                     forward                 backward
=====================  ======================  ==========================================
all_reduce_forward     all-reduce (sum)        identity                       ("g")
all_reduce_backward    identity                all-reduce (sum)               ("f")
all_gather(axis)       gather along ``axis``   split, or reduce-scatter if
                                               ``tensor_parallel_output_grad``
reduce_scatter(axis)   reduce-scatter          all-gather
scatter(axis)          keep this rank's chunk  all-gather
=====================  ======================  ==========================================

These give exact gradients with a loss that is replicated on every tensor-parallel rank, unlike
``torch.distributed.nn.functional.all_reduce``, whose backward all-reduces again (2x weight grads).

With no process group (simulated planning) every op keeps only its *shape* effect: all-reduce is the
identity, all-gather repeats the local chunk ``world_size`` times, scatter and reduce-scatter keep a
chunk. That keeps meta-device shape propagation exact for per-rank views.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """A tensor-parallel group: ``group`` is None when simulated (no communication)."""

    world_size: int
    rank: int
    group: object | None = None

    @property
    def simulated(self) -> bool:
        return self.group is None


def _check_divisible(x: torch.Tensor, axis: int, ws: int, what: str) -> None:
    if x.shape[axis] % ws:
        raise RuntimeError(
            f"{what}: dimension {axis} of a tensor of shape {tuple(x.shape)} is not divisible by the "
            f"tensor-parallel size {ws}")


def _all_reduce(x: torch.Tensor, g: TPGroup) -> torch.Tensor:
    if g.simulated or g.world_size == 1:
        return x
    x = x.contiguous().clone()
    dist.all_reduce(x, group=g.group)
    return x


def _all_gather(x: torch.Tensor, axis: int, g: TPGroup) -> torch.Tensor:
    if g.world_size == 1:
        return x
    if g.simulated:
        return torch.cat([x] * g.world_size, dim=axis)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(g.world_size)]
    dist.all_gather(parts, x, group=g.group)
    return torch.cat(parts, dim=axis)


def _split(x: torch.Tensor, axis: int, g: TPGroup) -> torch.Tensor:
    if g.world_size == 1:
        return x
    _check_divisible(x, axis, g.world_size, "scatter")
    return x.chunk(g.world_size, dim=axis)[g.rank].contiguous()


def _reduce_scatter(x: torch.Tensor, axis: int, g: TPGroup) -> torch.Tensor:
    if g.world_size == 1:
        return x
    _check_divisible(x, axis, g.world_size, "reduce_scatter")
    if g.simulated:
        return _split(x, axis, g)
    if dist.get_backend(g.group) == "nccl":
        moved = x.movedim(axis, 0).contiguous()
        out = torch.empty((moved.shape[0] // g.world_size, *moved.shape[1:]), dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out, moved, group=g.group)
        return out.movedim(0, axis).contiguous()
    # gloo has no reduce-scatter: all-reduce, then keep this rank's chunk (same result, more traffic).
    return _split(_all_reduce(x, g), axis, g)


class _AllReduceForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        return _all_reduce(x, g)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AllReduceBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.g), None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, g, tp_output_grad):
        ctx.axis, ctx.g, ctx.tp_output_grad = axis, g, tp_output_grad
        return _all_gather(x, axis, g)

    @staticmethod
    def backward(ctx, grad):
        if ctx.tp_output_grad:
            return _reduce_scatter(grad, ctx.axis, ctx.g), None, None, None
        return _split(grad, ctx.axis, ctx.g), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, g):
        ctx.axis, ctx.g = axis, g
        return _reduce_scatter(x, axis, g)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.axis, ctx.g), None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, g):
        ctx.axis, ctx.g = axis, g
        return _split(x, axis, g)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.axis, ctx.g), None, None


def all_reduce_forward(x: torch.Tensor, g: TPGroup) -> torch.Tensor:
    """Sum ``x`` over the group in forward; pass the gradient through (Megatron's ``g``)."""
    return _AllReduceForward.apply(x, g)


def all_reduce_backward(x: torch.Tensor, g: TPGroup) -> torch.Tensor:
    """Identity in forward; sum the gradient over the group in backward (Megatron's ``f``)."""
    return _AllReduceBackward.apply(x, g)


def all_gather(x: torch.Tensor, axis: int, g: TPGroup, tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """Concatenate the ranks' ``x`` along ``axis`` (shape ``[..., n*ws, ...]``)."""
    return _AllGather.apply(x, axis, g, tensor_parallel_output_grad)


def reduce_scatter(x: torch.Tensor, axis: int, g: TPGroup) -> torch.Tensor:
    """Sum over the group and keep this rank's chunk along ``axis`` (shape ``[..., n/ws, ...]``)."""
    return _ReduceScatter.apply(x, axis, g)


def scatter(x: torch.Tensor, axis: int, g: TPGroup) -> torch.Tensor:
    """Keep this rank's chunk of a replicated ``x`` along ``axis``."""
    return _Scatter.apply(x, axis, g)
