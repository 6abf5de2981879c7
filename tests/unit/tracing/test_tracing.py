"""Tracing by need (torch.fx, then torch.export + unflatten), find_node / find_subgraph / find.

Real HF models with tiny random configs (2 layers, hidden 64); nothing is downloaded.
"""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import slapo_lab as sl
from slapo_lab.module_state import peek_meta
from slapo_lab.tracing import is_traced

transformers = pytest.importorskip("transformers")
from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

warnings.filterwarnings("ignore", category=FutureWarning)


def bert(seed: int = 0) -> BertModel:
    torch.manual_seed(seed)
    cfg = BertConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=100,
        max_position_embeddings=32,
    )
    return BertModel(cfg).eval()


def gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=100, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(cfg).eval()


def llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))


def params_by_id(mod: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in mod.named_parameters()}


def paths(sch) -> list[str]:
    return [p for p, _ in sch.named_schedules()]


# --------------------------------------------------------------------------------------------------
# torch.fx
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make,path,kw",
    [
        (bert, "encoder.layer.0.intermediate", {}),
        (gpt2, "transformer.h.0.mlp", {"use_cache": False}),
        (llama, "model.layers.0.mlp", {"use_cache": False}),
    ],
    ids=["BertIntermediate", "GPT2MLP", "LlamaMLP"],
)
def test_fx_traces_mlp_submodules_in_place(make, path, kw, ids):
    model = make()
    ref = model(input_ids=ids, **kw)[0]
    before = params_by_id(model)
    old = model.get_submodule(path)
    old_children = [n for n, _ in old.named_children()]
    sch = sl.create_schedule(model)

    gm = sch[path].trace(tracer="fx")

    assert isinstance(gm, fx.GraphModule)
    assert type(gm).__name__ == type(old).__name__ and sl.tracing.orig_class(gm) is type(old)
    assert model.get_submodule(path) is gm and sch[path].mod is gm  # registered on the parent
    assert list(sch[path].child) == [n for n, _ in gm.named_children()]  # children re-mirrored
    assert set(old_children) >= set(sch[path].child)
    assert params_by_id(model) == before  # same parameter objects
    assert any(n.op == "call_module" for n in gm.graph.nodes)
    torch.testing.assert_close(model(input_ids=ids, **kw)[0], ref)
    assert sch[path].trace() is gm  # already traced: unchanged


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = nn.GELU()

    def forward(self, x):
        return self.act(self.fc(x)) + x


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_fx_recursive_flatten_and_leaf_modules():
    x = torch.randn(3, 8)
    net = _Net()
    ref = net(x)

    sch = sl.create_schedule(net)
    gm = sch.trace()  # hierarchical: every block gets its own graph
    assert paths(sch) == paths(sl.create_schedule(_Net()))
    assert isinstance(sch["blocks.0"].mod, fx.GraphModule) and type(sch["blocks.0"].mod).__name__ == "_Block"
    assert isinstance(sch["blocks.0.fc"].mod, nn.Linear)
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["blocks.0", "blocks.1", "head"]
    torch.testing.assert_close(gm(x), ref)

    sch = sl.create_schedule(_Net())
    sch.trace(recursive=False)
    assert not is_traced(sch["blocks.0"].mod) and type(sch["blocks.0"].mod) is _Block

    sch = sl.create_schedule(_Net())
    sch.trace(leaf_modules=["blocks.1"])
    assert is_traced(sch["blocks.0"].mod) and type(sch["blocks.1"].mod) is _Block

    sch = sl.create_schedule(_Net())
    sch.trace(leaf_modules=[_Block])
    assert type(sch["blocks.0"].mod) is _Block and type(sch["blocks.1"].mod) is _Block

    flat = _Net()
    flat_ref = flat(x)
    sch = sl.create_schedule(flat)
    gm = sch.trace(flatten=True)
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == [
        "blocks.0.fc",
        "blocks.0.act",
        "blocks.1.fc",
        "blocks.1.act",
        "head",
    ]
    torch.testing.assert_close(gm(x), flat_ref)


