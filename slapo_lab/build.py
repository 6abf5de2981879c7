"""Build: turn a schedule into the runnable model of this rank.

For now (tensor parallelism and checkpointing) the scheduled module *is* the runnable model: the
primitives sliced its parameters and installed the sync hooks in place, so ``build`` returns
``sch.mod``. Pipeline stages (``cut_pipeline_stage``) and the DeepSpeed runtime are built by the
pipeline work (another issue) and raise ``NotImplementedError`` here until then.
"""
from __future__ import annotations

from typing import Any

from torch import nn

TARGETS = (None, "torch")


def build(sch, target: str | None = None, **kwargs: Any) -> tuple[nn.Module, Any]:
    """The runnable model of this rank and its optimizer (None: the caller makes one).

    Args:
        sch: the top :class:`~slapo_lab.Schedule` (any node: its top is used).
        target: None or ``"torch"`` (plain PyTorch); ``"deepspeed"`` is not supported yet.
        **kwargs: reserved for the pipeline/DeepSpeed targets; must be empty for now.

    Returns:
        ``(sch.mod, None)`` for the top schedule.

    Raises:
        NotImplementedError: for the ``"deepspeed"`` target or a schedule with pipeline cuts.
        ValueError: for an unknown target or unexpected keyword arguments.
    """
    top = sch.get_top_schedule()
    if target == "deepspeed":
        raise NotImplementedError("build(target=\"deepspeed\") is not implemented yet; it comes with pipeline "
                                  "support, use target=None for plain PyTorch.")
    if target not in TARGETS:
        raise ValueError(f"Unknown build target {target!r}; use None or \"torch\".")
    cuts = top.metadata.primitives.get("cut_pipeline_stage", [])
    if cuts:
        raise NotImplementedError(f"This schedule has {len(cuts)} pipeline cut(s) ({cuts[0]} ...), and building "
                                  "pipeline stages is not implemented yet.")
    if kwargs:
        raise ValueError(f"build() got unexpected keyword arguments: {', '.join(sorted(kwargs))}.")
    return top.mod, None
