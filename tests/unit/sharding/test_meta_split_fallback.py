"""The split read from a meta copy's dataflow falls back to the remembered real model where the meta forward
stops early, and index maps broadcast by an elementwise op survive a later ``view``.

Laguna (transformers 5.x, built tiny from its config class by tests/family_sweep.py): its first block is dense and
its second has experts, whose routing the meta forward cannot run, so the meta analysis holds one block of two;
its per-head output gate ``g_proj`` multiplies the attention output through ``gate.unsqueeze(-1)`` (an expanded
map) before ``.view(B, T, -1)``. The schedule is a meta copy with the real model remembered (as the editor
makes it): both blocks get q/k/v/g/o and MLP roles, the Megatron preset keeps nothing whole, and the numeric
check on 2 simulated ranks passes.
"""

from __future__ import annotations

import torch
from family_sweep import build, families

import slapo_lab as sl
from slapo_lab import presets
from slapo_lab.call_order import set_example_inputs
from slapo_lab.numeric import numeric_check
from slapo_lab.preset_check import set_reference
from slapo_lab.sharding import infer
from slapo_lab.utils import meta_copy


def test_a_meta_copy_whose_forward_stops_early_reads_every_block_from_the_real_model():
    model, inputs = build("laguna", families()["laguna"][1])
    inputs = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    sch = sl.create_schedule(meta_copy(model), world_size=2)
    set_example_inputs(sch, inputs)
    set_reference(sch, model)
    for block, mlp in (("model.layers.0", "mlp"), ("model.layers.1", "mlp.shared_experts")):
        roles = infer.block_split(sch, block).roles
        assert roles["self_attn.g_proj"] == "g" and roles["self_attn.o_proj"] == "o", roles
        assert roles[f"{mlp}.down_proj"] == "mlp_out", roles
    notes = presets.megatron_tp(sch, vocab_parallel=presets.has_vocab_embedding(sch)).notes
    assert not any("Kept whole" in n for n in notes), notes
    report = numeric_check(model, sch.record.calls, 2, inputs)
    assert report.passed, report.message
