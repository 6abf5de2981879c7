"""Example inputs that reach a multimodal model's tower (:mod:`slapo_lab.multimodal_inputs`), on tiny real
Hugging Face models built from their config classes:

* Gemma 3 (SigLIP vision tower, a projector that pools the patch grid to ``mm_tokens_per_image`` rows): the
  inputs gain ``pixel_values`` and exactly ``mm_tokens_per_image`` placeholder tokens (``image_token_index``)
  per row, a count measured by running the model, not read from that field; the Megatron preset at TP 2 then
  shards the vision tower's projections and the numeric check judges them (``NumericReport.unjudged`` empty),
  where on ``input_ids`` alone it names them as never run;
* Qwen2-Audio (a Whisper-style audio encoder, ``feature_attention_mask`` beside ``input_features``): the
  placeholder count is the encoder's own ``_get_feat_extract_output_lengths`` of the frames, the audio
  placeholder (``audio_token_index``) is a top-level config field, and its ``num_mel_bins`` equals the text
  model's ``intermediate_size`` (the numeric check's shrunk copy keeps the one and halves the other, and folds
  the placeholder id as it folds the token ids: the test makes it shrink widths, as for a large model); the
  preset passes its own check and the numeric check with the tower judged;
* a text-only model and a model whose tower input cannot be made are returned their inputs unchanged.
"""

from __future__ import annotations

import torch
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2AudioConfig,
    Qwen2AudioForConditionalGeneration,
)

import slapo_lab as sl
from slapo_lab import numeric, presets
from slapo_lab.call_order import set_example_inputs
from slapo_lab.multimodal_inputs import multimodal_inputs, tower_input_names
from slapo_lab.numeric import numeric_check
from slapo_lab.preset_check import set_reference
from slapo_lab.utils import meta_copy

TEXT = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
}


def _text_inputs(seq: int = 16) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(3, 200, (2, seq), generator=g), "use_cache": False}


def _gemma3():
    cfg = Gemma3Config(
        text_config={**TEXT, "sliding_window": 8},
        vision_config={
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "image_size": 64,
            "patch_size": 16,
        },
        mm_tokens_per_image=4,  # the 4 x 4 patch grid pooled to 2 x 2
        image_token_index=250,
        boi_token_index=251,
        eoi_token_index=252,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return Gemma3ForConditionalGeneration(cfg).eval()


def _qwen2_audio():
    cfg = Qwen2AudioConfig(
        text_config={"model_type": "qwen2", **TEXT},
        audio_config={
            "d_model": 64,
            "encoder_ffn_dim": 128,
            "encoder_layers": 2,
            "encoder_attention_heads": 4,
            "num_mel_bins": 128,  # the text model's intermediate_size, too
            "max_source_positions": 16,
        },
        audio_token_index=255,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return Qwen2AudioForConditionalGeneration(cfg).eval()


def _preset_and_check(model, inputs: dict):
    sch = sl.create_schedule(meta_copy(model), world_size=2)
    set_example_inputs(sch, inputs)
    set_reference(sch, model)
    calls = presets.megatron_tp(sch, vocab_parallel=presets.has_vocab_embedding(sch))
    # the preset's own check ran on the remembered inputs, their placeholder tokens included
    assert not any("not checked" in n for n in getattr(calls, "notes", [])), calls.notes
    sharded = {c.path for c in sch.record.calls if c.primitive == "shard"}
    return sharded, numeric_check(model, sch.record.calls, 2, inputs, timeout=100.0)


def _placeholders(inputs: dict, token: int) -> list[int]:
    return (inputs["input_ids"] == token).sum(dim=1).tolist()


def test_gemma3_image_tower_is_fed_and_judged():
    model = _gemma3()
    text = _text_inputs()
    assert tower_input_names(model) == ["pixel_values"]
    inputs = multimodal_inputs(model, text)
    assert tuple(inputs["pixel_values"].shape) == (2, 3, 64, 64)
    assert _placeholders(inputs, 250) == [4, 4]  # mm_tokens_per_image per row, measured by running the model
    assert inputs["input_ids"].shape == (2, 20)
    model(**inputs)  # runs as built

    # on input_ids alone the check names the sharded vision tower as never run
    _, report = _preset_and_check(model, text)
    assert report.status == "passed"
    assert any("vision_tower" in m for m in report.unjudged)

    sharded, report = _preset_and_check(model, inputs)
    assert report.status == "passed", report.message
    assert report.unjudged == ()
    assert any(p.startswith("model.vision_tower.") for p in sharded), sharded


def test_qwen2_audio_tower_is_fed_and_judged(monkeypatch):
    monkeypatch.setattr(
        numeric, "SHRINK_ABOVE", 0
    )  # the check's copy with halved widths, as for a large model
    model = _qwen2_audio()
    text = _text_inputs()
    inputs = multimodal_inputs(model, text)
    frames = inputs["input_features"].shape[-1]
    assert tuple(inputs["input_features"].shape) == (2, 128, 32)  # 2 * max_source_positions frames
    assert inputs["feature_attention_mask"].shape == (2, frames)
    _, per_sample = model.model.audio_tower._get_feat_extract_output_lengths(torch.tensor([frames]))
    assert _placeholders(inputs, 255) == [int(per_sample)] * 2

    sharded, report = _preset_and_check(model, inputs)
    assert report.status == "passed", report.message
    assert report.unjudged == ()
    assert any(p.startswith("model.audio_tower.") for p in sharded), sharded


def test_models_without_a_reachable_tower_keep_their_inputs():
    cfg = LlamaConfig(**TEXT)
    llama = LlamaForCausalLM(cfg).eval()
    text = _text_inputs()
    assert tower_input_names(llama) == []
    assert multimodal_inputs(llama, text) is text
    one_row = {"input_ids": text["input_ids"][0]}  # not (batch, sequence): nothing to place tokens in
    assert multimodal_inputs(_gemma3(), one_row) is one_row
