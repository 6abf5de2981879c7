"""Slapo's framework dialects at Slapo's module path (``slapo.framework_dialect``): the pieces of Slapo 0.0.3's
``slapo/framework_dialect/`` that do not need the framework itself. slapo_lab's DeepSpeed pipeline runtime is
:mod:`slapo_lab.pipeline.deepspeed_runtime`."""

from . import deepspeed

__all__ = ["deepspeed"]
