"""init_empty_weights and consolidate_model: empty construction, reproducible per-rank slices."""

import pytest
import torch
from harness import BERT_COL as COL
from harness import BERT_ROW as ROW
from harness import apply_bert_tp
from torch import nn
from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM

import slapo_lab as sl
from slapo_lab.init import consolidate_model, init_empty_weights


def _bert_cfg():
    return BertConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=100,
        max_position_embeddings=64,
        pad_token_id=0,
    )


def _bert_tp(world_size, rank, **kw):
    with init_empty_weights():
        model = BertModel(_bert_cfg())
    sch = sl.create_schedule(model, world_size=world_size, rank=rank)
    if world_size > 1:
        sch["embeddings.word_embeddings"].shard("weight", axis=0)  # vocab parallel
        sch["embeddings.word_embeddings"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
        apply_bert_tp(sch, 2, checkpoint=False)
    consolidate_model(sch, **kw)
    return model


def test_init_empty_weights_puts_params_on_meta():
    with init_empty_weights():
        model = BertModel(_bert_cfg())
        lin = nn.Linear(10, 10, bias=False)
        frozen = nn.Linear(3, 3)
        frozen.weight.requires_grad_(False)
        frozen.weight.my_tag = "x"
        frozen.register_parameter("extra", nn.Parameter(torch.ones(2)))
    assert all(p.is_meta for p in model.parameters()) and lin.weight.is_meta
    assert all(not b.is_meta for b in model.buffers())  # buffers stay real by default
    assert isinstance(lin.weight, nn.Parameter) and lin.weight.requires_grad
    assert frozen.extra.is_meta and frozen.weight.is_meta
    assert nn.Linear(2, 2).weight.device.type == "cpu"  # the patch is gone after the block
    with init_empty_weights(include_buffers=True):
        model2 = BertModel(_bert_cfg())
    assert all(t.is_meta for t in list(model2.parameters()) + list(model2.buffers()))
    assert torch.empty(1).device.type == "cpu"
    with init_empty_weights(enable=False):
        real = nn.Linear(2, 2)
    assert not real.weight.is_meta
    with pytest.raises(RuntimeError), init_empty_weights():
        raise RuntimeError("inside")
    assert nn.Linear(2, 2).weight.device.type == "cpu"  # restored after an exception too


def test_consolidate_tp2_ranks_concatenate_to_world_size_1():
    full = dict(_bert_tp(1, 0).named_parameters())
    r0 = dict(_bert_tp(2, 0).named_parameters())
    r1 = dict(_bert_tp(2, 1).named_parameters())
    n_sharded = 0
    for name, ref in full.items():
        a, b = r0[name], r1[name]
        assert not a.is_meta and not torch.isnan(a).any()
        axis = getattr(a, "shard_axis", None)
        if axis is None:
            assert torch.equal(a, ref) and torch.equal(b, ref), name
        else:
            n_sharded += 1
            assert a.orig_shape == ref.shape
            assert torch.equal(torch.cat([a, b], dim=axis), ref), name
    assert n_sharded == 1 + 2 * (2 * len(COL) + len(ROW))
    # Hugging Face's init was used: N(0, 0.02) linears, ones/zeros norms, zeroed padding row
    q = full["encoder.layer.0.attention.self.query.weight"]
    assert abs(q.std().item() - 0.02) < 0.004
    assert torch.equal(full["embeddings.LayerNorm.weight"], torch.ones(64))
    assert torch.equal(full["embeddings.word_embeddings.weight"][0], torch.zeros(64))
    assert full["encoder.layer.0.attention.self.query.bias"].abs().sum() == 0


def test_consolidate_is_reproducible_and_seeded():
    rng = torch.get_rng_state()
    a = dict(_bert_tp(1, 0).named_parameters())
    assert torch.equal(rng, torch.get_rng_state())  # the global generator is untouched
    b = dict(_bert_tp(1, 0).named_parameters())
    c = dict(_bert_tp(1, 0, seed=7).named_parameters())
    name = "encoder.layer.1.output.dense.weight"
    assert torch.equal(a[name], b[name]) and not torch.equal(a[name], c[name])
    # different modules of the same shape get different values
    assert not torch.equal(a["encoder.layer.0.output.dense.weight"], a[name])


def test_consolidated_model_runs_and_keeps_ties():
    cfg = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=100,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):  # buffers on meta too: rebuilt by the model's own _init_weights
        model = LlamaForCausalLM(cfg)
    sch = sl.create_schedule(model)
    consolidate_model(sch)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    assert torch.isfinite(model.model.rotary_emb.inv_freq).all()
    out = model(torch.randint(0, 100, (1, 8))).logits
    assert out.shape == (1, 8, 100) and torch.isfinite(out).all()


