"""Run an exported script's ``--verify`` under torchrun in a subprocess, streaming its output.

The subprocess runs without a shell, in its own process session (so a crash, a hang or a Cancel
kills the whole torchrun tree, never the kernel), with a wall-clock timeout. Used by the editor's
"Verify on GPU" button; usable on its own.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

_DIFF = re.compile(r"max abs diff ([0-9.eE+-]+|inf|nan)")
_EXC = re.compile(r"^\s*(\[rank\d+\]:\s*)?[\w.]*(Error|Exception|Interrupt)\b[^:]*:")


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plan_device(nproc: int, want: str = "cuda") -> tuple[str, str]:
    """Choose where Verify runs: ``("cuda", "")`` or ``("cpu", the one-sentence reason)``."""
    import torch

    if want == "cpu":
        return "cpu", "Verify runs on the CPU with gloo, as asked."
    if not torch.cuda.is_available():
        return "cpu", "CUDA is not available on this machine, so Verify runs on the CPU with gloo."
    n = torch.cuda.device_count()
    if n < nproc:
        return "cpu", (f"The schedule needs {nproc} ranks but this machine has {n} GPU(s), "
                       "so Verify runs on the CPU with gloo.")
    return "cuda", ""


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
            return f"Verify was stopped after {self.seconds:.0f} s (its time limit); the schedule is unchanged."
        if self.status == "cancelled":
            return "Verify was cancelled; the schedule is unchanged."
        tail = next((ln for ln in reversed(self.lines) if _EXC.match(ln) and "ChildFailedError" not in ln), "")
        return (f"Verify crashed (exit code {self.returncode})" + (f": {tail.strip()[:200]}" if tail else "")
                + "; the schedule is unchanged.")


class VerifyRunner:
    """Runs ``torchrun --nproc_per_node=N script --verify --steps 1 --device D`` in the background.

    Args:
        on_line: called with each output line (from a reader thread).
        on_done: called with the :class:`VerifyResult` when the run ends, however it ends.
    """

    def __init__(self, on_line: Callable[[str], None] | None = None,
                 on_done: Callable[[VerifyResult], None] | None = None) -> None:
        self.on_line = on_line or (lambda line: None)
        self.on_done = on_done or (lambda result: None)
        self._proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None
        self._cancelled = False
        self.result: VerifyResult | None = None

    @property
    def running(self) -> bool:
        """Whether a run is in progress."""
        return self._thread is not None and self._thread.is_alive()

    def command(self, script: str, nproc: int, device: str, extra: list[str] | None = None) -> list[str]:
        """The argv (no shell) of the run."""
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(script),
                "--device", device, "--verify", "--steps", "1", *(extra or [])]

    def start(self, script: str, nproc: int, device: str = "cpu", timeout: float = 600.0,
              extra: list[str] | None = None, note: str = "") -> None:
        """Start the run; returns at once.

        Raises:
            RuntimeError: if a run is already in progress.
        """
        if self.running:
            raise RuntimeError("A Verify run is already in progress; cancel it first.")
        self._cancelled = False
        cmd = self.command(script, nproc, device, extra)
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=env, start_new_session=True, cwd=os.path.dirname(os.path.abspath(script)))
        self._thread = threading.Thread(target=self._watch, args=(self._proc, timeout, device, note), daemon=True)
        self._thread.start()

    def cancel(self) -> bool:
        """Kill the run (the whole process group); returns whether one was running."""
        if not self.running or self._proc is None:
            return False
        self._cancelled = True
        self._kill(self._proc)
        return True

    def wait(self, timeout: float | None = None) -> VerifyResult | None:
        """Block until the run ends (or ``timeout`` seconds); returns the result if it ended."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.result

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _watch(self, proc: subprocess.Popen, timeout: float, device: str, note: str) -> None:
        t0 = time.monotonic()
        lines: list[str] = []
        timed_out = threading.Event()

        def killer():
            if proc.poll() is None:
                timed_out.set()
                self._kill(proc)

        timer = threading.Timer(timeout, killer)
        timer.daemon = True
        timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                line = line.rstrip("\n")
                lines.append(line)
                if len(lines) > 5000:
                    del lines[:1000]
                try:
                    self.on_line(line)
                except Exception:
                    pass
            proc.wait()
        finally:
            timer.cancel()
        diffs = []
        for ln in lines:
            if ln.startswith("Verify:"):
                diffs += [float(x) for x in _DIFF.findall(ln)]
        passed = any("Verify: PASSED" in ln for ln in lines)
        if self._cancelled:
            status = "cancelled"
        elif timed_out.is_set():
            status = "timeout"
        elif proc.returncode == 0 and passed:
            status = "passed"
        elif any("Verify: FAILED" in ln for ln in lines):
            status = "failed"
        else:
            status = "crashed"
        self.result = VerifyResult(status, proc.returncode, time.monotonic() - t0, diffs, lines, device, note)
        try:
            self.on_done(self.result)
        except Exception:
            pass
