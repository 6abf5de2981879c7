"""Per-feature tensor arguments of a block: a tensor from outside the block that meets a split layer's features.

Gemma 3n / Gemma 4's decoder layer takes a ``per_layer_input`` (``(batch, seq, hidden_size_per_layer_input)``,
built by the model for all layers) and gates an MLP-like pair with it::

    h = act(per_layer_input_gate(x)) * per_layer_input      # (batch, seq, F)
    x = x + norm(per_layer_projection(h))

The index maps of :mod:`slapo_lab.sharding.infer` pair ``per_layer_input_gate`` (column parallel) with
``per_layer_projection`` (row parallel). On each rank ``h`` then holds the rank's ``F / ws`` features, so the
argument multiplied into them must hold the same features: it is *per feature* and is cut to the rank's
contiguous chunk, as a per-head argument (MPT's ALiBi ``position_bias``) is cut to the rank's heads
(:mod:`slapo_lab.sharding.heads`).

**Reading it** (:func:`capture`, :func:`complete`): the block's own tensor arguments (not its hidden states)
get an index map during the recorded forward of :mod:`slapo_lab.sharding.infer`, like its submodules'
arguments do. An argument whose map reaches the input of a row-parallel (``"mlp_out"``) linear with one axis
of the argument equal, element by element, to that input's feature index (so feature ``f`` of the row
layer's input is multiplied by entry ``f`` of the argument on that axis, and by nothing else of it) is a
per-feature input of the module that receives it, when that module is the row linear's parent (the shard
rule sees only the parent). Anything else (an argument broadcast over the features, one mixed across them)
is not noted, and the numeric gate of the preset keeps a wrong split whole.

**Applying it** (:func:`install`, called by the dense shard rule's ``apply_site`` when the row linear is
sharded): a forward pre-hook on the parent narrows the argument to this rank's ``[r F/ws, (r+1) F/ws)`` on that
axis, reading it through an all-reduce in backward (each rank's gradient covers its own features; the full
gradient is their sum). The hook is recorded in the parent's ``ModuleMeta.feature_inputs``, so undo,
replay and exported scripts reproduce it. Sources: transformers ``models/gemma4/modeling_gemma4.py``
(``Gemma4TextDecoderLayer.forward``), ``models/gemma3n/modeling_gemma3n.py``; Megatron-LM
``RowParallelLinear`` (``input_is_parallel``).
"""

from __future__ import annotations

import inspect
import threading
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..module_state import module_meta
from .heads import _install_input_slicer
from .infer_recorder import note_outside_input
from .infer_registry import _config_digest

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from .infer_maps import BlockSplit
    from .infer_recorder import _Recorder, _Snapshot
    from .shard_layout import ShardSite

_LOCK = threading.RLock()
#: (parent class name, row linear's child name, parent config digest) -> ((argument, axis, features), ...)
_REGISTRY: dict = {}


def capture(block: nn.Module, rec: _Recorder) -> list[RemovableHandle]:
    """A forward pre-hook on ``block`` (registered after the recorder's own, which resets it) that gives each
    floating tensor argument of the block other than its hidden states (the first positional argument, or a
    keyword naming ``hidden``) an ``"input::<name>"`` index map; returns the handles."""
    try:
        names = list(inspect.signature(type(block).forward).parameters)[1:]
    except (TypeError, ValueError):
        names = []

    def pre(_m, args, kwargs):
        if not rec.active:
            return
        named = [(names[j] if j < len(names) else None, a) for j, a in enumerate(args) if j]
        for nm, a in [*named, *kwargs.items()]:
            if nm is None or "hidden" in nm or not isinstance(a, torch.Tensor):
                continue
            if id(a) not in rec.input_of:
                note_outside_input(rec, f":{nm}", a)

    return [block.register_forward_pre_hook(pre, with_kwargs=True)]


