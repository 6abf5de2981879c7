"""Low-rank attention chains (MLA) and sparse-attention indexers split from the recorded dataflow (issue 23).

Tiny transformers 5.x models built from their config classes by the family sweep's shrinker
(:func:`tests.family_sweep.build`, no downloads):

* GLM-4-MoE-Lite (DeepSeek-V3's MLA; a dense first block, then MoE blocks whose data-dependent routing stops the
  meta forward the split inference runs): both blocks' ``q_b_proj`` / ``kv_b_proj`` are column parallel by heads,
  ``o_proj`` row parallel, the low-rank ``q_a_proj`` / ``kv_a_proj_with_mqa`` whole
  (:func:`slapo_lab.sharding.infer.block_split` reads the blocks the meta forward never reached from the
  remembered real model);
* DeepSeek-V2's rotary embedding through ``view_as_complex`` / ``view_as_real`` keeps ``q_b_proj``'s heads;
* HY-V4: the DSA indexer (``wq_b`` / ``wk`` / ``weights_proj``, which picks tokens with ``topk``) stays whole, the
  attention sinks follow the heads, and the Megatron preset passes the numeric check on 2 simulated ranks with
  every projection the sweep counts sharded;
* the sweep's own structural exclusions (:func:`tests.family_sweep.structural_exclusions`), measured on the
  forward: low-rank "a" projections and token routers on DeepSeek-V3.2, nothing on Llama.
"""

from __future__ import annotations

import warnings

import pytest

import slapo_lab as sl
from slapo_lab import presets
from slapo_lab.call_order import set_example_inputs
from slapo_lab.numeric import numeric_check
from slapo_lab.preset_check import set_reference
from slapo_lab.sharding import infer
from slapo_lab.utils import meta_copy
from tests.family_sweep import build, families, kept_whole, structural_exclusions


def _build(family: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build(family, families()[family][1])


def _schedule(model, inputs):
    sch = sl.create_schedule(meta_copy(model), world_size=2)
    set_example_inputs(sch, inputs)
    set_reference(sch, model)
    return sch


def _sharded(sch, path: str, name: str = "weight"):
    return getattr(getattr(sch.mod.get_submodule(path), name), "shard_axis", None)


def test_mla_blocks_the_meta_forward_never_reaches_are_read_from_the_real_model():
    model, inputs = _build("glm4_moe_lite")
    assert [type(b.mlp).__name__ for b in model.model.layers] == ["Glm4MoeLiteMLP", "Glm4MoeLiteMoE"]
    assert "model.layers.1" not in infer.analyse(
        meta_copy(model), inputs
    )  # the meta forward stops at routing
    sch = _schedule(model, inputs)
    for block in ("model.layers.0", "model.layers.1"):
        split = infer.block_split(sch, block)
        assert split is not None, block
        roles = {k: v for k, v in split.roles.items() if k.startswith("self_attn.")}
        assert roles == {"self_attn.q_b_proj": "q", "self_attn.kv_b_proj": "kv", "self_attn.o_proj": "o"}, (
            roles
        )
        assert "self_attn.kv_a_proj_with_mqa" in split.whole
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        presets.megatron_tp(sch, vocab_parallel=presets.has_vocab_embedding(sch))
        report = numeric_check(model, sch.record.calls, 2, inputs, timeout=120)
    assert report.status == "passed", report.message
    for block in ("model.layers.0", "model.layers.1"):
        assert _sharded(sch, f"{block}.self_attn.q_b_proj") == 0
        assert _sharded(sch, f"{block}.self_attn.kv_b_proj") == 0
        assert _sharded(sch, f"{block}.self_attn.o_proj") == 1
        assert _sharded(sch, f"{block}.self_attn.q_a_proj") is None
        assert _sharded(sch, f"{block}.self_attn.kv_a_proj_with_mqa") is None
    assert kept_whole(sch, model, inputs) == []


def test_complex_rotary_embedding_keeps_the_query_heads():
    model, inputs = _build(
        "deepseek_v2"
    )  # rotary: view_as_complex(q.reshape(..., -1, 2)) * freqs, view_as_real
    split = infer.block_split(_schedule(model, inputs), "model.layers.0")
    assert split.roles["self_attn.q_b_proj"] == "q" and split.roles["self_attn.kv_b_proj"] == "kv"
    assert split.layouts["self_attn.q_b_proj"].stride == 1
    assert split.attention == {"self_attn": (4, 4)}


def test_sparse_attention_indexer_stays_whole_and_sinks_follow_the_heads():
    model, inputs = _build("hy_v4")
    sch = _schedule(model, inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calls = presets.megatron_tp(sch, vocab_parallel=presets.has_vocab_embedding(sch))
        report = numeric_check(model, sch.record.calls, 2, inputs, timeout=120)
    assert report.status == "passed", report.message
    assert not any(n.startswith("Kept whole:") for n in calls.notes), calls.notes  # nothing failed the check
    for block in ("model.layers.0", "model.layers.1"):
        attn = f"{block}.self_attn"
        assert _sharded(sch, attn, "sinks") == 0
        assert _sharded(sch, f"{attn}.q_b_proj") == 0 and _sharded(sch, f"{attn}.gate_proj") == 0
        assert _sharded(sch, f"{attn}.o_proj") == 1
    whole = infer.block_split(sch, "model.layers.0").whole
    assert whole["self_attn.indexer.wq_b"].startswith("a token router"), (
        whole
    )  # reaches the block via topk only
    assert whole["self_attn.indexer.wk"].startswith("a token router"), whole
    for name in ("wq_b", "wk", "weights_proj"):
        assert _sharded(sch, f"model.layers.0.self_attn.indexer.{name}") is None
    assert kept_whole(sch, model, inputs) == []


@pytest.mark.parametrize(
    ("family", "expected"),
    [
        (
            "deepseek_v32",
            {
                "self_attn.q_a_proj": "a low-rank",
                "self_attn.kv_a_proj_with_mqa": "a low-rank",
                "self_attn.indexer.wq_b": "a token router",
                "self_attn.indexer.wk": "a token router",
                "self_attn.indexer.weights_proj": "a token router",
            },
        ),
        ("llama", {}),
    ],
)
def test_the_sweep_measures_low_rank_projections_and_token_routers(family, expected):
    model, inputs = _build(family)
    found = structural_exclusions(model, inputs, ["model.layers.0", "model.layers.1"])
    first = {k[len("model.layers.0.") :]: v for k, v in found.items() if k.startswith("model.layers.0.")}
    assert {k: v[: len(expected[k])] for k, v in first.items() if k in expected} == expected
    assert set(first) == set(expected), first