# --------------------------------------------------------------------------------------------------
# torch.export fallback
# --------------------------------------------------------------------------------------------------
def test_export_fallback_bert_layer_keeps_hierarchy_leaves_and_state(ids):
    model = bert()
    ref = model(input_ids=ids).last_hidden_state
    sch = sl.create_schedule(model)
    before_paths = paths(sch)
    before = params_by_id(model)
    query = model.encoder.layer[0].attention.self.query
    sch["encoder.layer.0.attention.self.query"].checkpoint()  # schedule state on a leaf
    sl.record_example_inputs(sch, {"input_ids": ids})

    um = sch["encoder.layer.0"].trace()  # fx fails on BertLayer -> export

    assert type(um).__name__ == "BertLayer" and is_traced(um)
    assert model.encoder.layer[0] is um
    assert paths(sch) == before_paths  # hierarchy preserved (unflatten)
    assert sch["encoder.layer.0.attention.self.query"].mod is query  # leaves are the original objects
    assert peek_meta(sch["encoder.layer.0.attention.self.query"].mod).checkpoint
    assert type(sch["encoder.layer.0.attention.self"].mod).__name__ == "BertSelfAttention"
    assert params_by_id(model) == before  # unflatten's clones were replaced
    torch.testing.assert_close(model(input_ids=ids).last_hidden_state, ref)
    # the pytree plumbing around preserved leaf calls is gone: dense feeds the activation directly
    g = sch["encoder.layer.0.intermediate"].mod.graph
    dense = next(n for n in g.nodes if n.op == "call_module" and n.target == "dense")
    assert [u.target for u in dense.users] == ["intermediate_act_fn"]


def test_export_full_bert_model_find_node_and_deepcopy(ids):
    model = bert()
    ref = model(input_ids=ids).last_hidden_state
    sch = sl.create_schedule(model)
    before_paths = paths(sch)

    um = sch.trace(example_inputs={"input_ids": ids})

    assert sch.mod is um and type(um).__name__ == "BertModel"
    assert paths(sch) == before_paths
    torch.testing.assert_close(um(input_ids=ids).last_hidden_state, ref)
    torch.testing.assert_close(copy.deepcopy(um)(input_ids=ids).last_hidden_state, ref)  # Verify copies

    layers = sch.find_node(r"layer\.\d+$")
    assert [(p, n.target) for p, n in layers] == [("encoder", "layer.0"), ("encoder", "layer.1")]
    queries = sch.find(r"query")
    assert [p for p, _ in queries] == ["encoder.layer.0.attention.self", "encoder.layer.1.attention.self"]
    assert all(n.op == "call_module" for _, n in queries)
    sdpa = sch["encoder.layer.1"].find_node(lambda n: "scaled_dot_product_attention" in str(n.target))
    assert [p for p, _ in sdpa] == ["attention.self"]  # parent paths relative to the node
    with pytest.raises(RuntimeError, match=r"Expected input at .*input_ids.*shape\[0\] to be equal to 2"):
        um(input_ids=torch.randint(0, 100, (3, 5)))  # static export: loud on other shapes
    with pytest.raises(RuntimeError, match=r"shape\[0\] to be equal to 2"):
        copy.deepcopy(um)(input_ids=torch.randint(0, 100, (3, 5)))


def test_export_full_gpt2_keeps_tied_weights(ids):
    model = gpt2()
    ref = model(input_ids=ids, use_cache=False).logits
    sch = sl.create_schedule(model)
    sl.record_example_inputs(sch, {"input_ids": ids, "use_cache": False})
    um = sch.trace(tracer="export")
    assert um.lm_head.weight is um.transformer.wte.weight is model.transformer.wte.weight
    assert type(sch["transformer.h.1.attn.c_attn"].mod).__name__ == "Conv1D"  # shardable leaf kept
    torch.testing.assert_close(um(input_ids=ids, use_cache=False).logits, ref)


def test_trace_until_llama_layers_stay_leaves(ids):
    model = llama()
    ref = model(input_ids=ids, use_cache=False).logits
    layer0 = model.model.layers[0]
    sch = sl.create_schedule(model)

    root = sch.trace_until("model.layers", example_inputs={"input_ids": ids, "use_cache": False})

    assert sch.mod is root and is_traced(sch["model"].mod)
    assert sch["model.layers.0"].mod is layer0 and not is_traced(layer0)
    calls = [(p, n.target) for p, n in sch.find_node(r"layers\.\d")]
    assert calls == [("model", "layers.0"), ("model", "layers.1")]
    torch.testing.assert_close(root(input_ids=ids, use_cache=False).logits, ref)
    assert sch.trace_until("model.layers") is root  # idempotent
    sch["model.layers.0"].cut_pipeline_stage()  # still usable after tracing
    assert sch.metadata.primitives["cut_pipeline_stage"] == ["model.layers.0"]


