"""Optimizer, learning-rate schedule and clipping by the global gradient norm.

The norm is the one of the whole model, over every tensor-parallel shard, data-parallel replica,
FSDP2 shard and pipeline stage: each gradient is viewed as a DTensor of its layout
(:mod:`slapo_lab.sharding.placements`), ``torch.nn.utils.get_total_norm`` reduces over the ``(dp, tp)``
mesh (sharded parts summed, replicated ones counted once), and the pipeline stages' squared norms are
summed over the pipeline group (torchtitan's ``clip_grad_norm_`` does the same for pipeline parallelism).
Tied copies of one parameter on several stages count once.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.optim import lr_scheduler as S

from .config import OptimizerOptions


def make_optimizer(opts: OptimizerOptions, params: Sequence[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """``--optimizer`` over ``params``: AdamW (``--lr``, ``--weight-decay``, ``--adam-beta1/2``, ``--adam-eps``)
    or SGD (``--lr``, ``--weight-decay``)."""
    params = list(params)
    if opts.optimizer == "sgd":
        return torch.optim.SGD(params, lr=opts.lr, weight_decay=opts.weight_decay)
    return torch.optim.AdamW(
        params,
        lr=opts.lr,
        betas=(opts.adam_beta1, opts.adam_beta2),
        eps=opts.adam_eps,
        weight_decay=opts.weight_decay,
    )


def make_scheduler(optimizer: torch.optim.Optimizer, schedule: str, warmup: int, total: int) -> S.LRScheduler:
    """The learning-rate schedule over ``total`` optimizer steps, from ``torch.optim.lr_scheduler``.

    ``warmup`` steps of ``LinearLR`` from ``lr / (warmup + 1)`` up to ``lr``, then ``constant``
    (``ConstantLR`` with factor 1), ``linear`` (``LinearLR`` down to 0 at ``total``) or ``cosine``
    (``CosineAnnealingLR`` down to 0 at ``total``), chained with ``SequentialLR``. Call ``step()``
    after every optimizer step.
    """

    rest = max(1, total - warmup)
    if schedule == "linear":
        main = S.LinearLR(optimizer, start_factor=1.0, end_factor=0.0, total_iters=rest)
    elif schedule == "cosine":
        main = S.CosineAnnealingLR(optimizer, T_max=rest, eta_min=0.0)
    else:
        main = S.ConstantLR(optimizer, factor=1.0, total_iters=0)
    if warmup <= 0:
        return main
    warm = S.LinearLR(optimizer, start_factor=1.0 / (warmup + 1), end_factor=1.0, total_iters=warmup)
    return S.SequentialLR(optimizer, [warm, main], milestones=[warmup])


def global_grad_norm(
    grads: Sequence[torch.Tensor], pp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The 2-norm of all gradients of the model, the same on every rank.

    Args:
        grads: this rank's gradients as DTensor views on the ``(dp, tp)`` mesh
            (:meth:`ShardLayout.dtensor`), each parameter once (tied copies on other stages left out).
        pp_group: the pipeline group whose stages' norms combine (None: no pipeline).

    Returns:
        A 0-dim float32 tensor (plain, replicated).
    """
    if grads:
        # DTensor logs a warning that reducing a scalar over both mesh dims takes two all-reduces: it does, and
        # for one scalar per step that is fine

        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        # one norm per device mesh (replicated key/value heads live on the (dp, kv, r) mesh, the rest on
        # (dp, tp): DTensor ops do not mix meshes), then the 2-norm of those norms
        by_mesh: dict[int, list] = {}
        for g in grads:
            by_mesh.setdefault(id(getattr(g, "device_mesh", None)), []).append(g)
        norms = []
        for group in by_mesh.values():
            n = torch.nn.utils.get_total_norm(group, norm_type=2.0, error_if_nonfinite=False)
            norms.append((n.full_tensor() if hasattr(n, "full_tensor") else n).float())
        total = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms), 2.0)
    else:
        total = torch.zeros((), dtype=torch.float32)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dev = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend(pp_group) == "nccl"
            else "cpu"
        )
        sq = (total**2).to(dev)
        dist.all_reduce(sq, group=pp_group)
        total = sq.sqrt().to(total.device)
    return total


def clip_(local_grads: Sequence[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale ``local_grads`` in place by ``max_norm / (total_norm + 1e-6)`` when that is below 1
    (``torch.nn.utils.clip_grads_with_norm_``'s rule, on the local tensors of every layout)."""
    if max_norm <= 0 or not math.isfinite(float(total_norm)):
        return
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for g in local_grads:
        g.mul_(coef.to(device=g.device, dtype=g.dtype))
