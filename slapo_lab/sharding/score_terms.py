"""Linears whose output is added to the attention scores head by head: per-head score terms that follow the split.

A relative-position bias may be computed from the hidden states: ProphetNet's main stream
(``transformers/models/prophetnet/modeling_prophetnet.py``, ``get_main_relative_pos_embeddings``) takes
``relative_pos_embeddings = nn.Linear(hidden, num_buckets * num_heads)``, views it as
``(B, T, num_buckets, num_heads)``, permutes the heads first, ``gather``-s each query/key pair's bucket and adds
the result to the scores ``(B, heads, T, S)``. Each output feature then reaches exactly one head, so the linear is
column parallel with the features of each rank's heads -- not contiguous here but one chunk of every bucket's
block of ``num_heads`` features (a strided shard, Megatron's ``partition_stride``;
:func:`slapo_lab.sharding.rules.local_shard`).

:class:`slapo_lab.sharding.infer._Recorder` keeps such a value as a score *extra* when a linear's map reaches the
scores (:func:`is_term`); ``gather`` carries the maps like any shape op, by a zero index where the index was
made on the meta device and has no values (:func:`unknown_index`: each output element stands for one element of
its row, and the per-head features seen are completed to the interleaved or contiguous layout they agree with);
:func:`note_roles` gives the linear a q-side role with one set of features per head (the convention of DeBERTa's
c2p / p2c score terms) and :func:`run_strides` the strided layout its per-rank features form. Where the linear's
features reach several heads' scores, no split by heads is right and the attention is refused in one sentence:
ProphetNet's predict stream (``get_predict_relative_pos_embeddings``) gathers rows ordered
``(batch, T, ngram, heads)`` and reads them back as ``(batch, ngram, heads, T)``, so head h's scores get other
heads' relative-position features.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .infer_maps import _common_parent, _head_sets, _Info, _linear_maps

if TYPE_CHECKING:
    from .infer_recorder import _Recorder

__all__ = ["is_term", "note_roles", "param_matmul", "run_strides", "unknown_index"]

_NOT_LINEAR = ("param:", "input:", "@", "cols:")


def is_term(maps: dict) -> bool:
    """Whether a value added to (or multiplied into) the scores carries a per-head term worth keeping: a
    parameter's or an outside input's entries (head tables, ALiBi), or a linear's output features."""
    return any(p.startswith(("param:", "input:")) or not p.startswith(_NOT_LINEAR) for p in maps)


def param_matmul(
    rec: _Recorder,
    mm: tuple[torch.Tensor, torch.Tensor],
    a: _Info | None,
    b: _Info | None,
    out: Any,
    src: frozenset[str],
) -> bool:
    """``x @ W`` with ``x`` a linear's output and ``W`` a 2-D parameter (Inkling's ``InklingRelativeLogits``:
    ``relative_states (B, T, heads, d_rel) @ proj (d_rel, extent)``): each output element mixes the features of
    its own row of ``x``, every other axis (the heads among them) kept, so it takes the map of the row's first
    feature (enough for the heads a value reaches; :func:`note_roles` completes the features), for the linear and
    for any parameter applied to ``x`` before. True when handled."""
    x, w = mm
    if a is None or b is None or a.scores is not None or not _linear_maps(a) or _linear_maps(b):
        return False
    if not isinstance(out, torch.Tensor) or w.dim() != 2 or x.dim() < 3 or out.shape[:-1] != x.shape[:-1]:
        return False
    maps = {
        p: [ms[0].narrow(-1, 0, 1).expand(tuple(out.shape)).contiguous()]
        for p, ms in a.maps.items()
        if not p.startswith(("@", "cols:")) and tuple(ms[0].shape) == tuple(x.shape)
    }  # a per-head scale applied before (Inkling 2's ScaledL2Clip) is carried too: it reaches the same heads
    if not maps:
        return False
    rec.set(out, _Info(maps, src))
    return True


def unknown_index(func: Callable[..., Any], index: torch.Tensor) -> torch.Tensor:
    """The index a map follows for an index made on the meta device, which has no values (ProphetNet's
    relative-position buckets come from position ids the meta forward computes): for ``gather`` /
    ``take_along_dim`` zeros, so each output element stands for one element of its own row along the gathered
    axis (the other axes, the heads among them, keep their place); for any other op a ``ValueError``, which
    drops the map."""
    if getattr(func, "__name__", "") not in ("gather", "take_along_dim"):
        raise ValueError("an index without values")
    return torch.zeros(tuple(index.shape), dtype=torch.long)


