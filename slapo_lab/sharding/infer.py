"""Read a block's tensor-parallel split from its recorded dataflow, not from its layers' names.

One forward of the model (real, shrunk or on the meta device, with one sample of example inputs) runs under a
:class:`torch.overrides.TorchFunctionMode` until the first block of every stack of blocks has run. Inside those
blocks every ``nn.Linear`` / HF ``Conv1D`` output, every parameter of another module and every attention output
gets an *index map*: an integer tensor of the same shape whose entries are the feature (or parameter entry) each
element came from. Shape ops (``view``, ``transpose``, ``chunk``, ``split``, ``unbind``, indexing, ``cat``,
``expand`` ...) are replayed on the maps, elementwise ops carry them (rotary embeddings, per-head norms,
activations, gating), anything else drops them. Where maps meet attention -- ``scaled_dot_product_attention``,
or a matmul of two mapped tensors whose scores a second matmul applies to a mapped value -- each q / k / v
argument's heads axis (``-3``) tells which features of which projection belong to which head:

* q / k / v projections, fused ones included, with the head and key/value head counts (``q.shape[-3]``, the
  distinct key heads) and the layout a column-parallel shard needs: the first of stride 1 (contiguous, e.g.
  GPT-NeoX's per-head interleaved ``query_key_value``: ``view(B, T, H, 3 * hd)`` then ``chunk(3)``), equal
  blocks (ModernBERT's ``Wqkv``: ``view(B, T, 3, H, hd)``) or blocks of unequal sizes (GPT-BigCode's
  ``split((H*hd, kv*hd, kv*hd))``) whose per-rank features are exactly the features of that rank's heads; with
  fewer key/value heads than ranks in a fused projection (multi-query attention: GPT-BigCode's ``c_attn``,
  Falcon's ``query_key_value``) the key/value blocks are kept by the ranks whose query heads use them (a
  ``BlockStride`` with ``groups``, Megatron-LM / vLLM key/value replication);
* a projection whose features reach every head (MLA's ``kv_a_proj_with_mqa`` rope part, broadcast over the
  heads) or also feed something else stays whole (a low-rank "a" of an a -> norm -> b chain);
* the output projection: the linear whose input is the attention output, its in-features of rank r exactly
  rank r's heads;
* per-head tensors: a parameter whose entries reach the heads (a relative-position table added to the scores,
  attention sinks concatenated to them, a q/k norm weight of shape ``(heads, head_dim)``, DeBERTa's flat
  ``q_bias`` of heads x head_dim) is split on the axis whose index is the head; a tensor argument from outside
  the block that meets the scores head by head (MPT's ALiBi ``position_bias``, MPNet's learned position bias)
  is a per-head *input*, cut to each rank's heads by the attention module's pre-hook
  (:func:`inferred_head_inputs`, :mod:`slapo_lab.sharding.heads`);
* MLP pairs whatever the activation: a linear whose input features are exactly, rank by rank, the features of
  one or more other linears under some stride (``act(gate) * up``, a fused ``gate|up`` chunked in two) is row
  parallel and those are column parallel;
* routers: a linear whose output reaches ``topk`` stays whole, and so does one whose output reaches the block's
  output only through a ``topk`` choice (a sparse-attention indexer's ``wq_b`` / ``wk`` / ``weights_proj``,
  DeepSeek-V3.2's DSA; lineage through any op and any later linear, cut at ``topk``'s results);
* norms over all of a split layer's features (OLMo 2's ``q_norm`` over every head's q, BitNet's
  ``attn_sub_norm`` over the attention output before ``o_proj``, ConvNeXt-V2's GRN between ``pwconv1`` and
  ``pwconv2``): a parameter of one entry per feature applied to a value whose last axis holds a projection's
  (or an attention output's) features in order follows them (``feature_params``); such a norm passes the maps
  on (unless its input is a sum with an unmapped value: a residual), is sharded like the features, and its
  statistics are summed over the ranks (:mod:`slapo_lab.sharding.feature_stats`).

Complex views (``view_as_complex`` / ``view_as_real``, DeepSeek-V2's rotary embedding) carry the maps of both
features of a pair. Where the meta forward stops before a block has run (an MoE block's data-dependent routing
on the meta device), that block is read from the schedule's remembered real model.

Results are cached per model instance, and registered per attention class, child name and config (so the shard
rules of :mod:`slapo_lab.sharding.rules`, which see one module, find the layout of a fused projection); the
shard primitive calls :func:`ensure` on the top model before its first shard, so a replay in a fresh process (an
exported script, the numeric check's shrunk copy) infers the same split. Sources: Megatron-LM
``ColumnParallelLinear`` / ``RowParallelLinear`` (``partition_stride``), transformers' ``base_model_tp_plan``
(cross-checked in tests/test_split_inference.py).

This module runs the forward, caches and registers the results and answers for a block (:func:`analyse`,
:func:`ensure`, :func:`block_split`, :func:`lookup`); the parts live in :mod:`slapo_lab.sharding.infer_maps`
(index maps and the result types, re-exported here), :mod:`slapo_lab.sharding.infer_recorder` (the
``TorchFunctionMode``), :mod:`slapo_lab.sharding.infer_analyse` (a block's events read into roles and layouts)
and :mod:`slapo_lab.sharding.infer_blocks` (which blocks, which inputs, and re-rooting a split).
"""

