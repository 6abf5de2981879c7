"""The tensor-parallel split read from one block's recorded dataflow, not from names.

Tiny transformers 5.x models built from their config classes (no downloads):

* the inferred roles and layouts (:mod:`slapo_lab.sharding.infer`): GPT-NeoX's per-head interleaved
  ``query_key_value`` (contiguous by heads), ModernBERT's ``Wqkv`` (three blocks) and ``Wi`` (``gate|up``
  chunked in two), GPT-BigCode's multi-query ``c_attn`` (its query block split, its one key/value head replicated
  on every rank: a ``BlockStride`` with ``replicas``), DeepSeek-V3's MLA (``q_b_proj`` / ``kv_b_proj`` column parallel, ``kv_a_proj_with_mqa`` whole: its rope
  part reaches every head), per-head tensors (Cohere's q/k norm weights, Swin's relative position table, GPT-OSS's
  attention sinks), StableLM's per-head norm list (its attention refused in one sentence), GPT-OSS's experts
  with an output bias (added once over the ranks);
* the Megatron preset on each, then the numeric check on 2 simulated ranks (:func:`slapo_lab.numeric.
  numeric_check`): ✓, with the parts kept whole named;
* transformers' own ``config.base_model_tp_plan`` as a cross-check of the inferred roles, where it exists.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import slapo_lab as sl
from slapo_lab import presets
from slapo_lab.numeric import numeric_check
from slapo_lab.sharding import infer
from slapo_lab.sharding.rules import BlockStride

V = 128
_DENSE = {"vocab_size": V, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}

FAMILIES = {
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {**_DENSE, "intermediate_size": 128}),
    "modernbert": (
        "ModernBertConfig",
        "ModernBertForMaskedLM",
        {
            **_DENSE,
            "intermediate_size": 128,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "cls_token_id": 1,
            "sep_token_id": 2,
        },
    ),
    "gpt_bigcode": (
        "GPTBigCodeConfig",
        "GPTBigCodeForCausalLM",
        {"vocab_size": V, "n_embd": 64, "n_layer": 2, "n_head": 4, "multi_query": True},
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {
            **_DENSE,
            "num_key_value_heads": 4,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "q_lora_rank": 32,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 8,
        },
    ),
    "cohere": (
        "CohereConfig",
        "CohereForCausalLM",
        {
            **_DENSE,
            "num_key_value_heads": 2,
            "intermediate_size": 128,
            "use_qk_norm": True,
            "eos_token_id": 2,
        },
    ),
    "stablelm": (
        "StableLmConfig",
        "StableLmForCausalLM",
        {**_DENSE, "num_key_value_heads": 4, "intermediate_size": 128, "qk_layernorm": True},
    ),
    "swin": (
        "SwinConfig",
        "SwinForImageClassification",
        {
            "image_size": 32,
            "patch_size": 4,
            "embed_dim": 16,
            "depths": [2, 2],
            "num_heads": [2, 4],
            "window_size": 4,
        },
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            **_DENSE,
            "num_key_value_heads": 2,
            "intermediate_size": 64,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "head_dim": 16,
        },
    ),
    "apertus": (
        "ApertusConfig",
        "ApertusForCausalLM",
        {**_DENSE, "num_key_value_heads": 2, "intermediate_size": 128},
    ),
    "llama_kv3": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            **_DENSE,
            "num_attention_heads": 6,
            "hidden_size": 48,
            "num_key_value_heads": 3,
            "intermediate_size": 96,
        },
    ),
    "mamba": (
        "MambaConfig",
        "MambaForCausalLM",
        {"vocab_size": V, "hidden_size": 64, "num_hidden_layers": 2, "state_size": 8, "expand": 2},
    ),
}


def _build(family: str, seed: int = 0):
    cfg_cls, model_cls, kw = FAMILIES[family]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kw)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # zero-initialised biases and sinks would hide a bias added on every rank
        for name, p in model.named_parameters():
            if name.endswith(("down_proj_bias", "sinks")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def _inputs(family: str) -> dict:
    g = torch.Generator().manual_seed(3)
    if family == "swin":
        return {"pixel_values": torch.randn(2, 3, 32, 32, generator=g)}
    return {"input_ids": torch.randint(1, V, (2, 8), generator=g)}


def _split(family: str, block: str):
    model = _build(family)
    sch = sl.create_schedule(model, world_size=2)
    return infer.block_split(sch, block)


def test_gpt_neox_interleaved_query_key_value_is_split_contiguously_by_heads():
    s = _split("gpt_neox", "gpt_neox.layers.0")
    assert s.roles["attention.query_key_value"] == "qkv"
    assert s.layouts["attention.query_key_value"] == infer.Layout(
        "qkv", 1, 4
    )  # view(B, T, H, 3 hd), chunk(3)
    assert s.roles["attention.dense"] == "o"
    assert (s.roles["mlp.dense_h_to_4h"], s.roles["mlp.dense_4h_to_h"]) == ("mlp_in", "mlp_out")
    assert s.attention == {"attention": (4, 4)}


def test_modernbert_fused_wqkv_is_three_blocks_and_wi_is_gate_and_up():
    s = _split("modernbert", "model.layers.1")
    assert s.roles == {"attn.Wqkv": "qkv", "attn.Wo": "o", "mlp.Wi": "mlp_in", "mlp.Wo": "mlp_out"}
    assert s.layouts["attn.Wqkv"].stride == 3  # view(B, T, 3, H, hd)
    assert s.layouts["mlp.Wi"].stride == 2  # input, gate = Wi(x).chunk(2)


def test_gpt_bigcode_multi_query_attention_splits_its_query_heads_and_replicates_its_key_value_head():
    s = _split("gpt_bigcode", "transformer.h.0")
    assert s.attention == {"attn": (4, 1)}  # one key/value head, read from split((H*hd, hd, hd))
    assert s.refusals == {} and s.whole == {}
    assert (s.roles["attn.c_attn"], s.roles["attn.c_proj"]) == ("qkv", "o")
    stride = s.layouts["attn.c_attn"].stride  # [q (4 heads); k (1 head); v (1 head)], k and v on both ranks
    assert isinstance(stride, BlockStride) and (stride.sizes, stride.groups) == ((64, 16, 16), (0, 1, 1))
    assert (s.roles["mlp.c_fc"], s.roles["mlp.c_proj"]) == ("mlp_in", "mlp_out")


def test_deepseek_v3_mla_low_rank_chains_split_b_and_keep_a_whole():
    s = _split("deepseek_v3", "model.layers.0")
    assert s.roles["self_attn.q_b_proj"] == "q" and s.roles["self_attn.kv_b_proj"] == "kv"
    assert s.roles["self_attn.o_proj"] == "o"
    assert "self_attn.q_a_proj" not in s.roles  # a -> norm -> b: a stays whole
    assert s.shared == {"self_attn.kv_a_proj_with_mqa"}  # its rope part is one key head for all heads
    moe = _split("deepseek_v3", "model.layers.1")
    assert moe.roles["mlp.shared_experts.down_proj"] == "mlp_out"


def test_per_head_tensors_follow_the_head_split():
    cohere = _split("cohere", "model.layers.0")
    assert {(h.module, h.name, h.axis) for h in cohere.head_params} == {
        ("self_attn.q_norm", "weight", 0),
        ("self_attn.k_norm", "weight", 0),
    }
    swin = _split("swin", "swin.encoder.layers.1")
    assert [(h.module, h.name, h.axis, h.heads) for h in swin.head_params] == [
        (f"blocks.{i}.attention.relative_position_bias", "relative_position_bias_table", 1, 4) for i in (0, 1)
    ]
    oss = _split("gpt_oss", "model.layers.0")
    assert [(h.module, h.name, h.axis) for h in oss.head_params] == [("self_attn", "sinks", 0)]


def test_stablelm_per_head_norm_list_keeps_its_attention_whole_in_one_sentence():
    s = _split("stablelm", "model.layers.0")
    assert s.refusals["self_attn"] == (
        "its per-head self_attn.q_layernorm.norms is a list of 4 modules, one per head (e.g. StableLM's "
        "qk_layernorm), which no shard splits, so its heads stay whole"
    )


FULL = ("gpt_neox", "modernbert", "deepseek_v3", "cohere", "swin", "gpt_oss", "apertus")


def test_replicated_parameters_applied_to_a_split_output_sum_their_gradients():
    s = _split("apertus", "model.layers.0")
    # XIELU's alpha_p / alpha_n see this rank's intermediate features only, the q/k norms this rank's heads
    assert s.grad_sum == {"mlp.act_fn", "self_attn.q_norm", "self_attn.k_norm"}


@pytest.mark.parametrize("family", [*FULL, "gpt_bigcode", "stablelm", "llama_kv3"])
def test_the_megatron_preset_is_right_on_the_family(family):
    model = _build(family)
    sch = sl.create_schedule(model, world_size=2)
    calls = presets.megatron_tp(sch, vocab_parallel=presets.has_vocab_embedding(sch))
    whole = " ".join(calls.notes)
    if family in FULL:  # every q/k/v/o and MLP projection of every block is sharded
        for phrase in ("q_proj", "query_key_value", "Wqkv", "Wo", "o_proj", "down_proj", "fc1", "fc2"):
            assert f" {phrase}" not in whole and f".{phrase}" not in whole.replace("a_proj", ""), whole
    elif family == "gpt_bigcode":  # query heads split, the key/value head on both ranks
        assert "c_attn" not in whole and "attn.c_proj" not in whole, whole
        w = sch["transformer.h.0.attn.c_attn"].mod.weight
        assert tuple(w.shape) == (32 + 16 + 16, 64) and w.shard_stride.groups == (0, 1, 1)
    elif family == "stablelm":
        assert (
            "self_attn.q_proj, self_attn.k_proj, self_attn.v_proj, self_attn.o_proj (StableLmAttention"
            in whole
        )
    else:  # 3 key/value heads on 2 ranks: the attention stays whole, the MLP is split
        assert whole == (
            "Kept whole on every rank: in every block self_attn.q_proj, self_attn.k_proj, self_attn.v_proj, "
            "self_attn.o_proj (its 3 key/value heads neither divide by nor divide the world size 2)."
        )
        assert sch["model.layers.0.mlp.down_proj"].mod.weight.shape == (48, 48)
    assert [f for f in sl.check_schedule(sch) if f.kind != "replicated"] == []
    report = numeric_check(_build(family), sch.record.calls, 2, _inputs(family))
    assert report.passed, report.message


def test_mamba_splits_without_example_inputs():
    # Mamba-1 typed without example inputs: the inference's own forward passes the model's cache to the mixer,
    # and the mixer's dependency runs each start from a copy of it (slapo_lab/sharding/mixers.py ``_fresh``);
    # a one-group Mamba-2 splits too (tests/unit/sharding/test_channel_mixers.py: its gated norm's statistics are summed)
    sch = sl.create_schedule(_build("mamba"), world_size=2)
    presets.megatron_tp(sch)
    assert presets.replicated_dense(sch) is None  # every projection of every block sharded
    report = numeric_check(_build("mamba"), sch.record.calls, 2, _inputs("mamba"))
    assert report.passed, report.message


def test_gpt_oss_experts_add_their_output_bias_once():
    model = _build("gpt_oss")
    sch = sl.create_schedule(model, world_size=2)
    presets.megatron_tp(sch)
    experts = sch["model.layers.0.mlp.experts"].mod
    assert experts.gate_up_proj.shard_stride == 1 and experts.down_proj_bias.shape == (4, 64)
    assert ("bwd_post", "all_reduce_param_grads") in sl.module_state(experts).syncs


# -- transformers' base_model_tp_plan as a cross-check ----------------------------------------------------------
_PLAN = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"num_key_value_heads": 2, "intermediate_size": 128}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"num_key_value_heads": 2, "intermediate_size": 128}),
    "starcoder2": (
        "Starcoder2Config",
        "Starcoder2ForCausalLM",
        {"num_key_value_heads": 2, "intermediate_size": 128},
    ),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", {"intermediate_size": 128}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "num_key_value_heads": 2,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {"num_key_value_heads": 2, "intermediate_size": 128, "pad_token_id": 0},
    ),
}
_STYLES = {
    "colwise": "column",
    "colwise_gather_output": "column",
    "rowwise": "row",
    "rowwise_split_input": "row",
}
_KIND = {"q": "column", "k": "column", "v": "column", "qkv": "column", "kv": "column", "mlp_in": "column"}


def _plan_cases():
    yield from _PLAN
    yield "gpt_neox"
    yield "cohere"
    yield "deepseek_v3"


@pytest.mark.parametrize("family", list(_plan_cases()))
def test_inferred_roles_agree_with_transformers_tp_plan(family):
    if family in _PLAN:
        cfg_cls, model_cls, kw = _PLAN[family]
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**{**_DENSE, **kw}))
    else:
        model = _build(family)
    plan = model.config.base_model_tp_plan
    sch = sl.create_schedule(model, world_size=2)
    prefix = model.base_model_prefix
    compared = 0
    for pat, style in plan.items():
        if style not in _STYLES or not pat.startswith("layers.*."):
            continue
        rel = pat[len("layers.*.") :]
        for i in range(len(getattr(model, prefix).layers)):
            block = f"{prefix}.layers.{i}"
            if rel not in dict(sch[block].mod.named_modules()):
                continue
            role = infer.block_split(sch, block).roles.get(rel)
            assert _KIND.get(role, "row" if role in ("o", "mlp_out") else None) == _STYLES[style], (
                block,
                rel,
                role,
            )
            compared += 1
    assert compared >= 2


def test_einsum_attention_is_read_and_a_class_reading_heads_from_its_config_stays_whole():
    cfg = transformers.FunnelConfig(
        vocab_size=V, block_sizes=[1, 1], d_model=32, n_head=4, d_head=8, d_inner=64
    )
    torch.manual_seed(0)
    sch = sl.create_schedule(transformers.FunnelForMaskedLM(cfg).eval(), world_size=2)
    s = infer.block_split(sch, "funnel.encoder.blocks.0")  # a list around one layer: paths keep the "0."
    assert s.roles["0.attention.q_head"] == "q" and s.roles["0.attention.post_proj"] == "o"  # bind,bjnd->bnij
    calls = presets.megatron_tp(sch)
    # its config copy holds this rank's heads, but its raw per-head parameters (r_w_bias, r_kernel ...) are not
    # split: the gate's numeric check keeps the attention whole
    assert calls.notes[0].startswith("Kept whole:") and "0.attention (q_head" in calls.notes[0]
    assert sch["funnel.encoder.blocks.0.0.ffn.linear_2"].mod.weight.shape == (32, 32)  # the MLP is split
    torch.manual_seed(0)
    report = numeric_check(transformers.FunnelForMaskedLM(cfg).eval(), sch.record.calls, 2, _inputs("funnel"))
    assert report.passed, report.message
