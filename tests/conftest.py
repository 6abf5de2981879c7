"""Shared pytest fixtures (add new ones; do not remove: other test files use them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import harness
import pytest
from harness import apply_bert_tp as apply_bert_tp_fn

REPO_ROOT = harness.REPO_ROOT

# The editor's live numeric check runs in background threads after every change; the suite creates hundreds of
# editors, so it is off unless a test turns it on (tests/unit/numeric/test_numeric_check.py passes live_check=True).
os.environ.setdefault("SLAPO_LAB_LIVE_CHECK", "0")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository root (holds the ``slapo_lab`` package)."""
    return REPO_ROOT


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for torchrun's --master_port)."""
    return harness.free_port()


@pytest.fixture
def subprocess_env() -> dict:
    """Environment for child Pythons: the repo on PYTHONPATH, HF offline, one thread per process."""
    return harness.child_env()


def _run_bounded(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """Run ``cmd`` (no shell) in its own process group; on timeout kill the whole group and fail."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        harness.kill_tree(proc.pid)
        out, err = proc.communicate()
        pytest.fail(
            f"{' '.join(map(str, cmd))} ran over {timeout} s and was killed\n"
            f"--- stdout\n{out[-4000:]}\n--- stderr\n{err[-4000:]}"
        )
    finally:
        if proc.poll() is None:  # pragma: no cover - an exception while waiting
            harness.kill_tree(proc.pid)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture
def run_bounded():
    """``run_bounded(cmd, timeout, cwd=..., env=...)``: a subprocess bounded by ``timeout`` seconds.

    The child runs in a new process group that is killed (SIGKILL) if it overruns, so torchrun's
    workers never outlive the test; returns a ``CompletedProcess`` with text stdout/stderr.
    """
    return _run_bounded


@pytest.fixture
def torchrun_cmd():
    """``torchrun_cmd(nproc, port, script, *args)``: the argv of a local CPU torchrun launch."""

    def cmd(nproc: int, port: int, script, *args: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
            str(script),
            *args,
        ]

    return cmd


@pytest.fixture
def tiny_bert():
    """A small randomly initialised HF BertModel: 4 layers, hidden 128, 4 heads, intermediate 256, vocab 1000."""
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(
        num_hidden_layers=4,
        hidden_size=128,
        num_attention_heads=4,
        intermediate_size=256,
        vocab_size=1000,
        max_position_embeddings=128,
    )
    return BertModel(cfg)


@pytest.fixture
def apply_bert_tp():
    """``apply_bert_tp(sch, num_layers, checkpoint=True)``: issue 2's BERT tensor-parallel schedule.

    On every layer: query/key/value and intermediate.dense shard weight and bias on axis 0 plus
    ``sync(mode="bwd_post", sync_op_or_fn="all_reduce")``; attention.output.dense and output.dense
    shard weight on axis 1 plus ``sync(mode="fwd_post", sync_op_or_fn="all_reduce")``; then
    ``sch["encoder.layer.<i>"].checkpoint()``.
    """
    return apply_bert_tp_fn


@pytest.fixture(scope="module")
def bert():
    """``(BertModel, input_ids)``: a 2-layer HF BERT (hidden 64, 4 heads, vocab 120) and ids of shape ``(2, 16)``."""
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=120,
        max_position_embeddings=64,
    )
    return BertModel(cfg), torch.randint(0, 120, (2, 16))


@pytest.fixture
def editor(bert):
    """A ScheduleEditor on :func:`bert` planning for world size 2 (a fresh one per test)."""
    import slapo_lab as sl

    model, ids = bert
    return sl.ScheduleEditor(model, example_inputs={"input_ids": ids}, world_size=2)
