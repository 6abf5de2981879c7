"""Export: loop folding, safe rendering, model/input specs, schedule files, CLI, build, and the exported script's
entry into ``slapo_lab.train`` (its command line, launch refusals, a one-process run; no torchrun here)."""

from __future__ import annotations

import ast
import copy
import errno
import inspect
import json
import math
import os
import re
import runpy
import subprocess
import sys
import types
from pathlib import Path

import harness
import pytest
import torch
from torch import nn

import slapo_lab as sl
import slapo_lab.train.config as train_config
from slapo_lab.build import build
from slapo_lab.export import (
    ExportError,
    export_script,
    find_runs,
    input_spec,
    load_schedule,
    model_spec,
    render_script,
    save_schedule,
    schedule_lines,
)
from slapo_lab.record import SCHEMA_VERSION, Call
from slapo_lab.train import preflight
from slapo_lab.train.config import TrainConfig

REPO = harness.REPO_ROOT
HOSTILE = ['a"b', "x\ny", "__import__('os')", "{i}", "c'd\\", "e}{", 'f"]); import os; ("']
# the step line of slapo_lab.train (CPU: no MFU)
STEP = re.compile(
    r"^step (\d+)/(\d+) loss (\S+) \| lr (\S+) \| grad norm (\S+) \| (\d+) tokens/s \| ([\d.]+) "
    r"samples/s \| peak mem (\d+) MiB$",
    re.MULTILINE,
)


def _one_sentence(err) -> str:
    text = str(err.value if hasattr(err, "value") else err)
    assert "\n" not in text and text.endswith("."), text
    return text


class _RecordingSchedule:
    """Stands in for ``sch``: records ``sch[path].<primitive>(*args, **kwargs)`` as Calls."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, path):
        rec = self

        class Node:
            def __getattr__(self, name):
                return lambda *a, **k: rec.calls.append(Call(path, name, tuple(a), dict(k)))

        return Node()


def _load_script(text: str) -> dict:
    """Run a generated script's module-level code (not ``main``): its constants and functions."""
    ns = {"__name__": "exported"}
    exec(compile(text, "train.py", "exec"), ns)  # noqa: S102 - running generated code is the test
    return ns


def _replay_lines(lines):
    ns = _load_script("def schedule(sch):\n" + "\n".join("    " + ln for ln in lines))
    sch = _RecordingSchedule()
    ns["schedule"](sch)
    return sch.calls


# what the body of schedule(sch) may consist of: subscripts of sch with literal (or f-string) paths, calls with
# literal arguments (negative numbers, lists, tuples, dicts), and range loops
SCHEDULE_NODES = (
    ast.FunctionDef,
    ast.arguments,
    ast.arg,
    ast.Expr,
    ast.Call,
    ast.Attribute,
    ast.Subscript,
    ast.Name,
    ast.Constant,
    ast.keyword,
    ast.For,
    ast.JoinedStr,
    ast.FormattedValue,
    ast.Load,
    ast.Store,
    ast.Pass,
    ast.UnaryOp,
    ast.USub,
    ast.List,
    ast.Tuple,
    ast.Dict,
)
CONSTANTS = ("MODEL", "INPUTS", "TP", "STAGES", "CONFIG")
MAIN = (
    'if __name__ == "__main__":\n    raise SystemExit(slapo_lab.train.main(model=MODEL, schedule=schedule, '
    "inputs=INPUTS, tp=TP, stages=STAGES, launcher={!r}, config=CONFIG, title=__doc__.splitlines()[0]))"
)


def _script_constants(text: str, launcher: str = "torchrun") -> dict:
    """Check that an exported script is data plus one call, and return its constants (read as literals).

    The module must be exactly: a docstring; ``import slapo_lab.train`` and the import of ``TrainConfig`` and
    its section classes from ``slapo_lab.train.config``; ``MODEL``, ``INPUTS``, ``TP`` and ``STAGES`` assigned
    Python literals (``ast.literal_eval``: nothing a schedule file holds can become code there), ``CONFIG`` a
    ``TrainConfig(...)`` of section calls of literals (``TrainConfig.from_literal``, returned as the options it
    changes); ``def schedule(sch)`` made of :data:`SCHEDULE_NODES` naming only ``sch``, ``i`` and
    ``range``; and the ``__main__`` block calling ``slapo_lab.train.main``.
    """
    tree = ast.parse(text)
    doc, *body = tree.body
    assert (
        isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)
    )
    constants, functions, mains = {}, [], []
    for node in body:
        if isinstance(node, ast.Import):
            assert [(a.name, a.asname) for a in node.names] == [("slapo_lab.train", None)], ast.dump(node)
        elif isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
            assert node.module == "slapo_lab.train.config" and "TrainConfig" in names, ast.dump(node)
            assert all(hasattr(train_config, n) and n.endswith(("Options", "Config")) for n in names), names
        elif isinstance(node, ast.Assign):
            (target,) = node.targets
            assert isinstance(target, ast.Name) and target.id in CONSTANTS and target.id not in constants
            if target.id == "CONFIG":
                constants[target.id] = TrainConfig.from_literal(ast.unparse(node.value)).changed()
            else:
                constants[target.id] = ast.literal_eval(node.value)
        elif isinstance(node, ast.FunctionDef):
            assert (
                node.name == "schedule"
                and [a.arg for a in node.args.args] == ["sch"]
                and not node.decorator_list
            )
            assert not (node.args.vararg or node.args.kwarg or node.args.kwonlyargs or node.args.defaults)
            first = node.body[0]
            docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            statements = node.body[1:] if docstring else node.body
            for stmt in statements:
                for sub in ast.walk(stmt):
                    assert isinstance(sub, SCHEDULE_NODES), ast.dump(sub)
                    assert not isinstance(sub, ast.Name) or sub.id in ("sch", "i", "range"), ast.dump(sub)
            functions.append(node)
        elif isinstance(node, ast.If):
            assert ast.unparse(node) == ast.unparse(ast.parse(MAIN.format(launcher))), ast.unparse(node)
            mains.append(node)
        else:
            pytest.fail(f"unexpected statement in the script: {ast.unparse(node)}")
    assert set(constants) == set(CONSTANTS) and len(functions) == len(mains) == 1
    return constants


def _imports(text: str) -> set[str]:
    """The top-level packages the script imports (anywhere in it)."""
    out = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            out.add((node.module or "").split(".")[0])
    return out


