"""Per-module schedule state and the composed forward that realises it.

Primitives never wrap or move a module (paths stay what the user typed); instead they record their
effect in ``mod._slapo_meta`` and install :func:`slapo_forward` as the instance's ``forward``. That
forward runs, inside out: the module's own ``forward`` (or a sharded implementation such as a
row-parallel linear), then the optional parameter-gradient all-reduce (``sync(..., param_grads=True)``),
then the optional RNG fork, then the optional activation checkpoint. Sync hooks are ordinary forward
(pre-)hooks and so run outside the checkpoint.

Everything here is written to trace under ``torch.compile(block, fullgraph=True)`` (the runtime's
``--compile``, as torchtitan compiles each transformer block): no Python-side state changes inside an
activation checkpoint, no iteration Dynamo cannot follow. The one exception is the RNG fork, which swaps the
global generator's state (``torch.get_rng_state``, which Dynamo does not trace): a graph break.
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any

import torch
from torch import nn

META_ATTR = "_slapo_meta"


def module_meta(mod: nn.Module) -> dict[str, Any]:
    """The module's schedule state dict, created empty on first use.

    Keys: ``sharded`` {tensor name: axis}, ``output_type`` ("partition" | "partial" | None),
    ``output_axis`` (int, for "partition"), ``syncs`` [(mode, op name)], ``checkpoint`` (bool),
    ``checkpoint_policy`` ("full" | "selective", with ``checkpoint``),
    ``fork_rng`` (bool), ``cut`` (bool), ``impl`` (callable replacing the class forward or None),
    ``partial_reducers`` [callable] (run on a partial-sum output before a bias is added),
    ``hooks`` [RemovableHandle]; after ``sync(..., param_grads=True)`` also ``grad_allreduce_params`` [name]
    and ``grad_allreduce_group`` (the :class:`~slapo_lab.sharding.sync_ops.TPGroup` to sum over); after a
    shard with replicas (key/value heads on more ranks than heads) ``grad_replica_params`` [name] and
    ``grad_replica_group`` (the replica sub-group); after a shard whose blocks are partly replicated (a fused
    multi-query projection) ``grad_block_replicas`` {name: (axis, local block sizes, replicas per block)} and
    ``grad_block_group``.
    """
    meta = mod.__dict__.get(META_ATTR)
    if meta is None:
        meta = {
            "sharded": {},
            "output_type": None,
            "output_axis": None,
            "syncs": [],
            "checkpoint": False,
            "checkpoint_policy": "full",
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


# Argument types that are never a KV cache: checked first, so that the usual arguments of a block (tensors,
# flags, None, the (cos, sin) tuple of rotary embeddings) take one ``isinstance`` that torch.compile traces.
_NOT_A_CACHE = (torch.Tensor, bool, int, float, str, type(None), tuple, list, dict)


def _cache_class() -> type | None:
    """``transformers.cache_utils.Cache`` if ``transformers`` is imported, else None (no cache can exist then)."""
    mod = sys.modules.get("transformers.cache_utils")
    return getattr(mod, "Cache", None)


def _is_kv_cache(value) -> bool:
    """Whether ``value`` is a ``transformers`` KV cache (an instance of ``transformers.cache_utils.Cache``).

    Written for ``torch.compile(fullgraph=True)``: a type check against constant classes, no walk over the
    MRO (Dynamo cannot iterate ``type(value).__mro__``: the graph break the checkpoint wrapper used to cause).
    """
    if isinstance(value, _NOT_A_CACHE):
        return False
    cls = _cache_class()
    return cls is not None and isinstance(value, cls)


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


def _with_param_grad_all_reduce(self: nn.Module, fn, names: list[str], g, sharded: bool = False):
    """``fn`` run with this module's replicated parameters ``names`` read through
    :func:`~slapo_lab.sharding.sync_ops.all_reduce_backward` (identity forward, gradient summed over ``g``).

    The parameters are swapped for the call with ``torch.nn.utils.stateless._reparametrize_module`` (what
    ``torch.func.functional_call`` uses): the originals are back when the call returns or raises, re-entrant
    calls stack, and Dynamo knows the context manager (its mutations of ``_parameters`` cancel out), so it
    traces inside an activation checkpoint, where writing ``module._parameters`` from a hook is an "unsafe side
    effect" graph break.

    ``sharded``: the parameters are replicated shards (``shard_replicas``, key/value heads held by several
    ranks) and ``g`` is their replica group; otherwise they are the module's unsharded parameters.
    """
    from torch.nn.utils.stateless import _reparametrize_module

    from .sharding.sync_ops import all_reduce_backward

    def call(*a, **k):
        params = self._parameters
        swap = {
            n: all_reduce_backward(params[n], g)
            for n in names
            if params.get(n) is not None and (getattr(params[n], "shard_axis", None) is not None) == sharded
        }
        with _reparametrize_module(self, swap):
            return fn(*a, **k)

    return call


def _get_param(mod: nn.Module, name: str):
    try:
        return mod.get_parameter(name)
    except AttributeError:
        return None


def _with_block_grad_all_reduce(self: nn.Module, fn, blocks: dict, g):
    """``fn`` run with each parameter of ``blocks`` (``{name: (axis, local block sizes, replicas per block)}``)
    read as its blocks concatenated, those of replicas > 1 through
    :func:`~slapo_lab.sharding.sync_ops.all_reduce_backward` on ``g`` (their gradients summed over the ranks
    sharing them: the key/value heads of a fused multi-query projection); swapped as in
    :func:`_with_param_grad_all_reduce`."""
    from torch.nn.utils.stateless import _reparametrize_module

    from .sharding.sync_ops import all_reduce_backward

    def call(*a, **k):
        swap = {}
        for n, (axis, local, reps) in blocks.items():
            # (a dotted name: a child's parameter its parent's forward reads directly, Mamba-2's conv1d.weight)
            p = self._parameters.get(n) if "." not in n else _get_param(self, n)
            if p is None:
                continue
            pieces = p.split(list(local), dim=axis)
            swap[n] = torch.cat(
                [all_reduce_backward(x, g) if r > 1 else x for x, r in zip(pieces, reps, strict=True)],
                dim=axis,
            )
        with _reparametrize_module(self, swap):
            return fn(*a, **k)

    return call


def slapo_forward(self: nn.Module, *args, **kwargs):
    """The composed forward installed by primitives (see the module docstring).

    Inside out: the class ``forward`` or the sharded ``impl``; the parameter-gradient all-reduce of
    ``sync(..., param_grads=True)`` (``grad_allreduce_group``); the RNG fork (``fork_rng``); the activation
    checkpoint (``checkpoint``, only while gradients are enabled). Every step but the RNG fork traces under
    ``torch.compile(fullgraph=True)`` without a graph break.
    """
    meta = self.__dict__[META_ATTR]
    impl = meta["impl"]
    fn = functools.partial(impl, self) if impl is not None else type(self).forward.__get__(self)
    group = meta.get("grad_allreduce_group")
    if group is not None:
        fn = _with_param_grad_all_reduce(self, fn, meta["grad_allreduce_params"], group)
    group = meta.get("grad_replica_group")
    if group is not None:
        fn = _with_param_grad_all_reduce(self, fn, meta["grad_replica_params"], group, sharded=True)
    if meta.get("grad_block_replicas"):
        fn = _with_block_grad_all_reduce(self, fn, meta["grad_block_replicas"], meta["grad_block_group"])
    if meta["fork_rng"]:
        from .random import get_cuda_rng_tracker

        inner = fn

        def fn(*a, **k):  # deliberate rebinding
            with get_cuda_rng_tracker().fork():
                return inner(*a, **k)

    if meta["checkpoint"] and torch.is_grad_enabled():
        from .random import checkpoint, checkpoint_selective

        _ckpt = checkpoint_selective if meta.get("checkpoint_policy") == "selective" else checkpoint

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
