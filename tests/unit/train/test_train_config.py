"""TrainConfig (slapo_lab/train/config.py): the typed options, the command line generated from them, their
one-sentence errors, and the parser kept identical to the one exported scripts had before (a snapshot)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import runpy
import sys
from pathlib import Path

import harness
import pytest

import slapo_lab.train.config as config_module
from slapo_lab.export import render_script
from slapo_lab.parallel_dims import ParallelDims
from slapo_lab.train import preflight
from slapo_lab.train.args import build_parser, parse_args
from slapo_lab.train.config import (
    BatchOptions,
    ConfigError,
    OptimizerOptions,
    ParallelOptions,
    TrainConfig,
    option_fields,
)

SNAPSHOT = harness.TESTS / "data" / "train_args_snapshot.json"
KINDS = {
    "torchrun": ("torchrun", False),
    "torchrun+pipeline": ("torchrun", True),
    "deepspeed": ("deepspeed", False),
    "deepspeed+pipeline": ("deepspeed", True),
}


def _table(parser: argparse.ArgumentParser) -> list[dict]:
    return [
        {
            "flags": list(a.option_strings),
            "dest": a.dest,
            "default": a.default,
            "choices": list(a.choices) if a.choices else None,
            "help": a.help,
        }
        for a in parser._actions
        if not isinstance(a, argparse._HelpAction)
    ]


#: options added after the snapshot: a plan's prediction, printed beside the measurements (slapo_lab.planner)
ADDED_SINCE = {"predicted_step_s", "predicted_peak_gib"}


@pytest.mark.parametrize("kind", list(KINDS))
def test_parser_matches_the_snapshot_of_the_old_parser(kind):
    """Every flag of the hand-written parser (snapshot taken before TrainConfig) is still there, with the same
    spellings, default, choices and help text; no flag was added but those of :data:`ADDED_SINCE`."""
    launcher, pipeline = KINDS[kind]
    old = {r["dest"]: r for r in json.loads(SNAPSHOT.read_text())["parsers"][kind]}
    new = {r["dest"]: r for r in _table(build_parser("d", launcher, pipeline, 4, 128))}
    assert new.keys() - ADDED_SINCE == old.keys() and ADDED_SINCE <= new.keys()
    for dest, row in old.items():
        assert new[dest] == row, dest


def test_every_field_has_a_label_and_unique_name():
    names = [f.name for s in dataclasses.fields(TrainConfig) for f in dataclasses.fields(s.default_factory)]
    assert len(names) == len(set(names)) == len(option_fields())
    for name, (_, f) in option_fields().items():
        assert f.metadata["label"], name
        assert f.metadata["help"] or name in (
            "optimizer",
            "adam_beta1",
            "adam_beta2",
            "adam_eps",
            "local_rank",
        )


def test_round_trip_argv_and_flat():
    cfg = TrainConfig.from_flat(
        {
            "model_path": "m",
            "data": "corpus.jsonl",
            "seq_len": 64,
            "eval_data": "val.txt",
            "eval_every": 5,
            "dp": 2,
            "zero": 2,
            "pp_schedule": "Interleaved1F1B",
            "stages_per_rank": 2,
            "global_batch_size": 8,
            "epochs": 1.5,
            "lr": 3e-5,
            "adam_beta2": 0.95,
            "lr_schedule": "cosine",
            "checkpoint_dir": "ck",
            "checkpoint_every": 10,
            "no_resume": True,
            "bf16": True,
            "verify": False,
            "peak_tflops": 989.5,
        }
    )
    argv = cfg.to_argv()
    assert "--no-verify" in argv and "--zero" in argv and "--lr" in argv
    assert TrainConfig.from_args(argv, launcher="deepspeed", pipeline=True) == cfg
    assert TrainConfig.from_flat(cfg.flat()) == cfg
    assert TrainConfig().to_argv() == []
    assert cfg.optimizer.lr == 3e-5 and cfg.batch.epochs == 1.5 and cfg.parallel.zero == 2


@pytest.mark.parametrize(
    "values, sentence",
    [
        ({"global_batch_size": 0}, "--global-batch-size must be at least 1, not 0"),
        ({"dp": 0}, "--dp must be at least 1, not 0"),
        ({"steps": -1}, "--steps must not be negative"),
        ({"lr": -0.1}, "--lr must not be negative"),
        ({"max_grad_norm": -1.0}, "--max-grad-norm must not be negative"),
        ({"epochs": 0.0}, "--epochs must be positive"),
        ({"optimizer": "lion"}, "--optimizer must be one of adamw, sgd, not 'lion'."),
        ({"data": "x.txt"}, "--data needs --seq-len (tokens per training sequence)"),
        ({"checkpoint_every": 3}, "--checkpoint-every needs --checkpoint-dir"),
        ({"eval_every": 3}, "--eval-every needs --eval-data"),
        ({"device": "cpu", "backend": "nccl"}, "--backend nccl moves CUDA tensors only"),
        ({"stages_per_rank": 2}, "--stages-per-rank > 1 needs --pp-schedule Interleaved1F1B"),
        (
            {"zero": 1, "fsdp": True},
            "--fsdp and --zero both shard over the data-parallel replicas; choose one",
        ),
        ({"learning_rate": 1.0}, "unknown option(s) learning_rate"),
    ],
)
def test_one_sentence_errors(values, sentence):
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_flat(values)
    assert str(err.value).startswith(sentence) and "\n" not in str(err.value)


def test_command_line_error_is_argparse_exit_2(capsys):
    parser = build_parser("d", "torchrun", False, 4, 128)
    with pytest.raises(SystemExit) as done:
        parse_args(parser, ["--checkpoint-every", "5"])
    assert done.value.code == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .endswith("error: --checkpoint-every needs --checkpoint-dir")
    )


def test_defaults_layers_and_frozen():
    """Old scripts' DEFAULTS dict over the example sizes; a TrainConfig as every default; options are frozen."""
    cfg = parse_args(build_parser("d", example_batch=4, example_seq=128, defaults={"dp": 2, "lr": 0.5}), [])
    assert (cfg.batch.global_batch_size, cfg.data.seq_len, cfg.parallel.dp, cfg.optimizer.lr) == (
        4,
        128,
        2,
        0.5,
    )
    base = TrainConfig(batch=BatchOptions(global_batch_size=6), optimizer=OptimizerOptions(lr=0.25))
    cfg = parse_args(build_parser("d", example_batch=4, defaults=base), ["--steps", "3"])
    assert (cfg.batch.global_batch_size, cfg.optimizer.lr, cfg.batch.steps) == (6, 0.25, 3)
    with pytest.raises(ValueError, match="unknown default option"):
        build_parser("d", defaults={"zero": 1})  # --zero exists in DeepSpeed scripts only
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.optimizer.lr = 1.0
    with pytest.raises(ConfigError, match="TrainConfig's optimizer must be a OptimizerOptions"):
        TrainConfig(optimizer={"lr": 1.0})