def _ruff(path: Path) -> subprocess.CompletedProcess:
    """``ruff check`` with the repository's config, run from the repo root and from the script's folder.

    (Whether ``slapo_lab`` counts as first-party for import sorting depends on the folder.)
    """
    ruff = Path(sys.executable).with_name("ruff")
    cmd = [str(ruff)] if ruff.exists() else [sys.executable, "-m", "ruff"]
    for cwd in (REPO, path.parent):
        r = subprocess.run(
            [*cmd, "check", "--config", str(REPO / "pyproject.toml"), "--no-cache", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=cwd,
            check=False,
        )
        if r.returncode:
            break
    return r


def _run_script(path, argv, monkeypatch) -> int:
    """``python path *argv`` in this process (one process, no launcher: RANK unset); returns the exit status."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(sys, "argv", [str(path), *argv])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(path), run_name="__main__")
    return exit_.value.code


def _parsed(path, argv, monkeypatch):
    """The options ``python path *argv`` parses (through the script and ``slapo_lab.train.main``), the
    :class:`~slapo_lab.train.config.TrainConfig` flattened to ``ns.<option>``; the run is stopped right after
    parsing, before the launch checks (:mod:`slapo_lab.train.preflight`)."""
    from slapo_lab.train import preflight

    seen = []

    def stop(args, **_):
        seen.append(args)
        raise preflight.PreflightError("stopped by the test after parsing.")

    with monkeypatch.context() as m:
        m.setattr(preflight, "check", stop)
        assert _run_script(path, argv, m) == 2
    return types.SimpleNamespace(**seen[0].flat())


@pytest.fixture
def bert_tp(tiny_bert, apply_bert_tp):
    """(model, calls): issue 2's schedule recorded on the tiny BERT, simulated for 2 ranks."""
    sch = sl.create_schedule(tiny_bert, world_size=2)
    apply_bert_tp(sch, 4)
    return tiny_bert, list(sch.record.calls)


@pytest.fixture
def ids():
    return torch.randint(0, 1000, (4, 32), generator=torch.Generator().manual_seed(0))


# --------------------------------------------------------------------------------------- folding
def test_bert_schedule_folds_into_one_loop(bert_tp):
    _, calls = bert_tp
    lines = schedule_lines(calls)
    assert lines[0] == "for i in range(4):"
    assert len(lines) == 1 + len(calls) // 4
    assert '    sch[f"encoder.layer.{i}.attention.self.query"].shard("weight", axis=0)' in lines
    assert '    sch[f"encoder.layer.{i}"].checkpoint()' in lines
    assert (
        '    sch[f"encoder.layer.{i}.output.dense"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")'
        in lines
    )
    assert _replay_lines(lines) == calls


def _c(path, prim="checkpoint", *args, **kwargs):
    return Call(path, prim, args, kwargs)


@pytest.mark.parametrize(
    "calls, expected",
    [
        # one call per layer, layers not starting at 0
        (
            [_c("h.2.mlp"), _c("h.3.mlp"), _c("h.4.mlp")],
            ["for i in range(2, 5):", '    sch[f"h.{i}.mlp"].checkpoint()'],
        ),
        # the index at the end of the path
        ([_c("h.0"), _c("h.1")], ["for i in range(2):", '    sch[f"h.{i}"].checkpoint()']),
        # a gap in the indices: no loop
        ([_c("h.0"), _c("h.2")], ['sch["h.0"].checkpoint()', 'sch["h.2"].checkpoint()']),
        # non-canonical index (f"{i}" would write "1", not "01"): no loop
        ([_c("h.00"), _c("h.01")], ['sch["h.00"].checkpoint()', 'sch["h.01"].checkpoint()']),
        # different arguments: no loop
        (
            [_c("h.0", "shard", "weight", axis=0), _c("h.1", "shard", "weight", axis=1)],
            ['sch["h.0"].shard("weight", axis=0)', 'sch["h.1"].shard("weight", axis=1)'],
        ),
        # two indices change together: no loop
        ([_c("h.0.e.0"), _c("h.1.e.1")], ['sch["h.0.e.0"].checkpoint()', 'sch["h.1.e.1"].checkpoint()']),
    ],
)
def test_fold_cases(calls, expected):
    assert schedule_lines(calls) == expected
    assert _replay_lines(expected) == calls


def test_fold_keeps_surrounding_calls_and_order():
    calls = (
        [_c("embeddings.word_embeddings", "shard", "weight", axis=0)]
        + [
            c
            for i in range(3)
            for c in (_c(f"enc.layer.{i}.q", "shard", "weight", axis=0), _c(f"enc.layer.{i}"))
        ]
        + [_c("pooler.dense", "shard", "weight", axis=0), _c("enc.layer.7")]
    )
    lines = schedule_lines(calls)
    assert lines == [
        'sch["embeddings.word_embeddings"].shard("weight", axis=0)',
        "for i in range(3):",
        '    sch[f"enc.layer.{i}.q"].shard("weight", axis=0)',
        '    sch[f"enc.layer.{i}"].checkpoint()',
        'sch["pooler.dense"].shard("weight", axis=0)',
        'sch["enc.layer.7"].checkpoint()',
    ]
    assert _replay_lines(lines) == calls
    runs = find_runs(calls)
    assert len(runs) == 4 and runs[1].count == 3 and runs[1].length == 2


def test_fold_prefers_the_longest_cover():
    # all queries first, then all keys: two one-line loops
    calls = [_c(f"l.{i}.q", "shard", "weight", axis=0) for i in range(3)] + [
        _c(f"l.{i}.k", "shard", "weight", axis=0) for i in range(3)
    ]
    lines = schedule_lines(calls)
    assert [ln for ln in lines if ln.startswith("for")] == ["for i in range(3):", "for i in range(3):"]
    assert _replay_lines(lines) == calls


class _Hostile(nn.Module):
    def __init__(self):
        super().__init__()
        self.d = nn.ModuleDict({k: nn.Linear(4, 4) for k in HOSTILE})
        self.layers = nn.ModuleList([nn.ModuleDict({k: nn.Linear(4, 4) for k in HOSTILE}) for _ in range(3)])
        self.safe = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

    def forward(self, x):
        return x


@pytest.fixture
def hostile_calls():
    sch = sl.create_schedule(_Hostile(), world_size=2)
    for k in HOSTILE:
        sch[f"d.{k}"].shard("weight", axis=0)
        sch[f"d.{k}"].shard("bias", axis=0)
    for i in range(3):  # repeats over layers, but with hostile suffixes: never an f-string
        for k in HOSTILE:
            sch[f"layers.{i}.{k}"].shard("weight", axis=0)
    for i in range(3):  # safe paths still fold
        sch[f"safe.{i}"].shard("weight", axis=1)
    return list(sch.record.calls)


def test_hostile_module_names_render_as_literals(hostile_calls):
    lines = schedule_lines(hostile_calls)
    loops = [ln for ln in lines if ln.startswith("for ")]
    assert loops == ["for i in range(3):"]  # only the safe run folded
    fstrings = [ln for ln in lines if 'sch[f"' in ln]
    assert fstrings == ['    sch[f"safe.{i}"].shard("weight", axis=1)']
    assert _replay_lines(lines) == hostile_calls  # every path comes back byte for byte
    # the code is nothing but subscripts of sch with literal (or f-string) paths and literal arguments
    tree = ast.parse("def schedule(sch):\n" + "\n".join("    " + ln for ln in lines))
    allowed = (
        ast.Module,
        ast.FunctionDef,
        ast.arguments,
        ast.arg,
        ast.Expr,
        ast.Call,
        ast.Attribute,
        ast.Subscript,
        ast.Name,
        ast.Constant,
        ast.keyword,
        ast.For,
        ast.JoinedStr,
        ast.FormattedValue,
        ast.Load,
        ast.Store,
    )
    for node in ast.walk(tree):
        assert isinstance(node, allowed), ast.dump(node)
        if isinstance(node, ast.Name):
            assert node.id in ("sch", "i", "range")


def test_hostile_schedule_script_is_data_compiles_and_is_ruff_clean(hostile_calls, tmp_path):
    spec = {"kind": "factory", "factory": "hostile_models:build"}
    inputs = {"x": {"shape": [2, 4], "dims": ["batch", 4], "dtype": "float32"}}
    text = render_script(spec, hostile_calls, inputs, world_size=2)
    compile(text, "train.py", "exec")
    out = tmp_path / "train.py"
    out.write_text(text)
    r = _ruff(out)
    assert r.returncode == 0, r.stdout + r.stderr
    consts = _script_constants(text)  # only literals, the schedule function and the call into slapo_lab.train
    assert consts == {"MODEL": spec, "INPUTS": inputs, "TP": 2, "STAGES": 1, "CONFIG": {}}
    assert _imports(text) == {"slapo_lab"}  # the factory is imported by the runtime, on every node
    ns = _load_script(text)
    sch = _RecordingSchedule()
    ns["schedule"](sch)
    assert sch.calls == hostile_calls  # every hostile path comes back byte for byte


# ----------------------------------------------------------------------------------------- render
def test_bert_script_compiles_is_ruff_clean_and_replays(bert_tp, ids, tmp_path, monkeypatch, capsys):
    model, calls = bert_tp
    path = export_script(tmp_path / "train_bert.py", model, calls, {"input_ids": ids}, world_size=2)
    assert path == (tmp_path / "train_bert.py").resolve()
    text = path.read_text()
    compile(text, str(path), "exec")
    r = _ruff(path)
    assert r.returncode == 0, r.stdout + r.stderr
    for cmd in (
        "torchrun --nproc_per_node=2 train_bert.py --device cuda",
        (
            "torchrun --nnodes=4 --nproc_per_node=8 --node_rank=R --master_addr=HOST0 --master_port=29500 "
            "train_bert.py"
        ),
        "torchrun --nproc_per_node=2 --master_addr=127.0.0.1 train_bert.py --device cpu",
        "python train_bert.py --help",
    ):
        assert cmd in text
    assert _imports(text) == {"slapo_lab"}
    consts = _script_constants(text)
    assert consts["MODEL"] == model_spec(model) and consts["MODEL"]["config"] == json.loads(
        json.dumps(model.config.to_dict())
    )
    assert consts["INPUTS"] == input_spec({"input_ids": ids}, 1000)
    assert (consts["TP"], consts["STAGES"], consts["CONFIG"]) == (2, 1, {})
    # the runtime rebuilds the model from the spec (on the meta device) with the recorded full shapes
    from slapo_lab.train.weights import build_meta_model

    rebuilt = build_meta_model(consts["MODEL"])
    assert type(rebuilt) is type(model)
    assert {n: p.shape for n, p in rebuilt.named_parameters()} == {
        n: p.orig_shape if hasattr(p, "orig_shape") else p.shape for n, p in model.named_parameters()
    }
    # schedule(sch) replays the recorded calls
    sch = sl.create_schedule(rebuilt, world_size=2)
    _load_script(text)["schedule"](sch)
    assert sch.record.calls == calls
    # the command line, through the script and slapo_lab.train.main: the example's batch and length are the
    # defaults, Verify is on
    args = _parsed(path, [], monkeypatch)
    assert (
        args.verify,
        args.global_batch_size,
        args.seq_len,
        args.micro_batch_size,
        args.bf16,
        args.data,
        args.optimizer,
        args.lr,
        args.max_grad_norm,
    ) == (True, 4, 32, None, False, "synthetic", "adamw", 1e-4, 1.0)
    assert _parsed(path, ["--no-verify", "--device", "cpu"], monkeypatch).verify is False
    # DeepSpeed / pipeline options only there: this script's command line refuses them (their typed fields keep
    # the defaults the runtime reads)
    assert (args.zero, args.pp_schedule, args.stages_per_rank) == (0, "1F1B", 1)
    capsys.readouterr()
    for flag, value in (("--zero", "1"), ("--pp-schedule", "GPipe"), ("--stages-per-rank", "2")):
        assert _run_script(path, [flag, value], monkeypatch) == 2
        assert f"unrecognized arguments: {flag} {value}" in capsys.readouterr().err
    assert _run_script(path, ["--help"], monkeypatch) == 0
    helptext = " ".join(capsys.readouterr().out.split())
    assert helptext.startswith("usage: train_bert.py")
    assert "Train BertModel with a slapo-lab schedule: 2-way tensor parallelism." in helptext
    for option in (
        "--global-batch-size N",
        "--micro-batch-size N",
        "--dp N",
        "--fsdp",
        "--model-path DIR",
        "--checkpoint-dir DIR",
        "--save-hf DIR",
        "--log-dir DIR",
        "--verify, --no-verify",
    ):
        assert option in helptext, option


def test_script_runs_as_a_plain_python_file(bert_tp, ids, tmp_path):
    """The file launches on its own (``python train_bert.py --help``): it needs nothing but slapo_lab importable."""
    from harness import child_env

    model, calls = bert_tp
    path = export_script(tmp_path / "train_bert.py", model, calls, {"input_ids": ids}, world_size=2)
    r = subprocess.run(
        [sys.executable, str(path), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=child_env(),
        check=False,
    )
    assert r.returncode == 0 and "--global-batch-size" in r.stdout, r.stdout + r.stderr


def test_hostile_config_values_stay_data(tiny_bert, ids):
    evil = "'''\"\"\"\n<<SCHEDULE_BODY>> __import__('os').system('echo pwned') #\\"
    tiny_bert.config.evil_note = evil
    spec = model_spec(tiny_bert)
    text = render_script(
        spec, [], input_spec({"input_ids": ids}, 1000), world_size=1, script_name='x"; rm.py'
    )
    consts = _script_constants(text)
    assert consts["MODEL"]["config"]["evil_note"] == evil and consts["MODEL"] == spec
    assert _load_script(text)["MODEL"]["config"]["evil_note"] == evil
    assert "pass  # no recorded calls" in text
    assert (
        "python train.py --device cpu" in text and "rm.py" not in text
    )  # the unsafe script name is not used


def test_hostile_export_defaults_stay_data(tiny_bert, ids):
    """Options baked in at export (paths the user typed) are literals too; unknown options are refused."""
    evil = "'''\"\"\"\n__import__('os').system('echo pwned') #\\"
    defaults = {
        "model_path": evil,
        "checkpoint_dir": evil + "/ckpt",
        "save_hf": "out\n" + evil,
        "log_dir": "{i}",
        "dp": 2,
        "fsdp": True,
        "lr": 3e-4,
    }
    text = render_script(
        model_spec(tiny_bert), [], input_spec({"input_ids": ids}, 1000), world_size=2, defaults=defaults
    )
    assert _script_constants(text)["CONFIG"] == defaults
    for bad, match in [
        ({"os.system('x')": 1}, "is not an option an export can set"),
        ({"zero": 1}, 'needs launcher="deepspeed"'),
        ({"lr": float("nan")}, "Python literal"),
        ({"log_dir": print}, "the Python function print"),
    ]:
        with pytest.raises(ExportError, match=re.escape(match)) as err:
            render_script(
                model_spec(tiny_bert), [], input_spec({"input_ids": ids}, 1000), world_size=2, defaults=bad
            )
        _one_sentence(err)


def test_lm_head_trains_on_labels(ids):
    """A model with a language-model head trains on its own loss with labels = input_ids (synthetic data)."""
    from transformers import BertConfig, BertForMaskedLM

    from slapo_lab.train.data import SyntheticData, objective_of
    from slapo_lab.train.loop import model_loss

    m = BertForMaskedLM(
        BertConfig(
            num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=100
        )
    )
    consts = _script_constants(
        render_script(model_spec(m), [], input_spec({"input_ids": ids % 100}, 100), world_size=1)
    )
    assert objective_of(consts["MODEL"]["class"]) == "masked_lm"
    assert objective_of("BertModel") is None and objective_of("GPT2LMHeadModel") == "causal_lm"
    data = SyntheticData(consts["INPUTS"], 8, seed=0, lm_labels=True)
    batch = data.batch([0, 1], 0)
    assert batch["input_ids"].shape == (2, 8) and batch["input_ids"].max() < 100
    assert torch.equal(batch["labels"], batch["input_ids"])
    assert torch.equal(data.batch([0, 1], 0)["input_ids"], batch["input_ids"])  # the same on every rank
    out = m(**batch)
    loss = model_loss(out, 0)
    assert loss is out.loss and loss.ndim == 0 and torch.isfinite(loss)


def test_script_main_refuses_a_wrong_world_size(bert_tp, ids, tmp_path, monkeypatch, capsys):
    model, calls = bert_tp
    path = export_script(tmp_path / "t.py", model, calls, {"input_ids": ids}, 2)
    assert (
        _run_script(path, ["--device", "cpu", "--steps", "1"], monkeypatch) == 2
    )  # `python t.py`: 1 process
    err = capsys.readouterr().err.strip()
    assert err == (
        "error: This schedule runs tp=2 (tensor parallel) x pp=1 (pipeline) x dp processes, so the world "
        "size must be a multiple of 2, but 1 process(es) were launched; use torchrun --nproc_per_node=2."
    ), err


def test_script_main_refuses_a_batch_that_does_not_split(monkeypatch, tmp_path, capsys):
    """A global batch that micro-batches cannot make up: one sentence, exit status 2, before the model is built."""
    model = _tiny_gpt2()
    path = export_script(tmp_path / "t.py", model, [], {"input_ids": torch.randint(0, 128, (4, 16))}, 1)
    assert (
        _run_script(
            path, ["--device", "cpu", "--global-batch-size", "3", "--micro-batch-size", "2"], monkeypatch
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("error: The global batch size 3 is not divisible by micro-batch size 2")
        and "\n" not in err
        and err.endswith(".")
    ), err
    for bad, match in [
        (["--global-batch-size", "0"], "--global-batch-size must be at least 1"),
        (["--device", "cpu", "--backend", "nccl"], "--backend nccl moves CUDA tensors only"),
        (["--checkpoint-every", "2"], "--checkpoint-every needs --checkpoint-dir"),
        (["--data", "corpus.jsonl", "--seq-len", "0"], "--seq-len must be at least 1"),
    ]:
        assert _run_script(path, bad, monkeypatch) == 2
        assert match in capsys.readouterr().err, bad


def test_script_main_single_process_lm(monkeypatch, tmp_path, capsys):
    """World size 1 without torchrun: Verify, then an LM head trains on labels=input_ids (AdamW, 2 micro-batches
    of 2 per step, metrics.csv in --log-dir)."""
    import csv

    from transformers import BertConfig, BertForMaskedLM

    from slapo_lab.train import metrics

    torch.manual_seed(0)
    model = BertForMaskedLM(
        BertConfig(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            intermediate_size=128,
            vocab_size=200,
            max_position_embeddings=64,
        )
    )
    sch = sl.create_schedule(model)
    for i in range(2):
        sch[f"bert.encoder.layer.{i}"].checkpoint()
    ids = torch.randint(0, 200, (4, 16))
    text = render_script(
        model_spec(model),
        sch.record.calls,
        input_spec({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, 200),
        world_size=1,
    )
    assert "for i in range(2):" in text and "python train.py --device cpu" in text
    path = tmp_path / "train.py"
    path.write_text(text)
    precisions = []
    real_logger = metrics.MetricsLogger
    monkeypatch.setattr(
        metrics,
        "MetricsLogger",
        lambda *a, **k: precisions.append(k.get("precision")) or real_logger(*a, **k),
    )
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        rc = _run_script(
            path,
            [
                "--device",
                "cpu",
                "--steps",
                "2",
                "--micro-batch-size",
                "2",
                "--verify-batch-size",
                "1",
                "--log-dir",
                str(tmp_path / "logs"),
            ],
            monkeypatch,
        )
    finally:
        torch.set_float32_matmul_precision(old)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert (
        "Verify: PASSED" in out and "Verify: one forward and backward of 1 sequence(s) of 16 tokens" in out
    ), out
    assert (
        "1 rank(s) = tp 1 x pp 1 x dp 1, device cpu, global batch 4 x 16 tokens in micro-batches of 2 (2 per "
        "step and replica)" in out
    ), out
    assert "labels = input_ids" in out, out
    steps = STEP.findall(out)
    assert [(s[0], s[1]) for s in steps] == [("1", "2"), ("2", "2")], out
    losses = [float(s[2]) for s in steps]
    assert all(math.isfinite(x) for x in losses) and 3.0 < losses[0] < 8.0, out  # ln(200) = 5.3
    assert float(steps[0][3]) == pytest.approx(1e-4)  # AdamW at the default peak lr, linear decay after
    assert precisions == ["fp32"]  # MFU is taken against the peak of the precision that ran (issue 10)
    with open(tmp_path / "logs" / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["step"] for r in rows] == ["1", "2"]
    assert [float(r["loss"]) for r in rows] == pytest.approx(losses, abs=1e-6)


def test_training_peak_memory_excludes_verify(monkeypatch, tmp_path, capsys):
    """Issue 10: the printed (CUDA) peak included Verify's; after Verify the runtime must restart the peak count
    (:func:`slapo_lab.train.metrics.reset_peak_memory`, a no-op on CPU) before the first training step, and take
    MFU against the bf16 peak under --bf16."""
    from slapo_lab.train import metrics, verify

    events, precisions = [], []
    real_verify, real_logger = verify.run_verify, metrics.MetricsLogger

    class Logger(real_logger):
        def __init__(self, *a, **k):
            precisions.append(k.get("precision"))
            super().__init__(*a, **k)

        def log_step(self, step, **kw):
            events.append(f"step {step}")
            return super().log_step(step, **kw)

    monkeypatch.setattr(verify, "run_verify", lambda *a, **k: events.append("verify") or real_verify(*a, **k))
    monkeypatch.setattr(metrics, "reset_peak_memory", lambda device: events.append("reset"))
    monkeypatch.setattr(metrics, "MetricsLogger", Logger)
    model = _tiny_gpt2()
    path = export_script(tmp_path / "t.py", model, [], {"input_ids": torch.randint(0, 128, (2, 8))}, 1)
    assert _run_script(path, ["--device", "cpu", "--steps", "1", "--bf16"], monkeypatch) == 0, (
        capsys.readouterr()
    )
    assert "Verify: PASSED" in capsys.readouterr().out
    assert precisions == ["bf16"]
    assert events[0] == "verify" and events[-1] == "step 1", events
    assert "reset" in events, f"the peak memory count is never restarted after Verify: {events}"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"launcher": "mpirun"}, "is not supported"),
        ({"launcher": None}, "is not supported"),
        ({"world_size": 0}, "positive integer"),
        ({"world_size": True}, "positive integer"),
    ],
)
def test_render_argument_errors(bert_tp, ids, kwargs, match):
    model, calls = bert_tp
    args = {"world_size": 2, **kwargs}
    with pytest.raises(ExportError, match=match) as err:
        render_script(model_spec(model), calls, input_spec({"input_ids": ids}), **args)
    _one_sentence(err)