from __future__ import annotations

import inspect
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from ..call_order import _INPUTS_KEY, REFERENCE_KEY, VALUES_KEY
from . import attention_site as _attention_site
from . import feature_inputs as _feature_inputs
from . import head_buffers as _head_buffers
from . import mixers as _mixers
from .infer_analyse import (
    _analyse,
    _feature_norm,
    _is_norm,
    _resolve_head_inputs,
    _resolve_head_params,
)
from .infer_blocks import _around, _example_inputs, _prefixed, _real_buffers, _signature, _stacks, _sub_split
from .infer_maps import (
    BlockSplit,
    HeadParam,
    Layout,
    _dense_out,
    _Done,
    _Info,
    _is_dense,
    _tensors,
)
from .infer_recorder import _Recorder, _Snapshot, note_outside_input
from .infer_registry import (
    _HEAD_INPUTS,
    _HEADS,
    _REGISTRY,
    _config_digest,
    inferred_head_inputs,
    inferred_heads,
    lookup,
)

# --------------------------------------------------------------------------------------------- running it
_LOCK = threading.RLock()
_DONE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # top model -> {block path: BlockSplit}
_BY_DIGEST: dict = {}  # (top class, config digest, input shapes) -> {block path: BlockSplit}


def analyse(
    model: nn.Module, stored_inputs: dict | None = None, real: nn.Module | None = None
) -> dict[str, BlockSplit]:
    """``{block path: BlockSplit}`` for the first block of each class among ``model``'s stacks of blocks.

    Runs the model forward once (``torch.no_grad``, one sample) until every such block has run; ``{}`` when it
    cannot (no example inputs to build, or a forward that fails: callers then fall back to names). Cached per
    model instance and per model class + config + input shapes. ``real``: the same model with real tensors
    (the unscheduled model a meta copy was made from): where ``model``'s buffers are on the meta device, the
    maps follow an indexing by them with ``real``'s values (Swin's ``relative_position_index``, which gathers
    its per-head relative-position table, is a non-persistent buffer that a meta copy holds without values).
    """
    with _LOCK:
        if model in _DONE:
            return _DONE[model]
        result = _analyse_model(model, stored_inputs, real)
        _DONE[model] = result
        return result


