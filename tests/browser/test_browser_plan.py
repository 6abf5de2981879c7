"""The editor's Plan pane in a real JupyterLab, driven by headless Chromium (issue 26): cluster shape → Plan → the
ranked table → Apply a row → ✓ from the live numeric check → Export with the plan's options.

A tiny Llama built from ``transformers.LlamaConfig`` (no downloads) on 1 node × 2 GPUs with one sequence per step:
data parallelism cannot split it, so the plans that fit use the two GPUs for tensor or pipeline parallelism, and
the test applies the best row the schedule primitives can record. Run: ``source scripts/env.sh &&
.venv/bin/python -m pytest -q -s tests/browser/test_browser_plan.py``. Screenshot: ``artifacts/editor_plan.png``.
"""

from __future__ import annotations

import re
import textwrap
import time

import pytest
from test_browser_editor import (
    WAIT_UI,
    _button,
    _kernel_eval,
    _open_and_run,
    _report_failure,
    _shutdown_kernel,
    _type_number,
    _wait_text,
    lab,  # noqa: F401 - the module's JupyterLab server and page (a pytest fixture)
)

pytestmark = pytest.mark.browser

LLAMA_CELL = textwrap.dedent(
    """
    import torch
    import slapo_lab as sl
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 256, (2, 16))
    editor = sl.ScheduleEditor(model, example_inputs={"input_ids": ids}, live_check=True)
    editor
    """
)


@pytest.mark.timeout(600)
def test_cluster_shape_plan_table_apply_check_and_export(lab):  # noqa: F811 - the fixture imported above
    from browser_util import save_screenshot, write_notebook

    page, base_url, token, nb_dir, tmp = lab
    write_notebook(nb_dir / "plan.ipynb", [LLAMA_CELL], hide_input=True)
    t0 = time.monotonic()
    try:
        _open_and_run(page, base_url, token, "plan.ipynb")
        editor = page.locator(".slapo-editor").first
        message = editor.locator(".slapo-msg")
        header = editor.locator(".widget-html-content").first
        _type_number(editor, "GPUs/node", 2)
        _wait_text(editor, "1 node × 2 GPUs")
        _type_number(editor, "batch per step", 1)
        _button(editor, "Plan").click()
        table = editor.locator(".slapo-plan-rows")
        table.wait_for(timeout=WAIT_UI)
        rows = table.locator("tbody tr").all_inner_texts()
        assert 1 <= len(rows) <= 5 and all("dp 1" in r for r in rows), rows
        why_not = _wait_text(editor.locator(".slapo-plan-why-not"), "Why not the others")
        assert "global batch of 1" in why_not, why_not
        # the best row the schedule primitives can record (not selective checkpointing, not interleaved stages)
        options = [  # ipywidgets draws a Dropdown's spaces as no-break spaces
            o.replace("\xa0", " ")
            for o in editor.locator(
                ".widget-dropdown:has(label:text-is('row')) select option"
            ).all_inner_texts()
        ]
        pick = next(i for i, o in enumerate(options) if not re.search("selective|interleaved", o))
        editor.locator(".widget-dropdown:has(label:text-is('row')) select").select_option(index=pick)
        _button(editor, "Apply").click()
        layout = options[pick].split(": ", 1)[1]
        tp, pp, dp = map(int, re.match(r"tp (\d+) x pp (\d+) x dp (\d+)", layout).groups())
        assert tp * pp * dp == 2, layout
        _wait_text(message, f"Applied the plan {layout} with")
        stages = f"{pp} stage{'s' if pp > 1 else ''}"
        _wait_text(header, f"tensor parallel {tp} · pipeline {stages} · data parallel {dp} = 2 GPUs")
        editor.locator(".slapo-numeric-passed").wait_for(timeout=120_000)
        assert editor.locator(".slapo-check-box").count() == 0
        mbs = re.search(r"mbs (\d+)", layout).group(1)
        micro = editor.locator(".widget-text:has(label:text-is('micro batch')) input")
        assert micro.input_value() == mbs
        assert editor.locator(".widget-text:has(label:text-is('global batch')) input").input_value() == "1"
        _button(editor, "Export").click()
        _wait_text(message, "Exported")
        got = _kernel_eval(
            page, "o = editor.export_options['options']; print(o['dp'], o['global_batch_size'], "
            "o['micro_batch_size'], o['seq_len'], editor.world_size, len(editor.schedule.record.actions()))",
        ).split()  # fmt: skip
        assert got == ["1", "1", mbs, "16", str(tp), "1"], got
        page.mouse.move(2, 2)
        save_screenshot(page.locator(".jp-OutputArea-output:has(.slapo-editor)").first, "editor_plan.png")
        print(f"\n[plan flow] {time.monotonic() - t0:.1f} s")
    except BaseException:
        _report_failure(page, tmp, "editor_plan_failure.png")
        raise
    finally:
        _shutdown_kernel(page)
