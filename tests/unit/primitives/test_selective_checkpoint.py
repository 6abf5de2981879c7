"""``checkpoint(policy="selective")``: per-op selective activation checkpointing (torchtitan's
``selective_ac_option="op"`` through torch's ``create_selective_checkpoint_contexts``) as a schedule primitive.

A real Llama from its config class. What is checked: gradients equal the unscheduled model's; the backward
recomputes fewer matmuls than full checkpointing and more than none (counted at the aten level); the call records,
replays from its JSON and exports; the preset records it (the planner's ``apply`` in test_planner.py); at TP 2 the numeric check
passes; under ``torch.compile`` (aot_eager) the gradients still match."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

import slapo_lab as sl
from slapo_lab import presets
from slapo_lab.errors import ScheduleError
from slapo_lab.numeric import numeric_check
from slapo_lab.record import dumps, replay


def _llama(layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            self.n += 1
        return func(*args, **(kwargs or {}))


def _grads_and_backward_matmuls(model) -> tuple[dict, int]:
    loss = model(input_ids=IDS, labels=IDS, use_cache=False).loss
    with _CountMatmuls() as count:
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, count.n


def _scheduled(model, policy: str | None):
    sch = sl.create_schedule(copy.deepcopy(model))
    if policy is not None:
        presets.checkpoint_blocks(sch, policy=policy, check=False)
    return sch


def test_selective_keeps_gradients_and_recomputes_less_than_full():
    model = _llama()
    ref, n_none = _grads_and_backward_matmuls(copy.deepcopy(model))
    counts = {}
    for policy in ("full", "selective"):
        sch = _scheduled(model, policy)
        grads, counts[policy] = _grads_and_backward_matmuls(sch.mod)
        for name, g in ref.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=f"{policy}: {name}")
    assert n_none < counts["selective"] < counts["full"], (n_none, counts)


def test_selective_with_the_tensor_parallel_rng_tracker_in_use():
    """The training runtime seeds the tracker (set_random_seed with a tp_rank), and then the recomputation restores
    its states; that restore must stay outside torch's recompute mode, which expects exactly the forward's ops
    (it read "aten.clone.default encountered during backward but not found in storage" when inside)."""
    from slapo_lab.random import get_cuda_rng_tracker, set_random_seed

    model = _llama()
    ref, _ = _grads_and_backward_matmuls(copy.deepcopy(model))
    set_random_seed(1234, tp_rank=0)
    try:
        assert get_cuda_rng_tracker().states
        sch = _scheduled(model, "selective")
        grads, _ = _grads_and_backward_matmuls(sch.mod)
    finally:
        get_cuda_rng_tracker().reset()
    for name, g in ref.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_the_call_records_replays_and_exports():
    model = _llama()
    sch = sl.create_schedule(copy.deepcopy(model))
    sch["model.layers.0"].checkpoint(policy="selective")
    (call,) = sch.record.calls
    assert call.kwargs == {"policy": "selective"}
    fresh = sl.create_schedule(copy.deepcopy(model))
    replay(fresh, json.loads(dumps(sch.record.calls))["calls"])
    assert fresh["model.layers.0"].mod._slapo_meta.checkpoint_policy == "selective"
    from slapo_lab.export import input_spec, model_spec, render_script

    text = render_script(
        model_spec(model), sch.record.calls, input_spec({"input_ids": IDS}, 128), world_size=1
    )
    assert 'checkpoint(policy="selective")' in text or "checkpoint(policy='selective')" in text
    with pytest.raises(
        ScheduleError, match=r"^checkpoint\(policy='some'\) on model\.layers\.1: the policy is one of"
    ):
        sch["model.layers.1"].checkpoint(policy="some")
    assert len(sch.record) == 1


def test_tensor_parallel_with_selective_checkpointing_checks_numerically():
    model = _llama()
    sch = sl.create_schedule(copy.deepcopy(model), world_size=2)
    presets.megatron_tp(sch, check=False)
    presets.checkpoint_blocks(sch, policy="selective", check=False)
    report = numeric_check(model, sch.record.calls, 2, {"input_ids": IDS})
    assert report.status == "passed" and not report.unjudged, report.message


def test_selective_checkpoint_under_torch_compile():
    model = _llama()
    ref, _ = _grads_and_backward_matmuls(copy.deepcopy(model))
    sch = _scheduled(model, "selective")
    for block in sch.mod.model.layers:
        block.compile(fullgraph=True, backend="aot_eager")
    grads, _ = _grads_and_backward_matmuls(sch.mod)
    for name, g in ref.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_the_memory_plan_counts_what_selective_checkpointing_keeps():
    """The memory view's exact pass (``plan(activation="autograd")``) sees the outputs the selective policy keeps,
    which live in the checkpoint's own cache, not in autograd's saved tensors: less than no checkpointing, more
    than full checkpointing."""
    from slapo_lab.plan import plan

    model = _llama(layers=4)
    saved = {}
    for policy in (None, "selective", "full"):
        sch = _scheduled(model, policy)
        saved[policy] = plan(sch, example_inputs={"input_ids": IDS}, activation="autograd").per_stage[0][
            "activation_bytes"
        ]
    assert saved["full"] < saved["selective"] < saved[None], saved
