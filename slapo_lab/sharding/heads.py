"""Per-rank head counts of a tensor-parallel attention module.

When an attention module's q / k / v projections are column parallel (or its output projection row
parallel, or a per-head table such as T5's ``relative_attention_bias`` split on its heads axis), each rank
computes ``heads / world_size`` whole heads. HF attention classes that reshape with ``-1`` heads (BERT,
RoBERTa, GPT-2, Llama in transformers 5.x) need nothing more, but several keep the head count in an
attribute and read it at run time: ``OPTAttention.forward`` views q/k/v as ``(batch, -1, self.num_heads,
head_dim)`` (a global count silently folds heads into the sequence axis), ``GPTNeoSelfAttention._split_heads``
views as ``self.num_heads`` heads (crashes), ``T5Attention.forward`` builds a ``(1, self.n_heads, q, k)``
zero position bias for cross attention. Those attributes must hold this rank's numbers (Megatron-LM's
``ParallelAttention.num_attention_heads_per_partition``).

With fewer key/value heads than ranks each rank holds one key/value head, replicated on ``ws / kv`` ranks
(:func:`slapo_lab.sharding.rules.kv_replicas`): its key/value head counts become 1 and, where the class keeps
one, ``num_key_value_groups`` (query heads per key/value head, read by HF's ``repeat_kv``) becomes
``heads / ws`` (:func:`local_counts`).

Which attributes a class treats as per-rank comes from two sources, unioned:

* the registry (:func:`register_attention_heads`): the attributes a class defines as head counts or as the
  heads x head_dim width (``OPTAttention``: ``num_heads``, ``embed_dim``; ``T5Attention``: ``n_heads``,
  ``inner_dim`` ...), including ones only ``__init__`` reads, so the per-rank module describes itself;
* detection: every known head-count / head-width attribute name (:data:`HEAD_ATTRS`, :data:`KV_HEAD_ATTRS`,
  :data:`WIDTH_ATTRS`) that the class's methods other than ``__init__`` read as ``self.<name>`` (found by
  parsing the class source with :mod:`ast`; a class without source counts as reading all of them).

A class whose run-time code reads a head count from its ``config`` (shared by every layer and rank, so it
cannot hold a per-rank number) -- found by the same parsing (:func:`config_head_keys`), or registered
(:data:`CONFIG_HEADS`, :func:`register_config_heads`: Phi-3's ``Phi3Attention.forward`` slices its fused
``qkv_proj`` output at ``self.config.num_attention_heads * self.head_dim``) -- gets its own shallow copy of
the config holding this rank's counts (the model's and the other layers' config stay global). A config count
or a head-count attribute that disagrees with the module's heads is refused with one sentence before anything
changes.

Some attention classes take a per-head tensor that the *model* builds for all heads: BLOOM's ALiBi bias
(``BloomModel.build_alibi_tensor``: ``(batch x heads, 1, keys)``, consumed by ``BloomAttention.forward`` as
``alibi.baddbmm(...)`` over ``batch x self.num_heads`` rows) and Falcon's with ``alibi=True`` (``FalconModel``
folds it into a ``(batch, heads, queries, keys)`` attention mask and passes ``(batch, heads, 1, keys)``). Those
arguments (:data:`PER_HEAD_INPUTS`) are cut to this rank's heads by a forward pre-hook on the attention
module, so each rank adds its own heads' slopes.

The rewrite is recorded in the attention module's ``ModuleMeta.attention_heads`` (``{"heads",
"kv_heads", "world_size", "attrs": {name: [global, local]}}``, plus ``"config": {key: [global, local]}``
and ``"inputs": [argument names]`` when those apply) and happens inside the ``shard`` primitive, so replay,
undo and exported scripts reproduce it.
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import math
import re
from functools import cache

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..module_state import module_meta, peek_meta
from . import attention_site as _attention_site
from .class_source import runtime_methods as _runtime_methods
from .infer_registry import inferred_head_inputs
from .sync_ops import TPGroup, all_reduce_backward

HEAD_ATTRS = ("num_heads", "n_heads", "n_head", "num_attention_heads")
"""Attribute names that hold the number of attention (query) heads."""
KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads")
"""Attribute names that hold the number of key/value heads (grouped-query attention)."""
WIDTH_ATTRS = ("embed_dim", "inner_dim", "all_head_size", "hidden_size")
"""Attribute names that may hold the heads x head_dim width; rewritten only when equal to it."""
CONFIG_HEAD_KEYS = frozenset({*HEAD_ATTRS, *KV_HEAD_ATTRS})

_REGISTRY: dict[str, tuple[str, ...]] = {
    # class name -> attributes that are per-rank once the heads are split (matched along the MRO)
    "OPTAttention": ("num_heads", "embed_dim"),
    "GPTNeoSelfAttention": ("num_heads", "embed_dim"),
    "T5Attention": ("n_heads", "inner_dim"),
    # T5's copies (same attributes, not subclasses)
    **{
        name: ("n_heads", "inner_dim")
        for name in (
            "MT5Attention",
            "UMT5Attention",
            "LongT5Attention",
            "LongT5LocalAttention",
            "LongT5TransientGlobalAttention",
        )
    },
}


CONFIG_HEADS: dict[str, tuple[str, ...]] = {
    # class name -> config keys its run-time code reads as head counts; the module gets a per-rank config copy
    "Phi3Attention": ("num_attention_heads", "num_key_value_heads"),
}

PER_HEAD_INPUTS: dict[str, tuple[tuple[str, int | str], ...]] = {
    # class name -> (forward argument, its heads axis) for the per-head tensors the model builds for all heads:
    # "flat" = (batch x heads, ...) rows (BLOOM's alibi), an int = that axis has one entry per head (Falcon with
    # alibi=True: alibi (batch, heads, 1, keys) and the attention mask (batch, heads, queries, keys) it is folded
    # into; a mask with one entry on that axis is shared by all heads and stays whole)
    "BloomAttention": (("alibi", "flat"),),
    "FalconAttention": (("alibi", 1), ("attention_mask", 1)),
}


def register_config_heads(class_name: str, keys: tuple[str, ...] | list[str]) -> None:
    """Let the attention class ``class_name`` (or a subclass) read head counts ``keys`` from its ``config`` at
    run time: once its heads are split, the module gets its own shallow copy of the config with this rank's
    counts.

    Raises:
        ValueError: for a key that is not a head count (:data:`HEAD_ATTRS`, :data:`KV_HEAD_ATTRS`).
    """
    bad = [k for k in keys if k not in CONFIG_HEAD_KEYS]
    if bad:
        raise ValueError(f"{bad[0]!r} is not a head-count config key slapo can rewrite.")
    CONFIG_HEADS[class_name] = tuple(keys)


def register_attention_heads(class_name: str, attrs: tuple[str, ...] | list[str]) -> None:
    """Declare which attributes of the attention class ``class_name`` (or its subclasses) are per rank.

    Each name must be a head count (:data:`HEAD_ATTRS`), a key/value head count (:data:`KV_HEAD_ATTRS`)
    or a heads x head_dim width (:data:`WIDTH_ATTRS`); they are divided by the world size when the
    module's heads are split.

    Raises:
        ValueError: for a name of none of those kinds.
    """
    bad = [a for a in attrs if a not in (*HEAD_ATTRS, *KV_HEAD_ATTRS, *WIDTH_ATTRS)]
    if bad:
        raise ValueError(f"{bad[0]!r} is not a head-count or head-width attribute name slapo can rewrite.")
    _REGISTRY[class_name] = tuple(attrs)


@cache
def runtime_reads(cls: type) -> tuple[frozenset[str], frozenset[str]] | None:
    """``(self attributes, self.config attributes)`` read by ``cls``'s methods other than ``__init__``.

    Walks the classes of ``cls.__mro__`` below ``nn.Module``, overridden methods included (``super()`` may
    call them); None when a class has no source to read.
    """
    self_attrs: set[str] = set()
    cfg_attrs: set[str] = set()
    methods = _runtime_methods(cls)
    if methods is None:
        return None
    for fn in methods:
        for node in ast.walk(fn):
            if not isinstance(node, ast.Attribute):
                continue
            base = node.value
            if isinstance(base, ast.Name) and base.id == "self":
                self_attrs.add(node.attr)
            elif (
                isinstance(base, ast.Attribute)
                and base.attr == "config"
                and isinstance(base.value, ast.Name)
                and base.value.id == "self"
            ):
                cfg_attrs.add(node.attr)
    return frozenset(self_attrs), frozenset(cfg_attrs)


_HEAD_COUNT_NAME = re.compile(r"(num|n)_\w*heads?")
"""A head-count attribute by the form of its name (``num_attn_heads``), rewritten only when it holds the
module's heads and the class reads it at run time."""


