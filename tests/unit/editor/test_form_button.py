"""FormButton: a click applies the page's values of its form before the click handlers run (the browser half,
labextension/src/form_button.ts, sends them; tests/browser/test_browser_editor.py shows the race it closes)."""

from __future__ import annotations

import ipywidgets as W
import pytest
from transformers import GPT2Config, GPT2LMHeadModel

import slapo_lab as sl
from slapo_lab.editor.form_button import FormButton


def _click(button, content) -> None:
    button._handle_button_msg(None, content, [])


def test_a_click_sets_the_form_in_order_then_runs_the_handlers():
    kind = W.Dropdown(options=[("a", 1), ("b", 2), ("c", 3)], value=1)
    n = W.BoundedIntText(value=1, min=1, max=8)
    seen = []
    kind.observe(lambda ch: seen.append(("kind", ch["new"])), names="value")
    button = FormButton([kind, n], description="go")
    button.on_click(lambda _b: seen.append(("click", kind.value, n.value)))
    _click(button, {"event": "click", "form": [{"index": 2}, {"value": 5}]})
    assert seen == [("kind", 3), ("click", 3, 5)]
    assert button.get_state()["form"] == [f"IPY_MODEL_{kind.model_id}", f"IPY_MODEL_{n.model_id}"]


@pytest.mark.parametrize(
    "form, expected",
    [
        (None, (1, 3)),
        ("junk", (1, 3)),
        ([{"index": 1}], (1, 3)),  # a wrong length: the whole form is ignored
        ([{"index": 99}, {"value": 2}], (1, 2)),  # a refused state leaves that widget's value
        ([{"other": 1}, {"value": "x"}], (1, 3)),
        ([[], {}], (1, 3)),
    ],
)
def test_a_malformed_form_is_ignored_and_the_click_still_runs(form, expected, caplog):
    kind = W.Dropdown(options=[("a", 1), ("b", 2)], value=1)
    n = W.BoundedIntText(value=3, min=1, max=8)
    clicks = []
    button = FormButton([kind, n], description="go")
    button.on_click(lambda _b: clicks.append((kind.value, n.value)))
    content = {"event": "click"} if form is None else {"event": "click", "form": form}
    _click(button, content)
    assert clicks == [expected]
    assert form is None or "FormButton 'go'" in caplog.text
    _click(button, {"event": "other"})
    assert len(clicks) == 1


def test_the_editors_buttons_submit_the_choices_they_read():
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64))
    ed = sl.ScheduleEditor(model, world_size=2, live_check=False)
    assert ed._btn_preset.form == [ed._preset, ed._preset_k]
    assert ed._btn_export.form[0] is ed._f_launcher and ed._btn_export.form[-1] is ed._export_path
    assert ed._btn_shard.form == [ed._param, ed._axis, ed._similar]
    # the page chose "cut into N balanced pipeline stages" with N = 2; the kernel still has Megatron, k = 1
    stages = [v for _label, v in ed._preset.options].index("stages")
    _click(ed._btn_preset, {"event": "click", "form": [{"index": stages}, {"value": 2}]})
    assert ed.message.startswith("Preset stages recorded 1 calls"), ed.message
    assert [c.primitive for c in ed.schedule.record.calls] == ["cut_pipeline_stage"]
    assert ed._preset_k.value == 2
