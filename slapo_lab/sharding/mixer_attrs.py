"""The per-rank attributes of a channel-parallel sequence mixer, found by search on rank copies.

A mixer's forward reads integer attributes (``intermediate_size``, ``conv_dim``, ``num_heads``, ``n_groups``;
the RG-LRU's ``num_attention_heads``) and, in its modules' run-time methods, integer config entries
(``self.config.<key>``: xLSTM's ``num_heads``, read by :func:`slapo_lab.sharding.heads.runtime_reads`). Those
equal to a split width, adjusted by the fewest additions / removals among the other even ones (every subset when
there are at most 5; at most ``_MAX_TRIES`` tries and ``_MAX_SEARCH_S`` seconds), are divided by the world size
on rank copies at world size 2 (:func:`_rank_copy`) until each rank's output-linear input equals its chunk of
the full one (and a gathered linear's rank inputs, concatenated, its full input: :func:`_emulate_gathers`);
each attribute the forward does not need is then dropped again (:func:`_find_attrs`). Widths that keep a
shared part (blocks replicated over some ranks) get their own per-rank value (:func:`_local_widths`). The
attention counterpart is :mod:`slapo_lab.sharding.heads`. Split from :mod:`slapo_lab.sharding.mixers`.
"""

from __future__ import annotations

import copy
import itertools
import time

import torch
from torch import nn

from .heads import runtime_reads
from .mixer_deps import _run, _StatMode, _with_stats
from .mixer_plan import MixerDeps, MixerPlan, _is_linear, plan
from .shard_layout import block_replicas, block_sizes, local_shard

_MAX_TRIES = 40
_MAX_SEARCH_S = 10.0  # seconds the per-rank attribute search may take per mixer


