"""Which blocks the split inference records, with what inputs, and how a block's split maps to other paths.

:func:`_stacks` finds the first block of each class among a model's stacks of blocks (``nn.ModuleList`` of one
class; otherwise each structure among hybrid stacks, as :func:`slapo_lab.presets.find_blocks` takes them),
:func:`_signature` tells blocks of one structure apart (classes, parameter names and global shapes),
:func:`_example_inputs` builds one sample of inputs (from the schedule's stored example inputs, or from the
forward's signature and config) and :func:`_real_buffers` pairs a meta copy's buffers with the real model's
values. :func:`_sub_split`, :func:`_prefixed` and :func:`_around` re-root a
:class:`~slapo_lab.sharding.infer_maps.BlockSplit` for a block nested in, or a container around, an analysed
block (Swin's stages, PVT's ``encoder.block.i``, Funnel's lists). Split from :mod:`slapo_lab.sharding.infer`.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from .infer_maps import BlockSplit, HeadParam, _is_dense


def _stacks(model: nn.Module, mixed: bool = False) -> list[tuple[str, nn.Module]]:
    """The first block of each class among the model's stacks of blocks (``nn.ModuleList`` of one class); where
    there is none, of each structure among its hybrid stacks (``mixed``: lists of blocks of several classes,
    each holding a dense layer, as :func:`slapo_lab.presets.find_blocks` takes them then)."""
    seen: set = set()
    out = []
    for p, m in model.named_modules():
        if not _is_stack(m, mixed):
            continue
        for j, kid in enumerate(m):
            sig = _signature(kid)
            if sig in seen or (mixed and not any(_is_dense(x) for x in kid.modules())):
                continue
            if any(kid is not b and _inside(kid, b) for _, b in out):
                continue
            seen.add(sig)
            out.append((f"{p}.{j}" if p else str(j), kid))
    return out or (_stacks(model, True) if not mixed else [])


def _is_stack(m: nn.Module, mixed: bool) -> bool:
    """Whether ``m`` is a stack of blocks: an ``nn.ModuleList`` of blocks of one class holding a dense layer, or
    (``mixed``) of several classes, some holding one; a list of lists (Funnel's blocks) is not (the blocks are
    inside, and they run)."""
    if not isinstance(m, nn.ModuleList) or len(m) < 1:
        return False
    kids = list(m)
    if mixed:
        if len(kids) < 2 or len({type(k) for k in kids}) < 2:
            return False
        if not any(any(_is_dense(x) for x in k.modules()) for k in kids):
            return False  # (a list beside convolution-only blocks, SwiftFormer's stages, is taken: those are skipped)
    elif len({type(k) for k in kids}) != 1 or not any(_is_dense(x) for x in kids[0].modules()):
        return False
    return not isinstance(kids[0], (nn.ModuleList, nn.ModuleDict))


def _inside(mod: nn.Module, outer: nn.Module) -> bool:
    return any(mod is m for m in outer.modules())


def _example_input(k: str, t: object, dev: torch.device, vocab: int) -> object:
    """A one-sample example of the stored input ``k`` (``t``: a tensor, possibly on the meta device, or any
    value, kept): random floats, remembered values, ones for a mask, zeros for an index into a table of
    another size than the vocabulary (index 0 is valid in every table), random token ids below ``vocab``."""
    if not isinstance(t, torch.Tensor):
        return t
    shape = (1, *t.shape[1:]) if t.dim() >= 1 else tuple(t.shape)
    if dev.type == "meta":
        return torch.empty(shape, dtype=t.dtype, device="meta")
    if t.is_floating_point():
        return torch.randn(shape, dtype=t.dtype, device=dev)
    if not t.is_meta:  # remembered values (call_order.VALUES_KEY): placeholder tokens
        return t[:1].to(dev) if t.dim() >= 1 else t.to(dev)
    if t.dtype == torch.bool or "mask" in k:
        return torch.ones(shape, dtype=t.dtype, device=dev)
    if "input_ids" not in k:
        # another index tensor (positions, entity ids, token types): the stored meta tensor has no values and
        # its table's size is not the vocabulary's, but index 0 is valid in every table
        return torch.zeros(shape, dtype=t.dtype, device=dev)
    return torch.randint(0, int(vocab), shape, dtype=t.dtype, device=dev)


def _example_inputs(model: nn.Module, stored: dict | None) -> dict | None:
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    cfg = getattr(model, "config", None)
    vocab = getattr(cfg, "vocab_size", None) or 2
    if stored:
        return {k: _example_input(k, t, dev, vocab) for k, t in stored.items()}
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    ids = lambda: torch.randint(1, int(vocab), (1, 8), device=dev)
    if "input_ids" in params:
        out = {"input_ids": ids()}
        if "decoder_input_ids" in params and getattr(cfg, "is_encoder_decoder", False):
            out["decoder_input_ids"] = ids()
        return out
    if "pixel_values" in params and cfg is not None:
        vis = getattr(cfg, "vision_config", None) or cfg
        size = getattr(vis, "image_size", None)
        size = size[0] if isinstance(size, (list, tuple)) else size
        ch = getattr(vis, "num_channels", 3)
        if isinstance(size, int):
            return {"pixel_values": torch.randn(1, ch, size, size, device=dev)}
    return None


def _real_buffers(model: nn.Module, real: nn.Module | None) -> dict[int, tuple]:
    """``{id(meta buffer of model): (it, real's buffer at the same path)}`` (same shape and dtype, on the
    CPU)."""
    if real is None or real is model:
        return {}
    theirs = dict(real.named_buffers())
    out = {}
    for name, buf in model.named_buffers():
        other = theirs.get(name)
        if (
            buf.is_meta
            and isinstance(other, torch.Tensor)
            and not other.is_meta
            and tuple(other.shape) == tuple(buf.shape)
            and other.dtype == buf.dtype
        ):
            out[id(buf)] = (buf, other.detach().to("cpu"))
    return out


def _signature(mod: nn.Module) -> tuple:
    """A block's structure: its modules' classes and its parameters' names and global shapes (blocks of one
    class may differ in their parameters: MiMo-V2-Flash's layers with and without attention sinks)."""
    return (
        type(mod),
        tuple((r, type(x).__name__) for r, x in mod.named_modules()),
        tuple((n, tuple(getattr(p, "orig_shape", p.shape))) for n, p in mod.named_parameters()),
    )


def _sub_split(split: BlockSplit, prefix: str) -> BlockSplit:
    """The part of ``split`` under ``prefix`` (a path inside its block), with paths relative to it."""
    pre = prefix + "."

    def cut(d):
        return {k[len(pre) :]: v for k, v in d.items() if k.startswith(pre)}

    return BlockSplit(
        cut(split.roles),
        cut(split.layouts),
        cut(split.whole),
        [
            HeadParam(hp.module[len(pre) :], hp.name, hp.axis, hp.heads)
            for hp in split.head_params
            if hp.module.startswith(pre)
        ],
        cut(split.attention),
        cut(split.refusals),
        cut(split.refused_roles),
        {k[len(pre) :] for k in split.shared if k.startswith(pre)},
        {k[len(pre) :] for k in split.grad_sum if k.startswith(pre)},
        {k[len(pre) :] for k in split.ran if k.startswith(pre)},
        head_inputs=[
            HeadParam(hi.module[len(pre) :], hi.name, hi.axis, hi.heads)
            for hi in split.head_inputs
            if hi.module.startswith(pre)
        ],
        feature_params={
            k[len(pre) :]: {x[len(pre) :] for x in v}
            for k, v in split.feature_params.items()
            if k.startswith(pre)
        },
        unpaired={k[len(pre) :] for k in split.unpaired if k.startswith(pre)},
    )


def _prefixed(split: BlockSplit, prefix: str) -> BlockSplit:
    """``split`` with ``prefix`` put before every path (the block seen from a container around it)."""
    pre = prefix + "."

    def add(d):
        return {pre + k: v for k, v in d.items()}

    return BlockSplit(
        add(split.roles),
        add(split.layouts),
        add(split.whole),
        [HeadParam(pre + hp.module, hp.name, hp.axis, hp.heads) for hp in split.head_params],
        {pre + k if k else prefix: v for k, v in split.attention.items()},
        {pre + k if k else prefix: v for k, v in split.refusals.items()},
        add(split.refused_roles),
        {pre + k for k in split.shared},
        {pre + k for k in split.grad_sum},
        {pre + k for k in split.ran},
        head_inputs=[HeadParam(pre + hi.module, hi.name, hi.axis, hi.heads) for hi in split.head_inputs],
        feature_params={pre + k: {pre + x for x in v} for k, v in split.feature_params.items()},
        unpaired={pre + k for k in split.unpaired},
    )


def _around(top, mod: nn.Module, full: str, result: dict) -> BlockSplit | None:
    """The split of a container of several blocks (PVT's ``encoder.block.i``, a list of layers whose first
    alone was analysed): every outermost child that is an analysed block, or has an analysed block's
    structure, with its split; None when fewer than two children have one (the callers' cases)."""
    sigs = [(_signature(top.mod.get_submodule(p)), split) for p, split in result.items()]
    parts: list[BlockSplit] = []
    taken: list[str] = []
    for rel, sub in mod.named_modules():
        if not rel or any(rel.startswith(t + ".") for t in taken):
            continue
        hit = result.get(f"{full}.{rel}" if full else rel)
        if hit is None:
            sig = _signature(sub)
            hit = next((split for want, split in sigs if want == sig), None)
        if hit is not None:
            parts.append(_prefixed(hit, rel))
            taken.append(rel)
    if len(parts) < 2:
        return None
    out = BlockSplit()
    for part in parts:
        for f in ("roles", "layouts", "whole", "attention", "refusals", "refused_roles"):
            getattr(out, f).update(getattr(part, f))
        for f in ("shared", "grad_sum", "ran"):
            getattr(out, f).update(getattr(part, f))
        out.head_params.extend(part.head_params)
    return out
