"""The schedule check (``sl.check_schedule``): open items of a half-built tensor-parallel schedule.

Every family's Megatron preset (and GPT-2 sequence parallel, the HF tp plans) checks clean; each kind
of open item is found on a schedule built by hand, its ``fix`` closes it, and syncs placed on an
enclosing module count; the editor lists the items above the code and its Export says so; on 2 gloo
ranks a half-built GQA attention that runs without any error is a different model, and the check's
fixes make it the original (loss equal, gradients within 1e-6), while its exported script fails its own Verify
(exit status 1).
"""

from __future__ import annotations

import re

import harness
import pytest
from zoo.families import FAMILIES

import slapo_lab as sl


def _sch(family: str, world_size: int = 2):
    return sl.create_schedule(FAMILIES[family].build(), world_size=world_size)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_megatron_preset_checks_clean(family):
    sch = _sch(family)
    sl.presets.megatron_tp(sch, vocab_parallel=family not in ("albert", "vit"))
    assert len(sch.record) > 10
    assert sl.check_schedule(sch) == []


def test_sequence_parallel_and_hf_plans_check_clean():
    sch = _sch("gpt2")
    sl.presets.megatron_tp(sch, sequence_parallel=True)
    assert sl.check_schedule(sch) == []
    for family in ("llama", "qwen3"):
        sch = _sch(family)
        sl.presets.apply_hf_tp_plan(sch)
        assert sl.check_schedule(sch) == [], family


def _apply(sch, findings):
    for f in findings:
        assert f.fix and f.fix.startswith("sch[")
        exec(f.fix, {"sch": sch})  # noqa: S102 - the check's own suggested calls


