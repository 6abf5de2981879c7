"""slapo-lab: Slapo's schedule language on PyTorch 2.13, with a JupyterLab visual editor.

The public API. Exported scripts call ``slapo_lab.train.main``; the editor uses these names and the internal modules
of lower layers that ``tests/test_import_layers.py`` lists (``EDITOR_MAY_USE``; see docs/ARCHITECTURE.md).
"""

import importlib
import importlib.metadata
import json
import os
import sys
import types

# First, before torch is imported: a process started by torchrun or the DeepSpeed launcher (an exported
# script's ``import slapo_lab.train``) ends when its launcher ends (slapo_lab/train/lifeline.py, stdlib only).
from .train import lifeline as _lifeline

_lifeline.arm()


def _version() -> str:
    """The version: the installed distribution's metadata (the wheel takes it from package.json, the one home of
    the version, through pyproject's ``[tool.hatch.version] source = "nodejs"``); a source checkout never installed
    reads package.json itself; "0+unknown" without either."""
    try:
        return importlib.metadata.version("slapo-lab")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        with open(
            os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "package.json")
        ) as f:
            version = json.load(f).get("version")
    except (OSError, ValueError, AttributeError):
        version = None
    return version if isinstance(version, str) and version else "0+unknown"


__version__ = _version()

# The public names and the module each comes from. They are imported on first use (PEP 562), all at once, in
# this order: ``import slapo_lab.train.preflight`` (an exported script's launch checks) must not pay for torch,
# and any other use of the package sees everything loaded, as an eager import would give it.
_SUBMODULES = ("graph", "pipeline", "presets", "sharding", "utils")
_NAMES = {
    "build": ".build",
    "Finding": ".check",
    "check_schedule": ".check",
    "close_open_items": ".check",
    "ScheduleError": ".errors",
    "ExportError": ".export",
    "export_script": ".export",
    "load_schedule": ".export",
    "save_schedule": ".export",
    "consolidate_model": ".init",
    "init_empty_weights": ".init",
    "ModuleMeta": ".module_state",
    "module_state": (".module_state", "peek_meta"),
    "analyze_tie_weights": ".pipeline",
    "Cluster": ".planner",
    "DeviceProfile": ".planner",
    "Estimate": ".planner",
    "Layout": ".planner",
    "auto_plan": ".planner",
    "calibrate": ".planner",
    "estimate": ".planner",
    "Plan": ".plan",
    "plan": ".plan",
    "Primitive": ".primitives",
    "check_primitive": ".primitives.base",
    "list_primitives": ".primitives",
    "register_primitive": ".primitives",
    "LinearWithSeparateBias": ".primitives.replace",
    "checkpoint": ".random",
    "get_cuda_rng_tracker": ".random",
    "is_random_seed_set": ".random",
    "set_random_seed": ".random",
    "Call": ".record",
    "Recorder": ".record",
    "format_call": ".record",
    "replay": ".record",
    "Schedule": ".schedule",
    "ScheduleMetadata": ".schedule",
    "create_schedule": ".schedule",
    "TPGroup": ".sharding.sync_ops",
    "ModulePattern": ".tracing",
    "Pattern": ".tracing",
    "call_module": ".tracing",
    "record_example_inputs": ".tracing",
    "Database": ".tune",
    "Space": ".tune",
    "Symbol": ".tune",
    "Verify": ".verify",
    "VerifyReport": ".verify",
    "verify_models": ".verify",
}
_loaded = False


class _Package(types.ModuleType):
    """The package object: a submodule bound under a public function's name (``plan``, ``build``,
    ``module_state``) when it is imported does not hide the function, as with an eager import."""

    def __setattr__(self, name: str, value) -> None:
        if name in _NAMES and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def _load() -> None:
    """Import every public name into the package (the first public attribute asked for does this)."""
    global _loaded
    if _loaded:
        return
    module = sys.modules[__name__]
    for name in _SUBMODULES:
        setattr(module, name, importlib.import_module(f".{name}", __name__))
    for name, where in _NAMES.items():
        src, attr = where if isinstance(where, tuple) else (where, name)
        setattr(module, name, getattr(importlib.import_module(src, __name__), attr))
    _loaded = True


__all__ = [
    "Call",
    "Cluster",
    "Database",
    "DeviceProfile",
    "Estimate",
    "ExportError",
    "Finding",
    "Layout",
    "LinearWithSeparateBias",
    "ModuleMeta",
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
    "auto_plan",
    "build",
    "calibrate",
    "call_module",
    "check_primitive",
    "check_schedule",
    "checkpoint",
    "close_open_items",
    "consolidate_model",
    "create_schedule",
    "estimate",
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
        from .editor import ScheduleEditor  # noqa: PLC0415 - ipywidgets: loaded only for the editor

        return ScheduleEditor
    if name in ("op", "framework_dialect", "pattern"):
        return importlib.import_module(f".{name}", __name__)
    if name in _NAMES or name in _SUBMODULES:
        _load()
        return globals()[name]
    raise AttributeError(f"module 'slapo_lab' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
