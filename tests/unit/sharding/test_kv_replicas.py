"""More tensor-parallel ranks than key/value heads (issue 16 item 3): key/value heads replicated over ranks.

With H query heads, KV key/value heads and ws ranks (ws > KV, ws % KV == 0, H % ws == 0) rank i keeps query
heads [i*H/ws, (i+1)*H/ws) and the whole key/value head i // (ws/KV) (Megatron-LM / vLLM's replication).
Checked here: the layout helpers, the shard primitive and its refusals, the head attributes, the Megatron
preset, the numeric check over 4 and 8 simulated ranks (Llama and Qwen3-MoE with 2 key/value heads), seeded
init; and on 4 gloo ranks: Verify + 3 SGD steps against the unsharded model, DCP round trips of the replicated
layout and gradient norms, and an exported script at tp 4 with ``--verify --steps 2`` and clipping.
"""

from __future__ import annotations

import re

import pytest
import torch
import tp_train
import zoo.matrix
import zoo.tp

import slapo_lab as sl
from slapo_lab import presets
from slapo_lab.init import consolidate_model, init_empty_weights
from slapo_lab.numeric import numeric_check
from slapo_lab.sharding.placements import ShardLayout, layout_of
from slapo_lab.sharding.rules import kv_replicas, local_shard, merge_shards
from slapo_lab.sharding.sync_ops import TPGroup
from slapo_lab.utils import meta_copy
from tests.harness import REPO_ROOT, launch_results

MULTIRANK = REPO_ROOT / "tests" / "multirank"

ATTN = "model.layers.0.self_attn"


def _llama(heads=8, kv=2, head_dim=8, device="meta"):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = zoo.matrix.decoder_cfg(
        LlamaConfig,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        hidden_size=heads * head_dim,
    )
    with torch.device(device):
        return LlamaForCausalLM(cfg)


# --- layout helpers -------------------------------------------------------------------------------------------
def test_kv_replicas_counts():
    assert kv_replicas(8, 2, 4) == 2 and kv_replicas(8, 2, 8) == 4 and kv_replicas(32, 4, 8) == 2
    assert kv_replicas(8, 2, 2) == 1  # divides: a plain shard
    assert kv_replicas(12, 3, 4) == 1  # 4 % 3: cannot replicate evenly
    assert kv_replicas(4, 2, 8) == 1  # 4 query heads do not divide by 8


def test_local_shard_and_merge_with_replicas():
    t = torch.arange(16.0).reshape(8, 2)  # 2 heads of 4 rows
    parts = [local_shard(t, 0, 4, r, 1, 2) for r in range(4)]
    assert torch.equal(parts[0], t[:4]) and torch.equal(parts[1], t[:4])
    assert torch.equal(parts[2], t[4:]) and torch.equal(parts[3], t[4:])
    assert torch.equal(merge_shards(parts, 0, 1, 2), t)
    with pytest.raises(ValueError):
        local_shard(t, 0, 4, 0, 3, 2)  # replicas with a strided shard


def test_shard_layout_with_replicas():
    full = torch.arange(48.0).reshape(8, 6)
    lays = [ShardLayout((8, 6), 0, 1, 4, r, tp_replicas=2) for r in range(4)]
    assert all(lay.local_shape == (4, 6) for lay in lays)
    assert [lay.blocks()[0][1] for lay in lays] == [(0, 0), (0, 0), (4, 0), (4, 0)]
    assert all(torch.equal(lay.take(full), local_shard(full, 0, 4, r, 1, 2)) for r, lay in enumerate(lays))
    from torch.distributed.tensor import Replicate, Shard

    assert lays[1].placements() == (Replicate(), Shard(0), Replicate())
    fsdp = lays[3].with_fsdp(1, 2, 1)
    assert fsdp.tp_replicas == 2 and fsdp.local_shape == (4, 3)
    with pytest.raises(ValueError):
        ShardLayout((8, 6), 0, 1, 4, 0, tp_replicas=3)


def test_replica_group_simulated():
    g = TPGroup(8, 5).replica_group(4)
    assert (g.world_size, g.rank, g.simulated) == (4, 1, True)
    assert TPGroup(4, 2).replica_group(1) == TPGroup(4, 2)


