"""Simulated tensor-parallel ranks for the numeric check: one thread per rank in one process, joined by
PyTorch's threaded process group (``torch.testing._internal.distributed.multi_threaded_pg``, PyTorch 2.13:
real ``torch.distributed`` collectives between threads).

:func:`run_threaded_ranks` runs a function on every rank and returns the results in rank order; a rank that
raises tells the others to leave (:func:`check_stop`, :class:`RanksStopped`) instead of leaving them blocked
in a collective. The check itself is described in :mod:`slapo_lab.numeric` (step 2).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import attention as sdpa
from torch.testing._internal.distributed import multi_threaded_pg as mtpg

from ..errors import ScheduleError

_run_lock = threading.Lock()  # one check at a time: the threaded process group is process-wide state


# ------------------------------------------------------------------------------------------------ the run
@contextlib.contextmanager
def _threaded_world():
    """Install PyTorch's threaded process-group backend for the duration (process-wide, one at a time), with
    no collective or termination left from an earlier world.

    The scaled-dot-product-attention backend flags are process-wide too, and ``torch.nn.attention.sdpa_kernel``
    saves and restores them per call: two rank threads inside a model that selects a backend for one call
    (Granite Speech's conformer attention: ``sdpa_kernel(SDPBackend.MATH)``) can interleave so that the last
    to leave restores the other's selection, leaving the math backend alone enabled for the rest of the
    process (every later attention then saves its whole score matrix). They are put back when the world ends.
    """
    if dist.is_available() and dist.is_initialized():
        raise ScheduleError(
            "The numeric check simulates ranks in this process, which already holds a process group; "
            "run Verify instead."
        )

    with _run_lock:
        mtpg._install_threaded_pg()
        mtpg.ProcessLocalGroup.reset()
        torch._C._distributed_c10d._set_thread_isolation_mode(
            True
        )  # group names per thread, as torch's tests
        backends = sdpa._cur_sdpa_kernel_backends(with_priority=True)  # what sdpa_kernel itself saves
        try:
            yield mtpg
        finally:
            sdpa._sdpa_kernel(backends, set_priority=True)
            torch._C._distributed_c10d._set_thread_isolation_mode(False)
            mtpg._uninstall_threaded_pg()
            mtpg.ProcessLocalGroup.reset()


def _tell_ranks_to_leave(pg, err: BaseException) -> None:
    """Set the threaded backend's termination event and wake every rank waiting in a collective (each then
    raises ``SystemExit``). Setting the event alone wakes nobody: a waiting rank re-reads it only when its
    collective's condition is notified (``ProcessLocalGroup.exception_handle``)."""
    for _ in range(100):  # the ranks may add a collective while the handler walks them
        try:
            pg.exception_handle(err)
            return
        except RuntimeError:
            continue


class RanksStopped(SystemExit):
    """Raised inside a rank thread (at a module boundary or between replayed calls) once the ranks are told
    to leave: the check was cancelled, timed out, or another rank failed."""


def run_threaded_ranks(
    fn, world_size: int, timeout: float = 60.0, cancelled: threading.Event | None = None
) -> tuple[dict[int, Any], dict[int, BaseException], str | None]:
    """Call ``fn(rank)`` for every rank, each on its own thread inside its own
    ``init_process_group("threaded")`` (destroyed after), over one in-process threaded world.

    When a rank raises, the check is cancelled, or ``timeout`` seconds pass, the other ranks are told to leave
    (those in a collective raise ``SystemExit`` there; :func:`check_stop` lets ``fn`` leave between
    collectives), and this returns only after every rank thread has ended: no thread of this world ever runs
    on into the next one (a rank left waiting in a collective would hang it, or join its first collective).

    Args:
        fn: called with the rank (0 … ``world_size`` - 1) on that rank's thread.
        world_size: number of simulated ranks.
        timeout: seconds before the ranks are told to leave.
        cancelled: set it to tell the ranks to leave early.

    Returns:
        ``(results, errors, stopped)``: each rank's return value; each failing rank's exception (a
        ``SystemExit`` when it was told to leave); and ``"cancelled"``, ``"timeout"`` or None.

    Raises:
        ScheduleError: when this process already holds a (real) process group.
    """
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}
    stopped: str | None = None
    with _threaded_world() as mtpg:
        pg = mtpg.ProcessLocalGroup
        store = dist.HashStore()

        def run(rank: int) -> None:
            try:
                dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
                try:
                    results[rank] = fn(rank)
                finally:
                    dist.destroy_process_group()
            except BaseException as err:  # noqa: BLE001 - reported to the caller; the other ranks must leave
                errors[rank] = err
                _tell_ranks_to_leave(pg, err)

        threads = [
            threading.Thread(target=run, args=(r,), name=f"slapo-rank{r}", daemon=True)
            for r in range(world_size)
        ]
        for th in threads:
            th.start()
        deadline = time.monotonic() + timeout
        while any(th.is_alive() for th in threads):
            if cancelled is not None and cancelled.is_set():
                stopped = "cancelled"
            elif time.monotonic() > deadline:
                stopped = "timeout"
            if stopped:
                _tell_ranks_to_leave(pg, RanksStopped(stopped))
            next(th for th in threads if th.is_alive()).join(0.05)
    return results, errors, stopped


def check_stop() -> None:
    """Inside a rank of :func:`run_threaded_ranks`: raise :class:`RanksStopped` when the ranks were told to
    leave (a computation between collectives ends at its next call of this)."""
    if mtpg.ProcessLocalGroup._terminate.is_set():
        raise RanksStopped("the simulated ranks were told to stop")
