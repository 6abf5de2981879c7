"""The readable graph (issue 11): computed properties of the rendered SVG and the graph widget's
render ids (no browser needed; the screenshots are in test_browser_screens.py).

Each test fails on the code before the fix: clicks carried no drawing id (a late click selected
another module), an 80-layer expanded level fitted into 1-2 px text, long badges widened nodes
without bound, one border colour carried stage / checkpoint / cut, and edges kept the unsharded
shapes after sharding.
"""

from __future__ import annotations

import re

import harness
import pytest
import torch
from transformers import BertConfig, BertModel
from zoo.scale import llama2_70b_config, on_meta

import slapo_lab as sl
from slapo_lab import graph as g
from slapo_lab.editor import GraphWidget
from slapo_lab.graph import dataflow as _dataflow

REPO = harness.REPO_ROOT
# a large graph view (CSS px); the editor's default box is smaller, and the browser then keeps a
# readable minimum scale and pans (test_browser_screens.py)
BOX_W, BOX_H = 960, 720
MIN_TEXT_PX = 6.0


# ------------------------------------------------------------------------------------ helpers


def _send(widget: GraphWidget, content) -> None:
    widget._handle_msg({"content": {"data": {"method": "custom", "content": content}}, "buffers": []})


def _fitted_text_px(svg: str) -> tuple[float, float]:
    """(smallest, largest) text size in CSS px when the whole drawing is fitted into BOX (the
    browser's fit: min of the two ratios, never above the natural 4/3 px per pt)."""
    m = re.search(r'viewBox="[\d.]+ [\d.]+ ([\d.]+) ([\d.]+)"', svg)
    w, h = float(m.group(1)), float(m.group(2))
    scale = min(BOX_W / w, BOX_H / h, 4 / 3)
    sizes = [float(s) for s in re.findall(r'<text[^>]*font-size="([\d.]+)"', svg)]
    return min(sizes) * scale, max(sizes) * scale


def _node_group(svg: str, token: str) -> str:
    m = re.search(rf'<g id="{token}" class="node[^"]*">(.*?)</g>', svg, re.DOTALL)
    assert m, f"no node {token}"
    return m.group(1)


def _x_extent(fragment: str) -> float:
    """Width of the node's outline (its first path / polygon)."""
    m = re.search(r'<(?:path|polygon)[^>]*(?: d| points)="([^"]+)"', fragment)
    nums = [float(x) for x in re.findall(r"-?[\d.]+", m.group(1))]
    xs = nums[0::2]
    return max(xs) - min(xs)


def _token(ids: dict, node) -> str:
    return next(t for t, n in ids.items() if n == node)


def _bert(layers: int = 4) -> BertModel:
    with torch.device("meta"):
        return BertModel(
            BertConfig(
                num_hidden_layers=layers,
                hidden_size=64,
                num_attention_heads=4,
                intermediate_size=128,
                vocab_size=200,
                max_position_embeddings=64,
            )
        )


def _ids():
    return {"input_ids": torch.zeros(2, 16, dtype=torch.long, device="meta")}


# ------------------------------------------------------------------------------------ render id


def test_click_from_an_older_drawing_is_ignored_with_one_sentence():
    w = GraphWidget()
    events, errors = [], []
    w.on_node_click(lambda tok, path: events.append((tok, path)))
    w.on_error(errors.append)
    try:
        w.set_graph("<svg xmlns='http://www.w3.org/2000/svg'/>", {"n0": "encoder", "n1": "pooler"})
        first = w.render_id
        # the view changes (another level): token n0 now names another module
        w.set_graph("<svg xmlns='http://www.w3.org/2000/svg'/>", {"n0": "encoder.layer.0", "n1": "x"})
        assert w.render_id == first + 1
        _send(w, {"event": "click", "node": "n0", "render": first})  # sent before the redraw arrived
        assert events == []
        assert len(errors) == 1 and "before the last redraw" in errors[0]
        assert errors[0].count(". ") == 0 and errors[0].endswith(".")  # one sentence
        _send(w, {"event": "click", "node": "n0", "render": w.render_id})
        assert events == [("n0", "encoder.layer.0")]
        _send(w, {"event": "click", "node": "n0", "render": "1"})
        assert "render id is not an integer" in errors[-1] and len(events) == 1
        assert "render_id" in w.get_state()
    finally:
        w.close()


