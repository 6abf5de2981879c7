"""Norms over a split layer's features: sharded with the features, their statistics summed over the ranks.

:mod:`slapo_lab.sharding.feature_stats` (the shard rule) and ``BlockSplit.feature_params``
(:mod:`slapo_lab.sharding.infer`, read from the block's dataflow):

* the rule alone, on a column-parallel layer -> norm -> row-parallel layer, for ``nn.LayerNorm``, ``nn.RMSNorm``,
  transformers' ``LlamaRMSNorm``, a LayerNorm written with ``mean`` / ``var`` and ConvNeXt-V2's GRN: the numeric
  check on 2 threaded ranks passes, and fails when the statistics are not summed over the ranks;
* tiny transformers models built from their config classes: BitNet's ``attn_sub_norm`` (over the attention
  output) / ``ffn_sub_norm`` (over the MLP features), OLMo 2's ``q_norm`` / ``k_norm`` (over all heads' q / k),
  ConvNeXt-V2's GRN: the inferred feature modules, the Megatron preset splitting every projection, the numeric
  check passing.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn

import slapo_lab as sl
from slapo_lab import presets
from slapo_lab.numeric import numeric_check
from slapo_lab.sharding import feature_stats, infer


class MeanVarLayerNorm(nn.Module):
    """A LayerNorm written out with ``mean`` and ``var`` (a class the rule knows only as a norm by its name)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n))
        self.bias = nn.Parameter(torch.randn(n))

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        var = x.var(-1, keepdim=True, unbiased=False)
        return (x - mu) / torch.sqrt(var + 1e-5) * self.weight + self.bias


def _norms():
    from transformers.models.convnextv2.modeling_convnextv2 import ConvNextV2GRN
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    grn = ConvNextV2GRN(16)
    with torch.no_grad():
        for p in grn.parameters():
            p.copy_(torch.randn(p.shape))
    return {
        "layer_norm": lambda: nn.LayerNorm(16),
        "rms_norm": lambda: nn.RMSNorm(16),
        "llama_rms_norm": lambda: LlamaRMSNorm(16),
        "mean_var": lambda: MeanVarLayerNorm(16),
        "grn": lambda: grn,
    }


class ColNormRow(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(8, 16), norm, nn.Linear(16, 8)

    def forward(self, x):
        return self.down(self.norm(self.up(x)))


def _calls(model: nn.Module):
    sch = sl.create_schedule(copy.deepcopy(model), world_size=2)
    sch["up"].shard("weight", 0)
    sch["up"].shard("bias", 0)
    sch["up"].sync("bwd_post", "all_reduce")
    for name, p in model.norm.named_parameters():
        sch["norm"].shard(name, p.dim() - 1)
    sch["down"].shard("weight", 1)
    sch["down"].sync("fwd_post", "all_reduce")
    return sch.record.calls


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm", "llama_rms_norm", "mean_var", "grn"])
def test_a_norm_sharded_on_its_features_sums_its_statistics_over_the_ranks(kind, monkeypatch):
    torch.manual_seed(0)
    model = ColNormRow(_norms()[kind]())
    x = torch.randn(2, 3, 3, 8) if kind == "grn" else torch.randn(2, 5, 8)
    calls = _calls(model)
    report = numeric_check(model, calls, 2, {"x": x})
    assert report.passed, report.message
    # the same shards with each rank's own statistics only: the outputs differ
    monkeypatch.setattr(feature_stats, "_global_sum", lambda t, g: t)
    report = numeric_check(model, calls, 2, {"x": x})
    assert report.status == "failed" and report.worst > 1e-2, report.message


_TINY_DECODER = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}

