"""Which layers of a block a tensor-parallel preset splits, and how: :func:`block_layers` (``(path, kind)`` in
module order: column, row, norm, head_norm, features, experts, heads ...), :func:`tp_block` (one block made
Megatron tensor parallel), and :func:`replicated_dense` (one sentence naming the dense layers a schedule keeps
whole, and why).

A projection is recognised by its module's layout where the model fuses q/k/v or gate/up (Falcon's / BLOOM's
``query_key_value``, Phi-3's ``qkv_proj``: :func:`_fused_kind`, from
:func:`slapo_lab.sharding.rules.fused_layout`), by the data flow read from the block's graph
(:mod:`slapo_lab.sharding.infer`), or by its name (``COLUMN_NAMES`` / ``ROW_NAMES``); an attention whose heads
cannot be split keeps its projections whole.
"""

from __future__ import annotations

from torch import nn

from ..blocks import find_blocks, is_conv1d
from ..errors import ScheduleError
from ..module_state import peek_meta
from ..preset_check import KEPT_WHOLE_KEY
from ..record import Call
from ..sharding import infer, mixers
from ..sharding.heads import plan_local_heads, recorded_heads
from ..sharding.lone_linears import lone_linear_kind
from ..sharding.rules import (
    ShardSite,
    attention_refusal,
    attention_role,
    fused_layout,
    head_dim,
    is_head_table,
    is_norm,
)
from .parallel import (
    COLUMN_NAMES,
    HEAD_NORM_NAMES,
    ROW_NAMES,
    _all_or_nothing,
    _is_experts,
    _since,
    apply_layer,
)


def _fused_kind(node) -> tuple[str | None, str | None]:
    """``(kind, refusal)`` of a dense layer from its attention module's attributes rather than its name: a
    fused projection (:func:`slapo_lab.sharding.rules.fused_layout`: Falcon's / BLOOM's ``query_key_value``,
    Phi-3's ``qkv_proj`` / ``gate_up_proj``, GPT-2's ``c_attn``) is ``"column"``, the output projection beside
    a fused q/k/v (Falcon's / BLOOM's ``self_attention.dense``) ``"row"``; an attention whose heads cannot be
    split (Falcon's multi-query attention) gives ``(None, reason)``; ``(None, None)`` for anything else."""
    if node.parent is None:
        return None, None
    site = ShardSite(node.mod, "weight", node.parent.mod, node.name, node.path)
    lay = fused_layout(site)
    role = attention_role(site)
    if lay is None and role != "o":
        return None, None
    reason = attention_refusal(node.parent.mod) if role is not None else None
    if reason is None and lay is not None:
        reason = lay.refusal
    if reason:
        return None, reason
    return ("column" if lay is not None else "row"), None


def _classify(rel: str) -> str | None:
    parts = rel.split(".")
    last, last2 = parts[-1], ".".join(parts[-2:])
    for key in (last2, last):
        if key in COLUMN_NAMES:
            return "column"
        if key in ROW_NAMES:
            return "row"
    return None


def block_layers(sch, block_path: str) -> list[tuple[str, str]]:
    """``(path, kind)`` for the projections, norms and experts of one block, in module order.

    Kinds: ``"column"`` / ``"row"``: ``nn.Linear`` / HF ``Conv1D`` recognised as a fused projection by its
    module's layout (Falcon's / BLOOM's ``query_key_value`` and Phi-3's ``qkv_proj`` / ``gate_up_proj``
    column, Falcon's / BLOOM's ``self_attention.dense`` row; see :func:`_fused_kind`) or by name (``q_proj``,
    ``query``, ``c_attn``, ``gate_proj``, ``intermediate.dense``, ALBERT's ``ffn`` ... column; ``o_proj``,
    ``c_proj``, ``output.dense``, ``down_proj``, ALBERT's ``attention.dense`` / ``ffn_output`` ... row, see
    ``COLUMN_NAMES`` / ``ROW_NAMES``; other linears stay replicated, as do the projections of an attention
    whose heads cannot be split: Falcon's multi-query attention); ``"norm"``; ``"head_norm"`` (a per-head
    q/k norm of size head_dim, ``HEAD_NORM_NAMES``); ``"features"`` (a module whose parameters follow a split
    layer's features entry by entry, OLMo 2's q_norm: sharded with them); ``"qk_norm_full"`` (a q/k norm over
    all heads, which cannot be split); ``"experts"`` (3-D expert weights, :func:`experts_parallel`); ``"heads"`` (a per-head
    table such as T5's relative attention bias).
    """
    block = sch[block_path]
    split = _split_of(sch, block_path)
    heads: dict = {}
    for hp in split.head_params if split is not None else ():
        heads.setdefault(hp.module, []).append(hp)  # a module may hold several (DeBERTa's q_bias, v_bias)
    out = []
    for rel, node in block.named_schedules():
        if not rel:
            continue
        kind = _layer_kind(sch, block, split, heads, rel, node)
        if kind:
            out.append((f"{block_path}.{rel}" if block_path else rel, kind))
    return out if split is None else _split_layers(sch, block, block_path, split, out)


