"""Grouped convolutions over attention heads (:mod:`slapo_lab.sharding.channel_heads`).

Nyströmformer adds ``Conv2d(heads, heads, (k, 1), groups=heads)`` of the value, laid out as ``(batch, heads,
tokens, head_dim)``, to its attention output. On a tiny model built from ``NystromformerConfig`` the split
inference reads from the dataflow that the convolution's channels are the value projection's heads (its weight
a per-head parameter on axis 0), the Megatron preset splits it with the heads, and the numeric check on 2
simulated ranks passes; without the convolution's split the same schedule fails.
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


def _nystromformer():
    cfg = transformers.NystromformerConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        num_landmarks=64,  # = segment_means_seq_len: the exact softmax attention (plus the convolution)
        segment_means_seq_len=64,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = transformers.NystromformerForMaskedLM(cfg).eval()
    inputs = {"input_ids": torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(1))}
    return model, inputs


def test_a_convolution_over_heads_is_split_with_the_heads():
    model, inputs = _nystromformer()
    sch = sl.create_schedule(copy.deepcopy(model), world_size=2)
    set_example_inputs(sch, inputs)  # Nyströmformer's segment means need the configured sequence length
    block = "nystromformer.encoder.layer.0"
    split = infer.block_split(sch, block)
    assert split.attention == {"attention.self": (4, 4)}
    assert infer.HeadParam("attention.self.conv", "weight", 0, 4) in split.head_params
    assert "attention.self.conv" not in split.grad_sum
    calls = presets.megatron_tp(sch, vocab_parallel=presets.has_vocab_embedding(sch))
    assert not any("in every" in n for n in calls.notes), (
        calls.notes
    )  # only the LM head's transform stays whole
    conv = sch[f"{block}.attention.self.conv"].mod
    assert conv.weight.shape[0] == 2 and conv.groups == conv.in_channels == 2
    report = numeric_check(model, sch.record.calls, 2, inputs)
    assert report.passed, report.message
    kept = [c for c in sch.record.calls if not c.path.endswith("attention.self.conv")]
    assert len(kept) < len(sch.record.calls)
    report = numeric_check(model, kept, 2, inputs)
    assert not report.passed, report.message