def test_parallel_section_yields_parallel_dims():
    assert ParallelOptions().dims(2, 1, 8) == ParallelDims(2, 1, 4)
    assert ParallelOptions(dp=2).dims(2, 2, 8) == ParallelDims(2, 2, 2)
    assert ParallelOptions().dims(3, 1, 8) == ParallelDims(3, 1, 2)  # the replicas that fit
    assert TrainConfig().model.tokenizer_dir is None
    assert TrainConfig.from_flat({"model_path": "m"}).model.tokenizer_dir == "m"


# ---------------------------------------------------------------------------------------------- literal & scripts
OLD_SCRIPT = harness.TESTS / "data" / "exported_before_trainconfig.py.txt"
STEP = re.compile(r"^step (\d+)/(\d+) loss (\S+) \| lr (\S+)", re.MULTILINE)


def test_literal_round_trips_and_stays_data():
    """``TrainConfig.literal()`` is Python that builds the same config, and ``from_literal`` reads it back without
    running it; a hostile path stays a string; anything but section calls of literals is refused."""
    evil = "'''\"\"\"\n__import__('os').system('echo pwned') #\\"
    cfg = TrainConfig.from_flat(
        {
            "model_path": evil,
            "data": "c.jsonl",
            "seq_len": 64,
            "dp": 2,
            "fsdp": True,
            "lr": 3e-4,
            "verify": False,
        }
    )
    text = cfg.literal()
    assert text.startswith("TrainConfig(\n    model=ModelOptions(model_path=") and text.endswith("\n)")
    assert all(len(line) <= 110 for line in text.splitlines())
    assert eval(text, {n: getattr(config_module, n) for n in config_module.__all__}) == cfg
    assert TrainConfig.from_literal(text) == cfg
    assert cfg.section_classes() == [
        "DataOptions",
        "ModelOptions",
        "OptimizerOptions",
        "ParallelOptions",
        "VerifyOptions",
    ]
    assert (
        TrainConfig().literal() == "TrainConfig()"
        and TrainConfig.from_literal("TrainConfig()") == TrainConfig()
    )
    long = TrainConfig.from_flat({"model_path": "m" * 120})
    assert TrainConfig.from_literal(long.literal()) == long
    assert "    model=ModelOptions(\n        model_path='mmm" in long.literal()  # too long: one option a line
    for bad, words in (
        ("TrainConfig(data=DataOptions(data=open('x')))", "malformed"),
        ("TrainConfig(data=__import__('os'))", "expected a DataOptions(...)"),
        ("TrainConfig(data=DataOptions(lr=1.0))", "DataOptions has no option lr."),
        ("TrainConfig(batch=BatchOptions(steps=-1))", "--steps must not be negative"),
    ):
        with pytest.raises((ConfigError, ValueError), match=re.escape(words)):
            TrainConfig.from_literal(bad)


