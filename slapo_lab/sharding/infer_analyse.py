"""The analysis of the split inference: one block's recorded events read into Megatron-LM roles and layouts.

From the events and maps :class:`~slapo_lab.sharding.infer_recorder._Recorder` recorded for one block,
:func:`_analyse` builds its :class:`~slapo_lab.sharding.infer_maps.BlockSplit`: q / k / v projections (fused
ones included) with their head counts and the column-parallel layout whose per-rank features are exactly a
rank's heads (contiguous, equal blocks, unequal blocks, or key/value blocks replicated over the ranks whose query
heads use them), the output projection, MLP pairs under any stride, routers and token routers (DeepSeek-V3.2's
sparse-attention indexer) kept whole, low-rank and shared projections kept whole, per-head parameters and
per-head inputs (resolved to their heads axis by :func:`_resolve_head_params` / :func:`_resolve_head_inputs`),
and norms whose parameters follow a split layer's features (:func:`_feature_params`). Sources: Megatron-LM
``ColumnParallelLinear`` / ``RowParallelLinear`` (``partition_stride``), Megatron-LM / vLLM key/value head
replication, transformers' ``base_model_tp_plan`` (cross-checked in tests/test_split_inference.py). Split from
:mod:`slapo_lab.sharding.infer`.
"""

from __future__ import annotations

import torch
from torch import nn

from . import attention_site as _attention_site
from . import channel_heads as _channel_heads
from . import fanout as _fanout
from . import head_buffers as _head_buffers
from . import score_terms as _score_terms
from .infer_maps import (
    BlockSplit,
    HeadParam,
    Layout,
    _candidate_strides,
    _common_parent,
    _dense_out,
    _fits,
    _head_sets,
    _Info,
    _replicated_strides,
    _test_ws,
)
from .infer_recorder import _Recorder


def _token_routers(rec) -> set[str]:
    """The linears whose outputs reach the block's output only through a ``topk`` choice of tokens (a
    sparse-attention indexer: DeepSeek-V3.2's ``wq_b`` / ``wk`` / ``weights_proj``): lineage from linear to
    linear, cut at ``topk``'s results."""
    succ: dict = {}
    for m_path, inf in rec.linear_in.items():
        for p in inf.src:
            succ.setdefault(p, set()).add(m_path)
    reach = set(rec.out_src)
    grown = True
    while grown:
        grown = False
        for p, ms in succ.items():
            if p not in reach and ms & reach:
                reach.add(p)
                grown = True
    return set(rec.topk_src) - reach


def _analyse(rec: _Recorder, block: nn.Module, dense: dict[str, nn.Module]) -> BlockSplit:
    """The :class:`BlockSplit` of one block read from its recorded forward ``rec``: each attention's projections
    by heads (:func:`_analyse_attention`), the MLP pairs (:func:`_note_mlp_pairs`), the per-feature parameters,
    the parameters whose gradients sum over ranks, and the routers kept whole. ``dense``: the block's linears."""
    split = BlockSplit()
    out_feats = {p: _dense_out(m) for p, m in dense.items()}
    token_routers = _token_routers(rec)
    for i, ev in enumerate(rec.events):
        _analyse_attention(split, rec, i, ev, dense, out_feats, token_routers)
    _note_mlp_pairs(split, rec, dense, out_feats)
    split.ran = set(rec.ran)
    _feature_params(split, rec, block)
    _note_grad_sums(split, rec)
    _note_whole_routers(split, rec, dense, token_routers)
    return split


def _projections(maps: dict) -> set[str]:
    """The producers (linears) among the keys of an :class:`_Info`'s ``maps``."""
    return {p for p in maps if not p.startswith(("@", "param:", "input:", "cols:"))}