def test_record_example_inputs_on_meta_and_export_a_submodule(ids):
    with torch.device("meta"):
        model = bert()
    sch = sl.create_schedule(model)
    rec = sl.record_example_inputs(sch, {"input_ids": ids})  # real ids are moved to meta
    args, _ = rec["encoder.layer.1"]
    assert args[0].device.type == "meta" and args[0].shape == (2, 8, 64)
    assert "encoder.layer.1.attention.self.query" in rec
    um = sch["encoder.layer.1"].trace()
    assert type(um).__name__ == "BertLayer"
    assert all(p.device.type == "meta" for p in um.parameters())


# --------------------------------------------------------------------------------------------------
# find_subgraph / find
# --------------------------------------------------------------------------------------------------
class LinearGelu(sl.Pattern):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(1, 1)  # matched by class: any Linear call (or functional linear)

    def forward(self, x):
        return F.gelu(self.fc(x))


class DenseGelu(sl.Pattern):
    def __init__(self):
        super().__init__()
        self.fc = sl.ModulePattern(r"dense$")

    def forward(self, x):
        return F.gelu(self.fc(x))


def test_find_subgraph_lambda_pattern_and_module_pattern(ids):
    model = bert()
    sch = sl.create_schedule(model)
    inter = sch["encoder.layer.0.intermediate"]

    found = inter.find(lambda x: F.gelu(sl.call_module("dense", x)))  # traces by need (fx)
    assert is_traced(inter.mod)
    assert [[(p, n.target) for p, n in sub] for sub in found] == [
        [("", "dense"), ("", "intermediate_act_fn")]
    ]
    assert [[n.target for _, n in s] for s in inter.find_subgraph(LinearGelu())] == [
        ["dense", "intermediate_act_fn"]
    ]
    assert len(inter.find(DenseGelu())) == 1
    assert inter.find(lambda x, w: F.gelu(F.linear(x, w))) == found  # functional linear = nn.Linear
    assert inter.find(lambda x: torch.tanh(sl.call_module("dense", x))) == []

    sl.record_example_inputs(sch, {"input_ids": ids})  # export graphs match too
    found = sch["encoder.layer.1"].find(LinearGelu())
    assert [[(p, n.target) for p, n in sub] for sub in found] == [
        [("intermediate", "dense"), ("intermediate", "intermediate_act_fn")]
    ]


def test_find_subgraph_matches_aten_ops_and_constants():
    class M(nn.Module):
        def forward(self, x, y):
            a = torch.relu(x) * 2
            b = torch.relu(y) * 3
            return a + b

    sch = sl.create_schedule(M())
    found = sch.find(lambda x: torch.relu(x) * 3)
    assert [[n.name for _, n in sub] for sub in found] == [["relu_1", "mul_1"]]
    assert len(sch.find(lambda x: torch.relu(x) * 5)) == 0
    assert len(sch.find(lambda x: F.relu(x))) == 2


def test_find_traces_by_need_or_says_why():
    sch = sl.create_schedule(bert())
    with pytest.raises(
        sl.ScheduleError, match=r"cannot be traced: fx says .*; torch\.export says .*example inputs"
    ):
        sch.find(r"query")
    assert not is_traced(sch.mod)


# --------------------------------------------------------------------------------------------------
# error paths: one sentence, nothing changed
# --------------------------------------------------------------------------------------------------
def _one_sentence(err: Exception) -> str:
    text = str(err)
    assert "\n" not in text and text.endswith("."), text
    return text