FAMILIES = {
    "bitnet": (
        "BitNetConfig",
        "BitNetForCausalLM",
        _TINY_DECODER,
        {
            "self_attn.attn_sub_norm": {"self_attn.o_proj"},
            "mlp.ffn_sub_norm": {"mlp.gate_proj", "mlp.up_proj"},
        },
    ),
    "olmo2": (
        "Olmo2Config",
        "Olmo2ForCausalLM",
        _TINY_DECODER,
        {"self_attn.q_norm": {"self_attn.q_proj"}, "self_attn.k_norm": {"self_attn.k_proj"}},
    ),
    "convnextv2": (
        "ConvNextV2Config",
        "ConvNextV2ForImageClassification",
        {"image_size": 32, "num_stages": 2, "hidden_sizes": [16, 32], "depths": [1, 1], "num_labels": 4},
        {"layers.0.grn": {"layers.0.pwconv1"}},
    ),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_megatron_preset_shards_norms_over_split_features(family):
    cfg_cls, model_cls, kw, expected = FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kw)).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norm weights of ones (and GRN's zeros) would hide a weight sharded the wrong way
        for name, p in model.named_parameters():
            if "norm" in name or "grn" in name:
                p.copy_(torch.randn(p.shape, generator=g))
    if family == "convnextv2":
        inputs = {"pixel_values": torch.randn(2, 3, 32, 32, generator=g)}
        block = "convnextv2.encoder.stages.0"
    else:
        inputs = {"input_ids": torch.randint(1, 128, (2, 8), generator=g)}
        block = "model.layers.0"
    sch = sl.create_schedule(copy.deepcopy(model), world_size=2)
    split = infer.block_split(sch, block)
    assert split.feature_params == expected
    assert not split.grad_sum & set(expected)
    calls = presets.megatron_tp(sch, vocab_parallel=presets.has_vocab_embedding(sch))
    assert not any(n.startswith("Kept whole: in every") for n in calls.notes), calls.notes
    for rel in expected:
        w = sch[f"{block}.{rel}"].mod.weight
        assert w.shape[-1] * 2 == w.orig_shape[-1] and w.shard_axis == w.dim() - 1
    report = numeric_check(model, sch.record.calls, 2, inputs)
    assert report.passed, report.message


class NormedEmbedding(nn.Embedding):
    """An embedding whose own forward normalises the looked-up rows (transformers' ``InklingNormedEmbedding``)."""

    def __init__(self, n: int, d: int) -> None:
        super().__init__(n, d)
        self.embed_norm = nn.RMSNorm(d)

    def forward(self, ids):
        return self.embed_norm(super().forward(ids))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = NormedEmbedding(32, 16), nn.Linear(16, 4)
        with torch.no_grad():
            self.embed.embed_norm.weight.copy_(torch.randn(16))

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids):
        return self.head(self.embed(input_ids))


def test_a_norm_inside_a_vocab_parallel_embedding_sums_its_gradients():
    torch.manual_seed(0)
    model = TinyLM()
    sch = sl.create_schedule(copy.deepcopy(model), world_size=2)
    presets.vocab_parallel_embeddings(sch)
    calls = sch.record.calls
    assert [(c.path, c.kwargs.get("param_grads")) for c in calls if c.path == "embed.embed_norm"] == [
        ("embed.embed_norm", True)
    ]
    inputs = {"input_ids": torch.randint(0, 32, (2, 8))}
    report = numeric_check(model, calls, 2, inputs)
    assert report.passed, report.message
    # without it each rank's embed_norm.weight gradient holds its own rows' part only
    report = numeric_check(model, [c for c in calls if c.path != "embed.embed_norm"], 2, inputs)
    assert report.status == "failed" and "embed" in report.message, report.message


class ConvBlock(nn.Module):
    """up -> a depthwise causal convolution over its features (Inkling's short convolutions) -> down."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
        self.conv = nn.Conv1d(32, 32, 3, groups=32, padding=2)

    def forward(self, x):
        h = self.conv(self.up(x).transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)
        return x + self.down(torch.nn.functional.silu(h))


class ConvStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([ConvBlock(), ConvBlock()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_depthwise_convolution_over_split_features_is_split_by_channels():
    from slapo_lab.call_order import set_example_inputs

    torch.manual_seed(0)
    model = ConvStack()
    inputs = {"x": torch.randn(2, 8, 16)}
    sch = sl.create_schedule(copy.deepcopy(model), world_size=2)
    set_example_inputs(sch, inputs)
    assert infer.block_split(sch, "layers.0").feature_params == {"conv": {"up"}}
    presets.megatron_tp(sch, vocab_parallel=False)
    conv = sch["layers.1.conv"].mod
    assert conv.weight.shape == (16, 1, 3) and conv.bias.shape == (16,) and conv.groups == 16
    report = numeric_check(model, sch.record.calls, 2, inputs)
    assert report.passed, report.message
