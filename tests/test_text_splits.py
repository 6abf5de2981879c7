"""Per-head score terms made by a linear (:mod:`slapo_lab.sharding.score_terms`), read from the dataflow.

ProphetNet's n-gram self-attention adds ``relative_pos_embeddings(hidden)`` -- an ``nn.Linear(hidden,
num_buckets * heads)`` viewed as ``(num_buckets, heads)``, permuted heads first and gathered by bucket -- to its
scores. Built tiny from ``ProphetNetConfig`` (no downloads): the split inference gives that linear a column
role whose strided layout keeps, on each rank, one chunk of every bucket's block of head features: exactly that
rank's heads. The strided-layout and meta-index helpers are checked on their own.
"""

from __future__ import annotations

import torch
import transformers

from slapo_lab.sharding import infer, score_terms
from slapo_lab.sharding.rules import local_shard

HEADS, BUCKETS = 4, 8


def _prophetnet():
    torch.manual_seed(0)
    cfg = transformers.ProphetNetConfig(
        vocab_size=64,
        hidden_size=32,
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
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
    )
    model = transformers.ProphetNetForConditionalGeneration(cfg).eval()
    g = torch.Generator().manual_seed(0)
    inputs = {
        "input_ids": torch.randint(3, 64, (2, 8), generator=g),
        "decoder_input_ids": torch.randint(3, 64, (2, 6), generator=g),
        "use_cache": False,
    }
    return model, inputs


def test_relative_position_linear_follows_the_heads():
    model, inputs = _prophetnet()
    splits = infer.analyse(model, inputs)
    dec = next(s for b, s in splits.items() if ".decoder." in b)
    rel = "self_attn.relative_pos_embeddings"
    assert dec.roles[rel] == "q", dec.whole.get(rel)
    lay = dec.layouts[rel]
    assert lay.stride == BUCKETS  # one chunk of every bucket's block of HEADS features per rank
    idx = torch.arange(BUCKETS * HEADS)
    for rank in range(2):
        mine = local_shard(idx, 0, 2, rank, lay.stride)
        # feature b * HEADS + h is head h's (the view as (num_buckets, heads)): rank r keeps heads 2r, 2r + 1
        assert sorted({int(f) % HEADS for f in mine}) == [2 * rank, 2 * rank + 1]
        assert len(mine) == BUCKETS * HEADS // 2
    # the q/k/v/o projections of the same attention keep their contiguous head split
    assert dec.roles["self_attn.query_proj"] == "q" and dec.roles["self_attn.out_proj"] == "o"


def test_run_strides_and_completion():
    n = BUCKETS * HEADS
    rank0 = {b * HEADS + h for b in range(BUCKETS) for h in (0, 1)}
    assert score_terms.run_strides(n, [rank0]) == [BUCKETS]
    assert score_terms.run_strides(n, [set(range(n // 2))]) == []  # one run: the plain contiguous shard
    assert score_terms.run_strides(n, [{0, 1, 5}]) == []  # runs of different lengths: no equal blocks
    seen = [{h, 2 * HEADS + h} for h in range(HEADS)]  # a gather that picked two buckets of each head
    assert score_terms._complete(seen, n) == [set(range(h, n, HEADS)) for h in range(HEADS)]
    assert (
        score_terms._complete([{0}, {1}, {HEADS + 3}, {3}], n) is None
    )  # no layout explains feature 7 on head 2


def test_meta_index_is_never_read_as_values():
    """A gather by an index made on the meta device follows a zero index (an element of the same row);
    any other indexing op by such an index drops the map instead of reading garbage."""
    idx = torch.zeros(3, 2, dtype=torch.long, device="meta")
    assert torch.equal(score_terms.unknown_index(torch.gather, idx), torch.zeros(3, 2, dtype=torch.long))
    try:
        score_terms.unknown_index(torch.index_select, idx)
    except ValueError:
        pass
    else:
        raise AssertionError("index_select by an index without values must drop the map")
