"""Head layouts the split inference reads from the dataflow of today's models (slapo_lab/sharding/infer.py).

Tiny transformers 5.x models built from their config classes by the family sweep's shrinker
(``tests/family_sweep.py`` :func:`build`), scheduled as the editor does (a meta copy, the example inputs and the
unscheduled model remembered), the Megatron preset at TP 2, then the numeric check on 2 simulated ranks:

* MPT: the ALiBi ``position_bias`` the model builds for all heads and passes to every attention module is a
  per-head *input* (read where it meets the scores), cut to each rank's heads by a pre-hook; MPNet's learned
  position bias, passed on from the layer to its attention module, is cut there and its gradient summed over
  the ranks;
* Llama 4: the complex rotary embedding (``view_as_complex`` / ``view_as_real``) carries the q / k feature maps,
  and its experts, stored transposed without an ``is_transposed`` flag, are read from the weights' shapes;
* MiMo-V2-Flash: blocks of one class that differ in their parameters (attention sinks in some layers only) are
  read one by one;
* DeBERTa: q_bias / v_bias, heads x head_dim features on one axis, are split with the heads (two per-head
  parameters on one module);
* NeoMME: a value projection whose heads also reach the output projection's input (exclusive self-attention) is
  split with its heads;
* GPT-OSS: a meta copy whose forward fails inside a block (its grouped-mm experts need real values) is read from
  the unscheduled model the schedule remembers (its attention sinks follow the heads).
"""

from __future__ import annotations

import warnings

import family_sweep as fs
import pytest
import torch

import slapo_lab as sl
from slapo_lab import presets
from slapo_lab.call_order import set_example_inputs
from slapo_lab.numeric import numeric_check
from slapo_lab.preset_check import set_reference
from slapo_lab.sharding import infer
from slapo_lab.utils import meta_copy


def _scheduled(family: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, inputs = fs.build(family, fs.families()[family][1])
    sch = sl.create_schedule(meta_copy(model), world_size=2)
    set_example_inputs(sch, inputs)
    set_reference(sch, model)
    return model, inputs, sch


def _preset_is_full_and_right(model, inputs, sch) -> None:
    calls = presets.megatron_tp(sch, vocab_parallel=presets.has_vocab_embedding(sch))
    assert not [n for n in calls.notes if n.startswith("Kept whole:")], calls.notes  # no region failed
    assert fs.kept_whole(sch) == []  # every projection of every block is sharded
    report = numeric_check(model, sch.record.calls, 2, inputs, timeout=fs.CHECK_TIMEOUT)
    assert report.passed, report.message


def test_mpt_alibi_position_bias_is_a_per_head_input_cut_to_each_ranks_heads():
    model, inputs, sch = _scheduled("mpt")
    split = infer.block_split(sch, "transformer.blocks.0")
    assert split.roles["attn.Wqkv"] == "qkv" and split.roles["attn.out_proj"] == "o"
    # (heads, 1, keys) built once by MptModel, added to the (batch, heads, queries, keys) scores
    assert split.head_inputs == [infer.HeadParam("attn", "position_bias", 0, 4)]
    _preset_is_full_and_right(model, inputs, sch)
    attn = sch["transformer.blocks.0.attn"].mod
    assert sl.module_state(attn).attention_heads["inputs"] == ["position_bias"]


def test_llama4_complex_rotary_and_transposed_experts_are_read():
    model, inputs, sch = _scheduled("llama4_text")
    split = infer.block_split(sch, "model.layers.0")
    assert {split.roles[f"self_attn.{p}_proj"] for p in "qkvo"} == {"q", "k", "v", "o"}
    _preset_is_full_and_right(model, inputs, sch)
    experts = sch["model.layers.0.feed_forward.experts"].mod  # (E, hidden, 2 x inter) / (E, inter, hidden)
    assert experts.gate_up_proj.shard_axis == 2 and experts.down_proj.shard_axis == 1


def test_blocks_of_one_class_that_differ_in_parameters_are_read_one_by_one():
    model, inputs, sch = _scheduled("mimo_v2_flash")
    first, second = (infer.block_split(sch, f"model.layers.{i}") for i in (0, 1))
    assert first.head_params == []
    assert second.head_params == [infer.HeadParam("self_attn", "sinks", 0, 4)]
    _preset_is_full_and_right(model, inputs, sch)


@pytest.mark.parametrize("family", ["gpt_oss"])
def test_a_meta_copy_that_fails_inside_a_block_is_read_from_the_remembered_model(family):
    model, inputs, sch = _scheduled(family)
    assert infer.analyse(sch.mod, inputs) == {}  # the meta forward fails in the experts' grouped mm
    split = infer.block_split(sch, "model.layers.0")
    assert split is not None and split.head_params == [infer.HeadParam("self_attn", "sinks", 0, 4)]
    _preset_is_full_and_right(model, inputs, sch)
    assert torch.equal(torch.tensor(sch["model.layers.0.self_attn"].mod.sinks.orig_shape), torch.tensor([4]))


def test_deberta_flat_per_head_biases_follow_the_heads():
    model, inputs, sch = _scheduled("deberta")
    split = infer.block_split(sch, "deberta.encoder.layer.0")
    # q_bias / v_bias of heads x head_dim features, viewed into heads where they are added to q and v
    assert split.head_params == [
        infer.HeadParam("attention.self", name, 0, 4) for name in ("q_bias", "v_bias")
    ]
    _preset_is_full_and_right(model, inputs, sch)
    attn = sch["deberta.encoder.layer.0.attention.self"].mod
    assert attn.q_bias.shape == attn.v_bias.shape == (32,)


def test_a_value_that_also_reaches_the_output_projection_by_head_is_split_with_its_heads():
    model, inputs, sch = _scheduled("neomme")
    split = infer.block_split(sch, "model.layers.0")
    # NeoMME's exclusive self-attention subtracts each head's value direction from its output before o_proj
    assert split.roles["self_attn.v_proj"] == "v" and split.roles["self_attn.output_projection.o_proj"] == "o"
    _preset_is_full_and_right(model, inputs, sch)


def test_a_learned_per_head_bias_passed_inward_is_cut_at_the_attention_and_its_gradient_summed():
    model, inputs, sch = _scheduled("mpnet")
    split = infer.block_split(sch, "mpnet.encoder.layer.0")
    # MPNetEncoder looks the (batch, heads, q, k) bias up once; MPNetLayer passes it on to attention.attn
    assert split.head_inputs == [infer.HeadParam("attention.attn", "position_bias", 1, 4)]
    _preset_is_full_and_right(model, inputs, sch)  # the table's gradient: the ranks' heads summed
