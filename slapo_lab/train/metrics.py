"""Progress and metrics of a training run: a tqdm bar, one line per step, TensorBoard events and
``metrics.csv`` (rank 0 only), peak memory and model FLOPs utilisation (MFU).

Memory: on CUDA the peak is ``torch.cuda.max_memory_allocated`` since the last
:func:`reset_peak_memory`; on CPU it is the process's peak resident set above the start-up baseline
recorded by :func:`mark_memory_baseline` (call it before the model is built), i.e. ``VmHWM`` minus the
``VmRSS`` of that moment (``/proc/self/status``; ``resource.getrusage`` where there is no ``/proc``). The
CPU peak cannot be reset.

MFU (CUDA only): ``6 * n_params * tokens / seconds / (world_size * peak TFLOP/s * 1e12)``, the peak from
``--peak-tflops`` or :data:`slapo_lab.hardware.PEAK_TFLOPS` by device name and precision.
"""

from __future__ import annotations

import csv
import os
import resource
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from ..hardware import PRECISIONS, peak_tflops_for

if TYPE_CHECKING:
    from typing_extensions import Self

PROGRESS_MODES = ("auto", "on", "off")
CSV_COLUMNS = (
    "step",
    "loss",
    "grad_norm",
    "lr",
    "tokens_per_s",
    "samples_per_s",
    "peak_mem_mib",
    "mfu",
    "eval_loss",
)
CSV_NAME = "metrics.csv"


# ---------------------------------------------------------------------------------------------------------
# memory

_baseline_kib: float = 0.0


