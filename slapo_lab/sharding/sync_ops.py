"""Tensor-parallel communication with Megatron-LM's forward/backward pairs, as ``torch.library`` custom ops.

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

On a live group (a process group of two or more ranks) every op is a ``torch.library.custom_op`` (namespace
``slapo_lab_pp``, kept from when only pipeline export used them) with a fake implementation (output shape
only) and an autograd formula (``register_autograd``) from the table above; it names its group by
``group_name`` (resolved with ``torch.distributed.distributed_c10d._resolve_process_group`` when it runs). The
same ops therefore serve eager training, ``torch.compile(fullgraph=True)`` (Dynamo records one opaque node per
collective: no graph break, and the backward formula travels with it into AOTAutograd's backward graph) and
``torch.export`` (the pipeline's stage graphs keep the collectives and their Megatron backward; a
``torch.autograd.Function`` would lose its backward there, and a collective on a fake tensor would not trace).
One exception: ``all_reduce_backward`` is the identity in forward, and a custom op may not return its input,
so outside ``torch.export`` it is an autograd function returning an alias, whose backward calls the all-reduce
custom op; a copy there would be saved by the column-parallel layer that follows, one more activation each.

With no process group (simulated planning) every op keeps only its *shape* effect: all-reduce is the
identity, all-gather repeats the local chunk ``world_size`` times, scatter and reduce-scatter keep a
chunk. That keeps meta-device shape propagation exact for per-rank views. With a width-1 group every op is
the identity.

Sources: Megatron-LM ``megatron/core/tensor_parallel/mappings.py``; PyTorch's custom-op guide
(``torch.library.custom_op``, ``register_fake``, ``register_autograd``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

_NS = "slapo_lab_pp"
# (id(tp process group), r) -> (that group, its replica sub-group), see TPGroup.replica_group
_REPLICA_GROUPS: dict[tuple[int, int], tuple[object, object]] = {}


@dataclass(frozen=True)
class TPGroup:
    """A tensor-parallel group: ``group`` is None when simulated (no communication)."""

    world_size: int
    rank: int
    group: object | None = None

    @property
    def simulated(self) -> bool:
        """True without a process group: the ops change shapes only."""
        return self.group is None

    @property
    def live(self) -> bool:
        """True when the ops communicate: a process group of two or more ranks."""
        return self.group is not None and self.world_size > 1

    def replica_group(self, replicas: int) -> TPGroup:
        """The sub-group of the ``replicas`` consecutive ranks that share this rank's replicated shard.

        With ``r = replicas``, rank ``i`` of this group belongs to replica group ``i // r``: its ranks
        ``{h*r, ..., h*r + r - 1}`` (``h = i // r``) hold the same key/value head when there are fewer
        key/value heads than ranks (:func:`slapo_lab.sharding.rules.kv_replicas`), and the weight gradient of
        that head is summed over them. The result's ``rank`` is ``i % r``.

        Simulated (no process group): a simulated group of width ``r``. Live: a process group over those ranks'
        global ranks, made once per (process group, ``r``) with ``torch.distributed.new_group(...,
        use_local_synchronization=True)`` (only the member ranks take part, so each replica group is made by its
        own ranks; this works under gloo, NCCL and torch's threaded test backend) and cached. Source: Megatron-LM
        ``megatron/core/transformer/attention.py`` (key/value heads replicated when ``num_query_groups`` is below
        the tensor-parallel size) and vLLM ``vllm/model_executor/layers/linear.py`` ``QKVParallelLinear``
        (``num_kv_head_replicas``).

        Raises:
            ValueError: if ``replicas`` is not a positive divisor of the group's width.
        """
        r = int(replicas)
        if r < 1 or self.world_size % r:
            raise ValueError(
                f"{replicas} replicas do not divide a tensor-parallel group of {self.world_size}"
            )
        if r == 1 or r == self.world_size:
            return self
        if self.group is None:
            return TPGroup(r, self.rank % r, None)
        key = (id(self.group), r)
        hit = _REPLICA_GROUPS.get(key)
        if hit is None or hit[0] is not self.group:
            ranks = dist.get_process_group_ranks(self.group)
            start = (self.rank // r) * r
            sub = dist.new_group(ranks[start : start + r], use_local_synchronization=True)
            hit = _REPLICA_GROUPS[key] = (self.group, sub)
        return TPGroup(r, self.rank % r, hit[1])

    def __copy__(self) -> TPGroup:
        return self

    def __deepcopy__(self, memo) -> TPGroup:
        return self  # immutable, and a process group cannot be copied: copies of a model share the group


def _check_divisible(x: torch.Tensor, axis: int, ws: int, what: str) -> None:
    if x.shape[axis] % ws:
        raise RuntimeError(
            f"{what}: dimension {axis} of a tensor of shape {tuple(x.shape)} is not divisible by the "
            f"tensor-parallel size {ws}"
        )


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


# --- plain collectives (no autograd): the bodies of the custom ops and of their backward formulas ------------
def _group(name: str, ws: int, rank: int) -> TPGroup:
    return TPGroup(ws, rank, _resolve_process_group(name))


def _gather_shape(x: torch.Tensor, axis: int, ws: int) -> list[int]:
    shape = list(x.shape)
    shape[axis] *= ws
    return shape


def _split_shape(x: torch.Tensor, axis: int, ws: int, what: str) -> list[int]:
    _check_divisible(x, axis, ws, what)
    shape = list(x.shape)
    shape[axis] //= ws
    return shape


@torch.library.custom_op(f"{_NS}::all_reduce", mutates_args=())
def _c_all_reduce(x: torch.Tensor, group_name: str, ws: int, rank: int) -> torch.Tensor:
    return _all_reduce(x, _group(group_name, ws, rank))  # a fresh tensor (ws > 1)


@_c_all_reduce.register_fake
def _(x, group_name, ws, rank):
    return torch.empty_like(x)


@torch.library.custom_op(f"{_NS}::all_gather", mutates_args=())
def _c_all_gather(x: torch.Tensor, axis: int, group_name: str, ws: int, rank: int) -> torch.Tensor:
    return _all_gather(x, axis, _group(group_name, ws, rank))


@_c_all_gather.register_fake
def _(x, axis, group_name, ws, rank):
    return x.new_empty(_gather_shape(x, axis, ws))


@torch.library.custom_op(f"{_NS}::reduce_scatter", mutates_args=())
def _c_reduce_scatter(x: torch.Tensor, axis: int, group_name: str, ws: int, rank: int) -> torch.Tensor:
    return _reduce_scatter(x, axis, _group(group_name, ws, rank)).clone()


@_c_reduce_scatter.register_fake
def _(x, axis, group_name, ws, rank):
    return x.new_empty(_split_shape(x, axis, ws, "reduce_scatter"))


@torch.library.custom_op(f"{_NS}::split", mutates_args=())
def _c_split(x: torch.Tensor, axis: int, group_name: str, ws: int, rank: int) -> torch.Tensor:
    return _split(x, axis, TPGroup(ws, rank)).clone()  # no communication: the group is not needed


@_c_split.register_fake
def _(x, axis, group_name, ws, rank):
    return x.new_empty(_split_shape(x, axis, ws, "scatter"))


# --- differentiable custom ops (Megatron pairs) ------------------------------------------------------------
def _setup_ctx(ctx, inputs, output):
    ctx.args = inputs[1:]


@torch.library.custom_op(f"{_NS}::all_reduce_fwd", mutates_args=())
def _d_all_reduce_fwd(x: torch.Tensor, group_name: str, ws: int, rank: int) -> torch.Tensor:
    """Forward: all-reduce (sum); backward: identity (Megatron's ``g``)."""
    return _c_all_reduce(x, group_name, ws, rank)


@_d_all_reduce_fwd.register_fake
def _(x, group_name, ws, rank):
    return torch.empty_like(x)


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
def _d_all_gather(
    x: torch.Tensor, axis: int, tp_output_grad: bool, group_name: str, ws: int, rank: int
) -> torch.Tensor:
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
    return x.new_empty(_split_shape(x, axis, ws, "reduce_scatter"))


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
    return x.new_empty(_split_shape(x, axis, ws, "scatter"))


_d_scatter.register_autograd(_bwd_gather, setup_context=_setup_ctx)


# --- simulated and width-1 groups: autograd functions around the plain collectives, which do not communicate
# then (all-gather: the chunk repeated; scatter / reduce-scatter: this rank's chunk; the forward all-reduce is
# no function at all: all_reduce_forward returns x); and
# the all-reduce-in-backward of live groups outside export (see _AllReduceBackward) ---------------------------
class _AllReduceBackward(torch.autograd.Function):
    """Megatron's ``f`` on any group outside ``torch.export``: an alias in forward (a custom op must return a
    new tensor, and that copy would be saved by the layer after it: one more activation per column-parallel
    layer), the all-reduce custom op on the gradient in backward on a live group (Dynamo traces both)."""

    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        g = ctx.g
        if g.live:
            return _c_all_reduce(grad.contiguous(), g.group.group_name, g.world_size, g.rank), None
        return grad, None


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


# --- the entry points ------------------------------------------------------------------------------------
def all_reduce_forward(x: torch.Tensor, g: TPGroup) -> torch.Tensor:
    """Sum ``x`` over the group in forward; pass the gradient through (Megatron's ``g``,
    ``reduce_from_tensor_model_parallel_region``).

    Args:
        x: any shape; the result has the same shape.
        g: the tensor-parallel group; simulated or width 1: the identity, ``x`` itself (an autograd Function
            that returned its input would mark it a view its caller may not change in place, as Falcon's
            parallel attention and MLP do).
    """
    if not g.live:
        return x
    return _d_all_reduce_fwd(x, g.group.group_name, g.world_size, g.rank)


def all_reduce_backward(x: torch.Tensor, g: TPGroup) -> torch.Tensor:
    """Identity in forward; sum the gradient over the group in backward (Megatron's ``f``,
    ``copy_to_tensor_model_parallel_region``).

    Args:
        x: any shape; the result has the same shape.
        g: the tensor-parallel group; simulated or width 1: the identity both ways.
    """
    if g.live and torch.compiler.is_exporting():  # the exported graph keeps the op and its backward
        return _d_all_reduce_bwd(x, g.group.group_name, g.world_size, g.rank)
    return _AllReduceBackward.apply(x, g)


def all_gather(
    x: torch.Tensor, axis: int, g: TPGroup, tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    """Concatenate the ranks' ``x`` along ``axis``: shape ``[..., n, ...]`` becomes ``[..., n * ws, ...]``
    (Megatron's ``gather_from_tensor_model_parallel_region`` on the last axis,
    ``gather_from_sequence_parallel_region`` on the sequence axis).

    The backward keeps this rank's chunk of the gradient -- summed over the ranks first (reduce-scatter) when
    ``tensor_parallel_output_grad``, i.e. when each rank's gradient of the gathered tensor is a partial one.
    Simulated: the local chunk repeated ``ws`` times.
    """
    if not g.live:
        return _AllGather.apply(x, axis, g, tensor_parallel_output_grad)
    axis = axis % x.dim()
    return _d_all_gather(x, axis, bool(tensor_parallel_output_grad), g.group.group_name, g.world_size, g.rank)


def reduce_scatter(x: torch.Tensor, axis: int, g: TPGroup) -> torch.Tensor:
    """Sum over the group and keep this rank's chunk along ``axis``: shape ``[..., n, ...]`` becomes
    ``[..., n / ws, ...]`` (Megatron's ``reduce_scatter_to_sequence_parallel_region``); backward: all-gather.

    Gloo has no reduce-scatter: there it is an all-reduce, then this rank's chunk. Simulated: the chunk.

    Raises:
        RuntimeError: if ``x.shape[axis]`` is not divisible by the group's width (also while tracing).
    """
    if not g.live:
        return _ReduceScatter.apply(x, axis, g)
    axis = axis % x.dim()
    return _d_reduce_scatter(x, axis, g.group.group_name, g.world_size, g.rank)


def scatter(x: torch.Tensor, axis: int, g: TPGroup) -> torch.Tensor:
    """Keep this rank's chunk of a replicated ``x`` along ``axis``: shape ``[..., n, ...]`` becomes
    ``[..., n / ws, ...]`` (Megatron's ``scatter_to_sequence_parallel_region``); backward: all-gather.

    Raises:
        RuntimeError: if ``x.shape[axis]`` is not divisible by the group's width (also while tracing).
    """
    if not g.live:
        return _Scatter.apply(x, axis, g)
    axis = axis % x.dim()
    return _d_scatter(x, axis, g.group.group_name, g.world_size, g.rank)
