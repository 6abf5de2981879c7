"""The editor's schedule file: save, load, autosave, and an outside change met without losing anyone's work.

A mixin of :class:`slapo_lab.editor.state.EditorState` (its state: ``schedule_file``, the file's last known
stamp, the problem shown with every message), kept apart from the widgets: every method here is driven by calls,
and the editor's tests drive them without a browser. :func:`serialized` is the editor's lock for its methods.
"""

from __future__ import annotations

import functools
import hashlib
import os
import time
from pathlib import Path

from ..errors import ScheduleError
from ..export import load_schedule, save_schedule
from ..record import Action

__all__ = ["SchedulePersistence", "serialized"]


def serialized(method):
    """Run an editor method under the editor's lock.

    JupyterLab 4.4+ with ipykernel 7 runs widget messages (button clicks, graph clicks) in a comm
    subshell, a thread of its own, while typed cells and the redraw scheduled after them run in the
    main thread: without the lock a click could apply its calls in the middle of that redraw, which
    then reported the click's last call over the click's own message. The lock is re-entrant (an
    action redraws through :meth:`ScheduleEditor._flush`)."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


def _file_actions(sf, path) -> list:
    """The calls of a loaded schedule file grouped into the editor's actions (``meta.editor_actions``,
    ``[[label, number of calls], ...]``); one action for the whole file when that entry is missing or
    does not add up."""
    calls = list(sf.calls)
    spec = (sf.meta or {}).get("editor_actions")
    ok = (
        isinstance(spec, list)
        and all(
            isinstance(x, list)
            and len(x) == 2
            and isinstance(x[0], str)
            and isinstance(x[1], int)
            and not isinstance(x[1], bool)
            and x[1] > 0
            for x in spec
        )
        and sum(x[1] for x in spec) == len(calls)
    )
    if not ok:
        return [Action(f"load {path}", tuple(calls))] if calls else []
    out, i = [], 0
    for label, n in spec:
        out.append(Action(label, tuple(calls[i : i + n])))
        i += n
    return out


def _file_stamp(path) -> tuple | None:
    """What identifies the content of the file at ``path``: ``(mtime_ns, size, sha256 hex)``, or None
    when there is no file. Raises OSError for a file that exists but cannot be read."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    with open(path, "rb") as f:  # schedule files are bounded (export.io), so one read is fine
        digest = hashlib.sha256(f.read()).hexdigest()
    return (st.st_mtime_ns, st.st_size, digest)


def _same_file(a: tuple | None, b: tuple | None) -> bool:
    """Two stamps of :func:`_file_stamp` name the same content: both absent, or same size and hash (an
    equal mtime alone is not trusted: a rewrite within the clock's resolution keeps it)."""
    if a is None or b is None:
        return a is b
    return a[1:] == b[1:]


def _mine_name(path) -> str:
    """``bert.schedule.json`` → ``bert.schedule.mine-20261124-093015.json`` (next to it, a name not yet taken)."""
    src = Path(path)
    stem = src.name.removesuffix(".json")
    base = f"{stem}.mine-{time.strftime('%Y%m%d-%H%M%S')}"
    out, n = src.with_name(base + ".json"), 1
    while out.exists():
        out, n = src.with_name(f"{base}-{n}.json"), n + 1
    return str(out)