def _layer_kind(sch, block, split, heads: dict, rel: str, node) -> str | None:
    """The kind :func:`block_layers` gives the module ``rel`` of ``block`` (None: left out)."""
    mod = node.mod
    if isinstance(mod, nn.Linear) or is_conv1d(mod):
        return _linear_kind(sch, block, split, rel, node)
    if split is not None and rel in split.feature_params:
        return "features"  # a norm over a split projection's features: sharded with them
    if rel in heads:
        kept = [hp for hp in heads[rel] if not _undivided(split, f"{rel}.{hp.name}", sch.world_size, block)]
        # one kind per module: "head_param:q_bias:0;v_bias:0"
        return "head_param:" + ";".join(f"{hp.name}:{hp.axis}" for hp in kept) if kept else None
    if is_norm(mod) and any(p is not None for p in mod._parameters.values()):
        return _block_norm_kind(sch, block, split, rel, node)
    if (
        split is not None
        and rel in split.grad_sum
        and not _is_experts(mod)
        and not _undivided(split, f"{rel}.w", sch.world_size, block)
    ):
        return "grad_sum"
    if _is_experts(mod):
        return "experts"
    if isinstance(mod, nn.Embedding) and node.parent is not None and _is_head_table(node):
        return "heads"
    return None


def _linear_kind(sch, block, split, rel: str, node) -> str | None:
    """``"column"`` / ``"row"`` for a linear (or HF ``Conv1D``) of the block, None where it stays replicated."""
    fused, refusal = _fused_kind(node)
    role = split.roles.get(rel) if split is not None else None
    if refusal:
        return None
    if role is not None:  # read from the block's dataflow (slapo_lab/sharding/infer.py)
        kind = _role_kind(role)
        if kind and role not in ("mlp_in", "mlp_out") and _undivided(split, rel, sch.world_size, block):
            return None  # an attention whose heads do not divide stays whole (replicated_dense says why)
        return kind
    if fused and (split is None or not split.attention):
        return fused  # a layout read from the attention module's attributes (Falcon, BLOOM, Phi-3)
    if (
        split is not None
        and (split.roles or split.whole)
        and (rel in split.whole or rel in split.ran)
        and (split.attention or rel in split.whole or _classify(rel) is None)
    ):
        # the dataflow ran it and paired it with nothing: it stays whole -- unless the dataflow saw no
        # attention at all in the block (MRA's custom sparse attention kernels): names are the hints there
        # -- or, where nothing keeps it whole, column parallel with its output gathered (lone_linears.py)
        return lone_linear_kind(split, rel, node.mod, node.parent.mod if node.parent is not None else None)
    return _classify(rel)  # names are hints where the dataflow says nothing


def _block_norm_kind(sch, block, split, rel: str, node) -> str:
    """:func:`_norm_kind` of a norm of the block, corrected by what the block's split shards around it."""
    kind = _norm_kind(node)
    if kind == "norm" and split is not None and rel in split.grad_sum:
        kind = "head_norm"  # applied to a column-parallel output: its gradients are partial sums
    if kind == "head_norm" and split is not None and _undivided(split, f"{rel}.w", sch.world_size, block):
        kind = "norm"  # its attention stays whole: its gradients are whole too
    return kind


