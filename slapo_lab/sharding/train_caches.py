"""Values a module caches from its parameters for evaluation, dropped when a parameter is sharded.

Some modules keep a tensor derived from a parameter between eval-mode forwards and drop it in their own
``train`` override, PyTorch's ``Module.train`` being the hook by which a module learns its parameters may have
changed: LeViT's ``LevitAttention`` caches ``attention_biases[:, attention_bias_idxs]`` per device in
``attention_bias_cache`` and clears it in ``train(True)``. After ``attention_biases`` is split by heads, a cache
filled by an earlier forward still holds every head's biases (``The size of tensor a (2) must match the size of
tensor b (4)``, or a silently wrong bias where the shapes broadcast). :func:`drop` lets such a module clear it
(``train(True)``), then restores every submodule's mode. Source: transformers
``models/levit/modeling_levit.py`` (``LevitAttention.train``; the same pattern as timm's ``levit.py``).
"""

from __future__ import annotations

from torch import nn


def drop(mod: nn.Module) -> None:
    """Run ``mod``'s own ``train`` override (if its class has one) in training mode, so it drops what it
    cached from its parameters, then put back the mode of ``mod`` and of each of its submodules."""
    if type(mod).train is nn.Module.train:
        return
    modes = [(m, m.training) for m in mod.modules()]
    mod.train(True)
    for m, was in modes:
        m.training = was
