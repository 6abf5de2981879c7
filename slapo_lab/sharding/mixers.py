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
"""

from __future__ import annotations

import copy
import itertools
import threading
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..module_state import module_meta
from .rules import ShardRule, is_norm, local_shard, make_stride, register_shard_rule

MAX_CHUNKS = 16
_MAX_TRIES = 40
_MAX_SEARCH_S = 10.0  # seconds the per-rank attribute search may take per mixer


class _Stop(Exception):
    pass


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


def capture(block: nn.Module, store: dict) -> list:
    """Forward pre-hooks on every module of ``block`` (the block itself aside) holding two or more linears (a
    candidate mixer: Mamba's ``mixer``, or MRA's ``attention`` around its ``self.query`` ... ``output.dense``)
    that keep its first call's arguments in ``store[rel]``; returns the handles."""
    handles = []
    for rel, m in block.named_modules():
        if not rel or _is_linear(m) or sum(_is_linear(c) for c in m.modules()) < 2:
            continue

        def pre(_m, args, kwargs, rel=rel):
            if rel not in store:  # state objects (a cache) as they were before the call, which fills them
                store[rel] = (_fresh(args), {k: _fresh(v) for k, v in kwargs.items()})

        handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
    return handles


def _is_linear(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear)


_PLAIN = (torch.Tensor, nn.Module, int, float, bool, str, bytes, type(None), torch.dtype, torch.device)


def _fresh(x):
    """``x`` with each state object in it (anything but tensors, modules, plain values and containers: a
    transformers ``Cache`` that the mixer's forward fills with its convolution and recurrent states) replaced
    by a deep copy, so each run of the mixer starts from the state it was first called with (a forward that
    read the state left by an earlier run would see a longer sequence, and in-place state updates break the
    gradients); an object that cannot be copied is kept."""
    if isinstance(x, _PLAIN) or callable(x):
        return x
    if isinstance(x, (list, tuple)):
        return type(x)(_fresh(y) for y in x)
    if isinstance(x, dict):
        return {k: _fresh(v) for k, v in x.items()}
    try:
        return copy.deepcopy(x)
    except Exception:  # noqa: BLE001 - an object without a copy: shared, as before
        return x


_LOCK = threading.RLock()
_LAYOUTS: dict = {}  # (owner class, param name, global shape) -> {ws: (axis, stride)}
_ATTRS: dict = {}  # (mixer class, signature of its parameter shapes) -> {attr: global value}
_ATTR_LOCAL: dict = {}  # the same key -> {ws: {global width: per-rank width}} where that is not global / ws
_UNRUN: set = set()  # (mixer class, submodule) whose forward the mixer never calls (it reads the weights)
_CLASSES: set = set()


def complete(split, block: nn.Module, captured: dict) -> None:
    """Add the mixers of ``block`` (paths in ``captured``) that the index maps could not split to ``split``:
    their input linears become ``"mlp_in"`` with their layout, the output linear ``"mlp_out"``, and
    ``split.mixers`` (``{mixer path: MixerDeps}``) keeps the dependencies for :func:`layers`."""
    from .infer import Layout

    found = getattr(split, "mixers", None) or {}
    for rel, (args, kwargs) in captured.items():
        mixer = block.get_submodule(rel)
        kids = [f"{rel}.{n}" for n, c in mixer.named_modules() if n and _is_linear(c)]
        paired = [k for k in kids if k in split.roles]
        own = any(  # per-channel parameters besides the linears and the norms
            p is not None
            for sub, mod in mixer.named_modules()
            if not _is_linear(mod) and not is_norm(mod)
            for p in mod._parameters.values()
        )
        partial_mlp = (
            paired
            and (len(paired) < len(kids) or own)
            and all(split.roles[k] in ("mlp_in", "mlp_out") for k in paired)
        )  # an MLP pair the index maps found inside a mixer whose other input linears or whose per-channel
        # parameters (RWKV's time_decay) they could not follow
        # one "head" read by the index maps (a linear-attention recurrence, Qwen3.5's gated DeltaNet, whose
        # scores the maps see as a single head) is no head split: the channels may still split
        one_head = split.attention.get(rel, (0, 0))[0] == 1 and not any(k in split.roles for k in kids)
        if (
            _has_experts(mixer)  # a mixture of experts: slapo_lab/sharding/experts.py
            or any(
                (k in split.roles and not partial_mlp) or (k in split.refused_roles and not one_head)
                for k in kids
            )
            or any(rel.startswith(m + ".") for m in found)
            or any((a == rel and not one_head) or a.startswith(rel + ".") for a in split.attention)
        ):
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
            for k in [*deps.outs, deps.row]:
                split.unpaired.add(f"{rel}.{k}")
                split.whole[f"{rel}.{k}"] = p2.reason or (
                    f"no per-rank values of {type(mixer).__name__}'s attributes reproduce its channels on each "
                    "rank, so the mixer stays whole"
                )
            continue
        for k in paired:
            split.roles.pop(k, None)
            split.layouts.pop(k, None)
        for k, fed in p2.low_rank.items():
            split.whole[f"{rel}.{k}"] = (
                f"a low-rank projection whose output reaches the channels only through {', '.join(fed)} (column "
                "parallel, its input gradient summed over the ranks): it stays whole"
            )
        if one_head:
            split.attention.pop(rel, None)
            split.refusals.pop(rel, None)
            for k in kids:
                split.refused_roles.pop(k, None)
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
    split.mixers = found


