"""Simulated planning (slapo_lab.plan): numbers checked against hand computation."""

import copy
import json
import time

import pytest
import torch
from harness import BERT_COL as COL
from harness import BERT_ROW as ROW
from harness import apply_bert_tp
from torch import nn
from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM
from zoo.scale import llama2_70b_config, on_meta

import slapo_lab as sl
from slapo_lab.plan import estimate_activations, stage_assignment

L, H, I, V = 4, 64, 256, 1000  # small BERT


def _bert():
    cfg = BertConfig(
        num_hidden_layers=L,
        hidden_size=H,
        num_attention_heads=4,
        intermediate_size=I,
        vocab_size=V,
        max_position_embeddings=128,
    )
    with torch.device("meta"):
        return BertModel(cfg)


def _tp(sch):
    apply_bert_tp(sch, L, checkpoint=False)


def _split_counts(model):
    """(elements that TP shards, elements that stay replicated), from the unsharded model."""
    sharded = 0
    for i in range(L):
        layer = model.encoder.layer[i]
        for n in COL:
            m = layer.get_submodule(n)
            sharded += m.weight.numel() + m.bias.numel()
        for n in ROW:
            sharded += layer.get_submodule(n).weight.numel()
    total = sum(p.numel() for p in model.parameters())
    return sharded, total - sharded


def test_tp_param_bytes_exact():
    ref = _bert()
    sharded, replicated = _split_counts(ref)
    sch = sl.create_schedule(_bert(), world_size=2)
    _tp(sch)
    pl = sl.plan(sch)
    st = pl.per_stage[0]
    per_rank = replicated + sharded // 2
    assert st["num_params"] == per_rank
    assert st["sharded_params"] == sharded // 2 and st["replicated_params"] == replicated
    assert st["param_bytes"] == 4 * per_rank
    assert st["grad_bytes"] == 4 * per_rank
    assert st["optimizer_bytes"] == 8 * per_rank  # Adam: 2 fp32 moments
    assert st["activation_bytes"] is None and pl.activation == "skipped"
    assert pl.total_bytes == st["total_bytes"] == 16 * per_rank + st["buffer_bytes"]
    assert pl.num_ranks == 2 and pl.world_size == 2

    # mixed precision: bf16 params and grads, fp32 Adam moments + fp32 master copy = 16 B/param (ZeRO)
    mp = sl.plan(sch, param_dtype=torch.bfloat16, master_weights=True).per_stage[0]
    assert (mp["param_bytes"], mp["grad_bytes"], mp["optimizer_bytes"]) == (
        2 * per_rank,
        2 * per_rank,
        12 * per_rank,
    )
    assert sl.plan(sch, optimizer="sgd").per_stage[0]["optimizer_bytes"] == 0
    assert sl.plan(sch, optimizer="sgd_momentum").per_stage[0]["optimizer_bytes"] == 4 * per_rank
    assert sl.plan(sch, optimizer=torch.optim.AdamW).per_stage[0]["optimizer_bytes"] == 8 * per_rank
    assert sl.plan(sch, param_dtype=2, grad_dtype=torch.float32).per_stage[0]["grad_bytes"] == 4 * per_rank
    assert sl.plan(sch, param_dtype=None).per_stage[0]["param_bytes"] == 4 * per_rank  # own dtype: fp32


def test_frozen_params_have_no_grads_or_states():
    sch = sl.create_schedule(_bert(), world_size=1)
    emb = sch.mod.embeddings.word_embeddings.weight
    emb.requires_grad_(False)
    st = sl.plan(sch).per_stage[0]
    assert st["param_bytes"] - st["grad_bytes"] == 4 * emb.numel()
    assert st["param_bytes"] * 2 - st["optimizer_bytes"] == 8 * emb.numel()


