"""Pipeline refusals (issue 16, items 8 and 9): pipelines that cannot be right are refused in one sentence; errors from
transformers or the model become one sentence (or a working fallback).

* BatchNorm (training) / a contrastive model (CLIP) as more than one micro-batch: refused by
  ``partition_pipeline`` / ``build_pipeline`` (they know ``n_microbatches``) and by the export checks
  (they know the script's default micro-batches); one micro-batch per step is allowed. The cut itself
  is accepted: ``cut_pipeline_stage`` cannot know the number of micro-batches.
* A micro-batch that leaves BatchNorm one value per channel (the ResNet crash inside torchrun) is refused
  before anything is launched.
* DeBERTa-v2's ``Tensor.item()`` on meta: the dataflow graph is recorded on a small real copy.
* CLIP's megatron preset: no ``NotImplementedError`` from ``get_input_embeddings``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import slapo_lab as sl
from slapo_lab.export import ExportError, export_script
from slapo_lab.pipeline import partition_pipeline, set_example_inputs


def _resnet():
    from transformers import ResNetConfig, ResNetModel

    torch.manual_seed(0)
    cfg = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic")
    return ResNetModel(cfg)


def _clip():
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(0)
    text = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 99,
        "max_position_embeddings": 16,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "pad_token_id": 1,
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "image_size": 16,
        "patch_size": 8,
    }
    return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))


def _cut(model, inputs, path):
    sch = sl.create_schedule(model)
    set_example_inputs(sch, inputs)
    sch[path].cut_pipeline_stage()  # accepted: the number of micro-batches is not known yet
    return sch


def _one_sentence(text: str) -> None:
    assert text.endswith(".") and text.count(". ") == 0, text


@pytest.fixture(scope="module")
def resnet_cut():
    model = _resnet()
    x = {"pixel_values": torch.randn(4, 3, 32, 32)}
    return model, x, _cut(model, x, "encoder.stages.0")


def test_batchnorm_pipeline_with_micro_batches_is_refused(resnet_cut, tmp_path):
    model, x, sch = resnet_cut
    with pytest.raises(sl.ScheduleError) as err:
        partition_pipeline(sch, x, n_microbatches=2)
    msg = str(err.value)
    _one_sentence(msg)
    assert msg.startswith("Cannot pipeline ResNetModel as 2 micro-batches: embedder.embedder.normalization")
    for part in ("(BatchNorm2d)", "SyncBatchNorm", "n_microbatches=1", "GroupNorm or LayerNorm", "eval mode"):
        assert part in msg
    # the exported stages keep batch statistics even in the run's Verify (eval mode): refused whatever
    # the micro-batches (the default 4 / 2 = 2, or one of 4 rows)
    for defaults in ({}, {"micro_batch_size": 4}):
        with pytest.raises(ExportError) as err:
            export_script(tmp_path / "t.py", model, sch.record.calls, x, 1, defaults=defaults)
        msg = str(err.value)
        _one_sentence(msg)
        assert msg.startswith(
            "Cannot export ResNetModel as a pipeline: embedder.embedder.normalization (BatchNorm2d)"
        )
        assert "GroupNorm or LayerNorm" in msg and "eval mode in a factory" in msg


def test_batchnorm_pipeline_with_one_micro_batch_is_accepted(resnet_cut):
    model, x, sch = resnet_cut
    part = partition_pipeline(sch, x, n_microbatches=1)  # build_pipeline runs one micro-batch as GPipe
    assert part.num_stages == 2
    out = part.pipe(x["pixel_values"])
    out = out[0] if isinstance(out, (tuple, list)) else out
    with torch.no_grad():
        ref = model(**x).last_hidden_state  # training mode: the whole batch's statistics
    torch.testing.assert_close(out, ref)


def test_batchnorm_one_value_per_channel_is_refused_before_launch(tmp_path):
    """8x8 images leave the last stage 1x1: one row per micro-batch gives BatchNorm one value per channel."""
    model = _resnet()
    x = {"pixel_values": torch.randn(2, 3, 8, 8)}
    sch = _cut(model, x, "encoder.stages.0")
    with pytest.raises(sl.ScheduleError) as err:
        partition_pipeline(sch, {"pixel_values": x["pixel_values"][:1]}, n_microbatches=1)
    _one_sentence(str(err.value))
    assert str(err.value).startswith(
        "Cannot train ResNetModel on micro-batches of 1 row: encoder.stages.1.layers.0.layer.0.normalization "
        "(BatchNorm2d) would see one value per channel"
    )
    # without pipeline stages the crash is the same: refused at export, accepted with 2 rows
    with pytest.raises(ExportError, match="micro-batches of 1 row: encoder.stages.1") as err:
        export_script(tmp_path / "t.py", model, [], x, 1, defaults={"global_batch_size": 1})
    _one_sentence(str(err.value))
    export_script(tmp_path / "t.py", model, [], x, 1, defaults={"global_batch_size": 2})


def test_frozen_batchnorm_pipelines_with_micro_batches_and_equals_the_model():
    """BatchNorm put in eval mode (running statistics) is per sample: the pipeline keeps it frozen."""
    model = _resnet()
    x = {"pixel_values": torch.randn(4, 3, 32, 32)}
    sch = _cut(model, x, "encoder.stages.0")
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eval()
    part = partition_pipeline(sch, x, n_microbatches=2)
    assert [m.training for m in model.modules() if isinstance(m, nn.BatchNorm2d)] == [False] * 6
    out = part.pipe(x["pixel_values"][:2])
    out = out[0] if isinstance(out, (tuple, list)) else out
    with torch.no_grad():
        ref = model(pixel_values=x["pixel_values"][:2]).last_hidden_state
    torch.testing.assert_close(out, ref)


def test_contrastive_pipeline_with_micro_batches_is_refused(tmp_path):
    model = _clip()
    inputs = {"input_ids": torch.randint(3, 99, (4, 8)), "pixel_values": torch.randn(4, 3, 16, 16)}
    sch = _cut(model, inputs, "text_model")
    with pytest.raises(sl.ScheduleError) as err:
        partition_pipeline(sch, inputs, n_microbatches=2)
    msg = str(err.value)
    _one_sentence(msg)
    assert msg.startswith(
        "Cannot pipeline CLIPModel as 2 micro-batches: the model itself (CLIPModel) compares"
    )
    assert "contrastive loss" in msg and "n_microbatches=1" in msg
    with pytest.raises(ExportError, match="Cannot pipeline CLIPModel as 2 micro-batches") as err:
        export_script(tmp_path / "t.py", model, sch.record.calls, inputs, 1)
    _one_sentence(str(err.value))
    assert partition_pipeline(sch, inputs, n_microbatches=1).num_stages == 2


def test_clip_megatron_preset_leaks_no_transformers_error():
    from slapo_lab import presets

    sch = sl.create_schedule(_clip(), world_size=2)
    assert presets.vocab_size(sch) is None
    calls = presets.megatron_tp(sch)  # no NotImplementedError from get_input_embeddings
    assert any("get_input_embeddings() is not an nn.Embedding" in n for n in calls.notes)
    with pytest.raises(sl.ScheduleError) as err:
        presets.vocab_parallel_embeddings(sl.create_schedule(_clip(), world_size=2))
    _one_sentence(str(err.value))


def test_deberta_v2_dataflow_falls_back_to_a_real_copy():
    from transformers import DebertaV2Config, DebertaV2Model

    from slapo_lab.graph import record_dataflow
    from slapo_lab.utils import meta_copy, to_meta

    cfg = DebertaV2Config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=128,
        relative_attention=True,
        pos_att_type=["p2c", "c2p"],
    )
    meta = meta_copy(DebertaV2Model(cfg))
    inputs = to_meta({"input_ids": torch.zeros(2, 16, dtype=torch.long)})  # no mask: Tensor.item() on meta
    flow = record_dataflow(meta, inputs)
    assert flow.fallback.startswith("recorded on a real CPU copy") and "Tensor.item()" in flow.fallback
    assert flow.level_graph("").number_of_edges() >= 3
    assert flow.level_graph("encoder").number_of_edges() >= 4
    assert flow.call_count("encoder.layer.1") == 1
    assert all(p.is_meta for p in meta.parameters())  # the given model is untouched
    with pytest.raises(sl.graph.DataflowError) as err:
        record_dataflow(meta, inputs, real_fallback=False)
    assert "Tensor.item()" in str(err.value)


def test_dataflow_fallback_failure_is_one_sentence():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            if x.sum().item() > 1e9:  # .item() fails on meta
                return x
            raise ValueError("inputs of this kind are not supported")

    from slapo_lab.graph import DataflowError, record_dataflow

    with pytest.raises(DataflowError) as err:
        record_dataflow(Bad().to("meta"), (torch.zeros(2, 4, device="meta"),))
    msg = str(err.value)
    _one_sentence(msg)
    assert "failed on meta tensors" in msg and "on a small real copy" in msg and "inputs of this kind" in msg
