"""Per-module schedule state and the composed forward that realises it.

Primitives never wrap or move a module (paths stay what the user typed); instead they record their
effect in the module's :class:`ModuleMeta` (``mod._slapo_meta``, one typed field per piece of state) and
install :func:`slapo_forward` as the instance's ``forward``. That forward runs, inside out: the module's
own ``forward`` (or a sharded implementation such as a row-parallel linear), then the optional
parameter-gradient all-reduce (``sync(..., param_grads=True)``), then the optional RNG fork, then the optional
activation checkpoint. Sync hooks are ordinary forward (pre-)hooks and so run outside the checkpoint.

Everything here is written to trace under ``torch.compile(block, fullgraph=True)`` (the runtime's
``--compile``, as torchtitan compiles each transformer block): no Python-side state changes inside an
activation checkpoint, no iteration Dynamo cannot follow. The one exception is the RNG fork, which swaps the
global generator's state (``torch.get_rng_state``, which Dynamo does not trace): a graph break.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

from .random import checkpoint, checkpoint_selective, get_cuda_rng_tracker

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from .sharding.sync_ops import TPGroup

META_ATTR = "_slapo_meta"


@dataclass(slots=False)
class ModuleMeta:
    """The schedule state of one module, kept in ``mod.__dict__[META_ATTR]`` (``mod._slapo_meta``).

    Written by the primitives (:mod:`slapo_lab.primitives`) and the shard rules (:mod:`slapo_lab.sharding`),
    read by the composed forward (:func:`slapo_forward`), the schedule check (:mod:`slapo_lab.check`), the
    memory plan, the pipeline partitioner and the exports. Every field has its default until a primitive sets
    it, so a reader never asks whether a key exists. Equality is field by field, as the dict it replaces
    (hook handles by identity). A ``copy.deepcopy`` of the module copies it with the module;
    :class:`slapo_lab.atomic.Snapshot` copies its containers (:meth:`copy_containers`) so that a failed preset
    puts them back. Reading a field that does not exist raises ``AttributeError``.
    """

    sharded: dict[str, int] = field(default_factory=dict)
    """``{tensor name: axis}`` of this module's sharded parameters and buffers (``shard``)."""
    output_type: str | None = None
    """How the output is split across the tensor-parallel ranks: ``"partition"`` (each rank holds a slice along
    :attr:`output_axis`), ``"partial"`` (each rank holds a partial sum) or None (replicated)."""
    output_axis: int | None = None
    """The axis of a ``"partition"`` output; None otherwise."""
    syncs: list[tuple[str, str]] = field(default_factory=list)
    """``[(mode, op name)]`` of the ``sync`` calls, in order: mode ``"fwd_pre"`` | ``"fwd_post"`` |
    ``"bwd_post"``, op ``"all_reduce"``, ``"all_gather"`` ..., ``"all_reduce_param_grads"`` or a function's
    name."""
    output_synced: bool = False
    """A forward ``sync`` (``fwd_post``) made the output whole again (the numeric check's culprit search)."""
    replicated_input: bool = False
    """The module's input is replicated on every rank although its output is partial (a tensor-parallel experts
    module that holds both halves of the MLP): a backward ``sync`` on it is not needed."""
    checkpoint: bool = False
    """The forward runs under activation checkpointing (``checkpoint``)."""
    checkpoint_policy: str = "full"
    """``"full"`` (recompute everything) or ``"selective"`` (keep matmul outputs), with :attr:`checkpoint`."""
    order_args_fn: Callable[..., Any] | None = None
    """``checkpoint(order_args_fn=...)``: maps the call's ``(*args, **kwargs)`` to the positional arguments the
    checkpoint passes on; None to pass them as called."""
    fork_rng: bool = False
    """The forward runs in the tensor-parallel RNG tracker's fork (``fork_rng``)."""
    cut: bool = False
    """A pipeline stage starts after this module (``cut_pipeline_stage``)."""
    impl: Callable[..., Any] | None = None
    """A function ``(module, *args, **kwargs)`` run instead of the class ``forward`` (a row-parallel linear, a
    vocab-parallel embedding ...); None for the class ``forward``."""
    partial_reducers: list[Callable[..., Any]] = field(default_factory=list)
    """Functions an :attr:`impl` runs on its partial-sum output before it adds a bias (a ``fwd_post`` all-reduce
    of a row-parallel layer)."""
    hooks: list[RemovableHandle] = field(default_factory=list)
    """Handles of the forward (pre-)hooks primitives installed (syncs, head and feature input slicers)."""
    tp_group: TPGroup | None = None
    """The tensor-parallel group a shard was made for (the global feature statistics of a sharded norm)."""
    grad_allreduce_params: list[str] = field(default_factory=list)
    """Names of the replicated parameters whose gradients ``sync(..., param_grads=True)`` sums."""
    grad_allreduce_group: TPGroup | None = None
    """The group those gradients are summed over; None without ``sync(..., param_grads=True)``."""
    grad_replica_params: list[str] = field(default_factory=list)
    """Names of the parameters sharded with replicas (key/value heads on more ranks than heads)."""
    grad_replica_group: TPGroup | None = None
    """The replica sub-group their gradients are summed over; None without replicas."""
    grad_block_replicas: dict[str, tuple[int, list[int], tuple[int, ...]]] = field(default_factory=dict)
    """``{parameter name: (axis, local block sizes, replicas per block)}`` of a shard whose blocks are partly
    replicated (a fused multi-query projection); a dotted name is a child's parameter the forward reads."""
    grad_block_group: TPGroup | None = None
    """The group the replicated blocks' gradients are summed over."""
    bias_rank: int = 0
    """The rank that adds the bias of a partial-sum experts module (:mod:`slapo_lab.sharding.experts`)."""
    vocab_start: int | None = None
    """The first vocabulary row this rank holds, of a vocab-parallel embedding; None otherwise."""
    orig_padding_idx: int | None = None
    """The embedding's ``padding_idx`` before a vocab-parallel shard (the full layer's, for init); None
    otherwise or when it had none."""
    feature_local: int | None = None
    """Of a norm whose features are sharded (:mod:`slapo_lab.sharding.feature_stats`): the features this rank
    holds; None otherwise."""
    feature_factor: int | None = None
    """Of the same norm: full features / local features."""
    mixer_attrs: dict[str, list[int]] | None = None
    """``{attribute: [global, local]}`` of a channel mixer's width attributes divided by the world size
    (:mod:`slapo_lab.sharding.mixers`); None until they are."""
    attention_heads: dict[str, Any] | None = None
    """The record of an attention module's head attributes rewritten to this rank's share
    (:func:`slapo_lab.sharding.heads.localise_heads`): ``{"heads", "kv_heads", "world_size", "attrs":
    {attribute: [global, local]}}`` and, where they apply, ``"config"``, ``"width"`` and ``"inputs"``; None
    until then."""
    feature_inputs: list[str] = field(default_factory=list)
    """The per-feature arguments this module's input slicer cuts to the rank's features
    (:mod:`slapo_lab.sharding.feature_inputs`)."""

    def copy_containers(self, copy_value: Callable[[Any], Any]) -> ModuleMeta:
        """A new state whose fields are ``copy_value`` of these (the containers a primitive changes in place)."""
        new = object.__new__(ModuleMeta)
        new.__dict__.update({k: copy_value(v) for k, v in self.__dict__.items()})
        return new


