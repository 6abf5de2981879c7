"""Exported scripts really run on CPU ranks (gloo): issue 2's BERT schedule (TP=2) under ``torchrun``;
GPT-2 pipelines (PP=2 and TP=2 x PP=2 under ``torchrun``, PP=2 under the ``deepspeed`` launcher) whose
``--verify`` (the default) proves the loss and every gradient against the unscheduled model (sharded by FSDP2
over the ranks) before training with ``slapo_lab.train``.

Every subprocess is bounded by a timeout and killed with its whole process group on overrun.
"""

from __future__ import annotations

import math
import re
import sys
import time
from pathlib import Path

import harness
import pytest
import torch

import slapo_lab as sl
from slapo_lab.export import export_script

pytestmark = pytest.mark.multirank

# slapo_lab.train's step line (CPU: no MFU)
STEP = re.compile(
    r"^step (\d+)/(\d+) loss (\S+) \| lr (\S+) \| grad norm (\S+) \| (\d+) tokens/s \| ([\d.]+) "
    r"samples/s \| peak mem (\d+) MiB$",
    re.MULTILINE,
)
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
    return export_script(
        tmp_path / "train_bert.py", tiny_bert, sch.record.calls, {"input_ids": ids}, world_size=2
    )


def test_bert_tp_script_runs_on_two_cpu_ranks(
    bert_script, run_bounded, torchrun_cmd, free_port, subprocess_env
):
    """With the flags of issue 10: an explicit --backend gloo, a smaller Verify batch, bf16 autocast."""
    start = time.perf_counter()
    r = run_bounded(
        torchrun_cmd(
            2,
            free_port,
            bert_script,
            "--device",
            "cpu",
            "--steps",
            "2",
            "--backend",
            "gloo",
            "--verify-batch-size",
            "3",
            "--bf16",
        ),
        timeout=300,
        cwd=bert_script.parent,
        env=subprocess_env,
    )
    wall = time.perf_counter() - start
    print(f"2-rank torchrun wall time: {wall:.1f} s")
    assert r.returncode == 0, _explain(r)
    out = r.stdout
    assert (
        "Verify: PASSED" in out and "Verify: one forward and backward of 3 sequence(s) of 32 tokens" in out
    ), _explain(r)
    assert (
        "2 rank(s) = tp 2 x pp 1 x dp 1, device cpu, global batch 4 x 32 tokens in micro-batches of 4 (1 per "
        "step and replica), bf16 compute / fp32 weights"
    ) in out, _explain(r)
    outputs = OUTPUT_DIFF.findall(out)
    grads = GRAD_DIFF.findall(out)
    assert {name for name, _ in outputs} == {"loss", "last_hidden_state", "pooler_output"}, _explain(r)
    assert len(grads) == 1 and int(grads[0][0]) > 0, _explain(r)
    for _, diff in outputs + [(None, grads[0][1])]:
        assert float(diff) <= 1e-5, _explain(r)
    steps = STEP.findall(out)
    assert [(s[0], s[1]) for s in steps] == [("1", "2"), ("2", "2")], _explain(r)  # printed by rank 0 only
    for s in steps:
        assert math.isfinite(float(s[2])) and float(s[4]) > 0 and int(s[5]) > 0 and float(s[6]) > 0


# ------------------------------------------------------------------------------------ pipelines
# Exported pipeline scripts (GPT-2 with its tied LM head, 2 layers, hidden 64, no dropout) under torchrun or
# the deepspeed launcher; --verify runs one training step's batch through the pipeline and the reference.
PP_GRADS = GRAD_DIFF
GPT2_PARAMS = 28  # the tied lm_head / transformer.wte counted once
_RUNS: dict[str, tuple] = {}


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=128,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(cfg)


def _export_gpt2(folder, tp: int, launcher: str = "torchrun"):
    model = _gpt2()
    sch = sl.create_schedule(model, world_size=tp)
    if tp > 1:
        sl.presets.megatron_tp(
            sch
        )  # column/row-parallel blocks (strided c_attn), vocab-parallel wte + lm_head
    sch["transformer.h.0"].cut_pipeline_stage()
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    name = f"train_gpt2_tp{tp}_{launcher}.py"
    return export_script(
        folder / name, model, sch.record.calls, {"input_ids": ids}, world_size=tp, launcher=launcher
    )


def _pp_env(env):
    env = dict(env)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(harness.REPO_ROOT / ".cache" / "torch_extensions"))
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    return env


