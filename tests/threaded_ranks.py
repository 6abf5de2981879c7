"""Simulated ranks for tests: one thread per rank in PyTorch's threaded process group, as the numeric check
runs them (``slapo_lab.numeric._threaded_world`` installs the backend; real ``torch.distributed`` collectives
between threads of this process)."""

from __future__ import annotations

import threading
from collections.abc import Callable


def run_threaded_ranks(fn: Callable[[int], object], world_size: int = 2, timeout: float = 60.0) -> None:
    """Call ``fn(rank)`` for every rank, each on its own thread inside its own ``init_process_group("threaded")``
    (destroyed after), and join each thread for up to ``timeout`` seconds.

    Raises:
        BaseException: the first failing rank's exception (the other ranks are told to leave their collectives),
            or a TimeoutError naming the ranks still running after the timeout.
    """
    import torch.distributed as dist

    from slapo_lab.numeric import _threaded_world

    errors: dict[int, BaseException] = {}
    with _threaded_world() as mtpg:
        store = dist.HashStore()

        def run(rank: int) -> None:
            try:
                dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
                try:
                    fn(rank)
                finally:
                    dist.destroy_process_group()
            except BaseException as err:  # noqa: BLE001 - raised in the caller's thread below
                errors[rank] = err
                mtpg.ProcessLocalGroup.exception_handle(err)  # the other ranks leave their collectives

        threads = [threading.Thread(target=run, args=(r,)) for r in range(world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        if errors:
            mtpg.ProcessLocalGroup.reset()  # forget the collective the ranks left, or the next world joins it
    real = [r for r in sorted(errors) if not isinstance(errors[r], SystemExit)]  # SystemExit: told to leave
    if errors:
        raise errors[(real or sorted(errors))[0]]
    alive = [r for r, t in enumerate(threads) if t.is_alive()]
    if alive:
        raise TimeoutError(f"simulated ranks {alive} of {world_size} still running after {timeout:.0f} s")
