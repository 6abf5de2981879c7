"""The editor's Verify: run the exported script with ``--verify`` under torchrun, with a progress bar, the phase and
the log.

:class:`VerifyPanel` holds the editor (the :class:`~slapo_lab.editor.state.EditorState` whose schedule it verifies)
and inherits nothing from it. It exports the schedule with the Export form's options to a temporary folder and runs
it in a subprocess (:class:`~slapo_lab.editor.verify_runner.VerifyRunner`); the phases come from the run's
``slapo-lab phase:`` lines (:mod:`slapo_lab.train.phases`), warnings stay out of the visible log.
"""

from __future__ import annotations

import html
import time

import ipywidgets as W

from ..train.phases import PHASES
from .verify_runner import LogFilter, VerifyRunner

__all__ = ["VerifyPanel"]


class VerifyPanel:
    """The Verify button, Cancel, the progress bar, the phase and the log.

    Args:
        editor: the editor (its state: ``model``, ``dims``, the export checks and script writer, the Export form's
            options, the message line, the schedule check's open items).

    Attributes:
        btn_verify, btn_cancel, progress, phase, log: the widgets; runner: the last
        :class:`~slapo_lab.editor.verify_runner.VerifyRunner` (None before the first run); log_lines: the visible
        log of the last run (no warnings); verify_all: every line of it while it runs.
    """

    def __init__(self, editor) -> None:
        self.editor = editor
        self.runner = None
        self.log_lines: list[str] = []  # the visible log of the last Verify (no warnings)
        self.verify_all: list[str] = []  # every line of it (the runner's result keeps them once it ends)
        self.log_filter: LogFilter | None = None
        self.t0: float | None = None
        self.phase_name = "export"
        self.btn_verify = W.Button(
            description="Verify on GPU",
            icon="check",
            button_style="success",
            tooltip="run the exported script with --verify under torchrun (CPU/gloo without GPUs)",
        )
        self.btn_cancel = W.Button(description="Cancel", icon="stop", disabled=True)
        self.btn_verify.on_click(lambda _: editor.verify())
        self.btn_cancel.on_click(lambda _: editor.cancel_verify())
        self.progress = W.IntProgress(
            value=0, min=0, max=len(PHASES) - 1, layout=W.Layout(visibility="hidden", width="30%")
        )
        self.phase = W.HTML()  # "Verify 3/6: building this rank's shards … (12 s)"
        self.log = W.HTML()

    def run(self, device: str = "cuda", timeout: float = 600.0, wait: bool = False):
        """Run the schedule under Verify in a torchrun subprocess (the "Verify on GPU" button).

        Exports the script with the export form's options to a temporary folder and runs it with
        ``--verify --steps 1`` on ``tp x pp x dp`` ranks (FSDP as chosen; a ZeRO stage is left out: it
        changes neither outputs nor gradients, and the run needs no DeepSpeed); output streams into the
        editor's log. The form's model path and data are used when they exist on this machine, else seeded
        random weights and synthetic data, and the message says which in one sentence; checkpoints, the
        save-HF directory and validation data are left out. Without enough GPUs it says so in one sentence
        and verifies on the CPU with gloo. A crash, hang (past ``timeout`` seconds) or Cancel ends the
        subprocess tree, never the kernel.

        Returns:
            The :class:`VerifyResult` if ``wait`` (None if it could not start), else the runner.
        """
        if self.runner is not None and self.runner.running:
            self.editor._error("A Verify run is already in progress; wait for it or press Cancel.")
            return None
        self.t0 = time.monotonic()  # the bar and the phase show from the first second
        self.verify_all, self.log_filter = [], LogFilter()
        self.phase_name = "export"
        self.progress.bar_style = ""
        self.progress.value = 0
        self.progress.layout.visibility = "visible"
        self.show_phase(self.t0)
        try:
            launcher, _, options = self.editor._form_options()
            script, options, used = self.editor.verifier.write(launcher, options)
        except Exception as err:  # noqa: BLE001 - reported, never raised past this point
            self.hide_progress()
            self.editor._error(f"Verify could not start: {err}")
            return None
        nproc, dev, note, too_big = self.editor.verifier.plan(options, device)
        if too_big:
            self.hide_progress()
            self.editor._error(too_big)
            return None
        note = (note + " " if note else "") + used
        self.log_lines = []
        self.log.value = ""
        self.progress.layout.visibility = "visible"
        self.progress.value = 1  # exported; now launching
        self.phase_name = "launch"
        self.show_phase(time.monotonic())
        self.btn_cancel.disabled = False
        self.btn_verify.disabled = True
        self.editor._info(note + f" Verifying on {nproc} rank(s)…")
        self.runner = VerifyRunner(on_line=self.on_line, on_done=self.on_done, on_phase=self.on_phase)
        try:
            self.runner.start(script, nproc, dev, timeout=timeout, note=note)
        except (OSError, RuntimeError) as err:  # the buttons must never stay disabled
            self.btn_cancel.disabled = True
            self.btn_verify.disabled = False
            self.hide_progress()
            self.editor._error(f"Verify could not start: {err}")
            return None
        if wait:
            return self.runner.wait()
        return self.runner

    def verify_options(self, launcher: str, options: dict) -> tuple[dict, str]:
        """The form's options for a Verify run and the sentence on what it uses (:meth:`VerifyController.options
        <slapo_lab.editor.verify_controller.VerifyController.options>`)."""
        return self.editor.verifier.options(launcher, options)

    def cancel(self) -> bool:
        """Cancel a running Verify; returns whether one was running."""
        return self.runner is not None and self.runner.cancel()

    def hide_progress(self) -> None:
        self.progress.layout.visibility = "hidden"
        self.phase.value = ""

    def lines(self) -> list[str]:
        """Every output line of the last (or current) Verify run, warnings included (the panel hides them)."""
        runner = self.runner
        if runner is None:
            return []
        return list(runner.result.lines) if runner.result is not None else list(self.verify_all)

    def on_phase(self, name: str) -> None:
        """A phase began (:mod:`slapo_lab.train.phases`): name it beside the bar and move the bar."""
        order = list(PHASES)
        if name not in order:
            return
        if name == "train":  # Verify runs one step after it passed; the bar stays on "compare"
            return
        self.phase_name = name
        self.progress.value = order.index(name)
        self.show_phase(time.monotonic())

    def show_phase(self, now: float) -> None:

        name = self.phase_name
        i = list(PHASES).index(name)
        secs = now - (self.t0 if self.t0 is not None else now)
        self.phase.value = (
            f"<span class='slapo-phase'>Verify {i + 1}/{len(PHASES)}: {html.escape(PHASES[name])} "
            f"<small>({secs:.0f} s)</small></span>"
        )

    def on_line(self, line: str) -> None:
        """One output line (already cut at MAX_LINE_CHARS by the runner). The panel shows the last 40 lines
        that are not warnings or phase markers (:class:`~slapo_lab.editor.verify_runner.LogFilter`);
        :meth:`verify_log` has them all."""
        if self.log_filter is None:
            self.log_filter = LogFilter()
        self.verify_all.append(line)
        del self.verify_all[:-5000]
        self.show_phase(time.monotonic())
        if not self.log_filter.visible(line):
            if self.log_filter.hidden and self.log_lines:
                self.render_log()
            return
        self.log_lines.append(line)
        del self.log_lines[:-200]
        self.render_log()

    def render_log(self) -> None:
        hidden = self.log_filter.hidden
        note = (
            f"({hidden} warning line{'s' if hidden != 1 else ''} hidden; editor.verify_log() has every line)\n"
            if hidden
            else ""
        )
        self.log.value = (
            f"<pre class='slapo-log'>{html.escape(note + chr(10).join(self.log_lines[-40:]))}</pre>"
        )

    def on_done(self, result) -> None:
        self.on_phase("done")
        self.progress.value = self.progress.max
        self.progress.bar_style = "success" if result.status == "passed" else "danger"
        self.btn_cancel.disabled = True
        self.btn_verify.disabled = False
        text = ((result.note + " ") if result.note else "") + result.summary
        if result.status == "passed":
            self.editor._info(text)
        else:
            n = self.editor._open_count()
            if n:
                text += (
                    f" The schedule check lists {n} open item{'s' if n > 1 else ''} above the code; "
                    "closing them is the first thing to try."
                )
            self.editor._error(text)
