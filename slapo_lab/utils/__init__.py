"""Small model utilities shared by the editor, export and planning."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn


def meta_copy(model: nn.Module) -> nn.Module:
    """A structural copy of ``model`` whose parameters and buffers live on the meta device.

    Costs no tensor memory (tied parameters stay tied: the deep-copy memo maps each original tensor
    to one meta tensor). The original model is not touched.
    """
    memo: dict[int, Any] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in memo:
            continue
        meta = torch.empty_like(t, device="meta")
        if isinstance(t, nn.Parameter):
            meta = nn.Parameter(meta, requires_grad=t.requires_grad)
            for k, v in t.__dict__.items():
                meta.__dict__.setdefault(k, v)
        memo[id(t)] = meta
    return copy.deepcopy(model, memo)


def iter_tensors(x: Any):
    """Every tensor in a nested structure (tensor, dict — HF ``ModelOutput`` included —, tuple, list)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from iter_tensors(v)
    elif isinstance(x, (tuple, list)):
        for v in x:
            yield from iter_tensors(v)
    elif hasattr(x, "to_tuple") and callable(x.to_tuple):
        yield from iter_tensors(x.to_tuple())


def to_meta(x: Any) -> Any:
    """Tensors in a nested structure (dict / tuple / list) moved to the meta device."""
    if isinstance(x, torch.Tensor):
        return torch.empty_like(x, device="meta")
    if isinstance(x, dict):
        return {k: to_meta(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(to_meta(v) for v in x)
    return x


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"`` (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"
