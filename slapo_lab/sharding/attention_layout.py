"""Attention awareness for the shard rules: head counts, fused q/k/v layouts and key/value head replication.

An attention module's global head counts (:func:`attention_heads`) come from its recorded per-rank rewrite
(:mod:`slapo_lab.sharding.heads`), its attributes or config, or the block's dataflow
(:mod:`slapo_lab.sharding.infer`). Fused projections (:func:`fused_layout`) are column parallel by the layout
their attention module's attributes and config give: GPT-2's ``c_attn`` and Phi-3's ``qkv_proj`` /
``gate_up_proj`` store their parts as blocks back to back (a strided shard, Megatron-LM's
``partition_stride``; unequal blocks under grouped-query attention are a
:class:`~slapo_lab.sharding.shard_layout.BlockStride`), BLOOM's and Falcon's ``query_key_value`` interleave
them per head or per key/value group (a contiguous shard of whole heads / groups), and Falcon's multi-query
attention cannot be split by heads (refused).

With more ranks than key/value heads (:func:`kv_replicas`: ``ws % kv == 0``, heads divisible by ``ws``) a
separate key / value projection is "sharded with replicas": each rank holds one whole key/value head, shared
by ``ws / kv`` consecutive ranks, as Megatron-LM (``megatron/core/transformer/attention.py``) and vLLM
(``vllm/model_executor/layers/linear.py`` ``QKVParallelLinear``) replicate them. Split from
:mod:`slapo_lab.sharding.rules`, which re-exports the public names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from . import heads as _heads
from . import infer_registry as _infer
from .shard_layout import ShardSite, make_stride

# --- attention awareness ---------------------------------------------------------------------------
# Names of the projections inside an attention module (HF BERT, GPT-2, Llama, OPT, T5, DistilBERT ...).
_Q_NAMES = frozenset({"q_proj", "query", "q", "wq", "q_lin", "q_attn", "query_proj"})
_K_NAMES = frozenset({"k_proj", "key", "k", "wk", "k_lin", "key_proj"})
_V_NAMES = frozenset({"v_proj", "value", "v", "wv", "v_lin", "value_proj"})
_O_NAMES = frozenset({"o_proj", "out_proj", "o", "wo", "out_lin"})


def _pos_int(obj, *attrs) -> int | None:
    if obj is None:
        return None
    for a in attrs:
        v = getattr(obj, a, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def attention_heads(parent: nn.Module | None) -> tuple[int, int] | None:
    """``(attention heads, key/value heads)`` of an attention module, from its attributes or ``config``.

    The *global* counts: once a shard splits the module's heads, its per-rank attributes (``num_heads`` of
    OPT ...) are rewritten (:mod:`slapo_lab.sharding.heads`) and the global counts are read from the
    record kept in its ``_slapo_meta``. None when the module does not look like attention.
    """
    if parent is None:
        return None
    recorded = _heads.recorded_heads(parent)
    if recorded is not None:
        return recorded
    cfg = getattr(parent, "config", None)
    inferred = _infer.inferred_heads(parent)  # read from the block's dataflow (slapo_lab/sharding/infer.py)
    n = _pos_int(parent, "num_heads", "num_attention_heads", "n_head", "n_heads") or _pos_int(
        cfg, "num_attention_heads", "n_head"
    )
    if n is None:
        return inferred
    kv = (
        _pos_int(parent, "num_key_value_heads", "num_kv_heads")
        or _pos_int(cfg, "num_key_value_heads")
        or (inferred[1] if inferred is not None and inferred[0] == n else None)
        or n
    )
    return n, kv


def head_dim(attn: nn.Module) -> int | None:
    """Features per head of an attention module: its ``head_dim`` (or ``attention_head_size`` /
    ``key_value_proj_dim``), else its config's ``head_dim``, else hidden size over the heads; None when
    none is known."""
    cfg = getattr(attn, "config", None)
    v = _pos_int(attn, "head_dim", "attention_head_size", "key_value_proj_dim") or _pos_int(cfg, "head_dim")
    if v is not None:
        return v
    heads = attention_heads(attn)
    hidden = getattr(cfg, "hidden_size", None)
    return hidden // heads[0] if heads and isinstance(hidden, int) else None


def is_norm(mod: nn.Module) -> bool:
    """Whether ``mod`` is a LayerNorm / RMSNorm (torch's, or a model's own class named so)."""
    return isinstance(mod, (nn.LayerNorm, nn.RMSNorm)) or type(mod).__name__.endswith(
        ("LayerNorm", "RMSNorm")
    )


def fused_qkv_blocks(site: ShardSite) -> int:
    """How many projections a GPT-2-style fused ``c_attn`` stores back to back (3 = q, k, v; 2 = k, v).

    Detected as an HF ``Conv1D`` named ``c_attn`` whose parent has an integer ``split_size`` (the
    per-projection width: ``GPT2Attention`` and its copies) with ``nf == 3 * split_size`` (self
    attention) or ``2 * split_size`` (cross attention: k and v; q is the separate ``q_attn``).
    Returns 1 for anything else.
    """
    mod, parent = site.mod, site.parent
    if site.child_name != "c_attn" or parent is None or not hasattr(mod, "nf"):
        return 1
    split = getattr(parent, "split_size", None)
    if not isinstance(split, int) or split <= 0:
        return 1
    for k in (3, 2):
        if mod.nf == k * split:
            return k
    return 1


def _class_names(mod: nn.Module | None) -> set[str]:
    return {k.__name__ for k in type(mod).__mro__} if mod is not None else set()


def _global_out(mod: nn.Module) -> int | None:
    """The global number of output features of an ``nn.Linear`` / HF ``Conv1D`` (its weight's ``orig_shape``
    once sharded)."""
    w = getattr(mod, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        return None
    shape = tuple(getattr(w, "orig_shape", None) or w.shape)
    if type(mod).__name__ == "Conv1D":
        return shape[1]
    return shape[0] if isinstance(mod, nn.Linear) else None


def _global_in(mod: nn.Module) -> int | None:
    w = getattr(mod, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        return None
    shape = tuple(getattr(w, "orig_shape", None) or w.shape)
    if type(mod).__name__ == "Conv1D":
        return shape[0]
    return shape[1] if isinstance(mod, nn.Linear) else None


@dataclass(frozen=True)
class FusedLayout:
    """How a fused projection stores its parts on its output features, read from the attention module's
    attributes and config (or the MLP's shapes), and so how a column-parallel shard of it splits.

    Attributes:
        parts: ``"qkv"``, ``"kv"`` (attention) or ``"gate_up"`` (a gated MLP's gate and up projections).
        stride: the ``shard_stride`` of a column-parallel shard: 1 when each rank keeps one contiguous range
            (parts interleaved per head or per key/value group), n for n equal blocks back to back, or a
            :class:`BlockStride` for unequal blocks.
        units: how many pieces a contiguous shard must keep whole (heads, or key/value groups), else None.
        unit: what those pieces are, for messages (``"attention heads"``, ``"key/value head groups"``).
        source: the code the layout follows.
        refusal: why the projection cannot be split by heads at all (one sentence fragment), or None.
    """

    parts: str
    stride: int = 1
    units: int | None = None
    unit: str = ""
    source: str = ""
    refusal: str | None = None


# Attention classes (matched along the MRO) whose fused q/k/v layout has been read from transformers' code:
# class name -> (child name, layout). "heads": per head [q, k, v] interleaved (``view(..., heads, 3,
# head_dim)``), so a contiguous range is whole heads of all three; "blocks": [q; k; v] back to back with
# heads x head_dim, kv x head_dim, kv x head_dim features. Falcon is read from its own attributes.
_FUSED_QKV: dict[str, tuple[str, str, str]] = {
    "BloomAttention": ("query_key_value", "heads", "transformers modeling_bloom.py BloomAttention._reshape"),
    "Phi3Attention": ("qkv_proj", "blocks", "transformers modeling_phi3.py Phi3Attention.forward"),
}


def register_fused_qkv(class_name: str, child: str, layout: str, source: str = "") -> None:
    """Declare that attention class ``class_name`` (or a subclass) stores q, k and v fused in its child
    ``child`` with ``layout`` ``"heads"`` (per head ``[q, k, v]`` interleaved: a contiguous shard by heads)
    or ``"blocks"`` (``[q; k; v]`` back to back: a strided shard, unequal blocks under grouped-query
    attention).

    Raises:
        ValueError: for another layout name.
    """
    if layout not in ("heads", "blocks"):
        raise ValueError(f"fused q/k/v layout {layout!r} is not 'heads' or 'blocks'")
    _FUSED_QKV[class_name] = (child, layout, source)


def _falcon_layout(site: ShardSite, out: int) -> FusedLayout | None:
    """Falcon's ``query_key_value`` (transformers modeling_falcon.py ``FalconAttention.__init__`` /
    ``_split_heads``), from the module's ``new_decoder_architecture`` / ``multi_query`` attributes."""
    parent = site.parent
    new_arch, mqa = getattr(parent, "new_decoder_architecture", None), getattr(parent, "multi_query", None)
    if not isinstance(new_arch, bool) or not isinstance(mqa, bool):
        return None
    counts, hd = attention_heads(parent), head_dim(parent)
    if counts is None or hd is None:
        return None
    n, kv = counts
    src = "transformers modeling_falcon.py FalconAttention._split_heads"
    cls = type(parent).__name__
    if new_arch:
        if out != (n + 2 * kv) * hd:
            return None
        return FusedLayout("qkv", 1, kv, "key/value head groups", src)
    if mqa:
        return FusedLayout(
            "qkv",
            1,
            None,
            "",
            src,
            f"{cls} uses multi-query attention, one key/value head for all {n} query heads, so its fused "
            "query_key_value and its dense cannot be split by heads",
        )
    if out != 3 * n * hd:
        return None
    return FusedLayout("qkv", 1, n, "attention heads", src)


def fused_layout(site: ShardSite) -> FusedLayout | None:
    """The layout of a fused projection (see :class:`FusedLayout`), or None for any other tensor's module.

    * GPT-2's ``c_attn`` (:func:`fused_qkv_blocks`): q, k, v (or k, v) as equal blocks;
    * Falcon's ``query_key_value`` (``FalconAttention``): with ``new_decoder_architecture`` one group per
      key/value head, ``[q x heads/kv, k, v]`` (contiguous by groups); otherwise per head ``[q, k, v]``
      (contiguous by heads); with ``multi_query`` (one key/value head) a refusal;
    * BLOOM's ``query_key_value``: per head ``[q, k, v]`` (contiguous by heads);
    * Phi-3's ``qkv_proj``: ``[q; k; v]`` blocks of heads x head_dim, kv x head_dim, kv x head_dim;
    * a gated MLP's ``gate_up_proj`` whose sibling ``down_proj`` takes half its outputs (Phi-3's
      ``Phi3MLP``: ``gate, up = y.chunk(2, -1)``): 2 equal blocks.

    Sizes are global (a weight's ``orig_shape`` once sharded); a layout whose sizes do not match the
    module's head counts is not recognised (None).
    """
    mod, parent, name = site.mod, site.parent, site.child_name
    if parent is None:
        return None
    out = _global_out(mod)
    if out is None:
        return None
    blocks = fused_qkv_blocks(site)
    if blocks > 1:
        return FusedLayout(
            "qkv" if blocks == 3 else "kv", blocks, None, "", "transformers GPT2Attention (split_size)"
        )
    if name == "gate_up_proj":
        return _gate_up_layout(parent, out)
    if name == "query_key_value":
        falcon = _falcon_or_inferred(site, out)
        if falcon is not None:
            return falcon
    names = _class_names(parent)
    spec = next((v for k, v in _FUSED_QKV.items() if k in names), None)
    if spec is None or spec[0] != name:
        return _inferred_layout(site)
    return _registered_qkv_layout(parent, out, spec)


def _gate_up_layout(parent: nn.Module, out: int) -> FusedLayout | None:
    """A gated MLP's ``gate_up_proj`` of ``out`` features whose sibling ``down_proj`` takes half of them (Phi-3's
    ``Phi3MLP``): 2 equal blocks; else None."""
    down = getattr(parent, "down_proj", None)
    half = _global_in(down) if isinstance(down, nn.Module) else None
    if half is not None and out == 2 * half:
        return FusedLayout("gate_up", 2, None, "", "transformers modeling_phi3.py Phi3MLP.forward (chunk(2))")
    return None


def _falcon_or_inferred(site: ShardSite, out: int) -> FusedLayout | None:
    """Falcon's ``query_key_value`` layout; where it refuses (multi-query), the layout the dataflow shows when
    that one splits (a replicated split)."""
    falcon = _falcon_layout(site, out)
    if falcon is not None and falcon.refusal:  # multi-query: the dataflow may show a replicated split
        inferred = _inferred_layout(site)
        falcon = inferred if inferred is not None and inferred.refusal is None else falcon
    return falcon


def _registered_qkv_layout(parent: nn.Module, out: int, spec: tuple) -> FusedLayout | None:
    """The layout of a fused q/k/v registered for ``parent``'s class (``spec``: ``(child name, "heads" or
    "blocks", source)``), when ``out`` matches the module's head counts; else None."""
    counts, hd = attention_heads(parent), head_dim(parent)
    if counts is None or hd is None:
        return None
    n, kv = counts
    if spec[1] == "heads":
        if n != kv or out != 3 * n * hd:
            return None
        return FusedLayout("qkv", 1, n, "attention heads", spec[2])
    if out != (n + 2 * kv) * hd:
        return None
    return FusedLayout("qkv", make_stride((n * hd, kv * hd, kv * hd)), None, "", spec[2])


_INFERRED_SOURCE = "the block's recorded dataflow (slapo_lab/sharding/infer.py)"


def _inferred_layout(site: ShardSite) -> FusedLayout | None:
    """The layout :mod:`slapo_lab.sharding.infer` read from the block's dataflow: a fused q/k/v (contiguous by
    heads, or blocks), a fused MLP input (``gate|up`` chunked), or the refusal of an attention whose fused
    projection cannot be split by heads (multi-query attention); None otherwise."""
    found = _infer.lookup(site.parent, site.child_name)
    if found is None:
        return None
    role, lay, refusal = found
    if role == "o":
        return None
    if refusal:
        return FusedLayout("qkv", 1, None, "", _INFERRED_SOURCE, f"{type(site.parent).__name__}: {refusal}")
    if lay is None:
        return None
    if role == "mlp_in":
        return FusedLayout("gate_up", lay.stride, None, "", _INFERRED_SOURCE) if lay.stride != 1 else None
    if not set(role) <= set("qkvg") or (len(role) < 2 and lay.stride == 1):
        return None  # one part with a strided layout keeps it (a per-head score term: score_terms.py)
    if lay.stride == 1:
        return FusedLayout(role, 1, lay.units, "attention heads", _INFERRED_SOURCE)
    return FusedLayout(role, lay.stride, None, "", _INFERRED_SOURCE)


def fused_qkv_of(attn: nn.Module | None) -> tuple[str, FusedLayout] | None:
    """``(child name, layout)`` of the fused q/k/v projection directly inside ``attn``, or None."""
    if attn is None:
        return None
    for cname, child in attn.named_children():
        found = _infer.lookup(attn, cname)
        if found is not None and ((len(found[0]) > 1 and set(found[0]) <= set("qkvg")) or found[2]):
            lay = fused_layout(ShardSite(child, "weight", attn, cname))
            if lay is not None:
                return cname, lay
        if cname in ("query_key_value", "qkv_proj", "c_attn"):
            lay = fused_layout(ShardSite(child, "weight", attn, cname))
            if lay is not None and lay.parts in ("qkv", "kv"):
                return cname, lay
    return None


def attention_refusal(attn: nn.Module | None) -> str | None:
    """Why ``attn``'s heads cannot be split across ranks at all, or None: Falcon's multi-query attention (its
    one key/value head), BLOOM's ``pretraining_tp`` emulation (``slow_but_exact`` slices ``dense.weight``
    itself)."""
    fused = fused_qkv_of(attn)
    if fused is not None and fused[1].refusal:
        return fused[1].refusal
    if (
        "BloomAttention" in _class_names(attn)
        and getattr(attn, "slow_but_exact", False)
        and (getattr(attn, "pretraining_tp", 1) or 1) > 1
    ):
        return (
            f"{type(attn).__name__} emulates pretraining_tp={attn.pretraining_tp} with slow_but_exact, slicing "
            "dense.weight itself instead of calling dense, so a row-parallel dense would be bypassed; set "
            "slow_but_exact=False"
        )
    return None


def attention_role(site: ShardSite) -> str | None:
    """``"q"``, ``"k"``, ``"v"``, ``"o"`` (output projection), ``"qkv"`` / ``"kv"`` (fused) or None.

    Fused projections are recognised by their layout (:func:`fused_layout`); the output projection by its
    name, GPT-2's ``c_proj`` beside ``c_attn``, or ``dense`` beside a fused ``query_key_value`` / ``qkv_proj``
    (Falcon's and BLOOM's ``self_attention.dense``).
    """
    name, parent = site.child_name, site.parent
    if parent is None or attention_heads(parent) is None:
        return None
    if name in _Q_NAMES:
        return "q"
    if name in _K_NAMES:
        return "k"
    if name in _V_NAMES:
        return "v"
    if name in _O_NAMES or (name == "c_proj" and hasattr(parent, "c_attn")):
        return "o"
    lay = fused_layout(site)
    if lay is not None and lay.parts in ("qkv", "kv"):
        return lay.parts
    if name == "dense" and fused_qkv_of(parent) is not None:
        return "o"
    found = _infer.lookup(parent, name)
    if found is not None and found[0] != "g" and (found[0] == "o" or set(found[0]) <= set("qkvg")):
        return found[0]
    return None


def heads_reason(site: ShardSite, side: str | None, world_size: int) -> str | None:
    """Why splitting an attention projection's head features (``side`` "out" for q/k/v, "in" for the
    output projection) across ``world_size`` ranks breaks attention, or None.

    Every rank must hold whole heads, and whole key/value heads for grouped-query attention: ``kv`` divisible
    by ``world_size``, or -- for separate q / k / v / o projections -- dividing it, each key/value head then
    replicated on ``world_size / kv`` ranks (:func:`kv_replicas`; the per-rank ``num_key_value_groups`` is
    rewritten by :mod:`slapo_lab.sharding.heads`). Otherwise the sentence is "the 3 key/value heads do not
    divide by 4" (or "the 4 attention heads do not divide by 8").
    """
    if side is None or world_size == 1:
        return None
    role = attention_role(site)
    if role is None or (role == "o") != (side == "in"):
        return None
    refusal = attention_refusal(site.parent)
    if refusal:
        return refusal
    n, kv = attention_heads(site.parent)
    if n == kv:
        order = [("attention", n)]
    elif role in ("k", "v", "kv"):
        order = [("key/value", kv), ("attention", n)]
    else:
        order = [("attention", n), ("key/value", kv)]
    # separate q / k / v / o projections may replicate key/value heads over ranks (kv_replicas, which also needs
    # the query heads to divide: checked next); a fused one cannot (its k and v rows sit beside split q rows)
    replicable = (
        (role in ("q", "k", "v", "o") or _replicated_fused(site)) and kv < world_size and world_size % kv == 0
    )
    for what, count in order:
        if count % world_size and not (what == "key/value" and replicable):
            return f"the {count} {what} heads do not divide by {world_size}"
    return None


def kv_replicas(heads: int, kv_heads: int, world_size: int) -> int:
    """On how many ranks each key/value head is replicated when ``world_size`` exceeds ``kv_heads``.

    ``world_size / kv_heads`` when ``kv_heads < world_size``, ``world_size % kv_heads == 0`` and
    ``heads % world_size == 0``: rank ``i`` keeps query heads ``[i*heads/ws, (i+1)*heads/ws)`` and the whole
    key/value head ``i // r`` -- exactly the one its query heads use under grouped-query attention, since
    ``heads / kv_heads = r * heads / ws`` -- so attention needs no collective beyond column / row parallelism,
    and the weight gradient of a replicated head is a partial sum over its ``r`` ranks
    (:meth:`~slapo_lab.sharding.sync_ops.TPGroup.replica_group`). 1 otherwise (no replication, or not
    possible). Sources: Megatron-LM ``megatron/core/transformer/attention.py`` (``num_query_groups`` below the
    tensor-parallel size), vLLM ``vllm/model_executor/layers/linear.py`` ``QKVParallelLinear``
    (``num_kv_head_replicas = tp_size // total_num_kv_heads``).
    """
    if world_size <= kv_heads or world_size % kv_heads or heads % world_size:
        return 1
    return world_size // kv_heads


def _replicated_fused(site: ShardSite) -> bool:
    """Whether ``site``'s fused q/k/v layout keeps its key/value blocks replicated (:class:`BlockStride`
    ``replicas``: multi-query attention read from the dataflow)."""
    lay = fused_layout(site)
    return lay is not None and lay.refusal is None and any(getattr(lay.stride, "groups", None) or ())


def splits_heads(site: ShardSite, side: str | None) -> bool:
    """Whether sharding this projection's ``side`` ("out" for q/k/v, "in" for the output projection)
    leaves each rank a subset of the parent attention module's heads."""
    role = attention_role(site)
    return side is not None and role is not None and (role == "o") == (side == "in")


def local_heads_reason(site: ShardSite, world_size: int) -> str | None:
    """Why the parent attention module's head attributes cannot be made per rank, or None."""
    if world_size == 1 or _heads.recorded_heads(site.parent) is not None:
        return None
    n, kv = attention_heads(site.parent)
    return _heads.plan_local_heads(site.parent, n, kv, world_size)[1]


def localise_parent_heads(site: ShardSite, world_size: int, rank: int = 0) -> None:
    """Rewrite the parent attention module's head attributes to this rank's share (once; ``rank`` picks the
    per-head inputs it keeps, BLOOM's ALiBi slopes)."""
    if world_size == 1 or site.parent is None:
        return
    n, kv = attention_heads(site.parent)
    _heads.localise_heads(site.parent, n, kv, world_size, rank, group=site.tp)