def _aligned_axis(m: torch.Tensor, shape: tuple) -> int | None:
    """The axis of an argument of ``shape`` whose index equals, at every element of ``m`` (the argument's index
    map broadcast to a row linear's input), that element's feature (last-axis) index; None if there is none."""
    fin = m.shape[-1]
    flat = m.reshape(-1, fin)
    if not bool((flat >= 0).all()):
        return None
    feats = torch.arange(fin).expand_as(flat)
    coords = torch.unravel_index(flat, tuple(shape))
    for axis, size in enumerate(shape):
        if size == fin and bool((coords[axis] == feats).all()):
            return axis
    return None


def complete(split: BlockSplit, block: nn.Module, snap: _Snapshot) -> None:
    """Note (``split.feature_inputs``: ``[(row linear path, argument, axis)]``) and register the per-feature
    arguments of ``block``'s row-parallel linears read from the recorded forward ``snap``."""
    found = []
    for r_path, role in list(split.roles.items()):
        if role != "mlp_out" or r_path not in snap.linear_in:
            continue
        parent_rel, _, child = r_path.rpartition(".")
        for p, ms in snap.linear_in[r_path].maps.items():
            hit = _feature_argument(snap, p, ms, parent_rel)
            if hit is None:
                continue
            name, axis = hit
            found.append((r_path, name, axis))
            parent = block.get_submodule(parent_rel) if parent_rel else block
            _register(parent, child, (name, axis, int(ms[0].shape[-1])))
    if found:
        split.feature_inputs = found


def _feature_argument(snap: _Snapshot, p: str, ms: list, parent_rel: str) -> tuple[str, int] | None:
    """``(argument name, axis)`` of the outside input ``p`` (``"input:<module>:<argument>"``, maps ``ms``) of a
    row linear, as the linear's parent at ``parent_rel`` receives it, when its entries follow the linear's input
    features along that axis; None otherwise (received above the parent, which its shard rule cannot reach)."""
    if not p.startswith("input:"):
        return None
    key = p[len("input:") :]
    shape = snap.input_shapes.get(key)
    if shape is None or not ms:
        return None
    axis = _aligned_axis(ms[0], shape)
    if axis is None:
        return None
    receivers = [key, *snap.input_aliases.get(key, [])]
    at = next((w for w in receivers if w.rsplit(":", 1)[0] == parent_rel), None)
    if at is None:
        return None  # received above the row linear's parent, which its shard rule cannot reach
    rshape = snap.input_shapes.get(at, shape)
    axis -= len(shape) - len(rshape)  # the same trailing axes, if an outer module dropped leading ones
    return None if axis < 0 else (at.rsplit(":", 1)[1], axis)


def _register(parent: nn.Module, child: str, spec: tuple[str, int, int]) -> None:
    """Register ``spec`` (argument, axis, features) for ``parent``'s row-parallel child ``child`` (once)."""
    reg = (type(parent).__name__, child, _config_digest(getattr(parent, "config", None)))
    with _LOCK:
        have = _REGISTRY.get(reg, ())
        if spec not in have:
            _REGISTRY[reg] = (*have, spec)


def specs(parent: nn.Module | None, child: str) -> tuple:
    """``((argument, axis, features), ...)``: the per-feature arguments ``parent`` takes for its row-parallel
    child ``child`` (read by :func:`complete`), or ``()``."""
    if parent is None:
        return ()
    return _REGISTRY.get((type(parent).__name__, child, _config_digest(getattr(parent, "config", None))), ())


def install(site: ShardSite, side: str | None, world_size: int, rank: int) -> None:
    """When ``site`` (a dense layer's weight) is sharded row-parallel (``side`` ``"in"``), cut the per-feature
    arguments its parent takes for it to this rank's features (once per parent and argument)."""
    if side != "in" or world_size == 1 or site.parent is None:
        return
    found = specs(site.parent, site.child_name)
    if not found:
        return
    meta = module_meta(site.parent)
    done = meta.feature_inputs
    for name, axis, feats in found:
        if name in done or feats % world_size:
            continue
        meta.hooks.append(
            _install_input_slicer(site.parent, ((name, axis),), feats, world_size, rank, site.tp)
        )
        done.append(name)
