"""Per-head buffers of an attention (:mod:`slapo_lab.sharding.head_buffers`), read from the dataflow.

MiniMax's lightning attention (transformers ``MiniMaxLightningAttention``, a tiny model from its config class,
``tests/family_sweep.py``'s ``build``) keeps its decay rates as buffers: ``slope_rate`` ``(heads, 1, 1)`` applied
to the key/value state, ``query_decay`` / ``key_decay`` ``(heads, block, 1)`` applied to q and k, and
``diagonal_decay`` ``(1, heads, block, block)`` applied to the scores. Each is split with the heads, the preset's
numeric check passes with every projection sharded, and each rank keeps its heads' rows.
"""

from __future__ import annotations

import warnings

from family_sweep import build

import slapo_lab as sl
from slapo_lab import presets
from slapo_lab.call_order import set_example_inputs
from slapo_lab.numeric import numeric_check
from slapo_lab.preset_check import set_reference
from slapo_lab.sharding import infer
from slapo_lab.utils import meta_copy


def test_lightning_attention_decays_follow_the_heads():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, inputs = build("minimax", "MiniMaxForCausalLM")
    sch = sl.create_schedule(meta_copy(model), world_size=2)
    set_example_inputs(sch, inputs)
    set_reference(sch, model)
    block = next(
        b for b in presets.find_blocks(sch) if hasattr(model.get_submodule(b).self_attn, "slope_rate")
    )
    attn = model.get_submodule(f"{block}.self_attn")
    heads = attn.num_attention_heads
    split = infer.block_split(sch, block)
    assert split.attention["self_attn"] == (heads, heads)
    found = {hp.name: (hp.axis, hp.heads) for hp in split.head_params if hp.module == "self_attn"}
    assert found == {
        "slope_rate": (0, heads),  # meets the k^T v state: kv * exp(-slope_rate * n)
        "query_decay": (0, heads),  # meets q
        "key_decay": (0, heads),  # meets k
        "diagonal_decay": (1, heads),  # meets the scores
    }
    presets.megatron_tp(sch, vocab_parallel=presets.has_vocab_embedding(sch))
    report = numeric_check(model, sch.record.calls, 2, inputs, timeout=100)
    assert report.status == "passed", report.message
    assert presets.replicated_dense(sch) is None  # every projection sharded
    local = sch[f"{block}.self_attn"].mod
    assert tuple(local.slope_rate.shape) == (heads // 2, 1, 1)
    assert tuple(local.query_decay.shape) == (heads // 2, *attn.query_decay.shape[1:])
    assert local.diagonal_decay.shape[1] == heads // 2
