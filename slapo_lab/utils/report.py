"""Slapo's memory report at Slapo's module path (``slapo.utils.report``). Source: Slapo 0.0.3
``slapo/utils/report.py``."""

from __future__ import annotations

import logging
import resource

import torch
import torch.distributed as dist

logger = logging.getLogger("slapo_lab")


def report_memory(msg: str = "", report_gc: bool = False) -> float:
    """Log this process's peak CPU memory and the current CUDA device's peak memory; return the latter in MiB
    (0.0 without CUDA). ``report_gc`` is accepted for Slapo's signature (Slapo also counts live tensors)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 / 1024  # KiB -> GiB
    logger.info("%s CPU RAM peak: %.4f GiB", msg, rss)
    if not torch.cuda.is_available():
        return 0.0
    gpu_mem = torch.cuda.max_memory_allocated(torch.cuda.current_device()) / 1024 / 1024
    rank = dist.get_rank() if dist.is_initialized() else 0
    logger.info("%s GPU rank %d used: %.4f MiB", msg, rank, gpu_mem)
    return gpu_mem
