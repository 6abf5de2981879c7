"""Example inputs that reach a multimodal model's vision or audio tower, found by running the model.

A vision-language or audio-language model given ``input_ids`` alone never runs its tower, so the numeric check
cannot judge the tower's split (:attr:`slapo_lab.numeric.NumericReport.unjudged`). Such a model's forward also
takes the tower's input (``pixel_values``, ``input_features``, ``input_values``, or a prefixed form such as
``image_pixel_values`` / ``audio_input_features``), often a mask beside it (``pixel_attention_mask``,
``input_features_mask``, ``feature_attention_mask``), and merges the tower's output rows into the text at
placeholder tokens: ``input_ids`` holding the config's ``image_token_id`` / ``audio_token_index`` ... once per
row of features (the ``*Processor`` classes of transformers expand one placeholder into that many).

:func:`multimodal_inputs` reads all of it from the model's structure and config, with no table of families:

1. **Tower inputs** from the forward's signature (parameters named ``pixel_values`` / ``input_features`` /
   ``input_values``, prefixed or not), shaped by the (sub-)config that holds the sizes: ``(B, num_channels,
   image_size, image_size)`` for images (else ``(B, 1, num_channels, image_size, image_size)``: one image
   per sample), ``(B, num_mel_bins, frames)`` for audio with ``frames`` taken from
   the audio config's own lengths (``2 * max_source_positions``, ``2 * n_window`` ...; the first that runs
   wins), ``(B, 4000)`` samples for raw audio. A forward parameter ending in ``_mask`` that shares a word with
   a tower input (``pixel_attention_mask`` ~ ``pixel_values``, ``feature_attention_mask`` ~
   ``input_features``) is given ones (every pixel / frame valid), else left out.
2. **How many placeholder tokens**, measured: the forward runs once with the tower inputs and no placeholder,
   with forward hooks on every module; each module output whose last axis is the text embedding's width is a
   candidate (``numel / width`` rows of features, most recent first: the tower's projector runs just before
   the merge), divided over the batch rows.
3. **Which token** is the placeholder: the integer config fields (the config and its sub-configs) whose name
   ends in ``_token_id`` / ``_token_index`` and that lie inside the vocabulary, those naming the tower's
   modality (``image``/``vision`` for pixels, ``audio``/``speech`` for audio) first; no placeholder at all is
   tried first (GIT prepends its image features to the text).
4. **Accepted** only when the forward with those inputs runs *and its output changes when the tower input is
   drawn again*: the tower's output reaches the model's output, so gradients through the tower are compared,
   not only its forward run.

Costs a few dozen forwards of the model (tiny models: well under a second each) and returns ``inputs``
unchanged when nothing is accepted.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["multimodal_inputs", "tower_input_names"]

#: Most forwards :func:`multimodal_inputs` runs per tower input before it gives up.
MAX_TRIES = 48
#: Audio samples for a raw-waveform tower input (``input_values``).
SAMPLES = 4000
_TOWER = re.compile(r"(?:^|_)(pixel_values|input_features|input_values)$")
_MODALITY = {
    "pixel_values": ("image", "vision", "pixel", "img"),
    "input_features": ("audio", "speech", "sound", "feature"),
    "input_values": ("audio", "speech", "sound"),
}
_COMMON_WORDS = {"attention", "mask", "values", "input", "inputs"}


def tower_input_names(model: nn.Module) -> list[str]:
    """The forward parameters of ``model`` that feed a vision or audio tower (``pixel_values``,
    ``image_pixel_values``, ``input_features``, ``audio_input_features``, ``input_values`` ...), in signature
    order; [] when the forward's signature cannot be read."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return []
    return [p for p in params if _TOWER.search(p)]


def _configs(cfg, depth: int = 0) -> Iterator[tuple[str, object]]:
    """``(name, config)`` for ``cfg`` and its sub-configs (attributes holding a config), depth first."""
    yield "", cfg
    if depth >= 2:
        return
    for k, v in vars(cfg).items():
        if hasattr(v, "to_dict") and not isinstance(v, dict) and v is not cfg:
            for n, c in _configs(v, depth + 1):
                yield f"{k}.{n}" if n else k, c


