"""Channel-parallel sequence mixers (Mamba and kin), read from the mixer's feature dependencies.

A state-space or linear-attention mixer (HF ``Mamba2Mixer``, ``NemotronHMamba2Mixer``, ``MambaMixer``,
Qwen3-Next's / Qwen3.5's gated DeltaNet ``linear_attn``, RecurrentGemma's RG-LRU block, RWKV's time mixing ...)
projects the hidden states with one or more input linears (Mamba-2's fused ``in_proj``: ``z | x | B | C |
dt``), mixes each channel over time (a depthwise ``conv1d``, a selective scan or a delta rule per head, a gated
norm per group) and projects back with one output linear (``out_proj``). The index maps of
:mod:`slapo_lab.sharding.infer` stop at the scan; this module reads the split by differentiation instead.

**Candidates**: every module of a block (the block aside) holding two or more linears, outermost first, that
is not an attention the index maps read, holds no expert bank, and whose linears the index maps left unpaired
(or paired as an MLP while other linears or per-channel parameters of it stayed unexplained: RWKV's
``time_decay``). Its first call's arguments are recorded during the block's forward (:func:`capture`).

**Dependencies** (:func:`dependencies`): on a copy of the mixer with random weights (a meta mixer is
materialised on the CPU; state a forward left on a module, such as RecurrentGemma's ``recurrent_states``, is
cleared) and random inputs of the recorded shapes (positions counting 0, 1, ...; a state object such as a
transformers ``Cache`` copied as it was before the first call, afresh for each run), the linears run in some
order; the last one is the output linear, the others the input linears, whose outputs are replaced by leaves.
The output linear's input ``X`` (``(..., F)``) is cut into ``K`` chunks of features (``K``, a power of two up
to 16 dividing ``F``) and, for each chunk, the gradient of a positive random weighting of it is taken with
respect to every input linear's output and every other parameter of the mixer (a depthwise convolution's
weight and bias, ``A_log``, ``D``, ``dt_bias``, a gated norm's weight, a linear whose weight the forward uses
directly: Mamba's ``dt_proj``). Its non-zero pattern is which input features and parameter entries the chunk's
channels need.

**Plan** (:func:`plan`): for a world size ``ws`` dividing ``K``, rank ``r`` owns chunks ``[r K/ws, (r+1)
K/ws)`` (the output linear is row parallel, its input features split contiguously):

* an input linear whose features partition over the ranks is column parallel, with the layout that cuts each
  of its blocks alike (a :class:`~slapo_lab.sharding.rules.BlockStride` of the fused parts: Megatron-LM's
  ``megatron/core/ssm/mamba_mixer.py`` splits each of ``z``, ``x``, ``B``, ``C``, ``dt`` of ``in_proj`` by its
  local width, ``ngroups_local_tp = ngroups // tp``);
* an input linear fed by other input linears whose every output all ranks need (Mamba's ``x_proj``: ``dt``,
  ``B``, ``C`` from all channels) is computed from the gathered channels, its output features split and
  gathered again (``"gather_linear"``: the gathers' backward reduce-scatters sum the ranks' partial gradients);
  a column fed by such a gather skips its own input-gradient all-reduce (``"column_shard"``);
* an input linear whose output reaches the channels only through other input linears (a low-rank "a": Kimi's
  ``g_a_proj`` -> ``g_b_proj``) stays whole (``low_rank``); the column-parallel linears it feeds sum their
  input gradients over the ranks, so its gradients are complete;
* every other parameter is split on the axis whose slices each rank needs alone (the convolution by channel
  over its ``[x, B, C]`` blocks, ``A_log`` / ``D`` / ``dt_bias`` by head, the grouped norm by group), or, when
  every rank needs all of it, replicated with its gradient summed over the ranks (``"grad_sum"``);
* features several ranks need, in blocks each shared by consecutive ranks (Mamba-2's ``B`` / ``C`` with fewer
  groups than ranks: vLLM replicates them, Megatron-LM requires ``ngroups % tp == 0``), are replicated on those
  ranks, the rest split: a
  :class:`~slapo_lab.sharding.rules.BlockStride` with ``groups`` for the input linear, the convolution's ``B`` /
  ``C`` channels and a per-feature buffer (Falcon-H1's ``mup_vector``) alike; the shard primitive sums the
  gradient of a shared block over the ranks holding it (moved to the mixer's forward when the mixer reads the
  child's weight without calling it: ``causal_conv1d_fn``);
* a norm whose statistics span the channels (Mamba-2's gated norm with one group) is read with its statistics
  detached and then split by features with its statistics summed over the ranks
  (:mod:`slapo_lab.sharding.feature_stats`, kind ``"features"``; vLLM's ``Mixer2RMSNormGated`` all-reduces the
  variance over the TP group the same way when ``n_groups == 1``);
* anything else shared by some ranks, or features no rank needs, keep the mixer whole, with that sentence.

**Per-rank attributes**: the integer attributes of the mixer and its submodules that its forward reads
(``intermediate_size``, ``conv_dim``, ``num_heads``, ``n_groups``; the RG-LRU's ``num_attention_heads``) must
hold per-rank values, and so must the integer config entries that the run-time methods of its modules read as
``self.config.<key>`` (xLSTM's ``num_heads``; the mixer then gets its own shallow copy of the config, as an
attention does in :mod:`slapo_lab.sharding.heads`). Those equal to a split width, adjusted by the fewest
additions / removals among the other even ones (only those a run-time method reads; every subset when there
are at most 5) are divided by the world size on rank copies at world size 2 until each rank's ``X`` equals its
chunk of the full ``X`` (and a gathered linear's rank inputs, concatenated, its full input); then each
attribute the forward does not need is dropped again. Without such values the mixer stays whole. The layouts
and attributes are registered per mixer class and parameter shape, so the shard primitive (through
:class:`MixerRule`) finds them in any process (a replay, an exported script, the numeric check's copy).
Sources: Megatron-LM ``megatron/core/ssm/mamba_mixer.py`` (``MambaMixer``), transformers
``models/mamba2/modeling_mamba2.py``, ``models/mamba/modeling_mamba.py``.

This module holds the entry points (:func:`complete`, :func:`dependencies`, :func:`layers`, :func:`reason`) and
:class:`MixerRule` with its registries; the parts live in :mod:`slapo_lab.sharding.mixer_deps` (recording and
differentiating a mixer), :mod:`slapo_lab.sharding.mixer_plan` (:class:`MixerDeps`, :class:`MixerPlan`,
:func:`plan`) and :mod:`slapo_lab.sharding.mixer_attrs` (the per-rank attribute search), re-exported here.
"""

