"""TrainConfig (slapo_lab/train/config.py): the typed options, the command line generated from them, their
one-sentence errors, and the parser kept identical to the one exported scripts had before (a snapshot)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from slapo_lab.parallel_dims import ParallelDims
from slapo_lab.train.args import build_parser, parse_args
from slapo_lab.train.config import (
    BatchOptions,
    ConfigError,
    OptimizerOptions,
    ParallelOptions,
    TrainConfig,
    option_fields,
)

SNAPSHOT = Path(__file__).parent / "data" / "train_args_snapshot.json"
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


@pytest.mark.parametrize("kind", list(KINDS))
def test_parser_matches_the_snapshot_of_the_old_parser(kind):
    """Every flag of the hand-written parser (snapshot taken before TrainConfig) is still there, with the same
    spellings, default, choices and help text; no flag was added."""
    launcher, pipeline = KINDS[kind]
    old = {r["dest"]: r for r in json.loads(SNAPSHOT.read_text())["parsers"][kind]}
    new = {r["dest"]: r for r in _table(build_parser("d", launcher, pipeline, 4, 128))}
    assert new.keys() == old.keys()
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
