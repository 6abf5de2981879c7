"""Slapo's pattern helpers at Slapo's module path (``slapo.pattern``): :class:`Pattern`,
:class:`ModulePattern` and :func:`call_module` for ``Schedule.find``. Source: Slapo 0.0.3 ``slapo/pattern.py``;
the definitions live in :mod:`slapo_lab.tracing`."""

from .tracing import ModulePattern, Pattern, call_module

__all__ = ["ModulePattern", "Pattern", "call_module"]
