"""The editor's Plan pane (issue 26): the widget-free controller (``EditorState.planner``) and its widgets.

A tiny Llama built from ``transformers.LlamaConfig`` (no downloads): plan a cluster, read the ranked table and the
grouped why-not list, apply a row as one undoable action that the numeric check passes, export with its options.
"""

import re
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from slapo_lab.editor import EditorState
from slapo_lab.errors import ScheduleError
from slapo_lab.numeric import numeric_check

SEQ = 16


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg)


def _inputs() -> dict:
    return {"input_ids": torch.randint(0, 256, (4, SEQ), generator=torch.Generator().manual_seed(1))}


def test_plan_controller_ranks_applies_undoes_and_exports_without_widgets(tmp_path):
    st = EditorState(_llama(), _inputs())
    req = st.planner.defaults()
    assert (req.nodes, req.gpus_per_node, req.seq_len, req.global_batch_size) == (1, 1, SEQ, 4)
    plan = st.planner.run(
        nodes=1, gpus_per_node=4, seq_len=SEQ, global_batch_size=4, dtype="fp32",
        tp=[2], pp=[2], checkpoints=("all",), pp_schedules=("1F1B", "GPipe"),
    )  # fmt: skip
    rows = st.planner.rows()
    assert rows and len(rows) <= 5 and [r["rank"] for r in rows] == list(range(len(rows)))
    speeds = [r["tokens_per_s_per_gpu"] for r in rows]
    assert speeds == sorted(speeds, reverse=True)
    assert all(r["layout"].startswith("tp 2 x pp 2 x dp 1") and r["peak_gib"] > 0 for r in rows)
    # every layout considered is either a fitting one or counted once in the grouped why-not list
    groups = st.planner.why_not()
    assert groups and sum(n for n, _ in groups) == plan.priced - plan.fitting
    assert all(s.endswith(".") and "\n" not in s for _, s in groups)

    assert st.planner.apply(0) is None
    est = plan.candidates[0]
    assert st.planner.chosen is est and st.message.startswith(f"Applied the plan {est.layout.describe()}")
    assert st.world_size == 2 and st.dims().pp == 2 and (st.cluster.nodes, st.cluster.gpus_per_node) == (1, 4)
    actions = st.schedule.record.actions()
    assert len(actions) == 1 and actions[0].label == f"plan {est.layout.describe()}"
    names = {c.primitive for c in st.schedule.record.calls}
    assert {"shard", "sync", "checkpoint", "cut_pipeline_stage"} <= names
    assert st.check() == []
    report = numeric_check(st.model, st.schedule.record.calls, st.world_size, st.example_inputs)
    assert report.status == "passed", report.message

    kwargs = st.planner.export_kwargs()
    lay = est.layout
    assert kwargs == {
        "launcher": "torchrun",
        "dp": 1,
        "fsdp": False,
        "global_batch_size": 4,
        "micro_batch_size": lay.micro_batch_size,
        "seq_len": SEQ,
        "predicted_step_s": est.export_options()["predicted_step_s"],
        "predicted_peak_gib": est.export_options()["predicted_peak_gib"],
    }
    out = st.export(str(tmp_path / "train.py"), **kwargs)
    text = Path(out).read_text(encoding="utf-8")
    assert f"micro_batch_size={lay.micro_batch_size}" in text  # the script's TrainConfig literal
    assert f"predicted_step_s={kwargs['predicted_step_s']}" in text  # printed beside the measured step times
    assert "--nproc_per_node=4" in st.message  # tp 2 x pp 2 x dp 1

    assert st.undo() is None and st.schedule.record.calls == []  # one Undo removes the plan's calls


