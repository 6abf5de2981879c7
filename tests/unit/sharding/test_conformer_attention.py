"""A conformer encoder's attention with a Shaw relative-position table, read from its dataflow.

``GraniteSpeechConformerAttention`` (transformers' ``modeling_granite_speech.py``) views q and the fused
``to_kv`` into blocks of ``context_size`` frames, ``(batch, blocks, heads, frames, head_dim)``, adds a Shaw
relative-position term (Shaw et al. 2018, "Self-Attention with Relative Position Representations":
``rel_pos_emb``, an ``nn.Embedding`` of one row per distance over ``head_dim``, shared by every head, multiplied
with q) as the attention mask of ``scaled_dot_product_attention``, and projects back with ``to_out``. On a tiny
encoder built from ``GraniteSpeechEncoderConfig`` the split inference reads q, the fused k|v, the output
projection and both feed-forward pairs; the embedding lookup keeps the table's map
(:func:`slapo_lab.sharding.channel_heads.embedding_rows`), so the table is found applied to the head-split q and
its gradient is summed over the ranks; the Megatron preset then splits every projection and passes the numeric
check on 2 simulated ranks (without that sum the table's gradient differs and the gate kept the attention whole).
(In the family sweep this encoder never runs: the sweep feeds GraniteSpeech token ids only.)
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


def test_conformer_attention_with_shaw_positions_splits_by_heads():
    cfg = transformers.GraniteSpeechEncoderConfig(
        input_dim=16,
        num_layers=2,
        hidden_dim=64,
        feedforward_mult=2,
        num_heads=4,
        dim_head=16,
        output_dim=8,
        context_size=8,
        max_pos_emb=16,
        conv_kernel_size=3,
    )
    torch.manual_seed(0)
    enc = transformers.GraniteSpeechCTCEncoder(cfg).eval()
    inputs = {"hidden_states": torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(1))}
    sch = sl.create_schedule(copy.deepcopy(enc), world_size=2)
    set_example_inputs(sch, inputs)
    split = infer.block_split(sch, "layers.0")
    assert {k: split.roles.get(k) for k in ("attn.to_q", "attn.to_kv", "attn.to_out")} == {
        "attn.to_q": "q",
        "attn.to_kv": "kv",
        "attn.to_out": "o",
    }
    assert split.attention == {"attn": (4, 4)} and not split.head_params
    assert "attn.rel_pos_emb" in split.grad_sum
    calls = presets.megatron_tp(sch)
    assert not any("in every" in n for n in calls.notes), calls.notes
    assert sch["layers.0.attn.to_kv"].mod.weight.shard_axis == 0
    assert sch["layers.0.attn.to_out"].mod.weight.shard_axis == 1
    cuda = torch.backends.cuda
    flags = (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled())
    report = numeric_check(enc, sch.record.calls, 2, inputs)
    assert report.passed, report.message
    # the conformer selects the math backend per call, on two rank threads at once: the check leaves the
    # process's attention backends as they were (else every later attention saves its whole score matrix)
    assert (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled()) == flags
