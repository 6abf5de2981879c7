"""Tensor-parallel splits where a block's shapes come from its structure rather than from its projections.

Tiny transformers 5.x models built from their config classes (no downloads); the Megatron preset at TP 2, then
the numeric check on 2 simulated ranks (:func:`slapo_lab.numeric.numeric_check`):

* **index buffers of a meta copy** (:func:`slapo_lab.sharding.infer.analyse`, ``real=``): the editor analyses a
  meta copy, whose ``relative_position_index`` (Swin's gather of its per-head relative-position table) has no
  values; the remembered unscheduled model's buffer gives them, so the table (last axis = heads) follows the
  head split in every stage, the third stage included (its blocks are analysed inside it);
* **a reshape to the width read from the input** (:class:`slapo_lab.sharding.heads._LocalWidth`): TrOCR's
  attention reshapes its output with ``embed_dim`` from ``hidden_states.size()``; FSMT's compares
  ``self.embed_dim`` with its input's, so that attribute stays global;
* **depthwise convolutions on a column-parallel output** (kind ``"features"``, :class:`slapo_lab.sharding.feature_stats.DepthwiseConvRule`): SegFormer's Mix-FFN filters
  each of ``fc1``'s channels alone (``dwconv``), so each rank filters its own;
* **blocks of tokens** (LongT5's local attention: padded, cut into blocks, concatenated in threes, scored with
  ``einsum("...qhd,...khd->...hqk")``): the heads axis is told from the batch and block axes by the features;
* **a container of blocks** (PVT's ``encoder.block.i``, a list of layers of which only the first was
  analysed): every layer takes the analysed split;
* **blocks cut inside** (LeViT's stages, each a block of residual layers): the numeric check's shrunk copy
  keeps fewer layers of a stage, so it is analysed afresh, not served the full model's split; a
  ``BatchNorm1d`` after a column-parallel linear keeps its running statistics for this rank's features.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import slapo_lab as sl
from slapo_lab import presets
from slapo_lab.call_order import set_example_inputs
from slapo_lab.numeric import numeric_check
from slapo_lab.preset_check import set_reference
from slapo_lab.sharding import infer
from slapo_lab.sharding.heads import _local_shape, plan_local_heads, runtime_compared
from slapo_lab.utils import meta_copy

MODELS = {
    "swin": (
        "SwinConfig",
        "SwinForImageClassification",
        {"image_size": 32, "patch_size": 2, "embed_dim": 16, "depths": [2, 2, 2], "num_heads": [2, 2, 4]},
    ),
    "trocr": (
        "TrOCRConfig",
        "TrOCRForCausalLM",
        {
            "vocab_size": 128,
            "d_model": 64,
            "decoder_layers": 2,
            "decoder_attention_heads": 4,
            "decoder_ffn_dim": 128,
        },
    ),
    "longt5": (
        "LongT5Config",
        "LongT5ForConditionalGeneration",
        {
            "vocab_size": 128,
            "d_model": 32,
            "d_kv": 8,
            "d_ff": 64,
            "num_layers": 2,
            "num_heads": 4,
            "local_radius": 2,
            "encoder_attention_type": "local",
            "decoder_start_token_id": 0,
        },
    ),
    "pvt": (
        "PvtConfig",
        "PvtForImageClassification",
        {
            "num_encoder_blocks": 2,
            "image_size": 32,
            "depths": [2, 2],
            "sequence_reduction_ratios": [2, 1],
            "hidden_sizes": [16, 32],
            "patch_sizes": [4, 2],
            "strides": [4, 2],
            "num_attention_heads": [2, 2],
            "mlp_ratios": [2, 2],
        },
    ),
    "levit": (
        "LevitConfig",
        "LevitForImageClassification",
        {
            "image_size": 32,
            "hidden_sizes": [16, 32, 48],
            "num_attention_heads": [4, 4, 4],
            "depths": [2, 2, 2],
            "key_dim": [16, 16, 16],
            "mlp_ratio": [2, 2, 2],
            "attention_ratio": [2, 2, 2],
            "num_labels": 2,
        },
    ),
    "segformer": (
        "SegformerConfig",
        "SegformerForImageClassification",
        {
            "num_encoder_blocks": 2,
            "depths": [1, 1],
            "sr_ratios": [2, 1],
            "hidden_sizes": [16, 32],
            "patch_sizes": [7, 3],
            "strides": [4, 2],
            "num_attention_heads": [2, 2],
            "mlp_ratios": [2, 2],
        },
    ),
}


def _build(family: str):
    cfg_cls, model_cls, kw = MODELS[family]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**kw)
    if family == "swin":
        cfg.window_size = 4
    return getattr(transformers, model_cls)(cfg).eval()


def _inputs(family: str) -> dict:
    g = torch.Generator().manual_seed(3)
    if family == "trocr":
        return {"input_ids": torch.randint(1, 128, (2, 8), generator=g)}
    if family == "longt5":
        return {
            "input_ids": torch.randint(1, 128, (2, 12), generator=g),
            "decoder_input_ids": torch.randint(1, 128, (2, 6), generator=g),
        }
    return {"pixel_values": torch.randn(2, 3, 32, 32, generator=g)}


def _editor_schedule(model, inputs):
    """The schedule as the editor makes it: a meta copy, its example inputs and the unscheduled model."""
    sch = sl.create_schedule(meta_copy(model), world_size=2)
    set_example_inputs(sch, inputs)
    set_reference(sch, model)
    return sch


def _sharded_on(sch, path: str, name: str) -> int | None:
    return getattr(getattr(sch[path].mod, name), "shard_axis", None)


def test_swin_tables_follow_the_heads_on_a_meta_copy_in_every_stage():
    model, inputs = _build("swin"), _inputs("swin")
    sch = _editor_schedule(model, inputs)
    for stage in ("swin.encoder.layers.0", "swin.encoder.layers.1"):  # layers.1: analysed block by block
        split = infer.block_split(sch, stage)
        assert [(h.module, h.name, h.axis, h.heads) for h in split.head_params] == [
            (f"blocks.{i}.attention.relative_position_bias", "relative_position_bias_table", 1, 2)
            for i in (0, 1)
        ]
        assert {split.roles[f"blocks.1.attention.{p}_proj"] for p in "qkvo"} == {"q", "k", "v", "o"}
    presets.megatron_tp(sch, vocab_parallel=False)
    for stage in range(3):
        for block in range(2):
            attn = f"swin.encoder.layers.{stage}.blocks.{block}.attention"
            assert _sharded_on(sch, f"{attn}.relative_position_bias", "relative_position_bias_table") == 1
            for p, axis in (("q", 0), ("k", 0), ("v", 0), ("o", 1)):
                assert _sharded_on(sch, f"{attn}.{p}_proj", "weight") == axis, (attn, p)
    report = numeric_check(model, sch.record.calls, 2, inputs)
    assert report.passed, report.message


def test_an_attention_reshaping_to_its_input_width_gets_this_ranks_width():
    assert _local_shape(2 * 8 * 32, (2, 8, 64), 64, 32) == [2, 8, 32]
    assert _local_shape(2 * 8 * 64, (2, 8, 64), 64, 32) is None  # fits: untouched
    assert _local_shape(2 * 8 * 32, (2, -1, 64), 64, 32) is None  # -1: not a width read from the input
    model, inputs = _build("trocr"), _inputs("trocr")
    sch = sl.create_schedule(model, world_size=2)
    notes = presets.megatron_tp(sch, vocab_parallel=False).notes
    assert not any("self_attn" in n for n in notes), notes
    attn = sch["model.decoder.layers.0.self_attn"].mod
    assert sl.module_state(attn).attention_heads["width"] == [64, 32]
    report = numeric_check(_build("trocr"), sch.record.calls, 2, inputs)
    assert report.passed, report.message
    # FSMT asserts ``embed_dim == self.embed_dim`` (the input's width): that attribute stays global
    from transformers.models.fsmt.modeling_fsmt import Attention

    assert "embed_dim" in runtime_compared(Attention)
    plan, reason = plan_local_heads(Attention(64, 4), 4, 4, 2)
    assert reason is None and plan == {"num_heads": (4, 2)}


def test_segformer_depthwise_convolution_filters_this_ranks_channels():
    model, inputs = _build("segformer"), _inputs("segformer")
    sch = _editor_schedule(model, inputs)
    kinds = dict(presets.block_layers(sch, "segformer.stages.0"))
    pre = "segformer.stages.0.blocks.0.mlp."
    assert (kinds[pre + "fc1"], kinds[pre + "dwconv.dwconv"], kinds[pre + "fc2"]) == (
        "column",
        "features",  # its weight follows fc1's features: split by channels (sharding/feature_stats.py)
        "row",
    )
    notes = presets.megatron_tp(sch, vocab_parallel=False).notes
    assert not any("mlp" in n for n in notes), notes
    conv = sch[pre + "dwconv.dwconv"].mod
    assert tuple(conv.weight.shape) == (16, 1, 3, 3) and conv.groups == conv.in_channels == 16
    report = numeric_check(model, sch.record.calls, 2, inputs)
    assert report.passed, report.message


def test_longt5_local_attention_over_blocks_of_tokens_is_split_by_heads():
    model, inputs = _build("longt5"), _inputs("longt5")
    sch = _editor_schedule(model, inputs)
    split = infer.block_split(sch, "encoder.block.0")
    attn = "layer.0.LocalSelfAttention"
    assert split.attention[attn] == (4, 4)
    assert [split.roles[f"{attn}.{p}"] for p in "qkvo"] == ["q", "k", "v", "o"]
    notes = presets.megatron_tp(sch, vocab_parallel=False).notes
    assert notes == ["Kept whole on every rank: lm_head (outside the repeated blocks)."], notes
    assert _sharded_on(sch, f"encoder.block.0.{attn}.relative_attention_bias", "weight") == 1
    report = numeric_check(model, sch.record.calls, 2, inputs)
    assert report.passed, report.message


def test_every_layer_of_a_container_of_blocks_takes_the_analysed_split():
    model, inputs = _build("pvt"), _inputs("pvt")
    sch = _editor_schedule(model, inputs)
    split = infer.block_split(sch, "pvt.encoder.block.0")
    assert {split.roles[f"{i}.mlp.dense{j}"] for i in (0, 1) for j in (1, 2)} == {"mlp_in", "mlp_out"}
    assert split.roles["1.mlp.dense1"] == "mlp_in" and split.roles["1.attention.output.dense"] == "o"
    presets.megatron_tp(sch, vocab_parallel=False)
    for i in (0, 1):
        assert _sharded_on(sch, f"pvt.encoder.block.0.{i}.mlp.dense2", "weight") == 1
    report = numeric_check(model, sch.record.calls, 2, inputs)
    assert report.passed, report.message


def test_a_hybrid_stack_of_two_block_classes_is_found_and_split():
    from tests.family_sweep import build, families

    model, inputs = build("inkling2_text", families()["inkling2_text"][1])
    sch = _editor_schedule(model, inputs)
    assert presets.find_blocks(sch) == ["model.layers.0", "model.layers.1"]  # full and sliding layers
    presets.megatron_tp(sch, vocab_parallel=False)
    for i in (0, 1):  # the expert banks of both layer classes
        experts = sch[f"model.layers.{i}.mlp.experts"].mod
        assert any(getattr(p, "shard_axis", None) is not None for p in experts.parameters()), i
    report = numeric_check(model, sch.record.calls, 2, inputs)
    assert report.passed, report.message


def test_a_model_of_convolutions_only_is_refused_naming_what_its_blocks_hold():
    cfg = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic")
    sch = sl.create_schedule(transformers.ResNetForImageClassification(cfg).eval(), world_size=2)
    with pytest.raises(sl.ScheduleError) as ei:
        presets.megatron_tp(sch, vocab_parallel=False)
    assert str(ei.value) == (
        "ResNetForImageClassification has no dense projection (nn.Linear or HF Conv1D) in its 2 repeated blocks "
        "for the Megatron preset to split (they hold Conv2d x5, BatchNorm2d x5), so nothing is split."
    )


def test_levit_mlps_split_with_their_batch_norms_in_stages_the_check_cuts():
    model, inputs = _build("levit"), _inputs("levit")
    sch = _editor_schedule(model, inputs)
    mlp = "levit.encoder.stages.2.layers.1.module."
    kinds = dict(presets.block_layers(sch, "levit.encoder.stages.2.layers.1"))
    assert (kinds[mlp + "linear_up.linear"], kinds[mlp + "linear_up.batch_norm"]) == ("column", "features")
    # LeViT's attention wraps its fused linear and a batch norm in one module class that its MLP uses too: the
    # shard rules see them under the attention module around them (slapo_lab/sharding/attention_site.py), so
    # the attention is split as well (tests/unit/sharding/test_vision_splits.py)
    notes = presets.megatron_tp(sch, vocab_parallel=False).notes
    assert not any(n.startswith("Kept whole: in every LevitResidualLayer") for n in notes), notes
    bn = sch[mlp + "linear_up.batch_norm"].mod
    assert bn.running_mean.shape == bn.weight.shape == (48,)  # 96 features, this rank's half
    report = numeric_check(model, sch.record.calls, 2, inputs)
    assert report.passed, report.message
