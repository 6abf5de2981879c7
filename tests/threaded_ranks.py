"""Simulated ranks for tests: one thread per rank in PyTorch's threaded process group, as the numeric check
runs them (:func:`slapo_lab.numeric.run_threaded_ranks`: real ``torch.distributed`` collectives between threads
of this process)."""

from __future__ import annotations

from collections.abc import Callable


def run_threaded_ranks(fn: Callable[[int], object], world_size: int = 2, timeout: float = 60.0) -> None:
    """Call ``fn(rank)`` for every rank, each on its own thread inside its own ``init_process_group("threaded")``.

    Raises:
        BaseException: the first failing rank's exception (the other ranks are told to leave their collectives),
            or a TimeoutError when the ranks were still running after ``timeout`` seconds.
    """
    from slapo_lab.numeric import run_threaded_ranks as run

    _results, errors, stopped = run(fn, world_size, timeout)
    real = [r for r in sorted(errors) if not isinstance(errors[r], SystemExit)]  # SystemExit: told to leave
    if errors:
        raise errors[(real or sorted(errors))[0]]
    if stopped:
        raise TimeoutError(f"simulated ranks of {world_size} still running after {timeout:.0f} s")
