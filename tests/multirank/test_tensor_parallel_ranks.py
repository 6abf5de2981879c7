"""Tensor parallelism on 2 real ranks (torchrun, gloo on 127.0.0.1) against the single-process model.

One torchrun launch runs every case of ``tests/multirank/tp_train.py`` (BERT, BERT-MLM with its tied
decoder, GPT-2 by hand / preset / sequence parallel with the tied vocab-parallel head, Llama by preset / sequence
parallel / HF tp plan): inside ``sl.Verify`` (must pass), then three SGD steps whose losses, gathered gradients and
updated parameters must match the unscheduled copy within 1e-5 (fp32). The launch is shared by the
per-case tests below.
"""

from __future__ import annotations

import harness
import pytest
from harness import launch_results

ROOT = harness.REPO_ROOT
SCRIPT = ROOT / "tests" / "multirank" / "tp_train.py"
TIMEOUT_S = 300
CASES = [
    "bert_manual",
    "bert_megatron_tp",
    "bert_mlm_tied_decoder",
    "gpt2_manual_tied_vocab",
    "gpt2_megatron_tp",
    "gpt2_sequence_parallel",
    "gpt2_sequence_parallel_checkpointed",
    "llama_megatron_tp",
    "llama_sequence_parallel",
    "llama_hf_plan",
]

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def results():
    return launch_results(SCRIPT, 2, ["all"], TIMEOUT_S)


@pytest.mark.parametrize("case", CASES)
def test_tp_matches_single_process(results, case):
    rc, out, res = results
    assert case in res, f"no result for {case} (torchrun exit {rc}):\n{out[-4000:]}"
    r = res[case]
    assert not r["bad"], f"{case}: " + "; ".join(r["bad"])
    assert r["verify"] is True
    assert r["max_loss_diff"] <= 1e-5 and r["max_grad_diff"] <= 1e-5 and r["max_param_diff"] <= 1e-5, r
    assert len(r["loss"]) == 3
    if case.startswith("gpt2"):
        assert r["tied"] is True
        assert "transformer.h.0.attn.c_attn.weight" in r["strided"]
    else:
        assert r["strided"] == []


def test_launch_exit_status(results):
    rc, out, res = results
    assert rc == 0 and set(res) == set(CASES), out[-4000:]