def _analyse_model(model: nn.Module, stored_inputs: dict | None, real=None) -> dict[str, BlockSplit]:
    blocks = _stacks(model)
    if not blocks:
        return {}
    inputs = _example_inputs(model, stored_inputs)
    if inputs is None:
        return {}
    key = _cache_key(model, inputs, blocks)
    if key[1] is not None and key in _BY_DIGEST:
        result = _BY_DIGEST[key]
        _register(model, result)
        return result
    rec = _Recorder()
    rec.values = _real_buffers(model, real)
    recording = _Recording(rec, blocks)
    for bpath, block in blocks:
        recording.hook(bpath, block)
    _run_until_done(model, inputs, rec, recording.handles)
    result = {}
    for bpath, block in blocks:
        snap = recording.snaps.get(bpath)
        split = _read_block(block, snap, recording.dense_by_block[bpath], recording.mixer_args.get(bpath, {}))
        if split is not None:
            result[bpath] = split
    if key[1] is not None and len(result) == len(blocks):
        # only a complete reading stands for every model of this class and config: a forward that failed
        # part-way (a meta copy whose expert kernel needs real values) leaves the unscheduled model to try
        _BY_DIGEST[key] = result
    _register(model, result)
    return result


def _cache_key(model: nn.Module, inputs: dict, blocks: list) -> tuple:
    """The key of :data:`_BY_DIGEST`: the model's class, its config's digest, the input shapes and each block's
    structure (a shrunk copy, the numeric check's or a stack cut inside a block, shares the config and the block
    paths but not what is inside them: LeViT's stages, each a block of layers)."""
    return (
        type(model).__qualname__,
        _config_digest(getattr(model, "config", None)),
        tuple((k, tuple(v.shape)) for k, v in inputs.items() if isinstance(v, torch.Tensor)),
        tuple((p, _signature(b)) for p, b in blocks),
    )


def _run_until_done(model: nn.Module, inputs: dict, rec: _Recorder, handles: list) -> None:
    """Run ``model`` forward once (eval mode, ``torch.no_grad``, recorded by ``rec``) until every block has run
    (``_Done``) or it fails, then remove the hooks ``handles`` and restore each module's training mode."""
    was_training = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.no_grad(), rec:
            try:
                model(**inputs)
            except _Done:
                pass
    except Exception:  # noqa: BLE001, S110 - a model the inference cannot run: callers fall back to names
        pass
    finally:
        for h in handles:
            h.remove()
        for m, t in was_training.items():
            m.training = t


def _read_block(block: nn.Module, snap: _Snapshot | None, dense: dict, mixer_args: dict) -> BlockSplit | None:
    """The :class:`BlockSplit` of ``block`` read from its recorded forward ``snap``, or None when it did not run or
    the analysis cannot read it (names are then the hints)."""
    if snap is None:
        return None
    try:
        split = _analyse(snap, block, dense)
        _resolve_head_params(split, block)
        _resolve_head_inputs(split, snap.input_shapes, snap.input_aliases)
        _mixers.complete(split, block, mixer_args)  # SSM mixers: slapo_lab/sharding/mixers.py
        _feature_inputs.complete(split, block, snap)  # slapo_lab/sharding/feature_inputs.py
    except Exception:  # noqa: BLE001 - a block the analysis cannot read: names are the hints
        return None
    return split


