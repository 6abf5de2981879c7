"""Pipeline parallelism on real ranks (torchrun, gloo on 127.0.0.1, CPU) against the single-process model.

Each launch of ``tests/multirank/pp_train.py`` runs a few cases (see its ``CASES``): a small model with
random weights is cut, built with ``slapo_lab.pipeline.build_pipeline`` on the case's runtime and trained
for three SGD steps next to an unscheduled copy; the losses and every updated parameter (by original
FQN, tied copies and tensor-parallel shards included) must match within 1e-5 (fp32).

Launches (world size: cases):
* 2: PP=2 with GPipe and 1F1B on HF GPT-2 (tied LM head) and HF BERT + head (torch runtime);
* 2: 4 stages interleaved on 2 ranks (Interleaved1F1B): GPT-2, BERT, a custom model whose skip
  connection crosses stages, a T5-like nested cut and HF T5 with seed 002's nested cuts;
* 2: PP=2 on DeepSpeed (``PipelineModule`` + ``engine.train_batch``): GPT-2, BERT, skip model;
* 3: PP=3, the skip connection crossing a whole stage: torch 1F1B and DeepSpeed;
* 4: TP=2 x PP=2 (BERT's Megatron schedule; GPT-2 with a tied vocab-parallel wte / lm_head split
  across stages) and DP=2 x PP=2 (torch and DeepSpeed);
* 8: TP=2 x PP=2 x DP=2 on one ``(dp, pp, tp)`` mesh (the skip model with column-parallel blocks).
Every launch is bounded (its process group is killed on timeout).
"""

from __future__ import annotations

import importlib.util

import harness
import pytest
from harness import launch_results

ROOT = harness.REPO_ROOT
SCRIPT = ROOT / "tests" / "multirank" / "pp_train.py"
HAS_DS = importlib.util.find_spec("deepspeed") is not None

pytestmark = pytest.mark.multirank

LAUNCHES = {
    "pp2_torch": (2, 150, ["gpt2_gpipe", "gpt2_1f1b", "bert_gpipe", "bert_1f1b"]),
    "interleaved": (
        2,
        180,
        ["gpt2_interleaved", "bert_interleaved", "skip_interleaved", "nested_interleaved", "t5_interleaved"],
    ),
    # the first DeepSpeed init on a machine JIT-compiles its shm op (~50-90 s, then cached)
    "pp2_deepspeed": (2, 300, ["gpt2_deepspeed", "bert_deepspeed", "skip_deepspeed"]),
    "pp3": (3, 240, ["skip3_1f1b", "skip3_deepspeed"]),
    "mesh4": (4, 240, ["bert_tp2_pp2", "gpt2_tp2_pp2", "gpt2_dp2_pp2", "gpt2_dp2_pp2_deepspeed"]),
    "mesh8": (8, 180, ["skip_tp2_pp2_dp2"]),
}
DS_CASES = {"gpt2_deepspeed", "bert_deepspeed", "skip_deepspeed", "skip3_deepspeed", "gpt2_dp2_pp2_deepspeed"}


_RESULTS: dict[str, tuple[int, str, dict]] = {}


def _results(launch: str):
    if launch not in _RESULTS:
        nproc, timeout, cases = LAUNCHES[launch]
        cases = [c for c in cases if HAS_DS or c not in DS_CASES]
        _RESULTS[launch] = launch_results(SCRIPT, nproc, cases, timeout)
    return _RESULTS[launch]


CASES = [(launch, case) for launch, (_, _, cases) in LAUNCHES.items() for case in cases]


@pytest.mark.parametrize("launch,case", CASES, ids=[c for _, c in CASES])
def test_pipeline_matches_single_process(launch, case):
    if case in DS_CASES and not HAS_DS:
        pytest.skip("DeepSpeed is not installed (DS_BUILD_OPS=0 pip install deepspeed)")
    rc, out, res = _results(launch)
    assert case in res, f"no result for {case} (torchrun exit {rc}):\n{out[-5000:]}"
    r = res[case]
    assert not r["bad"], f"{case}: " + "; ".join(r["bad"])
    assert len(r["loss"]) == 3 and r["max_loss_diff"] <= 1e-5 and r["max_param_diff"] <= 1e-5, r
    stages = {"interleaved": 4, "pp3": 3}.get(launch, 2)
    assert r["num_stages"] == stages
    if case.startswith("gpt2"):  # wte on the first stage, the tied lm_head on the last
        assert r["tied"] == [[[0, "transformer.wte.weight"], [stages - 1, "lm_head.weight"]]]
    if case.startswith("t5"):
        assert r["tied"] == [
            [[0, "encoder.embed_tokens.weight"], [2, "decoder.embed_tokens.weight"], [3, "lm_head.weight"]]
        ]
    if "tp2" in case:  # the tensor-parallel sync ops really run inside the exported stages
        assert r["n_sharded"] > 0 and r["tp_ops"] > 0, r


@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_launch_exit_status(launch):
    cases = [c for c in LAUNCHES[launch][2] if HAS_DS or c not in DS_CASES]
    rc, out, res = _results(launch)
    assert rc == 0 and set(res) == set(cases), out[-5000:]
