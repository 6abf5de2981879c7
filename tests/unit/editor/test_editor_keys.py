"""Keyboard shortcuts, context menus and the panel, kernel side (issue 17 items 1-3).

The browser sends ``{"event": "action", "action": ..., "node"?: token, "render"?: id}`` through the
GraphWidget; these tests feed such messages to the widget as the comm would and check that the editor
runs the same methods as its buttons, that anything malformed is one sentence, what the
``action_reasons`` trait holds, and that ``editor.open()`` without a JupyterLab front end answers with
one sentence. Run: ``source scripts/env.sh && .venv/bin/python -m pytest -q tests/unit/editor/test_editor_keys.py``.
"""

from __future__ import annotations

import json

import harness
import ipywidgets as W
import pytest

from slapo_lab.editor.graph_widget import ACTIONS, GraphWidget

REPO = harness.REPO_ROOT
Q = "encoder.layer.0.attention.self.query"


def _msg(widget, content):
    widget._handle_msg({"content": {"data": {"method": "custom", "content": content}}, "buffers": []})


def _token(editor, path):
    for tok, p in editor._graph.node_ids.items():
        if p == path:
            return tok
    raise AssertionError(f"{path} not in graph nodes {sorted(editor._graph.node_ids.values())}")


def _act(editor, action, node=None, **extra):
    content = {"event": "action", "action": action, **extra}
    if node is not None:
        content["node"] = node
    _msg(editor._graph, content)


def _one_sentence(text: str) -> None:
    assert text and text.rstrip().endswith((".", "…")), text
    assert "Traceback" not in text and "\n" not in text, text


# ------------------------------------------------------------------------------------ messages → actions


def test_action_messages_run_the_buttons_methods(editor):
    _act(editor, "select", _token(editor, "encoder"))
    assert editor.selected == "encoder"
    _act(editor, "open")  # Enter on the tree: opens the selected module
    assert editor.level == "encoder"
    editor.select(Q)
    _act(editor, "checkpoint")
    _act(editor, "shard")  # the inspector's tensor/axis, as the shard button
    assert editor.code.splitlines() == [f'sch["{Q}"].checkpoint()', f'sch["{Q}"].shard("weight", axis=0)']
    why = editor._btn_sync.tooltip  # all_reduce after a column split: refused, as the button would be
    _act(editor, "sync")
    assert why and editor.message == why and len(editor.schedule.record.calls) == 2
    n = len(editor.schedule.record.calls)
    _act(editor, "undo")
    assert len(editor.schedule.record.calls) == n - 1
    _act(editor, "redo")
    assert len(editor.schedule.record.calls) == n


def test_actions_on_a_named_node_select_it_first(editor):
    editor.open_level("encoder.layer.0")
    tok = _token(editor, "encoder.layer.0.attention")
    _act(editor, "checkpoint", tok, render=editor._graph.render_id)
    assert editor.selected == "encoder.layer.0.attention"
    assert editor.code == 'sch["encoder.layer.0.attention"].checkpoint()'
    # the checkpoint redrew the graph: the old token is stale now, and refused in one sentence
    _act(editor, "open", tok, render=editor._graph.render_id - 1)
    assert "drawn before the last redraw" in editor.message and editor.level == "encoder.layer.0"
    # dblclick equivalent: open the node's level; Backspace: up again, the level we came from selected
    _act(editor, "open", _token(editor, "encoder.layer.0.attention"))
    assert editor.level == "encoder.layer.0.attention"
    _act(editor, "up")
    assert editor.level == "encoder.layer.0" and editor.selected == "encoder.layer.0.attention"


def test_cut_and_select_similar(editor):
    editor.open_level("encoder.layer")
    editor.select("encoder.layer.0")
    _act(editor, "cut")
    assert "cut_pipeline_stage" in editor.code
    editor.select("encoder.layer.0.attention.self.query")
    _act(editor, "similar")
    assert editor._similar.value is True
    assert "2 similar modules" in editor.message
    editor.select("embeddings")
    _act(editor, "similar")
    _one_sentence(editor.message)
    assert "no modules of the same type" in editor.message


