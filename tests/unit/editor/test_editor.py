"""Kernel-side tests of the ScheduleEditor: simulated front-end messages and button clicks."""

import re
from pathlib import Path

import pytest

import slapo_lab as sl


def _panel_text(html_value):
    import html
    import re

    no_style = re.sub(r"<style>.*?</style>", "", html_value, flags=re.DOTALL)
    return html.unescape(re.sub(r"<[^>]+>", "", no_style))


def _msg(widget, content):
    widget._handle_msg({"content": {"data": {"method": "custom", "content": content}}, "buffers": []})


def _token(editor, path):
    for tok, p in editor._graph.node_ids.items():
        if p == path:
            return tok
    raise AssertionError(f"{path} not in graph nodes {sorted(editor._graph.node_ids.values())}")


def test_editor_leaves_user_model_untouched(bert, editor):
    model, _ = bert
    editor.apply("shard", "weight", axis=0, path="encoder.layer.0.attention.self.query")
    assert model.encoder.layer[0].attention.self.query.weight.shape == (64, 64)
    assert model.encoder.layer[0].attention.self.query.weight.device.type == "cpu"
    assert editor.schedule["encoder.layer.0.attention.self.query"].mod.weight.shape == (32, 64)


def test_root_graph_has_children_and_svg(editor):
    paths = set(editor._graph.node_ids.values())
    assert {"embeddings", "encoder", "pooler"} <= paths
    assert "<svg" in editor._graph.svg


def test_node_click_selects_and_dblclick_opens(editor):
    _msg(editor._graph, {"event": "click", "node": _token(editor, "encoder")})
    assert editor.selected == "encoder"
    assert "BertEncoder" in editor._inspector.value
    _msg(editor._graph, {"event": "dblclick", "node": _token(editor, "encoder")})
    assert editor.level == "encoder"


def test_click_each_action_button_records_exact_call(editor):
    q = "encoder.layer.0.attention.self.query"
    editor.select(q)
    assert "64×64" in editor._inspector.value and "32×64" not in editor._inspector.value
    editor._param.value, editor._axis.value = "weight", 0
    editor._btn_shard.click()
    editor._param.value, editor._axis.value = "bias", 0
    editor._btn_shard.click()
    editor._sync.value = ("bwd_post", "all_reduce")
    editor._btn_sync.click()
    assert "32×64" in editor._inspector.value  # per-rank shape after the shard
    editor.select("encoder.layer.0")
    editor._btn_ckpt.click()
    editor.select("encoder.layer.1")
    editor._btn_cut.click()
    assert editor.code.splitlines() == [
        f'sch["{q}"].shard("weight", axis=0)',
        f'sch["{q}"].shard("bias", axis=0)',
        f'sch["{q}"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")',
        'sch["encoder.layer.0"].checkpoint()',
        'sch["encoder.layer.1"].cut_pipeline_stage()',
    ]
    assert editor.code in _panel_text(editor._code.value)


def test_typing_equals_clicking(bert):
    model, ids = bert
    clicked = sl.ScheduleEditor(model, example_inputs={"input_ids": ids}, world_size=2)
    typed = sl.ScheduleEditor(model, example_inputs={"input_ids": ids}, world_size=2)
    d = "encoder.layer.1.output.dense"
    clicked.select(d)
    clicked._param.value, clicked._axis.value = "weight", 1
    clicked._btn_shard.click()
    clicked._sync.value = ("fwd_post", "all_reduce")
    clicked._btn_sync.click()
    typed.schedule[d].shard("weight", 1)
    typed.schedule[d].sync("fwd_post", "all_reduce")
    assert clicked.code == typed.code != ""
    assert typed.code in _panel_text(typed._code.value)


def test_invalid_click_says_why_and_changes_nothing(bert):
    model, ids = bert
    ed = sl.ScheduleEditor(model, example_inputs={"input_ids": ids}, world_size=3)
    ed.select("encoder.layer.0.intermediate.dense")
    ed._param.value, ed._axis.value = "weight", 0
    ed._btn_shard.click()
    assert "not divisible by the world size 3" in ed.message
    assert "128" in ed.message
    assert ed.code == ""
    assert ed.schedule["encoder.layer.0.intermediate.dense"].mod.weight.shape == (128, 64)
    # the reason is also shown before clicking
    assert "not divisible" in ed._reasons.value


