"""Graph navigation and search, kernel side (issue 17 item 5): the ``highlighted`` / ``centre`` traits of
:class:`GraphWidget`, the editor's search (full paths, one sentence for no match, graph highlight), and
the constants the browser half must share with Python.

Run: ``source scripts/env.sh && .venv/bin/python -m pytest -q tests/unit/editor/test_graph_navigation.py`` (a few
seconds; the browser half is tested in ``tests/browser/test_browser_navigation.py``).
"""

from __future__ import annotations

import math
import re

import harness
import pytest

from slapo_lab.editor import GraphWidget
from slapo_lab.editor.graph_widget import MINIMAP_NODES

REPO = harness.REPO_ROOT
WIDGET_TS = REPO / "labextension" / "src" / "widget.ts"
NODE_IDS = {"d1n0": "embeddings", "d1n1": "encoder", "d1n2": "pooler"}


@pytest.fixture
def widget():
    w = GraphWidget(svg="<svg xmlns='http://www.w3.org/2000/svg'></svg>", node_ids=NODE_IDS, render_id=1)
    w.errors = []
    w.on_error(w.errors.append)
    yield w
    w.close()


def _ts_const(name: str) -> float:
    m = re.search(rf"const {name}(?::[^=]+)? = ([0-9.eE+-]+);", WIDGET_TS.read_text())
    assert m, f"{name} not found in widget.ts"
    return float(m.group(1))


# ------------------------------------------------------------------------------------ widget traits


def test_new_traits_are_synced_with_defaults(widget):
    state = widget.get_state()
    assert (state["highlighted"], state["centre"], state["centre_request"]) == ([], "", 0)


def test_highlight_paths_and_centre_first(widget):
    assert widget.highlight(["pooler", "encoder"]) == ["d1n1", "d1n2"]  # drawing order
    assert widget.highlighted == ["d1n1", "d1n2"]
    assert (widget.centre, widget.centre_request) == ("d1n1", 1)
    assert widget.highlight(["embeddings"], centre=False) == ["d1n0"]
    assert (widget.centre, widget.centre_request) == ("d1n1", 1)  # not asked again
    assert widget.highlight(None) == [] and widget.highlighted == []
    assert widget.highlight([]) == [] and widget.centre_request == 1  # nothing to centre on
    assert widget.errors == []


def test_highlight_rule_is_reapplied_to_each_drawing_without_centring(widget):
    widget.highlight(lambda tok, node: node.startswith("enc"))
    assert (widget.highlighted, widget.centre_request) == (["d1n1"], 1)
    prefix = widget.next_token_prefix()
    widget.set_graph("<svg/>", {f"{prefix}0": "pooler", f"{prefix}1": "encoder"})
    assert widget.highlighted == [f"{prefix}1"]  # the new drawing's token
    assert widget.centre_request == 1  # a redraw does not move the view
    assert widget.centre == ""  # the old token is not a node of this drawing
    widget.highlight(None)
    widget.set_graph("<svg/>", {"d3n0": "encoder"})
    assert widget.highlighted == []


def test_centre_on_only_drawn_tokens(widget):
    assert widget.centre_on("d1n2") is True
    assert (widget.centre, widget.centre_request) == ("d1n2", 1)
    assert widget.centre_on("d1n2") is True  # the same node again: a new request
    assert widget.centre_request == 2
    assert widget.centre_on("d9n9") is False
    assert (widget.centre, widget.centre_request) == ("d1n2", 2)


def test_a_failing_rule_highlights_nothing_and_reports(widget):
    def bad(_tok, _node):
        raise KeyError("boom")

    assert widget.highlight(bad) == []
    assert len(widget.errors) == 1 and "Highlighting failed (KeyError" in widget.errors[0]
    widget.set_graph("<svg/>", {"d2n0": "encoder"})  # the redraw survives the bad rule
    assert widget.highlighted == [] and widget.svg == "<svg/>"


def test_browser_constants_match():
    assert _ts_const("MINIMAP_NODES") == MINIMAP_NODES == 40
    notch = math.exp(100 * _ts_const("ZOOM_PER_PX"))
    assert 1.1 <= notch <= 1.2, notch  # one 100-px wheel notch with Ctrl, or a pinch of 100 px
    assert math.exp(5 * 3 * _ts_const("ZOOM_PER_PX")) < 1.1  # five small pinch events: a few percent
    assert 1 < _ts_const("MAX_STEP_ZOOM") <= 2
    ts = WIDGET_TS.read_text()
    assert ".on('wheel.zoom', null)" in ts  # d3's 10x ctrl-wheel zoom is not used
    assert "passive: false" in ts  # the wheel handler may preventDefault (only when it pans or zooms)


