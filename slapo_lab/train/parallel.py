"""The process layout of a run: the ``(dp, pp, tp)`` device mesh, data parallelism, FSDP2.

Ranks are laid out as :func:`slapo_lab.pipeline.make_mesh` does (``init_device_mesh(device, (dp, pp,
tp))``, tensor-parallel groups innermost, as Megatron-LM). Data parallelism is DDP over ``dp``
(``torch.nn.parallel.DistributedDataParallel``), or with ``--fsdp`` FSDP2's ``fully_shard`` on every
repeated block and the root (torchtitan's 2-D/3-D layouts: FSDP over ``dp`` on top of the schedule's
tensor-parallel shards); pipelines average their replicas' gradients in their runtime.

FSDP2 shards each tensor-parallel local tensor on a dimension other than the tensor-parallel axis
(:func:`~slapo_lab.sharding.placements.fsdp_dim_for`), so every parameter stays one DTensor placement
on the ``(dp, tp)`` mesh; a 1-D tensor split over ``tp`` (a column-parallel bias) has no other
dimension and stays whole on every replica (FSDP2's ``ignored_params``), its gradient averaged over
``dp`` by :meth:`Layout.average_ignored_grads`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard
from torch.nn.parallel import DistributedDataParallel

from ..parallel_dims import ParallelDims
from ..pipeline import make_mesh
from ..sharding.placements import fsdp_dim_for
from .preflight import layout_problem
from .weights import Target


class LayoutError(ValueError):
    """The launched processes do not fit the schedule; ``str(err)`` is one sentence."""


@dataclass
class Layout:
    """This rank's place in ``world = dp x pp x tp`` processes.

    Attributes:
        tp / pp / dp: the sizes; tp_rank / pp_rank / dp_rank: this rank's coordinates.
        stages_per_rank: pipeline stages each pipeline rank runs (Interleaved1F1B).
        mesh: the :class:`~slapo_lab.pipeline.PipelineMesh` (its ``mesh`` is the 3-D DeviceMesh).
        view_mesh: the 2-D ``(dp, tp)`` DeviceMesh of the DTensor views (:mod:`slapo_lab.sharding.placements`).
        fsdp: whether FSDP2 shards over ``dp``.
        ignored: the parameters FSDP2 leaves whole (their gradients are averaged by :meth:`average_ignored_grads`).
    """

    tp: int
    pp: int
    dp: int
    stages_per_rank: int
    mesh: Any
    view_mesh: Any
    fsdp: bool = False
    ignored: list = field(default_factory=list)

    @property
    def tp_rank(self) -> int:
        return self.mesh.tp_rank

    @property
    def pp_rank(self) -> int:
        return self.mesh.pp_rank

    @property
    def dp_rank(self) -> int:
        return self.mesh.dp_rank

    @property
    def dims(self) -> ParallelDims:
        """The degrees (:class:`~slapo_lab.parallel_dims.ParallelDims`): every derived size comes from it."""
        return ParallelDims(self.tp, self.pp, self.dp)

    @property
    def world(self) -> int:
        return self.dims.world_size

    def describe(self) -> str:
        """``tp 2 x pp 1 x dp 2 (FSDP2)``."""
        return f"tp {self.tp} x pp {self.pp} x dp {self.dp}" + (" (FSDP2)" if self.fsdp else "")

    def average_ignored_grads(self) -> None:
        """Average the gradients of the parameters FSDP2 left whole over the data-parallel replicas."""
        if self.dp == 1 or not self.ignored:
            return
        grads = [p.grad for p in self.ignored if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.mesh.dp_group)
        flat /= self.dp
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def make_layout(
    tp: int,
    stages: int,
    world: int,
    *,
    dp: int | None,
    stages_per_rank: int,
    fsdp: bool,
    device: str,
    launch_hint: str = "torchrun --nproc_per_node=",
) -> Layout:
    """The layout of ``world`` processes for a schedule of ``tp``-way tensor parallelism and ``stages`` stages.

    Raises:
        LayoutError: the world size is not a multiple of ``tp x pp``, or not ``tp x pp x dp`` for a
            given ``dp``, or the stages do not divide by ``stages_per_rank`` (one sentence with the
            launch that fits).
    """

    problem = layout_problem(tp, stages, world, dp, stages_per_rank, launch_hint)
    if problem:
        raise LayoutError(problem)
    dims = ParallelDims.for_world(world, tp, stages // stages_per_rank)
    mesh = make_mesh(tp=dims.tp, pp=dims.pp, dp=dims.dp, device=device)
    return Layout(
        dims.tp, dims.pp, dims.dp, stages_per_rank, mesh, mesh.mesh["dp", "tp"], fsdp=fsdp and dims.dp > 1
    )


def apply_fsdp(module: nn.Module, blocks: list[nn.Module], targets: list, layout: Layout) -> list:
    """``fully_shard`` every block, then ``module``, over the ``dp`` mesh (on meta parameters: nothing is
    allocated).

    FSDP2 replaces the parameter objects; the new ones keep the shard annotations (``orig_shape``,
    ``shard_axis``, ``shard_stride``), and the returned targets point at them with their FSDP layout.

    Args:
        module: the scheduled model (or a pipeline stage).
        blocks: its repeated blocks (each its own FSDP unit: one all-gather per block).
        targets: the :class:`~slapo_lab.train.weights.Target` s of ``module``'s parameters (tensor-parallel
            layouts).
        layout: the run's layout (``layout.ignored`` gains the parameters FSDP2 leaves whole).

    Parameters stay float32 in FSDP2 (no ``MixedPrecisionPolicy``): ``--bf16`` is autocast, so Verify can
    compare the same modules in float32 (the cost: all-gathers move float32).

    Returns:
        New targets, in the same order.
    """

    dims = {id(t.param): fsdp_dim_for(t.layout, layout.dp) for t in targets}
    ignored = {t.param for t in targets if dims[id(t.param)] is None}
    annotations = {id(t.param): dict(t.param.__dict__) for t in targets}
    before = {name: id(p) for name, p in module.named_parameters(remove_duplicate=False)}

    def placement(p):
        return Shard(dims.get(id(p)) or 0)

    dp_mesh = layout.mesh.mesh["dp"]
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, shard_placement_fn=placement, ignored_params=ignored)
    fully_shard(module, mesh=dp_mesh, shard_placement_fn=placement, ignored_params=ignored)
    layout.ignored.extend(p for p in ignored if all(p is not q for q in layout.ignored))
    after = dict(module.named_parameters(remove_duplicate=False))
    new_of = {old: after[name] for name, old in before.items()}
    out = []
    for t in targets:
        old = id(t.param)
        p = new_of.get(old, t.param)
        if p is t.param:
            out.append(t)
            continue
        for k, v in annotations[old].items():
            p.__dict__.setdefault(k, v)
        out.append(Target(t.name, p, t.layout.with_fsdp(dims[old], layout.dp, layout.dp_rank)))
    return out


def wrap_ddp(model: nn.Module, layout: Layout, device: str, find_unused: bool) -> nn.Module:
    """``DistributedDataParallel`` over the ``dp`` group (the model itself when ``dp`` is 1)."""
    if layout.dp == 1:
        return model

    ids = [torch.device(device).index] if device.startswith("cuda") else None
    return DistributedDataParallel(
        model, device_ids=ids, process_group=layout.mesh.dp_group, find_unused_parameters=find_unused
    )
