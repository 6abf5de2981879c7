"""Canonical schedules, applied through ordinary primitive calls (so they are recorded and exportable).

Every preset calls ``sch[path].shard(...)`` / ``.sync(...)`` / ``.checkpoint()`` like a user would and
returns the :class:`~slapo_lab.record.Call` objects it appended to ``sch.record``. Presets are all or
nothing (:func:`atomic`): when a call fails midway (block 2 of 24 ...), its
:class:`~slapo_lab.errors.ScheduleError` propagates and the schedule, the model and the record are exactly
as before the preset.

Megatron-LM tensor parallelism per transformer block (Slapo's canonical schedules, reference.md):

* column parallel (q, k, v, fused ``c_attn``, MLP up / gate / ``c_fc`` / ``intermediate.dense``): shard the
  weight on its output features (``nn.Linear`` axis 0, HF ``Conv1D`` axis 1) and the bias on axis 0, then
  ``sync(mode="bwd_post", sync_op_or_fn="all_reduce")`` (Megatron's *f*: all-reduce the input gradient);
* row parallel (attention output / ``o_proj`` / ``c_proj`` / ``output.dense``, MLP down): shard the weight on
  its input features (``nn.Linear`` axis 1, ``Conv1D`` axis 0), ``sync(mode="fwd_post", sync_op_or_fn=
  "all_reduce")`` (Megatron's *g*; the bias is added once, after the reduce);
* vocab parallel (``vocab_parallel=True``): the input embedding's weight on axis 0 + ``fwd_post all_reduce``;
  the output embedding (``lm_head``, BERT's MLM decoder) -- tied, so already sharded by the embedding, or
  sharded on axis 0 here -- becomes column parallel with a vocabulary-partitioned output, so it gets
  ``bwd_post all_reduce`` plus ``fwd_post all_gather(axis=-1, tensor_parallel_output_grad=False)`` and the
  loss sees full logits. (With the replicated loss every rank computes, the gradient of the gathered
  logits is already complete on each rank: backward just keeps this rank's slice, a reduce-scatter would
  multiply it by the world size.)

Sequence parallelism (``sequence_parallel=True``, GPT-2): between the tensor-parallel regions each rank holds
a slice of the sequence (axis 1 of ``(batch, seq, hidden)``): ``scatter(axis=1)`` after the embeddings
(``fwd_post`` on ``transformer.drop``), ``fwd_pre all_gather(axis=1)`` before each column-parallel layer (its
backward reduce-scatter replaces *f*), ``fwd_post reduce_scatter(axis=1)`` after each row-parallel layer (replacing
*g*), and ``fwd_pre all_gather(axis=1, tensor_parallel_output_grad=False)`` on ``transformer.ln_f`` to return to
the full sequence. The LayerNorms inside the blocks and the row-parallel biases stay replicated but see only
this rank's tokens, so their gradients are partial sums: ``sync(mode="bwd_post", sync_op_or_fn="all_reduce",
param_grads=True)`` all-reduces them in backward (what Megatron does for its ``sequence_parallel`` parameters).
The sequence length must divide by the world size.
"""

from __future__ import annotations

import functools
import re

from torch import nn

from .atomic import atomic
from .blocks import _BLOCK_CLASSES, FAMILIES, detect_family, find_blocks, is_conv1d
from .errors import ScheduleError
from .record import Call
from .sharding.lone_linears import lone_linear_kind
from .sharding.rules import head_dim, is_norm

# Projections by their attribute name (last path component) or path suffix inside a block.
COLUMN_NAMES = frozenset(
    {
        "q_proj",
        "k_proj",
        "v_proj",
        "query",
        "key",
        "value",
        "q",
        "k",
        "v",
        "wq",
        "wk",
        "wv",
        "q_lin",
        "k_lin",
        "v_lin",
        "q_attn",
        "c_attn",
        "c_fc",
        "gate_proj",
        "up_proj",
        "fc1",
        "w1",
        "w3",
        "fc_in",
        "dense_h_to_4h",
        "lin1",
        "intermediate.dense",
    }
)
ROW_NAMES = frozenset(
    {
        "o_proj",
        "out_proj",
        "o",
        "wo",
        "out_lin",
        "c_proj",
        "down_proj",
        "fc2",
        "w2",
        "fc_out",
        "dense_4h_to_h",
        "lin2",
        "output.dense",
    }
)


COLUMN_NAMES = COLUMN_NAMES | {"wi", "wi_0", "wi_1"}  # T5's (gated) feed-forward input projections
# ALBERT: AlbertAttention.dense is its output projection, AlbertLayer.ffn / ffn_output its MLP
COLUMN_NAMES = COLUMN_NAMES | {"ffn"}
ROW_NAMES = ROW_NAMES | {"attention.dense", "ffn_output"}
# DeBERTa-v2/v3: q/k/v and the relative-position projections (applied to the replicated relative embeddings,
# then split by heads like k and q)
COLUMN_NAMES = COLUMN_NAMES | {"query_proj", "key_proj", "value_proj", "pos_key_proj", "pos_query_proj"}
# Per-head norms applied to q / k after the head split (Qwen3, Gemma 3 ...): replicated weights of size head_dim
# that see only this rank's heads, so their gradients are partial sums (HF style "replicated_with_grad_allreduce").
HEAD_NORM_NAMES = frozenset(
    {"q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_layernorm", "key_layernorm"}
)


def _since(sch, n: int) -> list[Call]:
    return list(sch.record.calls[n:])


class PresetCalls(list):
    """The calls a preset recorded (a list of :class:`~slapo_lab.record.Call`), plus ``notes``: one
    sentence for each part the preset left as it was and why (e.g. a vocabulary that does not divide)."""

    def __init__(self, calls, notes=()) -> None:
        super().__init__(calls)
        self.notes = list(notes)


