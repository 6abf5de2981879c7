"""The ScheduleEditor in a real JupyterLab, driven by headless Chromium (issues 2 and 6).

1. ``notebooks/quickstart.ipynb`` as shipped: run all cells, click into the graph (encoder →
   the folded ``BertLayer × 4`` → ``layer.2``), press *checkpoint*, read the call in the code panel.
2. A small BERT notebook: expand a folded block by double-click, apply a preset, Undo, Export,
   Verify (CPU/gloo without CUDA), and screenshots of the editor in the light and dark themes.

One JupyterLab server and one browser serve both tests (module fixture); every wait is bounded and
a failure prints the editor's message line, code panel and Verify log, the kernel-side state, the
notebook's stream output, the browser console and the server log. Screenshots land in
``artifacts/`` (git-ignored): ``editor_quickstart.png``, ``editor_light.png``, ``editor_dark.png``.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import textwrap
import time
from pathlib import Path

import harness
import pytest

pytestmark = pytest.mark.browser

REPO_ROOT = harness.REPO_ROOT
QUICKSTART = REPO_ROOT / "notebooks" / "quickstart.ipynb"

SMALL_BERT_CELL = textwrap.dedent(
    """
    import torch
    import slapo_lab as sl
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                 intermediate_size=128, vocab_size=200, max_position_embeddings=64))
    ids = torch.randint(0, 200, (2, 16))
    editor = sl.ScheduleEditor(model, example_inputs={"input_ids": ids}, world_size=2)
    editor
    """
)

# Kernel-side state printed when a test fails (every notebook here names its editor ``editor``).
KERNEL_STATE = textwrap.dedent(
    """
    try:
        print("editor.message:", editor.message)
        print("editor.level:", repr(editor.level), "selected:", repr(editor.selected),
              "expanded:", sorted(editor.expanded))
        import threading
        print("numeric check:", editor.numeric_report, "|", editor._numeric_box.value[:300])
        print("threads:", [t.name for t in threading.enumerate()])
        print("editor.code:\\n" + editor.code)
        print("verify log tail:\\n" + "\\n".join(editor._log_lines[-30:]))
    except Exception as err:
        print("no editor state:", type(err).__name__, err)
    """
)

WAIT_UI = 60_000  # ms: a kernel round trip that redraws the editor (heavily loaded 2-core machine)


# ------------------------------------------------------------------------------------ helpers


def _kernel_eval(page, code: str, timeout: float = 30.0) -> str:
    """Run ``code`` in the current notebook's kernel (no cell); return its text output."""
    from browser_util import _js_with_timeout

    body = """
      const k = nb.sessionContext.session && nb.sessionContext.session.kernel;
      if (!k) return '(no kernel)';
      const fut = k.requestExecute({code: CODE, silent: false, store_history: false});
      let out = '';
      fut.onIOPub = (msg) => {
        const t = msg.header.msg_type, c = msg.content;
        if (t === 'stream') out += c.text;
        else if (t === 'error') out += `${c.ename}: ${c.evalue}\\n`;
        else if (t === 'execute_result') out += (c.data['text/plain'] || '') + '\\n';
      };
      await fut.done;
      return out;
    """
    return page.evaluate(
        _js_with_timeout(body.replace("CODE", "code"), timeout).replace("async () =>", "async (code) =>", 1),
        code,
    )


def _notebook_streams(page, limit: int = 3000) -> str:
    """The tail of every stream / error output of the current notebook (the kernel's printed text)."""
    from browser_util import _CURRENT_NB

    text = page.evaluate(
        f"""() => {{
  const nb = ({_CURRENT_NB})();
  if (!nb) return '(no notebook panel)';
  let out = '';
  nb.content.widgets.forEach((cell, i) => {{
    const outputs = cell.model.outputs;
    if (!outputs) return;
    for (let j = 0; j < outputs.length; j++) {{
      const o = outputs.get(j).toJSON();
      if (o.output_type === 'stream') out += `[cell ${{i}} ${{o.name}}] ` + [].concat(o.text).join('');
      if (o.output_type === 'error') out += `[cell ${{i}} error] ${{o.ename}}: ${{o.evalue}}\\n`;
    }}
  }});
  return out.replace(/\\u001b\\[[0-9;]*m/g, '');
}}"""
    )
    return text[-limit:]