class _Recording:
    """The hooks that record the first forward of each of a model's blocks with ``rec``, and what they keep:
    ``snaps`` (block path -> its :class:`_Snapshot`), ``dense_by_block`` (block path -> {path: linear}),
    ``mixer_args`` (block path -> {candidate mixer path: its first call's arguments}) and ``handles``."""

    def __init__(self, rec: _Recorder, blocks: list) -> None:
        self.rec = rec
        self.handles: list = []
        self.pending = {p for p, _ in blocks}
        self.dense_by_block: dict[str, dict] = {}
        self.snaps: dict[str, _Snapshot] = {}
        self.mixer_args: dict[str, dict] = {}

    def hook(self, bpath: str, block: nn.Module) -> None:
        """Install the hooks of the block at ``bpath`` (their order is the order they run in)."""
        r = self.rec
        dense = {rel: m for rel, m in block.named_modules() if rel and _is_dense(m)}
        self.dense_by_block[bpath] = dense
        self.handles.extend(self._block_hooks(bpath, block))
        self.handles.extend(_mixers.capture(block, self.mixer_args.setdefault(bpath, {})))
        self.handles.extend(_feature_inputs.capture(block, r))  # per-feature block arguments
        self.handles.extend(_attention_site.capture(bpath, block, r))  # where attention runs
        for rel, m in dense.items():
            self.handles.extend(_linear_hooks(r, rel, m))
        arg_names: dict[str, list] = {}
        for rel, m in block.named_modules():
            if rel and not _is_dense(m):
                hook = _outside_inputs_hook(r, rel, arg_names)
                self.handles.append(m.register_forward_pre_hook(hook, with_kwargs=True))
        for rel, m in block.named_modules():
            if rel and not _is_dense(m) and _is_norm(m):
                self.handles.append(m.register_forward_hook(_norm_hook(r, dense)))

    def _block_hooks(self, bpath: str, block: nn.Module) -> list:
        """The block's own pre-hook (resets the recorder for it) and post-hook (keeps its snapshot; raises
        ``_Done`` once every block has run)."""
        r = self.rec
        names = _param_names(block)
        buffers = _head_buffers.names(block, _is_dense)
        names.update(buffers)
        buffer_keys = set(buffers.values())

        def pre(_m, args, kwargs):
            r.active += 1
            r.params = names
            r.buffer_keys, r.meets = buffer_keys, []
            r.events, r.linear_in, r.linear_in_shape, r.routers, r.n_attn = [], {}, {}, set(), 0
            r.info, r.keep, r.score_extras, r.view_of, r.param_uses, r.ran = {}, [], [], {}, {}, set()
            r.input_shapes, r.input_of, r.input_aliases = {}, {}, {}
            r.aligned, r.mixed = {}, set()
            r.channel_groups = {}
            r.topk_src, r.out_src = set(), set()

        def post(_m, _args, _kwargs, _out):
            r.active -= 1
            r.out_src = set().union(
                *(i.src for i in map(r.info.get, map(id, _tensors(_out))) if i is not None)
            )
            self.snaps[bpath] = _Snapshot(r)
            self.pending.discard(bpath)
            if not self.pending:
                raise _Done

        return [
            block.register_forward_pre_hook(pre, with_kwargs=True),
            block.register_forward_hook(post, with_kwargs=True),
        ]


def _param_names(block: nn.Module) -> dict[int, str]:
    """``{id(parameter): "module path:name"}`` for the parameters of ``block``'s modules other than its linears
    (and the block itself)."""
    names = {}
    for rel, m in block.named_modules():
        if _is_dense(m) or m is block:
            continue
        for pn, prm in m.named_parameters(recurse=False):
            if prm is not None:
                names[id(prm)] = f"{rel}:{pn}"
    return names


def _linear_hooks(r: _Recorder, rel: str, m: nn.Module) -> list:
    """A linear's pre-hook (notes that it ran and its input's maps) and post-hook (its output features get a map
    of their own, ``{rel: [feature index]}``)."""

    def lin_pre(_m, args):
        r.ran.add(rel)
        if args and isinstance(args[0], torch.Tensor):
            inf = r.get(args[0])
            if inf is not None:
                r.linear_in[rel] = inf
                r.linear_in_shape[rel] = tuple(args[0].shape)

    feats = _dense_out(m)

    def lin_post(_m, _args, out):
        if isinstance(out, torch.Tensor) and out.shape[-1] == feats:
            prev = r.info.get(id(out))
            src = (prev.src if prev else frozenset()) | {rel}
            mp = torch.arange(feats).expand(*out.shape)
            r.set(out, _Info({rel: [mp]}, frozenset({rel}) | (src - src)))

    return [m.register_forward_pre_hook(lin_pre), m.register_forward_hook(lin_post)]