def _all_or_nothing(fn):
    """Run the preset ``fn(sch, ...)`` inside :func:`atomic` (a failing preset leaves nothing applied) and as one
    recorded action (one undo removes it, typed in a cell or clicked)."""

    @functools.wraps(fn)
    def wrapper(sch, *args, **kwargs):
        with atomic(sch), sch.record.action(f"preset {fn.__name__}"):
            return fn(sch, *args, **kwargs)

    return wrapper


def _dense(sch, path: str, what: str):
    """The node at ``path`` and its dense-layer shard rule (which weight axis is out / in)."""
    from .sharding.rules import DenseRule, get_shard_rule

    node = sch[path]
    rule = get_shard_rule(node.mod)
    if not isinstance(rule, DenseRule):
        raise ScheduleError(
            f"{what} needs an nn.Linear or HF Conv1D at {path}, not a {type(node.mod).__name__}."
        )
    return node, rule


class EarlierCallConflict(ScheduleError):
    """A call made before the preset is in its way (a tensor sharded on another axis): the preset is
    refused as a whole, never kept whole around it, since the user's own call is what must change."""


def _ensure_shard(node, name: str, axis: int) -> None:
    """``node.shard(name, axis=axis)``, unless the tensor is already sharded on that axis (typed earlier, or
    tied to a sharded tensor): presets compose with what is there.

    Raises:
        ScheduleError: the tensor is sharded on another axis (one sentence saying which call to undo).
    """
    from .module_state import peek_meta

    t = getattr(node.mod, name)
    axis %= max(t.dim(), 1)
    meta = peek_meta(node.mod)
    have = meta["sharded"].get(name) if meta else None
    if have is None:
        have = getattr(t, "shard_axis", None)
    if have is None:
        node.shard(name, axis=axis)
    elif have != axis:
        full = f"{node.path}.{name}" if node.path else name
        raise EarlierCallConflict(
            f"{full} is already sharded on axis {have}, but this preset shards it on axis {axis}; undo "
            f"that shard (or shard it on axis {axis}) and apply the preset again."
        )


def _ensure_sync(node, mode: str, op: str, **kwargs) -> None:
    """``node.sync(mode=mode, sync_op_or_fn=op, **kwargs)``, unless the module already has that sync."""
    from .module_state import peek_meta
    from .primitives.tensor_parallel import PARAM_GRADS_OP

    meta = peek_meta(node.mod)
    key = (mode, PARAM_GRADS_OP if kwargs.get("param_grads") else op)
    if not (meta and key in meta["syncs"]):
        node.sync(mode=mode, sync_op_or_fn=op, **kwargs)


@_all_or_nothing
def column_parallel(sch, path: str, sequence_parallel: bool = False) -> list[Call]:
    """Make the ``nn.Linear`` / HF ``Conv1D`` at ``path`` column parallel (Megatron ``ColumnParallelLinear``).

    Weight on its output features, bias on axis 0, then ``bwd_post all_reduce`` -- or, with
    ``sequence_parallel``, ``fwd_pre all_gather(axis=1)`` (whose backward reduce-scatter also sums the input
    gradient).
    """
    n = len(sch.record)
    node, rule = _dense(sch, path, "column_parallel")
    mod = node.mod
    _ensure_shard(node, "weight", rule.out_axis)
    if getattr(mod, "bias", None) is not None:
        _ensure_shard(node, "bias", 0)
    if sequence_parallel:
        _ensure_sync(node, "fwd_pre", "all_gather", axis=1)
    else:
        _ensure_sync(node, "bwd_post", "all_reduce")
    return _since(sch, n)


@_all_or_nothing
def row_parallel(sch, path: str, sequence_parallel: bool = False) -> list[Call]:
    """Make the ``nn.Linear`` / HF ``Conv1D`` at ``path`` row parallel (Megatron ``RowParallelLinear``).

    Weight on its input features, then ``fwd_post all_reduce`` -- or, with ``sequence_parallel``,
    ``fwd_post reduce_scatter(axis=1)`` plus ``bwd_post all_reduce(param_grads=True)`` for the replicated bias
    (added after the reduce-scatter, so it sees only this rank's tokens).
    """
    n = len(sch.record)
    node, rule = _dense(sch, path, "row_parallel")
    mod = node.mod
    _ensure_shard(node, "weight", rule.in_axis)
    if sequence_parallel:
        _ensure_sync(node, "fwd_post", "reduce_scatter", axis=1)
        if getattr(mod, "bias", None) is not None:
            _ensure_sync(node, "bwd_post", "all_reduce", param_grads=True)
    else:
        _ensure_sync(node, "fwd_post", "all_reduce")
    return _since(sch, n)


