"""Slapo's hook utilities at Slapo's module path (``slapo.utils.common``).

Source: Slapo 0.0.3 ``slapo/utils/common.py``. ``get_hooks`` / ``has_hook`` / ``transfer_hooks`` read and move
a module's plain hooks by kind: ``"fwd_pre"`` (forward pre-hooks), ``"fwd_post"`` (forward hooks) and
``"bwd_post"`` (``register_backward_hook`` / ``register_full_backward_hook`` hooks).
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from types import FunctionType

from torch import nn

from ..errors import ScheduleError
from ..primitives.subgraphs import check_fusion_hooks

HOOK_TYPE_TO_ATTR = {
    "fwd_pre": "_forward_pre_hooks",
    "fwd_post": "_forward_hooks",
    "bwd_post": "_backward_hooks",
}
# the with-kwargs / always-called flags ride along with their hook dicts
_COMPANIONS = {
    "_forward_pre_hooks": ("_forward_pre_hooks_with_kwargs",),
    "_forward_hooks": ("_forward_hooks_with_kwargs", "_forward_hooks_always_called"),
    "_backward_hooks": (),
}


def _attr(hook_type: str) -> str:
    try:
        return HOOK_TYPE_TO_ATTR[hook_type]
    except KeyError:
        raise ScheduleError(
            f"Unknown hook type {hook_type!r}; use one of {', '.join(HOOK_TYPE_TO_ATTR)}."
        ) from None


def get_hooks(mod: nn.Module) -> dict[str, list]:
    """The plain hooks of ``mod``: ``{"fwd_pre": [...], "fwd_post": [...], "bwd_post": [...]}``.

    Source: Slapo 0.0.3 ``slapo/utils/common.py`` (``get_hooks``).
    """
    return {kind: list(getattr(mod, attr).values()) for kind, attr in HOOK_TYPE_TO_ATTR.items()}


def has_hook(mod: nn.Module, hook_type: str) -> bool:
    """Whether ``mod`` has a hook of ``hook_type`` (``"fwd_pre"``, ``"fwd_post"`` or ``"bwd_post"``).

    Raises:
        ScheduleError: an unknown ``hook_type``.
    """
    return len(getattr(mod, _attr(hook_type))) > 0


def transfer_hooks(old_mod: nn.Module, new_mod: nn.Module, hook_types=None) -> None:
    """Copy the hooks of the given kinds (default: all three) from ``old_mod`` to ``new_mod``.

    The old module keeps its hooks (Slapo shares the dicts; here the new module gets its own copy, so
    removing a hook handle removes it from the old module only).

    Raises:
        ScheduleError: an unknown hook type.
    """
    for kind in hook_types if hook_types is not None else HOOK_TYPE_TO_ATTR:
        attr = _attr(kind)
        for name in (attr, *_COMPANIONS[attr]):
            src = getattr(old_mod, name, None)
            if src:
                getattr(new_mod, name).update(src)
    if getattr(old_mod, "_is_full_backward_hook", None) is not None and old_mod._backward_hooks:
        new_mod._is_full_backward_hook = old_mod._is_full_backward_hook


def transfer_hooks_for_fusion(sch, subgraphs, new_mod: nn.Module) -> None:
    """Move the hooks of the modules a replaced subgraph calls onto ``new_mod`` (Slapo's rule).

    One subgraph (vertical): the first module's ``fwd_pre`` / ``bwd_post`` hooks and the last module's
    ``fwd_post`` hooks move over. ``subgraphs`` is what ``find()`` returns.

    Raises:
        ScheduleError: a hook that cannot be kept -- any hook in horizontal fusion, a ``fwd_post`` hook on the
            first module, a ``fwd_pre`` / ``bwd_post`` hook on the last, any hook on a module in between.
    """
    for src, kinds in check_fusion_hooks(sch.mod, subgraphs):
        transfer_hooks(src, new_mod, kinds)


def transfor_param_tags(sch, param, new_param) -> None:
    """Copy the schedule's parameter tags (``sch.metadata.param_tags``) from ``param`` to ``new_param``
    (Slapo's spelling kept)."""
    for tag in sch.get_top_schedule().metadata.param_tags:
        if hasattr(param, tag):
            setattr(new_param, tag, getattr(param, tag))


def is_lambda_function(obj) -> bool:
    """Whether ``obj`` is a ``lambda``."""
    return isinstance(obj, FunctionType) and obj.__name__ == "<lambda>"


@lru_cache
def importlib_or_none(name: str):
    """The module ``name`` if it can be imported, else None."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        return None
