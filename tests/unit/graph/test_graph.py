"""slapo_lab.graph: recorded dataflow, level graphs, module tree and graphviz rendering.

Real HF transformers 5.x models from small configs (no downloads), on meta and on CPU.
"""

from __future__ import annotations

import gc
import re
import shutil
import xml.etree.ElementTree as ET

import networkx as nx
import pytest
import torch
from torch import nn
from transformers import (
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

import slapo_lab.graph as g
from slapo_lab.graph import DataflowError, record_dataflow

needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz 'dot' not installed")

B, S, H = 2, 16, 64
X = "×"


def shp(*dims) -> str:
    return X.join(str(d) for d in dims)


def _bert(device: str, layers: int = 3) -> BertModel:
    with torch.device(device):
        return BertModel(
            BertConfig(num_hidden_layers=layers, hidden_size=H, num_attention_heads=4, intermediate_size=128)
        )


def _gpt2(device: str) -> GPT2LMHeadModel:
    with torch.device(device):
        return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=H, n_head=4, vocab_size=1000, n_positions=64))


def _llama(device: str, layers: int = 3) -> LlamaForCausalLM:
    with torch.device(device):
        return LlamaForCausalLM(
            LlamaConfig(
                num_hidden_layers=layers,
                hidden_size=H,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=128,
                vocab_size=1000,
            )
        )


def _ids(device: str) -> torch.Tensor:
    return torch.zeros(B, S, dtype=torch.long, device=device)


@pytest.fixture(scope="module", params=["meta", "cpu"])
def bert_flow(request):
    return record_dataflow(_bert(request.param), {"input_ids": _ids(request.param)})


@pytest.fixture(scope="module", params=["meta", "cpu"])
def gpt2_flow(request):
    return record_dataflow(_gpt2(request.param), {"input_ids": _ids(request.param)})


@pytest.fixture(scope="module", params=["meta", "cpu"])
def llama_flow(request):
    return record_dataflow(_llama(request.param), {"input_ids": _ids(request.param)})


def edges(G: nx.DiGraph) -> dict:
    return {(u, v): a["label"] for u, v, a in G.edges(data=True)}


# -- recording ---------------------------------------------------------------------------------------
def test_bert_root_level_chain(bert_flow):
    G = bert_flow.level_graph("")
    assert G.graph["path"] == "" and G.graph["model"] == "BertModel"
    e = edges(G)
    assert e[(".input:input_ids", "embeddings")] == shp(B, S)
    assert e[("embeddings", "encoder")] == shp(B, S, H)
    assert e[("encoder", "pooler")] == shp(B, S, H)
    assert e[("pooler", ".output")] == shp(B, H)
    assert e[("encoder", ".output")] == shp(B, S, H)  # last_hidden_state
    assert G.nodes["embeddings"]["kind"] == "module"
    assert G.nodes["embeddings"]["type"] == "BertEmbeddings"
    assert G.nodes[".input:input_ids"]["kind"] == "input"
    assert G.nodes[".output"]["kind"] == "output"
    assert G.nodes["pooler"]["params"] == H * H + H


def test_bert_encoder_folded_and_expanded(bert_flow):
    G = bert_flow.level_graph("encoder")
    fold = "encoder.layer.0-2"
    assert fold in G
    a = G.nodes[fold]
    assert (a["label"], a["kind"], a["count"], a["type"]) == ("BertLayer × 3", "folded", 3, "BertLayer")
    assert a["members"] == ["encoder.layer.0", "encoder.layer.1", "encoder.layer.2"]
    assert a["sub"] == "layer.0-2" and a["path"] == "encoder.layer.0"
    assert a["params"] == sum(bert_flow.params(m) for m in a["members"])
    e = edges(G)
    assert e == {(".input:hidden_states", fold): shp(B, S, H), (fold, ".output"): shp(B, S, H)}

    G2 = bert_flow.level_graph("encoder", expanded={fold})
    assert fold not in G2
    e2 = edges(G2)
    assert e2[(".input:hidden_states", "encoder.layer.0")] == shp(B, S, H)
    assert e2[("encoder.layer.0", "encoder.layer.1")] == shp(B, S, H)
    assert e2[("encoder.layer.1", "encoder.layer.2")] == shp(B, S, H)
    assert e2[("encoder.layer.2", ".output")] == shp(B, S, H)
    assert len(e2) == 4
    assert set(bert_flow.level_graph("encoder", fold=False)) == set(G2)