def _run(path: Path, argv: list[str], monkeypatch) -> int:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(sys, "argv", [str(path), *argv])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(path), run_name="__main__")
    return done.value.code


def _parsed(path: Path, argv: list[str], monkeypatch) -> TrainConfig:
    seen = []

    def stop(cfg, **_):
        seen.append(cfg)
        raise preflight.PreflightError("stopped by the test after parsing.")

    with monkeypatch.context() as m:
        m.setattr(preflight, "check", stop)
        assert _run(path, argv, m) == 2
    return seen[0]


def test_new_script_renders_config_and_parses_like_an_old_one(tmp_path, monkeypatch, capsys):
    """A script exported now holds ``CONFIG = TrainConfig(...)`` of the chosen options; its command line gives
    the same options as the script exported before TrainConfig (``DEFAULTS`` dict, kept as a fixture) with the
    same choices, with and without flags that override them."""
    old = tmp_path / "train_old_bert.py"
    old.write_text(OLD_SCRIPT.read_text())
    ns = runpy.run_path(str(old), run_name="fixture")
    text = render_script(
        ns["MODEL"], [], ns["INPUTS"], 1, script_name="train_new.py", defaults=ns["DEFAULTS"]
    )
    assert "DEFAULTS" not in text and "config=CONFIG" in text
    assert "from slapo_lab.train.config import BatchOptions, OptimizerOptions, TrainConfig\n" in text
    assert "    batch=BatchOptions(global_batch_size=2, micro_batch_size=1, steps=2),\n" in text
    new = tmp_path / "train_new.py"
    new.write_text(text)
    for argv in ([], ["--lr", "0.5", "--steps", "7", "--seq-len", "8"], ["--global-batch-size", "4"]):
        a, b = _parsed(old, argv, monkeypatch), _parsed(new, argv, monkeypatch)
        assert a == b, argv
    assert (a.batch.steps, a.optimizer.lr, a.batch.global_batch_size, a.batch.micro_batch_size) == (
        2,
        1e-3,
        4,
        1,
    )
    assert a.data.seq_len == 16  # the example's, from INPUTS
    capsys.readouterr()


def test_old_exported_script_still_trains(tmp_path, monkeypatch, capsys):
    """The compatibility path: a script exported before TrainConfig (its ``main(..., defaults=DEFAULTS)``
    call, a fixture written by that version) still runs: Verify passes and its baked-in defaults (2 steps at lr
    1e-3, global batch 2 in micro-batches of 1) train."""
    path = tmp_path / "train_old_bert.py"
    path.write_text(OLD_SCRIPT.read_text())
    assert "defaults=DEFAULTS" in path.read_text()
    assert _run(path, ["--device", "cpu", "--verify-batch-size", "1"], monkeypatch) == 0
    out = capsys.readouterr().out
    assert (
        "Verify: PASSED" in out and "global batch 2 x 16 tokens in micro-batches of 1 (2 per step" in out
    ), out
    steps = STEP.findall(out)
    assert [(s[0], s[1]) for s in steps] == [("1", "2"), ("2", "2")], out
    assert all(math.isfinite(float(s[2])) for s in steps), out
