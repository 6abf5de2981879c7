"""Sequence parallelism laid out from the model's structure (``slapo_lab/presets/sequence.py``), on real
Hugging Face models built tiny from their configs (the family sweep's builder), judged by the numeric check
(forward and every gradient against the unsharded model, 2 simulated ranks)."""

from __future__ import annotations

import family_sweep as fs
import pytest
import torch

import slapo_lab as sl
from slapo_lab import presets
from slapo_lab.call_order import set_example_inputs
from slapo_lab.numeric import numeric_check
from slapo_lab.numeric.culprit import _slice_of
from slapo_lab.preset_check import set_reference
from slapo_lab.utils import meta_copy


def _sp(family: str):
    model, inputs = fs.build(family, fs.families()[family][1])
    sch = sl.create_schedule(meta_copy(model), world_size=2)
    set_example_inputs(sch, inputs)
    set_reference(sch, model)
    return model, inputs, sch


def _syncs(sch, path: str) -> list[tuple]:
    return [
        (
            c.kwargs.get("mode"),
            c.kwargs.get("sync_op_or_fn"),
            c.kwargs.get("axis"),
            c.kwargs.get("tensor_parallel_output_grad"),
            c.kwargs.get("param_grads"),
        )
        for c in sch.record.calls
        if c.path == path and c.primitive == "sync"
    ]


def test_llama_gathers_at_the_attention_and_mlp_modules_and_checks_equal():
    model, inputs, sch = _sp("llama")
    presets.megatron_tp(sch, sequence_parallel=True)
    b = "model.layers.0"
    assert _syncs(sch, b) == [("fwd_pre", "scatter", -2, None, None)]
    assert _syncs(sch, "model.layers.1")[-1] == ("fwd_post", "all_gather", -2, False, None)
    # HF Llama reshapes q/k/v with its own input's sequence length: the gather is on self_attn's input,
    # not on each projection, and the projections only shard (the gather's backward sums their gradients)
    assert _syncs(sch, f"{b}.self_attn") == [("fwd_pre", "all_gather", -2, None, None)]
    assert _syncs(sch, f"{b}.mlp") == [("fwd_pre", "all_gather", -2, None, None)]
    assert _syncs(sch, f"{b}.self_attn.q_proj") == [] and _syncs(sch, f"{b}.mlp.up_proj") == []
    assert _syncs(sch, f"{b}.self_attn.o_proj") == [("fwd_post", "reduce_scatter", -2, None, None)]
    for norm in ("input_layernorm", "post_attention_layernorm"):
        assert _syncs(sch, f"{b}.{norm}") == [("bwd_post", "all_reduce", None, None, True)]
    report = numeric_check(model, sch.record.calls, 2, inputs)
    assert report.status == "passed", report.message


def test_bert_norm_after_the_row_layer_sums_its_gradient_and_checks_equal():
    model, inputs, sch = _sp("bert")
    presets.megatron_tp(sch, sequence_parallel=True)
    b = next(c.path for c in sch.record.calls if c.path.endswith("layer.0"))
    assert _syncs(sch, f"{b}.attention.self") == [("fwd_pre", "all_gather", -2, None, None)]
    assert _syncs(sch, f"{b}.intermediate.dense")[-1] == ("fwd_pre", "all_gather", -2, None, None)
    assert ("bwd_post", "all_reduce", None, None, True) in _syncs(sch, f"{b}.attention.output.LayerNorm")
    assert numeric_check(model, sch.record.calls, 2, inputs).status == "passed"


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_an_expert_bank_runs_on_the_whole_sequence_and_checks_equal(family):
    """The experts' split is no column-to-row pair on the tokens (the router and the experts read flattened
    tokens): the MoE module is an island, gathered in and scattered out, with plain TP inside (Qwen2-MoE's
    shared expert too)."""
    model, inputs, sch = _sp(family)
    presets.megatron_tp(sch, sequence_parallel=True)
    mlp = "model.layers.0.mlp"
    assert _syncs(sch, mlp) == [
        ("fwd_pre", "all_gather", -2, False, None),
        ("fwd_post", "scatter", -2, None, None),
    ]
    assert ("fwd_post", "all_reduce", None, None, None) in _syncs(sch, f"{mlp}.experts")
    assert _syncs(sch, f"{mlp}.gate") == []  # the router sees every token: its gradient is whole
    report = numeric_check(model, sch.record.calls, 2, inputs)
    assert report.status == "passed", report.message


def test_a_model_where_it_changes_the_result_is_refused_whole():
    """T5's cross-attention reads the encoder's sequence through k and v, whose input gradients the decoder's
    gathers do not sum: the numeric check sees it and the preset is refused in one sentence, nothing kept."""
    _model, _inputs, sch = _sp("t5")
    with pytest.raises(
        sl.ScheduleError, match=r"^Sequence parallelism is not applied, because .*EncDecAttention"
    ):
        presets.megatron_tp(sch, sequence_parallel=True)
    assert len(sch.record) == 0
    presets.megatron_tp(sch)  # without it the preset applies
    assert len(sch.record) > 0


def test_sequence_parallelism_over_the_plain_preset_names_the_earlier_all_reduce():
    """A schedule that already has the plain Megatron preset: its row layers all-reduce, which sequence
    parallelism would reduce-scatter; the SP preset says so in one sentence and records nothing."""
    _model, _inputs, sch = _sp("qwen2")
    presets.megatron_tp(sch)
    n = len(sch.record)
    with pytest.raises(sl.ScheduleError, match=r"o_proj already all-reduces its output .*; undo that before"):
        presets.megatron_tp(sch, sequence_parallel=True)
    assert len(sch.record) == n