@cache
def runtime_compared(cls: type) -> frozenset[str] | None:
    """The ``self`` attributes ``cls``'s methods other than ``__init__`` compare (``==`` / ``!=`` / ``assert``):
    a width compared with the input's (FSMT's ``assert embed_dim == self.embed_dim``) is the model width, not
    the heads' width, and stays global. None when a class has no source to read."""
    out: set[str] = set()
    methods = _runtime_methods(cls)
    if methods is None:
        return None
    for fn in methods:
        for node in ast.walk(fn):
            if not isinstance(node, ast.Compare):
                continue
            for side in (node.left, *node.comparators):
                if (
                    isinstance(side, ast.Attribute)
                    and isinstance(side.value, ast.Name)
                    and side.value.id == "self"
                ):
                    out.add(side.attr)
    return frozenset(out)


@cache
def group_widths(cls: type) -> frozenset[str]:
    """The ``self`` attributes ``cls``'s methods other than ``__init__`` read only as the dividend of an integer
    division by another attribute that is not a head count: the width of one of a fixed number of fused groups
    (CodeGen's ``local_dim = self.embed_dim // self.mp_num``, then ``qkv.view(..., -1, 3 * local_dim)``: each
    rank keeps whole groups, of the global width, on the ``-1`` axis). Such a width stays global when the heads
    are split (a rank with a part of a group fails the numeric check). Empty when a class has no source."""
    methods = _runtime_methods(cls)
    if methods is None:
        return frozenset()
    as_group: set[str] = set()
    other: set[str] = set()

    def self_attr(node) -> str | None:
        ok = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
        return node.attr if ok else None

    for fn in methods:
        divided = set()
        for node in ast.walk(fn):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv):
                a, b = self_attr(node.left), self_attr(node.right)
                if (
                    a is not None
                    and b is not None
                    and not (b in HEAD_ATTRS or b in KV_HEAD_ATTRS or _HEAD_COUNT_NAME.fullmatch(b))
                ):
                    as_group.add(a)
                    divided.add(id(node.left))
        for node in ast.walk(fn):
            a = self_attr(node)
            if a is not None and id(node) not in divided:
                other.add(a)
    return frozenset(as_group - other)


