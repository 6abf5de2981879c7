"""Vision blocks' splits read from their structure (issue 23's vision families).

A patch-merging linear (Swin's / Donut-Swin's ``downsample.reduction``: ``LayerNorm(4C)`` then
``Linear(4C, 2C)`` between stages) reaches no attention head and no row-parallel partner: the Megatron preset
makes it column parallel with its output gathered (:mod:`slapo_lab.sharding.lone_linears`), on tiny real HF
models built from their config classes; the numeric check on 2 simulated ranks passes, and fails without the
gather. :func:`~slapo_lab.sharding.lone_linears.lone_linear_kind` keeps a router, a low-rank projection, a
projection of an attention with a shared projection and a linear that did not run out of it.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import slapo_lab as sl
from slapo_lab import presets
from slapo_lab.numeric import numeric_check
from slapo_lab.preset_check import layer_regions
from slapo_lab.sharding.infer import BlockSplit
from slapo_lab.sharding.lone_linears import lone_linear_kind

SWIN = {"image_size": 32, "patch_size": 4, "embed_dim": 16, "depths": [1, 1], "num_heads": [2, 2]}
SWIN.update(window_size=4, num_labels=3)
FAMILIES = {
    "swin": ("SwinConfig", "SwinForImageClassification", "swin"),
    "donut-swin": ("DonutSwinConfig", "DonutSwinForImageClassification", "donut"),
}


def _build(family: str):
    cfg_cls, model_cls, base = FAMILIES[family]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**SWIN)
    model = getattr(transformers, model_cls)(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norm weights of ones would hide a wrongly gathered feature order less well
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape, generator=g))
    inputs = {"pixel_values": torch.randn(2, 3, 32, 32, generator=g)}
    return model, inputs, f"{base}.encoder.layers.0"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_patch_merging_linear_is_column_parallel_with_its_output_gathered(family):
    model, inputs, block = _build(family)
    sch = sl.create_schedule(copy.deepcopy(model), world_size=2)
    red = f"{block}.downsample.reduction"
    assert (red, "column_gather") in presets.block_layers(sch, block)
    calls = presets.megatron_tp(sch, vocab_parallel=False)
    assert not any(n.startswith("Kept whole: in every") for n in calls.notes), calls.notes
    w = sch[red].mod.weight
    assert w.shard_axis == 0 and w.shape[0] * 2 == w.orig_shape[0]
    gather = [
        c
        for c in sch.record.calls
        if c.path == red and c.primitive == "sync" and "all_gather" in c.kwargs.values()
    ]
    assert len(gather) == 1 and gather[0].kwargs["mode"] == "fwd_post", gather
    assert "downsample.reduction" not in (presets.replicated_dense(sch) or "")
    report = numeric_check(model, sch.record.calls, 2, inputs)
    assert report.passed, report.message
    # the gather is what makes it right: without it the next stage sees half the merged features
    report = numeric_check(model, [c for c in sch.record.calls if c not in gather], 2, inputs)
    assert not report.passed


def test_only_a_linear_nothing_keeps_whole_gets_the_gathered_column_split():
    split = BlockSplit(
        roles={"attn.q": "q", "attn.o": "o"},
        whole={"mlp.router": "a router"},
        attention={"attn": (4, 4)},
        ran={"attn.q", "attn.o", "mlp.router", "downsample.reduction", "attn.extra"},
    )
    assert lone_linear_kind(split, "downsample.reduction") == "column_gather"
    assert lone_linear_kind(split, "attn.extra") == "column_gather"
    assert lone_linear_kind(split, "mlp.router") is None  # kept whole for a reason
    assert lone_linear_kind(split, "attn.q") is None  # has a role
    assert lone_linear_kind(split, "never.ran") is None  # the forward did not run it: no kind
    moe = torch.nn.Module()  # a router the dataflow did not see: one logit per expert of a sibling bank
    moe.router, moe.experts = (
        torch.nn.Linear(8, 4),
        torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4)),
    )
    assert lone_linear_kind(split, "downsample.reduction", moe.router, moe) is None
    assert lone_linear_kind(split, "downsample.reduction", torch.nn.Linear(8, 6), moe) == "column_gather"
    split.shared = {"attn.kv_a"}  # an attention with a projection shared by its heads: f is on its input
    assert lone_linear_kind(split, "attn.extra") is None
    assert lone_linear_kind(split, "downsample.reduction") == "column_gather"


def test_a_gathered_column_linear_is_a_region_of_its_own():
    layers = [("attn.q", "column"), ("attn.o", "row"), ("reduction", "column_gather")]
    regions = layer_regions("Stage", layers)
    assert [paths for _r, paths in regions] == [["attn.q", "attn.o"], ["reduction"]]


LEVIT = {
    "image_size": 32,
    "hidden_sizes": [16, 32, 48],
    "num_attention_heads": [4, 4, 4],
    "depths": [2, 2, 2],
    "key_dim": [16, 16, 16],
    "mlp_ratio": [2, 2, 2],
    "attention_ratio": [2, 2, 2],
    "num_labels": 2,
}


def test_levit_attention_around_its_wrapped_projections_is_split_by_heads():
    """LeViT's ``LevitAttention`` runs the score matmuls; its fused ``queries_keys_values.linear`` and its
    ``projection.linear`` each sit in an ``MLPLayerWithBN`` (linear + batch norm) that its MLPs use too. The
    attention module is the one that ran the attention (attention_site.py), the shard rules see the
    projections under it, its head count and ``out_dim_projection`` become per rank, its per-head
    ``attention_biases`` are split, and the biases it cached from an earlier eval forward are dropped."""
    from slapo_lab.preset_check import set_reference
    from slapo_lab.sharding import infer
    from slapo_lab.utils import meta_copy

    torch.manual_seed(0)
    model = transformers.LevitForImageClassification(transformers.LevitConfig(**LEVIT)).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "attention_biases" in name or "batch_norm" in name:
                p.copy_(torch.randn(p.shape, generator=g))
    inputs = {"pixel_values": torch.randn(2, 3, 32, 32, generator=g)}
    with torch.no_grad():
        model(**inputs)  # fills LevitAttention.attention_bias_cache with every head's biases
    sch = sl.create_schedule(meta_copy(model), world_size=2)
    from slapo_lab.call_order import set_example_inputs

    set_example_inputs(sch, inputs)
    set_reference(sch, model)
    block = "levit.encoder.stages.2.layers.0"
    split = infer.block_split(sch, block)
    assert split.attention == {"module": (4, 4)}
    assert split.roles == {"module.queries_keys_values.linear": "qkv", "module.projection.linear": "o"}
    calls = presets.megatron_tp(sch, vocab_parallel=False)
    assert not any(n.startswith("Kept whole: in every") for n in calls.notes), calls.notes
    attn = sch[f"{block}.module"].mod
    assert (attn.num_attention_heads, attn.out_dim_projection) == (2, 64)
    assert attn.attention_biases.shape[0] == 2
    report = numeric_check(model, sch.record.calls, 2, inputs)
    assert report.passed, report.message


def test_hiera_mask_unit_attention_reads_its_heads_beside_a_windows_axis():
    """Hiera's ``HieraMaskUnitAttention`` holds q / k / v as ``(batch, heads, windows, tokens, head_dim)`` and
    pools its queries with ``max`` over tokens at a stage's first layer: the heads are read from the axis
    that splits the features apart (head_axes.py), its fused ``qkv`` is split in 3 blocks of heads, ``proj``
    is row parallel, ``hidden_size_output`` becomes per rank, and the stage-transition ``proj`` is column
    parallel with its output gathered."""
    from slapo_lab.sharding import infer

    torch.manual_seed(0)
    cfg = transformers.HieraConfig(
        embed_dim=16, num_heads=[2, 2], depths=[1, 1], image_size=[32, 32], num_labels=2,
        masked_unit_size=[4, 4], query_stride=[2, 2], num_query_pool=1,
    )  # fmt: skip
    model = transformers.HieraForImageClassification(cfg).eval()
    inputs = {"pixel_values": torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))}
    sch = sl.create_schedule(copy.deepcopy(model), world_size=2)
    for stage in ("hiera.encoder.stages.0", "hiera.encoder.stages.1"):
        split = infer.block_split(sch, stage)
        assert split.attention == {"layers.0.attn": (2, 2)}, (stage, split.attention)
        assert split.roles["layers.0.attn.qkv"] == "qkv" and split.roles["layers.0.attn.proj"] == "o"
        assert split.layouts["layers.0.attn.qkv"].stride == 3
    kinds = dict(presets.block_layers(sch, "hiera.encoder.stages.1"))
    assert kinds["hiera.encoder.stages.1.layers.0.proj"] == "column_gather"
    calls = presets.megatron_tp(sch, vocab_parallel=False)
    assert not any(n.startswith("Kept whole: in every") for n in calls.notes), calls.notes
    attn = sch["hiera.encoder.stages.1.layers.0.attn"].mod
    assert (attn.num_heads, attn.hidden_size_output) == (1, 16)
    report = numeric_check(model, sch.record.calls, 2, inputs)
    assert report.passed, report.message


def test_a_stage_of_convolution_blocks_beside_an_attention_block_is_recorded():
    """SwiftFormer's stage is an ``nn.ModuleList`` of convolution-only encoders and one attention block: the
    dataflow of the attention block is recorded (the convolution blocks, with no dense layer, are skipped), so
    the preset is no longer refused for want of a recorded dataflow. Its additive attention contracts the query
    with a learned vector over all features (``query @ w_g``), so the channel-mixer rule finds no per-rank split
    of its channels; its linears pair with nothing and are column parallel with their outputs gathered where the
    check passes (lone_linears), and what stays whole says why."""
    from slapo_lab.sharding import infer

    torch.manual_seed(0)
    cfg = transformers.SwiftFormerConfig(
        image_size=32, depths=[2, 2, 2, 2], embed_dims=[16, 16, 32, 32], num_labels=2
    )
    model = transformers.SwiftFormerForImageClassification(cfg).eval()
    inputs = {"pixel_values": torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))}
    sch = sl.create_schedule(copy.deepcopy(model), world_size=2)
    blocks = presets.find_blocks(sch)
    attn_block = next(b for b in blocks if hasattr(model.get_submodule(b), "attn"))  # a stage's second block
    split = infer.block_split(sch, attn_block)
    assert split is not None and {"attn.to_query", "attn.to_key", "attn.proj", "attn.final"} <= split.ran
    presets.megatron_tp(sch, vocab_parallel=False)  # not refused
    report = numeric_check(model, sch.record.calls, 2, inputs)
    assert report.passed, report.message