# --- the shard primitive ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("ws", [4, 8])
def test_k_and_v_hold_one_replicated_head(ws):
    sch = sl.create_schedule(_llama(), world_size=ws, rank=ws - 1)
    for n in ("q_proj", "k_proj", "v_proj"):
        sch[f"{ATTN}.{n}"].shard("weight", axis=0)
    attn = sch[ATTN].mod
    k = attn.k_proj.weight
    assert k.shape == (8, 64) and k.orig_shape == (16, 64) and k.shard_replicas == ws // 2
    assert not hasattr(attn.q_proj.weight, "shard_replicas") and attn.q_proj.weight.shape == (64 // ws, 64)
    rec = sl.module_state(attn).attention_heads
    assert (rec["heads"], rec["kv_heads"]) == (8, 2)
    assert attn.num_key_value_groups == 8 // ws  # one kv head per rank serves its 8/ws query heads
    assert rec["attrs"]["num_key_value_groups"] == [4, 8 // ws]
    meta = sl.module_state(attn.k_proj)
    assert meta.grad_replica_params == ["weight"] and meta.grad_replica_group.world_size == ws // 2
    assert meta.grad_replica_group.rank == (ws - 1) % (ws // 2)


def test_kv_heads_that_do_not_divide_the_degree_are_refused_in_one_sentence():
    sch = sl.create_schedule(_llama(heads=12, kv=3, head_dim=8), world_size=4)
    for n in ("k_proj", "v_proj", "q_proj"):
        with pytest.raises(sl.ScheduleError) as ei:
            sch[f"{ATTN}.{n}"].shard("weight", axis=0)
        assert str(ei.value) == (
            f"Cannot shard {ATTN}.{n}.weight on axis 0 across 4 ranks: the 3 key/value heads do not divide by 4."
        )
    # the query heads must still divide: 4 heads, 2 kv heads at 8 ranks
    sch = sl.create_schedule(_llama(heads=4, kv=2, head_dim=16), world_size=8)
    with pytest.raises(
        sl.ScheduleError, match=r"across 8 ranks: the 4 attention heads do not divide by 8\.$"
    ):
        sch[f"{ATTN}.k_proj"].shard("weight", axis=0)


# --- the Megatron preset and the numeric check --------------------------------------------------------------------
CASES = [
    ("llama", zoo.tp.llama_kv2_model, 4),
    ("llama", zoo.tp.llama_kv2_model, 8),
    ("qwen3_moe", zoo.tp.qwen3_moe_kv2_model, 4),
    ("qwen3_moe", zoo.tp.qwen3_moe_kv2_model, 8),
]


@pytest.mark.parametrize("family,make,ws", CASES, ids=[f"{c[0]}-tp{c[2]}" for c in CASES])
def test_megatron_preset_is_numerically_exact(family, make, ws):
    torch.manual_seed(1234)
    model = make()
    sch = sl.create_schedule(meta_copy(model), world_size=ws)
    presets.megatron_tp(sch)
    assert sl.check_schedule(sch) == []
    replicated = [n for n, p in sch.mod.named_parameters() if getattr(p, "shard_replicas", 1) > 1]
    assert len(replicated) == 4 and all(n.endswith(("k_proj.weight", "v_proj.weight")) for n in replicated)
    report = numeric_check(model, sch.record.calls, ws, tp_train.case_inputs(family))
    assert report.passed, report.message
    assert report.message.startswith(f"Numerically equal to the unsharded model on {ws} simulated ranks")


def test_numeric_check_finds_a_missing_replica_reduce(monkeypatch):
    import slapo_lab.primitives.tensor_parallel as tpm

    torch.manual_seed(1234)
    model = zoo.tp.llama_kv2_model()
    sch = sl.create_schedule(meta_copy(model), world_size=4)
    presets.megatron_tp(sch)
    monkeypatch.setattr(tpm, "_install_replica_grad_all_reduce", lambda *a: None)
    report = numeric_check(model, sch.record.calls, 4, tp_train.case_inputs("llama"))
    assert not report.passed and "only gradients differ" in report.message and "k_proj" in report.message


def test_consolidate_gives_each_rank_its_kv_head():
    def build(ws, rank):
        with init_empty_weights():
            model = zoo.tp.llama_kv2_model()
        sch = sl.create_schedule(model, world_size=ws, rank=rank)
        if ws > 1:
            presets.megatron_tp(sch)
        consolidate_model(sch)
        return dict(model.named_parameters())

    full = build(1, 0)
    ranks = [build(4, r) for r in range(4)]
    name = "model.layers.1.self_attn.v_proj.weight"
    assert all(torch.equal(ranks[r][name], local_shard(full[name], 0, 4, r, 1, 2)) for r in range(4))
    assert torch.equal(merge_shards([ranks[r][name] for r in range(4)], 0, 1, 2), full[name])
    assert layout_of(ranks[3][name], 4, 3).blocks()[0][1] == (8, 0)


# --- 4 gloo ranks -------------------------------------------------------------------------------------------
@pytest.mark.multirank
def test_four_rank_training_matches_the_unsharded_model():
    rc, out, res = launch_results(MULTIRANK / "tp_train.py", 4, ["kv_replicas"], 300)
    assert rc == 0, out[-4000:]
    for case, *_ in tp_train.FAMILY_CASES["kv_replicas"]:
        assert case in res, f"no result for {case} (torchrun exit {rc}):\n{out[-4000:]}"
        r = res[case]
        assert not r["bad"], f"{case}: " + "; ".join(r["bad"])
        assert r["verify"] is True and len(r["loss"]) == 3
        assert r["max_loss_diff"] <= 1e-5 and r["max_grad_diff"] <= 1e-5 and r["max_param_diff"] <= 1e-5, r
        assert len(r["replicated"]) == 4


@pytest.mark.multirank
def test_four_rank_checkpoints_and_norms_of_replicated_heads():
    rc, out, res = launch_results(MULTIRANK / "kv_replicas_dcp.py", 4, [], timeout=240)
    assert rc == 0, out[-4000:]
    for case in (
        "save_tp4_replicas",
        "load_tp4_replicas",
        "load_tp2_dp2_fsdp",
        "load_full",
        "save_tp2_dp2_load_tp4_replicas",
        "norm_views",
        "norm_llama_tp4",
    ):
        assert res.get(case, {}).get("ok"), f"{case}: {res.get(case)}\n{out[-4000:]}"
    assert res["save_tp4_replicas"]["kinds"]["k"] == ["DTensor", ["R", "S(0)", "R"]]


STEP = re.compile(r"^step (\d+)/2 loss (\S+) \| lr \S+ \| grad norm (\S+) \|", re.MULTILINE)


@pytest.mark.multirank
def test_exported_script_at_tp4_verifies_and_trains(
    tmp_path, run_bounded, torchrun_cmd, free_port, subprocess_env
):
    from slapo_lab.export import export_script

    torch.manual_seed(0)
    model = zoo.tp.qwen3_moe_kv2_model()
    sch = sl.create_schedule(model, world_size=4)
    presets.megatron_tp(sch)
    ids = torch.randint(0, tp_train.VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))
    script = export_script(
        tmp_path / "train_qwen3_moe.py", model, sch.record.calls, {"input_ids": ids}, world_size=4
    )
    args = ["--device", "cpu", "--backend", "gloo", "--verify", "--steps", "2", "--max-grad-norm", "0.5"]
    r = run_bounded(torchrun_cmd(4, free_port, script, *args), timeout=300, cwd=tmp_path, env=subprocess_env)
    out = r.stdout
    assert r.returncode == 0, f"exit {r.returncode}\n{out[-4000:]}\n{r.stderr[-4000:]}"
    assert "Verify: PASSED" in out and "layout tp 4 x pp 1 x dp 1" in out, out[-4000:]
    steps = STEP.findall(out)
    assert [s[0] for s in steps] == ["1", "2"], out[-4000:]
    assert all(float(s[2]) > 0.5 for s in steps)  # above the clip: clipping ran on every step
