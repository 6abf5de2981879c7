"""Modules that couple the samples of a batch, which a pipeline split into micro-batches cannot honour.

A pipeline runs each step as ``n_microbatches`` micro-batches and averages their losses. That equals
the unsharded model only when every sample's loss depends on that sample alone. Two kinds of module
break it:

* **BatchNorm in training mode** (any ``torch.nn.modules.batchnorm._BatchNorm``: ``BatchNorm1d/2d/3d``,
  ``SyncBatchNorm``; or one without running statistics): it normalises with the statistics of the
  batch it sees, so each micro-batch gets its own statistics. ``SyncBatchNorm`` syncs over data-parallel
  ranks, not over micro-batches, so it is no fix. With one micro-batch per step the statistics are the
  whole batch's; BatchNorm in eval mode (running statistics) or GroupNorm / LayerNorm are per sample.
  A micro-batch that leaves BatchNorm one value per channel (one row after global pooling) fails in
  torch ("Expected more than 1 value per channel when training"): :func:`batchnorm_single_value`
  finds it on a meta copy before anything is launched.
* **A contrastive model** (HF ``CLIPModel``, ``SiglipModel``, ``BlipModel``, ... : a module with a
  ``logit_scale*`` parameter whose ``forward`` takes ``return_loss``): its logits and loss compare every
  sample with every other sample of the batch, so micro-batches compute a different loss.

:func:`coupling_refusal` turns them into one sentence for ``partition_pipeline`` / ``build_pipeline``
(which know ``n_microbatches``) and for the export checks (which know the script's defaults).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..call_order import _strip_schedule
from ..utils import meta_copy, to_meta


def _batch_stats(m: nn.Module) -> bool:
    """Whether the BatchNorm ``m`` normalises with batch statistics (training mode, or no running stats)."""
    return m.training or getattr(m, "running_mean", None) is None


def _contrastive(m: nn.Module) -> bool:
    if not any(n.startswith("logit_scale") for n, _ in m.named_parameters(recurse=False)):
        return False
    try:
        return "return_loss" in inspect.signature(m.forward).parameters
    except (TypeError, ValueError):
        return False


def batch_coupled_modules(model: nn.Module, all_batchnorms: bool = False) -> list[tuple[str, str, str]]:
    """Modules of ``model`` whose result depends on the other samples of the batch, in module order.

    Args:
        model: the model (any device, meta included).
        all_batchnorms: count every BatchNorm, whatever its mode (an exported script rebuilds the model
            in training mode).

    Returns:
        ``[(path, class name, kind)]`` with kind ``"batchnorm"`` or ``"contrastive"`` (path ``""`` is the root).
    """
    out = []
    for path, m in model.named_modules():
        if isinstance(m, _BatchNorm) and (all_batchnorms or _batch_stats(m)):
            out.append((path, type(m).__name__, "batchnorm"))
        elif _contrastive(m):
            out.append((path, type(m).__name__, "contrastive"))
    return out


class _Found(Exception):
    pass


def batchnorm_single_value(
    model: nn.Module, args: tuple = (), kwargs: dict | None = None, all_batchnorms: bool = False
) -> str | None:
    """The path of the first batch-statistics BatchNorm that sees one value per channel on these inputs.

    Runs ``model`` once on a meta copy (no memory, no compute) with ``args`` / ``kwargs`` of the
    micro-batch's shapes, e.g. ``input_ids`` of shape ``(micro_rows, seq)`` or ``pixel_values`` of shape
    ``(micro_rows, 3, H, W)``; ``all_batchnorms`` counts eval-mode BatchNorm too (a run that trains them).
    Returns None when no BatchNorm would fail, or when the model cannot run on meta tensors (then nothing
    is known).
    """

    def counted(m: nn.Module) -> bool:
        return isinstance(m, _BatchNorm) and (all_batchnorms or _batch_stats(m))

    if not any(counted(m) for m in model.modules()):
        return None
    try:
        copy = meta_copy(model)
        _strip_schedule(copy)
        names = {id(m): p for p, m in copy.named_modules()}

        def pre(mod, a):
            x = a[0] if a else None
            if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] and x.numel() // x.shape[1] <= 1:
                raise _Found(names.get(id(mod), ""))

        for m in copy.modules():
            if counted(m):
                m.register_forward_pre_hook(pre)
        with torch.no_grad():
            copy(*to_meta(tuple(args)), **to_meta(dict(kwargs or {})))
    except _Found as found:
        return str(found.args[0])
    except Exception:  # noqa: BLE001 - a model that fails on meta: unknown, not a refusal
        return None
    return None


def coupling_refusal(
    model: nn.Module,
    n_microbatches: int,
    one_microbatch: str,
    *,
    all_batchnorms: bool = False,
) -> str | None:
    """One sentence refusing to run ``model`` as ``n_microbatches`` micro-batches, or None when it may.

    Args:
        model: the (root) model.
        n_microbatches: micro-batches per step; 1 is always allowed here.
        one_microbatch: how the caller gets one micro-batch per step, e.g. ``"n_microbatches=1"``.
        all_batchnorms: see :func:`batch_coupled_modules`.
    """
    if n_microbatches <= 1:
        return None
    coupled = batch_coupled_modules(model, all_batchnorms)
    if not coupled:
        return None
    name = type(model).__name__
    path, cls, kind = coupled[0]
    where = f"{path} ({cls})" if path else f"the model itself ({cls})"
    if kind == "batchnorm":
        k = sum(1 for c in coupled if c[2] == "batchnorm") - 1
        more = f" (as are {k} more)" if k > 0 else ""
        return (
            f"Cannot pipeline {name} as {n_microbatches} micro-batches: {where} is a BatchNorm layer "
            f"normalising with batch statistics{more}, so every micro-batch gets different statistics and the "
            "pipeline cannot equal the unsharded model (SyncBatchNorm syncs ranks, not micro-batches, so it "
            f"is no fix); use one micro-batch per step ({one_microbatch}), replace BatchNorm with GroupNorm "
            "or LayerNorm, or put the BatchNorm layers in eval mode (running statistics)."
        )
    return (
        f"Cannot pipeline {name} as {n_microbatches} micro-batches: {where} compares every sample with every "
        "other sample of the batch (a contrastive loss such as CLIP's return_loss=True), so micro-batches "
        f"compute a different loss than the whole batch; use one micro-batch per step ({one_microbatch}) "
        "or train it without pipeline stages."
    )


def export_batchnorm_refusal(model: nn.Module, all_batchnorms: bool = False) -> str | None:
    """One sentence refusing to export ``model`` as a pipeline because of batch-statistics BatchNorm, or None.

    Exported stages keep the mode they were traced in, so BatchNorm keeps batch statistics even in the
    run's Verify and evaluation (eval mode: running statistics): the run could not equal the unsharded
    model whatever the number of micro-batches.
    """
    bns = [c for c in batch_coupled_modules(model, all_batchnorms) if c[2] == "batchnorm"]
    if not bns:
        return None
    path, cls, _ = bns[0]
    more = f" (as are {len(bns) - 1} more)" if len(bns) > 1 else ""
    return (
        f"Cannot export {type(model).__name__} as a pipeline: {path or 'the model itself'} ({cls}) is a "
        f"BatchNorm layer normalising with batch statistics{more}, which every micro-batch computes for "
        "itself and the exported stages keep even in the run's Verify and evaluation (running statistics), "
        "so the run could not equal the unsharded model (SyncBatchNorm is no fix across micro-batches); "
        "replace BatchNorm with GroupNorm or LayerNorm, or build the model with its BatchNorm layers in "
        'eval mode in a factory (factory="package.module:function").'
    )


def single_value_refusal(model: nn.Module, rows: int, path: str, fix: str) -> str:
    """The sentence for a BatchNorm that would see one value per channel in micro-batches of ``rows`` rows."""
    m = model.get_submodule(path) if path else model
    where = f"{path} ({type(m).__name__})" if path else f"the model itself ({type(m).__name__})"
    return (
        f"Cannot train {type(model).__name__} on micro-batches of {rows} row{'s' if rows != 1 else ''}: "
        f"{where} would see one value per channel in training mode and fail inside the run (Expected more "
        f"than 1 value per channel when training); {fix}, replace BatchNorm with GroupNorm or LayerNorm, or "
        "put the BatchNorm layers in eval mode (running statistics)."
    )
