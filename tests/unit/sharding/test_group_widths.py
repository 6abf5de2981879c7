"""A width read as one of a fixed number of fused groups stays global when the heads are split
(:func:`slapo_lab.sharding.heads.group_widths`).

CodeGen's ``qkv_proj`` holds ``mp_num`` groups, each ``[q | v | k]`` of its heads: ``qkv.view(..., -1, 3 *
local_dim)`` with ``local_dim = self.embed_dim // self.mp_num``. A rank keeps whole groups on the ``-1`` axis, so
``embed_dim`` must keep its global value there, while the head count becomes the rank's: the preset splits
``qkv_proj`` (contiguous whole groups, read from the dataflow) and ``out_proj``, and the numeric check passes.
"""

from __future__ import annotations

import copy

from torch import nn

import slapo_lab as sl
from slapo_lab import presets
from slapo_lab.call_order import set_example_inputs
from slapo_lab.module_state import peek_meta
from slapo_lab.numeric import numeric_check
from slapo_lab.preset_check import set_reference
from slapo_lab.sharding import heads, infer


class HeadWidthAttention(nn.Module):
    """A width divided by the head count (a head's width), and one read directly: both per rank."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.embed_dim, self.groups = 4, 32, 2
        self.qkv = nn.Linear(32, 96)

    def forward(self, x):
        hd = self.embed_dim // self.num_heads
        y = self.qkv(x).view(*x.shape[:-1], -1, 3 * hd)
        return y.reshape(*x.shape[:-1], 3 * self.embed_dim)


def test_only_a_width_divided_by_a_group_count_is_a_group_width():
    from transformers.models.codegen.modeling_codegen import CodeGenAttention
    from transformers.models.llama.modeling_llama import LlamaAttention

    assert heads.group_widths(CodeGenAttention) == frozenset({"embed_dim"})
    assert heads.group_widths(HeadWidthAttention) == frozenset()
    assert heads.group_widths(LlamaAttention) == frozenset()


def test_codegen_keeps_its_group_width_and_splits_qkv_by_whole_groups(monkeypatch):
    from tests.family_sweep import build, families, kept_whole

    model, inputs = build("codegen", families()["codegen"][1])
    sch = sl.create_schedule(copy.deepcopy(model), world_size=2)
    set_example_inputs(sch, inputs)
    set_reference(sch, model)
    split = infer.block_split(sch, "transformer.h.0")
    assert split.roles["attn.qkv_proj"] == "qvk" and split.roles["attn.out_proj"] == "o"
    assert split.layouts["attn.qkv_proj"] == infer.Layout("qvk", 1, 4)
    calls = presets.megatron_tp(sch, vocab_parallel=presets.has_vocab_embedding(sch))
    assert not any(n.startswith("Kept whole: in every") for n in calls.notes), calls.notes
    attn = sch["transformer.h.0.attn"].mod
    assert attn.embed_dim == model.transformer.h[0].attn.embed_dim
    rec = peek_meta(attn).attention_heads
    assert rec["heads"] == 4 and rec["world_size"] == 2 and "embed_dim" not in rec["attrs"]
    report = numeric_check(model, sch.record.calls, 2, inputs)
    assert report.passed, report.message
    assert kept_whole(sch, model, inputs) == []
    # with embed_dim made per rank, each rank views its qkv as groups of half the width: the outputs differ
    monkeypatch.setattr(heads, "group_widths", lambda cls: frozenset())
    report = numeric_check(model, sch.record.calls, 2, inputs)
    assert report.status == "failed" and "transformer.h.0.attn" in report.message, report.message