def test_sync_before_shard_is_refused(editor):
    editor.select("encoder.layer.0.output.dense")
    editor._sync.value = ("fwd_post", "all_reduce")
    editor._btn_sync.click()
    assert "no sharded parameters" in editor.message
    assert editor.code == ""


@pytest.mark.parametrize(
    "content",
    [
        {"event": "explode", "node": "n0"},
        {"node": "n0"},
        {"event": "click"},
        {"event": "click", "node": 42},
        {"event": "click", "node": "no-such-token"},
        "just a string",
        {"event": "click", "node": "x" * 100000},
    ],
)
def test_malformed_messages_are_reported_not_raised(editor, content):
    editor.apply("checkpoint", path="encoder.layer.0")
    before = editor.code
    _msg(editor._graph, content)
    assert editor.message.startswith("Ignored")
    assert len(editor.message) < 300
    assert editor.code == before


def test_folded_layers_expand(editor):
    editor.open_level("encoder.layer")
    nodes = set(editor._graph.node_ids.values())
    folded = [n for n, d in editor._last_graph.nodes(data=True) if d.get("kind") == "folded"]
    assert folded, "two BertLayers should fold into one node"
    assert editor._last_graph.nodes[folded[0]]["label"].startswith("BertLayer")
    _msg(editor._graph, {"event": "dblclick", "node": _token(editor, folded[0])})
    nodes = set(editor._graph.node_ids.values())
    assert {"encoder.layer.0", "encoder.layer.1"} <= nodes


def test_undo_redo_clear(editor):
    q = "encoder.layer.0.attention.self.query"
    editor.apply("shard", "weight", axis=0, path=q)
    editor.apply("checkpoint", path="encoder.layer.0")
    assert len(editor.schedule.record.calls) == 2
    assert editor.undo() is None
    assert editor.code == f'sch["{q}"].shard("weight", axis=0)'
    assert editor.schedule[q].mod.weight.shape == (32, 64)
    assert editor.redo() is None
    assert editor.code.endswith('sch["encoder.layer.0"].checkpoint()')
    assert editor.undo() is None and editor.undo() is None
    assert editor.schedule[q].mod.weight.shape == (64, 64)
    assert "Nothing to undo" in editor.undo()
    editor.apply("checkpoint", path="encoder.layer.1")  # a new action drops the redo stack
    assert "Nothing to redo" in editor.redo()
    editor.clear()
    assert editor.code == ""


def test_save_load_and_restore_from_schedule_file(bert, tmp_path):
    model, ids = bert
    f = tmp_path / "bert.schedule.json"
    ed = sl.ScheduleEditor(model, example_inputs={"input_ids": ids}, world_size=2, schedule_file=str(f))
    ed.apply("shard", "weight", axis=0, path="encoder.layer.0.intermediate.dense")
    ed.apply("checkpoint", path="encoder.layer.1")
    assert f.exists()
    # a "restarted kernel": a new editor on a freshly built model restores the work
    again = sl.ScheduleEditor(model, example_inputs={"input_ids": ids}, world_size=2, schedule_file=str(f))
    assert again.code == ed.code != ""
    assert "Restored 2 recorded calls" in again.message
    assert again.schedule["encoder.layer.0.intermediate.dense"].mod.weight.shape == (64, 64)
    # explicit save / load, and a wrong world size is refused without touching the schedule
    p = ed.save(str(tmp_path / "copy.json"))
    other = sl.ScheduleEditor(model, example_inputs={"input_ids": ids}, world_size=4)
    other.apply("checkpoint", path="encoder.layer.0")
    msg = other.load(p)
    assert "world size 2" in msg and other.code == 'sch["encoder.layer.0"].checkpoint()'
    fresh = sl.ScheduleEditor(model, example_inputs={"input_ids": ids}, world_size=2)
    assert fresh.load(p) is None and fresh.code == ed.code