@pytest.mark.parametrize(
    "call, match",
    [
        ({"path": "a", "primitive": "os.system", "args": [], "kwargs": {}}, "unknown primitive"),
        ({"path": "a", "primitive": "nonexistent", "args": [], "kwargs": {}}, "unknown primitive"),
        (
            {"path": "a", "primitive": "shard", "args": ["weight"], "kwargs": {"axis=0),x(": 1}},
            "not a Python name",
        ),
        (
            {"path": "a", "primitive": "shard", "args": ["weight"], "kwargs": {"axis": float("nan")}},
            "Python literal",
        ),
        ({"path": "a", "primitive": "shard", "args": ["weight"], "kwargs": {"bogus": 1}}, "wrong arguments"),
        ({"path": 3, "primitive": "shard"}, "string path"),
        (Call("a", "sync", (), {"mode": "fwd_post", "sync_op_or_fn": print}), "named sync op"),
        (Call("a", "shard", (nn.Linear(2, 2),), {"axis": 0}), "Linear module object"),
    ],
)
def test_bad_calls_are_refused(call, match, ids):
    spec = {"kind": "factory", "factory": "pkg.mod:fn"}
    with pytest.raises(ExportError, match=match) as err:
        render_script(spec, [call], input_spec({"input_ids": ids}), world_size=2)
    _one_sentence(err)