def _fused_kind(node) -> tuple[str | None, str | None]:
    """``(kind, refusal)`` of a dense layer from its attention module's attributes rather than its name: a
    fused projection (:func:`slapo_lab.sharding.rules.fused_layout`: Falcon's / BLOOM's ``query_key_value``,
    Phi-3's ``qkv_proj`` / ``gate_up_proj``, GPT-2's ``c_attn``) is ``"column"``, the output projection beside
    a fused q/k/v (Falcon's / BLOOM's ``self_attention.dense``) ``"row"``; an attention whose heads cannot be
    split (Falcon's multi-query attention) gives ``(None, reason)``; ``(None, None)`` for anything else."""
    from .sharding.rules import ShardSite, attention_refusal, attention_role, fused_layout

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
        path = f"{block_path}.{rel}" if block_path else rel
        mod = node.mod
        if isinstance(mod, nn.Linear) or is_conv1d(mod):
            fused, refusal = _fused_kind(node)
            role = split.roles.get(rel) if split is not None else None
            if refusal:
                kind = None
            elif role is not None:  # read from the block's dataflow (slapo_lab/sharding/infer.py)
                kind = _role_kind(role)
                if (
                    kind
                    and role not in ("mlp_in", "mlp_out")
                    and _undivided(split, rel, sch.world_size, block)
                ):
                    kind = (
                        None  # an attention whose heads do not divide stays whole (replicated_dense says why)
                    )
            elif fused and (split is None or not split.attention):
                kind = fused  # a layout read from the attention module's attributes (Falcon, BLOOM, Phi-3)
            elif (
                split is not None
                and (split.roles or split.whole)
                and (rel in split.whole or rel in split.ran)
                and (split.attention or rel in split.whole or _classify(rel) is None)
            ):
                # the dataflow ran it and paired it with nothing: it stays whole -- unless the dataflow saw no
                # attention at all in the block (MRA's custom sparse attention kernels): names are the hints there
                # -- or, where nothing keeps it whole, column parallel with its output gathered (lone_linears.py)
                kind = lone_linear_kind(split, rel, mod, node.parent.mod if node.parent is not None else None)
            else:
                kind = _classify(rel)  # names are hints where the dataflow says nothing
            if kind:
                out.append((path, kind))
        elif split is not None and rel in split.feature_params:
            out.append((path, "features"))  # a norm over a split projection's features: sharded with them
        elif rel in heads:
            kept = [
                hp for hp in heads[rel] if not _undivided(split, f"{rel}.{hp.name}", sch.world_size, block)
            ]
            if kept:  # one kind per module: "head_param:q_bias:0;v_bias:0"
                out.append((path, "head_param:" + ";".join(f"{hp.name}:{hp.axis}" for hp in kept)))
        elif is_norm(mod) and any(p is not None for p in mod._parameters.values()):
            kind = _norm_kind(node)
            if kind == "norm" and split is not None and rel in split.grad_sum:
                kind = "head_norm"  # applied to a column-parallel output: its gradients are partial sums
            if (
                kind == "head_norm"
                and split is not None
                and _undivided(split, f"{rel}.w", sch.world_size, block)
            ):
                kind = "norm"  # its attention stays whole: its gradients are whole too
            out.append((path, kind))
        elif (
            split is not None
            and rel in split.grad_sum
            and not _is_experts(mod)
            and not _undivided(split, f"{rel}.w", sch.world_size, block)
        ):
            out.append((path, "grad_sum"))
        elif _is_experts(mod):
            out.append((path, "experts"))
        elif isinstance(mod, nn.Embedding) and node.parent is not None and _is_head_table(node):
            out.append((path, "heads"))
    if split is not None and split.feature_params:
        out = _feature_layers(block_path, split, out)
    if split is not None and getattr(split, "mixers", None):  # SSM mixers (slapo_lab/sharding/mixers.py)
        from .sharding import mixers

        cut = len(block_path) + 1 if block_path else 0
        out = [(p, k) for p, k in out if mixers.reason(split, p[cut:], sch.world_size) is None]
        mine = mixers.layers(split, block_path, sch.world_size)
        out = [x for x in out if x[0] not in {p for p, _ in mine}] + mine
    if split is not None and split.shared:
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
        from .sharding.heads import plan_local_heads, recorded_heads

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
    from .sharding import infer

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
    from .module_state import peek_meta
    from .preset_check import KEPT_WHOLE_KEY

    kept = sch.get_top_schedule()._top.extra.get(KEPT_WHOLE_KEY) or {}

    blocks = find_blocks(sch)
    inside: dict[str, str] = {}
    outside: list[str] = []
    splits: dict = {}
    for path, node in sch.named_schedules():
        mod = node.mod
        if not (isinstance(mod, nn.Linear) or is_conv1d(mod)) or getattr(mod, "weight", None) is None:
            continue
        meta = peek_meta(mod)
        if (meta and meta["sharded"]) or getattr(mod.weight, "shard_axis", None) is not None:
            continue
        if exclude_noted and path in kept:
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
    if not inside and not outside:
        return None
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


def _is_experts(mod: nn.Module) -> bool:
    from .sharding.experts import is_experts_module

    return is_experts_module(mod)


def _norm_kind(node) -> str:
    """``"norm"`` (a block norm), ``"head_norm"`` (per-head q/k norm of size head_dim) or ``"qk_norm_full"``
    (a q/k norm over all heads' features: OLMo 2 style, which tensor parallelism would change)."""
    if node.name not in HEAD_NORM_NAMES or node.parent is None:
        return "norm"
    w = next(p for p in node.mod._parameters.values() if p is not None)
    hd = head_dim(node.parent.mod)
    return "head_norm" if hd is not None and w.shape[-1] == hd else "qk_norm_full"


@_all_or_nothing
def experts_parallel(sch, path: str) -> list[Call]:
    """Tensor-parallel experts at ``path`` (an HF experts module with 3-D ``gate_up_proj`` / ``down_proj``).

    ``gate_up_proj`` (or ``up_proj``) and its bias on the intermediate axis, ``bwd_post all_reduce`` (the
    input and routing-weight gradients are partial), ``down_proj`` on the intermediate axis, ``fwd_post
    all_reduce`` (the experts' outputs are partial sums); see :mod:`slapo_lab.sharding.experts`.

    Raises:
        ScheduleError: when ``path`` is no such module, or a primitive refuses (sizes not divisible ...).
    """
    from .sharding.experts import UP_NAMES, intermediate_axis

    node = sch[path]
    mod = node.mod
    if not _is_experts(mod):
        raise ScheduleError(
            f"experts_parallel needs an experts module with 3-D expert weights at {path}, "
            f"not a {type(mod).__name__}."
        )
    n = len(sch.record)
    for name in (*UP_NAMES, "gate_up_proj_bias", "up_proj_bias"):
        if mod._parameters.get(name) is not None:
            _ensure_shard(node, name, intermediate_axis(mod, name))
    _ensure_sync(node, "bwd_post", "all_reduce")
    _ensure_shard(node, "down_proj", intermediate_axis(mod, "down_proj"))
    _ensure_sync(node, "fwd_post", "all_reduce")
    if mod._parameters.get("down_proj_bias") is not None and sch.world_size > 1:
        # added on one rank only (see slapo_lab/sharding/experts.py): its gradient is summed over the ranks
        _ensure_sync(node, "bwd_post", "all_reduce", param_grads=True)
    return _since(sch, n)


