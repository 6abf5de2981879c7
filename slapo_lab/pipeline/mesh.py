"""One device mesh for tensor x pipeline x data parallelism.

Ranks are laid out as :meth:`slapo_lab.parallel_dims.ParallelDims.build_mesh` does
(``init_device_mesh(device, (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))``): global rank
``= (d * pp + p) * tp + t``; tensor-parallel groups are the innermost (neighbouring ranks), as in Megatron-LM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..errors import ScheduleError
from ..parallel_dims import ParallelDims, ParallelDimsError


@dataclass
class PipelineMesh:
    """The groups of one rank in a ``(dp, pp, tp)`` mesh.

    Attributes:
        mesh: the ``DeviceMesh`` (dims ``("dp", "pp", "tp")``).
        tp_group / pp_group / dp_group: this rank's process groups along each dim.
        tp / pp / dp: the sizes; tp_rank / pp_rank / dp_rank: this rank's coordinates.
    """

    mesh: Any
    tp_group: Any
    pp_group: Any
    dp_group: Any
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int


def make_mesh(tp: int = 1, pp: int = 1, dp: int = 1, device: str = "cpu") -> PipelineMesh:
    """Create the ``(dp, pp, tp)`` device mesh over the initialised default process group.

    Create the schedule with ``group=mesh.tp_group`` (so ``sch.world_size == tp``) and pass
    ``pp_group=mesh.pp_group, dp_group=mesh.dp_group`` to :func:`build_pipeline`.

    Raises:
        ScheduleError: if ``torch.distributed`` is not initialised, a size is not a positive
            integer, or the world size is not ``tp * pp * dp``.
    """
    try:
        dims = ParallelDims(tp, pp, dp)
    except ParallelDimsError as err:
        raise ScheduleError(f"make_mesh: {err}") from None
    if not (dist.is_available() and dist.is_initialized()):
        raise ScheduleError(
            "make_mesh needs an initialised torch.distributed process group "
            "(torch.distributed.init_process_group, e.g. under torchrun)."
        )
    ws = dist.get_world_size()
    if ws != dims.world_size:
        raise ScheduleError(
            f"The world size is {ws}, but tp={tp} x pp={pp} x dp={dp} = {dims.world_size}; "
            "the mesh must cover every rank exactly once."
        )
    mesh = dims.build_mesh(device)
    dp_rank, pp_rank, tp_rank = dims.coords(dist.get_rank())
    return PipelineMesh(
        mesh,
        mesh.get_group("tp"),
        mesh.get_group("pp"),
        mesh.get_group("dp"),
        tp,
        pp,
        dp,
        tp_rank,
        pp_rank,
        dp_rank,
    )