@cache
def reshapes_to_a_local_width(cls: type) -> bool:
    """Whether ``cls``'s methods other than ``__init__`` ``view`` / ``reshape`` to an explicit shape whose last
    axis is a local value rather than the module's attribute (TrOCR's ``attn_output.reshape(bsz, tgt_len,
    embed_dim)`` with ``embed_dim`` read from ``hidden_states.size()``, Pegasus-X's ``dim.hidden_dim``): such
    a forward gets :class:`_LocalWidth`. True when a class has no source to read."""
    methods = _runtime_methods(cls)
    if methods is None:
        return True
    for fn in methods:
        for node in ast.walk(fn):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("view", "reshape")
                and len(node.args) >= 2
                and not any(isinstance(a, ast.Starred) for a in node.args)
            ):
                continue
            last = node.args[-1]
            if isinstance(last, ast.Name) or (
                isinstance(last, ast.Attribute)
                and not (isinstance(last.value, ast.Name) and last.value.id == "self")
            ):
                return True
    return False


def _registered(cls: type, table: dict | None = None) -> tuple[str, ...]:
    table = _REGISTRY if table is None else table
    for klass in cls.__mro__:
        if klass.__name__ in table:
            return table[klass.__name__]
    return ()


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


GROUP_ATTRS = ("num_key_value_groups",)
"""Attribute names that hold query heads per key/value head (HF ``repeat_kv``); rewritten when the ratio
changes per rank, i.e. when key/value heads are replicated."""


