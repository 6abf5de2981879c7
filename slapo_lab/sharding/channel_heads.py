"""Grouped convolutions whose channels are attention heads: their filters follow the head split.

Nyströmformer (``NystromformerSelfAttention``, Xiong et al. 2021, "Nyströmformer: A Nyström-Based Algorithm for
Approximating Self-Attention", transformers' ``modeling_nystromformer.py``) adds to the attention output a
depthwise ``nn.Conv2d(num_heads, num_heads, (k, 1), groups=num_heads)`` applied to the value laid out as
``(batch, heads, tokens, head_dim)``: its channel axis *is* the heads axis, and channel ``c`` filters head ``c``
alone. Once the value projection is column parallel each rank holds only its own heads, so the convolution must
keep only their filters (split on axis 0 of its weight and bias, ``groups`` shrunk alike:
:class:`slapo_lab.sharding.feature_stats.DepthwiseConvRule`).

The split inference (:mod:`slapo_lab.sharding.infer`) reads this from the dataflow, not from names:

* while recording (:func:`note_conv`), a convolution with ``groups`` = input = output channels whose input
  carries a projection's index map notes, per channel, the set of that projection's features it holds
  (only when those sets are disjoint: each channel is a group of features of its own);
* when the attention has been read (:func:`resolve`), a convolution whose channel sets are exactly the heads of
  a q / k / v projection (key/value heads repeated for grouped-query attention count once) becomes a per-head
  parameter of the block (its weight and bias split on axis 0, one filter per head).

A convolution whose channels hold features of one projection in order (a depthwise convolution over features,
``align_depthwise``) is not this case and is left to the recorder.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .infer_maps import BlockSplit
    from .infer_recorder import _Recorder, _Snapshot

_CONVS = frozenset({"conv1d", "conv2d", "conv3d"})


def note_conv(rec: _Recorder, name: str, args: tuple, kwargs: dict) -> None:
    """Record, on ``rec`` (the recorder), a grouped convolution whose channels are disjoint groups of one
    projection's features: ``rec.channel_groups["module:param"] = (producer, [feature set per channel])``."""
    if name not in _CONVS:
        return
    x = args[0] if args else kwargs.get("input")
    w = args[1] if len(args) > 1 else kwargs.get("weight")
    b = args[2] if len(args) > 2 else kwargs.get("bias")
    groups = args[6] if len(args) > 6 else kwargs.get("groups", 1)
    if not _is_depthwise(x, w, groups):
        return
    c = x.shape[1]
    xi = rec.get(x)
    if xi is None:
        return
    found = {p: sets for p, ms in xi.maps.items() if (sets := _channel_groups(p, ms, c)) is not None}
    if len(found) != 1:
        return
    ((p, sets),) = found.items()
    groups_ = rec.__dict__.setdefault("channel_groups", {})
    for t in (w, b):
        inf = rec.get(t) if isinstance(t, torch.Tensor) else None
        for u in inf.maps if inf is not None else ():
            if u.startswith("param:") and t.shape[0] == c:
                groups_[u[len("param:") :]] = (p, sets, c, t.numel() // c)


def _is_depthwise(x: object, w: object, groups: object) -> bool:
    """Whether a convolution of input ``x`` (at least 3-D, 2 or more channels) and weight ``w`` is depthwise:
    one group per channel, one input channel per output channel."""
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor) or x.dim() < 3:
        return False
    c = x.shape[1]
    return not (c < 2 or groups != c or w.shape[0] != c or w.shape[1] != 1)


def _channel_groups(p: str, ms: list, c: int) -> list[frozenset] | None:
    """The features of producer ``p`` (maps ``ms``) per channel of a convolution's ``c`` channels, when they are
    disjoint groups of several features each (a channel holding one feature: not heads); else None."""
    if p.startswith(("param:", "@", "input:", "cols:")):
        return None
    m = ms[0].movedim(1, 0).reshape(c, -1)
    sets = [frozenset(v for v in row.unique().tolist() if v >= 0) for row in m]
    if all(sets) and sum(map(len, sets)) == len(frozenset().union(*sets)) and max(map(len, sets)) > 1:
        return sets
    return None


def resolve(split: BlockSplit, rec: _Snapshot, roles: dict) -> None:
    """Add to ``split.head_params`` every recorded convolution whose channels are, in order, the heads of a
    projection of ``roles`` (``{producer: {role: [feature set per head]}}``, one attention's reading)."""
    for key, (p, sets, c, per) in getattr(rec, "channel_groups", {}).items():
        for hsets in roles.get(p, {}).values():
            uniq = [frozenset(s) for j, s in enumerate(hsets) if j == 0 or s != hsets[j - 1]]
            if len(uniq) != c or any(uniq[h] != sets[h] for h in range(c)):
                continue
            mod, name = key.rsplit(":", 1)
            if not any(hp[0] == mod and hp[1] == name for hp in split.head_params):
                entries = [frozenset(range(h * per, (h + 1) * per)) for h in range(c)]
                split.head_params.append((mod, name, entries, c))
            break


def embedding_rows(rec: _Recorder, args: tuple, kwargs: dict, out: Any, src: frozenset[str]) -> bool:
    """``F.embedding(indices, weight)`` of a parameter ``weight`` inside the block (Granite Speech's Shaw
    relative-position table ``rel_pos_emb``, one row per distance over ``head_dim``): the output's map is the
    weight's map indexed by the same indices (their real values where the indices are a meta buffer's), so a
    product with a head-split q records the table among the parameters applied to q (its gradient is then a
    partial sum over this rank's heads, summed over the ranks). True when the output's map was set."""
    idx = args[0] if args else kwargs.get("input")
    w = args[1] if len(args) > 1 else kwargs.get("weight")
    if (
        not isinstance(idx, torch.Tensor)
        or not isinstance(w, torch.Tensor)
        or not isinstance(out, torch.Tensor)
    ):
        return False
    inf = rec.get(w)
    if inf is None or idx.is_floating_point():
        return False
    real = rec.real(idx)
    if real.device.type == "meta":
        return False
    maps = {}
    for p, ms in inf.maps.items():
        if p.startswith("param:") and tuple(ms[0].shape) == tuple(w.shape):
            maps[p] = [torch.nn.functional.embedding(real.cpu().long(), ms[0])]
    if not maps:
        return False
    rec.set(out, type(inf)(maps, src))
    return True
