"""The editor as its own JupyterLab panel, keyboard-first, with context menus (issue 17 items 1-3).

A real JupyterLab (1280×800) in headless Chromium, driven by clicks and keys only (the kernel is read, never
driven, from the test):

1. ``editor.open()`` in a cell opens the editor as a main-area panel split to the right of the notebook:
   full height, the toolbar (Undo, Redo, preset, Export, Verify) and the message line visible; the cell's
   view stays;
2. keys on the inline editor: ``c`` checkpoints, Ctrl+Z / Shift+Ctrl+Z undo and redo (the recorded calls
   change) and the notebook's cells do NOT move (``d d``, ``x``, arrows and Ctrl+Z never reach the notebook);
3. keys in the panel: arrows walk the graph, Enter opens a level, Backspace goes up;
4. right-click on a graph node: the context menu (the top-level's "Up one level" disabled with its reason);
   its Checkpoint records the call; right-click on a tree row: that module's menu (its Shard disabled, why);
5. ``?`` shows the shortcut list.

Screenshots: ``docs/screenshots/editor_panel_1280x800.png``, ``editor_context_menu.png``,
``editor_shortcuts.png``. Run: ``source scripts/env.sh && .venv/bin/python -m pytest -q -s
tests/browser/test_browser_panel_keys.py``.
"""

from __future__ import annotations

import re
import textwrap
import time

import harness
import pytest

pytestmark = pytest.mark.browser

REPO_ROOT = harness.REPO_ROOT
SHOTS = REPO_ROOT / "docs" / "screenshots"
WAIT = 60_000

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
    editor
    """
)
OPEN_CELL = "editor.open()"
LAST_CELL = "answer = 42"

# JS: the current notebook's cells as (type, source), and the active cell index.
_CELLS_JS = """() => {
  const w = window.jupyterapp.shell.widgets('main');
  for (const x of w) {
    if (x.content && x.content.widgets && x.sessionContext) {
      return {cells: x.content.widgets.map(c => c.model.sharedModel.getSource()), active: x.content.activeCellIndex};
    }
  }
  return null;
}"""


def _node(scope, label: str):
    pattern = re.compile(rf"^\s*{re.escape(label)}\s*$")
    return scope.locator("g.node").filter(has=scope.page.locator("css=text").filter(has_text=pattern))


def _selected_label(graph) -> str:
    texts = graph.locator("g.node.slapo-selected text").all_text_contents()
    return texts[0].strip() if texts else ""


# JS: run CODE in the kernel of the notebook (found among the main-area widgets: the editor panel may be the
# current one), return its text output.
_KERNEL_JS = """async (code) => {
  let nb = null;
  for (const x of window.jupyterapp.shell.widgets('main')) {
    if (x.content && x.content.widgets && x.sessionContext) { nb = x; break; }
  }
  const k = nb && nb.sessionContext.session && nb.sessionContext.session.kernel;
  if (!k) return '(no kernel)';
  const fut = k.requestExecute({code, silent: false, store_history: false});
  let out = '';
  fut.onIOPub = (msg) => {
    const t = msg.header.msg_type, c = msg.content;
    if (t === 'stream') out += c.text;
    else if (t === 'error') out += `${c.ename}: ${c.evalue}\\n`;
  };
  await Promise.race([fut.done, new Promise((_, no) => setTimeout(() => no(new Error('kernel timeout')), 30000))]);
  return out;
}"""


def _kernel_eval(page, code: str) -> str:
    return page.evaluate(_KERNEL_JS, code)


def _code(page) -> str:
    # under the editor's lock: a click's action runs in the comm thread and redraws before it lets go
    return _kernel_eval(page, "with editor._lock: print(editor.code)").strip()


def _wait_code(page, predicate, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    code = _code(page)
    while not predicate(code) and time.monotonic() < deadline:
        time.sleep(0.3)
        code = _code(page)
    return code


def _wait_drawn(page, graph, timeout: float = 30.0) -> None:
    """Wait until ``graph`` shows the kernel's current drawing (its node tokens are ``d<render_id>n<i>``)."""
    out = _kernel_eval(page, "with editor._lock: print(f'RID={editor._graph.render_id}')")
    found = re.findall(r"RID=(\d+)", out)
    assert found, out
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:  # this drawing or a later one (background work may redraw meanwhile)
        handle = graph.element_handle(timeout=timeout * 1000)
        page.wait_for_function(_DRAWN_JS, arg=[handle, int(found[-1])], timeout=timeout * 1000)
    except PlaywrightTimeout:
        # one line that CI's summary keeps: what each graph view shows, and the page's last errors
        shown = page.evaluate(_DRAWINGS_JS)
        errors = [m for m in getattr(page, "console_messages", []) if m.startswith(("error", "pageerror"))]
        raise AssertionError(
            f"drawing {found[-1]} not shown after {timeout:.0f} s; views show {shown}; errors: {errors[-5:]}"
        ) from None