@pytest.mark.parametrize(
    "spec, match",
    [
        (
            {"kind": "hf", "class": "os", "config_class": "BertConfig", "config": {}},
            "not a transformers model",
        ),
        ({"kind": "hf", "class": "BertModel", "config_class": "__import__", "config": {}}, "config_class"),
        ({"kind": "hf", "class": "BertModel", "config_class": "BertConfig", "config": []}, "JSON object"),
        (
            {
                "kind": "hf",
                "class": "BertModel",
                "config_class": "BertConfig",
                "config": {},
                "attn_implementation": 'x"); import os; (',
            },
            "plain name",
        ),
        ({"kind": "factory", "factory": "os; import x:y"}, "package.module:function"),
        ({"kind": "factory", "factory": "pkg.class:fn"}, "package.module:function"),
        ({"kind": "pickle"}, "kind"),
    ],
)
def test_bad_model_specs_are_refused(spec, match, ids):
    with pytest.raises(ExportError, match=match) as err:
        render_script(spec, [], input_spec({"input_ids": ids}), world_size=1)
    _one_sentence(err)


# ------------------------------------------------------------------------------------ model_spec
def test_model_spec_hf(tiny_bert):
    spec = model_spec(tiny_bert)
    assert spec["kind"] == "hf" and spec["class"] == "BertModel" and spec["module"] == "transformers"
    assert spec["config_class"] == "BertConfig" and spec["config"] == json.loads(
        json.dumps(tiny_bert.config.to_dict())
    )
    json.dumps(spec)


