"""Fused projections (issue 16 item 4): column parallel with the layout read from the attention module.

* Falcon's ``self_attention.query_key_value``: with ``new_decoder_architecture`` one ``[q x heads/kv, k, v]``
  group per key/value head (a contiguous shard by groups), without multi-query attention per head
  ``[q, k, v]`` (a contiguous shard by heads), with multi-query attention ``[q; k; v]`` blocks whose query
  block is split and whose one key/value head every rank keeps (a ``BlockStride`` with ``replicas``, read from
  the dataflow); ALiBi (``alibi=True``) is cut to each rank's heads;
* BLOOM's ``query_key_value`` (per head ``[q, k, v]``) and its ALiBi bias, cut to each rank's heads;
* Phi-3's ``qkv_proj`` (``[q; k; v]`` blocks, unequal under grouped-query attention: a ``BlockStride``) and
  ``gate_up_proj`` (``[gate; up]``), with a per-module config holding this rank's head counts;
* GPT-2's ``c_attn`` as before.

Numerics: :func:`slapo_lab.numeric.numeric_check` over 2 and 4 simulated ranks against the unsharded model;
the two-rank gloo training runs are in tests/unit/presets/test_presets_compose.py (``tp_train.py fused``).
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import zoo.tp

import slapo_lab as sl
from slapo_lab import presets
from slapo_lab.numeric import numeric_check
from slapo_lab.sharding.placements import ShardLayout, layout_of
from slapo_lab.sharding.rules import BlockStride, local_shard, merge_shards
from tests.harness import REPO_ROOT, launch_results

INPUTS = {
    "input_ids": torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(3)),
    "use_cache": False,
}


def _falcon(**kw):
    from transformers import FalconConfig, FalconForCausalLM

    cfg = {"vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, **kw}
    return FalconForCausalLM(FalconConfig(**cfg))


def _phi3(heads=4, kv=4):
    from transformers import Phi3Config, Phi3ForCausalLM

    return Phi3ForCausalLM(
        Phi3Config(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            pad_token_id=0,
            bos_token_id=0,
            eos_token_id=0,
        )
    )


def _bloom():
    from transformers import BloomConfig, BloomForCausalLM

    return BloomForCausalLM(BloomConfig(vocab_size=128, hidden_size=64, n_layer=2, n_head=4))


# (name, builder for world size 2, builder for world size 4): GQA models get 8 heads / 4 kv heads at 4 ranks
FAMILIES = {
    "falcon_new_arch": (
        lambda: _falcon(new_decoder_architecture=True, num_kv_heads=2),
        lambda: _falcon(num_attention_heads=8, new_decoder_architecture=True, num_kv_heads=4),
    ),
    "falcon_old_layout": (lambda: _falcon(multi_query=False), lambda: _falcon(multi_query=False)),
    "falcon_mqa": (_falcon, _falcon),  # FalconConfig's default: multi_query=True, one key/value head
    "falcon_alibi": (
        lambda: _falcon(multi_query=False, alibi=True),
        lambda: _falcon(multi_query=False, alibi=True),
    ),
    "bloom": (_bloom, _bloom),
    "phi3": (_phi3, _phi3),
    "phi3_gqa": (lambda: _phi3(4, 2), lambda: _phi3(8, 4)),
    "gpt2": (zoo.tp.gpt2_model, zoo.tp.gpt2_model),
}


def _scheduled(make, ws):
    torch.manual_seed(0)
    model = make()
    sch = sl.create_schedule(model, world_size=ws)
    calls = presets.megatron_tp(sch)
    return model, sch, calls


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_megatron_preset_shards_fused_projections_and_computes_the_same_model(family, ws):
    make = FAMILIES[family][ws // 4]
    _, sch, calls = _scheduled(make, ws)
    assert calls.notes == [], calls.notes  # nothing in the blocks stays silently whole
    assert sl.check_schedule(sch) == []
    torch.manual_seed(0)
    report = numeric_check(make(), sch.record.calls, ws, INPUTS)
    assert report.passed, report.message


def test_falcon_new_architecture_is_sharded_by_key_value_groups():
    model, _sch, _ = _scheduled(FAMILIES["falcon_new_arch"][0], 2)
    attn = model.transformer.h[0].self_attention
    # (4 + 2 x 2) x 16 = 128 outputs; each rank keeps one whole group [q, q, k, v] of 64 rows, contiguous
    assert attn.query_key_value.weight.shape == (64, 64)
    assert attn.query_key_value.weight.shard_stride == 1
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
    assert attn.dense.weight.shape == (64, 32)
    assert sl.module_state(attn).attention_heads["attrs"]["num_kv_heads"] == [2, 1]


def test_falcon_groups_that_do_not_divide_are_refused_in_one_sentence():
    sch = sl.create_schedule(_falcon(new_decoder_architecture=True, num_kv_heads=2), world_size=4)
    with pytest.raises(sl.ScheduleError) as ei:
        sch["transformer.h.0.self_attention.query_key_value"].shard("weight", axis=0)
    assert str(ei.value) == (
        "Cannot shard transformer.h.0.self_attention.query_key_value.weight on axis 0 across 4 ranks: the 2 "
        "key/value heads do not divide by 4."
    )


def test_falcon_multi_query_attention_splits_its_query_heads_and_replicates_its_key_value_head():
    model, _, _ = _scheduled(_falcon, 2)  # FalconConfig's default: multi_query=True, one key/value head
    attn = model.transformer.h[0].self_attention
    w = attn.query_key_value.weight  # [q (4 x 16); k (16); v (16)]: this rank's 2 query heads, k and v whole
    assert w.shape == (32 + 16 + 16, 64)
    assert (w.shard_stride.sizes, w.shard_stride.groups) == ((64, 16, 16), (0, 1, 1))
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1) and attn.dense.weight.shape == (64, 32)
    # the key/value blocks' gradient is summed over the ranks sharing them
    assert sl.module_state(attn.query_key_value).grad_block_replicas["weight"] == (
        0,
        [32, 16, 16],
        (1, 2, 2),
    )
    merged = merge_shards(
        [local_shard(torch.arange(96), 0, 2, r, w.shard_stride) for r in range(2)], 0, w.shard_stride
    )
    assert torch.equal(merged, torch.arange(96))


def test_bloom_attention_takes_its_own_heads_alibi_slopes():
    model, _sch, _ = _scheduled(_bloom, 2)
    attn = model.transformer.h[0].self_attention
    assert attn.query_key_value.weight.shape == (96, 64) and attn.query_key_value.bias.shape == (96,)
    rec = sl.module_state(attn).attention_heads
    assert rec["inputs"] == ["alibi"] and attn.num_heads == 2
    # the hook keeps rows (batch x heads) of this rank's heads: rank 0 heads 0, 1 of 4
    full_alibi = torch.arange(2 * 4, dtype=torch.float32).reshape(8, 1, 1).expand(8, 1, 5).contiguous()
    (hook,) = attn._forward_pre_hooks.values()
    _args, kw = hook(attn, (torch.zeros(2, 5, 64), torch.zeros(2, 5, 64)), {"alibi": full_alibi})
    assert kw["alibi"][:, 0, 0].tolist() == [0.0, 1.0, 4.0, 5.0]


def test_bloom_slow_but_exact_pretraining_tp_is_refused():
    from transformers import BloomConfig, BloomForCausalLM

    model = BloomForCausalLM(
        BloomConfig(
            vocab_size=128, hidden_size=64, n_layer=2, n_head=4, pretraining_tp=2, slow_but_exact=True
        )
    )
    sch = sl.create_schedule(model, world_size=2)
    with pytest.raises(sl.ScheduleError, match=r"slow_but_exact, slicing dense.weight itself"):
        sch["transformer.h.0.self_attention.query_key_value"].shard("weight", axis=0)


def test_phi3_gqa_qkv_is_an_unequal_block_shard_with_a_per_module_config():
    model, _sch, _ = _scheduled(FAMILIES["phi3_gqa"][0], 2)
    attn = model.model.layers[0].self_attn
    w = attn.qkv_proj.weight
    # [q 64; k 32; v 32] -> this rank: [q 32; k 16; v 16]
    assert (
        w.shape == (64, 64)
        and isinstance(w.shard_stride, BlockStride)
        and w.shard_stride.sizes == (64, 32, 32)
    )
    assert w.shard_stride == 3 and w.shard_stride > 1
    assert model.model.layers[0].mlp.gate_up_proj.weight.shard_stride == 2
    # the module's own config holds this rank's counts; the model's and its class's stay global
    assert (attn.config.num_attention_heads, attn.config.num_key_value_heads) == (2, 1)
    assert attn.config is not model.config and model.config.num_attention_heads == 4
    assert attn.num_key_value_heads == 1 and attn.num_key_value_groups == 2
    rec = sl.module_state(attn).attention_heads
    assert rec["config"] == {"num_attention_heads": [4, 2], "num_key_value_heads": [2, 1]}
    lay = layout_of(w, 2, 0)
    assert lay.tp_block_sizes == (64, 32, 32) and lay.local_shape == (64, 64)


def test_phi3_equal_blocks_keep_an_int_stride():
    model, _, _ = _scheduled(_phi3, 2)
    w = model.model.layers[1].self_attn.qkv_proj.weight
    assert type(w.shard_stride) is int and w.shard_stride == 3


def test_check_schedule_knows_fused_attention_roles():
    torch.manual_seed(0)
    sch = sl.create_schedule(_falcon(new_decoder_architecture=True, num_kv_heads=2), world_size=2)
    node = sch["transformer.h.0.self_attention.query_key_value"]
    node.shard("weight", axis=0)
    node.sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    found = sl.check_schedule(sch)
    assert [f.kind for f in found] == ["partial_heads"]
    assert "splits its heads in query_key_value but not in dense" in found[0].message
    assert [c.path for c in found[0].calls] == ["transformer.h.0.self_attention.dense"]

    sch = sl.create_schedule(_phi3(4, 2), world_size=2)
    sch["model.layers.0.self_attn.o_proj"].shard("weight", axis=1)
    sch["model.layers.0.self_attn.o_proj"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    found = sl.check_schedule(sch)
    assert [f.kind for f in found] == ["partial_heads"]
    assert "not in qkv_proj" in found[0].message
    sl.close_open_items(sch)
    assert sl.check_schedule(sch) == []
    assert isinstance(sch["model.layers.0.self_attn.qkv_proj"].mod.weight.shard_stride, BlockStride)


@pytest.mark.parametrize("ws", [2, 4])
def test_block_stride_shards_merge_back_and_layouts_take_the_same_slices(ws):
    stride = BlockStride((64, 32, 32))
    full = torch.arange(128 * 6, dtype=torch.float32).reshape(128, 6)
    parts = [local_shard(full, 0, ws, r, stride) for r in range(ws)]
    assert torch.equal(merge_shards(parts, 0, stride), full)
    assert torch.equal(merge_shards(parts, 0, (64, 32, 32)), full)  # a plain list of block sizes too
    seen = torch.zeros(full.shape, dtype=torch.int64)
    for r in range(ws):
        lay = ShardLayout(full.shape, 0, stride, ws, r)
        assert torch.equal(lay.take(full), parts[r]) and lay.local_shape == tuple(parts[r].shape)
        assert len(lay.blocks()) == 3
        for _, offs, szs in lay.blocks():
            seen[tuple(slice(o, o + s) for o, s in zip(offs, szs, strict=False))] += 1
    assert bool((seen == 1).all())
    with pytest.raises(ValueError, match="has no DTensor placement"):
        ShardLayout(full.shape, 0, stride, ws, 0).placements()
    # the stride survives the copies Verify and checkpoints make
    for clone in (copy.deepcopy(stride), pickle.loads(pickle.dumps(stride))):
        assert isinstance(clone, BlockStride) and clone.sizes == (64, 32, 32) and clone == 3


@pytest.mark.multirank
def test_unequal_block_checkpoint_views_round_trip_through_dcp_on_two_gloo_ranks():
    rc, out, res = launch_results(REPO_ROOT / "tests" / "multirank" / "fused_dcp.py", 2, [], timeout=240)
    assert rc == 0, out[-3000:]
    for case in ("save_tp2", "load_tp2", "load_tp1_dp2_fsdp", "load_full", "dtensor_refused"):
        assert case in res, f"{case} missing\n{out[-3000:]}"
        assert res[case]["ok"], (case, res[case], out[-3000:])
    assert res["save_tp2"]["kind"] == "ShardedTensor" and res["save_tp2"]["shards"] == 3