def test_half_built_gqa_attention_plans_without_error_but_is_found():
    fam = FAMILIES["llama"]
    sch = sl.create_schedule(fam.build(), world_size=2)
    a = sch["model.layers.0.self_attn"]
    a["q_proj"].shard("weight", axis=0)
    a["q_proj"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    a["o_proj"].shard("weight", axis=1)
    a["o_proj"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    # the meta forward runs: 2 query heads per rank meet 2 key/value heads, no shape error anywhere
    assert sl.plan(sch, example_inputs=fam.example_inputs(), activation="estimate") is not None
    (f,) = sl.check_schedule(sch)
    assert (f.kind, f.path) == ("partial_heads", "model.layers.0.self_attn")
    assert "q_proj, o_proj but not in k_proj, v_proj" in f.message
    assert f.message.endswith(".") and "\n" not in f.message  # one sentence
    assert f.fix.splitlines() == [
        'sch["model.layers.0.self_attn.k_proj"].shard("weight", axis=0)',
        'sch["model.layers.0.self_attn.v_proj"].shard("weight", axis=0)',
    ]
    _apply(sch, [f])
    second = sl.check_schedule(sch)  # k and v are now column parallel: their input gradients
    assert {(x.kind, x.path.rsplit(".", 1)[1]) for x in second} == {
        ("unreduced_input_grad", "k_proj"),
        ("unreduced_input_grad", "v_proj"),
    }
    _apply(sch, second)
    assert sl.check_schedule(sch) == []


def test_row_parallel_without_reduce_is_found_and_an_enclosing_reduce_counts():
    sch = _sch("llama")
    mlp = sch["model.layers.1.mlp"]
    for name in ("gate_proj", "up_proj"):
        mlp[name].shard("weight", axis=0)
        mlp[name].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    mlp["down_proj"].shard("weight", axis=1)
    (f,) = sl.check_schedule(sch)
    assert (f.kind, f.path) == ("unreduced_partial", "model.layers.1.mlp.down_proj")
    assert "partial sums" in f.message
    mlp.sync(mode="fwd_post", sync_op_or_fn="all_reduce")  # on the MLP around it: also sums them
    assert sl.check_schedule(sch) == []


def test_column_parallel_without_input_grad_reduce_and_whole_bias():
    sch = _sch("bert")
    q = "bert.encoder.layer.0.attention.self.query"
    sch[q].shard("weight", axis=0)
    kinds = {f.kind: f for f in sl.check_schedule(sch)}
    assert set(kinds) == {"unreduced_input_grad", "whole_bias", "partial_heads"}
    assert kinds["whole_bias"].fix == f'sch["{q}"].shard("bias", axis=0)'
    _apply(sch, [kinds["whole_bias"], kinds["partial_heads"]])
    sch["bert.encoder.layer.0.attention.self"].sync(
        mode="bwd_post", sync_op_or_fn="all_reduce"
    )  # one f for q, k, v
    left = sl.check_schedule(sch)  # the next round: key and value biases, output.dense's partial sums
    assert {(f.kind, f.path.rsplit(".", 1)[1]) for f in left} == {
        ("whole_bias", "key"),
        ("whole_bias", "value"),
        ("unreduced_partial", "dense"),
    }
    _apply(sch, left)
    assert sl.check_schedule(sch) == []


def test_output_projection_outside_the_attention_module_counts():
    # BERT keeps the output projection in attention.output.dense, beside the heads' module
    sch = _sch("bert")
    o = "bert.encoder.layer.1.attention.output.dense"
    sch[o].shard("weight", axis=1)
    sch[o].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    (f,) = sl.check_schedule(sch)
    assert (f.kind, f.path) == ("partial_heads", "bert.encoder.layer.1.attention.self")
    assert [c.path.rsplit(".", 1)[1] for c in f.calls] == ["query", "key", "value"]
    # ALBERT names it dense, inside the attention module
    sch = _sch("albert")
    attn = "albert.encoder.albert_layer_groups.0.albert_layers.0.attention"
    sch[f"{attn}.query"].shard("weight", axis=0)
    (f,) = [x for x in sl.check_schedule(sch) if x.kind == "partial_heads"]
    assert f.fix.splitlines()[-1] == f'sch["{attn}.dense"].shard("weight", axis=1)'
    sl.close_open_items(sch)
    assert sl.check_schedule(sch) == []


def test_fused_qkv_without_output_projection_is_found():
    sch = _sch("gpt2")
    attn = sch["transformer.h.0.attn"]
    attn["c_attn"].shard("weight", axis=1)
    attn["c_attn"].shard("bias", axis=0)
    attn["c_attn"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    (f,) = sl.check_schedule(sch)
    assert f.kind == "partial_heads" and "output projection" in f.message
    assert (
        f.fix == 'sch["transformer.h.0.attn.c_proj"].shard("weight", axis=0)'
    )  # Conv1D: input features on 0


def _half_gqa():
    sch = _sch("llama")
    a = sch["model.layers.0.self_attn"]
    a["q_proj"].shard("weight", axis=0)
    a["q_proj"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    return sch


def test_close_open_items_is_one_action_and_all_or_nothing():
    sch = _half_gqa()
    n0 = len(sch.record.calls)
    with pytest.raises(sl.ScheduleError, match="still open after 1 rounds"):
        sl.close_open_items(sch, max_rounds=1)  # round 1 splits k, v and o; their syncs would need round 2
    assert len(sch.record.calls) == n0
    assert [f.kind for f in sl.check_schedule(sch)] == ["partial_heads"]
    assert getattr(sch["model.layers.0.self_attn.k_proj"].mod.weight, "shard_axis", None) is None  # restored
    applied = sl.close_open_items(sch)
    assert [(c.path.rsplit(".", 1)[1], c.primitive) for c in applied] == [
        ("k_proj", "shard"),
        ("v_proj", "shard"),
        ("o_proj", "shard"),
        ("k_proj", "sync"),
        ("v_proj", "sync"),
        ("o_proj", "sync"),
    ]
    assert sl.check_schedule(sch) == []
    assert sch.record.actions()[-1].label == "close open items"
    assert sl.close_open_items(sch) == []


def test_per_head_norms_need_their_gradients_summed():
    sch = _sch("qwen3")
    a = "model.layers.1.self_attn"
    for n in ("q_proj", "k_proj", "v_proj"):
        sch[f"{a}.{n}"].shard("weight", axis=0)
        sch[f"{a}.{n}"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    sch[f"{a}.o_proj"].shard("weight", axis=1)
    sch[f"{a}.o_proj"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    found = sl.check_schedule(sch)
    assert [(f.kind, f.path) for f in found] == [
        ("unreduced_param_grads", f"{a}.q_norm"),
        ("unreduced_param_grads", f"{a}.k_norm"),
    ]
    assert found[0].fix == (
        f'sch["{a}.q_norm"].sync(mode="bwd_post", sync_op_or_fn="all_reduce", param_grads=True)'
    )
    assert len(sl.close_open_items(sch)) == 2 and sl.check_schedule(sch) == []
    # ALBERT's attention.LayerNorm normalises the whole hidden state: no per-head gradient to sum
    sch = _sch("albert")
    sl.presets.megatron_tp(sch, vocab_parallel=False)
    assert sl.check_schedule(sch) == []


def test_world_size_one_has_nothing_open():
    assert sl.check_schedule(sl.create_schedule(FAMILIES["bert"].build())) == []


def test_editor_lists_open_items_and_export_says_so(tmp_path):
    fam = FAMILIES["llama"]
    ed = sl.ScheduleEditor(fam.build(), example_inputs=fam.example_inputs(), world_size=2)
    assert ed.check() == [] and ed._check.value == ""
    ed.apply("shard", "weight", axis=0, path="model.layers.0.self_attn.q_proj")
    assert [f.kind for f in ed.check()] == ["unreduced_input_grad", "partial_heads"]
    assert "2 open items" in ed._check.value and "k_proj" in ed._check.value
    with pytest.raises(sl.ExportError, match=r"^Not exported: .*model\.layers\.0\.self_attn.*force=True"):
        ed.export(str(tmp_path / "train.py"))  # the numeric check marks it failing: nothing is written
    assert not (tmp_path / "train.py").exists()
    ed.export(str(tmp_path / "train.py"), force=True)
    assert "2 open items" in ed.message and "--verify will fail" in ed.message
    assert ed._btn_fix.layout.display == ""
    assert ed.close_open_items() is None
    assert ed.check() == [] and ed._check.value == "" and ed._btn_fix.layout.display == "none"
    assert "Closed the open items with 7 calls" in ed.message
    ed.undo()  # the fixes are one action
    assert [f.kind for f in ed.check()] == ["unreduced_input_grad", "partial_heads"]
    ed.undo()
    assert ed._check.value == "" and ed.check() == []
    ed.apply_preset("megatron")
    assert ed._check.value == ""
    ed.export(str(tmp_path / "train.py"))
    assert "open item" not in ed.message


def test_on_two_ranks_the_half_built_model_is_wrong_and_the_fixes_make_it_the_original():
    rc, out, res = harness.launch_results(
        harness.REPO_ROOT / "tests" / "multirank" / "check_fixes.py", 2, [], 240
    )
    assert rc == 0, out[-3000:]
    half, fixed = res["half"], res["fixed"]
    assert half["kinds"] == ["partial_heads"]
    assert abs(half["loss"] - half["ref_loss"]) > 1e-4 or half["grad_diff"] > 1e-3, half  # silently different
    assert fixed["n"] == 0 and len(fixed["applied"]) == 4, (
        fixed
    )  # k, v split by heads; then their input grads
    assert abs(fixed["loss"] - fixed["ref_loss"]) < 1e-5 and fixed["grad_diff"] < 1e-6, fixed


@pytest.mark.multirank
def test_the_exported_script_of_a_half_built_schedule_fails_its_verify(tmp_path):
    """What the export warns about ("--verify will fail until they are closed"): the script of the half-built
    schedule above runs, but its Verify (slapo_lab.train, against the unscheduled model) fails, names the
    gradients that differ, and the ranks exit with status 1 before any training step."""
    fam = FAMILIES["llama"]
    model = fam.build()
    sch = sl.create_schedule(model, world_size=2)
    a = sch["model.layers.0.self_attn"]
    a["q_proj"].shard("weight", axis=0)
    a["q_proj"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    a["o_proj"].shard("weight", axis=1)
    a["o_proj"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    assert [f.kind for f in sl.check_schedule(sch)] == ["partial_heads"]
    with pytest.raises(sl.ExportError, match=r"^Not exported: .*model\.layers\.0"):  # the numeric check's ✗
        sl.export_script(tmp_path / "train_half.py", model, sch.record.calls, fam.example_inputs(), 2)
    assert not (tmp_path / "train_half.py").exists()
    script = sl.export_script(
        tmp_path / "train_half.py", model, sch.record.calls, fam.example_inputs(), 2, force=True
    )
    rc, out = harness.launch_torchrun(script, 2, ["--device", "cpu", "--steps", "1"], 240)
    if "EADDRINUSE" in out or "address already in use" in out:  # the free port was taken in between
        rc, out = harness.launch_torchrun(script, 2, ["--device", "cpu", "--steps", "1"], 240)
    assert rc != 0 and "Verify: FAILED" in out and "Verify: PASSED" not in out, out[-4000:]
    assert re.search(r"exitcode\s*:\s*1 ", out), out[-4000:]  # Verify failed: status 1, not a crash
    assert re.search(
        r"^Verify: output logits: max abs diff \S+, max rel diff \S+  <-- exceeds tolerance",
        out,
        re.MULTILINE,
    ), out[-4000:]
    assert "Verify:   model.layers.0.self_attn.v_proj.weight: max abs diff" in out, out[-4000:]
    assert "Traceback" not in out.split("Verify: FAILED")[0] and "step 1/1" not in out, out[-4000:]


def test_cli_check_and_export_warning(tmp_path, capsys):
    from slapo_lab.cli import main

    fam = FAMILIES["llama"]
    model = fam.build()
    sch = sl.create_schedule(model, world_size=2)
    sch["model.layers.0.self_attn.q_proj"].shard("weight", axis=0)
    path = sl.save_schedule(
        tmp_path / "half.json",
        sch.record.calls,
        model=model,
        example_inputs=fam.example_inputs(),
        world_size=2,
    )
    assert main(["check", str(path)]) == 3
    out = capsys.readouterr().out
    assert "2 open items:" in out and "- model.layers.0.self_attn splits its heads in q_proj" in out
    assert (
        'sch["model.layers.0.self_attn.k_proj"].shard("weight", axis=0)' in out.split("to close them, add")[1]
    )
    assert main(["export", str(path), "-o", str(tmp_path / "train.py")]) == 2  # the numeric check's ✗
    err = capsys.readouterr().err
    assert (
        err.startswith("slapo-lab export: error:") and "Not exported:" in err and "--force-unverified" in err
    )
    assert err.count("\n") == 1 and not (tmp_path / "train.py").exists()
    assert main(["export", str(path), "-o", str(tmp_path / "train.py"), "--force-unverified"]) == 0
    cap = capsys.readouterr()
    assert "wrote" in cap.out and "warning: the schedule check has 2 open items" in cap.err
    assert "\n" not in cap.err.strip()

    full = sl.create_schedule(fam.build(), world_size=2)
    sl.presets.megatron_tp(full)
    done = sl.save_schedule(
        tmp_path / "full.json",
        full.record.calls,
        model=model,
        example_inputs=fam.example_inputs(),
        world_size=2,
    )
    assert main(["check", str(done)]) == 0
    assert "no open items" in capsys.readouterr().out
    assert main(["export", str(done), "-o", str(tmp_path / "train2.py")]) == 0
    assert capsys.readouterr().err == ""
    (tmp_path / "bad.json").write_text("{")
    assert main(["check", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("slapo-lab check: error:") and err.count("\n") == 1


def test_a_failing_check_never_breaks_the_editor(tmp_path, monkeypatch):
    import slapo_lab.check

    def boom(sch):
        raise RuntimeError("check bug")

    fam = FAMILIES["bert"]
    ed = sl.ScheduleEditor(fam.build(), example_inputs=fam.example_inputs(), world_size=2)
    monkeypatch.setattr(slapo_lab.check, "check_schedule", boom)
    assert ed.apply("shard", "weight", axis=0, path="bert.encoder.layer.0.attention.self.query") is None
    assert ed._check.value == "" and "Applied" in ed.message
    assert ed.export(str(tmp_path / "train.py"), force=True).endswith("train.py")
    assert "Exported" in ed.message
