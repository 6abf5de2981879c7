"""Per-head buffers of an attention, read from the dataflow: tensors that must follow the head split.

A linear attention may keep per-head constants as buffers rather than parameters: MiniMax's lightning
attention (transformers ``models/minimax/modeling_minimax.py``, ``MiniMaxLightningAttention``) holds its ALiBi-like
decay rates ``slope_rate`` ``(heads, 1, 1)`` and the decays built from them, ``query_decay`` / ``key_decay``
``(heads, block, 1)`` and ``diagonal_decay`` ``(1, heads, block, block)``. Each rank computes its own heads, so
each must keep its heads' rows, as with ALiBi slopes (Press et al., "Train Short, Test Long", 2022) or
attention sinks. Such a buffer meets the heads where it is applied elementwise: to the queries or keys
(``q * query_decay``), to the scores (``scores * diagonal_decay``, seen by the index maps as a per-head score
term), or to a head-by-head state made from keys and values (``kv_state * exp(-slope_rate * n)``, where the
state is the product ``k^T @ v`` of two head-indexed values).

:func:`names` lists a block's floating-point buffers (outside its linears) so the recorder of
:mod:`slapo_lab.sharding.infer` maps them like parameters (``"param:module:name"``); :func:`note_meet`, called
for each elementwise op whose output carries such a buffer's map, records, per index of the output's heads axis
(``-3``), which buffer entries met which producer features there (from the output's own maps, or from the two
operands of a ``k^T @ v``-like product it derives from); :func:`note_attention`, once an attention's heads are
read (``{producer: {role: [features of head h]}}``), notes each buffer whose entries split by head (every index
meeting the features of one head only, and no entry in two heads) in ``split.head_params``, resolved against the
buffer's shape and sharded with the heads like a per-head parameter. A buffer that meets several heads at one
index (a key/value head shared by grouped queries) or none is not noted (it stays whole, as before).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from .infer_maps import BlockSplit, _Info
    from .infer_recorder import _Recorder, _Snapshot

_MAX_MEETS = 64  # per block: enough for every decay of a chunked linear attention


def names(block: nn.Module, is_dense: Callable[[nn.Module], bool]) -> dict[int, str]:
    """``{id(buffer): "module.rel:name"}`` for the floating-point buffers of ``block``'s modules that are not
    dense layers (``is_dense``); integer buffers (index tables) keep their own handling."""
    out = {}
    for rel, m in block.named_modules():
        if not rel or is_dense(m):
            continue
        for bn, buf in m._buffers.items():
            if isinstance(buf, torch.Tensor) and buf.is_floating_point() and buf.dim() >= 1:
                out[id(buf)] = f"{rel}:{bn}"
    return out


def _at(m: torch.Tensor, h: int) -> set:
    row = m.select(-3, h)
    return set(row[row >= 0].unique().tolist())


def note_meet(
    rec: _Recorder,
    o: torch.Tensor,
    maps: dict,
    scores: tuple | None,
    get: Callable[[torch.Tensor], _Info | None],
) -> None:
    """Record where a buffer's map in ``maps`` (the maps of elementwise output ``o``) meets producer features,
    per index of ``o``'s axis -3; ``scores``: the output's score tag (pairs of operands of a product of two
    mapped values, read with ``get``)."""
    if o.dim() < 3 or len(rec.meets) >= _MAX_MEETS:
        return
    bufs = [p for p in maps if p.startswith("param:") and p[len("param:") :] in rec.buffer_keys]
    if not bufs:
        return
    prods = _producer_maps(maps)
    for a, b in scores or ():
        for t in (a, b):
            inf = get(t) if isinstance(t, torch.Tensor) else None
            if inf is not None and t.dim() == o.dim() and t.shape[-3] == o.shape[-3]:
                prods += _producer_maps(inf.maps)
    if not prods:
        return
    for key in bufs:
        mb = maps[key][0]
        if mb.dim() == o.dim():
            rec.meets.append((key[len("param:") :], _meets_per_index(mb, prods, o)))


def _producer_maps(maps: dict) -> list[tuple[str, torch.Tensor]]:
    """``[(producer, its first map)]`` for the producers (linears) among ``maps``."""
    return [(p, ms[0]) for p, ms in maps.items() if not p.startswith(("param:", "@", "input:", "cols:"))]


def _meets_per_index(mb: torch.Tensor, prods: list, o: torch.Tensor) -> list[tuple[set, dict]]:
    """Per index ``h`` of ``o``'s axis -3: ``(the buffer's entries there (map ``mb``), {producer: its features
    there})``."""
    per_index = []
    for h in range(o.shape[-3]):
        feats: dict = {}
        for p, m in prods:
            if m.dim() == o.dim():
                feats.setdefault(p, set()).update(_at(m, h))
        per_index.append((_at(mb, h), feats))
    return per_index


def note_attention(split: BlockSplit, rec: _Snapshot, roles: dict, n: int) -> None:
    """Note in ``split.head_params`` each buffer whose recorded meets split its entries by the ``n`` heads of
    the attention whose producers' per-head features are ``roles`` (``{producer: {role: [set per head]}}``)."""
    if not rec.meets:  # no buffer met the heads' features: nothing to map (and no per-feature map to build)
        return
    head_of = _heads_of_features(roles, n)
    if not head_of:
        return
    found = {key: _buffer_heads(per_index, head_of, n) for key, per_index in _first_meets(rec.meets)}
    for key, sets in found.items():
        if sets is None or not all(sets):
            continue
        if any(sets[a] & sets[b] for a in range(n) for b in range(a + 1, n)):
            continue
        mod, name = key.rsplit(":", 1)
        if any(hp[0] == mod and hp[1] == name for hp in split.head_params):
            continue
        split.head_params.append((mod, name, [frozenset(s) for s in sets], n))


def _heads_of_features(roles: dict, n: int) -> dict[tuple[str, int], set[int]]:
    """``{(producer, feature): the heads it belongs to}`` over the per-head feature sets of ``n`` heads in
    ``roles``."""
    head_of: dict = {}
    for p, per_role in roles.items():
        for sets in per_role.values():
            if len(sets) != n:
                continue
            for h, s in enumerate(sets):
                for f in s:
                    head_of.setdefault((p, f), set()).add(h)
    return head_of


def _first_meets(meets: list) -> list[tuple[str, list]]:
    """``meets`` grouped by buffer, in order of first appearance: ``[(buffer key, [per_index, ...])]``."""
    grouped: dict = {}
    for key, per_index in meets:
        grouped.setdefault(key, []).append(per_index)
    return list(grouped.items())


def _buffer_heads(per_indexes: list, head_of: dict, n: int) -> list[set] | None:
    """The buffer's entries per head read from its recorded meets ``per_indexes``, or None when an index meets
    features of several heads (not a per-head buffer)."""
    cur: list[set] = [set() for _ in range(n)]
    for per_index in per_indexes:
        for entries, feats in per_index:
            hs = set().union(*(head_of.get((p, f), set()) for p, fs in feats.items() for f in fs))
            if not entries or not hs:
                continue
            if len(hs) != 1:
                return None  # an index meeting several heads: not a per-head buffer
            cur[next(iter(hs))] |= entries
    return cur


__all__ = ["names", "note_attention", "note_meet"]
