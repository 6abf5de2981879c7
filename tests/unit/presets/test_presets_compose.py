"""Presets compose with what is already there (the quickstart types layer 0 by hand, then clicks Megatron),
and a vocabulary that does not divide by the world size stays replicated with one sentence saying so.

* one process: the preset skips tensors sharded the same way and syncs already there, refuses a tensor
  sharded on another axis in one sentence (nothing applied), and ends with the same calls as the preset alone;
* 2 gloo ranks (``tests/multirank/tp_train.py compose``): both schedules train like the unsharded model.
"""

from __future__ import annotations

import harness
import pytest
import torch
import tp_train
import zoo.matrix
from harness import launch_results
from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

import slapo_lab as sl
from slapo_lab import presets
from slapo_lab.errors import ScheduleError

SCRIPT = harness.TESTS / "multirank" / "tp_train.py"


def _bert():
    torch.manual_seed(0)
    return BertModel(
        BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128)
    )


def _key(c):
    return (c.path, c.primitive, repr(c.args), repr(sorted(c.kwargs.items())))


def test_megatron_completes_a_layer_sharded_by_hand():
    alone = sl.create_schedule(_bert(), world_size=2)
    presets.megatron_tp(alone)
    sch = sl.create_schedule(_bert(), world_size=2)
    tp_train.bert_typed_layer0_then_megatron(sch)
    assert sorted(map(_key, sch.record.calls)) == sorted(map(_key, alone.record.calls))
    assert len(sch.record.actions()) == 12  # 11 typed calls, then the preset as one action


def test_a_tensor_sharded_on_another_axis_is_refused_in_one_sentence_and_nothing_applies():
    sch = sl.create_schedule(_bert(), world_size=2)
    sch["encoder.layer.1.attention.self.key"].shard("weight", axis=1)
    n = len(sch.record.calls)
    with pytest.raises(ScheduleError) as info:
        presets.megatron_tp(sch)
    msg = str(info.value)
    assert msg == (
        "encoder.layer.1.attention.self.key.weight is already sharded on axis 1, but this preset shards it on "
        "axis 0; undo that shard (or shard it on axis 0) and apply the preset again."
    )
    assert len(sch.record.calls) == n
    assert sch["encoder.layer.0.attention.self.query"].mod.weight.shape == (64, 64)


def test_the_editor_applies_megatron_after_the_quickstart_cell_and_says_what_stayed_whole():
    model = _bert()
    ed = sl.ScheduleEditor(model, example_inputs={"input_ids": torch.randint(0, 100, (2, 8))}, world_size=2)
    sch = ed.schedule
    p = "encoder.layer.0.attention"
    for name in ("query", "key", "value"):
        sch[f"{p}.self.{name}"].shard("weight", axis=0)
    assert ed.apply_preset("megatron") is None, ed.message
    assert ed.message.startswith("Preset megatron recorded") and ed.check() == []

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=50257))
    ed = sl.ScheduleEditor(gpt2, example_inputs={"input_ids": torch.randint(0, 50257, (2, 8))}, world_size=4)
    assert ed.apply_preset("megatron") is None, ed.message
    assert ed.message.endswith(
        "The word embedding stays replicated: its vocabulary of 50257 does not divide by the world size 4 "
        "(pad the vocabulary to a multiple of 4 to shard it). "
        "Kept whole on every rank: lm_head (outside the repeated blocks)."
    )
    assert not hasattr(ed.schedule["transformer.wte"].mod.weight, "shard_axis") and ed.check() == []
    assert ed.schedule["transformer.h.0.attn.c_attn"].mod.weight.shape == (64, 48)


@pytest.mark.multirank
def test_composed_schedules_train_like_the_unsharded_model_on_two_ranks():
    rc, out, res = launch_results(SCRIPT, 2, ["compose"], 300)
    for case in (
        "bert_typed_layer0_then_megatron",
        "gpt2_odd_vocab_megatron_tp",
        "gemma3_vocab_parallel_megatron_tp",
        "whisper_encoder_and_decoder_megatron_tp",
        "deberta_v2_megatron_tp",
        "deberta_v3_shared_keys_megatron_tp",
    ):
        assert case in res, f"no result for {case} (torchrun exit {rc}):\n{out[-4000:]}"
        r = res[case]
        assert not r["bad"], f"{case}: " + "; ".join(r["bad"])
        assert r["verify"] is True and r["n_sharded"] > 0
        assert r["max_loss_diff"] <= 1e-5 and r["max_grad_diff"] <= 1e-5 and r["max_param_diff"] <= 1e-5, r


@pytest.mark.multirank
def test_fused_projections_train_like_the_unsharded_model_on_two_ranks():
    """Falcon (new decoder architecture, old per-head layout, ALiBi), BLOOM (ALiBi), Phi-3 (equal and unequal
    q/k/v blocks, gate/up): Verify passes and 3 SGD steps match the unsharded model within 1e-5."""
    rc, out, res = launch_results(SCRIPT, 2, ["fused"], 300)
    assert rc == 0, out[-4000:]
    for case, *_ in tp_train.FAMILY_CASES["fused"]:
        assert case in res, f"no result for {case} (torchrun exit {rc}):\n{out[-4000:]}"
        r = res[case]
        assert not r["bad"], f"{case}: " + "; ".join(r["bad"])
        assert r["verify"] is True and r["n_sharded"] > 0
        assert r["max_loss_diff"] <= 1e-5 and r["max_grad_diff"] <= 1e-5 and r["max_param_diff"] <= 1e-5, r
    # Phi-3's fused projections are strided (q/k/v blocks, gate/up), Falcon's and BLOOM's contiguous by heads
    assert "model.layers.0.self_attn.qkv_proj.weight" in res["phi3_gqa_megatron_tp"]["strided"]
    assert "model.layers.0.mlp.gate_up_proj.weight" in res["phi3_megatron_tp"]["strided"]
    assert res["bloom_megatron_tp"]["strided"] == []


