"""Export: loop folding, safe rendering, model/input specs, schedule files, CLI, build (fast, no torchrun)."""
from __future__ import annotations

import ast
import copy
import errno
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import slapo_lab as sl
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

HOSTILE = ['a"b', "x\ny", "__import__('os')", "{i}", "c'd\\", "e}{", "f\"]); import os; (\""]


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


def _ruff(path: Path) -> subprocess.CompletedProcess:
    """``ruff check`` with default rules, run from the repo root and from the script's folder.

    (Whether ``slapo_lab`` counts as first-party for import sorting depends on the folder.)
    """
    ruff = Path(sys.executable).with_name("ruff")
    cmd = [str(ruff)] if ruff.exists() else [sys.executable, "-m", "ruff"]
    for cwd in (Path(__file__).resolve().parents[1], path.parent):
        r = subprocess.run([*cmd, "check", "--isolated", "--no-cache", str(path)], capture_output=True, text=True,
                           timeout=60, cwd=cwd, check=False)
        if r.returncode:
            break
    return r


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
    assert '    sch[f"encoder.layer.{i}.output.dense"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")' in lines
    assert _replay_lines(lines) == calls


def _c(path, prim="checkpoint", *args, **kwargs):
    return Call(path, prim, args, kwargs)


@pytest.mark.parametrize("calls, expected", [
    # one call per layer, layers not starting at 0
    ([_c("h.2.mlp"), _c("h.3.mlp"), _c("h.4.mlp")], ["for i in range(2, 5):", '    sch[f"h.{i}.mlp"].checkpoint()']),
    # the index at the end of the path
    ([_c("h.0"), _c("h.1")], ["for i in range(2):", '    sch[f"h.{i}"].checkpoint()']),
    # a gap in the indices: no loop
    ([_c("h.0"), _c("h.2")], ['sch["h.0"].checkpoint()', 'sch["h.2"].checkpoint()']),
    # non-canonical index (f"{i}" would write "1", not "01"): no loop
    ([_c("h.00"), _c("h.01")], ['sch["h.00"].checkpoint()', 'sch["h.01"].checkpoint()']),
    # different arguments: no loop
    ([_c("h.0", "shard", "weight", axis=0), _c("h.1", "shard", "weight", axis=1)],
     ['sch["h.0"].shard("weight", axis=0)', 'sch["h.1"].shard("weight", axis=1)']),
    # two indices change together: no loop
    ([_c("h.0.e.0"), _c("h.1.e.1")], ['sch["h.0.e.0"].checkpoint()', 'sch["h.1.e.1"].checkpoint()']),
])
def test_fold_cases(calls, expected):
    assert schedule_lines(calls) == expected
    assert _replay_lines(expected) == calls


def test_fold_keeps_surrounding_calls_and_order():
    calls = ([_c("embeddings.word_embeddings", "shard", "weight", axis=0)]
             + [c for i in range(3) for c in (_c(f"enc.layer.{i}.q", "shard", "weight", axis=0),
                                              _c(f"enc.layer.{i}"))]
             + [_c("pooler.dense", "shard", "weight", axis=0), _c("enc.layer.7")])
    lines = schedule_lines(calls)
    assert lines == ['sch["embeddings.word_embeddings"].shard("weight", axis=0)',
                     "for i in range(3):",
                     '    sch[f"enc.layer.{i}.q"].shard("weight", axis=0)',
                     '    sch[f"enc.layer.{i}"].checkpoint()',
                     'sch["pooler.dense"].shard("weight", axis=0)',
                     'sch["enc.layer.7"].checkpoint()']
    assert _replay_lines(lines) == calls
    runs = find_runs(calls)
    assert len(runs) == 4 and runs[1].count == 3 and runs[1].length == 2


def test_fold_prefers_the_longest_cover():
    # all queries first, then all keys: two one-line loops
    calls = [_c(f"l.{i}.q", "shard", "weight", axis=0) for i in range(3)] + \
            [_c(f"l.{i}.k", "shard", "weight", axis=0) for i in range(3)]
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
    assert loops == ["for i in range(3):"]               # only the safe run folded
    fstrings = [ln for ln in lines if 'sch[f"' in ln]
    assert fstrings == ['    sch[f"safe.{i}"].shard("weight", axis=1)']
    assert _replay_lines(lines) == hostile_calls          # every path comes back byte for byte
    # the code is nothing but subscripts of sch with literal (or f-string) paths and literal arguments
    tree = ast.parse("def schedule(sch):\n" + "\n".join("    " + ln for ln in lines))
    allowed = (ast.Module, ast.FunctionDef, ast.arguments, ast.arg, ast.Expr, ast.Call, ast.Attribute,
               ast.Subscript, ast.Name, ast.Constant, ast.keyword, ast.For, ast.JoinedStr, ast.FormattedValue,
               ast.Load, ast.Store)
    for node in ast.walk(tree):
        assert isinstance(node, allowed), ast.dump(node)
        if isinstance(node, ast.Name):
            assert node.id in ("sch", "i", "range")