def _has_experts(mod: nn.Module) -> bool:
    """Whether ``mod`` holds an expert bank (transformers 5.x's 3-D experts module, or a list of experts)."""
    from .experts import is_experts_module

    return any(
        is_experts_module(m)
        or (isinstance(m, nn.ModuleList) and "expert" in f"{n} {type(m).__name__}".lower())
        for n, m in mod.named_modules()
    )


def _register_layout(mixer: nn.Module, child: str, lay) -> None:
    """The column layout of ``mixer``'s linear ``child`` for the shard rules (as infer registers an MLP input)."""
    from . import infer

    parent_rel, _, name = child.rpartition(".")
    parent = mixer.get_submodule(parent_rel) if parent_rel else mixer
    key = (type(parent).__name__, name, infer._config_digest(getattr(parent, "config", None)))
    infer._REGISTRY[key] = ("mlp_in", lay, None)


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


def _world_sizes(chunks: int) -> list[int]:
    return [w for w in (2, 4, 8, 16) if chunks % w == 0]


# ------------------------------------------------------------------------------------------- the dependencies
def _materialise(mixer: nn.Module) -> nn.Module:
    """A float32 CPU copy of ``mixer`` with random parameters (seeded), buffers kept where they hold values."""
    meta = any(t.is_meta for t in itertools.chain(mixer.parameters(), mixer.buffers()))
    m = copy.deepcopy(mixer)
    if meta:
        m = m.to_empty(device="cpu")
    m = m.float()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        if meta:
            for b in m.buffers():
                if b.is_floating_point():
                    b.copy_(torch.randn(b.shape, generator=g))
                else:
                    b.zero_()
    for (
        mod
    ) in m.modules():  # state a forward left on the module (RecurrentGemma's recurrent_states): none yet
        for k, v in list(vars(mod).items()):
            if isinstance(v, torch.Tensor) and not k.startswith("_"):
                setattr(mod, k, None)
    m.eval()
    return m


def _real_inputs(args, kwargs, g):
    def conv(x, key=""):
        if isinstance(x, torch.Tensor):
            if x.is_floating_point():
                return torch.randn(x.shape, generator=g)
            if x.dtype == torch.bool or "mask" in key:
                return torch.ones(x.shape, dtype=x.dtype)
            if not x.is_meta:
                return x.to("cpu")
            if "position" in key and x.dim():  # positions 0, 1, ... (a zero position resets a recurrence)
                return torch.arange(x.shape[-1], dtype=x.dtype).expand(x.shape).contiguous()
            return torch.zeros(x.shape, dtype=x.dtype)
        if isinstance(x, (list, tuple)):
            return type(x)(conv(y) for y in x)
        return x

    return conv(list(args)), {k: conv(v, k) for k, v in kwargs.items()}