def test_browser_sends_the_render_id():
    src = (REPO / "labextension" / "src" / "widget.ts").read_text()
    assert "render: this._renderId" in src
    assert src.count("render: this._renderId") == 2  # click and dblclick


# ------------------------------------------------------------------------------------ legibility


def test_bert_fitted_text_is_readable():
    flow = g.record_dataflow(_bert(layers=12), _ids())
    for level, expanded in (("", ()), ("encoder", ("encoder.layer.0-11",))):
        svg, _ = g.render_svg(flow.level_graph(level, expanded=expanded))
        small, _ = _fitted_text_px(svg)
        assert small >= MIN_TEXT_PX, (level, small)


@pytest.fixture(scope="module")
def llama70b_flow():
    model = on_meta(llama2_70b_config())
    return g.record_dataflow(model, {"input_ids": torch.zeros(1, 4096, dtype=torch.long, device="meta")})


def test_llama70b_fully_expanded_keeps_readable_text(llama70b_flow):
    G = llama70b_flow.level_graph("model", expanded={"model.layers.0-79"})
    assert sum(1 for _, d in G.nodes(data=True) if d["kind"] == "module") == 83  # 80 layers + 3
    svg, ids = g.render_svg(G)
    small, large = _fitted_text_px(svg)
    assert small >= MIN_TEXT_PX and large >= 7.0, (small, large)

    # wrapped into rows: layers 0..6 share one row (same y), layer 7 starts the next one, below
    def centre(path):
        frag = _node_group(svg, _token(ids, path))
        ys = [float(y) for y in re.findall(r'<text[^>]* y="(-?[\d.]+)"', frag)]
        xs = [float(x) for x in re.findall(r'<text[^>]* x="(-?[\d.]+)"', frag)]
        return xs[0], ys[0]

    (x0, y0), (x1, y1), (x7, y7) = (centre(f"model.layers.{i}") for i in (0, 1, 7))
    assert y0 == y1 and x1 > x0
    assert y7 > y0 and abs(x7 - x0) < 1.0  # next row, left-aligned


def test_long_badges_do_not_widen_nodes():
    flow = g.record_dataflow(_bert(layers=2), _ids())
    G = flow.level_graph("encoder.layer.0")
    plain, ids = g.render_svg(G)
    long = [f"sync-{i}:reduce_scatter_long" for i in range(6)]
    badged, _ = g.render_svg(G, {"encoder.layer.0.attention": {"badges": long}})
    tok = _token(ids, "encoder.layer.0.attention")
    w0, w1 = _x_extent(_node_group(plain, tok)), _x_extent(_node_group(badged, tok))
    assert w1 <= max(w0, 190.0), (w0, w1)
    assert "+5" in _node_group(badged, tok)  # the rest is summarised ...
    assert all(f"{i}:reduce_scatter" in badged for i in range(6))  # ... and listed in the tooltip
    assert g.render.badge_line(["ab", "cd"]) == "ab · cd"
    assert g.render.badge_line(["x" * 40]).endswith("…") and len(g.render.badge_line(["x" * 40])) <= 28


def test_stage_checkpoint_cut_and_selection_use_distinct_channels():
    flow = g.record_dataflow(_bert(layers=4), _ids())
    G = flow.level_graph("encoder", expanded={"encoder.layer.0-3"})
    styles = {
        "encoder.layer.0": {"band": "#1f77b4", "fill": "#c6dbef"},
        "encoder.layer.1": {"dashed": True},
        "encoder.layer.2": {"cut": True},
    }
    svg, ids = g.render_svg(G, styles)
    stage, ckpt, cut, plain = (_node_group(svg, _token(ids, f"encoder.layer.{i}")) for i in range(4))
    # one border colour for every module: the border carries none of the facts
    borders = {re.search(r'stroke="(#[0-9a-f]{6})"', f).group(1) for f in (stage, ckpt, cut, plain)}
    assert borders == {"#4a5568"}
    assert 'fill="#1f77b4" stroke="transparent"' in stage  # stage: a band
    assert "stroke-dasharray" in ckpt and "stroke-dasharray" not in stage + cut + plain  # checkpoint
    cut_edge = re.search(
        rf'<g id="e\d+" class="edge slapo&#45;cut&#45;edge">\s*<title>{_token(ids, "encoder.layer.2")}&#45;&gt;'
        rf"{_token(ids, 'encoder.layer.3')}</title>(.*?)</g>",
        svg,
        re.DOTALL,
    )
    assert (
        cut_edge
        and f'stroke="{g.render.CUT_COLOUR}"' in cut_edge.group(1)
        and 'stroke-width="3"' in cut_edge.group(1)
    )
    assert svg.count("slapo&#45;cut&#45;edge") == 1  # only the edge after the cut
    # selection: drawn by the browser as a halo (a filter), never as a border stroke
    css = (REPO / "labextension" / "style" / "base.css").read_text()
    rule = re.search(r"g\.node\.slapo-selected\s*\{([^}]*)\}", css).group(1)
    assert "drop-shadow" in rule and "stroke" not in rule
    assert not re.search(r"slapo-selected[^{]*\{[^}]*stroke", css)
    # dark theme: fills let the background through, text follows the theme
    assert re.search(r"data-jp-theme-light='false'\][^{]*g\.node path[^{]*\{[^}]*fill-opacity", css)