def test_hostile_schedule_script_compiles_and_is_ruff_clean(hostile_calls, tmp_path):
    spec = {"kind": "factory", "factory": "hostile_models:build"}
    text = render_script(spec, hostile_calls, {"x": {"shape": [2, 4], "dims": ["batch", 4], "dtype": "float32"}},
                         world_size=2)
    compile(text, "train.py", "exec")
    out = tmp_path / "train.py"
    out.write_text(text)
    r = _ruff(out)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "from hostile_models import build as model_factory  # isort: skip" in text


# ----------------------------------------------------------------------------------------- render
def test_bert_script_compiles_is_ruff_clean_and_replays(bert_tp, ids, tmp_path):
    model, calls = bert_tp
    path = export_script(tmp_path / "train_bert.py", model, calls, {"input_ids": ids}, world_size=2)
    assert path == (tmp_path / "train_bert.py").resolve()
    text = path.read_text()
    compile(text, str(path), "exec")
    r = _ruff(path)
    assert r.returncode == 0, r.stdout + r.stderr
    for cmd in ("torchrun --nproc_per_node=2 train_bert.py --device cuda",
                ("torchrun --nnodes=M --nproc_per_node=N --node_rank=R --master_addr=HOST --master_port=29500 "
                 "train_bert.py"),
                "torchrun --nproc_per_node=2 --master_addr=127.0.0.1 train_bert.py --device cpu"):
        assert cmd in text
    imports = {ln.split()[1].split(".")[0] for ln in text.splitlines() if ln.startswith(("import ", "from "))}
    assert imports <= {"argparse", "copy", "gc", "json", "os", "resource", "sys", "time", "torch", "transformers",
                       "slapo_lab"}
    # run the module-level code (not main): constants, model, schedule
    ns = _load_script(text)
    assert ns["CONFIG"] == json.loads(json.dumps(model.config.to_dict())) and ns["WORLD_SIZE"] == 2
    rebuilt = ns["build_model"](0)
    assert type(rebuilt) is type(model)
    assert {n: p.shape for n, p in rebuilt.named_parameters()} == \
        {n: p.orig_shape if hasattr(p, "orig_shape") else p.shape for n, p in model.named_parameters()}
    a, b = ns["build_model"](5), ns["build_model"](5)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))   # same on every rank
    sch = sl.create_schedule(rebuilt, world_size=2)
    ns["schedule"](sch)
    assert sch.record.calls == calls
    args = ns["parse_args"]([])
    assert (args.verify, args.batch_size, args.seq_len, args.micro_batches, args.bf16) == (True, 4, 32, 1, False)
    assert ns["parse_args"](["--no-verify", "--device", "cpu"]).verify is False
    inputs = ns["make_inputs"](3, 16, 7, "cpu")
    assert inputs["input_ids"].shape == (3, 16) and inputs["input_ids"].max() < 1000
    assert torch.equal(inputs["input_ids"], ns["make_inputs"](3, 16, 7, "cpu")["input_ids"])
    assert ns["LM_LABELS"] is False


def test_hostile_config_values_stay_data(tiny_bert, ids):
    evil = "'''\"\"\"\n<<SCHEDULE_BODY>> __import__('os').system('echo pwned') #\\"
    tiny_bert.config.evil_note = evil
    spec = model_spec(tiny_bert)
    text = render_script(spec, [], input_spec({"input_ids": ids}, 1000), world_size=1, script_name='x"; rm.py')
    ns = _load_script(text)
    assert ns["CONFIG"]["evil_note"] == evil
    assert "pass  # no recorded calls" in text
    assert "python train.py --device cpu" in text   # the unsafe script name is not used


