"""The planner: every layout of a model on a cluster, priced from the block profiles and ranked.

``auto_plan(model, cluster=Cluster(nodes=4, gpus_per_node=8, gpu="H100-SXM"), seq_len=8192,
global_batch_size=512)`` enumerates tensor parallelism (powers of two within a node that divide the GPUs),
pipeline stages (cut points balanced on the cost model, GPipe / 1F1B / interleaved 1F1B), data parallelism with
DDP, FSDP2, ZeRO-1 or ZeRO-2 (``dp`` fills the cluster), activation checkpointing (none, all, every k-th block,
selective) and the micro-batch size, prices each with :func:`slapo_lab.planner.model.estimate`'s arithmetic
(one profile per TP degree, no forward per candidate), and returns the fastest that fit, with the others'
reasons grouped (one sentence per kind, with a count and the closest example).
"""

from __future__ import annotations

import functools
import itertools
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..errors import ScheduleError
from ..module_state import has_sequence_parallel
from ..parallel_dims import ParallelDims
from ..schedule import Schedule
from ..utils import human_bytes
from ..utils.collector import gc_paused
from .devices import GiB
from .model import CHECKPOINTS, Cluster, Estimate, Layout, _check_key, _check_layout, _price, _pricer_for

__all__ = ["Plan", "Rejection", "auto_plan"]


@functools.lru_cache(maxsize=4096)
def _group_key(sentence: str) -> str:
    """A rejection sentence with its numbers blanked: the key of its group (sentences repeat across a search)."""
    return re.sub(r"\d+(\.\d+)?", "N", sentence)


@dataclass
class Rejection:
    """Layouts refused for one kind of reason.

    Attributes:
        sentence: one sentence, the example closest to fitting for memory (the first seen otherwise).
        count: how many layouts it refused.
        layouts: up to three of them.
    """

    sentence: str
    count: int = 0
    layouts: list = field(default_factory=list)
    _closest: float = float("inf")


@dataclass
class Plan:
    """What :func:`auto_plan` found.

    Attributes:
        candidates: the ``top_k`` fastest layouts that fit (:class:`~slapo_lab.planner.model.Estimate`, each with
            ``.layout``), best first (tokens/s/GPU).
        rejected: :class:`Rejection` per kind of reason, most frequent first.
        priced: layouts considered.
        seconds: wall time of the search (profiles included).
        costed: layouts whose memory and step time were computed (the rest were refused before: TP beyond a
            node, a batch that does not divide, ...).
        fitting: those of them that fit.
    """

    candidates: list
    rejected: list
    priced: int
    seconds: float
    costed: int = 0
    fitting: int = 0

    def __iter__(self):
        return iter(self.candidates)

    def __len__(self) -> int:
        return len(self.candidates)

    def __getitem__(self, i):
        return self.candidates[i]

    def table(self) -> str:
        """The ranked table and the why-not list, as text."""
        w = max([62, *(len(e.layout.describe()) for e in self.candidates)])  # the layout column's width
        head = f"{'#':>2}  {'layout':<{w}} {'peak GiB':>8} {'step s':>8} {'tok/s/GPU':>10} {'MFU':>6}"
        rows = [head, "-" * len(head)]
        for i, e in enumerate(self.candidates, 1):
            rows.append(
                f"{i:>2}  {e.layout.describe():<{w}} {e.peak_memory_bytes / GiB:>8.1f} {e.step_time_s:>8.3f} "
                f"{e.tokens_per_s_per_gpu:>10,.0f} {e.mfu:>6.1%}"
            )
        if not self.candidates:
            rows.append("   (no layout fits)")
        rows.append(
            f"\n{self.priced:,} layouts considered, {self.costed:,} costed, {self.fitting:,} fit "
            f"({self.seconds:.2f} s); rejected:"
        )
        for r in self.rejected:
            rows.append(f"  {r.count:>6} x {r.sentence}")
        return "\n".join(rows)