def _run(
    m: nn.Module, args, kwargs, leaves: dict | None = None, row: str | None = None, seen: dict | None = None
):
    """Run ``m``; the output of each linear in ``leaves`` (path -> None) is replaced by a leaf that requires
    grad (stored there), and the input of ``row`` is returned (the run stops there). Returns (order of the
    linears called, row input)."""
    order, handles, got = [], [], {}
    for rel, c in m.named_modules():
        if not _is_linear(c) or not rel:
            continue

        def pre(_c, a, rel=rel):
            order.append(rel)
            if seen is not None:
                seen.setdefault(rel, a[0])
            if rel == row:
                got["x"] = a[0]
                raise _Stop

        def post(_c, _a, out, rel=rel):
            if leaves is not None and rel in leaves:
                leaf = out.detach().clone().requires_grad_(True)
                leaves[rel] = leaf
                return leaf
            return None

        handles += [c.register_forward_pre_hook(pre), c.register_forward_hook(post)]
    try:
        m(*_fresh(list(args)), **{k: _fresh(v) for k, v in kwargs.items()})
    except _Stop:
        pass
    finally:
        for h in handles:
            h.remove()
    return order, got.get("x")


def dependencies(mixer: nn.Module, args, kwargs) -> MixerDeps | None:
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


class _StatMode(TorchFunctionMode):
    """Inside a norm-like module: each ``mean`` / ``sum`` / ``var`` / ``std`` over the last axis is detached
    (``"detach"``), recorded in ``store`` in call order (``"record"``), or, where its input holds ``local`` features,
    replaced by the next recorded value (``"replay"``: a rank copy gets the statistic over all ranks' features, as
    :class:`~slapo_lab.sharding.feature_stats.GlobalFeatureStats` gives it at run time)."""

    def __init__(self, how: str, store: list, local: int | None = None) -> None:
        super().__init__()
        self.how, self.store, self.local, self.hits = how, store, local, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from .feature_stats import _dims

        kwargs = dict(kwargs or {})
        out = func(*args, **kwargs)
        x = args[0] if args else kwargs.get("input")
        if getattr(func, "__name__", "") not in ("mean", "sum", "var", "std") or not isinstance(
            x, torch.Tensor
        ):
            return out
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if x.dim() < 1 or not isinstance(dim, (int, tuple, list, type(None))):
            return out
        if x.dim() - 1 not in _dims(dim, x.dim()):
            return out
        self.hits += 1
        if self.how == "detach":
            return out.detach()
        if self.how == "record":
            self.store.append(out.detach())
            return out
        v = self.store.pop(0) if self.store else None
        if x.shape[-1] == self.local and v is not None and v.shape == out.shape:
            return v
        return out


def _with_stats(mod: nn.Module, make) -> None:
    """Run ``mod``'s forward (on this instance) under the mode ``make()`` returns."""
    inner = mod.forward

    def forward(*a, **k):
        mode = make()
        with mode:
            return inner(*a, **k)

    mod.forward = forward


def _stat_norms(m: nn.Module, args, kwargs) -> dict:
    """The norm-like modules of ``m`` (leaves other than linears and convolutions holding parameters) whose
    forward takes a statistic over its last axis, with those statistics' values in a run of ``m``:
    ``{path: [values]}``."""
    r = copy.deepcopy(m)
    found: dict = {}
    for sub, mod in r.named_modules():
        if (
            sub
            and not _is_linear(mod)
            and not isinstance(mod, nn.modules.conv._ConvNd)
            and any(p is not None for p in mod._parameters.values())
            and not any(True for _ in mod.children())
        ):
            found[sub] = []
            _with_stats(mod, lambda store=found[sub]: _StatMode("record", store))
    try:
        with torch.no_grad():
            r(*args, **kwargs)
    except Exception:  # noqa: BLE001 - no reading of its statistics
        return {}
    return {k: v for k, v in found.items() if v}


def _stats_split_features(deps: MixerDeps, norms: dict) -> bool:
    """Whether each norm in ``norms`` is split contiguously on the last axis of its parameters at every world
    size the plan allows (its features follow the output linear's input), never replicated."""
    for ws in _world_sizes(deps.chunks):
        p = plan(deps, ws)
        if p.reason:
            continue
        for key, shape in deps.shapes.items():
            sub = key.rsplit(":", 1)[0]
            if sub in norms and (sub in p.grad_sum or p.shards.get(key) != (len(shape) - 1, 1)):
                return False
    return True