def _split_layers(sch, block, block_path: str, split, out: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """``out`` with what the block's split adds: features entries, SSM mixers, shared attention."""
    if split.feature_params:
        out = _feature_layers(block_path, split, out)
    if getattr(split, "mixers", None):  # SSM mixers (slapo_lab/sharding/mixers.py)
        cut = len(block_path) + 1 if block_path else 0
        out = [(p, k) for p, k in out if mixers.reason(split, p[cut:], sch.world_size) is None]
        mine = mixers.layers(split, block_path, sch.world_size)
        out = [x for x in out if x[0] not in {p for p, _ in mine}] + mine
    if split.shared:
        out = _shared_attention(block, block_path, split, out)
    return out


def _feature_layers(block_path: str, split, layers: list) -> list:
    """``layers`` without the ``"features"`` modules (:attr:`~slapo_lab.sharding.infer.BlockSplit.feature_params`)
    whose linears are not all split here (an attention whose heads do not divide stays whole: so do its norms)."""
    pre = f"{block_path}." if block_path else ""
    split_kinds = {p[len(pre) :] for p, k in layers if k in ("column", "column_shard", "row")}
    return [
        (p, k)
        for p, k in layers
        if k != "features" or split.feature_params.get(p[len(pre) :], {None}) <= split_kinds
    ]


def _shared_attention(block, block_path: str, split, layers: list) -> list:
    """An attention module with a projection whose features reach every head (MLA's ``kv_a_proj_with_mqa``: its
    rope part is one key head broadcast to all; DeepSeek-V2/V3): the gradient reaching that whole projection
    is a partial sum on each rank, and so is what its column-parallel partners pass back, so Megatron's *f*
    moves to the attention module's input (``bwd_post all_reduce`` there, kind ``"attention_f"``), its
    column-parallel layers shard without their own (``"column_shard"``), and every replicated parameter inside
    it (the low-rank "a" projections and their norms) sums its gradients over the ranks (``"grad_sum"``)."""
    pre = f"{block_path}." if block_path else ""
    attns = {a for a in split.attention if any(s.startswith(a + ".") or not a for s in split.shared)}
    out = []
    inside = lambda rel, a: not a or rel.startswith(a + ".")
    for path, kind in layers:
        rel = path[len(pre) :]
        a = next((a for a in attns if inside(rel, a)), None)
        if a is not None and kind == "column":
            kind = "column_shard"
        if a is not None and kind in ("norm", "head_norm"):
            continue  # summed below with the other replicated parameters
        out.append((path, kind))
    roles = set(split.roles)
    for a in sorted(attns):
        for rel, node in block[a].named_schedules() if a else block.named_schedules():
            full = f"{a}.{rel}" if a and rel else (a or rel)
            per_head = {hp.name for hp in split.head_params if hp.module == full}
            if full in roles or not any(
                p is not None and p.requires_grad and n not in per_head
                for n, p in node.mod._parameters.items()
            ):
                continue  # (a per-head parameter, such as attention sinks, is split with the heads: not summed)
            if not rel and not a:
                continue
            out.append((f"{pre}{full}", "grad_sum"))
        out.append((f"{pre}{a}" if a else block_path, "attention_f"))
    return out


def _undivided(split, rel: str, ws: int, block=None) -> str | None:
    """Why the attention around ``rel`` (a projection of the block's split) cannot split its heads over ``ws``
    ranks (its heads, or its key/value heads, neither divisible by nor dividing ``ws``), or None."""
    attn = max((a for a in split.attention if not a or rel.startswith(a + ".")), key=len, default=None)
    if attn is None or ws <= 1:
        return None
    n, kv = split.attention[attn]
    if n % ws:
        return f"its {n} attention heads do not divide by the world size {ws}"
    if kv % ws and ws % kv:
        return f"its {kv} key/value heads neither divide by nor divide the world size {ws}"
    if (
        block is not None
    ):  # a class that keeps its head count where no rank can hold its own (Funnel's config)
        mod = block[attn].mod if attn else block.mod
        return None if recorded_heads(mod) is not None else plan_local_heads(mod, n, kv, ws)[1]
    return None


def _role_kind(role: str | None) -> str | None:
    """``"column"`` for a projection into heads (any of q / k / v / an output gate g, fused or not) or an MLP
    input, ``"row"`` for the attention output or an MLP output, None otherwise."""
    if role in ("o", "mlp_out"):
        return "row"
    if role == "mlp_in" or (role and set(role) <= set("qkvg")):
        return "column"
    return None


def _split_of(sch, block_path: str):
    """The block's split read from its dataflow (:func:`slapo_lab.sharding.infer.block_split`), or None."""
    try:
        return infer.block_split(sch, block_path)
    except Exception:  # noqa: BLE001 - no dataflow: the names are the hints
        return None


def replicated_dense(sch, exclude_noted: bool = False) -> str | None:
    """One sentence naming the dense layers (``nn.Linear`` / HF ``Conv1D``) a tensor-parallel schedule keeps
    whole (replicated on every rank) and why, or None when it shards them all.

    Inside the repeated blocks (:func:`find_blocks`) a layer is named once by its path within a block
    ("in every block self_attention.query_key_value"); the reason there is that its name is not one of the
    recognised projections (:func:`block_layers`), or why its attention cannot be split by heads (Falcon's
    multi-query attention). Outside the blocks it is named by its path (BERT's ``pooler.dense``, a tied
    ``lm_head`` whose vocabulary stayed whole). A layer a preset kept whole because splitting it failed
    (:mod:`slapo_lab.preset_check`) gives that reason; ``exclude_noted`` leaves those out (the preset's own
    notes name them).
    """
    kept = sch.get_top_schedule()._top.extra.get(KEPT_WHOLE_KEY) or {}

    blocks = find_blocks(sch)
    inside: dict[str, str] = {}
    outside: list[str] = []
    splits: dict = {}
    for path, node in sch.named_schedules():
        if not _is_whole_dense(node.mod) or (exclude_noted and path in kept):
            continue
        block = next((b for b in blocks if path.startswith(b + ".")), None)
        if block is None:
            outside.append(path)
        else:
            rel = path[len(block) + 1 :]
            if rel not in inside:
                why = (
                    kept.get(path, "").rstrip(".")
                    or _fused_kind(node)[1]
                    or _dataflow_reason(sch, block, rel, splits)
                    or "not a recognised q/k/v, output or MLP projection"
                )
                inside[rel] = why
    return _kept_whole_sentence(inside, outside) if inside or outside else None


def _is_whole_dense(mod: nn.Module) -> bool:
    """Whether ``mod`` is a dense layer (``nn.Linear`` / HF ``Conv1D`` with a weight) that no call sharded."""
    if not (isinstance(mod, nn.Linear) or is_conv1d(mod)) or getattr(mod, "weight", None) is None:
        return False
    meta = peek_meta(mod)
    return not ((meta and meta.sharded) or getattr(mod.weight, "shard_axis", None) is not None)


def _kept_whole_sentence(inside: dict[str, str], outside: list[str]) -> str:
    """:func:`replicated_dense`'s sentence: the layers within a block grouped by reason, then those outside."""
    parts = []
    by_reason: dict[str, list[str]] = {}
    for rel, why in inside.items():
        by_reason.setdefault(why, []).append(rel)
    for why, rels in by_reason.items():
        names = ", ".join(rels[:4]) + (f" and {len(rels) - 4} more" if len(rels) > 4 else "")
        parts.append(f"in every block {names} ({why})")
    if outside:
        names = ", ".join(outside[:4]) + (f" and {len(outside) - 4} more" if len(outside) > 4 else "")
        parts.append(f"{names} (outside the repeated blocks)")
    return "Kept whole on every rank: " + "; ".join(parts) + "."


def _dataflow_reason(sch, block: str, rel: str, cache: dict) -> str | None:
    """Why the block's dataflow (:func:`slapo_lab.sharding.infer.block_split`) keeps the dense layer ``rel``
    whole, or None when the dataflow was not recorded."""
    if block not in cache:
        cache[block] = _split_of(sch, block)
    split = cache[block]
    if split is None or not (split.roles or split.whole):
        return None
    if rel in split.whole:
        return split.whole[rel]
    if split.roles.get(rel) not in (None, "mlp_in", "mlp_out"):
        why = _undivided(split, rel, sch.world_size, sch[block])
        if why:
            return why
    parent = rel.rpartition(".")[0]
    if split.shared and any(not a or parent == a or parent.startswith(a + ".") for a in split.attention):
        return (
            "a low-rank or shared projection of an attention whose heads are split: it stays whole and its "
            "gradients are summed over the ranks"
        )
    return (
        "its output reaches no attention head and no row-parallel partner through ops that keep features "
        "apart, so no split of it is right"
    )


def _norm_kind(node) -> str:
    """``"norm"`` (a block norm), ``"head_norm"`` (per-head q/k norm of size head_dim) or ``"qk_norm_full"``
    (a q/k norm over all heads' features: OLMo 2 style, which tensor parallelism would change)."""
    if node.name not in HEAD_NORM_NAMES or node.parent is None:
        return "norm"
    w = next(p for p in node.mod._parameters.values() if p is not None)
    hd = head_dim(node.parent.mod)
    return "head_norm" if hd is not None and w.shape[-1] == hd else "qk_norm_full"


def _is_head_table(node) -> bool:

    return is_head_table(ShardSite(node.mod, "weight", node.parent.mod, node.name, node.path), 1)


def _no_pair_reason(sch, block_path: str, layers: list[tuple[str, str]]) -> str:
    """The sentence for a block with no column- and row-parallel pair to split."""
    names = ", ".join(p for p, _ in layers) or "none"
    conv = _convolutions_only(sch)
    if conv:
        return conv
    if _split_of(sch, block_path) is not None:
        dense = [
            p
            for p, n in sch[block_path].named_schedules()
            if isinstance(n.mod, nn.Linear) or is_conv1d(n.mod)
        ]
        return (
            f"{block_path or 'the root module'} has no dense layer its recorded dataflow can split: "
            f"{', '.join(dense[:4]) or 'none'} reach no attention head whose heads divide by the world size and "
            "no row-parallel partner through ops that keep features apart (a norm over the whole width, a "
            "convolution or a recurrent scan lies between them), so it stays whole; shard its layers with "
            "column_parallel() / row_parallel() by hand if you know a right split."
        )
    if not layers:  # no layer got a kind: name the dense layers the block holds, not "none"
        dense = [
            p
            for p, n in sch[block_path].named_schedules()
            if p and (isinstance(n.mod, nn.Linear) or is_conv1d(n.mod))
        ]
        if dense:
            return (
                f"{block_path or 'the root module'} has no recognisable column- and row-parallel projection pair "
                f"(its dense layers {', '.join(dense[:4])}{' ...' if len(dense) > 4 else ''} pair with nothing "
                "the preset knows, and its dataflow could not be recorded); shard its layers with "
                "column_parallel() / row_parallel() instead."
            )
    return (
        f"{block_path or 'the root module'} has no recognisable column- and row-parallel projection pair "
        f"(found: {names}); shard its layers with column_parallel() / row_parallel() instead."
    )


def _convolutions_only(sch) -> str | None:
    """The refusal for a model whose repeated blocks hold no dense projection at all (``nn.Linear`` / HF
    ``Conv1D``) but convolutions (ResNet, RegNet, MobileNet, PP-LCNet, PoolFormer), naming the layers with
    parameters they hold; None when some block holds a dense projection or none holds a convolution."""
    blocks = find_blocks(sch)
    if not blocks:
        return None
    kinds: dict[str, int] = {}
    for b in blocks:
        for _rel, node in sch[b].named_schedules():
            mod = node.mod
            if isinstance(mod, nn.Linear) or is_conv1d(mod):
                return None
            if any(p is not None for p in mod._parameters.values()):
                kinds[type(mod).__name__] = kinds.get(type(mod).__name__, 0) + 1
    if not any(isinstance(n, str) and "Conv" in n for n in kinds):
        return None
    held = ", ".join(f"{n} x{c}" for n, c in sorted(kinds.items(), key=lambda kv: -kv[1]))
    return (
        f"{type(sch.mod).__name__} has no dense projection (nn.Linear or HF Conv1D) in its "
        f"{len(blocks)} repeated blocks for the Megatron preset to split (they hold {held}), so nothing is "
        "split."
    )


@_all_or_nothing
def tp_block(sch, block_path: str, sequence_parallel: bool = False) -> list[Call]:
    """Megatron tensor parallelism for one transformer block at ``block_path`` (any family).

    Finds its q/k/v/out and up/down projections (:func:`block_layers`) and makes them column / row
    parallel; with ``sequence_parallel`` the block's norms get ``bwd_post all_reduce(param_grads=True)``.

    Raises:
        ScheduleError: when the block has no column- or no row-parallel projection, or a primitive fails.
    """
    layers = block_layers(sch, block_path)
    kinds = {k for _, k in layers}
    if "column_shard" in kinds:
        kinds.add("column")
    if "experts" in kinds:
        kinds |= {"column", "row"}
    full = next((p for p, k in layers if k == "qk_norm_full"), None)
    if full is not None:
        raise ScheduleError(
            f"{full} normalises q or k over all attention heads' features, so splitting the heads across "
            "ranks would change its result; this model's attention cannot be tensor parallel by heads."
        )
    if "column" not in kinds or "row" not in kinds:
        raise ScheduleError(_no_pair_reason(sch, block_path, layers))
    n = len(sch.record)
    for path, kind in layers:
        apply_layer(sch, path, kind, sequence_parallel)
    return _since(sch, n)
