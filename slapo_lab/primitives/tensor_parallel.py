"""Tensor-parallel primitives: ``shard``, ``sync``, ``fork_rng``.

Semantics follow Slapo (``slapo/primitives/shard.py``, ``sync.py``, ``fork_rng.py``) with
Megatron-LM's communication pairs (see :mod:`slapo_lab.sharding.sync_ops`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import ScheduleError
from ..module_state import ModuleMeta, install_forward, module_meta, peek_meta
from ..sharding import attention_site as _attention_site
from ..sharding import experts as _experts  # noqa: F401 - registers the 3-D experts shard rule
from ..sharding import feature_stats as _feature_stats  # noqa: F401 - registers the feature-axis norm rule
from ..sharding import infer as _infer
from ..sharding import sync_ops
from ..sharding import train_caches as _train_caches
from ..sharding.router import router_experts
from ..sharding.rules import (
    ShardSite,
    block_replicas,
    block_sizes,
    fused_layout,
    get_shard_rule,
    local_shard,
    shard_replicas,
    stride_key,
)
from .base import Primitive, register_primitive

if TYPE_CHECKING:
    from ..schedule import Schedule

SYNC_MODES = ("fwd_pre", "fwd_post", "bwd_post")
SYNC_OPS = ("all_reduce", "all_gather", "reduce_scatter", "scatter")


def _where(sch) -> str:
    return sch.path or "the root module"


def _tensor(sch, tensor_name: Any) -> torch.Tensor:
    if not isinstance(tensor_name, str):
        raise ScheduleError(f"shard() takes a parameter or buffer name as a string, not {tensor_name!r}.")
    mod = sch.mod
    t = (
        mod._parameters.get(tensor_name, None)
        if tensor_name in mod._parameters
        else mod._buffers.get(tensor_name)
    )
    if t is None:
        names = [n for n, v in list(mod._parameters.items()) + list(mod._buffers.items()) if v is not None]
        have = ", ".join(names) if names else "no parameters or buffers of its own"
        raise ScheduleError(
            f"{_where(sch)} ({type(mod).__name__}) has no parameter or buffer named {tensor_name!r}; it has {have}."
        )
    return t


def _owners(sch, tensor: torch.Tensor) -> list[tuple[nn.Module, str]]:
    owners = sch.owners_of(tensor)
    return owners or [(sch.mod, "")]


def _sites(sch, t: torch.Tensor, tensor_name: str) -> list[ShardSite]:
    """One :class:`ShardSite` per owner of ``t`` (tied tensors have several), with each owner's parent."""
    owners = _owners(sch, t)
    top = sch.get_top_schedule().mod
    parents: dict[int, tuple[nn.Module, str, str]] = {}
    if any(mod is not sch.mod for mod, _ in owners):
        for ppath, pmod in top.named_modules():
            for cname, cmod in pmod.named_children():
                parents.setdefault(id(cmod), (pmod, cname, f"{ppath}.{cname}" if ppath else cname))
    sites = []
    for mod, name in owners:
        if mod is sch.mod:
            parent, cname, path = (sch.parent.mod if sch.parent is not None else None), sch.name, sch.path
        else:
            parent, cname, path = parents.get(id(mod), (None, "", ""))
        parent, cname = _attention_site.lift(top, path, parent, cname)  # a projection in a wrapper (LeViT)
        sites.append(ShardSite(mod, name or tensor_name, parent, cname, path, getattr(sch, "tp", None)))
    return sites


def _rule_hook(site: ShardSite, name: str):
    """The rule's optional site-aware method ``name`` (rules written before it existed lack it), or None."""
    return getattr(get_shard_rule(site.mod), name, None)


def _stride(sites: list[ShardSite], axis: int, full: str) -> int:
    """The tensor's ``shard_stride`` (an int, or a :class:`~slapo_lab.sharding.rules.BlockStride` of unequal
    blocks), the same for every owner."""
    strides = {}
    for s in sites:
        v = (_rule_hook(s, "stride") or (lambda site, ax: 1))(s, axis)
        strides.setdefault(stride_key(v), v)
    if len(strides) > 1:
        raise ScheduleError(
            f"Cannot shard {full} on axis {axis}: the modules it is tied to store it in different layouts "
            f"(strides {sorted(map(repr, strides.values()))})."
        )
    return next(iter(strides.values()))