def _rank_copy(m: nn.Module, deps: MixerDeps, p: MixerPlan, ws: int, rank: int, attrs: dict) -> nn.Module:
    r = copy.deepcopy(m)
    with torch.no_grad():
        for lin, stride in p.columns.items():
            mod = r.get_submodule(lin)
            mod.weight = nn.Parameter(local_shard(mod.weight, 0, ws, rank, stride).clone())
            if mod.bias is not None:
                mod.bias = nn.Parameter(local_shard(mod.bias, 0, ws, rank, stride).clone())
            mod.out_features = mod.weight.shape[0]
        for key, (axis, stride) in p.shards.items():
            sub, name = key.rsplit(":", 1)
            mod = r.get_submodule(sub) if sub else r
            part = local_shard(getattr(mod, name), axis, ws, rank, stride).clone()
            if name in mod._buffers:
                mod._buffers[name] = part
            else:
                setattr(mod, name, nn.Parameter(part))
            _fix_conv(mod, name, axis)
    local = _local_widths(deps, p, ws)
    for k, v in attrs.items():
        _set_attr(r, k, local.get(v, v // ws))
    for sub, values in deps.stats.items():  # each rank's norm sees the statistics over all ranks' features
        mod = r.get_submodule(sub)
        width = next(t.shape[-1] for t in mod._parameters.values() if t is not None)
        _with_stats(mod, lambda values=values, width=width: _StatMode("replay", list(values), width))
    return r


def _local_widths(deps: MixerDeps, p: MixerPlan, ws: int) -> dict:
    """``{global width: this rank's width}`` over ``ws`` ranks for the widths whose split keeps a shared part
    whole (a fused projection or a convolution with blocks shared by several ranks: Mamba-2's ``conv_dim`` is
    ``x / ws + B + C`` per rank with one group); a width with two different answers is left out (its attribute
    is then divided by ``ws``, as every width of a plain split is)."""
    found: dict = {}

    def add(n: int, stride) -> None:
        if not getattr(stride, "groups", None) or not any(stride.groups):
            return
        sizes = block_sizes(n, stride)
        locs = [s * r // ws for s, r in zip(sizes, block_replicas(stride, len(sizes), ws), strict=True)]
        for i in range(len(sizes)):  # every run of consecutive blocks (a fused part, or all of them)
            for j in range(i + 1, len(sizes) + 1):
                found.setdefault(sum(sizes[i:j]), set()).add(sum(locs[i:j]))

    for lin, stride in p.columns.items():
        add(deps.feats[lin], stride)
    for key, (axis, stride) in p.shards.items():
        add(deps.shapes[key][axis], stride)
    return {g: next(iter(v)) for g, v in found.items() if len(v) == 1 and next(iter(v)) != g // ws}


def _set_attr(mixer: nn.Module, key: str, value: int) -> None:
    sub, _, name = key.rpartition(":")
    owner = mixer.get_submodule(sub) if sub else mixer
    if name.startswith("config."):
        # a count the forward reads from the config, shared by every layer (and, unsharded, every rank): the
        # modules of this mixer holding that config get one shallow copy of it with this rank's value (as
        # slapo_lab/sharding/heads.py gives an attention its own config)
        cfg = owner.config
        mine = copy.copy(cfg)
        setattr(mine, name[len("config.") :], value)
        for mod in mixer.modules():
            if getattr(mod, "config", None) is cfg:
                mod.config = mine
        return
    setattr(owner, name, value)


def _get_attr(mixer: nn.Module, key: str):
    sub, _, name = key.rpartition(":")
    try:
        owner = mixer.get_submodule(sub) if sub else mixer
        if name.startswith("config."):
            return getattr(owner.config, name[len("config.") :], None)
        return getattr(owner, name, None)
    except AttributeError:
        return None


def _read_at_run_time(m: nn.Module, key: str) -> bool:
    """Whether the attribute ``key`` (``"submodule:name"``) is read by its module's methods other than
    ``__init__`` (:func:`slapo_lab.sharding.heads.runtime_reads`; True when the class has no source)."""
    sub, _, name = key.rpartition(":")
    if name.startswith("config."):
        return True  # found among the run-time reads already
    try:
        reads = runtime_reads(type(m.get_submodule(sub) if sub else m))
    except AttributeError:
        return True
    return reads is None or name in reads[0]


def _config_ints(m: nn.Module, ws: int) -> dict:
    """``{"submodule:config.key": value}``: the integer config entries (above 1, divisible by ``ws``) that the
    run-time methods of ``m``'s modules read as ``self.config.<key>`` (xLSTM's ``num_heads``), keyed at the
    outermost module holding each config object."""
    out: dict = {}
    seen: set = set()
    for sub, mod in m.named_modules():
        cfg = getattr(mod, "config", None)
        if cfg is None or isinstance(cfg, (int, float, str, bool)):
            continue
        reads = runtime_reads(type(mod))
        if reads is None:
            continue
        for k in sorted(reads[1]):
            v = getattr(cfg, k, None)
            if type(v) is int and v > 1 and v % ws == 0 and (id(cfg), k) not in seen:
                seen.add((id(cfg), k))
                out[f"{sub}:config.{k}"] = v
    return out


def _emulate_gathers(r: nn.Module, deps: MixerDeps, p: MixerPlan, local: dict) -> None:
    """A rank copy's gathered linears: each keeps its local input in ``local`` and returns the full
    run's output (what the all-gathers give every rank)."""
    for g in p.gathers:
        full = deps.values[g][1]

        def forward(x, *_a, g=g, full=full, **_k):
            local.setdefault(g, x)
            return full

        r.get_submodule(g).forward = forward


def _fix_conv(mod: nn.Module, name: str, axis: int) -> None:
    """A depthwise ``nn.Conv1d`` whose weight was cut on its channels: its channel and group counts follow."""
    if isinstance(mod, nn.Conv1d) and name == "weight" and axis == 0 and mod.groups == mod.in_channels:
        c = mod.weight.shape[0]
        mod.in_channels = mod.out_channels = mod.groups = c


def _find_attrs(m: nn.Module, args, kwargs, x: torch.Tensor, deps: MixerDeps) -> dict | None:
    """The mixer attributes that make rank copies at world size 2 reproduce their chunks of ``x``, or None."""
    ws = 2
    p = plan(deps, ws)
    ints = {k: v for k, v in _int_attrs(m, ws).items() if _read_at_run_time(m, k)}

    def works(attempt) -> bool:
        return _rank_copies_work(m, args, kwargs, x, deps, p, ws, {k: ints[k] for k in attempt})

    t0 = time.perf_counter()
    for attempt in _attr_tries(ints, _split_widths(p, deps, x))[:_MAX_TRIES]:
        if time.perf_counter() - t0 > _MAX_SEARCH_S:
            break
        if works(attempt):
            keep = set(attempt)
            for k in sorted(attempt):  # the fewest: an attribute the forward does not read stays global
                if works(keep - {k}):
                    keep.discard(k)
            return {k: ints[k] for k in sorted(keep)}
    return None


def _split_widths(p: MixerPlan, deps: MixerDeps, x: torch.Tensor) -> set[int]:
    """The widths a split touches: the input linears' features, ``x``'s, and the blocks of each column layout
    and parameter shard of plan ``p``."""
    widths = set(deps.feats.values()) | {x.shape[-1]}
    for stride in p.columns.values():
        widths |= set(getattr(stride, "sizes", ()) or ())
        if not getattr(stride, "sizes", None) and int(stride) > 1:
            widths |= {deps.feats[next(iter(p.columns))] // int(stride)}
    for key, (axis, stride) in p.shards.items():
        widths.add(deps.shapes[key][axis])
        widths |= set(getattr(stride, "sizes", ()) or ())
    return widths


def _int_attrs(m: nn.Module, ws: int) -> dict[str, int]:
    """``{"submodule:attribute": value}`` (the mixer's own: ``":attribute"``) of the integer attributes of ``m``'s
    modules and config that divide by ``ws``; convolutions follow their weight instead."""
    ints = {
        f"{sub}:{k}": v
        for sub, mod in m.named_modules()
        if not _is_linear(mod) and not isinstance(mod, nn.modules.conv._ConvNd)
        for k, v in vars(mod).items()
        if type(v) is int and v > 1 and v % ws == 0 and not k.startswith("_") and k != "layer_idx"
    }
    ints.update(_config_ints(m, ws))
    return ints


def _attr_tries(ints: dict[str, int], widths: set[int]) -> list[frozenset]:
    """The sets of attributes to try, in order: those equal to a split width first, then the nearest changes of
    that set (every subset when there are few candidates)."""
    base = frozenset(k for k, v in ints.items() if v in widths)
    rest = sorted(set(ints) - base)
    tries = [base]
    if len(ints) <= 5:  # few candidates: every subset, the nearest to the split widths' first
        subsets = [
            frozenset(c) for r in range(len(ints) + 1) for c in itertools.combinations(sorted(ints), r)
        ]
        tries += sorted((t for t in subsets if t != base), key=lambda t: (len(t ^ base), sorted(t)))
    else:
        tries += [base | {k} for k in rest] + [base - {k} for k in sorted(base)]
        tries += [(base - {d}) | {a} for d in sorted(base) for a in rest]
        tries += [base | {a, b} for a, b in itertools.combinations(rest, 2)]
    return tries


def _rank_copies_work(
    m: nn.Module, args, kwargs, x: torch.Tensor, deps: MixerDeps, p: MixerPlan, ws: int, attrs: dict
) -> bool:
    """Whether rank copies of ``m`` with the per-rank ``attrs`` each reproduce their chunk of ``x``, and the
    ranks' inputs of each gathered linear make its full input."""
    half = x.shape[-1] // ws
    inputs: list = []
    for rank in range(ws):
        local: dict = {}
        try:
            r = _rank_copy(m, deps, p, ws, rank, attrs)
            _emulate_gathers(r, deps, p, local)
            with torch.no_grad():
                _, xr = _run(r, args, kwargs, None, deps.row)
        except Exception:  # noqa: BLE001 - these attributes do not fit: the next try
            return False
        inputs.append(local)
        want = x[..., rank * half : (rank + 1) * half]
        if (
            xr is None
            or tuple(xr.shape) != tuple(want.shape)
            or not torch.allclose(xr, want, atol=1e-5, rtol=1e-4)
        ):
            return False
    return _gathers_complete(p, deps, inputs)


def _gathers_complete(p: MixerPlan, deps: MixerDeps, inputs: list[dict]) -> bool:
    """Whether the ranks' inputs of each gathered linear, concatenated, are its full input."""
    for g in p.gathers:
        parts = [loc.get(g) for loc in inputs]
        full = deps.values[g][0]
        if full is None or any(x is None for x in parts):
            return False
        cat = torch.cat(parts, dim=-1)
        if tuple(cat.shape) != tuple(full.shape) or not torch.allclose(cat, full, atol=1e-5, rtol=1e-4):
            return False
    return True
