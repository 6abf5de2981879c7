"""The editor's "Verify on GPU": a real torchrun subprocess, plus crash / hang / cancel handling."""

import sys
import time

import pytest
import torch
from transformers import BertConfig, BertModel

import slapo_lab as sl
from slapo_lab.editor.verify_runner import VerifyRunner, plan_device


@pytest.mark.multirank
def test_verify_button_runs_torchrun_and_passes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = BertModel(
        BertConfig(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            intermediate_size=128,
            vocab_size=200,
            max_position_embeddings=64,
        )
    )
    ed = sl.ScheduleEditor(model, example_inputs={"input_ids": torch.randint(0, 200, (2, 16))}, world_size=2)
    sl.presets.megatron_tp(ed.schedule)
    ed.apply("checkpoint", path="encoder.layer.0")
    phases = []
    show = ed._verify.on_phase  # the Verify panel (editor/verify_panel.py) draws the phases
    monkeypatch.setattr(ed._verify, "on_phase", lambda name: (phases.append(name), show(name)))
    ed._btn_verify.click()
    assert ed._runner is not None and ed._btn_cancel.disabled is False
    assert "Verify 2/7: launching the ranks" in ed._phase.value or phases  # named from the first second
    assert ed._progress.layout.visibility == "visible" and ed._progress.value >= 1
    result = ed._runner.wait(300)
    assert result is not None, "verify did not finish in 300 s"
    assert result.status == "passed", "\n".join(result.lines[-30:])
    assert phases == ["launch", "setup", "reference", "compare", "train", "done"], phases
    assert "Verify 7/7: done" in ed._phase.value and ed._progress.value == ed._progress.max
    assert "slapo-lab phase:" not in ed._log.value and "slapo-lab phase: setup" in "\n".join(ed.verify_log())
    assert result.max_abs_diffs and max(result.max_abs_diffs) <= 1e-5
    if not torch.cuda.is_available():
        assert "CUDA is not available on this machine, so Verify runs on the CPU with gloo." in ed.message
    assert "Verify passed" in ed.message
    assert "Verify: PASSED" in ed._log.value
    assert ed._btn_verify.disabled is False


def _script(tmp_path, body):
    p = tmp_path / "fake.py"
    p.write_text("import sys, time, os\n" + body)
    return str(p)


def test_crash_is_reported_in_one_sentence(tmp_path):
    r = VerifyRunner()
    r.start(_script(tmp_path, "raise ValueError('boom from rank')\n"), 1, "cpu", timeout=120)
    res = r.wait(150)
    assert res.status == "crashed" and res.returncode != 0
    assert "crashed" in res.summary and "boom from rank" in res.summary


def test_hang_past_timeout_is_killed(tmp_path):
    r = VerifyRunner()
    t0 = time.monotonic()
    r.start(_script(tmp_path, "print('started', flush=True)\ntime.sleep(600)\n"), 1, "cpu", timeout=8)
    res = r.wait(120)
    assert res.status == "timeout"
    assert time.monotonic() - t0 < 60
    assert "time limit" in res.summary


def test_cancel_stops_the_run(tmp_path):
    lines = []
    r = VerifyRunner(on_line=lines.append)
    r.start(_script(tmp_path, "print('working', flush=True)\ntime.sleep(600)\n"), 1, "cpu", timeout=300)
    deadline = time.monotonic() + 60
    while not any("working" in ln for ln in lines) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert r.cancel() is True
    res = r.wait(60)
    assert res.status == "cancelled"
    assert r.cancel() is False


def test_failed_verify_is_reported(tmp_path):
    r = VerifyRunner()
    body = "print('Verify: output x: max abs diff 3.0e-01, max rel diff 1.0e+00')\nprint('Verify: FAILED')\nsys.exit(1)\n"
    r.start(_script(tmp_path, body), 1, "cpu", timeout=120)
    res = r.wait(150)
    assert res.status == "failed" and res.max_abs_diffs == [0.3]
    assert "differs" in res.summary


def test_more_ranks_than_gpus_falls_back_to_cpu():
    dev, note = plan_device(64, "cuda")
    assert dev == "cpu" and "gloo" in note


def test_runner_never_uses_a_shell(tmp_path):
    r = VerifyRunner()
    cmd = r.command("a b; rm -rf x.py", 2, "cpu")
    assert cmd[0] == sys.executable and "a b; rm -rf x.py" in cmd


# ------------------------------------------------------------------ issue 11: the whole tree ends, output is capped
_TREE = r"""
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"],
    start_new_session=True)
print(f"PIDS {os.getpid()} {child.pid}", flush=True)
"""


def _gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _pids_from(lines):
    for ln in lines:
        if "PIDS " in ln:
            return [int(x) for x in ln.split("PIDS ", 1)[1].split()]
    return []