# JS: rebind COMMAND to Alt+K as the Settings editor does (JupyterLab's shortcuts settings, user layer)
# (through JupyterLab's setting registry: the shortcuts plugin listens to it and rebinds at once)
_REBIND_JS = """async (command) => {
  const app = window.jupyterapp;
  const services = app.pluginRegistry._services; // token -> plugin id (JupyterLab 4.4)
  const token = Array.from(services.keys()).find(t => t.name === '@jupyterlab/coreutils:ISettingRegistry');
  const registry = await app.resolveRequiredService(token);
  await registry.set('@jupyterlab/shortcuts-extension:shortcuts', 'shortcuts',
                     [{command, keys: ['Alt K'], selector: '.slapo-editor'}]);
}"""

# JS: whether graph element G shows drawing RID or a later one (node ids are d<render id>n<i>)
_DRAWN_JS = """([g, rid]) => {
  const n = g.querySelector('g.node[id]');
  const m = n && /^d(\\d+)n/.exec(n.id);
  return !!m && Number(m[1]) >= rid;
}"""

# JS: the drawing (render id) each graph view on the page shows, and its message line
_DRAWINGS_JS = """() => Array.from(document.querySelectorAll('.slapo-graph')).map((g) => {
  const n = g.querySelector('g.node[id]');
  const where = g.closest('.slapo-panel-host') ? 'panel' : 'cell';
  const msg = g.querySelector('.slapo-graph-message');
  return `${where}:${n ? n.id.replace(/n\\d+$/, '') : 'none'}${msg && msg.textContent ? ' (' + msg.textContent + ')' : ''}`;
}).join(', ')"""


