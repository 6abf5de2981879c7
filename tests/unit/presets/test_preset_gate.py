"""Presets check their calls before they commit (slapo_lab/preset_check.py), and export never ships a ✗.

A region (an attention's q/k/v..o, an MLP's up..down, an expert bank, the embeddings) that a primitive refuses
or that makes the numeric check fail is kept whole in every block of its class, with one sentence saying
which and why; nothing is committed when no region is right; export_script, the editor's Export and
``slapo-lab export`` refuse a schedule the numeric check marks failing unless forced.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slapo_lab as sl
from slapo_lab import presets
from slapo_lab.preset_check import layer_regions


class _WidthHeads(nn.Module):
    """An attention that derives its head size from the input's width (nanoGPT's ``C // n_head``), which
    tensor parallelism halves: split, it computes the wrong heads."""

    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.n_head = heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(width, width) for _ in range(3))
        self.o_proj = nn.Linear(width, width)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (p(x) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class _MLP(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.up_proj, self.down_proj = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return self.down_proj(F.gelu(self.up_proj(x)))


class _Block(nn.Module):
    def __init__(self, mlp: bool = True) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(32)
        self.attn = _WidthHeads()
        self.mlp = _MLP() if mlp else None

    def forward(self, x):
        x = x + self.attn(self.ln(x))
        return x + self.mlp(x) if self.mlp is not None else x


class _Model(nn.Module):
    def __init__(self, mlp: bool = True) -> None:
        super().__init__()
        self.wte = nn.Embedding(64, 32)
        self.h = nn.ModuleList([_Block(mlp) for _ in range(3)])

    def forward(self, input_ids):
        x = self.wte(input_ids)
        for b in self.h:
            x = b(x)
        return x


def build_model() -> nn.Module:
    """The factory exported scripts rebuild the model with (``test_preset_gate:build_model``)."""
    torch.manual_seed(0)
    return _Model()


def test_regions_are_the_megatron_pairs_with_their_per_head_extras():
    layers = [
        ("ln_1", "norm"),
        ("attn.q_proj", "column"),
        ("attn.k_proj", "column"),
        ("attn.q_norm", "head_norm"),
        ("attn.v_proj", "column"),
        ("attn.o_proj", "row"),
        ("mlp.gate", "column"),
        ("mlp.up", "column"),
        ("mlp.down", "row"),
        ("moe.experts", "experts"),
    ]
    regions = layer_regions("Block", layers)
    assert [(r.label, paths) for r, paths in regions] == [
        (
            "attn (q_proj, k_proj, v_proj, o_proj, q_norm)",
            ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "attn.q_norm"],
        ),
        ("mlp (gate, up, down)", ["mlp.gate", "mlp.up", "mlp.down"]),
        ("moe (experts)", ["moe.experts"]),
        ("ln_1", ["ln_1"]),
    ]
    assert all(r.where == "every Block" for r, _ in regions)


def test_a_region_that_fails_the_check_is_kept_whole_and_the_rest_is_split():
    """Typed, with no example inputs remembered: the gate guesses input_ids, splits the attention, sees it
    fail, keeps it whole in every block and commits the MLP and the vocabulary-parallel embedding."""
    torch.manual_seed(0)
    model = _Model()
    reference = copy.deepcopy(model)
    sch = sl.create_schedule(model, world_size=2)
    result = presets.megatron_tp(sch)
    kept = [n for n in result.notes if n.startswith("Kept whole:")]
    assert len(kept) == 1 and kept[0].startswith(
        "Kept whole: in every _Block attn (q_proj, k_proj, v_proj, o_proj), because it fails the numeric check "
        "when split: the scheduled model fails in h.0.attn"
    ), result.notes
    assert "\n" not in kept[0] and kept[0].endswith(".")
    paths = {c.path for c in result}
    assert {f"h.{i}.mlp.{p}" for i in range(3) for p in ("up_proj", "down_proj")} <= paths
    assert not any(".attn." in p for p in paths)
    assert model.h[2].attn.q_proj.weight.shape == (32, 32) and model.h[2].mlp.up_proj.weight.shape == (32, 32)
    inputs = {"input_ids": torch.randint(0, 64, (2, 8))}
    found = sl.check_schedule(sch, numeric=True, reference=reference, example_inputs=inputs)
    assert found == [], found
    # the coverage note names the attention with the gate's reason, not "not a recognised projection"
    cover = presets.replicated_dense(sch)
    assert "attn.q_proj" in cover and "fails the numeric check when split" in cover


def test_nothing_is_committed_when_no_region_is_right():
    torch.manual_seed(0)
    model = _Model(mlp=False)
    sch = sl.create_schedule(model, world_size=2)
    params = dict(model.named_parameters())
    with pytest.raises(sl.ScheduleError) as info:
        presets.megatron_tp(sch, vocab_parallel=False)
    msg = str(info.value)
    assert msg.startswith(
        "No part of the preset can be applied right, so nothing is applied: in every _Block attn"
    )
    assert "h.0.attn" in msg and "\n" not in msg
    assert len(sch.record) == 0
    assert all(p is params[n] for n, p in model.named_parameters())


def test_without_the_check_the_preset_applies_every_region():
    torch.manual_seed(0)
    model = _Model()
    sch = sl.create_schedule(model, world_size=2)
    calls = presets.megatron_tp(sch, check=False)
    assert any(c.path == "h.0.attn.q_proj" for c in calls)
    assert not any(n.startswith("Kept whole:") for n in calls.notes)


def test_export_refuses_a_failing_schedule_and_reuses_the_editors_live_result(tmp_path, monkeypatch):
    import slapo_lab.numeric

    torch.manual_seed(0)
    model = _Model()
    inputs = {"input_ids": torch.randint(0, 64, (2, 8))}
    sch = sl.create_schedule(copy.deepcopy(model), world_size=2)
    presets.megatron_tp(sch, check=False)  # the attention split that fails
    with pytest.raises(sl.ExportError) as info:
        sl.export_script(tmp_path / "t.py", model, sch.record.calls, inputs, 2)
    msg = str(info.value)
    assert msg.startswith("Not exported: the scheduled model fails in h.0.attn") and "force=True" in msg
    assert "\n" not in msg and not (tmp_path / "t.py").exists()
    factory = "test_preset_gate:build_model"
    written = sl.export_script(
        tmp_path / "t.py", model, sch.record.calls, inputs, 2, factory=factory, force=True
    )
    assert written.exists()

    ed = sl.ScheduleEditor(model, example_inputs=inputs, world_size=2, live_check=False, factory=factory)
    ed.apply_preset("megatron")
    assert "Kept whole: in every _Block attn" in ed.message, ed.message
    report = ed.numeric_check()  # what the live check shows for this schedule
    assert report.passed, report.message
    ed.numeric_report = report
    runs = []
    real = slapo_lab.numeric.numeric_check
    monkeypatch.setattr(slapo_lab.numeric, "numeric_check", lambda *a, **k: runs.append(1) or real(*a, **k))
    ed.export(str(tmp_path / "train.py"))
    assert runs == [] and (tmp_path / "train.py").exists()  # the live ✓ of this schedule was reused
    ed.apply("checkpoint", path="h.1")
    ed.numeric_report = None  # a change: the live result no longer holds
    ed.export(str(tmp_path / "train2.py"))
    assert runs == [1]
