"""The parallel degrees of a run, and every size derived from them: :class:`ParallelDims`.

One home for the ``tp x pp x dp`` arithmetic: the world size, the GPUs of one model replica, the data-parallel
degree that a world or a cluster holds, a rank's coordinates, the micro-batch split of a global batch, and the
device mesh. The editor's cluster view, the export's launch lines, the preflight, the training runtime and the
pipeline mesh all ask it instead of multiplying for themselves.

Ranks are laid out as ``(dp, pp, tp)``, tensor parallelism innermost (adjacent ranks, one node's NVLink), then
pipeline stages, then data-parallel replicas outermost: Megatron-LM's order
(``megatron/core/parallel_state.py``, ``initialize_model_parallel``) and the mesh torchtitan builds
(``torchtitan/distributed/parallel_dims.py``, ``ParallelDims.build_mesh``), whose dataclass this one follows
(expert and context parallelism are not degrees of this project yet).

Standard library only at import time (the launch preflight runs before torch is imported); :meth:`build_mesh`
imports ``torch.distributed`` when it is called.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ParallelDims", "ParallelDimsError"]


class ParallelDimsError(ValueError):
    """Degrees that do not describe a layout; ``str(err)`` is one sentence."""


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ParallelDimsError(f"{name} must be a positive integer, not {value!r}.")
    return value


@dataclass(frozen=True)
class ParallelDims:
    """Tensor-, pipeline- and data-parallel degrees.

    Attributes:
        tp: tensor-parallel ranks per model replica (a layer's shards).
        pp: pipeline ranks per replica (each runs ``stages / pp`` stages).
        dp: data-parallel replicas (DDP, FSDP2 or ZeRO over them).

    Raises:
        ParallelDimsError: a degree that is not a positive integer (one sentence naming it).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            _positive(name, getattr(self, name))

    # -- sizes
    @property
    def replica(self) -> int:
        """GPUs (processes) of one model replica: ``tp * pp``."""
        return self.tp * self.pp

    @property
    def world_size(self) -> int:
        """Processes of the whole run: ``tp * pp * dp``."""
        return self.replica * self.dp

    @property
    def stage_ranks(self) -> int:
        """Processes that hold one pipeline stage: ``tp * dp`` (its TP shards in every replica)."""
        return self.tp * self.dp

    @classmethod
    def for_world(cls, world: int, tp: int = 1, pp: int = 1) -> ParallelDims | None:
        """The dims whose replicas of ``tp x pp`` fill ``world`` processes exactly, or None when ``tp * pp``
        does not divide ``world`` (or exceeds it).

        Raises:
            ParallelDimsError: ``world``, ``tp`` or ``pp`` is not a positive integer.
        """
        _positive("the world size", world)
        unit = cls(tp, pp).replica
        if world % unit:
            return None
        return cls(tp, pp, world // unit)

    @classmethod
    def filling(cls, gpus: int, tp: int = 1, pp: int = 1) -> tuple[ParallelDims, int]:
        """The most replicas of ``tp x pp`` that fit in ``gpus`` GPUs (at least one) and the GPUs they leave
        idle (negative when even one replica needs more than ``gpus``).

        Raises:
            ParallelDimsError: ``gpus``, ``tp`` or ``pp`` is not a positive integer.
        """
        _positive("the GPU count", gpus)
        unit = cls(tp, pp).replica
        dims = cls(tp, pp, max(1, gpus // unit))
        return dims, gpus - dims.world_size

    # -- ranks
    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(dp_rank, pp_rank, tp_rank)`` of global ``rank`` in the ``(dp, pp, tp)`` layout.

        Raises:
            ParallelDimsError: ``rank`` is outside ``[0, world_size)``.
        """
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ParallelDimsError(
                f"rank {rank!r} is not one of the {self.world_size} ranks of {self.describe()}."
            )
        return rank // self.replica, (rank // self.tp) % self.pp, rank % self.tp

    # -- batches
    def micro_batches(self, global_batch: int, micro: int | None = None, stages: int = 1) -> tuple[int, int]:
        """``(micro_batch_size, accumulation)`` for a ``global_batch`` of sequences per optimizer step.

        Without ``micro`` a pipeline of ``stages`` stages gets ``global_batch / (dp * stages)`` rows per
        micro-batch (enough micro-batches to fill it), anything else ``global_batch / dp``; the accumulation is
        ``global_batch / (micro * dp)`` micro-batches per step and replica. Both are at least 1, rounded down (the
        data's :class:`~slapo_lab.train.data.BatchPlan` refuses a batch that does not divide).
        """
        micro = micro or max(1, global_batch // (self.dp * max(1, stages)))
        return micro, max(1, global_batch // (micro * self.dp))

    # -- words and mesh
    def describe(self) -> str:
        """``tp 2 x pp 1 x dp 4``."""
        return f"tp {self.tp} x pp {self.pp} x dp {self.dp}"

    def build_mesh(self, device: str):
        """The 3-D ``torch.distributed.device_mesh.DeviceMesh`` of shape ``(dp, pp, tp)``, dims named
        ``("dp", "pp", "tp")`` (``init_device_mesh``; the default process group must be initialised with
        ``world_size`` ranks)."""
        from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415 - torch: launch checks import this

        return init_device_mesh(device, (self.dp, self.pp, self.tp), mesh_dim_names=("dp", "pp", "tp"))
