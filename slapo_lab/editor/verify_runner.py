"""Run an exported script's ``--verify`` under torchrun in a subprocess, streaming its output.

The subprocess runs without a shell, in its own process session, with a wall-clock timeout. A
timeout or a Cancel ends the whole process *tree*: torchrun starts each worker in a session of its
own, so signalling torchrun's process group would miss them. The runner remembers every descendant
it has seen (``psutil``, polled while the run lasts, so a worker orphaned by a dead torchrun is still
known), sends SIGTERM to all of them, and SIGKILL to what is left after a grace period; when the run
ends by itself, leftover descendants are ended the same way. Output is read in chunks: each line is
cut at :data:`MAX_LINE_CHARS` and the kept log at :data:`MAX_LOG_CHARS`, so a rank printing a
300 MB line costs the kernel a few kilobytes. Used by the editor's "Verify on GPU" button; usable on
its own.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import psutil
import torch

from ..train.phases import parse_phase

MAX_LINE_CHARS = 10_000  # longer output lines are cut (with a note saying how much)
MAX_LOG_CHARS = 2_000_000  # the kept log (VerifyResult.lines) drops its oldest lines beyond this
GRACE_S = 5.0  # seconds between SIGTERM and SIGKILL
_TOKEN_VAR = "SLAPO_LAB_VERIFY_RUN"

# A Python warning as ``warnings`` prints it ("path.py:12: FutureWarning: message"), torchrun's rank prefix allowed;
# the source line printed after it is indented.
_WARNING = re.compile(r"^(\[[a-z]*\d+\]:\s*)?\S.*:\d+: \w*Warning: ")
_DIFF = re.compile(r"max abs diff ([0-9.eE+-]+|inf|nan)")
_EXC = re.compile(r"^\s*(\[rank\d+\]:\s*)?[\w.]*(Error|Exception|Interrupt)\b[^:]*:")


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plan_device(nproc: int, want: str = "cuda") -> tuple[str, str]:
    """Choose where Verify runs: ``("cuda", "")`` or ``("cpu", the one-sentence reason)``."""
    if want == "cpu":
        return "cpu", "Verify runs on the CPU with gloo, as asked."
    if not torch.cuda.is_available():
        return "cpu", "CUDA is not available on this machine, so Verify runs on the CPU with gloo."
    n = torch.cuda.device_count()
    if n < nproc:
        return "cpu", (
            f"The schedule needs {nproc} ranks but this machine has {n} GPU(s), "
            "so Verify runs on the CPU with gloo."
        )
    return "cuda", ""


#: bytes per parameter a CPU Verify run holds over all its ranks: fp32 weights, gradients and two AdamW
#: states of the scheduled model, plus the unsharded reference's weights and gradients (FSDP-sharded)
VERIFY_BYTES_PER_PARAM = 4 * 6


def cpu_verify_too_big(n_params: int, nproc: int, available: int | None = None) -> str | None:
    """One sentence when a CPU Verify of an ``n_params`` model on ``nproc`` ranks would not fit in this
    machine's free memory (``available`` bytes; default: psutil's available memory), else None.

    The estimate is :data:`VERIFY_BYTES_PER_PARAM` per parameter over all ranks together.
    """
    if available is None:
        available = psutil.virtual_memory().available
    need = n_params * VERIFY_BYTES_PER_PARAM
    if need <= available:
        return None
    return (
        f"Verify on the CPU would start {nproc} rank(s) holding about {need / 2**30:,.0f} GiB for this "
        f"{n_params / 1e9:.1f} B-parameter model, more than the {available / 2**30:,.0f} GiB free here; "
        "run it on GPUs, or verify the schedule on a smaller config of the same model."
    )


@dataclass
class VerifyResult:
    """Outcome of one run: ``status`` in passed / failed / crashed / timeout / cancelled."""

    status: str
    returncode: int | None
    seconds: float
    max_abs_diffs: list[float] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    device: str = "cpu"
    note: str = ""

    @property
    def summary(self) -> str:
        """One sentence for the editor's message line."""
        worst = max(self.max_abs_diffs, default=None)
        diff = f"; largest difference {worst:.2e}" if worst is not None else ""
        where = f" on {self.device.upper()}" if self.device else ""
        if self.status == "passed":
            return f"Verify passed{where} in {self.seconds:.0f} s{diff}."
        if self.status == "failed":
            return f"Verify failed{where}: the scheduled model differs from the original{diff}."
        if self.status == "timeout":
            return (
                f"Verify was stopped after {self.seconds:.0f} s (its time limit); the schedule is unchanged."
            )
        if self.status == "cancelled":
            return "Verify was cancelled; the schedule is unchanged."
        tail = next(
            (ln for ln in reversed(self.lines) if _EXC.match(ln) and "ChildFailedError" not in ln), ""
        )
        return (
            f"Verify crashed (exit code {self.returncode})"
            + (f": {tail.strip()[:200]}" if tail else "")
            + "; the schedule is unchanged."
        )


