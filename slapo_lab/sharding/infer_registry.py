"""The registry :mod:`slapo_lab.sharding.infer` fills from the recorded dataflow, and what the shard rules read.

Keys are ``(class name, [child name,] config digest)``: a config's digest (:func:`_config_digest`, a SHA-1 of
its JSON values) makes two models of the same class and config share what was inferred from one of them. Kept
below :mod:`~slapo_lab.sharding.infer` so that the modules infer itself imports (``attention_site``,
``feature_inputs``) read it without an import cycle.
"""

from __future__ import annotations

import hashlib
import weakref
from typing import Any

from torch import nn

_DIGESTS: dict[int, tuple] = {}  # id(config) -> (weak reference, digest): configs are read, not changed


def _config_digest(cfg: Any) -> str | None:
    """A digest of a config's values (the registry's key), cached per config object."""
    if cfg is None:
        return None
    hit = _DIGESTS.get(id(cfg))
    if hit is not None and hit[0]() is cfg:
        return hit[1]
    digest = _compute_digest(cfg)
    try:
        _DIGESTS[id(cfg)] = (weakref.ref(cfg), digest)
    except TypeError:  # not weakly referenceable: not cached
        pass
    return digest


def _compute_digest(cfg: Any) -> str:
    try:
        text = cfg.to_json_string(use_diff=False)
    except Exception:  # noqa: BLE001
        text = repr(sorted((k, repr(v)) for k, v in vars(cfg).items()))
    return hashlib.sha1(text.encode()).hexdigest()


# (attention class name, child name, config digest) -> (role, Layout or None, refusal or None)
_REGISTRY: dict = {}
_HEADS: dict = {}  # (attention class name, config digest) -> (heads, key/value heads)
_HEAD_INPUTS: dict = {}  # (attention class name, config digest) -> ((argument, heads axis), ...)


def lookup(parent: nn.Module | None, child: str) -> tuple | None:
    """``(role, Layout or None, refusal or None)`` inferred for ``parent``'s child ``child``, or None."""
    if parent is None:
        return None
    return _REGISTRY.get((type(parent).__name__, child, _config_digest(getattr(parent, "config", None))))


def inferred_heads(attn: nn.Module | None) -> tuple[int, int] | None:
    """``(heads, key/value heads)`` read from the dataflow of ``attn``'s class (and config), or None."""
    if attn is None:
        return None
    return _HEADS.get((type(attn).__name__, _config_digest(getattr(attn, "config", None))))


def inferred_head_inputs(attn: nn.Module | None) -> tuple:
    """``((argument name, heads axis), ...)``: the per-head tensor arguments ``attn``'s class (and config) takes,
    built for all heads outside its block (MPT's ALiBi ``position_bias``), read from the dataflow; ``()`` if none."""
    if attn is None:
        return ()
    return _HEAD_INPUTS.get((type(attn).__name__, _config_digest(getattr(attn, "config", None))), ())
