"""Holds on Python's cyclic garbage collector: :func:`gc_paused` for a block, :func:`gc_deferred` for a block whose
collection should run after a Jupyter cell, and :func:`running_loop`. Every part of the package that pauses the
collector takes a counted hold here (never ``gc.disable()`` itself), so that blocks in several threads, and a
deferred resume's timer thread, nest: the last hold to go turns the collector back on."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import asyncio


# The collector is held off while any of our blocks (or a deferred resume) holds it: the last one to let go turns
# it back on. Guarded by a lock, as gc_deferred's timer thread lets go too.
_GC_LOCK = threading.Lock()
_gc_holds = 0  # active gc_paused blocks + gc_deferred resumes still pending
_gc_young0 = 0  # the youngest generation's count when the first hold began
_gc_collect_owed = False  # a pending resume promised one full collection
_gc_oldest = 0  # the oldest generation's size when last counted (a lower bound that spares most counts)
_gc_pending = 0  # net new objects our holds left since the last full collection (see _on_full_collection)


def _on_full_collection(phase: str, info: dict) -> None:
    """A ``gc.callbacks`` hook: any full collection, ours or CPython's own, clears what our holds left."""
    global _gc_pending
    if phase == "stop" and info.get("generation") == 2:
        _gc_pending = 0


gc.callbacks.append(_on_full_collection)


def _hold_gc() -> bool:
    """Take one hold on the collector; False (nothing taken) if something else turned it off."""
    global _gc_holds, _gc_young0
    with _GC_LOCK:
        if not gc.isenabled() and not _gc_holds:
            return False
        if not _gc_holds:
            gc.disable()
            _gc_young0 = gc.get_count()[0]
        _gc_holds += 1
        return True


def _release_gc(collect: bool = False, settle: bool = False) -> None:
    """Let go of one hold. The last one turns the collector back on and runs a full collection if one was
    promised (``collect``, now or by an earlier hold) or, with ``settle``, if the holds made one due."""
    global _gc_holds, _gc_collect_owed, _gc_oldest, _gc_pending
    with _GC_LOCK:
        _gc_holds -= 1
        _gc_collect_owed = _gc_collect_owed or collect
        if _gc_holds:
            return
        gc.enable()
        run, _gc_collect_owed = _gc_collect_owed, False
        # net new tracked objects since the first hold, added to what earlier holds left uncollected
        _gc_pending += max(gc.get_count()[0] - _gc_young0, 0)
    if not run and settle and _gc_pending > max(gc.get_threshold()[0], _gc_oldest / 8):
        # counting the oldest generation takes 10-40 ms at 10^5-10^6 objects: only past both bounds
        _gc_oldest = len(gc.get_objects(generation=2))
        run = _gc_pending > _gc_oldest / 8
    if run:
        gc.collect()
        _gc_oldest = len(gc.get_objects(generation=2))


@contextlib.contextmanager
def gc_paused(settle: bool = False) -> Iterator[None]:
    """Pause Python's cyclic garbage collector for a ``with`` block or, as ``@gc_paused()``, a function.

    Loading a schedule allocates a few containers per call (parsed JSON, :class:`Call` objects, bound
    arguments) that hold no cycles; every collection on the way only re-scans them and the rest of
    the heap (torch, the model, its schedule tree: hundreds of thousands of objects). Pausing it makes
    ``load_schedule`` of 50,000 calls in an editor's process 2.5 times as fast (1.5 s -> 0.6 s). Garbage
    cycles made inside the block are collected after it, as usual. Blocks nest (the outermost turns the
    collector back on), and a :func:`gc_deferred` resume that falls inside a block waits for its end. A
    no-op when something else turned the collector off.

    ``settle=True`` (an editor action: a preset, an undo's replay, the editor's constructor) also runs, at
    the end of the block, the full collection the block brings on, so a click soon after it does not pay for
    it. CPython's rule (``Modules/gcmodule.c``, ``gc_collect_generations``) runs a full collection once the
    objects that survived into the oldest generation since the last one exceed a quarter of that generation.
    The blocks' net new tracked objects (the youngest generation's count since the collector was paused,
    which nothing reset meanwhile), summed over every block since the last full collection (ours or CPython's,
    seen through ``gc.callbacks``), stand for those survivors; once they reach half of that quarter (an eighth
    of the oldest generation), the collection is due, or so near that the next few clicks would bring it on,
    and the block that got there pays it now. At Llama-405B dimensions the Megatron preset leaves ~10^5 new
    objects on a heap of ~5 * 10^5, and the collection (0.2-0.5 s here) otherwise lands in the first clicks
    after it; a script's editor constructor and preset leave 7 * 10^4 and 8 * 10^4, each under the bound
    alone, and the preset's end collects for both. A BERT preset leaves ~10^4 on ~4 * 10^5 and collects
    nothing. Counting the oldest generation takes 10-40 ms, so it is counted only past one young collection's
    threshold (a click is not) and past an eighth of its size when last counted.
    """
    if not _hold_gc():
        yield
        return
    ok = False
    try:
        yield
        ok = True
    finally:
        _release_gc(settle=settle and ok)


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The asyncio loop running this thread (a Jupyter kernel's, while a cell runs), or None (a script, a test)."""
    import asyncio  # noqa: PLC0415 - the module imports it only for type checking

    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


@contextlib.contextmanager
def gc_deferred(loop: asyncio.AbstractEventLoop | None, delay: float = 1.0) -> Iterator[None]:
    """As :func:`gc_paused`, but inside a running asyncio ``loop`` (a Jupyter kernel's) the collector stays off
    after the block and is turned back on, with one full collection, ``delay`` seconds later (by a timer thread).

    A block that makes ~10^5 long-lived objects (a 70B model's meta copy, its dataflow) makes the collector's
    next full collection re-scan the whole heap (0.2-0.4 s here) right after the block, when it turns back on:
    inside the cell that built the editor, before its view is shown. Deferred, the collection runs while the
    user looks at the view; if an editor action (a :func:`gc_paused` block) is running then, it runs at that
    action's end instead. Without a loop (a script, a test), or when the block raises, the collector is
    turned back on at once, as :func:`gc_paused` does. A no-op when something else turned the collector off.
    """
    if not _hold_gc():
        yield
        return
    handed_over = False
    try:
        yield
        if loop is not None:  # a timer thread, not the loop: it runs even if the loop stops or closes first
            timer = threading.Timer(delay, _release_gc, kwargs={"collect": True})
            timer.daemon = True
            timer.start()
            handed_over = True
    finally:
        if not handed_over:
            _release_gc()