def test_model_spec_of_scheduled_model(bert_tp):
    model, _ = bert_tp  # sharded in place: orig_shape is compared
    assert model_spec(model)["class"] == "BertModel"


class _Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)


def test_model_spec_needs_a_factory():
    from transformers import BertConfig, BertModel

    class MyBert(BertModel):
        pass

    cfg = BertConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=50
    )
    for model in (_Custom(), MyBert(cfg), BertModel(cfg, add_pooling_layer=False)):
        with pytest.raises(ExportError, match=r'factory="package\.module:function"') as err:
            model_spec(model)
        _one_sentence(err)


def test_model_spec_factory(tmp_path, monkeypatch):
    (tmp_path / "my_factories.py").write_text(
        "import torch\n\ndef make():\n    return torch.nn.Linear(2, 2)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert model_spec(_Custom(), factory="my_factories:make") == {
        "kind": "factory",
        "factory": "my_factories:make",
    }
    for bad, match in [
        ("my_factories.make", "package.module:function"),
        ("no_such_mod_xyz:f", "does not import"),
        ("my_factories:missing", "has no function"),
        ("__main__:f", "__main__"),
    ]:
        with pytest.raises(ExportError, match=match) as err:
            model_spec(_Custom(), factory=bad)
        _one_sentence(err)


# ------------------------------------------------------------------------------------ input_spec
def test_input_spec():
    ids = torch.randint(0, 50, (4, 16))
    spec = input_spec(
        {
            "input_ids": ids,
            "attention_mask": torch.ones(4, 16, dtype=torch.long),
            "token_type_ids": torch.zeros(4, 16, dtype=torch.long),
            "pixel": torch.randn(4, 3),
            "labels": torch.tensor([0, 2, 1, -100]),
            "return_dict": True,
        },
        vocab_size=1000,
    )
    assert spec["input_ids"] == {
        "shape": [4, 16],
        "dims": ["batch", "seq"],
        "dtype": "int64",
        "low": 0,
        "high": 1000,
    }
    assert spec["attention_mask"]["fill"] == 1 and spec["token_type_ids"]["fill"] == 0
    assert spec["pixel"]["dims"] == ["batch", 3] and "low" not in spec["pixel"]
    assert spec["labels"] == {"shape": [4], "dims": ["batch"], "dtype": "int64", "low": 0, "high": 3}
    assert spec["return_dict"] == {"value": True}
    assert input_spec({"input_ids": ids})["input_ids"]["high"] == int(ids.max()) + 1
    meta = input_spec({"input_ids": ids.to("meta"), "attention_mask": ids.to("meta")}, vocab_size=7)
    assert meta["input_ids"]["high"] == 7 and meta["attention_mask"] == {
        "shape": [4, 16],
        "dims": ["batch", "seq"],
        "dtype": "int64",
        "fill": 1,
    }


@pytest.mark.parametrize(
    "inputs, match",
    [
        ([1, 2], "must be a dict"),
        ({"x": torch.zeros(2, dtype=torch.complex64)}, "does not support"),
        ({"x": object()}, "only tensors"),
        ({1: torch.zeros(2)}, "strings"),
    ],
)
def test_input_spec_errors(inputs, match):
    with pytest.raises(ExportError, match=match) as err:
        input_spec(inputs)
    _one_sentence(err)


