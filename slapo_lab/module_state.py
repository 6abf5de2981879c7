"""Per-module schedule state and the composed forward that realises it.

Primitives never wrap or move a module (paths stay what the user typed); instead they record their
effect in ``mod._slapo_meta`` and install :func:`slapo_forward` as the instance's ``forward``. That
forward runs, inside out: the module's own ``forward`` (or a sharded implementation such as a
row-parallel linear), then the optional RNG fork, then the optional activation checkpoint. Sync
hooks are ordinary forward (pre-)hooks and so run outside the checkpoint.
"""
from __future__ import annotations

import functools
import types
from typing import Any

import torch
from torch import nn

META_ATTR = "_slapo_meta"


def module_meta(mod: nn.Module) -> dict[str, Any]:
    """The module's schedule state dict, created empty on first use.

    Keys: ``sharded`` {tensor name: axis}, ``output_type`` ("partition" | "partial" | None),
    ``output_axis`` (int, for "partition"), ``syncs`` [(mode, op name)], ``checkpoint`` (bool),
    ``fork_rng`` (bool), ``cut`` (bool), ``impl`` (callable replacing the class forward or None),
    ``partial_reducers`` [callable] (run on a partial-sum output before a bias is added),
    ``hooks`` [RemovableHandle].
    """
    meta = mod.__dict__.get(META_ATTR)
    if meta is None:
        meta = {
            "sharded": {},
            "output_type": None,
            "output_axis": None,
            "syncs": [],
            "checkpoint": False,
            "fork_rng": False,
            "cut": False,
            "impl": None,
            "partial_reducers": [],
            "hooks": [],
        }
        mod.__dict__[META_ATTR] = meta
    return meta


def peek_meta(mod: nn.Module) -> dict[str, Any] | None:
    """The module's schedule state, or None if no primitive touched it (no side effect)."""
    return mod.__dict__.get(META_ATTR)


def _is_kv_cache(value) -> bool:
    """Whether ``value`` is a ``transformers`` KV cache (an instance of ``transformers.cache_utils.Cache``)."""
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in type(value).__mro__)


def without_kv_cache(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of a checkpointed call with every ``transformers`` KV cache replaced by None and
    ``use_cache=True`` by False: the recomputation in backward would append the keys and values again
    (GPT-Neo: "The size of tensor a (32) must match the size of tensor b (16)"); transformers itself turns the
    cache off under gradient checkpointing."""
    args = tuple(None if _is_kv_cache(a) else a for a in args)
    kwargs = {k: None if _is_kv_cache(v) else v for k, v in kwargs.items()}
    if kwargs.get("use_cache") is True:
        kwargs["use_cache"] = False
    return args, kwargs


def slapo_forward(self: nn.Module, *args, **kwargs):
    """The composed forward installed by primitives (see module docstring)."""
    meta = self.__dict__[META_ATTR]
    impl = meta["impl"]
    fn = functools.partial(impl, self) if impl is not None else type(self).forward.__get__(self)
    if meta["fork_rng"]:
        from .random import get_cuda_rng_tracker

        inner = fn

        def fn(*a, **k):  # noqa: F811 - deliberate rebinding
            with get_cuda_rng_tracker().fork():
                return inner(*a, **k)

    if meta["checkpoint"] and torch.is_grad_enabled():
        from .random import checkpoint as _ckpt

        args, kwargs = without_kv_cache(args, kwargs)
        order = meta.get("order_args_fn")
        if order is not None:
            args, kwargs = tuple(order(*args, **kwargs)), {}
        return _ckpt(fn, *args, **kwargs)
    return fn(*args, **kwargs)


def install_forward(mod: nn.Module) -> None:
    """Make ``mod.forward`` the composed :func:`slapo_forward` (idempotent)."""
    module_meta(mod)
    fwd = mod.__dict__.get("forward")
    if not (isinstance(fwd, types.MethodType) and fwd.__func__ is slapo_forward):
        mod.forward = types.MethodType(slapo_forward, mod)