def test_stages_split_params():
    ref = _bert()
    sch = sl.create_schedule(_bert(), world_size=2)
    _tp(sch)
    sch["encoder.layer.2"].cut_pipeline_stage()  # recorded out of order on purpose
    sch["encoder.layer.0"].cut_pipeline_stage()
    pl = sl.plan(sch)
    assert pl.num_stages == 3 and pl.num_ranks == 6
    s0, s1, s2 = pl.per_stage

    def layer_rank(i):  # per-rank elements of one layer under TP 2
        layer = ref.encoder.layer[i]
        sharded = sum(
            layer.get_submodule(n).weight.numel() + layer.get_submodule(n).bias.numel() for n in COL
        )
        sharded += sum(layer.get_submodule(n).weight.numel() for n in ROW)
        total = sum(p.numel() for p in layer.parameters())
        return total - sharded + sharded // 2

    emb = sum(p.numel() for p in ref.embeddings.parameters())
    pool = sum(p.numel() for p in ref.pooler.parameters())
    assert s0["num_params"] == emb + layer_rank(0)
    assert s1["num_params"] == layer_rank(1) + layer_rank(2)
    assert s2["num_params"] == layer_rank(3) + pool
    assert (s0["blocks"], s1["blocks"], s2["blocks"]) == ([0, 0], [1, 2], [3, 3])
    assert (
        s0["first"] == "embeddings" and s0["last"] == "encoder.layer.0" and s1["first"] == "encoder.layer.1"
    )
    assert s1["last"] == "encoder.layer.2" and s2["last"].startswith("pooler")
    assert [s["ranks"] for s in pl.per_stage] == [[0, 1], [2, 3], [4, 5]]
    assert pl.total_bytes == max(s["total_bytes"] for s in pl.per_stage)
    assert pl.blocks == "encoder.layer"
    assign = stage_assignment(sch)
    assert assign.cuts == ["encoder.layer.0", "encoder.layer.2"]
    assert assign.stage_of["encoder.layer.0.attention.self.query"] == 0  # inside the cut module
    assert assign.stage_of["encoder.layer.1"] == 1


def test_stale_and_coinciding_cuts():
    sch = sl.create_schedule(_bert())
    sch["encoder.layer.1"].cut_pipeline_stage()
    # recorded behind the primitive's back: a cut ending where the outer one ends adds no stage
    sch.metadata.primitives["cut_pipeline_stage"].append("encoder.layer.1.output")
    pl = sl.plan(sch)
    assert pl.num_stages == 2 and any("encoder.layer.1.output" in n for n in pl.notes)
    sch.metadata.primitives["cut_pipeline_stage"].append("encoder.layer.9")
    with pytest.raises(sl.ScheduleError, match="encoder.layer.9"):
        sl.plan(sch)


def test_tied_weights_counted_per_stage():
    cfg = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=100,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        m = LlamaForCausalLM(cfg)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    sch = sl.create_schedule(m)
    one = sl.plan(sch).per_stage[0]["num_params"]
    assert one == sum(p.numel() for p in m.parameters())  # counted once
    sch["model.layers.0"].cut_pipeline_stage()
    s0, s1 = sl.plan(sch).per_stage
    assert s0["num_params"] + s1["num_params"] == one + 100 * 64  # both stages hold the tied matrix


