"""The time of the model's parts on one device: each op's roofline at the device's rates, tensor-parallel
collectives, the optimizer step, and the links (:class:`Pricer`); :func:`adam_op_costs` counts AdamW's own ops.

Units: seconds, bytes, FLOPs. How each term is priced, and the constants' sources: ``model.py``'s module docstring
and ``devices.py``.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import ScheduleError
from .profile import ModelProfile, PartProfile, _tensors, profile_model

if TYPE_CHECKING:
    from .model import Cluster

__all__ = ["Pricer", "adam_op_costs"]

_ELEM = {"bf16": 2, "fp16": 2, "fp32": 4}


class Pricer:
    """Prices layouts of one model on one cluster at one sequence length; caches what layouts share.

    Args:
        model: an ``nn.Module`` or a Schedule (profiled per TP degree by :func:`profile.profile_model`).
        cluster: a :class:`~slapo_lab.planner.model.Cluster` (its ``device`` profile and node size are read).
        seq_len: tokens per sequence.
        dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"``.

    Raises:
        ScheduleError: another dtype (one sentence).
    """

    def __init__(self, model, cluster: Cluster, seq_len: int, dtype: str):
        if dtype not in _ELEM:
            raise ScheduleError(f"estimate: dtype must be one of {', '.join(_ELEM)}, not {dtype!r}.")
        self.model = model
        self.cluster = cluster
        self.dev = cluster.device
        self.seq_len = seq_len
        self.dtype = dtype
        self.elem = _ELEM[dtype]
        self.peak = self.dev.flops(dtype) * self.dev.matmul_efficiency
        attention = self.dev.attention_efficiency
        self.attention_peak = None if attention is None else self.dev.flops(dtype) * attention
        mm = self.dev.matmul_curve
        self._mm_curve = (
            (
                np.log2([float(f) for f, _ in mm]),
                self.dev.flops(dtype) * np.array([x for _, x in mm], dtype=float),
            )
            if mm
            else None
        )
        self.bw = self.dev.hbm_bandwidth * self.dev.memory_efficiency
        self._scale = dict(self.dev.collective_scale)
        curve = self.dev.memory_curve
        self._curve = (
            (np.log2([float(n) for n, _ in curve] + [1e15]), np.array([v for _, v in curve] + [self.bw]))
            if curve
            else None
        )
        opt = self.dev.optimizer_curve
        self._opt_curve = (
            (np.log2([float(n) for n, _ in opt]), np.array([v for _, v in opt], dtype=float)) if opt else None
        )
        self._profiles: dict = {}
        self._op_time: dict = {}
        self._stage_cache: dict = {}
        self.blocks: dict = {}
        self.cuts: dict = {}
        self.stages: dict = {}
        self._flops: dict = {}

    def model_flops(self, prof: ModelProfile) -> float:
        """Model FLOPs (forward + backward) of one sequence through all ranks of a replica."""
        got = self._flops.get(id(prof))
        if got is None:
            got = self._flops[id(prof)] = (
                prof.total("fwd_flops") * prof.tp + prof.total("bwd_flops") * prof.tp
            )
        return got

    # -- profiles
    def profile(self, tp: int, sp: bool) -> ModelProfile:
        key = (tp, sp)
        if key not in self._profiles:
            try:
                self._profiles[key] = profile_model(self.model, tp, self.seq_len, self.dtype, sp)
            except ScheduleError as err:
                self._profiles[key] = err
        got = self._profiles[key]
        if isinstance(got, ScheduleError):
            raise got
        return got

    # -- time of op rows for b sequences
    def bandwidth(self, nbytes: np.ndarray) -> np.ndarray:
        """Achieved bytes/s of ops moving ``nbytes`` each: the profile's ``memory_curve`` interpolated at
        ``log2(bytes)`` (the memory bandwidth beyond its last point), or the memory bandwidth without a curve."""
        if self._curve is None:
            return np.full(np.shape(nbytes), self.bw)
        xs, ys = self._curve
        return np.interp(np.log2(np.maximum(nbytes, 1.0)), xs, ys)

    def flop_rate(self, flops: np.ndarray, attention: np.ndarray) -> np.ndarray:
        """Achieved FLOP/s of ops doing ``flops`` each: an attention kernel (``attention`` true) at the profile's
        ``attention_efficiency`` of peak, a matmul at its ``matmul_curve`` interpolated at ``log2(FLOPs)`` (or
        at ``matmul_efficiency`` of peak without a curve)."""
        if self._mm_curve is None:
            rate = np.full(np.shape(flops), self.peak)
        else:
            xs, ys = self._mm_curve
            rate = np.interp(np.log2(np.maximum(flops, 1.0)), xs, ys)
        if self.attention_peak is None:
            return rate
        return np.where(attention > 0, self.attention_peak, rate)

    def ops_time(self, rows: np.ndarray, b: int, n_ops: int | None = None, extra_host: float = 0.0) -> float:
        """Seconds of op ``rows`` for ``b`` sequences: each op's roofline ``max(FLOPs / FLOP rate, bytes /
        bandwidth at its working set)`` (:meth:`flop_rate`, :meth:`bandwidth`), the FLOP side with the page faults
        of its outputs past the allocator's mmap threshold (``DeviceProfile.fresh_page_cost``: a CPU's), plus the
        host's ``op_overhead``
        per dispatched op (``n_ops``, views included; default one per row), and ``extra_host`` seconds more per
        dispatched op (torch's selective-checkpoint mode: ``DeviceProfile.selective_op_overhead``), all added where
        the host runs the kernels (a CPU). Where it queues them ahead (``launch_async``), the rows run as a
        two-stage line with an unbounded queue between: the host launches kernel ``i`` at ``H_i`` (``op_overhead``
        per kernel and ``extra_host`` per dispatch before it, views' spread evenly over the rows), and the device
        starts it once it is launched and kernel ``i - 1`` is done, so the last ends at
        ``max_j (H_j + kernels j..end)`` (the departure time of a tandem queue; between ``max(kernels, host)``
        and the sum of each op's ``max(kernel, host)``): short kernels after long ones hide their launches, a
        run of short kernels waits on the host."""
        key = (id(rows), b, n_ops, extra_host)
        t = self._op_time.get(key)
        if t is None:
            if rows.size == 0:
                t = 0.0
            else:
                nbytes = b * rows[:, 1] + rows[:, 2]
                flops = b * rows[:, 0]
                attention = rows[:, 3] if rows.shape[1] > 3 else np.zeros(len(rows))
                rate = self.flop_rate(flops, attention)
                busy = np.divide(flops, rate, out=np.zeros_like(flops), where=flops > 0)
                if self.dev.fresh_page_cost > 0 and rows.shape[1] > 5:
                    # a FLOP-bound op's outputs past the allocator's mmap threshold fault their pages in first
                    big = self.dev.fresh_page_bytes
                    act, wgt = b * rows[:, 4], rows[:, 5]
                    fresh = np.where(act >= big, act, 0.0) + np.where(wgt >= big, wgt, 0.0)
                    busy = busy + np.where(flops > 0, fresh * self.dev.fresh_page_cost, 0.0)
                roof = np.maximum(busy, nbytes / self.bandwidth(nbytes))
                oh, n = self.dev.op_overhead, (len(rows) if n_ops is None else n_ops)
                if self.dev.launch_async:
                    # the host launches kernel i at H_i (its dispatches so far); the device starts it once it is
                    # launched and kernel i-1 is done, so the last one ends at max_j (H_j + kernels j..end)
                    host = np.full(len(rows), (len(rows) * oh + n * extra_host) / len(rows))
                    t = float((np.cumsum(host) + np.cumsum(roof[::-1])[::-1]).max())
                else:
                    t = float(roof.sum()) + n * (oh + extra_host)
            self._op_time[key] = (t, rows)  # keep rows alive so the id stays theirs
            return t
        return t[0]

    def optimizer_time(self, sizes: np.ndarray, shard_dp: int = 1, partition_dp: int = 1) -> float:
        """Seconds of the optimizer step over trainable tensors of ``sizes`` elements each, as the training
        runtime runs it (``torch.optim.AdamW`` with its defaults, fp32 master weights).

        Args:
            sizes: ``(k,)`` elements per tensor (one rank's tensor-parallel shards).
            shard_dp: each tensor is split over this many ranks (FSDP: every rank steps its shard of each).
            partition_dp: the tensors are partitioned over this many ranks (ZeRO-1/2: each rank steps whole
                tensors, about a ``partition_dp``-th of them).

        With the profile's measured ``optimizer_curve`` each tensor costs its elements times the seconds per
        element measured at its size. Without it: AdamW's op sequence (:func:`adam_op_costs`: ops per tensor,
        bytes per element) at the memory bandwidth of the tensors' working set, plus ``op_overhead`` per op --
        per op on a GPU (``launch_async``: the default multi-tensor kernels take every tensor of a group at
        once), per op and tensor on a CPU (the single-tensor update).
        """
        sizes = np.asarray(sizes, dtype=float) / shard_dp
        elems, tensors = float(sizes.sum()), float(len(sizes))
        if elems <= 0:
            return 0.0
        if self._opt_curve is not None:
            return self._measured_step(sizes) / partition_dp
        ops, per_elem = adam_op_costs(4)
        if self.dev.launch_async:
            return elems * per_elem / self.bw / partition_dp + ops * self.dev.op_overhead
        each = elems / max(tensors, 1.0)  # the mean tensor's working set sets the bandwidth
        bw = float(self.bandwidth(np.array([each * per_elem / max(ops, 1)]))[0])
        return (elems * per_elem / bw + tensors * ops * self.dev.op_overhead) / partition_dp

    def accumulate_time(self, sizes: np.ndarray, shard_dp: int = 1) -> float:
        """Seconds of one gradient accumulation over trainable tensors of ``sizes`` elements each: autograd's
        ``AccumulateGrad`` adds every micro-batch's gradient after the first into ``.grad`` in place (reads two
        gradients, writes one, in the training dtype). ``shard_dp``: FSDP accumulates each rank's shard.

        With the profile's measured ``optimizer_curve`` each tensor is priced at the rate AdamW's elementwise
        passes reach over tensors of its size (that step's seconds per element, scaled by these bytes over the
        step's bytes per element, :func:`adam_op_costs`): both sweep parameter-sized tensors in place, beyond
        the caches. Without it: the bytes at the bandwidth of their working set (:meth:`bandwidth`), plus
        ``op_overhead`` per tensor.
        """
        sizes = np.asarray(sizes, dtype=float) / shard_dp
        if sizes.size == 0:
            return 0.0
        if self._opt_curve is not None:
            return self._measured_step(sizes) * 3 * self.elem / adam_op_costs(4)[1]
        nbytes = 3 * self.elem * sizes
        return float((nbytes / self.bandwidth(nbytes)).sum()) + len(sizes) * self.dev.op_overhead

    def _measured_step(self, sizes: np.ndarray) -> float:
        """Seconds of the measured optimizer step (``optimizer_curve``, interpolated at ``log2`` of each size)
        over tensors of ``sizes`` elements each."""
        xs, ys = self._opt_curve
        return float((sizes * np.interp(np.log2(np.maximum(sizes, 1.0)), xs, ys)).sum())

    def link(self, n: int, within_node: bool) -> tuple[float, float]:
        if within_node:
            return self.dev.intra_bandwidth, self.dev.intra_latency
        return self.dev.inter_bandwidth, self.dev.inter_latency

    def collective(self, op: str, nbytes: float, n: int, within_node: bool) -> float:
        if n <= 1 or nbytes <= 0:
            return 0.0
        bw, lat = self.link(n, within_node)
        steps = 2 * math.log2(n)
        factor = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
        # the backend's own all-gather / reduce-scatter against a ring (``DeviceProfile.collective_scale``)
        return (factor * nbytes / bw + steps * lat) * self._scale.get(op, 1.0)

    # -- one part at micro-batch b under a checkpoint flag
    def part_cost(self, part: PartProfile, tp: int, b: int, ckpt: str) -> tuple[float, float, float, float]:
        """(compute s, recompute s, tp comm s, saved bytes) of one micro-batch of ``b`` through ``part``."""
        key = (id(part), tp, b, ckpt)
        hit = self._stage_cache.get(key)
        if hit is not None:
            return hit
        fwd_ops = part.fwd_ops or len(part.fwd)
        compute = self.ops_time(part.fwd, b, fwd_ops) + self.ops_time(
            part.bwd, b, part.bwd_ops or len(part.bwd)
        )
        if ckpt == "all":
            recompute, saved = self.ops_time(part.recompute_all, b, fwd_ops), part.input_bytes * b
        elif ckpt == "selective":
            # torch's selective-checkpoint mode runs Python for every op of the forward and of the recomputation,
            # the kept ones too (no kernel: their outputs come from its cache); priced here as recompute
            sac = self.dev.selective_op_overhead
            recompute = (
                self.ops_time(part.recompute_selective, b, fwd_ops, sac)
                + self.ops_time(part.fwd, b, fwd_ops, sac)
                - self.ops_time(part.fwd, b, fwd_ops)
            )
            saved = part.selective_bytes * b
        else:
            recompute, saved = 0.0, part.saved_bytes * b
        comm = sum(self.collective(op, nbytes * b, tp, True) for op, _phase, nbytes in part.comm)
        out = (compute, recompute, comm, saved)
        self._stage_cache[key] = out
        return out


@lru_cache(maxsize=4)
def adam_op_costs(elem: int = 4) -> tuple[int, float]:
    """``(aten ops per tensor, bytes moved per element)`` of one eager ``torch.optim.AdamW(foreach=False)`` step,
    counted, not assumed: a second step (the first makes the state) on one 4096-element parameter of
    ``elem`` bytes per element, under a dispatch mode that counts every op and sums the bytes of its tensor
    inputs and outputs (scalar step counters included)."""

    dtype = {2: torch.bfloat16, 4: torch.float32}.get(elem, torch.float32)
    n = 4096
    p = torch.nn.Parameter(torch.ones(n, dtype=dtype))
    p.grad = torch.full((n,), 0.1, dtype=dtype)
    opt = torch.optim.AdamW([p], lr=1e-4, foreach=False)
    opt.step()

    class Count(TorchDispatchMode):
        ops, nbytes = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            Count.ops += 1
            Count.nbytes += sum(t.numel() * t.element_size() for t in _tensors((args, kwargs, out)))
            return out

    with Count():
        opt.step()
    return Count.ops, Count.nbytes / n