def _sp_default(pr, tp: int, model_or_schedule) -> bool:
    """Whether sequence parallelism is on by default at TP ``tp``: for a schedule, whether it has it (a
    reduce-scatter after a row-parallel layer); for a model, whether the preset lays it out (its profile at
    ``tp`` with it can be made). Off for a degree beyond a node or one the preset refuses, whose layouts are
    then refused with the plain preset's sentence."""
    if isinstance(model_or_schedule, Schedule):
        return has_sequence_parallel(model_or_schedule.mod)
    if tp > pr.cluster.gpus_per_node:
        return False
    try:
        pr.profile(tp, True)
    except ScheduleError:
        return False
    return True


def _powers_of_two_dividing(n: int, limit: int) -> list[int]:
    return [d for d in (1 << i for i in range(20)) if d <= limit and n % d == 0]


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


class _Search:
    """The candidates priced so far: those that fit, and the rejected grouped by their sentence."""

    def __init__(self, pr, global_batch_size: int):
        self.pr = pr
        self.global_batch_size = global_batch_size
        self.fits: list[Estimate] = []
        self.groups: dict[str, Rejection] = {}
        self.priced = self.costed = 0
        # _check_layout's answer (or refusal) per _check_key: it reads neither the shard nor the checkpoint
        self._checked: dict[tuple, tuple | str] = {}
        # Layout's refusal (or None) per combination of the fields after the degrees: the search's degrees are
        # positive integers (ParallelDims.for_world made them), so only those fields can be refused
        self._valid: dict[tuple, str | None] = {}

    def reject(self, fields: tuple | None, sentence: str | Callable[[], str], over: float = 0.0) -> None:
        """Count a rejected layout (its :class:`Layout` fields) in its group (the sentence with its numbers
        blanked; every "does not fit" in one group, which says the closest miss: its ``sentence`` is a callable,
        made only for a closer miss)."""
        key = "fit" if over else _group_key(str(sentence))
        g = self.groups.get(key)
        if g is None:
            g = self.groups[key] = Rejection(sentence if isinstance(sentence, str) else "")
        g.count += 1
        if len(g.layouts) < 3:
            g.layouts.append(None if fields is None else Layout(*fields))
        if over and over < g._closest:
            g._closest, g.sentence = over, sentence if isinstance(sentence, str) else sentence()

    def price(self, *fields) -> None:
        """Price the :class:`Layout` of ``fields`` (its fields in order, degrees from the search) and keep it, or
        say why not; the Layout is built only when it is priced or kept as an example of a refusal."""
        self.priced += 1
        rest = fields[3:]
        if rest not in self._valid:
            try:
                Layout(1, 1, 1, *rest)
                self._valid[rest] = None
            except ScheduleError as err:
                self._valid[rest] = str(err)
        invalid = self._valid[rest]
        if invalid is not None:
            self.reject(None, invalid)
            return
        key = _check_key(*fields)
        checked = self._checked.get(key)
        layout = None
        if checked is None:
            layout = Layout(*fields)
            try:
                checked = _check_layout(self.pr, layout, self.global_batch_size)
            except ScheduleError as err:
                checked = str(err)
            self._checked[key] = checked
        if isinstance(checked, str):
            self.reject(fields, checked)
            return
        layout = layout or Layout(*fields)
        try:
            est = _price(self.pr, layout, self.global_batch_size, checked)
        except ScheduleError as err:
            self.reject(fields, str(err))
            return
        self.costed += 1
        hbm = self.pr.cluster.device.hbm_bytes
        if not est.fits:
            over_b = est.peak_memory_bytes - hbm

            def sentence() -> str:
                busiest = int(np.argmax(sum(est.stage_memory.values())))
                return (
                    f"does not fit by {human_bytes(over_b)} ({human_bytes(est.peak_memory_bytes)} on stage "
                    f"{busiest} of {human_bytes(hbm)}; closest: {layout.describe()})."
                )

            self.reject(fields, sentence, over_b / GiB)
            return
        self.fits.append(est)


