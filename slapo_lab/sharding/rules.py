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

This module holds the rules and their registry (:func:`register_shard_rule`, :func:`get_shard_rule`); the
layouts they read live in :mod:`slapo_lab.sharding.shard_layout` (:class:`ShardSite`, strided and replicated
shards) and :mod:`slapo_lab.sharding.attention_layout` (head counts, fused q/k/v layouts), re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..module_state import install_forward, module_meta
from . import feature_inputs as _feature_inputs
from .attention_layout import (
    FusedLayout,
    attention_heads,
    attention_refusal,
    attention_role,
    fused_layout,
    fused_qkv_blocks,
    fused_qkv_of,
    head_dim,
    heads_reason,
    is_norm,
    kv_replicas,
    local_heads_reason,
    localise_parent_heads,
    register_fused_qkv,
    splits_heads,
)
from .shard_layout import (
    BlockStride,
    ShardSite,
    block_replicas,
    block_sizes,
    local_shard,
    make_stride,
    merge_shards,
    stride_key,
)


def shard_replicas(site: ShardSite, axis: int, world_size: int) -> int:
    """How many ranks share each chunk when this tensor is sharded: :func:`kv_replicas` for the output
    features of a separate key or value projection (``k_proj`` / ``v_proj`` weight axis 0 and bias), else 1."""
    rule = get_shard_rule(site.mod)
    hook = getattr(rule, "replicas", None)
    return int(hook(site, axis, world_size)) if hook is not None else 1


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

    def stride(self, site: ShardSite, axis: int) -> int | BlockStride:
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
    meta.output_type = kind
    meta.output_axis = axis


def _reduce_partial(mod: nn.Module, y: torch.Tensor) -> torch.Tensor:
    for fn in module_meta(mod).partial_reducers:
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
    start = meta.vocab_start
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

    def check(self, mod: nn.Module, name: str, axis: int) -> str | None:
        meta = module_meta(mod)
        if name == "bias":
            if axis != 0:
                return f"a {self.kind} bias has a single axis, 0"
            if meta.sharded.get("weight") == self.in_axis:
                return (
                    f"the weight is sharded on axis {self.in_axis} (row parallel), so the bias must stay "
                    "replicated: it is added once, after the all_reduce"
                )
        if name == "weight" and axis == self.in_axis and "bias" in meta.sharded:
            return (
                f"the bias is sharded, which only fits a column-parallel {self.kind} weight "
                f"(axis {self.out_axis})"
            )
        return None

    def check_site(self, site: ShardSite, axis: int, world_size: int) -> str | None:
        side = self._side(site.name, axis)
        reason = heads_reason(site, side, world_size)
        if reason is None and splits_heads(site, side):
            reason = local_heads_reason(site, world_size)
        return reason

    def stride(self, site: ShardSite, axis: int) -> int | BlockStride:
        """A column-parallel shard of a fused projection (:func:`fused_layout`) is strided by its blocks."""
        if self._side(site.name, axis) != "out":
            return 1
        lay = fused_layout(site)
        return lay.stride if lay is not None and lay.refusal is None else 1

    def replicas(self, site: ShardSite, axis: int, world_size: int) -> int:
        """A separate key or value projection's output features with fewer key/value heads than ranks: each
        rank holds one whole key/value head, shared by :func:`kv_replicas` ranks."""
        if world_size == 1 or self._side(site.name, axis) != "out" or attention_role(site) not in ("k", "v"):
            return 1
        n, kv = attention_heads(site.parent)
        return kv_replicas(n, kv, world_size)

    def apply_site(self, site: ShardSite, axis: int, world_size: int, rank: int) -> None:
        """A q/k/v (or output) projection split by heads: the parent's head attributes become per rank."""
        if splits_heads(site, self._side(site.name, axis)):
            localise_parent_heads(site, world_size, rank)
        _feature_inputs.install(site, self._side(site.name, axis), world_size, rank)

    def set_features(
        self, mod: nn.Module, out_features: int | None = None, in_features: int | None = None
    ) -> None:
        """Keep the module's own feature-count attributes equal to its (sharded) weight."""
        raise NotImplementedError

    def apply(self, mod: nn.Module, name: str, axis: int, world_size: int, rank: int) -> None:
        if name != "weight":
            return
        if axis == self.out_axis:
            self.set_features(mod, out_features=mod.weight.shape[self.out_axis])
            _set_output(mod, "partition", -1)
        else:
            self.set_features(mod, in_features=mod.weight.shape[self.in_axis])
            _set_output(mod, "partial")
            module_meta(mod).impl = type(self).row_forward
            install_forward(mod)