def test_the_preset_says_which_dense_layers_stay_whole_and_why():
    from transformers import FalconConfig, FalconForCausalLM

    sch = sl.create_schedule(_bert(), world_size=2)
    assert presets.megatron_tp(sch).notes == [
        "Kept whole on every rank: pooler.dense (outside the repeated blocks)."
    ]
    torch.manual_seed(0)
    falcon = FalconForCausalLM(
        FalconConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    )
    sch = sl.create_schedule(falcon, world_size=2)
    # FalconConfig's default is multi-query attention: one key/value head, which every rank keeps beside its
    # query heads (read from the dataflow), so nothing in the blocks stays whole
    assert presets.megatron_tp(sch).notes == []
    assert sch["transformer.h.0.self_attention.query_key_value"].mod.weight.shape == (32 + 16 + 16, 64)
    assert sch["transformer.h.0.mlp.dense_h_to_4h"].mod.weight.shape == (128, 64)


def test_every_stack_of_blocks_is_found_and_a_model_without_a_vocabulary_embedding_gets_a_note():
    from transformers import CLIPConfig, CLIPModel

    sch = sl.create_schedule(zoo.matrix.whisper_model(), world_size=2)
    assert presets.find_blocks(sch) == [
        f"model.{s}.layers.{i}" for s in ("encoder", "decoder") for i in (0, 1)
    ]
    assert presets.megatron_tp(sch).notes == []  # every dense layer of both stacks is sharded
    assert sch["model.decoder.layers.1.encoder_attn.k_proj"].mod.weight.shape == (16, 32)

    tower = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    cfg = CLIPConfig(
        text_config={**tower, "vocab_size": 128},
        vision_config={**tower, "image_size": 32, "patch_size": 8},
        projection_dim=16,
    )
    sch = sl.create_schedule(CLIPModel(cfg), world_size=2)  # get_input_embeddings raises NotImplementedError
    notes = presets.megatron_tp(sch).notes
    assert notes[0] == (
        "No word embedding is sharded: the model's get_input_embeddings() is not an nn.Embedding, so its "
        "embeddings stay replicated."
    )
    assert (
        notes[1]
        == "Kept whole on every rank: visual_projection, text_projection (outside the repeated blocks)."
    )
    for name in ("text_model", "vision_model"):
        assert sch[f"{name}.encoder.layers.1.mlp.fc1"].mod.weight.shape == (32, 32)


def test_deberta_projections_are_recognised():
    sch = sl.create_schedule(zoo.matrix.deberta_v2_model(), world_size=2)
    calls = presets.megatron_tp(sch)
    att = "deberta.encoder.layer.1.attention.self"
    for name in ("query_proj", "key_proj", "value_proj", "pos_key_proj", "pos_query_proj"):
        assert sch[f"{att}.{name}"].mod.weight.shape == (16, 32), name
    assert sch[att].mod.num_attention_heads == 2
    assert calls.notes == [
        "Kept whole on every rank: cls.predictions.transform.dense (outside the repeated blocks)."
    ]


def test_dense_layers_kept_whole_are_a_replicated_finding_and_a_line_in_the_editor():
    from transformers import LlamaConfig, LlamaForCausalLM

    from slapo_lab.utils import meta_copy

    torch.manual_seed(0)
    # 3 key/value heads neither divide by nor divide 2 ranks: the attention stays whole, the MLP is split
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=128,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=3,
        )
    )
    sch = sl.create_schedule(meta_copy(llama), world_size=2)
    assert sl.check_schedule(sch, coverage=True) == []  # nothing sharded yet: nothing to say
    notes = presets.megatron_tp(sch).notes
    assert sl.check_schedule(sch) == []  # right as it is: not an open item
    found = sl.check_schedule(sch, coverage=True)
    assert [(f.kind, f.message) for f in found] == [("replicated", notes[0])]

    ed = sl.ScheduleEditor(llama, example_inputs={"input_ids": torch.randint(0, 128, (2, 8))}, world_size=2)
    assert ed._coverage.value == ""
    assert ed.apply_preset("megatron") is None, ed.message
    assert "self_attn.q_proj" in ed._coverage.value and ed._check.value == ""
    ed.undo()
    assert ed._coverage.value == ""


def test_a_preset_refused_by_an_earlier_action_offers_the_undo_that_resolves_it():
    ed = sl.ScheduleEditor(_bert(), example_inputs={"input_ids": torch.randint(0, 100, (2, 8))}, world_size=2)
    ed.schedule["encoder.layer.0.attention.self.query"].shard("weight", axis=1)  # typed: the other axis
    assert ed.apply_preset("megatron") == ed.message
    assert "is already sharded on axis 1, but this preset shards it on axis 0" in ed.message
    assert ed._btn_resolve.layout.display == "" and ed._btn_resolve.description.startswith("Undo: ")
    ed._btn_resolve.click()  # the offered click: undo the typed shard
    assert not ed.schedule.record.calls and ed._btn_resolve.layout.display == "none"
    assert ed.apply_preset("megatron") is None, ed.message
    assert ed._btn_resolve.layout.display == "none" and ed.check() == []
