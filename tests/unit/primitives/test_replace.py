"""replace / replace_all / fuse / decompose / annotate on real HF models (tiny random configs)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import slapo_lab as sl

transformers = pytest.importorskip("transformers")
from transformers import BertConfig, BertModel
from transformers.activations import GELUActivation

warnings.filterwarnings("ignore", category=FutureWarning)

INTER = "encoder.layer.0.intermediate"


def bert(seed: int = 0, **cfg) -> BertModel:
    torch.manual_seed(seed)
    cfg = BertConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=100,
        max_position_embeddings=32,
        **cfg,
    )
    return BertModel(cfg).eval()


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))


def out(model, ids):
    return model(input_ids=ids).last_hidden_state


def state(sch):
    """Everything a refused call must leave alone."""
    return (
        [(p, s.mod) for p, s in sch.named_schedules()],
        len(sch.record),
        [(n, id(p)) for n, p in sch.mod.named_parameters()],
    )


def one_sentence(err: Exception) -> str:
    text = str(err)
    assert "\n" not in text and text.endswith("."), text
    return text


class MyIntermediate(nn.Module):
    """Same math as BertIntermediate, different class and argument name."""

    def __init__(self, dense: nn.Linear):
        super().__init__()
        self.fc = dense

    def forward(self, x):
        return F.gelu(self.fc(x))


class TwoInputs(nn.Module):
    def forward(self, x, y):
        return x + y


class MyGelu(nn.Module):
    def forward(self, x):
        return F.gelu(x)


# --------------------------------------------------------------------------------------------------
# replace a module
# --------------------------------------------------------------------------------------------------
def test_replace_module_keeps_path_and_numerics(ids):
    model = bert()
    ref = out(model, ids)
    sch = sl.create_schedule(model)
    dense = model.encoder.layer[0].intermediate.dense
    sch[f"{INTER}.dense"].annotate("weight", "my_tag", 7)
    sch[INTER].mod.register_forward_hook(lambda m, a, o: o * 1.0)  # a plain hook moves along

    new = MyIntermediate(dense)
    got = sch[INTER].replace(new)
    assert got is not new and type(got) is MyIntermediate  # the model gets a copy (user objects never change)

    assert model.encoder.layer[0].intermediate is got and sch[INTER].mod is got
    assert list(sch[INTER].child) == ["fc"] and sch[f"{INTER}.fc"].mod is dense  # shared with the model
    assert len(got._forward_hooks) == 1 and not new._forward_hooks
    assert dense.weight.my_tag == 7
    torch.testing.assert_close(out(model, ids), ref)
    assert sl.format_call(sch.record.calls[-1]) == f'sch["{INTER}"].replace(<MyIntermediate>)'


def test_replace_checks_signature_against_the_old_forward_and_the_recorded_call(ids):
    model = bert()
    sch = sl.create_schedule(model)
    before = state(sch)
    with pytest.raises(sl.ScheduleError) as info:
        sch[INTER].replace(TwoInputs())
    msg = one_sentence(info.value)
    assert "TwoInputs.forward(x, y)" in msg and "BertIntermediate.forward(hidden_states" in msg
    assert state(sch) == before
    assert sl.check_primitive(sch[INTER], "replace", TwoInputs()) == msg

    sl.record_example_inputs(sch, {"input_ids": ids})  # BertLayer is called with keywords
    with pytest.raises(
        sl.ScheduleError,
        match=r"MyIntermediate\.forward\(x\) cannot take the call "
        r"encoder\.layer\.0 receives",
    ) as info:
        sch["encoder.layer.0"].replace(MyIntermediate(nn.Linear(64, 64)))
    one_sentence(info.value)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda s: s[INTER].replace(MyGelu), r"takes a module instance, not the class MyGelu"),
        (lambda s: s[INTER].replace(3), r"takes an nn\.Module or a function, not int"),
        (lambda s: s[INTER].replace(F.gelu), r"A function can only replace a found node or subgraph"),
        (lambda s: s[INTER].replace(s["pooler"].mod), r"already in the model at pooler"),
        (lambda s: s[INTER].replace(s[INTER].mod), r"would be replaced by itself"),
        (
            lambda s: s[INTER].replace(MyGelu(), name="other"),
            r"name= only names a module replacing a subgraph",
        ),
        (lambda s: s[INTER].replace(MyGelu(), concrete_args={"a": 1}), r"concrete_args only applies"),
        (
            lambda s: s[INTER].replace(MyGelu(), target_ops=[1, 2]),
            r"target_ops must be what find\(\) returns",
        ),
        (lambda s: s["nope"].replace(MyGelu()), r"No module 'nope' in the schedule"),
        (lambda s: s[INTER].replace_all(int, lambda n, m: m), r"takes an nn\.Module class"),
        (lambda s: s[INTER].replace_all(nn.GELU, 3), r"make_mod_fn must be a callable"),
        (lambda s: s[INTER].replace_all(nn.Conv2d, lambda n, m: m), r"No module of type Conv2d under"),
        (lambda s: s.replace_all(nn.Dropout, lambda n, m: 3), r"make_mod_fn returned a int for"),
        (
            lambda s: s.replace_all(nn.Dropout, lambda n, m: 1 / 0),
            r"make_mod_fn failed for .*ZeroDivisionError",
        ),
        (
            lambda s: s[f"{INTER}.intermediate_act_fn"].decompose(),
            r"applies to an nn\.Linear, but .* is a GELUActivation",
        ),
        (
            lambda s: s["pooler.dense"].annotate("nope", "k", 1),
            r"has no parameter named 'nope'; it has weight, bias",
        ),
        (lambda s: s["pooler.dense"].annotate("weight", "not valid", 1), r"must be a Python identifier"),
        (lambda s: s["pooler.dense"].annotate("weight", "grad", 1), r"'grad' is a tensor attribute"),
        (lambda s: s["pooler.dense"].annotate("weight", "shard_axis", 1), r"set by shard\(\) itself"),
    ],
)
def test_refusals_are_one_sentence_and_change_nothing(call, match):
    sch = sl.create_schedule(bert())
    before = state(sch)
    with pytest.raises(sl.ScheduleError, match=match) as info:
        call(sch)
    one_sentence(info.value)
    assert state(sch) == before


def test_replace_all_gelu_activation_then_nn_gelu(ids):
    model = bert()
    ref = out(model, ids)
    sch = sl.create_schedule(model)

    replaced = sch.replace_all(GELUActivation, lambda name, mod: nn.GELU())
    assert replaced == [
        "encoder.layer.0.intermediate.intermediate_act_fn",
        "encoder.layer.1.intermediate.intermediate_act_fn",
    ]
    assert all(isinstance(sch[p].mod, nn.GELU) for p in replaced)

    seen = []
    replaced = sch["encoder"].replace_all(nn.GELU, lambda name, mod: seen.append(name) or MyGelu())
    assert seen == ["layer.0.intermediate.intermediate_act_fn", "layer.1.intermediate.intermediate_act_fn"]
    assert all(type(sch[p].mod) is MyGelu for p in replaced)
    torch.testing.assert_close(out(model, ids), ref)
    assert [c.primitive for c in sch.record.calls] == ["replace_all", "replace_all"]  # one record each


def test_replace_all_checks_every_target_before_swapping():
    sch = sl.create_schedule(bert())
    before = state(sch)
    made = []

    def make(name, mod):  # the second target gets an incompatible module
        made.append(name)
        return MyGelu() if len(made) == 1 else TwoInputs()

    with pytest.raises(sl.ScheduleError, match=r"TwoInputs\.forward\(x, y\) does not take the same required"):
        sch.replace_all(GELUActivation, make)
    assert state(sch) == before and len(made) == 2


# --------------------------------------------------------------------------------------------------
# subgraphs: replace, fuse, horizontal fusion, function nodes
# --------------------------------------------------------------------------------------------------
def test_replace_found_subgraph_with_a_module(ids):
    model = bert()
    ref = out(model, ids)
    sch = sl.create_schedule(model)
    dense = model.encoder.layer[0].intermediate.dense
    sub = sch[INTER].find(lambda x: F.gelu(sl.call_module("dense", x)))
    assert len(sub) == 1

    new = MyIntermediate(dense)
    sch[INTER].replace(new, target_ops=sub, name="dense_gelu")

    gm = sch[INTER].mod
    # Slapo numbers the name it registers the module under (_get_unique_module_name): dense_gelu_0
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["dense_gelu_0"]
    assert list(sch[INTER].child) == ["dense_gelu_0"] and sch[f"{INTER}.dense_gelu_0.fc"].mod is dense
    torch.testing.assert_close(out(model, ids), ref)
    with pytest.raises(sl.ScheduleError, match=r"removed by an earlier replacement; call find\(\) again"):
        sch[INTER].replace(MyGelu(), target_ops=sub)


def test_fuse_found_subgraph(ids):
    model = bert()
    ref = out(model, ids)
    sch = sl.create_schedule(model)
    sub = sch[INTER].find(lambda x, w: F.gelu(F.linear(x, w)))

    fused = sch[INTER].fuse(sub, compiler=None)

    assert isinstance(fused, fx.GraphModule) and type(fused).__name__ == "FusedModule"
    assert list(sch[INTER].child) == ["FusedModule_0"]
    assert [n.target for n in fused.graph.nodes if n.op == "call_module"] == ["dense", "intermediate_act_fn"]
    torch.testing.assert_close(out(model, ids), ref)
    assert sch.record.calls[-1].primitive == "fuse"

    sub = sch["encoder.layer.1.intermediate"].find(lambda x: F.gelu(sl.call_module("dense", x)))
    with pytest.warns(FutureWarning, match="TorchScript is deprecated"):
        fused = sch["encoder.layer.1.intermediate"].fuse(sub, compiler="TorchScript")
    assert fused._compiled_call_impl is not None  # torch.compile'd lazily (not run here: slow on CPU)


def test_fuse_refusals():
    sch = sl.create_schedule(bert())
    sub = sch[INTER].find(lambda x: F.gelu(sl.call_module("dense", x)))
    before = state(sch)
    for kwargs, match in [
        ({"subgraph": sub, "compiler": "tvm"}, r"Unknown compiler 'tvm'"),
        ({"subgraph": sub, "name": "a.b"}, r"must be a Python identifier"),
        ({"subgraph": [sub[0][:1]]}, r"one subgraph of two or more nodes"),
        ({"subgraph": [sub[0], sub[0]]}, r"one subgraph of two or more nodes"),
    ]:
        with pytest.raises(sl.ScheduleError, match=match) as info:
            sch[INTER].fuse(**kwargs)
        one_sentence(info.value)
    with pytest.raises(sl.ScheduleError, match=r"not in a traced graph under pooler"):
        sch["pooler"].fuse(sub)
    assert state(sch) == before


def test_subgraph_with_two_results_is_refused():
    class M(nn.Module):
        def forward(self, x):
            a = torch.relu(x)
            b = a * 2
            return a + b, b

    sch = sl.create_schedule(M())
    sub = sch.find(lambda x: torch.relu(x) * 2)
    with pytest.raises(sl.ScheduleError, match=r"has 2 results used outside it \(relu, mul\)") as info:
        sch.fuse(sub)
    one_sentence(info.value)
    with pytest.raises(
        sl.ScheduleError, match=r"TwoInputs\.forward\(x, y\) cannot take the subgraph's 1 input"
    ):
        sch.replace(TwoInputs(), target_ops=sch.find(lambda x: torch.relu(x)))


def test_horizontal_fusion_of_qkv_in_an_exported_layer(ids):
    model = bert()
    ref = out(model, ids)
    sch = sl.create_schedule(model)
    sl.record_example_inputs(sch, {"input_ids": ids})
    layer = sch["encoder.layer.0"]
    nodes = layer.find(r"query|key|value")
    assert [(p, n.target) for p, n in nodes] == [("attention.self", t) for t in ("query", "key", "value")]
    attn = model.encoder.layer[0].attention.self
    q, k, v = attn.query, attn.key, attn.value

    class QKV(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.cat([q.weight, k.weight, v.weight]).detach())
            self.bias = nn.Parameter(torch.cat([q.bias, k.bias, v.bias]).detach())

        def forward(self, x):
            return F.linear(x, self.weight, self.bias).chunk(3, dim=-1)

    layer.replace(QKV(), target_ops=[[n] for n in nodes], name="qkv")

    assert list(sch["encoder.layer.0.attention.self"].child)[-1] == "qkv_0"
    assert "query" not in sch["encoder.layer.0.attention.self"].child
    torch.testing.assert_close(out(model, ids), ref)


def test_replace_a_function_node(ids):
    model = bert()
    x = torch.randn(2, 8, 64)
    sch = sl.create_schedule(model)
    inter = sch[INTER]
    inter.trace(flatten=True)  # GELUActivation is inlined: F.gelu
    (found,) = inter.find_node(lambda n: n.op == "call_function" and "gelu" in str(n.target))

    def double_gelu(t):
        return 2 * F.gelu(t)

    node = inter.replace(double_gelu, target_ops=found)
    assert node.target is double_gelu
    dense = model.encoder.layer[0].intermediate.dense
    torch.testing.assert_close(inter.mod(x), 2 * F.gelu(dense(x)))

    def two(a, b):
        return a + b

    (found,) = inter.find_node(lambda n: n.op == "call_function" and n.target is double_gelu)
    with pytest.raises(
        sl.ScheduleError, match=r"two\(a, b\) cannot take the arguments of double_gelu"
    ) as info:
        inter.replace(two, target_ops=found)
    one_sentence(info.value)
    sch2 = sl.create_schedule(bert())
    (dense_call,) = sch2[INTER].find_node("dense")
    with pytest.raises(
        sl.ScheduleError, match=r"A function can replace a call_function node, but dense is a call_module"
    ):
        sch2[INTER].replace(double_gelu, target_ops=dense_call)


# --------------------------------------------------------------------------------------------------
# decompose, annotate
# --------------------------------------------------------------------------------------------------
def test_decompose_then_shard_bias(ids):
    model = bert()
    ref = out(model, ids)
    x = torch.randn(2, 8, 64)
    sch = sl.create_schedule(model, world_size=2, rank=1)
    path = f"{INTER}.dense"
    dense = model.get_submodule(path)
    w, b = dense.weight, dense.bias
    full = dense(x)

    new = sch[path].decompose()

    assert type(new) is sl.LinearWithSeparateBias and isinstance(new, nn.Linear)
    assert new.weight is w and new.bias is b and model.get_submodule(path) is new
    torch.testing.assert_close(out(model, ids), ref)
    torch.testing.assert_close(new(x), full)

    sch[path].shard("weight", axis=0)
    sch[path].shard("bias", axis=0)
    assert new.weight.shape == (64, 64) and new.bias.shape == (64,) and new.out_features == 64
    torch.testing.assert_close(new(x), full[..., 64:])  # rank 1's column slice, bias added
    assert sl.module_state(new).output_type == "partition"

    with pytest.raises(sl.ScheduleError, match=r"already decomposed") as info:
        sch[path].decompose()
    one_sentence(info.value)
    with pytest.raises(sl.ScheduleError, match=r"already sharded; decompose\(\) must come before shard\(\)"):
        sch["encoder.layer.0.output.dense"].shard("weight", axis=1)
        sch["encoder.layer.0.output.dense"].decompose()
    nobias = nn.Linear(4, 4, bias=False)
    with pytest.raises(sl.ScheduleError, match=r"has no bias to separate"):
        sl.create_schedule(nn.Sequential(nobias))["0"].decompose()


def test_decompose_trace_flatten_and_fuse_bias_gelu(ids):
    """Slapo's flow: separate the bias, trace flat, find bias add + GELU, fuse."""
    model = bert()
    ref = out(model, ids)
    sch = sl.create_schedule(model)
    inter = sch[INTER]
    inter["dense"].decompose()
    gm = inter.trace(flatten=True)
    assert [str(n.target) for n in gm.graph.nodes if n.op == "call_function"][-2:] == [
        "<built-in function add>",
        "<built-in function gelu>",
    ]
    sub = inter.find(lambda x, b: F.gelu(x + b))
    assert [[n.name for _, n in s] for s in sub] == [["add", "gelu"]]
    fused = inter.fuse(sub, compiler=None, name="BiasGeLU")
    assert type(fused).__name__ == "BiasGeLU" and "BiasGeLU_0" in inter.child
    torch.testing.assert_close(out(model, ids), ref)