def _wait_for_pids(lines, seconds=90):
    deadline = time.monotonic() + seconds
    while not _pids_from(lines) and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = _pids_from(lines)
    assert pids, "the fake rank did not start:\n" + "\n".join(lines[-20:])
    return pids


def _cleanup(pids):
    import os
    import signal

    for pid in pids:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)


def test_cancel_ends_workers_and_their_children_in_other_sessions(tmp_path):
    lines = []
    r = VerifyRunner(on_line=lines.append, grace=1.0)
    r.start(_script(tmp_path, _TREE + "time.sleep(600)\n"), 1, "cpu", timeout=300)
    pids = _wait_for_pids(lines)
    try:
        assert r.cancel() is True
        res = r.wait(60)
        assert res is not None, "the run did not end after Cancel"
        assert res.status == "cancelled"
        left = [p for p in [*pids, *r.pids] if not _gone(p)]
        assert left == [], f"processes of the tree still alive after Cancel: {left}"
    finally:
        _cleanup(pids)


def test_timeout_ends_the_tree_and_reports(tmp_path):
    lines = []
    done = []
    r = VerifyRunner(on_line=lines.append, on_done=done.append, grace=1.0)
    r.start(_script(tmp_path, _TREE + "time.sleep(600)\n"), 1, "cpu", timeout=15)
    pids = _wait_for_pids(lines)
    try:
        res = r.wait(90)
        assert res is not None and res.status == "timeout" and done == [res]
        assert [p for p in [*pids, *r.pids] if not _gone(p)] == []
    finally:
        _cleanup(pids)


def test_leftover_child_after_a_normal_exit_is_ended(tmp_path):
    """A rank exits but leaves a child (own session, holding the output pipe): the run still ends."""
    lines = []
    r = VerifyRunner(on_line=lines.append, grace=1.0)
    r.start(
        _script(tmp_path, _TREE + "time.sleep(1)\nprint('Verify: PASSED', flush=True)\n"),
        1,
        "cpu",
        timeout=300,
    )
    pids = _wait_for_pids(lines)
    try:
        res = r.wait(90)
        assert res is not None, "the run never ended: a leftover child kept it open"
        assert res.status == "passed"
        assert [p for p in [*pids, *r.pids] if not _gone(p)] == []
    finally:
        _cleanup(pids)


def test_a_50_mb_line_is_cut_and_memory_stays_bounded(tmp_path):
    import tracemalloc

    from slapo_lab.editor.verify_runner import MAX_LINE_CHARS

    body = (
        "sys.stdout.write('x' * 50_000_000 + '\\n'); sys.stdout.flush()\n"
        "print('after the long line', flush=True)\n"
    )
    seen = []
    r = VerifyRunner(on_line=lambda ln: seen.append(len(ln)))
    tracemalloc.start()
    try:
        r.start(_script(tmp_path, body), 1, "cpu", timeout=120)
        res = r.wait(150)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert res is not None and res.status == "crashed"  # no "Verify: PASSED": a crash, reported normally
    assert any(ln == "after the long line" for ln in res.lines)
    long = next(ln for ln in res.lines if ln.startswith("xxxx"))
    assert len(long) < MAX_LINE_CHARS + 100 and "more bytes of this line not shown" in long
    assert max(seen) < MAX_LINE_CHARS + 100
    assert peak < 8_000_000, f"reading a 50 MB line peaked at {peak / 1e6:.0f} MB of Python memory"


def test_kept_log_is_capped(tmp_path):
    from slapo_lab.editor.verify_runner import MAX_LOG_CHARS

    body = "line = 'y' * 9000\nfor i in range(400):\n    print(i, line)\nprint('Verify: PASSED')\n"
    r = VerifyRunner()
    r.start(_script(tmp_path, body), 1, "cpu", timeout=120)
    res = r.wait(150)
    assert res.status == "passed"  # the verdict survives dropping old lines
    assert sum(len(ln) for ln in res.lines) <= MAX_LOG_CHARS + 100
    assert res.lines[0].endswith("earlier lines not kept]") and res.lines[-1] == "Verify: PASSED"


def test_the_visible_log_hides_warnings_and_phase_markers():
    from slapo_lab.editor.verify_runner import LogFilter

    lines = [
        "slapo-lab phase: setup",
        "/x/site-packages/transformers/utils/generic.py:441: FutureWarning: `torch.utils._pytree` is deprecated.",
        "  _torch_pytree._register_pytree_node(",
        "[rank1]:/x/torch/distributed/tensor/_api.py:12: UserWarning: something",
        "[rank1]:  warnings.warn(",
        "model: 0.43 M parameters, 2 rank(s) = TP 2",
        "  indented line of the run's own output",
        "Verify: PASSED",
    ]
    f = LogFilter()
    assert [line for line in lines if f.visible(line)] == [
        "model: 0.43 M parameters, 2 rank(s) = TP 2",
        "  indented line of the run's own output",
        "Verify: PASSED",
    ]
    assert f.hidden == 4
