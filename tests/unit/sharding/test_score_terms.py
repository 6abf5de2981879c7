"""Per-head score terms made by a linear (:mod:`slapo_lab.sharding.score_terms`), read from the dataflow.

* a hand-written attention whose relative-position bias is a linear of the hidden states,
  ``nn.Linear(width, num_buckets * heads)`` viewed as ``(num_buckets, heads)``, permuted heads first and
  ``gather``-ed by each query/key pair's bucket (the shape of ProphetNet's main stream): the linear is column
  parallel with a strided layout (one chunk of every bucket's block of head features per rank), every projection
  is split and the numeric check on 2 simulated ranks passes, on a meta copy as the editor makes it (the bucket
  index then has no values); without the strided layout the preset keeps the attention whole;
* ProphetNet built tiny from ``ProphetNetConfig`` (no downloads): its predict stream reads the gathered rows back
  in another order (``(batch, T, ngram, heads)`` rows as ``(ngram, batch, heads, T)``), so head h's scores get
  other heads' relative-position features -- checked on the model itself -- and the n-gram self-attention is kept
  whole with that sentence, its cross-attention split;
* LUKE built tiny from ``LukeConfig`` with entities (the sweep's second input sequence,
  ``tests/family_sweep.py``: ``entity_ids`` and ``entity_position_ids``): the entity-aware attention's extra
  queries ``w2e_query`` / ``e2w_query`` / ``e2e_query`` are read from the dataflow and split by heads, the preset's
  own check runs (the check draws the remembered meta positions among the token positions, not the vocabulary)
  and passes;
* Longformer built tiny from ``LongformerConfig`` with the sweep's ``global_attention_mask`` (the first token
  global): ``query_global`` / ``key_global`` / ``value_global`` run, are read as q / k / v and split by heads with
  the local projections, and the check passes;
* RWKV built tiny from ``RwkvConfig``: ``feed_forward.receptance`` gates ``feed_forward.value``'s output after
  its row-parallel all-reduce, so it is column parallel with its output gathered while ``key`` / ``value`` are
  split, and the check passes;
* Inkling (text) built tiny as the sweep builds it (``tests/family_sweep.py``, from its config class):
  ``r_proj``'s per-head relative states pass through ``relative_states @ proj`` (a weight over each head's
  features, :func:`slapo_lab.sharding.score_terms.param_matmul`) into the attention's bias, so ``r_proj`` is
  split by heads with q / k / v / o and the check passes;
* the strided-layout, completion and meta-index helpers on their own.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

import slapo_lab as sl
from slapo_lab import presets
from slapo_lab.call_order import set_example_inputs
from slapo_lab.numeric import numeric_check, shrunk_inputs
from slapo_lab.preset_check import set_reference
from slapo_lab.sharding import infer, score_terms
from slapo_lab.sharding.rules import local_shard
from slapo_lab.utils import meta_copy

HEADS, BUCKETS, WIDTH = 4, 8, 32


class RelAttention(nn.Module):
    """Attention with a per-head relative-position bias computed by a linear of the hidden states."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.num_buckets = HEADS, WIDTH // HEADS, BUCKETS
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.rel_proj = nn.Linear(WIDTH, BUCKETS * HEADS)
        self.o_proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, -1, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        scores = q @ k.transpose(-1, -2) * self.head_dim**-0.5
        rel = self.rel_proj(x).view(b, t, self.num_buckets, -1).permute(0, 3, 1, 2)  # (b, heads, t, buckets)
        pos = torch.arange(t, device=x.device)
        half = self.num_buckets // 2
        bucket = ((pos[None, :] - pos[:, None]).clamp(-half, half - 1) + half).expand(b, rel.shape[1], t, t)
        scores = scores + torch.gather(rel, -1, bucket)
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, -1)
        return self.o_proj(out)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = RelAttention()
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.down(torch.relu(self.up(x)))


class RelNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, WIDTH)
        self.layers = nn.ModuleList([Layer() for _ in range(2)])
        self.head = nn.Linear(WIDTH, 32)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _preset(model, inputs):
    sch = sl.create_schedule(meta_copy(model), world_size=2)
    set_example_inputs(sch, inputs)
    set_reference(sch, model)
    return sch, presets.megatron_tp(sch, vocab_parallel=False)


def _rel_net():
    torch.manual_seed(0)
    return RelNet().eval(), {"input_ids": torch.randint(0, 32, (2, 8))}


def test_a_relative_position_linear_follows_the_heads():
    model, inputs = _rel_net()
    sch, calls = _preset(model, inputs)
    split = infer.block_split(sch, "layers.0")
    assert split.roles["attn.rel_proj"] == "q"
    assert split.layouts["attn.rel_proj"].stride == BUCKETS
    idx = torch.arange(BUCKETS * HEADS)
    for rank in range(
        2
    ):  # feature b * HEADS + h is head h's: rank r keeps heads 2r and 2r + 1 of every bucket
        mine = local_shard(idx, 0, 2, rank, BUCKETS)
        assert sorted({int(f) % HEADS for f in mine}) == [2 * rank, 2 * rank + 1]
    assert not any(n.startswith("Kept whole: in every") for n in calls.notes), calls.notes
    for rel in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.rel_proj", "up"):
        assert sch[f"layers.0.{rel}"].mod.weight.shard_axis == 0, rel
    for rel in ("attn.o_proj", "down"):
        assert sch[f"layers.0.{rel}"].mod.weight.shard_axis == 1, rel
    report = numeric_check(model, sch.record.calls, 2, inputs, timeout=100)
    assert report.status == "passed", report.message


def test_without_the_strided_layout_the_attention_stays_whole(monkeypatch):
    monkeypatch.setattr(score_terms, "run_strides", lambda n, needed: [])
    model, inputs = _rel_net()
    sch, calls = _preset(model, inputs)
    assert getattr(sch["layers.0.attn.rel_proj"].mod.weight, "shard_axis", None) is None
    assert getattr(sch["layers.0.attn.q_proj"].mod.weight, "shard_axis", None) is None, calls.notes
    assert sch["layers.0.up"].mod.weight.shard_axis == 0  # the MLP is split all the same


def _prophetnet():
    torch.manual_seed(0)
    cfg = transformers.ProphetNetConfig(
        vocab_size=64,
        hidden_size=WIDTH,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_encoder_layers=1,
        num_decoder_layers=1,
        num_encoder_attention_heads=HEADS,
        num_decoder_attention_heads=HEADS,
        num_buckets=BUCKETS,
        relative_max_distance=16,
        ngram=2,
        max_position_embeddings=32,
    )
    return transformers.ProphetNetForConditionalGeneration(cfg).eval()


def test_prophetnet_predict_stream_mixes_heads_so_its_attention_stays_whole():
    model = _prophetnet()
    attn = model.prophetnet.decoder.layers[0].self_attn
    # the claim, on the model: with only head 0's relative-position features nonzero, the main stream's bias
    # reaches head 0 alone and the predict stream's reaches every head
    with torch.no_grad():
        keep = torch.arange(BUCKETS * HEADS) % HEADS == 0
        attn.relative_pos_embeddings.weight[~keep] = 0
        attn.relative_pos_embeddings.bias[~keep] = 0
        g = torch.Generator().manual_seed(0)
        main = attn.get_main_relative_pos_embeddings(
            torch.randn(1, 8, WIDTH, generator=g),
            torch.zeros(1, HEADS, 8, 8),
            None,
            torch.randint(0, BUCKETS, (1, 8, 8), generator=g),
        )
        predict = attn.get_predict_relative_pos_embeddings(
            torch.randn(1, 8, 2, WIDTH, generator=g),
            torch.zeros(1, 2, HEADS, 8, 16),
            None,
            torch.randint(0, BUCKETS, (1, 8, 16), generator=g),
        )
    assert main[:, 1:].abs().max() == 0 and main[:, 0].abs().max() > 0
    assert all(predict[:, :, h].abs().max() > 0 for h in range(HEADS))

    model = _prophetnet()
    g = torch.Generator().manual_seed(0)
    inputs = {
        "input_ids": torch.randint(3, 64, (2, 8), generator=g),
        "decoder_input_ids": torch.randint(3, 64, (2, 6), generator=g),
        "use_cache": False,
    }
    dec = next(s for b, s in infer.analyse(model, inputs).items() if ".decoder." in b)
    why = dec.whole["self_attn.relative_pos_embeddings"]
    assert "relative_pos_embeddings output is added to the attention scores" in why
    assert dec.whole["self_attn.query_proj"] == why and dec.whole["self_attn.out_proj"] == why
    assert dec.roles["cross_attn.query_proj"] == "q" and dec.roles["cross_attn.out_proj"] == "o"