def _is_head_table(node) -> bool:
    from .sharding.rules import ShardSite, is_head_table

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


def apply_layer(sch, path: str, kind: str, sequence_parallel: bool = False) -> None:
    """Make one layer of a block tensor parallel by its :func:`block_layers` kind (the calls are recorded).

    Raises:
        ScheduleError: the first primitive call that refuses.
    """
    if kind == "column":
        column_parallel(sch, path, sequence_parallel)
    elif kind == "column_shard":  # column parallel whose input gradient the attention module's f sums
        node, rule = _dense(sch, path, "column_parallel")
        _ensure_shard(node, "weight", rule.out_axis)
        if getattr(node.mod, "bias", None) is not None:
            _ensure_shard(node, "bias", 0)
    elif kind == "attention_f":
        _ensure_sync(sch[path], "bwd_post", "all_reduce")
    elif kind == "grad_sum":
        _ensure_sync(sch[path], "bwd_post", "all_reduce", param_grads=True)
    elif kind == "features":
        # a norm over a split layer's features: its parameters are sharded like them, and its statistics are
        # summed over the ranks (slapo_lab/sharding/feature_stats.py)
        node = sch[path]
        conv = isinstance(
            node.mod, nn.modules.conv._ConvNd
        )  # a depthwise convolution: one filter per channel
        for name, prm in list(node.mod._parameters.items()):
            if prm is not None:
                _ensure_shard(node, name, 0 if conv else prm.dim() - 1)
        _shard_running_stats(node)
    elif kind == "row":
        row_parallel(sch, path, sequence_parallel)
    elif kind == "heads":  # a per-head table (T5's relative_attention_bias): this rank's heads' columns
        _ensure_shard(sch[path], "weight", 1)
    elif kind.startswith("head_param:"):  # a parameter with one entry per head on an axis (Swin's relative
        # position table, GPT-OSS's sinks, Cohere's q/k norm weights), read from the dataflow: this rank's heads
        for one in kind[len("head_param:") :].split(";"):  # several on one module (DeBERTa's q_bias, v_bias)
            name, axis = one.split(":")
            _ensure_shard(sch[path], name, int(axis))
        _shard_running_stats(sch[path])
    elif kind == "column_gather":
        # a linear whose features reach no head and no row-parallel partner (Swin's patch-merging
        # downsample.reduction): column parallel, its output gathered; see slapo_lab/sharding/lone_linears.py
        column_parallel(sch, path)
        _ensure_sync(sch[path], "fwd_post", "all_gather", axis=-1, tensor_parallel_output_grad=False)
    elif kind == "gather_linear":
        # a mixer's linear whose whole output every rank needs (Mamba's x_proj: dt, B, C from all channels): its
        # input channels gathered, its output features split, its output gathered (the gathers' backward
        # reduce-scatters sum the ranks' partial gradients); see slapo_lab/sharding/mixers.py
        node, rule = _dense(sch, path, "column_parallel")
        _ensure_shard(node, "weight", rule.out_axis)
        if getattr(node.mod, "bias", None) is not None:
            _ensure_shard(node, "bias", 0)
        _ensure_sync(node, "fwd_pre", "all_gather", axis=-1)
        _ensure_sync(node, "fwd_post", "all_gather", axis=-1)
    elif kind.startswith("channel_params:"):
        # a mixer's per-channel / per-head parameters (A_log, D, dt_bias, a depthwise conv1d, a grouped norm:
        # slapo_lab/sharding/mixers.py), each on its axis; then, with ";grad_sum", its replicated ones sum gradients
        spec, _, extra = kind.split(":", 1)[1].partition(";")
        for item in spec.split(","):
            name, axis = item.split("=")
            _ensure_shard(sch[path], name, int(axis))
        if extra == "grad_sum":
            _ensure_sync(sch[path], "bwd_post", "all_reduce", param_grads=True)
    elif kind == "experts":
        experts_parallel(sch, path)
    elif kind == "head_norm" or sequence_parallel:  # a head norm sees this rank's heads only; under
        # sequence parallelism a norm sees this rank's tokens only: either way, sum its gradients over the ranks
        _ensure_sync(sch[path], "bwd_post", "all_reduce", param_grads=True)


def _shard_running_stats(node) -> None:
    """Shard a batch norm's running statistics like its sharded per-feature parameters: LeViT's
    ``Linear -> BatchNorm1d`` and any norm that keeps one running mean / variance per feature. Each buffer of
    the parameters' shape follows the first of them that is sharded (same axis, hence the same index map), so
    the module's eval-mode forward sees this rank's features' statistics (``running_mean should contain 128
    elements not 256`` otherwise)."""
    if not isinstance(node.mod, nn.modules.batchnorm._BatchNorm):
        return
    axes = {
        tuple(getattr(p, "orig_shape", p.shape)): p.shard_axis
        for p in node.mod._parameters.values()
        if p is not None and getattr(p, "shard_axis", None) is not None
    }
    for name, buf in list(node.mod._buffers.items()):
        axis = axes.get(tuple(buf.shape)) if buf is not None else None
        if axis is not None:
            _ensure_shard(node, name, axis)


def _path_of(sch, mod: nn.Module) -> str | None:
    for p, node in sch.named_schedules():
        if node.mod is mod:
            return p
    return None


