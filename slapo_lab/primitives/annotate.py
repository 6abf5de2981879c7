"""Parameter annotations: ``annotate``.

Slapo's ``slapo/primitives/annotate.py``: set an attribute on a parameter and remember the key in
``sch.metadata.param_tags``. The attribute travels with the parameter: ``shard`` copies a
parameter's attributes to its shard, and ``replace`` / ``replace_all`` copy tagged attributes to a
same-named parameter of the new module (or keep the very same parameter object).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import ScheduleError
from .base import Primitive, own_copy, register_primitive

if TYPE_CHECKING:
    from ..schedule import Schedule

#: attributes that primitives set themselves and that an annotation must not overwrite
RESERVED = frozenset({"orig_shape", "shard_axis", "shard_stride", "shard_replicas", "sequence_parallel"})


def _param(sch, param_name: Any) -> nn.Parameter:
    where = sch.path or "the root module"
    if not isinstance(param_name, str) or not param_name:
        raise ScheduleError(f"annotate() takes a parameter name as a string, not {param_name!r}.")
    try:
        return sch.mod.get_parameter(param_name)
    except AttributeError:
        names = [n for n, _ in sch.mod.named_parameters()][:8]
        have = ", ".join(names) if names else "no parameters"
        raise ScheduleError(f"{where} has no parameter named {param_name!r}; it has {have}.") from None


_GOOD_KEYS: set[str] = set()  # keys that passed the checks below (a long schedule repeats a few keys)


def check_annotate(sch: Schedule, param_name: str, key: str) -> nn.Parameter:
    """Validate an annotate call; return the parameter (raises ScheduleError)."""
    p = _param(sch, param_name)
    if type(key) is str and key in _GOOD_KEYS:
        return p
    if not isinstance(key, str) or not key.isidentifier():
        raise ScheduleError(f"An annotation key must be a Python identifier string, not {key!r}.")
    if key in RESERVED:
        raise ScheduleError(f"{key!r} is set by shard() itself and cannot be used as an annotation key.")
    if hasattr(torch.Tensor, key) or hasattr(nn.Parameter, key) or key.startswith("__"):
        raise ScheduleError(f"{key!r} is a tensor attribute; pick another annotation key.")
    _GOOD_KEYS.add(key)
    return p


@register_primitive()
class AnnotatePrimitive(Primitive):
    """Set ``param.<key> = value`` on the parameter ``param_name`` of this module (dotted names reach
    into submodules) and add ``key`` to ``sch.metadata.param_tags``. Annotating the same key again
    overwrites the value. A module or tensor ``value`` (also inside a list, tuple or dict) is
    deep-copied first, like ``replace``'s module (anything already in the model, e.g. another
    parameter, is kept as is), so the annotation never aliases an object the user holds.

    Raises:
        ScheduleError: unknown parameter, a key that is not an identifier, or a key that would shadow a
            tensor attribute or one that ``shard`` sets (``orig_shape``, ``shard_axis``).
    """

    name = "annotate"
    positional = 3

    @classmethod
    def check(cls, sch: Schedule, param_name: str, key: str, value: Any) -> None:
        check_annotate(sch, param_name, key)

    @staticmethod
    def apply(sch: Schedule, param_name: str, key: str, value: Any) -> nn.Parameter:
        p = check_annotate(sch, param_name, key)
        setattr(p, key, own_copy(sch, value, "annotate()"))
        sch.metadata.param_tags.add(key)
        return p