# ------------------------------------------------------------------------------------ editor search


def test_search_lists_full_paths_and_highlights_the_containing_node(editor):
    graph = editor._graph
    before = graph.centre_request
    n = editor.search("intermediate")
    labels = [label for label, _ in editor._tree.options]
    assert n == len(labels) == 6
    assert len(set(labels)) == len(labels), labels  # no four identical "intermediate · BertIntermediate"
    assert "encoder.layer.0.intermediate · BertIntermediate" in labels
    assert "encoder.layer.1.intermediate.dense · Linear" in labels
    enc = next(t for t, p in graph.node_ids.items() if p == "encoder")
    assert graph.highlighted == [enc]  # the top level shows encoder, which contains every match
    assert (graph.centre, graph.centre_request) == (enc, before + 1)
    assert editor._search_info.value == ""


def test_search_highlight_follows_the_level(editor):
    editor.search("intermediate")
    editor.open_level("encoder.layer.0")
    graph = editor._graph
    highlighted = {graph.node_ids[t] for t in graph.highlighted}
    assert highlighted == {"encoder.layer.0.intermediate"}, highlighted


def test_search_without_match_says_so_and_clear_restores(editor):
    total = len(editor._tree_visible())  # the collapsed tree's rows
    assert editor.search("xyz") == 0
    assert editor._search_info.value == "No module matches 'xyz'."
    assert editor._tree.layout.display == "none"  # no empty box
    assert editor._graph.highlighted == []
    assert editor.search("<b>") == 0
    assert editor._search_info.value == "No module matches '&lt;b&gt;'."  # escaped
    assert editor.search("") == total
    assert editor._search_info.value == "" and editor._tree.layout.display is None
    assert editor._tree.options == tuple(editor._tree_visible())  # the indented (collapsed) tree is back
    assert editor._graph.highlighted == []


def test_search_by_type_keeps_the_selection(editor):
    editor.select("encoder.layer.0.attention.self")
    n = editor.search("BertSelfAttention")
    assert n == 2
    assert [p for _, p in editor._tree.options] == [
        "encoder.layer.0.attention.self",
        "encoder.layer.1.attention.self",
    ]
    assert editor._tree.value == "encoder.layer.0.attention.self"


def test_the_tree_shows_only_the_open_modules_and_follows_the_selection(editor):
    def rows():
        return [(label.strip("\u2003"), path) for label, path in editor._tree.options]

    assert rows() == [
        ("\u25be (model) · BertModel", ""),
        ("\u25b8 embeddings · BertEmbeddings", "embeddings"),
        ("\u25b8 encoder · BertEncoder", "encoder"),
        ("\u25b8 pooler · BertPooler", "pooler"),
    ]
    editor.select("encoder.layer.1.attention")
    paths = [p for _, p in rows()]
    assert "encoder.layer.1.attention.self" in paths and "encoder.layer.1.intermediate" in paths
    assert "encoder.layer.0" in paths and "encoder.layer.0.attention" not in paths  # a closed sibling
    assert editor._tree.value == "encoder.layer.1.attention"
    assert ("\u25be attention · BertAttention", "encoder.layer.1.attention") in rows()
    editor.select("encoder")  # an ancestor: the rest folds away
    assert [p for _, p in rows()] == ["", "embeddings", "encoder", "encoder.layer", "pooler"]
    assert len(editor._all_tree_options) > 40  # what search still filters


def test_a_70b_tree_is_short():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import slapo_lab as sl

    cfg = LlamaConfig(
        num_hidden_layers=80,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    ed = sl.ScheduleEditor(model, world_size=2, live_check=False)
    assert len(ed._all_tree_options) > 900
    assert len(ed._tree.options) < 100, len(ed._tree.options)
    ed.select("model.layers.41.mlp.up_proj")
    paths = [p for _, p in ed._tree.options]
    assert (
        len(paths) < 110 and "model.layers.41.mlp.down_proj" in paths and ed._tree.value.endswith("up_proj")
    )