def test_annotate_survives_shard_and_replace():
    model = bert()
    sch = sl.create_schedule(model, world_size=2)
    q = sch["encoder.layer.0.attention.self.query"]
    p = q.annotate("weight", "replicated_param", False)
    assert p is q.mod.weight and p.replicated_param is False
    assert "replicated_param" in sch.metadata.param_tags
    assert sch.record.code().endswith('.annotate("weight", "replicated_param", False)')

    q.shard("weight", axis=0)
    assert q.mod.weight is not p and q.mod.weight.replicated_param is False

    sch["encoder.layer.0"].annotate("attention.self.key.weight", "lr_scale", 0.5)  # dotted names
    key = sch["encoder.layer.0.attention.self.key"]
    fresh = nn.Linear(64, 64)
    key.replace(fresh)  # a new parameter object under the same name
    assert key.mod.weight.lr_scale == 0.5
    assert not hasattr(fresh.weight, "lr_scale")  # the user's module is copied, never changed


def test_replace_checks_the_call_in_a_traced_parent_graph():
    class Parent(nn.Module):
        def __init__(self):
            super().__init__()
            self.child = nn.Linear(4, 4)

        def forward(self, x):
            return self.child(x)

    class KeywordOnly(nn.Module):
        def forward(self, *, x):
            return x

    sch = sl.create_schedule(Parent())
    sch.trace()
    with pytest.raises(
        sl.ScheduleError,
        match=r"KeywordOnly\.forward\(\*, x\) cannot take the call child in the "
        r"traced graph of the root makes \(1 positional",
    ) as info:
        sch["child"].replace(KeywordOnly())
    one_sentence(info.value)
    sch["child"].replace(MyGelu())  # same call shape: fine
    x = torch.randn(2, 4)
    torch.testing.assert_close(sch.mod(x), F.gelu(x))
