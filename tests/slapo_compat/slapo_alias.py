"""``import slapo`` -> ``slapo_lab``: run Slapo 0.0.3's own tests and model schedules unmodified.

``slapo`` and ``slapo.<sub>`` resolve to ``slapo_lab`` and ``slapo_lab.<sub>`` (the same module objects, not
copies). ``slapo.model_schedule`` and ``slapo.logger`` are Slapo's own files, read from the ``slapo==0.0.3``
wheel that ``scripts/install.sh`` downloads and unpacks into ``.cache/slapo/wheel`` (never installed, never
copied into this repository); ``slapo.initialization`` maps to ``slapo_lab.init``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import unittest.mock
from pathlib import Path

WHEEL = Path(
    os.environ.get("SLAPO_WHEEL_DIR", Path(__file__).resolve().parents[2] / ".cache" / "slapo" / "wheel")
)
"""Where the unpacked ``slapo-0.0.3-py3-none-any.whl`` lies (``slapo/`` and ``tests/``)."""

_RENAMED = {"slapo.initialization": "slapo_lab.init"}
_FROM_WHEEL = ("slapo.model_schedule", "slapo.logger")


def missing() -> str | None:
    """One sentence when the wheel is not unpacked, else None."""
    if (WHEEL / "slapo" / "model_schedule").is_dir() and (WHEEL / "tests").is_dir():
        return None
    return (
        f"Slapo 0.0.3's wheel is not unpacked in {WHEEL}; run scripts/install.sh (it downloads slapo==0.0.3)."
    )


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module):
        # importlib set __spec__ to the alias's; give the real module its own spec back
        module.__spec__ = importlib.util.find_spec(self.target)


class _SlapoAlias(importlib.abc.MetaPathFinder):
    """``slapo[.x]`` -> ``slapo_lab[.x]``; ``slapo.model_schedule[.x]`` and ``slapo.logger`` -> the wheel's."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "slapo" and not fullname.startswith("slapo."):
            return None
        if any(fullname == w or fullname.startswith(w + ".") for w in _FROM_WHEEL):
            where = WHEEL.joinpath(*fullname.split("."))
            if where.is_dir():
                return importlib.util.spec_from_file_location(
                    fullname, where / "__init__.py", submodule_search_locations=[str(where)]
                )
            return importlib.util.spec_from_file_location(fullname, where.with_suffix(".py"))
        target_name = _RENAMED.get(fullname, "slapo_lab" + fullname[len("slapo") :])
        try:
            if importlib.util.find_spec(target_name) is None:
                return None
        except ImportError:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(target_name), is_package=True)


def install() -> None:
    """Put the alias first on ``sys.meta_path`` (once) and map ``mock`` to ``unittest.mock``."""
    import slapo_lab

    if not any(isinstance(f, _SlapoAlias) for f in sys.meta_path):
        sys.meta_path.insert(0, _SlapoAlias())
    sys.modules.setdefault("slapo", slapo_lab)
    try:  # Slapo's tests use the ``mock`` backport; the standard library's unittest.mock is the same API
        import mock  # noqa: F401, UP026
    except ImportError:
        sys.modules["mock"] = unittest.mock


install()