def test_lm_head_trains_on_labels(ids):
    from transformers import BertConfig, BertForMaskedLM

    m = BertForMaskedLM(BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                   intermediate_size=64, vocab_size=100))
    text = render_script(model_spec(m), [], input_spec({"input_ids": ids % 100}, 100), world_size=1)
    ns = _load_script(text)
    assert ns["LM_LABELS"] is True
    batch = ns["make_inputs"](2, 8, 0, "cpu")
    assert torch.equal(batch["labels"], batch["input_ids"])
    loss = ns["compute_loss"](ns["build_model"](0)(**batch), 0)
    assert loss.ndim == 0 and torch.isfinite(loss)


def test_script_main_refuses_a_wrong_world_size(bert_tp, ids, tmp_path, monkeypatch, capsys):
    model, calls = bert_tp
    ns = _load_script(export_script(tmp_path / "t.py", model, calls, {"input_ids": ids}, 2).read_text())
    monkeypatch.delenv("RANK", raising=False)       # one plain process, as `python t.py`
    assert ns["main"](["--device", "cpu", "--steps", "1"]) == 2
    assert "planned for 2 tensor-parallel ranks, but 1 process(es) were launched; use torchrun " \
           "--nproc_per_node=2." in capsys.readouterr().err


def test_script_main_single_process_lm(monkeypatch, capsys):
    """World size 1 without torchrun: Verify, then an LM head trains on labels=input_ids (AdamW, 2 micro-batches)."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                       intermediate_size=128, vocab_size=200, max_position_embeddings=64))
    sch = sl.create_schedule(model)
    for i in range(2):
        sch[f"bert.encoder.layer.{i}"].checkpoint()
    ids = torch.randint(0, 200, (4, 16))
    text = render_script(model_spec(model), sch.record.calls,
                         input_spec({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, 200), world_size=1)
    assert "for i in range(2):" in text and "python train.py --device cpu" in text
    ns = _load_script(text)
    monkeypatch.delenv("RANK", raising=False)
    assert ns["main"](["--device", "cpu", "--steps", "2", "--micro-batches", "2", "--optimizer", "adamw",
                       "--verify-batch-size", "1"]) == 0
    out = capsys.readouterr().out
    assert "Verify: PASSED" in out and "Verify: inputs of batch 1 (--verify-batch-size)" in out
    assert "memory: peak RSS = the process's peak resident set, Verify and start-up included" in out
    losses = [float(m) for m in re.findall(r"^step \d/2 loss (\S+) \| [\d.]+ samples/s \| \d+ tokens/s \| "
                                           r"peak RSS \d+ MiB$", out, re.MULTILINE)]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), out
    assert 3.0 < losses[0] < 8.0, out   # cross-entropy over 200 tokens starts near ln(200) = 5.3


@pytest.mark.parametrize("kwargs, match", [
    ({"launcher": "mpirun"}, "is not supported"),
    ({"launcher": None}, "is not supported"),
    ({"world_size": 0}, "positive integer"),
    ({"world_size": True}, "positive integer"),
])
def test_render_argument_errors(bert_tp, ids, kwargs, match):
    model, calls = bert_tp
    args = {"world_size": 2, **kwargs}
    with pytest.raises(ExportError, match=match) as err:
        render_script(model_spec(model), calls, input_spec({"input_ids": ids}), **args)
    _one_sentence(err)


@pytest.mark.parametrize("call, match", [
    ({"path": "a", "primitive": "os.system", "args": [], "kwargs": {}}, "unknown primitive"),
    ({"path": "a", "primitive": "nonexistent", "args": [], "kwargs": {}}, "unknown primitive"),
    ({"path": "a", "primitive": "shard", "args": ["weight"], "kwargs": {"axis=0),x(": 1}}, "not a Python name"),
    ({"path": "a", "primitive": "shard", "args": ["weight"], "kwargs": {"axis": float("nan")}}, "Python literal"),
    ({"path": "a", "primitive": "shard", "args": ["weight"], "kwargs": {"bogus": 1}}, "wrong arguments"),
    ({"path": 3, "primitive": "shard"}, "string path"),
    (Call("a", "sync", (), {"mode": "fwd_post", "sync_op_or_fn": print}), "named sync op"),
    (Call("a", "shard", (nn.Linear(2, 2),), {"axis": 0}), "Linear module object"),
])
def test_bad_calls_are_refused(call, match, ids):
    spec = {"kind": "factory", "factory": "pkg.mod:fn"}
    with pytest.raises(ExportError, match=match) as err:
        render_script(spec, [call], input_spec({"input_ids": ids}), world_size=2)
    _one_sentence(err)


@pytest.mark.parametrize("spec, match", [
    ({"kind": "hf", "class": "os", "config_class": "BertConfig", "config": {}}, "not a transformers model"),
    ({"kind": "hf", "class": "BertModel", "config_class": "__import__", "config": {}}, "config_class"),
    ({"kind": "hf", "class": "BertModel", "config_class": "BertConfig", "config": []}, "JSON object"),
    ({"kind": "hf", "class": "BertModel", "config_class": "BertConfig", "config": {},
      "attn_implementation": "x\"); import os; ("}, "plain name"),
    ({"kind": "factory", "factory": "os; import x:y"}, "package.module:function"),
    ({"kind": "factory", "factory": "pkg.class:fn"}, "package.module:function"),
    ({"kind": "pickle"}, "kind"),
])
def test_bad_model_specs_are_refused(spec, match, ids):
    with pytest.raises(ExportError, match=match) as err:
        render_script(spec, [], input_spec({"input_ids": ids}), world_size=1)
    _one_sentence(err)


# ------------------------------------------------------------------------------------ model_spec
def test_model_spec_hf(tiny_bert):
    spec = model_spec(tiny_bert)
    assert spec["kind"] == "hf" and spec["class"] == "BertModel" and spec["module"] == "transformers"
    assert spec["config_class"] == "BertConfig" and spec["config"] == json.loads(json.dumps(tiny_bert.config.to_dict()))
    json.dumps(spec)


def test_model_spec_of_scheduled_model(bert_tp):
    model, _ = bert_tp      # sharded in place: orig_shape is compared
    assert model_spec(model)["class"] == "BertModel"


class _Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)


def test_model_spec_needs_a_factory():
    from transformers import BertConfig, BertModel

    class MyBert(BertModel):
        pass

    cfg = BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=50)
    for model in (_Custom(), MyBert(cfg), BertModel(cfg, add_pooling_layer=False)):
        with pytest.raises(ExportError, match=r'factory="package\.module:function"') as err:
            model_spec(model)
        _one_sentence(err)


def test_model_spec_factory(tmp_path, monkeypatch):
    (tmp_path / "my_factories.py").write_text("import torch\n\ndef make():\n    return torch.nn.Linear(2, 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert model_spec(_Custom(), factory="my_factories:make") == {"kind": "factory", "factory": "my_factories:make"}
    for bad, match in [("my_factories.make", "package.module:function"), ("no_such_mod_xyz:f", "does not import"),
                       ("my_factories:missing", "has no function"), ("__main__:f", "__main__")]:
        with pytest.raises(ExportError, match=match) as err:
            model_spec(_Custom(), factory=bad)
        _one_sentence(err)


# ------------------------------------------------------------------------------------ input_spec
def test_input_spec():
    ids = torch.randint(0, 50, (4, 16))
    spec = input_spec({"input_ids": ids, "attention_mask": torch.ones(4, 16, dtype=torch.long),
                       "token_type_ids": torch.zeros(4, 16, dtype=torch.long), "pixel": torch.randn(4, 3),
                       "labels": torch.tensor([0, 2, 1, -100]), "return_dict": True}, vocab_size=1000)
    assert spec["input_ids"] == {"shape": [4, 16], "dims": ["batch", "seq"], "dtype": "int64", "low": 0,
                                 "high": 1000}
    assert spec["attention_mask"]["fill"] == 1 and spec["token_type_ids"]["fill"] == 0
    assert spec["pixel"]["dims"] == ["batch", 3] and "low" not in spec["pixel"]
    assert spec["labels"] == {"shape": [4], "dims": ["batch"], "dtype": "int64", "low": 0, "high": 3}
    assert spec["return_dict"] == {"value": True}
    assert input_spec({"input_ids": ids})["input_ids"]["high"] == int(ids.max()) + 1
    meta = input_spec({"input_ids": ids.to("meta"), "attention_mask": ids.to("meta")}, vocab_size=7)
    assert meta["input_ids"]["high"] == 7 and meta["attention_mask"] == {
        "shape": [4, 16], "dims": ["batch", "seq"], "dtype": "int64", "fill": 1}


@pytest.mark.parametrize("inputs, match", [
    ([1, 2], "must be a dict"),
    ({"x": torch.zeros(2, dtype=torch.complex64)}, "does not support"),
    ({"x": object()}, "only tensors"),
    ({1: torch.zeros(2)}, "strings"),
])
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
    f = save_schedule(tmp_path / "bert.schedule.json", calls, model=model, example_inputs={"input_ids": ids},
                      world_size=2)
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


@pytest.mark.parametrize("content, match", [
    ('{"schema": "slapo-lab/schedule", "version": 1, "calls": [', "not valid JSON"),
    ('{"schema": "slapo-lab/schedule", "version": 1, "calls": [], "meta": {"x": NaN}}', "not valid JSON"),
    ({"schema": "slapo-lab/schedule", "version": SCHEMA_VERSION + 1, "calls": []}, "newer than this slapo-lab"),
    ({"schema": "other", "version": 1, "calls": []}, "not a slapo-lab schedule file"),
    ({"schema": "slapo-lab/schedule", "version": "1", "calls": []}, "invalid schedule format version"),
    ({"schema": "slapo-lab/schedule", "version": 1, "calls": {}}, "no list of calls"),
    ({"schema": "slapo-lab/schedule", "version": 1,
      "calls": [{"path": "a", "primitive": "checkpoint"}, {"path": "b", "primitive": "rm -rf"}]}, "Call 2"),
    ({"schema": "slapo-lab/schedule", "version": 1, "calls": [], "meta": {"world_size": -1}}, "positive integer"),
])
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
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, bos_token_id=0,
                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
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


def test_pipeline_script(gpt2_pipeline, tmp_path, capsys, monkeypatch):
    from slapo_lab.export import launch_command, pipeline_stages, processes

    model, calls, inputs = gpt2_pipeline
    assert pipeline_stages(calls) == 2 and processes(calls, 2) == 4
    assert launch_command(calls, 2, "t.py") == "torchrun --nproc_per_node=4 t.py --device cuda"
    path = export_script(tmp_path / "train_gpt2.py", model, calls, inputs, world_size=2)
    text = path.read_text()
    r = _ruff(path)
    assert r.returncode == 0, r.stdout + r.stderr
    for line in ("2 pipeline stages x 2-way tensor parallelism",
                 "torchrun --nproc_per_node=4 train_gpt2.py --device cuda",
                 "torchrun --nproc_per_node=8 train_gpt2.py --device cuda",
                 "torchrun --nproc_per_node=4 --master_addr=127.0.0.1 train_gpt2.py --device cpu",
                 "slapo_lab.pipeline.make_mesh(tp=tp, pp=pp, dp=dp, device=args.device)",
                 "slapo_lab.create_schedule(model, group=mesh.tp_group)",
                 "pm, _ = slapo_lab.build(sch, TARGET, example_inputs=example",
                 "pm.train_step(**inputs, target=target)"):
        assert line in text, line
    ns = _load_script(text)
    assert (ns["WORLD_SIZE"], ns["NUM_STAGES"], ns["TARGET"], ns["LOSS"]) == (2, 2, "torch", "causal_lm")
    args = ns["parse_args"]([])
    assert (args.pp_schedule, args.micro_batches, args.stages_per_rank, args.dp, args.verify) == ("1F1B", 2, 1, None,
                                                                                                 True)
    assert args.bf16 is False and ns["parse_args"](["--bf16"]).bf16 and args.backend == "auto"
    for bad in (["--pp-schedule", "PipeDream"], ["--stages-per-rank", "2"],
                ["--stages-per-rank", "3", "--pp-schedule", "Interleaved1F1B"], ["--dp", "0"]):
        with pytest.raises(SystemExit):
            ns["parse_args"](bad)
    capsys.readouterr()
    # the process layout: a multiple of tp x pp = 4 processes, --dp must agree
    assert ns["check_layout"](ns["parse_args"]([]), 0, 4) == 1
    assert ns["check_layout"](ns["parse_args"]([]), 0, 8) == 2
    assert ns["check_layout"](ns["parse_args"](["--dp", "2"]), 0, 8) == 2
    assert ns["check_layout"](ns["parse_args"]([]), 0, 6) is None
    assert "world size must be a multiple of 4, but 6 process(es) were launched; use torchrun --nproc_per_node=4." \
        in capsys.readouterr().err
    assert ns["check_layout"](ns["parse_args"](["--dp", "2"]), 0, 4) is None
    assert "must be --dp 2 x 4 = 8, but 4 process(es)" in capsys.readouterr().err
    assert ns["check_layout"](ns["parse_args"](["--batch-size", "6"]), 0, 8) is None   # 2 replicas x 2 micro-batches
    assert "does not split into 2 data-parallel replica(s) of 2 micro-batch(es)" in capsys.readouterr().err
    monkeypatch.delenv("RANK", raising=False)          # one plain process: refused before any process group
    assert ns["main"](["--device", "cpu", "--steps", "1"]) == 2
    assert "use torchrun --nproc_per_node=4." in capsys.readouterr().err
    # the schedule function replays the calls; the loss is transformers' causal-LM loss
    sch = sl.create_schedule(ns["build_model"](0), world_size=2)
    ns["schedule"](sch)
    assert sch.record.calls == calls
    batch = ns["make_inputs"](2, 8, 0, "cpu")
    x, y = ns["pipeline_batch"](batch, 2, "cpu")
    assert set(x) == {"input_ids"} and torch.equal(y, batch["input_ids"])
    ref = ns["build_model"](0)
    out = ref(**batch)
    assert torch.allclose(ns["make_loss_fn"](0)(out.logits, y), out.loss, atol=1e-6)
    saved = ns["dropout_off"](model)
    assert saved == [] and ns["compare"](torch.ones(2), torch.ones(2)) == (0.0, 0.0, True)


def test_interleaved_pipeline_script_options():
    model = _tiny_gpt2()
    sch = sl.create_schedule(model)
    for i in (0, 1):
        sch[f"transformer.h.{i}"].cut_pipeline_stage()
    sch["transformer.ln_f"].cut_pipeline_stage()
    ids = torch.randint(0, 128, (8, 16))
    text = render_script(model_spec(model), sch.record.calls, input_spec({"input_ids": ids}, 128), world_size=1)
    ns = _load_script(text)
    assert ns["NUM_STAGES"] == 4 and "torchrun --nproc_per_node=4 train.py --device cuda" in text
    args = ns["parse_args"](["--stages-per-rank", "2", "--pp-schedule", "Interleaved1F1B"])
    assert ns["check_layout"](args, 0, 2) == 1 and ns["check_layout"](args, 0, 4) == 2
    assert ns["parse_args"]([]).micro_batches == 4


def test_deepspeed_pipeline_script(tmp_path, capsys, monkeypatch):
    from slapo_lab.cli import main

    model = _tiny_gpt2()
    ids = torch.randint(0, 128, (4, 16))
    sch = sl.create_schedule(model)
    sch["transformer.h.0"].cut_pipeline_stage()
    f = save_schedule(tmp_path / "gpt2.json", sch.record.calls, model=model, example_inputs={"input_ids": ids},
                      world_size=1)
    out = tmp_path / "train_ds.py"
    assert main(["export", str(f), "-o", str(out), "--launcher", "deepspeed"]) == 0
    assert f"launch: deepspeed --num_gpus 2 {out} --device cuda" in capsys.readouterr().out
    text = out.read_text()
    r = _ruff(out)
    assert r.returncode == 0, r.stdout + r.stderr
    for line in ("deepspeed --num_gpus 2 train_ds.py --device cuda",
                 "deepspeed --hostfile hostfile --num_nodes M --num_gpus N train_ds.py --device cuda",
                 "python train_ds.py --print-ds-config", "ds_config=ds_config(args, dp)"):
        assert line in text, line
    assert "import deepspeed" not in text   # DeepSpeed itself is imported by slapo_lab.build
    ns = _load_script(text)
    assert ns["TARGET"] == "deepspeed" and ns["DS_CONFIG"]["zero_optimization"] == {"stage": 0}
    assert "optimizer" not in ns["DS_CONFIG"]   # a torch optimizer: no fused-op builds
    assert ns["parse_args"](["--local_rank=1"]).local_rank == 1   # the deepspeed launcher passes it
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert ns["main"](["--print-ds-config"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg == {**ns["DS_CONFIG"], "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
                   "gradient_accumulation_steps": 2}
    assert ns["main"](["--print-ds-config", "--batch-size", "16", "--micro-batches", "4", "--dp", "2"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == \
        (16, 2, 4)
    monkeypatch.setenv("WORLD_SIZE", "8")    # under a launcher: dp = 8 / 2
    assert ns["main"](["--print-ds-config", "--batch-size", "16"]) == 0
    assert json.loads(capsys.readouterr().out)["train_micro_batch_size_per_gpu"] == 2


def test_deepspeed_tp_script(bert_tp, ids, tmp_path, monkeypatch, capsys):
    model, calls = bert_tp
    path = export_script(tmp_path / "train_bert_ds.py", model, calls, {"input_ids": ids}, world_size=2,
                         launcher="deepspeed")
    text = path.read_text()
    r = _ruff(path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "deepspeed --num_gpus 2 train_bert_ds.py --device cuda" in text and "class ModelParallelUnit" in text
    assert "mpu=ModelParallelUnit(mesh)" in text
    ns = _load_script(text)
    assert ns["NUM_STAGES"] == 1 and ns["parse_args"](["--bf16"]).bf16
    monkeypatch.delenv("RANK", raising=False)
    assert ns["main"](["--device", "cpu"]) == 2
    assert "run this script with a launcher" in capsys.readouterr().err


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
            raise RuntimeError("Expected all tensors to be on the same device, but found at least two devices, "
                               "cuda:0 and cpu!")
        unwrap = lambda t: t.inner if isinstance(t, SimCuda) else t
        out = func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in kwargs.items()})
        return SimCuda(out) if isinstance(out, torch.Tensor) else out


def test_pipeline_verify_compares_on_one_device(gpt2_pipeline, tmp_path):
    """Issue 10: the pipeline's Verify compared CUDA stage weights with the CPU reference (torch.equal raised)."""
    model, calls, inputs = gpt2_pipeline
    text = export_script(tmp_path / "t.py", model, calls, inputs, world_size=2).read_text()
    ns = _load_script(text)
    stage, ref = SimCuda(torch.arange(6.0).reshape(2, 3)), torch.arange(6.0).reshape(2, 3)
    with pytest.raises(RuntimeError, match="same device"):
        torch.equal(stage, ref)                      # what the old verify_pipeline did
    assert ns["same"](stage, ref) and not ns["same"](stage, ref + 1) and not ns["same"](stage, ref.reshape(3, 2))
    assert ns["compare"](stage, ref) == (0.0, 0.0, True)
    diff, rel, ok = ns["compare"](stage, ref + 0.5)
    assert (diff, ok) == (0.5, False) and rel == pytest.approx(0.5 / (5.5 + 1e-5))
    assert ns["compare"](stage, ref + 0.5, atol=1e-5, rtol=0.0, scale=0.1) == (diff, rel, True)   # 0.5 <= 0.1 x 5.5
    assert ns["compare"](stage, ref * 1.1, atol=1e-5, rtol=0.03, scale=0.03)[2] is False   # bf16 tolerance still bites
    a, b = ns["on_one_device"](stage, stage)
    assert a.device.type == b.device.type == "cuda"  # already together: compared where they are
    source = text[text.index("def verify_pipeline("):]
    source = source[:source.index("\ndef ", 1)]
    assert "torch.equal(" not in source and "torch.allclose(" not in source   # only through same / compare