@pytest.mark.timeout(300)
def test_panel_keys_and_context_menu(tmp_path):
    from browser_util import (
        browser_available,
        browser_page,
        jupyter_lab,
        notebook_errors,
        open_notebook,
        run_all_cells,
        write_notebook,
    )
    from playwright.sync_api import expect
    from test_browser_editor import _report_failure

    why = browser_available()
    if why:
        pytest.skip(why)
    SHOTS.mkdir(parents=True, exist_ok=True)
    nb_dir = tmp_path / "nb"
    write_notebook(nb_dir / "panel.ipynb", [EDITOR_CELL, OPEN_CELL, LAST_CELL], hide_input=True)
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    with (
        jupyter_lab(tmp_path, nb_dir) as (base_url, token),
        browser_page(tmp_path, width=1280, height=800) as page,
    ):
        try:
            open_notebook(page, base_url, token, "panel.ipynb", reset=True)
            timings["lab open"] = time.monotonic() - t0
            # close the file browser (Ctrl+B, JupyterLab's own key): the notebook and the panel share the width
            page.locator(".jp-NotebookPanel").first.click(position={"x": 400, "y": 8})
            page.keyboard.press("Control+b")
            t = time.monotonic()
            run_all_cells(page)
            timings["run cells"] = time.monotonic() - t
            assert notebook_errors(page) == []

            # ---- 1. the panel, beside the notebook, full height, toolbar and message visible
            host = page.locator(".slapo-panel-host")
            expect(host).to_be_visible(timeout=WAIT)
            panel = host.locator(".slapo-editor.slapo-panel")
            pgraph = panel.locator(".slapo-graph").first
            _node(pgraph, "encoder").wait_for(state="visible", timeout=WAIT)
            nb_box = page.locator(".jp-NotebookPanel").first.bounding_box()
            host_box = host.bounding_box()
            assert host_box["x"] >= nb_box["x"] + nb_box["width"] - 2, (nb_box, host_box)  # split right
            assert host_box["height"] > 600, host_box  # full height of the main area at 800 px
            toolbar = panel.locator(".slapo-toolbar")
            for name in ("Undo", "Redo", "apply preset", "Export", "Verify on GPU"):
                expect(toolbar.locator("button").filter(has_text=name).first).to_be_in_viewport()
            msg = panel.locator(".slapo-msg")
            expect(msg).to_contain_text("panel beside the notebook", timeout=WAIT)
            expect(msg).to_be_in_viewport()
            # resizable: drag the split between the notebook and the panel 260 px to the left
            handle = page.locator(".lm-DockPanel-handle[data-orientation='horizontal']").filter(
                has_not=page.locator("css=.lm-mod-hidden")
            )
            hx = [
                b
                for b in (h.bounding_box() for h in handle.all())
                if b and b["width"] > 0 and b["height"] > 100
            ]
            hx = min(hx, key=lambda b: abs(b["x"] - host_box["x"]))
            page.mouse.move(hx["x"] + hx["width"] / 2, hx["y"] + hx["height"] / 2)
            page.mouse.down()
            page.mouse.move(hx["x"] - 260, hx["y"] + hx["height"] / 2, steps=8)
            page.mouse.up()
            wider = host.bounding_box()
            assert wider["width"] > host_box["width"] + 200, (host_box, wider)
            gbox = pgraph.locator(".slapo-graph-box").bounding_box()
            assert gbox["height"] > 300 and gbox["width"] > 300, gbox  # the graph fills the panel
            inline = page.locator(".jp-NotebookPanel .slapo-editor").first
            expect(inline.locator(".slapo-graph g.node").first).to_be_attached()  # the cell's view stays
            page.screenshot(path=str(SHOTS / "editor_panel_1280x800.png"))

            # ---- 2. keys on the inline editor never reach the notebook
            igraph = inline.locator(".slapo-graph").first
            _node(igraph, "pooler").scroll_into_view_if_needed()
            _node(igraph, "pooler").click()  # the click makes the editor's cell the active one
            expect(igraph.locator("g.node.slapo-selected")).to_contain_text("pooler", timeout=WAIT)
            before = page.evaluate(_CELLS_JS)
            t = time.monotonic()
            page.keyboard.press("c")
            code = _wait_code(page, lambda c: "checkpoint" in c)
            assert code == 'sch["pooler"].checkpoint()', code
            timings["key c → recorded"] = time.monotonic() - t
            page.keyboard.press("Control+z")
            code = _wait_code(page, lambda c: "checkpoint" not in c)
            assert "checkpoint" not in code, code
            page.keyboard.press("Control+Shift+z")
            code = _wait_code(page, lambda c: "checkpoint" in c)
            assert code == 'sch["pooler"].checkpoint()', code
            for key in ("d", "d", "x", "ArrowDown", "ArrowUp", "z"):  # the notebook's command-mode keys
                page.keyboard.press(key)
            after = page.evaluate(_CELLS_JS)
            assert after == before, (before, after)  # no cell deleted, cut, moved or undone
            # Ctrl+Z once more on the editor: undoes the redo, not a notebook action
            page.keyboard.press("Control+z")
            assert "checkpoint" not in _wait_code(page, lambda c: "checkpoint" not in c)
            assert page.evaluate(_CELLS_JS) == before
            _wait_drawn(page, pgraph)  # the panel shows the redrawn graph before it is clicked

            # ---- 3. arrows, Enter and Backspace in the panel
            _node(pgraph, "embeddings").click()
            expect(pgraph.locator("g.node.slapo-selected")).to_contain_text("embeddings", timeout=WAIT)
            page.keyboard.press("ArrowDown")  # the next node below (dataflow runs top to bottom)
            expect(pgraph.locator("g.node.slapo-selected")).to_contain_text("encoder", timeout=WAIT)
            page.keyboard.press("Enter")  # = double click: open the encoder's level
            _node(pgraph, "BertLayer × 2").wait_for(state="visible", timeout=WAIT)
            page.keyboard.press("Backspace")  # up again, the encoder selected
            _node(pgraph, "pooler").wait_for(state="visible", timeout=WAIT)
            expect(pgraph.locator("g.node.slapo-selected")).to_contain_text("encoder", timeout=WAIT)
            page.keyboard.press("ArrowUp")
            expect(pgraph.locator("g.node.slapo-selected")).to_contain_text("embeddings", timeout=WAIT)
            assert page.evaluate(_CELLS_JS) == before

            # ---- 4. the context menu of a graph node
            t = time.monotonic()
            _node(pgraph, "embeddings").click(button="right")
            menu = page.locator(".lm-Menu.slapo-context-menu")
            expect(menu).to_be_visible(timeout=WAIT)
            timings["right click → menu"] = time.monotonic() - t
            items = menu.locator(".lm-Menu-item")
            up = items.filter(has_text="Up one level")
            expect(up).to_have_class(re.compile(r"lm-mod-disabled"))
            expect(up).to_contain_text("top level")  # the one-sentence reason, in the item
            ckpt = items.filter(has_text=re.compile(r"^\s*Checkpoint"))
            expect(ckpt).not_to_have_class(re.compile(r"lm-mod-disabled"))
            assert page.locator(".lm-Menu:not(.slapo-context-menu)").count() == 0  # not the notebook's menu
            page.screenshot(path=str(SHOTS / "editor_context_menu.png"))
            ckpt.click()
            code = _wait_code(page, lambda c: 'sch["embeddings"].checkpoint()' in c)
            assert 'sch["embeddings"].checkpoint()' in code, code
            expect(menu).to_have_count(0)

            # ---- 4b. the context menu of a tree row: the row is selected first, its reasons then shown
            _wait_drawn(page, pgraph)
            row = panel.locator(".slapo-tree option").filter(has_text="pooler · BertPooler").first
            row.evaluate("o => o.scrollIntoView({block: 'center'})")
            rb = row.bounding_box()
            assert rb and rb["height"] > 0, rb
            page.mouse.click(rb["x"] + 30, rb["y"] + rb["height"] / 2, button="right")
            expect(menu).to_be_visible(timeout=WAIT)
            expect(pgraph.locator("g.node.slapo-selected")).to_contain_text("pooler", timeout=WAIT)
            shard = menu.locator(".lm-Menu-item[data-command='slapo-lab:shard']")
            expect(shard).to_have_class(re.compile(r"lm-mod-disabled"))
            expect(shard).to_contain_text("no parameters of its own")  # pooler's own reason, not embeddings'
            page.keyboard.press("Escape")
            expect(menu).to_have_count(0)
            # the tree shows pooler's children now that it is selected; a row's tooltip is its full path
            child = panel.locator(".slapo-tree option").filter(has_text="dense · Linear").first
            expect(child).to_be_attached(timeout=WAIT)
            child.evaluate("o => o.scrollIntoView({block: 'center'})")
            child.hover()
            expect(child).to_have_attribute("title", "pooler.dense · Linear")

            # ---- 5. the shortcut list on "?"
            _wait_drawn(page, pgraph)
            _node(pgraph, "pooler").click()
            expect(panel.locator(".slapo-msg.slapo-err")).to_have_count(0)
            page.keyboard.press("Shift+Slash")
            dialog = page.locator(".jp-Dialog .slapo-shortcuts")
            expect(dialog).to_be_visible(timeout=WAIT)
            for text in ("Undo", "Checkpoint", "Ctrl+Z", "Backspace"):
                expect(dialog).to_contain_text(text)
            page.screenshot(path=str(SHOTS / "editor_shortcuts.png"))
            page.keyboard.press("Escape")
            expect(dialog).to_have_count(0)
            assert page.evaluate(_CELLS_JS) == before

            # ---- 6. Export… in the toolbar opens the Export pane, whose Export button is the panel's only one
            toolbar.locator("button").filter(has_text="Export…").click()
            form = panel.locator(".slapo-export")
            expect(form).to_be_visible(timeout=WAIT)
            exports = panel.locator("button:visible").filter(has_text=re.compile(r"^\s*Export\s*$"))
            expect(exports).to_have_count(1)
            expect(form.locator("button").filter(has_text=re.compile(r"^\s*Export\s*$"))).to_be_visible()

            # ---- 7. a key rebound in Settings (what the Settings editor saves): Alt+K checkpoints from now on
            page.evaluate(_REBIND_JS, "slapo-lab:checkpoint")
            page.wait_for_function(
                "() => window.jupyterapp.commands.keyBindings.some("
                "b => b.command === 'slapo-lab:checkpoint' && b.keys.join(' ') === 'Alt K')",
                timeout=WAIT,
            )
            _wait_drawn(page, pgraph)
            _node(pgraph, "pooler").click()
            expect(pgraph.locator("g.node.slapo-selected")).to_contain_text("pooler", timeout=WAIT)
            page.keyboard.press("Alt+k")
            code = _wait_code(page, lambda c: 'sch["pooler"].checkpoint()' in c)
            assert 'sch["pooler"].checkpoint()' in code, code
            assert page.evaluate(_CELLS_JS) == before
            assert not [m for m in page.console_messages if "pageerror" in m]
        except Exception:
            _report_failure(page, tmp_path, "panel_keys_failure.png")
            raise
        finally:
            print(
                "timings:",
                {k: round(v, 1) for k, v in timings.items()},
                "total",
                round(time.monotonic() - t0, 1),
            )