def _input_embedding(sch) -> nn.Embedding | None:
    """The model's ``get_input_embeddings()`` when it is an ``nn.Embedding``, else None (no such method, a
    patch ``Conv2d``, or transformers' ``NotImplementedError`` for a model with several towers: CLIP)."""
    get_in = getattr(sch.mod, "get_input_embeddings", None)
    try:
        emb = get_in() if callable(get_in) else None
    except NotImplementedError:
        emb = None
    return emb if isinstance(emb, nn.Embedding) else None


def vocab_size(sch) -> int | None:
    """Rows of the model's input ``nn.Embedding`` (``get_input_embeddings()``), or None without one."""
    emb = _input_embedding(sch)
    return None if emb is None else emb.num_embeddings


def has_vocab_embedding(sch) -> bool:
    """Whether the model's ``get_input_embeddings()`` is an ``nn.Embedding`` (a vocabulary to shard).

    False for vision models (ViT's input embedding is a patch ``Conv2d``) and models without the HF method;
    the editor's Megatron button passes this as ``megatron_tp(vocab_parallel=...)``.
    """
    return vocab_size(sch) is not None


@_all_or_nothing
def vocab_parallel_embeddings(sch) -> list[Call]:
    """Vocab-parallel input embedding and, if the model has one, a vocab-parallel output embedding.

    Uses HF's ``get_input_embeddings()`` / ``get_output_embeddings()``. The output layer (``lm_head``) is
    tied to the embedding in GPT-2 and BERT-MLM, so sharding the embedding already shards it (the
    tensor stays one object); an untied one (Llama) is sharded on axis 0 here.

    Raises:
        ScheduleError: when the model has no ``nn.Embedding`` input embedding.
    """
    top = sch.mod
    emb = _input_embedding(sch)
    if emb is None:
        raise ScheduleError("vocab_parallel needs a model whose get_input_embeddings() is an nn.Embedding.")
    emb_path = _path_of(sch, emb)
    n = len(sch.record)
    _ensure_shard(sch[emb_path], "weight", 0)
    _ensure_sync(sch[emb_path], "fwd_post", "all_reduce")
    # a module inside the embedding's own forward (Inkling's embed_norm after the lookup) runs on this rank's
    # rows only, before the reduce: its replicated parameters' gradients are partial sums over the ranks
    for rel, node in sch[emb_path].named_schedules():
        if rel and any(p is not None and p.requires_grad for p in node.mod._parameters.values()):
            _ensure_sync(node, "bwd_post", "all_reduce", param_grads=True)
    # every other embedding tied to it (T5: encoder.embed_tokens, decoder.embed_tokens share ``shared.weight``)
    # looks up through the same masked vocab-parallel forward, so its partial output needs the same all_reduce
    for owner, _name in sch.owners_of(sch[emb_path].mod.weight):
        if owner is not emb and isinstance(owner, nn.Embedding):
            _ensure_sync(sch[_path_of(sch, owner)], "fwd_post", "all_reduce")
    get_out = getattr(top, "get_output_embeddings", None)
    try:
        head = get_out() if callable(get_out) else None
    except NotImplementedError:  # pragma: no cover - some HF models
        head = None
    if isinstance(head, nn.Linear):
        hp = _path_of(sch, head)
        node = sch[hp]
        if getattr(head.weight, "shard_axis", None) is None:  # untied
            _ensure_shard(node, "weight", 0)
        if head.bias is not None and getattr(head.bias, "shard_axis", None) is None:
            _ensure_shard(node, "bias", 0)
        _ensure_sync(node, "bwd_post", "all_reduce")
        _ensure_sync(node, "fwd_post", "all_gather", axis=-1, tensor_parallel_output_grad=False)
    return _since(sch, n)


def _gpt2_base(sch) -> str:
    for p, node in sch.named_schedules():
        if type(node.mod).__name__ == "GPT2Model":
            return p
    raise ScheduleError(
        "sequence parallelism presets need a GPT2Model (transformer.drop / transformer.ln_f)."
    )


def hf_tp_plan(sch) -> dict[str, str]:
    """HF's tensor-parallel plan for the model's blocks, with paths relative to ``sch``.

    ``config.base_model_tp_plan`` (e.g. Llama: ``{"layers.*.self_attn.q_proj": "colwise", ...}``) is keyed
    relative to the base model (``model.base_model_prefix``, e.g. ``model``); ``*`` matches one path
    component. Empty when the config has no plan.
    """
    cfg = getattr(sch.mod, "config", None)
    plan = getattr(cfg, "base_model_tp_plan", None) or {}
    prefix = getattr(sch.mod, "base_model_prefix", "") or ""
    if prefix and prefix not in sch.child:
        prefix = ""
    return {(f"{prefix}.{k}" if prefix else k): v for k, v in plan.items()}


_HF_STYLES = {
    "colwise": "column",
    "rowwise": "row",
    "colwise_gather_output": "column_gather",
    "replicated_with_grad_allreduce": "grad_allreduce",
    "moe_tp_experts": "experts",
    "packed_colwise": "packed_column",
}
# styles HF also uses for single parameters of an experts module (covered by that module's "moe_tp_experts")
_HF_PARAM_STYLES = ("packed_colwise", "colwise", "rowwise")