def module_meta(mod: nn.Module) -> ModuleMeta:
    """The module's :class:`ModuleMeta`, created with every field at its default on first use."""
    meta = mod.__dict__.get(META_ATTR)
    if meta is None:
        meta = ModuleMeta()
        mod.__dict__[META_ATTR] = meta
    return meta


def peek_meta(mod: nn.Module) -> ModuleMeta | None:
    """The module's :class:`ModuleMeta`, or None if no primitive touched it (no side effect)."""
    return mod.__dict__.get(META_ATTR)


def syncs_of(mod: nn.Module) -> list[tuple[str, str]]:
    """``(mode, op)`` of each sync on ``mod`` itself, in the order they were made (``[]`` for none)."""
    meta = peek_meta(mod)
    return list(meta.syncs) if meta else []


def has_sequence_parallel(root: nn.Module) -> bool:
    """Whether any module under ``root`` reduce-scatters its output: a row-parallel layer under sequence
    parallelism (``sync(mode="fwd_post", sync_op_or_fn="reduce_scatter")``, the only mode that op takes)."""
    return any(("fwd_post", "reduce_scatter") in syncs_of(m) for m in root.modules())


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
    from .sharding.sync_ops import all_reduce_backward  # noqa: PLC0415 - sharding imports module_state

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
    from .sharding.sync_ops import all_reduce_backward  # noqa: PLC0415 - sharding imports module_state

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
    meta: ModuleMeta = self.__dict__[META_ATTR]
    impl = meta.impl
    fn = functools.partial(impl, self) if impl is not None else type(self).forward.__get__(self)
    group = meta.grad_allreduce_group
    if group is not None:
        fn = _with_param_grad_all_reduce(self, fn, meta.grad_allreduce_params, group)
    group = meta.grad_replica_group
    if group is not None:
        fn = _with_param_grad_all_reduce(self, fn, meta.grad_replica_params, group, sharded=True)
    if meta.grad_block_replicas:
        fn = _with_block_grad_all_reduce(self, fn, meta.grad_block_replicas, meta.grad_block_group)
    if meta.fork_rng:
        inner = fn

        def fn(*a, **k):  # deliberate rebinding
            with get_cuda_rng_tracker().fork():
                return inner(*a, **k)

    if meta.checkpoint and torch.is_grad_enabled():
        _ckpt = checkpoint_selective if meta.checkpoint_policy == "selective" else checkpoint

        args, kwargs = without_kv_cache(args, kwargs)
        order = meta.order_args_fn
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
