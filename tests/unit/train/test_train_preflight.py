"""Fail fast and resume only the run it belongs to (issue 24, items 1 and 2).

An exported script checks its launch (:mod:`slapo_lab.train.preflight`) before torch is imported: a bad argument,
a wrong ``--data`` path, a model directory without tokenizer files, ``--seq-len`` above the model's
``max_position_embeddings``, a dp that does not fit the world size, or a checkpoint of another model is one
sentence and exit status 2, printed once per job. A relaunch resumes only a checkpoint of the same shapes, and
says so when it ignores other weights. Real exported scripts, tiny real Llama directories written by
``save_pretrained``, and torchrun on gloo.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.harness import REPO_ROOT, child_env, launch_torchrun, torchrun_argv
from tests.train_fixtures import meta_model, write_corpus, write_pretrained, write_tokenizer


@pytest.fixture(scope="module")
def pf(tmp_path_factory):
    from transformers import AutoConfig, LlamaForCausalLM

    import slapo_lab as sl

    d = tmp_path_factory.mktemp("preflight")
    corpus = write_corpus(d / "data", 60)
    a = write_pretrained(d / "a")  # intermediate_size 128, max_position_embeddings 512
    write_tokenizer(a, [corpus])
    same = write_pretrained(d / "same", seed=1)  # the same shapes, other weights
    write_tokenizer(same, [corpus])
    other = write_pretrained(d / "other", intermediate_size=96)
    write_tokenizer(other, [corpus])
    bare = write_pretrained(d / "bare")  # no tokenizer files
    config = AutoConfig.from_pretrained(a)
    ids = torch.zeros(4, 16, dtype=torch.long)
    with sl.init_empty_weights():
        lm = LlamaForCausalLM(config)
    sch = sl.create_schedule(meta_model("LlamaForCausalLM", config), world_size=2)
    sl.presets.megatron_tp(sch)
    return {
        "dir": d,
        "corpus": corpus,
        "a": a,
        "same": same,
        "other": other,
        "bare": bare,
        "plain": sl.export_script(d / "plain.py", lm, [], {"input_ids": ids}, world_size=1),
        "tp": sl.export_script(d / "tp.py", lm, sch.record.calls, {"input_ids": ids}, world_size=2),
    }


def _python(script, *args, timeout=120):
    """``python -X importtime script --device cpu *args``: (status, stdout, stderr without the import lines,
    the modules imported)."""
    p = subprocess.run(
        [sys.executable, "-X", "importtime", str(script), "--device", "cpu", *map(str, args)],
        cwd=REPO_ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )
    imported, err = set(), []
    for line in p.stderr.splitlines():
        if line.startswith("import time:"):
            imported.add(line.rsplit("|", 1)[-1].strip())
        else:
            err.append(line)
    return p.returncode, p.stdout, "\n".join(err), imported


def test_the_preflight_module_imports_no_torch():
    p = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import slapo_lab.train.preflight"],
        cwd=REPO_ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    names = {ln.rsplit("|", 1)[-1].strip() for ln in p.stderr.splitlines() if ln.startswith("import time:")}
    assert "slapo_lab.train.preflight" in names
    assert not {"torch", "transformers", "datasets", "numpy"} & names, sorted(names)


def test_bad_input_fails_before_torch_in_one_sentence(pf):
    d = pf["dir"]
    text = ["--model-path", pf["a"], "--data", pf["corpus"], "--seq-len", "16"]
    cases = [
        # a wrong --data path
        (
            ["--model-path", pf["a"], "--data", d / "nope.jsonl", "--seq-len", "16"],
            ["nope.jsonl", "does not exist"],
        ),
        # a file of another kind
        (
            ["--model-path", pf["a"], "--data", pf["a"] / "config.json", "--seq-len", "16"],
            [".jsonl or .parquet"],
        ),
        # a model directory without tokenizer files: the sentence suggests --tokenizer
        (
            ["--model-path", pf["bare"], "--data", pf["corpus"], "--seq-len", "16"],
            ["no tokenizer files", "--tokenizer"],
        ),
        # --seq-len above max_position_embeddings (512 in the tiny config)
        (
            [*text[:4], "--seq-len", "1024"],
            ["--seq-len 1024", "512", "max_position_embeddings", "config.json"],
        ),
        # dp that does not fit the world size (one process)
        ([*text, "--dp", "2"], ["--dp 2 x 1 = 2", "1 process(es) were launched"]),
        # a bad argument (argparse: its usage line, then the sentence)
        ([*text, "--steps", "-3"], ["--steps must not be negative"]),
    ]
    for args, words in cases:
        rc, out, err, imported = _python(pf["plain"], *args)
        assert rc == 2, (args, out[-2000:], err[-2000:])
        last = err.strip().splitlines()[-1]
        assert "error:" in last and all(w in last for w in words), (words, err[-2000:])
        assert sum("error:" in ln for ln in err.splitlines()) == 1 and "Traceback" not in err, err[-2000:]
        assert "torch" not in imported, (args, "torch was imported before the error")


@pytest.mark.multirank
def test_torchrun_ranks_say_it_once_before_torch(pf, tmp_path):
    """2 ranks under torchrun (each rank's output in its own file, ``--redirects 3``, imports timed with
    ``PYTHONPROFILEIMPORTTIME``): a wrong --data path and a dp that does not fit are one sentence, the last line rank
    0 writes and nothing on rank 1; both ranks exit with status 2 without having imported torch."""
    for i, (args, word) in enumerate(
        (
            (["--data", pf["dir"] / "nope.jsonl", "--tokenizer", pf["a"], "--seq-len", "16"], "nope.jsonl"),
            (["--dp", "2"], "--dp 2 x 2 = 4"),
        )
    ):
        logs = tmp_path / f"logs{i}"
        argv = torchrun_argv(pf["tp"], 2, ["--device", "cpu", *map(str, args)])
        argv[3:3] = ["--log-dir", str(logs), "--redirects", "3"]
        p = subprocess.run(
            argv,
            cwd=REPO_ROOT,
            env=child_env(PYTHONPROFILEIMPORTTIME="1"),
            capture_output=True,
            text=True,
            check=False,
            timeout=240,
        )
        assert p.returncode != 0 and "exitcode  : 2" in p.stdout + p.stderr, (p.stdout + p.stderr)[-3000:]
        ranks = {}
        for rank in (0, 1):
            (err_log,) = logs.glob(f"*/attempt_0/{rank}/stderr.log")
            lines = err_log.read_text().splitlines()
            imported = {ln.rsplit("|", 1)[-1].strip() for ln in lines if ln.startswith("import time:")}
            assert "torch" not in imported, f"rank {rank} imported torch before the error"
            ranks[rank] = [ln for ln in lines if not ln.startswith("import time:") and ln.strip()]
        assert ranks[0] and ranks[0][-1].startswith("error:") and word in ranks[0][-1], ranks[0][-5:]
        assert sum("error:" in ln for ln in ranks[0]) == 1 and not ranks[1], ranks


def _train(script, args, timeout=600):
    return launch_torchrun(
        script, 2, ["--device", "cpu", "--no-verify", "--progress", "off", *map(str, args)], timeout
    )


@pytest.mark.multirank
def test_a_relaunch_resumes_only_its_own_run(pf, tmp_path):
    """Train 2 steps from model a at TP 2; a relaunch with another intermediate_size is one sentence before
    anything loads; with the same shapes and other weights it resumes with a note naming the ignored
    --model-path; --no-resume starts afresh from the new weights."""
    ckpt = tmp_path / "ckpt"
    base = ["--data", pf["corpus"], "--seq-len", "16", "--global-batch-size", "2", "--checkpoint-dir", ckpt]
    rc, out = _train(pf["tp"], ["--model-path", pf["a"], "--steps", "2", *base])
    assert rc == 0, out[-4000:]
    saved = json.loads((ckpt / "step-00000002" / "run.json").read_text())
    assert saved["config"]["intermediate_size"] == 128 and saved["seq_len"] == 16
    assert saved["model_path"] == str(pf["a"].resolve()) and "model.safetensors" in saved["weights"]["files"]
    assert saved["data"] == str(pf["corpus"].resolve()) and saved["started"]
    assert any(".shard(" in c for c in saved["schedule"]), saved["schedule"]

    # another architecture: one sentence naming the difference, before torch (exit code 2 on both ranks)
    rc, out = _train(pf["tp"], ["--model-path", pf["other"], "--steps", "4", *base])
    errors = [ln for ln in out.splitlines() if "error:" in ln]
    assert rc != 0 and len(errors) == 1, out[-4000:]
    assert "was saved for intermediate_size 128, the model has 96" in errors[0], errors
    assert "--no-resume" in errors[0] and "exitcode  : 2" in out and "CheckpointException" not in out

    # the same shapes, other weights, and another schedule (the TP-1 script at dp 2): notes, then the run
    # resumes at step 2 and keeps its origin
    rc, out = _train(pf["plain"], ["--model-path", pf["same"], "--steps", "3", *base])
    assert rc == 0, out[-4000:]
    note = f"note: resuming step 2 of the run started from {pf['a'].resolve()}; --model-path {pf['same']} is ignored"
    assert note in out and "resumed from" in out, out[-4000:]
    assert "was saved by another schedule" in out and "this one has 0" in out, out[-4000:]
    again = json.loads((ckpt / "step-00000003" / "run.json").read_text())
    assert again["model_path"] == str(pf["a"].resolve()) and again["started"] == saved["started"]

    # --no-resume: a fresh run from the other model, no note
    rc, out = _train(pf["tp"], ["--model-path", pf["other"], "--steps", "1", "--no-resume", *base])
    assert rc == 0 and "note: resuming" not in out and "resumed from" not in out, out[-4000:]


def test_a_tokenizer_that_does_not_load_suggests_the_tokenizer_option(tmp_path):
    """Issue 24: a directory whose tokenizer files do not make a tokenizer names --tokenizer in its sentence."""
    from slapo_lab.train.data import DataError, load_tokenizer

    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"})
    )
    with pytest.raises(DataError) as err:
        load_tokenizer(tmp_path)
    assert "could not be loaded" in str(err.value) and "pass --tokenizer" in str(err.value), str(err.value)


def test_position_limits_and_shape_differences_are_read_from_the_config():
    """The limit and the differences come from the config's own keys, across families, no table of models."""
    from transformers import CLIPConfig, GPT2Config, LlamaConfig, T5Config

    from slapo_lab.train.preflight import config_differences, position_limit

    assert position_limit(GPT2Config().to_dict()) == ("n_positions", 1024)
    assert position_limit(LlamaConfig(max_position_embeddings=256).to_dict()) == (
        "max_position_embeddings",
        256,
    )
    scaled = LlamaConfig(
        max_position_embeddings=256,
        rope_scaling={"rope_type": "linear", "factor": 4.0, "original_max_position_embeddings": 256},
    ).to_dict()
    assert position_limit(scaled)[1] == 1024
    assert position_limit(CLIPConfig().to_dict()) == ("max_position_embeddings", 77)  # its text tower
    assert position_limit(T5Config().to_dict()) is None  # relative positions: no limit
    a = LlamaConfig(intermediate_size=688, eos_token_id=2).to_dict()
    b = LlamaConfig(intermediate_size=512, eos_token_id=7, rms_norm_eps=1e-5).to_dict()
    assert config_differences(a, b) == [("intermediate_size", 688, 512)]