@pytest.mark.parametrize(
    "call,match",
    [
        (
            lambda s: s["encoder.layer.0"].trace(tracer="fx"),
            r"encoder\.layer\.0 \(BertLayer\) cannot be traced by torch\.fx: ",
        ),
        (
            lambda s: s["encoder.layer.0"].trace(tracer="export"),
            r"cannot be traced by torch\.export: it needs example inputs",
        ),
        (lambda s: s.trace(tracer="magic"), r"Unknown tracer 'magic'"),
        (lambda s: s.trace(tracer="huggingface"), r"transformers\.utils\.fx"),
        (lambda s: s.trace(flatten=True, recursive=False), r"needs recursive=True"),
        (lambda s: s.trace(flatten=True, tracer="export"), r"torch\.export: it needs example inputs"),
        (lambda s: s.trace(leaf_modules=["nope"]), r"leaf_modules entry 'nope' names no submodule"),
        (lambda s: s.trace(leaf_modules=[3]), r"leaf_modules entries must be"),
        (lambda s: s["pooler"].trace(concrete_args={"nope": 1}), r"concrete_args names nope"),
        (lambda s: s.trace(example_inputs=3), r"example_inputs must be a tensor"),
        (lambda s: s["encoder"].trace_until("layer"), r"call it on the root schedule"),
        (lambda s: s.trace_until("encoder.nope"), r"No module 'encoder\.nope'"),
        (lambda s: s.trace_until(""), r"names the root itself"),
        (lambda s: s.trace_until("encoder", recursive=False), r"does not take recursive"),
        (lambda s: s.find(3), r"find\(\) takes a regular expression"),
        (lambda s: s["pooler"].find_node("("), r"'\(' is not a valid regular expression"),
        (lambda s: s["pooler"].find_subgraph(nn.Linear(2, 2)), r"must be a function .* or a Pattern"),
        (lambda s: s["pooler"].find_subgraph(lambda x: x), r"no operation to look for"),
        (
            lambda s: s["pooler"].find_subgraph(lambda x: x if x.sum() > 0 else -x),
            r"could not be traced by torch\.fx",
        ),
        (
            lambda s: sl.record_example_inputs(s, {"input_ids": torch.zeros(2, 8)}),
            r"Running the root module .* failed",
        ),
        (lambda s: sl.ModulePattern("["), r"not a valid regular expression"),
        (lambda s: sl.call_module("x", torch.zeros(1)), r"only describes a node inside a pattern"),
    ],
)
def test_errors_are_one_sentence_and_change_nothing(call, match):
    model = bert()
    sch = sl.create_schedule(model)
    before = [(p, s.mod) for p, s in sch.named_schedules()]
    with pytest.raises(sl.ScheduleError, match=match) as info:
        call(sch)
    _one_sentence(info.value)
    assert [(p, s.mod) for p, s in sch.named_schedules()] == before
    assert len(sch.record) == 0


def test_find_node_predicate_error_after_tracing_by_need():
    sch = sl.create_schedule(bert())
    with pytest.raises(
        sl.ScheduleError, match=r"The node predicate raised ZeroDivisionError on node"
    ) as info:
        sch["pooler"].find_node(lambda n: 1 / 0)
    _one_sentence(info.value)
    assert is_traced(sch["pooler"].mod)  # the trace by need stays: it was valid


def test_trace_refuses_a_module_with_hook_primitives():
    sch = sl.create_schedule(bert())
    sch["encoder.layer.0.intermediate"].checkpoint()
    with pytest.raises(sl.ScheduleError, match=r"already carries checkpoint.*trace its parent") as info:
        sch["encoder.layer.0.intermediate"].trace()
    _one_sentence(info.value)
    gm = sch["encoder.layer.0.output"].trace()  # siblings still trace
    assert is_traced(gm)


# --------------------------------------------------------------------------------------------------
# Slapo's trace(tracer="pytorch") on transformers 5.x: fx.GraphModules, find / replace / fuse on them
# --------------------------------------------------------------------------------------------------
def _graph_children(gm: nn.Module) -> list[str]:
    return [qn for qn, m in gm.named_modules() if qn and isinstance(m, fx.GraphModule)]


@pytest.mark.parametrize("flatten", [False, True], ids=["hierarchy", "flatten"])
@pytest.mark.parametrize(
    "make,path,kw,leaf",
    [
        (llama, "model.layers.0", {"use_cache": False}, "self_attn.q_proj"),
        (bert, "encoder.layer.0", {}, "attention.self.query"),
    ],
    ids=["LlamaDecoderLayer", "BertLayer"],
)
def test_pytorch_tracer_gives_graph_modules_without_inputs(make, path, kw, leaf, flatten, ids):
    """Slapo's ``trace(tracer="pytorch")`` with no inputs: torch.export on the model's dummy inputs,
    shape-generic, as fx.GraphModules; the model then runs on other shapes and gives the same result."""
    model = make()
    ref = model(input_ids=ids, **kw)[0]
    query = model.get_submodule(f"{path}.{leaf}")
    sch = sl.create_schedule(model)

    gm = sch[path].trace(tracer="pytorch", flatten=flatten)

    assert isinstance(gm, fx.GraphModule) and model.get_submodule(path) is gm
    assert type(gm).__name__ == sl.tracing.orig_class(gm).__name__ == type(model.get_submodule(path)).__name__
    calls = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    if flatten:  # one graph: the leaves are called by their dotted paths, and are no schedule nodes
        assert _graph_children(gm) == [] and leaf in calls
        assert f"{path}.{leaf}" not in sch and sch[path].get_module(leaf) is query
    else:  # every non-leaf submodule is a graph module of its own; leaves are the original objects
        assert leaf.rsplit(".", 1)[0] in _graph_children(gm)
        assert sch[f"{path}.{leaf}"].mod is query
    torch.testing.assert_close(model(input_ids=ids, **kw)[0], ref)  # (2, 8), traced on dummies (3, 5)
    torch.testing.assert_close(copy.deepcopy(model)(input_ids=ids, **kw)[0], ref)


