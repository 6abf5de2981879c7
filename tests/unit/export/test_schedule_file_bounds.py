"""Big schedule files (issue 18): a file over the bound is refused quickly, in one sentence, and the
editor keeps its schedule; a file at the bound is read. The speed of what is allowed is a benchmark
figure (``benchmarks/schedule_load_bench.py``), not a timed test. Also the pieces the load leans on:
binding without ``inspect`` binds exactly as ``Signature.bind`` does, and a record of one action per
call groups in linear time."""

from __future__ import annotations

import gc
import itertools
import json
import re
import time

import pytest

import slapo_lab as sl
from slapo_lab.export import ExportError
from slapo_lab.export import io as schedule_io
from slapo_lab.record import SCHEMA, SCHEMA_VERSION, Call, Recorder, format_call
from slapo_lab.utils.collector import gc_paused


def _write_compact(path, n: int):
    """``n`` valid ``annotate`` calls on the conftest BERT as compact JSON (about 110 bytes a call)."""
    calls = [
        {
            "path": f"encoder.layer.{i % 2}.output.dense",
            "primitive": "annotate",
            "args": ["weight", "tag", i],
            "kwargs": {},
        }
        for i in range(n)
    ]
    data = {"schema": SCHEMA, "version": SCHEMA_VERSION, "meta": {"world_size": 2}, "calls": calls}
    path.write_text(json.dumps(data, separators=(",", ":")), encoding="utf-8")
    return path


def _one_sentence(text: str) -> str:
    assert "\n" not in text and text.endswith("."), text
    assert len(re.findall(r"[.;]\s+[A-Z]", text)) == 0, text  # one sentence, not two glued together
    return text


def test_a_file_over_the_call_bound_is_refused_in_one_sentence_before_validation(
    editor, tmp_path, monkeypatch
):
    limit = schedule_io.MAX_SCHEDULE_CALLS
    path = _write_compact(tmp_path / "big.json", limit + 1)
    assert path.stat().st_size < schedule_io.MAX_SCHEDULE_BYTES  # the count, not the size, is over
    editor.apply("checkpoint", path="encoder.layer.0")
    before = (editor.code, len(editor.schedule.record.calls), editor.schedule.record.actions())

    def no_validation(*_a, **_k):
        raise AssertionError("the calls of a file over the bound were validated")

    monkeypatch.setattr(schedule_io, "validate_calls", no_validation)
    t = time.perf_counter()
    with pytest.raises(ExportError) as err:
        sl.load_schedule(path)
    msg = _one_sentence(str(err.value))
    assert f"has {limit + 1:,} calls" in msg and f"at most {limit:,} calls" in msg, msg
    t = time.perf_counter()
    said = editor.load(str(path))
    took = time.perf_counter() - t
    assert said == msg and editor.message.endswith(msg)
    assert took < 5, f"refusing took {took:.1f} s"  # the file of this kind took 270 s to load
    assert (editor.code, len(editor.schedule.record.calls), editor.schedule.record.actions()) == before
    assert not editor._busy
    assert editor.apply("checkpoint", path="encoder.layer.1") is None  # the editor goes on as before


def test_a_file_over_the_size_bound_is_refused_before_it_is_read(editor, tmp_path):
    path = tmp_path / "huge.json"
    with path.open("wb") as f:  # sparse: no disk written, and zeros that would not parse as JSON
        f.truncate(schedule_io.MAX_SCHEDULE_BYTES + 1)
    before = editor.code
    t = time.perf_counter()
    with pytest.raises(ExportError) as err:
        sl.load_schedule(path)
    assert time.perf_counter() - t < 1
    msg = _one_sentence(str(err.value))
    assert f"over the {schedule_io.MAX_SCHEDULE_BYTES // 2**20} MiB" in msg, msg  # refused by size, not JSON
    assert editor.load(str(path)) == msg and editor.code == before and not editor._busy


def test_a_file_at_the_call_bound_is_read(tmp_path):
    path = _write_compact(tmp_path / "at.json", schedule_io.MAX_SCHEDULE_CALLS)
    calls, meta = sl.load_schedule(path)
    assert len(calls) == schedule_io.MAX_SCHEDULE_CALLS and meta == {"world_size": 2}
    assert calls[7] == Call("encoder.layer.1.output.dense", "annotate", ("weight", "tag", 7), {})
    assert gc.isenabled()  # load_schedule pauses the collector only while it reads


def test_gc_paused_restores_the_collector():
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # it was off: it stays off
    finally:
        gc.enable()