def _analyse_attention(
    split: BlockSplit,
    rec: _Recorder,
    i: int,
    ev: dict,
    dense: dict[str, nn.Module],
    out_feats: dict[str, int],
    token_routers: set[str],
) -> None:
    """Note in ``split`` the ``i``-th attention event ``ev`` of ``rec``: its module's head counts, the roles and
    layouts of its q / k / v (and gate) projections and its output projection, or why its heads stay whole."""
    (q, qi), (_k, ki), (_v, vi) = ev["q"], ev["k"], ev["v"]
    if qi is None or ki is None or vi is None or q.dim() < 3:
        return
    scorers = _projections(qi.maps) | _projections(ki.maps)
    if scorers and scorers <= token_routers:
        return  # scores that choose tokens (a sparse-attention indexer's), not an attention to split
    n = q.shape[-3]
    roles: dict[str, dict] = {}  # producer -> role -> [set per head]
    head_lists: list = []
    kv = None
    for role, t, inf, main in _score_operands(ev, token_routers):
        if inf is not None:
            kv = _note_operand(split, roles, head_lists, (role, t, inf, main), n, kv)
    _note_extras(split, ev["extras"])
    mixed_term = _score_terms.note_roles(
        ev["extras"], roles, n, dense, rec.linear_in, token_routers | rec.routers
    )  # score terms
    kv = kv or n
    parent_of = {p: p.rsplit(".", 1)[0] if "." in p else "" for p in dense}
    attn_mod = _attention_site.owner(
        _common_parent([parent_of.get(p, "") for p in roles if p in dense]), ev.get("where")
    )
    o_path = next((p for p, inf in rec.linear_in.items() if f"@attn{i}" in inf.maps), None)
    if o_path is not None:
        _note_output_gate(
            split, roles, rec.linear_in[o_path], f"@attn{i}", ev.get("out_heads", n), o_path, dense
        )
    split.attention[attn_mod] = (n, kv)
    _head_buffers.note_attention(split, rec, roles, n)  # per-head buffers (MiniMax's decays)
    _channel_heads.resolve(split, rec, roles)  # a convolution over heads (channel_heads.py)
    ws = _test_ws(n, kv) or _test_ws(n)
    refusal = _head_list_refusal(head_lists) or mixed_term
    refusal = _lay_out_projections(split, roles, dense, out_feats, (n, kv, ws), refusal)
    refusal = refusal or _fanout.shared_heads_reason(roles, rec, dense, o_path)  # fanout.py
    if refusal:
        _refuse(split, roles, dense, attn_mod, o_path, refusal)
    elif o_path is not None and o_path not in split.roles:
        _note_output_projection(
            split, o_path, rec.linear_in[o_path].maps[f"@attn{i}"][0], ev.get("out_heads", n), ws
        )


def _score_operands(ev: dict, token_routers: set[str]) -> list[tuple]:
    """``[(role, tensor, its _Info or None, main)]``: an attention event's q, k and v (``main``), then the operands
    of more scores added to the first (DeBERTa's c2p / p2c position terms) as q / k, save those of a token choice
    (an indexer's mask)."""
    (q, qi), (k, ki), (v, vi) = ev["q"], ev["k"], ev["v"]
    infos = ev.get("infos", {})
    args = [("q", q, qi, True), ("k", k, ki, True), ("v", v, vi, True)]
    for a, b in ev.get("pairs", ()):
        pa, pb = infos.get(id(a)), infos.get(id(b))
        made = {
            p for inf in (pa, pb) if inf is not None for p in inf.maps if not p.startswith(("@", "param:"))
        }
        if made and made <= token_routers:
            continue  # a token choice's scores added to the attention's (an indexer's mask), not a head term
        args += [("q", a, pa, False), ("k", b, pb, False)]
    return args


def _note_operand(
    split: BlockSplit, roles: dict, head_lists: list, operand: tuple, n: int, kv: int | None
) -> int | None:
    """Note the producers of one score operand ``(role, tensor, _Info, main)`` in ``roles`` (their per-head
    feature sets under the operand's role) and its per-head parameters and inputs in ``split``; returns the
    key/value head count ``kv`` updated by a main k."""
    role, t, inf, main = operand
    for p, ms in inf.maps.items():
        if p.startswith("@"):
            continue
        if p.startswith(("input:", "param:")):
            _note_operand_param(split, head_lists, p, ms)
            continue
        sets = _head_sets(t, ms)
        if len(sets) != n and role == "q":
            continue
        have = roles.setdefault(p, {})
        if not main:  # a score term's side takes the projection's role in the main term, if it has one
            role = next((r for r in ("q", "k") if r in have), "k")
        # the same projection in two score terms (DeBERTa's q in c2p): one role
        have[role] = [x | y for x, y in zip(have[role], sets, strict=False)] if role in have else sets
        if role == "k" and main:
            distinct = len({frozenset(s) for s in sets if s})
            kv = distinct if kv is None else max(kv, distinct)
    return kv