# ---------------------------------------------------------------------------------- export errors
def test_export_script_path_errors(bert_tp, ids, tmp_path, monkeypatch):
    model, calls = bert_tp
    with pytest.raises(ExportError, match="does not exist") as err:
        export_script(tmp_path / "missing" / "train.py", model, calls, {"input_ids": ids}, 2)
    _one_sentence(err)
    with pytest.raises(ExportError, match="is a folder") as err:
        export_script(tmp_path, model, calls, {"input_ids": ids}, 2)
    _one_sentence(err)

    def denied(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr("slapo_lab.export.script.tempfile.mkstemp", denied)
    with pytest.raises(ExportError, match="permission denied") as err:
        export_script(tmp_path / "train.py", model, calls, {"input_ids": ids}, 2)
    _one_sentence(err)
    assert not (tmp_path / "train.py").exists()


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root ignores folder permissions")
def test_export_script_read_only_folder(bert_tp, ids, tmp_path):
    model, calls = bert_tp
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(ExportError, match="Cannot write") as err:
            export_script(ro / "train.py", model, calls, {"input_ids": ids}, 2)
        _one_sentence(err)
    finally:
        ro.chmod(0o755)


# ---------------------------------------------------------------------------- schedule files, CLI
def test_save_load_round_trip_and_cli(bert_tp, ids, tmp_path, capsys):
    from slapo_lab.cli import main

    model, calls = bert_tp
    f = save_schedule(
        tmp_path / "bert.schedule.json", calls, model=model, example_inputs={"input_ids": ids}, world_size=2
    )
    loaded = load_schedule(f)
    assert loaded.calls == calls and loaded.world_size == 2
    assert loaded.meta["model"] == model_spec(model) and loaded.meta["inputs"]["input_ids"]["high"] == 1000
    out = tmp_path / "train.py"
    assert main(["export", str(f), "-o", str(out)]) == 0
    assert "torchrun --nproc_per_node=2" in capsys.readouterr().out
    assert out.read_text() == render_script(loaded.meta["model"], calls, loaded.meta["inputs"], 2)


def _write(tmp_path, data) -> Path:
    p = tmp_path / "s.json"
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return p


@pytest.mark.parametrize(
    "content, match",
    [
        ('{"schema": "slapo-lab/schedule", "version": 1, "calls": [', "not valid JSON"),
        ('{"schema": "slapo-lab/schedule", "version": 1, "calls": [], "meta": {"x": NaN}}', "not valid JSON"),
        (
            {"schema": "slapo-lab/schedule", "version": SCHEMA_VERSION + 1, "calls": []},
            "newer than this slapo-lab",
        ),
        ({"schema": "other", "version": 1, "calls": []}, "not a slapo-lab schedule file"),
        ({"schema": "slapo-lab/schedule", "version": "1", "calls": []}, "invalid schedule format version"),
        ({"schema": "slapo-lab/schedule", "version": 1, "calls": {}}, "no list of calls"),
        (
            {
                "schema": "slapo-lab/schedule",
                "version": 1,
                "calls": [{"path": "a", "primitive": "checkpoint"}, {"path": "b", "primitive": "rm -rf"}],
            },
            "Call 2",
        ),
        (
            {"schema": "slapo-lab/schedule", "version": 1, "calls": [], "meta": {"world_size": -1}},
            "positive integer",
        ),
    ],
)
def test_load_schedule_errors(tmp_path, content, match, capsys):
    from slapo_lab.cli import main

    p = _write(tmp_path, content)
    with pytest.raises(ExportError, match=match) as err:
        load_schedule(p)
    _one_sentence(err)
    out = tmp_path / "train.py"
    assert main(["export", str(p), "-o", str(out)]) == 2
    assert not out.exists()
    assert capsys.readouterr().err.startswith("slapo-lab export: error: ")


def test_load_missing_file_and_cli_missing_meta(tmp_path, capsys):
    from slapo_lab.cli import main

    with pytest.raises(ExportError, match="does not exist") as err:
        load_schedule(tmp_path / "nope.json")
    _one_sentence(err)
    f = save_schedule(tmp_path / "s.json", [Call("a", "checkpoint")])
    assert main(["export", str(f), "-o", str(tmp_path / "t.py")]) == 2
    assert "meta.model, meta.inputs, meta.world_size" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ build
def test_build_minimal(tiny_bert):
    sch = sl.create_schedule(tiny_bert, world_size=2)
    assert build(sch) == (tiny_bert, None) and build(sch["encoder"], target="torch")[0] is tiny_bert
    with pytest.raises(sl.ScheduleError, match="DeepSpeed target needs example_inputs and loss_fn"):
        build(sch, target="deepspeed")
    with pytest.raises(ValueError, match="Unknown build target"):
        build(sch, target="jax")
    with pytest.raises(ValueError, match="unexpected keyword"):
        build(sch, loss_fn=None)
    sch["encoder.layer.0"].cut_pipeline_stage()
    with pytest.raises(sl.ScheduleError, match="1 pipeline cut"):
        build(sch)


# ------------------------------------------------------------------------ pipelines and DeepSpeed
def _tiny_gpt2():
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


@pytest.fixture
def gpt2_pipeline():
    """(model, calls, inputs): GPT-2 with the Megatron preset for 2 ranks (tied vocab-parallel head), cut in 2."""
    model = _tiny_gpt2()
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    sch = sl.create_schedule(model, world_size=2)
    sl.presets.megatron_tp(sch)
    sch["transformer.h.0"].cut_pipeline_stage()
    return model, list(sch.record.calls), {"input_ids": ids}


def _fake_mesh(monkeypatch):
    """make_layout without process groups: its mesh is a stand-in (only the sizes are checked)."""
    import types

    import slapo_lab.train.parallel

    monkeypatch.setattr(
        slapo_lab.train.parallel, "make_mesh", lambda **k: types.SimpleNamespace(mesh={("dp", "tp"): k})
    )


def _layout(*args, monkeypatch, dp=None, stages_per_rank=1):
    from slapo_lab.train.parallel import make_layout

    _fake_mesh(monkeypatch)
    return make_layout(*args, dp=dp, stages_per_rank=stages_per_rank, fsdp=False, device="cpu")


def test_world_size_is_any_multiple_of_tp_x_pp(monkeypatch):
    """Data parallelism fills the rest; a world size that does not fit is one sentence naming the launch that does."""
    from slapo_lab.train.parallel import LayoutError

    lay = _layout(2, 1, 4, monkeypatch=monkeypatch)  # a TP-2 schedule on 4 processes: dp 2
    assert (lay.tp, lay.pp, lay.dp) == (2, 1, 2)
    lay = _layout(2, 2, 8, monkeypatch=monkeypatch)
    assert (lay.tp, lay.pp, lay.dp) == (2, 2, 2) and lay.describe() == "tp 2 x pp 2 x dp 2"
    assert _layout(2, 2, 8, dp=2, monkeypatch=monkeypatch).dp == 2
    for args, dp, match in [
        (
            (2, 2, 6),
            None,
            (
                "world size must be a multiple of 4, but 6 process(es) were "
                "launched; use torchrun --nproc_per_node=4."
            ),
        ),
        (
            (2, 2, 4),
            2,
            ("must be --dp 2 x 4 = 8, but 4 process(es) were launched; use torchrun --nproc_per_node=8."),
        ),
        ((2, 1, 1), None, "multiple of 2, but 1 process(es)"),
    ]:
        with pytest.raises(LayoutError, match=re.escape(match)) as err:
            _layout(*args, dp=dp, monkeypatch=monkeypatch)
        _one_sentence(err)


def test_pipeline_script(gpt2_pipeline, tmp_path, capsys, monkeypatch):
    from slapo_lab.export import launch_command, pipeline_stages, processes

    model, calls, inputs = gpt2_pipeline
    assert pipeline_stages(calls) == 2 and processes(calls, 2) == 4
    assert launch_command(calls, 2, "t.py") == "torchrun --nproc_per_node=4 t.py --device cuda"
    path = export_script(tmp_path / "train_gpt2.py", model, calls, inputs, world_size=2)
    text = path.read_text()
    r = _ruff(path)
    assert r.returncode == 0, r.stdout + r.stderr
    for line in (
        "2-way tensor parallelism x 2 pipeline stages",
        "one node with 4 GPU(s) (tp 2 x pp 2):",
        "torchrun --nproc_per_node=4 train_gpt2.py --device cuda",
        "data parallelism over the rest (dp = 32 / 4)",
        "torchrun --nproc_per_node=4 --master_addr=127.0.0.1 train_gpt2.py --device cpu",
    ):
        assert line in text, line
    consts = _script_constants(text)
    assert (consts["TP"], consts["STAGES"], consts["INPUTS"]) == (2, 2, input_spec(inputs, 128))
    args = _parsed(path, [], monkeypatch)
    assert (
        args.pp_schedule,
        args.micro_batch_size,
        args.stages_per_rank,
        args.dp,
        args.verify,
        args.bf16,
        args.backend,
        args.global_batch_size,
        args.seq_len,
    ) == ("1F1B", None, 1, None, True, False, "auto", 4, 16)
    assert _parsed(path, ["--bf16"], monkeypatch).bf16
    capsys.readouterr()
    for bad, match in [
        (["--pp-schedule", "PipeDream"], "invalid choice: 'PipeDream'"),
        (["--stages-per-rank", "2"], "--stages-per-rank > 1 needs --pp-schedule Interleaved1F1B"),
        (["--dp", "0"], "--dp must be at least 1"),
    ]:
        assert _run_script(path, bad, monkeypatch) == 2
        err = capsys.readouterr().err
        assert match in err and err.strip().splitlines()[-1].startswith("train_gpt2.py: error: "), (bad, err)
    # one plain process: refused (one sentence, exit 2) before anything is built
    assert _run_script(path, ["--device", "cpu", "--steps", "1"], monkeypatch) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("error: ") and err.endswith("use torchrun --nproc_per_node=4.") and "\n" not in err
    ), err
    assert (
        _run_script(
            path,
            ["--device", "cpu", "--stages-per-rank", "3", "--pp-schedule", "Interleaved1F1B"],
            monkeypatch,
        )
        == 2
    )
    assert (
        capsys.readouterr().err.strip() == "error: --stages-per-rank 3 does not divide the 2 pipeline stages."
    )
    # the schedule function replays the calls; the last stage's loss is transformers' causal-LM loss
    from slapo_lab.train.data import SyntheticData
    from slapo_lab.train.loop import pipeline_loss_fn

    sch = sl.create_schedule(copy.deepcopy(_tiny_gpt2()), world_size=2)
    _load_script(text)["schedule"](sch)
    assert sch.record.calls == calls
    batch = SyntheticData(consts["INPUTS"], 8, seed=0, lm_labels=True).batch([0, 1], 0)
    assert set(batch) == {"input_ids", "labels"} and torch.equal(batch["labels"], batch["input_ids"])
    ref = _tiny_gpt2()
    out = ref(**batch)
    assert torch.allclose(pipeline_loss_fn("causal_lm", 0)(out.logits, batch["labels"]), out.loss, atol=1e-6)