def _dependencies(pristine: nn.Module, a, kw, order: list, g, norms: dict):
    """The body of :func:`dependencies`: ``(MixerDeps, the output linear's input)`` or None; the statistics of
    the modules in ``norms`` are detached."""
    m = copy.deepcopy(pristine)
    for sub in norms:
        _with_stats(m.get_submodule(sub), lambda: _StatMode("detach", []))
    row = order[-1]
    ins = order[:-1]
    leaves = dict.fromkeys(ins)
    seen: dict = {}
    bufs: dict = {}  # a per-feature buffer (Falcon-H1's mup_vector scales in_proj's outputs): a leaf, so its
    # entries' dependencies are read like a parameter's
    for sub, mod in m.named_modules():
        for n, b in list(mod._buffers.items()):
            if isinstance(b, torch.Tensor) and b.is_floating_point() and b.numel() > 1:
                mod._buffers[n] = b.detach().clone().requires_grad_(True)
                bufs.setdefault(sub, []).append(n)
    with torch.enable_grad():
        _, x = _run(m, a, kw, leaves, row, seen)
        if x is None or not x.requires_grad or any(v is None for v in leaves.values()):
            return None
        feats = x.shape[-1]
        k = next((c for c in (16, 8, 4, 2) if c <= MAX_CHUNKS and feats % c == 0), None)
        if k is None:
            return None
        params = {}
        for sub, mod in m.named_modules():
            if sub in ins or sub == row:
                continue  # (a linear whose weight the forward uses directly, Mamba's dt_proj, counts here)
            for n, p in mod.named_parameters(recurse=False):
                params[f"{sub}:{n}"] = p
            for n in bufs.get(sub, ()):
                params[f"{sub}:{n}"] = mod._buffers[n]
        deps = MixerDeps(k, row)
        deps.feats = {p: leaves[p].shape[-1] for p in ins}
        deps.shapes = {key: tuple(p.shape) for key, p in params.items()}
        for p in ins:
            xin = seen.get(p)
            deps.values[p] = (None if xin is None else xin.detach(), leaves[p].detach())
            deps.feeds[p] = set()
            if isinstance(xin, torch.Tensor) and xin.requires_grad:
                gs = torch.autograd.grad(
                    xin.sum(), [leaves[q] for q in ins], retain_graph=True, allow_unused=True
                )
                deps.feeds[p] = {q for q, gq in zip(ins, gs, strict=True) if gq is not None}
        targets = [leaves[p] for p in ins] + list(params.values())
        w = torch.rand(x.shape, generator=g) + 0.5
        width = feats // k
        for c in range(k):
            loss = (x[..., c * width : (c + 1) * width] * w[..., c * width : (c + 1) * width]).sum()
            grads = torch.autograd.grad(loss, targets, retain_graph=True, allow_unused=True)
            for p, gr in zip(ins, grads[: len(ins)], strict=True):
                nz = (
                    torch.zeros(0, dtype=torch.long)
                    if gr is None
                    else torch.nonzero(gr.abs().reshape(-1, gr.shape[-1]).sum(0)).flatten()
                )
                deps.outs.setdefault(p, []).append(nz)
            for key, gr in zip(params, grads[len(ins) :], strict=True):
                nz = (
                    torch.zeros(0, dtype=torch.long)
                    if gr is None
                    else torch.nonzero(gr.reshape(-1)).flatten()
                )
                deps.params.setdefault(key, []).append(nz)
    return deps, x


