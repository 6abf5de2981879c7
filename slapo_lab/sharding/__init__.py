"""Per-module shard rules and tensor-parallel communication ops."""
from .sync_ops import TPGroup, all_gather, all_reduce_backward, all_reduce_forward, reduce_scatter, scatter  # noqa: F401
from .rules import get_shard_rule, register_shard_rule  # noqa: F401
