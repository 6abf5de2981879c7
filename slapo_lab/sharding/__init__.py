"""Per-module shard rules, per-rank attention head counts and tensor-parallel communication ops."""

from .heads import register_attention_heads  # noqa: F401
from .rules import get_shard_rule, register_shard_rule  # noqa: F401
from .sync_ops import TPGroup, all_gather, all_reduce_backward, all_reduce_forward, reduce_scatter, scatter  # noqa: F401