def test_plan_controller_refusals_are_one_sentence():
    st = EditorState(_llama(), _inputs())
    assert st.planner.apply(0) == "Plan first: there is no ranked table to choose from."
    with pytest.raises(ScheduleError, match=r"^Plan: unknown GPU 'TPU'; choose one of A100-40GB, "):
        st.planner.run(gpu="TPU")
    with pytest.raises(ScheduleError, match=r"^Plan: seq_len must be a positive whole number, not 0\.$"):
        st.planner.run(seq_len=0)
    with pytest.raises(ScheduleError, match=r"^Apply a plan first: no candidate is chosen\.$"):
        st.planner.export_kwargs()
    st.planner.run(nodes=1, gpus_per_node=2, seq_len=SEQ, global_batch_size=4, dtype="fp32", tp=[1], pp=[1])
    n = len(st.planner.rows())
    assert st.planner.apply(n) == f"The plan has {n} candidates; there is no row {n} to apply."
    assert st.message == f"The plan has {n} candidates; there is no row {n} to apply."
    # a candidate the schedule primitives cannot record is refused whole, in one sentence, nothing recorded
    st.planner.run(checkpoints=("none",), shards=("none",), tp=[1], pp=[2], pp_schedules=("interleaved",))
    assert st.planner.apply(0).startswith("The plan was not applied: apply: interleaved stages are not")
    assert st.schedule.record.calls == [] and st.planner.chosen is None


def test_plan_pane_draws_the_table_and_apply_fills_the_export_form():
    from slapo_lab.editor import ScheduleEditor

    ed = ScheduleEditor(_llama(), _inputs(), live_check=False)
    pane = ed._plan_panel
    assert pane.box in ed._costs_box.children and pane.btn_apply.disabled
    ed._gpn.value = 2  # the cluster control: 1 node x 2 GPUs
    pane.dtype.value, pane.batch.value, pane.gpu.value = "fp32", 4, "A100-80GB"
    pane.btn_plan.click()  # outside a kernel: planned here
    res = ed.planner.result
    assert res is not None and ed.planner.request.gpu == "A100-80GB" and ed.planner.request.gpus_per_node == 2
    cells = re.findall(r"<tr><td style='text-align:right'>(\d+)</td><td>([^<]+)</td>", pane.table.value)
    assert [(int(i), lay) for i, lay in cells] == [(i + 1, e.layout.describe()) for i, e in enumerate(res)]
    assert [v for _, v in pane.row.options] == list(range(len(res))) and not pane.btn_apply.disabled
    assert "Why not the others" in pane.why_not.value and f"{res.rejected[0].count:,} ×" in pane.why_not.value
    assert f"{res.priced:,} layouts considered" in pane.status.value

    # a ZeRO-2 plan (searched through the controller: the pane redraws from its listener)
    ed.planner.run(shards=("zero2",), tp=[1], pp=[1])
    assert all(", zero2, " in lay for lay, _ in pane.row.options)
    pane.row.value = 1
    pane.btn_apply.click()
    assert ed.planner.chosen is ed.planner.result.candidates[1] and "Applied #2." in pane.status.value
    mbs = ed.planner.chosen.layout.micro_batch_size
    launcher, _, options = ed._form_options()
    assert launcher == "deepspeed" and options["zero"] == 2 and "fsdp" not in options
    assert (options["dp"], options["global_batch_size"], options["micro_batch_size"], options["seq_len"]) == (
        2, 4, mbs, SEQ,
    )  # fmt: skip
    assert "ZeRO-2" in ed._cluster_info.value  # the header's degrees follow the form
    assert options["predicted_step_s"] == ed.planner.chosen.export_options()["predicted_step_s"]
    ed._export.f_dp.value = "1"  # another layout than the plan's: its prediction is no longer exported
    assert "predicted_step_s" not in ed._form_options()[2]
    # no row: Apply says so in one sentence, nothing changes
    n = len(ed.schedule.record.calls)
    pane.row.options = []
    assert pane.apply() == "Plan first, then choose a row of the ranked table to apply." == ed.message
    assert len(ed.schedule.record.calls) == n
