"""The vocabulary of the split inference (:mod:`slapo_lab.sharding.infer`): op classes, index maps and results.

An *index map* is an integer tensor of a value's shape whose entries are the producer feature (or parameter
entry) each element came from (-1: none). This module holds the op sets the recorder
(:mod:`slapo_lab.sharding.infer_recorder`) sorts torch functions into (shape ops replayed on the maps, ops that
pass them on, routing ops, factories, writes), the per-value record :class:`_Info` (maps, lineage, pending score
terms), the results -- :class:`HeadParam`, :class:`Layout`, :class:`BlockSplit` -- and the helpers the recorder
and the analysis (:mod:`slapo_lab.sharding.infer_analyse`) share: the heads each element of a q / k / v
argument reaches (:func:`_head_sets`) and the column-parallel strides whose per-rank features are exactly a
rank's heads (:func:`_candidate_strides`, :func:`_fits`; Megatron-LM's ``partition_stride`` in
``megatron/core/tensor_parallel/layers.py``, with key/value replication as in Megatron-LM / vLLM). Complex views
(``view_as_complex`` / ``view_as_real``, DeepSeek-V2's rotary embedding) carry a feature pair per element
(:func:`_complex_maps`). Split from :mod:`slapo_lab.sharding.infer`, which re-exports the public names.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from torch import nn

from .shard_layout import BlockStride, block_replicas, block_sizes, local_shard, make_stride

_SHAPE_OPS = frozenset(
    {
        "view",
        "reshape",
        "transpose",
        "permute",
        "unflatten",
        "flatten",
        "contiguous",
        "chunk",
        "split",
        "split_with_sizes",
        "unbind",
        "__getitem__",
        "narrow",
        "expand",
        "expand_as",
        "repeat",
        "repeat_interleave",
        "unsqueeze",
        "squeeze",
        "cat",
        "concat",
        "concatenate",
        "stack",
        "movedim",
        "moveaxis",
        "t",
        "clone",
        "view_as",
        "reshape_as",
        "select",
        "swapaxes",
        "swapdims",
        "index_select",
        "tensor_split",
        "gather",
        "take_along_dim",
    }
)
_PASS_OPS = frozenset(
    {"to", "float", "half", "bfloat16", "type_as", "type", "double", "detach", "requires_grad_"}
)
_ROUTE_OPS = frozenset({"topk", "argmax", "sort", "argsort"})
_FACTORY_OPS = frozenset(
    {
        "new_empty",
        "new_zeros",
        "new_ones",
        "new_full",
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
        "new_tensor",
    }
)
_WRITE_OPS = frozenset({"copy_", "__setitem__"})
_MAX_MAPS = 3
#: Complex views (DeepSeek-V2's rotary embedding: ``view_as_complex(x.reshape(..., -1, 2))`` then
#: ``view_as_real(...).flatten(3)``): a complex element's map holds its pair of features, see :func:`_complex_maps`.
_COMPLEX_OPS = frozenset({"view_as_complex", "view_as_real"})
_PAIR = 1 << 31
_BOOL = torch.Tensor.__bool__


def _is_dense(mod: nn.Module) -> bool:
    return isinstance(mod, nn.Linear) or (type(mod).__name__ == "Conv1D" and hasattr(mod, "nf"))


def _dense_out(mod: nn.Module) -> int:
    return mod.weight.shape[1] if type(mod).__name__ == "Conv1D" else mod.weight.shape[0]


@dataclass
class _Info:
    maps: dict = field(default_factory=dict)  # producer -> [index map (int64, the tensor's shape)]
    src: frozenset = frozenset()  # every linear the value derives from (lineage, any op)
    scores: tuple | None = None  # ((q arg, k arg), ...): the score terms not yet applied to v


@dataclass(frozen=True)
class HeadParam:
    """A parameter whose entries follow the heads: ``axis`` holds one entry per head."""

    module: str  # path relative to the block
    name: str
    axis: int
    heads: int


@dataclass(frozen=True)
class Layout:
    """How a column-parallel shard of a projection reaching attention must split its output features.

    ``stride``: 1 (contiguous: whole heads of every part), n (n equal blocks) or a
    :class:`~slapo_lab.sharding.rules.BlockStride`; ``parts``: its attention roles in feature order
    (``"qkv"``, ``"kv"``, ``"q"`` ...); ``units``: the heads a contiguous shard keeps whole (None for blocks).
    """

    parts: str
    stride: int
    units: int | None


@dataclass
class BlockSplit:
    """The split of one block read from its dataflow (paths relative to the block).

    ``roles``: linear path -> ``"q"``, ``"k"``, ``"v"``, ``"qkv"``, ``"kv"`` (fused), ``"o"``, ``"mlp_in"``,
    ``"mlp_out"``; ``layouts``: path -> :class:`Layout` of every q/k/v projection; ``whole``: linear path ->
    why it stays whole (router, shared by all heads, low-rank, a refused attention); ``head_params``: the
    per-head parameters; ``attention``: attention module path -> (heads, key/value heads); ``refusals``:
    attention module path -> why its heads cannot be split.
    """

    roles: dict = field(default_factory=dict)
    layouts: dict = field(default_factory=dict)
    whole: dict = field(default_factory=dict)
    head_params: list = field(default_factory=list)
    attention: dict = field(default_factory=dict)
    refusals: dict = field(default_factory=dict)
    refused_roles: dict = field(default_factory=dict)
    shared: set = field(default_factory=set)
    grad_sum: set = field(default_factory=set)
    ran: set = field(
        default_factory=set
    )  # the linears the recorded forward ran (the others: names are hints)
    # per-head tensor arguments of an attention module, built for all heads outside the block (MPT's ALiBi
    # position_bias): HeadParam(module, argument name, heads axis, heads); cut to each rank's heads
    head_inputs: list = field(default_factory=list)
    # module path -> the split linears whose features its parameters follow entry by entry (a norm over all of a
    # column-parallel output, or over the attention output / MLP features a row-parallel layer takes):
    # its parameters are sharded on their last axis and its statistics summed over the ranks (feature_stats)
    feature_params: dict = field(default_factory=dict)
    # the linears of a channel mixer kept whole because no per-rank split of its channels exists (mixers.py): they
    # pair with nothing, and each may still be column parallel with its output gathered (lone_linears.py)
    unpaired: set = field(default_factory=set)


def _common_parent(paths: list[str]) -> str:
    """The longest dotted prefix the module paths ``paths`` share (``""`` for none or no paths)."""
    if not paths:
        return ""
    parts = [p.split(".") if p else [] for p in paths]
    out = []
    for xs in zip(*parts, strict=False):
        if len(set(xs)) != 1:
            break
        out.append(xs[0])
    return ".".join(out)


class _Done(Exception):
    pass


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _residual(inf: _Info | None) -> bool:
    """A value summed with a split layer's output that keeps the features from staying apart: unmapped, or a
    tensor from outside the block only (BERT's ``input_tensor``, the block's input passed to ``SelfOutput``)."""
    return inf is None or (bool(inf.maps) and all(p.startswith("input:") for p in inf.maps))


def _expand_ellipsis(eq: str, ops: list) -> str | None:
    """``eq`` with each ``...`` written out as letters it does not use (as many as the operand's extra axes;
    the output's as many as the most), or None when they cannot be."""
    if "..." not in eq:
        return eq
    ins, out = eq.split("->")
    subs = ins.split(",")
    free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in eq]
    counts = []
    for sub, t in zip(subs, ops, strict=True):
        n = t.dim() - (len(sub) - 3) if "..." in sub else 0
        if n < 0 or n > len(free):
            return None
        counts.append(n)
    most = max(counts)
    letters = free[:most]
    subs = [sub.replace("...", "".join(letters[most - n :])) for sub, n in zip(subs, counts, strict=True)]
    return ",".join(subs) + "->" + out.replace("...", "".join(letters))