def _run_pipeline(key, folder, run_bounded, cmd_of, env, timeout):
    """Launch once per session (other tests compare their losses with the torchrun PP=2 run)."""
    if key not in _RUNS:
        start = time.perf_counter()
        r = run_bounded(cmd_of(folder), timeout=timeout, cwd=folder, env=_pp_env(env))
        wall = time.perf_counter() - start
        print(f"{key}: wall time {wall:.1f} s")
        _RUNS[key] = (r, wall)
    return _RUNS[key][0]


def _check_pipeline_verify(r, n_steps=2, tol=1e-5):
    """Verify passed (loss and every gradient within ``tol``), then ``n_steps`` training steps; their losses."""
    out = r.stdout
    assert r.returncode == 0 and "Verify: PASSED" in out, _explain(r)
    assert "Verify: one forward and backward of 4 sequence(s) of 16 tokens" in out, _explain(
        r
    )  # one step's batch
    outputs = dict(OUTPUT_DIFF.findall(out))
    assert set(outputs) == {"loss"}, _explain(r)  # a pipeline's output is its loss
    ((n_grads, grad_diff),) = PP_GRADS.findall(out)
    assert int(n_grads) == GPT2_PARAMS, _explain(r)
    for d in (outputs["loss"], grad_diff):
        assert float(d) <= tol, _explain(r)
    steps = STEP.findall(out)
    assert [(s[0], s[1]) for s in steps] == [(str(i), str(n_steps)) for i in range(1, n_steps + 1)], _explain(
        r
    )
    assert all(math.isfinite(float(s[2])) for s in steps)
    assert 4.0 < float(steps[0][2]) < 6.0, _explain(
        r
    )  # cross entropy over 128 tokens starts near ln(128) = 4.85
    return [float(s[2]) for s in steps]


def _torchrun_pp2(tmp_path_factory, run_bounded, torchrun_cmd, free_port, subprocess_env):
    folder = tmp_path_factory.mktemp("pp2")
    script = _export_gpt2(folder, tp=1)
    return _run_pipeline(
        "pp2",
        folder,
        run_bounded,
        lambda f: torchrun_cmd(2, free_port, script, "--device", "cpu", "--steps", "2"),
        subprocess_env,
        timeout=180,
    )


def test_gpt2_pp2_script_verifies_on_two_cpu_ranks(
    tmp_path_factory, run_bounded, torchrun_cmd, free_port, subprocess_env
):
    r = _torchrun_pp2(tmp_path_factory, run_bounded, torchrun_cmd, free_port, subprocess_env)
    _check_pipeline_verify(r)
    assert (
        "2 rank(s) = tp 1 x pp 2 x dp 1" in r.stdout
        and "in micro-batches of 2 (2 per step and replica)" in r.stdout
    ), _explain(r)


def test_gpt2_tp2_pp2_script_verifies_on_four_cpu_ranks(
    tmp_path, tmp_path_factory, run_bounded, torchrun_cmd, free_port, subprocess_env
):
    script = _export_gpt2(tmp_path, tp=2)
    r = _run_pipeline(
        "tp2pp2",
        tmp_path,
        run_bounded,
        lambda f: torchrun_cmd(
            4, free_port, script, "--device", "cpu", "--steps", "2", "--pp-schedule", "GPipe"
        ),
        subprocess_env,
        timeout=240,
    )
    losses = _check_pipeline_verify(r)
    assert "4 rank(s) = tp 2 x pp 2 x dp 1" in r.stdout, _explain(r)
    # the same model (seeded init, identical for every layout), data and optimizer as the PP=2 run
    want = _check_pipeline_verify(
        _torchrun_pp2(tmp_path_factory, run_bounded, torchrun_cmd, free_port, subprocess_env)
    )
    assert all(abs(a - b) <= 1e-5 for a, b in zip(losses, want, strict=False)), (losses, want)


def test_gpt2_pp2_bf16_script_on_two_gloo_ranks(
    tmp_path, tmp_path_factory, run_bounded, torchrun_cmd, free_port, subprocess_env
):
    """Issue 10: --bf16 for pipelines: bf16 autocast inside the stages with fp32 weights. Verify still proves the
    schedule in fp32 (1e-5); the training steps run in bf16 (their losses move off the fp32 run's, a little)."""
    script = _export_gpt2(tmp_path, tp=1)
    r = _run_pipeline(
        "pp2_bf16",
        tmp_path,
        run_bounded,
        lambda f: torchrun_cmd(
            2, free_port, script, "--device", "cpu", "--steps", "2", "--bf16", "--backend", "gloo"
        ),
        subprocess_env,
        timeout=180,
    )
    losses = _check_pipeline_verify(r)
    assert "in micro-batches of 2 (2 per step and replica), bf16 compute / fp32 weights" in r.stdout, (
        _explain(r)
    )
    want = _check_pipeline_verify(
        _torchrun_pp2(tmp_path_factory, run_bounded, torchrun_cmd, free_port, subprocess_env)
    )
    assert losses != want and all(abs(a - b) <= 0.03 for a, b in zip(losses, want, strict=False)), (
        losses,
        want,
    )


