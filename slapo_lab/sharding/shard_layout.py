"""Where a sharded tensor lives and how its features are laid out along the shard axis.

:class:`ShardSite` names a sharded tensor's owner and parent. A tensor that stores several blocks back to back
(a fused q/k/v or gate/up projection) is sharded block by block: a plain ``int`` ``shard_stride`` for equal
blocks (Megatron-LM's ``partition_stride``, ``megatron/core/tensor_parallel/layers.py``), a
:class:`BlockStride` for unequal ones (Phi-3's ``qkv_proj`` under grouped-query attention) or for blocks of
key/value heads replicated over consecutive ranks (:func:`block_replicas`; Megatron-LM
``megatron/core/transformer/attention.py`` and vLLM ``vllm/model_executor/layers/linear.py``
``QKVParallelLinear`` replicate key/value heads the same way). :func:`local_shard` cuts one rank's shard and
:func:`merge_shards` puts the full tensor back. Split from :mod:`slapo_lab.sharding.rules`, which re-exports
these names.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class ShardSite:
    """Where a sharded tensor lives: the owning module, the tensor's name on it, and the module's parent.

    Tied tensors have one site per owner. ``parent`` / ``child_name`` let a rule look at the
    surrounding attention module (head counts, GPT-2's fused ``c_attn``); ``parent`` is None for the
    root module.
    """

    mod: nn.Module
    name: str
    parent: nn.Module | None = None
    child_name: str = ""
    path: str = ""
    tp: object = None  # the schedule's tensor-parallel group (sums a per-head input's gradient), if known


class BlockStride(int):
    """A ``shard_stride`` of blocks of unequal sizes (Phi-3's ``qkv_proj`` under grouped-query attention:
    ``[q (heads x head_dim); k (kv heads x head_dim); v (kv heads x head_dim)]``).

    Its integer value is the number of blocks, so code that only asks whether a tensor is strided
    (``shard_stride > 1``) or how many blocks it has keeps working; ``sizes`` are the blocks' global sizes
    along the shard axis, in order. Every block must divide by the world size. Pickles and deep-copies as
    itself. Equal blocks are a plain ``int`` stride (Megatron-LM's ``partition_stride``).

    ``groups`` (optional, one per block, default all 0): a block of ``g > 0`` groups holds ``g`` key/value heads;
    with fewer of them than ranks it is split into ``g`` chunks only, each held by ``ws / g`` consecutive ranks
    (:func:`block_replicas`; ``g = 1``: the whole block on every rank) -- the key/value heads of a fused
    multi-query projection (GPT-BigCode's ``c_attn``, Falcon's ``query_key_value``: one key/value head beside
    the query heads), replicated as Megatron-LM / vLLM replicate key/value heads. 0: split over every rank.
    """

    sizes: tuple[int, ...]
    groups: tuple[int, ...]

    def __new__(cls, sizes, groups=None):
        sizes = tuple(int(s) for s in sizes)
        if len(sizes) < 2 or min(sizes) <= 0:
            raise ValueError(f"a BlockStride needs two or more positive block sizes, not {sizes!r}")
        gs = tuple(int(g) for g in groups) if groups is not None else (0,) * len(sizes)
        if len(gs) != len(sizes) or min(gs) < 0:
            raise ValueError(f"a BlockStride needs one group count (0 or more) per block, not {gs!r}")
        obj = super().__new__(cls, len(sizes))
        obj.sizes = sizes
        obj.groups = gs
        return obj

    def __getnewargs__(self):
        return (self.sizes, self.groups)

    def __repr__(self) -> str:
        extra = f", groups=({', '.join(map(str, self.groups))})" if any(self.groups) else ""
        return f"BlockStride({', '.join(map(str, self.sizes))}{extra})"

    __str__ = __repr__


def make_stride(sizes: Iterable[int]) -> int:
    """The ``shard_stride`` of a tensor storing blocks of ``sizes`` back to back: ``len(sizes)`` when they are
    equal (a plain int), else a :class:`BlockStride`."""
    sizes = [int(s) for s in sizes]
    if len(sizes) <= 1:
        return 1
    return len(sizes) if len(set(sizes)) == 1 else BlockStride(sizes)


def block_sizes(n: int, stride: int | Sequence[int]) -> list[int]:
    """The global sizes of the blocks a tensor of ``n`` features along its shard axis stores back to back.

    ``stride``: an int (that many equal blocks), a :class:`BlockStride`, or a sequence of block sizes
    (which must sum to ``n``).

    Raises:
        ValueError: when the sizes do not sum to ``n`` or equal blocks do not divide it.
    """
    sizes = getattr(stride, "sizes", None)
    if sizes is None and not isinstance(stride, int):
        sizes = tuple(int(s) for s in stride)
    if sizes is None:
        stride = int(stride)
        if stride < 1 or n % stride:
            raise ValueError(f"{n} features do not split into {stride} equal blocks")
        return [n // stride] * stride
    if sum(sizes) != n:
        raise ValueError(f"blocks of sizes {list(sizes)} do not add up to the {n} features they should tile")
    return list(sizes)


def stride_key(stride: int) -> tuple[int, tuple[int, ...] | None, tuple[int, ...] | None]:
    """A hashable key that tells strides apart by their blocks (``3`` and ``BlockStride(4, 2, 2)`` differ)."""
    return (int(stride), getattr(stride, "sizes", None), getattr(stride, "groups", None))


def block_replicas(stride: int, blocks: int, world_size: int) -> tuple[int, ...]:
    """On how many consecutive ranks each of a stride's ``blocks`` blocks is shared over ``world_size`` ranks:
    1, but ``world_size / g`` for a block of a :class:`BlockStride` holding ``g`` key/value head groups, fewer
    than the ranks.

    Raises:
        ValueError: for groups that neither divide nor divide by ``world_size``.
    """
    out = []
    for g in getattr(stride, "groups", None) or (0,) * blocks:
        if g == 0 or g % world_size == 0:
            out.append(1)
        elif world_size % g == 0:
            out.append(world_size // g)
        else:
            raise ValueError(f"{g} key/value head groups neither divide nor divide by {world_size} ranks")
    return tuple(out)


def local_shard(
    t: torch.Tensor, axis: int, world_size: int, rank: int, stride: int | Sequence[int] = 1, replicas: int = 1
) -> torch.Tensor:
    """This rank's shard of ``t`` along ``axis`` (a view for a plain or an equal-block stride).

    ``replicas`` r > 1 (a key/value projection with fewer key/value heads than ranks, see
    :func:`kv_replicas`): ``t`` is split into ``world_size / r`` chunks and consecutive ranks
    ``{h*r, ..., h*r + r - 1}`` all hold chunk ``h = rank // r`` (Megatron-LM / vLLM key/value head
    replication); only a plain stride of 1 combines with replicas.

    ``stride`` > 1 means ``t`` stores ``stride`` equal blocks back to back along ``axis`` (GPT-2's fused
    q, k, v): the shard is this rank's chunk of *each* block, concatenated (a strided shard, as
    Megatron's ``partition_stride``). ``stride`` may also be a :class:`BlockStride` or a sequence of block
    sizes (Phi-3's ``[q; k; v]`` with fewer key/value heads): this rank's chunk of each block, concatenated
    (a copy).

    Raises:
        ValueError: when the blocks do not tile the axis (see :func:`block_sizes`), or for replicas that do
            not divide the world size or come with a stride.
    """
    if replicas != 1:
        if replicas < 1 or world_size % replicas or int(stride) != 1:
            raise ValueError(f"{replicas} replicas do not fit {world_size} ranks with stride {stride!r}")
        world_size, rank = world_size // replicas, rank // replicas
    if world_size == 1:
        return t
    if isinstance(stride, int) and not isinstance(stride, BlockStride):
        if stride == 1:
            return t.chunk(world_size, dim=axis)[rank]
        blocks = t.unflatten(axis, (stride, t.shape[axis] // stride))
        return blocks.chunk(world_size, dim=axis + 1)[rank].flatten(axis, axis + 1)
    parts = t.split(block_sizes(t.shape[axis], stride), dim=axis)
    reps = block_replicas(stride, len(parts), world_size)
    return torch.cat(
        [p.chunk(world_size // r, dim=axis)[rank // r] for p, r in zip(parts, reps, strict=True)], dim=axis
    )


def merge_shards(
    parts: list[torch.Tensor], axis: int, stride: int | Sequence[int] = 1, replicas: int = 1
) -> torch.Tensor:
    """Inverse of :func:`local_shard`: the full tensor from every rank's shard, in rank order.

    ``stride``: as for :func:`local_shard` (a :class:`BlockStride` or a sequence holds the *global* block
    sizes; each rank holds ``size / len(parts)`` of each block). ``replicas`` r > 1: consecutive groups of
    r parts are copies of one chunk, and the first of each group is used.
    """
    if replicas != 1:
        parts = list(parts)[::replicas]
    if len(parts) == 1:
        return parts[0]
    axis = axis % parts[0].dim()
    if isinstance(stride, int) and not isinstance(stride, BlockStride):
        if stride == 1:
            return torch.cat(parts, dim=axis)
        blocks = [p.unflatten(axis, (stride, p.shape[axis] // stride)) for p in parts]
        return torch.cat(blocks, dim=axis + 1).flatten(axis, axis + 1)
    ws = len(parts)
    given = getattr(stride, "sizes", None)
    sizes = list(given) if given is not None else block_sizes(sum(p.shape[axis] for p in parts), stride)
    reps = block_replicas(stride, len(sizes), ws)
    local = [s * r // ws for s, r in zip(sizes, reps, strict=True)]
    pieces = [p.split(local, dim=axis) for p in parts]
    return torch.cat([pieces[r][j] for j in range(len(sizes)) for r in range(0, ws, reps[j])], dim=axis)
