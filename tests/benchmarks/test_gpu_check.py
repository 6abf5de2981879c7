"""benchmarks/gpu_check.sh, the check run whenever a GPU is lent, still runs: its whole flow on a 10-layer Llama on
the CPU (calibration, the planner, the exported script with ``--compile`` on the aot_eager backend printing its
measurements against the plan's prediction, the hand loop), so that a
change here cannot break it unseen on the day a GPU is there.

Ten layers, because a block compiled once per layer is what broke ``--compile`` on the GPU (a Hugging Face KV cache
guarded per layer recompiled every block until dynamo's recompile limit of 8 stopped the run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import harness

ROOT = harness.REPO_ROOT


def test_gpu_check_flow_runs_on_the_cpu(tmp_path):
    out = tmp_path / "gc"
    cmd = ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--size", "tiny", "--device", "cpu"]
    cmd += ["--steps", "3", "--warmup", "1", "--seq", "32", "--batch", "2", "--out", str(out)]
    cmd += ["--only", "env,calibrate,model,plan,script_compile,hand"]
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["PYTHON"] = sys.executable
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
    report = json.loads((out / "report.json").read_text())
    failed = {name: s["status"] for name, s in report["status"].items() if s["status"] != "ok"}
    for name, said in failed.items():  # pytest shows a failed test's output whole; it cuts a long assertion
        log = out / f"{name}.step.log"
        print(f"--- {name}: {said}\n{log.read_text()[-4000:] if log.exists() else '(no log)'}")
    assert proc.returncode == 0, failed
    assert all(s["status"] == "ok" for s in report["status"].values()), report["status"]
    compiled = report["script_compile"]
    assert compiled["steps_logged"] == 3 and compiled["tokens_per_s"] > 0
    assert compiled["data"].endswith("corpus.txt")  # the real text file, through HF datasets
    assert report["model"]["n_params"] == report["hand"]["n_params"]  # one model, two loops
    assert compiled["plan_line"].startswith("measured / predicted: step ")  # the calibrated plan's prediction
    assert "exported script --compile" in (out / "report.md").read_text()
