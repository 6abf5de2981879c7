"""The example notebooks run end to end headless (``python -m slapo_lab.tools.run_notebook``, exit 0).

* ``llama70b_plan.ipynb``: a 70B Llama on the meta device, Megatron TP 8 x 4 pipeline stages, the plan;
* ``gpt2_tp_pp.ipynb``: a small GPT-2 in the editor, Megatron TP 2 (tied vocab-parallel head) x 2 stages,
  the plan, the exported script, which it then runs on 4 CPU processes (torchrun, gloo) with --verify;
* ``finetune.ipynb``: train for real -- it writes a tiny "pretrained" Llama directory (its BPE tokenizer trained on a
  seeded jsonl corpus), schedules it in the editor (Megatron TP 2 + checkpointing), exports the run (model path,
  data, dp 2 with FSDP2, checkpoints, --save-hf), fine-tunes on 4 CPU processes, resumes from the checkpoint with
  more --steps, converts the checkpoint, and loads the result with from_pretrained (loss, greedy generation).

The quickstart is covered by ``scripts/lab.sh --headless`` and the browser tests. Each run is bounded (its
process group -- kernel, torchrun and ranks -- is killed on overrun).
"""

from __future__ import annotations

import sys
import time

import harness
import pytest

NOTEBOOKS = harness.REPO_ROOT / "notebooks"


def _run(name, run_bounded, env, timeout):
    start = time.perf_counter()
    r = run_bounded(
        [sys.executable, "-m", "slapo_lab.tools.run_notebook", str(NOTEBOOKS / name)],
        timeout=timeout,
        cwd=NOTEBOOKS,
        env=env,
    )
    print(f"{name}: {time.perf_counter() - start:.1f} s")
    assert r.returncode == 0, (
        f"exit {r.returncode}\n--- stdout\n{r.stdout[-4000:]}\n--- stderr\n{r.stderr[-6000:]}"
    )
    assert "ran end to end" in r.stdout


def test_llama70b_plan_notebook(run_bounded, subprocess_env):
    _run("llama70b_plan.ipynb", run_bounded, subprocess_env, timeout=300)


@pytest.mark.multirank
def test_gpt2_tp_pp_notebook(run_bounded, subprocess_env):
    _run("gpt2_tp_pp.ipynb", run_bounded, subprocess_env, timeout=420)


@pytest.mark.multirank
def test_finetune_notebook(run_bounded, subprocess_env):
    _run("finetune.ipynb", run_bounded, subprocess_env, timeout=420)
