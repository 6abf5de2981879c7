"""The exported script's command line: its options, and bad input that gets one sentence and exit status 2.

Single-process launches of small exported scripts (``python script.py``: a group of one), plus one torchrun
launch with a world size that does not fit the schedule, and the checkpoint bookkeeping.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.harness import REPO_ROOT, child_env, launch_torchrun
from tests.train_fixtures import meta_model, write_corpus, write_pretrained, write_tokenizer


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from transformers import AutoConfig, LlamaForCausalLM, LlamaModel

    import slapo_lab as sl

    d = tmp_path_factory.mktemp("cli")
    corpus = write_corpus(d / "data", 60)
    model_dir = write_pretrained(d / "llama")
    write_tokenizer(model_dir, [corpus])
    bert_dir = write_pretrained(d / "bert", "BertForMaskedLM")
    config = AutoConfig.from_pretrained(model_dir)
    ids = torch.zeros(4, 16, dtype=torch.long)
    with sl.init_empty_weights():
        lm, base = LlamaForCausalLM(config), LlamaModel(config)
    sch = sl.create_schedule(meta_model("LlamaForCausalLM", config), world_size=2)
    sl.presets.megatron_tp(sch)
    return {
        "dir": d,
        "corpus": corpus,
        "model": model_dir,
        "bert": bert_dir,
        "plain": sl.export_script(d / "plain.py", lm, [], {"input_ids": ids}, world_size=1),
        "base": sl.export_script(d / "base.py", base, [], {"input_ids": ids}, world_size=1),
        "tp": sl.export_script(d / "tp.py", lm, sch.record.calls, {"input_ids": ids}, world_size=2),
    }


def _run(script, *args, timeout=300):
    p = subprocess.run(
        [sys.executable, str(script), "--device", "cpu", *map(str, args)],
        cwd=REPO_ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )
    return p.returncode, p.stdout, p.stderr


def _one_sentence(stderr: str, *words: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def test_help_lists_the_options(files):
    rc, out, err = _run(files["tp"], "--help")
    assert rc == 0, err
    for flag in (
        "--model-path",
        "--tokenizer",
        "--data",
        "--eval-data",
        "--seq-len",
        "--dp",
        "--fsdp",
        "--global-batch-size",
        "--micro-batch-size",
        "--lr",
        "--weight-decay",
        "--warmup-steps",
        "--lr-schedule",
        "--max-grad-norm",
        "--checkpoint-dir",
        "--checkpoint-every",
        "--save-hf",
        "--bf16",
        "--compile",
        "--log-dir",
        "--verify",
        "--progress",
    ):
        assert flag in out, flag


def test_bad_input_is_one_sentence_and_exit_2(files):
    d = files["dir"]
    cases = [
        ((files["plain"], "--model-path", d / "missing"), ("missing",)),
        ((files["plain"], "--model-path", files["bert"]), ("bert", "llama")),
        (
            (files["plain"], "--model-path", files["model"], "--data", d / "nope.jsonl", "--seq-len", "16"),
            ("nope.jsonl",),
        ),
        (
            (files["base"], "--data", files["corpus"], "--tokenizer", files["model"], "--seq-len", "16"),
            ("LlamaModel", "language-model head"),
        ),
        (
            (
                files["plain"],
                "--model-path",
                files["model"],
                "--data",
                files["corpus"],
                "--seq-len",
                "16",
                "--global-batch-size",
                "100000",
            ),
            ("fewer than one global batch of 100000",),
        ),
    ]
    for args, words in cases:
        rc, out, err = _run(*args)
        assert rc == 2, (args, out[-2000:], err[-2000:])
        _one_sentence(err, *words)
    # argparse refuses a bad combination before anything is built
    rc, out, err = _run(files["plain"], "--checkpoint-every", "2")
    assert rc == 2 and "--checkpoint-every needs --checkpoint-dir" in err


@pytest.mark.multirank
def test_a_world_size_that_does_not_fit_the_schedule(files):
    rc, out = launch_torchrun(files["tp"], 3, ["--device", "cpu", "--steps", "1"], timeout=300)
    assert rc != 0
    lines = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert lines and "multiple of 2" in lines[0] and "--nproc_per_node=" in lines[0], out[-3000:]


def test_only_complete_checkpoints_are_resumed_from(tmp_path):
    from slapo_lab.train.checkpoint import latest_checkpoint

    for name, complete in (
        ("step-00000002", True),
        ("step-00000004", True),
        ("step-00000006.partial", True),
        ("step-00000008", False),
    ):
        (tmp_path / name).mkdir()
        if complete:
            (tmp_path / name / ".metadata").write_bytes(b"x")
    assert latest_checkpoint(tmp_path) == (4, tmp_path / "step-00000004")
    assert latest_checkpoint(tmp_path / "absent") is None


def test_convert_refuses_what_is_not_a_checkpoint(tmp_path):
    (tmp_path / "latest").write_text("global_step4")
    for folder, word in ((tmp_path, "DeepSpeed"), (tmp_path / "empty", "no complete checkpoint")):
        folder.mkdir(exist_ok=True)
        p = subprocess.run(
            [sys.executable, "-m", "slapo_lab.cli", "convert", str(folder), "--to-hf", str(tmp_path / "out")],
            cwd=REPO_ROOT,
            env=child_env(),
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        assert p.returncode == 2 and word in p.stderr and "Traceback" not in p.stderr, p.stderr


@pytest.mark.multirank
def test_a_masked_lm_fine_tunes_on_text_with_tensor_parallelism(tmp_path):
    """The other objective on text: a BERT masked LM (its tokenizer has a mask token) fine-tuned at TP 2 on the
    MLM loss (15% masked, as DataCollatorForLanguageModeling), Verify first; the loss goes down."""
    import csv

    from transformers import AutoConfig

    import slapo_lab as sl

    corpus = write_corpus(tmp_path / "data", 200)
    bert_dir = write_pretrained(tmp_path / "bert", "BertForMaskedLM")
    write_tokenizer(bert_dir, [corpus])
    config = AutoConfig.from_pretrained(bert_dir)
    model = meta_model("BertForMaskedLM", config)
    sch = sl.create_schedule(meta_model("BertForMaskedLM", config), world_size=2)
    sl.presets.megatron_tp(sch)
    script = sl.export_script(
        tmp_path / "mlm.py",
        model,
        sch.record.calls,
        {"input_ids": torch.zeros(4, 32, dtype=torch.long)},
        world_size=2,
        defaults={"model_path": str(bert_dir), "data": str(corpus), "seq_len": 32},
    )
    log_dir = tmp_path / "log"
    args = [
        "--device",
        "cpu",
        "--steps",
        "8",
        "--lr",
        "3e-3",
        "--global-batch-size",
        "8",
        "--log-dir",
        log_dir,
    ]
    rc, out = launch_torchrun(script, 2, list(map(str, args)), timeout=300)
    assert rc == 0 and "Verify: PASSED" in out, out[-4000:]
    assert "(masked_lm)" in out, out[-3000:]
    with open(log_dir / "metrics.csv", newline="") as f:
        losses = [float(r["loss"]) for r in csv.DictReader(f) if r["loss"]]
    assert len(losses) == 8 and losses[-1] < losses[0], losses