# ------------------------------------------------------------------------------------------------- the plan
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
    from .rules import BlockStride

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
        fed = sorted(q for q in deps.outs if q != p and p in deps.feeds.get(q, ()))
        if fed and not any(len(x) for x in per):
            # a low-rank "a" whose output reaches the channels only through other input linears (Kimi's
            # g_a_proj -> g_b_proj, f_a_proj -> f_b_proj): kept whole; the column-parallel linears it feeds sum
            # their input gradients over the ranks, so its gradients are complete on every rank
            out.low_rank[p] = fed
            continue
        n = deps.feats[p]
        own = _owners(per, ws, n)
        count = _ranks(own)
        shared = int((count > 1).sum())
        if bool((count == ws).all()) and n % ws == 0 and deps.feeds.get(p):
            # every rank needs all its outputs (Mamba's x_proj: dt, B, C from all channels): computed from the
            # gathered channels, its output features split and gathered again
            out.gathers.add(p)
            out.kinds[p] = "gather_linear"
            continue
        unused = int((count == 0).sum())
        grouped = _grouped_layout(own.tolist(), ws) if shared and shared < n and not unused else None
        if grouped is not None:  # parts shared by heads on different ranks (B, C): replicated on those ranks
            out.columns[p] = grouped
            continue
        if shared or unused:
            if shared == n:
                what = (
                    f"all {n} of {p}'s output features reach the channels of every rank (something between it and "
                    f"{deps.row} mixes all channels, e.g. a gated norm over all of them: Mamba-2's with one group)"
                )
            elif shared:
                what = (
                    f"{shared} of {p}'s {n} output features reach the channels of several ranks, not as groups "
                    "each held whole by consecutive ranks (as Mamba-2's B and C with fewer groups than ranks are)"
                )
            else:
                what = f"{unused} of {p}'s {n} output features reach none of the output projection's inputs"
            out.reason = f"{what}, so the mixer stays whole"
            return out
        stride = _runs_layout(_single(own), ws)
        if stride is None:
            out.reason = f"no column-parallel layout of {p} gives each rank the features its channels need"
            return out
        out.columns[p] = stride
    for p in out.columns:  # fed by a gathered output: its input gradient is summed by that gather's backward
        out.kinds[p] = "column_shard" if deps.feeds.get(p, set()) & out.gathers else "column"
    for key, per in deps.params.items():
        shape = deps.shapes[key]
        n = 1
        for s in shape:
            n *= s
        own = _owners(per, ws, n)
        count = _ranks(own)
        if not bool((count > 0).any()):
            continue
        if bool((count[count > 0] == ws).all()):  # every rank needs it: replicated, gradients summed
            out.grad_sum.add(key.rsplit(":", 1)[0])
            continue
        shared = bool((count != 1).any())
        grid = own.view(shape)
        found = None
        for axis, size in enumerate(shape):
            rows = grid.movedim(axis, 0).reshape(size, -1)
            if not bool((rows == rows[:, :1]).all()):
                continue  # a slice needed by several ranks
            if shared:  # a depthwise convolution's B / C channels, shared like in_proj's B / C
                stride = _grouped_layout(rows[:, 0].tolist(), ws)
                if stride is not None:
                    found = (axis, stride)
                    break
                continue
            stride = _runs_layout(_single(rows[:, 0]), ws)
            if stride is not None:
                found = (axis, stride)
                break
        if found is None and shared:
            out.reason = f"the entries of {key.replace(':', '.')} are shared by some ranks only, so the mixer stays whole"
            return out
        if found is None:
            out.reason = f"no axis of {key.replace(':', '.')} splits it by the ranks' channels, so the mixer stays whole"
            return out
        out.shards[key] = found
    return out


