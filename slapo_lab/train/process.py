"""The process group of a launched run, and what one rank says: :class:`RunError`, the device and backend a
rank uses (``--device``, ``--backend``), joining the launcher's group, printing on rank 0.

A rank's device is ``cuda:<LOCAL_RANK % GPUs>`` (torchrun and the DeepSpeed launcher set ``LOCAL_RANK`` and
``LOCAL_WORLD_SIZE``), or the CPU; NCCL needs one GPU per process, gloo may share one. Without a launcher
(``python script.py``) the run is one process on a group of its own (a ``HashStore``). Source:
``torch/distributed/distributed_c10d.py`` (``init_process_group``, ``device_id``).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .config import ParallelOptions


class RunError(ValueError):
    """A problem of the launch or of the user's input; ``str(err)`` is one sentence."""


def device_type(opts: ParallelOptions) -> str:
    """``--device``, else ``"cuda"`` when CUDA is available and ``"cpu"`` otherwise."""
    return opts.device or ("cuda" if torch.cuda.is_available() else "cpu")


def device_of(opts: ParallelOptions) -> tuple[str, str | None]:
    """(device, error): cuda:<local rank % GPUs> or cpu."""
    want = device_type(opts)
    if want == "cpu":
        return "cpu", None
    gpus = torch.cuda.device_count()
    if gpus == 0:
        return "", "error: CUDA is not available here; run with --device cpu."
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if ranks > gpus and backend(opts) == "nccl":
        return "", (
            f"error: {ranks} processes on this node but {gpus} GPU(s), and NCCL needs one GPU per process; "
            "launch at most one process per GPU, or add --backend gloo to share GPUs (testing)."
        )
    return f"cuda:{local_rank % gpus}", None


def backend(opts: ParallelOptions) -> str:
    """``--backend``; ``auto``: nccl on cuda, gloo on cpu (:func:`device_type`)."""
    if opts.backend != "auto":
        return opts.backend
    return "nccl" if device_type(opts) == "cuda" else "gloo"


def init_process_group(opts: ParallelOptions, device: str) -> None:
    """Join the launcher's group (env://), or make a group of one process without a launcher."""
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        dist.init_process_group(backend(opts), store=dist.HashStore(), rank=0, world_size=1)
        return
    if backend(opts) == "nccl":
        dist.init_process_group("nccl", device_id=torch.device(device))
    else:
        dist.init_process_group("gloo")


def is_rank0() -> bool:
    """Whether this process is global rank 0 (the process group must be initialised)."""
    return dist.get_rank() == 0


def say(*lines: str) -> None:
    """Print ``lines`` on rank 0 only, flushed (the run's messages, once per run rather than once per rank)."""
    if is_rank0():
        for line in lines:
            print(line, flush=True)
