"""A norm (or any module) whose parameters are sharded on the feature axis its statistics span.

OLMo 2's ``q_norm`` / ``k_norm`` normalise q and k over *all* heads' features, BitNet's ``attn_sub_norm`` /
``ffn_sub_norm`` normalise the attention output / the MLP's intermediate features before the row-parallel
projection, and ConvNeXt-V2's GRN divides by the mean over channels. Under tensor parallelism each rank holds
a contiguous slice of those features, so the module is right on a rank when

* its per-feature parameters (weight, bias) are sharded like the features: ``shard(name, axis=-1)``, and
* every reduction its forward makes over the feature axis is summed over the tensor-parallel group: a
  ``mean`` over the last axis is the all-reduced sum divided by the global width, a ``var`` is two such
  passes (the global mean, then the global mean of the squared deviations), ``F.layer_norm`` /
  ``F.rms_norm`` over the last axis are computed from those global statistics.

:class:`FeatureStatsRule` does both when a parameter of such a module is sharded on its last axis: the
module's own class ``forward`` runs under a :class:`torch.overrides.TorchFunctionMode` that replaces those
reductions (the class's formula, ``(1 + weight)`` scales, gates, casts ... is kept as it is). The sum goes
through :func:`~slapo_lab.sharding.sync_ops.all_reduce_backward` then
:func:`~slapo_lab.sharding.sync_ops.all_reduce_forward`: all-reduced in forward *and* in backward, because the
gradient reaching the statistic on one rank holds only that rank's features' part (the loss is replicated, the
normalised features are partitioned). So it runs on the numeric check's threaded ranks, in the exported
script (the recorded ``shard`` calls replay the rule) and under Verify. With no process group (simulated
planning) the all-reduce is the identity and only the shapes are right.

Sources: vLLM's ``RMSNormTP`` for MiniMax (``vllm/model_executor/layers/mamba/linear_attn.py``: the variance
all-reduced over the tensor-parallel group, divided by the world size); Megatron-Bridge's DiT attention
(``layernorm_across_heads``: gathers q / k over the TP group, normalises, scatters back -- the same result
with more traffic); Megatron-LM ``megatron/core/tensor_parallel/mappings.py`` for the forward/backward pairs.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..module_state import install_forward, module_meta
from . import sync_ops
from .rules import _RULES, NormRule, ShardRule, get_shard_rule, is_norm, register_shard_rule


def _global_sum(t: torch.Tensor, g) -> torch.Tensor:
    """``t`` summed over the tensor-parallel group ``g`` in forward, its gradient summed in backward."""
    if g is None or not g.live:
        return t
    return sync_ops.all_reduce_forward(sync_ops.all_reduce_backward(t, g), g)


def _dims(dim, nd: int) -> tuple[int, ...]:
    if dim is None:
        return tuple(range(nd))
    if isinstance(dim, int):
        dim = (dim,)
    return tuple(sorted(d % nd for d in dim))


class GlobalFeatureStats(TorchFunctionMode):
    """Inside a module whose input is this rank's ``local`` of ``factor * local`` features (last axis): every
    ``mean`` / ``sum`` / ``var`` / ``std`` over the last axis, and ``F.layer_norm`` / ``F.rms_norm`` over it,
    is computed over all ranks' features (see the module docstring)."""

    def __init__(self, group: sync_ops.TPGroup | None, local: int, factor: int) -> None:
        super().__init__()
        self.g, self.local, self.factor = group, local, factor

    def _mean(self, x, dims, keepdim=False, dtype=None):
        s = _global_sum(x.sum(dims, keepdim=keepdim, dtype=dtype), self.g)
        count = math.prod(x.shape[d] for d in dims) * self.factor
        return s / count

    def _var(self, x, dims, correction=1, keepdim=False):
        mean = self._mean(x, dims, keepdim=True)
        sq = self._mean((x - mean) ** 2, dims, keepdim=keepdim)
        n = math.prod(x.shape[d] for d in dims) * self.factor
        return sq * (n / (n - correction)) if correction else sq

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        x = args[0] if args else kwargs.get("input")
        if (
            name in ("mean", "sum", "var", "std", "layer_norm", "rms_norm")
            and isinstance(x, torch.Tensor)
            and x.dim() >= 1
            and x.shape[-1] == self.local
            and x.is_floating_point()
        ):
            rest = list(args[1:])
            kwargs.pop("input", None)
            if name in ("layer_norm", "rms_norm"):
                shape = rest[0] if rest else kwargs.get("normalized_shape")
                if len(tuple(shape)) == 1:
                    weight = rest[1] if len(rest) > 1 else kwargs.get("weight")
                    if name == "layer_norm":
                        bias = rest[2] if len(rest) > 2 else kwargs.get("bias")
                        eps = rest[3] if len(rest) > 3 else kwargs.get("eps", 1e-5)
                        mean = self._mean(x, (x.dim() - 1,), keepdim=True)
                        var = self._var(x, (x.dim() - 1,), correction=0, keepdim=True)
                        y = (x - mean) * torch.rsqrt(var + eps)
                    else:
                        bias = None
                        eps = rest[2] if len(rest) > 2 else kwargs.get("eps")
                        eps = torch.finfo(x.dtype).eps if eps is None else eps
                        y = x * torch.rsqrt(self._mean(x * x, (x.dim() - 1,), keepdim=True) + eps)
                    y = y * weight if weight is not None else y
                    return y + bias if bias is not None else y
            else:
                dim = rest.pop(0) if rest else kwargs.pop("dim", None)
                dims = _dims(dim, x.dim())
                if x.dim() - 1 in dims:
                    keepdim = rest.pop(0) if rest else kwargs.pop("keepdim", False)
                    if name in ("mean", "sum"):
                        dtype = kwargs.pop("dtype", None)
                        s = x.sum(dims, keepdim=keepdim, dtype=dtype)
                        return (
                            self._mean(x, dims, keepdim, dtype) if name == "mean" else _global_sum(s, self.g)
                        )
                    correction = kwargs.pop("correction", None)
                    if correction is None:
                        correction = 1 if kwargs.pop("unbiased", True) else 0
                    v = self._var(x, dims, correction, keepdim)
                    return v if name == "var" else v.sqrt()
        return func(*args, **kwargs)