from __future__ import annotations

import copy
import threading

import torch
from torch import nn

from ..module_state import install_forward, module_meta, peek_meta
from . import infer_registry
from .experts import is_experts_module
from .infer_maps import BlockSplit, Layout
from .mixer_attrs import _find_attrs, _fix_conv, _get_attr, _local_widths, _set_attr
from .mixer_deps import (
    _dependencies,
    _materialise,
    _real_inputs,
    _run,
    _stat_norms,
    _stats_split_features,
    capture,
)
from .mixer_plan import (
    MAX_CHUNKS,
    MixerDeps,
    MixerPlan,
    _grouped_layout,  # noqa: F401 - tests/test_shared_mixer_groups.py reads it from here
    _is_linear,
    _world_sizes,
    plan,
)
from .rules import _DEFAULT, _RULES, BlockStride, ShardRule, ShardSite, is_norm, register_shard_rule

_LOCK = threading.RLock()
_LAYOUTS: dict = {}  # (owner class, param name, global shape) -> {ws: (axis, stride)}
_ATTRS: dict = {}  # (mixer class, signature of its parameter shapes) -> {attr: global value}
_ATTR_LOCAL: dict = {}  # the same key -> {ws: {global width: per-rank width}} where that is not global / ws
_UNRUN: set = set()  # (mixer class, submodule) whose forward the mixer never calls (it reads the weights)
_CLASSES: set = set()