def _text(locator, timeout: float = 2_000) -> str:
    with contextlib.suppress(Exception):
        return locator.first.inner_text(timeout=timeout)
    return "(not found)"


def _report_failure(page, tmp_path: Path, shot: str) -> None:
    """Print everything that helps to understand a failed browser step."""
    from browser_util import save_screenshot, server_log

    with contextlib.suppress(Exception):
        print(f"failure screenshot: {save_screenshot(page, shot)}")
    editor = page.locator(".slapo-editor")
    print("message line:", _text(editor.locator(".slapo-msg")))
    print("code panel:\n" + _text(editor.locator(".slapo-code")))
    print("verify log:\n" + _text(editor.locator(".slapo-log"))[-3000:])
    with contextlib.suppress(Exception):
        print("graph nodes:", editor.locator(".slapo-graph g.node").all_text_contents())
    from playwright.sync_api import Error as PlaywrightError

    try:
        print("kernel state:\n" + _kernel_eval(page, KERNEL_STATE, timeout=30))
    except PlaywrightError as err:
        print(f"kernel state unavailable: {err}")
    with contextlib.suppress(Exception):
        print("notebook output:\n" + _notebook_streams(page))
    print("console:\n" + "\n".join(getattr(page, "console_messages", [])[-40:]))
    print("server log:\n" + server_log(tmp_path))


def _node(graph, label: str | re.Pattern):
    """Locator of the graph node with a text line that is exactly ``label`` (or matches the pattern)."""
    pattern = label if isinstance(label, re.Pattern) else re.compile(rf"^\s*{re.escape(label)}\s*$")
    return graph.locator("g.node").filter(has=graph.page.locator("css=text").filter(has_text=pattern))


def _layer(i: int) -> re.Pattern:
    """A BertLayer node: labelled ``layer.<i>`` at the encoder's level, ``<i>`` at encoder.layer's."""
    return re.compile(rf"^\s*(layer\.)?{i}\s*$")


def _wait_selected(graph, label: str | re.Pattern, timeout: float = WAIT_UI) -> None:
    """Wait until the kernel marked the node labelled ``label`` as selected in the SVG."""
    _node(graph, label).and_(graph.locator("g.node.slapo-selected")).wait_for(timeout=timeout)


def _button(editor, name: str):
    """An ipywidgets Button by its description (the Font Awesome icon's glyph is in the accessible
    name, so ``get_by_role(name=...)`` does not match; the text content does)."""
    text = re.compile(rf"^\s*{re.escape(name)}\s*$")
    return editor.locator("button.jupyter-button").filter(has_text=text)


def _wait_text(locator, text: str, present: bool = True, timeout: float = WAIT_UI) -> str:
    """Wait until ``locator``'s text contains ``text`` (or, ``present=False``, no longer does).

    The locator is re-resolved on every poll: the editor's HTML widgets replace their content.
    Returns the text at that moment.
    """
    from playwright.sync_api import expect

    if present:
        expect(locator.first).to_contain_text(text, timeout=timeout)
    else:
        expect(locator.first).not_to_contain_text(text, timeout=timeout)
    return locator.first.inner_text()


def _shutdown_kernel(page, timeout: float = 30.0) -> None:
    from browser_util import _js_with_timeout

    with contextlib.suppress(Exception):
        page.evaluate(_js_with_timeout("await nb.sessionContext.shutdown();", timeout))


# WCAG contrast ratio of an element's text colour against the first opaque background behind it.
_CONTRAST_JS = """(selectors) => {
  const rgb = c => (c.match(/[\\d.]+/g) || []).map(Number);
  const lum = c => {
    const [r, g, b] = rgb(c).slice(0, 3).map(v => { v /= 255; return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4); });
    return 0.2126 * r + 0.7152 * g + 0.0722 * b;
  };
  const bgOf = el => {
    for (let e = el; e; e = e.parentElement) {
      const m = rgb(getComputedStyle(e).backgroundColor);
      if (m.length === 3 || (m.length === 4 && m[3] > 0.5)) return getComputedStyle(e).backgroundColor;
    }
    return 'rgb(255, 255, 255)';
  };
  const out = {};
  for (const s of selectors) {
    const el = document.querySelector(s);
    if (!el) { out[s] = null; continue; }
    const fg = getComputedStyle(el).color, bg = bgOf(el);
    const a = lum(fg), b = lum(bg);
    out[s] = [Math.round((Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05) * 100) / 100, fg, bg];
  }
  return out;
}"""