def test_bert_layer_level(bert_flow):
    p = "encoder.layer.1"
    e = edges(bert_flow.level_graph(p))
    assert e[(".input:hidden_states", f"{p}.attention")] == shp(B, S, H)
    assert e[(f"{p}.attention", f"{p}.intermediate")] == shp(B, S, H)
    assert e[(f"{p}.intermediate", f"{p}.output")] == shp(B, S, 128)
    assert e[(f"{p}.attention", f"{p}.output")] == shp(B, S, H)  # residual
    assert e[(f"{p}.output", ".output")] == shp(B, S, H)


def test_bert_self_attention_level(bert_flow):
    p = "encoder.layer.0.attention.self"
    G = bert_flow.level_graph(p)
    e = edges(G)
    for proj in ("query", "key", "value"):
        assert e[(".input:hidden_states", f"{p}.{proj}")] == shp(B, S, H)
        assert e[(f"{p}.{proj}", ".output")] == shp(B, S, H)  # through reshape + attention ops
    # HF 5.x applies attention dropout functionally: the Dropout module never runs, still shown
    assert G.nodes[f"{p}.dropout"]["ran"] is False
    assert G.degree(f"{p}.dropout") == 0


def test_gpt2_attention_level(gpt2_flow):
    p = "transformer.h.0.attn"
    G = gpt2_flow.level_graph(p)
    e = edges(G)
    assert e[(".input:hidden_states", f"{p}.c_attn")] == shp(B, S, H)
    assert e[(f"{p}.c_attn", f"{p}.c_proj")] == shp(B, S, H)
    assert e[(f"{p}.c_proj", f"{p}.resid_dropout")] == shp(B, S, H)
    assert e[(f"{p}.resid_dropout", ".output")] == shp(B, S, H)
    assert G.nodes[f"{p}.c_attn"]["type"] == "Conv1D"
    root = edges(gpt2_flow.level_graph(""))
    assert root[("transformer", "lm_head")] == shp(B, S, H)
    assert root[("lm_head", ".output")] == shp(B, S, 1000)
    t = gpt2_flow.level_graph("transformer")
    assert t.nodes["transformer.h.0-1"]["label"] == "GPT2Block × 2"
    assert edges(t)[("transformer.drop", "transformer.h.0-1")] == shp(B, S, H)


def test_llama_levels(llama_flow):
    e = edges(llama_flow.level_graph(""))
    assert e == {
        (".input:input_ids", "model"): shp(B, S),
        ("model", "lm_head"): shp(B, S, H),
        ("lm_head", ".output"): shp(B, S, 1000),
    }
    G = llama_flow.level_graph("model")
    assert G.nodes["model.layers.0-2"]["label"] == "LlamaDecoderLayer × 3"
    e = edges(G)
    assert e[("model.embed_tokens", "model.layers.0-2")] == shp(B, S, H)
    assert e[("model.rotary_emb", "model.layers.0-2")] == shp(1, S, 16)  # cos / sin, head_dim 16
    assert e[("model.layers.0-2", "model.norm")] == shp(B, S, H)
    p = "model.layers.1"
    e = edges(llama_flow.level_graph(p))
    assert e[(".input:hidden_states", f"{p}.input_layernorm")] == shp(B, S, H)
    assert e[(f"{p}.input_layernorm", f"{p}.self_attn")] == shp(B, S, H)
    assert e[(".input:position_embeddings", f"{p}.self_attn")] == shp(1, S, 16)
    assert e[(f"{p}.self_attn", f"{p}.post_attention_layernorm")] == shp(B, S, H)
    assert e[(".input:hidden_states", f"{p}.post_attention_layernorm")] == shp(B, S, H)  # residual
    assert e[(f"{p}.post_attention_layernorm", f"{p}.mlp")] == shp(B, S, H)
    assert e[(f"{p}.mlp", ".output")] == shp(B, S, H)
    e = edges(llama_flow.level_graph(f"{p}.mlp"))
    assert e[(f"{p}.mlp.gate_proj", f"{p}.mlp.act_fn")] == shp(B, S, 128)
    assert e[(f"{p}.mlp.act_fn", f"{p}.mlp.down_proj")] == shp(B, S, 128)
    assert e[(f"{p}.mlp.up_proj", f"{p}.mlp.down_proj")] == shp(B, S, 128)


