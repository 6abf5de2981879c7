"""Graph click tokens (issue 18) are unique across drawings, so a stale token is ignored, never re-mapped.

Tokens used to be positional (``n0, n1, ...``): after a redraw the same token named another module, and
a message *without* a ``render`` id (a kernel-side driver, a fuzz case) carrying a token of the previous
drawing selected that other module (``encoder.layer.1``). Now every drawing's tokens carry its number
(``d7n3``), so such a message is reported as one sentence and changes nothing.
"""

from __future__ import annotations

import re
import shutil
import xml.etree.ElementTree as ET

import pytest

from slapo_lab import graph as g
from slapo_lab.editor.graph_widget import GraphWidget

needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz not installed")
SVG = "<svg xmlns='http://www.w3.org/2000/svg'/>"


def _send(widget, content):
    widget._on_browser_msg(widget, content, [])


def _index(token: str) -> int:
    return int(re.search(r"\d+$", token).group())


def _one_sentence(text: str) -> None:
    assert text.endswith(".") and text.count(". ") == 0 and "\n" not in text, text


# ------------------------------------------------------------------------------------ render_svg


def _small_graph():
    import networkx as nx

    G = nx.DiGraph()
    G.add_node(".input:x", kind="input", label="x", sub="2×4")
    G.add_node("a", path="a", label="a", type="Linear")
    G.add_node("b", path="b", label="b", type="ReLU")
    G.add_node(".output", kind="output", label="output")
    G.add_edges_from([(".input:x", "a"), ("a", "b"), ("b", ".output")])
    return G


@needs_dot
def test_render_svg_token_prefix_names_every_node_and_shares_the_layout_cache():
    G = _small_graph()
    g.clear_layout_cache()
    plain, ids_plain = g.render_svg(G)
    assert set(ids_plain) == {f"n{i}" for i in range(len(G))}  # the default is unchanged
    svg, ids = g.render_svg(G, {"a": {"fill": "#ffd8a8"}}, token_prefix="d7n")
    assert set(ids) == {f"d7n{i}" for i in range(len(G))}
    assert sorted(ids.values()) == sorted(G.nodes)
    assert {_index(t): p for t, p in ids.items()} == {_index(t): p for t, p in ids_plain.items()}
    root = ET.fromstring(svg)
    node_groups = [el for el in root.iter() if el.get("class", "").startswith("node")]
    assert {el.get("id") for el in node_groups} == set(ids)
    assert not re.search(r'id="n\d+"', svg)  # no positional token left in the drawing
    titles = {"".join(el.find("{http://www.w3.org/2000/svg}title").itertext()) for el in node_groups}
    assert titles == set(ids)
    # the prefix is not part of the layout: one layout, the second render a cache hit, same geometry
    info = g.layout_cache_info()
    assert (info["hits"], info["misses"]) == (1, 1)

    def geometry(text):
        return re.findall(r'(?<![\w-])(?:points|d|cx|cy|x|y)="([^"]*)"', text)

    assert geometry(svg) == geometry(plain)


@pytest.mark.parametrize("bad", ["", "7n", "d7", "e", "a_n", "d n", "n-", 'n"', 3, None])
def test_render_svg_refuses_a_bad_token_prefix(bad):
    with pytest.raises(ValueError, match="token_prefix") as info:
        g.render_svg(_small_graph(), token_prefix=bad)
    _one_sentence(str(info.value))


# ------------------------------------------------------------------------------------ GraphWidget


def test_widget_ignores_a_token_of_an_older_drawing_without_a_render_id():
    w = GraphWidget()
    events, errors = [], []
    w.on_node_click(lambda tok, path: events.append((tok, path)))
    w.on_node_dblclick(lambda tok, path: events.append(("dbl", tok, path)))
    w.on_error(errors.append)
    try:
        assert w.next_token_prefix() == "d1n"
        w.set_graph(SVG, {"d1n0": "encoder", "d1n1": "pooler"})
        assert w.render_id == 1 and w.next_token_prefix() == "d2n"
        w.set_graph(SVG, {"d2n0": "encoder.layer.0", "d2n1": "encoder.layer.1"})
        for event in ("click", "dblclick"):
            _send(w, {"event": event, "node": "d1n1"})  # no render id: a kernel-side driver
        assert events == []
        assert len(errors) == 2
        assert "drawing 1" in errors[0] and "drawing 2" in errors[0] and "'click'" in errors[0]
        for e in errors:
            _one_sentence(e)
        _send(w, {"event": "click", "node": "d2n1"})
        assert events == [("d2n1", "encoder.layer.1")]
        _send(w, {"event": "click", "node": "d9n1"})  # a drawing that never existed: ignored too
        assert len(events) == 1 and "drawing 9" in errors[-1]
    finally:
        w.close()


# ------------------------------------------------------------------------------------ ScheduleEditor


@needs_dot
def test_editor_ignores_a_stale_token_sent_without_a_render_id(editor):
    errors = []
    editor._graph.on_error(errors.append)
    root = dict(editor._graph.node_ids)
    editor.open_level("encoder")  # another level: a new drawing with other nodes
    assert editor.level == "encoder" and editor.selected == "encoder"
    new = dict(editor._graph.node_ids)
    assert set(root).isdisjoint(new)  # tokens never repeat across drawings
    # a token of the root drawing whose position names a module in the new drawing (the old bug's
    # victim: positional tokens made it select that module)
    by_index = {_index(t): p for t, p in new.items()}
    stale = [
        t
        for t, p in root.items()
        if by_index.get(_index(t)) not in (None, p, editor.selected)
        and not by_index[_index(t)].startswith(".")
    ]
    assert stale, (root, new)
    before = (editor.selected, editor.level, editor._graph.selected, editor.code)
    for tok in stale:
        for event in ("click", "dblclick"):
            n = len(errors)
            editor._graph._on_browser_msg(editor._graph, {"event": event, "node": tok})
            assert (editor.selected, editor.level, editor._graph.selected, editor.code) == before, tok
            assert len(errors) == n + 1 and errors[-1].startswith("Ignored"), errors[n:]
            _one_sentence(errors[-1])
            assert "drawing" in errors[-1] and editor.message == errors[-1]
    # a token of the drawing shown now still selects its module (the folded layers: the first one)
    tok = next(t for t, p in new.items() if p == "encoder.layer.0-1")
    editor._graph._on_browser_msg(editor._graph, {"event": "click", "node": tok})
    assert editor.selected == "encoder.layer.0"