class SchedulePersistence:
    """Save / load / autosave of the editor's schedule file (see the module docstring)."""

    @serialized
    def save(self, path: str) -> str:
        """Write the recorded schedule as versioned JSON (``sl.load_schedule`` reads it back); the meta keeps
        the editor's actions (``editor_actions``) and the last export's options (``export_options``), which
        :meth:`load` restores.

        Raises:
            ExportError: (a ValueError) with one sentence if the file cannot be written.
        """
        rec = self.schedule.record
        actions = [[a.label, len(a.calls)] for a in rec.actions()]  # undo per action after a restore
        save_schedule(
            path,
            rec.calls,
            model=self.model,
            example_inputs=self.example_inputs,
            world_size=self.world_size,
            factory=self.factory,
            meta={
                "editor_actions": actions,
                **({"export_options": self.export_options} if self.export_options else {}),
            },
        )
        if self._is_schedule_file(path):  # an explicit save to the file: this content is now ours
            self._in_sync(_file_stamp(path))
        return str(path)

    def _in_sync(self, stamp: tuple | None) -> None:
        """``schedule_file`` now holds this editor's schedule (its :func:`_file_stamp` is ``stamp``): autosave
        is on again and no file problem is said any more."""
        self._disk, self._conflict, self._file_problem = stamp, False, None
        self._show_file_bar(False)

    def _is_schedule_file(self, path) -> bool:
        return self.schedule_file is not None and os.path.abspath(os.path.expanduser(str(path))) == (
            os.path.abspath(os.path.expanduser(self.schedule_file))
        )

    def _keep_unrestorable(self, path: str, reason: str) -> None:
        """Leave a schedule file that could not be restored exactly as it is, and autosave elsewhere.

        The editor starts empty and autosaves to ``<name>.mine-<time>.json`` next to it (see
        :func:`_mine_name`), so the file the user looks for keeps its content; the message names both.
        """
        mine = _mine_name(path)
        self.schedule_file, self._disk = mine, None
        self._error(
            f"{reason.rstrip('.')}. {path} is left as it is; this editor starts empty and autosaves to {mine}."
        )

    @serialized
    def load(self, path: str) -> str | None:
        """Replace the schedule by the one in JSON file ``path``, all or nothing.

        Returns None on success, else the one-sentence reason (the current schedule is kept).
        """
        own = self._is_schedule_file(path)
        try:
            stamp = _file_stamp(path) if own else None
            sf = load_schedule(path)
            ws = (sf.meta or {}).get("world_size")
            if ws is not None and ws != self.world_size:
                return self._error(
                    f"{path} was planned for world size {ws}, but this editor plans for "
                    f"{self.world_size}; create the editor with world_size={ws}."
                )
            with self._working(f"loading {path}"):
                self._rebuild(_file_actions(sf, path), autosave=not own)  # the file already holds it
            if own:
                self._in_sync(stamp)
            self.history.redo_stack.clear()
            self._refresh_history()
            remembered = (sf.meta or {}).get("export_options")
            if isinstance(remembered, dict) and isinstance(remembered.get("options", {}), dict):
                self.export_options = remembered  # the form skips entries of the wrong type
                self._set_form(remembered)
        except ScheduleError as err:
            return self._error(f"{path} could not be applied, so the schedule is unchanged: {err}")
        except KeyboardInterrupt:  # Kernel > Interrupt: nothing of the file was applied
            self._error(f"Loading {path} was interrupted, so the schedule is unchanged.")
            raise
        except Exception as err:  # noqa: BLE001 - reported, never raised past this point
            return self._error(str(err) if str(err).endswith(".") else f"{path} could not be loaded: {err}")
        self._info(f"Loaded {len(self.schedule.record.calls)} recorded calls from {path}.")
        return None

    def _autosave(self) -> None:
        """Write the schedule to ``schedule_file`` (atomically: a temporary file and a rename), but only
        while the file on disk is the one this editor last read or wrote (same size and SHA-256): a file
        changed by another editor, a text editor or git is never overwritten without the user's choice
        (:meth:`reload_file`, :meth:`keep_mine`, :meth:`overwrite_file`). A failed write leaves the old
        file intact and is said with every message until a write succeeds."""
        path = self.schedule_file
        if path is None or self._conflict:
            return
        try:
            now = _file_stamp(path)
        except OSError as err:
            now = ("unreadable", err.strerror)
        if not _same_file(now, self._disk):
            self._conflict = True
            self._file_problem = (
                f"{path} was changed outside this editor since it last read or wrote it (another editor, "
                "a text editor or git), so autosave is off: reload the file, keep this schedule as a new "
                "file, or overwrite the file (editor.reload_file(), editor.keep_mine(), editor.overwrite_file())."
            )
            self._show_file_bar(True)
            self._error(self._file_problem)
            return
        try:
            self.save(path)
        except Exception as err:  # noqa: BLE001 - reported with every message until a write succeeds
            reason = str(err).rstrip(".")
            self._file_problem = (
                f"The schedule was not kept in {path} ({reason}); the file still holds the schedule as last "
                "saved, and the next change tries again."
            )
            self._error(self._file_problem)

    @serialized
    def reload_file(self) -> str | None:
        """Take the schedule in ``schedule_file`` as it is on disk now (after an outside change), dropping
        this editor's unsaved calls; returns None or the one-sentence reason nothing changed."""
        if self.schedule_file is None:
            return self._error("This editor has no schedule file to reload; create it with schedule_file=.")
        return self.load(self.schedule_file)

    @serialized
    def keep_mine(self) -> str | None:
        """Save this editor's schedule as ``<name>.mine-<time>.json`` next to ``schedule_file`` and
        autosave there from now on; the changed file is left as it is. Returns None or one sentence."""
        if self.schedule_file is None:
            return self._error("This editor has no schedule file; save with editor.save(path).")
        old, mine = self.schedule_file, _mine_name(self.schedule_file)
        try:
            self.save(mine)
        except Exception as err:  # noqa: BLE001 - one sentence, nothing changed
            return self._error(f"Could not save this schedule as {mine}: {str(err).rstrip('.')}.")
        self.schedule_file = mine
        self._in_sync(_file_stamp(mine))
        self._info(f"Saved this schedule as {mine} and autosave goes there now; {old} is left as it is.")
        return None

    @serialized
    def overwrite_file(self) -> str | None:
        """Replace ``schedule_file`` by this editor's schedule (after an outside change) and autosave
        again; returns None or one sentence."""
        if self.schedule_file is None:
            return self._error("This editor has no schedule file; save with editor.save(path).")
        try:
            self.save(self.schedule_file)
        except Exception as err:  # noqa: BLE001 - one sentence; the file is intact
            return self._error(f"Could not overwrite {self.schedule_file}: {str(err).rstrip('.')}.")
        self._info(f"Overwrote {self.schedule_file} with this schedule; autosave is on again.")
        return None
