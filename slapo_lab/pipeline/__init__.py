"""Pipeline parallelism for cut schedules: partition, runtimes, composition, balance.

``sch[path].cut_pipeline_stage()`` records cuts (Slapo: the marked module is the last of its stage);
this package turns them into something that trains:

* :func:`partition_pipeline` -- export-based split (``torch.export`` + ``torch.distributed.pipelining``),
  cuts at any depth, liveness of values that skip stages, tied weights replicated per stage;
* :func:`build_pipeline` -- this rank's stages on ``target="torch"`` (GPipe / 1F1B / Interleaved1F1B)
  or ``target="deepspeed"`` (``PipelineModule`` + ``engine.train_batch``), returning a
  :class:`PipelineModel` with ``train_step``;
* :func:`make_mesh` -- a ``(dp, pp, tp)`` device mesh and this rank's groups for TP x PP x DP;
* :func:`suggest_cuts` -- balanced cut paths over repeated blocks (by parameters, measured time or
  estimated FLOPs);
* :func:`call_order` / :func:`set_example_inputs` -- the forward call order that
  ``cut_pipeline_stage`` checks against (a meta-device forward, cached on the schedule);
* :func:`analyze_tie_weights` -- Slapo's tied-weight groups, by stage.

Sources: Slapo ``slapo/pipeline.py`` (seed 002); PyTorch ``torch/distributed/pipelining/_IR.py``
(seed 003) and ``schedules.py``; torchgpipe ``skip/layout.py`` (seed 004); DeepSpeed
``deepspeed/runtime/pipe``.
"""

from torch import nn

from ..call_order import CallOrder, call_order, check_cuts, record_call_order, set_example_inputs
from ..errors import ScheduleError
from .balance import CutSuggestion, suggest_cuts
from .mesh import PipelineMesh, make_mesh
from .partition import PipelinePartition, StageInfo, default_output_fn, partition_pipeline
from .runtime import SCHEDULES, TARGETS, PipelineModel, build_pipeline

__all__ = [
    "SCHEDULES",
    "TARGETS",
    "CallOrder",
    "CutSuggestion",
    "PipelineMesh",
    "PipelineModel",
    "PipelinePartition",
    "StageInfo",
    "analyze_tie_weights",
    "build_pipeline",
    "call_order",
    "check_cuts",
    "default_output_fn",
    "make_mesh",
    "partition_pipeline",
    "record_call_order",
    "set_example_inputs",
    "suggest_cuts",
]


def analyze_tie_weights(top_mod, is_pipeline_partitioned):
    """Tied weights (one parameter object under several names) and the pipeline stage of each name.

    Slapo's ``slapo.pipeline.analyze_tie_weights`` (Slapo 0.0.3 ``slapo/pipeline.py``), same signature and
    result; the same alias walk as :func:`partition_pipeline`'s tied groups (``PipelinePartition.tied``).

    Args:
        top_mod: an ``nn.Module``. When ``is_pipeline_partitioned``, its children are the pipeline stages in
            order (stage ``i`` is the ``i``-th child) and names are relative to the stage.
        is_pipeline_partitioned: False: every name is in stage 0 and every set of two or more aliasing names
            is a group; True: only parameters held by two or more stages form a group (the first name in its
            first stage, then every name in later stages).

    Returns:
        ``{parameter: group}``: a set of ``(name, 0)`` when not partitioned, a list of ``(name, stage id)``
        when partitioned.

    Raises:
        ScheduleError: ``top_mod`` is not an ``nn.Module``.
    """
    if not isinstance(top_mod, nn.Module):
        raise ScheduleError(f"analyze_tie_weights() takes an nn.Module, not {type(top_mod).__name__}.")
    if not is_pipeline_partitioned:
        names: dict[int, list] = {}
        params: dict[int, nn.Parameter] = {}
        for name, p in top_mod.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
            params[id(p)] = p
        return {params[k]: {(n, 0) for n in v} for k, v in names.items() if len(set(v)) > 1}
    held: dict[int, list] = {}
    params = {}
    for stage_id, (_, stage) in enumerate(top_mod.named_children()):
        for name, p in stage.named_parameters(remove_duplicate=False):
            held.setdefault(id(p), []).append((name, stage_id))
            params[id(p)] = p
    ret = {}
    for k, entries in held.items():
        first_stage = entries[0][1]
        if all(sid == first_stage for _, sid in entries):
            continue
        ret[params[k]] = [entries[0]] + [e for e in entries if e[1] != first_stage]
    return ret
