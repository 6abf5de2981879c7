"""Shard rule for HF mixture-of-experts blocks whose experts are stored as 3-D parameters.

transformers 5.x keeps all experts of a sparse MoE block in one module (``MixtralExperts``, Qwen3-MoE,
OLMoE ... decorated with ``@use_experts_implementation``): ``gate_up_proj`` of shape ``(experts, 2 *
intermediate, hidden)`` holds each expert's gate and up projections back to back on axis 1, ``down_proj``
of shape ``(experts, hidden, intermediate)`` maps back (``is_transposed`` models store both transposed:
``(experts, hidden, 2 * intermediate)`` and ``(experts, intermediate, hidden)``).

Tensor-parallel experts (Megatron's MLP split applied to every expert; HF's ``moe_tp_experts`` plan):

* ``gate_up_proj`` on its intermediate axis (1, or 2 when transposed) -- *strided* by 2 when gate and up
  are concatenated, so each rank keeps its slice of the gate *and* of the up projection (``shard_stride``
  = 2) and ``gate_up.chunk(2, dim=-1)`` inside the expert forward still separates them;
* ``down_proj`` on its intermediate axis (2, or 1 when transposed): each rank's experts produce partial
  sums, so the module's output type is ``"partial"`` and needs ``sync(mode="fwd_post",
  sync_op_or_fn="all_reduce")``;
* the module's inputs (hidden states and the router's ``top_k_weights``) feed every rank's partial
  computation, so their gradients are partial too: ``sync(mode="bwd_post", sync_op_or_fn="all_reduce")``
  on the experts module (the ``f`` of Megatron; the integer ``top_k_index`` is left alone).

* an output bias (GPT-OSS's ``down_proj_bias``) is added once over the ranks, as Megatron's row-parallel
  layer adds its bias after the reduce: rank 0 adds it, the others add it times 0 (so every rank runs the same
  collectives), and ``sync(bwd_post, all_reduce, param_grads=True)`` sums its gradient over the ranks.

The router (``gate``) stays replicated: every rank routes every token identically. The expert axis (0) is
refused: expert parallelism needs an all-to-all token exchange that this rule does not provide.
"""

from __future__ import annotations

import torch
from torch import nn

from ..module_state import install_forward, module_meta
from .rules import _RULES, ShardRule, ShardSite, register_shard_rule

UP_NAMES = ("gate_up_proj", "up_proj")
DOWN_NAME = "down_proj"


def is_experts_module(mod: nn.Module) -> bool:
    """Whether ``mod`` stores its experts as 3-D parameters (``gate_up_proj`` / ``up_proj`` + ``down_proj``)."""
    down = mod._parameters.get(DOWN_NAME) if isinstance(mod, nn.Module) else None
    if not isinstance(down, torch.Tensor) or down.dim() != 3:
        return False
    up = next((mod._parameters.get(n) for n in UP_NAMES if mod._parameters.get(n) is not None), None)
    return (
        isinstance(up, torch.Tensor) and up.dim() == 3 and isinstance(getattr(mod, "num_experts", None), int)
    )


def _transposed(mod: nn.Module) -> bool:
    """Whether the experts are stored transposed (``(experts, hidden, 2 * intermediate)`` /
    ``(experts, intermediate, hidden)``): the module's ``is_transposed`` where it has one, else read from the
    shapes, the hidden size being the axis the two weights share (Llama 4's ``Llama4TextExperts`` multiplies
    ``bmm(x, gate_up_proj)`` with no flag)."""
    flag = getattr(mod, "is_transposed", None)
    if isinstance(flag, bool):
        return flag
    up = next((mod._parameters.get(n) for n in UP_NAMES if mod._parameters.get(n) is not None), None)
    down = mod._parameters.get(DOWN_NAME)
    if (
        not isinstance(up, torch.Tensor)
        or not isinstance(down, torch.Tensor)
        or up.dim() != 3
        or down.dim() != 3
    ):
        return False
    (_, a, b), (_, c, d) = (
        tuple(getattr(up, "orig_shape", up.shape)),
        tuple(getattr(down, "orig_shape", down.shape)),
    )
    plain = b == c and a in (d, 2 * d)
    transposed = a == d and b in (c, 2 * c)
    return transposed and not plain


