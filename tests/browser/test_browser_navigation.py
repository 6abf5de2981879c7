"""Graph navigation in a real JupyterLab + headless Chromium (issue 17 item 5, Netron / Model Explorer).

One notebook: an 85-node GraphWidget (a level big enough for the minimap), a small BERT
ScheduleEditor, and filler output so that the notebook scrolls. Checked, in order:

1. the wheel over an *unfocused* graph scrolls the notebook and leaves the graph's transform alone;
2. a click gives the graph focus; then the wheel (deltaY and deltaX) pans: translate changes, scale
   does not, and the notebook does not scroll;
3. Ctrl+wheel zooms by a bounded factor (a 100-px notch: 1.1-1.2x; five small pinch events: < 1.1x);
4. "Fit" puts the whole drawing's bounding box inside the visible box;
5. the minimap exists for the 85-node level (not for the 5-node one) and a click on it moves the view;
6. search highlights and centres a node: ``GraphWidget.highlight`` on the big graph (far away node), and
   typing in the editor's search box (full paths in the results, one sentence for no match).

Screenshot: ``docs/screenshots/graph_navigation.png`` (the big graph after the search, minimap shown).
Run: ``source scripts/env.sh && .venv/bin/python -m pytest -q -s tests/browser/test_browser_navigation.py``.
"""

from __future__ import annotations

import contextlib
import re
import textwrap
import time

import harness
import pytest

pytestmark = pytest.mark.browser

REPO_ROOT = harness.REPO_ROOT
SCREENSHOT = REPO_ROOT / "docs" / "screenshots" / "graph_navigation.png"

BIG_GRAPH_CELL = textwrap.dedent(
    """
    import graphviz
    from slapo_lab.editor import GraphWidget

    g = graphviz.Digraph(graph_attr={"rankdir": "TB", "nodesep": "0.25", "ranksep": "0.3"},
                         node_attr={"shape": "box", "style": "rounded,filled", "fillcolor": "#e3f2fd",
                                    "fontname": "Helvetica", "fontsize": "12"})
    for i in range(85):  # five chains of 17 blocks: a level of 85 nodes
        g.node(f"m{i}", f"blocks.{i}\\nLinear", id=f"d1n{i}", tooltip=f"blocks.{i}")
        if i % 17:
            g.edge(f"m{i - 1}", f"m{i}")
    big = GraphWidget(svg=g.pipe(format="svg").decode(), node_ids={f"d1n{i}": f"blocks.{i}" for i in range(85)},
                      render_id=1, height="420px")
    big.add_class("slapo-test-big")
    big
    """
)

EDITOR_CELL = textwrap.dedent(
    """
    import torch
    import slapo_lab as sl
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                 intermediate_size=128, vocab_size=200, max_position_embeddings=64))
    editor = sl.ScheduleEditor(model, example_inputs={"input_ids": torch.randint(0, 200, (2, 16))},
                               world_size=2)
    editor.add_class("slapo-test-editor")
    editor
    """
)

FILLER_CELL = 'print("\\n".join(f"filler line {i}" for i in range(150)))'

BIG = ".slapo-test-big"
ED = ".slapo-test-editor"

# JS: the notebook's scroll container (the nearest scrollable ancestor of the big graph).
_SCROLLER = """() => {
  let e = document.querySelector('.slapo-test-big');
  while (e && !(e.scrollHeight > e.clientHeight + 10 && /(auto|scroll)/.test(getComputedStyle(e).overflowY))) {
    e = e.parentElement;
  }
  return e;
}"""


def _transform(page, root: str) -> tuple[float, float, float]:
    """(x, y, k) of the zoom layer of the graph under ``root``."""
    t = page.evaluate(
        "(root) => document.querySelector(root + ' .slapo-zoom-layer').getAttribute('transform') || ''", root
    )
    m = re.fullmatch(r"translate\(([-\d.e]+),([-\d.e]+)\) scale\(([-\d.e]+)\)", t)
    assert m, t
    return float(m.group(1)), float(m.group(2)), float(m.group(3))


def _scroll_top(page) -> float:
    return page.evaluate(f"() => ({_SCROLLER})().scrollTop")


def _empty_point(page, root: str) -> tuple[float, float]:
    """Client coordinates of a point in the graph box on no node, button or minimap."""
    return tuple(
        page.evaluate(
            """(root) => {
  const box = document.querySelector(root + ' .slapo-graph-box');
  const r = box.getBoundingClientRect();
  for (let fy = 0.1; fy < 0.95; fy += 0.05) {
    for (let fx = 0.05; fx < 0.95; fx += 0.05) {
      const x = r.left + fx * r.width, y = r.top + fy * r.height;
      const e = document.elementFromPoint(x, y);
      if (e && e.closest('.slapo-graph-canvas') && !e.closest('g.node')) return [x, y];
    }
  }
  throw new Error('no empty point in the graph');
}""",
            root,
        )
    )


