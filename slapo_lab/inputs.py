"""Example inputs made from a Hugging Face model's config and forward signature, when the user gave none.

The numeric check behind presets (:mod:`slapo_lab.preset_check`) and export needs one forward's keyword
inputs. Users pass ``example_inputs=`` to the editor; a typed ``presets.megatron_tp(sch)`` has none. For a
Hugging Face model they follow from the model: ``main_input_name`` (``input_ids``, ``pixel_values``,
``input_features``, ``input_values``) shaped by its config, plus ``decoder_input_ids`` for an encoder-decoder
and ``input_ids`` beside ``pixel_values`` for a two-tower model (CLIP). Tensors are on the meta device: the
numeric check draws them (token ids inside the vocabulary).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

__all__ = ["inputs_from_config"]

BATCH, SEQ = 2, 16


def _cfg_get(cfg, *names, sub=("vision_config", "text_config", "audio_config", "encoder")):
    for n in names:
        v = getattr(cfg, n, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    for s in sub:
        c = getattr(cfg, s, None)
        if c is not None and not isinstance(c, dict):
            for n in names:
                v = getattr(c, n, None)
                if isinstance(v, int) and not isinstance(v, bool):
                    return v
    return None


def _image(cfg) -> torch.Tensor | None:
    size = getattr(cfg, "image_size", None)
    if size is None:
        size = getattr(getattr(cfg, "vision_config", None), "image_size", None)
    if isinstance(size, (list, tuple)):
        h, w = int(size[0]), int(size[-1])
    elif isinstance(size, int):
        h = w = size
    else:
        return None
    ch = _cfg_get(cfg, "num_channels") or 3
    return torch.empty(BATCH, ch, h, w, device="meta")


def _takes_token_ids(params: Any, main: str) -> bool:
    """Whether a forward with parameters ``params`` and main input ``main`` gets token ids: a text model's, or
    an image-text model's beside its pixels."""
    return "input_ids" in params and (
        main == "input_ids" or (main == "pixel_values" and "pixel_values" in params)
    )


def _takes_pixels(cfg: Any, params: Any, main: str, has_token_ids: bool) -> bool:
    """Whether the forward gets pixels: a vision model's, or an image-text model's beside its token ids when
    its config gives an image size."""
    return main == "pixel_values" or ("pixel_values" in params and has_token_ids and _image(cfg) is not None)


def _audio_features(cfg: Any) -> torch.Tensor | None:
    """Meta log-mel features ``(BATCH, mel bins, 2 * max_source_positions)`` of a speech encoder's config, or
    None when it does not give both sizes."""
    mels = _cfg_get(cfg, "num_mel_bins", "feature_size")
    frames = _cfg_get(cfg, "max_source_positions")
    if mels is None or frames is None:
        return None
    return torch.empty(BATCH, mels, 2 * frames, device="meta")


def inputs_from_config(model: nn.Module) -> dict | None:
    """Meta-device keyword inputs for one forward of Hugging Face ``model``, or None when unknown.

    Returns:
        e.g. ``{"input_ids": (2, 16) int64}``, ``{"pixel_values": (2, C, H, W)}``, ``{"input_features":
        (2, num_mel_bins, 2 * max_source_positions)}``, ``{"input_values": (2, 4000)}``, plus
        ``decoder_input_ids`` (2, 8) for an encoder-decoder; None for a model without a config or with a
        main input of another kind.
    """
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "to_dict"):
        return None
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    main = getattr(model, "main_input_name", "input_ids")
    out: dict[str, torch.Tensor] = {}
    if _takes_token_ids(params, main):
        out["input_ids"] = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
    if _takes_pixels(cfg, params, main, "input_ids" in out):
        img = _image(cfg)
        if img is None:
            return None
        out["pixel_values"] = img
    if main in ("input_features", "input_values"):
        audio = _audio_features(cfg) if main == "input_features" else torch.empty(BATCH, 4000, device="meta")
        if audio is None:
            return None
        out[main] = audio
    if not out:
        return None
    if getattr(cfg, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        out["decoder_input_ids"] = torch.empty(BATCH, SEQ // 2, dtype=torch.long, device="meta")
    return out
