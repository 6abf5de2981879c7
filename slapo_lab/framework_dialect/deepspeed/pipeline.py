"""Tied-weight ranks for a DeepSpeed pipeline (Slapo 0.0.3 ``slapo/framework_dialect/deepspeed/pipeline.py``)."""

from __future__ import annotations

from ...errors import ScheduleError


def analyze_tie_ranks(tie_weight_groups, topology):
    """The rank groups that must sum each tied weight's gradient, and the stages that hold it.

    Args:
        tie_weight_groups: one group per tied weight, each a collection of ``(name, stage id)`` (the values of
            :func:`slapo_lab.pipeline.analyze_tie_weights` on a partitioned model).
        topology: DeepSpeed's ``PipeModelDataParallelTopology`` (anything with ``filter_match(pipe=stage)``
            returning the ranks of that stage, the same number for every stage).

    Returns:
        ``(tie_ranks, tie_stages)``: per group, ``tie_ranks[g]`` is a list of sorted rank lists (the i-th rank
        of each stage) and ``tie_stages[g]`` the sorted stage ids.

    Raises:
        ScheduleError: an empty group, or stages with different numbers of ranks.
    """
    tie_ranks, tie_stages = [], []
    for group in tie_weight_groups:
        group = list(group)
        if not group:
            raise ScheduleError("A tied-weight group is empty; each needs (name, stage id) pairs.")
        stage_ranks = [list(topology.filter_match(pipe=stage_id)) for _, stage_id in group]
        width = len(stage_ranks[0])
        if any(len(r) != width for r in stage_ranks):
            raise ScheduleError(
                "The stages of a tied weight have different numbers of ranks "
                f"({', '.join(str(len(r)) for r in stage_ranks)}); the topology must be uniform."
            )
        tie_ranks.append([sorted(r[i] for r in stage_ranks) for i in range(width)])
        tie_stages.append(sorted(stage_id for _, stage_id in group))
    return tie_ranks, tie_stages
