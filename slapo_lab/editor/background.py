"""The editor's background work after each change, without widgets: call order, activations, live check, spare copy.

:class:`BackgroundChecks` is owned by :class:`~slapo_lab.editor.state.EditorState` (``state.background``) and holds
it. After every change (:meth:`BackgroundChecks.schedule`) it cancels the work under way and, ``BACKGROUND_DEBOUNCE``
seconds after the last change, runs in one daemon thread, in order and each cancelled by the next change: in a
kernel, the forward call order the cut button's reason needs (:func:`slapo_lab.call_order.record_for_cache`) and the
activation pass the memory view needs (:func:`slapo_lab.activation_cache.profile_for_cache`); then the live numeric
check (:func:`slapo_lab.numeric.numeric_check` on a shrunk copy over simulated ranks); then, in a kernel, the spare
meta copy the next undo starts from. What it finds is drawn through the state's hooks: ``_show_numeric(phase,
report)`` (the check's line), ``_refresh_reasons``, ``_refresh_costs`` and ``_refresh_check``.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref

from .. import numeric as numeric_module
from ..activation_cache import profile_for_cache
from ..call_order import call_order, record_for_cache
from ..numeric import NumericReport

__all__ = ["BackgroundChecks"]

_log = logging.getLogger("slapo_lab.editor")

_LIVE_CHECKS: weakref.WeakSet = weakref.WeakSet()  # controllers whose background thread may be running


@atexit.register
def _stop_live_checks() -> None:
    """At interpreter exit, cancel every live numeric check and wait (briefly) for its threads: a daemon
    thread killed inside a collective aborts the process ("terminate called without an active exception")."""
    for checks in list(_LIVE_CHECKS):
        checks.cancel.set()
        timer = checks.timer
        if timer is not None:
            timer.cancel()
            timer.join(10.0)


class BackgroundChecks:
    """The debounced background thread of one editor state.

    Args:
        state: the :class:`~slapo_lab.editor.state.EditorState` (its ``schedule``, ``model``, ``example_inputs``,
            ``world_size``, ``live_check``, ``BACKGROUND_DEBOUNCE`` (seconds), the lock, its hooks, and
            ``numeric_report``, which the live check sets).
        activations: what the activation pass counts (:data:`slapo_lab.editor.state.ACTIVATIONS`).

    Attributes:
        gen: bumped by every change: a check started before it drops its result.
        cancel: the event the work under way watches (set by the next change).
        timer: the ``threading.Timer`` of the last scheduled work, or None before the first.
    """

    def __init__(self, state, activations: str) -> None:
        self.state = state
        self.activations = activations
        self.gen = 0
        self.cancel = threading.Event()
        self.timer: threading.Timer | None = None

    def schedule(self, kernel: bool) -> None:
        """After a change: cancel the work under way and start it again after the debounce (``kernel``: the
        state runs in a kernel, so the call order, activations and spare copy are worked out too). Nothing starts
        when neither the live check (``state.live_check`` with example inputs) nor ``kernel`` asks for it."""
        st = self.state
        self.gen += 1
        self.cancel.set()
        if self.timer is not None:
            self.timer.cancel()
        st.numeric_report = None
        numeric = bool(st.live_check and st.example_inputs)
        if not numeric:
            st._show_numeric("off")
        if not (numeric or kernel):
            return
        self.cancel = cancel = threading.Event()
        if numeric:
            st._show_numeric("waiting")
        self.timer = threading.Timer(
            st.BACKGROUND_DEBOUNCE,
            self.run,
            args=(self.gen, list(st.schedule.record.calls), cancel, kernel, numeric),
        )
        self.timer.daemon = True
        self.timer.start()
        _LIVE_CHECKS.add(self)

    def run(self, gen: int, calls: list, cancel: threading.Event, kernel: bool, numeric: bool) -> None:
        """The background work of change ``gen`` (its recorded ``calls``), in order, each skipped once ``cancel``
        is set; a failure is logged, never raised (the work is advice)."""
        st = self.state
        try:
            if kernel and record_for_cache(st.schedule, st._lock, cancel):
                with st._lock:
                    if st.selected in st.schedule and not st._busy:
                        st._refresh_reasons()
            if (
                kernel
                and st.example_inputs
                and not cancel.is_set()
                and profile_for_cache(st.schedule, st.example_inputs, st._lock, self.activations, cancel)
            ):
                with st._lock:
                    st._refresh_costs()
        except Exception as err:  # noqa: BLE001 - background work is advice: it must never break the editor
            _log.warning("background work failed: %s: %s", type(err).__name__, err)
        if numeric and not cancel.is_set():
            self.run_numeric(gen, calls, cancel)
        if kernel and not cancel.is_set():
            try:  # last: the next undo replays onto it instead of copying the model first
                st.history.make_spare()
            except Exception as err:  # noqa: BLE001 - the rebuild then copies the model itself
                _log.warning("no spare copy for undo: %s: %s", type(err).__name__, err)

    def run_numeric(self, gen: int, calls: list, cancel: threading.Event) -> NumericReport:
        """The numeric check of ``calls`` (:func:`slapo_lab.numeric.numeric_check`); its result becomes
        ``state.numeric_report`` and is shown unless a newer change came meanwhile. Never raises: a check that
        cannot run is a ``"skipped"`` report saying why."""
        st = self.state
        if gen == self.gen:
            st._show_numeric("running")
        try:
            report = numeric_module.numeric_check(
                st.model, calls, st.world_size, st.example_inputs, cancelled=cancel
            )
        except Exception as err:  # noqa: BLE001 - the live check is advice: it must never break the editor
            _log.warning("numeric check could not run: %s: %s", type(err).__name__, err)
            report = NumericReport("skipped", f"The numeric check could not run: {type(err).__name__}: {err}")
        if gen != self.gen or cancel.is_set():
            return report  # the schedule changed meanwhile: a newer check shows its own result
        st.numeric_report = report
        st._show_numeric("done", report)
        with st._lock:
            st._refresh_check()  # a failure is an open item; a pass clears the previous one
        return report

    def check_now(self) -> NumericReport:
        """Run the numeric check now, in this thread, on the current schedule (:meth:`run_numeric`)."""
        st = self.state
        with st._lock:
            self.gen += 1
            gen, calls = self.gen, list(st.schedule.record.calls)
        return self.run_numeric(gen, calls, threading.Event())

    def wait(self, timeout: float = 120.0) -> bool:
        """Wait until the work after the last change is done; returns whether it finished within ``timeout``
        seconds."""
        timer = self.timer
        if timer is None:
            return True
        timer.join(timeout)
        return not timer.is_alive()

    def prefetch(self) -> float:
        """Record the forward call order that the cut checks (and the cut button's reason) need, so the first
        navigation does not pay for it; a no-op when it is cached. Returns seconds spent."""
        t0 = time.perf_counter()
        try:
            call_order(self.state.schedule)
        except Exception as err:  # noqa: BLE001 - the check then runs (and explains itself) on the first cut
            _log.warning("call order not recorded ahead: %s", err)
        return time.perf_counter() - t0
