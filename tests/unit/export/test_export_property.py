"""Property: a recorded schedule survives both exports unchanged.

Random *valid* schedules -- shards of parameters on either axis, syncs (every mode and named op, with
the keyword arguments the engine takes), checkpoints and pipeline cuts, on random modules of a small
HF BERT or GPT-2 (tied LM head) planned for 1, 2 or 4 ranks; each drawn action is kept only when
``sl.check_primitive`` accepts it -- are

1. saved as JSON (:func:`save_schedule`), loaded back and replayed onto a fresh meta copy, and
2. rendered as a training script whose ``schedule(sch)`` function (compiled on its own from the
   script's source, with nothing in scope but ``sch`` and the builtins) is run on a fresh meta copy.

Both must give the same module structure (``named_modules`` types), the same parameter shapes and
sharding annotations, the same per-module schedule state, and the same recorded calls. One meta model
of each kind is built per session and copied per example (``slapo_lab.utils.meta_copy``), so 200
examples take seconds.
"""

from __future__ import annotations

import ast
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import slapo_lab as sl
from slapo_lab.export import input_spec, load_schedule, model_spec, render_script, save_schedule
from slapo_lab.utils import meta_copy

SYNC_OPS = ["all_reduce", "all_gather", "reduce_scatter", "scatter"]
SYNC_KWARGS = [
    {},
    {},
    {"axis": -1},
    {"axis": 1},
    {"tensor_parallel_output_grad": False},
    {"axis": -1, "tensor_parallel_output_grad": False},
    {"param_grads": True},
]


class _Model:
    """One meta model: its spec and input spec (computed once), module paths to draw from."""

    def __init__(self, model, vocab: int):
        self.model = model
        ids = torch.zeros(4, 16, dtype=torch.long, device="meta")
        self.spec = model_spec(model)
        self.inputs = input_spec({"input_ids": ids}, vocab)
        self.paths = [n for n, _ in model.named_modules() if n]
        self.param_paths = [
            n for n, m in model.named_modules() if n and any(True for _ in m.parameters(False))
        ]


@pytest.fixture(scope="module")
def models():
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        bert = BertModel(
            BertConfig(
                num_hidden_layers=2,
                hidden_size=64,
                num_attention_heads=4,
                intermediate_size=128,
                vocab_size=128,
                max_position_embeddings=32,
            )
        )
        gpt2 = GPT2LMHeadModel(
            GPT2Config(
                n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0
            )
        )
    return {"bert": _Model(bert, 128), "gpt2": _Model(gpt2, 128)}


@pytest.fixture(scope="module")
def folder():
    with tempfile.TemporaryDirectory(prefix="slapo-property-") as d:
        yield Path(d)


def _action(data, m: _Model):
    """(path, primitive, args, kwargs) drawn at random (not necessarily valid)."""
    kind = data.draw(st.sampled_from(["shard", "shard", "sync", "sync", "checkpoint", "cut_pipeline_stage"]))
    if kind == "shard":
        path = data.draw(st.sampled_from(m.param_paths))
        names = [n for n, _ in m.model.get_submodule(path).named_parameters(recurse=False)]
        return (
            path,
            "shard",
            (data.draw(st.sampled_from(names)),),
            {"axis": data.draw(st.sampled_from([0, 1, -1]))},
        )
    path = data.draw(st.sampled_from(m.paths))
    if kind == "sync":
        kwargs = {
            "mode": data.draw(st.sampled_from(["fwd_post", "fwd_pre", "bwd_post"])),
            "sync_op_or_fn": data.draw(st.sampled_from(SYNC_OPS)),
            **data.draw(st.sampled_from(SYNC_KWARGS)),
        }
        return path, "sync", (), kwargs
    return path, kind, (), {}


def _state(sch):
    """Everything the schedule changed, comparably: module types, parameter shapes and annotations, states."""
    mod = sch.mod
    modules = [(n, type(m).__name__) for n, m in mod.named_modules()]
    params = {
        n: (
            tuple(p.shape),
            getattr(p, "shard_axis", None),
            getattr(p, "shard_stride", None),
            tuple(getattr(p, "orig_shape", p.shape)),
        )
        for n, p in mod.named_parameters(remove_duplicate=False)
    }
    states = {n: _plain(sl.module_state(m)) for n, m in mod.named_modules()}
    return modules, params, states, sorted(sch.metadata.primitives.get("cut_pipeline_stage", []))


def _plain(x):
    """A module state as comparable data: hook handles counted, functions by name."""
    if isinstance(x, sl.ModuleMeta):
        x = vars(x)
    if isinstance(x, dict):
        return {k: len(v) if k == "hooks" else _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if callable(x):
        return getattr(x, "__qualname__", type(x).__name__)
    return x


def _schedule_function(text: str):
    """The script's ``schedule`` function, compiled alone from its source (no other script globals)."""
    tree = ast.parse(text)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "schedule")
    ns: dict = {}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "train.py", "exec"), ns)  # noqa: S102 - the test
    return ns["schedule"]


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_schedule_round_trips_through_json_and_script(data, models, folder):
    name = data.draw(st.sampled_from(sorted(models)))
    m = models[name]
    world_size = data.draw(st.sampled_from([1, 2, 2, 4]))
    sch = sl.create_schedule(meta_copy(m.model), world_size=world_size)
    for _ in range(data.draw(st.integers(0, 12))):
        path, prim, args, kwargs = _action(data, m)
        node = sch[path]
        if sl.check_primitive(node, prim, *args, **kwargs) is None:
            getattr(node, prim)(*args, **kwargs)  # a checked call must apply
    calls = list(sch.record.calls)
    want = _state(sch)
    event(f"{len(calls) // 3 * 3}+ valid calls")  # --hypothesis-show-statistics: what was drawn
    for prim in sorted({c.primitive for c in calls}):
        event(f"has {prim}")

    # 1. JSON: save, load, replay onto a fresh meta copy
    f = save_schedule(
        folder / "s.json", calls, world_size=world_size, meta={"model": m.spec, "inputs": m.inputs}
    )
    loaded = load_schedule(f)
    assert loaded.calls == calls and loaded.world_size == world_size
    again = sl.create_schedule(meta_copy(m.model), world_size=world_size)
    sl.replay(again, loaded.calls)
    assert again.record.calls == calls
    assert _state(again) == want

    # 2. script: render, take its schedule(sch), run it on a fresh meta copy
    try:
        text = render_script(loaded.meta["model"], loaded.calls, loaded.meta["inputs"], world_size)
    except (
        sl.ExportError
    ) as err:  # the only refusal for these calls: a TP x PP schedule for DeepSpeed (not asked)
        raise AssertionError(f"render_script refused a valid schedule: {err}") from None
    third = sl.create_schedule(meta_copy(m.model), world_size=world_size)
    _schedule_function(text)(third)
    assert third.record.calls == calls
    assert _state(third) == want
