"""A norm over a layer's output plus the block's input (a residual) does not pass that layer's features on.

BERT-style blocks end their attention with ``LayerNorm(dense(context) + input_tensor)``, where ``input_tensor``
is the block's input handed to the ``SelfOutput`` module. The split inference maps a tensor from outside the
block that reaches a submodule (to find per-head arguments such as MPT's ALiBi bias), so that residual carries
an ``input:`` map; a sum with it is still a residual (:func:`slapo_lab.sharding.infer._residual`), and the norm
after it needs every feature of ``dense``: ``dense`` and ``intermediate.dense`` are not a column / row pair.
Where the attention itself cannot be read (Longformer's sliding-window chunks are ``as_strided`` views, heads
folded into the batch), the MLP pair is still ``intermediate.dense`` -> ``output.dense``, and the Megatron
preset on a tiny Longformer built from its config class passes the numeric check on 2 simulated ranks with
q / k / v / o and the MLP split.
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


def test_a_residual_from_outside_the_block_keeps_the_mlp_pair_after_the_attention():
    cfg = transformers.LongformerConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        attention_window=4,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LongformerForMaskedLM(cfg).eval()
    inputs = {"input_ids": torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(1))}
    sch = sl.create_schedule(copy.deepcopy(model), world_size=2)
    set_example_inputs(sch, inputs)
    block = "longformer.encoder.layer.0"
    split = infer.block_split(sch, block)
    assert split.roles.get("intermediate.dense") == "mlp_in"
    assert split.roles.get("output.dense") == "mlp_out"
    assert "attention.output.dense" not in split.roles
    assert "attention.output.LayerNorm" not in split.feature_params
    presets.megatron_tp(sch, vocab_parallel=presets.has_vocab_embedding(sch))
    for rel in ("attention.self.query", "attention.self.value", "intermediate.dense"):
        assert sch[f"{block}.{rel}"].mod.weight.shard_axis == 0, rel
    for rel in ("attention.output.dense", "output.dense"):
        assert sch[f"{block}.{rel}"].mod.weight.shard_axis == 1, rel
    report = numeric_check(model, sch.record.calls, 2, inputs)
    assert report.passed, report.message
