"""Per-module-class shard rules: what sharding a parameter means for the module's attributes and output.

A rule keeps the module self-consistent after one of its tensors is sliced (``Linear.out_features``,
HF ``Conv1D.nf`` ...), declares the output's type -- ``"partition"`` (each rank holds a slice along
``output_axis``) or ``"partial"`` (each rank holds a partial sum that needs a reduce) -- and, where the
math requires it, swaps in a sharded forward (a row-parallel layer adds its bias only after the
reduce; a vocab-parallel embedding masks ids outside this rank's range). Semantics follow Slapo's
``slapo/sharding/shard_ops.py`` and Megatron-LM's ``ColumnParallelLinear`` / ``RowParallelLinear`` /
``VocabParallelEmbedding``.

Fused projections (:func:`fused_layout`) are column parallel by the layout their attention module's
attributes and config give: GPT-2's ``c_attn`` and Phi-3's ``qkv_proj`` / ``gate_up_proj`` store their parts
as blocks back to back (a strided shard, Megatron-LM's ``partition_stride``; unequal blocks under
grouped-query attention are a :class:`BlockStride`), BLOOM's and Falcon's ``query_key_value`` interleave
them per head or per key/value group (a contiguous shard of whole heads / groups), and Falcon's multi-query
attention cannot be split by heads (refused).

With more ranks than key/value heads (:func:`kv_replicas`: ``ws % kv == 0``, heads divisible by ``ws``) a
separate key / value projection is "sharded with replicas": each rank holds one whole key/value head, shared
by ``ws / kv`` consecutive ranks (``shard_replicas``; :func:`local_shard` / :func:`merge_shards` take
``replicas``), as Megatron-LM (``megatron/core/transformer/attention.py``) and vLLM
(``vllm/model_executor/layers/linear.py`` ``QKVParallelLinear``) replicate them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..module_state import install_forward, module_meta
from . import feature_inputs as _feature_inputs
from . import heads as _heads
from . import infer as _infer


@dataclass
class ShardSite:
    """Where a sharded tensor lives: the owning module, the tensor's name on it, and the module's parent.

    Tied tensors have one site per owner. ``parent`` / ``child_name`` let a rule look at the
    surrounding attention module (head counts, GPT-2's fused ``c_attn``); ``parent`` is None for the
    root module.
    """

    mod: nn.Module
    name: str
    parent: nn.Module | None = None
    child_name: str = ""
    path: str = ""
    tp: object = None  # the schedule's tensor-parallel group (sums a per-head input's gradient), if known


class BlockStride(int):
    """A ``shard_stride`` of blocks of unequal sizes (Phi-3's ``qkv_proj`` under grouped-query attention:
    ``[q (heads x head_dim); k (kv heads x head_dim); v (kv heads x head_dim)]``).

    Its integer value is the number of blocks, so code that only asks whether a tensor is strided
    (``shard_stride > 1``) or how many blocks it has keeps working; ``sizes`` are the blocks' global sizes
    along the shard axis, in order. Every block must divide by the world size. Pickles and deep-copies as
    itself. Equal blocks are a plain ``int`` stride (Megatron-LM's ``partition_stride``).

    ``groups`` (optional, one per block, default all 0): a block of ``g > 0`` groups holds ``g`` key/value heads;
    with fewer of them than ranks it is split into ``g`` chunks only, each held by ``ws / g`` consecutive ranks
    (:func:`block_replicas`; ``g = 1``: the whole block on every rank) -- the key/value heads of a fused
    multi-query projection (GPT-BigCode's ``c_attn``, Falcon's ``query_key_value``: one key/value head beside
    the query heads), replicated as Megatron-LM / vLLM replicate key/value heads. 0: split over every rank.
    """

    sizes: tuple[int, ...]
    groups: tuple[int, ...]

    def __new__(cls, sizes, groups=None):
        sizes = tuple(int(s) for s in sizes)
        if len(sizes) < 2 or min(sizes) <= 0:
            raise ValueError(f"a BlockStride needs two or more positive block sizes, not {sizes!r}")
        gs = tuple(int(g) for g in groups) if groups is not None else (0,) * len(sizes)
        if len(gs) != len(sizes) or min(gs) < 0:
            raise ValueError(f"a BlockStride needs one group count (0 or more) per block, not {gs!r}")
        obj = super().__new__(cls, len(sizes))
        obj.sizes = sizes
        obj.groups = gs
        return obj

    def __getnewargs__(self):
        return (self.sizes, self.groups)

    def __repr__(self) -> str:
        extra = f", groups=({', '.join(map(str, self.groups))})" if any(self.groups) else ""
        return f"BlockStride({', '.join(map(str, self.sizes))}{extra})"

    __str__ = __repr__


def make_stride(sizes) -> int:
    """The ``shard_stride`` of a tensor storing blocks of ``sizes`` back to back: ``len(sizes)`` when they are
    equal (a plain int), else a :class:`BlockStride`."""
    sizes = [int(s) for s in sizes]
    if len(sizes) <= 1:
        return 1
    return len(sizes) if len(set(sizes)) == 1 else BlockStride(sizes)


def block_sizes(n: int, stride) -> list[int]:
    """The global sizes of the blocks a tensor of ``n`` features along its shard axis stores back to back.

    ``stride``: an int (that many equal blocks), a :class:`BlockStride`, or a sequence of block sizes
    (which must sum to ``n``).

    Raises:
        ValueError: when the sizes do not sum to ``n`` or equal blocks do not divide it.
    """
    sizes = getattr(stride, "sizes", None)
    if sizes is None and not isinstance(stride, int):
        sizes = tuple(int(s) for s in stride)
    if sizes is None:
        stride = int(stride)
        if stride < 1 or n % stride:
            raise ValueError(f"{n} features do not split into {stride} equal blocks")
        return [n // stride] * stride
    if sum(sizes) != n:
        raise ValueError(f"blocks of sizes {list(sizes)} do not add up to the {n} features they should tile")
    return list(sizes)


def stride_key(stride) -> tuple:
    """A hashable key that tells strides apart by their blocks (``3`` and ``BlockStride(4, 2, 2)`` differ)."""
    return (int(stride), getattr(stride, "sizes", None), getattr(stride, "groups", None))


def block_replicas(stride, blocks: int, world_size: int) -> tuple[int, ...]:
    """On how many consecutive ranks each of a stride's ``blocks`` blocks is shared over ``world_size`` ranks:
    1, but ``world_size / g`` for a block of a :class:`BlockStride` holding ``g`` key/value head groups, fewer
    than the ranks.

    Raises:
        ValueError: for groups that neither divide nor divide by ``world_size``.
    """
    out = []
    for g in getattr(stride, "groups", None) or (0,) * blocks:
        if g == 0 or g % world_size == 0:
            out.append(1)
        elif world_size % g == 0:
            out.append(world_size // g)
        else:
            raise ValueError(f"{g} key/value head groups neither divide nor divide by {world_size} ranks")
    return tuple(out)


def local_shard(
    t: torch.Tensor, axis: int, world_size: int, rank: int, stride=1, replicas: int = 1
) -> torch.Tensor:
    """This rank's shard of ``t`` along ``axis`` (a view for a plain or an equal-block stride).

    ``replicas`` r > 1 (a key/value projection with fewer key/value heads than ranks, see
    :func:`kv_replicas`): ``t`` is split into ``world_size / r`` chunks and consecutive ranks
    ``{h*r, ..., h*r + r - 1}`` all hold chunk ``h = rank // r`` (Megatron-LM / vLLM key/value head
    replication); only a plain stride of 1 combines with replicas.

    ``stride`` > 1 means ``t`` stores ``stride`` equal blocks back to back along ``axis`` (GPT-2's fused
    q, k, v): the shard is this rank's chunk of *each* block, concatenated (a strided shard, as
    Megatron's ``partition_stride``). ``stride`` may also be a :class:`BlockStride` or a sequence of block
    sizes (Phi-3's ``[q; k; v]`` with fewer key/value heads): this rank's chunk of each block, concatenated
    (a copy).

    Raises:
        ValueError: when the blocks do not tile the axis (see :func:`block_sizes`), or for replicas that do
            not divide the world size or come with a stride.
    """
    if replicas != 1:
        if replicas < 1 or world_size % replicas or int(stride) != 1:
            raise ValueError(f"{replicas} replicas do not fit {world_size} ranks with stride {stride!r}")
        world_size, rank = world_size // replicas, rank // replicas
    if world_size == 1:
        return t
    if isinstance(stride, int) and not isinstance(stride, BlockStride):
        if stride == 1:
            return t.chunk(world_size, dim=axis)[rank]
        blocks = t.unflatten(axis, (stride, t.shape[axis] // stride))
        return blocks.chunk(world_size, dim=axis + 1)[rank].flatten(axis, axis + 1)
    parts = t.split(block_sizes(t.shape[axis], stride), dim=axis)
    reps = block_replicas(stride, len(parts), world_size)
    return torch.cat(
        [p.chunk(world_size // r, dim=axis)[rank // r] for p, r in zip(parts, reps, strict=True)], dim=axis
    )


def merge_shards(parts: list[torch.Tensor], axis: int, stride=1, replicas: int = 1) -> torch.Tensor:
    """Inverse of :func:`local_shard`: the full tensor from every rank's shard, in rank order.

    ``stride``: as for :func:`local_shard` (a :class:`BlockStride` or a sequence holds the *global* block
    sizes; each rank holds ``size / len(parts)`` of each block). ``replicas`` r > 1: consecutive groups of
    r parts are copies of one chunk, and the first of each group is used.
    """
    if replicas != 1:
        parts = list(parts)[::replicas]
    if len(parts) == 1:
        return parts[0]
    axis = axis % parts[0].dim()
    if isinstance(stride, int) and not isinstance(stride, BlockStride):
        if stride == 1:
            return torch.cat(parts, dim=axis)
        blocks = [p.unflatten(axis, (stride, p.shape[axis] // stride)) for p in parts]
        return torch.cat(blocks, dim=axis + 1).flatten(axis, axis + 1)
    ws = len(parts)
    given = getattr(stride, "sizes", None)
    sizes = list(given) if given is not None else block_sizes(sum(p.shape[axis] for p in parts), stride)
    reps = block_replicas(stride, len(sizes), ws)
    local = [s * r // ws for s, r in zip(sizes, reps, strict=True)]
    pieces = [p.split(local, dim=axis) for p in parts]
    return torch.cat([pieces[r][j] for j in range(len(sizes)) for r in range(0, ws, reps[j])], dim=axis)


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
        down = getattr(parent, "down_proj", None)
        half = _global_in(down) if isinstance(down, nn.Module) else None
        if half is not None and out == 2 * half:
            return FusedLayout(
                "gate_up", 2, None, "", "transformers modeling_phi3.py Phi3MLP.forward (chunk(2))"
            )
        return None
    if name == "query_key_value":
        falcon = _falcon_layout(site, out)
        if falcon is not None and falcon.refusal:  # multi-query: the dataflow may show a replicated split
            inferred = _inferred_layout(site)
            falcon = inferred if inferred is not None and inferred.refusal is None else falcon
        if falcon is not None:
            return falcon
    names = _class_names(parent)
    spec = next((v for k, v in _FUSED_QKV.items() if k in names), None)
    if spec is None or spec[0] != name:
        return _inferred_layout(site)
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


def shard_replicas(site: ShardSite, axis: int, world_size: int) -> int:
    """How many ranks share each chunk when this tensor is sharded: :func:`kv_replicas` for the output
    features of a separate key or value projection (``k_proj`` / ``v_proj`` weight axis 0 and bias), else 1."""
    rule = get_shard_rule(site.mod)
    hook = getattr(rule, "replicas", None)
    return int(hook(site, axis, world_size)) if hook is not None else 1


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


class ShardRule:
    """Base rule: any tensor, any axis; the output type stays unknown.

    Besides ``check`` / ``apply`` (module only), a rule may look at the tensor's :class:`ShardSite`
    (the parent module): ``check_site`` (refuse, e.g. heads that do not divide), ``stride`` (a strided
    shard of fused blocks) and ``apply_site`` (fix the parent's attributes). The defaults do nothing.
    """

    def matches(self, mod: nn.Module) -> bool:
        return True

    def check(self, mod: nn.Module, name: str, axis: int) -> str | None:
        """Return a reason (one sentence fragment) why this shard makes no sense, or None."""
        return None

    def apply(self, mod: nn.Module, name: str, axis: int, world_size: int, rank: int) -> None:
        """Update the module after ``name`` was sliced on ``axis`` into ``world_size`` chunks."""
        return

    def check_site(self, site: ShardSite, axis: int, world_size: int) -> str | None:
        """Like :meth:`check` with the parent in view; the reason is shown after "across N ranks: "."""

    def stride(self, site: ShardSite, axis: int) -> int:
        """How many equal blocks the tensor stores back to back along ``axis``, or a :class:`BlockStride` of
        unequal ones (see :func:`local_shard`)."""
        return 1

    def apply_site(self, site: ShardSite, axis: int, world_size: int, rank: int) -> None:
        """Update the parent after the shard (runs after :meth:`apply`)."""

    def replicas(self, site: ShardSite, axis: int, world_size: int) -> int:
        """On how many consecutive ranks each chunk is replicated (1: a plain shard; see
        :func:`local_shard`)."""
        return 1


def _set_output(mod: nn.Module, kind: str, axis: int | None = None) -> None:
    meta = module_meta(mod)
    meta["output_type"] = kind
    meta["output_axis"] = axis


def _reduce_partial(mod: nn.Module, y: torch.Tensor) -> torch.Tensor:
    for fn in module_meta(mod)["partial_reducers"]:
        y = fn(y)
    return y


def _row_parallel_linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    y = _reduce_partial(self, F.linear(x, self.weight))
    return y + self.bias if self.bias is not None else y


def _row_parallel_conv1d(self, x: torch.Tensor) -> torch.Tensor:
    size_out = x.size()[:-1] + (self.weight.shape[1],)
    y = torch.matmul(x.reshape(-1, x.size(-1)), self.weight).view(size_out)
    y = _reduce_partial(self, y)
    return y + self.bias if self.bias is not None else y


def _row_parallel_conv2d(self: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    y = _reduce_partial(self, self._conv_forward(x, self.weight, None))
    return y + self.bias.view(1, -1, 1, 1) if self.bias is not None else y


def _vocab_parallel_embedding(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    meta = module_meta(self)
    start = meta["vocab_start"]
    end = start + self.weight.shape[0]
    outside = (ids < start) | (ids >= end)
    local = (ids - start).masked_fill(outside, 0)
    # the class's own forward on this rank's rows: nn.Embedding's lookup (``padding_idx`` is the local pad
    # row, or None when another rank holds it), or a subclass's (Gemma-3's ScaledWordEmbedding multiplies
    # by ``embed_scale``): whatever it adds to the lookup stays in the result
    out = type(self).forward(self, local)
    out = out.masked_fill(outside.unsqueeze(-1), 0.0)
    return _reduce_partial(self, out)


class DenseRule(ShardRule):
    """A dense layer ``y = x W (+ b)``: sharding ``W`` on its output axis is column parallel (partitioned
    output), on its input axis row parallel (partial sums; the bias, kept replicated, is added after the
    reduce). Subclasses name the layer and say which weight axis holds the output features.

    Attributes:
        kind: the layer's name in messages ("Linear", "Conv1D").
        out_axis: the weight axis of the output features (``nn.Linear``: 0; HF ``Conv1D``: 1).
        row_forward: the row-parallel forward (reduce, then add the bias).
    """

    kind = "dense layer"
    out_axis = 0
    row_forward = None

    @property
    def in_axis(self) -> int:
        """The weight axis of the input features."""
        return 1 - self.out_axis

    def _side(self, name: str, axis: int) -> str | None:
        """Which head features a shard splits: "out" (q/k/v side), "in" (output projection) or None."""
        if name == "bias" or (name == "weight" and axis == self.out_axis):
            return "out"
        return "in" if name == "weight" and axis == self.in_axis else None

    def check(self, mod, name, axis):
        meta = module_meta(mod)
        if name == "bias":
            if axis != 0:
                return f"a {self.kind} bias has a single axis, 0"
            if meta["sharded"].get("weight") == self.in_axis:
                return (
                    f"the weight is sharded on axis {self.in_axis} (row parallel), so the bias must stay "
                    "replicated: it is added once, after the all_reduce"
                )
        if name == "weight" and axis == self.in_axis and "bias" in meta["sharded"]:
            return (
                f"the bias is sharded, which only fits a column-parallel {self.kind} weight "
                f"(axis {self.out_axis})"
            )
        return None

    def check_site(self, site, axis, world_size):
        side = self._side(site.name, axis)
        reason = heads_reason(site, side, world_size)
        if reason is None and splits_heads(site, side):
            reason = local_heads_reason(site, world_size)
        return reason

    def stride(self, site, axis):
        """A column-parallel shard of a fused projection (:func:`fused_layout`) is strided by its blocks."""
        if self._side(site.name, axis) != "out":
            return 1
        lay = fused_layout(site)
        return lay.stride if lay is not None and lay.refusal is None else 1

    def replicas(self, site, axis, world_size):
        """A separate key or value projection's output features with fewer key/value heads than ranks: each
        rank holds one whole key/value head, shared by :func:`kv_replicas` ranks."""
        if world_size == 1 or self._side(site.name, axis) != "out" or attention_role(site) not in ("k", "v"):
            return 1
        n, kv = attention_heads(site.parent)
        return kv_replicas(n, kv, world_size)

    def apply_site(self, site, axis, world_size, rank):
        """A q/k/v (or output) projection split by heads: the parent's head attributes become per rank."""
        if splits_heads(site, self._side(site.name, axis)):
            localise_parent_heads(site, world_size, rank)
        _feature_inputs.install(site, self._side(site.name, axis), world_size, rank)

    def set_features(self, mod, out_features: int | None = None, in_features: int | None = None) -> None:
        """Keep the module's own feature-count attributes equal to its (sharded) weight."""
        raise NotImplementedError

    def apply(self, mod, name, axis, world_size, rank):
        if name != "weight":
            return
        if axis == self.out_axis:
            self.set_features(mod, out_features=mod.weight.shape[self.out_axis])
            _set_output(mod, "partition", -1)
        else:
            self.set_features(mod, in_features=mod.weight.shape[self.in_axis])
            _set_output(mod, "partial")
            module_meta(mod)["impl"] = type(self).row_forward
            install_forward(mod)


class LinearRule(DenseRule):
    """``nn.Linear`` (weight ``(out, in)``): axis 0 = column parallel, axis 1 = row parallel."""

    kind = "Linear"
    out_axis = 0
    row_forward = staticmethod(_row_parallel_linear)

    def matches(self, mod):
        return isinstance(mod, nn.Linear)

    def set_features(self, mod, out_features=None, in_features=None):
        if out_features is not None:
            mod.out_features = out_features
        if in_features is not None:
            mod.in_features = in_features


class Conv1DRule(DenseRule):
    """HF ``Conv1D`` (weight ``(in, out)``, transposed): axis 1 = column parallel, axis 0 = row parallel.

    GPT-2's fused ``c_attn`` (see :func:`fused_qkv_blocks`) stores q, k and v back to back on its output
    axis, so a column-parallel shard of it (``weight`` axis 1, ``bias`` axis 0) is *strided*: each rank
    keeps its chunk of each of q, k and v (``param.shard_stride == 3``), i.e. whole heads of all three,
    and the parent's ``split_size`` (used by ``GPT2Attention.forward`` to split the fused output) becomes
    the local width. ``GPT2Attention`` reshapes with ``-1`` heads, so ``num_heads`` / ``embed_dim`` stay
    the global numbers (head checks read them).
    """

    kind = "Conv1D"
    out_axis = 1
    row_forward = staticmethod(_row_parallel_conv1d)

    def matches(self, mod):
        return type(mod).__name__ == "Conv1D" and hasattr(mod, "nf")

    def set_features(self, mod, out_features=None, in_features=None):
        if out_features is not None:
            mod.nf = out_features
        if in_features is not None and hasattr(mod, "nx"):
            mod.nx = in_features

    def apply_site(self, site, axis, world_size, rank):
        super().apply_site(site, axis, world_size, rank)
        # the stride was decided (and recorded on the new weight) before apply() changed ``nf``
        blocks = getattr(site.mod.weight, "shard_stride", 1) if site.name == "weight" and axis == 1 else 1
        if (
            blocks > 1
            and site.parent is not None
            and isinstance(getattr(site.parent, "split_size", None), int)
        ):
            site.parent.split_size = site.mod.nf // blocks


def is_head_table(site: ShardSite, axis: int) -> bool:
    """Whether ``site`` is a per-head table sharded on its heads axis: an ``nn.Embedding`` weight inside an
    attention module with one column per (global) head, split on axis 1 -- T5's ``relative_attention_bias``
    (``num_buckets x n_heads``), whose lookup gives each head its position bias."""
    if site.name != "weight" or axis != 1 or site.parent is None:
        return False
    counts = attention_heads(site.parent)
    w = site.mod.weight
    return counts is not None and tuple(getattr(w, "orig_shape", w.shape))[1] == counts[0]


class EmbeddingRule(ShardRule):
    """``nn.Embedding``: axis 0 = vocab parallel (masked lookup, partial output), axis 1 = hidden split.

    A per-head table inside an attention module (:func:`is_head_table`, T5's ``relative_attention_bias``)
    split on axis 1 keeps this rank's heads' columns: the attention module's head attributes become per
    rank as when its q/k/v are split (:mod:`slapo_lab.sharding.heads`).
    """

    def matches(self, mod):
        return isinstance(mod, nn.Embedding)

    def check_site(self, site, axis, world_size):
        if world_size == 1 or not is_head_table(site, axis):
            return None
        n = attention_heads(site.parent)[0]
        if n % world_size:
            return f"the {n} attention heads do not divide by {world_size}"
        return local_heads_reason(site, world_size)

    def apply_site(self, site, axis, world_size, rank):
        if is_head_table(site, axis):
            localise_parent_heads(site, world_size, rank)

    def apply(self, mod, name, axis, world_size, rank):
        if axis == 0:
            meta = module_meta(mod)
            meta["vocab_start"] = rank * mod.weight.shape[0]
            meta["orig_padding_idx"] = pad = mod.padding_idx
            start, rows = meta["vocab_start"], mod.weight.shape[0]
            mod.num_embeddings = rows
            mod.padding_idx = pad - start if pad is not None and start <= pad < start + rows else None
            meta["impl"] = _vocab_parallel_embedding
            install_forward(mod)
            _set_output(mod, "partial")
        else:
            mod.embedding_dim = mod.weight.shape[1]
            _set_output(mod, "partition", -1)


class Conv2dRule(ShardRule):
    """``nn.Conv2d`` (weight ``(out, in, kh, kw)``): axis 0 = output channels, axis 1 = input channels."""

    def matches(self, mod):
        return isinstance(mod, nn.Conv2d)

    def check(self, mod, name, axis):
        if name == "weight" and axis > 1:
            return "only the channel axes 0 (output) and 1 (input) of a Conv2d weight can be sharded"
        if name == "bias" and module_meta(mod)["sharded"].get("weight") == 1:
            return "the weight is sharded on its input channels, so the bias must stay replicated"
        if mod.groups != 1:  # a depthwise one is slapo_lab/sharding/feature_stats.py's DepthwiseConvRule
            return "grouped convolutions cannot be sharded by channel"
        return None

    def apply(self, mod, name, axis, world_size, rank):
        if name != "weight":
            return
        if axis == 0:
            mod.out_channels = mod.weight.shape[0]
            _set_output(mod, "partition", 1)
        else:
            mod.in_channels = mod.weight.shape[1]
            _set_output(mod, "partial")
            module_meta(mod)["impl"] = _row_parallel_conv2d
            install_forward(mod)


class BatchNormRule(ShardRule):
    """``nn.BatchNorm2d``: per-channel statistics, so channel sharding is exact (input split on axis 1)."""

    def matches(self, mod):
        return isinstance(mod, nn.modules.batchnorm._BatchNorm)

    def apply(self, mod, name, axis, world_size, rank):
        t = getattr(mod, name)
        if t is not None and t.dim() == 1:
            mod.num_features = t.shape[0]
        _set_output(mod, "partition", 1)


class NormRule(ShardRule):
    """LayerNorm / RMSNorm: statistics span the whole normalised dimension, so sharding is refused."""

    def matches(self, mod):
        name = type(mod).__name__
        return isinstance(mod, (nn.LayerNorm, nn.RMSNorm)) or (name.endswith(("LayerNorm", "RMSNorm")))

    def check(self, mod, name, axis):
        t = getattr(mod, name, None)
        shape = getattr(mod, "normalized_shape", None)
        per_head = (
            isinstance(t, torch.Tensor)
            and t.dim() >= 2
            and axis < t.dim() - 1
            and not (isinstance(mod, (nn.LayerNorm, nn.RMSNorm)) and shape is not None and len(shape) > 1)
        )
        if per_head:
            # one row of weights per head (Cohere's q_norm / k_norm over (heads, head_dim), normalising each
            # head over head_dim): a rank holding some heads holds their rows
            return None
        return (
            f"{type(mod).__name__} normalises over its whole feature dimension, so a sharded {name} would "
            "change the result; keep it replicated (sequence parallelism splits the sequence axis instead)"
        )


_RULES: list[ShardRule] = [
    LinearRule(),
    Conv1DRule(),
    EmbeddingRule(),
    Conv2dRule(),
    BatchNormRule(),
    NormRule(),
]
_DEFAULT = ShardRule()


def register_shard_rule(rule: ShardRule, first: bool = True) -> None:
    """Add a rule for a module class (checked before the built-ins when ``first``)."""
    if first:
        _RULES.insert(0, rule)
    else:
        _RULES.append(rule)


def get_shard_rule(mod: nn.Module) -> ShardRule:
    """The first rule that matches ``mod`` (a permissive default otherwise)."""
    for rule in _RULES:
        if rule.matches(mod):
            return rule
    return _DEFAULT


ShardFn = Callable[[torch.Tensor], torch.Tensor]