def test_tied_sharded_embedding_stays_tied():
    cfg = LlamaConfig(
        num_hidden_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=64,
        tie_word_embeddings=True,
    )
    with init_empty_weights():
        model = LlamaForCausalLM(cfg)
    sch = sl.create_schedule(model, world_size=2, rank=1)
    sch["model.embed_tokens"].shard("weight", axis=0)
    consolidate_model(sch)
    w = model.model.embed_tokens.weight
    assert model.lm_head.weight is w and w.shape == (32, 32) and not w.is_meta
    assert any(k is w for k in sch.metadata.tie_weights)  # the tie table follows the new tensor


def test_non_hf_model_uses_reset_parameters_and_param_init_fn():
    def build(ws, rank, fn=None):
        with init_empty_weights():
            model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.LayerNorm(8))
        sch = sl.create_schedule(model, world_size=ws, rank=rank)
        if ws > 1:
            sch["0"].shard("weight", axis=0)
            sch["0"].shard("bias", axis=0)
            sch["2"].shard("weight", axis=1)
        consolidate_model(sch, param_init_fn=fn)
        return model

    full, a, b = build(1, 0), build(2, 0), build(2, 1)
    assert torch.equal(torch.cat([a[0].weight, b[0].weight]), full[0].weight)
    assert torch.equal(torch.cat([a[0].bias, b[0].bias]), full[0].bias)
    assert torch.equal(torch.cat([a[2].weight, b[2].weight], dim=1), full[2].weight)
    assert torch.equal(a[2].bias, full[2].bias) and torch.equal(full[3].weight, torch.ones(8))
    bound = 1 / 8**0.5  # torch's Linear init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) with the FULL fan-in
    assert full[0].weight.abs().max() <= bound and full[0].weight.abs().max() > 0.8 * bound
    assert a[2].weight.abs().max() > 1 / 16**0.5 * 0.8  # fan-in 16, not the shard's 8

    def fill(m):
        for p in m.parameters(recurse=False):
            p.data.fill_(0.5)

    custom = build(2, 1, fill)
    assert all(torch.equal(p, torch.full_like(p, 0.5)) for p in custom.parameters())


def test_stage_only_materialises_that_stage():
    with init_empty_weights():
        model = BertModel(_bert_cfg())
    sch = sl.create_schedule(model)
    sch["encoder.layer.0"].cut_pipeline_stage()
    consolidate_model(sch, stage=1)
    assert model.embeddings.word_embeddings.weight.is_meta
    assert model.encoder.layer[0].output.dense.weight.is_meta
    assert not model.encoder.layer[1].output.dense.weight.is_meta and not model.pooler.dense.weight.is_meta
    ref = dict(_bert_tp(1, 0).named_parameters())
    assert torch.equal(model.encoder.layer[1].output.dense.weight, ref["encoder.layer.1.output.dense.weight"])
    with pytest.raises(sl.ScheduleError):
        consolidate_model(sch, stage=2)


def test_unrebuildable_meta_buffer_raises():
    class WithBuffer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.register_buffer("table", torch.arange(4.0))

    with init_empty_weights(include_buffers=True):
        model = WithBuffer()
    with pytest.raises(sl.ScheduleError, match="table"):
        consolidate_model(sl.create_schedule(model))
    with pytest.raises(sl.ScheduleError):
        consolidate_model(sl.create_schedule(nn.Linear(2, 2)), target="megatron")