# Text of the editor that must stay readable in both themes (the code panel's own string colour too).
READABLE = [
    ".slapo-editor .widget-html-content",  # the header line
    ".slapo-editor select",  # the module tree
    ".slapo-editor .slapo-msg",
    ".slapo-editor .slapo-code-pre",
    ".slapo-editor .slapo-code-pre .s2",
    ".slapo-editor .slapo-log",
    ".slapo-editor .slapo-graph-box",
]
MIN_CONTRAST = 3.0  # WCAG AA for large text; normal text wants 4.5


def _unreadable(page, selectors=READABLE) -> dict:
    """{selector: [ratio, colour, background]} of the elements whose contrast is below MIN_CONTRAST."""
    found = page.evaluate(_CONTRAST_JS, selectors)
    missing = [s for s, v in found.items() if v is None]
    assert not missing, f"not on the page: {missing}"
    return {s: v for s, v in found.items() if v[0] < MIN_CONTRAST}


# ------------------------------------------------------------------------------------ fixture


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """One JupyterLab server and one Chromium page for this module: ``(page, base_url, token, nb_dir, tmp)``."""
    from browser_util import browser_available, browser_page, jupyter_lab

    why = browser_available()
    if why:
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp("browser_editor")
    nb_dir = tmp / "notebooks"
    nb_dir.mkdir()
    t0 = time.monotonic()
    # tall enough that the whole editor is inside the notebook's scroll area for the screenshots
    with (
        jupyter_lab(tmp, nb_dir, startup_timeout=180) as (base_url, token),
        browser_page(tmp, width=1500, height=2300, default_timeout_ms=60_000) as page,
    ):
        print(f"\n[lab] server + browser up in {time.monotonic() - t0:.1f} s")
        yield page, base_url, token, nb_dir, tmp
        t1 = time.monotonic()
    print(f"[lab] cleanup {time.monotonic() - t1:.1f} s")


def _open_and_run(page, base_url, token, name: str) -> tuple[float, float]:
    from browser_util import notebook_errors, open_notebook, run_all_cells

    t0 = time.monotonic()
    open_notebook(page, base_url, token, name, timeout=180, reset=True)
    t1 = time.monotonic()
    run_all_cells(page, timeout=420)
    t2 = time.monotonic()
    errors = notebook_errors(page)
    assert errors == [], "\n\n".join(errors)
    return t1 - t0, t2 - t1


# ------------------------------------------------------------------------------------ issue 2


