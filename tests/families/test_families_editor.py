"""The editor on every common model family: it opens with a full graph, and the TP preset, the checkpoint
preset and one pipeline cut each apply (or refuse in one sentence, leaving nothing applied) on real HF
models built from tiny configs (tests/families.py)."""

from __future__ import annotations

import warnings

import pytest
from zoo.families import FAMILIES

import slapo_lab as sl
from slapo_lab.presets import find_blocks


@pytest.fixture(params=sorted(FAMILIES))
def editor(request):
    fam = FAMILIES[request.param]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ed = sl.ScheduleEditor(fam.build(), example_inputs=fam.example_inputs(), world_size=2)
    ed.family = fam
    return ed


def _edges(editor, level: str) -> int:
    editor.open_level(level)
    return editor._level_graph().number_of_edges()


def test_editor_opens_with_a_full_graph(editor):
    assert editor._flow is not None, editor._flow_error
    assert _edges(editor, "") >= 2
    blocks = find_blocks(editor.schedule)
    assert len(blocks) >= 1, "no repeated blocks found"
    # Inside a block every child takes part in the dataflow: at least as many edges as children - 1.
    n_children = len(editor.schedule[blocks[0]].child)
    assert _edges(editor, blocks[0]) >= n_children - 1


def test_presets_and_one_cut_apply(editor):
    for preset in ("megatron", "checkpoint"):
        before = len(editor.schedule.record.calls)
        assert editor.apply_preset(preset) is None, editor.message
        assert len(editor.schedule.record.calls) > before
    blocks = find_blocks(editor.schedule)
    mid = editor.family.cut or blocks[len(blocks) // 2 - 1]
    assert editor.apply("cut_pipeline_stage", path=mid) is None, editor.message
    assert editor.schedule.metadata.primitives["cut_pipeline_stage"]
    assert "cut_pipeline_stage()" in editor.code
    # The plan (per-rank memory per stage) follows the schedule: two stages now.
    assert sl.plan(editor.schedule).num_stages == 2