def test_corrupt_or_future_schedule_file_is_refused_whole(bert, tmp_path):
    import json

    model, ids = bert
    ed = sl.ScheduleEditor(model, example_inputs={"input_ids": ids}, world_size=2)
    ed.apply("checkpoint", path="encoder.layer.0")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert ed.load(str(bad)) is not None
    future = tmp_path / "future.json"
    good = json.loads(Path(ed.save(str(tmp_path / "good.json"))).read_text())
    good["version"] = 999
    future.write_text(json.dumps(good))
    assert "newer" in ed.load(str(future))
    half = tmp_path / "half.json"
    good = json.loads((tmp_path / "good.json").read_text())
    good["calls"].append({"path": "encoder.layer.0", "primitive": "checkpoint", "args": [], "kwargs": {}})
    half.write_text(json.dumps(good))
    msg = ed.load(str(half))
    assert msg is not None and "already checkpointed" in msg
    assert ed.code == 'sch["encoder.layer.0"].checkpoint()'


def test_apply_to_all_similar_is_all_or_nothing(editor):
    q = "encoder.layer.0.attention.self.query"
    assert editor.similar(q) == [q, "encoder.layer.1.attention.self.query"]
    editor.select(q)
    editor._similar.value = True
    editor._param.value, editor._axis.value = "weight", 0
    editor._btn_shard.click()
    assert editor.code.splitlines() == [
        f'sch["{q}"].shard("weight", axis=0)',
        'sch["encoder.layer.1.attention.self.query"].shard("weight", axis=0)',
    ]
    # layer 1's key already sharded by hand: the similar-apply on layer 0's key must change nothing
    editor._similar.value = False
    editor.apply("shard", "weight", axis=0, path="encoder.layer.1.attention.self.key")
    n = len(editor.schedule.record.calls)
    editor._similar.value = True
    editor.select("encoder.layer.0.attention.self.key")
    editor._param.value, editor._axis.value = "weight", 0
    editor._btn_shard.click()
    assert "Not applied to any of the 2 similar modules" in editor.message
    assert len(editor.schedule.record.calls) == n


def test_search_filters_tree(editor):
    n = editor.search("BertSelfAttention")
    assert n == 2
    assert all("attention.self" in p for _, p in editor._tree.options)
    assert editor.search("") == len(editor._tree.options) == 4  # the collapsed tree again: model + 3 children


def test_presets_record_calls_and_undo(editor):
    assert editor.apply_preset("megatron") is None
    code = editor.code
    assert 'sch["encoder.layer.1.output.dense"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")' in code
    assert "Preset megatron recorded" in editor.message
    assert editor.apply_preset("checkpoint", 2) is None
    assert editor.code.endswith('sch["encoder.layer.0"].checkpoint()')
    assert editor.apply_preset("megatron") is None  # presets compose: everything is there already
    assert editor.message.startswith("Preset megatron added nothing: the schedule has it all.")
    assert editor.code.endswith('sch["encoder.layer.0"].checkpoint()')
    assert "unknown preset" in editor.apply_preset("nonsense")