def test_gpt2_pp2_script_under_the_deepspeed_launcher(
    tmp_path, tmp_path_factory, run_bounded, torchrun_cmd, free_port, subprocess_env
):
    pytest.importorskip("deepspeed")
    script = _export_gpt2(tmp_path, tp=1, launcher="deepspeed")
    cmd = [
        str(Path(sys.executable).with_name("deepspeed")),
        "--hostfile",
        str(tmp_path / "no-hostfile"),
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port),
        str(script),
        "--device",
        "cpu",
        "--steps",
        "2",
        "--verify-batch-size",
        "4",
    ]
    # the first DeepSpeed start on a machine JIT-compiles its shm op (~50-90 s, then cached)
    r = _run_pipeline("pp2_deepspeed", tmp_path, run_bounded, lambda f: cmd, subprocess_env, timeout=300)
    losses = _check_pipeline_verify(r)
    assert "DeepSpeed ZeRO-0" in r.stdout and "--local_rank=1" in r.stdout + r.stderr, _explain(r)
    # the same model, data and optimizer as the torchrun PP=2 run: the same training losses
    torch_losses = _check_pipeline_verify(
        _torchrun_pp2(tmp_path_factory, run_bounded, torchrun_cmd, free_port, subprocess_env)
    )
    assert all(abs(a - b) <= 2e-6 for a, b in zip(losses, torch_losses, strict=False)), (losses, torch_losses)


def test_bert_tp2_script_under_the_deepspeed_launcher(
    tmp_path, apply_bert_tp, run_bounded, free_port, subprocess_env
):
    """Tensor parallelism on DeepSpeed's engine (a model-parallel unit keeps its data parallelism off the shards,
    ZeRO-1 shards the optimizer states): the losses equal one process training the unscheduled model (the
    synthetic data and the seeded initialisation do not depend on the layout)."""
    pytest.importorskip("deepspeed")
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(
        BertConfig(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            intermediate_size=128,
            vocab_size=200,
            max_position_embeddings=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    )
    sch = sl.create_schedule(model, world_size=2)
    apply_bert_tp(sch, 2)
    ids = torch.randint(0, 200, (4, 16), generator=torch.Generator().manual_seed(0))
    script = export_script(
        tmp_path / "train_bert_ds.py",
        model,
        sch.record.calls,
        {"input_ids": ids},
        world_size=2,
        launcher="deepspeed",
    )
    ref = export_script(tmp_path / "train_bert_ref.py", model, [], {"input_ids": ids}, world_size=1)
    opts = ["--steps", "3", "--micro-batch-size", "2", "--lr", "1e-3"]
    cmd = [
        str(Path(sys.executable).with_name("deepspeed")),
        "--hostfile",
        str(tmp_path / "no-hostfile"),
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port),
        str(script),
        "--device",
        "cpu",
        "--zero",
        "1",
        *opts,
    ]
    start = time.perf_counter()
    r = run_bounded(cmd, timeout=300, cwd=tmp_path, env=_pp_env(subprocess_env))
    print(f"deepspeed TP=2: wall time {time.perf_counter() - start:.1f} s")
    assert r.returncode == 0 and "Verify: PASSED" in r.stdout, _explain(r)
    assert "tp 2 x pp 1 x dp 1, DeepSpeed ZeRO-1" in r.stdout, _explain(r)
    losses = [float(s[2]) for s in STEP.findall(r.stdout)]
    one = run_bounded(
        [sys.executable, str(ref), "--device", "cpu", *opts],
        timeout=300,
        cwd=tmp_path,
        env=_pp_env(subprocess_env),
    )
    assert one.returncode == 0, _explain(one)
    want = [float(s[2]) for s in STEP.findall(one.stdout)]
    assert len(losses) == len(want) == 3 and all(
        abs(a - b) <= 2e-5 for a, b in zip(losses, want, strict=False)
    ), (
        losses,
        want,
    )
