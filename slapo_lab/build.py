"""Build: turn a schedule into the runnable model of this rank.

Without pipeline cuts the scheduled module *is* the runnable model: the primitives sliced its
parameters and installed the sync hooks in place, so ``build`` returns ``(sch.mod, None)`` (target
None / "torch"). With cuts, or with ``target="deepspeed"``, the model is partitioned into pipeline
stages and wrapped for a runtime by :func:`slapo_lab.pipeline.build_pipeline`
(torch.distributed.pipelining GPipe / 1F1B / Interleaved1F1B, or DeepSpeed's PipelineModule).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .errors import ScheduleError
from .pipeline import build_pipeline

TARGETS = (None, "torch", "deepspeed")


def build(sch, target: str | None = None, **kwargs: Any) -> tuple[nn.Module, Any]:
    """The runnable model of this rank and its optimizer (None: the caller makes one).

    Args:
        sch: the top :class:`~slapo_lab.Schedule` (any node: its top is used).
        target: None or ``"torch"`` (plain PyTorch, or torch.distributed.pipelining when the schedule
            has cuts) or ``"deepspeed"`` (DeepSpeed pipeline engine).
        **kwargs: for pipelines, the keyword arguments of :func:`slapo_lab.pipeline.build_pipeline`
            (``example_inputs``, ``loss_fn``, ``schedule``, ``n_microbatches``, ``pp_group``,
            ``dp_group``, ``stages_per_rank``, ``optimizer``, ``output_fn``, ``device``, ``ds_config``).

    Returns:
        ``(sch.mod, None)`` without cuts; ``(PipelineModel, its optimizer)`` with cuts or DeepSpeed.

    Raises:
        ValueError: for an unknown target, or keyword arguments given to a plain (no-cut) build.
        ScheduleError: from the pipeline partition (one sentence).
    """
    top = sch.get_top_schedule()
    if target not in TARGETS:
        raise ValueError(f'Unknown build target {target!r}; use None, "torch" or "deepspeed".')
    cuts = top.metadata.primitives.get("cut_pipeline_stage", [])
    if cuts or target == "deepspeed":
        missing = [k for k in ("example_inputs", "loss_fn") if k not in kwargs]
        if missing:
            why = f"{len(cuts)} pipeline cut(s)" if cuts else "the DeepSpeed target"
            raise ScheduleError(
                f"Building a schedule with {why} needs {' and '.join(missing)}= "
                "(one batch of inputs and a loss_fn(output, target) for the pipeline runtime)."
            )
        pm = build_pipeline(top, target or "torch", **kwargs)
        return pm, pm.optimizer
    if kwargs:
        raise ValueError(
            f"build() got unexpected keyword arguments for a schedule without pipeline cuts: "
            f"{', '.join(sorted(kwargs))}."
        )
    return top.mod, None