# ------------------------------------------------------------------------------------- per-rank attributes
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
    from .rules import block_replicas, block_sizes

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
    from .heads import runtime_reads

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
    from .heads import runtime_reads

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
    widths = set(deps.feats.values()) | {x.shape[-1]}
    for stride in p.columns.values():
        widths |= set(getattr(stride, "sizes", ()) or ())
        if not getattr(stride, "sizes", None) and int(stride) > 1:
            widths |= {deps.feats[next(iter(p.columns))] // int(stride)}
    for key, (axis, stride) in p.shards.items():
        size = deps.shapes[key][axis]
        widths.add(size)
        widths |= set(getattr(stride, "sizes", ()) or ())
    ints = {  # "submodule:attribute" (the mixer's own: ":attribute"); convolutions follow their weight instead
        f"{sub}:{k}": v
        for sub, mod in m.named_modules()
        if not _is_linear(mod) and not isinstance(mod, nn.modules.conv._ConvNd)
        for k, v in vars(mod).items()
        if type(v) is int and v > 1 and v % ws == 0 and not k.startswith("_") and k != "layer_idx"
    }
    ints.update(_config_ints(m, ws))
    ints = {k: v for k, v in ints.items() if _read_at_run_time(m, k)}
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
    half = x.shape[-1] // ws

    def works(attempt) -> bool:
        attrs = {k: ints[k] for k in attempt}
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
        for g in p.gathers:  # the ranks' inputs of a gathered linear, concatenated, are its full input
            parts = [loc.get(g) for loc in inputs]
            full = deps.values[g][0]
            if full is None or any(x is None for x in parts):
                return False
            cat = torch.cat(parts, dim=-1)
            if tuple(cat.shape) != tuple(full.shape) or not torch.allclose(cat, full, atol=1e-5, rtol=1e-4):
                return False
        return True

    t0 = time.perf_counter()
    for attempt in tries[:_MAX_TRIES]:
        if time.perf_counter() - t0 > _MAX_SEARCH_S:
            break
        if works(attempt):
            keep = set(attempt)
            for k in sorted(attempt):  # the fewest: an attribute the forward does not read stays global
                if works(keep - {k}):
                    keep.discard(k)
            return {k: ints[k] for k in sorted(keep)}
    return None


# ------------------------------------------------------------------------------------------ preset layers
def layers(split, block_path: str, ws: int) -> list[tuple[str, str]]:
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


def reason(split, rel: str, ws: int) -> str | None:
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
    by the world size once (recorded in ``_slapo_meta["mixer_attrs"]`` as ``{name: [global, local]}``)."""

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

    def matches(self, mod):
        return (
            type(mod).__name__ in _CLASSES
            and not _is_linear(mod)
            and any(self._registered(mod, n) for n in [*mod._parameters, *mod._buffers])
        )

    def _other(self, mod) -> ShardRule:
        """The rule that would own ``mod`` without this one (for tensors no mixer plan registered)."""
        from .rules import _DEFAULT, _RULES

        return next((r for r in _RULES if r is not self and r.matches(mod)), _DEFAULT)

    def _registered(self, mod, name: str) -> bool:
        t = getattr(mod, name, None)
        if not isinstance(t, torch.Tensor):
            return False
        shape = tuple(getattr(t, "orig_shape", t.shape))
        return any(k[1] == type(mod).__name__ and k[2] == name and k[3] == shape for k in _LAYOUTS)

    def check(self, mod, name, axis):
        return None if self._registered(mod, name) else self._other(mod).check(mod, name, axis)

    def check_site(self, site, axis, world_size):
        if self._registered(site.mod, site.name):
            return None
        other = getattr(self._other(site.mod), "check_site", None)
        return other(site, axis, world_size) if other else None

    def stride(self, site, axis):
        for ws in _world_sizes(MAX_CHUNKS):
            lay, _ = self._layout(site, axis, ws)
            if lay is not None:
                return lay[1]
        other = getattr(self._other(site.mod), "stride", None)
        return other(site, axis) if other else 1

    def replicas(self, site, axis, world_size):
        if self._registered(site.mod, site.name):
            return 1
        other = getattr(self._other(site.mod), "replicas", None)
        return other(site, axis, world_size) if other else 1

    def apply(self, mod, name, axis, world_size, rank):
        if not self._registered(mod, name):
            self._other(mod).apply(mod, name, axis, world_size, rank)
            return
        _fix_conv(mod, name, axis)

    def apply_site(self, site, axis, world_size, rank):
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
        if not attrs or "mixer_attrs" in meta:
            return
        done = {}
        local = _ATTR_LOCAL.get((type(mixer).__name__, _shape_sig(mixer)), {}).get(world_size, {})
        for k, v in attrs.items():
            if _get_attr(mixer, k) == v:
                _set_attr(mixer, k, local.get(v, v // world_size))
            done[k] = [v, local.get(v, v // world_size)]
        meta["mixer_attrs"] = done


def _move_block_grads(child: nn.Module, child_name: str, mixer: nn.Module) -> None:
    """The gradient sums of ``child``'s replicated blocks (the shard primitive's ``grad_block_replicas``), taken
    by ``mixer``'s forward instead: the mixer reads ``child``'s weights without calling it (Mamba-2's ``conv1d``
    through ``causal_conv1d_fn``), so a sum installed on ``child``'s forward would never run."""
    from ..module_state import install_forward, peek_meta

    meta = peek_meta(child)
    blocks = (meta or {}).get("grad_block_replicas")
    if not blocks:
        return
    target = module_meta(mixer)
    for name, spec in list(blocks.items()):
        target.setdefault("grad_block_replicas", {})[f"{child_name}.{name}"] = spec
        target["grad_block_group"] = meta["grad_block_group"]
        del blocks[name]
    install_forward(mixer)


register_shard_rule(MixerRule())

__all__ = ["MixerDeps", "MixerPlan", "MixerRule", "capture", "complete", "dependencies", "layers", "plan"]
