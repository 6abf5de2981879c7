"""A launched rank ends when its launcher ends: :func:`arm`.

torch's elastic agent (``torchrun``) starts every worker with ``Popen(..., start_new_session=True)`` (its own
session and process group, ``torch/distributed/elastic/multiprocessing/subprocess_handler/
subprocess_handler.py``), so ``kill -KILL`` on the launcher's process group, a closed terminal or an
out-of-memory kill of the agent leaves the ranks training on, and writing checkpoints into a directory a
relaunch may be writing too. DeepSpeed's ``launch.py`` starts its workers with a plain ``Popen``; a killed
launcher leaves them running in the same way.

:func:`arm` ties the process to its parent, the launcher that started it:

* on Linux, ``prctl(PR_SET_PDEATHSIG, SIGTERM)`` (``man 2 prctl``) through :mod:`ctypes`: the kernel sends
  SIGTERM when the parent exits; the parent's pid is read before the call and compared after it, so a parent
  that died in between is caught too (the ``prctl`` manual's own advice);
* everywhere, a daemon thread that compares ``os.getppid()`` with that pid every ``poll`` seconds (a dead
  parent's children are re-parented to init or a subreaper) -- the fallback where ``prctl`` is missing;
* SIGTERM and SIGINT get the default action back (the process ends at once, in the kernel, whatever Python is
  doing: no ``KeyboardInterrupt``, no ``finally`` block, no checkpoint write; torchrun passes a Ctrl-C on to
  its workers as SIGINT, and SIGKILLs them 30 s later), and a parent found gone by the thread ends the
  process with ``os._exit(143)`` (128 + SIGTERM) for the same reason.

Checkpoint writers call :func:`check` before they save and before they publish a save, so that even the
thread's polling window cannot let a checkpoint be written after the launcher died.

This module imports nothing heavy: ``slapo_lab/__init__.py`` arms it before it imports torch, the earliest
point at which an exported script (``import slapo_lab.train``) runs slapo-lab code.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
EXIT_STATUS = 128 + signal.SIGTERM  # the status of a process ended by SIGTERM, as a shell reports it

# Environment variables by which a launcher marks the processes it starts (and waits for): torchrun's agent
# (``TORCHELASTIC_RUN_ID``) and DeepSpeed's ``launch.py`` (``LOCAL_RANK`` with ``CROSS_RANK``).
_LAUNCHED_BY = {"torchrun": ("TORCHELASTIC_RUN_ID",), "deepspeed": ("LOCAL_RANK", "CROSS_RANK")}

_state: dict = {"parent": None, "how": None, "thread": None}


def launcher_of(environ: Mapping[str, str] | None = None) -> str | None:
    """The launcher that started this process, read from ``environ`` (default ``os.environ``):
    ``"torchrun"``, ``"deepspeed"`` or None (a plain ``python script.py``, a notebook)."""
    env = os.environ if environ is None else environ
    for name, keys in _LAUNCHED_BY.items():
        if all(k in env for k in keys):
            return name
    return None


def _set_pdeathsig(sig: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)``; False where there is no ``prctl`` (not Linux) or it fails."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _orphaned() -> None:
    """The launcher is gone: end now, without cleanup (no ``finally``, ``atexit`` or checkpoint)."""
    try:
        sys.stderr.write(
            f"rank stopped: its launcher (pid {_state['parent']}) has exited; nothing more is saved.\n"
        )
        sys.stderr.flush()
    finally:
        os._exit(EXIT_STATUS)


def _watch(parent: int, poll: float) -> None:
    stop = threading.Event()
    while not stop.wait(poll):
        if os.getppid() != parent:
            _orphaned()


def arm(poll: float = 0.5, *, force: bool = False) -> str | None:
    """Make this process end when its launcher (its parent) ends; idempotent.

    Only a process started by a launcher (see :func:`launcher_of`) is tied, unless ``force``: a notebook
    or a plain ``python script.py`` is left alone.

    Args:
        poll: seconds between the watchdog thread's looks at ``os.getppid()``.
        force: tie the process to its parent whatever started it.

    Returns:
        How it is tied: ``"pdeathsig+watchdog"`` (Linux), ``"watchdog"`` (elsewhere), or None (not launched).
        A parent already gone ends the process at once (status 143).
    """
    if _state["how"] is not None:
        return _state["how"]
    if not force and launcher_of() is None:
        return None
    parent = os.getppid()
    _state["parent"] = parent
    if threading.current_thread() is threading.main_thread():
        # SIGTERM and SIGINT end the process at once, in the kernel: a launched rank sits in a session of its own,
        # so they come from its launcher only (torchrun passes a Ctrl-C on as SIGINT), and a KeyboardInterrupt
        # would leave the other ranks to fail in a collective and print a traceback each
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
    how = "pdeathsig+watchdog" if _set_pdeathsig(signal.SIGTERM) else "watchdog"
    if os.getppid() != parent:  # the parent died before the death signal was armed
        _orphaned()
    thread = threading.Thread(target=_watch, args=(parent, poll), name="slapo-lab-lifeline", daemon=True)
    thread.start()
    _state.update(how=how, thread=thread)
    return how


def finish(code: int) -> int:
    """End a launched rank that has finished its run (process group destroyed, writers closed) with ``code``.

    A process that a launcher started (:func:`launcher_of`) leaves through ``os._exit`` after flushing
    ``sys.stdout``, ``sys.stderr`` and :mod:`logging`: the interpreter's teardown would free, in no set order,
    the gloo process groups and the DeepSpeed engine that module-level state still references, and a gloo
    worker thread destroyed while joinable aborts the process (``terminate called without an active
    exception``, SIGABRT) after a run that succeeded -- torchrun then reports the job failed and SIGTERMs the
    other ranks. Anything else (a notebook, a test, a plain ``python script.py``) gets ``code`` back.

    Raises:
        Nothing; a launched rank does not return.
    """
    if launcher_of() is None:
        return code
    try:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    finally:
        os._exit(code)


def check() -> None:
    """End the process now if it was armed and its launcher is gone (call before writing anything that a
    relaunch could also write: a checkpoint)."""
    if _state["how"] is not None and os.getppid() != _state["parent"]:
        _orphaned()