def _note_operand_param(split: BlockSplit, head_lists: list, p: str, ms: list) -> None:
    """A parameter (``"param:..."``) or outside input (``"input:..."``) ``p`` in a score operand: a per-head one
    joins ``split``; a module list of one module per head joins ``head_lists``."""
    if p.startswith("input:"):
        _note_head_param(split, p, ms, split.head_inputs)
        return
    owned = _head_owned(p, ms)
    if owned is not None:
        head_lists.append(owned)
    _note_head_param(split, p, ms)


def _note_extras(split: BlockSplit, extras: list) -> None:
    """The per-head parameters and inputs among the values added to (or multiplied into) the scores."""
    for _e, inf in extras:
        for p, ms in inf.maps.items():
            if p.startswith("param:"):
                _note_head_param(split, p, ms)
            elif p.startswith("input:"):  # a per-head tensor the model builds (MPT's ALiBi position_bias)
                _note_head_param(split, p, ms, split.head_inputs)


def _note_output_gate(
    split: BlockSplit, roles: dict, o_in: _Info, key: str, heads_out: int, o_path: str, dense: dict
) -> None:
    """An output gate (``sigmoid(g(x)) * attention``, Qwen3-Next / AFMoE) read from the output projection's input
    ``o_in`` (``key``: the attention output's map): per-head features of a gate linear (role ``"g"`` in
    ``roles``), and a per-head gate bias (Beam's ``gate_bias``) in ``split.head_params``."""
    fin = o_in.maps[key][0].shape[-1]
    for p, ms in o_in.maps.items():
        if p.startswith("param:") and fin % heads_out == 0:
            _note_gate_bias(split, p, ms, fin, heads_out)
            continue
        if p not in dense or p == o_path or fin % heads_out:
            continue
        width = fin // heads_out
        sets = [set() for _ in range(heads_out)]
        for m in ms:
            row = m.reshape(-1, m.shape[-1])[0]
            for h in range(heads_out):
                seg = row[h * width : (h + 1) * width]
                sets[h] |= set(seg[seg >= 0].tolist())
        roles.setdefault(p, {})["g"] = sets


def _note_gate_bias(split: BlockSplit, p: str, ms: list, fin: int, heads_out: int) -> None:
    """A per-head gate bias ``p`` (``fin`` features of ``heads_out`` heads): noted once, when each head's
    entries are its own."""
    width = fin // heads_out
    row = ms[0].reshape(-1, fin)[0]
    sets = [
        frozenset(x for x in row[h * width : (h + 1) * width].tolist() if x >= 0) for h in range(heads_out)
    ]
    key = p[len("param:") :].rsplit(":", 1)
    pairs = ((a, b) for a in range(heads_out) for b in range(a + 1, heads_out))
    known = any(hp[0] == key[0] and hp[1] == key[1] for hp in split.head_params)
    if all(sets) and not known and not any(sets[a] & sets[b] for a, b in pairs):
        split.head_params.append((key[0], key[1], sets, heads_out))


def _head_list_refusal(head_lists: list) -> str | None:
    """Why an attention's heads stay whole when a per-head module list takes part in its scores, or None."""
    if not head_lists:
        return None
    where = head_lists[0]
    return (
        f"its per-head {where[0]} is a list of {where[1]} modules, one per head (e.g. StableLM's "
        "qk_layernorm), which no shard splits, so its heads stay whole"
    )


def _lay_out_projections(
    split: BlockSplit, roles: dict, dense: dict, out_feats: dict[str, int], heads: tuple, refusal: str | None
) -> str | None:
    """Give each projection of ``roles`` its role and layout over ``ws`` ranks (``heads``: ``(n, kv, ws)``), or
    keep it whole (``split.whole``); returns why the attention cannot split its heads (``refusal`` as given,
    or the first reason found), or None."""
    n, _kv, ws = heads
    for p, per_role in roles.items():
        if p not in dense or refusal:
            continue
        if ws is None:
            return f"its {n} attention heads cannot be split by heads"
        feats, refusal = _features_of(p, per_role, out_feats[p], heads, refusal)
        if refusal and len(per_role) > 1:
            break
        _lay_out_projection(split, p, per_role, feats, heads)
    return refusal