@_all_or_nothing
def apply_hf_tp_plan(sch, plan: dict[str, str] | None = None) -> list[Call]:
    """Apply an HF tensor-parallel plan (default :func:`hf_tp_plan`) with our primitives.

    ``"colwise"`` -> :func:`column_parallel`, ``"rowwise"`` -> :func:`row_parallel`,
    ``"colwise_gather_output"`` -> column parallel plus ``fwd_post all_gather(axis=-1,
    tensor_parallel_output_grad=False)``, ``"replicated_with_grad_allreduce"`` (Qwen3's per-head ``q_norm`` /
    ``k_norm``) -> ``sync(mode="bwd_post", sync_op_or_fn="all_reduce", param_grads=True)``,
    ``"moe_tp_experts"`` (Mixtral's ``mlp.experts``) -> :func:`experts_parallel`; the plan's entries for
    that module's parameters (``experts.gate_up_proj: packed_colwise``, ``experts.down_proj: rowwise``) are
    what :func:`experts_parallel` does, so they are covered by it. Modules are visited in tree order.
    Entries of the config's own plan that match no module of this model (layer kinds the family has but this
    config does not build) are skipped, as HF does; an explicit ``plan`` must match everywhere.

    Raises:
        ScheduleError: for an empty plan, a style with no mapping, or an explicit plan's pattern that matches
            nothing (all checked before anything changes).
    """
    from_config = plan is None
    plan = hf_tp_plan(sch) if plan is None else plan
    if not plan:
        raise ScheduleError(
            "The model's config has no base_model_tp_plan; use megatron_tp(sch, family=...) instead."
        )
    compiled = []
    for pat, style in plan.items():
        if style not in _HF_STYLES:
            raise ScheduleError(
                f"HF tensor-parallel style {style!r} (for {pat}) has no preset mapping; supported: "
                f"{', '.join(_HF_STYLES)}."
            )
        rx = re.compile("^" + r"\.".join("[^.]+" if c == "*" else re.escape(c) for c in pat.split(".")) + "$")
        compiled.append((pat, rx, _HF_STYLES[style]))
    targets = []
    hit = set()
    for p, _node in sch.named_schedules():
        for pat, rx, kind in compiled:
            if rx.match(p):
                targets.append((p, kind))
                hit.add(pat)
                break
    experts = {p for p, kind in targets if kind == "experts"}
    for pat, rx, _kind in compiled:
        if pat in hit or plan[pat] not in _HF_PARAM_STYLES:
            continue
        owners = {
            p
            for p, node in sch.named_schedules()
            for name in node.mod._parameters
            if rx.match(f"{p}.{name}" if p else name)
        }
        if owners and owners <= experts:
            hit.add(pat)  # a parameter of an experts module that experts_parallel shards
    packed = next((p for p, kind in targets if kind == "packed_column"), None)
    if packed is not None:
        raise ScheduleError(
            f"HF tensor-parallel style 'packed_colwise' on the module {packed} (a fused projection) "
            "has no preset mapping; it is supported for the weights of an experts module only."
        )
    missing = [pat for pat, _, _ in compiled if pat not in hit]
    if missing and from_config and hit:
        # a config's plan covers every layer kind of the family (Qwen3-MoE's dense mlp.gate_proj exists only
        # with mlp_only_layers): entries for kinds this model does not build are skipped, as HF does
        missing = []
    if missing:
        raise ScheduleError(f"The tensor-parallel plan entry {missing[0]!r} matches no module.")
    n = len(sch.record)
    for p, kind in targets:
        if kind == "row":
            row_parallel(sch, p)
        elif kind == "grad_allreduce":
            _ensure_sync(sch[p], "bwd_post", "all_reduce", param_grads=True)
        elif kind == "experts":
            experts_parallel(sch, p)
        else:
            column_parallel(sch, p)
            if kind == "column_gather":
                _ensure_sync(sch[p], "fwd_post", "all_gather", axis=-1, tensor_parallel_output_grad=False)
    return _since(sch, n)


