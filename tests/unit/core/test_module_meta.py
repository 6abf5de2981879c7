"""``ModuleMeta`` (slapo_lab/module_state.py), the typed schedule state of a module: what primitives write into it,
what an all-or-nothing block puts back, and what a deep copy keeps apart. Tiny ``nn.Sequential`` models, CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slapo_lab as sl
from slapo_lab.atomic import atomic
from slapo_lab.module_state import META_ATTR, ModuleMeta, module_meta, peek_meta


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))


def test_primitives_write_typed_fields_and_untouched_modules_have_none():
    model = _mlp()
    sch = sl.create_schedule(model, world_size=2)
    assert peek_meta(model[0]) is None and sl.module_state(model[0]) is None
    sch["0"].shard("weight", axis=0)
    sch["0"].shard("bias", axis=0)
    sch["0"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    sch["2"].shard("weight", axis=1)
    sch["2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    sch["1"].checkpoint()
    first, act, last = (sl.module_state(m) for m in model)
    assert isinstance(first, ModuleMeta) and first is model[0].__dict__[META_ATTR]
    assert (
        first.sharded == {"weight": 0, "bias": 0}
        and first.output_type == "partition"
        and first.output_axis == -1
    )
    assert first.syncs == [("bwd_post", "all_reduce")] and len(first.hooks) == 1
    assert last.sharded == {"weight": 1} and last.output_type == "partial" and last.impl is not None
    assert last.syncs == [("fwd_post", "all_reduce")] and last.output_synced
    assert act.checkpoint and act.checkpoint_policy == "full" and act.sharded == {}
    with pytest.raises(AttributeError):
        act.no_such_field  # noqa: B018 - a typo is an error, not a silent None
    assert module_meta(model[1]) is act  # created once


def test_an_all_or_nothing_block_restores_a_state_that_existed_before_it():
    """A module scheduled before the block keeps its ModuleMeta's earlier contents (its lists and dicts are
    copied on entry, not shared), so a later failure leaves neither a sync nor its hook behind."""
    model = _mlp()
    sch = sl.create_schedule(model, world_size=2)
    sch["0"].shard("weight", axis=0)
    with pytest.raises(RuntimeError, match="boom"), atomic(sch):
        sch["0"].shard("bias", axis=0)
        sch["0"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        sch["0"].checkpoint()
        raise RuntimeError("boom")
    after = sl.module_state(model[0])
    assert after.sharded == {"weight": 0} and after.syncs == [] and after.hooks == [] and not after.checkpoint
    assert len(model[0]._forward_pre_hooks) == 0 and len(sch.record) == 1


def test_a_deep_copy_of_a_scheduled_module_has_its_own_state():
    model = _mlp()
    sch = sl.create_schedule(model)
    sch["0"].checkpoint()
    twin = copy.deepcopy(model)
    twin_meta = sl.module_state(twin[0])
    assert twin_meta is not sl.module_state(model[0]) and twin_meta.checkpoint
    twin_meta.cut = True
    assert not sl.module_state(model[0]).cut
    x = torch.randn(2, 8)
    with torch.no_grad():  # the composed forward is installed on the copy too
        torch.testing.assert_close(twin(x), model(x))
    assert twin[0].forward.__func__ is model[0].forward.__func__
