"""Tracing by need (placeholder: filled in by the tracing work)."""


class TracingMixin:
    """Schedule methods for tracing and pattern finding (``trace``, ``trace_until``, ``find`` ...)."""