def test_up_at_top_and_open_leaf_are_one_sentence(editor):
    calls = len(editor.schedule.record.calls)
    _act(editor, "up")
    _one_sentence(editor.message)
    assert "top level" in editor.message
    editor.select(Q)
    _act(editor, "open")
    _one_sentence(editor.message)
    assert "no submodules" in editor.message
    _act(editor, "undo")  # nothing to undo: the editor's own sentence
    _one_sentence(editor.message)
    assert len(editor.schedule.record.calls) == calls


@pytest.mark.parametrize(
    "content, part",
    [
        ({"event": "action"}, "without an 'action' field"),
        ({"event": "action", "action": "explode"}, "unknown action 'explode'"),
        ({"event": "action", "action": 3}, "unknown action 3"),
        ({"event": "action", "action": "select"}, "'select' action without a 'node'"),
        ({"event": "action", "action": "checkpoint", "node": 7}, "node is not a string"),
        ({"event": "action", "action": "checkpoint", "node": "nope"}, "not in the current graph"),
        ({"event": "action", "action": "checkpoint", "node": "d999n1"}, "of drawing 999"),
        (
            {"event": "action", "action": "checkpoint", "node": "x", "render": "1"},
            "render id is not an integer",
        ),
        ({"event": "panel", "opened": "yes"}, "'opened' is not true or false"),
        ({"event": "panel", "opened": True, "reason": 5}, "reason is not a string"),
        ({"event": "keypress"}, "unknown event 'keypress'"),
        (["action"], "not a JSON object"),
    ],
)
def test_malformed_action_messages_are_one_sentence(editor, content, part):
    calls = list(editor.schedule.record.calls)
    _msg(editor._graph, content)
    assert part in editor.message
    _one_sentence(editor.message)
    assert editor.schedule.record.calls == calls


def test_stale_render_id_is_refused(editor):
    tok = _token(editor, "encoder")
    _act(editor, "checkpoint", tok, render=editor._graph.render_id - 1)
    assert "drawn before the last redraw" in editor.message
    assert not editor.schedule.record.calls


def test_graph_widget_action_callbacks():
    w = GraphWidget(node_ids={"d0n1": "a"})
    seen, errors = [], []
    w.on_action(lambda *a: seen.append(a))
    w.on_error(errors.append)
    try:
        for action in ACTIONS:
            if action != "select":
                _msg(w, {"event": "action", "action": action})
        _msg(w, {"event": "action", "action": "select", "node": "d0n1", "render": 0})
        assert seen[:-1] == [(a, None, None) for a in ACTIONS if a != "select"]
        assert seen[-1] == ("select", "d0n1", "a")
        assert errors == []
    finally:
        w.close()


# ------------------------------------------------------------------------------------ reasons trait


def test_reasons_trait_follows_the_selection(editor):
    g = editor._graph
    editor.select(Q)
    assert g.action_target == Q
    reasons = g.action_reasons
    assert set(reasons) >= {"checkpoint", "cut", "shard", "sync", "open", "up", "similar"}
    assert all(isinstance(v, str) for v in reasons.values())
    assert reasons["checkpoint"] == "" and reasons["shard"] == ""
    assert reasons["open"] and "no submodules" in reasons["open"]
    assert reasons["up"] == ""  # the level is the query's parent
    assert g.action_labels["shard"] == "Shard weight on axis 0"
    assert "similar" in g.action_labels
    # the buttons' tooltips are the same reasons
    assert reasons["sync"] == editor._btn_sync.tooltip and reasons["cut"] == editor._btn_cut.tooltip
    editor.apply("checkpoint")
    _one_sentence(g.action_reasons["checkpoint"])  # checkpointing twice is refused with its reason
    editor.open_level("")
    editor.select("embeddings")
    assert g.action_target == "embeddings" and g.action_reasons["up"]


