"""The activation pass composed from distinct blocks (slapo_lab/activation_cache.py): equal to the whole-model pass,
per pipeline stage, whatever the schedule; one pass per new block signature; a whole pass where it cannot run."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from torch import nn

import slapo_lab as sl
from slapo_lab import presets
from slapo_lab.activation_cache import _entry, cached_profile, has_cached_profile, is_composed
from slapo_lab.activations import saved_activations
from slapo_lab.plan import _saved_per_stage, plan, stage_assignment
from slapo_lab.utils import meta_copy

FAMILIES = {
    "llama": (
        T.LlamaConfig,
        T.LlamaForCausalLM,
        {
            "num_hidden_layers": 5,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 128,
            "vocab_size": 100,
        },
    ),
    "llama8": (
        T.LlamaConfig,
        T.LlamaForCausalLM,
        {
            "num_hidden_layers": 8,
            "hidden_size": 32,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 64,
            "vocab_size": 100,
        },
    ),
    "bert": (
        T.BertConfig,
        T.BertForMaskedLM,
        {
            "num_hidden_layers": 4,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "intermediate_size": 128,
            "vocab_size": 100,
        },
    ),
    # relative position bias made by the first block only: a block of its own kind, fed to the others
    "t5": (
        T.T5Config,
        T.T5ForConditionalGeneration,
        {
            "num_layers": 4,
            "num_decoder_layers": 3,
            "d_model": 64,
            "num_heads": 4,
            "d_kv": 16,
            "d_ff": 128,
            "vocab_size": 100,
        },
    ),
    # sliding-window and full attention layers alternate (a plain attribute in which blocks differ)
    "gemma2": (
        T.Gemma2Config,
        T.Gemma2ForCausalLM,
        {
            "num_hidden_layers": 5,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "intermediate_size": 128,
            "vocab_size": 100,
            "sliding_window": 8,
        },
    ),
}


def _schedule(family: str, variant: str):
    cfg_cls, model_cls, kw = FAMILIES[family]
    with torch.device("meta"):
        model = model_cls(cfg_cls(**kw))
    ids = torch.zeros(2, 16, dtype=torch.long)
    inputs = {"input_ids": ids, "labels": ids}
    if family == "t5":
        inputs["decoder_input_ids"] = ids
    sch = sl.create_schedule(meta_copy(model), world_size=2)
    if variant != "plain":
        presets.megatron_tp(sch, vocab_parallel=presets.has_vocab_embedding(sch), check=False)
    blocks = presets.find_blocks(sch)
    if "ckpt" in variant:
        for b in blocks[1::2]:
            sch[b].checkpoint()
    if "selective" in variant:
        sch[blocks[0]].checkpoint(policy="selective")
    if "cut" in variant:
        sch[blocks[len(blocks) // 2]].cut_pipeline_stage()
    return sch, inputs


@pytest.mark.parametrize("family", ["bert", "gemma2", "llama", "t5"])
@pytest.mark.parametrize("variant", ["plain", "tp+ckpt+cut", "tp+selective"])
def test_the_composed_pass_equals_the_whole_pass_per_stage(family, variant):
    sch, inputs = _schedule(family, variant)
    assign = stage_assignment(sch)
    whole = _saved_per_stage(saved_activations(sch.mod, inputs), assign, 1.0, None)
    composed, hit = cached_profile(sch, inputs, cache=False, mode="autograd")
    assert not hit
    assert _saved_per_stage(composed, assign, 1.0, None) == whole
    if (
        variant == "plain"
    ):  # every block alike (a counter such as layer_idx aside): the first two and the last run
        _, comp = _entry(sch, inputs, "autograd")
        if family in ("llama", "bert"):
            assert comp is not None and [st.kept for st in comp.stacks] == [
                [0, 1, len(comp.stacks[0].indices) - 1]
            ]


@pytest.mark.parametrize("start", [0, 2])
def test_checkpointing_the_next_block_needs_no_new_pass(start):
    """Checkpointing blocks one after another (as a person clicks down the stack), from the first block or from one
    in the middle: the first click's pass also measures a checkpointed block after a checkpointed one (on a copy of
    the first), so every later click is answered from the cache with no pass, and each plan matches the whole
    pass."""
    sch, inputs = _schedule("llama8", "tp")
    sch[f"model.layers.{start}"].checkpoint()
    first = plan(sch, example_inputs=inputs, activation="autograd")
    assert first.activation != "cached"
    _, comp = _entry(sch, inputs, "autograd")
    assert comp is not None and comp.stacks[0].kept.count(start) == 2  # kept twice: the second time, a copy
    for i in range(start + 1, start + 4):
        sch[f"model.layers.{i}"].checkpoint()
        assert is_composed(sch, inputs) and has_cached_profile(sch, inputs)
        pl = plan(sch, example_inputs=inputs, activation="autograd")
        assert pl.activation == "cached"
        whole = plan(sch, example_inputs=inputs, activation="autograd", cache=False)
        assert whole.per_stage[0]["activation_bytes"] == pl.per_stage[0]["activation_bytes"]


class _Kind(nn.Module):
    """A block whose forward saves more when ``wide`` is set (a plain attribute, as a sliding-window flag)."""

    def __init__(self, wide: bool, idx: int) -> None:
        super().__init__()
        self.wide, self.layer_idx = wide, idx
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        return torch.tanh(y * y) if self.wide else y


class _ByCount(nn.Module):
    """A stack its forward walks by its own count: cut down, it fails, and the whole pass answers."""

    def __init__(self, n: int, indexed: bool) -> None:
        super().__init__()
        self.n, self.indexed = n, indexed
        self.layers = nn.ModuleList(_Kind(i % 3 == 0, i) for i in range(n))

    def forward(self, x):
        if self.indexed:
            for i in range(self.n):
                x = self.layers[i](x)
        else:
            for layer in self.layers:
                x = layer(x)
        return (x * x).sum()  # saves the last block's output, which a wide block has saved already


@pytest.mark.parametrize("indexed", [False, True])
def test_blocks_that_differ_by_a_plain_attribute_and_a_forward_that_cannot_run_cut_down(indexed):
    sch = sl.create_schedule(_ByCount(7, indexed), world_size=1)
    x = torch.randn(4, 8)
    assert is_composed(sch, x)
    _, comp = _entry(sch, x, "autograd")
    # W N N W N N W: the contexts (W, first) (N after W, first) (N after N) (W after N) (N after W) stand for all,
    # and the last block runs too; layer_idx differs in every block, a counter, so it makes no kind
    assert [st.kept for st in comp.stacks] == [[0, 1, 2, 3, 4, 6]]
    assign = stage_assignment(sch)
    whole = _saved_per_stage(saved_activations(sch.mod, x), assign, 1.0, None)
    composed, _ = cached_profile(sch, x, cache=True, mode="autograd")
    assert _saved_per_stage(composed, assign, 1.0, None) == whole
