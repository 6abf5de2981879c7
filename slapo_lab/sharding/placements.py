"""The schedule's shards as the ecosystem sees them: DTensor placements on the ``(dp, tp)`` mesh.

The engine computes with plain local tensors: ``shard`` leaves this rank's slice in the module and
annotates the parameter (``orig_shape``, ``shard_axis``, ``shard_stride``; see
:mod:`slapo_lab.primitives.tensor_parallel`). Tools that read parameters across ranks --
``torch.distributed.checkpoint`` (with its Hugging Face storage reader and writer),
``torch.nn.utils.get_total_norm`` for clipping, FSDP2, a gather for a Hugging Face directory -- need
to know *which part of which global tensor* each local tensor is. :class:`ShardLayout` says it, and
turns a local tensor into the view those tools read:

* a :class:`~torch.distributed.tensor.DTensor` on the 2-D ``(dp, tp)`` device mesh (a view: it shares
  the local tensor's storage, so ``dcp.load`` writes straight into the parameter); the tensor-parallel
  placement is ``Replicate()``, ``Shard(axis)`` or, for a fused projection stored as ``stride`` blocks
  back to back (GPT-2's ``c_attn``: q, k, v), ``_StridedShard(axis, split_factor=stride)`` -- each rank
  holds its chunk of every block; the data-parallel placement is ``Replicate()`` (replicas) or
  ``Shard(dim)`` (FSDP2's shard of the tensor-parallel local tensor, on a dimension other than the
  tensor-parallel axis);
* for ``torch.distributed.checkpoint``, whose DTensor support assumes one contiguous chunk per rank,
  a strided layout is handed over as a ``ShardedTensor`` with one local shard per block (DCP's native
  several-chunks-per-rank form), so checkpoints reshard between any layouts.

Blocks of unequal sizes (Phi-3's ``qkv_proj`` under grouped-query attention: ``[q; k; v]`` of heads x
head_dim, kv x head_dim, kv x head_dim features; ``tp_stride`` a
:class:`~slapo_lab.sharding.rules.BlockStride`) have a ``ShardedTensor`` checkpoint view like any strided
layout, but no DTensor placement describes them (``_StridedShard`` splits equal blocks only), so
:meth:`ShardLayout.placements` / :meth:`ShardLayout.dtensor` refuse them with one sentence.

Key/value heads replicated over tensor-parallel ranks (fewer key/value heads ``kv`` than ranks ``tp``:
``tp_replicas`` r = tp / kv, each rank holds one whole head shared by r consecutive ranks;
:func:`slapo_lab.sharding.rules.kv_replicas`) are ``Shard`` over the kv groups and ``Replicate`` within a
group: the DTensor view lives on the ``(dp, tp)`` mesh with its ``tp`` dimension unflattened to
``(kv, r)`` (:func:`replica_mesh`), placements ``(dp, Shard(axis), Replicate())``. So DCP saves each head once
and loads it into every replica, and ``get_total_norm`` counts each head once.

Sources: PyTorch ``torch/distributed/tensor/placement_types.py`` (``Shard``, ``_StridedShard``: the
``split_factor`` semantics used here), ``torch/distributed/checkpoint/planner_helpers.py`` (chunk lists of
DTensor and ShardedTensor), Megatron-LM's ``partition_stride`` for fused projections.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard as LocalShard
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

from .shard_layout import block_replicas, block_sizes, merge_shards

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ShardLayout", "fsdp_dim_for", "layout_of", "replica_mesh"]

_REPLICA_MESHES: dict[tuple[int, int], tuple[object, object]] = {}  # (id(mesh), r) -> (mesh, unflattened)


def replica_mesh(mesh: DeviceMesh, replicas: int) -> DeviceMesh:
    """The ``(dp, tp)`` ``mesh`` with its last (``tp``) dimension unflattened to ``(tp / r, r)``: dimension 1
    runs over the key/value groups, dimension 2 over the ``r`` ranks sharing one key/value head (consecutive
    tensor-parallel ranks, as :meth:`~slapo_lab.sharding.sync_ops.TPGroup.replica_group`).

    Made once per (mesh, r) with ``DeviceMesh._unflatten`` and cached: the first call is collective over the
    mesh's ranks (it creates the process groups of the new dimensions), so every rank of the mesh must make it
    in the same order (the training loop's views of the same parameters do).

    Raises:
        ValueError: if ``replicas`` does not divide the mesh's last dimension.
    """
    tp = mesh.size(mesh.ndim - 1)
    if replicas < 1 or tp % replicas:
        raise ValueError(
            f"{replicas} key/value head replicas do not divide a tensor-parallel mesh dimension of {tp}"
        )
    key = (id(mesh), replicas)
    hit = _REPLICA_MESHES.get(key)
    if hit is None or hit[0] is not mesh:
        names = tuple(mesh.mesh_dim_names or ("dp", "tp"))
        out = mesh._unflatten(
            mesh.ndim - 1, (tp // replicas, replicas), (f"{names[-1]}_kv", f"{names[-1]}_kv_replica")
        )
        hit = _REPLICA_MESHES[key] = (mesh, out)
    return hit[1]


def _chunk_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``index`` of ``n`` items split by :func:`torch.chunk` into ``parts``."""
    size = math.ceil(n / parts) if n else 0
    start = min(n, index * size)
    return start, min(n, start + size)


@dataclass(frozen=True)
class ShardLayout:
    """Which part of a global tensor this rank's local tensor holds.

    Attributes:
        shape: the global (unsharded) shape.
        tp_axis: the tensor-parallel axis, or None (replicated over ``tp``).
        tp_stride: blocks stored back to back on ``tp_axis`` (1, or 3 for a fused q, k, v); a
            :class:`~slapo_lab.sharding.rules.BlockStride` (an int carrying ``sizes``) for unequal blocks.
        tp / tp_rank: tensor-parallel size and this rank's coordinate.
        fsdp_dim: the dimension FSDP2 shards the tensor-parallel local tensor on (never ``tp_axis``), or
            None (whole on every data-parallel replica).
        dp / dp_rank: data-parallel size and this rank's coordinate.
        tp_replicas: r > 1 when consecutive groups of r tensor-parallel ranks hold the same chunk (a key/value
            head replicated over ranks): ``tp_axis`` is split into ``tp / r`` chunks and rank ``t`` holds chunk
            ``t // r``; only with ``tp_stride`` 1.

    The local tensor is: the tensor-parallel local tensor (for ``tp_stride`` = s, this rank's chunk of
    each of the s blocks, concatenated; :func:`slapo_lab.sharding.rules.local_shard`), then, with
    ``fsdp_dim``, FSDP2's :func:`torch.chunk` piece ``dp_rank`` of it along ``fsdp_dim``.
    """

    shape: tuple[int, ...]
    tp_axis: int | None = None
    tp_stride: int = 1  # or a BlockStride
    tp: int = 1
    tp_rank: int = 0
    fsdp_dim: int | None = None
    dp: int = 1
    dp_rank: int = 0
    tp_replicas: int = 1

    def __post_init__(self) -> None:
        if self.fsdp_dim is not None and self.fsdp_dim == self.tp_axis:
            raise ValueError(f"FSDP cannot shard dimension {self.fsdp_dim}: it is the tensor-parallel axis.")
        if self.tp_replicas != 1 and (
            self.tp_replicas < 1 or self.tp % self.tp_replicas or int(self.tp_stride) != 1
        ):
            raise ValueError(
                f"{self.tp_replicas} replicas do not fit a tensor-parallel size of {self.tp} with stride "
                f"{self.tp_stride!r}."
            )

    @property
    def tp_parts(self) -> int:
        """Into how many chunks ``tp_axis`` is split: ``tp``, or ``tp / tp_replicas`` for replicated heads."""
        return self.tp // self.tp_replicas

    @property
    def tp_index(self) -> int:
        """Which chunk this rank holds: ``tp_rank``, or ``tp_rank // tp_replicas``."""
        return self.tp_rank // self.tp_replicas

    # -------------------------------------------------------------------------------- geometry
    @property
    def tp_sharded(self) -> bool:
        """Whether the tensor is split over the tensor-parallel ranks."""
        return self.tp_axis is not None and self.tp > 1

    def with_fsdp(self, dim: int | None, dp: int, dp_rank: int) -> ShardLayout:
        """This layout with FSDP2's shard on ``dim`` over ``dp`` replicas (None: replicated over dp)."""
        return ShardLayout(
            self.shape,
            self.tp_axis,
            self.tp_stride,
            self.tp,
            self.tp_rank,
            dim,
            dp,
            dp_rank,
            self.tp_replicas,
        )

    @property
    def tp_block_sizes(self) -> tuple[int, ...]:
        """The global sizes of the blocks stored back to back on ``tp_axis`` (one block when not strided)."""
        if self.tp_axis is None:
            return ()
        return tuple(block_sizes(self.shape[self.tp_axis], self.tp_stride))

    @property
    def uneven_blocks(self) -> bool:
        """Whether the strided blocks have unequal sizes or some are replicated (no DTensor placement describes
        the layout)."""
        sizes = self.tp_block_sizes
        return len(set(sizes)) > 1 or max(block_replicas(self.tp_stride, len(sizes), self.tp), default=1) > 1

    def _tp_runs(self) -> list[tuple[int, int]]:
        """Global ``(start, length)`` runs on ``tp_axis`` held by this rank, in local order."""
        runs, start = [], 0
        sizes = self.tp_block_sizes
        for size, r in zip(sizes, block_replicas(self.tp_stride, len(sizes), self.tp_parts), strict=True):
            # a block held by r ranks (a fused multi-query projection's key/value heads) is cut r times less
            piece = size * r // self.tp_parts
            runs.append((start + (self.tp_index // r) * piece, piece))
            start += size
        return runs

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of this rank's local tensor."""
        shape = list(self.shape)
        if self.tp_sharded:
            shape[self.tp_axis] = sum(length for _, length in self._tp_runs())
        if self.fsdp_dim is not None:
            lo, hi = _chunk_range(shape[self.fsdp_dim], self.dp, self.dp_rank)
            shape[self.fsdp_dim] = hi - lo
        return tuple(shape)

    def blocks(self) -> list[tuple[tuple[slice, ...], tuple[int, ...], tuple[int, ...]]]:
        """The contiguous pieces of the global tensor this rank holds.

        Returns:
            ``[(local index, global offsets, sizes)]``: ``local[index]`` is the global block of ``sizes``
            at ``offsets``. One block unless the layout is strided (``tp_stride`` > 1, split over ``tp``).
        """
        nd = len(self.shape)
        offsets = [0] * nd
        sizes = list(self.shape)
        if self.fsdp_dim is not None:
            lo, hi = _chunk_range(self.shape[self.fsdp_dim], self.dp, self.dp_rank)
            offsets[self.fsdp_dim], sizes[self.fsdp_dim] = lo, hi - lo
        if not self.tp_sharded:
            return [(tuple(slice(None) for _ in range(nd)), tuple(offsets), tuple(sizes))]
        out, pos = [], 0
        for start, length in self._tp_runs():
            index = [slice(None)] * nd
            index[self.tp_axis] = slice(pos, pos + length)
            offs, szs = list(offsets), list(sizes)
            offs[self.tp_axis], szs[self.tp_axis] = start, length
            out.append((tuple(index), tuple(offs), tuple(szs)))
            pos += length
        return out

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's local tensor cut out of the global tensor ``full`` (shape :attr:`shape`).

        Raises:
            ValueError: if ``full`` does not have the global shape.
        """
        if tuple(full.shape) != tuple(self.shape):
            raise ValueError(
                f"expected a tensor of the global shape {tuple(self.shape)}, got {tuple(full.shape)}"
            )
        parts = [
            full[tuple(slice(o, o + s) for o, s in zip(offs, szs, strict=False))]
            for _, offs, szs in self.blocks()
        ]
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts, dim=self.tp_axis)

    # -------------------------------------------------------------------------------- views
    def placements(self) -> tuple:
        """The DTensor placements of the local tensor on the ``(dp, tp)`` mesh; with ``tp_replicas`` > 1 three
        placements, on the ``(dp, kv, r)`` mesh of :func:`replica_mesh`: ``(dp, Shard(tp_axis), Replicate())``.

        Raises:
            ValueError: for blocks of unequal sizes (:attr:`uneven_blocks`), which no placement describes.
        """
        # DTensor's module costs ~1.5 s to import; only the views below need it
        from torch.distributed.tensor import Replicate, Shard  # noqa: PLC0415 - heavy (~1.5 s), views only
        from torch.distributed.tensor.placement_types import _StridedShard  # noqa: PLC0415 - as above

        if self.tp_sharded and self.uneven_blocks:
            raise ValueError(
                f"a tensor-parallel layout of unequal blocks {list(self.tp_block_sizes)} on axis {self.tp_axis} "
                "has no DTensor placement (_StridedShard splits equal blocks only); use checkpoint_view, or "
                "merge_shards to gather it"
            )

        dp_place = Shard(self.fsdp_dim) if self.fsdp_dim is not None and self.dp > 1 else Replicate()
        if not self.tp_sharded:
            tp_place = Replicate()
        elif self.tp_stride > 1:
            tp_place = _StridedShard(self.tp_axis, split_factor=int(self.tp_stride))
        else:
            tp_place = Shard(self.tp_axis)
        if self.tp_sharded and self.tp_replicas > 1:
            return dp_place, tp_place, Replicate()
        return dp_place, tp_place

    def dtensor(self, local: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        """``local`` as a DTensor on the 2-D ``(dp, tp)`` ``mesh`` (a view sharing its storage).

        Args:
            local: this rank's local tensor, of shape :attr:`local_shape` (a gradient or an optimizer
                state of the parameter qualifies), any dtype.
            mesh: the ``(dp, tp)`` :class:`~torch.distributed.device_mesh.DeviceMesh` (sizes ``dp`` x ``tp``);
                for replicated key/value heads the view lives on its :func:`replica_mesh`.

        Raises:
            ValueError: if ``local`` does not have the local shape, or for unequal blocks (:meth:`placements`).
        """
        from torch.distributed.tensor import DTensor  # noqa: PLC0415 - heavy (~1.5 s), views only

        self._check_local(local)
        if self.tp_sharded and self.tp_replicas > 1:
            mesh = replica_mesh(mesh, self.tp_replicas)
        full = torch.empty(self.shape, device="meta")
        return DTensor.from_local(
            local, mesh, self.placements(), run_check=False, shape=full.shape, stride=full.stride()
        )

    def norm_view(self, local: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        """``local`` as a DTensor for reductions that do not depend on where each element lies (norms): the
        :meth:`dtensor` view, or, for unequal blocks (Phi-3's grouped q/k/v), a plain ``Shard(tp_axis)`` view.
        Every element of the full tensor is there exactly once (each rank holds its share of every block), in
        another order, which a norm does not see; :meth:`full_tensor` puts them back in order.

        Raises:
            ValueError: if ``local`` does not have the local shape.
        """
        from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: PLC0415 - heavy (~1.5 s)

        if not (self.tp_sharded and self.uneven_blocks):
            return self.dtensor(local, mesh)
        self._check_local(local)
        dp_place = Shard(self.fsdp_dim) if self.fsdp_dim is not None and self.dp > 1 else Replicate()
        full = torch.empty(self.shape, device="meta")
        return DTensor.from_local(
            local,
            mesh,
            (dp_place, Shard(self.tp_axis)),
            run_check=False,
            shape=full.shape,
            stride=full.stride(),
        )

    def full_tensor(self, local: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        """The whole tensor, gathered from every rank (a collective: every rank calls it), in the model's own
        layout; unequal blocks are put back in order with :func:`slapo_lab.sharding.rules.merge_shards`.

        Raises:
            ValueError: if ``local`` does not have the local shape.
        """
        plain = self.norm_view(local, mesh).full_tensor()
        if not (self.tp_sharded and self.uneven_blocks):
            return plain
        parts = list(plain.chunk(self.tp, dim=self.tp_axis))
        return merge_shards(parts, self.tp_axis, self.tp_stride)

    def checkpoint_view(self, local: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        """``local`` as ``torch.distributed.checkpoint`` reads and writes it: :meth:`dtensor`, or for a
        strided layout a ``ShardedTensor`` with one local shard (a view of ``local``) per block.

        Raises:
            ValueError: if ``local`` does not have the local shape.
        """
        blocks = self.blocks()
        if len(blocks) == 1:
            return self.dtensor(local, mesh)
        self._check_local(local)
        # The global description tiles the tensor once: the blocks of every (dp, tp) coordinate of this layout
        # (dp only where FSDP splits; data-parallel replicas hold copies, described at this rank's own dp
        # coordinate), each placed on the rank at that coordinate. No communication.
        ranks = mesh.mesh
        dps = range(self.dp) if self.fsdp_dim is not None else [self.dp_rank]
        metas, mine = [], []
        for d in dps:
            for t in range(self.tp):
                lay = ShardLayout(
                    self.shape, self.tp_axis, self.tp_stride, self.tp, t, self.fsdp_dim, self.dp, d
                )
                where = f"rank:{int(ranks[d, t])}/{local.device}"
                for index, offs, szs in lay.blocks():
                    if 0 in szs:
                        continue
                    md = ShardMetadata(list(offs), list(szs), where)
                    metas.append(md)
                    if (d, t) == (self.dp_rank, self.tp_rank):
                        mine.append(LocalShard(local[index], md))
        props = TensorProperties(
            dtype=local.dtype,
            layout=torch.strided,
            requires_grad=False,
            memory_format=torch.contiguous_format,
            pin_memory=False,
        )
        meta = ShardedTensorMetadata(metas, torch.Size(self.shape), props)
        return ShardedTensor._init_from_local_shards_and_global_metadata(mine, meta, process_group=None)

    def _check_local(self, local: torch.Tensor) -> None:
        if tuple(local.shape) != self.local_shape:
            raise ValueError(
                f"expected a local tensor of shape {self.local_shape} for the global shape "
                f"{tuple(self.shape)}, got {tuple(local.shape)}"
            )


def layout_of(param: torch.Tensor, tp: int = 1, tp_rank: int = 0) -> ShardLayout:
    """The tensor-parallel layout of a scheduled parameter or buffer (no FSDP).

    Reads the annotations ``shard`` leaves: ``orig_shape`` (the global shape), ``shard_axis`` and
    ``shard_stride`` (an int, or a :class:`~slapo_lab.sharding.rules.BlockStride` of unequal blocks, kept
    as is) and ``shard_replicas`` (key/value heads replicated over ranks); an unannotated tensor is
    replicated (its own shape is global).

    Args:
        param: a parameter or buffer of a scheduled model (plain local tensor).
        tp / tp_rank: the tensor-parallel size and this rank's coordinate (``sch.tp``).
    """
    axis = getattr(param, "shard_axis", None)
    shape = tuple(getattr(param, "orig_shape", None) or param.shape)
    if axis is None or tp == 1:
        return ShardLayout(shape)
    stride = getattr(param, "shard_stride", 1) or 1
    stride = stride if getattr(stride, "sizes", None) is not None else int(stride)
    replicas = int(getattr(param, "shard_replicas", 1) or 1)
    return ShardLayout(shape, axis % len(shape), stride, tp, tp_rank, tp_replicas=replicas)


def fsdp_dim_for(layout: ShardLayout, dp: int) -> int | None:
    """The dimension FSDP2 should shard a parameter of ``layout`` on, or None to keep it whole.

    FSDP2 shards the tensor-parallel local tensor; on the tensor-parallel axis itself the result is not
    one DTensor placement (it is for a plain split, as ``_StridedShard``, but not for a strided fused
    projection), so the dimension is the largest other one, preferring one that ``dp`` divides. A 1-D
    tensor split over ``tp`` (a column-parallel bias) has no other dimension: it stays whole on every
    replica (FSDP2's ``ignored_params``), and the runtime averages its gradient over ``dp``.
    """
    dims = [d for d in range(len(layout.shape)) if d != (layout.tp_axis if layout.tp_sharded else None)]
    if not dims:
        return None
    local = layout.local_shape
    even = [d for d in dims if local[d] % dp == 0]
    return max(even or dims, key=lambda d: (local[d], -d))
