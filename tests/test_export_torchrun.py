"""Exported scripts really run: issue 2's BERT schedule under ``torchrun`` with 2 CPU ranks (gloo).

Every subprocess is bounded by a timeout and killed with its whole process group on overrun.
"""
from __future__ import annotations

import math
import re
import time

import pytest
import torch

import slapo_lab as sl
from slapo_lab.export import export_script

pytestmark = pytest.mark.multirank

STEP = re.compile(r"^step (\d+)/(\d+) loss (\S+) \| ([\d.]+) samples/s \| (\d+) tokens/s \| peak mem (\d+) MiB$",
                  re.MULTILINE)
OUTPUT_DIFF = re.compile(r"^Verify: output (\S+): max abs diff (\S+),", re.MULTILINE)
GRAD_DIFF = re.compile(r"^Verify: gradients of (\d+) parameters: max abs diff (\S+) ", re.MULTILINE)


def _explain(r) -> str:
    return f"exit {r.returncode}\n--- stdout\n{r.stdout[-6000:]}\n--- stderr\n{r.stderr[-6000:]}"


@pytest.fixture
def bert_script(tiny_bert, apply_bert_tp, tmp_path):
    """Issue 2's schedule (4 layers, simulated for 2 ranks) exported to tmp_path/train_bert.py."""
    sch = sl.create_schedule(tiny_bert, world_size=2)
    apply_bert_tp(sch, 4)
    ids = torch.randint(0, 1000, (4, 32), generator=torch.Generator().manual_seed(0))
    return export_script(tmp_path / "train_bert.py", tiny_bert, sch.record.calls, {"input_ids": ids}, world_size=2)


def test_bert_tp_script_runs_on_two_cpu_ranks(bert_script, run_bounded, torchrun_cmd, free_port, subprocess_env):
    start = time.perf_counter()
    r = run_bounded(torchrun_cmd(2, free_port, bert_script, "--device", "cpu", "--steps", "2"), timeout=300,
                    cwd=bert_script.parent, env=subprocess_env)
    wall = time.perf_counter() - start
    print(f"2-rank torchrun wall time: {wall:.1f} s")
    assert r.returncode == 0, _explain(r)
    out = r.stdout
    assert "Verify: PASSED" in out, _explain(r)
    outputs = OUTPUT_DIFF.findall(out)
    grads = GRAD_DIFF.findall(out)
    assert {name for name, _ in outputs} == {"last_hidden_state", "pooler_output"}, _explain(r)
    assert len(grads) == 1 and int(grads[0][0]) > 0, _explain(r)
    for _, diff in outputs + [(None, grads[0][1])]:
        assert float(diff) <= 1e-5, _explain(r)
    steps = STEP.findall(out)
    assert [(s[0], s[1]) for s in steps] == [("1", "2"), ("2", "2")], _explain(r)   # printed by rank 0 only
    for s in steps:
        assert math.isfinite(float(s[2])) and float(s[3]) > 0 and int(s[5]) > 0