@_all_or_nothing
def megatron_tp(
    sch,
    family: str | None = None,
    *,
    vocab_parallel: bool = True,
    sequence_parallel: bool = False,
    use_hf_plan: bool = False,
    check: bool = True,
) -> list[Call]:
    """Slapo's canonical Megatron tensor-parallel schedule for BERT, GPT-2, Llama (or any block stack).

    Args:
        sch: the root schedule (its ``world_size`` is the TP width).
        family: ``"bert"``, ``"gpt2"``, ``"llama"``, ``"roberta"``, ``"opt"``, ``"gpt_neo"``, ``"t5"`` (encoder and
            decoder blocks, cross attention, the per-head ``relative_attention_bias``; see ``FAMILIES``) or
            ``"generic"``; None detects it from the block classes (``"generic"`` = :func:`find_blocks` +
            :func:`tp_block` by projection names). A named family must match the model's blocks.
        vocab_parallel: also shard the word embedding (and the output embedding) by vocabulary
            (:func:`vocab_parallel_embeddings`); a vocabulary that does not divide by the world size
            (GPT-2's 50257 on 4 ranks), or a model without an ``nn.Embedding`` from
            ``get_input_embeddings()`` (CLIP, a hand-written GPT), stays replicated, with a sentence in
            the result's ``notes``.
        sequence_parallel: Megatron sequence parallelism between the TP regions (GPT-2 only; see the
            module docstring).
        use_hf_plan: shard the blocks by the config's ``base_model_tp_plan`` (:func:`apply_hf_tp_plan`)
            instead of by names.
        check: check the calls numerically before they are committed (:func:`slapo_lab.preset_check.gate`):
            a region (an attention's q/k/v...o, an MLP's up...down, an expert bank, the embeddings) that a
            primitive refuses or that makes the check fail is kept whole in every block of its class, with
            one sentence in ``notes``. Inside a real process group nothing is checked (Verify is the proof).

    The result's ``notes`` say what stayed whole and why: a vocabulary that does not divide, and the dense
    layers left replicated (:func:`replicated_dense`).

    Composes with what is already there: a tensor already sharded on the axis the preset would use and a
    sync the module already has are skipped, so a layer sharded by hand first is completed, not refused.

    Returns:
        PresetCalls: the recorded calls this preset made (a list) and its ``notes``.

    Raises:
        ScheduleError: unknown family, sequence parallelism for a family other than GPT-2, no blocks found,
            a tensor already sharded on another axis, or the first primitive call that fails (e.g. heads
            not divisible by the world size).
    """
    fam = family or detect_family(sch) or "generic"
    if fam not in (*FAMILIES, "generic"):
        raise ScheduleError(
            f"Unknown model family {family!r}; use one of {', '.join(FAMILIES)}, generic or None."
        )
    if family in _BLOCK_CLASSES and not {type(m).__name__ for m in sch.mod.modules()} & set(
        _BLOCK_CLASSES[family]
    ):
        raise ScheduleError(
            f"family={family!r} expects {' or '.join(_BLOCK_CLASSES[family])} blocks and this model has "
            "none; pass family=None to detect the family."
        )
    if sequence_parallel and fam != "gpt2":
        raise ScheduleError(
            f"The sequence-parallel preset exists for GPT-2 only (not {fam}): it needs a dropout after the "
            "embeddings to scatter at and a final LayerNorm to gather at."
        )
    if sequence_parallel and use_hf_plan:
        raise ScheduleError(
            "use_hf_plan does not combine with sequence_parallel: HF plans carry no sequence layout."
        )
    base = _gpt2_base(sch) if sequence_parallel else ""
    blocks = find_blocks(sch)
    if not blocks and not use_hf_plan:
        raise ScheduleError(
            "megatron_tp found no repeated transformer blocks (an nn.ModuleList of one block class)."
        )
    from .preset_check import gate

    # every block's layers are read once, before anything is split or checked: each application of the
    # gate then splits the same regions (the dataflow a block's split is read from is the unscheduled model's)
    layers_of = {b: block_layers(sch, b) for b in (blocks if not use_hf_plan else ())}
    calls, notes = gate(
        sch,
        functools.partial(
            _megatron_regions, sch, blocks, vocab_parallel, sequence_parallel, use_hf_plan, base, layers_of
        ),
        check=check,
    )
    if not check and getattr(sch.get_top_schedule().mod, "config", None) is None and sch.world_size > 1:
        _refuse_width_derived_heads(sch)
    whole = replicated_dense(sch, exclude_noted=True)
    if not calls and not _any_sharded(sch):
        if any(n.startswith("Kept whole:") for n in notes):
            raise ScheduleError(f"megatron_tp found no dense projection it can split: {' '.join(notes)}")
        # the reason of the first block that holds a dense layer (a hybrid stack's convolutional blocks say
        # nothing about why its attention blocks stay whole: SwiftFormer)
        first = next(
            (
                b
                for b in blocks
                if any(isinstance(m, nn.Linear) or is_conv1d(m) for m in sch[b].mod.modules())
            ),
            blocks[0] if blocks else "",
        )
        raise ScheduleError(_no_pair_reason(sch, first, block_layers(sch, first) if blocks else []))
    return PresetCalls(calls, [*notes, *([whole] if whole else [])])


def _any_sharded(sch) -> bool:
    return any(getattr(p, "shard_axis", None) is not None for p in sch.mod.parameters())


def _megatron_regions(sch, blocks, vocab_parallel, sequence_parallel, use_hf_plan, base, layers_of, skip):
    """One application of :func:`megatron_tp` region by region (:mod:`slapo_lab.preset_check`), leaving out
    the regions whose keys ``skip`` holds; a region a primitive refuses raises ``RegionRefused``."""
    from .preset_check import OUTSIDE, Applied, Region, RegionRefused, layer_regions

    n = len(sch.record)
    region_of_call: list = []
    owned: dict = {}
    notes: list[str] = []

    done: set = set()

    def run(region, fn) -> None:
        if region.key in skip:
            return
        k = len(sch.record)
        try:
            fn()
        except EarlierCallConflict:
            raise
        except ScheduleError as err:
            if region.key in done:  # the same layers applied in an earlier block of this class: what differs
                raise  # here is a call made before the preset, so the preset is refused as a whole
            raise RegionRefused(region, str(err)) from None
        done.add(region.key)
        region_of_call.extend([region] * (len(sch.record) - k))
        for c in sch.record.calls[k:]:
            owned.setdefault(c.path, region)

    if use_hf_plan:
        plan = Region(("", ("base_model_tp_plan",)), "the config's base_model_tp_plan", "the model")
        run(plan, lambda: apply_hf_tp_plan(sch))
    for b in blocks if not use_hf_plan else ():
        layers = layers_of[b]
        cls = type(sch[b].mod).__name__
        rel_layers = [(p[len(b) + 1 :] if b else p, k) for p, k in layers]
        kinds = dict(rel_layers)
        # a module with several kinds (GPT-OSS-style sinks on an MLA attention that also takes Megatron's f:
        # ``head_param`` then ``attention_f``) gets each of them, in block_layers' order
        queues: dict = {}
        for r, k in rel_layers:
            queues.setdefault(r, []).append(k)
        for region, rels in layer_regions(cls, rel_layers):
            if not any(kinds[r] in ("column", "column_shard", "experts", "heads") for r in rels) and any(
                kinds[r] == "row" for r in rels
            ):  # a row-parallel layer with no column-parallel partner can never be right: leave it
                continue
            paths = [f"{b}.{r}" if b else r for r in rels]
            for p in paths:
                owned[p] = region
            full = next((p for p, r in zip(paths, rels, strict=True) if kinds[r] == "qk_norm_full"), None)
            if full is not None:
                reason = (
                    f"{full} normalises q or k over all attention heads' features, so splitting the heads across "
                    "ranks would change its result."
                )
                run(region, functools.partial(_raise, reason))
                continue
            run(
                region,
                functools.partial(
                    _apply_layers,
                    sch,
                    paths,
                    [queues[r].pop(0) if len(queues[r]) > 1 else queues[r][0] for r in rels],
                    sequence_parallel,
                ),
            )
    if vocab_parallel:
        vocab = vocab_size(sch)
        if vocab is None:
            notes.append(
                "No word embedding is sharded: the model's get_input_embeddings() is not an nn.Embedding, "
                "so its embeddings stay replicated."
            )
        elif vocab % sch.world_size:
            notes.append(
                f"The word embedding stays replicated: its vocabulary of {vocab} does not divide by the "
                f"world size {sch.world_size} (pad the vocabulary to a multiple of {sch.world_size} to shard it)."
            )
        else:
            run(OUTSIDE, lambda: vocab_parallel_embeddings(sch))
    if sequence_parallel:
        pre = f"{base}." if base else ""

        def scatter_gather() -> None:
            _ensure_sync(sch[f"{pre}drop"], "fwd_post", "scatter", axis=1)
            _ensure_sync(
                sch[f"{pre}ln_f"], "fwd_pre", "all_gather", axis=1, tensor_parallel_output_grad=False
            )

        run(OUTSIDE, scatter_gather)
    return Applied(_since(sch, n), region_of_call, owned, notes)