@pytest.mark.timeout(900)
def test_quickstart_click_to_checkpoint(lab):
    from browser_util import save_screenshot

    page, base_url, token, nb_dir, tmp = lab
    shutil.copy(QUICKSTART, nb_dir / "quickstart.ipynb")
    t0 = time.monotonic()
    try:
        t_open, t_run = _open_and_run(page, base_url, token, "quickstart.ipynb")
        editor = page.locator(".slapo-editor").first
        graph = editor.locator(".slapo-graph").first
        code = editor.locator(".slapo-code")
        _node(graph, "encoder").wait_for(state="visible", timeout=WAIT_UI)
        # the typed cells (layer 0's attention) are already in the code panel
        assert 'sch["encoder.layer.0.attention.self.query"].shard("weight", axis=0)' in code.inner_text()
        assert "encoder.layer.2" not in code.inner_text()

        t_click = time.monotonic()
        _node(graph, "encoder").click()
        _wait_selected(graph, "encoder")
        t_click = time.monotonic() - t_click
        _node(graph, "encoder").dblclick()  # open the encoder's level
        folded = _node(graph, "BertLayer × 4")
        folded.wait_for(state="visible", timeout=WAIT_UI)
        folded.dblclick()  # expand the folded block into its members
        for i in range(4):
            _node(graph, _layer(i)).wait_for(state="visible", timeout=WAIT_UI)
        assert _node(graph, "BertLayer × 4").count() == 0

        _node(graph, _layer(2)).click()
        _wait_selected(graph, _layer(2))
        _button(editor, "checkpoint").click()
        expected = 'sch["encoder.layer.2"].checkpoint()'
        _wait_text(code, expected)
        assert code.inner_text().strip().splitlines()[-1].strip() == expected
        _wait_text(editor.locator(".slapo-msg"), f"Applied {expected}")
        # the graph redrew with the checkpoint badge on layer.2
        _node(graph, _layer(2)).filter(has_text="ckpt").wait_for(timeout=WAIT_UI)
        # typing and clicking share one record: the kernel sees the same last call
        assert _kernel_eval(page, "print(editor.code.splitlines()[-1])").strip() == expected
        shot = save_screenshot(
            page.locator(".jp-OutputArea-output:has(.slapo-editor)").first, "editor_quickstart.png"
        )
        # a half-built shard typed in the kernel: the schedule check lists it, one click closes it
        _kernel_eval(page, 'sch["encoder.layer.1.attention.self.query"].shard("weight", axis=0)')
        check = editor.locator(".slapo-check-box")
        _wait_text(check, "open items")
        assert (
            "encoder.layer.1.attention.self splits its heads in query but not in key, value,"
            in check.inner_text()
        )
        assert _unreadable(page, [".slapo-editor .slapo-check-box"]) == {}
        save_screenshot(editor.locator(".slapo-check-box").first, "editor_open_items.png")
        _button(editor, "close open items").click()
        _wait_text(editor.locator(".slapo-msg"), "Closed the open items with 10 calls")
        check.first.wait_for(state="detached", timeout=WAIT_UI)
        typed = _kernel_eval(page, "print(editor.code)")
        assert 'sch["encoder.layer.1.attention.self.key"].shard("weight", axis=0)' in typed
        assert _kernel_eval(page, "print(len(editor.check()))").strip() == "0"
        print(
            f"\n[quickstart] open {t_open:.1f} s, run all {t_run:.1f} s, click→selected {t_click:.2f} s, "
            f"whole {time.monotonic() - t0:.1f} s; screenshot {shot}"
        )
    except BaseException:
        _report_failure(page, tmp, "editor_quickstart_failure.png")
        raise
    finally:
        _shutdown_kernel(page)  # free the CPU for the next test


# ------------------------------------------------------------------------------------ issue 6


