"""Per-module-class shard rules: what sharding a parameter means for the module's attributes and output.

A rule keeps the module self-consistent after one of its tensors is sliced (``Linear.out_features``,
HF ``Conv1D.nf`` ...), declares the output's type -- ``"partition"`` (each rank holds a slice along
``output_axis``) or ``"partial"`` (each rank holds a partial sum that needs a reduce) -- and, where the
math requires it, swaps in a sharded forward (a row-parallel layer adds its bias only after the
reduce; a vocab-parallel embedding masks ids outside this rank's range). Semantics follow Slapo's
``slapo/sharding/shard_ops.py`` and Megatron-LM's ``ColumnParallelLinear`` / ``RowParallelLinear`` /
``VocabParallelEmbedding``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..module_state import install_forward, module_meta
from . import heads as _heads


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


def local_shard(t: torch.Tensor, axis: int, world_size: int, rank: int, stride: int = 1) -> torch.Tensor:
    """This rank's shard of ``t`` along ``axis`` (a view).

    ``stride`` > 1 means ``t`` stores ``stride`` equal blocks back to back along ``axis`` (GPT-2's fused
    q, k, v): the shard is this rank's chunk of *each* block, concatenated (a strided shard, as
    Megatron's ``partition_stride``).
    """
    if world_size == 1:
        return t
    if stride == 1:
        return t.chunk(world_size, dim=axis)[rank]
    blocks = t.unflatten(axis, (stride, t.shape[axis] // stride))
    return blocks.chunk(world_size, dim=axis + 1)[rank].flatten(axis, axis + 1)


def merge_shards(parts: list[torch.Tensor], axis: int, stride: int = 1) -> torch.Tensor:
    """Inverse of :func:`local_shard`: the full tensor from every rank's shard, in rank order."""
    if len(parts) == 1:
        return parts[0]
    axis = axis % parts[0].dim()
    if stride == 1:
        return torch.cat(parts, dim=axis)
    blocks = [p.unflatten(axis, (stride, p.shape[axis] // stride)) for p in parts]
    return torch.cat(blocks, dim=axis + 1).flatten(axis, axis + 1)


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
    n = _pos_int(parent, "num_heads", "num_attention_heads", "n_head", "n_heads") or _pos_int(
        cfg, "num_attention_heads", "n_head"
    )
    if n is None:
        return None
    kv = _pos_int(parent, "num_key_value_heads", "num_kv_heads") or _pos_int(cfg, "num_key_value_heads") or n
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


def attention_role(site: ShardSite) -> str | None:
    """``"q"``, ``"k"``, ``"v"``, ``"o"`` (output projection), ``"qkv"`` / ``"kv"`` (fused) or None."""
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
    blocks = fused_qkv_blocks(site)
    if blocks == 3:
        return "qkv"
    if blocks == 2:
        return "kv"
    return None


def heads_reason(site: ShardSite, side: str | None, world_size: int) -> str | None:
    """Why splitting an attention projection's head features (``side`` "out" for q/k/v, "in" for the
    output projection) across ``world_size`` ranks breaks attention, or None.

    Every rank must hold whole heads, and whole key/value heads for grouped-query attention (the ratio
    ``heads / kv heads`` that HF's ``repeat_kv`` uses must stay the same on every rank).
    """
    if side is None or world_size == 1:
        return None
    role = attention_role(site)
    if role is None or (role == "o") != (side == "in"):
        return None
    n, kv = attention_heads(site.parent)
    if n == kv:
        order = [("attention", n)]
    elif role in ("k", "v", "kv"):
        order = [("key/value", kv), ("attention", n)]
    else:
        order = [("attention", n), ("key/value", kv)]
    for what, count in order:
        if count % world_size:
            return f"the {count} {what} heads do not divide by {world_size}"
    return None


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


def localise_parent_heads(site: ShardSite, world_size: int) -> None:
    """Rewrite the parent attention module's head attributes to this rank's share (once)."""
    if world_size == 1 or site.parent is None:
        return
    n, kv = attention_heads(site.parent)
    _heads.localise_heads(site.parent, n, kv, world_size)


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
        """How many equal blocks the tensor stores back to back along ``axis`` (see :func:`local_shard`)."""
        return 1

    def apply_site(self, site: ShardSite, axis: int, world_size: int, rank: int) -> None:
        """Update the parent after the shard (runs after :meth:`apply`)."""


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

    def apply_site(self, site, axis, world_size, rank):
        """A q/k/v (or output) projection split by heads: the parent's head attributes become per rank."""
        if splits_heads(site, self._side(site.name, axis)):
            localise_parent_heads(site, world_size)

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

    def stride(self, site, axis):
        return fused_qkv_blocks(site) if self._side(site.name, axis) == "out" else 1

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
            localise_parent_heads(site, world_size)

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
        if mod.groups != 1:
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