def _raise(reason: str) -> None:
    raise ScheduleError(reason)


def _apply_layers(sch, paths: list[str], kinds: list[str], sequence_parallel: bool) -> None:
    for path, kind in zip(paths, kinds, strict=True):
        apply_layer(sch, path, kind, sequence_parallel)


def _refuse_width_derived_heads(sch) -> None:
    """A model of the user's own classes (no Hugging Face config, so no attribute the shard rules rewrite per
    rank is known to be the one its forward reads): run the sharded model once on meta tensors with the
    schedule's example inputs (simulated ranks: shapes only); a forward that fails means it derives head
    counts or sizes from widths the preset split (nanoGPT's ``C // self.n_head``), and the preset is refused
    in one sentence (all or nothing: nothing stays applied). Without example inputs nothing is run (the
    editor's live numeric check still runs the model)."""
    from .call_order import _INPUTS_KEY
    from .plan import estimate_activations

    top = sch.get_top_schedule()
    inputs = top._top.extra.get(_INPUTS_KEY)
    if inputs is None:
        return
    try:
        estimate_activations(top.mod, inputs)
    except ScheduleError as err:
        where = getattr(err, "module", None)
        at = f"{where}'s forward" if where else "the model's forward"
        cause = err.__cause__ if err.__cause__ is not None else err
        text = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise ScheduleError(
            f"with its heads split over {sch.world_size} ranks, {at} fails ({type(cause).__name__}: {text}); it "
            "probably derives head counts or sizes from the input's width (e.g. C // n_head), which tensor "
            "parallelism changes, so shard it by hand with a forward that reads per-rank sizes."
        ) from None


@_all_or_nothing
def checkpoint_blocks(
    sch, every: int = 1, ratio: float = 1.0, *, policy: str = "full", check: bool = True
) -> list[Call]:
    """Activation-checkpoint the transformer blocks (:func:`find_blocks`).

    Checkpoints block ``i`` of the first ``int(len(blocks) * ratio)`` blocks (Slapo's ``ckpt_ratio``) when
    ``i % every == 0``; blocks already checkpointed are skipped. ``policy``: ``"full"`` or ``"selective"`` (see
    :mod:`slapo_lab.primitives.checkpoint`). With ``check`` the calls are checked
    numerically first (:func:`slapo_lab.preset_check.gate`): the blocks of a class whose recomputation
    differs (randomness the checkpoint does not replay) stay as they are, said in the result's ``notes``.

    Returns:
        PresetCalls: the recorded calls and their ``notes``.

    Raises:
        ScheduleError: for a bad ``every`` / ``ratio``, when no blocks are found, or when no checkpoint
            checks right.
    """
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ScheduleError(f"every must be a positive integer, not {every!r}.")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
        raise ScheduleError(f"ratio must be a number in [0, 1], not {ratio!r}.")
    from .primitives.checkpoint import POLICIES

    if policy not in POLICIES:
        raise ScheduleError(f"policy must be one of {', '.join(map(repr, POLICIES))}, not {policy!r}.")
    blocks = find_blocks(sch)
    if not blocks:
        raise ScheduleError(
            "checkpoint_blocks found no repeated blocks (an nn.ModuleList of one block class)."
        )
    from .preset_check import gate

    apply = functools.partial(_checkpoint_regions, sch, blocks, every, ratio, policy=policy)
    calls, notes = gate(sch, apply, check=check)
    return PresetCalls(calls, notes)


def _checkpoint_regions(sch, blocks, every, ratio, skip, policy="full"):
    """One application of :func:`checkpoint_blocks`; a region is the checkpoints of one block class."""
    from .module_state import peek_meta
    from .preset_check import Applied, Region

    n = len(sch.record)
    region_of_call, owned = [], {}
    for i, b in enumerate(blocks[: int(len(blocks) * ratio)]):
        cls = type(sch[b].mod).__name__
        region = Region(
            (cls, ("checkpoint",)), "block", f"every {cls}", kept="Not checkpointed", done="checkpointed"
        )
        owned[b] = region
        meta = peek_meta(sch[b].mod)
        if i % every == 0 and not (meta and meta["checkpoint"]) and region.key not in skip:
            if policy == "full":
                sch[b].checkpoint()  # recorded as before: schedules without a policy stay Slapo's calls
            else:
                sch[b].checkpoint(policy=policy)
            region_of_call.append(region)
    return Applied(_since(sch, n), region_of_call, owned, [])


__all__ = [
    "COLUMN_NAMES",
    "FAMILIES",
    "HEAD_NORM_NAMES",
    "ROW_NAMES",
    "apply_hf_tp_plan",
    "apply_layer",
    "atomic",
    "block_layers",
    "checkpoint_blocks",
    "column_parallel",
    "detect_family",
    "experts_parallel",
    "find_blocks",
    "has_vocab_embedding",
    "hf_tp_plan",
    "megatron_tp",
    "row_parallel",
    "tp_block",
    "vocab_parallel_embeddings",
]