@pytest.mark.timeout(900)
def test_editor_preset_undo_export_verify_themes(lab):
    from browser_util import save_screenshot, write_notebook

    page, base_url, token, nb_dir, tmp = lab
    write_notebook(nb_dir / "small_bert.ipynb", [SMALL_BERT_CELL], hide_input=True)
    exported = nb_dir / "exported" / "train_small_bert.py"
    t0 = time.monotonic()
    timings = {}
    try:
        timings["open"], timings["run all"] = _open_and_run(page, base_url, token, "small_bert.ipynb")
        editor = page.locator(".slapo-editor").first
        graph = editor.locator(".slapo-graph").first
        code = editor.locator(".slapo-code")
        message = editor.locator(".slapo-msg")
        _node(graph, "encoder").wait_for(state="visible", timeout=WAIT_UI)
        assert "no primitives yet" in code.inner_text()

        # double-click: open the encoder, then expand the folded block into its member nodes
        t = time.monotonic()
        _node(graph, "encoder").dblclick()
        _node(graph, "BertLayer × 2").wait_for(state="visible", timeout=WAIT_UI)
        assert _node(graph, _layer(0)).count() == 0
        _node(graph, "BertLayer × 2").dblclick()
        for i in range(2):
            _node(graph, _layer(i)).wait_for(state="visible", timeout=WAIT_UI)
        assert _node(graph, "BertLayer × 2").count() == 0
        _node(graph, _layer(1)).click()
        _wait_selected(graph, _layer(1))
        timings["navigate"] = time.monotonic() - t

        # preset: checkpoint every k-th block (k = 1) → one call per layer
        t = time.monotonic()
        editor.locator(".widget-dropdown:has(label:text-is('preset')) select").select_option(
            label="checkpoint every k-th block"
        )
        k_box = editor.locator(".widget-inline-hbox:has(label:text-is('k / N')) input")
        assert k_box.input_value() == "1"
        _button(editor, "apply preset").click()
        # the code panel folds the repeat over layers into a loop, as the exported script does
        loop = 'sch[f"encoder.layer.{i}"].checkpoint()'
        _wait_text(code, loop)
        panel = code.inner_text().strip()
        assert [ln.strip() for ln in panel.splitlines()] == ["for i in range(2):", loop], panel
        _wait_text(message, "Preset checkpoint recorded 2 calls.")
        _node(graph, _layer(1)).filter(has_text="ckpt").wait_for(timeout=WAIT_UI)
        timings["preset"] = time.monotonic() - t

        # Undo pops the whole preset (one user action); Redo brings it back
        t = time.monotonic()
        _button(editor, "Undo").click()
        _wait_text(message, "Undid preset checkpoint (2 calls).")
        _wait_text(code, "checkpoint()", present=False)
        _button(editor, "Redo").click()
        _wait_text(message, "Redid preset checkpoint (2 calls).")
        _wait_text(code, loop)
        assert code.inner_text().strip() == panel
        timings["undo"] = time.monotonic() - t

        # Export to a path typed into the "script" box
        t = time.monotonic()
        exported.parent.mkdir()
        script_box = editor.locator(".widget-text:has(label:text-is('script')) input")
        script_box.fill(str(exported))
        script_box.press("Tab")  # commits the value (continuous_update or not)
        _button(editor, "Export").click()
        msg = _wait_text(message, "Exported")
        assert f"Exported {exported}" in msg, msg
        assert "torchrun --nproc_per_node=2" in msg, msg
        assert exported.is_file(), f"{exported} is missing although the editor said: {msg}"
        text = exported.read_text()
        assert loop in text
        timings["export"] = time.monotonic() - t

        # Verify on GPU (CPU/gloo here): wait for the verdict in the message line
        t = time.monotonic()
        _button(editor, "Verify on GPU").click()
        cancel = _button(editor, "Cancel")
        _wait_text(message, "Verifying on 2 rank(s)")
        # the verdict replaces "Verifying on …" when the torchrun run ends (passed, failed, timed out)
        msg = _wait_text(message, "Verifying on", present=False, timeout=330_000)
        assert "Verify passed" in msg, msg
        import torch

        if not torch.cuda.is_available():
            assert "CUDA is not available on this machine, so Verify runs on the CPU with gloo." in msg, msg
        assert "PASSED" in editor.locator(".slapo-log").inner_text()
        assert cancel.is_disabled() and _button(editor, "Verify on GPU").is_enabled()
        timings["verify"] = time.monotonic() - t

        # screenshots: light, then dark theme (restored to light afterwards)
        out = page.locator(".jp-OutputArea-output:has(.slapo-editor)").first
        _node(graph, _layer(1)).click()  # a selected node and a filled inspector in the pictures
        _wait_selected(graph, _layer(1))
        page.mouse.move(2, 2)  # no hover tooltip in the pictures
        light = save_screenshot(out, "editor_light.png")
        bad = _unreadable(page)
        assert bad == {}, f"text hard to read in the light theme: {bad}"
        page.evaluate(
            "() => window.jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Dark'})"
        )
        page.wait_for_function("() => document.body.dataset.jpThemeLight === 'false'", timeout=30_000)
        page.wait_for_timeout(1_000)  # let the theme's CSS variables settle
        dark = save_screenshot(out, "editor_dark.png")
        bad = _unreadable(page)
        assert bad == {}, f"text hard to read in the dark theme: {bad}"
        # an action that cannot apply: its one-sentence error must be readable on the dark background
        _button(editor, "sync").click()  # a BertLayer has no sharded parameters: the sync is refused
        _wait_selected(graph, _layer(1))
        msg = _wait_text(editor.locator(".slapo-msg.slapo-err"), "has no sharded parameters")
        bad = _unreadable(page, [".slapo-editor .slapo-msg.slapo-err"])
        assert bad == {}, f"the error line is hard to read in the dark theme: {bad}"
        assert code.inner_text().strip() == panel  # unchanged
        timings["whole"] = time.monotonic() - t0
        print(
            "\n[editor] "
            + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items())
            + f"; screenshots {light}, {dark}"
        )
    except BaseException:
        _report_failure(page, tmp, "editor_failure.png")
        raise
    finally:
        with contextlib.suppress(Exception):
            page.evaluate(
                "() => window.jupyterapp.commands.execute('apputils:change-theme', "
                "{theme: 'JupyterLab Light'})"
            )
        _shutdown_kernel(page)


# ------------------------------------------------------------------------------------ issue 17 walkthroughs