def complete(split: BlockSplit, block: nn.Module, captured: dict) -> None:
    """Add the mixers of ``block`` (paths in ``captured``) that the index maps could not split to ``split``:
    their input linears become ``"mlp_in"`` with their layout, the output linear ``"mlp_out"``, and
    ``split.mixers`` (``{mixer path: MixerDeps}``) keeps the dependencies for :func:`layers`."""
    found = getattr(split, "mixers", None) or {}
    for rel, (args, kwargs) in captured.items():
        mixer = block.get_submodule(rel)
        kids = [f"{rel}.{n}" for n, c in mixer.named_modules() if n and _is_linear(c)]
        paired = [k for k in kids if k in split.roles]
        partial_mlp = _partial_mlp(split, mixer, kids, paired)
        # one "head" read by the index maps (a linear-attention recurrence, Qwen3.5's gated DeltaNet, whose
        # scores the maps see as a single head) is no head split: the channels may still split
        one_head = split.attention.get(rel, (0, 0))[0] == 1 and not any(k in split.roles for k in kids)
        if _maps_answer_stands(split, rel, mixer, kids, found, partial_mlp, one_head):
            continue  # an attention (split or refused by its heads) or an MLP: the index maps' answer stands
        try:
            deps = dependencies(mixer, args, kwargs)
        except Exception:  # noqa: BLE001, S112 - a mixer that cannot run alone: the index maps' answer stands
            continue
        if deps is None:
            continue
        p2 = plan(deps, 2)
        if (p2.reason or deps.attrs is None) and partial_mlp:
            continue  # the index maps' MLP pair stands
        found[rel] = deps
        if p2.reason or deps.attrs is None:
            _keep_whole(split, rel, mixer, deps, p2)
            continue
        for k in paired:
            split.roles.pop(k, None)
            split.layouts.pop(k, None)
        if one_head:
            split.attention.pop(rel, None)
            split.refusals.pop(rel, None)
            for k in kids:
                split.refused_roles.pop(k, None)
        _note_mixer_split(split, rel, mixer, deps, p2)
    split.mixers = found


def _partial_mlp(split: BlockSplit, mixer: nn.Module, kids: list[str], paired: list[str]) -> bool:
    """Whether the index maps found an MLP pair (``paired``) inside a mixer whose other input linears (of
    ``kids``) or whose per-channel parameters (RWKV's time_decay) they could not follow."""
    own = any(  # per-channel parameters besides the linears and the norms
        p is not None
        for sub, mod in mixer.named_modules()
        if not _is_linear(mod) and not is_norm(mod)
        for p in mod._parameters.values()
    )
    return bool(
        paired
        and (len(paired) < len(kids) or own)
        and all(split.roles[k] in ("mlp_in", "mlp_out") for k in paired)
    )


def _maps_answer_stands(
    split: BlockSplit,
    rel: str,
    mixer: nn.Module,
    kids: list[str],
    found: dict,
    partial_mlp: bool,
    one_head: bool,
) -> bool:
    """Whether the index maps' answer stands for the mixer at ``rel``: a mixture of experts
    (slapo_lab/sharding/experts.py), an attention split or refused by its heads, an MLP, or a mixer inside one
    already found."""
    return bool(
        _has_experts(mixer)
        or any(
            (k in split.roles and not partial_mlp) or (k in split.refused_roles and not one_head)
            for k in kids
        )
        or any(rel.startswith(m + ".") for m in found)
        or any((a == rel and not one_head) or a.startswith(rel + ".") for a in split.attention)
    )


def _keep_whole(split: BlockSplit, rel: str, mixer: nn.Module, deps: MixerDeps, p2: MixerPlan) -> None:
    """The linears of a mixer no per-rank split of its channels exists for stay whole (``split.unpaired``)."""
    for k in [*deps.outs, deps.row]:
        split.unpaired.add(f"{rel}.{k}")
        split.whole[f"{rel}.{k}"] = p2.reason or (
            f"no per-rank values of {type(mixer).__name__}'s attributes reproduce its channels on each "
            "rank, so the mixer stays whole"
        )


def _note_mixer_split(split: BlockSplit, rel: str, mixer: nn.Module, deps: MixerDeps, p2: MixerPlan) -> None:
    """The roles and layouts of a mixer's linears by its plan ``p2`` at 2 ranks: low-rank ones whole, column
    parallel (``"mlp_in"``, or ``"mixer_column"`` whose input gradient a gather sums), gathered, and the output
    linear ``"mlp_out"``."""
    for k, fed in p2.low_rank.items():
        split.whole[f"{rel}.{k}"] = (
            f"a low-rank projection whose output reaches the channels only through {', '.join(fed)} (column "
            "parallel, its input gradient summed over the ranks): it stays whole"
        )
    for k, stride in p2.columns.items():
        # "mlp_in": column parallel (registered by infer); "mixer_column": column parallel whose input
        # gradient a gather sums, applied by layers() with the layout registered here
        role = "mlp_in" if p2.kinds[k] == "column" else "mixer_column"
        split.roles[f"{rel}.{k}"] = role
        split.layouts[f"{rel}.{k}"] = Layout("in", stride, None)
        split.whole.pop(f"{rel}.{k}", None)
        if role != "mlp_in":
            _register_layout(mixer, k, Layout("in", stride, None))
    for k in p2.gathers:
        split.roles[f"{rel}.{k}"] = "mixer_gather"
        split.whole.pop(f"{rel}.{k}", None)
    split.roles[f"{rel}.{deps.row}"] = "mlp_out"
    split.whole.pop(f"{rel}.{deps.row}", None)
    _register(mixer, deps)


