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

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..module_state import install_forward, module_meta


class ShardRule:
    """Base rule: any tensor, any axis; the output type stays unknown."""

    def matches(self, mod: nn.Module) -> bool:
        return True

    def check(self, mod: nn.Module, name: str, axis: int) -> str | None:
        """Return a reason (one sentence fragment) why this shard makes no sense, or None."""
        return None

    def apply(self, mod: nn.Module, name: str, axis: int, world_size: int, rank: int) -> None:
        """Update the module after ``name`` was sliced on ``axis`` into ``world_size`` chunks."""
        return None


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
    pad = meta.get("orig_padding_idx")
    pad = pad - start if pad is not None and start <= pad < end else None
    out = F.embedding(local, self.weight, pad, self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse)
    out = out.masked_fill(outside.unsqueeze(-1), 0.0)
    return _reduce_partial(self, out)


class LinearRule(ShardRule):
    """``nn.Linear`` (weight ``(out, in)``): axis 0 = column parallel, axis 1 = row parallel."""

    def matches(self, mod):
        return isinstance(mod, nn.Linear)

    def check(self, mod, name, axis):
        meta = module_meta(mod)
        if name == "bias":
            if axis != 0:
                return "a Linear bias has a single axis, 0"
            if meta["sharded"].get("weight") == 1:
                return ("the weight is sharded on axis 1 (row parallel), so the bias must stay replicated: "
                        "it is added once, after the all_reduce")
        if name == "weight" and axis == 1 and "bias" in meta["sharded"]:
            return "the bias is sharded, which only fits a column-parallel weight (axis 0)"
        return None

    def apply(self, mod, name, axis, world_size, rank):
        if name != "weight":
            return
        if axis == 0:
            mod.out_features = mod.weight.shape[0]
            _set_output(mod, "partition", -1)
        else:
            mod.in_features = mod.weight.shape[1]
            _set_output(mod, "partial")
            module_meta(mod)["impl"] = _row_parallel_linear
            install_forward(mod)


class Conv1DRule(ShardRule):
    """HF ``Conv1D`` (weight ``(in, out)``, transposed): axis 1 = column parallel, axis 0 = row parallel."""

    def matches(self, mod):
        return type(mod).__name__ == "Conv1D" and hasattr(mod, "nf")

    def check(self, mod, name, axis):
        meta = module_meta(mod)
        if name == "bias":
            if axis != 0:
                return "a Conv1D bias has a single axis, 0"
            if meta["sharded"].get("weight") == 0:
                return ("the weight is sharded on axis 0 (row parallel), so the bias must stay replicated: "
                        "it is added once, after the all_reduce")
        if name == "weight" and axis == 0 and "bias" in meta["sharded"]:
            return "the bias is sharded, which only fits a column-parallel Conv1D weight (axis 1)"
        return None

    def apply(self, mod, name, axis, world_size, rank):
        if name != "weight":
            return
        if axis == 1:
            mod.nf = mod.weight.shape[1]
            _set_output(mod, "partition", -1)
        else:
            if hasattr(mod, "nx"):
                mod.nx = mod.weight.shape[0]
            _set_output(mod, "partial")
            module_meta(mod)["impl"] = _row_parallel_conv1d
            install_forward(mod)


class EmbeddingRule(ShardRule):
    """``nn.Embedding``: axis 0 = vocab parallel (masked lookup, partial output), axis 1 = hidden split."""

    def matches(self, mod):
        return isinstance(mod, nn.Embedding)

    def apply(self, mod, name, axis, world_size, rank):
        if axis == 0:
            meta = module_meta(mod)
            meta["vocab_start"] = rank * mod.weight.shape[0]
            meta["orig_padding_idx"] = mod.padding_idx
            mod.num_embeddings = mod.weight.shape[0]
            mod.padding_idx = None
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
        return (f"{type(mod).__name__} normalises over its whole feature dimension, so a sharded {name} would "
                "change the result; keep it replicated (sequence parallelism splits the sequence axis instead)")


_RULES: list[ShardRule] = [LinearRule(), Conv1DRule(), EmbeddingRule(), Conv2dRule(), BatchNormRule(), NormRule()]
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