GPT2_CELL = textwrap.dedent(
    """
    import torch
    import slapo_lab as sl
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=50257, n_positions=64))
    ids = torch.randint(0, 50257, (2, 16))
    editor = sl.ScheduleEditor(model, example_inputs={"input_ids": ids}, world_size=4, live_check=True)
    editor
    """
)


def _choose(editor, label: str, option: str) -> None:
    editor.locator(f".widget-dropdown:has(label:text-is('{label}')) select").select_option(label=option)


def _kernel_has(page, expr: str, expected: str, timeout: float = 30.0) -> None:
    """Wait until ``repr(expr)`` in the notebook's kernel is ``expected`` (a widget value synced from the page)."""
    deadline = time.monotonic() + timeout
    got = ""
    while time.monotonic() < deadline:
        got = _kernel_eval(page, f"print(repr({expr}))").strip()
        if got == expected:
            return
        time.sleep(0.2)
    raise AssertionError(
        f"the kernel's {expr} is {got}, not {expected}, {timeout:.0f} s after the page set it"
    )


def _type_number(editor, label: str, value: int) -> None:
    box = editor.locator(f".widget-inline-hbox:has(label:text-is('{label}')) input")
    box.fill(str(value))
    box.press("Enter")


@pytest.mark.timeout(900)
def test_the_quickstarts_default_preset_applies_after_run_all(lab):
    """Run All, then one click on "apply preset": Megatron composes with the typed layer-0 cell (it used to
    refuse: "…query.weight is already sharded on axis 0"), and the open items stay empty."""
    from browser_util import save_screenshot

    page, base_url, token, nb_dir, tmp = lab
    shutil.copy(QUICKSTART, nb_dir / "quickstart_preset.ipynb")
    try:
        _open_and_run(page, base_url, token, "quickstart_preset.ipynb")
        editor = page.locator(".slapo-editor").first
        message = editor.locator(".slapo-msg")
        _node(editor.locator(".slapo-graph").first, "encoder").wait_for(state="visible", timeout=WAIT_UI)
        _button(editor, "apply preset").click()
        msg = _wait_text(message, "Preset megatron recorded")
        assert "already sharded" not in msg and "not applied" not in msg, msg
        assert editor.locator(".slapo-check-box").count() == 0
        _wait_text(editor.locator(".slapo-code"), 'sch[f"encoder.layer.{i}.attention.self.query"]')
        save_screenshot(
            page.locator(".jp-OutputArea-output:has(.slapo-editor)").first, "quickstart_preset.png"
        )
    except BaseException:
        _report_failure(page, tmp, "quickstart_preset_failure.png")
        raise
    finally:
        _shutdown_kernel(page)


@pytest.mark.timeout(900)
def test_gpt2_with_its_real_vocabulary_on_4_gpus_tp_checkpoint_and_2_stages_by_clicks(lab):
    """GPT-2 with its 50257-token vocabulary on 2 nodes × 2 GPUs, by clicks only: TP 2 from the cluster control,
    the Megatron preset (the vocabulary stays replicated, said in one line), checkpoint every block, 2 balanced
    stages; the header names the three degrees and the live numeric check shows ✓."""
    from browser_util import save_screenshot, write_notebook

    page, base_url, token, nb_dir, tmp = lab
    write_notebook(nb_dir / "gpt2_clicks.ipynb", [GPT2_CELL], hide_input=True)
    try:
        _open_and_run(page, base_url, token, "gpt2_clicks.ipynb")
        editor = page.locator(".slapo-editor").first
        message = editor.locator(".slapo-msg")
        header = editor.locator(".widget-html-content").first
        _node(editor.locator(".slapo-graph").first, "transformer").wait_for(state="visible", timeout=WAIT_UI)
        _type_number(editor, "GPUs/node", 2)
        _type_number(editor, "nodes", 2)
        _wait_text(editor, "2 nodes × 2 GPUs")
        _choose(editor, "TP", "2")
        _wait_text(message, "at TP 2 (was TP 4)")
        _wait_text(header, "tensor parallel 2 · pipeline 1 stage · data parallel 2 = 4 GPUs")

        # no pause between a choice and its click: the click carries the page's choice (FormButton)
        _choose(editor, "preset", "Megatron tensor parallelism (every block)")
        _button(editor, "apply preset").click()
        msg = _wait_text(message, "Preset megatron recorded")
        assert "vocabulary of 50257 does not divide by the world size 2" in msg, msg
        _choose(editor, "preset", "checkpoint every k-th block")
        _button(editor, "apply preset").click()
        _wait_text(message, "Preset checkpoint recorded 4 calls.")
        _choose(editor, "preset", "cut into N balanced pipeline stages")
        _type_number(editor, "k / N", 2)
        _button(editor, "apply preset").click()
        _wait_text(message, "Preset stages recorded 1 calls.")
        _wait_text(header, "tensor parallel 2 · pipeline 2 stages · data parallel 1 = 4 GPUs")
        editor.locator(".slapo-numeric-passed").wait_for(timeout=120_000)
        assert editor.locator(".slapo-check-box").count() == 0
        page.mouse.move(2, 2)
        save_screenshot(
            page.locator(".jp-OutputArea-output:has(.slapo-editor)").first, "gpt2_tp_ckpt_stages.png"
        )
    except BaseException:
        _report_failure(page, tmp, "gpt2_clicks_failure.png")
        raise
    finally:
        _shutdown_kernel(page)