def _complete(sets: list[set], feats: int) -> list[set] | None:
    """Per-head feature sets seen through a gather that picked only some of each head's features, completed to
    the layout every seen feature agrees with: interleaved (feature ``f`` of head ``f % n``: a ``view(..., X,
    n)``, ProphetNet's ``(num_buckets, num_heads)``) or contiguous (head ``f // (feats / n)``: ``view(..., n,
    X)``); None when neither explains them."""
    n = len(sets)
    if feats % n:
        return None
    seen = [(h, f) for h, s in enumerate(sets) for f in s]
    if all(f % n == h for h, f in seen):
        return [set(range(h, feats, n)) for h in range(n)]
    width = feats // n
    if all(f // width == h for h, f in seen):
        return [set(range(h * width, (h + 1) * width)) for h in range(n)]
    return None


def note_roles(
    extras: list, roles: dict, n: int, dense: dict, linear_in: dict, routers: frozenset | set = frozenset()
) -> str | None:
    """Give every linear of ``dense`` whose output features reach the scores of an attention of ``n`` heads,
    each feature exactly one head and every head some feature, the role ``"q"`` with its per-head feature sets
    (``roles``: producer -> role -> [set of features per head], updated in place).

    ``extras``: ``[(score-shaped tensor (..., heads, T, S), its _Info)]`` of one attention event;
    ``linear_in``: linear path -> the _Info of its input. A linear whose input carries another linear's features
    (Doge's ``dt_proj`` of the values) gets no role: a column shard of it would see only this rank's heads.
    ``routers``: linears that choose tokens or experts (a sparse-attention indexer's ``weights_proj``, whose
    own scores are no attention's): never a score term.

    Returns:
        why the attention's heads cannot be split (a sentence fragment) when such a linear's features reach the
        scores of several heads (ProphetNet's predict stream gathers its relative-position rows in another
        order than it reads them back, so head h's scores get other heads' terms): the linear then joins
        ``roles`` so the refusal keeps it whole with the attention; None otherwise."""
    # the attention module the event's own q / k / v belong to: a term another attention's scores left behind
    # (an extra noted after that attention's last event) is not this one's
    base = _common_parent([r.rpartition(".")[0] for r in roles if r in dense])
    mixed = None
    for e, inf in extras:
        if not isinstance(e, torch.Tensor) or e.dim() < 3 or e.shape[-3] != n:
            continue
        for p, ms in inf.maps.items():
            if p.startswith(_NOT_LINEAR) or p not in dense or p in roles or p in routers:
                continue
            if base and not p.startswith(base + "."):
                continue
            fed = linear_in.get(p)
            if fed is not None and any(q in dense for q in fed.maps):
                continue
            sets = _head_sets(e, ms)
            if len(sets) != n or not all(sets):
                continue
            if any(sets[a] & sets[b] for a in range(n) for b in range(a + 1, n)):
                # a feature shared by heads' scores: no split by heads keeps it with every head that reads it
                roles[p] = {"q": sets}
                mixed = mixed or (
                    f"its {p.rsplit('.', 1)[-1]} output is added to the attention scores with features of one "
                    "head reaching other heads' scores, so splitting the heads would change them"
                )
                continue
            feats = getattr(dense[p], "out_features", None) or dense[p].weight.shape[-1]
            full = _complete(sets, feats) if len(set().union(*sets)) < feats else sets
            if full is not None:
                roles[p] = {"q": full}
    return mixed


def run_strides(n: int, needed: list[set]) -> list[int]:
    """The equal-block stride a column shard needs when rank 0's features ``needed[0]`` are runs of equal length
    spread at equal distances over ``n`` features (one run per block): ``[number of blocks]``, else ``[]``."""
    first = sorted(needed[0]) if needed and needed[0] else []
    if not first:
        return []
    runs: list[list[int]] = []
    for f in first:
        if runs and f == runs[-1][-1] + 1:
            runs[-1].append(f)
        else:
            runs.append([f])
    k = len(runs)
    if k < 2 or n % k or len({len(r) for r in runs}) != 1:
        return []
    block = n // k
    if any(r[0] != i * block for i, r in enumerate(runs)):
        return []
    return [k]
