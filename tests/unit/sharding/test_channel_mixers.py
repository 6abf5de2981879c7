"""Channel-parallel sequence mixers (:mod:`slapo_lab.sharding.mixers`): the split of a state-space or
linear-attention mixer read from its feature dependencies, then the Megatron preset and the numeric check.

Tiny transformers 5.x models built from their config classes (``tests/family_sweep.py``'s ``build``, no
downloads):

* Mamba-2 with 2 groups: ``in_proj`` column parallel over its fused ``[z, x, B, C, dt]`` blocks, the depthwise
  ``conv1d`` over its ``[x, B, C]`` channels, ``A_log`` / ``D`` / ``dt_bias`` and the grouped norm by head /
  group, ``out_proj`` row parallel, and ``intermediate_size`` / ``conv_dim`` / ``num_heads`` / ``n_groups``
  per rank (Megatron-LM ``megatron/core/ssm/mamba_mixer.py``); ✓ with every projection sharded;
* Mamba-2 with 1 group: its gated norm spans all channels, so its statistic is summed over the ranks
  (``feature_stats``), and ``B`` / ``C`` reach every rank's heads, so they are replicated: ✓;
* Mamba-1: ``x_proj`` (every channel needs all of its dt, B, C) computed from the gathered channels, its output
  features split and gathered, ``dt_proj`` (whose weight the forward uses directly) per channel: ✓;
* Qwen3.5's gated DeltaNet (``linear_attn``: ``in_proj_qkv`` as three blocks, ``in_proj_z`` / ``in_proj_b`` /
  ``in_proj_a`` contiguous, ``conv1d`` by channel, the per-head norm replicated with its gradient summed): ✓;
* RecurrentGemma's RG-LRU (attributes of a submodule per rank) and RWKV's per-channel time_decay / time_first;
* the layout reader on its own (:func:`slapo_lab.sharding.mixers.plan` on hand-made dependencies).
"""

from __future__ import annotations

import warnings

import torch
from family_sweep import build

import slapo_lab as sl
from slapo_lab import presets
from slapo_lab.call_order import set_example_inputs
from slapo_lab.numeric import numeric_check
from slapo_lab.preset_check import set_reference
from slapo_lab.sharding import infer, mixers
from slapo_lab.sharding.rules import BlockStride
from slapo_lab.utils import meta_copy