def test_costs_update_live(editor):
    before = editor.memory_plan.per_stage[0]["param_bytes"]
    assert "Busiest rank needs" in editor._costs_text.value and "<svg" in editor._costs.value
    editor.apply("shard", "weight", axis=0, path="encoder.layer.0.intermediate.dense")
    assert "activations not estimated" in editor._costs_text.value  # the bias is not sharded yet
    editor.apply("shard", "bias", axis=0, path="encoder.layer.0.intermediate.dense")
    editor.apply("shard", "weight", axis=1, path="encoder.layer.0.output.dense")  # the row-parallel partner
    after = editor.memory_plan.per_stage[0]["param_bytes"]
    assert before - after == ((128 * 64 + 128) // 2 + 64 * 128 // 2) * 4
    assert editor.memory_plan.per_stage[0]["activation_bytes"] > 0
    editor._gpu.value = 141e9
    assert "141 GB" in editor._costs.value


def test_graph_styles_folded_badges_stage_bands_and_legend(editor):
    editor.apply("checkpoint", path="encoder.layer.0")
    editor.open_level("encoder")
    folded = next(n for n, d in editor._last_graph.nodes(data=True) if d.get("kind") == "folded")
    st = editor._folded_style(editor._last_graph.nodes[folded]["members"], None)
    assert "ckpt 1/2" in st["badges"]
    assert "ckpt 1/2" in editor._graph.svg
    editor.apply("cut_pipeline_stage", path="encoder.layer.0")
    assert "stages 0–1" in editor._graph.svg  # the folded run spans both stages
    editor.open_level("")
    assert "stage 0" in editor._graph.svg and "stage 1" in editor._graph.svg  # embeddings / pooler
    assert "<svg" in editor._legend.value and "stage 1 (band on the left)" in editor._legend.value


def test_fold_back_and_per_rank_tooltips(editor):
    editor.open_level("encoder")
    folded = next(n for n, d in editor._last_graph.nodes(data=True) if d.get("kind") == "folded")
    editor._on_node_dblclick(folded)
    assert "encoder.layer.0" in editor._graph.node_ids.values()
    fold = [b for b in editor._crumbs.children if b.description == "fold repeats"]
    assert fold
    fold[0].click()
    assert "encoder.layer.0" not in editor._graph.node_ids.values() and not editor.expanded
    editor.apply("shard", "weight", axis=0, path="encoder.layer.0.intermediate.dense")
    editor.open_level("encoder.layer.0.intermediate")
    assert "4,224 on this rank" in editor._graph.svg  # half of the 128×64 weight + the whole bias (tooltip)


# --- the Export form -------------------------------------------------------------------------------
def _defaults_of(script):
    """The options the ``CONFIG = TrainConfig(...)`` literal of an exported script sets (read without running it)."""
    import ast

    from slapo_lab.train.config import TrainConfig

    tree = ast.parse(Path(script).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["CONFIG"]:
            return TrainConfig.from_literal(ast.unparse(node.value)).changed()
    raise AssertionError("no CONFIG in the script")


def _one_sentence(text):
    assert "\n" not in text and text.endswith("."), text
    return text


@pytest.fixture(scope="module")
def pretrained_llama(tmp_path_factory):
    """``(folder, model)``: a tiny Llama written with save_pretrained (+ a tokenizer and a corpus in the same
    folder), read back with from_pretrained."""
    from train_fixtures import write_corpus, write_pretrained, write_tokenizer
    from transformers import LlamaForCausalLM

    folder = tmp_path_factory.mktemp("llama")
    corpus = write_corpus(folder, n_docs=40)
    write_tokenizer(folder / "tiny", [corpus])
    write_pretrained(folder / "tiny")
    return folder, LlamaForCausalLM.from_pretrained(str(folder / "tiny"))


def test_export_form_bakes_options_into_the_script(
    pretrained_llama, monkeypatch, run_bounded, subprocess_env
):
    import sys

    import torch

    folder, model = pretrained_llama
    monkeypatch.chdir(folder)
    ids = torch.randint(0, 256, (2, 16))
    ed = sl.ScheduleEditor(model, example_inputs={"input_ids": ids}, world_size=2)
    # defaults: the from_pretrained directory, synthetic data, the example's sequence length and batch
    assert ed._f_model.value == str(folder / "tiny")
    assert (ed._f_data.value, ed._f_seq.value, ed._f_batch.value, ed._f_dp.value) == (
        "synthetic",
        "16",
        "2",
        "1",
    )
    assert ed._f_fsdp.layout.display != "none" and ed._f_zero.layout.display == "none"
    ed._f_data.value = "corpus.jsonl"
    ed._f_seq.value = "32"
    ed._f_dp.value = "2"
    ed._f_fsdp.value = True
    ed._f_batch.value = "4"
    ed._f_steps.value = "3"
    ed._f_ckpt.value = "ckpt"
    ed._f_ckpt_every.value = "2"
    ed._f_save_hf.value = "trained"
    ed._export_path.value = "train_tiny.py"
    # the memory view follows dp and FSDP
    assert ed.memory_plan.dp == 2 and ed.memory_plan.shard == "fsdp"
    assert "TP 2 × DP 2, FSDP = 4 GPUs" in ed._costs_text.value
    ed._btn_export.click()
    assert ed.message.startswith(
        f"Exported {folder / 'train_tiny.py'} — launch: "
        "torchrun --nproc_per_node=4 train_tiny.py --device cuda"
    ), ed.message
    assert "torchrun --nproc_per_node=4 train_tiny.py --device cuda" in ed._export_info.value
    assert _defaults_of(folder / "train_tiny.py") == {
        "model_path": str(folder / "tiny"),
        "data": "corpus.jsonl",
        "seq_len": 32,
        "dp": 2,
        "fsdp": True,
        "checkpoint_dir": "ckpt",
        "checkpoint_every": 2,
        "save_hf": "trained",
        "global_batch_size": 4,
        "steps": 3,
    }
    assert ed.export_options["options"]["dp"] == 2 and ed.export_options["launcher"] == "torchrun"
    out = run_bounded([sys.executable, "train_tiny.py", "--help"], 120, cwd=folder, env=subprocess_env)
    assert out.returncode == 0, out.stderr
    assert "--model-path" in out.stdout and "corpus.jsonl" in out.stdout  # the baked default shows in --help

    # deepspeed: a ZeRO stage instead of FSDP, and the deepspeed launch
    ed._f_launcher.value = "deepspeed"
    assert ed._f_fsdp.layout.display == "none" and ed._f_zero.layout.display != "none"
    assert ed.memory_plan.shard is None
    ed._f_zero.value = 2
    assert ed.memory_plan.shard == "zero2" and "ZeRO-2" in ed._costs_text.value
    ed._btn_export.click()
    assert "deepspeed --num_gpus 4 train_tiny.py --device cuda" in ed.message, ed.message
    defaults = _defaults_of(folder / "train_tiny.py")
    assert defaults["zero"] == 2 and "fsdp" not in defaults


def test_export_form_refuses_bad_input_in_one_sentence_and_keeps_it(editor, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "train_bertmodel.py"
    cases = [
        ("_f_data", "missing.jsonl", "The data path missing.jsonl does not exist"),
        ("_f_model", "no_such_dir", "The model path no_such_dir does not exist"),
        ("_f_dp", "0", "must be positive, not 0"),
        ("_f_dp", "two", "must be a whole number, not 'two'"),
        ("_f_seq", "-8", "The sequence length must be positive"),
        ("_f_steps", "-1", "The number of steps must be zero or more"),
        ("_f_ckpt_every", "5", "A checkpoint every 5 steps needs a checkpoint directory"),
    ]
    for name, value, expected in cases:
        widget = getattr(editor, name)
        before = widget.value
        widget.value = value
        editor._btn_export.click()
        assert expected in _one_sentence(editor.message), (name, editor.message)
        assert expected in _panel_text(editor._export_info.value)
        assert widget.value == value  # what was typed stays
        assert not script.exists()
        widget.value = before
    editor._f_dp.value = "2"
    editor._f_batch.value = "3"
    editor._btn_export.click()
    assert _one_sentence(editor.message) == (
        "The global batch size 3 is not divisible by dp 2: every replica takes "
        "the same number of sequences per step."
    )
    assert (editor._f_dp.value, editor._f_batch.value) == ("2", "3") and not script.exists()
    # BERT has no language-model head: text data is refused before anything is written
    (tmp_path / "corpus.txt").write_text("some text\n")
    editor._f_batch.value = "4"
    editor._f_data.value = "corpus.txt"
    editor._btn_export.click()
    assert "no language-model head" in _one_sentence(editor.message) and not script.exists()
    editor._f_data.value = "synthetic"
    editor._btn_export.click()
    assert editor.message.startswith("Exported") and _defaults_of(script) == {"dp": 2, "global_batch_size": 4}
    # a pipeline: the runtime's micro-batches (global batch / (dp x stages), rounded down) must divide evenly
    # (a cut after the last of the 2 layers too would leave an empty third stage: the numeric check refuses it)
    assert editor.apply("cut_pipeline_stage", path="encoder.layer.0") is None
    editor._f_batch.value = "14"
    editor._btn_export.click()
    assert _one_sentence(editor.message) == (
        "The global batch size 14 does not split into equal micro-batches over "
        "dp 2 and 2 pipeline stages; choose a multiple of 4."
    )
    editor._f_batch.value = "12"
    editor._btn_export.click()
    assert "torchrun --nproc_per_node=8 train_bertmodel.py --device cuda" in editor.message, (
        editor.message
    )  # tp 2 x pp 2 x dp 2
    assert editor.apply("cut_pipeline_stage", path="encoder.layer.1") is None
    editor._btn_export.click()
    assert re.match(
        r"Not exported: the pipeline cannot be built from this schedule: The \d cuts", editor.message
    )


def test_export_from_python_remembers_options_in_the_schedule_file(bert, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, ids = bert
    f = tmp_path / "bert.schedule.json"
    ed = sl.ScheduleEditor(model, example_inputs={"input_ids": ids}, world_size=2, schedule_file=str(f))
    assert ed.export_options is None
    ed.apply("checkpoint", path="encoder.layer.0")
    out = ed.export("train.py")  # today's call: no options, a synthetic-data script
    assert out == str(tmp_path / "train.py") and _defaults_of(out) == {}
    assert "torchrun --nproc_per_node=2 train.py --device cuda" in ed.message
    ed.export("train_ds.py", launcher="deepspeed", dp=2, zero=1, global_batch_size=4, steps=0)
    assert _defaults_of("train_ds.py") == {"dp": 2, "zero": 1, "global_batch_size": 4, "steps": 0}
    assert "deepspeed --num_gpus 4 train_ds.py --device cuda" in ed.message
    # the form shows what the export used, and the memory view plans it
    assert (ed._f_launcher.value, ed._f_dp.value, ed._f_zero.value, ed._export_path.value) == (
        "deepspeed",
        "2",
        1,
        "train_ds.py",
    )
    assert ed.memory_plan.dp == 2 and ed.memory_plan.shard == "zero1"
    for bad, match in [
        ({"zero": 1}, "needs the deepspeed launcher"),
        ({"shards": 2}, "not an export option"),
        ({"dp": 0}, "must be positive"),
        ({"global_batch_size": 3, "dp": 2}, "not divisible"),
    ]:
        with pytest.raises(sl.export.ExportError, match=match):
            ed.export("bad.py", **bad)
    assert not (tmp_path / "bad.py").exists()
    # a restarted kernel: the schedule file brings the options back into the form
    import json

    assert json.loads(f.read_text())["meta"]["export_options"]["options"]["zero"] == 1
    again = sl.ScheduleEditor(model, example_inputs={"input_ids": ids}, world_size=2, schedule_file=str(f))
    assert again.export_options == ed.export_options
    assert (again._f_launcher.value, again._f_dp.value, again._f_zero.value, again._f_steps.value) == (
        "deepspeed",
        "2",
        1,
        "0",
    )
    assert again.memory_plan.shard == "zero1"


def test_verify_uses_local_model_and_data_or_says_synthetic(editor, tmp_path, monkeypatch):
    from slapo_lab.editor.verify_runner import VerifyRunner

    started = []
    monkeypatch.setattr(
        VerifyRunner,
        "start",
        lambda self, script, nproc, dev, timeout=0, extra=None, note="": started.append(
            (script, nproc, note)
        ),
    )
    monkeypatch.chdir(tmp_path)
    editor._f_dp.value = "2"
    editor._f_ckpt.value = "ckpt"
    editor._f_data.value = "elsewhere/corpus.jsonl"  # exists only on the cluster
    editor.verify(device="cpu")
    script, nproc, note = started[-1]
    assert nproc == 4  # tp 2 x dp 2
    assert (
        "Verify uses seeded random weights and synthetic data, because the data path elsewhere/corpus.jsonl "
        "does not exist here."
    ) in note and note in editor.message
    assert _defaults_of(script) == {"dp": 2}  # no checkpoints, no data
    assert editor._f_data.value == "elsewhere/corpus.jsonl"
    editor._f_dp.value = "x"
    assert editor.verify(device="cpu") is None and "Verify could not start: " in editor.message
    assert len(started) == 1
