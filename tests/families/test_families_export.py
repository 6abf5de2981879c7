"""Exported tensor-parallel scripts (Megatron preset + checkpoint preset) pass ``--verify`` on 2 gloo ranks for the
families whose exported TP script no other suite launches (OPT and T5: test_families_tp_head_counts.py; Qwen3, Mixtral and
ViT: test_families_tp_gqa_moe_vit.py; BERT and GPT-2: test_export_torchrun.py)."""

from __future__ import annotations

import warnings

import pytest
from harness import launch_torchrun
from zoo.families import FAMILIES

import slapo_lab as sl
from slapo_lab import presets
from slapo_lab.export import export_script


@pytest.mark.multirank
@pytest.mark.parametrize("family", ["roberta", "albert", "gpt_neo", "llama", "mistral"])
def test_exported_tp_script_verifies_on_two_ranks(family, tmp_path):
    fam = FAMILIES[family]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = fam.build()
    sch = sl.create_schedule(model, world_size=2)
    presets.megatron_tp(sch, vocab_parallel=presets.has_vocab_embedding(sch))
    presets.checkpoint_blocks(sch)
    script = export_script(
        tmp_path / f"train_{family}.py", model, sch.record.calls, fam.example_inputs(), world_size=2
    )
    args = ["--device", "cpu", "--steps", "2"]
    rc, out = launch_torchrun(script, 2, args, 300)
    if "EADDRINUSE" in out or "address already in use" in out:  # the free port was taken in between
        rc, out = launch_torchrun(script, 2, args, 300)
    assert rc == 0 and "Verify: PASSED" in out, f"exit {rc}\n{out[-4000:]}"
    grads = [line for line in out.splitlines() if line.startswith("Verify: gradients of ")]
    assert len(grads) == 1 and float(grads[0].split("max abs diff ")[1].split()[0]) <= 1e-5, grads
    assert "step 2/2 loss" in out, out[-2000:]