def _schedule(model_type: str, cls: str, **overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if overrides:
            from family_sweep import example_inputs, tiny_config
            from transformers import AutoModelForCausalLM

            cfg = tiny_config(model_type)
            for k, v in overrides.items():
                setattr(cfg, k, v)
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(cfg).eval()
            inputs = example_inputs(model)
        else:
            model, inputs = build(model_type, cls)
    sch = sl.create_schedule(meta_copy(model), world_size=2)
    set_example_inputs(sch, inputs)
    set_reference(sch, model)
    return model, inputs, sch


def _preset_and_check(model, inputs, sch):
    presets.megatron_tp(sch, vocab_parallel=presets.has_vocab_embedding(sch))
    report = numeric_check(model, sch.record.calls, 2, inputs, timeout=100)
    assert report.status == "passed", report.message
    return presets.replicated_dense(sch)


def test_mamba2_split_follows_megatron():
    model, inputs, sch = _schedule("mamba2", "Mamba2ForCausalLM")
    block = presets.find_blocks(sch)[0]
    split = infer.block_split(sch, block)
    assert split.roles == {"mixer.in_proj": "mlp_in", "mixer.out_proj": "mlp_out"}
    mixer = model.get_submodule(f"{block}.mixer")
    d, gn, h = mixer.intermediate_size, mixer.n_groups * mixer.ssm_state_size, mixer.num_heads
    assert mixer.n_groups == 2
    assert split.layouts["mixer.in_proj"].stride.sizes == (d, d, gn, gn, h)  # z | x | B | C | dt
    deps = split.mixers["mixer"]
    plan = mixers.plan(deps, 2)
    assert plan.reason is None
    conv = plan.shards["conv1d:weight"]
    assert conv[0] == 0 and isinstance(conv[1], BlockStride) and conv[1].sizes == (d, gn, gn)
    assert {k: v[0] for k, v in plan.shards.items()} == {
        ":A_log": 0,
        ":D": 0,
        ":dt_bias": 0,
        "conv1d:weight": 0,
        "conv1d:bias": 0,
        "norm:weight": 0,
    }
    assert set(deps.attrs) == {":intermediate_size", ":conv_dim", ":num_heads", ":n_groups"}
    assert _preset_and_check(model, inputs, sch) is None  # every projection sharded
    local = sch[f"{block}.mixer"].mod
    assert (local.intermediate_size, local.num_heads, local.n_groups) == (d // 2, h // 2, 1)


def test_mamba2_one_group_splits_with_summed_norm_statistics():
    model, inputs, sch = _schedule("mamba2", "Mamba2ForCausalLM", n_groups=1)
    block = presets.find_blocks(sch)[0]
    split = infer.block_split(sch, block)
    # one group: the gated norm spans all channels, so its statistic is summed over the ranks (feature_stats),
    # and B / C reach every rank's heads, so they are replicated (as vLLM's mamba_mixer2.py duplicates them)
    assert split.roles == {"mixer.in_proj": "mlp_in", "mixer.out_proj": "mlp_out"}
    mixer = model.get_submodule(f"{block}.mixer")
    d, gn, h = mixer.intermediate_size, mixer.ssm_state_size, mixer.num_heads
    stride = split.layouts["mixer.in_proj"].stride
    assert (stride.sizes, stride.groups) == ((d, d, 2 * gn, h), (0, 0, 1, 0))
    assert set(split.mixers["mixer"].stats) == {"norm"}
    assert dict(presets.block_layers(sch, block))[f"{block}.mixer.norm"] == "features"
    assert _preset_and_check(model, inputs, sch) is None  # every projection sharded
    local = sch[f"{block}.mixer"].mod
    assert (local.intermediate_size, local.conv_dim, local.norm.group_size) == (
        d // 2,
        d // 2 + 2 * gn,
        d // 2,
    )


def test_gated_deltanet_split():
    model, inputs, sch = _schedule("qwen3_5_text", "Qwen3_5ForCausalLM")
    block = next(b for b in presets.find_blocks(sch) if hasattr(model.get_submodule(b), "linear_attn"))
    split = infer.block_split(sch, block)
    roles = {k: v for k, v in split.roles.items() if k.startswith("linear_attn.")}
    assert roles == {
        "linear_attn.in_proj_qkv": "mlp_in",
        "linear_attn.in_proj_z": "mlp_in",
        "linear_attn.in_proj_b": "mlp_in",
        "linear_attn.in_proj_a": "mlp_in",
        "linear_attn.out_proj": "mlp_out",
    }
    assert split.layouts["linear_attn.in_proj_qkv"].stride == 3  # q | k | v blocks, each by heads
    plan = mixers.plan(split.mixers["linear_attn"], 2)
    assert plan.shards["conv1d:weight"] == (0, 3)
    assert plan.grad_sum == {"norm"}  # one head_dim weight shared by every head: replicated, gradients summed
    assert _preset_and_check(model, inputs, sch) is None


def test_plan_reads_blocks_and_refuses_shared_features():
    # 4 chunks (2 per rank at world size 2) of an output linear's input, over an input linear of 8 features
    # stored as two blocks [a0 a1 | b0 b1] of 4: chunk c needs a's and b's features of its rank
    deps = mixers.MixerDeps(4, "out")
    deps.feats = {"inp": 8}
    deps.outs = {"inp": [{0, 4}, {1, 5}, {2, 6}, {3, 7}]}
    deps.shapes = {":w": (4, 3)}
    deps.params = {":w": [{0, 1, 2}, {3, 4, 5}, {6, 7, 8}, {9, 10, 11}]}
    p = mixers.plan(deps, 2)
    assert p.reason is None and p.columns["inp"] == 2 and p.shards[":w"] == (0, 1)
    assert mixers.plan(deps, 4).columns["inp"] == 2
    deps = mixers.MixerDeps(4, "out", feats={"inp": 8})
    deps.outs = {"inp": [{0, 4}, {1, 5}, {2, 6}, {3, 4}]}  # feature 4 needed by both ranks, 7 by none
    assert "reach the channels of several ranks" in mixers.plan(deps, 2).reason


def test_mamba1_gathers_x_proj():
    model, inputs, sch = _schedule("mamba", "MambaForCausalLM")
    block = presets.find_blocks(sch)[0]
    split = infer.block_split(sch, block)
    # x_proj contracts over every channel and every channel needs all of dt, B, C: computed from the gathered
    # channels; dt_proj (its weight used directly) and A_log / D / conv1d split per channel
    assert split.roles == {
        "mixer.in_proj": "mlp_in",
        "mixer.x_proj": "mixer_gather",
        "mixer.out_proj": "mlp_out",
    }
    assert split.layouts["mixer.in_proj"].stride == 2  # x | z
    kinds = dict(presets.block_layers(sch, block))
    assert kinds[f"{block}.mixer.x_proj"] == "gather_linear"
    assert kinds[f"{block}.mixer.dt_proj"] == "channel_params:weight=0,bias=0"
    assert kinds[f"{block}.mixer"] == "channel_params:A_log=0,D=0"
    assert _preset_and_check(model, inputs, sch) is None


def test_recurrent_gemma_rg_lru_and_rwkv_time_decay():
    # RecurrentGemma: the RG-LRU's per-head gate banks split by head and its own num_attention_heads per rank
    model, inputs, sch = _schedule("recurrent_gemma", "RecurrentGemmaForCausalLM")
    block = presets.find_blocks(sch)[0]
    deps = infer.block_split(sch, block).mixers["temporal_block"]
    assert deps.attrs == {"rg_lru:num_attention_heads": model.config.num_attention_heads}
    assert mixers.plan(deps, 2).shards["rg_lru:recurrent_gate_weight"] == (0, 1)
    assert _preset_and_check(model, inputs, sch) is None
    # RWKV: key / value / receptance -> output is an MLP pair to the index maps, but time_decay and time_first
    # hold one entry per channel: they split with it (the feed-forward's receptance gate, applied after the
    # row-parallel value, pairs with nothing: column parallel with its output gathered, sharding/lone_linears.py)
    model, inputs, sch = _schedule("rwkv", "RwkvForCausalLM")
    block = presets.find_blocks(sch)[0]
    kinds = dict(presets.block_layers(sch, block))
    assert kinds[f"{block}.attention"] == "channel_params:time_decay=0,time_first=0"
    assert kinds[f"{block}.feed_forward.receptance"] == "column_gather"
    assert _preset_and_check(model, inputs, sch) is None  # every projection sharded


def test_xlstm_reads_its_head_count_from_a_per_rank_config():
    # xLSTM's mLSTM layer reshapes q / k / v into ``self.config.num_heads`` heads: the config, shared by every
    # layer, cannot hold a per-rank count, so the mixer gets its own copy of it holding this rank's heads
    model, inputs, sch = _schedule("xlstm", "xLSTMForCausalLM")
    block = presets.find_blocks(sch)[0]
    deps = infer.block_split(sch, block).mixers["mlstm_layer"]
    heads = model.config.num_heads
    assert deps.attrs[":config.num_heads"] == heads
    assert mixers.plan(deps, 2).shards["multihead_norm:weight"] == (0, 1)  # per head, by head
    assert _preset_and_check(model, inputs, sch) is None  # every projection sharded
    local = sch[f"{block}.mlstm_layer"].mod
    assert local.config.num_heads == heads // 2 and local.config is not sch.mod.config
    assert sch.mod.config.num_heads == heads  # the model's (and the other layers') config stays global


def test_plan_keeps_a_low_rank_input_whole_before_its_column():
    # Kimi's g_a_proj -> g_b_proj: "a" (2 features) reaches the 4 chunks only through "b" (8 features, two
    # per chunk), so "a" stays whole and "b" is column parallel (its input gradient summed over the ranks)
    deps = mixers.MixerDeps(4, "out", feats={"a": 2, "b": 8})
    deps.outs = {"a": [set()] * 4, "b": [{0, 1}, {2, 3}, {4, 5}, {6, 7}]}
    deps.feeds = {"a": set(), "b": {"a"}}
    p = mixers.plan(deps, 2)
    assert p.reason is None and p.low_rank == {"a": ["b"]} and p.columns == {"b": 1}
    assert p.kinds == {"b": "column"}
    unused = mixers.MixerDeps(4, "out", feats=deps.feats, outs=deps.outs)  # "a" feeds nothing: whole mixer
    unused.feeds = {"a": set(), "b": set()}
    assert "reach none of the output projection's inputs" in mixers.plan(unused, 2).reason
