"""The cluster-shape control: nodes x GPUs per node, TP x PP x DP in words, and the TP degree changed in the UI."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import slapo_lab as sl
from slapo_lab.editor.cluster import ClusterShape, data_parallel, degrees_text, tp_choices


def test_the_arithmetic_of_a_cluster():
    shape = ClusterShape(4, 8)
    assert shape.gpus == 32 and str(shape) == "4 nodes × 8 GPUs"
    assert tp_choices(shape) == [1, 2, 4, 8] and tp_choices(shape, current=16) == [1, 2, 4, 8, 16]
    assert data_parallel(shape, 4, 2) == (4, None)
    assert data_parallel(shape, 4, 3) == (
        2,
        (
            "TP 4 × PP 3 = 12 GPUs per replica does not divide the 32 GPUs of 4 nodes × 8 GPUs: 2 replicas use 24 "
            "and leave 8 idle."
        ),
    )
    assert data_parallel(ClusterShape(1, 4), 8, 1)[1] == (
        "One replica needs TP 8 × PP 1 = 8 GPUs, more than the 4 of 1 node × 4 GPUs."
    )
    assert "spans nodes" in data_parallel(ClusterShape(2, 8), 16, 1)[1]
    assert (
        degrees_text(4, 2, 4, "fsdp")
        == "tensor parallel 4 · pipeline 2 stages · data parallel 4 (FSDP) = 32 GPUs"
    )
    with pytest.raises(
        ValueError, match="The number of gpus per node must be a positive whole number, not 0."
    ):
        ClusterShape(1, 0)


def _gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=50257))


def test_the_editor_plans_for_nodes_times_gpus_and_says_the_three_degrees():
    ed = sl.ScheduleEditor(
        _gpt2(), example_inputs={"input_ids": torch.randint(0, 50257, (2, 8))}, world_size=4
    )
    assert "tensor parallel 4 · pipeline 1 stage · data parallel 1 = 4 GPUs" in ed._header.value
    assert ed.apply_preset("megatron") is None, ed.message
    assert ed.apply("cut_pipeline_stage", path="transformer.h.0") is None, ed.message
    assert "tensor parallel 4 · pipeline 2 stages · data parallel 1 = 8 GPUs" in ed._header.value
    assert ed.set_cluster(4, 8) is None
    assert ed._f_dp.value == "4" and ed.memory_plan.dp == 4
    assert "tensor parallel 4 · pipeline 2 stages · data parallel 4 = 32 GPUs" in ed._header.value
    assert "4 nodes × 8 GPUs" in ed._cluster_info.value
    assert ed.set_cluster(3, 4) == ed.message  # 12 GPUs for replicas of 8: one sentence, dp 1
    assert ed.message == (
        "TP 4 × PP 2 = 8 GPUs per replica does not divide the 12 GPUs of 3 nodes × 4 GPUs: 1 replica uses 8 and "
        "leaves 4 idle."
    )
    assert ed._f_dp.value == "1"


def test_the_tp_degree_changes_in_the_ui_by_replaying_or_says_what_blocks_it():
    ed = sl.ScheduleEditor(
        _gpt2(), example_inputs={"input_ids": torch.randint(0, 50257, (2, 8))}, world_size=4
    )
    assert ed.apply_preset("megatron") is None, ed.message
    ed.set_cluster(1, 8)
    assert list(ed._tp.options) == [1, 2, 4, 8]
    calls = list(ed.schedule.record.calls)
    ed._tp.value = 2  # the dropdown
    assert ed.world_size == 2 and ed.message == f"Replayed {len(calls)} recorded calls at TP 2 (was TP 4)."
    assert ed.schedule.record.calls == calls
    assert ed.schedule["transformer.h.0.attn.c_attn"].mod.weight.shape == (64, 96)
    assert "tensor parallel 2" in ed._header.value and ed._f_dp.value == "4"
    assert ed.set_tp(8) == ed.message  # 4 heads do not split over 8 ranks
    assert ed.message.startswith("The schedule stays at TP 2: at TP 8 ")
    assert ed.world_size == 2 and ed._tp.value == 2 and ed.schedule.record.calls == calls
    assert ed.schedule["transformer.h.0.attn.c_attn"].mod.weight.shape == (64, 96)
    ed.undo()
    assert ed.world_size == 2 and ed.schedule.record.calls == calls[: len(calls) - len(ed._redo[-1].calls)]
