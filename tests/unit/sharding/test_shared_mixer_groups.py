"""Parts of a channel-parallel mixer that heads on different ranks share (:mod:`slapo_lab.sharding.mixers`), and
the partial gradients a gathered output's consumers receive (:func:`slapo_lab.numeric.first_differing_input_grad`).

* The layout reader: positions needed by several ranks run in blocks shared by consecutive ranks
  (``_grouped_layout``: a :class:`~slapo_lab.sharding.rules.BlockStride` with ``groups``), the rest split.
* Falcon-H1's Mamba-2 mixer with one group (and no gated norm): ``B`` and ``C`` of the fused ``in_proj`` (and their
  channels of the depthwise ``conv1d``) are replicated on every rank with their gradients summed, ``z`` / ``x`` /
  ``dt`` split by heads, its ``mup_vector`` buffer split like ``in_proj``'s outputs, ``conv_dim`` per rank
  ``x / 2 + B + C`` (vLLM's ``mamba_mixer2.py`` duplicates groups below the TP size); ✓.
* FalconMamba: ``x_proj``'s gathered output feeds the weightless ``b/c/dt_layernorm``, whose input gradient on a rank
  is that rank's part, summed by the gather's backward: ✓; the same schedule whose gather does not sum in backward
  (``tensor_parallel_output_grad=False``) is still found ✗.

Tiny transformers 5.x models built from their config classes (``tests/family_sweep.py``'s ``build``).
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
from slapo_lab.sharding.rules import BlockStride, local_shard
from slapo_lab.utils import meta_copy


def _schedule(model_type: str, cls: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, inputs = build(model_type, cls)
    sch = sl.create_schedule(meta_copy(model), world_size=2)
    set_example_inputs(sch, inputs)
    set_reference(sch, model)
    return model, inputs, sch


def test_grouped_layout_reads_shared_blocks():
    # world size 2: [z0 z0 z1 z1 | B B (both ranks) | dt0 dt1]
    stride = mixers._grouped_layout([1, 1, 2, 2, 3, 3, 1, 2], 2)
    assert isinstance(stride, BlockStride) and stride.sizes == (4, 2, 2) and stride.groups == (0, 1, 0)
    idx = torch.arange(8)
    assert local_shard(idx, 0, 2, 0, stride).tolist() == [0, 1, 4, 5, 6]
    assert local_shard(idx, 0, 2, 1, stride).tolist() == [2, 3, 4, 5, 7]
    # world size 4, 2 groups: group 0 on ranks 0-1, group 1 on ranks 2-3
    stride = mixers._grouped_layout([1, 2, 4, 8, 3, 3, 12, 12], 4)
    assert stride.sizes == (4, 4) and stride.groups == (0, 2)
    assert local_shard(idx, 0, 4, 1, stride).tolist() == [1, 4, 5]
    assert mixers._grouped_layout([3, 3], 2) is None  # nothing split
    assert mixers._grouped_layout([2, 1, 3], 2) is None  # a split block must start at rank 0
    assert mixers._grouped_layout([1, 2, 3, 3, 3], 2) is not None
    assert mixers._grouped_layout([1, 2, 2, 3], 2) is None  # unequal runs


def test_falcon_h1_replicates_b_and_c():
    model, inputs, sch = _schedule("falcon_h1", "FalconH1ForCausalLM")
    block = presets.find_blocks(sch)[0]
    split = infer.block_split(sch, block)
    assert split.roles["mamba.in_proj"] == "mlp_in" and split.roles["mamba.out_proj"] == "mlp_out"
    mixer = model.get_submodule(f"{block}.mamba")
    d, gn, h = mixer.intermediate_size, mixer.n_groups * mixer.ssm_state_size, mixer.num_heads
    assert mixer.n_groups == 1
    stride = split.layouts["mamba.in_proj"].stride  # z | x | B C (on both ranks) | dt
    assert (stride.sizes, stride.groups) == ((d, d, 2 * gn, h), (0, 0, 1, 0))
    plan = mixers.plan(split.mixers["mamba"], 2)
    assert plan.shards["conv1d:weight"] == (0, BlockStride((d, 2 * gn), (0, 1)))
    assert plan.shards[":mup_vector"] == (2, stride)
    assert presets.megatron_tp(sch, vocab_parallel=presets.has_vocab_embedding(sch)) is not None
    report = numeric_check(model, sch.record.calls, 2, inputs, timeout=100)
    assert report.status == "passed", report.message
    assert presets.replicated_dense(sch) is None  # every projection sharded
    local = sch[f"{block}.mamba"].mod
    assert (local.intermediate_size, local.num_heads, local.conv_dim) == (d // 2, h // 2, d // 2 + 2 * gn)
    assert local.in_proj.weight.shape[0] == d + 2 * gn + h // 2


def _falcon_mamba_schedule(sums_in_backward: bool):
    model, inputs, sch = _schedule("falcon_mamba", "FalconMambaForCausalLM")
    for block in presets.find_blocks(sch):
        for path, kind in presets.block_layers(sch, block):
            if kind != "gather_linear":
                presets.apply_layer(sch, path, kind)
                continue
            node = sch[path]
            node.shard("weight", axis=0)
            node.sync(mode="fwd_pre", sync_op_or_fn="all_gather", axis=-1)
            node.sync(
                mode="fwd_post",
                sync_op_or_fn="all_gather",
                axis=-1,
                tensor_parallel_output_grad=sums_in_backward,
            )
    return numeric_check(model, sch.record.calls, 2, inputs, timeout=100)


def test_gathered_output_consumers_receive_partial_gradients():
    assert _falcon_mamba_schedule(True).status == "passed"
    # a gather whose backward only slices (no sum over the ranks): the mixer's input gradient is wrong
    report = _falcon_mamba_schedule(False)
    assert report.status == "failed" and "mixer" in report.message, report.message