NEOX_CELL = textwrap.dedent(
    """
    import torch
    import slapo_lab as sl
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    cfg = GPTNeoXConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                        vocab_size=201, max_position_embeddings=64)
    model = GPTNeoXForCausalLM(cfg)
    ids = torch.randint(0, 201, (2, 16))
    editor = sl.ScheduleEditor(model, example_inputs={"input_ids": ids}, world_size=2, live_check=True)
    editor
    """
)


@pytest.mark.timeout(600)
def test_a_fused_interleaved_qkv_family_gets_a_right_preset_with_the_check_and_the_coverage_line(lab):
    """GPT-NeoX (Pythia): one fused ``query_key_value`` whose q, k and v interleave per head. The Megatron
    preset reads that split from the block's dataflow and shards it with ``attention.dense``; the live numeric
    check shows ✓; the coverage line names what stays whole (its 201-token vocabulary does not divide by 2)."""
    from browser_util import save_screenshot, write_notebook

    page, base_url, token, nb_dir, tmp = lab
    write_notebook(nb_dir / "neox_preset.ipynb", [NEOX_CELL], hide_input=True)
    try:
        _open_and_run(page, base_url, token, "neox_preset.ipynb")
        editor = page.locator(".slapo-editor").first
        message = editor.locator(".slapo-msg")
        _node(editor.locator(".slapo-graph").first, "gpt_neox").wait_for(state="visible", timeout=WAIT_UI)
        _choose(editor, "preset", "Megatron tensor parallelism (every block)")
        _button(editor, "apply preset").click()
        msg = _wait_text(message, "Preset megatron recorded")
        assert "vocabulary of 201 does not divide by the world size 2" in msg, msg
        code = _wait_text(editor.locator(".slapo-code"), "query_key_value")
        assert "attention.dense" in code, code
        editor.locator(".slapo-numeric-passed").wait_for(timeout=120_000)
        line = _wait_text(editor.locator(".slapo-coverage-line"), "Kept whole on every rank")
        assert "lm_head" in line and "query_key_value" not in line, line
        page.mouse.move(2, 2)
        save_screenshot(page.locator(".jp-OutputArea-output:has(.slapo-editor)").first, "neox_preset.png")
    except BaseException:
        _report_failure(page, tmp, "neox_preset_failure.png")
        raise
    finally:
        _shutdown_kernel(page)


FORM_CELL = textwrap.dedent(
    """
    import torch
    import slapo_lab as sl
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64))
    ids = torch.randint(0, 512, (2, 16))
    editor = sl.ScheduleEditor(model, example_inputs={"input_ids": ids}, world_size=2, live_check=False)
    editor
    """
)


def _keep_kernel_busy(page, seconds: float) -> None:
    """Start ``time.sleep(seconds)`` in the notebook's kernel and return at once (the kernel queues what
    the page sends meanwhile)."""
    from browser_util import _CURRENT_NB

    page.evaluate(
        f"""() => {{
  const nb = ({_CURRENT_NB})();
  nb.sessionContext.session.kernel.requestExecute({{code: 'import time; time.sleep({seconds})', silent: true}});
}}"""
    )


