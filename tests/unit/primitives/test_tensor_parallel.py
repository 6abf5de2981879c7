"""Tensor parallelism in one process: simulated world sizes 2 and 4 on CPU and meta.

Shapes and attributes after shard, strided shards of GPT-2's fused q/k/v, tied weights, attention-head
divisibility errors, sync rejections, ``param_grads`` syncs, and the presets. The multi-rank numerics are
in test_tensor_parallel_ranks.py.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import slapo_lab as sl
from slapo_lab import presets
from slapo_lab.module_state import peek_meta
from slapo_lab.sharding.rules import local_shard, merge_shards

warnings.filterwarnings("ignore")
V = 128


def gpt2(device="cpu", n_head=4, n_embd=32, **kw):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=2,
        n_embd=n_embd,
        n_head=n_head,
        vocab_size=V,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
        **kw,
    )
    with torch.device(device):
        torch.manual_seed(0)
        return GPT2LMHeadModel(cfg)


def bert(device="cpu", hidden=32, heads=4, mlm=False):
    from transformers import BertConfig, BertForMaskedLM, BertModel

    cfg = BertConfig(
        num_hidden_layers=2,
        hidden_size=hidden,
        num_attention_heads=heads,
        intermediate_size=64,
        vocab_size=V,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    with torch.device(device):
        torch.manual_seed(0)
        return (BertForMaskedLM if mlm else BertModel)(cfg)


def llama(device="cpu", heads=4, kv=2, head_dim=8, hidden=32):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=hidden,
        intermediate_size=64,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        vocab_size=V,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    with torch.device(device):
        torch.manual_seed(0)
        return LlamaForCausalLM(cfg)


def ids(seq=8):
    return torch.randint(1, V, (2, seq), generator=torch.Generator().manual_seed(1))


def assert_unchanged(sch, fn, match):
    """fn() raises ScheduleError matching ``match`` and changes neither the record nor any parameter."""
    before = len(sch.record)
    params = {n: p for n, p in sch.mod.named_parameters()}
    with pytest.raises(sl.ScheduleError, match=match) as ei:
        fn()
    assert len(sch.record) == before
    assert all(p is params[n] for n, p in sch.mod.named_parameters())
    return str(ei.value)


# --- strided shards ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("stride", [1, 2, 3])
def test_local_shard_merge_roundtrip(ws, stride):
    t = torch.arange(4 * stride * ws * 3, dtype=torch.float32).reshape(4, stride * ws * 3)
    parts = [local_shard(t, 1, ws, r, stride) for r in range(ws)]
    assert all(p.shape == (4, 3 * stride) for p in parts)
    assert torch.equal(merge_shards(parts, 1, stride), t)
    if stride > 1:  # each rank holds its chunk of every block
        blocks = t.chunk(stride, dim=1)
        assert torch.equal(parts[1], torch.cat([b.chunk(ws, dim=1)[1] for b in blocks], dim=1))


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_gpt2_fused_qkv_is_sharded_strided(ws, device):
    m = gpt2(device)
    full_w = m.transformer.h[0].attn.c_attn.weight.detach().clone()
    full_b = m.transformer.h[0].attn.c_attn.bias.detach().clone()
    rank = ws - 1
    sch = sl.create_schedule(m, world_size=ws, rank=rank)
    node = sch["transformer.h.0.attn.c_attn"]
    node.shard("weight", axis=1)
    node.shard("bias", axis=0)
    attn = m.transformer.h[0].attn
    w, b = attn.c_attn.weight, attn.c_attn.bias
    assert w.shape == (32, 96 // ws) and b.shape == (96 // ws,)
    assert w.shard_stride == 3 and b.shard_stride == 3 and w.shard_axis == 1 and b.shard_axis == 0
    assert w.orig_shape == (32, 96)
    assert attn.c_attn.nf == 96 // ws
    assert attn.split_size == 32 // ws  # GPT2Attention.forward splits the fused output by it
    assert attn.num_heads == 4 and attn.embed_dim == 32  # global numbers stay (forward reshapes with -1)
    if device == "cpu":
        c = 32 // ws
        want = torch.cat([full_w[:, k * 32 + rank * c : k * 32 + (rank + 1) * c] for k in range(3)], dim=1)
        assert torch.equal(w, want)
        assert torch.equal(
            b, torch.cat([full_b[k * 32 + rank * c : k * 32 + (rank + 1) * c] for k in range(3)])
        )
    # contiguous shards elsewhere
    sch["transformer.h.0.mlp.c_fc"].shard("weight", axis=1)
    assert m.transformer.h[0].mlp.c_fc.weight.shard_stride == 1


def test_gpt2_c_attn_row_parallel_is_not_strided():
    m = gpt2()
    sch = sl.create_schedule(m, world_size=2)
    sch["transformer.h.0.attn.c_attn"].shard("weight", axis=0)
    assert m.transformer.h[0].attn.c_attn.weight.shard_stride == 1
    assert m.transformer.h[0].attn.split_size == 32


# --- shapes after the presets ------------------------------------------------------------------------------
@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_gpt2_megatron_shapes_and_tied_head(ws, device):
    m = gpt2(device)
    sch = sl.create_schedule(m, world_size=ws, rank=1)
    calls = presets.megatron_tp(sch)
    assert calls == sch.record.calls
    assert m.lm_head.weight is m.transformer.wte.weight  # tied weights stay one object
    assert m.transformer.wte.weight.shape == (V // ws, 32) and m.lm_head.out_features == V // ws
    assert m.transformer.wte.weight.orig_shape == (V, 32)
    assert sch.metadata.tie_weights[m.transformer.wte.weight] == [m.transformer.wte, m.lm_head]
    assert sl.module_state(m.lm_head).output_type == "partition"
    assert ("fwd_post", "all_gather") in sl.module_state(m.lm_head).syncs
    h = m.transformer.h[1]
    assert h.mlp.c_fc.weight.shape == (32, 128 // ws) and h.mlp.c_proj.weight.shape == (128 // ws, 32)
    assert h.attn.c_proj.weight.shape == (32 // ws, 32) and h.attn.c_proj.bias.shape == (32,)
    if device == "cpu":  # HF's mask code calls .item(): no eager forward on meta
        assert m(input_ids=ids()).logits.shape == (2, 8, V)  # simulated: full shapes come back


@pytest.mark.parametrize("ws", [2, 4])
def test_gpt2_sequence_parallel_preset(ws):
    m = gpt2()
    sch = sl.create_schedule(m, world_size=ws)
    presets.megatron_tp(sch, sequence_parallel=True)
    code = sch.record.code()
    # the sequence (axis -2) is scattered on the first block's input and gathered on the last block's output
    assert 'sch["transformer.h.0"].sync(mode="fwd_pre", sync_op_or_fn="scatter", axis=-2)' in code
    assert (
        'sch["transformer.h.1"].sync(mode="fwd_post", sync_op_or_fn="all_gather", axis=-2, '
        "tensor_parallel_output_grad=False)"
    ) in code
    # each region gathers around its column and row layers; the row layers reduce-scatter
    for region in ("attn", "mlp"):
        assert (
            f'sch["transformer.h.0.{region}"].sync(mode="fwd_pre", sync_op_or_fn="all_gather", axis=-2)'
            in code
        )
    assert (
        'sch["transformer.h.0.mlp.c_proj"].sync(mode="fwd_post", sync_op_or_fn="reduce_scatter", axis=-2)'
        in code
    )
    blocks = [line for line in code.splitlines() if '"transformer.h.' in line]
    assert not [
        b for b in blocks if b.endswith('sync_op_or_fn="all_reduce")')
    ]  # no f: the gathers' backward sums
    assert (
        'sch["transformer.h.0.ln_1"].sync(mode="bwd_post", sync_op_or_fn="all_reduce", param_grads=True)'
        in code
    )
    assert (
        'sch["transformer.h.0.attn.c_proj"].sync(mode="bwd_post", sync_op_or_fn="all_reduce", '
        "param_grads=True)"
    ) in code
    assert m.transformer.h[0].ln_1.weight.sequence_parallel is True
    out = m(input_ids=ids()).logits
    assert out.shape == (2, 8, V)
    out.sum().backward()
    assert m.transformer.h[0].ln_1.weight.grad is not None
    assert isinstance(m.transformer.h[0].ln_1._parameters["weight"], nn.Parameter)  # swapped back


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_bert_megatron_shapes(ws, device):
    m = bert(device)
    sch = sl.create_schedule(m, world_size=ws)
    presets.megatron_tp(sch)
    att = m.encoder.layer[0].attention
    assert att.self.query.weight.shape == (32 // ws, 32) and att.self.query.bias.shape == (32 // ws,)
    assert att.output.dense.weight.shape == (32, 32 // ws)
    assert m.encoder.layer[1].intermediate.dense.out_features == 64 // ws
    assert m.embeddings.word_embeddings.weight.shape == (V // ws, 32)
    if device == "cpu":
        assert m(input_ids=ids()).last_hidden_state.shape == (2, 8, 32)


@pytest.mark.parametrize("ws", [2, 4])
def test_bert_mlm_tied_decoder(ws):
    m = bert(mlm=True)
    sch = sl.create_schedule(m, world_size=ws)
    presets.megatron_tp(sch)
    dec = m.cls.predictions.decoder
    assert dec.weight is m.bert.embeddings.word_embeddings.weight
    assert dec.bias is m.cls.predictions.bias and dec.bias.shape == (V // ws,)
    assert m(input_ids=ids()).logits.shape == (2, 8, V)


@pytest.mark.parametrize("ws", [2])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_llama_megatron_shapes(ws, device):
    m = llama(device)
    sch = sl.create_schedule(m, world_size=ws)
    presets.megatron_tp(sch)
    a = m.model.layers[0].self_attn
    assert a.q_proj.weight.shape == (32 // ws, 32) and a.k_proj.weight.shape == (16 // ws, 32)
    assert a.o_proj.weight.shape == (32, 32 // ws)
    assert m.model.layers[0].mlp.down_proj.weight.shape == (32, 64 // ws)
    assert m.model.layers[0].mlp.down_proj.in_features == 64 // ws
    assert m.lm_head.weight.shape == (V // ws, 32) and m.lm_head.weight is not m.model.embed_tokens.weight
    assert a.num_key_value_groups == 2  # heads / kv heads stays the same on every rank
    if device == "cpu":
        assert m(input_ids=ids()).logits.shape == (2, 8, V)


def test_llama_hf_plan():
    m = llama()
    sch = sl.create_schedule(m, world_size=2)
    plan = presets.hf_tp_plan(sch)
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan["model.layers.*.mlp.down_proj"] == "rowwise"
    calls = presets.megatron_tp(sch, use_hf_plan=True, vocab_parallel=False)
    assert len(calls) == 2 * (5 * 2 + 2 * 2)
    assert calls[0] == sl.Call("model.layers.0.self_attn.q_proj", "shard", ("weight",), {"axis": 0})
    assert m.model.embed_tokens.weight.shape == (V, 32)
    with pytest.raises(sl.ScheduleError, match="has no preset mapping"):
        presets.apply_hf_tp_plan(
            sl.create_schedule(llama(), world_size=2), {"model.layers.*.mlp": "sequence_parallel"}
        )
    with pytest.raises(sl.ScheduleError, match="matches no module"):
        presets.apply_hf_tp_plan(sl.create_schedule(llama(), world_size=2), {"model.nothing.*": "colwise"})
    with pytest.raises(sl.ScheduleError, match="no base_model_tp_plan"):
        presets.apply_hf_tp_plan(sl.create_schedule(gpt2(), world_size=2))


def test_preset_record_replays_to_the_same_state():
    m1, m2 = gpt2(), gpt2()
    s1 = sl.create_schedule(m1, world_size=2, rank=1)
    presets.megatron_tp(s1, sequence_parallel=True)
    s2 = sl.create_schedule(m2, world_size=2, rank=1)
    sl.replay(s2, [c.to_json() for c in s1.record.calls])
    assert s2.record.calls == s1.record.calls
    for (n1, p1), (n2, p2) in zip(m1.named_parameters(), m2.named_parameters(), strict=False):
        assert (
            n1 == n2
            and torch.equal(p1, p2)
            and getattr(p1, "shard_stride", 1) == getattr(p2, "shard_stride", 1)
        )


# --- attention-head divisibility ---------------------------------------------------------------------------
def test_llama_kv_heads_must_divide():
    sch = sl.create_schedule(llama(device="meta", heads=6, kv=3, head_dim=8, hidden=48), world_size=2)
    # 3 kv heads x 8 = 24 divides by 2, but the heads do not
    msg = assert_unchanged(
        sch, lambda: sch["model.layers.0.self_attn.k_proj"].shard("weight", axis=0), "key/value heads"
    )
    assert msg == (
        "Cannot shard model.layers.0.self_attn.k_proj.weight on axis 0 across 2 ranks: "
        "the 3 key/value heads do not divide by 2."
    )
    # q_proj too: a rank cannot hold whole query heads of groups whose key/value head it lacks
    assert_unchanged(
        sch,
        lambda: sch["model.layers.0.self_attn.q_proj"].shard("weight", axis=0),
        "the 3 key/value heads do not divide by 2",
    )


def test_llama_kv_heads_message_from_the_brief():
    sch = sl.create_schedule(llama(device="meta", heads=6, kv=2, head_dim=12, hidden=72), world_size=3)
    msg = assert_unchanged(
        sch, lambda: sch["model.layers.0.self_attn.k_proj"].shard("weight", axis=0), "heads"
    )
    assert msg == (
        "Cannot shard model.layers.0.self_attn.k_proj.weight on axis 0 across 3 ranks: "
        "the 2 key/value heads do not divide by 3."
    )
    assert sl.check_primitive(
        sch["model.layers.0.self_attn.v_proj"], "shard", "weight", axis=0
    ) == msg.replace("k_proj", "v_proj")


def test_llama_attention_heads_and_o_proj():
    sch = sl.create_schedule(llama(device="meta", heads=4, kv=4, head_dim=12, hidden=48), world_size=3)
    assert_unchanged(
        sch,
        lambda: sch["model.layers.1.self_attn.q_proj"].shard("weight", axis=0),
        r"^Cannot shard model.layers.1.self_attn.q_proj.weight on axis 0 across 3 ranks: "
        r"the 4 attention heads do not divide by 3.$",
    )
    assert_unchanged(
        sch,
        lambda: sch["model.layers.1.self_attn.o_proj"].shard("weight", axis=1),
        "the 4 attention heads do not divide by 3",
    )
    # the o_proj output axis and the MLP are not head-bound
    sch["model.layers.1.self_attn.o_proj"].shard("weight", axis=0)
    sch["model.layers.1.mlp.gate_proj"].shard("weight", axis=1)


def test_bert_heads_must_divide():
    sch = sl.create_schedule(bert(device="meta", hidden=48, heads=4), world_size=3)  # 48 % 3 == 0, 4 % 3 != 0
    for n in ("query", "key", "value"):
        assert_unchanged(
            sch,
            lambda n=n: sch[f"encoder.layer.0.attention.self.{n}"].shard("weight", axis=0),
            f"attention.self.{n}.weight on axis 0 across 3 ranks: the 4 attention heads do not divide by 3",
        )
    assert_unchanged(
        sch,
        lambda: sch["encoder.layer.0.attention.self.query"].shard("bias", axis=0),
        "the 4 attention heads",
    )
    sch["encoder.layer.0.attention.output.dense"].shard("weight", axis=1)  # BertSelfOutput: no head info


def test_gpt2_fused_qkv_errors():
    sch = sl.create_schedule(gpt2(device="meta", n_head=4, n_embd=48), world_size=3)
    assert_unchanged(
        sch,
        lambda: sch["transformer.h.0.attn.c_attn"].shard("weight", axis=1),
        r"^Cannot shard transformer.h.0.attn.c_attn.weight on axis 1 across 3 ranks: "
        r"the 4 attention heads do not divide by 3.$",
    )
    assert_unchanged(sch, lambda: sch["transformer.h.0.attn.c_attn"].shard("bias", axis=0), "attention heads")
    assert_unchanged(
        sch, lambda: sch["transformer.h.0.attn.c_proj"].shard("weight", axis=0), "attention heads"
    )
    # the preset keeps the attention whole (its heads do not divide: read from the dataflow, so it is never
    # applied) and splits the MLP (192 / 3); one sentence names both layers and the reason
    notes = presets.megatron_tp(sch).notes
    assert any(
        n.startswith("Kept whole") and "attn.c_attn, attn.c_proj" in n and "4 attention heads" in n
        for n in notes
    ), notes
    assert sch["transformer.h.0.attn.c_attn"].mod.weight.shape == (48, 144)
    assert sch["transformer.h.0.mlp.c_fc"].mod.weight.shape == (48, 64)


def test_fused_qkv_block_size_error_without_head_info():
    # without a head count to check, the fused-block size rule speaks: 108 = 3 x 36, 36 % 8 != 0
    sch = sl.create_schedule(gpt2(device="meta", n_embd=36, n_head=4), world_size=8)
    attn = sch["transformer.h.0.attn"].mod
    attn.num_heads, attn.config = None, None
    assert_unchanged(
        sch,
        lambda: sch["transformer.h.0.attn.c_attn"].shard("weight", axis=1),
        r"^Cannot shard transformer.h.0.attn.c_attn.weight on axis 1: it stores 3 projections of size "
        r"36 back to back \(fused q, k, v\), and 36 is not divisible by the world size 8.$",
    )


def test_size_divisibility_message_is_unchanged():
    sch = sl.create_schedule(gpt2(device="meta"), world_size=3)
    assert_unchanged(
        sch,
        lambda: sch["transformer.h.0.mlp.c_fc"].shard("weight", axis=1),
        r"^Cannot shard transformer.h.0.mlp.c_fc.weight on axis 1: size 128 is not divisible by the "
        r"world size 3.$",
    )


# --- tied weights ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ws", [2, 4])
def test_tied_weights_stay_tied(ws):
    m = gpt2()
    sch = sl.create_schedule(m, world_size=ws, rank=ws - 1)
    full = m.transformer.wte.weight.detach().clone()
    sch["transformer.wte"].shard("weight", axis=0)
    w = m.transformer.wte.weight
    assert m.lm_head.weight is w and w.shard_axis == 0 and w.shard_stride == 1
    assert torch.equal(w, full.chunk(ws)[ws - 1])
    assert sl.module_state(m.transformer.wte).sharded == {"weight": 0}
    assert sl.module_state(m.lm_head).sharded == {"weight": 0}
    # the head's tensor is the same one: sharding it again is refused
    assert_unchanged(sch, lambda: sch["lm_head"].shard("weight", axis=0), "already sharded")
    assert_unchanged(sch, lambda: sch["lm_head"].shard("weight", axis=1), "already sharded")


# --- sync rejections ---------------------------------------------------------------------------------------
def test_sync_rejections():
    m = gpt2()
    sch = sl.create_schedule(m, world_size=2)
    sch["transformer.wte"].shard("weight", axis=0)
    head = sch["lm_head"]
    assert_unchanged(
        sch, lambda: head.sync(mode="fwd_post", sync_op_or_fn="all_reduce"), "partitioned output"
    )
    assert_unchanged(
        sch, lambda: head.sync(mode="fwd_post", sync_op_or_fn="reduce_scatter", axis=1), "partitioned output"
    )
    assert_unchanged(
        sch, lambda: sch["transformer.wte"].sync(mode="fwd_post", sync_op_or_fn="all_gather"), "partial sums"
    )
    sch["transformer.h.0.attn.c_proj"].shard("weight", axis=0)
    assert_unchanged(
        sch,
        lambda: sch["transformer.h.0.attn.c_proj"].sync(mode="bwd_post", sync_op_or_fn="all_reduce"),
        "row parallel",
    )
    assert_unchanged(
        sch,
        lambda: sch["transformer.h.0.ln_1"].sync(mode="bwd_post", sync_op_or_fn="all_reduce"),
        "no sharded parameters",
    )
    head.sync(mode="fwd_post", sync_op_or_fn="all_gather", axis=-1, tensor_parallel_output_grad=False)
    assert_unchanged(
        sch,
        lambda: head.sync(mode="fwd_post", sync_op_or_fn="all_gather", axis=-1),
        "already has a fwd_post all_gather",
    )
    assert_unchanged(sch, lambda: head.sync(mode="fwd_pre", sync_op_or_fn="all_reduce"), "not all_reduce")


def test_param_grads_sync_rules():
    m = gpt2()
    sch = sl.create_schedule(m, world_size=2)
    ln = sch["transformer.h.0.ln_1"]
    assert_unchanged(
        sch,
        lambda: ln.sync(mode="fwd_post", sync_op_or_fn="all_reduce", param_grads=True),
        "needs mode='bwd_post'",
    )
    assert_unchanged(
        sch,
        lambda: ln.sync(mode="bwd_post", sync_op_or_fn="all_reduce", param_grads=False),
        "param_grads must be True",
    )
    assert_unchanged(
        sch,
        lambda: ln.sync(mode="bwd_post", sync_op_or_fn="all_gather", param_grads=True),
        "does not take param_grads",
    )
    assert_unchanged(
        sch,
        lambda: sch["transformer.drop"].sync(mode="bwd_post", sync_op_or_fn="all_reduce", param_grads=True),
        "no replicated trainable",
    )
    ln.sync(mode="bwd_post", sync_op_or_fn="all_reduce", param_grads=True)
    assert ("bwd_post", "all_reduce_param_grads") in sl.module_state(ln.mod).syncs
    assert_unchanged(
        sch,
        lambda: ln.sync(mode="bwd_post", sync_op_or_fn="all_reduce", param_grads=True),
        "already all-reduces its parameter gradients",
    )
    assert_unchanged(sch, lambda: ln.shard("weight", axis=0), "must stay replicated")
    # a row-parallel layer's replicated bias (sequence parallelism)
    cp = sch["transformer.h.0.attn.c_proj"]
    cp.shard("weight", axis=0)
    cp.sync(mode="fwd_post", sync_op_or_fn="reduce_scatter", axis=1)
    cp.sync(mode="bwd_post", sync_op_or_fn="all_reduce", param_grads=True)
    assert peek_meta(cp.mod).grad_allreduce_params == ["bias"]


def test_param_grads_sync_is_exact_in_one_process_and_survives_deepcopy():
    torch.manual_seed(0)
    ln = nn.LayerNorm(8)
    ref = copy.deepcopy(ln)
    sch = sl.create_schedule(nn.Sequential(ln), world_size=2)
    sch["0"].sync(mode="bwd_post", sync_op_or_fn="all_reduce", param_grads=True)
    x = torch.randn(3, 8)
    ln(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    assert torch.equal(ln.weight.grad, ref.weight.grad)  # simulated all-reduce = identity
    assert ln._parameters["weight"] is sch["0"].mod.weight and isinstance(ln.weight, nn.Parameter)
    dup = copy.deepcopy(sch.mod)
    # the swap lives in the composed forward (a bound method in the instance dict), which deepcopy rebinds
    from slapo_lab.module_state import slapo_forward

    assert dup[0].forward.__func__ is slapo_forward and dup[0].forward.__self__ is dup[0]
    dup[0](x).sum().backward()
    assert isinstance(dup[0]._parameters["weight"], nn.Parameter) and dup[0].weight.grad is not None
    # an exception inside forward still puts the parameters back
    with pytest.raises(RuntimeError):
        ln(torch.randn(3, 5))
    assert isinstance(ln._parameters["weight"], nn.Parameter)


# --- presets: errors, blocks, checkpoint -------------------------------------------------------------------
def test_megatron_tp_errors():
    sch = sl.create_schedule(llama(device="meta"), world_size=2)
    assert_unchanged(sch, lambda: presets.megatron_tp(sch, family="no_such_family"), "Unknown model family")
    assert_unchanged(
        sch, lambda: presets.megatron_tp(sch, use_hf_plan=True, sequence_parallel=True), "HF plans carry no"
    )
    tiny = sl.create_schedule(nn.Sequential(nn.Linear(4, 4)), world_size=2)
    assert_unchanged(tiny, lambda: presets.megatron_tp(tiny), "no repeated transformer blocks")
    assert_unchanged(tiny, lambda: presets.column_parallel(tiny, ""), "nn.Linear or HF Conv1D")


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)
        self.other = nn.Linear(8, 8)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class _Stack(nn.Module):
    def __init__(self, n=4):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(_Block() for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_generic_blocks_and_tp_block():
    m = _Stack()
    sch = sl.create_schedule(m, world_size=2)
    assert presets.detect_family(sch) is None
    assert presets.find_blocks(sch) == [f"blocks.{i}" for i in range(4)]
    assert presets.block_layers(sch, "blocks.0") == [
        ("blocks.0.norm", "norm"),
        ("blocks.0.fc1", "column"),
        ("blocks.0.fc2", "row"),
    ]
    calls = presets.megatron_tp(sch, vocab_parallel=False)
    assert len(calls) == 4 * 5
    assert m.blocks[3].fc1.out_features == 8 and m.blocks[3].fc2.in_features == 8
    assert m.blocks[3].other.weight.shape == (8, 8)  # unrecognised: replicated
    assert m(torch.randn(2, 8)).shape == (2, 8)
    bad = sl.create_schedule(nn.Sequential(nn.ModuleList([nn.Sequential(nn.Linear(2, 2))])), world_size=2)
    with pytest.raises(sl.ScheduleError, match="no recognisable column- and row-parallel"):
        presets.tp_block(bad, "0.0")


def test_checkpoint_blocks():
    sch = sl.create_schedule(_Stack(6), world_size=1)
    calls = presets.checkpoint_blocks(sch, every=2)
    assert [c.path for c in calls] == ["blocks.0", "blocks.2", "blocks.4"]
    assert all(c.primitive == "checkpoint" for c in calls)
    calls = presets.checkpoint_blocks(sch, every=1, ratio=0.5)  # first 3, skipping those already done
    assert [c.path for c in calls] == ["blocks.1"]
    for bad in (0, 1.5, True):
        with pytest.raises(sl.ScheduleError, match="every must be"):
            presets.checkpoint_blocks(sch, every=bad)
    with pytest.raises(sl.ScheduleError, match="ratio must be"):
        presets.checkpoint_blocks(sch, ratio=2)
    g = sl.create_schedule(gpt2(device="meta"))
    assert [c.path for c in presets.checkpoint_blocks(g)] == ["transformer.h.0", "transformer.h.1"]
    b = sl.create_schedule(bert(device="meta"))
    assert presets.find_blocks(b) == ["encoder.layer.0", "encoder.layer.1"]