def test_backend_and_gpu_placement(bert_tp, gpt2_pipeline, ids, tmp_path, monkeypatch, capsys):
    """Issue 10: --backend {auto,nccl,gloo}; local rank i -> cuda:i % GPUs, and NCCL refuses shared GPUs."""
    model, calls = bert_tp
    ns = _load_script(export_script(tmp_path / "tp.py", model, calls, {"input_ids": ids}, world_size=2).read_text())
    args = ns["parse_args"]
    assert ns["backend_of"](args(["--device", "cpu"])) == "gloo"
    assert ns["backend_of"](args(["--device", "cuda"])) == "nccl"
    assert ns["backend_of"](args(["--device", "cuda", "--backend", "gloo"])) == "gloo"
    with pytest.raises(SystemExit):
        args(["--device", "cpu", "--backend", "nccl"])
    assert "--backend nccl moves CUDA tensors only" in capsys.readouterr().err
    place = ns["place"]
    assert place(args(["--device", "cpu"]), 3, 0) == ("cpu", None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    gloo = args(["--device", "cuda", "--backend", "gloo"])
    assert place(gloo, 0, 1) == ("cuda:0", None) and place(gloo, 1, 1) == ("cuda:0", None)   # two ranks, one GPU
    assert place(gloo, 3, 2) == ("cuda:1", None)
    device, error = place(args(["--device", "cuda"]), 1, 1)
    assert device is None and "2 processes on this node but 1 GPU(s), and NCCL needs one GPU per process" in error
    assert "--backend gloo" in error and "\n" not in error
    assert place(args(["--device", "cuda"]), 1, 2) == ("cuda:1", None)
    assert "CUDA is not available" in place(gloo, 0, 0)[1]
    monkeypatch.delenv("RANK", raising=False)
    assert ns["main"](["--device", "cuda", "--backend", "gloo"]) == 2   # no GPU here: one sentence, exit 2
    assert capsys.readouterr().err.strip() == "error: CUDA is not available here; run with --device cpu."
    # pipelines: gloo's send/recv take CPU tensors only, so gloo on CUDA is refused up front
    pm, pcalls, pinputs = gpt2_pipeline
    pns = _load_script(export_script(tmp_path / "pp.py", pm, pcalls, pinputs, world_size=2).read_text())
    device, error = pns["place"](pns["parse_args"](["--device", "cuda", "--backend", "gloo"]), 0, 4)
    assert device is None and "gloo cannot send CUDA tensors between pipeline stages" in error
    assert pns["place"](pns["parse_args"](["--device", "cpu", "--backend", "gloo"]), 0, 0) == ("cpu", None)


def test_mfu_uses_the_peak_of_the_precision_run(bert_tp, ids, tmp_path, monkeypatch):
    """Issue 10: fp32 runs were divided by the bf16 peak; --peak-tflops still overrides."""
    model, calls = bert_tp
    ns = _load_script(export_script(tmp_path / "tp.py", model, calls, {"input_ids": ids}, world_size=2).read_text())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    args = ns["parse_args"]
    assert ns["peak_tflops"](args(["--bf16"]), "cuda:0") == 989.0
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert ns["precision"](args([])) == "fp32" and ns["peak_tflops"](args([]), "cuda:0") == 67.0
        torch.set_float32_matmul_precision("high")
        assert ns["precision"](args([])) == "tf32" and ns["peak_tflops"](args([]), "cuda:0") == 494.0
    finally:
        torch.set_float32_matmul_precision(old)
    assert ns["peak_tflops"](args(["--peak-tflops", "123"]), "cuda:0") == 123.0
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    assert ns["peak_tflops"](args(["--bf16"]), "cuda:0") is None   # no bf16 tensor cores: MFU n/a, not a guess
    line = ns["step_line"](args(["--device", "cpu"]), 1, 2.5, 0.5, 32, "cpu", 10**6, 2)
    assert line.endswith("| 256 tokens/s | peak RSS " + line.split("peak RSS ")[1]) and "MFU" not in line


def test_free_verify_memory_resets_the_cuda_peak(bert_tp, ids, tmp_path, monkeypatch):
    """Issue 10: the printed CUDA peak included Verify's; after Verify the cache is emptied and the peak reset."""
    model, calls = bert_tp
    ns = _load_script(export_script(tmp_path / "tp.py", model, calls, {"input_ids": ids}, world_size=2).read_text())
    seen = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: seen.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: seen.append(("reset", device)))
    ns["free_verify_memory"]("cpu")
    assert seen == []
    ns["free_verify_memory"]("cuda:1")
    assert seen == ["empty_cache", ("reset", "cuda:1")]
    text = (tmp_path / "tp.py").read_text()
    train = text[text.index("def train("):]
    verify_end = train.index("if not report.passed")
    assert train.index("free_verify_memory(device)") < verify_end < train.index("for step in range")


