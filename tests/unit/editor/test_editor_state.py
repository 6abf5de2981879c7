"""The editor's state without widgets (slapo_lab.editor.state.EditorState): driven by calls, read by hooks."""

import json
import subprocess
import sys
import textwrap

import torch

from slapo_lab.editor import EditorState
from slapo_lab.train.config import TrainConfig

Q = "encoder.layer.0.attention.self.query"


class Recorder(EditorState):
    """An EditorState whose hooks write down what a view would draw."""

    def __init__(self, *args, **kwargs):
        self.events: list[tuple] = []
        super().__init__(*args, **kwargs)

    def _refresh_all(self, reset_view=False):
        self.events.append(("all", len(self.schedule.record.calls)))

    def _refresh_view(self, reset_view=False):
        self.events.append(("view", self.level, self.selected))

    def _refresh_history(self):
        self.events.append(("history", len(self.schedule.record.actions()), len(self._redo)))

    def _show_message(self, text, error):
        self.events.append(("message", text, error))

    def _set_busy(self, busy, restore=None):
        self.events.append(("busy", busy))
        return "token" if busy else None

    def _show_file_bar(self, show):
        self.events.append(("file bar", show))

    def kinds(self):
        return [e[0] for e in self.events]


def test_the_state_imports_and_runs_without_widgets(tmp_path):
    """A script drives a BERT schedule through the state alone: ipywidgets is never imported."""
    code = textwrap.dedent(
        """
        import json, sys
        import torch
        from transformers import BertConfig, BertModel
        from slapo_lab.editor import EditorState

        torch.manual_seed(0)
        cfg = BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                         vocab_size=120, max_position_embeddings=64)
        st = EditorState(BertModel(cfg), {"input_ids": torch.randint(0, 120, (2, 16))}, world_size=2)
        out = {"select": st.select("encoder.layer.0.attention.self.query")}
        out["shard"] = st.apply("shard", "weight", axis=0)
        out["msg1"] = st.message
        out["preset"] = st.apply_preset("megatron")
        out["msg2"] = st.message
        out["calls"] = len(st.schedule.record.calls)
        out["undo"] = st.undo()
        out["after_undo"] = len(st.schedule.record.calls)
        out["redo"] = st.redo()
        out["check"] = [f.message for f in st.check()]
        out["widgets"] = sorted(m for m in sys.modules if m.split(".")[0] in ("ipywidgets", "traitlets", "comm"))
        print("RESULT " + json.dumps(out))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    out = json.loads(line[len("RESULT ") :])
    assert out["widgets"] == [], out["widgets"]
    assert out["select"] is None and out["shard"] is None and out["preset"] is None
    assert out["msg1"] == f'Applied sch["{Q}"].shard("weight", axis=0)', out["msg1"]
    assert out["msg2"].startswith("Preset megatron recorded"), out["msg2"]  # it skips the typed shard
    assert out["after_undo"] == 1 and out["undo"] is None and out["redo"] is None
    assert out["check"] == []  # the preset plus the shard is the whole model split, nothing open


def test_an_action_is_one_busy_span_one_redraw_and_one_message(bert):
    model, ids = bert
    st = Recorder(model, {"input_ids": ids}, world_size=2)
    assert st.kinds()[0] == "all"  # the first drawing
    st.events.clear()
    assert st.apply_preset("megatron") is None
    kinds = st.kinds()
    assert kinds.count("all") == 1, st.events  # dozens of calls, one redraw
    assert kinds.index("busy") < kinds.index("all") < len(kinds) - 1 - kinds[::-1].index("busy")
    assert ("busy", True) in st.events and ("busy", False) in st.events
    working = [e for e in st.events if e[0] == "message" and e[1].startswith("Working: preset megatron")]
    assert working and st.events[-1][0] == "message" and st.events[-1][1].startswith("Preset megatron")
    assert st.message == st.events[-1][1] and not st.events[-1][2]


def test_a_refusal_is_one_sentence_offers_its_resolving_click_and_changes_nothing(bert):
    model, ids = bert
    st = Recorder(model, {"input_ids": ids}, world_size=2)
    st.apply("shard", "weight", axis=1, path=Q)  # conflicts with megatron's column split of the query
    before = list(st.schedule.record.calls)
    st.events.clear()
    why = st.apply_preset("megatron")
    assert why and why.startswith("The megatron preset was not applied") and why.count(". ") <= 1, why
    assert st.schedule.record.calls == before  # all or nothing
    assert st.events[-1] == ("message", why, True)
    assert st.resolve_label.startswith("Undo: shard on " + Q), st.resolve_label
    st._resolve()  # the offered click
    assert not st.schedule.record.calls and st.resolve_label == ""
    assert st.apply_preset("megatron") is None


def test_bad_input_is_one_sentence_and_the_schedule_survives(bert):
    model, ids = bert
    st = EditorState(model, {"input_ids": ids}, world_size=2)
    st.apply("checkpoint", path="encoder.layer.0")
    calls = list(st.schedule.record.calls)
    for act in (
        lambda: st.select("no.such.module"),
        lambda: st.apply("shard", "weight", axis=5, path=Q),
        lambda: st.apply(42, path=Q),
        lambda: st.open_level("pooler.dense"),
        lambda: st.set_tp(0),
        lambda: st.set_cluster(0, 8),
    ):
        why = act()
        assert isinstance(why, str) and why.endswith(".") and "\n" not in why, why
        assert st.message == why
    assert st.schedule.record.calls == calls


def test_navigation_redraws_the_view_only(bert):
    model, ids = bert
    st = Recorder(model, {"input_ids": ids}, world_size=2)
    st.events.clear()
    assert st.open_level("encoder") is None
    assert st.select("encoder.layer.1") is None
    assert set(st.kinds()) == {"view"}, st.events
    assert (st.level, st.selected) == ("encoder", "encoder.layer.1")


def test_apply_to_similar_is_one_action_and_resets(bert):
    model, ids = bert
    st = EditorState(model, {"input_ids": ids}, world_size=2)
    st.select("encoder.layer.0")
    st.apply_to_similar = True
    assert st.apply("checkpoint") is None
    assert st.apply_to_similar is False
    assert st.code.splitlines() == [
        'sch["encoder.layer.0"].checkpoint()',
        'sch["encoder.layer.1"].checkpoint()',
    ]
    assert "2 similar modules" in st.message
    st.undo()
    assert st.code == ""


class _Counted(torch.nn.Module):
    """A block whose forward reads a call counter when ``stateful``: recomputing it in backward (checkpoint)
    sees another count, so its gradients change; the plain blocks of the same class are safe to checkpoint."""

    def __init__(self, stateful: bool, inner: int):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, inner), torch.nn.Linear(inner, 16)
        self.stateful, self.calls = stateful, 0

    def forward(self, x):
        self.calls += 1
        h = torch.relu(self.fc1(x))
        if self.stateful:
            h = h * (1 + self.calls % 2)
        return x + self.fc2(h)


class _Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            [_Counted(False, 32), _Counted(True, 48)]
        )  # widths apart: the check keeps both

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_apply_to_similar_is_refused_when_spreading_it_breaks_the_model():
    """On the plain block alone the checkpoint passes the numeric check; on both similar blocks it fails (the
    stateful one recomputes with another count): one sentence, nothing recorded; a plain click still works."""
    torch.manual_seed(0)
    st = EditorState(_Stack(), {"x": torch.randn(2, 4, 16)}, world_size=1)
    st.select("blocks.0")
    st.apply_to_similar = True
    why = st.apply("checkpoint")
    assert why is not None and why.startswith("Not applied to the 2 similar modules: on blocks.0 alone"), why
    assert "fails" in why and st.code == ""
    assert st.apply("checkpoint") is None and st.code == 'sch["blocks.0"].checkpoint()'


def test_tp_degree_replays_and_the_cluster_shape_is_checked(bert):
    model, ids = bert
    st = EditorState(model, {"input_ids": ids}, world_size=2)
    assert st.apply_preset("megatron") is None
    n = len(st.schedule.record.calls)
    assert st.set_tp(4) is None and st.world_size == 4
    assert len(st.schedule.record.calls) == n
    assert st.schedule[Q].mod.weight.shape == (16, 64)  # 64 rows over 4 ranks
    why = st.set_tp(3)  # 4 heads do not divide by 3: stays at 4
    assert why and why.startswith("The schedule stays at TP 4") and st.world_size == 4, why
    assert st.set_cluster(1, 8) is None  # 2 replicas of TP 4
    assert st.set_cluster(1, 2) is not None  # one replica needs 4 GPUs


def test_the_schedule_file_is_kept_and_an_outside_change_is_never_overwritten(bert, tmp_path):
    model, ids = bert
    path = tmp_path / "sch.json"
    st = Recorder(model, {"input_ids": ids}, world_size=2, schedule_file=str(path))
    st.apply("checkpoint", path="encoder.layer.0")
    st.apply("checkpoint", path="encoder.layer.1")
    again = EditorState(model, {"input_ids": ids}, world_size=2, schedule_file=str(path))
    assert again.code == st.code and "Restored 2 recorded calls" in again.message
    assert again.undo() is None and again.code == 'sch["encoder.layer.0"].checkpoint()'  # undo per action
    # `again` rewrote the file: `st`'s next change must not overwrite it
    st.events.clear()
    st.apply("checkpoint", path="pooler")
    assert ("file bar", True) in st.events and "changed outside this editor" in st.message
    assert json.loads(path.read_text())["calls"][-1]["path"] == "encoder.layer.0"
    assert st.keep_mine() is None and ("file bar", False) in st.events


def test_undo_in_a_kernel_replays_onto_the_spare_copy_made_in_the_background(bert):
    """In a kernel the background work ends by making the meta copy the next undo starts from, so an undo only
    replays (the copy was a third of an undo at 70B); outside one, the rebuild copies the model itself."""
    import asyncio

    import slapo_lab as sl

    model, ids = bert
    loop = asyncio.new_event_loop()

    def in_kernel(fn, *args, **kwargs):
        async def handler():
            return fn(*args, **kwargs)

        out = loop.run_until_complete(handler())
        loop.run_until_complete(asyncio.sleep(0))
        return out

    try:
        ed = in_kernel(lambda: sl.ScheduleEditor(model, {"input_ids": ids}, world_size=2, live_check=False))
        ed.BACKGROUND_DEBOUNCE = 0.0
        assert in_kernel(ed.apply_preset, "megatron") is None
        assert in_kernel(ed.apply, "checkpoint", path="encoder.layer.0") is None
        assert ed.wait_background(60)
        spare = ed._spare
        assert spare is not None and spare is not ed._meta_model
        assert all(p.device.type == "meta" for p in spare.parameters())
        assert in_kernel(ed.undo) is None
        assert ed._meta_model is spare  # replayed onto the spare copy
        assert ed.schedule[Q].mod.weight.shape == (32, 64)  # the sharded model, minus the undone call
        assert "checkpoint" not in ed.code
        assert ed.wait_background(60) and ed._spare is not None and ed._spare is not spare  # made again
    finally:
        loop.close()
    st = EditorState(model, {"input_ids": ids}, world_size=2)  # no kernel: no background, no spare
    st.apply("checkpoint", path="pooler")
    assert st.undo() is None and st._spare is None


def test_in_a_kernel_the_constructors_garbage_collection_runs_after_the_cell():
    """gc_deferred: off inside the block; inside a running loop still off after it and back on (having
    collected) ``delay`` seconds later; without a loop, or when the block raises, back on at once."""
    import asyncio
    import gc
    import time

    import pytest

    from slapo_lab.utils import collector
    from slapo_lab.utils.collector import gc_deferred

    deadline = (
        time.monotonic() + 5
    )  # an editor built in a loop by the test before turns it back on within 1 s
    while not gc.isenabled() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gc.isenabled()
    with gc_deferred(None):
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError), gc_deferred(asyncio.new_event_loop()):
        raise ValueError("x")
    assert gc.isenabled()

    # an earlier deferral's timer thread collects right after it turns the collector back on, holding the GIL
    # for as long as a full collection of this process takes: let it finish before timing a new one
    time.sleep(0.1)
    gc.collect()

    full = []

    def seen(phase, info):
        if phase == "stop" and info["generation"] == 2:
            full.append(time.monotonic())

    async def cell():
        with gc_deferred(asyncio.get_running_loop(), delay=0.2):
            assert not gc.isenabled()
        handed = time.monotonic()

        # the deferral still holds the collector, unless this thread was held up past the delay (another thread's
        # collection holds the GIL). Read from the holds, not gc.isenabled(): a library that turns the collector
        # off and on itself (DeepSpeed's engines, torch's state_dict helpers) in another thread flips the flag
        # under any hold
        def pending() -> bool:
            return collector._gc_holds >= 1 or time.monotonic() - handed >= 0.2

        assert pending()  # the cell's view is sent first
        await asyncio.sleep(0.05)
        assert pending()
        # back on, having collected once, after the delay (the collection itself can take a while in a big process)
        end = time.monotonic() + 5
        while not (collector._gc_holds == 0 and any(t >= handed for t in full)) and time.monotonic() < end:
            await asyncio.sleep(0.05)
        return (collector._gc_holds, gc.isenabled(), any(t >= handed for t in full))

    loop = asyncio.new_event_loop()
    gc.callbacks.append(seen)
    try:
        assert loop.run_until_complete(cell()) == (0, True, True)
    finally:
        gc.callbacks.remove(seen)
        loop.close()
    with gc_deferred(loop, delay=0.1):  # the loop closed: the timer turns the collector back on all the same
        pass
    time.sleep(0.5)
    assert gc.isenabled()


def test_a_dataflow_recorded_in_another_thread_does_not_turn_the_collector_on_under_a_held_block():
    """record_dataflow pauses the collector with a counted hold, as gc_paused does, not gc.disable()/enable():
    a pass that started before a block took its hold (a background thread's) must not turn the collector back
    on inside that block when it ends. With the raw pair, the block saw the collector off, took no hold, and
    the pass's end turned it on under it."""
    import gc
    import threading
    import time

    from torch import nn

    from slapo_lab.graph.dataflow import record_dataflow
    from slapo_lab.utils.collector import gc_paused

    entered, go = threading.Event(), threading.Event()
    deadline = time.monotonic() + 5  # a deferral left by an editor built in a loop before ends within 1 s
    while not gc.isenabled() and time.monotonic() < deadline:
        time.sleep(0.05)

    class Waits(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            entered.set()
            go.wait(10)
            return self.lin(x)

    assert gc.isenabled()
    t = threading.Thread(target=record_dataflow, args=(Waits(), (torch.zeros(2, 4),)))
    t.start()
    try:
        assert entered.wait(10)
        assert not gc.isenabled()  # the pass holds it off
        with gc_paused():
            go.set()
            t.join(10)
            assert not t.is_alive()
            assert not gc.isenabled()  # the pass ended inside the block: the block's hold keeps it off
        assert gc.isenabled()
    finally:
        go.set()
        t.join(10)


def test_an_action_that_leaves_many_objects_runs_the_collection_they_bring_on_at_its_end():
    """gc_paused(settle=True): a block that leaves more new objects than an eighth of the oldest generation runs
    one full collection at its end (so the click after a preset does not); a click-sized block runs none; two
    blocks under the bound alone but past it together (a script's editor and its preset) collect at the second's
    end; and a gc_deferred resume that falls inside a paused block waits for the block's end, then collects
    there."""
    import asyncio
    import gc
    import time

    from slapo_lab.utils.collector import gc_deferred, gc_paused

    full = []

    def seen(phase, info):
        if phase == "stop" and info["generation"] == 2:
            full.append(time.monotonic())

    small = many = None
    gc.collect()
    gc.callbacks.append(seen)
    try:
        with gc_paused(settle=True):
            small = [[] for _ in range(1000)]
        assert gc.isenabled() and not full  # a click's worth: nothing collected
        with gc_paused(settle=True):
            many = [[] for _ in range(len(gc.get_objects(generation=2)) // 4)]
            assert not full
        assert gc.isenabled() and len(full) == 1  # collected once, at the end
        full.clear()
        n = len(gc.get_objects(generation=2)) // 8 * 7 // 10  # 70 % of an eighth of the oldest generation
        with gc_paused(settle=True):
            first = [[] for _ in range(n)]
        assert not full  # one block under the bound: nothing collected
        with gc_paused(settle=True):
            second = [[] for _ in range(n)]
        assert len(full) == 1 and len(first) == len(second)  # both past it: the second pays for the two
        full.clear()

        async def cell():
            with gc_deferred(asyncio.get_running_loop(), delay=0.1):
                pass

        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(cell())
        finally:
            loop.close()
        assert not gc.isenabled()
        with gc_paused():  # an action that outlasts the deferral
            time.sleep(0.4)
            assert not gc.isenabled() and not full  # the resume waits for the action
            end = time.monotonic()
        assert gc.isenabled() and len(full) == 1 and full[0] >= end  # the promised collection, at its end
    finally:
        gc.callbacks.remove(seen)
        del small, many


def test_export_is_the_widgets_export_and_its_launch_line_fits_this_machine(bert, tmp_path, monkeypatch):
    """Issue 24: the state has export (one implementation with the widget's), and the message's launch line
    says --device cpu where this machine lacks the GPUs (and the GPU launch beside it)."""
    import ast

    from slapo_lab.editor import ScheduleEditor

    assert ScheduleEditor.export is EditorState.export  # the widget's export is the state's (not a copy)
    model, ids = bert
    st = Recorder(model, {"input_ids": ids}, world_size=2)
    st.apply_preset("megatron")
    monkeypatch.chdir(tmp_path)
    out = st.export("train_bert.py", dp=2, steps=3)
    assert out == str(tmp_path / "train_bert.py")
    tree = ast.parse((tmp_path / "train_bert.py").read_text())
    defaults = next(
        TrainConfig.from_literal(ast.unparse(n.value)).changed()
        for n in tree.body
        if isinstance(n, ast.Assign) and n.targets[0].id == "CONFIG"
    )
    assert defaults == {"dp": 2, "steps": 3} and st.export_options["options"] == {"dp": 2, "steps": 3}
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 4:
        assert st.message.startswith(
            f"Exported {out} — launch: torchrun --nproc_per_node=4 train_bert.py --device cuda"
        )
        assert "torchrun --nproc_per_node=4 --master_addr=127.0.0.1 train_bert.py --device cpu" in st.message
    # the launch line for each machine
    assert (
        st._launch_command("train_bert.py", "torchrun", 2, gpus=8)
        == "torchrun --nproc_per_node=4 train_bert.py --device cuda"
    )
    cpu = st._launch_command("train_bert.py", "torchrun", 2, gpus=0)
    assert cpu.endswith(
        "(no CUDA): torchrun --nproc_per_node=4 --master_addr=127.0.0.1 train_bert.py --device cpu"
    )
    # a refused export is one sentence and writes nothing
    import pytest

    from slapo_lab.export import ExportError

    with pytest.raises(ExportError, match="not divisible by dp 3"):
        st.export("bad.py", dp=3, global_batch_size=4)
    assert not (tmp_path / "bad.py").exists()


def test_the_editor_imports_no_training_data_module():
    # the training runtime's data module imports transformers' collators and tokenizers (0.38 s of a cold
    # editor's imports under python -X importtime); the Export form needs only the objective, whose home is the spec
    code = "import sys, slapo_lab.editor; print(sorted(m for m in ('slapo_lab.train.data', 'datasets') if m in sys.modules))"
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", proc.stdout


def test_importing_the_editor_in_a_cell_defers_its_collection_to_after_the_cell_once():
    # a restarted kernel's first cell imports the editor: the full collection its ~10^5 new objects bring on runs
    # a second after the cell (gc_deferred), not inside it; a later lookup of ScheduleEditor takes no hold
    code = textwrap.dedent(
        """
        import asyncio, gc, time
        import torch, transformers  # the heap a notebook holds before it imports the editor

        full = []
        gc.callbacks.append(lambda phase, info: phase == "stop" and info["generation"] == 2 and full.append(1))

        async def cell():
            import slapo_lab.editor
            from slapo_lab.editor import ScheduleEditor
            return gc.isenabled(), len(full)

        async def later_cell():
            from slapo_lab.editor import ScheduleEditor
            return gc.isenabled()

        loop = asyncio.new_event_loop()
        on_in_cell, collected_in_cell = loop.run_until_complete(cell())
        time.sleep(1.5)
        print(on_in_cell, collected_in_cell, gc.isenabled(), len(full) >= 1, loop.run_until_complete(later_cell()))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["False", "0", "True", "True", "True"], proc.stdout