def _replicas(sites: list[ShardSite], axis: int, ws: int, full: str) -> int:
    """On how many ranks each chunk of the tensor is replicated (:func:`~slapo_lab.sharding.rules.kv_replicas`
    for a key / value projection with fewer key/value heads than ranks), the same for every owner."""
    found = {shard_replicas(s, axis, ws) for s in sites}
    if len(found) > 1:
        raise ScheduleError(
            f"Cannot shard {full} on axis {axis}: the modules it is tied to would replicate it on different "
            f"numbers of ranks ({', '.join(map(str, sorted(found)))})."
        )
    return found.pop()


def check_shard(sch: Schedule, tensor_name: str, axis: int) -> tuple[torch.Tensor, int]:
    """Validate a shard call; return the tensor and the normalised axis (raises ScheduleError)."""
    t = _tensor(sch, tensor_name)
    full = f"{sch.path + '.' if sch.path else ''}{tensor_name}"
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise ScheduleError(f"The shard axis of {full} must be an integer, not {axis!r}.")
    _refuse_router(sch, full)
    if not -t.dim() <= axis < t.dim():
        raise ScheduleError(
            f"Cannot shard {full} on axis {axis}: it has shape {tuple(t.shape)}, so the axis must be in "
            f"[{-t.dim()}, {t.dim() - 1}]."
            if t.dim()
            else f"Cannot shard {full}: it is a scalar."
        )
    axis = axis % t.dim()
    _refuse_sharded_again(sch, t, tensor_name, full)
    ws = sch.world_size
    _infer.ensure(sch)  # layouts of fused projections, read from the model's dataflow before its first shard
    sites = _sites(sch, t, tensor_name)
    for site in sites:  # attention heads first: the more telling reason
        check_site = _rule_hook(site, "check_site")
        reason = check_site(site, axis, ws) if check_site else None
        if reason:
            raise ScheduleError(f"Cannot shard {full} on axis {axis} across {ws} ranks: {reason}.")
    _check_divisible(t, full, axis, ws, sites)
    for mod, name in _owners(sch, t):
        reason = get_shard_rule(mod).check(mod, name or tensor_name, axis)
        if reason:
            raise ScheduleError(f"Cannot shard {full} on axis {axis}: {reason}.")
    return t, axis


def _refuse_router(sch: Schedule, full: str) -> None:
    """Raise ScheduleError when ``sch`` is a mixture-of-experts router (which stays whole)."""
    experts = router_experts(sch.mod, sch.parent.mod if sch.parent is not None else None)
    if experts is None:
        return
    bank = f" of {sch.parent.path + '.' if sch.parent.path else ''}{experts}" if experts else ""
    raise ScheduleError(
        f"Cannot shard {full}: {_where(sch)} is the mixture-of-experts router{bank} (it scores every expert "
        "for every token, and the softmax and top-k choice need all the scores on every rank), so it stays "
        "whole."
    )


def _refuse_sharded_again(sch: Schedule, t: torch.Tensor, tensor_name: str, full: str) -> None:
    """Raise ScheduleError for a tensor already sharded (here or through a tie), or kept replicated by
    ``sync(param_grads=True)``."""
    meta = peek_meta(sch.mod)
    if meta and tensor_name in meta.sharded:
        raise ScheduleError(
            f"{full} is already sharded on axis {meta.sharded[tensor_name]}; shard each tensor once."
        )
    if getattr(t, "shard_axis", None) is not None:
        raise ScheduleError(
            f"{full} is already sharded on axis {t.shard_axis} (it is tied to a sharded tensor)."
        )
    if meta and tensor_name in meta.grad_allreduce_params:
        raise ScheduleError(
            f"{full} has its gradient all-reduced by sync(param_grads=True) (a replicated parameter under "
            "sequence parallelism), so it must stay replicated."
        )