def _int(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _first(cfg, names: tuple[str, ...], prefer: tuple[str, ...]) -> tuple[object, int] | None:
    """``(config, value)`` of the first config (those whose path names a ``prefer`` word first) with an int
    field among ``names``."""
    found = list(_configs(cfg))
    found.sort(key=lambda nc: not any(w in nc[0] for w in prefer))
    for _, c in found:
        for n in names:
            v = getattr(c, n, None)
            if isinstance(v, (list, tuple)) and v and _int(v[0]):
                v = v[0]
            if _int(v):
                return c, v
    return None


def _words(name: str) -> set[str]:
    return {w.removesuffix("s") for w in name.split("_")} - {w.removesuffix("s") for w in _COMMON_WORDS}


def _image_shapes(cfg: Any, batch: int) -> list[tuple[int, ...]]:
    """Candidate pixel shapes from the vision config's image size and channels: one image per sample, or a
    list of images per sample (Idefics 3, ModernVBert); none without an image size."""
    size = _first(cfg, ("image_size",), ("vision", "image"))
    if size is None:
        return []
    chans = _first(cfg, ("num_channels",), ("vision", "image"))
    c = chans[1] if chans is not None else 3
    return [(batch, c, size[1], size[1]), (batch, 1, c, size[1], size[1])]


def _feature_shapes(cfg: Any, batch: int) -> list[tuple[int, ...]]:
    """Candidate audio feature shapes ``(batch, mel bins, frames)``: frames from the audio config's window
    fields (twice and once each), then a few short lengths; none without a mel-bin count."""
    mels = _first(cfg, ("num_mel_bins", "feature_size", "input_feat_per_channel"), ("audio", "speech"))
    if mels is None:
        return []
    sub = mels[0]
    frames: list[int] = []
    for field in ("max_source_positions", "n_window", "chunk_size", "max_audio_length"):
        v = _int(getattr(sub, field, None))
        if v is not None:
            frames += [2 * v, v]
    frames += [100, 64, 32]
    return [(batch, mels[1], f) for f in dict.fromkeys(x for x in frames if x <= 3000)]


def _variants(model: nn.Module, name: str, params, batch: int, g: torch.Generator) -> Iterator[dict]:
    """Candidate tensors for tower input ``name`` (and its masks), most likely first."""
    kind = _TOWER.search(name).group(1)
    cfg = model.config
    if kind == "pixel_values":
        shapes = _image_shapes(cfg, batch)
    elif kind == "input_features":
        shapes = _feature_shapes(cfg, batch)
    else:
        shapes = [(batch, SAMPLES)]
    masks = [
        p
        for p in params
        if p.endswith("_mask")
        and p not in ("attention_mask", "decoder_attention_mask")
        and _words(p) & _words(name)
    ]
    for shape in shapes:
        x = torch.randn(shape, generator=g)
        if kind == "pixel_values":
            mask_shape = (*shape[:-3], shape[-2], shape[-1])
        else:
            mask_shape = (shape[0], shape[-1])
        full = {name: x, **{m: torch.ones(mask_shape, dtype=torch.long) for m in masks}}
        yield full
        if masks:
            yield {name: x}


def _leaves(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _leaves(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _leaves(v)]
    if hasattr(x, "to_tuple"):
        return _leaves(x.to_tuple())
    return []


def _run(model: nn.Module, inputs: dict, width: int | None = None):
    """``(outputs or None, rows)``: the model's outputs on ``inputs`` (None when the forward raises) and, when
    ``width`` is given, the row counts (``numel / width``) of every module output of that width, latest first."""
    rows: list[int] = []
    hooks = []
    if width is not None:

        def note(_m, _a, out):
            for t in _leaves(out)[:1]:
                if t.is_floating_point() and t.dim() >= 2 and t.shape[-1] == width:
                    rows.append(t.numel() // width)

        hooks = [m.register_forward_hook(note) for m in model.modules()]
    try:
        with torch.no_grad():
            out = model(**inputs)
    except Exception:  # noqa: BLE001 - a candidate that does not fit the model is skipped
        out = None
    finally:
        for h in hooks:
            h.remove()
    return out, list(dict.fromkeys(reversed(rows)))


def _differs(a, b) -> bool:
    la, lb = _leaves(a), _leaves(b)
    return any(
        x.shape != y.shape or (x.is_floating_point() and not torch.allclose(x, y))
        for x, y in zip(la, lb, strict=False)
    )


def _placeholder_ids(model: nn.Module, kind: str, vocab: int) -> list[int]:
    ids: list[tuple[bool, int]] = []
    for path, c in _configs(model.config):
        for k, v in vars(c).items():
            if k.endswith(("_token_id", "_token_index")) and _int(v) is not None and v < vocab:
                named = any(w in f"{path}.{k}" for w in _MODALITY[kind])
                ids.append((not named, v))
    ids.sort(key=lambda t: t[0])
    return list(dict.fromkeys(v for _, v in ids))


def _with_placeholders(inputs: dict, token: int, per_row: int) -> dict:
    """``inputs`` with ``per_row`` copies of ``token`` written after the first token of every ``input_ids`` row
    (the rows grow by ``per_row``; a mask or token-type tensor of the same length grows with them)."""
    ids = inputs["input_ids"]
    seq = ids.shape[1]
    out = dict(inputs)
    run = torch.full((ids.shape[0], per_row), token, dtype=ids.dtype)
    out["input_ids"] = torch.cat([ids[:, :1], run, ids[:, 1:]], dim=1)
    for k, v in inputs.items():
        if (
            k != "input_ids"
            and isinstance(v, torch.Tensor)
            and v.dim() == 2
            and v.shape[1] == seq
            and k
            in (
                "attention_mask",
                "token_type_ids",
            )
        ):
            fill = torch.ones if k == "attention_mask" else torch.zeros
            out[k] = torch.cat([v[:, :1], fill((v.shape[0], per_row), dtype=v.dtype), v[:, 1:]], dim=1)
    return out


def multimodal_inputs(model: nn.Module, inputs: dict, *, seed: int = 0) -> dict:
    """``inputs`` (real tensors for one forward of ``model``, with ``input_ids`` of shape ``(B, S)``) extended
    so that every vision or audio tower of ``model`` runs and its output reaches the model's output (see the
    module docstring for how each part is read from the model).

    Args:
        model: a Hugging Face model on a real device (its forward runs a few dozen times, without gradients).
        inputs: keyword inputs that already run ``model`` (e.g. ``input_ids`` and ``use_cache=False``).
        seed: seeds the drawn images / audio features.

    Returns:
        a new dict: ``inputs`` plus, per tower input the forward takes, e.g. ``pixel_values`` ``(B, C, H, W)``
        or ``input_features`` ``(B, mel bins, frames)`` and its masks (ones), with ``input_ids`` grown to
        ``(B, S + n)`` by ``n`` placeholder tokens per row where the model merges ``n`` rows of features per
        sample. A tower input no candidate makes reach the output is left out; ``inputs`` itself when the
        model has no tower input, no ``input_ids``, or none is accepted. Never raises for a model that runs on
        ``inputs``.
    """
    names = [n for n in tower_input_names(model) if n not in inputs]
    ids = inputs.get("input_ids")
    if not names or not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return inputs
    params = inspect.signature(model.forward).parameters
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    width = getattr(emb, "embedding_dim", None)
    vocab = getattr(emb, "num_embeddings", None) or int(ids.max()) + 1
    batch = ids.shape[0]
    g = torch.Generator().manual_seed(seed)
    out = dict(inputs)
    for name in names:
        kind = _TOWER.search(name).group(1)
        tokens = _placeholder_ids(model, kind, vocab)
        tries = 0
        accepted = None
        for tower in _variants(model, name, params, batch, g):
            if tries >= MAX_TRIES or accepted is not None:
                break
            base = {**out, **tower}
            first, rows = _run(model, base, width)
            tries += 1
            candidates: list[dict] = [base] if first is not None else []
            counts = [r // batch for r in rows if r % batch == 0 and 0 < r // batch <= 4096]
            candidates += [_with_placeholders(base, t, n) for t in tokens for n in counts[:6]]
            for cand in candidates:
                if tries >= MAX_TRIES:
                    break
                got = first if cand is base else _run(model, cand)[0]
                tries += cand is not base
                if got is None:
                    continue
                again = dict(cand)
                again[name] = torch.randn(cand[name].shape, generator=g)
                tries += 1
                if _differs(got, _run(model, again)[0]):
                    accepted = cand
                    break
        if accepted is not None:
            out = accepted
    return out