def _node_offset(page, root: str, token: str) -> tuple[float, float]:
    """How far (CSS px) the centre of node ``token`` is from the centre of the graph's visible box."""
    return tuple(
        page.evaluate(
            """([root, token]) => {
  const c = document.querySelector(root + ' .slapo-graph-canvas').getBoundingClientRect();
  const n = document.querySelector(root + ' g.node#' + token).getBoundingClientRect();
  return [n.left + n.width / 2 - (c.left + c.width / 2), n.top + n.height / 2 - (c.top + c.height / 2)];
}""",
            [root, token],
        )
    )


def _kernel(page, code: str, timeout: float = 30.0) -> str:
    from test_browser_editor import _kernel_eval

    return _kernel_eval(page, code, timeout)


@pytest.mark.timeout(240)
def test_graph_navigation_in_jupyterlab(tmp_path):
    from browser_util import (
        browser_available,
        browser_page,
        jupyter_lab,
        notebook_errors,
        open_notebook,
        run_all_cells,
        server_log,
        write_notebook,
    )

    why = browser_available()
    if why:
        pytest.skip(why)
    nb_dir = tmp_path / "notebooks"
    write_notebook(nb_dir / "nav.ipynb", [BIG_GRAPH_CELL, EDITOR_CELL, FILLER_CELL], hide_input=True)
    t0 = time.monotonic()
    with (
        jupyter_lab(tmp_path, nb_dir) as (base_url, token),
        browser_page(tmp_path, width=1400, height=1000) as page,
    ):
        t_up = time.monotonic() - t0
        try:
            open_notebook(page, base_url, token, "nav.ipynb")
            run_all_cells(page)
            assert notebook_errors(page) == []
            t_run = time.monotonic() - t0 - t_up
            big = page.locator(BIG)
            big.locator("g.node#d1n84").wait_for(state="attached", timeout=30_000)
            big.scroll_into_view_if_needed()
            assert page.locator(f"{BIG} .slapo-graph-canvas g.node").count() == 85
            assert page.evaluate("() => document.querySelectorAll('#d1n5').length") == 1  # minimap: no ids

            # 1. unfocused: the wheel scrolls the notebook, the graph does not move
            page.evaluate("() => document.activeElement && document.activeElement.blur()")
            box = big.locator(".slapo-graph-box").bounding_box()
            page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
            before, top0 = _transform(page, BIG), _scroll_top(page)
            page.mouse.wheel(0, 200)
            page.wait_for_function(f"(t) => ({_SCROLLER})().scrollTop > t + 50", arg=top0, timeout=5_000)
            assert _transform(page, BIG) == before
            assert big.locator(".slapo-graph-hint").is_visible()  # "click the graph to pan ..."

            # 2. focused: the wheel pans (both axes), scale unchanged, the notebook stays
            big.scroll_into_view_if_needed()
            x, y = _empty_point(page, BIG)
            page.mouse.click(x, y)
            assert page.evaluate(
                "() => document.activeElement === document.querySelector('.slapo-test-big .slapo-graph-box')"
            )
            assert "slapo-focused" in big.locator(".slapo-graph-box").get_attribute("class")
            top1, (x0, y0, k0) = _scroll_top(page), _transform(page, BIG)
            page.mouse.wheel(0, 120)
            page.wait_for_function(
                "(y0) => !document.querySelector('.slapo-test-big .slapo-zoom-layer')"
                ".getAttribute('transform').includes(',' + y0 + ')')",
                arg=y0,
                timeout=5_000,
            )
            page.mouse.wheel(60, 0)  # a horizontal two-finger swipe
            page.wait_for_timeout(200)
            x1, y1, k1 = _transform(page, BIG)
            assert y1 < y0 and x1 < x0 and k1 == k0, ((x0, y0, k0), (x1, y1, k1))
            assert _scroll_top(page) == top1

            # 3. Ctrl+wheel zooms about the pointer by a bounded factor; a pinch's small steps gently
            page.keyboard.down("Control")
            page.mouse.wheel(0, -100)
            page.wait_for_timeout(200)
            k2 = _transform(page, BIG)[2]
            for _ in range(5):
                page.mouse.wheel(0, -3)
            page.wait_for_timeout(200)
            k3 = _transform(page, BIG)[2]
            page.keyboard.up("Control")
            assert 1.1 <= k2 / k1 <= 1.2, (k1, k2)
            assert 1.0 < k3 / k2 < 1.1, (k2, k3)
            assert _scroll_top(page) == top1

            # 4. Fit: the drawing's bounding box inside the visible box (before: it was not)
            def drawing_in_box() -> dict:
                return page.evaluate(
                    """() => {
  const c = document.querySelector('.slapo-test-big .slapo-graph-canvas').getBoundingClientRect();
  const d = document.querySelector('.slapo-test-big .slapo-zoom-layer').getBoundingClientRect();
  return {inside: d.left >= c.left - 1 && d.top >= c.top - 1 && d.right <= c.right + 1
                  && d.bottom <= c.bottom + 1, w: d.width, h: d.height, cw: c.width, ch: c.height};
}"""
                )

            assert not drawing_in_box()["inside"]
            big.locator(".slapo-graph-fit").click()
            fitted = drawing_in_box()
            assert fitted["inside"], fitted
            assert max(fitted["w"] / fitted["cw"], fitted["h"] / fitted["ch"]) > 0.8, fitted  # and fills it

            # 5. the minimap: shown for 85 nodes; a click in it moves the view there
            mini = big.locator(".slapo-graph-minimap")
            assert mini.is_visible()
            assert mini.locator("g.slapo-mini-node").count() == 85
            assert page.locator(f"{ED} .slapo-graph-minimap").is_hidden()  # 5 nodes: none
            page.keyboard.down("Control")  # zoom in (over the canvas) so that there is somewhere to go
            page.mouse.move(x, y)
            for _ in range(6):
                page.mouse.wheel(0, -100)
            page.keyboard.up("Control")
            page.wait_for_timeout(100)
            fx, fy, fk = _transform(page, BIG)
            mbox = mini.bounding_box()
            page.mouse.click(mbox["x"] + mbox["width"] * 0.9, mbox["y"] + mbox["height"] * 0.9)
            mx, my, mk = _transform(page, BIG)
            assert mk == fk and (mx, my) != (fx, fy)
            view = mini.locator(".slapo-minimap-view").bounding_box()
            assert view["height"] < mbox["height"] * 0.8  # the frame shows the zoomed-in part only

            # 6a. highlight + centre from the kernel: a node far from the view is centred
            _kernel(page, "big.highlight(['blocks.16', 'blocks.33'])")
            big.locator("g.node#d1n16.slapo-highlighted").wait_for(timeout=15_000)
            assert big.locator(".slapo-graph-canvas g.node.slapo-highlighted").count() == 2
            page.wait_for_function(
                """() => {
  const c = document.querySelector('.slapo-test-big .slapo-graph-canvas').getBoundingClientRect();
  const n = document.querySelector('.slapo-test-big g.node#d1n16').getBoundingClientRect();
  return Math.abs(n.left + n.width / 2 - c.left - c.width / 2) < 3
      && Math.abs(n.top + n.height / 2 - c.top - c.height / 2) < 3;
}""",
                timeout=10_000,
            )
            big.scroll_into_view_if_needed()
            page.wait_for_timeout(300)
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            big.locator(".slapo-graph-box").screenshot(path=str(SCREENSHOT))

            # 6b. the editor's search box: full paths, the graph node that holds the matches centred
            ed = page.locator(ED)
            ed.scroll_into_view_if_needed()
            ex, ey = _empty_point(page, ED)
            page.mouse.click(ex, ey)
            page.mouse.wheel(150, 150)  # pan the editor's graph away first
            page.wait_for_timeout(200)
            search = ed.locator("input[placeholder='search name or type']")
            search.fill("intermediate")
            search.press("Enter")
            ed.locator("g.node.slapo-highlighted").wait_for(timeout=30_000)
            tok = ed.locator(".slapo-graph-canvas g.node.slapo-highlighted").get_attribute("id")
            assert ed.locator(".slapo-graph-canvas g.node.slapo-highlighted").count() == 1
            page.wait_for_function(
                """(tok) => {
  const c = document.querySelector('.slapo-test-editor .slapo-graph-canvas').getBoundingClientRect();
  const n = document.querySelector('.slapo-test-editor g.node#' + tok).getBoundingClientRect();
  return Math.abs(n.left + n.width / 2 - c.left - c.width / 2) < 3
      && Math.abs(n.top + n.height / 2 - c.top - c.height / 2) < 3;
}""",
                arg=tok,
                timeout=10_000,
            )
            options = [o.replace("\xa0", " ").strip() for o in ed.locator("select option").all_inner_texts()]
            assert "encoder.layer.0.intermediate · BertIntermediate" in options, options
            assert "encoder" in ed.locator(f"g.node#{tok}").text_content()
            search.fill("xyz")
            search.press("Enter")
            ed.get_by_text("No module matches 'xyz'.").wait_for(timeout=30_000)
            assert ed.locator("g.node.slapo-highlighted").count() == 0
            assert notebook_errors(page) == []
            errors = [
                m for m in page.console_messages if m.startswith(("error", "pageerror")) and "slapo" in m
            ]
            assert errors == [], errors
        except Exception:
            with contextlib.suppress(Exception):
                page.screenshot(path=str(tmp_path / "failure.png"))
                print(f"failure screenshot: {tmp_path / 'failure.png'}")
            print("console:\n" + "\n".join(getattr(page, "console_messages", [])[-40:]))
            print("server log:\n" + server_log(tmp_path))
            raise
        t_checks = time.monotonic() - t0 - t_up - t_run
    print(f"\nserver+browser up {t_up:.1f} s, notebook open+run {t_run:.1f} s, checks {t_checks:.1f} s, "
          f"whole test {time.monotonic() - t0:.1f} s")  # fmt: skip
