"""``slapo_lab.blocks``: the one home of block finding, asked by presets, the memory plan and pipeline balancing."""

from __future__ import annotations

import torch
import transformers
from torch import nn

import slapo_lab as sl
from slapo_lab import blocks, presets
from slapo_lab.pipeline import balance
from slapo_lab.plan import stage_assignment


class _Block(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class _SequentialNet(nn.Module):
    """A user's model whose blocks sit in an ``nn.Sequential`` (no ``nn.ModuleList`` anywhere)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Sequential(nn.Linear(8, 16), nn.ReLU())  # children of two classes: no stack
        self.body = nn.Sequential(*[_Block() for _ in range(3)])
        self.out = nn.Linear(16, 2)

    def forward(self, x):
        return self.out(self.body(self.head(x)))


def test_blocks_of_a_sequential_stack_are_found_by_every_caller():
    sch = sl.create_schedule(_SequentialNet())
    assert blocks.find_blocks(sch) == ["body.0", "body.1", "body.2"]
    assert presets.find_blocks is blocks.find_blocks  # presets re-export the one finder
    assert blocks.block_stack(sch) == ("body", 3)
    assert stage_assignment(sch).blocks == "body"
    assert balance.block_stacks(sch) == ("body", ["body.0", "body.1", "body.2"])


def test_the_stack_with_most_blocks_is_the_plans_for_an_encoder_decoder():
    cfg = transformers.T5Config(
        vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=3, num_decoder_layers=2, num_heads=4
    )
    sch = sl.create_schedule(transformers.T5ForConditionalGeneration(cfg))
    found = blocks.find_blocks(sch)
    assert [b for b in found if b.startswith("encoder.")] == [f"encoder.block.{i}" for i in range(3)]
    assert [b for b in found if b.startswith("decoder.")] == [f"decoder.block.{i}" for i in range(2)]
    assert blocks.block_stack(sch) == ("encoder.block", 3)
    assert stage_assignment(sch).blocks == "encoder.block"


def test_a_model_without_repeated_blocks_has_no_stack():
    sch = sl.create_schedule(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    assert blocks.find_blocks(sch) == []
    assert blocks.block_stack(sch) == (None, 0)