def _outside_inputs_hook(r: _Recorder, rel: str, arg_names: dict[str, list]) -> Callable:
    """A forward pre-hook for the module at ``rel`` that maps the tensors from outside the block reaching it
    (MPT's ALiBi position_bias), so a per-head one shows where it meets the attention scores; ``arg_names``
    caches each module's forward argument names."""

    def sub_pre(mod, args, kwargs):
        if not r.active:
            return
        if rel not in arg_names:
            try:
                arg_names[rel] = list(inspect.signature(type(mod).forward).parameters)[1:]
            except (TypeError, ValueError):
                arg_names[rel] = []
        names_ = arg_names[rel]
        named = [(names_[j] if j < len(names_) else None, a) for j, a in enumerate(args) if j]
        for nm, a in [*named, *kwargs.items()]:
            if nm is None or "hidden" in nm or not isinstance(a, torch.Tensor):
                continue
            if id(a) in r.input_of:  # passed on inward (MPNet's position_bias: layer -> attention)
                r.input_shapes.setdefault(f"{rel}:{nm}", tuple(a.shape))
                r.input_aliases.setdefault(r.input_of[id(a)], []).append(f"{rel}:{nm}")
                continue
            note_outside_input(r, f"{rel}:{nm}", a)

    return sub_pre


def _norm_hook(r: _Recorder, dense: dict) -> Callable:
    """A norm's forward hook: a norm over a projection's whole output needs all its features, so the maps of the
    projections of that width stop there (no split through it), unless its parameters follow those features
    (then it is sharded with them: ``feature_params``)."""

    def norm_post(_m, _args, out):
        if not isinstance(out, torch.Tensor):
            return
        inf = r.info.get(id(out))
        if inf is None:
            return
        width = out.shape[-1]
        if _feature_norm(_m, width) and not any(
            isinstance(a, torch.Tensor) and id(a) in r.mixed for a in _args
        ):
            return
        keep = {p: ms for p, ms in inf.maps.items() if p not in dense or _dense_out(dense[p]) != width}
        r.set(out, _Info(keep, inf.src, inf.scores))

    return norm_post


def _register(model: nn.Module, result: dict) -> None:
    """Make the inferred layouts and head counts visible to the shard rules (which see one module)."""
    for bpath, split in result.items():
        block = model.get_submodule(bpath)
        for rel, role in split.roles.items():
            if not (role in ("o", "mlp_in") or set(role) <= set("qkvg")):
                continue
            parent_rel, _, child = rel.rpartition(".")
            parent = block.get_submodule(parent_rel) if parent_rel else block
            key = (type(parent).__name__, child, _config_digest(getattr(parent, "config", None)))
            _REGISTRY[key] = (role, split.layouts.get(rel), None)
        for rel in split.whole:
            parent_rel, _, child = rel.rpartition(".")
            parent = block.get_submodule(parent_rel) if parent_rel else block
            attn = split.refusals.get(parent_rel)
            if attn and rel in split.refused_roles:
                key = (type(parent).__name__, child, _config_digest(getattr(parent, "config", None)))
                _REGISTRY[key] = (split.refused_roles[rel], None, attn)
        for apath, counts in split.attention.items():
            attn = block.get_submodule(apath) if apath else block
            _HEADS[(type(attn).__name__, _config_digest(getattr(attn, "config", None)))] = counts
        _attention_site.register(block, split, _REGISTRY, _config_digest)  # a wrapped projection (LeViT)
        for hi in split.head_inputs:
            attn = block.get_submodule(hi.module) if hi.module else block
            key = (type(attn).__name__, _config_digest(getattr(attn, "config", None)))
            found = _HEAD_INPUTS.setdefault(key, ())
            if hi.name not in dict(found):
                _HEAD_INPUTS[key] = (*found, (hi.name, hi.axis))


class ScheduleLike(Protocol):
    """What :func:`ensure` and :func:`block_split` read of a :class:`slapo_lab.schedule.Schedule` (a protocol: the
    schedule sits a layer above sharding, which may not import it)."""

    mod: nn.Module
    path: str
    _top: Any  # the schedule tree's shared state: ``extra`` holds the stored example inputs

    def get_top_schedule(self) -> ScheduleLike: ...


