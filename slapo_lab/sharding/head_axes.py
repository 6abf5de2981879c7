"""Attention whose heads axis is not third from last, and reductions over an axis the features do not vary on.

:mod:`slapo_lab.sharding.infer` reads an attention's heads from axis ``-3`` of its q / k / v, the layout of
``(batch, heads, tokens, head_dim)``. Hiera's mask-unit attention (transformers ``HieraMaskUnitAttention``)
views its fused ``qkv`` as ``(batch, tokens, windows, 3, heads, head_dim)`` and permutes it to ``(3, batch, heads,
windows, tokens, head_dim)``: a windows axis (of one window where the stage has one) sits between the heads and
the tokens, so axis ``-3`` is the windows, and the attention looked like one head. :func:`heads_axis` finds the
axis that splits the projections' features apart (:func:`~slapo_lab.sharding.infer._varies`, as for LongT5's
blocks of tokens in an einsum) where axis ``-3`` does not; :func:`canonical` moves it to ``-3`` on a copy of the
operand whose index maps move alike, so the rest of the analysis reads the heads as usual, and the attention
output's heads axis is that axis. Such a score matmul counts as attention only when its scores pass a softmax
before they meet v (:func:`canonical_scores`, :func:`note_softmax`, :func:`scores_of`): the chunk-wise
matmuls of a linear attention or recurrence over ``(batch, heads, chunks, chunk, dim)`` (Gated DeltaNet's
``chunk_gated_delta_rule``, xLSTM's chunk-wise mLSTM) have the same layout and no softmax over keys; they stay
what they were, mixers (:mod:`slapo_lab.sharding.mixers`).

Hiera also pools its queries (``query.view(..., query_stride, tokens // query_stride, head_dim).max(dim=3)``):
a reduction. :func:`reduce_maps` keeps the index maps through ``max`` / ``min`` / ``amax`` / ``amin`` / ``sum``
/ ``mean`` over an axis along which every map is constant (the tokens pooled all hold the same features), so
the pooled queries still show their heads; a reduction over features (a norm's statistics) still drops them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .infer_maps import _Info, _varies

if TYPE_CHECKING:
    from .infer_recorder import _Recorder

_REDUCE_OPS = frozenset({"max", "min", "amax", "amin", "sum", "mean"})


def heads_axis(inf: _Info | None, t: torch.Tensor) -> int | None:
    """The axis (non-negative) of ``t`` (with index maps ``inf``) holding the heads, where axis ``-3`` does
    not split the projections' features apart and exactly one earlier axis does; else None (axis -3 is
    the heads, or nothing tells)."""
    n = t.dim()
    if inf is None or n < 4 or _varies(inf, n - 3):
        return None
    found = [a for a in range(n - 3) if _varies(inf, a)]
    return found[0] if len(found) == 1 else None


def canonical_scores(
    rec: _Recorder, q: torch.Tensor, k: torch.Tensor, axis: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, k)`` of a score matmul with their heads ``axis`` moved to ``-3`` (:func:`canonical`); the pair
    counts as attention only once its scores pass a softmax (:func:`note_softmax`, :func:`scores_of`)."""
    pair = (canonical(rec, q, axis), canonical(rec, k, axis))
    rec.__dict__.setdefault("axis_pending", {})[id(pair[0])] = (pair[0], q, k)
    return pair


def note_softmax(rec: _Recorder, name: str, ins: list[tuple[torch.Tensor, _Info]]) -> None:
    """A softmax over scores whose q / k :func:`canonical_scores` moved: they are an attention's."""
    pending = getattr(rec, "axis_pending", None)
    if not pending or name not in ("softmax", "log_softmax", "_softmax"):
        return
    confirmed = rec.__dict__.setdefault("axis_confirmed", {})
    for _t, inf in ins:
        for q, _k in inf.scores or ():
            if pending.pop(id(q), None) is not None:
                confirmed[id(q)] = q


def scores_of(rec: _Recorder, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``(q, k, moved)`` for the scores about to be applied to v: the moved pair when its scores passed a
    softmax, else the operands as the score matmul had them (a chunk-wise linear attention or recurrence, such
    as Gated DeltaNet's or xLSTM's over ``(batch, heads, chunks, chunk, dim)``, has no softmax over keys: it
    stays a mixer for :mod:`slapo_lab.sharding.mixers`)."""
    if getattr(rec, "axis_confirmed", {}).get(id(q)) is q:
        return q, k, True
    hit = getattr(rec, "axis_pending", {}).get(id(q))
    if hit is not None and hit[0] is q:
        return hit[1], hit[2], False
    return q, k, False


def canonical(rec: _Recorder, t: torch.Tensor, axis: int) -> torch.Tensor:
    """``t`` with its heads ``axis`` moved to ``-3`` (the last two axes kept), its maps moved alike (a new
    tensor known to the recorder ``rec``)."""
    n = t.dim()
    return rec.canonical(t, [axis, n - 2, n - 1])


def reduce_maps(rec: _Recorder, name: str, args: tuple, kwargs: dict, out: Any) -> bool:
    """Give the values of a reduction (``name`` in ``max`` / ``min`` / ``amax`` / ``amin`` / ``sum`` /
    ``mean``) over one axis its input's index maps with that axis taken out, where every map is constant
    along it; True when it did."""
    if name not in _REDUCE_OPS or not args or not isinstance(args[0], torch.Tensor):
        return False
    x = args[0]
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    if isinstance(dim, (tuple, list)) and len(dim) == 1:
        dim = dim[0]
    if not isinstance(dim, int) or isinstance(dim, bool) or x.dim() == 0:
        return False
    keep = bool(kwargs.get("keepdim", args[2] if len(args) > 2 and isinstance(args[2], bool) else False))
    values = out[0] if isinstance(out, tuple) else out
    inf = rec.get(x)
    if inf is None or not isinstance(values, torch.Tensor):
        return False
    dim %= x.dim()
    maps: dict = {}
    for p, ms in inf.maps.items():
        kept = []
        for m in ms:
            if m.dim() != x.dim():
                return False
            first = m.narrow(dim, 0, 1)
            if not bool((m == first).all()):
                return False  # features differ along the axis: a reduction over features drops the maps
            kept.append(first if keep else first.squeeze(dim))
        maps[p] = kept
    if any(tuple(m.shape) != tuple(values.shape) for ms in maps.values() for m in ms):
        return False
    rec.set(values, _Info(maps, inf.src, None))
    return True