def test_run_strides_and_completion():
    n = BUCKETS * HEADS
    rank0 = {b * HEADS + h for b in range(BUCKETS) for h in (0, 1)}
    assert score_terms.run_strides(n, [rank0]) == [BUCKETS]
    assert score_terms.run_strides(n, [set(range(n // 2))]) == []  # one run: the plain contiguous shard
    assert score_terms.run_strides(n, [{0, 1, 5}]) == []  # runs of different lengths: no equal blocks
    seen = [{h, 2 * HEADS + h} for h in range(HEADS)]  # a gather that picked two buckets of each head
    assert score_terms._complete(seen, n) == [set(range(h, n, HEADS)) for h in range(HEADS)]
    assert score_terms._complete([{0}, {1}, {HEADS + 3}, {3}], n) is None  # feature 7 on head 2: no layout


def test_an_index_without_values_is_never_read():
    """A gather by an index made on the meta device follows a zero index (an element of the same row); any
    other indexing op by such an index drops the map instead of mapping garbage."""
    idx = torch.zeros(3, 2, dtype=torch.long, device="meta")
    assert torch.equal(score_terms.unknown_index(torch.gather, idx), torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError):
        score_terms.unknown_index(torch.index_select, idx)


def test_luke_entity_queries_are_split_by_heads():
    from tests.family_sweep import example_inputs

    torch.manual_seed(0)
    cfg = transformers.LukeConfig(
        vocab_size=64,
        entity_vocab_size=32,
        entity_emb_size=WIDTH,
        hidden_size=WIDTH,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        intermediate_size=64,
        max_position_embeddings=32,
        use_entity_aware_attention=True,
    )
    model = transformers.LukeForMaskedLM(cfg).eval()
    inputs = example_inputs(model)
    assert inputs["entity_ids"].shape == (2, 4) and inputs["entity_position_ids"].shape == (2, 4, 1)
    sch, calls = _preset(model, inputs)
    assert not any("not checked" in n or n.startswith("Kept whole: in every") for n in calls.notes), (
        calls.notes
    )
    split = infer.block_split(sch, "luke.encoder.layer.0")
    for rel in ("query", "w2e_query", "e2w_query", "e2e_query", "key", "value"):
        assert split.roles[f"attention.self.{rel}"] in ("q", "k", "v"), rel
        assert sch[f"luke.encoder.layer.0.attention.self.{rel}"].mod.weight.shard_axis == 0, rel
    assert sch["luke.encoder.layer.0.attention.output.dense"].mod.weight.shard_axis == 1
    report = numeric_check(model, sch.record.calls, 2, inputs, timeout=100)
    assert report.status == "passed" and not report.unjudged, report.message


def test_meta_position_ids_are_drawn_among_the_token_positions():
    meta = {
        "input_ids": torch.zeros(2, 16, dtype=torch.long, device="meta"),
        "entity_position_ids": torch.zeros(2, 4, 1, dtype=torch.long, device="meta"),
    }
    out = shrunk_inputs(meta, nn.Embedding(1000, 4))
    assert int(out["entity_position_ids"].max()) < 16 and int(out["input_ids"].max()) >= 16


def test_longformer_global_projections_are_split_by_heads():
    from tests.family_sweep import example_inputs

    torch.manual_seed(0)
    cfg = transformers.LongformerConfig(
        vocab_size=64,
        hidden_size=WIDTH,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        intermediate_size=64,
        attention_window=4,
        max_position_embeddings=40,
        pad_token_id=1,
    )
    model = transformers.LongformerForMaskedLM(cfg).eval()
    inputs = example_inputs(model)
    assert (
        inputs["global_attention_mask"][:, 0].eq(1).all()
        and inputs["global_attention_mask"][:, 1:].eq(0).all()
    )
    sch, calls = _preset(model, inputs)
    assert not any("not checked" in n or n.startswith("Kept whole: in every") for n in calls.notes), (
        calls.notes
    )
    split = infer.block_split(sch, "longformer.encoder.layer.0")
    for rel, role in (("query_global", "q"), ("key_global", "k"), ("value_global", "v"), ("query", "q")):
        assert split.roles[f"attention.self.{rel}"] == role, rel
        assert sch[f"longformer.encoder.layer.0.attention.self.{rel}"].mod.weight.shard_axis == 0, rel
    report = numeric_check(model, sch.record.calls, 2, inputs, timeout=100)
    assert report.status == "passed" and not report.unjudged, report.message


def test_rwkv_receptance_gates_after_the_reduce_and_is_split_with_its_output_gathered():
    """A gate on a row-parallel output (``sigmoid(receptance(x)) * value(...)``, whole only after ``value``'s
    all-reduce) is column parallel with its output gathered (:mod:`slapo_lab.sharding.lone_linears`), and the
    check passes: each rank computes half the gate, the gather makes it whole before it meets the reduced output."""
    torch.manual_seed(0)
    cfg = transformers.RwkvConfig(
        vocab_size=64,
        hidden_size=WIDTH,
        num_hidden_layers=2,
        attention_hidden_size=WIDTH,
        intermediate_size=64,
    )
    model = transformers.RwkvForCausalLM(cfg).eval()
    inputs = {"input_ids": torch.randint(0, 64, (2, 8)), "use_cache": False}  # no state written in place
    sch, _ = _preset(model, inputs)
    split = infer.block_split(sch, "rwkv.blocks.0")
    assert split.roles["feed_forward.key"] == "mlp_in" and split.roles["feed_forward.value"] == "mlp_out"
    assert "feed_forward.receptance" not in split.whole
    assert sch["rwkv.blocks.0.feed_forward.receptance"].mod.weight.shard_axis == 0
    assert sch["rwkv.blocks.0.feed_forward.value"].mod.weight.shard_axis == 1
    report = numeric_check(model, sch.record.calls, 2, inputs, timeout=100)
    assert report.status == "passed", report.message


def test_inkling_relative_states_follow_the_heads():
    from tests.family_sweep import build, families

    model, inputs = build("inkling_text", families()["inkling_text"][1])
    sch, calls = _preset(model, inputs)
    assert not any(n.startswith("Kept whole: in every") for n in calls.notes), calls.notes
    split = infer.block_split(sch, "model.layers.0")
    assert split.roles["self_attn.r_proj"] == "q" and split.roles["self_attn.o_proj"] == "o"
    assert "self_attn.rel_logits_proj" in split.grad_sum  # its bank is applied to this rank's heads only
    for rel in ("q_proj", "k_proj", "v_proj", "r_proj"):
        assert sch[f"model.layers.0.self_attn.{rel}"].mod.weight.shard_axis == 0, rel
    report = numeric_check(model, sch.record.calls, 2, inputs, timeout=100)
    assert report.status == "passed", report.message