# the search allocates ~10^5 small objects without cycles (layouts, estimates, numpy arrays): each full collection
# on the way re-scans the process's whole heap (torch, transformers, the model; ~0.2 s in a fresh process at 405B)
@gc_paused()
def auto_plan(
    model_or_schedule,
    cluster: Cluster | None = None,
    seq_len: int = 2048,
    global_batch_size: int = 8,
    dtype: str = "bf16",
    top_k: int = 5,
    *,
    tp: list[int] | None = None,
    pp: list[int] | None = None,
    shards: tuple = ("none", "fsdp", "zero1", "zero2"),
    checkpoints: tuple = ("none", "all", "selective", *range(2, 17)),
    micro_batch_sizes: tuple = (1, 2, 4, 8, 16, 32),
    pp_schedules: tuple = ("1F1B", "GPipe", "interleaved"),
    sequence_parallel: tuple | None = None,
) -> Plan:
    """Search the layouts of ``model_or_schedule`` on ``cluster`` and rank those that fit.

    Args:
        model_or_schedule: an ``nn.Module`` (meta works) or a Schedule (then only its ``world_size`` as TP).
        cluster: :class:`~slapo_lab.planner.model.Cluster` (default one node of 8 H100-SXM).
        seq_len / global_batch_size / dtype: the run (tokens per sequence, sequences per step, training dtype).
        top_k: how many candidates to return.
        tp / pp: degrees to try (default: TP powers of two within a node dividing the GPUs; PP every divisor of
            the GPUs left up to the number of blocks).
        shards / checkpoints / micro_batch_sizes / pp_schedules: the other choices.
        sequence_parallel: the values to search for TP > 1; None (the default): on wherever the tensor-parallel
            preset can lay it out on this model, off otherwise, as Megatron-LM and torchtitan turn it on with
            tensor parallelism (it cuts the activations between the regions by the TP degree for the same
            bytes moved); ``(False, True)`` prices both.

    Returns:
        Plan: ``.candidates`` (Estimates, best tokens/s/GPU first), ``.rejected`` (grouped reasons), ``.priced``.

    Raises:
        ScheduleError: a model that cannot be profiled at TP 1 (one sentence).
    """

    t0 = time.perf_counter()
    cluster = cluster or Cluster()
    n = cluster.gpus
    pr = _pricer_for(model_or_schedule, cluster, seq_len, dtype)
    if isinstance(model_or_schedule, Schedule):
        tps = [model_or_schedule.world_size]
    else:
        # powers of two within a node, and the next one (priced only to say why it is refused)
        tps = tp or _powers_of_two_dividing(n, 2 * cluster.gpus_per_node)
    base = pr.profile(tps[0] if isinstance(model_or_schedule, Schedule) else 1, False)
    nblocks = base.num_blocks
    checkpoints = tuple(c for c in checkpoints if c in CHECKPOINTS or (isinstance(c, int) and c < nblocks))
    search = _Search(pr, global_batch_size)
    for t in tps:
        sps = (False,) if t == 1 else sequence_parallel or (_sp_default(pr, t, model_or_schedule),)
        for p in pp or _divisors(n // t if n % t == 0 else 1, nblocks):
            dims = ParallelDims.for_world(n, t, p)
            if dims is None:
                continue
            d = dims.dp
            scheds = pp_schedules if p > 1 else ("1F1B",)
            shs = shards if d > 1 else ("none",)
            for sched, sh, ck, mbs, sp in itertools.product(scheds, shs, checkpoints, micro_batch_sizes, sps):
                search.price(t, p, d, sh, mbs, ck, sched, sp)
    fits = sorted(search.fits, key=lambda e: -e.tokens_per_s_per_gpu)
    rejected = sorted(search.groups.values(), key=lambda g: -g.count)
    priced, costed, fitted = search.priced, search.costed, len(fits)
    return Plan(fits[:top_k], rejected, priced, time.perf_counter() - t0, costed, fitted)