@pytest.mark.parametrize("name", sl.list_primitives())
def test_bind_binds_exactly_as_signature_bind(name):
    """Primitive.bind skips ``inspect`` for calls that bind; every call binds (or fails) as before."""
    from slapo_lab.errors import ScheduleError
    from slapo_lab.primitives import get_primitive

    prim = get_primitive(name)
    sig = prim.signature()
    pool = [*sig.parameters, "bogus", "kwargs", "sch"]
    for n_args in range(5):
        for names in itertools.chain.from_iterable(itertools.combinations(pool, r) for r in range(3)):
            args, kwargs = tuple(range(n_args)), dict.fromkeys(names, "v")
            try:
                want = sig.bind(*args, **kwargs)
            except TypeError as err:
                with pytest.raises(ScheduleError, match=re.escape(str(err))):
                    prim.bind(*args, **kwargs)
                continue
            got = prim.bind(*args, **kwargs)
            assert list(got.arguments.items()) == list(want.arguments.items()), (args, kwargs)
            assert (got.args, got.kwargs) == (want.args, want.kwargs)


def _record_of(n: int):
    rec = Recorder()
    calls = [Call(f"h.{i % 7}", "annotate", ("weight", "tag", i), {}) for i in range(n)]
    with rec.action("preset"):
        for c in calls[:3]:
            rec.append(c)
    for c in calls[3:]:  # typed lines: one action each, labelled with their code
        rec.append(c)
    return rec, calls


def test_actions_of_a_record_of_one_action_per_call_are_linear():
    """10x the actions costs about 10x (it was quadratic: 100x, minutes for 100,000 actions): the first
    ``actions()`` of fresh records (later calls reuse cached labels), a ratio measured in one run, so a loaded
    machine slows both sides alike."""

    def first_call(n: int) -> float:
        import gc

        rec, _ = _record_of(n)
        gc.collect()
        gc.disable()  # a collection of the other side's garbage must not land in one measurement
        try:
            t = time.perf_counter()
            rec.actions()
            return time.perf_counter() - t
        finally:
            gc.enable()

    small = min(first_call(10_000) for _ in range(2))
    large = min(first_call(100_000) for _ in range(2))
    assert large / max(small, 1e-4) < 50, (small, large)  # linear: ~10-20; quadratic: ~100
    rec, calls = _record_of(100_000)
    actions = rec.actions()
    assert len(actions) == 1 + len(calls) - 3
    assert actions[0] == ("preset", tuple(calls[:3]))
    assert actions[-1] == (format_call(calls[-1]), (calls[-1],))


def _actions_before(rec: Recorder) -> list:
    """Recorder.actions as it was (quadratic): the reference for the grouping."""
    n = len(rec.calls)
    starts = [(i, lab) for i, lab in rec._starts if 0 <= i < n]
    out, pos = [], 0
    for k, (i, lab) in enumerate(starts):
        if i < pos:
            continue
        while pos < i:
            out.append((format_call(rec.calls[pos]), (rec.calls[pos],)))
            pos += 1
        end = next((j for j, _ in starts[k + 1 :] if j > i), n)
        out.append((format_call(rec.calls[i]) if lab is None else lab, tuple(rec.calls[i:end])))
        pos = end
    while pos < n:
        out.append((format_call(rec.calls[pos]), (rec.calls[pos],)))
        pos += 1
    return out


def test_actions_group_as_before_whatever_was_done_to_the_record_by_hand():
    import random

    rng = random.Random(0)
    for _ in range(200):
        rec = Recorder()
        for k in range(rng.randrange(12)):
            if rng.random() < 0.5:
                rec.append(Call(f"m.{k}", "checkpoint"))
            else:
                with rec.action(f"act {k}"):
                    for j in range(rng.randrange(3)):
                        rec.append(Call(f"m.{k}.{j}", "checkpoint"))
        for _ in range(rng.randrange(3)):  # edits by hand: drop or add calls, out-of-range starts
            if rec.calls and rng.random() < 0.5:
                del rec.calls[rng.randrange(len(rec.calls))]
            else:
                rec.calls.insert(rng.randrange(len(rec.calls) + 1), Call("by.hand", "checkpoint"))
        if rng.random() < 0.3:
            rec._starts.insert(rng.randrange(len(rec._starts) + 1), (rng.randrange(-1, 14), "odd"))
        assert [tuple(a) for a in rec.actions()] == _actions_before(rec)