def local_counts(heads: int, kv_heads: int, world_size: int) -> tuple[int, int]:
    """This rank's ``(query heads, key/value heads)``: ``heads / ws`` and ``kv_heads / ws``, or one key/value
    head when there are fewer key/value heads than ranks and each is replicated on ``ws / kv_heads`` ranks
    (:func:`slapo_lab.sharding.rules.kv_replicas`; Megatron-LM / vLLM key/value head replication)."""
    local_kv = kv_heads // world_size if kv_heads % world_size == 0 else 1
    return heads // world_size, local_kv


def _wanted_attrs(attn: nn.Module, heads: int, known: tuple, read_attrs: set, registered: tuple) -> list[str]:
    """The attributes of ``attn`` to rewrite per rank: the known head-count and width names it has and reads at
    run time (or its class registered), another head count it reads (ProphetNet's ``num_attn_heads``: named as
    one, and holding the module's ``heads``), and the widths it reshapes to (LeViT's ``out_dim_projection``)."""
    wanted = [a for a in known if a in registered or (a in read_attrs and hasattr(attn, a))]
    wanted += sorted(
        a
        for a in read_attrs
        if a not in wanted and _HEAD_COUNT_NAME.fullmatch(a) and getattr(attn, a, None) == heads
    )
    wanted += _attention_site.width_attrs(attn, read_attrs, wanted)  # LeViT's out_dim_projection
    return wanted


def _head_dim_attr(attn: nn.Module) -> int | None:
    """``attn``'s per-head width from its ``head_dim`` / ``attention_head_size`` / ``key_value_proj_dim``
    attribute (the first positive int), or None."""
    return next(
        (
            getattr(attn, a)
            for a in ("head_dim", "attention_head_size", "key_value_proj_dim")
            if _int(getattr(attn, a, None)) and getattr(attn, a) > 0
        ),
        None,
    )


