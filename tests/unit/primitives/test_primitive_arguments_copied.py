"""Modules and tensors handed to primitives are copied before they enter the model.

``sch["a.b"].replace(my_linear)`` followed by ``shard`` of the replaced module used to put the user's
own ``nn.Linear`` into the model, so the shard sliced *its* weight ((64, 64) -> (32, 64)), and the
editor's undo / redo left it that way. Now the model gets a deep copy (anything already in the model,
such as the old module it wraps, stays shared), so the object the user holds is never changed.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import slapo_lab as sl

Q = "encoder.layer.0.attention.self.query"


def _bert():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=120,
        max_position_embeddings=64,
    )
    return BertModel(cfg)


def _snapshot(mod: nn.Module) -> dict:
    """Everything a primitive could change on a module the user holds."""
    return {
        "params": [
            (
                n,
                id(p),
                tuple(p.shape),
                p.device.type,
                None if p.is_meta else p.detach().clone(),
                dict(p.__dict__),
            )
            for n, p in mod.named_parameters()
        ],
        "buffers": [(n, id(b), tuple(b.shape)) for n, b in mod.named_buffers()],
        "modules": [(n, id(m)) for n, m in mod.named_modules()],
        "hooks": (len(mod._forward_hooks), len(mod._forward_pre_hooks), len(mod._backward_hooks)),
        "forward": mod.__dict__.get("forward"),
        "dict": sorted(k for k in mod.__dict__ if not k.startswith("_")),
        "training": mod.training,
    }


def _assert_untouched(mod: nn.Module, snap: dict) -> None:
    now = _snapshot(mod)
    for (n, i, shape, dev, val, attrs), (n2, i2, shape2, dev2, val2, attrs2) in zip(
        snap["params"], now["params"], strict=True
    ):
        assert (n, i, shape, dev) == (n2, i2, shape2, dev2), f"parameter {n} of the user's module changed"
        assert attrs == attrs2, (
            f"parameter {n} of the user's module got attributes {set(attrs2) - set(attrs)}"
        )
        if val is not None:
            assert torch.equal(val, val2), f"values of parameter {n} of the user's module changed"
    for key in ("buffers", "modules", "hooks", "forward", "dict", "training"):
        assert snap[key] == now[key], f"the user's module changed: {key}"


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_replace_then_shard_leaves_the_users_module_alone(device):
    model = _bert()
    if device == "meta":
        model = model.to("meta")
    sch = sl.create_schedule(model, world_size=2)
    with torch.device(device):
        mine = nn.Linear(64, 64)
    snap = _snapshot(mine)

    got = sch[Q].replace(mine)
    assert got is not mine and type(got) is nn.Linear  # the model holds a copy ...
    assert model.get_submodule(Q) is got and sch[Q].mod is got
    assert got.weight.device.type == device
    if device == "cpu":  # ... with the user's values
        assert torch.equal(got.weight, mine.weight) and torch.equal(got.bias, mine.bias)
    sch[Q].shard("weight", axis=0)
    sch[Q].shard("bias", axis=0)
    sch[Q].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    sch["encoder.layer.0.attention.self"].checkpoint()

    assert sch[Q].mod.weight.shape == (32, 64) and sch[Q].mod.bias.shape == (32,)
    _assert_untouched(mine, snap)
    assert mine.weight.shape == (64, 64) and not hasattr(mine.weight, "shard_axis")


def test_the_same_user_module_can_replace_two_paths():
    model = _bert()
    sch = sl.create_schedule(model, world_size=2)
    mine = nn.Linear(64, 64)
    snap = _snapshot(mine)
    a = sch[Q].replace(mine)
    b = sch["encoder.layer.1.attention.self.query"].replace(mine)  # not "already in the model"
    assert a is not b and a.weight is not b.weight
    sch[Q].shard("weight", axis=0)
    assert b.weight.shape == (64, 64)
    _assert_untouched(mine, snap)


def test_a_new_module_that_wraps_the_old_one_shares_it_with_the_model():
    class Scaled(nn.Module):
        def __init__(self, inner: nn.Module, scale: torch.Tensor):
            super().__init__()
            self.inner = inner
            self.scale = nn.Parameter(scale)

        def forward(self, x):
            return self.inner(x) * self.scale

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    sch = sl.create_schedule(model, world_size=2)
    old = sch["0"].mod
    mine = Scaled(old, torch.ones(16))
    snap = _snapshot(mine)
    scale_id = id(mine.scale)
    got = sch["0"].replace(mine)
    assert got is not mine and got.inner is old and got.inner.weight is old.weight  # shared, not copied
    assert got.scale is not mine.scale and torch.equal(got.scale, mine.scale)
    assert sch["0.inner"].mod is old
    sch["0.inner"].shard("weight", axis=1)
    # the user's wrapper holds the model's old module, which the shard changed; its own parts did not
    assert mine.scale.shape == (16,) and id(mine.scale) == scale_id
    assert snap["modules"] == _snapshot(mine)["modules"]


def test_replace_all_and_subgraph_replace_copy_the_modules_they_are_given():
    import torch.nn.functional as F

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.LayerNorm(16))
    sch = sl.create_schedule(model, world_size=2)
    mine = nn.Linear(8, 16)
    snap = _snapshot(mine)
    assert sch.replace_all(nn.Linear, lambda path, mod: mine) == ["0"]
    assert sch["0"].mod is not mine
    sch["0"].shard("weight", axis=0)
    _assert_untouched(mine, snap)

    class Gelu(nn.Module):
        def __init__(self):
            super().__init__()
            self.alpha = nn.Parameter(torch.ones(16))

        def forward(self, x):
            return F.gelu(x) * self.alpha

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 16)
            self.norm = nn.LayerNorm(16)

        def forward(self, x):
            return self.norm(torch.relu(self.fc(x)))

    traced = sl.create_schedule(Block(), world_size=2)
    traced.trace()
    sub = traced.find(lambda x: torch.relu(x))
    act = Gelu()
    snap = _snapshot(act)
    got = traced.replace(act, target_ops=sub, name="act")
    assert got is not act and traced["act_0"].mod is got
    traced["act_0"].annotate("alpha", "lr_scale", 0.5)
    _assert_untouched(act, snap)


def test_tensor_arguments_are_copied_too():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    sch = sl.create_schedule(model, world_size=2)
    t = torch.ones(3)
    sch["0"].annotate("weight", "scale", t)
    assert sch["0"].mod.weight.scale is not t and torch.equal(sch["0"].mod.weight.scale, t)
    sch["0"].annotate("weight", "tied_to", sch["2"].mod.weight)  # already in the model: kept
    assert sch["0"].mod.weight.tied_to is sch["2"].mod.weight
    sch["0"].annotate("weight", "groups", [1, 2])  # no tensor inside: the very list
    plain = [1, 2]
    sch["2"].annotate("weight", "groups", plain)
    assert sch["2"].mod.weight.groups is plain


def test_replay_adopts_its_own_copies_instead_of_copying_again():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    sch = sl.create_schedule(model, world_size=2)
    mine = nn.Linear(8, 16)
    sch["0"].replace(mine)
    sch["0"].shard("weight", axis=0)
    call = sch.record.calls[0]
    assert call.args[0] is mine  # the record names what the user passed
    args, kwargs = call.replay_args()
    again = sl.create_schedule(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)), world_size=2)
    again["0"].replace(*args, **kwargs)
    assert again["0"].mod is args[0]  # a fresh replay copy is owned already: no second copy
    assert args[0] is not mine and again["0"].mod.weight.shape == (16, 8)
    sl.replay(again, sch.record.calls[1:])
    assert again["0"].mod.weight.shape == (8, 8) and mine.weight.shape == (16, 8)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_editor_replace_shard_undo_redo_leave_the_users_module_alone(device):
    model = _bert()
    ed = sl.ScheduleEditor(model, example_inputs={"input_ids": torch.randint(0, 120, (2, 16))}, world_size=2)
    with torch.device(device):
        mine = nn.Linear(64, 64)
    snap = _snapshot(mine)

    ed.schedule[Q].replace(mine)
    ed.schedule[Q].shard("weight", axis=0)
    assert ed.schedule[Q].mod.weight.shape == (32, 64) and ed.schedule[Q].mod is not mine
    _assert_untouched(mine, snap)

    assert ed.undo() is None  # the shard
    assert ed.schedule[Q].mod.weight.shape == (64, 64)
    _assert_untouched(mine, snap)
    assert ed.undo() is None  # the replace
    assert type(ed.schedule[Q].mod) is nn.Linear and ed.code == ""
    _assert_untouched(mine, snap)
    assert ed.redo() is None and ed.redo() is None
    assert ed.schedule[Q].mod.weight.shape == (32, 64) and ed.schedule[Q].mod is not mine
    _assert_untouched(mine, snap)
    assert mine.weight.shape == (64, 64) and model.get_submodule(Q).weight.shape == (64, 64)