def _proc_status_kib(field: str) -> float | None:
    """A ``kB`` field of ``/proc/self/status`` (``VmHWM``, ``VmRSS``), or None without /proc."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return float(line.split()[1])
    except OSError:
        return None
    return None


def _maxrss_kib() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / 1024 if sys.platform == "darwin" else float(rss)


def mark_memory_baseline() -> float:
    """Record the process's resident set now (``VmRSS``; the peak so far where /proc is missing) as the CPU
    baseline of :func:`peak_memory_mib`. Call it before the model is built. Returns the baseline in MiB."""
    global _baseline_kib
    rss = _proc_status_kib("VmRSS")
    _baseline_kib = rss if rss is not None else _maxrss_kib()
    return _baseline_kib / 1024


def _is_cuda(device) -> bool:
    return str(device).startswith("cuda")


def peak_memory_mib(device: str | torch.device) -> float:
    """Peak memory of this process in MiB (2**20 bytes).

    ``device`` ``"cuda"`` / ``"cuda:N"`` / a ``torch.device``: ``torch.cuda.max_memory_allocated`` since the
    last :func:`reset_peak_memory`. CPU: peak RSS above the start-up baseline (``VmHWM`` minus the
    resident set at :func:`mark_memory_baseline`, 0 if never marked; never negative).
    """
    if _is_cuda(device):
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = _proc_status_kib("VmHWM")
    if peak is None:
        peak = _maxrss_kib()
    return max(0.0, peak - _baseline_kib) / 1024


def reset_peak_memory(device: str | torch.device) -> bool:
    """Restart the peak count: ``torch.cuda.reset_peak_memory_stats`` on CUDA; on Linux, the peak resident set
    (``VmHWM``) by writing ``5`` to ``/proc/self/clear_refs`` (Linux 4.0+). Returns whether it was reset
    (False where the system offers no way)."""
    if _is_cuda(device):
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------------------
# the logger


def _fmt(value) -> str:
    """A CSV cell: empty for None, else the number with up to 8 significant digits."""
    return "" if value is None else f"{float(value):.8g}"


class MetricsLogger:
    """Progress bar, step lines, TensorBoard scalars and ``metrics.csv`` of one training run.

    Only ``rank == 0`` does anything; on other ranks every method is a no-op and no file is created.

    Args:
        rank: this process's global rank.
        log_dir: where ``metrics.csv`` and the TensorBoard event files go (created; None: neither).
        total_steps: optimizer steps of the whole run (the bar's total, the ``/N`` of step lines).
        start_step: steps already done when resuming (0: a fresh run). When > 0, an existing
            ``metrics.csv`` is kept up to that step and appended to (rows of later steps, written by a
            run that died after its last checkpoint, are dropped), and TensorBoard purges events after
            it.
        progress: ``"on"``: a tqdm bar on stderr; ``"auto"``: only when stderr is a terminal; ``"off"``.
            While the bar is shown, lines go through ``tqdm.write``, else ``print(..., flush=True)``.
        device: the training device (``"cpu"``, ``"cuda"``, ``"cuda:0"``): CUDA memory and MFU there.
        n_params: parameters of the whole (unsharded) model, for MFU.
        world_size: processes (GPUs) of the run, for MFU.
        precision: ``"fp32"``, ``"tf32"`` or ``"bf16"``: the column of :data:`slapo_lab.hardware.PEAK_TFLOPS`.
        peak_tflops: peak TFLOP/s of one GPU (``--peak-tflops``), overriding the table.
        predicted_step_s / predicted_peak_gib: a plan's predicted seconds per optimizer step and peak allocated
            GiB of the busiest rank (``--predicted-step-s`` / ``--predicted-peak-gib``, from
            :meth:`slapo_lab.planner.Estimate.export_options`): printed at the start, each step's time as a
            ratio to it, and at the end (:meth:`close`) the median step (the first one, which compiles and warms
            up, left out) and rank 0's peak memory as ratios to them.

    Raises:
        ValueError: for an unknown ``progress`` or ``precision``.

    Use as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        rank: int,
        *,
        log_dir: str | os.PathLike | None = None,
        total_steps: int,
        start_step: int = 0,
        progress: str = "auto",
        device: str | torch.device = "cpu",
        n_params: int,
        world_size: int,
        precision: str = "fp32",
        peak_tflops: float | None = None,
        predicted_step_s: float | None = None,
        predicted_peak_gib: float | None = None,
    ):
        if progress not in PROGRESS_MODES:
            raise ValueError(f"The progress mode {progress!r} is not one of {', '.join(PROGRESS_MODES)}.")
        if precision not in PRECISIONS:
            raise ValueError(f"The precision {precision!r} is not one of {', '.join(PRECISIONS)}.")
        self.rank = rank
        self.active = rank == 0
        self.total_steps = int(total_steps)
        self.start_step = int(start_step)
        self.device = str(device)
        self.n_params = int(n_params)
        self.world_size = int(world_size)
        self.precision = precision
        self.log_dir = Path(log_dir) if log_dir is not None and self.active else None
        self.peak_tflops = None
        self.predicted_step_s = predicted_step_s or None
        self.predicted_peak_gib = predicted_peak_gib or None
        self._step_seconds: list[float] = []
        self._peak_mib = 0.0
        self.bar = None
        self._writer = None
        self._csv = None
        self._csv_writer = None
        if not self.active:
            return
        if _is_cuda(self.device):
            self.peak_tflops = peak_tflops or peak_tflops_for(
                torch.cuda.get_device_name(self.device), precision
            )
        if progress == "on" or (progress == "auto" and sys.stderr.isatty()):
            self.bar = tqdm(
                total=self.total_steps,
                initial=self.start_step,
                unit="step",
                file=sys.stderr,
                dynamic_ncols=True,
                leave=True,
            )
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._open_csv()
            from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - tensorboard loads only with --log-dir

            purge = self.start_step + 1 if self.start_step > 0 else None
            self._writer = SummaryWriter(str(self.log_dir), purge_step=purge)
        if self.predicted_step_s or self.predicted_peak_gib:
            said = [f"{self.predicted_step_s:.3f} s per step"] if self.predicted_step_s else []
            said += [f"{self.predicted_peak_gib:.2f} GiB peak allocated"] if self.predicted_peak_gib else []
            self.info("plan: predicted " + " and ".join(said) + " (the measured figures follow as ratios)")

    # -- output --------------------------------------------------------------------------------------

    @property
    def csv_path(self) -> Path | None:
        """``log_dir / "metrics.csv"`` (None without a log directory or on other ranks)."""
        return self.log_dir / CSV_NAME if self.log_dir is not None else None

    def _open_csv(self) -> None:
        """A fresh ``metrics.csv`` with its header; when resuming, the existing one appended to (rewritten
        without the rows after ``start_step`` if there are such)."""
        path = self.csv_path
        rows: list[list[str]] = []
        if self.start_step > 0 and path.exists():
            with open(path, newline="") as fh:
                rows = list(csv.reader(fh))
            if rows and tuple(rows[0]) != CSV_COLUMNS:  # another format: set it aside rather than mix columns
                os.replace(path, path.with_name(path.name + ".old"))
                rows = []
        if rows:
            kept = [r for r in rows[1:] if r and r[0].isdigit() and int(r[0]) <= self.start_step]
            if len(kept) == len(rows) - 1:
                self._csv = open(path, "a", newline="")  # noqa: SIM115 - open until close()
                self._csv_writer = csv.writer(self._csv)
                return
            rows = kept
        self._csv = open(path, "w", newline="")  # noqa: SIM115 - open until close()
        self._csv_writer = csv.writer(self._csv)
        self._csv_writer.writerow(CSV_COLUMNS)
        self._csv_writer.writerows(rows)
        self._csv.flush()

    def info(self, line: str) -> None:
        """Print ``line`` on rank 0 (through the bar when it is shown, so that it stays intact)."""
        if not self.active:
            return
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def _row(self, **cells) -> None:
        if self._csv_writer is not None:
            self._csv_writer.writerow(
                [_fmt(cells.get(c)) if c != "step" else str(cells["step"]) for c in CSV_COLUMNS]
            )
            self._csv.flush()

    def _scalar(self, tag: str, value, step: int) -> None:
        if self._writer is not None and value is not None:
            self._writer.add_scalar(tag, float(value), global_step=step)

    # -- metrics -------------------------------------------------------------------------------------

    def mfu(self, tokens: int | None, seconds: float) -> float | None:
        """Model FLOPs utilisation as a fraction (0.41 = 41 %): ``6 * n_params * tokens / seconds /
        (world_size * peak_tflops * 1e12)``; None off CUDA, without a known peak or token count."""
        if not _is_cuda(self.device) or not self.peak_tflops or not tokens or seconds <= 0:
            return None
        return 6 * self.n_params * tokens / seconds / (self.world_size * self.peak_tflops * 1e12)

    def log_step(
        self,
        step: int,
        *,
        loss: float,
        lr: float,
        grad_norm: float | None = None,
        tokens: int | None = None,
        samples: int,
        seconds: float,
    ) -> str | None:
        """Report optimizer step ``step`` (1-based: the number of steps done, as in ``step 3/6``).

        Args:
            loss: the step's mean training loss.
            lr: the learning rate the step used.
            grad_norm: the global gradient norm before clipping (None: not measured, left out).
            tokens: tokens the step trained on over all replicas (``global_batch_size * seq_len``;
                None for inputs without a sequence: no tokens/s and no MFU).
            samples: samples of the step over all replicas (the global batch size).
            seconds: wall-clock seconds of the step.

        Prints (rank 0) e.g. ``step 3/6 loss 5.123456 | lr 1.00e-03 | grad norm 1.2345 | 1234 tokens/s |
        12.0 samples/s | peak mem 123 MiB | MFU 41.0% of 989 TF bf16`` (MFU only on CUDA), advances the
        bar, writes the TensorBoard scalars ``train/loss``, ``train/lr``, ``train/grad_norm``,
        ``train/tokens_per_s``, ``train/peak_mem_mib``, ``train/mfu`` and one ``metrics.csv`` row.
        Returns the line (None on other ranks).
        """
        if not self.active:
            return None
        seconds = max(float(seconds), 1e-9)
        tokens_per_s = tokens / seconds if tokens else None
        samples_per_s = samples / seconds
        mem = peak_memory_mib(self.device)
        mfu = self.mfu(tokens, seconds)
        parts = [f"step {step}/{self.total_steps} loss {loss:.6f}", f"lr {lr:.2e}"]
        if grad_norm is not None:
            parts.append(f"grad norm {grad_norm:.4f}")
        if tokens_per_s is not None:
            parts.append(f"{tokens_per_s:.0f} tokens/s")
        parts += [f"{samples_per_s:.1f} samples/s", f"peak mem {mem:.0f} MiB"]
        self._step_seconds.append(seconds)
        self._peak_mib = max(self._peak_mib, mem)
        if self.predicted_step_s:
            parts.append(f"step {seconds / self.predicted_step_s:.2f}x predicted")
        if _is_cuda(self.device):
            parts.append(
                f"MFU {100 * mfu:.1f}% of {self.peak_tflops:g} TF {self.precision}"
                if mfu is not None
                else "MFU n/a (pass --peak-tflops)"
            )
        line = " | ".join(parts)
        if self.bar is not None:
            self.bar.update(max(0, step - self.bar.n))
            self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        self.info(line)
        self._scalar("train/loss", loss, step)
        self._scalar("train/lr", lr, step)
        self._scalar("train/grad_norm", grad_norm, step)
        self._scalar("train/tokens_per_s", tokens_per_s, step)
        self._scalar("train/peak_mem_mib", mem, step)
        self._scalar("train/mfu", mfu, step)
        self._row(
            step=step,
            loss=loss,
            grad_norm=grad_norm,
            lr=lr,
            tokens_per_s=tokens_per_s,
            samples_per_s=samples_per_s,
            peak_mem_mib=mem,
            mfu=mfu,
        )
        return line

    def log_eval(self, step: int, loss: float, samples: int | None = None) -> str | None:
        """Report the evaluation loss after step ``step``: prints ``eval step 3: loss 5.123456`` (``(96
        sequences)`` after it when ``samples`` is given), writes ``eval/loss`` and a ``metrics.csv`` row with
        only ``step`` and ``eval_loss``. Returns the line."""
        if not self.active:
            return None
        line = f"eval step {step}: loss {loss:.6f}" + (
            f" ({samples} sequences)" if samples is not None else ""
        )
        self.info(line)
        self._scalar("eval/loss", loss, step)
        self._row(step=step, eval_loss=loss)
        return line

    def plan_summary(self) -> str | None:
        """``measured / predicted: step 0.95x (median 0.213 s of 29 steps against 0.225 s), peak memory 1.04x
        (36,791 MiB on rank 0 against 35,280 MiB)`` when a prediction was given and steps ran; else None."""
        if (
            not self.active
            or not self._step_seconds
            or not (self.predicted_step_s or self.predicted_peak_gib)
        ):
            return None
        parts = []
        if self.predicted_step_s:
            steps = self._step_seconds[1:] or self._step_seconds
            med = statistics.median(steps)
            parts.append(
                f"step {med / self.predicted_step_s:.2f}x (median {med:.3f} s of {len(steps)} steps against "
                f"{self.predicted_step_s:.3f} s)"
            )
        if self.predicted_peak_gib:
            pred = self.predicted_peak_gib * 1024
            parts.append(
                f"peak memory {self._peak_mib / pred:.2f}x ({self._peak_mib:,.0f} MiB on rank 0 against {pred:,.0f} MiB)"
            )
        return "measured / predicted: " + ", ".join(parts)

    def close(self) -> None:
        """Print :meth:`plan_summary` (once), then flush and close the event writer, ``metrics.csv`` and the bar
        (idempotent)."""
        line = self.plan_summary()
        if line is not None:
            self._step_seconds = []
            self.info(line)
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None
        if self._csv is not None:
            self._csv.close()
            self._csv = None
            self._csv_writer = None
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