def _has_experts(mod: nn.Module) -> bool:
    """Whether ``mod`` holds an expert bank (transformers 5.x's 3-D experts module, or a list of experts)."""
    return any(
        is_experts_module(m)
        or (isinstance(m, nn.ModuleList) and "expert" in f"{n} {type(m).__name__}".lower())
        for n, m in mod.named_modules()
    )


def _register_layout(mixer: nn.Module, child: str, lay) -> None:
    """The column layout of ``mixer``'s linear ``child`` for the shard rules (as infer registers an MLP input)."""
    parent_rel, _, name = child.rpartition(".")
    parent = mixer.get_submodule(parent_rel) if parent_rel else mixer
    key = (type(parent).__name__, name, infer_registry._config_digest(getattr(parent, "config", None)))
    infer_registry._REGISTRY[key] = ("mlp_in", lay, None)


def _owner_key(mixer: nn.Module, sub: str, name: str, shape) -> tuple:
    owner = mixer.get_submodule(sub) if sub else mixer
    cls = type(mixer).__name__ + (f".{sub}" if sub else "")
    return (cls, type(owner).__name__, name, tuple(shape))


def _register(mixer: nn.Module, deps: MixerDeps) -> None:
    """Make each parameter's layout (per world size) and the per-rank attributes visible to :class:`MixerRule`."""
    with _LOCK:
        for key, shape in deps.shapes.items():
            sub, name = key.rsplit(":", 1)
            if (
                sub in deps.stats
            ):  # a norm over split features: FeatureStatsRule's (sharding/feature_stats.py),
                _LAYOUTS.pop(_owner_key(mixer, sub, name, shape), None)  # also where another config split it
                continue
            layouts = {}
            for ws in _world_sizes(deps.chunks):
                p = plan(deps, ws)  # cached per world size
                if p.reason is None and key in p.shards:
                    layouts[ws] = p.shards[key]
            if layouts:
                _LAYOUTS[_owner_key(mixer, sub, name, shape)] = layouts
                _CLASSES.add(type(mixer.get_submodule(sub) if sub else mixer).__name__)
        _ATTRS[(type(mixer).__name__, _shape_sig(mixer))] = dict(deps.attrs or {})
        _UNRUN.update((type(mixer).__name__, sub) for sub in deps.unrun)
        _ATTR_LOCAL[(type(mixer).__name__, _shape_sig(mixer))] = {
            ws: _local_widths(deps, plan(deps, ws), ws)
            for ws in _world_sizes(deps.chunks)
            if plan(deps, ws).reason is None
        }


def _shape_sig(mixer: nn.Module) -> tuple:
    return tuple(
        (n, tuple(getattr(p, "orig_shape", p.shape))) for n, p in mixer.named_parameters(recurse=False)
    )