def test_editor_styles_and_legend_channels():
    model = BertModel(
        BertConfig(
            num_hidden_layers=4,
            hidden_size=64,
            num_attention_heads=4,
            intermediate_size=128,
            vocab_size=200,
            max_position_embeddings=64,
        )
    )
    ed = sl.ScheduleEditor(
        model, example_inputs={"input_ids": torch.zeros(2, 16, dtype=torch.long)}, world_size=2
    )
    ed.schedule["encoder.layer.1"].checkpoint()
    ed.schedule["encoder.layer.1"].cut_pipeline_stage()
    ed.apply_preset("megatron")
    from slapo_lab.plan import stage_assignment

    stage_of = stage_assignment(ed.schedule).stage_of
    st = ed._style("encoder.layer.1", stage_of)
    assert st.get("dashed") and st.get("cut") and st.get("band") and "color" not in st
    assert st["fill"]  # TP inside
    q = ed._style("encoder.layer.0.attention.self.query", stage_of)
    assert "TP col" in q["badges"] and len(" · ".join(q["badges"])) < 40
    ed.open_level("encoder")
    legend = ed._legend.value
    for text in ("dashed border", "bar on its edges", "halo", "band on the left"):
        assert text in legend
    ed.close()


def test_edges_show_per_rank_shapes_after_sharding():
    flow = g.record_dataflow(_bert(layers=2), _ids())
    sch = sl.create_schedule(_bert(layers=2), world_size=2)
    sl.presets.megatron_tp(sch)

    def mod(path):
        return sch[path].mod if path in sch else None

    att = _dataflow.per_rank_edges(flow.level_graph("encoder.layer.0.attention"), 2, mod, sl.module_state)
    a, b = "encoder.layer.0.attention.self", "encoder.layer.0.attention.output"
    assert att.edges[a, b]["label"] == "2×16×64→32"  # heads split: a column-parallel output
    assert att.edges[a, b]["rank_shapes"] == ["2×16×32"]
    assert att.edges[b, ".output"]["label"] == "2×16×64"  # row parallel + all-reduce: whole again
    layer = _dataflow.per_rank_edges(flow.level_graph("encoder.layer.0"), 2, mod, sl.module_state)
    i, o = "encoder.layer.0.intermediate", "encoder.layer.0.output"
    assert layer.edges[i, o]["label"] == "2×16×128→64"
    svg, _ = g.render_svg(layer)
    assert "2×16×128→64" in svg and "per rank: 2×16×64" in svg
    # one rank: nothing changes
    same = _dataflow.per_rank_edges(flow.level_graph("encoder.layer.0"), 1, mod, sl.module_state)
    assert same.edges[i, o]["label"] == "2×16×128"


def test_legend_swatches():
    svg = g.legend_svg(
        [
            ("col", "#c6dbef"),
            ("ckpt", "#6a51a3", "dashed"),
            ("cut", "#d6336c", "bar"),
            ("sel", "#2196f3", "halo"),
            ("stage 0", "#1f77b4", "band"),
        ]
    )
    assert "stroke-dasharray" in svg and svg.count("<text") == 5
    with pytest.raises(ValueError, match="swatch"):
        g.legend_svg([("x", "#000000", "sparkle")])
