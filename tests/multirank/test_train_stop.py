"""A training run stops when its launcher stops (issue 24, item 3; slapo_lab/train/lifeline.py).

torchrun's agent starts every rank in a session of its own, so SIGKILL on the agent's process group used to
leave the ranks training and writing checkpoints. Here an exported script trains a tiny Llama on 2 gloo ranks
(DDP) with a checkpoint every 2 steps; once the first checkpoint is on disk the test SIGKILLs torchrun's
process group (or presses Ctrl-C: SIGINT to torchrun) and asserts that both ranks are gone within seconds and
that no checkpoint appears afterwards.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.harness import REPO_ROOT, child_env, kill_tree, torchrun_argv
from tests.train_fixtures import meta_model

pytestmark = pytest.mark.multirank

GONE_WITHIN_S = 5.0


def _export(folder: Path) -> Path:
    from transformers import LlamaConfig

    import slapo_lab as sl

    config = LlamaConfig(
        num_hidden_layers=1,
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=128,
        max_position_embeddings=64,
    )
    model = meta_model("LlamaForCausalLM", config)
    return sl.export_script(
        folder / "train_stop.py", model, [], {"input_ids": torch.zeros(2, 16, dtype=torch.long)}, world_size=1
    )


def _alive(proc) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _complete(ckpt: Path) -> set[str]:
    return {p.name for p in ckpt.glob("step-*") if (p / ".metadata").is_file()}


@pytest.mark.parametrize("stop", ["SIGKILL torchrun's process group", "Ctrl-C (SIGINT to torchrun)"])
def test_stopping_torchrun_stops_every_rank_and_their_checkpoints(tmp_path, stop):
    """SIGKILL: the agent cannot pass anything on, the ranks' parent-death signal ends them. Ctrl-C: the agent
    passes SIGINT on; a KeyboardInterrupt used to leave the other ranks failing in a collective for ~10 s with a
    traceback each."""
    import psutil

    script = _export(tmp_path)
    ckpt = tmp_path / "ckpt"
    log = (tmp_path / "torchrun.log").open("w")
    args = ["--device", "cpu", "--dp", "2", "--no-verify", "--steps", "100000"]
    args += ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--keep-checkpoints", "0"]
    agent = subprocess.Popen(
        torchrun_argv(script, 2, args),
        cwd=REPO_ROOT,
        env=child_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # the agent's own process group, as a terminal's job would be
    )
    ranks: list = []
    try:
        deadline = time.monotonic() + 180
        while not _complete(ckpt):  # training has started and written its first checkpoint
            assert agent.poll() is None, (tmp_path / "torchrun.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "torchrun.log").read_text()[-3000:]
            time.sleep(0.2)
        ranks = psutil.Process(agent.pid).children()
        assert len(ranks) == 2 and all(r.pid != agent.pid for r in ranks)
        assert all(os.getsid(r.pid) == r.pid for r in ranks)  # each rank leads a session: killpg misses it
        if stop.startswith("SIGKILL"):
            os.killpg(agent.pid, signal.SIGKILL)
        else:
            os.kill(agent.pid, signal.SIGINT)
        killed = time.monotonic()
        while any(_alive(r) for r in ranks) and time.monotonic() - killed < GONE_WITHIN_S:
            time.sleep(0.05)
        gone_after = time.monotonic() - killed
        print(f"ranks gone {gone_after:.2f} s after {stop}")
        agent.wait(timeout=60)
        alive = [r.pid for r in ranks if _alive(r)]
        assert not alive, f"ranks {alive} still running {GONE_WITHIN_S} s after torchrun was killed"
        saved = _complete(ckpt)
        time.sleep(2.0)  # ~100 training steps' time: an orphaned rank would have saved again by now
        assert _complete(ckpt) == saved
    finally:
        log.close()
        for r in ranks:
            kill_tree(r.pid)
        if agent.poll() is None:
            kill_tree(agent.pid)
            agent.wait()


_CHILD = """
import sys, time
from slapo_lab.train import lifeline
lifeline._set_pdeathsig = lambda sig: False  # as where prctl is missing: the watchdog thread alone
open(sys.argv[1], "w").write(str(lifeline.arm(poll=0.1, force=True)))
time.sleep(120)
"""

_PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", *sys.argv[1:]], stdout=subprocess.DEVNULL)
print(child.pid, flush=True)
time.sleep(120)
"""


def test_the_watchdog_alone_ends_a_rank_whose_parent_died(tmp_path):
    """Without ``prctl`` (not Linux) the thread polling ``os.getppid()`` ends the process (status 143)."""
    import sys

    import psutil

    from slapo_lab.train import lifeline

    assert (
        lifeline.launcher_of({}) is None and lifeline.launcher_of({"TORCHELASTIC_RUN_ID": "1"}) == "torchrun"
    )
    assert lifeline.launcher_of({"LOCAL_RANK": "0", "CROSS_RANK": "0"}) == "deepspeed"
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, _CHILD, str(tmp_path / "armed")],
        cwd=REPO_ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    child = None
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        deadline = time.monotonic() + 60
        while not (tmp_path / "armed").is_file():
            assert time.monotonic() < deadline and _alive(child)
            time.sleep(0.1)
        time.sleep(0.2)
        assert (tmp_path / "armed").read_text() == "watchdog"
        parent.kill()
        parent.wait()
        killed = time.monotonic()
        while _alive(child) and time.monotonic() - killed < GONE_WITHIN_S:
            time.sleep(0.05)
        assert not _alive(child), "the watchdog did not end the process after its parent died"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if child is not None and _alive(child):
            child.kill()


_FINISHED = """
import atexit, sys
from slapo_lab.train import lifeline
atexit.register(lambda: print("interpreter teardown ran"))
print("run done")
sys.exit(lifeline.finish(int(sys.argv[1])) + 100)
"""


@pytest.mark.parametrize("launched", [True, False])
def test_a_finished_launched_rank_skips_the_interpreter_teardown(launched):
    """A launched rank ends in :func:`lifeline.finish` with the run's status and its output flushed, without the
    teardown whose unordered frees of gloo groups aborted ranks after a good run; elsewhere it only returns."""
    import sys

    env = child_env()
    for key in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "CROSS_RANK"):
        env.pop(key, None)
    if launched:
        env["TORCHELASTIC_RUN_ID"] = "test"
    r = subprocess.run(
        [sys.executable, "-c", _FINISHED, "3"],
        check=False,
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.stdout.startswith("run done"), r.stdout + r.stderr
    if launched:
        assert r.returncode == 3 and "teardown" not in r.stdout
    else:
        assert r.returncode == 103 and "interpreter teardown ran" in r.stdout