# ------------------------------------------------------------------------------------------- the dependencies
def dependencies(mixer: nn.Module, args: tuple, kwargs: dict) -> MixerDeps | None:
    """The :class:`MixerDeps` of ``mixer`` (called with ``args`` / ``kwargs``, meta or real), or None when it is no
    mixer of this kind (fewer than one input linear before its last linear, features not a power-of-two
    multiple, inputs without a gradient path).

    When every rank's channels need features of several ranks, the dependencies are read again with the
    statistics over the last axis of the mixer's norm-like modules (leaves with parameters whose forward takes a
    ``mean`` / ``sum`` / ``var`` / ``std`` over its features: Mamba-2's gated norm with one group) detached: such a
    statistic, summed over the ranks (:mod:`slapo_lab.sharding.feature_stats`), is no reason to keep the mixer
    whole. Those norms (``deps.stats``) are then split by their features, contiguously, like the output linear's
    input; any other split of them keeps the first reading's reason."""
    pristine = _materialise(mixer)
    g = torch.Generator().manual_seed(1)
    a, kw = _real_inputs(args, kwargs, g)
    first = copy.deepcopy(pristine)
    ran: set = set()
    hooks = [
        mod.register_forward_pre_hook(lambda *_a, sub=sub: ran.add(sub))
        for sub, mod in first.named_modules()
        if sub
    ]
    with torch.no_grad():
        order, _ = _run(first, a, kw)
    for h in hooks:
        h.remove()
    order = list(dict.fromkeys(order))
    if len(order) < 2:
        return None
    got = _dependencies(pristine, a, kw, order, g, {})
    if got is None:
        return None
    deps, x = got
    deps.unrun = {  # (Mamba-2's conv1d: its weight read by causal_conv1d_fn)
        sub
        for sub, mod in first.named_modules()
        if sub and sub not in ran and any(p is not None for p in mod._parameters.values())
    }
    if plan(deps, 2).reason:
        norms = _stat_norms(pristine, a, kw)
        again = _dependencies(pristine, a, kw, order, g, norms) if norms else None
        if again is not None and not plan(again[0], 2).reason and _stats_split_features(again[0], norms):
            deps, x = again
            deps.stats, deps.unrun = norms, got[0].unrun
    if not plan(deps, 2).reason:
        deps.attrs = _find_attrs(pristine, a, kw, x.detach(), deps)
    return deps


# ------------------------------------------------------------------------------------------ preset layers
def layers(split: BlockSplit, block_path: str, ws: int) -> list[tuple[str, str]]:
    """``(path, kind)`` for the mixers' parameters of a block over ``ws`` ranks, one entry per module:
    ``"channel_params:<name>=<axis>,..."`` (shards on the axes :func:`plan` found; :class:`MixerRule` gives their
    layouts; ``";grad_sum"`` after them when the module's other parameters are replicated and sum their
    gradients), ``"grad_sum"``, or ``"features"`` for a norm whose statistics span the split features (see
    :func:`dependencies`); a path here replaces the index maps' kind for it."""
    pre = f"{block_path}." if block_path else ""
    out = []
    for rel, deps in (getattr(split, "mixers", None) or {}).items():
        p = plan(deps, ws)
        if p.reason or deps.attrs is None:
            continue
        for k, kind in p.kinds.items():
            if kind != "column":  # "column" linears come through their "mlp_in" role
                out.append((pre + f"{rel}.{k}", kind))
        per_module: dict = {}
        for key, (axis, _stride) in p.shards.items():
            sub, name = key.rsplit(":", 1)
            per_module.setdefault(sub, []).append(f"{name}={axis}")
        for sub in sorted(set(per_module) | p.grad_sum):
            path = pre + ".".join(x for x in (rel, sub) if x)
            if sub in deps.stats:  # its statistics summed over the ranks, its parameters split by feature
                out.append((path, "features"))
                continue
            if sub not in per_module:
                out.append((path, "grad_sum"))
                continue
            tail = ";grad_sum" if sub in p.grad_sum else ""  # its other (replicated) parameters sum gradients
            out.append((path, "channel_params:" + ",".join(per_module[sub]) + tail))
    return out


def reason(split: BlockSplit, rel: str, ws: int) -> str | None:
    """Why the mixer around the linear ``rel`` (a path in the block) stays whole over ``ws`` ranks, or None."""
    for mrel, deps in (getattr(split, "mixers", None) or {}).items():
        if rel.startswith(mrel + "."):
            p = plan(deps, ws)
            return p.reason
    return None


