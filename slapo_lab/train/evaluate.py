"""The validation loss of a launched run: :func:`evaluate` (``--eval-data``, every ``--eval-every`` steps and at
the end).

The loss is the sum of every labelled token's cross entropy over the sum of those tokens, summed over the
data-parallel replicas and read off the last pipeline stage; the same sequences at every layout
(:func:`slapo_lab.train.data.eval_micro_batches` pads with rows that count nothing), so it does not depend on
``dp``, ``tp``, ``pp`` or the micro-batch size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from .data import eval_micro_batches, eval_sample_count
from .losses import cat_batches, first_tensor, labelled_tokens, split_target, to_device, token_losses

if TYPE_CHECKING:
    from .run import Run


def evaluate(run: Run) -> tuple[float, int]:
    """The validation loss over the first ``--eval-samples`` sequences of ``--eval-data`` (all by default):
    the sum of every labelled token's cross entropy divided by the number of those tokens, summed over the
    data-parallel replicas (each evaluates its part) and taken from the last pipeline stage, the same on
    every rank; and the number of sequences evaluated.

    The sequences are the same at every layout: :func:`~slapo_lab.train.data.eval_micro_batches` pads the
    last micro-batch (and a pipeline's last group) with rows whose labels count nothing, so the loss at
    equal weights does not depend on the micro-batch size, ``dp``, ``tp`` or ``pp``. Replicas may get one
    group of micro-batches fewer; under FSDP2 every forward all-gathers over the replicas, so each runs as
    many forwards as replica 0 (which has the most), the extra ones uncounted.
    """
    lay = run.layout
    objective = run.objective or "causal_lm"
    group = run.plan.accumulation if run.pm is not None else 1
    micro = list(
        eval_micro_batches(
            run.eval_data, run.micro, lay.dp, lay.dp_rank, run.cfg.eval.eval_samples, group=group
        )
    )
    most = len(
        eval_micro_batches(run.eval_data, run.micro, lay.dp, 0, run.cfg.eval.eval_samples, group=group)
    )
    batches = [(mb, True) for mb in micro]
    if lay.fsdp:
        batches += [(batches[0][0] if batches else _eval_filler(run, group), False)] * (most - len(micro))
    with torch.no_grad():
        if run.pm is not None:
            total, tokens = _pipeline_sums(run, batches, group, objective)
        else:
            total, tokens = _module_sums(run, batches, objective)
    if lay.fsdp:
        # a forward without backward leaves FSDP2's root unsharded (then the optimizer's parameters are not the
        # module's, and a checkpoint cannot map them)
        for m in run.module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
    if lay.dp > 1:
        both = torch.stack([total, tokens]).to(run.reduce_device)
        dist.all_reduce(both, group=lay.mesh.dp_group)
        total, tokens = both[0].cpu(), both[1].cpu()
    rows = eval_sample_count(run.eval_data, run.cfg.eval.eval_samples)
    return (float(total / tokens) if float(tokens) else float("nan")), rows


def _pipeline_sums(
    run: Run, batches: list[tuple[dict, bool]], group: int, objective: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 token-loss sum and labelled-token count of the counted ``batches`` on the pipeline, ``group``
    micro-batches per step."""
    total = torch.zeros((), dtype=torch.float64)
    tokens = torch.zeros((), dtype=torch.float64)
    for k in range(0, len(batches), group):
        batch = to_device(cat_batches([b for b, _ in batches[k : k + group]]), run.device)
        inputs, target = split_target(batch, 1, run.device)
        with run.pipeline_loss.summed():  # the mean over micro-batches of their token sums
            loss = run.pm.eval_step(**inputs, target=target)
        if batches[k][1]:
            total += loss * group
            tokens += labelled_tokens(target, objective)
    return total, tokens


def _module_sums(
    run: Run, batches: list[tuple[dict, bool]], objective: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 token-loss sum and labelled-token count of the counted ``batches`` on the (unpipelined) model,
    in eval mode."""
    total = torch.zeros((), dtype=torch.float64)
    tokens = torch.zeros((), dtype=torch.float64)
    run.module.eval()
    for mb, counted in batches:
        inputs, labels = split_target(to_device(mb, run.device), 1, run.device)
        with run.autocast():
            logits = first_tensor(run.model(**run.forward_kwargs(inputs)))
        if counted:
            total += token_losses(logits, labels, objective).double().sum().cpu()
            tokens += labelled_tokens(labels, objective)
    run.module.train()
    return total, tokens


def _eval_filler(run: Run, group: int) -> dict:
    """A batch of the evaluation shapes for a replica that has none left (its forwards are not counted)."""
    return next(
        iter(
            eval_micro_batches(
                run.eval_data, run.micro, run.layout.dp, 0, run.cfg.eval.eval_samples, group=group
            )
        )
    )