def test_container_level_uses_ancestor_frame(llama_flow):
    G = llama_flow.level_graph("model.layers")
    assert G.graph["frame"] == "model"
    assert "model.layers.0-2" in G
    assert ("model.layers.0-2", ".output") in G.edges


def test_leaf_level_and_module_info(bert_flow):
    p = "encoder.layer.0.attention.self.query"
    assert edges(bert_flow.level_graph(p)) == {(".input:input", ".output"): shp(B, S, H)}
    info = bert_flow.module_info(p)
    assert info["type"] == "Linear" and info["calls"] == 1
    assert info["inputs"] == [{"name": "input", "shapes": [(B, S, H)], "dtypes": ["float32"]}]
    assert info["outputs"][0]["shapes"] == [(B, S, H)]
    assert info["parameters"] == {
        "weight": {"shape": (H, H), "dtype": "float32", "numel": H * H},
        "bias": {"shape": (H,), "dtype": "float32", "numel": H},
    }
    assert info["params"] == H * H + H
    info = bert_flow.module_info("encoder.layer.0")
    assert "attention.self.query.weight" in info["parameters"]
    assert info["children"] == ["attention", "intermediate", "output"]
    with pytest.raises(KeyError, match="No module at path 'nope'"):
        bert_flow.module_info("nope")
    with pytest.raises(KeyError):
        bert_flow.level_graph("encoder.nope")


def test_meta_op_cache_changes_nothing():
    m = _llama("meta", layers=2)
    a = record_dataflow(m, {"input_ids": _ids("meta")})
    b = record_dataflow(m, {"input_ids": _ids("meta")}, cache_meta_ops=False)
    assert a.cache_hits > 0 and b.cache_hits == 0
    assert a.num_ops == b.num_ops
    for path in a.paths:
        ga, gb = a.level_graph(path), b.level_graph(path)
        assert edges(ga) == edges(gb), path
        assert dict(ga.nodes(data="label")) == dict(gb.nodes(data="label"))


def test_hooks_removed_and_gc_restored():
    m = _bert("meta", layers=1)
    assert gc.isenabled()
    record_dataflow(m, {"input_ids": _ids("meta")})
    assert gc.isenabled()
    for mod in m.modules():
        assert not mod._forward_hooks and not mod._forward_pre_hooks