def test_activation_estimate_hand_count():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    x = torch.randn(2, 8)
    pl = sl.plan(sl.create_schedule(model), example_inputs=(x,), optimizer=None)
    assert pl.per_stage[0]["activation_bytes"] == 4 * (2 * 16 + 2 * 16 + 2 * 4)
    # TP 2: the hidden (2 x 16) is split; the row-parallel output is full after the all-reduce
    sch = sl.create_schedule(model, world_size=2)
    sch["0"].shard("weight", axis=0)
    sch["0"].shard("bias", axis=0)
    sch["0"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    sch["2"].shard("weight", axis=1)
    sch["2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    pl = sl.plan(sch, example_inputs=(x,))
    assert pl.per_stage[0]["activation_bytes"] == 4 * (2 * 8 + 2 * 8 + 2 * 4)
    assert sl.plan(sch, example_inputs=(x,), micro_batch_size=4).per_stage[0]["activation_bytes"] == 8 * 40
    assert (
        sl.plan(sch, example_inputs=(x,), activation_dtype=torch.bfloat16).per_stage[0]["activation_bytes"]
        == 80
    )
    assert sl.plan(sch, example_inputs=(x,), activation=None).per_stage[0]["activation_bytes"] is None
    assert sl.plan(sch, activation=1000).per_stage[0]["activation_bytes"] == 1000
    # the pass ran on a meta copy in training mode; the model keeps its device and mode
    assert model[0].weight.device.type == "cpu" and not any(m.training for m in model.modules())


def test_checkpoint_reduces_activation_estimate():
    ids = torch.zeros(2, 32, dtype=torch.long)
    sch = sl.create_schedule(_bert(), world_size=2)
    _tp(sch)
    before = sl.plan(sch, example_inputs={"input_ids": ids})
    assert before.activation == "estimated"
    again = sl.plan(sch, example_inputs={"input_ids": ids})
    assert again.activation == "cached" and again.per_stage == before.per_stage
    for i in range(L):
        sch[f"encoder.layer.{i}"].checkpoint()
    after = sl.plan(sch, example_inputs={"input_ids": ids})
    assert after.activation == "cached"  # checkpoints do not change shapes: the pass is reused
    a0, a1 = before.per_stage[0]["activation_bytes"], after.per_stage[0]["activation_bytes"]
    assert 0 < a1 < a0 / 3
    # hand count: the leaves outside the encoder (embeddings, pooler) plus every checkpointed layer's
    # hidden-state input (2 x 32 x 64 fp32); layer 0's input is the embeddings' dropout output, already
    # counted, so L - 1 inputs add
    prof = estimate_activations(sch.mod, {"input_ids": ids})
    leaf_outside = sum(
        n * e for p, its in prof.leaf_out.items() if not p.startswith("encoder.") for _, n, e, _ in its
    )
    emb = 4 * 2 * 32 * H  # word, token-type, LayerNorm, dropout: (2, 32, 64); position: (1, 32, 64)
    assert leaf_outside == 4 * emb + emb // 2 + 2 * 4 * 2 * H  # + pooler dense and tanh: (2, 64)
    assert a1 == leaf_outside + (L - 1) * 2 * 32 * H * 4
    fresh = sl.plan(sch, example_inputs={"input_ids": ids}, cache=False)
    assert fresh.activation == "estimated" and fresh.per_stage[0]["activation_bytes"] == a1


def _measured_saved_bytes(model, ids):
    """Bytes of unique storages autograd saves in a real forward (parameters and buffers excluded)."""
    skip = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids)
    return sum(seen.values())


def test_autograd_activation_matches_real_saved_tensors():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    pl = sl.plan(sl.create_schedule(model), example_inputs=(torch.randn(2, 8),), activation="autograd")
    # Linear 0 saves its input x (2 x 8); ReLU saves its output (2 x 16), which Linear 2 saves too
    assert pl.per_stage[0]["activation_bytes"] == 4 * (2 * 8 + 2 * 16) and pl.activation_method == "autograd"

    torch.manual_seed(0)
    cfg = BertConfig(
        num_hidden_layers=L,
        hidden_size=H,
        num_attention_heads=4,
        intermediate_size=I,
        vocab_size=V,
        max_position_embeddings=128,
    )
    real = BertModel(cfg).train()
    ids = torch.randint(0, V, (2, 32))
    sch = sl.create_schedule(real)
    whole = sl.plan(sch, example_inputs={"input_ids": ids}, activation="autograd")
    assert whole.per_stage[0]["activation_bytes"] == _measured_saved_bytes(real, ids)
    for i in range(L):
        sch[f"encoder.layer.{i}"].checkpoint()
    ck = sl.plan(sch, example_inputs={"input_ids": ids}, activation="autograd")
    assert ck.activation == "estimated"  # a new checkpoint set needs a new pass
    assert ck.per_stage[0]["activation_bytes"] == _measured_saved_bytes(real, ids)
    assert ck.per_stage[0]["activation_bytes"] < whole.per_stage[0]["activation_bytes"] / 3
    sch["encoder.layer.1"].cut_pipeline_stage()
    cut = sl.plan(sch, example_inputs={"input_ids": ids}, activation="autograd")
    assert cut.activation == "cached"  # cuts only regroup the same pass
    assert sum(s["activation_bytes"] for s in cut.per_stage) == ck.per_stage[0]["activation_bytes"]
    assert all(s["activation_bytes"] > 0 for s in cut.per_stage)


def test_plan_to_dict_table_fits_and_errors():
    sch = sl.create_schedule(_bert(), world_size=2)
    _tp(sch)
    sch["encoder.layer.1"].cut_pipeline_stage()
    pl = sl.plan(sch, example_inputs={"input_ids": torch.zeros(1, 16, dtype=torch.long)})
    d = json.loads(json.dumps(pl.to_dict()))
    assert d["num_stages"] == 2 and d["total_bytes"] == pl.total_bytes and len(d["per_stage"]) == 2
    text = pl.table()
    assert "encoder.layer[0..1]" in text and "encoder.layer[2..3]" in text and "busiest rank" in text
    assert pl.fits(pl.total_bytes) and not pl.fits(pl.total_bytes - 1)
    assert pl.cluster_bytes == 2 * sum(s["total_bytes"] for s in pl.per_stage)
    for bad in (
        {"optimizer": "lion"},
        {"param_dtype": "fp8"},
        {"micro_batch_size": 0},
        {"activation": "guess"},
        {"activation": True},
        {"activation": -1},
    ):
        with pytest.raises(sl.ScheduleError):
            sl.plan(sch, **bad)
    with pytest.raises(sl.ScheduleError):
        pl.fits("80GB")


def test_activation_failure_is_one_sentence():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            raise RuntimeError("boom")

    with pytest.raises(sl.ScheduleError, match="boom"):
        sl.plan(sl.create_schedule(Bad()), example_inputs=(torch.zeros(1, 4),))


# --- a 70B Llama, tensor parallel 8, on meta ------------------------------------------------------
H70, KV70, I70, V70, L70 = 8192, 8, 28672, 32000, 80


@pytest.fixture(scope="module")
def llama70b_tp8():
    model = on_meta(llama2_70b_config(max_position_embeddings=2048))  # 2048: LlamaConfig's default, as before
    cfg = model.config  # the hand counts below are written with these sizes
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) == (
        L70,
        H70,
        I70,
        V70,
    )
    assert cfg.num_key_value_heads == KV70
    sch = sl.create_schedule(model, world_size=8)
    for i in range(L70):
        p = f"model.layers.{i}"
        for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            sch[f"{p}.{n}"].shard("weight", axis=0)
            sch[f"{p}.{n}"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        for n in ("self_attn.o_proj", "mlp.down_proj"):
            sch[f"{p}.{n}"].shard("weight", axis=1)
            sch[f"{p}.{n}"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    return sch


def test_llama70b_tp8_plan_fast_and_exact(llama70b_tp8):
    sch = llama70b_tp8
    sl.plan(sch)  # warm
    t0 = time.perf_counter()
    pl = sl.plan(sch, param_dtype=torch.bfloat16, master_weights=True)
    elapsed = time.perf_counter() - t0
    assert elapsed < 1.0, f"planning took {elapsed:.2f} s"
    # independent count from the config
    kv = KV70 * (H70 // 64)
    sharded_layer = 2 * H70 * H70 + 2 * H70 * kv + 3 * H70 * I70  # q, o, k, v, gate, up, down
    replicated = L70 * 2 * H70 + 2 * V70 * H70 + H70  # 2 norms per layer, embed + lm_head, final norm
    full = L70 * sharded_layer + replicated
    assert 68e9 < full < 71e9  # a "70B" model
    per_rank = L70 * sharded_layer // 8 + replicated
    st = pl.per_stage[0]
    assert st["num_params"] == per_rank
    assert st["param_bytes"] == 2 * per_rank and st["optimizer_bytes"] == 12 * per_rank
    assert pl.total_bytes == 16 * per_rank + st["buffer_bytes"]
    assert not pl.fits(80 * 2**30) and pl.fits(200 * 2**30)
    # 4 pipeline stages of 20 layers: 32 ranks; stage 0 adds the embedding, stage 3 the head and norm
    for i in (19, 39, 59):
        sch[f"model.layers.{i}"].cut_pipeline_stage()
    pp = sl.plan(sch, param_dtype=torch.bfloat16)
    layer_rank = sharded_layer // 8 + 2 * H70
    assert [s["num_params"] for s in pp.per_stage] == [
        V70 * H70 + 20 * layer_rank,
        20 * layer_rank,
        20 * layer_rank,
        20 * layer_rank + H70 + V70 * H70,
    ]
    assert pp.num_ranks == 32


# --- data parallelism: FSDP and ZeRO divide by dp ----------------------------------------------------------
# a small Llama: hidden 64, 4 heads of 16, 2 kv heads (k/v 64 x 32), MLP 128, vocabulary 100, untied head
LH, LI, LV = 64, 128, 100
LAYER_TP = 2 * LH * LH + 2 * LH * 32 + 3 * LH * LI  # q, o, k, v, gate, up, down: what TP splits
LAYER = LAYER_TP + 2 * LH  # + input and post-attention RMSNorm
EDGE = LV * LH + LH + LV * LH  # embedding, final norm, lm_head


def _small_llama(world_size=1, tp=False):
    cfg = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=LH,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=LI,
        vocab_size=LV,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    sch = sl.create_schedule(model, world_size=world_size)
    if tp:
        for i in range(2):
            p = f"model.layers.{i}"
            for n in (
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "mlp.gate_proj",
                "mlp.up_proj",
            ):
                sch[f"{p}.{n}"].shard("weight", axis=0)
            for n in ("self_attn.o_proj", "mlp.down_proj"):
                sch[f"{p}.{n}"].shard("weight", axis=1)
    return sch


def test_fsdp_and_zero_divide_by_dp_hand_count():
    sch = _small_llama()
    n = EDGE + 2 * LAYER
    assert sum(p.numel() for p in sch.mod.parameters()) == n == 86848
    base = sl.plan(sch)
    buf = base.per_stage[0]["buffer_bytes"]  # the rotary inv_freq: per replica, never divided
    assert base.dp == 1 and base.shard is None and base.per_stage[0]["gather_bytes"] == 0
    assert base.total_bytes == 16 * n + buf and base.num_ranks == 1

    ddp = sl.plan(sch, dp=4)  # plain data parallelism: every replica holds everything
    assert ddp.per_stage[0]["total_bytes"] == base.total_bytes and ddp.num_ranks == 4
    assert ddp.cluster_bytes == 4 * base.total_bytes

    fsdp = sl.plan(sch, dp=4, shard="fsdp").per_stage[0]
    assert (fsdp["param_bytes"], fsdp["grad_bytes"], fsdp["optimizer_bytes"]) == (
        n,
        n,
        2 * n,
    )  # 4 B / 4, 8 B / 4
    assert fsdp["gather_bytes"] == 4 * LAYER + 4 * LAYER  # one decoder layer's fp32 parameters and gradients
    assert fsdp["gather_block"] == "model.layers.0"
    assert fsdp["total_bytes"] == 4 * n + 8 * LAYER + buf

    z1 = sl.plan(sch, dp=4, shard="zero1").per_stage[0]
    assert (z1["param_bytes"], z1["grad_bytes"], z1["optimizer_bytes"], z1["gather_bytes"]) == (
        4 * n,
        4 * n,
        2 * n,
        0,
    )
    z2 = sl.plan(sch, dp=4, shard="zero2").per_stage[0]
    assert (z2["param_bytes"], z2["grad_bytes"], z2["optimizer_bytes"]) == (4 * n, n, 2 * n)
    assert z2["total_bytes"] == 7 * n + buf

    # bf16 parameters and gradients, fp32 master copy + Adam moments (16 B / parameter), dp 3: rounded up
    mp = sl.plan(sch, dp=3, shard="fsdp", param_dtype=torch.bfloat16, master_weights=True).per_stage[0]
    assert (mp["param_bytes"], mp["grad_bytes"], mp["optimizer_bytes"]) == (
        -(-2 * n // 3),
        -(-2 * n // 3),
        -(-12 * n // 3),
    )
    assert mp["gather_bytes"] == 2 * LAYER + 2 * LAYER
    # one replica: nothing to shard, the plan says so
    one = sl.plan(sch, shard="fsdp")
    assert one.per_stage == base.per_stage and any("shards nothing" in s for s in one.notes)


def test_fsdp_with_tp_and_stages_hand_count():
    sch = _small_llama(world_size=2, tp=True)
    layer = LAYER_TP // 2 + 2 * LH  # one rank's share of a layer under TP 2 (norms replicated)
    sch["model.layers.0"].cut_pipeline_stage()
    pl = sl.plan(sch, dp=2, shard="fsdp")
    assert pl.num_ranks == 2 * 2 * 2 and pl.dp == 2 and pl.shard == "fsdp"
    s0, s1 = pl.per_stage
    first, last = LV * LH + layer, layer + LH + LV * LH  # embedding + layer 0 | layer 1 + norm + lm_head
    assert (s0["num_params"], s1["num_params"]) == (first, last)  # elements of the tp x pp layout
    for s, elems, blk in ((s0, first, "model.layers.0"), (s1, last, "model.layers.1")):
        assert s["param_bytes"] == s["grad_bytes"] == 4 * elems // 2
        assert s["optimizer_bytes"] == 8 * elems // 2
        assert s["gather_bytes"] == 8 * layer and s["gather_block"] == blk
        assert s["total_bytes"] == 8 * elems + 8 * layer + s["buffer_bytes"]
    assert pl.cluster_bytes == (s0["total_bytes"] + s1["total_bytes"]) * 2 * 2
    d = json.loads(json.dumps(pl.to_dict()))
    assert (d["dp"], d["shard"], d["num_ranks"], d["settings"]["dp"]) == (2, "fsdp", 8, 2)
    text = pl.table()
    assert "gather" in text.splitlines()[0] and "8 rank(s) (2 stage(s) x TP 2 x DP 2, FSDP)" in text
    assert "all-gather working set" in text
    assert "gather" not in sl.plan(sch, dp=2, shard="zero2").table().splitlines()[0]
    assert "x DP 2, ZeRO-2" in sl.plan(sch, dp=2, shard="zero2").table()
    for bad in ({"dp": 0}, {"dp": True}, {"dp": 2.0}, {"shard": "zero3"}, {"shard": "FSDP"}):
        with pytest.raises(sl.ScheduleError):
            sl.plan(sch, **bad)


def test_a_module_registered_after_the_layers_but_run_before_them_is_in_the_first_stage():
    """Llama's rotary_emb is registered after the layers and norm but runs before layer 0: with the forward's
    call order it is in stage 0, where the pipeline computes it (registration order put it in the last)."""
    from slapo_lab.call_order import cached_call_order, call_order, set_example_inputs

    cfg = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=64
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    sch = sl.create_schedule(model)
    set_example_inputs(sch, {"input_ids": torch.zeros(1, 8, dtype=torch.long, device="meta")})
    sch["model.layers.0"].cut_pipeline_stage()
    assert stage_assignment(sch).stage_of["model.rotary_emb"] == 1
    assert cached_call_order(sch) is not None  # the cut's check recorded it
    by_run = stage_assignment(sch, call_order(sch)).stage_of
    assert by_run["model.rotary_emb"] == 0 and by_run["model.layers.1"] == 1 and by_run["model.norm"] == 1


def _llama_gqa():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg).train()


def test_the_activation_pass_counts_attention_as_flash_attention_saves_it():
    """On meta tensors SDPA takes the math path and saves two batch x heads x seq x seq matrices that a real
    (flash) kernel never holds; the pass runs it as the flash kernel: equal to a real run's saved bytes."""
    from slapo_lab.activations import ATTENTION_KERNEL

    model = _llama_gqa()
    ids = torch.randint(0, 256, (2, 512))
    pl = sl.plan(
        sl.create_schedule(copy.deepcopy(model)), example_inputs={"input_ids": ids}, activation="autograd"
    )
    assert pl.per_stage[0]["activation_bytes"] == _measured_saved_bytes(model, ids)
    assert ATTENTION_KERNEL.startswith("flash attention (SDPA)")


def test_the_per_rank_activation_estimate_matches_two_simulated_ranks_within_10_percent():
    """The Megatron schedule at TP 2: the plan's per-rank estimate (meta, simulated) against the bytes autograd
    saves on rank 0 of a real two-rank run (threads in PyTorch's threaded process group)."""
    from threaded_ranks import run_threaded_ranks

    from slapo_lab.utils import meta_copy

    model = _llama_gqa()
    ids = torch.randint(0, 256, (2, 512))
    sch = sl.create_schedule(meta_copy(model), world_size=2)
    sl.presets.megatron_tp(sch)
    estimate = sl.plan(sch, example_inputs={"input_ids": ids}, activation="autograd").per_stage[0]
    measured = {}

    def rank(r):
        ranked = sl.create_schedule(copy.deepcopy(model))
        sl.replay(ranked, sch.record.calls)
        measured[r] = _measured_saved_bytes(ranked.mod, ids)

    run_threaded_ranks(rank, world_size=2, timeout=120)
    assert set(measured) == {0, 1}
    ratio = estimate["activation_bytes"] / measured[0]
    assert 0.9 <= ratio <= 1.1, (estimate["activation_bytes"], measured)