def test_pipeline_verify_turns_dropout_off(tmp_path, monkeypatch, capsys):
    """Verify runs both models with dropout off. A pipeline's stages are exported graphs whose dropout is an
    ``aten.dropout`` op, not an ``nn.Dropout`` module, so it must be turned off there too: GPT-2 with its default
    dropout (0.1), cut in two, both stages on one process (Interleaved1F1B), passes its Verify and trains."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0
        )
    )
    assert model.config.resid_pdrop == model.config.attn_pdrop == model.config.embd_pdrop == 0.1
    sch = sl.create_schedule(model)
    sch["transformer.h.0"].cut_pipeline_stage()
    path = export_script(
        tmp_path / "t.py", model, sch.record.calls, {"input_ids": torch.randint(0, 128, (4, 16))}, 1
    )
    rc = _run_script(
        path,
        ["--device", "cpu", "--steps", "1", "--pp-schedule", "Interleaved1F1B", "--stages-per-rank", "2"],
        monkeypatch,
    )
    out = capsys.readouterr().out
    assert rc == 0 and "Verify: PASSED" in out, out
    assert "1 rank(s) = tp 1 x pp 1 x dp 1" in out and len(STEP.findall(out)) == 1, out


def test_interleaved_pipeline_script_options(tmp_path, monkeypatch):
    model = _tiny_gpt2()
    sch = sl.create_schedule(model)
    for i in (0, 1):
        sch[f"transformer.h.{i}"].cut_pipeline_stage()
    sch["transformer.ln_f"].cut_pipeline_stage()
    ids = torch.randint(0, 128, (8, 16))
    path = tmp_path / "train.py"
    path.write_text(
        render_script(model_spec(model), sch.record.calls, input_spec({"input_ids": ids}, 128), world_size=1)
    )
    text = path.read_text()
    assert (
        _script_constants(text)["STAGES"] == 4
        and "torchrun --nproc_per_node=4 train.py --device cuda" in text
    )
    args = _parsed(path, ["--stages-per-rank", "2", "--pp-schedule", "Interleaved1F1B"], monkeypatch)
    assert (args.stages_per_rank, args.pp_schedule) == (2, "Interleaved1F1B")
    lay = _layout(1, 4, 2, stages_per_rank=2, monkeypatch=monkeypatch)  # 2 stages on each of 2 pipeline ranks
    assert (lay.pp, lay.dp, lay.stages_per_rank) == (2, 1, 2)
    assert _layout(1, 4, 4, stages_per_rank=2, monkeypatch=monkeypatch).dp == 2
    assert _layout(1, 4, 4, monkeypatch=monkeypatch).pp == 4


def test_deepspeed_pipeline_script(tmp_path, capsys, monkeypatch):
    """The deepspeed launcher's pipeline script: data plus one call, the launch lines, and the DeepSpeed config it
    prints (a torch optimizer, so no fused-op builds; batch sizes from the options and the replicas)."""
    from slapo_lab.cli import main

    model = _tiny_gpt2()
    ids = torch.randint(0, 128, (4, 16))
    sch = sl.create_schedule(model)
    sch["transformer.h.0"].cut_pipeline_stage()
    f = save_schedule(
        tmp_path / "gpt2.json", sch.record.calls, model=model, example_inputs={"input_ids": ids}, world_size=1
    )
    out = tmp_path / "train_ds.py"
    assert main(["export", str(f), "-o", str(out), "--launcher", "deepspeed"]) == 0
    assert f"launch: deepspeed --num_gpus 2 {out} --device cuda" in capsys.readouterr().out
    text = out.read_text()
    r = _ruff(out)
    assert r.returncode == 0, r.stdout + r.stderr
    consts = _script_constants(text, launcher="deepspeed")
    assert consts["STAGES"] == 2 and consts["TP"] == 1
    for line in ("deepspeed --num_gpus 2 train_ds.py --device cuda", "python train_ds.py --print-ds-config"):
        assert line in text, line

    def config(*argv):
        assert _run_script(out, ["--print-ds-config", *argv], monkeypatch) == 0
        return json.loads(capsys.readouterr().out)

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = config()
    assert (
        cfg["zero_optimization"] == {"stage": 0}
        and "optimizer" not in cfg
        and cfg["zero_allow_untested_optimizer"]
    )
    # the example's batch of 4 over 2 stages: 2 micro-batches of 2
    assert (
        cfg["train_batch_size"],
        cfg["train_micro_batch_size_per_gpu"],
        cfg["gradient_accumulation_steps"],
    ) == (4, 2, 2)
    cfg = config("--global-batch-size", "16", "--micro-batch-size", "2", "--dp", "2", "--zero", "1")
    assert (
        cfg["train_batch_size"],
        cfg["train_micro_batch_size_per_gpu"],
        cfg["gradient_accumulation_steps"],
    ) == (16, 2, 4) and cfg["zero_optimization"] == {"stage": 1}
    monkeypatch.setenv("WORLD_SIZE", "8")  # under a launcher: dp = 8 / 2
    assert config("--global-batch-size", "16")["train_micro_batch_size_per_gpu"] == 2
    assert config("--local_rank=1")["train_batch_size"] == 4  # the deepspeed launcher passes --local_rank


def test_deepspeed_tp_script(bert_tp, ids, tmp_path, monkeypatch, capsys):
    """The deepspeed launcher's tensor-parallel script: ZeRO options, and one sentence for a world that does not
    fit (one process for a schedule of 2 tensor-parallel ranks)."""
    model, calls = bert_tp
    path = export_script(
        tmp_path / "train_bert_ds.py", model, calls, {"input_ids": ids}, world_size=2, launcher="deepspeed"
    )
    text = path.read_text()
    r = _ruff(path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "deepspeed --num_gpus 2 train_bert_ds.py --device cuda" in text
    assert _script_constants(text, launcher="deepspeed")["TP"] == 2
    args = _parsed(path, ["--bf16", "--zero", "2"], monkeypatch)
    assert args.bf16 and args.zero == 2
    with pytest.raises(ExportError, match="needs launcher"):
        export_script(tmp_path / "t.py", model, calls, {"input_ids": ids}, world_size=2, defaults={"zero": 1})
    assert _run_script(path, ["--device", "cpu"], monkeypatch) == 2
    assert "multiple of 2" in capsys.readouterr().err


def test_pipeline_export_refusals(gpt2_pipeline):
    model, calls, inputs = gpt2_pipeline
    spec = model_spec(model)
    with pytest.raises(ExportError, match="tensor x pipeline x data parallelism") as err:
        render_script(spec, calls, input_spec(inputs, 128), world_size=2, launcher="deepspeed")
    _one_sentence(err)
    with pytest.raises(ExportError, match="'return_dict' is a constant") as err:
        render_script(spec, calls, input_spec({**inputs, "return_dict": True}, 128), world_size=2)
    _one_sentence(err)
    # without cuts a constant input is fine (the tensor-parallel script passes it through)
    tp_calls = [c for c in calls if c.primitive != "cut_pipeline_stage"]
    render_script(spec, tp_calls, input_spec({**inputs, "return_dict": True}, 128), world_size=2)


def test_cli_pipeline_launch_line(gpt2_pipeline, tmp_path, capsys):
    from slapo_lab.cli import main

    model, calls, inputs = gpt2_pipeline
    f = save_schedule(tmp_path / "s.json", calls, model=model, example_inputs=inputs, world_size=2)
    out = tmp_path / "t.py"
    assert main(["export", str(f), "-o", str(out)]) == 0
    assert f"launch: torchrun --nproc_per_node=4 {out} --device cuda" in capsys.readouterr().out
    assert main(["export", str(f), "-o", str(out), "--launcher", "deepspeed"]) == 2
    assert "tensor x pipeline x data parallelism" in capsys.readouterr().err


# ------------------------------------------------------------- GPUs: backend, placement, MFU, Verify memory
class SimCuda(torch.Tensor):
    """A CPU tensor that claims to live on ``cuda:0``: any op mixing it with a CPU tensor (other than a 0-dim
    one) fails the way real CUDA does, and ``.cpu()`` / ``.to("cpu")`` bring it back -- enough to catch
    device mismatches on a machine without a GPU."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device="cuda:0")

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = [*args, *kwargs.values()]
        if func is torch.ops.aten._to_copy.default and kwargs.get("device") == torch.device("cpu"):
            return args[0].inner.clone().to(dtype=kwargs.get("dtype", args[0].dtype))
        if any(type(t) is torch.Tensor and t.dim() > 0 for t in flat):
            raise RuntimeError(
                "Expected all tensors to be on the same device, but found at least two devices, "
                "cuda:0 and cpu!"
            )
        unwrap = lambda t: t.inner if isinstance(t, SimCuda) else t
        out = func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in kwargs.items()})
        return SimCuda(out) if isinstance(out, torch.Tensor) else out