class _Features:
    """How the output features of one projection split: ``part`` (each feature's role, ``"?"`` for none),
    ``needed`` (the features each of the ``ws`` ranks needs), ``shared`` (a feature in two parts) and
    ``replicated`` (k / v of a fused multi-query projection -> its key/value head groups)."""

    def __init__(self, feats: int, ws: int) -> None:
        self.part = ["?"] * feats
        self.needed: list[set] = [set() for _ in range(ws)]
        self.shared = False
        self.replicated: dict[str, int] = {}


def _features_of(
    p: str, per_role: dict, feats: int, heads: tuple, refusal: str | None
) -> tuple[_Features, str | None]:
    """The :class:`_Features` of projection ``p`` (``per_role``: role -> [feature set per head]; ``feats``
    output features) and the refusal (``refusal`` as given, or why its heads cannot split)."""
    n, _kv, ws = heads
    out = _Features(feats, ws)
    for role, sets in per_role.items():
        hn = len(sets)
        out.shared = _mark_parts(out.part, role, sets, feats) or out.shared
        uniq = [x for j, x in enumerate(sets) if j == 0 or x != sets[j - 1]]  # key/value heads
        if role in ("k", "v") and "q" in per_role and len(uniq) % ws and ws % len(uniq) == 0 and n % ws == 0:
            # a fused multi-query projection: each rank keeps the key/value head its query heads use,
            # shared by ws / kv ranks (GPT-BigCode's c_attn, Falcon's query_key_value)
            out.replicated[role] = len(uniq)  # key/value head groups
            for r in range(ws):
                out.needed[r] |= uniq[r // (ws // len(uniq))]
            continue
        if hn % ws:
            refusal = _uneven_heads_refusal(p, role, per_role, hn, heads) or refusal
            continue
        per = hn // ws
        for r in range(ws):
            for h in range(r * per, (r + 1) * per):
                out.needed[r] |= sets[h]
    return out, refusal


def _mark_parts(part: list[str], role: str, sets: list[set], feats: int) -> bool:
    """Mark the features of ``sets`` as ``role``'s in ``part``; True when one already belonged to another part
    (a feature shared by two parts)."""
    shared = False
    for s in sets:
        for f in s:
            if not 0 <= f < feats:
                continue
            if part[f] not in ("?", role):
                if "g" in (role, part[f]):
                    # a q/k/v feature that also reaches the output projection's input by head (NeoMME's
                    # exclusive self-attention subtracts v's direction there): one part; the ranks' needed
                    # features must still agree
                    part[f] = part[f] if role == "g" else role
                    continue
                shared = True
            part[f] = role
    return shared


def _uneven_heads_refusal(p: str, role: str, per_role: dict, hn: int, heads: tuple) -> str | None:
    """Why ``hn`` heads of ``role`` in projection ``p`` that do not divide by the ranks keep the attention whole;
    None for a separate key/value projection, replicated (:func:`kv_replicas`)."""
    n, kv, ws = heads
    if role in ("k", "v") and len(per_role) == 1 and ws % max(kv, 1) == 0:
        return None  # a separate key/value projection, replicated (kv_replicas)
    if role not in ("k", "v"):
        return f"its {hn} heads do not split by heads"
    return (
        f"its {kv} key/value head{'s' if kv != 1 else ''} for {n} query heads (multi-query "
        f"attention) {'sit' if kv != 1 else 'sits'} in the fused {p.rsplit('.', 1)[-1]} beside the query heads, so it "
        "cannot be split by heads"
    )


def _lay_out_projection(split: BlockSplit, p: str, per_role: dict, f: _Features, heads: tuple) -> None:
    """The role and :class:`Layout` of projection ``p`` whose features split as ``f``, or why it stays whole
    (``split.whole``; ``split.shared`` for features every head or other layers read)."""
    n, kv, ws = heads
    feats = len(f.part)
    copies = {x for x in range(feats) if f.part[x] in f.replicated}
    shared = f.shared or any(
        (f.needed[r] & f.needed[s]) - copies for r in range(ws) for s in range(r + 1, ws)
    )
    if shared or "?" in f.part or len(set().union(*f.needed)) != feats:
        split.shared.add(p)
        split.whole[p] = (
            "its features reach every attention head or feed other layers too (a shared or low-rank "
            "projection), so it stays whole"
        )
        return
    parts = "".join(dict.fromkeys(f.part))
    cands = _replicated_strides(f.part, f.replicated) if f.replicated else _candidate_strides(feats, f.part)
    cands = [*cands, *_score_terms.run_strides(feats, f.needed)]  # one run of features per block
    lay = next((s for s in cands if _fits(feats, s, ws, f.needed)), None)
    if lay is None:
        split.whole[p] = f"no shard of {p} keeps whole heads on every rank"
        return
    split.roles[p] = parts
    units = len(per_role.get("q", per_role.get("k", []))) if lay == 1 and len(parts) > 1 else None
    if len(parts) > 1 and lay == 1 and "k" in per_role:
        units = kv if kv != n else n
    split.layouts[p] = Layout(parts, lay, units)


def _refuse(
    split: BlockSplit, roles: dict, dense: dict, attn_mod: str, o_path: str | None, refusal: str
) -> None:
    """Keep an attention's projections (and output projection ``o_path``) whole, for ``refusal``."""
    split.refusals[attn_mod] = refusal
    for p in roles:
        if p in dense:
            split.roles.pop(p, None)
            split.layouts.pop(p, None)
            split.whole[p] = refusal
            split.refused_roles[p] = "qkv"
    if o_path is not None:
        split.whole[o_path] = refusal
        split.refused_roles[o_path] = "o"


def _note_output_projection(
    split: BlockSplit, o_path: str, m: torch.Tensor, heads_out: int, ws: int | None
) -> None:
    """Give the output projection ``o_path`` the role ``"o"`` when each of the ``ws`` ranks' contiguous share of
    its input features (``m``: the attention output's map there) holds whole heads, its own in order."""
    fin = m.shape[-1]
    if not ws or fin % ws:
        return
    col = m.reshape(-1, fin)[0]
    dv = max(int(col.max().item()) + 1, 1) // heads_out
    ok = dv > 0 and all(
        set((col[r * fin // ws : (r + 1) * fin // ws] // dv).tolist())
        == set(range(r * heads_out // ws, (r + 1) * heads_out // ws))
        for r in range(ws)
    )
    if ok:
        split.roles[o_path] = "o"


def _note_mlp_pairs(split: BlockSplit, rec: _Recorder, dense: dict, out_feats: dict[str, int]) -> None:
    """MLP pairs: a row linear whose input features are, rank by rank, exactly some column linears' features
    (``"mlp_out"`` and ``"mlp_in"`` with their layouts)."""
    taken = set(split.roles) | set(split.whole)
    for r_path, inf in rec.linear_in.items():
        cols = _column_inputs(r_path, inf, dense, taken, rec.routers)
        if not cols:
            continue
        fin = rec.linear_in_shape[r_path][-1]
        ws = _test_ws(fin)
        plan = _column_plan(cols, fin, ws, out_feats) if ws is not None else None
        if not plan:
            continue
        if any(p in inf2.maps for q, inf2 in rec.linear_in.items() if q != r_path for p in plan):
            continue  # a column layer's features also reach another linear (Mamba's x_proj), which would see a part
        split.roles[r_path] = "mlp_out"
        for p, lay in plan.items():
            split.roles[p] = "mlp_in"
            split.layouts[p] = Layout("gate_up" if lay == 2 else "in", lay, None)
            taken.add(p)
        taken.add(r_path)


def _column_inputs(r_path: str, inf: _Info, dense: dict, taken: set, routers: set) -> dict | None:
    """``{column linear: its maps}`` reaching the input ``inf`` of linear ``r_path``, when they are all the
    linears it reads (parameters aside) and none is taken; None otherwise."""
    if r_path in taken or r_path not in dense or r_path in routers:
        return None
    cols = {p: ms for p, ms in inf.maps.items() if p in dense and p not in taken and p != r_path}
    if not cols or any(not p.startswith("param:") and p not in cols for p in inf.maps if p in dense):
        return None
    return cols


def _column_plan(cols: dict, fin: int, ws: int, out_feats: dict[str, int]) -> dict | None:
    """``{column linear: stride}``: a contiguous (or strided) shard of each column linear in ``cols`` that gives
    each of ``ws`` ranks the features its share of the row linear's ``fin`` input features reads; None when the
    features are not all explained or no shard fits."""
    flat = {p: [m.reshape(-1, m.shape[-1])[0] for m in ms] for p, ms in cols.items()}
    explained = torch.zeros(fin, dtype=torch.bool)
    plan = {}
    for p, rows in flat.items():
        feats = out_feats[p]
        needed = [set() for _ in range(ws)]
        for row in rows:
            explained |= row >= 0
            for rk in range(ws):
                seg = row[rk * fin // ws : (rk + 1) * fin // ws]
                needed[rk] |= set(seg[seg >= 0].tolist())
        if len(set().union(*needed)) != feats:
            return None
        part = ["x"] * feats
        lay = next((s for s in _candidate_strides(feats, part) if _fits(feats, s, ws, needed)), None)
        if lay is None:
            return None
        plan[p] = lay
    return plan if plan and bool(explained.all()) else None


def _note_grad_sums(split: BlockSplit, rec: _Recorder) -> None:
    """Replicated parameters applied to a column-parallel layer's (partitioned) output see this rank's features
    only (XIELU's alpha in Apertus' MLP, a per-head q/k norm): their gradients are partial sums."""
    columns = {p for p, r in split.roles.items() if r not in ("o", "mlp_out")}
    split_params = {hp[0] for hp in split.head_params}
    for key, prods in rec.param_uses.items():
        mod = key.rsplit(":", 1)[0]
        if prods & columns and mod not in split_params and mod not in split.feature_params:
            split.grad_sum.add(mod)


def _note_whole_routers(split: BlockSplit, rec: _Recorder, dense: dict, token_routers: set[str]) -> None:
    """Routers (of experts, or of tokens through a ``topk``) stay whole: every rank must route alike."""
    for p in rec.routers:
        if p in dense and p not in split.roles:
            split.whole[p] = "a router: every rank must route every token the same way"
    for p in sorted(token_routers):
        if p in dense and p not in split.roles and p not in split.whole:
            split.whole[p] = (
                "a token router: its output reaches the block only through a topk choice, which every rank must "
                "make the same way"
            )


def _feature_params(split: BlockSplit, rec, block: nn.Module) -> None:
    """``split.feature_params``: the modules all of whose parameters follow, entry by entry, the features of
    linears this split shards contiguously: a column-parallel projection's output (OLMo 2's ``q_norm`` over all
    heads' q), or an attention output whose output projection is row parallel (BitNet's ``attn_sub_norm``)."""
    o_of = {}
    for i in range(len(rec.events)):
        key = f"@attn{i}"
        o_of[key] = next((p for p, inf in rec.linear_in.items() if key in inf.maps), None)
    by_mod: dict[str, set] = {}
    for key, prods in rec.aligned.items():
        by_mod.setdefault(key.rsplit(":", 1)[0], set()).update(prods)
    for mod, prods in by_mod.items():
        owner = block.get_submodule(mod) if mod else block
        # every parameter of the module's subtree: a bias that follows the features after a convolution of
        # replicated weights (ConvBERT's SeparableConv1D: depthwise -> pointwise -> + bias) is not a feature norm
        keys = [
            f"{'.'.join(x for x in (mod, n.rpartition('.')[0]) if x)}:{n.rpartition('.')[2]}"
            for n, p in owner.named_parameters()
            if p.requires_grad
        ]
        if not keys or any(k not in rec.aligned for k in keys):
            continue
        linears = set()
        for p in prods:
            if p.startswith("@attn"):
                o = o_of.get(p)
                ok = o is not None and split.roles.get(o) == "o"
            else:
                role, lay = split.roles.get(p), split.layouts.get(p)
                o = p
                ok = (
                    role is not None
                    and (role == "mlp_in" or set(role) <= set("qkvg"))
                    and lay is not None
                    and type(lay.stride) is int
                    and lay.stride == 1
                )
            if not ok:
                break
            linears.add(o)
        else:
            if linears:
                split.feature_params[mod] = linears


def _head_owned(p: str, ms: list) -> tuple[str, int] | None:
    """``(container path, heads)`` when parameter ``p`` reaches exactly one head and belongs to the i-th
    module of a module list (one module per head), else None."""
    m = ms[0]
    if m.dim() < 3:
        return None
    used = [h for h in range(m.shape[-3]) if bool((m.select(-3, h) >= 0).any())]
    mod = p[len("param:") :].rsplit(":", 1)[0]
    container, _, idx = mod.rpartition(".")
    if len(used) != 1 or not idx.isdigit():
        return None
    return container, m.shape[-3]


def _note_head_param(split: BlockSplit, p: str, ms: list, into: list | None = None) -> None:
    """A parameter (or, ``into`` ``split.head_inputs``, a tensor argument from outside the block) whose entries
    reach attention heads (axis -3 of its map): note, per head, its entries (heads repeated for grouped-query
    attention count once)."""
    into = split.head_params if into is None else into
    key = p.split(":", 1)[1]
    mod, name = key.rsplit(":", 1)
    if any(hp[0] == mod and hp[1] == name for hp in into):
        return
    m = ms[0]
    if m.dim() < 3:
        return
    raw = [
        frozenset(x for x in m.select(-3, h).reshape(-1).unique().tolist() if x >= 0)
        for h in range(m.shape[-3])
    ]
    sets = []
    for st in raw:
        if not sets or sets[-1] != st:
            sets.append(st)
    n = len(sets)
    if n < 2 or any(sets[a] & sets[b] for a in range(n) for b in range(a + 1, n)):
        return  # shared by several heads (a scale over head_dim)
    into.append((mod, name, sets, n))  # resolved against the parameter's (or argument's) shape later


def _feature_norm(mod: nn.Module, width: int) -> bool:
    """A norm with parameters, each of one entry per feature of a ``width``-wide last axis."""
    params = [p for p in mod._parameters.values() if p is not None]
    return bool(params) and all(p.dim() >= 1 and p.shape[-1] == width == p.numel() for p in params)


def _is_norm(mod: nn.Module) -> bool:
    return isinstance(mod, (nn.LayerNorm, nn.RMSNorm)) or type(mod).__name__.endswith(
        ("LayerNorm", "RMSNorm")
    )


def _resolve_head_params(split: BlockSplit, block: nn.Module) -> None:
    resolved = []
    for mod, name, sets, n in split.head_params:
        owner = block.get_submodule(mod) if mod else block
        prm = getattr(owner, name, None)
        if not isinstance(prm, torch.Tensor):
            continue
        shape = tuple(prm.shape)
        idx = torch.arange(prm.numel()).view(shape)
        for axis, size in enumerate(shape):
            if size != n:
                continue
            if all(set(idx.select(axis, h).reshape(-1).tolist()) >= sets[h] for h in range(n)):
                resolved.append(HeadParam(mod, name, axis, n))
                break
        else:  # heads x head_dim flattened on one axis (DeBERTa's q_bias / v_bias): head h a contiguous range
            for axis, size in enumerate(shape):
                if size % n or size == n:
                    continue
                chunks = idx.chunk(n, dim=axis)
                if all(set(chunks[h].reshape(-1).tolist()) >= sets[h] for h in range(n)):
                    resolved.append(HeadParam(mod, name, axis, n))
                    break
    split.head_params = resolved


def _resolve_head_inputs(split: BlockSplit, shapes: dict, aliases: dict) -> None:
    """The heads axis of each per-head tensor argument (of the attention module it reaches, itself or passed on
    to it by an outer module of the block), from its shape."""
    resolved = []
    for first, name0, sets, n in split.head_inputs:
        where = [f"{first}:{name0}", *aliases.get(f"{first}:{name0}", [])]
        at = next((w for w in where if w.rsplit(":", 1)[0] in split.attention), None)
        shape = shapes.get(at) if at is not None else None
        if shape is None:
            continue
        mod, name = at.rsplit(":", 1)
        idx = torch.arange(max(1, int(torch.tensor(shape).prod()))).view(shape)
        for axis, size in enumerate(shape):
            if size == n and all(set(idx.select(axis, h).reshape(-1).tolist()) >= sets[h] for h in range(n)):
                resolved.append(HeadParam(mod, name, axis, n))
                break
    split.head_inputs = resolved