def test_the_check_compares_a_sequence_slice_with_the_reference_slice():
    full = torch.arange(24.0).reshape(2, 6, 2)
    assert torch.equal(_slice_of(full[:, 3:], full, 1, 2), full[:, 3:])
    assert torch.equal(_slice_of(full, full, 0, 2), full)
    assert _slice_of(full[:, :2], full, 0, 2) is None  # a third is no rank's slice on 2 ranks
    assert _slice_of(full[:1, :3], full, 0, 2) is None  # two axes differ
    assert _slice_of(full[..., :1], full, 0, 2) is None  # features, not the sequence
    assert _slice_of(full[0, :3], full[0], 0, 2) is None  # 2-D: flattened tokens come in rank order


def test_the_editor_preset_records_it_or_says_in_one_sentence_why_not():
    """The editor's "Megatron + sequence parallelism" preset: recorded calls on a Llama, checked ✓; on T5 one
    sentence, the schedule as it was, and the plain preset still applies."""
    model, inputs = fs.build("llama", fs.families()["llama"][1])
    ed = sl.ScheduleEditor(model, example_inputs=inputs, world_size=2)
    assert ed.apply_preset("megatron_sp") is None, ed.message
    assert ed.message.startswith("Preset megatron_sp recorded")
    assert 'sch["model.layers.0"].sync(mode="fwd_pre", sync_op_or_fn="scatter", axis=-2)' in ed.code
    assert ed.numeric_check().status == "passed"
    t5, t5_inputs = fs.build("t5", fs.families()["t5"][1])
    ed = sl.ScheduleEditor(t5, example_inputs=t5_inputs, world_size=2)
    msg = ed.apply_preset("megatron_sp")
    assert msg == ed.message and msg.startswith(
        "The megatron_sp preset was not applied: Sequence parallelism is not applied, because"
    )
    assert len(ed.schedule.record.calls) == 0
    assert ed.apply_preset("megatron") is None, ed.message


def _llama(layers: int):
    """A tiny Llama of ``layers`` blocks on the zoo's decoder config (2 key/value heads), and its inputs."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from zoo.matrix import DECODER, VOCAB

    torch.manual_seed(0)
    cfg = LlamaConfig(**{**DECODER, "num_hidden_layers": layers}, num_key_value_heads=2)
    return LlamaForCausalLM(cfg), {"input_ids": torch.randint(0, VOCAB, (2, 16))}


def test_the_check_of_a_deeper_model_runs_on_two_blocks_that_end_with_the_gather():
    """Six blocks: the first scatters, the last gathers, the four between share one schedule. The check's copy
    keeps two blocks, the scatter on the first and the last block's gather on the second: the layout of a
    two-block model (checked in seconds whatever the depth). Each kept block runs its own calls (a kept block
    that shared an earlier one's schedule used to run unsharded in the copy)."""
    from slapo_lab.blocks import find_blocks
    from slapo_lab.numeric.shrink import _map_calls, _plan_blocks

    model, inputs = _llama(6)
    ed = sl.ScheduleEditor(model, example_inputs=inputs, world_size=2)
    assert ed.apply_preset("megatron_sp") is None, ed.message
    calls = list(ed.schedule.record.calls)
    blocks = find_blocks(ed.schedule)
    keep, alias, tails = _plan_blocks(calls, blocks)
    assert keep == {"model.layers": 2} and tails == {"model.layers.5": "model.layers.1"}
    assert alias["model.layers.0"] == "model.layers.0" and alias["model.layers.1"] == "model.layers.1"
    mapped = _map_calls(calls, blocks, alias, tails=tails)
    gathers = [
        c.path for c in mapped if c.kwargs.get("axis") == -2 and c.kwargs.get("sync_op_or_fn") == "all_gather"
    ]
    assert gathers[-1] == "model.layers.1" and "model.layers.5" not in {c.path for c in mapped}
    report = ed.numeric_check()
    assert report.status == "passed" and "2 of 6 blocks" in report.message, report.message
    # a middle block whose schedule repeats an earlier one's, kept because a later block differs, runs its calls
    ed.apply("checkpoint", path="model.layers.3")
    keep, alias, _ = _plan_blocks(list(ed.schedule.record.calls), blocks)
    assert keep == {"model.layers": 4} and alias["model.layers.2"] == "model.layers.2"
    assert ed.numeric_check().status == "passed"


def test_with_pipeline_stages_it_checks_equal_while_the_live_check_runs():
    """Sequence parallelism and two pipeline stages: the stages are captured with torch.export, which is not
    thread-safe; a check asked for while the editor's live check captures too waits for it instead of failing
    ("ProxyTorchDispatchMode slot already occupied")."""
    model, inputs = _llama(4)
    ed = sl.ScheduleEditor(model, example_inputs=inputs, world_size=2, live_check=True)
    assert ed.apply_preset("megatron_sp") is None, ed.message
    assert ed.apply_preset("stages", 2) is None, ed.message
    report = ed.numeric_check()
    assert report.status == "passed" and "as 2 pipeline stages" in report.message, report.message
    ed.wait_background(120)
    assert ed.numeric_report is not None and ed.numeric_report.status == "passed", ed.numeric_report
