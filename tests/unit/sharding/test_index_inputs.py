"""Index inputs other than token ids in the split inference's one-sample forward.

Example inputs are stored as meta tensors (``set_example_inputs``), so the inference's forward
(:func:`slapo_lab.sharding.infer._example_inputs`) makes values: random token ids for ``*input_ids``, and zeros for
every other integer input (positions, entity ids, token types), whose tables are not the vocabulary (index 0 is
valid in each). LUKE's entity-aware self-attention (Yamada et al. 2020, "LUKE: Deep Contextualized Entity
Representations with Entity-aware Self-attention", transformers' ``modeling_luke.py``) runs its word-to-entity,
entity-to-word and entity-to-entity queries only on entity inputs; with ``entity_position_ids`` in range the
forward runs, the dataflow shows those queries reaching the heads, and the Megatron preset splits them with q / k
/ v and passes the numeric check on 2 simulated ranks.
"""

from __future__ import annotations

import copy

import torch
import transformers

import slapo_lab as sl
from slapo_lab import presets
from slapo_lab.call_order import set_example_inputs
from slapo_lab.numeric import numeric_check
from slapo_lab.sharding import infer

QUERIES = ("query", "w2e_query", "e2w_query", "e2e_query")


def test_entity_aware_queries_split_with_the_heads():
    cfg = transformers.LukeConfig(
        vocab_size=128,
        entity_vocab_size=16,
        hidden_size=64,
        entity_emb_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = transformers.LukeForMaskedLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    inputs = {
        "input_ids": torch.randint(1, 128, (2, 16), generator=g),
        "entity_ids": torch.randint(1, 16, (2, 3), generator=g),
        "entity_attention_mask": torch.ones(2, 3, dtype=torch.long),
        "entity_position_ids": torch.randint(0, 16, (2, 3, 4), generator=g),
    }
    sch = sl.create_schedule(copy.deepcopy(model), world_size=2)
    set_example_inputs(sch, inputs)
    block = "luke.encoder.layer.0"
    split = infer.block_split(sch, block)
    assert {f"attention.self.{q}" for q in QUERIES} <= set(split.roles), split.roles
    assert split.roles["attention.output.dense"] == "o"
    presets.megatron_tp(sch, vocab_parallel=presets.has_vocab_embedding(sch))
    for q in QUERIES:
        assert sch[f"{block}.attention.self.{q}"].mod.weight.shard_axis == 0, q
    report = numeric_check(model, sch.record.calls, 2, inputs)
    assert report.passed, report.message
