"""slapo-lab: Slapo's schedule language on PyTorch 2.13, with a JupyterLab visual editor.

The public API, and nothing else: the editor and exported scripts use only these names.
"""

from . import graph, pipeline, presets, sharding, utils
from .build import build
from .check import Finding, check_schedule, close_open_items
from .errors import ScheduleError
from .export import ExportError, export_script, load_schedule, save_schedule
from .init import consolidate_model, init_empty_weights
from .module_state import peek_meta as module_state
from .pipeline import analyze_tie_weights
from .plan import Plan, plan
from .primitives import Primitive, list_primitives, register_primitive
from .primitives.replace import LinearWithSeparateBias
from .random import checkpoint, get_cuda_rng_tracker, is_random_seed_set, set_random_seed
from .record import Call, Recorder, format_call, replay
from .schedule import Schedule, ScheduleMetadata, create_schedule
from .sharding.sync_ops import TPGroup
from .tracing import ModulePattern, Pattern, call_module, record_example_inputs
from .tune import Database, Space, Symbol
from .verify import Verify, VerifyReport, verify_models

__version__ = "0.1.0"


def check_primitive(sch: Schedule, primitive: str, *args, **kwargs) -> str | None:
    """Whether ``sch.<primitive>(*args, **kwargs)`` would apply: None if yes, else the error sentence.

    Nothing is changed or recorded.
    """
    from .primitives import get_primitive

    prim = get_primitive(primitive)
    if prim is None:
        return f"Unknown primitive {primitive!r}; primitives: {', '.join(list_primitives())}."
    from .primitives.base import named_refusal

    try:
        bound = prim.bind(*args, **kwargs)
        prim.check(sch, *bound.args, **bound.kwargs)
    except ScheduleError as err:
        return str(named_refusal(err, sch, primitive))
    return None


__all__ = [
    "Call",
    "Database",
    "ExportError",
    "Finding",
    "LinearWithSeparateBias",
    "ModulePattern",
    "Pattern",
    "Plan",
    "Primitive",
    "Recorder",
    "Schedule",
    "ScheduleEditor",
    "ScheduleError",
    "ScheduleMetadata",
    "Space",
    "Symbol",
    "TPGroup",
    "Verify",
    "VerifyReport",
    "analyze_tie_weights",
    "build",
    "call_module",
    "check_primitive",
    "check_schedule",
    "checkpoint",
    "close_open_items",
    "consolidate_model",
    "create_schedule",
    "export_script",
    "format_call",
    "framework_dialect",
    "get_cuda_rng_tracker",
    "graph",
    "init_empty_weights",
    "is_random_seed_set",
    "list_primitives",
    "load_schedule",
    "module_state",
    "op",
    "pattern",
    "pipeline",
    "plan",
    "presets",
    "record_example_inputs",
    "register_primitive",
    "replay",
    "save_schedule",
    "set_random_seed",
    "sharding",
    "utils",
    "verify_models",
]


def __getattr__(name: str):
    # The editor pulls in ipywidgets, and Slapo's ops and dialects are for Slapo's own code: import them only
    # when asked for (a kernel opening the editor does not pay for them).
    if name == "ScheduleEditor":
        from .editor import ScheduleEditor

        return ScheduleEditor
    if name in ("op", "framework_dialect", "pattern"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'slapo_lab' has no attribute {name!r}")