class Twice(nn.Module):
    """Shared submodule called twice, an Identity, an unused child, a tensor made from scratch."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.ident = nn.Identity()
        self.unused = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x, y):
        h = self.shared(x)
        h = self.shared(h + y)
        z = torch.ones(h.shape[0], 4, device=h.device)  # from scratch
        return self.head(self.ident(h) * z)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_small_model_calls_and_passthrough(device):
    m = Twice().to(device)
    flow = record_dataflow(m, (torch.zeros(3, 4, device=device), torch.zeros(3, 4, device=device)))
    assert flow.call_count("shared") == 2
    assert flow.module_info("shared")["calls"] == 2
    assert len(flow.module_info("shared")["per_call"]) == 2
    e = edges(flow.level_graph(""))
    assert e[(".input:x", "shared")] == shp(3, 4)
    assert e[(".input:y", "shared")] == shp(3, 4)  # positional args named from the signature
    assert e[("shared", "shared")] == shp(3, 4)  # first call feeds the second
    assert e[("shared", "ident")] == shp(3, 4)
    assert e[("ident", "head")] == shp(3, 4)  # Identity returns its input: still in the chain
    assert e[("head", ".output")] == shp(3, 2)
    G = flow.level_graph("")
    assert G.nodes["unused"]["ran"] is False and G.degree("unused") == 0


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        if h.sum() > -1e9:  # data-dependent branch
            h = self.b(h)
        return h


def test_data_dependent_control_flow():
    flow = record_dataflow(DataDependent(), (torch.ones(2, 4),))  # real tensors: fine
    assert ("a", "b") in flow.level_graph("").edges
    m = DataDependent().to("meta")
    with pytest.raises(DataflowError) as ei:
        record_dataflow(m, (torch.ones(2, 4, device="meta"),))
    msg = str(ei.value)
    assert msg.startswith("The forward pass of DataDependent failed") and msg.endswith(".")
    assert "\n" not in msg
    flow = record_dataflow(m, (torch.ones(2, 4, device="meta"),), assume_bool=True)
    assert flow.assumptions == [("", "__bool__")]
    assert ("a", "b") in flow.level_graph("").edges


class Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.Linear(5, 4))

    def forward(self, x):
        return self.inner(x)


def test_forward_error_is_dataflow_error_and_tree_still_works():
    m = Broken()
    with pytest.raises(DataflowError, match=r"failed in module 'inner\.1' \(RuntimeError: ") as ei:
        record_dataflow(m, (torch.zeros(2, 4),))
    assert isinstance(ei.value.__cause__, RuntimeError)
    assert "\n" not in str(ei.value)
    for mod in m.modules():
        assert not mod._forward_hooks and not mod._forward_pre_hooks
    T = g.module_tree(m)
    assert set(T) == {"", "inner", "inner.0", "inner.1"}
    assert set(T.edges) == {("", "inner"), ("inner", "inner.0"), ("inner", "inner.1")}
    assert T.nodes[""]["params"] == 4 * 4 + 4 + 5 * 4 + 4
    assert T.nodes["inner.1"]["type"] == "Linear"
    with pytest.raises(TypeError):
        record_dataflow(m, "not inputs")


def test_module_tree_llama_meta_counts_tied_once():
    m = _gpt2("meta")  # lm_head.weight is tied to transformer.wte.weight
    T = g.module_tree(m)
    assert nx.is_tree(T)
    assert T.nodes[""]["params"] == sum(p.numel() for p in m.parameters())
    assert T.nodes["transformer.h.1.attn.c_attn"]["type"] == "Conv1D"
    assert T.nodes["transformer.h.1"]["depth"] == 3


# -- rendering ------------------------------------------------------------------------------------
HOSTILE = ['a"b', "x\ny", "<script>alert(1)</script>", "q'\\N\\G&amp;", "é ×"]


class Hostile(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleDict({n: nn.Linear(4, 4) for n in HOSTILE})

    def forward(self, x):
        for b in self.blocks.values():
            x = b(x)
        return x


def _texts(svg: str) -> list[str]:
    root = ET.fromstring(svg)
    return ["".join(t.itertext()) for t in root.iter("{http://www.w3.org/2000/svg}text")]


@needs_dot
def test_hostile_names_render_valid_escaped_svg():
    flow = record_dataflow(Hostile(), (torch.zeros(2, 4),))
    G = flow.level_graph("")
    assert [v for u, v in G.edges] == [f"blocks.{n}" for n in HOSTILE] + [".output"]
    styles = {f"blocks.{HOSTILE[2]}": {"fill": "#ff0000", "badges": ["<b>x</b>", 'q"']}}
    svg, ids = g.render_svg(G, styles)
    root = ET.fromstring(svg)  # well-formed XML
    assert "<script" not in svg and "&lt;script&gt;" in svg
    texts = _texts(svg)
    for n in HOSTILE:
        shown = f"blocks.{n}".replace("\n", "\\n")
        assert shown in texts, shown  # literal text, no graphviz \N / \G expansion
    assert '<b>x</b> · q"' in texts
    # ids are tokens only, never names
    all_ids = [el.get("id") for el in root.iter() if el.get("id")]
    assert all(re.fullmatch(r"(n|e|a_n|a_e)\d+|slapo-graph", i) for i in all_ids), all_ids
    assert set(ids) == {f"n{i}" for i in range(len(G))}
    assert sorted(ids.values(), key=str) == sorted(G.nodes, key=str)
    node_groups = [el for el in root.iter() if el.get("class", "").startswith("node")]
    assert {el.get("id") for el in node_groups} == set(ids)
    # the red fill landed on the <script> node
    tok = next(t for t, n in ids.items() if n == f"blocks.{HOSTILE[2]}")
    grp = next(el for el in node_groups if el.get("id") == tok)
    assert any(el.get("fill") == "#ff0000" for el in grp.iter())


@needs_dot
def test_layout_cache_hit_when_only_colours_change(bert_flow):
    G = bert_flow.level_graph("encoder.layer.0")
    g.clear_layout_cache()
    svg1, ids1 = g.render_svg(G, {"encoder.layer.0.attention": {"fill": "#ffd8a8"}})
    assert g.layout_cache_info() == {"hits": 0, "misses": 1, "size": 1, "maxsize": 128}
    svg2, ids2 = g.render_svg(
        G, {"encoder.layer.0.attention": {"fill": "#a5d8ff", "color": "#1c7ed6", "penwidth": 2}}
    )
    info = g.layout_cache_info()
    assert (info["hits"], info["misses"]) == (1, 1)
    assert ids1 == ids2
    assert "#a5d8ff" in svg2 and "#ffd8a8" not in svg2

    def geometry(svg):  # positions of every node shape and edge path
        return re.findall(r'(?:points|d|cx|cy|x|y)="([^"]*)"', re.sub(r'stroke-width="[^"]*"', "", svg))

    assert geometry(svg1) == geometry(svg2)
    # a badge changes node sizes: a new layout
    g.render_svg(G, {"encoder.layer.0.attention": {"fill": "#a5d8ff", "badges": ["TP:0"]}})
    assert g.layout_cache_info()["misses"] == 2
    # a different level: a new layout; the old one is still cached
    g.render_svg(bert_flow.level_graph(""))
    g.render_svg(G, {"encoder.layer.0.output": {"fill": "#b2f2bb"}})
    info = g.layout_cache_info()
    assert (info["hits"], info["misses"], info["size"]) == (2, 3, 3)


@needs_dot
def test_render_folded_badges_and_styles(llama_flow):
    G = llama_flow.level_graph("model")
    svg, ids = g.render_svg(G, {"model.layers.0-2": {"fill": "#ffd8a8", "badges": ["TP", "ckpt", "stage 1"]}})
    texts = _texts(svg)
    assert "LlamaDecoderLayer × 3" in texts and "TP · ckpt · stage 1" in texts
    assert "model.layers.0-2" in ids.values()
    assert ' class="node slapo-node slapo-folded"' in svg.replace("&#45;", "-")
    with pytest.raises(ValueError, match="six-digit hex"):
        g.render_svg(G, {"model.norm": {"fill": "red"}})
    with pytest.raises(ValueError, match="six-digit hex"):
        g.render_svg(G, {"model.norm": {"color": "#fff"}})
    with pytest.raises(ValueError, match="Unknown style key"):
        g.render_svg(G, {"model.norm": {"fil": "#ffffff"}})
    with pytest.raises(ValueError, match="penwidth"):
        g.render_svg(G, {"model.norm": {"penwidth": 99}})


@needs_dot
def test_render_expanded_fan_out_is_fast_enough():
    """A source feeding every layer (rotary embeddings) is drawn merged, not as 24 labelled curves."""
    m = _llama("meta", layers=24)
    flow = record_dataflow(m, {"input_ids": _ids("meta")})
    G = flow.level_graph("model", expanded={"model.layers.0-23"})
    assert G.out_degree("model.rotary_emb") == 24
    svg, ids = g.render_svg(G, timeout=20)
    ET.fromstring(svg)
    assert len(ids) == len(G)


@needs_dot
def test_module_tree_renders():
    svg, ids = g.render_svg(g.module_tree(_bert("meta", layers=1)), rankdir="LR")
    ET.fromstring(svg)
    assert "" in ids.values() and "encoder.layer.0.attention.self.query" in ids.values()


def test_legend_svg():
    svg = g.legend_svg({"<sharded> & more": "#ffd8a8", "checkpointed": "#a5d8ff"}, title='A "legend"')
    root = ET.fromstring(svg)
    texts = ["".join(t.itertext()) for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert texts == ['A "legend"', "<sharded> & more", "checkpointed"]
    assert [r.get("fill") for r in root.iter("{http://www.w3.org/2000/svg}rect")] == ["#ffd8a8", "#a5d8ff"]
    with pytest.raises(ValueError):
        g.legend_svg([("x", "blue")])