@pytest.mark.timeout(600)
def test_a_choice_changed_twice_while_the_kernel_is_busy_is_the_one_the_click_applies(lab):
    """While the kernel is busy, the page's first new choice of preset is sent and waits in the kernel's queue,
    the second is held back by ipywidgets (one unanswered update per widget), and the click is sent at once.
    A plain Button then applies the first choice (shown first, with the form emptied); "apply preset" carries
    the page's choice with its click and applies the second."""
    from browser_util import write_notebook

    page, base_url, token, nb_dir, tmp = lab
    write_notebook(nb_dir / "form_click.ipynb", [FORM_CELL], hide_input=True)
    try:
        _open_and_run(page, base_url, token, "form_click.ipynb")
        editor = page.locator(".slapo-editor").first
        message = editor.locator(".slapo-msg")
        _node(editor.locator(".slapo-graph").first, "transformer").wait_for(state="visible", timeout=WAIT_UI)
        _type_number(editor, "k / N", 2)
        _kernel_has(page, "editor._preset_k.value", "2")

        def choose_twice_and_click() -> None:
            _keep_kernel_busy(page, 4)
            time.sleep(0.5)
            _choose(editor, "preset", "checkpoint every k-th block")  # sent: waits behind the sleep
            _choose(editor, "preset", "cut into N balanced pipeline stages")  # held back in the page
            _button(editor, "apply preset").click()  # sent at once

        # the race itself, with the click carrying nothing: the kernel applies the first choice
        assert (
            _kernel_eval(page, "editor._btn_preset.form = []; print(len(editor._btn_preset.form))").strip()
            == "0"
        )
        choose_twice_and_click()
        _wait_text(message, "Preset checkpoint recorded")
        _kernel_has(page, "editor._preset.value", "'stages'")  # the held-back choice arrives after the click
        _button(editor, "Undo").click()
        _kernel_has(page, "len(editor.schedule.record.calls)", "0")
        _choose(editor, "preset", "Megatron tensor parallelism (every block)")
        _kernel_has(page, "editor._preset.value", "'megatron'")

        # the editor's button: its click carries the page's choice and k
        assert (
            _kernel_eval(
                page,
                "editor._btn_preset.form = [editor._preset, editor._preset_k]; print(len(editor._btn_preset.form))",
            ).strip()
            == "2"
        )
        choose_twice_and_click()
        _wait_text(message, "Preset stages recorded 1 calls.")
        _kernel_has(page, "[c.primitive for c in editor.schedule.record.calls]", "['cut_pipeline_stage']")
    except BaseException:
        _report_failure(page, tmp, "form_click_failure.png")
        raise
    finally:
        _shutdown_kernel(page)


@pytest.mark.timeout(600)
def test_a_dead_kernel_is_said_on_the_editor_instead_of_looking_alive(lab):
    """The kernel dies (os._exit in the kernel: JupyterLab restarts it): the editor says so in one sentence and
    its controls stop taking clicks, instead of ignoring them silently."""
    from browser_util import save_screenshot, write_notebook

    page, base_url, token, nb_dir, tmp = lab
    write_notebook(nb_dir / "dies.ipynb", [SMALL_BERT_CELL], hide_input=True)
    try:
        _open_and_run(page, base_url, token, "dies.ipynb")
        editor = page.locator(".slapo-editor").first
        _node(editor.locator(".slapo-graph").first, "encoder").wait_for(state="visible", timeout=WAIT_UI)
        assert editor.locator(".slapo-kernel-gone-note").count() == 0
        with contextlib.suppress(Exception):
            _kernel_eval(page, "import os; os._exit(1)", timeout=10)
        note = editor.locator(".slapo-kernel-gone-note")
        text = _wait_text(note, "this editor no longer answers clicks")
        assert text.startswith(("The kernel restarted", "The kernel has stopped", "The kernel connection")), (
            text
        )
        events = editor.locator(".slapo-graph").first.evaluate(
            "e => getComputedStyle(e.parentElement).pointerEvents"
        )
        assert events == "none"
        save_screenshot(
            page.locator(".jp-OutputArea-output:has(.slapo-editor)").first, "editor_kernel_gone.png"
        )
    except BaseException:
        _report_failure(page, tmp, "kernel_gone_failure.png")
        raise
    finally:
        _shutdown_kernel(page)
