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
from collections.abc import Callable
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
            self._remember(proc.pid)
            self._remember_marked()
            alive = self._alive()
            if not alive:
                break
            for p in alive:
                try:
                    p.send_signal(sig)
                except psutil.Error:
                    pass
            deadline = time.monotonic() + (self.grace if sig == signal.SIGTERM else 5.0)
            while time.monotonic() < deadline:
                if proc.poll() is None:
                    try:
                        proc.wait(0.1)
                    except subprocess.TimeoutExpired:
                        pass
                else:
                    time.sleep(0.1)
                self._remember(proc.pid)
                if not self._alive():
                    break
        try:  # anything left in torchrun's own group
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass

    # ------------------------------------------------------------------ output
    def _read(self, fd: int, emit: Callable[[str], None], give_up: threading.Event) -> None:
        """Read the pipe in chunks; emit each line cut at MAX_LINE_CHARS (the rest is counted, not kept)."""
        buf = bytearray()
        cut = 0

        def flush():
            nonlocal buf, cut
            text = bytes(buf).decode("utf-8", errors="replace").rstrip("\r")
            if cut:
                text += f" … [{cut:,} more bytes of this line not shown]"
            buf, cut = bytearray(), 0
            emit(text)

        while True:
            try:
                ready, _, _ = select.select([fd], [], [], 0.2)
            except (OSError, ValueError):
                break
            if not ready:
                if give_up.is_set():
                    break
                continue
            try:
                chunk = os.read(fd, 1 << 16)
            except OSError:
                break
            if not chunk:
                break
            start = 0
            while start < len(chunk):
                nl = chunk.find(b"\n", start)
                piece = chunk[start:] if nl < 0 else chunk[start:nl]
                room = MAX_LINE_CHARS - len(buf)
                if room > 0:
                    buf += piece[:room]
                cut += max(0, len(piece) - max(room, 0))
                if nl < 0:
                    break
                flush()
                start = nl + 1
        if buf or cut:
            flush()

    def _watch(self, proc: subprocess.Popen, timeout: float, device: str, note: str) -> None:
        t0 = time.monotonic()
        kept: collections.deque[str] = collections.deque()
        size = dropped = 0
        diffs: list[float] = []
        passed = failed = timed_out = False

        def emit(line: str) -> None:
            nonlocal size, dropped, passed, failed
            phase = parse_phase(line)
            if phase is not None:
                self._phase(phase)
            if line.startswith("Verify:"):
                if len(diffs) < 100_000:
                    diffs.extend(float(x) for x in _DIFF.findall(line))
                passed = passed or "Verify: PASSED" in line
                failed = failed or "Verify: FAILED" in line
            kept.append(line)
            size += len(line)
            while size > MAX_LOG_CHARS and len(kept) > 1:
                size -= len(kept.popleft())
                dropped += 1
            try:
                self.on_line(line)
            except Exception:  # noqa: BLE001, S110 - a view must never stop the run's bookkeeping
                pass

        self._phase("launch")
        give_up = threading.Event()
        reader = threading.Thread(target=self._read, args=(proc.stdout.fileno(), emit, give_up), daemon=True)
        reader.start()
        try:
            while proc.poll() is None:
                self._remember(proc.pid)
                if self._stop.wait(0.5):
                    break
                if time.monotonic() - t0 > timeout:
                    timed_out = True
                    break
        finally:
            try:
                self._kill_tree(proc)  # also ends workers left behind by a torchrun that exited
            finally:
                reader.join(5)
                give_up.set()
                reader.join(2)
                if not reader.is_alive():  # never close an fd a reader could still select on
                    try:
                        proc.stdout.close()
                    except OSError:
                        pass
                lines = list(kept)
                if dropped:
                    lines.insert(0, f"[{dropped:,} earlier lines not kept]")
                if self._cancelled:
                    status = "cancelled"
                elif timed_out:
                    status = "timeout"
                elif proc.returncode == 0 and passed:
                    status = "passed"
                elif failed:
                    status = "failed"
                else:
                    status = "crashed"
                self.result = VerifyResult(
                    status, proc.returncode, time.monotonic() - t0, diffs, lines, device, note
                )
                try:
                    self.on_done(self.result)
                except Exception:  # noqa: BLE001, S110 - the result is kept on self.result either way
                    pass