def test_reasons_reach_the_browser_state(editor):
    state = editor._graph.get_state()
    for trait in ("action_reasons", "action_labels", "action_target"):
        assert trait in state
    json.dumps(state["action_reasons"])


# ------------------------------------------------------------------------------------ the panel


def test_open_without_a_front_end_is_one_sentence(editor):
    before = editor.code
    out = editor.open()
    assert isinstance(out, str)
    _one_sentence(out)
    assert "front end" in out and "display the editor in a cell" in out
    assert editor.message == out and editor.code == before
    assert editor.open_panel() == out


def test_panel_view_reuses_the_same_children(editor):
    panel = editor.panel_view()
    assert panel is editor.panel_view()
    assert {"slapo-editor", "slapo-panel"} <= set(panel._dom_classes)

    def walk(w):
        yield w
        for c in getattr(w, "children", ()):
            yield from walk(c)

    inside = {id(w) for w in walk(panel)}
    for w in (
        editor._graph,
        editor._tree,
        editor._inspector,
        editor._message,
        editor._btn_undo,
        editor._btn_redo,
    ):
        assert id(w) in inside
    for w in (editor._preset, editor._btn_preset, editor._btn_export, editor._btn_verify, editor._code):
        assert id(w) in inside
    panes = [w for w in walk(panel) if isinstance(w, W.Accordion)]
    assert len(panes) == 1 and panes[0].selected_index is None  # memory and code collapsed
    assert editor._costs_box in panes[0].children
    # the preset controls are in the toolbar, not also in the panel's inspector column
    assert sum(w is editor._btn_preset for w in walk(panel)) == 1
    # the cell's view is unchanged
    assert editor._body in editor.children


def test_open_sends_the_request_when_a_front_end_exists(editor, monkeypatch):
    sent = []
    monkeypatch.setattr(type(editor._graph), "front_end_problem", lambda self: None)
    monkeypatch.setattr(editor._graph, "send", lambda content, buffers=None: sent.append(content))
    assert editor.open() is None
    assert sent == [{"cmd": "open_panel", "model_id": editor.panel_view().model_id}]
    _msg(editor._graph, {"event": "panel", "opened": True})
    assert "panel beside the notebook" in editor.message
    _msg(editor._graph, {"event": "panel", "opened": False, "reason": "No notebook panel to split."})
    assert editor.message == "No notebook panel to split."
    # the palette / context-menu entry asks the kernel, which sends the same request
    _act(editor, "panel")
    assert len(sent) == 2


def test_widget_construction_still_opens_the_comm(editor):
    # ipywidgets calls open() in Widget.__init__ to create the comm: the override must keep that
    assert editor.comm is not None and editor.model_id


# ------------------------------------------------------------------------------------ the schema


def test_shortcut_schema_and_package():
    pkg = json.loads((REPO / "package.json").read_text())
    assert pkg["jupyterlab"]["schemaDir"] == "labextension/schema"
    schema = json.loads((REPO / "labextension" / "schema" / "plugin.json").read_text())
    shortcuts = {s["command"]: s for s in schema["jupyter.lab.shortcuts"]}
    expected = {
        "slapo-lab:undo": ["Accel Z"],
        "slapo-lab:redo": ["Shift Accel Z"],
        "slapo-lab:checkpoint": ["C"],
        "slapo-lab:cut": ["P"],
        "slapo-lab:shard": ["S"],
        "slapo-lab:sync": ["Y"],
        "slapo-lab:open-level": ["Enter"],
        "slapo-lab:up": ["Backspace"],
        "slapo-lab:focus-search": ["/"],
        "slapo-lab:shortcuts": ["Shift /"],
    }
    for cmd, keys in expected.items():
        assert shortcuts[cmd]["keys"] == keys
    assert all(s["selector"] == ".slapo-editor" for s in shortcuts.values())
    src = (REPO / "labextension" / "src" / "editor.ts").read_text()
    for cmd in shortcuts:
        assert f"{cmd.split(':')[1]}" in src
