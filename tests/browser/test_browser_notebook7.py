"""The ScheduleEditor in Notebook 7 (``jupyter notebook``), driven by headless Chromium.

Notebook 7 is built from JupyterLab's components and loads the same prebuilt labextensions (the
ipywidgets manager and slapo-lab's GraphWidget), so the editor has to work there too. A small BERT
notebook is opened at ``/notebooks/<name>``, all cells run, the graph SVG renders, a click on the
``encoder`` node selects it, *checkpoint* records ``sch["encoder"].checkpoint()`` in the code panel.
Screenshot: ``artifacts/editor_notebook7.png`` (git-ignored). Every wait is bounded; the server,
its kernels and the browser are ended on exit.
"""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.browser

NB_NAME = "editor_nb7.ipynb"


@pytest.mark.timeout(900)
def test_notebook7_click_to_checkpoint(tmp_path):
    from browser_util import (
        browser_available,
        browser_page,
        jupyter_server,
        notebook_errors,
        open_notebook,
        run_all_cells,
        save_screenshot,
        write_notebook,
    )
    from test_browser_editor import (
        SMALL_BERT_CELL,
        WAIT_UI,
        _button,
        _node,
        _report_failure,
        _wait_selected,
        _wait_text,
    )

    why = browser_available()
    if why:
        pytest.skip(why)
    nb_dir = tmp_path / "notebooks"
    write_notebook(nb_dir / NB_NAME, [SMALL_BERT_CELL])
    times: dict[str, float] = {}
    t0 = time.monotonic()
    with (
        jupyter_server(tmp_path, nb_dir, app="notebook", startup_timeout=180) as (base_url, token),
        browser_page(tmp_path, width=1500, height=2000, default_timeout_ms=60_000) as page,
    ):
        times["server + browser"] = time.monotonic() - t0
        try:
            t = time.monotonic()
            open_notebook(page, base_url, token, NB_NAME, timeout=180, app="notebook")
            # really Notebook 7's shell, not JupyterLab's
            assert page.evaluate("() => window.jupyterapp.name") == "Jupyter Notebook"
            times["open + kernel idle"] = time.monotonic() - t
            t = time.monotonic()
            run_all_cells(page, timeout=420)
            errors = notebook_errors(page)
            assert errors == [], "\n\n".join(errors)
            times["run all cells"] = time.monotonic() - t

            t = time.monotonic()
            editor = page.locator(".slapo-editor").first
            graph = editor.locator(".slapo-graph").first
            graph.locator("svg g.node").first.wait_for(state="visible", timeout=WAIT_UI)
            encoder = _node(graph, "encoder")
            encoder.wait_for(state="visible", timeout=WAIT_UI)
            times["graph rendered"] = time.monotonic() - t

            t = time.monotonic()
            encoder.click()
            _wait_selected(graph, "encoder")
            _button(editor, "checkpoint").click()
            code = _wait_text(editor.locator(".slapo-code"), 'sch["encoder"].checkpoint()')
            times["click + checkpoint"] = time.monotonic() - t
            assert 'sch["encoder"].checkpoint()' in code

            editor.scroll_into_view_if_needed()
            shot = save_screenshot(page, "editor_notebook7.png")
            print(f"\n[notebook7] screenshot: {shot}")
        except BaseException:
            _report_failure(page, tmp_path, "editor_notebook7_failure.png")
            raise
        t = time.monotonic()
    times["cleanup"] = time.monotonic() - t
    print("[notebook7] " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items()))