class LogFilter:
    """Which output lines of a run the editor shows: Python warnings (the ``file:line: XWarning: message``
    line and the indented source lines after it) and phase markers (:mod:`slapo_lab.train.phases`) are kept
    out of the visible log; the full log (:attr:`VerifyResult.lines`) keeps every line.

    Attributes:
        hidden: how many warning lines were kept out so far.
    """

    def __init__(self) -> None:
        self.hidden = 0
        self._in_warning = False

    def visible(self, line: str) -> bool:
        """Whether ``line`` belongs in the visible log (call once per line, in order)."""
        if parse_phase(line) is not None:
            return False
        if _WARNING.match(line):
            self.hidden += 1
            self._in_warning = True
            return False
        body = re.sub(r"^\[[a-z]*\d+\]:", "", line)
        if self._in_warning and body.startswith((" ", "\t")):
            self.hidden += 1
            return False
        self._in_warning = False
        return True


def _reap_group(proc: subprocess.Popen) -> None:
    """SIGKILL anything left in torchrun's own process group, then reap torchrun (5 s at most)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


def _stop_reader(reader: threading.Thread, give_up: threading.Event, proc: subprocess.Popen) -> None:
    """Let the reader drain the pipe (5 s), then tell it to give up; close the pipe once the reader is gone
    (never an fd a reader could still select on)."""
    reader.join(5)
    give_up.set()
    reader.join(2)
    if not reader.is_alive():
        with contextlib.suppress(OSError):
            proc.stdout.close()


def _chunks(fd: int, give_up: threading.Event) -> Iterator[bytes]:
    """The chunks read from pipe ``fd`` (64 KiB at most each) until its end, a read error, or ``give_up`` set
    while nothing is ready."""
    while True:
        try:
            ready, _, _ = select.select([fd], [], [], 0.2)
        except (OSError, ValueError):
            return
        if not ready:
            if give_up.is_set():
                return
            continue
        try:
            chunk = os.read(fd, 1 << 16)
        except OSError:
            return
        if not chunk:
            return
        yield chunk


class _LineCutter:
    """Bytes in, lines out: each line handed to ``emit`` cut at :data:`MAX_LINE_CHARS`, with a note of how
    many bytes of it were not kept."""

    def __init__(self, emit: Callable[[str], None]) -> None:
        self.emit = emit
        self.buf = bytearray()
        self.cut = 0

    def feed(self, chunk: bytes) -> None:
        """Add ``chunk``: emit each line it completes."""
        start = 0
        while start < len(chunk):
            nl = chunk.find(b"\n", start)
            piece = chunk[start:] if nl < 0 else chunk[start:nl]
            room = MAX_LINE_CHARS - len(self.buf)
            if room > 0:
                self.buf += piece[:room]
            self.cut += max(0, len(piece) - max(room, 0))
            if nl < 0:
                break
            self.flush()
            start = nl + 1

    def flush(self) -> None:
        """Emit the line gathered so far (with the count of its bytes cut) and start the next."""
        text = bytes(self.buf).decode("utf-8", errors="replace").rstrip("\r")
        if self.cut:
            text += f" … [{self.cut:,} more bytes of this line not shown]"
        self.buf, self.cut = bytearray(), 0
        self.emit(text)

    def close(self) -> None:
        """Emit the last line when the output did not end with a newline."""
        if self.buf or self.cut:
            self.flush()


class _RunLog:
    """The kept log of one run (its last :data:`MAX_LOG_CHARS` characters), the max abs diffs its ``Verify:``
    lines report, and whether one said PASSED or FAILED."""

    def __init__(self) -> None:
        self.kept: collections.deque[str] = collections.deque()
        self.size = self.dropped = 0
        self.diffs: list[float] = []
        self.passed = self.failed = False

    def add(self, line: str) -> None:
        """Keep ``line`` (dropping the oldest beyond the bound); read a ``Verify:`` line's verdict and diffs."""
        if line.startswith("Verify:"):
            if len(self.diffs) < 100_000:
                self.diffs.extend(float(x) for x in _DIFF.findall(line))
            self.passed = self.passed or "Verify: PASSED" in line
            self.failed = self.failed or "Verify: FAILED" in line
        self.kept.append(line)
        self.size += len(line)
        while self.size > MAX_LOG_CHARS and len(self.kept) > 1:
            self.size -= len(self.kept.popleft())
            self.dropped += 1

    def lines(self) -> list[str]:
        """The kept lines, after a note of how many earlier ones were dropped."""
        lines = list(self.kept)
        if self.dropped:
            lines.insert(0, f"[{self.dropped:,} earlier lines not kept]")
        return lines

    def status(self, returncode: int | None, timed_out: bool) -> str:
        """``"timeout"``, ``"passed"`` (exit 0, PASSED said), ``"failed"`` (FAILED said) or ``"crashed"``."""
        if timed_out:
            return "timeout"
        if returncode == 0 and self.passed:
            return "passed"
        return "failed" if self.failed else "crashed"