def ensure(sch: ScheduleLike) -> None:
    """Infer the split of the schedule's top model once (before its first shard), so the shard rules find the
    layouts of fused projections in any process."""
    top = sch.get_top_schedule()
    if top.mod in _DONE:
        return
    _analyse_top(top)


def _analyse_top(top) -> dict[str, BlockSplit]:
    """:func:`analyse` of the top schedule's model; where its forward cannot run (a meta copy whose forward
    reads tensor values, such as DeBERTa's relative positions), of the unscheduled model with real weights the
    schedule remembers (:data:`slapo_lab.call_order.REFERENCE_KEY`), whose modules have the same paths."""
    inputs = top._top.extra.get(_INPUTS_KEY)
    if inputs:
        inputs = {**inputs, **top._top.extra.get(VALUES_KEY, {})}
    ref = top._top.extra.get(REFERENCE_KEY)
    same = ref is not None and ref is not top.mod and type(ref) is type(top.mod)
    result = analyse(top.mod, inputs, ref if same else None)
    if not same:
        return result
    if result and len(result) >= len(_stacks(top.mod)):
        return result
    # the meta forward stopped before some block ran (an MoE block's data-dependent routing on the meta device,
    # DeepSeek-V3's layers after ``first_k_dense_replace``): the real model's forward records those blocks
    merged = {**analyse(ref, inputs), **result}
    if merged:
        with _LOCK:
            _DONE[top.mod] = merged
    return merged


def block_split(sch: ScheduleLike, block_path: str) -> BlockSplit | None:
    """The :class:`BlockSplit` of the block at ``block_path`` (relative to ``sch``), read from the analysed
    block of the same structure (or the analysed block around it), or None when the dataflow could not be
    recorded."""
    top = sch.get_top_schedule()
    result = _analyse_top(top)
    if not result:
        return None
    full = ".".join(p for p in (sch.path, block_path) if p)
    found = _split_by_path(result, full)
    if found is not None:
        return found
    return _split_by_structure(top, top.mod.get_submodule(full) if full else top.mod, full, result)


def _split_by_path(result: dict[str, BlockSplit], full: str) -> BlockSplit | None:
    """The split of the analysed block at ``full``, or of the part under ``full`` of the analysed block around
    it; None when no analysed block holds ``full``."""
    if full in result:
        return result[full]
    for p, split in result.items():
        if full.startswith(p + "."):
            return _sub_split(split, full[len(p) + 1 :])
    return None


def _split_by_structure(
    top: ScheduleLike, mod: nn.Module, full: str, result: dict[str, BlockSplit]
) -> BlockSplit | None:
    """The split of the block ``mod`` (at ``full``, not analysed itself) read from an analysed block of the same
    structure, inside it, or around it (:func:`_around`); None when none fits."""
    sig = _signature(mod)
    for p, split in result.items():  # a block of an analysed structure (before a block analysed inside it:
        if _signature(top.mod.get_submodule(p)) == sig:  # Swin's third stage, whose first layer was analysed)
            return split
    inner = [p for p in result if p.startswith(full + ".") or not full]
    if len(inner) == 1:  # the requested block is a container around one analysed block
        around = _around(top, mod, full, result)
        return around or _prefixed(result[inner[0]], inner[0][len(full) + 1 :] if full else inner[0])
    for p, split in result.items():  # a block of the same structure nested in an analysed one (Swin's stages)
        outer = top.mod.get_submodule(p)
        for rel, sub in outer.named_modules():
            if rel and _signature(sub) == sig:
                return _sub_split(split, rel)
    for p, split in result.items():  # a container around a block of an analysed structure (Funnel's lists)
        want = _signature(top.mod.get_submodule(p))
        found = [rel for rel, sub in mod.named_modules() if rel and _signature(sub) == want]
        if len(found) == 1:
            return _prefixed(split, found[0])
    return _around(top, mod, full, result)


__all__ = [
    "BlockSplit",
    "HeadParam",
    "Layout",
    "analyse",
    "block_split",
    "ensure",
    "inferred_head_inputs",
    "inferred_heads",
    "lookup",
]
