"""The cluster-shape control's arithmetic: nodes x GPUs per node, split as TP x PP x DP.

Pure functions (no widgets), so the editor's control and its tests share them. Tensor parallelism is kept
inside a node (its all-reduces run on every layer, over NVLink; Megatron-LM's and torchtitan's practice), the
pipeline degree is the schedule's stage count (cuts + 1), and data parallelism takes the rest.
"""

from __future__ import annotations

import dataclasses

from ..parallel_dims import ParallelDims


@dataclasses.dataclass(frozen=True)
class ClusterShape:
    """``nodes`` machines of ``gpus_per_node`` GPUs each.

    Raises:
        ValueError: either is not a positive whole number (one sentence).
    """

    nodes: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(
                    f"The number of {name.replace('_', ' ')} must be a positive whole number, not {v!r}."
                )

    @property
    def gpus(self) -> int:
        """All GPUs of the cluster."""
        return self.nodes * self.gpus_per_node

    def __str__(self) -> str:
        return f"{self.nodes} node{'s' if self.nodes != 1 else ''} × {self.gpus_per_node} GPUs"


def tp_choices(shape: ClusterShape, current: int | None = None) -> list[int]:
    """Tensor-parallel degrees that fit in one node (the divisors of ``gpus_per_node``), plus ``current``."""
    n = shape.gpus_per_node
    out = {d for d in range(1, n + 1) if n % d == 0}
    if current:
        out.add(current)
    return sorted(out)


def data_parallel(shape: ClusterShape, tp: int, pp: int) -> tuple[int, str | None]:
    """The data-parallel degree that fills the cluster with replicas of ``tp x pp`` GPUs.

    Returns:
        ``(dp, None)``, or ``(dp, sentence)`` when the replicas do not fill the cluster exactly or TP spans
        nodes (``dp`` is then the largest that fits, at least 1).
    """
    dims, idle = ParallelDims.filling(shape.gpus, tp, pp)
    per_replica, dp = dims.replica, dims.dp
    if idle < 0:
        return 1, (
            f"One replica needs TP {tp} × PP {pp} = {per_replica} GPUs, more than the {shape.gpus} of {shape}."
        )
    if idle:
        return dp, (
            f"TP {tp} × PP {pp} = {per_replica} GPUs per replica does not divide the {shape.gpus} GPUs of {shape}: "
            f"{dp} replica{'s use' if dp != 1 else ' uses'} {dims.world_size} and leave"
            f"{'' if dp != 1 else 's'} {idle} idle."
        )
    if tp > shape.gpus_per_node:
        return dp, (
            f"TP {tp} spans nodes (a node has {shape.gpus_per_node} GPUs): its per-layer all-reduces would cross "
            "the network; a TP degree that divides the GPUs per node keeps them on NVLink."
        )
    return dp, None


def degrees_text(tp: int, pp: int, dp: int, shard: str | None = None) -> str:
    """The three degrees in words: "tensor parallel 4 · pipeline 2 stages · data parallel 4 (FSDP) = 32 GPUs"."""
    shard_name = {"fsdp": "FSDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2"}.get(shard or "")
    return (
        f"tensor parallel {tp} · pipeline {pp} stage{'s' if pp != 1 else ''} · data parallel {dp}"
        + (f" ({shard_name})" if shard_name and dp > 1 else "")
        + f" = {ParallelDims(tp, pp, dp).world_size} GPUs"
    )