def _varies(inf: _Info, axis: int) -> bool:
    """Whether ``axis`` of a value splits its producers' features apart, as a heads axis does: for some
    producer, the features at index 0 and at index 1 of that axis are disjoint (along a batch-like axis, such
    as LongT5's blocks of tokens, every index holds the same features, or none where padded)."""
    for p, ms in inf.maps.items():
        if p.startswith(("param:", "@")):
            continue
        for m in ms:
            if m.dim() <= axis or m.shape[axis] < 2:
                continue
            a, b = m.select(axis, 0), m.select(axis, 1)
            sa, sb = set(a[a >= 0].unique().tolist()), set(b[b >= 0].unique().tolist())
            if sa and sb and not sa & sb:
                return True
    return False


def _complex_maps(name: str, maps: dict, out: torch.Tensor) -> dict:
    """The maps of ``view_as_complex`` / ``view_as_real``'s output: a complex element's map entry encodes its
    (real, imaginary) features as ``(f0 + 1) * 2**31 + (f1 + 1)`` (-1 where unmapped), decoded back into a last
    axis of 2 by ``view_as_real``; elementwise complex ops in between carry the encoded maps unchanged."""
    res: dict = {}
    for p, ms in maps.items():
        for m in ms:
            if name == "view_as_complex":
                e = (m[..., 0] + 1) * _PAIR + (m[..., 1] + 1)
            else:
                e = torch.stack((m // _PAIR - 1, m % _PAIR - 1), dim=-1)
            if tuple(e.shape) == tuple(out.shape):
                res.setdefault(p, []).append(e)
    return res


def _merge_scores(tags) -> tuple | None:
    """The score terms of every input, in order, each once."""
    out: list = []
    for tag in tags:
        for pair in tag or ():
            if not any(pair[0] is x[0] and pair[1] is x[1] for x in out):
                out.append(pair)
    return tuple(out) or None


def _broadcasts(a: tuple, b: tuple) -> bool:
    if len(a) > len(b):
        return False
    return all(x == y or x == 1 for x, y in zip(a[::-1], b[::-1], strict=False))


def _linear_maps(inf: _Info) -> bool:
    return any(not p.startswith(("param:", "@", "input:")) for p in inf.maps)


def _head_sets(t: torch.Tensor, maps: list, n: int | None = None) -> list[set]:
    """For each head (axis -3 of ``t``), the set of producer features its elements come from."""
    heads = t.shape[-3] if n is None else n
    sets = [set() for _ in range(heads)]
    for m in maps:
        if m.dim() < 3 or m.shape[-3] != heads:
            continue
        for h in range(heads):
            vals = m.select(-3, h).reshape(-1)
            sets[h] |= set(vals[vals >= 0].unique().tolist())
    return sets


def _candidate_strides(n: int, feature_part: list[str]) -> list:
    out: list = [1, 2, 3]
    runs = []
    for p in feature_part:
        if runs and runs[-1][0] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    if 1 < len(runs) <= 4:
        out.append(make_stride([r[1] for r in runs]))
    return [s for s in out if sum(_sizes(n, s)) == n]


def _replicated_strides(feature_part: list[str], replicated: dict[str, int]) -> list:
    """The stride of a fused projection whose parts are stored as blocks back to back, the replicated ones
    (key / value heads of multi-query attention) held whole by their replica groups; none when a part recurs."""
    runs = [[k, len(list(g))] for k, g in itertools.groupby(feature_part)]  # (part, run length), in order
    if len(runs) < 2 or len({r[0] for r in runs}) != len(runs):
        return []
    return [BlockStride([r[1] for r in runs], [replicated.get(r[0], 0) for r in runs])]


def _sizes(n: int, stride) -> list[int]:
    try:
        return block_sizes(n, stride)
    except ValueError:
        return [0]


def _fits(n: int, stride, ws: int, needed: list[set]) -> bool:
    sizes = _sizes(n, stride)
    if any(s % (ws // r) for s, r in zip(sizes, block_replicas(stride, len(sizes), ws), strict=False)):
        return False
    idx = torch.arange(n)
    return all(set(local_shard(idx, 0, ws, r, stride).tolist()) == needed[r] for r in range(ws))


def _test_ws(*counts: int) -> int | None:
    for ws in (2, 3, 5, 7):
        if all(c % ws == 0 for c in counts):
            return ws
    return None