class MixerRule(ShardRule):
    """The shard rule of a mixer's own parameters and of its channel-wise children (a depthwise ``nn.Conv1d``,
    a gated norm), for the tensors :func:`complete` registered: their stride comes from the plan, a depthwise
    convolution's channel and group counts follow its weight, and the mixer's per-rank attributes are divided
    by the world size once (recorded in ``ModuleMeta.mixer_attrs`` as ``{name: [global, local]}``)."""

    def _layout(self, site, axis: int, ws: int):
        mod = site.mod
        shape = tuple(getattr(getattr(mod, site.name), "orig_shape", getattr(mod, site.name).shape))
        keys = [(type(mod).__name__, type(mod).__name__, site.name, shape)]
        if site.parent is not None:
            keys.append(
                (f"{type(site.parent).__name__}.{site.child_name}", type(mod).__name__, site.name, shape)
            )
        for k in keys:
            lay = _LAYOUTS.get(k)
            if lay and ws in lay and lay[ws][0] == axis:
                return lay[ws], k
        return None, None

    def matches(self, mod: nn.Module) -> bool:
        return (
            type(mod).__name__ in _CLASSES
            and not _is_linear(mod)
            and any(self._registered(mod, n) for n in [*mod._parameters, *mod._buffers])
        )

    def _other(self, mod) -> ShardRule:
        """The rule that would own ``mod`` without this one (for tensors no mixer plan registered)."""
        return next((r for r in _RULES if r is not self and r.matches(mod)), _DEFAULT)

    def _registered(self, mod, name: str) -> bool:
        t = getattr(mod, name, None)
        if not isinstance(t, torch.Tensor):
            return False
        shape = tuple(getattr(t, "orig_shape", t.shape))
        return any(k[1] == type(mod).__name__ and k[2] == name and k[3] == shape for k in _LAYOUTS)

    def check(self, mod: nn.Module, name: str, axis: int) -> str | None:
        return None if self._registered(mod, name) else self._other(mod).check(mod, name, axis)

    def check_site(self, site: ShardSite, axis: int, world_size: int) -> str | None:
        if self._registered(site.mod, site.name):
            return None
        other = getattr(self._other(site.mod), "check_site", None)
        return other(site, axis, world_size) if other else None

    def stride(self, site: ShardSite, axis: int) -> int | BlockStride:
        for ws in _world_sizes(MAX_CHUNKS):
            lay, _ = self._layout(site, axis, ws)
            if lay is not None:
                return lay[1]
        other = getattr(self._other(site.mod), "stride", None)
        return other(site, axis) if other else 1

    def replicas(self, site: ShardSite, axis: int, world_size: int) -> int:
        if self._registered(site.mod, site.name):
            return 1
        other = getattr(self._other(site.mod), "replicas", None)
        return other(site, axis, world_size) if other else 1

    def apply(self, mod: nn.Module, name: str, axis: int, world_size: int, rank: int) -> None:
        if not self._registered(mod, name):
            self._other(mod).apply(mod, name, axis, world_size, rank)
            return
        _fix_conv(mod, name, axis)

    def apply_site(self, site: ShardSite, axis: int, world_size: int, rank: int) -> None:
        lay, key = self._layout(site, axis, world_size)
        if lay is None:
            other = getattr(self._other(site.mod), "apply_site", None)
            if other:
                other(site, axis, world_size, rank)
            return
        mixer = site.mod if "." not in key[0] else site.parent
        if mixer is None:
            return
        if mixer is not site.mod and (type(mixer).__name__, site.child_name) in _UNRUN:
            _move_block_grads(site.mod, site.child_name, mixer)
        attrs = _ATTRS.get((type(mixer).__name__, _shape_sig(mixer)))
        meta = module_meta(mixer)
        if not attrs or meta.mixer_attrs is not None:
            return
        done = {}
        local = _ATTR_LOCAL.get((type(mixer).__name__, _shape_sig(mixer)), {}).get(world_size, {})
        for k, v in attrs.items():
            if _get_attr(mixer, k) == v:
                _set_attr(mixer, k, local.get(v, v // world_size))
            done[k] = [v, local.get(v, v // world_size)]
        meta.mixer_attrs = done


def _move_block_grads(child: nn.Module, child_name: str, mixer: nn.Module) -> None:
    """The gradient sums of ``child``'s replicated blocks (the shard primitive's ``grad_block_replicas``), taken
    by ``mixer``'s forward instead: the mixer reads ``child``'s weights without calling it (Mamba-2's ``conv1d``
    through ``causal_conv1d_fn``), so a sum installed on ``child``'s forward would never run."""
    meta = peek_meta(child)
    blocks = meta.grad_block_replicas if meta else None
    if not blocks:
        return
    target = module_meta(mixer)
    for name, spec in list(blocks.items()):
        target.grad_block_replicas[f"{child_name}.{name}"] = spec
        target.grad_block_group = meta.grad_block_group
        del blocks[name]
    install_forward(mixer)


register_shard_rule(MixerRule())

__all__ = ["MixerDeps", "MixerPlan", "MixerRule", "capture", "complete", "dependencies", "layers", "plan"]