def test_verify_frees_the_reference_graph_before_the_scheduled_forward():
    """Verify OOM (issue 10): both models' activations were alive at once; now the reference's backward runs
    before the scheduled model's forward."""
    from slapo_lab.sharding.sync_ops import TPGroup

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    scheduled = copy.deepcopy(ref)
    seen = []
    scheduled.register_forward_pre_hook(lambda m, a: seen.append(all(p.grad is not None for p in ref.parameters())))
    report = sl.verify_models(ref, scheduled, torch.randn(3, 8), TPGroup(1, 0))
    assert report.passed and seen == [True], report.summary()


def test_training_step_makes_no_per_step_host_round_trips(bert_tp, ids, tmp_path):
    """Issue 10 (script slower than a hand loop on an H100): the probe vector was rebuilt on the CPU and copied
    to the GPU in every step (a blocking copy: the host waited for the forward pass before it could queue the
    backward) and each micro-batch's loss was read with .item(). Now the vector is made once per device and
    the loss is read once per step."""
    model, calls = bert_tp
    text = export_script(tmp_path / "tp.py", model, calls, {"input_ids": ids}, world_size=2).read_text()
    ns = _load_script(text)
    hidden = torch.randn(2, 3, 64)
    first = ns["probe_loss"](hidden, 7)
    probe = next(iter(ns["PROBES"].values()))
    assert torch.equal(ns["probe_loss"](hidden, 7), first) and next(iter(ns["PROBES"].values())) is probe
    assert len(ns["PROBES"]) == 1
    want = torch.randn(64, generator=torch.Generator().manual_seed(7))
    assert torch.allclose(first, (hidden @ (want / want.norm())).square().mean())   # the same objective as before
    loop = text[text.index("        for chunk in split_batch("):text.index("        optimizer.step()")]
    assert ".item()" not in loop and "total += loss.detach()" in loop
