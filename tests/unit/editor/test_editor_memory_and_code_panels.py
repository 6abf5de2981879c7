"""The editor's selection, memory line and code panel at 70B (issue 11): structural regressions, no timing.

* a selection never runs graphviz (the browser draws the selection halo);
* the memory line is one sentence naming the module and the reason, never an exception's text, and
  the rest of the editor keeps working when the plan fails;
* the code panel folds repeats over layers into loops, as the export does: the Megatron preset on a
  Llama-70B config (meta device) is a few dozen lines, and the folded text replays the same record.
"""

import importlib
import re

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from zoo.scale import llama2_70b_config, llama3_70b_config, on_meta

import slapo_lab as sl
import slapo_lab.graph
from slapo_lab.utils import meta_copy

plan_module = importlib.import_module("slapo_lab.plan")  # ``slapo_lab.plan`` is also the function sl.plan


def _text(html_value: str) -> str:
    import html

    no_style = re.sub(r"<style>.*?</style>", "", html_value, flags=re.DOTALL)
    return html.unescape(re.sub(r"<[^>]+>", "", no_style))


def _exec_panel(text: str, sch) -> None:
    exec(compile(text, "<code panel>", "exec"), {"sch": sch})  # noqa: S102 - the panel text is the test


def test_selection_change_runs_no_graphviz(editor, monkeypatch):
    editor.open_level("encoder.layer.0.attention.self")
    editor.apply("shard", "weight", axis=0, path="encoder.layer.0.attention.self.query")  # a styled node too
    renders = []
    real = slapo_lab.graph.render_svg
    monkeypatch.setattr(slapo_lab.graph, "render_svg", lambda *a, **k: renders.append(a) or real(*a, **k))
    svg = editor._graph.svg
    for path in (
        "encoder.layer.0.attention.self.key",
        "encoder.layer.0.attention.self.query",
        "encoder.layer.0.attention.self.value",
    ):
        assert editor.select(path) is None
        token = {p: t for t, p in editor._graph.node_ids.items()}[path]
        assert editor._graph.selected == token  # the browser highlights it
    assert renders == [] and editor._graph.svg == svg
    editor.apply("checkpoint", path="encoder.layer.0.attention.self.key")  # a schedule change does redraw
    assert len(renders) == 1


def test_memory_line_names_the_module_not_the_exception(editor):
    editor.apply("shard", "weight", axis=0, path="encoder.layer.0.intermediate.dense")  # bias not yet sharded
    line = _text(editor._costs_text.value)
    assert line.startswith("Busiest rank needs")  # the parameter plan still shows
    assert (
        "activations not estimated: the meta forward pass failed in encoder.layer.0.intermediate.dense "
        "because tensor shapes do not match"
    ) in line
    for raw in ("RuntimeError", "Mismatching", "broadcast", "at index"):
        assert raw not in line


