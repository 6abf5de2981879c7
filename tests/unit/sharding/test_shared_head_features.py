"""Head-split features that also feed another linear keep their attention whole (:mod:`slapo_lab.sharding.fanout`).

ConvBERT's span-based dynamic convolution multiplies the query by a separable convolution of the hidden states
(``key_conv_attn_layer``: depthwise -> pointwise -> ``+ bias`` of shape ``(features, 1)``) and feeds the product
to ``conv_kernel_layer``, a linear over every head's query features. On a tiny ConvBERT built from its config
class the split inference reads from the dataflow that the query reaches that linear, refuses the attention's
heads in one sentence naming it, does not take the separable convolution's bias for a norm over the query's
features (its module's other parameters, the convolutions' weights, follow no feature), and still pairs
``intermediate.dense`` -> ``output.dense``; the Megatron preset then splits the MLP and passes the numeric
check on 2 simulated ranks.
"""

from __future__ import annotations

import copy

import torch
import transformers

import slapo_lab as sl
from slapo_lab import presets
from slapo_lab.call_order import set_example_inputs
from slapo_lab.numeric import numeric_check
from slapo_lab.sharding import infer


def test_a_query_that_feeds_a_dynamic_convolution_keeps_its_attention_whole():
    cfg = transformers.ConvBertConfig(
        vocab_size=128,
        hidden_size=64,
        embedding_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        conv_kernel_size=3,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.ConvBertForMaskedLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a zero bias would hide a bias sharded the wrong way
        for layer in model.convbert.encoder.layer:
            layer.attention.self.key_conv_attn_layer.bias.copy_(torch.randn(32, 1, generator=g))
    inputs = {"input_ids": torch.randint(1, 128, (2, 16), generator=g)}
    sch = sl.create_schedule(copy.deepcopy(model), world_size=2)
    set_example_inputs(sch, inputs)
    block = "convbert.encoder.layer.0"
    split = infer.block_split(sch, block)
    assert "attention.self.conv_kernel_layer" in split.refusals["attention.self"]
    assert not {"attention.self.query", "attention.self.key", "attention.self.value"} & set(split.roles)
    assert "attention.self.key_conv_attn_layer" not in split.feature_params
    assert split.roles == {"intermediate.dense": "mlp_in", "output.dense": "mlp_out"}
    calls = presets.megatron_tp(sch, vocab_parallel=presets.has_vocab_embedding(sch))
    assert any("conv_kernel_layer, a linear that would see only" in n for n in calls.notes), calls.notes
    assert sch[f"{block}.intermediate.dense"].mod.weight.shard_axis == 0
    assert sch[f"{block}.output.dense"].mod.weight.shard_axis == 1
    assert getattr(sch[f"{block}.attention.self.query"].mod.weight, "shard_axis", None) is None
    report = numeric_check(model, sch.record.calls, 2, inputs)
    assert report.passed, report.message