def test_verify_compares_on_one_device():
    """Issue 10: the pipeline's Verify compared CUDA stage weights with the CPU reference (torch.equal raised).
    Verify compares every tensor through one function that brings both sides to the CPU in float64."""
    from slapo_lab.train import verify

    stage, ref = SimCuda(torch.arange(6.0).reshape(2, 3)), torch.arange(6.0).reshape(2, 3)
    with pytest.raises(RuntimeError, match="same device"):
        torch.equal(stage, ref)  # what the old verify_pipeline did
    assert verify._diff(stage, ref, 1e-5, 1e-5) == (0.0, 0.0, True)
    diff, rel, ok = verify._diff(stage, ref + 0.5, 1e-5, 1e-5)
    assert (diff, ok) == (0.5, False) and rel == pytest.approx(0.5 / (5.5 + 1e-5))
    assert verify._diff(stage, ref.reshape(3, 2), 1e-5, 1e-5) == (math.inf, math.inf, False)
    a, b = SimCuda(torch.arange(6.0)), torch.arange(6.0)
    assert verify._diff(a, b, 0.0, 0.0)[2] and not verify._diff(a, b + 1e-3, 0.0, 0.0)[2]  # weights: exact
    source = inspect.getsource(verify.run_verify)
    assert "torch.equal(" not in source and "torch.allclose(" not in source  # only through _diff


def test_verify_compares_all_zero_tensors():
    """Weights are compared exactly (atol = rtol = 0); a parameter whose values are all zero (every bias and
    LayerNorm bias of BERT, GPT-2, OPT, ViT ... at initialisation) must compare as equal, not divide by zero."""
    from slapo_lab.train import verify

    zeros = torch.zeros(4)
    assert verify._diff(zeros, zeros.clone(), 0.0, 0.0) == (0.0, 0.0, True)
    d, _, ok = verify._diff(zeros + 1e-3, zeros, 0.0, 0.0)
    assert d == pytest.approx(1e-3) and not ok


def test_backend_and_gpu_placement(monkeypatch, capsys):
    """Issue 10: --backend {auto,nccl,gloo}; local rank i -> cuda:i % GPUs, and NCCL refuses shared GPUs."""
    from slapo_lab.train import loop
    from slapo_lab.train.config import ParallelOptions

    def args(device, backend="auto"):
        return ParallelOptions(device=device, backend=backend)

    assert loop._backend(args("cpu")) == "gloo"
    assert loop._backend(args("cuda")) == "nccl"
    assert loop._backend(args("cuda", "gloo")) == "gloo"
    assert loop._device_of(args("cpu")) == ("cpu", None)

    def place(a, local_rank, gpus, local_world=2):
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        return loop._device_of(a)

    gloo = args("cuda", "gloo")
    assert place(gloo, 0, 1) == ("cuda:0", None) and place(gloo, 1, 1) == (
        "cuda:0",
        None,
    )  # two ranks, one GPU
    assert place(gloo, 3, 2, 4) == ("cuda:1", None)
    device, error = place(args("cuda"), 1, 1)
    assert (
        device == "" and "2 processes on this node but 1 GPU(s), and NCCL needs one GPU per process" in error
    )
    assert "--backend gloo" in error and "\n" not in error
    assert place(args("cuda"), 1, 2) == ("cuda:1", None)
    assert "CUDA is not available" in place(gloo, 0, 0)[1]


def test_no_gpu_is_one_sentence(bert_tp, ids, tmp_path, monkeypatch, capsys):
    model, calls = bert_tp
    path = export_script(tmp_path / "tp.py", model, calls, {"input_ids": ids}, world_size=2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(preflight, "launched_world", lambda: 2)  # the layout fits: the device is the problem
    assert _run_script(path, ["--device", "cuda", "--backend", "gloo"], monkeypatch) == 2  # no GPU: exit 2
    assert capsys.readouterr().err.strip() == "error: CUDA is not available here; run with --device cpu."


def test_pipeline_refuses_gloo_on_cuda(gpt2_pipeline, tmp_path, monkeypatch, capsys):
    """Issue 10: gloo's send / recv take CPU tensors only, and pipeline stages send, so a pipeline script with
    --device cuda --backend gloo must be refused up front in one sentence (exit 2), not crash in the first send."""
    model, calls, inputs = gpt2_pipeline
    path = export_script(tmp_path / "pp.py", model, calls, inputs, world_size=2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(preflight, "launched_world", lambda: 4)  # the layout fits: the backend is the problem
    assert _run_script(path, ["--device", "cuda", "--backend", "gloo"], monkeypatch) == 2
    err = capsys.readouterr().err.strip()
    assert "gloo" in err and "pipeline" in err and "CUDA" in err and "\n" not in err, err


def test_verify_frees_the_reference_graph_before_the_scheduled_forward():
    """Verify OOM (issue 10): both models' activations were alive at once; now the reference's backward runs
    before the scheduled model's forward."""
    from slapo_lab.sharding.sync_ops import TPGroup

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    scheduled = copy.deepcopy(ref)
    seen = []
    scheduled.register_forward_pre_hook(
        lambda m, a: seen.append(all(p.grad is not None for p in ref.parameters()))
    )
    report = sl.verify_models(ref, scheduled, torch.randn(3, 8), TPGroup(1, 0))
    assert report.passed and seen == [True], report.summary()


def test_training_step_makes_no_per_step_host_round_trips():
    """Issue 10 (script slower than a hand loop on an H100): the probe vector was rebuilt on the CPU and copied
    to the GPU in every step (a blocking copy: the host waited for the forward pass before it could queue the
    backward) and each micro-batch's loss was read with .item(). Now the vector is made once per device and
    the loss is read once per step."""
    from slapo_lab.train import loop

    loop._PROBES.clear()
    hidden = torch.randn(2, 3, 64)
    first = loop.probe_loss(hidden, 7)
    probe = next(iter(loop._PROBES.values()))
    assert torch.equal(loop.probe_loss(hidden, 7), first) and next(iter(loop._PROBES.values())) is probe
    assert len(loop._PROBES) == 1
    want = torch.randn(64, generator=torch.Generator().manual_seed(7))
    assert torch.allclose(
        first, (hidden @ (want / want.norm())).square().mean()
    )  # the same objective as before
    source = inspect.getsource(loop.Run._forward_backward)
    loop_body = source[
        source.index("for i, mb in enumerate(micro_batches)") : source.rindex("return self.dp_mean")
    ]
    assert ".item()" not in loop_body and not re.search(r"(?<![.\w])(float|int)\(", loop_body), loop_body
    assert "total += loss.detach()" in loop_body
