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
  ``cut_pipeline_stage`` checks against (a meta-device forward, cached on the schedule).

Sources: Slapo ``slapo/pipeline.py`` (seed 002); PyTorch ``torch/distributed/pipelining/_IR.py``
(seed 003) and ``schedules.py``; torchgpipe ``skip/layout.py`` (seed 004); DeepSpeed
``deepspeed/runtime/pipe``.
"""

from .balance import CutSuggestion, suggest_cuts
from .mesh import PipelineMesh, make_mesh
from .order import CallOrder, call_order, check_cuts, record_call_order, set_example_inputs
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
