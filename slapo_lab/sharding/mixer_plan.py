"""The plan of a channel-parallel sequence mixer: which rank owns which channels, and how each tensor splits.

:class:`MixerDeps` holds what each of ``chunks`` feature chunks of a mixer's output-linear input needs (read by
:func:`slapo_lab.sharding.mixer_deps.dependencies`); :func:`plan` turns it into a :class:`MixerPlan` for ``ws``
ranks, rank ``r`` owning chunks ``[r K/ws, (r+1) K/ws)``: input linears column parallel under the stride that
cuts each of their blocks alike (a :class:`~slapo_lab.sharding.shard_layout.BlockStride`, with ``groups`` for
blocks that consecutive ranks share), gathered linears, low-rank linears kept whole, other parameters split on
the axis each rank needs alone or replicated with their gradients summed, or a reason to keep the mixer whole.
Sources: Megatron-LM ``megatron/core/ssm/mamba_mixer.py`` (each of ``z``, ``x``, ``B``, ``C``, ``dt`` of
``in_proj`` split by its local width, ``ngroups_local_tp = ngroups // tp``), vLLM's replication of Mamba-2's
``B`` / ``C`` groups over the ranks when there are fewer groups than ranks. Split from
:mod:`slapo_lab.sharding.mixers` (its docstring has the whole method), which re-exports the public names.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from torch import nn

from .shard_layout import BlockStride, local_shard, make_stride

MAX_CHUNKS = 16


@dataclass
class MixerDeps:
    """What each of ``chunks`` feature chunks of the output linear's input needs (paths relative to the mixer).

    ``outs``: input linear path -> [its output features (a set or an index tensor), per chunk]; ``params``:
    ``"module:name"`` -> [its flat entries, per chunk]; ``shapes``: ``"module:name"`` -> shape; ``feats``: input
    linear path -> its output features; ``row``: the output linear's path; ``attrs``: the integer attributes that
    hold per-rank values (``"submodule:name"``, the mixer's own ``":name"`` -> global value), or None when none
    was found to work; ``feeds`` / ``values``: per input linear, the input linears its input derives from, and
    its input and output in the full run (for a gathered linear's check).
    """

    chunks: int
    row: str
    outs: dict = field(default_factory=dict)
    feats: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    shapes: dict = field(default_factory=dict)
    attrs: dict | None = None
    feeds: dict = field(default_factory=dict)
    values: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)  # norm path -> its statistics' values in the full run
    unrun: set = field(
        default_factory=set
    )  # submodules holding parameters whose forward the mixer never calls


@dataclass
class MixerPlan:
    """The split of one mixer over ``ws`` ranks: ``columns`` (input linear -> stride), ``shards``
    (``"module:name"`` -> (axis, stride)), ``grad_sum`` (modules whose replicated parameters sum their
    gradients), or ``reason`` why it stays whole."""

    columns: dict = field(default_factory=dict)
    kinds: dict = field(default_factory=dict)  # input linear -> "column" / "column_shard" / "gather_linear"
    gathers: set = field(default_factory=set)
    shards: dict = field(default_factory=dict)
    grad_sum: set = field(default_factory=set)
    reason: str | None = None
    low_rank: dict = field(default_factory=dict)  # input linear kept whole -> the input linears it feeds


def _is_linear(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear)


def _world_sizes(chunks: int) -> list[int]:
    return [w for w in (2, 4, 8, 16) if chunks % w == 0]


def _runs_layout(owner: list, ws: int):
    """The stride whose :func:`local_shard` gives rank r exactly the positions ``owner`` assigns it, or None."""
    runs = [[k, len(list(g))] for k, g in itertools.groupby(owner)]  # (part, run length), in order
    if len(runs) % ws:
        return None
    sizes = []
    for b in range(0, len(runs), ws):
        grp = runs[b : b + ws]
        if [r for r, _ in grp] != list(range(ws)) or len({n for _, n in grp}) != 1:
            return None
        sizes.append(grp[0][1] * ws)
    # merge consecutive blocks into one: a contiguous shard is one block
    stride = make_stride(sizes) if len(sizes) > 1 else 1
    idx = torch.arange(len(owner))
    for r in range(ws):
        want = [i for i, o in enumerate(owner) if o == r]
        if local_shard(idx, 0, ws, r, stride).tolist() != want:
            return None
    return stride


def _grouped_layout(masks: list, ws: int):
    """The :class:`~slapo_lab.sharding.rules.BlockStride` (with ``groups``) whose :func:`local_shard` gives rank r
    exactly the positions whose rank bit mask in ``masks`` holds r, when some positions are needed by several
    ranks, or None.

    The positions must run in blocks: a split block is ``ws`` equal runs owned by ranks 0, 1, ... alone (group
    count 0); a block shared by ``r`` consecutive ranks (``r`` dividing ``ws``) is ``g = ws / r`` equal runs
    owned by ranks ``{0..r-1}``, ``{r..2r-1}``, ... (group count ``g``: Mamba-2's ``B`` / ``C`` with ``g`` groups,
    fewer than the ranks, each group on the ranks whose heads read it). Every rank then keeps its chunk of each
    split block and its group of each shared block, the gradient of a shared block summed over the ranks that
    share it (the shard primitive does so for a :class:`BlockStride` with groups). At least one block must be
    split. Sources: vLLM ``vllm/model_executor/layers/mamba/mamba_mixer2.py`` (``extra_groups_for_head_shards``,
    ``mamba_v2_sharded_weight_loader``: groups fewer than the TP ranks are duplicated so each rank holds the group
    its heads read); Megatron-LM ``megatron/core/ssm/mamba_mixer.py`` asserts ``ngroups % tp_size == 0`` instead."""
    runs = [(int(m), len(list(g))) for m, g in itertools.groupby(int(v) for v in masks)]
    sizes, groups, i = [], [], 0
    while i < len(runs):
        m, _ = runs[i]
        r = m.bit_count()
        if m != (1 << r) - 1 or r == 0 or ws % r:  # a block starts with the ranks 0 .. r-1
            return None
        g = ws // r
        grp = runs[i : i + g]
        if [x for x, _ in grp] != [((1 << r) - 1) << (j * r) for j in range(g)] or len(
            {k for _, k in grp}
        ) != 1:
            return None
        sizes.append(grp[0][1] * g)
        groups.append(g if r > 1 else 0)
        i += g
    if all(groups) or not any(groups) or len(sizes) < 2:
        return None  # nothing split, or nothing shared (the plain layouts cover that)
    stride = BlockStride(sizes, groups)
    idx = torch.arange(len(masks))
    for r in range(ws):
        want = [i for i, m in enumerate(masks) if (int(m) >> r) & 1]
        if local_shard(idx, 0, ws, r, stride).tolist() != want:
            return None
    return stride


def _owners(per_chunk: list, ws: int, n: int) -> torch.Tensor:
    """For each of ``n`` positions, a bit mask (int64) of the ranks whose chunks need it."""
    per = len(per_chunk) // ws
    mask = torch.zeros(n, dtype=torch.long)
    for c, s in enumerate(per_chunk):
        idx = s if isinstance(s, torch.Tensor) else torch.tensor(sorted(s), dtype=torch.long)
        idx = idx[(idx >= 0) & (idx < n)]
        mask[idx] |= 1 << (c // per)
    return mask


def _ranks(mask: torch.Tensor) -> torch.Tensor:
    """How many ranks each bit mask holds."""
    return sum(((mask >> b) & 1) for b in range(MAX_CHUNKS)) if mask.numel() else mask


def _single(mask: torch.Tensor) -> list[int]:
    """The rank of each single-rank bit mask."""
    return [int(v).bit_length() - 1 for v in mask.tolist()]


def plan(deps: MixerDeps, ws: int) -> MixerPlan:
    """The :class:`MixerPlan` of ``deps`` over ``ws`` ranks (``ws`` must divide ``deps.chunks``); cached on
    ``deps`` per world size."""
    cache = deps.__dict__.setdefault("_plans", {})
    if ws not in cache:
        cache[ws] = _plan(deps, ws)
    return cache[ws]


def _plan(deps: MixerDeps, ws: int) -> MixerPlan:
    out = MixerPlan()
    if ws < 2 or deps.chunks % ws:
        out.reason = f"its {deps.chunks} channel chunks do not split over {ws} ranks"
        return out
    for p, per in deps.outs.items():
        reason = _plan_input_linear(out, deps, p, per, ws)
        if reason is not None:
            out.reason = reason
            return out
    for p in out.columns:  # fed by a gathered output: its input gradient is summed by that gather's backward
        out.kinds[p] = "column_shard" if deps.feeds.get(p, set()) & out.gathers else "column"
    for key, per in deps.params.items():
        reason = _plan_param(out, deps.shapes[key], key, per, ws)
        if reason is not None:
            out.reason = reason
            return out
    return out


def _plan_input_linear(out: MixerPlan, deps: MixerDeps, p: str, per: list, ws: int) -> str | None:
    """Plan the input linear ``p`` (``per``: the channels each of its output features reaches) into ``out``: kept
    whole as a low-rank "a", gathered, or column parallel (equal runs, or groups replicated on consecutive
    ranks); returns why the mixer stays whole, or None."""
    fed = sorted(q for q in deps.outs if q != p and p in deps.feeds.get(q, ()))
    if fed and not any(len(x) for x in per):
        # a low-rank "a" whose output reaches the channels only through other input linears (Kimi's
        # g_a_proj -> g_b_proj, f_a_proj -> f_b_proj): kept whole; the column-parallel linears it feeds sum
        # their input gradients over the ranks, so its gradients are complete on every rank
        out.low_rank[p] = fed
        return None
    n = deps.feats[p]
    own = _owners(per, ws, n)
    count = _ranks(own)
    shared = int((count > 1).sum())
    if bool((count == ws).all()) and n % ws == 0 and deps.feeds.get(p):
        # every rank needs all its outputs (Mamba's x_proj: dt, B, C from all channels): computed from the
        # gathered channels, its output features split and gathered again
        out.gathers.add(p)
        out.kinds[p] = "gather_linear"
        return None
    unused = int((count == 0).sum())
    grouped = _grouped_layout(own.tolist(), ws) if shared and shared < n and not unused else None
    if grouped is not None:  # parts shared by heads on different ranks (B, C): replicated on those ranks
        out.columns[p] = grouped
        return None
    if shared or unused:
        return f"{_unsplit_features(deps, p, n, shared, unused)}, so the mixer stays whole"
    stride = _runs_layout(_single(own), ws)
    if stride is None:
        return f"no column-parallel layout of {p} gives each rank the features its channels need"
    out.columns[p] = stride
    return None


def _unsplit_features(deps: MixerDeps, p: str, n: int, shared: int, unused: int) -> str:
    """What keeps input linear ``p``'s ``n`` output features from splitting: ``shared`` of them reach the
    channels of several ranks, or ``unused`` reach none."""
    if shared == n:
        return (
            f"all {n} of {p}'s output features reach the channels of every rank (something between it and "
            f"{deps.row} mixes all channels, e.g. a gated norm over all of them: Mamba-2's with one group)"
        )
    if shared:
        return (
            f"{shared} of {p}'s {n} output features reach the channels of several ranks, not as groups "
            "each held whole by consecutive ranks (as Mamba-2's B and C with fewer groups than ranks are)"
        )
    return f"{unused} of {p}'s {n} output features reach none of the output projection's inputs"


def _plan_param(out: MixerPlan, shape: tuple, key: str, per: list, ws: int) -> str | None:
    """Plan the mixer's parameter ``key`` (of ``shape``; ``per``: the channels each entry reaches) into ``out``:
    unused, replicated with summed gradients, or sharded on the axis that splits it by the ranks' channels;
    returns why the mixer stays whole, or None."""
    n = 1
    for s in shape:
        n *= s
    own = _owners(per, ws, n)
    count = _ranks(own)
    if not bool((count > 0).any()):
        return None
    if bool((count[count > 0] == ws).all()):  # every rank needs it: replicated, gradients summed
        out.grad_sum.add(key.rsplit(":", 1)[0])
        return None
    shared = bool((count != 1).any())
    found = _param_axis(own.view(shape), shape, shared, ws)
    if found is None and shared:
        return (
            f"the entries of {key.replace(':', '.')} are shared by some ranks only, so the mixer stays whole"
        )
    if found is None:
        return (
            f"no axis of {key.replace(':', '.')} splits it by the ranks' channels, so the mixer stays whole"
        )
    out.shards[key] = found
    return None


def _param_axis(grid: torch.Tensor, shape: tuple, shared: bool, ws: int) -> tuple | None:
    """``(axis, stride)``: the first axis of a parameter whose slices each belong to the ranks of one owner in
    ``grid`` (the owning rank per entry), split in runs (or, where entries are ``shared``, in groups replicated on
    consecutive ranks: a depthwise convolution's B / C channels, like in_proj's B / C); None when none does."""
    for axis, size in enumerate(shape):
        rows = grid.movedim(axis, 0).reshape(size, -1)
        if not bool((rows == rows[:, :1]).all()):
            continue  # a slice needed by several ranks
        if shared:
            stride = _grouped_layout(rows[:, 0].tolist(), ws)
        else:
            stride = _runs_layout(_single(rows[:, 0]), ws)
        if stride is not None:
            return (axis, stride)
    return None