def test_memory_line_when_the_plan_fails_is_one_sentence_and_the_view_works(editor, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("CUDA error: device-side assert triggered\nCompile with TORCH_USE_CUDA_DSA")

    monkeypatch.setattr(plan_module, "plan", broken)
    assert editor.apply("checkpoint", path="encoder.layer.0") is None
    line = _text(editor._costs_text.value)
    assert line == (
        "Memory plan unavailable: the plan could not be computed because of an unexpected "
        "RuntimeError; the details are in the log."
    )
    assert editor.memory_plan is None and editor._costs.value == ""
    # the rest of the view keeps working
    assert 'sch["encoder.layer.0"].checkpoint()' in _text(editor._code.value)
    assert editor.select("encoder.layer.1") is None
    assert editor.apply("checkpoint") is None and editor.code.endswith('sch["encoder.layer.1"].checkpoint()')


def test_memory_line_for_a_failed_activation_pass_via_plan(editor, monkeypatch):
    """A failure deep in the pass (provoked in one module's forward) is reported with that module's path."""
    import types

    target = editor.schedule["encoder.layer.1.output.dense"].mod

    def boom(self, *a, **k):
        raise ValueError("weird internal state 0x7f")

    monkeypatch.setattr(target, "forward", types.MethodType(boom, target))
    importlib.import_module(
        "slapo_lab.activation_cache"
    )._PROFILE_CACHE.clear()  # the start-up pass was cached
    editor._refresh_costs()
    line = _text(editor._costs_text.value)
    assert (
        "activations not estimated: the meta forward pass failed in encoder.layer.1.output.dense because of "
        "an unexpected ValueError; the details are in the log."
    ) in line
    assert "0x7f" not in line


def test_code_panel_folds_like_the_export_and_replays_the_same_record(editor, bert):
    assert editor.apply_preset("megatron") is None
    assert editor.apply_preset("checkpoint", 1) is None
    calls = list(editor.schedule.record.calls)
    panel = _text(editor._code.value)
    assert "for i in range(2):" in panel and len(panel.splitlines()) < len(calls)
    fresh = sl.create_schedule(meta_copy(bert[0]), world_size=2)
    _exec_panel(panel, fresh)
    assert fresh.record.calls == calls
    assert editor.code.count("\n") + 1 == len(calls)  # editor.code keeps one line per call


def test_code_panel_of_llama70b_megatron_is_a_few_dozen_lines():
    model = on_meta(llama2_70b_config())
    ed = sl.ScheduleEditor(model, world_size=8)  # no inputs: the dataflow pass is not what this tests
    assert ed.apply_preset("megatron") is None
    calls = list(ed.schedule.record.calls)
    assert len(calls) > 1000
    panel = _text(ed._code.value)
    assert len(panel.splitlines()) <= 40, panel
    assert (
        'for i in range(80):\n    sch[f"model.layers.{i}.self_attn.q_proj"].shard("weight", axis=0)' in panel
    )
    fresh = sl.create_schedule(meta_copy(model), world_size=8)
    _exec_panel(panel, fresh)
    assert fresh.record.calls == calls


def test_double_click_shows_a_busy_state_and_clears_it(editor, monkeypatch):
    editor.open_level("encoder")
    folded = [n for n, d in editor._last_graph.nodes(data=True) if d.get("kind") == "folded"]
    assert folded, "the two BERT layers are drawn as one folded node"
    editor._info("before")
    seen = []
    real = editor._refresh_view

    def spy(*a, **k):
        seen.append((editor._busy, editor.message, editor._btn_preset.disabled, editor._btn_undo.disabled))
        return real(*a, **k)

    monkeypatch.setattr(editor, "_refresh_view", spy)
    editor._on_node_dblclick(folded[0])
    assert seen and seen[0] == (True, f"Working: unfolding {folded[0]}…", True, True)
    assert not editor._busy and not editor._btn_preset.disabled and editor.message == "before"
    assert folded[0] in editor.expanded
    editor._on_node_dblclick("encoder.layer.1")  # opening a level: busy too
    assert (
        seen[-1][:3] == (True, "Working: opening encoder.layer.1…", True)
        and editor.level == "encoder.layer.1"
    )
    assert not editor._busy and not editor._btn_preset.disabled


def test_double_click_failure_clears_the_busy_state_with_one_sentence(editor, monkeypatch):
    editor.open_level("encoder")

    def broken(*a, **k):
        raise RuntimeError("dot: segfault at 0x0")

    monkeypatch.setattr(editor, "_refresh_view", broken)
    folded = next(n for n, d in editor._last_graph.nodes(data=True) if d.get("kind") == "folded")
    editor._on_node_dblclick(folded)  # never raises into the widget's message handler
    assert not editor._busy and not editor._btn_preset.disabled and not editor._btn_shard.disabled
    assert editor.message == (
        f"Could not show {folded}: drawing the graph failed (RuntimeError); the schedule is unchanged."
    )
    assert folded not in editor.expanded


def test_call_order_for_cut_checks_is_recorded_in_the_background_not_on_first_double_click(bert, monkeypatch):
    """In a kernel the editor records the forward call order (cut checks; ~1 s at 70B) in a background thread
    it starts after the constructor, so opening the first level never waits for it."""
    import asyncio

    order = importlib.import_module("slapo_lab.call_order")
    recorded = []
    real = order.record_call_order
    monkeypatch.setattr(order, "record_call_order", lambda *a, **k: recorded.append(1) or real(*a, **k))
    model, ids = bert

    async def cell():
        return sl.ScheduleEditor(model, example_inputs={"input_ids": ids}, world_size=2)

    loop = asyncio.new_event_loop()
    try:
        ed = loop.run_until_complete(cell())
        loop.run_until_complete(asyncio.sleep(0))  # the kernel goes idle: queued callbacks run
    finally:
        loop.close()
    assert ed.wait_background(60)
    assert recorded == [1]
    ed._on_node_dblclick("encoder")
    ed._on_node_dblclick("encoder.layer.0")
    assert ed.level == "encoder.layer.0" and "cut pipeline stage" not in ed._reasons.value
    assert recorded == [1]


def test_folding_a_long_unfoldable_record_tries_only_candidate_blocks(monkeypatch):
    """The code panel folds on every click: a record that does not fold (layers clicked out of order)
    must cost about one block try per call, not one per (call, length) pair (0.8 s for 960 calls)."""
    import random

    fold = importlib.import_module("slapo_lab.export.fold")
    cfg = LlamaConfig(
        num_hidden_layers=60,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=128,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    sch = sl.create_schedule(meta_copy(model), world_size=2)
    layers = list(range(60))
    random.Random(0).shuffle(layers)
    for i in layers:
        for name, axis in (("q_proj", 0), ("k_proj", 0), ("v_proj", 0), ("o_proj", 1)):
            sch[f"model.layers.{i}.self_attn.{name}"].shard("weight", axis=axis)
    for i in range(3):  # and one foldable stretch at the end
        sch[f"model.layers.{i}.mlp.down_proj"].shard("weight", axis=1)
    calls = list(sch.record.calls)
    tries = []
    real = fold._run_at
    monkeypatch.setattr(fold, "_run_at", lambda *a: tries.append(a[3]) or real(*a))
    lines = fold.schedule_lines(calls)
    assert len(tries) <= 2 * len(calls), len(tries)  # was ~n²/4 = 14,000 for these 243 calls
    assert "for i in range(3):" in lines[-2]
    fresh = sl.create_schedule(meta_copy(model), world_size=2)
    _exec_panel("\n".join(lines), fresh)
    assert fresh.record.calls == calls


def test_activations_of_a_large_model_are_estimated_in_the_background_and_the_view_follows():
    """In a kernel a whole-model activation pass (a meta forward of every layer, here 70B-wide layers; a model of
    two blocks is not composed from distinct blocks) runs in a background thread; the memory line says so, then
    shows the figure without a click."""
    import asyncio

    model = on_meta(llama3_70b_config(num_hidden_layers=2))
    ids = torch.zeros(1, 512, dtype=torch.long)

    async def cell():
        return sl.ScheduleEditor(model, example_inputs={"input_ids": ids}, world_size=8)

    loop = asyncio.new_event_loop()
    try:
        ed = loop.run_until_complete(cell())
    finally:
        loop.close()
    assert "activations: being estimated" in ed._costs_text.value
    assert ed.memory_plan.activation_method is None
    assert ed.wait_background(120)
    assert "being estimated" not in ed._costs_text.value and "flash-attention SDPA" in ed._costs_text.value
    assert (
        ed.memory_plan.activation_method == "autograd" and ed.memory_plan.per_stage[0]["activation_bytes"] > 0
    )