class LinearRule(DenseRule):
    """``nn.Linear`` (weight ``(out, in)``): axis 0 = column parallel, axis 1 = row parallel."""

    kind = "Linear"
    out_axis = 0
    row_forward = staticmethod(_row_parallel_linear)

    def matches(self, mod: nn.Module) -> bool:
        return isinstance(mod, nn.Linear)

    def set_features(
        self, mod: nn.Module, out_features: int | None = None, in_features: int | None = None
    ) -> None:
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

    def matches(self, mod: nn.Module) -> bool:
        return type(mod).__name__ == "Conv1D" and hasattr(mod, "nf")

    def set_features(
        self, mod: nn.Module, out_features: int | None = None, in_features: int | None = None
    ) -> None:
        if out_features is not None:
            mod.nf = out_features
        if in_features is not None and hasattr(mod, "nx"):
            mod.nx = in_features

    def apply_site(self, site: ShardSite, axis: int, world_size: int, rank: int) -> None:
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

    def matches(self, mod: nn.Module) -> bool:
        return isinstance(mod, nn.Embedding)

    def check_site(self, site: ShardSite, axis: int, world_size: int) -> str | None:
        if world_size == 1 or not is_head_table(site, axis):
            return None
        n = attention_heads(site.parent)[0]
        if n % world_size:
            return f"the {n} attention heads do not divide by {world_size}"
        return local_heads_reason(site, world_size)

    def apply_site(self, site: ShardSite, axis: int, world_size: int, rank: int) -> None:
        if is_head_table(site, axis):
            localise_parent_heads(site, world_size, rank)

    def apply(self, mod: nn.Module, name: str, axis: int, world_size: int, rank: int) -> None:
        if axis == 0:
            meta = module_meta(mod)
            meta.vocab_start = rank * mod.weight.shape[0]
            meta.orig_padding_idx = pad = mod.padding_idx
            start, rows = meta.vocab_start, mod.weight.shape[0]
            mod.num_embeddings = rows
            mod.padding_idx = pad - start if pad is not None and start <= pad < start + rows else None
            meta.impl = _vocab_parallel_embedding
            install_forward(mod)
            _set_output(mod, "partial")
        else:
            mod.embedding_dim = mod.weight.shape[1]
            _set_output(mod, "partition", -1)


class Conv2dRule(ShardRule):
    """``nn.Conv2d`` (weight ``(out, in, kh, kw)``): axis 0 = output channels, axis 1 = input channels."""

    def matches(self, mod: nn.Module) -> bool:
        return isinstance(mod, nn.Conv2d)

    def check(self, mod: nn.Module, name: str, axis: int) -> str | None:
        if name == "weight" and axis > 1:
            return "only the channel axes 0 (output) and 1 (input) of a Conv2d weight can be sharded"
        if name == "bias" and module_meta(mod).sharded.get("weight") == 1:
            return "the weight is sharded on its input channels, so the bias must stay replicated"
        if mod.groups != 1:  # a depthwise one is slapo_lab/sharding/feature_stats.py's DepthwiseConvRule
            return "grouped convolutions cannot be sharded by channel"
        return None

    def apply(self, mod: nn.Module, name: str, axis: int, world_size: int, rank: int) -> None:
        if name != "weight":
            return
        if axis == 0:
            mod.out_channels = mod.weight.shape[0]
            _set_output(mod, "partition", 1)
        else:
            mod.in_channels = mod.weight.shape[1]
            _set_output(mod, "partial")
            module_meta(mod).impl = _row_parallel_conv2d
            install_forward(mod)


class BatchNormRule(ShardRule):
    """``nn.BatchNorm2d``: per-channel statistics, so channel sharding is exact (input split on axis 1)."""

    def matches(self, mod: nn.Module) -> bool:
        return isinstance(mod, nn.modules.batchnorm._BatchNorm)

    def apply(self, mod: nn.Module, name: str, axis: int, world_size: int, rank: int) -> None:
        t = getattr(mod, name)
        if t is not None and t.dim() == 1:
            mod.num_features = t.shape[0]
        _set_output(mod, "partition", 1)


class NormRule(ShardRule):
    """LayerNorm / RMSNorm: statistics span the whole normalised dimension, so sharding is refused."""

    def matches(self, mod: nn.Module) -> bool:
        name = type(mod).__name__
        return isinstance(mod, (nn.LayerNorm, nn.RMSNorm)) or (name.endswith(("LayerNorm", "RMSNorm")))

    def check(self, mod: nn.Module, name: str, axis: int) -> str | None:
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

# the layouts moved to shard_layout / attention_layout stay importable from here
__all__ = [
    "BatchNormRule",
    "BlockStride",
    "Conv1DRule",
    "Conv2dRule",
    "DenseRule",
    "EmbeddingRule",
    "FusedLayout",
    "LinearRule",
    "NormRule",
    "ShardFn",
    "ShardRule",
    "ShardSite",
    "attention_heads",
    "attention_refusal",
    "attention_role",
    "block_replicas",
    "block_sizes",
    "fused_layout",
    "fused_qkv_blocks",
    "fused_qkv_of",
    "get_shard_rule",
    "head_dim",
    "heads_reason",
    "is_head_table",
    "is_norm",
    "kv_replicas",
    "local_heads_reason",
    "local_shard",
    "localise_parent_heads",
    "make_stride",
    "merge_shards",
    "register_fused_qkv",
    "register_shard_rule",
    "shard_replicas",
    "splits_heads",
    "stride_key",
]
