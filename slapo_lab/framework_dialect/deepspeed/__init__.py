"""Slapo's DeepSpeed dialect helpers (``slapo.framework_dialect.deepspeed``)."""

from . import pipeline

__all__ = ["pipeline"]
