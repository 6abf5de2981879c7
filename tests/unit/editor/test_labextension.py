"""The graph widget: kernel side (simulated browser messages), installation, and a real browser.

Run: ``source scripts/env.sh && .venv/bin/python -m pytest -q tests/unit/editor/test_labextension.py``
(``-m "not browser"`` skips the JupyterLab + Chromium test).
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import harness
import pytest

from slapo_lab.editor import GraphWidget
from slapo_lab.editor.graph_widget import MODULE_NAME, MODULE_VERSION

REPO = harness.REPO_ROOT
NODE_IDS = {"n_embed": "embeddings", "n_enc": "encoder.layer.0", "n_head": "lm_head"}


def send(widget: GraphWidget, content) -> None:
    """Feed one custom message to the widget as the comm would deliver it from the browser."""
    widget._handle_msg({"content": {"data": {"method": "custom", "content": content}}, "buffers": []})


@pytest.fixture
def widget():
    w = GraphWidget(svg="<svg xmlns='http://www.w3.org/2000/svg'></svg>", node_ids=NODE_IDS)
    w.events, w.errors = [], []
    w.on_node_click(lambda tok, path: w.events.append(("click", tok, path)))
    w.on_node_dblclick(lambda tok, path: w.events.append(("dblclick", tok, path)))
    w.on_error(w.errors.append)
    yield w
    w.close()


# ------------------------------------------------------------------------------------ (a) kernel side


def test_traits_and_module():
    w = GraphWidget()
    try:
        assert (w._model_name, w._view_name) == ("GraphModel", "GraphView")
        assert w._model_module == w._view_module == MODULE_NAME == "slapo-lab"
        assert w._model_module_version == w._view_module_version == MODULE_VERSION
        assert (w.svg, w.selected, w.height, w.reset_view) == ("", "", "420px", 0)
        assert w.node_ids == {}
        state = w.get_state()
        for trait in ("svg", "selected", "height", "reset_view"):
            assert trait in state
        assert "node_ids" not in state  # kernel-only
    finally:
        w.close()


def test_module_version_matches_package_json():
    pkg = json.loads((REPO / "package.json").read_text())
    assert pkg["name"] == MODULE_NAME
    assert MODULE_VERSION == f"^{pkg['version']}"
    # package.json is the version's one home: pyproject.toml reads it (hatch's nodejs source), Python from metadata
    import slapo_lab

    assert slapo_lab.__version__ == pkg["version"]
    assert 'source = "nodejs"' in (REPO / "pyproject.toml").read_text()
    version_ts = (REPO / "labextension" / "src" / "version.ts").read_text()
    assert f"MODULE_VERSION = '{pkg['version']}'" in version_ts
    assert f"MODULE_NAME = '{MODULE_NAME}'" in version_ts


def test_click_and_dblclick_dispatch(widget):
    send(widget, {"event": "click", "node": "n_enc"})
    send(widget, {"event": "dblclick", "node": "n_head"})
    assert widget.events == [("click", "n_enc", "encoder.layer.0"), ("dblclick", "n_head", "lm_head")]
    assert widget.errors == []


def test_remove_callback(widget):
    seen = []

    def cb(tok, path):
        seen.append(tok)

    widget.on_node_click(cb)
    widget.on_node_click(cb, remove=True)
    send(widget, {"event": "click", "node": "n_enc"})
    assert seen == [] and len(widget.events) == 1


@pytest.mark.parametrize(
    "content, expected",
    [
        ({"event": "hover", "node": "n_enc"}, "unknown event 'hover'"),
        ({"node": "n_enc"}, "without an 'event' field"),
        ({"event": "click"}, "'click' message without a 'node' field"),
        ({"event": "dblclick", "node": 3}, "node is not a string (got int)"),
        ({"event": "click", "node": None}, "node is not a string (got NoneType)"),
        ({"event": "click", "node": "n_gone"}, "node 'n_gone', which is not in the current graph"),
        (["click", "n_enc"], "not a JSON object (got list)"),
        ("click", "not a JSON object (got str)"),
        ({"event": ["click"], "node": "n_enc"}, "unknown event ['click']"),
    ],
)
def test_malformed_messages_reported_not_raised(widget, content, expected):
    widget._on_browser_msg(widget, content, [])  # the on_msg handler itself never raises
    send(widget, content)  # and through the comm path
    assert widget.events == []
    assert len(widget.errors) == 2, widget.errors
    msg = widget.errors[0]
    assert expected in msg, msg
    assert msg.endswith(".") and msg.count(". ") == 0 and "\n" not in msg  # one sentence


def test_long_token_is_shortened(widget):
    send(widget, {"event": "click", "node": "x" * 5000})
    assert len(widget.errors) == 1 and len(widget.errors[0]) < 200


def test_node_ids_follow_set_graph(widget):
    widget.set_graph("<svg xmlns='http://www.w3.org/2000/svg'></svg>", {"n_new": "new.path"})
    send(widget, {"event": "click", "node": "n_enc"})
    send(widget, {"event": "click", "node": "n_new"})
    assert widget.events == [("click", "n_new", "new.path")]
    assert len(widget.errors) == 1 and "n_enc" in widget.errors[0]


def test_set_graph_reset_view_counter(widget):
    widget.set_graph("<svg/>", {}, reset_view=False)
    assert widget.reset_view == 0
    widget.set_graph("<svg/>", {}, reset_view=True)
    widget.reset_zoom()
    assert widget.reset_view == 2


def test_callback_exception_does_not_escape(widget, caplog):
    def boom(tok, path):
        raise RuntimeError("callback bug")

    widget.on_node_click(boom)
    widget._on_browser_msg(widget, {"event": "click", "node": "n_enc"}, [])
    send(widget, {"event": "click", "node": "n_enc"})
    # the other callback still ran both times; the error went to the log (a traceback in a notebook)
    assert widget.events == [("click", "n_enc", "encoder.layer.0")] * 2


def test_errors_without_callback_are_logged(caplog):
    w = GraphWidget(node_ids={})
    try:
        with caplog.at_level("WARNING", logger="slapo_lab.editor.graph_widget"):
            w._on_browser_msg(w, {"event": "click", "node": "a"}, [])
        assert "not in the current graph" in caplog.text
    finally:
        w.close()


def test_public_docstrings():
    for name in ("on_node_click", "on_node_dblclick", "on_error", "set_graph", "reset_zoom"):
        assert getattr(GraphWidget, name).__doc__, name
    assert GraphWidget.__doc__


# ------------------------------------------------------------------------------------ (b) installed


def test_labextension_listed_enabled():
    jupyter = Path(sys.executable).with_name("jupyter")
    cmd = [str(jupyter), "labextension", "list"] if jupyter.exists() else [
        sys.executable, "-m", "jupyterlab.labextensions", "list"]  # fmt: skip
    res = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)
    out = re.sub(r"\x1b\[[0-9;]*m", "", res.stdout + res.stderr)
    line = next((ln for ln in out.splitlines() if ln.strip().startswith("slapo-lab ")), None)
    assert line is not None, f"slapo-lab is not installed (run `pip install -e .`):\n{out}"
    assert re.search(r"slapo-lab v0\.1\.0\s+enabled\s+OK", line), line
    assert "@jupyter-widgets/jupyterlab-manager" in out


def test_installed_extension_files():
    share = Path(sys.prefix) / "share" / "jupyter" / "labextensions" / "slapo-lab"
    pkg = json.loads((share / "package.json").read_text())
    assert pkg["name"] == "slapo-lab"
    build = pkg["jupyterlab"]["_build"]
    assert (share / build["load"]).is_file()
    assert json.loads((share / "install.json").read_text())["packageName"] == "slapo-lab"
    # the widget base is shared with the widget manager, never bundled a second time
    assert pkg["jupyterlab"]["sharedPackages"]["@jupyter-widgets/base"] == {
        "bundled": False,
        "singleton": True,
    }


# ------------------------------------------------------------------------------------ (c) real browser

NOTEBOOK_CELL = textwrap.dedent(
    """
    import graphviz
    import ipywidgets as W
    from slapo_lab.editor import GraphWidget

    def make_svg(fill):
        g = graphviz.Digraph(graph_attr={"rankdir": "LR"}, node_attr={"shape": "box", "style": "filled"})
        g.node("embed", "embeddings", id="n_embed", tooltip="embeddings: Embedding(100, 16)", fillcolor=fill)
        g.node("enc", "encoder", id="n_enc", tooltip="encoder.layer.0", fillcolor="#ffe0b2")
        g.node("head", "lm_head", id="n_head", tooltip="lm_head: Linear(16, 100)", fillcolor="#c8e6c9")
        g.edge("embed", "enc")
        g.edge("enc", "head")
        return g.pipe(format="svg").decode()

    svg_a, svg_b = make_svg("#bbdefb"), make_svg("#ff8a80")
    gw = GraphWidget(svg=svg_a, node_ids=__NODE_IDS__, height="300px")
    log = W.Label("ready")
    log.add_class("slapo-test-log")
    errors = W.Label("")
    errors.add_class("slapo-test-errors")

    def clicked(tok, path):
        gw.selected = tok
        gw.svg = svg_b if gw.svg == svg_a else svg_a  # recolour only: the zoom must stay
        log.value = f"click {tok} {path}"

    def dblclicked(tok, path):
        gw.reset_zoom()
        log.value = f"dblclick {tok} {path}"

    gw.on_node_click(clicked)
    gw.on_node_dblclick(dblclicked)
    gw.on_error(lambda m: setattr(errors, "value", m))

    EVIL = (
        '<svg xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink" '
        'onload="window.__slapo_pwned=1" viewBox="0 0 120 30">'
        '<script>window.__slapo_pwned=2</script>'
        '<style>body { display: none }</style>'
        '<g class="node" id="evil" onclick="window.__slapo_pwned=3">'
        '<a xlink:href="javascript:window.__slapo_pwned=4" href="javascript:window.__slapo_pwned=5">'
        '<rect width="60" height="24" fill="#eeeeee" onmouseover="window.__slapo_pwned=6"/>'
        '<text x="6" y="16">evil</text></a></g>'
        '<foreignObject width="10" height="10"><iframe src="javascript:parent.__slapo_pwned=7"></iframe>'
        '</foreignObject><image href="nothing.png" onerror="window.__slapo_pwned=8"/></svg>'
    )
    evil = GraphWidget(svg=EVIL, height="80px")
    evil.add_class("slapo-test-evil")
    evil.on_error(lambda m: setattr(errors, "value", m))
    W.VBox([gw, log, errors, evil])
    """
).replace("__NODE_IDS__", repr(NODE_IDS))

LAYER = ".slapo-graph:not(.slapo-test-evil) .slapo-zoom-layer"
IDENTITY = "translate(0,0) scale(1)"


@pytest.mark.browser
@pytest.mark.timeout(300)
def test_graph_widget_in_real_browser(tmp_path):
    from browser_util import (
        browser_available,
        browser_page,
        cell_locator,
        jupyter_lab,
        notebook_errors,
        open_notebook,
        run_all_cells,
        save_screenshot,
        server_log,
        write_notebook,
    )

    why = browser_available()
    if why:
        pytest.skip(why)
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    nb_dir = tmp_path / "notebooks"
    write_notebook(nb_dir / "graph_widget.ipynb", [NOTEBOOK_CELL], hide_input=True)
    t0 = time.monotonic()
    with jupyter_lab(tmp_path, nb_dir) as (base_url, token), browser_page(tmp_path) as page:
        t_server = time.monotonic() - t0
        try:
            open_notebook(page, base_url, token, "graph_widget.ipynb")
            run_all_cells(page)
            t_run = time.monotonic() - t0 - t_server
            assert notebook_errors(page) == []
            cell = cell_locator(page, 0)
            graph = cell.locator(".slapo-graph").first
            try:
                graph.locator("g.node#n_enc").wait_for(state="visible", timeout=30_000)
            except PlaywrightTimeout:
                raise AssertionError(f"the graph did not render; cell output:\n{cell.inner_text()}") from None
            layer = page.locator(LAYER)
            log = cell.locator(".slapo-test-log")
            errors = cell.locator(".slapo-test-errors")
            assert layer.get_attribute("transform") == IDENTITY
            height = graph.locator(".slapo-graph-box").evaluate("e => e.getBoundingClientRect().height")
            assert abs(height - 300) < 2, height  # the height trait
            # three nodes, graphviz ids kept; no native tooltips left
            assert graph.locator("g.node").count() == 3
            assert graph.locator("title").count() == 0

            # zoom with Ctrl+wheel (the plain wheel pans, and only a focused graph: test_browser_navigation.py)
            graph.scroll_into_view_if_needed()
            box = graph.bounding_box()
            page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
            page.keyboard.down("Control")
            page.mouse.wheel(0, -150)  # a mild zoom: every node stays in the box
            page.keyboard.up("Control")
            page.wait_for_function(
                f"() => document.querySelector('{LAYER}').getAttribute('transform') !== '{IDENTITY}'"
            )
            zoomed = layer.get_attribute("transform")

            # click: the kernel callback selects the node and recolours the graph
            t_click = time.monotonic()
            graph.locator("g.node#n_head").click()
            log.get_by_text("click n_head lm_head").wait_for(timeout=15_000)
            t_click = time.monotonic() - t_click
            graph.locator("g.node#n_head.slapo-selected").wait_for(timeout=10_000)
            graph.locator("g.node#n_embed polygon[fill='#ff8a80']").wait_for(timeout=10_000)
            assert graph.locator("g.node.slapo-selected").count() == 1
            assert page.locator(LAYER).get_attribute("transform") == zoomed  # kept across the re-render
            # the selection is a halo (a CSS filter); the border keeps its own meaning (issue 11)
            halo = graph.locator("g.node#n_head").evaluate("e => getComputedStyle(e).filter")
            assert "drop-shadow" in halo, halo

            # hover tooltip from the graphviz tooltip attribute
            graph.locator("g.node#n_enc").hover()
            tip = graph.locator(".slapo-graph-tooltip")
            tip.wait_for(state="visible", timeout=5_000)
            assert tip.inner_text() == "encoder.layer.0"

            # double click: the kernel resets the zoom
            graph.locator("g.node#n_enc").dblclick()
            log.get_by_text("dblclick n_enc encoder.layer.0").wait_for(timeout=15_000)
            page.wait_for_function(
                f"() => document.querySelector('{LAYER}').getAttribute('transform') === '{IDENTITY}'"
            )
            assert errors.inner_text().strip() == ""
            save_screenshot(cell, "labextension_graph_widget.png")

            # theme variables: the dark theme restyles the box and the default-black edges
            def colours():
                return graph.evaluate(
                    """el => [getComputedStyle(el.querySelector('.slapo-graph-box')).backgroundColor,
                              getComputedStyle(el.querySelector('g.edge path')).stroke]"""
                )

            light = colours()
            page.evaluate(
                "() => window.jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Dark'})"
            )
            page.wait_for_function("() => document.body.dataset.jpThemeLight === 'false'", timeout=15_000)
            page.wait_for_function(
                "(light) => { const el = document.querySelector('.slapo-graph:not(.slapo-test-evil) .slapo-graph-box');"
                " return getComputedStyle(el).backgroundColor !== light; }",
                arg=light[0],
                timeout=15_000,
            )
            dark = colours()
            assert dark[0] != light[0] and dark[1] != light[1], (light, dark)
            save_screenshot(cell, "labextension_graph_widget_dark.png")

            # sanitising: nothing active survived; a click on an unknown node reaches on_error
            evil = cell.locator(".slapo-test-evil")
            evil.locator("g.node#evil").wait_for(state="visible", timeout=10_000)
            report = evil.evaluate(
                """el => {
                  const all = [el, ...el.querySelectorAll('*')];
                  return {
                    tags: [...el.querySelectorAll('script, style, foreignObject, iframe, image')].map(e => e.tagName),
                    handlers: all.flatMap(e => [...e.attributes].map(a => a.name).filter(n => n.startsWith('on'))),
                    hrefs: all.filter(e => e.hasAttribute('href') || e.hasAttribute('xlink:href')).length,
                    bodyShown: getComputedStyle(document.body).display !== 'none',
                  };
                }"""
            )
            assert report == {"tags": [], "handlers": [], "hrefs": 0, "bodyShown": True}, report
            evil.locator("g.node#evil").click()
            errors.get_by_text("which is not in the current graph").wait_for(timeout=15_000)
            assert page.evaluate("() => window.__slapo_pwned") is None
            assert notebook_errors(page) == []
            t_body = time.monotonic()
        except Exception:
            with contextlib.suppress(Exception):
                save_screenshot(page, "labextension_graph_widget_failure.png")
            print("console:\n" + "\n".join(getattr(page, "console_messages", [])[-40:]))
            print("server log:\n" + server_log(tmp_path))
            raise
    t_end = time.monotonic()
    print(f"\nserver+browser up {t_server:.1f} s, notebook open+run {t_run:.1f} s, click round trip "
          f"{t_click:.2f} s, checks {t_body - t_run - t0 - t_server:.1f} s, cleanup {t_end - t_body:.1f} s, "
          f"whole test {t_end - t0:.1f} s")  # fmt: skip