def _feature_forward(self: nn.Module, *args, **kwargs):
    """The class forward with its reductions over the (sharded) feature axis made global."""
    meta = module_meta(self)
    local, factor = meta.feature_local, meta.feature_factor
    with GlobalFeatureStats(meta.tp_group, local, factor):
        return type(self).forward(self, *args, **kwargs)


def _has_own_rule(mod: nn.Module) -> bool:
    """Whether a rule other than the permissive default (and this one) claims ``mod``."""
    return any(
        not isinstance(r, FeatureStatsRule) and type(r) is not ShardRule and r.matches(mod) for r in _RULES
    )


class FeatureStatsRule(NormRule):
    """A norm, or a module no other rule claims and that holds no layer with parameters (ConvNeXt-V2's GRN),
    whose parameter is sharded on its *last* axis (the features): the parameter is a slice of per-feature
    values and the module's reductions over the features become global (:class:`GlobalFeatureStats`). Other
    axes keep the rule the module had (a norm's per-head rows, see :class:`~slapo_lab.sharding.rules.NormRule`;
    anything for another module)."""

    needs_group = True  # the shard primitive leaves the tensor-parallel group in the module's state

    def matches(self, mod: nn.Module) -> bool:
        if is_norm(mod):
            return True
        if isinstance(mod, (nn.Linear, nn.Embedding)) or any(
            p is not None for c in mod.children() for p in c.parameters()
        ):
            return False
        own = [p for p in mod._parameters.values() if p is not None]
        return bool(own) and not _has_own_rule(mod)

    def check(self, mod: nn.Module, name: str, axis: int) -> str | None:
        t = getattr(mod, name, None)
        if isinstance(t, torch.Tensor) and t.dim() >= 1 and axis == t.dim() - 1:
            return None
        return super().check(mod, name, axis) if is_norm(mod) else None

    def apply(self, mod: nn.Module, name: str, axis: int, world_size: int, rank: int) -> None:
        t = getattr(mod, name, None)
        if not isinstance(t, torch.Tensor) or axis != t.dim() - 1 or world_size <= 1:
            return
        meta = module_meta(mod)
        full = getattr(t, "orig_shape", t.shape)[-1]
        meta.feature_local, meta.feature_factor = t.shape[-1], max(full // max(t.shape[-1], 1), 1)
        for attr in ("normalized_shape",):
            shape = getattr(mod, attr, None)
            if isinstance(shape, tuple) and len(shape) == 1:
                setattr(mod, attr, (t.shape[-1],))
        meta.impl = _feature_forward
        install_forward(mod)
        meta.output_type, meta.output_axis = "partition", -1


class DepthwiseConvRule(ShardRule):
    """A depthwise convolution (``groups`` = in = out channels: one filter per channel, Inkling's short
    convolutions over k and v) sharded on axis 0 of its weight and bias: each rank filters its own channels, the
    output is partitioned on the channel axis. Other axes are refused (a filter is never split)."""

    def matches(self, mod: nn.Module) -> bool:
        return (
            isinstance(mod, nn.modules.conv._ConvNd)
            and mod.groups > 1
            and mod.groups == mod.in_channels == mod.out_channels
        )

    def check(self, mod: nn.Module, name: str, axis: int) -> str | None:
        if axis != 0:
            return f"a depthwise {type(mod).__name__} is split by channels (axis 0 of its {name}), not on axis {axis}"
        return None

    def apply(self, mod: nn.Module, name: str, axis: int, world_size: int, rank: int) -> None:
        if name == "weight":
            mod.in_channels = mod.out_channels = mod.groups = mod.weight.shape[0]
        meta = module_meta(mod)
        meta.output_type, meta.output_axis = "partition", 1


register_shard_rule(FeatureStatsRule())
register_shard_rule(DepthwiseConvRule())

__all__ = ["DepthwiseConvRule", "FeatureStatsRule", "GlobalFeatureStats", "get_shard_rule"]