def test_gpt2_block_with_recorded_inputs_keeps_conv1d_leaves(ids):
    model = gpt2()
    ref = model(input_ids=ids, use_cache=False).logits
    sch = sl.create_schedule(model)
    rec = sl.record_example_inputs(sch, {"input_ids": ids, "use_cache": False})
    args, kwargs = rec["transformer.h.0"]
    gm = sch["transformer.h.0"].trace(tracer="pytorch")
    assert isinstance(gm, fx.GraphModule) and type(gm).__name__ == "GPT2Block"
    assert [p for p, _ in sch["transformer.h.0"].find(r"c_attn|c_proj")] == ["attn", "attn", "mlp"]
    assert type(sch["transformer.h.0.attn.c_attn"].mod).__name__ == "Conv1D"  # shardable leaf kept
    torch.testing.assert_close(model(input_ids=ids, use_cache=False).logits, ref)
    names = list(inspect.signature(type(model.transformer.h[1]).forward).parameters)[1:]
    as_keywords = {
        **dict(zip(names, args, strict=False)),
        **kwargs,
    }  # the traced call written another way binds too
    torch.testing.assert_close(gm(**as_keywords)[0], gm(*args, **kwargs)[0])
    with pytest.raises(
        RuntimeError, match=r"GPT2Block is specialised to the non-tensor inputs it was traced"
    ):
        gm(*args, **{**kwargs, "use_cache": True})


class _GateUp(nn.Module):
    """SwiGLU's ``silu(gate(x)) * up(x)`` as one matmul of the concatenated weights."""

    def __init__(self, gate: nn.Linear, up: nn.Linear):
        super().__init__()
        self.weight = nn.Parameter(torch.cat([gate.weight, up.weight]).detach().clone())

    def forward(self, x):
        g, u = F.linear(x, self.weight).chunk(2, dim=-1)
        return F.silu(g) * u


def test_whole_llama_find_qkv_and_replace_the_swiglu_subgraph(ids):
    model = llama()
    ref = model(input_ids=ids, use_cache=False).logits
    sch = sl.create_schedule(model)
    gm = sch.trace(tracer="pytorch", example_inputs={"input_ids": ids, "use_cache": False})
    assert isinstance(gm, fx.GraphModule) and type(gm).__name__ == "LlamaForCausalLM"
    assert all(isinstance(sch[p].mod, fx.GraphModule) for p in ("model", "model.layers.1.self_attn"))

    qkv = sch.find(r"[qkv]_proj$")
    assert [(p, n.target) for p, n in qkv] == [
        (f"model.layers.{i}.self_attn", f"{c}_proj") for i in range(2) for c in "qkv"
    ]
    mlp = sch["model.layers.1.mlp"]
    (swiglu,) = mlp.find(lambda x: F.silu(sl.call_module("gate_proj", x)) * sl.call_module("up_proj", x))
    assert [n.target for _, n in swiglu if n.op == "call_module"] == ["gate_proj", "act_fn", "up_proj"]
    mlp.replace(_GateUp(mlp.mod.gate_proj, mlp.mod.up_proj), swiglu, name="gate_up")
    assert "gate_up_0" in mlp.child and "gate_proj" not in mlp.child  # only the subgraph called it
    torch.testing.assert_close(gm(input_ids=ids, use_cache=False).logits, ref)


def test_bert_bias_gelu_found_and_fused_after_a_flat_trace(ids):
    """Slapo's bias + GeLU fusion on a transformers 5.x BertLayer: decompose the dense layer, trace the
    layer into one flat graph (torch.export), find ``gelu(x + bias)`` and fuse it."""
    model = bert()
    ref = model(input_ids=ids).last_hidden_state
    sch = sl.create_schedule(model)
    sch["encoder.layer.0.intermediate.dense"].decompose()
    sl.record_example_inputs(sch, {"input_ids": ids})
    layer = sch["encoder.layer.0"]
    gm = layer.trace(tracer="pytorch", flatten=True)
    assert _graph_children(gm) == []
    (bias_gelu,) = layer.find(lambda x, bias: F.gelu(x + bias))
    assert [sl.tracing.op_key(n, gm) for _, n in bias_gelu] == ["add", "gelu"]
    fused = layer.fuse(bias_gelu, compiler=None, name="BiasGeLU")
    assert type(fused).__name__ == "BiasGeLU" and "BiasGeLU_0" in layer.child
    torch.testing.assert_close(model(input_ids=ids).last_hidden_state, ref)