def _width_rewrite(
    cls: type, a: str, v: object, sizes: tuple, registered: bool, compared: frozenset
) -> tuple[tuple[int, int] | None, str | None]:
    """``((global, local), None)`` for a width attribute ``a`` (value ``v``) of ``cls`` that holds the heads'
    width (``sizes``: ``(heads, head_dim or None, world_size)``); ``(None, None)`` for one kept whole;
    ``(None, reason)`` for a ``registered`` one that does not hold it."""
    heads, head_dim, world_size = sizes
    if not _int(v) or (a in compared and not registered):
        return None, None  # compared with the input's width (FSMT's ``assert embed_dim == self.embed_dim``)
    if a in group_widths(cls) and not registered:
        return None, None  # the width of one of a fixed number of fused groups (CodeGen's mp_num), kept whole
    hd = head_dim or (v // heads if v % heads == 0 else None)
    if hd is None or v != heads * hd:
        if registered:
            return None, (
                f"{cls.__name__}.{a} is {v}, not the {heads} heads x {head_dim} head size it should "
                "hold, so slapo cannot rewrite it to this rank's share"
            )
        return None, None  # a model width that happens to be read, not the heads' width
    return (v, v // world_size), None


def plan_local_heads(attn: nn.Module, heads: int, kv_heads: int, world_size: int) -> tuple[dict, str | None]:
    """The per-rank rewrite of ``attn``'s head attributes: ``({name: (global, local)}, None)``, or
    ``({}, reason)`` when the module cannot be made consistent (a sentence fragment).

    ``heads`` / ``kv_heads`` are the module's global counts, ``heads`` divisible by ``world_size`` and
    ``kv_heads`` divisible by it or dividing it (replicated key/value heads: one per rank; checked before).
    A width attribute is rewritten only when it equals ``heads * head_dim`` (head_dim from
    ``head_dim`` / ``attention_head_size`` / ``key_value_proj_dim``, else the width over the heads). With
    replicated key/value heads the query heads per key/value head change too: a ``num_key_value_groups``
    attribute (HF's Llama, Qwen3-MoE ... read it in ``repeat_kv``) becomes ``heads / ws``.
    """
    cls = type(attn)
    name = cls.__name__
    reads = runtime_reads(cls)
    known = (*HEAD_ATTRS, *KV_HEAD_ATTRS, *WIDTH_ATTRS)
    read_attrs = set(known) if reads is None else set(reads[0])
    cfg_plan, reason = plan_config_heads(attn, heads, kv_heads, world_size)
    if reason:
        return {}, reason
    registered = _registered(cls)
    wanted = _wanted_attrs(attn, heads, known, read_attrs, registered)
    compared = runtime_compared(cls) or frozenset()
    head_dim = _head_dim_attr(attn)
    local_q, local_kv = local_counts(heads, kv_heads, world_size)
    out: dict[str, tuple[int, int]] = {}
    for a in wanted:
        v = getattr(attn, a, None)
        if a in registered and v is None:
            continue  # registered for the class, absent on this instance
        if a in HEAD_ATTRS or a in KV_HEAD_ATTRS or _HEAD_COUNT_NAME.fullmatch(a):
            want = kv_heads if a in KV_HEAD_ATTRS else heads
            if not _int(v) or v != want:
                return {}, (
                    f"{name}.{a} is {v!r}, not the module's {want} heads, so slapo cannot rewrite it to "
                    "this rank's share"
                )
            out[a] = (v, local_kv if a in KV_HEAD_ATTRS else local_q)
        else:
            pair, reason = _width_rewrite(cls, a, v, (heads, head_dim, world_size), a in registered, compared)
            if reason:
                return {}, reason
            if pair is not None:
                out[a] = pair
    for a in GROUP_ATTRS:
        v = getattr(attn, a, None)
        if _int(v) and kv_heads and v == heads // kv_heads and local_q // local_kv != v:
            out[a] = (v, local_q // local_kv)
    out.update({f"config.{k}": v for k, v in cfg_plan.items()})
    return out, None


def config_head_keys(attn: nn.Module) -> tuple[str, ...]:
    """The head-count keys of ``attn.config`` that its class reads at run time: those registered
    (:data:`CONFIG_HEADS`) and those its methods other than ``__init__`` read as ``self.config.<key>``
    (:func:`runtime_reads`; Phi-4-multimodal's copy of Phi-3's attention slices its fused ``qkv_proj`` at
    ``self.config.num_attention_heads * self.head_dim``). Once the heads are split the module gets its own
    config copy holding this rank's counts."""
    keys = list(_registered(type(attn), CONFIG_HEADS))
    reads = runtime_reads(type(attn))
    if reads is not None and getattr(attn, "config", None) is not None:
        keys += sorted((reads[1] & CONFIG_HEAD_KEYS) - set(keys))
    return tuple(keys)


def plan_config_heads(
    attn: nn.Module, heads: int, kv_heads: int, world_size: int
) -> tuple[dict[str, tuple[int, int]], str | None]:
    """The per-rank counts of the config keys :data:`CONFIG_HEADS` registers for ``attn``'s class:
    ``({key: (global, local)}, None)``, or ``({}, reason)`` when the config's value is not the module's count."""
    keys = config_head_keys(attn)
    cfg = getattr(attn, "config", None)
    out: dict[str, tuple[int, int]] = {}
    for k in keys:
        v = getattr(cfg, k, None) if cfg is not None else None
        if v is None:
            continue
        want = heads if k in HEAD_ATTRS else kv_heads
        if not _int(v) or v != want:
            return {}, (
                f"{type(attn).__name__}.config.{k} is {v!r}, not the module's {want} heads, so slapo cannot "
                "give it this rank's share"
            )
        out[k] = (v, local_counts(heads, kv_heads, world_size)[0 if k in HEAD_ATTRS else 1])
    return out, None


def _cut_heads(t, axis, heads: int, local: int, rank: int, group=None):
    """This rank's heads of a per-head tensor (``axis`` "flat": rows ``batch x heads``; an int: that axis).

    A tensor with a gradient (MPNet's position bias, looked up from a table the model holds once) is read
    through :func:`~slapo_lab.sharding.sync_ops.all_reduce_backward` on ``group`` first: each rank's gradient
    covers its own heads only, and the table's gradient is their sum."""
    if not hasattr(t, "shape") or t.dim() == 0:
        return t
    if axis == "flat":
        if t.shape[0] % heads:
            return t
        v = _summed(t, group).view(-1, heads, *t.shape[1:])[:, rank * local : (rank + 1) * local]
        return v.reshape(-1, *t.shape[1:])
    if t.dim() <= axis or t.shape[axis] != heads:
        return t  # shared by all heads (a (batch, 1, q, k) mask), or already this rank's heads
    return _summed(t, group).narrow(axis, rank * local, local)


def _summed(t, group):
    """``t`` read through :func:`~slapo_lab.sharding.sync_ops.all_reduce_backward` on ``group`` when it has a
    gradient (only a tensor that is cut: its gradient from each rank covers that rank's heads)."""
    if group is None or not getattr(t, "requires_grad", False) or not torch.is_grad_enabled():
        return t
    return all_reduce_backward(t, group)


def _slice_per_head_inputs(module, args, kwargs, *, specs, index, heads, world_size, rank, group=None):
    """Forward pre-hook: cut each per-head argument of ``specs`` (``(name, heads axis)``) to this rank's
    heads, whether passed by keyword or by position."""
    local = heads // world_size
    args = list(args)
    for n, axis in specs:
        if kwargs.get(n) is not None:
            kwargs[n] = _cut_heads(kwargs[n], axis, heads, local, rank, group)
        elif index.get(n) is not None and index[n] < len(args) and args[index[n]] is not None:
            args[index[n]] = _cut_heads(args[index[n]], axis, heads, local, rank, group)
    return tuple(args), kwargs


def _install_input_slicer(attn: nn.Module, specs: tuple, heads: int, world_size: int, rank: int, group=None):
    try:
        params = list(inspect.signature(type(attn).forward).parameters)[1:]  # without self
    except (TypeError, ValueError):
        params = []
    index = {n: params.index(n) if n in params else None for n, _ in specs}
    hook = functools.partial(
        _slice_per_head_inputs,
        specs=specs,
        index=index,
        heads=heads,
        world_size=world_size,
        rank=rank,
        group=group,
    )
    return attn.register_forward_pre_hook(hook, with_kwargs=True)


def _local_shape(numel: int, shape, width: int, local: int) -> list[int] | None:
    """``shape`` with one entry equal to the heads' global ``width`` (the last such) made ``local``, where
    ``shape`` (no ``-1``) does not fit ``numel`` elements and that one does; else None."""
    try:
        dims = [int(d) for d in shape]
    except (TypeError, ValueError):
        return None
    if -1 in dims or math.prod(dims) == numel:
        return None
    for i in reversed(range(len(dims))):
        if dims[i] == width:
            fixed = [*dims[:i], local, *dims[i + 1 :]]
            if math.prod(fixed) == numel:
                return fixed
    return None


class _LocalWidth(TorchFunctionMode):
    """Inside a head-split attention's forward, a ``view`` / ``reshape`` to the heads' global width that this
    rank's tensor cannot fill takes this rank's width: TrOCR's, LED's decoder's, FSMT's, ProphetNet's and
    Pegasus-X's attention reshape their output with the width read from the *input* (``bsz, tgt_len,
    embed_dim = hidden_states.size()`` then ``attn_output.reshape(bsz, tgt_len, embed_dim)``), equal to the
    heads' width only when unsplit (Megatron-LM's ``hidden_size_per_partition``). Only a call that would
    fail is changed."""

    def __init__(self, width: int, local: int) -> None:
        super().__init__()
        self.width, self.local = width, local

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (
            getattr(func, "__name__", "") in ("view", "reshape")
            and args
            and isinstance(args[0], torch.Tensor)
        ):
            shape = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list, torch.Size)) else args[1:]
            shape = kwargs.get("shape", kwargs.get("size", shape))
            fixed = _local_shape(args[0].numel(), shape, self.width, self.local) if shape else None
            if fixed is not None:
                return func(args[0], fixed)
        return func(*args, **kwargs)


class _WidthScope:
    """The forward hooks that run a module's forward under :class:`_LocalWidth` (a new mode per call)."""

    def __init__(self, width: int, local: int) -> None:
        self.width, self.local, self.stack = width, local, []

    def enter(self, _module, _args) -> None:
        if torch.compiler.is_compiling():
            # dynamo cannot trace a mode pushed inside a checkpointed region (an unsafe side effect of the
            # higher-order op): compiled, the forward runs as written, which is right wherever its reshapes
            # already use the module's per-rank attributes (GPT-2); TrOCR-like reshapes fail there in one error
            return
        mode = _LocalWidth(self.width, self.local)
        mode.__enter__()
        self.stack.append(mode)

    def exit(self, _module, _args, _out) -> None:
        if self.stack and not torch.compiler.is_compiling():
            self.stack.pop().__exit__(None, None, None)


def _install_width_scope(attn: nn.Module, width: int, local: int) -> list:
    scope = _WidthScope(width, local)
    return [
        attn.register_forward_pre_hook(scope.enter),
        attn.register_forward_hook(scope.exit, always_call=True),
    ]


def recorded_heads(attn: nn.Module | None) -> tuple[int, int] | None:
    """The global ``(heads, kv heads)`` recorded when ``attn``'s head attributes were rewritten, or None."""
    meta = peek_meta(attn) if attn is not None else None
    rec = meta.attention_heads if meta else None
    return (rec["heads"], rec["kv_heads"]) if rec else None


def localise_heads(
    attn: nn.Module, heads: int, kv_heads: int, world_size: int, rank: int = 0, group: TPGroup | None = None
) -> dict:
    """Rewrite ``attn``'s head attributes to this rank's share (once per module; later calls do nothing).

    Also gives the module a per-rank config copy (:data:`CONFIG_HEADS`) and cuts the per-head arguments
    the model builds for all heads to this rank's (``rank``; :data:`PER_HEAD_INPUTS`).

    Returns the record stored in ``module_meta(attn).attention_heads``.

    Raises:
        ValueError: when :func:`plan_local_heads` refuses (callers check first, so nothing is half done).
    """
    meta = module_meta(attn)
    rec = meta.attention_heads
    if rec is not None:
        return rec
    plan, reason = plan_local_heads(attn, heads, kv_heads, world_size)
    if reason:
        raise ValueError(reason)
    cfg_plan = {a[len("config.") :]: v for a, v in plan.items() if a.startswith("config.")}
    plan = {a: v for a, v in plan.items() if not a.startswith("config.")}
    for a, (_g, local) in plan.items():
        setattr(attn, a, local)
    rec = {
        "heads": heads,
        "kv_heads": kv_heads,
        "world_size": world_size,
        "attrs": {a: [g, loc] for a, (g, loc) in plan.items()},
    }
    if cfg_plan:
        cfg = copy.copy(attn.config)  # this module's own: the model's config and other layers' stay global
        for k, (_g, local) in cfg_plan.items():
            setattr(cfg, k, local)
        attn.config = cfg
        rec["config"] = {k: [g, loc] for k, (g, loc) in cfg_plan.items()}
    head_dim = next(
        (
            getattr(attn, a)
            for a in ("head_dim", "attention_head_size", "key_value_proj_dim", "head_size")
            if _int(getattr(attn, a, None)) and getattr(attn, a) > 0
        ),
        None,
    )
    if head_dim and world_size > 1 and heads % world_size == 0 and reshapes_to_a_local_width(type(attn)):
        width = heads * head_dim
        meta.hooks.extend(_install_width_scope(attn, width, width // world_size))
        rec["width"] = [width, width // world_size]
    inputs = _registered(type(attn), PER_HEAD_INPUTS)
    inputs = (*inputs, *((n, a) for n, a in inferred_head_inputs(attn) if n not in dict(inputs)))
    if inputs and world_size > 1:
        meta.hooks.append(_install_input_slicer(attn, inputs, heads, world_size, rank, group))
        rec["inputs"] = [n for n, _ in inputs]
    meta.attention_heads = rec
    return rec
