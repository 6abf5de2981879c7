"""Vocab-parallel cross entropy (Slapo 0.0.3 ``slapo/op/cross_entropy.py``, from Megatron-LM)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ScheduleError
from ..sharding import reduce_forward_output


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0, group=None):
    """Per-token cross entropy when the vocabulary (last axis) is split over the ranks of ``group``.

    Args:
        vocab_parallel_logits: ``(*, V / world_size)``, this rank's contiguous slice of the vocabulary
            (rank ``r`` holds ids ``[r * V/ws, (r+1) * V/ws)``).
        target: ``(*)`` token ids in ``[0, V)``.
        label_smoothing: in ``[0, 1)``.
        group: a torch.distributed process group (None: the default group); without an initialised process
            group this is plain per-token cross entropy.

    Returns:
        ``(*)`` float losses (no reduction), the same on every rank.

    Raises:
        ScheduleError: ``label_smoothing`` outside ``[0, 1)`` or ``target``'s shape not the logits' leading shape.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ScheduleError(f"label_smoothing must be in [0, 1), not {label_smoothing}.")
    if tuple(target.shape) != tuple(vocab_parallel_logits.shape[:-1]):
        raise ScheduleError(
            f"target has shape {tuple(target.shape)}, but the logits {tuple(vocab_parallel_logits.shape)} need "
            f"{tuple(vocab_parallel_logits.shape[:-1])}."
        )
    live = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(group) if live else 0
    ws = dist.get_world_size(group) if live else 1
    if live and ws > 1:
        all_reduce = reduce_forward_output
    else:

        def all_reduce(x, _group):
            return x

    logits = vocab_parallel_logits.float()
    part = logits.shape[-1]
    m = logits.detach().max(dim=-1).values
    if live and ws > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    z = logits - m.unsqueeze(-1)
    start = rank * part
    outside = (target < start) | (target >= start + part)
    local = (target - start).masked_fill(outside, 0)
    predicted = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
    predicted = all_reduce(predicted, group)
    log_sum = torch.log(all_reduce(z.exp().sum(dim=-1), group))
    loss = log_sum - predicted
    if label_smoothing > 0:
        vocab = part * ws
        mean_log_probs = all_reduce(z.sum(dim=-1), group) / vocab - log_sum
        smoothing = label_smoothing * vocab / (vocab - 1)
        loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs
    return loss


class ParallelCrossEntropy(nn.Module):
    """``forward(outputs, labels)``: :func:`vocab_parallel_cross_entropy` over ``group`` (Slapo 0.0.3
    ``slapo/op/cross_entropy.py``); ``outputs`` ``(*, V / ws)``, ``labels`` ``(*)`` -> ``(*)`` losses."""

    def __init__(self, group=None):
        super().__init__()
        self.group = group

    def forward(self, outputs, labels):
        return vocab_parallel_cross_entropy(outputs, labels, group=self.group)
