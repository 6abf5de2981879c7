"""Mixture-of-experts routers: the layer that scores every expert for every token must stay whole.

A router (Mixtral's / Qwen3-MoE's ``mlp.gate``, a ``*TopKRouter`` in transformers 5.x, DeepSeek's ``MoEGate``)
is a linear map from the hidden state to one logit per expert, followed by a softmax and a top-k choice over
all experts. Split on its output features, each rank would pick its top-k among its own experts' scores and
normalise over them only; split on its input features, each rank would route on partial sums. Neither has a
sync that makes it right, so :func:`router_experts` lets ``shard`` refuse it in one sentence.

Recognised by structure, not by name: a module with a 2-D weight whose output features equal the number of
experts of a sibling expert bank (an ``nn.ModuleList`` of experts, or a module of 3-D per-expert parameter
banks as transformers 5.x stores them), or a module whose class name ends in ``Router``.
"""

from __future__ import annotations

from torch import nn

__all__ = ["router_experts"]


def _expert_count(mod: nn.Module, name: str) -> int | None:
    """The number of experts of ``mod`` when it is an expert bank, else None (a convolution's 3-D weight is
    ``(out channels, in channels / groups, kernel)``, no bank: Qwen3.5's depthwise ``conv1d`` beside its
    ``in_proj_qkv``)."""
    if isinstance(mod, nn.modules.conv._ConvNd):
        return None
    if isinstance(mod, nn.ModuleList) and len(mod) > 1 and "expert" in f"{name} {type(mod).__name__}".lower():
        return len(mod)
    if isinstance(mod, nn.modules.conv._ConvNd):  # a convolution's 3-D weight is filters, not experts
        return None
    banks = [p for p in mod.parameters(recurse=False) if p.dim() == 3]
    if banks and len({p.shape[0] for p in banks}) == 1:
        n = banks[0].shape[0]
        declared = getattr(mod, "num_experts", n)
        return n if declared == n else None
    return None


def router_experts(mod: nn.Module, parent: nn.Module | None) -> str | None:
    """The name of the expert bank that ``mod`` routes for (a sibling in ``parent``), ``""`` for a router
    recognised by its class alone, or None when ``mod`` is no router."""
    weight = getattr(mod, "weight", None)
    if parent is not None and isinstance(weight, nn.Parameter) and weight.dim() == 2:
        shape = getattr(weight, "orig_shape", weight.shape)
        for name, sib in parent.named_children():
            if sib is not mod and _expert_count(sib, name) == shape[0]:
                return name
    if type(mod).__name__.endswith("Router"):
        return ""
    return None