def intermediate_axis(mod: nn.Module, name: str) -> int | None:
    """The axis of ``name`` (an expert weight or bias) that holds the intermediate features, or None."""
    t = _transposed(mod)
    if name in UP_NAMES:
        return 2 if t else 1
    if name == DOWN_NAME:
        return 1 if t else 2
    if name in ("gate_up_proj_bias", "up_proj_bias"):
        return 1
    return None


def _experts_bias_once(self, *args, **kwargs):
    """The experts' forward with ``down_proj_bias`` added on rank 0 only, then the partial sum reduced (the
    ``fwd_post all_reduce`` sync registers its reducer here, as for a row-parallel linear)."""
    meta = module_meta(self)
    b = self._parameters["down_proj_bias"]
    if meta.bias_rank != 0:
        self._parameters["down_proj_bias"] = b * 0.0
    try:
        y = type(self).forward(self, *args, **kwargs)
    finally:
        self._parameters["down_proj_bias"] = b
    for fn in meta.partial_reducers:
        y = fn(y)
    return y


class ExpertsRule(ShardRule):
    """Tensor-parallel experts: ``gate_up_proj`` / ``up_proj`` column-like, ``down_proj`` row-like (see module doc).

    Output type after ``down_proj`` is sharded: ``"partial"`` (the experts' sum needs an all-reduce). The
    module also gets ``ModuleMeta.replicated_input = True``: it holds both halves of the MLP, so unlike
    a row-parallel linear its input is replicated and ``bwd_post all_reduce`` on it is right.
    """

    def matches(self, mod: nn.Module) -> bool:
        return is_experts_module(mod)

    def check(self, mod: nn.Module, name: str, axis: int) -> str | None:
        want = intermediate_axis(mod, name)
        if want is None:
            return (
                f"only the expert weights ({', '.join(n for n in (*UP_NAMES, DOWN_NAME) if n in mod._parameters)}) "
                "can be sharded, on their intermediate axis (tensor-parallel experts)"
            )
        if axis == 0 and name != "gate_up_proj_bias" and name != "up_proj_bias":
            return (
                "axis 0 splits the experts themselves (expert parallelism), which needs an all-to-all token "
                f"exchange; shard {name} on its intermediate axis {want} instead (tensor-parallel experts)"
            )
        if axis != want:
            return f"{name} holds the intermediate features on axis {want}; other axes would split the hidden size"
        return None

    def stride(self, site: ShardSite, axis: int) -> int:
        mod = site.mod
        if site.name in ("gate_up_proj", "gate_up_proj_bias") and getattr(mod, "is_concatenated", True):
            return 2  # [gate; up] back to back: each rank keeps its slice of both
        return 1  # interleaved (GPT-OSS: is_concatenated=False): a contiguous slice holds pairs of both

    def apply(self, mod: nn.Module, name: str, axis: int, world_size: int, rank: int) -> None:
        meta = module_meta(mod)
        meta.replicated_input = True
        if name == DOWN_NAME:
            meta.output_type = "partial"
            meta.output_axis = None
            if isinstance(getattr(mod, "intermediate_dim", None), int):
                mod.intermediate_dim = mod.down_proj.shape[axis]
            if mod._parameters.get("down_proj_bias") is not None and world_size > 1:
                # the output bias is added once over the ranks (Megatron's RowParallelLinear adds it after the
                # reduce): rank 0 adds it, the others add it times 0 (so its gradient, summed over the ranks by
                # sync(param_grads=True), reaches every rank and each rank runs the same collectives)
                meta.bias_rank = rank
                meta.impl = _experts_bias_once
                install_forward(mod)


__all__ = ["ExpertsRule", "intermediate_axis", "is_experts_module"]


def _register() -> None:
    if not any(isinstance(r, ExpertsRule) for r in _RULES):  # once, even if this module is reloaded
        register_shard_rule(ExpertsRule())


_register()
