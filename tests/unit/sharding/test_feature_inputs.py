"""Per-feature block arguments (:mod:`slapo_lab.sharding.feature_inputs`): a tensor built outside the block that
multiplies a column-parallel layer's features is cut to each rank's features.

* a hand-written stack whose layers gate their MLP with a per-layer input built by the model (the shape of
  Gemma 4's ``per_layer_input``): the argument is read from the dataflow, the preset splits every projection
  and the numeric check on 2 simulated ranks passes; without the backward all-reduce of the cut argument the
  gradient of the layer that builds it differs, and without the cut the forward fails;
* a per-token argument (one entry per token, broadcast over the features) is not per feature;
* Gemma 4 (text) built tiny from its config class: ``per_layer_input_gate`` / ``per_layer_projection`` split,
  ``per_layer_input`` cut, the check passing.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slapo_lab as sl
from slapo_lab import presets
from slapo_lab.call_order import set_example_inputs
from slapo_lab.module_state import peek_meta
from slapo_lab.numeric import numeric_check
from slapo_lab.preset_check import set_reference
from slapo_lab.sharding import feature_inputs, heads, infer


class GatedLayer(nn.Module):
    def __init__(self, per_token: bool) -> None:
        super().__init__()
        self.attn_in, self.attn_out = nn.Linear(16, 32), nn.Linear(32, 16)
        self.gate, self.proj = nn.Linear(16, 32), nn.Linear(32, 16)
        self.per_token = per_token

    def forward(self, hidden_states, layer_input):
        x = hidden_states + self.attn_out(torch.tanh(self.attn_in(hidden_states)))
        h = nn.functional.gelu(self.gate(x))
        h = h * (layer_input.mean(-1, keepdim=True) if self.per_token else layer_input)
        return x + self.proj(h)


class PerLayerInputNet(nn.Module):
    """Two gated layers, each taking its slice of one per-layer input the model builds from the embeddings."""

    def __init__(self, per_token: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.per_layer = nn.Linear(16, 2 * 32)
        self.layers = nn.ModuleList([GatedLayer(per_token) for _ in range(2)])
        self.head = nn.Linear(16, 32)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        per_layer = self.per_layer(x).view(*x.shape[:-1], 2, 32)
        for i, layer in enumerate(self.layers):
            x = layer(x, per_layer[:, :, i])
        return self.head(x)


def _preset(model, inputs):
    sch = sl.create_schedule(copy.deepcopy(model), world_size=2)
    set_example_inputs(sch, inputs)
    set_reference(sch, model)
    calls = presets.megatron_tp(sch, vocab_parallel=False)
    return sch, calls


def test_a_per_layer_input_follows_the_features_it_gates(monkeypatch):
    torch.manual_seed(0)
    model = PerLayerInputNet().eval()
    inputs = {"input_ids": torch.randint(0, 32, (2, 8))}
    sch, calls = _preset(model, inputs)
    split = infer.block_split(sch, "layers.0")
    assert split.roles["gate"] == "mlp_in" and split.roles["proj"] == "mlp_out"
    assert split.feature_inputs == [("proj", "layer_input", 2)]
    assert not any(n.startswith("Kept whole: in every") for n in calls.notes), calls.notes
    for rel in ("gate", "proj", "attn_in", "attn_out"):
        assert sch[f"layers.0.{rel}"].mod.weight.shard_axis is not None, rel
    assert peek_meta(sch["layers.0"].mod).feature_inputs == ["layer_input"]
    report = numeric_check(model, sch.record.calls, 2, inputs)
    assert report.passed, report.message
    # each rank's gradient of its cut covers its own features only: without the sum over the ranks the
    # gradient each layer sends back to the argument differs
    monkeypatch.setattr(heads, "_summed", lambda t, group: t)
    report = numeric_check(model, sch.record.calls, 2, inputs)
    assert report.status == "failed" and "only gradients differ" in report.message, report.message
    monkeypatch.undo()
    # and without the cut the rank's features meet all of the argument's
    monkeypatch.setattr(feature_inputs, "install", lambda *a, **k: None)
    report = numeric_check(model, sch.record.calls, 2, inputs)
    assert report.status == "error" and "layers.0" in report.message, report.message


def test_a_per_token_argument_is_not_per_feature():
    torch.manual_seed(0)
    model = PerLayerInputNet(per_token=True).eval()
    inputs = {"input_ids": torch.randint(0, 32, (2, 8))}
    sch, _ = _preset(model, inputs)
    split = infer.block_split(sch, "layers.0")
    assert split.roles["proj"] == "mlp_out"
    assert not getattr(split, "feature_inputs", None)
    meta = peek_meta(sch["layers.0"].mod)
    assert not (meta and meta.feature_inputs)
    report = numeric_check(model, sch.record.calls, 2, inputs)
    assert report.passed, report.message


@pytest.mark.parametrize("family", ["gemma4_text"])
def test_gemma4_per_layer_input_is_cut_with_its_gate(family):
    from tests.family_sweep import build, families, kept_whole

    model, inputs = build(family, families()[family][1])
    sch, _ = _preset(model, inputs)
    split = infer.block_split(sch, "model.layers.0")
    assert split.roles["per_layer_input_gate"] == "mlp_in"
    assert split.roles["per_layer_projection"] == "mlp_out"
    assert split.feature_inputs == [("per_layer_projection", "per_layer_input", 2)]
    report = numeric_check(model, sch.record.calls, 2, inputs)
    assert report.passed, report.message
    assert kept_whole(sch, model, inputs) == []