def _check_divisible(t: torch.Tensor, full: str, axis: int, ws: int, sites: list[ShardSite]) -> None:
    """Raise ScheduleError unless ``t``'s size on ``axis`` splits over ``ws`` ranks: into whole key/value heads
    when replicated, block by block for a fused projection, else evenly."""
    stride = _stride(sites, axis, full)
    replicas = _replicas(sites, axis, ws, full)
    if replicas > 1:  # one whole key/value head per rank, shared by `replicas` ranks
        if t.shape[axis] % (ws // replicas):
            raise ScheduleError(
                f"Cannot shard {full} on axis {axis}: size {t.shape[axis]} is not divisible by its "
                f"{ws // replicas} key/value heads."
            )
    elif stride > 1:
        _check_fused_blocks(t, full, axis, ws, stride, sites)
    if replicas == 1 and t.shape[axis] % ws:
        raise ScheduleError(
            f"Cannot shard {full} on axis {axis}: size {t.shape[axis]} is not divisible by the world size {ws}."
        )


def _check_fused_blocks(
    t: torch.Tensor, full: str, axis: int, ws: int, stride: int, sites: list[ShardSite]
) -> None:
    """Raise ScheduleError when a block of a fused projection (``stride`` blocks back to back) does not split
    over ``ws`` ranks."""
    sizes = block_sizes(t.shape[axis], stride)
    odd = next((b for b in sizes if b % ws), None)
    if odd is None:
        return
    what = (
        f"{len(sizes)} projections of size {sizes[0]}"
        if len(set(sizes)) == 1
        else f"{len(sizes)} projections of sizes {', '.join(map(str, sizes))}"
    )
    lay = fused_layout(sites[0])
    label = {"kv": "fused k, v", "gate_up": "fused gate and up"}.get(
        lay.parts if lay is not None else "", "fused q, k, v"
    )
    raise ScheduleError(
        f"Cannot shard {full} on axis {axis}: it stores {what} back to back ({label}), and "
        f"{odd} is not divisible by the world size {ws}."
    )


@register_primitive()
class ShardPrimitive(Primitive):
    """Split a parameter or buffer into ``world_size`` equal chunks along ``axis`` and keep this rank's.

    The module's shard rule keeps it consistent (``Linear.out_features`` ...) and records its output
    type (``partition`` along an axis, or ``partial`` sums that need a reduce). Tied tensors stay tied:
    every module holding the same tensor receives the same shard. The new parameter carries
    ``orig_shape`` (the full ``torch.Size``), ``shard_axis`` and ``shard_stride``.

    A fused projection that stores several blocks back to back on ``axis`` (GPT-2's ``c_attn``: q, k, v;
    Phi-3's ``gate_up_proj``: gate, up) is sharded *strided* (``shard_stride`` = 3, 2): this rank keeps its
    chunk of each block, so it holds whole heads of q, k and v. Blocks of unequal sizes (Phi-3's ``qkv_proj``
    with fewer key/value heads) give a :class:`~slapo_lab.sharding.rules.BlockStride` (an int, the number
    of blocks, carrying the sizes). A fused projection whose parts are interleaved per head (BLOOM's
    ``query_key_value``) or per key/value group (Falcon's with ``new_decoder_architecture``) is a plain
    contiguous shard of whole heads / groups (:func:`slapo_lab.sharding.rules.fused_layout`). An attention
    projection's head features must split into whole heads (and whole key/value heads under grouped-query
    attention) on every rank; Falcon's multi-query attention (one key/value head) is refused.

    More ranks than key/value heads (``kv < ws``, ``ws % kv == 0``, heads divisible by ``ws``): a separate
    ``k_proj`` / ``v_proj`` weight (axis 0) and bias are split into ``kv`` chunks of one whole head, and rank
    ``i`` keeps head ``i // r`` (``r = ws / kv``; the parameter carries ``shard_replicas = r``), the head its
    query heads ``[i*H/ws, (i+1)*H/ws)`` use. Its weight gradient, a partial sum over the ``r`` ranks sharing
    it, is all-reduced over that replica group in backward
    (:meth:`~slapo_lab.sharding.sync_ops.TPGroup.replica_group`). Sources: Megatron-LM
    ``megatron/core/transformer/attention.py``, vLLM ``vllm/model_executor/layers/linear.py``
    ``QKVParallelLinear`` (``num_kv_head_replicas``). Fused q/k/v projections do not replicate (refused as
    before: "the 2 key/value heads do not divide by 4").

    Raises:
        ScheduleError: unknown tensor name, non-integer or out-of-range axis, a size (or a fused block) not
            divisible by the world size, attention heads (or key/value heads) not divisible by the world
            size (key/value heads that divide it are replicated instead), heads that cannot be split
            (multi-query attention), a tensor already sharded, or a shard the module's rule refuses.
    """

    name = "shard"
    positional = 1

    @classmethod
    def check(cls, sch: Schedule, tensor_name: str, axis: int) -> None:
        check_shard(sch, tensor_name, axis)

    @staticmethod
    def apply(sch: Schedule, tensor_name: str, axis: int) -> torch.Tensor:
        t, axis = check_shard(sch, tensor_name, axis)
        ws, rank = sch.world_size, sch.rank
        owners = _owners(sch, t)
        sites = _sites(sch, t, tensor_name)
        stride = _stride(sites, axis, tensor_name)
        replicas = _replicas(sites, axis, ws, tensor_name)
        new = _local_shard_of(t, axis, ws, rank, stride, replicas)
        for mod, name in owners:
            _put_shard(sch, mod, name or tensor_name, new, axis, stride, replicas)
        for site in sites:
            apply_site = _rule_hook(site, "apply_site")
            if apply_site:
                apply_site(site, axis, ws, rank)
        sch._note_replaced(t, new)
        if len(owners) > 1:
            sch.metadata.tie_weights[new] = [m for m, _ in owners]
        return new


def _local_shard_of(
    t: torch.Tensor, axis: int, ws: int, rank: int, stride: int, replicas: int
) -> torch.Tensor:
    """This rank's shard of ``t`` (a parameter like ``t``, its annotations kept), carrying ``orig_shape``,
    ``shard_axis``, ``shard_stride`` and, for a replicated key/value head, ``shard_replicas``."""
    with torch.no_grad():
        chunk = local_shard(t.detach(), axis, ws, rank, stride, replicas).clone() if ws > 1 else t.detach()
    if isinstance(t, nn.Parameter):
        new = nn.Parameter(chunk, requires_grad=t.requires_grad)
        for k, v in t.__dict__.items():  # annotations survive
            new.__dict__.setdefault(k, v)
    else:
        new = chunk
    new.orig_shape = t.shape
    new.shard_axis = axis
    new.shard_stride = stride
    if replicas > 1:
        new.shard_replicas = replicas
    return new


def _put_shard(
    sch: Schedule, mod: nn.Module, name: str, new: torch.Tensor, axis: int, stride: int, replicas: int
) -> None:
    """Put the shard ``new`` in ``mod`` as ``name``, let the module's shard rule adapt it, and all-reduce the
    gradients of shards that several ranks hold."""
    ws, rank = sch.world_size, sch.rank
    if name in mod._parameters:
        mod._parameters[name] = new
    else:
        mod._buffers[name] = new
    module_meta(mod).sharded[name] = axis
    rule = get_shard_rule(mod)
    if getattr(rule, "needs_group", False):  # a rule whose forward communicates (feature_stats)
        module_meta(mod).tp_group = sch.tp
    rule.apply(mod, name, axis, ws, rank)
    # a value the module cached from the unsharded parameter for eval (LeViT's attention biases)
    _train_caches.drop(mod)
    trainable = isinstance(new, nn.Parameter) and new.requires_grad
    if replicas > 1 and trainable:
        _install_replica_grad_all_reduce(mod, name, sch.tp.replica_group(replicas))
    block_reps = block_replicas(stride, int(stride), ws) if ws > 1 else ()
    if max(block_reps, default=1) > 1 and trainable:
        _install_block_replica_grad_all_reduce(
            mod, name, axis, stride, ws, sch.tp.replica_group(max(block_reps))
        )


def _register_custom_sync(mod: nn.Module, meta: ModuleMeta, mode: str, fn: Callable[..., Any]) -> None:
    """Register the user's hook ``fn`` as the ``mode`` kind of hook of ``mod``."""
    if mode == "fwd_pre":
        h = mod.register_forward_pre_hook(fn)
    elif mode == "fwd_post":
        h = mod.register_forward_hook(fn)
    else:
        h = mod.register_full_backward_hook(fn)
    meta.hooks.append(h)
    meta.syncs.append((mode, getattr(fn, "__name__", "custom")))


def _input_grad_all_reduce(g: Any) -> Callable[..., Any]:
    """A forward-pre hook (with kwargs) routing every floating input through ``all_reduce_backward`` on ``g``
    (Megatron's ``f``: the input gradients are summed over the ranks)."""

    def pre(module, args, kw):
        wrap = lambda x: (
            sync_ops.all_reduce_backward(x, g)
            if (isinstance(x, torch.Tensor) and x.is_floating_point())
            else x
        )
        return tuple(wrap(a) for a in args), {k: wrap(v) for k, v in kw.items()}

    return pre


def _first_input_through(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A forward-pre hook (with kwargs) passing the module's first tensor input through ``fn``."""

    def pre(module, args, kw):
        idx = _first_tensor_index(args, kw)
        if idx is None:
            return None
        if idx[0] == "arg":
            args = (*args[: idx[1]], fn(args[idx[1]]), *args[idx[1] + 1 :])
        else:
            kw = dict(kw)
            kw[idx[1]] = fn(kw[idx[1]])
        return args, kw

    return pre


def _install_output_sync(mod: nn.Module, meta: ModuleMeta, op: str, fn: Callable[..., Any]) -> None:
    """Apply the sync ``fn`` to ``mod``'s output: before the bias add for a reduce of a sharded
    implementation's partial sums, else by a forward hook."""
    if meta.output_type == "partial" and meta.impl is not None and op in ("all_reduce", "reduce_scatter"):
        meta.partial_reducers.append(fn)  # reduce before the bias add
    else:
        meta.hooks.append(mod.register_forward_hook(lambda module, a, out: _map_output(out, fn)))


def _first_tensor_index(args, kwargs):
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            return ("arg", i)
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            return ("kw", k)
    return None


def _map_output(out, fn):
    """Apply ``fn`` to the module output's primary tensor (itself, first tuple item, first dict value)."""
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        new0 = fn(out[0])
        if hasattr(out, "_fields"):
            return type(out)(new0, *out[1:])
        return (new0, *out[1:])
    if isinstance(out, list) and out and isinstance(out[0], torch.Tensor):
        return [fn(out[0]), *out[1:]]
    if isinstance(out, dict) and out:
        k = next(iter(out))
        if isinstance(out[k], torch.Tensor):
            out[k] = fn(out[k])
    return out


def _op_fn(op: str, sch, kw: dict):
    g = sch.tp
    axis = kw.get("axis", -1)
    if op == "all_reduce":
        return lambda x: sync_ops.all_reduce_forward(x, g)
    if op == "all_gather":
        tpo = kw.get("tensor_parallel_output_grad", True)
        return lambda x: sync_ops.all_gather(x, axis, g, tpo)
    if op == "reduce_scatter":
        return lambda x: sync_ops.reduce_scatter(x, axis, g)
    return lambda x: sync_ops.scatter(x, axis, g)


def _has_shard_below(mod: nn.Module) -> bool:
    for m in mod.modules():
        meta = peek_meta(m)
        if meta and meta.sharded:
            return True
    return False


_OP_KWARGS = {
    "all_reduce": {"param_grads"},
    "all_gather": {"axis", "tensor_parallel_output_grad"},
    "reduce_scatter": {"axis"},
    "scatter": {"axis"},
}
PARAM_GRADS_OP = "all_reduce_param_grads"  # the label of sync(..., param_grads=True) in ModuleMeta.syncs


def _replicated_params(mod: nn.Module) -> list[str]:
    """Names of ``mod``'s own trainable parameters that are not sharded."""
    return [
        n
        for n, p in mod._parameters.items()
        if p is not None and p.requires_grad and getattr(p, "shard_axis", None) is None
    ]


def _check_param_grads(sch, mode, value) -> None:
    where = _where(sch)
    if value is not True:
        raise ScheduleError(f"param_grads must be True (or left out), not {value!r}.")
    if mode != "bwd_post":
        raise ScheduleError(
            f"param_grads=True all-reduces parameter gradients in backward, so it needs mode='bwd_post', "
            f"not {mode!r}."
        )
    meta = peek_meta(sch.mod)
    if meta and ("bwd_post", PARAM_GRADS_OP) in meta.syncs:
        raise ScheduleError(
            f"{where} already all-reduces its parameter gradients; a second one would apply it twice."
        )
    if not _replicated_params(sch.mod):
        raise ScheduleError(
            f"{where} ({type(sch.mod).__name__}) has no replicated trainable parameters of its own, so there is "
            "no parameter gradient to all-reduce."
        )


def check_sync(
    sch: Schedule, mode: str, sync_op_or_fn: str | Callable[..., Any], kwargs: dict[str, Any]
) -> None:
    """Validate a sync call (raises ScheduleError with one sentence)."""
    if mode not in SYNC_MODES:
        raise ScheduleError(f"Unknown sync mode {mode!r}; use one of {', '.join(SYNC_MODES)}.")
    if callable(sync_op_or_fn):
        if kwargs:
            raise ScheduleError("A custom sync function takes no extra keyword arguments.")
        return
    op = sync_op_or_fn
    _check_sync_op(op, kwargs)
    if "param_grads" in kwargs:
        _check_param_grads(sch, mode, kwargs["param_grads"])
        return
    if mode == "bwd_post" and op != "all_reduce":
        raise ScheduleError(f"bwd_post supports only all_reduce (got {op}).")
    meta = peek_meta(sch.mod)
    if meta and (mode, op) in meta.syncs:
        raise ScheduleError(f"{_where(sch)} already has a {mode} {op}; a second one would apply it twice.")
    _check_sync_fits_output(sch, mode, op, meta)
    if mode == "fwd_pre" and op in ("all_reduce", "reduce_scatter"):
        raise ScheduleError(f"fwd_pre supports all_gather and scatter on the input, not {op}.")


def _check_sync_op(op: str, kwargs: dict[str, Any]) -> None:
    """Raise ScheduleError for an unknown sync op, a keyword it does not take, or a non-integer axis."""
    if op not in SYNC_OPS:
        raise ScheduleError(f"Unknown sync op {op!r}; use one of {', '.join(SYNC_OPS)} or a callable hook.")
    extra = set(kwargs) - _OP_KWARGS[op]
    if extra:
        raise ScheduleError(f"sync op {op} does not take {', '.join(sorted(extra))}.")
    if "axis" in kwargs and (isinstance(kwargs["axis"], bool) or not isinstance(kwargs["axis"], int)):
        raise ScheduleError(f"The sync axis must be an integer, not {kwargs['axis']!r}.")


def _check_sync_fits_output(sch: Schedule, mode: str, op: str, meta: ModuleMeta | None) -> None:
    """Raise ScheduleError for a sync that contradicts what the module's sharding makes of its output: a
    reduce with nothing sharded below, a reduce of partitioned slices, a gather of partial sums, or an
    all-reduced input gradient of a row-parallel layer."""
    where = _where(sch)
    out_type = meta.output_type if meta else None
    if op == "all_reduce" and not _has_shard_below(sch.mod):
        raise ScheduleError(
            f"{where} has no sharded parameters, so its {'output' if mode == 'fwd_post' else 'input gradient'} "
            f"is already complete on every rank and an all_reduce would multiply it by {sch.world_size}; "
            "shard a parameter first."
        )
    if mode == "fwd_post" and op in ("all_reduce", "reduce_scatter") and out_type == "partition":
        raise ScheduleError(
            f"{where} has a partitioned output (its weight is split on the output features), so an {op} would "
            "sum different slices; use all_gather, or shard the weight on the input axis for a partial sum."
        )
    if mode == "fwd_post" and op in ("all_gather", "scatter") and out_type == "partial":
        raise ScheduleError(
            f"{where} produces partial sums (row parallel), so its output needs all_reduce or reduce_scatter, "
            f"not {op}."
        )
    if mode == "bwd_post" and out_type == "partial" and not meta.replicated_input:
        raise ScheduleError(
            f"{where} is row parallel: its input is already split, so its input gradient must not be "
            "all-reduced; put bwd_post all_reduce on the column-parallel layer before it."
        )


@register_primitive()
class SyncPrimitive(Primitive):
    """Insert a tensor-parallel synchronisation at a module boundary.

    Modes: ``fwd_pre`` (on the module's first tensor input: ``all_gather``, ``scatter``), ``fwd_post``
    (on its output's primary tensor: ``all_reduce``, ``all_gather(axis, tensor_parallel_output_grad)``,
    ``reduce_scatter(axis)``, ``scatter(axis)``), ``bwd_post`` (``all_reduce`` of the module's input
    gradients: Megatron's ``f``). A callable registers a custom hook of that kind. A row-parallel
    layer with a bias reduces *before* adding the bias. In simulated planning the ops change only
    shapes.

    ``sync(mode="bwd_post", sync_op_or_fn="all_reduce", param_grads=True)`` instead all-reduces the
    gradients of the module's own *replicated* (unsharded) parameters. Sequence parallelism needs it:
    a LayerNorm, or the bias of a row-parallel layer followed by ``reduce_scatter``, sees only this
    rank's part of the sequence, so each rank's gradient of its replicated parameters is a partial sum
    (Megatron all-reduces these "sequence_parallel" gradients after backward). Here each forward call
    routes those parameters through an identity whose backward all-reduces, so the gradients are exact
    as soon as ``backward()`` returns, with no change to the training loop; the parameters get the
    annotation ``sequence_parallel = True``.

    Raises:
        ScheduleError: unknown mode/op/kwargs, a duplicate sync, or a combination that contradicts the
            module's output type (e.g. all_reduce after a column-parallel layer).
    """

    name = "sync"
    positional = 0

    @classmethod
    def check(cls, sch: Schedule, mode: str, sync_op_or_fn: str | Callable[..., Any], **kwargs: Any) -> None:
        check_sync(sch, mode, sync_op_or_fn, kwargs)

    @staticmethod
    def apply(sch: Schedule, mode: str, sync_op_or_fn: str | Callable[..., Any], **kwargs: Any) -> None:
        check_sync(sch, mode, sync_op_or_fn, kwargs)
        mod = sch.mod
        meta = module_meta(mod)
        if callable(sync_op_or_fn):
            _register_custom_sync(mod, meta, mode, sync_op_or_fn)
            return
        op = sync_op_or_fn
        g = sch.tp
        if kwargs.get("param_grads"):
            _install_param_grad_all_reduce(sch.mod, g)
            return
        if mode == "bwd_post":
            meta.hooks.append(mod.register_forward_pre_hook(_input_grad_all_reduce(g), with_kwargs=True))
        elif mode == "fwd_pre":
            meta.hooks.append(
                mod.register_forward_pre_hook(_first_input_through(_op_fn(op, sch, kwargs)), with_kwargs=True)
            )
        else:
            _install_output_sync(mod, meta, op, _op_fn(op, sch, kwargs))
        meta.syncs.append((mode, op))
        if mode == "fwd_post" and op in ("all_reduce", "all_gather"):
            meta.output_synced = True


def _install_param_grad_all_reduce(mod: nn.Module, g) -> None:
    """Make every forward call of ``mod`` read its replicated parameters through ``all_reduce_backward``.

    The composed forward (:func:`slapo_lab.module_state.slapo_forward`, installed here) runs the module with
    each replicated parameter swapped for ``all_reduce_backward(param, g)`` (identity forward, all-reduced
    gradient) for the duration of the call, so outside a forward call the module holds its ordinary
    parameters and the gradients land, already summed, on them. The swap happens inside the composed forward,
    not in forward hooks: an activation checkpoint of the module (or of a block around it) then recomputes it
    too, and ``torch.compile`` traces it without a graph break (Dynamo refuses a hook that writes
    ``module._parameters`` inside a checkpoint). The instance ``forward`` survives ``copy.deepcopy``.
    """
    meta = module_meta(mod)
    names = _replicated_params(mod)
    meta.grad_allreduce_params = list(names)
    meta.grad_allreduce_group = g
    for n in names:
        mod._parameters[n].sequence_parallel = True
    install_forward(mod)
    meta.syncs.append(("bwd_post", PARAM_GRADS_OP))


def _install_replica_grad_all_reduce(mod: nn.Module, name: str, g) -> None:
    """Sum the gradient of ``mod``'s replicated shard ``name`` over its replica group ``g``.

    A key/value head held by ``r`` ranks (``shard_replicas``) gets, on each of them, the gradient from that
    rank's own query heads only: a partial sum over the replica group (Megatron-LM all-reduces it the same
    way). Each forward call reads the parameter through
    :func:`~slapo_lab.sharding.sync_ops.all_reduce_backward` on ``g`` (identity forward, summed gradient), by
    the same parameter swap as ``sync(..., param_grads=True)`` (:func:`_install_param_grad_all_reduce`), so the
    gradient is exact when ``backward()`` returns and the reduce survives checkpointing, deep copies and
    ``torch.compile``. The forward and the input gradient need nothing more: the column-parallel ``f`` already
    sums the input gradient over all tensor-parallel ranks, each contributing its own query heads' part.
    """
    meta = module_meta(mod)
    names = meta.grad_replica_params
    if name not in names:
        names.append(name)
    meta.grad_replica_group = g
    install_forward(mod)


def _install_block_replica_grad_all_reduce(mod: nn.Module, name: str, axis: int, stride, ws: int, g) -> None:
    """Sum the gradient of the replicated blocks of ``mod``'s shard ``name`` over the replica group ``g``.

    A fused multi-query projection (a :class:`~slapo_lab.sharding.rules.BlockStride` with ``replicas``: its
    query block split, its key/value blocks held by ``r`` ranks each) gets, on each rank, its own query heads'
    gradient for the key/value head it shares: a partial sum over the replica group, as for
    :func:`_install_replica_grad_all_reduce`; the split query block's gradient is this rank's alone. Each
    forward reads the parameter as its blocks concatenated, the replicated ones through
    :func:`~slapo_lab.sharding.sync_ops.all_reduce_backward` on ``g``.
    """
    sizes = block_sizes(int(sum(stride.sizes)), stride)
    reps = block_replicas(stride, len(sizes), ws)
    meta = module_meta(mod)
    meta.grad_block_replicas[name] = (
        axis,
        [s * r // ws for s, r in zip(sizes, reps, strict=False)],
        reps,
    )
    meta.grad_block_group = g
    install_forward(mod)


@register_primitive()
class ForkRNGPrimitive(Primitive):
    """Run the module's forward under the tensor-parallel RNG tracker's fork (dropout in a TP region).

    The fork swaps the global RNG state, which ``torch.compile`` does not trace: a module with ``fork_rng``
    (or a block around it) compiles only without ``fullgraph=True``, and Dynamo then runs it eagerly.

    Raises:
        ScheduleError: if already applied.
    """

    name = "fork_rng"

    @staticmethod
    def apply(sch: Schedule) -> None:
        meta = peek_meta(sch.mod)
        if meta and meta.fork_rng:
            raise ScheduleError(f"{_where(sch)} already runs under fork_rng().")
        module_meta(sch.mod).fork_rng = True
        install_forward(sch.mod)