class VerifyRunner:
    """Runs ``torchrun --nproc_per_node=N script --verify --steps 1 --device D`` in the background.

    Args:
        on_line: called with each output line (from a reader thread), phase markers included.
        on_done: called with the :class:`VerifyResult` when the run ends, however it ends.
        on_phase: called with the name of each phase (:data:`slapo_lab.train.phases.PHASES`) as it begins:
            ``"launch"`` when the process starts, the script's own markers, ``"done"`` when it ends.
    """

    def __init__(
        self,
        on_line: Callable[[str], None] | None = None,
        on_done: Callable[[VerifyResult], None] | None = None,
        grace: float = GRACE_S,
        on_phase: Callable[[str], None] | None = None,
    ) -> None:
        self.on_line = on_line or (lambda line: None)
        self.on_done = on_done or (lambda result: None)
        self.on_phase = on_phase or (lambda name: None)
        self.grace = grace
        self._proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None
        self._cancelled = False
        self._stop = threading.Event()
        self._seen: dict[int, psutil.Process] = {}
        self._token = ""
        self.result: VerifyResult | None = None

    def _phase(self, name: str) -> None:
        try:
            self.on_phase(name)
        except Exception:  # noqa: BLE001, S110 - a view must never stop the run's bookkeeping
            pass

    @property
    def running(self) -> bool:
        """Whether a run is in progress."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def pids(self) -> list[int]:
        """Process ids of the run's tree seen so far (torchrun, its workers and their children)."""
        return sorted(self._seen)

    def command(self, script: str, nproc: int, device: str, extra: list[str] | None = None) -> list[str]:
        """The argv (no shell) of the run."""
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
            str(script),
            "--device",
            device,
            "--verify",
            "--steps",
            "1",
            *(extra or []),
        ]

    def start(
        self,
        script: str,
        nproc: int,
        device: str = "cpu",
        timeout: float = 600.0,
        extra: list[str] | None = None,
        note: str = "",
    ) -> None:
        """Start the run; returns at once.

        Raises:
            RuntimeError: if a run is already in progress.
            OSError: if the subprocess cannot be started.
        """
        if self.running:
            raise RuntimeError("A Verify run is already in progress; cancel it first.")
        self._cancelled = False
        self._stop = threading.Event()
        self._seen = {}
        self.result = None
        cmd = self.command(script, nproc, device, extra)
        self._token = uuid.uuid4().hex  # inherited by every descendant: found even once orphaned
        env = dict(
            os.environ,
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
            **{_TOKEN_VAR: self._token},
        )
        # an argv list, no shell: torchrun on the script this editor just exported (docs/SECURITY.md)
        self._proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            cwd=os.path.dirname(os.path.abspath(script)),
        )
        self._remember(self._proc.pid)
        self._thread = threading.Thread(
            target=self._watch, args=(self._proc, timeout, device, note), daemon=True
        )
        self._thread.start()

    def cancel(self) -> bool:
        """Stop the run (the whole process tree, see the module docstring); returns whether one was running.

        Returns at once; :meth:`wait` returns when every process of the tree has ended (at most the
        grace period plus a few seconds later).
        """
        if not self.running or self._proc is None:
            return False
        self._cancelled = True
        self._stop.set()
        return True

    def wait(self, timeout: float | None = None) -> VerifyResult | None:
        """Block until the run ends (or ``timeout`` seconds); returns the result if it ended."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.result

    # ------------------------------------------------------------------ the process tree
    def _remember(self, pid: int) -> None:
        """Add ``pid`` and its live descendants to the processes seen (psutil keeps their start time,
        so a reused pid is never mistaken for one of ours)."""
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            procs = []
        for p in procs:
            self._seen.setdefault(p.pid, p)

    def _remember_marked(self) -> None:
        """Add every process of this user whose environment carries this run's token (descendants
        that were orphaned between two polls, e.g. a worker's child in its own session)."""
        if not self._token:
            return
        me = os.getuid()
        for p in psutil.process_iter(["uids"]):
            try:
                if p.info["uids"] is None or p.info["uids"].real != me or p.pid in self._seen:
                    continue
                if p.environ().get(_TOKEN_VAR) == self._token:
                    self._seen.setdefault(p.pid, p)
            except psutil.Error:
                pass

    def _alive(self) -> list[psutil.Process]:
        out = []
        for p in self._seen.values():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except psutil.Error:
                pass
        return out

    def _kill_tree(self, proc: subprocess.Popen) -> None:
        """SIGTERM every live process of the tree, SIGKILL what is left after ``grace`` seconds."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not self._signal_alive(proc, sig):
                break
            self._wait_gone(proc, self.grace if sig == signal.SIGTERM else 5.0)
        _reap_group(proc)

    def _signal_alive(self, proc: subprocess.Popen, sig: int) -> bool:
        """Send ``sig`` to every live process of the tree (its descendants found again first); False when none
        is alive."""
        self._remember(proc.pid)
        self._remember_marked()
        alive = self._alive()
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)
        return bool(alive)

    def _wait_gone(self, proc: subprocess.Popen, seconds: float) -> None:
        """Wait up to ``seconds`` for every process of the tree to end, reaping torchrun meanwhile."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if proc.poll() is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(0.1)
            else:
                time.sleep(0.1)
            self._remember(proc.pid)
            if not self._alive():
                break

    # ------------------------------------------------------------------ output
    def _read(self, fd: int, emit: Callable[[str], None], give_up: threading.Event) -> None:
        """Read the pipe in chunks; emit each line cut at MAX_LINE_CHARS (the rest is counted, not kept)."""
        lines = _LineCutter(emit)
        for chunk in _chunks(fd, give_up):
            lines.feed(chunk)
        lines.close()

    def _watch(self, proc: subprocess.Popen, timeout: float, device: str, note: str) -> None:
        """Stream ``proc``'s output until it ends, ``timeout`` seconds pass or Cancel; then end its tree and
        keep the :class:`VerifyResult` (``self.result``, handed to ``on_done``)."""
        t0 = time.monotonic()
        log = _RunLog()

        def emit(line: str) -> None:
            phase = parse_phase(line)
            if phase is not None:
                self._phase(phase)
            log.add(line)
            with contextlib.suppress(Exception):  # a view must never stop the run's bookkeeping
                self.on_line(line)

        self._phase("launch")
        give_up = threading.Event()
        reader = threading.Thread(target=self._read, args=(proc.stdout.fileno(), emit, give_up), daemon=True)
        reader.start()
        timed_out = False
        try:
            timed_out = self._wait_run(proc, t0, timeout)
        finally:
            try:
                self._kill_tree(proc)  # also ends workers left behind by a torchrun that exited
            finally:
                _stop_reader(reader, give_up, proc)
                status = "cancelled" if self._cancelled else log.status(proc.returncode, timed_out)
                self.result = VerifyResult(
                    status, proc.returncode, time.monotonic() - t0, log.diffs, log.lines(), device, note
                )
                with contextlib.suppress(Exception):  # the result is kept on self.result either way
                    self.on_done(self.result)

    def _wait_run(self, proc: subprocess.Popen, t0: float, timeout: float) -> bool:
        """Wait while ``proc`` runs, remembering its descendants; True when ``timeout`` seconds since ``t0``
        passed first, False when it ended or was cancelled."""
        while proc.poll() is None:
            self._remember(proc.pid)
            if self._stop.wait(0.5):
                return False
            if time.monotonic() - t0 > timeout:
                return True
        return False
