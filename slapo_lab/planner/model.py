"""Per-rank memory and step time of a layout, composed from the block profiles (``slapo_lab/planner/profile.py``).

``estimate(model_or_schedule, Layout(tp=, pp=, dp=, ...), cluster=Cluster(...), seq_len=, global_batch_size=)``
returns an :class:`Estimate`: for every pipeline stage (the ``tp`` ranks of a stage and their ``dp`` replicas
hold the same bytes) memory by category, and the step time of the busiest stage by part. No forward runs per
layout: a profile is taken once per tensor-parallel degree (and sequence parallelism) and every other choice is
arithmetic on it.

Memory per rank (bytes), stage ``s`` of ``pp``, micro-batch ``b``, ``m`` micro-batches per step:

* ``params``: the stage's parameters at their tensor-parallel shape in the training dtype, ``/ dp`` under FSDP;
* ``grads``: one gradient per trainable element in the training dtype, ``/ dp`` under FSDP and ZeRO-2;
* ``optimizer``: AdamW, two fp32 moments per trainable element, plus an fp32 master copy when training in
  bf16/fp16 (12 bytes; 8 in fp32): ZeRO paper (Rajbhandari et al., 2020, section 3.1), ``/ dp`` under FSDP, ZeRO-1
  and ZeRO-2;
* ``activations``: the saved bytes of the stage's parts per micro-batch (checkpoint policy applied per block)
  times the micro-batches in flight: GPipe all ``m``; 1F1B ``min(m, pp - s)`` (Narayanan et al., 2021, "Efficient
  Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", section 2.2); interleaved 1F1B with
  ``v`` = :data:`VIRTUAL_STAGES` model chunks per rank ``min(m, pp - s) * (1 + (pp - 1) / (pp v))`` (Korthikanti
  et al., 2022, "Reducing Activation Recomputation in Large Transformer Models", section 4.2.3); plus, with
  checkpointing, one block's full activations while it is recomputed, or the gradients of the largest part's
  activations during its backward (:data:`BACKWARD_WORKSET`), or, on the last stage, the two gradients of the
  model output's size that the loss's backward holds at once (w.r.t. the log-softmax output and w.r.t. the
  logits), whichever is larger (one part at a time); plus, without pipelining, the model's output itself (the
  caller holds it through backward; a pipeline's are ``pp_outputs``). With ONE
  micro-batch per step the gradients do not exist yet while the activations peak (the previous step set them to
  None, ``zero_grad(set_to_none=True)``; backward makes them as it frees the activations), so only the part of the
  activations beyond the gradients counts; with more, the earlier micro-batches' gradients are there and all of
  it counts;
* ``fsdp_gather``: under FSDP2 (``torch.distributed.fsdp.fully_shard`` on every block, then the root), the root
  unit's unsharded parameters (everything outside the blocks: ``fully_shard`` keeps the root gathered from
  forward to backward), plus the larger of (a) the gathered parameters of the current and the prefetched block and
  the unsharded gradients of one block (:data:`FSDP_PREFETCH_BLOCKS`) and (b) the root's reduce-scatter, which runs
  last, after the activations are freed: its unsharded gradients and the output shard (and, when earlier
  micro-batches left a shard, the new one beside it);
* ``ddp_buckets``: DDP's reducer copies every gradient into its flat buckets (``gradient_as_bucket_view=False``,
  the default, as :func:`slapo_lab.train.parallel.wrap_ddp` builds it): one more gradient-sized buffer for
  ``shard="none"`` and ``"zero1"`` (which all-reduces through the same reducer) with ``dp > 1``;
* ``pp_outputs``: with ``pp > 1``, the last stage's outputs of every micro-batch (a causal LM's logits), which
  ``torch.distributed.pipelining`` keeps until the step returns them merged;
* ``optimizer_step``: AdamW's temporaries (:data:`ADAM_TEMPORARIES` fp32 copies of the largest parameter tensor,
  that tensor's shard under FSDP, whole under ZeRO whose partitions hold whole tensors) where they exceed the
  activations, which the step runs without;
* ``headroom``: :data:`ALLOCATOR_HEADROOM` of the above for the caching allocator's fragmentation.

Step time (seconds), the busiest stage:

* compute: every aten op of the stage's parts as a roofline, ``max(FLOPs / (peak x matmul_efficiency), bytes /
  (HBM bandwidth x memory_efficiency))`` (``devices.py`` gives the efficiencies and their sources; a fused
  attention kernel runs at ``attention_efficiency`` of peak instead; a calibrated profile's ``matmul_curve``
  gives a matmul's rate at its own size, and its ``memory_curve`` the bandwidth at the op's own working set),
  plus the host's
  ``op_overhead`` per dispatched op (views included) where the host runs the kernels (a CPU), or, where it queues
  them ahead (a GPU), per kernel launch, each pass priced as a line of launches then kernels (a kernel starts once
  launched and once the one before it ends: :meth:`Pricer.ops_time`), forward and backward, ``m`` times; and from
  the second micro-batch on, autograd's accumulation of each new gradient into ``.grad`` (an in-place add over
  the rank's gradients, :meth:`Pricer.accumulate_time`);
* recompute: the forward ops a checkpoint runs again (all of a checkpointed block's; selective: those whose
  outputs are not kept, and the host time torch's selective-checkpoint mode adds to every op of the forward and
  of the recomputation, ``DeviceProfile.selective_op_overhead``);
* exposed communication: tensor-parallel syncs (not overlapped), pipeline sends of the boundary activation
  (forward and backward), and the part of the data-parallel traffic that compute does not hide: DDP and ZeRO
  all-reduce / reduce-scatter the gradients during the last micro-batch's backward, ZeRO all-gathers the updated
  parameters after the step, FSDP all-gathers parameters (forward and backward, bf16) and reduce-scatters
  gradients (fp32: torchtitan's ``mixed_precision_reduce`` default) each micro-batch behind that micro-batch's
  compute, one collective per block (each its latency), and copies the gathered bytes into the parameters and the
  gradients into the reduce-scatter's input (read + write, at the memory bandwidth). The device's
  ``comm_overlap`` is the fraction of data-parallel traffic compute hides (1 for NCCL; measured for gloo, which
  on a CPU competes with the ranks' compute), and its ``collective_scale`` what the backend's all-gather and
  reduce-scatter cost against a ring. Ring collectives: all-reduce ``2 (n - 1) / n x bytes / bandwidth``,
  all-gather and reduce-scatter ``(n - 1) / n x bytes / bandwidth``, plus ``2 log2(n)`` latencies (NCCL's tree for the latency term);
  a group inside one node uses the node's links, any other the per-GPU network bandwidth;
* bubble: the pipeline's fill and drain, every stage's micro-batch time but the busiest one's, ``/ v``, for GPipe
  and 1F1B (``v = 1``) and interleaved 1F1B: with equal stages ``(pp - 1) / v`` stage-times, the fraction
  ``(pp - 1) / (m v + pp - 1)`` of the step (Narayanan et al., 2021, section 2.2); unequal stages (the head's
  stage is heavier) fill and drain with their own, shorter times;
* optimizer: AdamW's elementwise update over the rank's share of the trainable elements (fp32 master weights),
  memory bound, as ``slapo_lab.train`` builds it (``torch.optim.AdamW`` with its defaults): its op sequence's
  bytes per element counted from AdamW itself (:func:`adam_op_costs`) / (HBM bandwidth x memory_efficiency),
  plus ``op_overhead`` per op -- once per op on a GPU, where the default multi-tensor (``foreach``) kernels take
  every tensor at once, per op and tensor on a CPU, where the single-tensor update runs.

MFU: model FLOPs (``FlopCounterMode``'s forward + backward, no recompute, attention counted in full) per step
over ``GPUs x peak x step time``.

Constants, each with its source (none is fitted to a published run): :data:`ALLOCATOR_HEADROOM`,
:data:`BACKWARD_WORKSET`, :data:`VIRTUAL_STAGES`, :data:`FSDP_PREFETCH_BLOCKS`,
and the device profile's ``matmul_efficiency`` / ``memory_efficiency`` / latencies (``devices.py``).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field, replace
from functools import lru_cache

import numpy as np

from .. import presets
from ..errors import ScheduleError
from ..parallel_dims import ParallelDims
from .devices import DeviceProfile, GiB, device_profile
from .pricer import Pricer
from .profile import ModelProfile

__all__ = [
    "ALLOCATOR_HEADROOM",
    "BACKWARD_WORKSET",
    "CHECKPOINTS",
    "PP_SCHEDULES",
    "SHARDS",
    "Cluster",
    "Estimate",
    "Layout",
    "estimate",
]

#: Fraction of the live bytes the caching allocator holds beyond them (fragmentation): GMLake (Guo et al., ASPLOS
#: 2024, "GMLake: Efficient and Transparent GPU Memory Defragmentation for Large-scale DNN Training with Virtual
#: Memory Stitching") measured 15 % fragmentation on average (up to 33 %) for eight LLMs on A100-80GB with
#: PyTorch's caching allocator.
ALLOCATOR_HEADROOM = 0.15
#: Backward of a part holds the gradients of its saved activations while it runs: at most as many bytes as the
#: part saved for one micro-batch (each saved tensor has a gradient of its size at most); counted once, for the
#: largest part of the stage (an upper-bound approximation of ours, not measured).
BACKWARD_WORKSET = 1.0
#: fp32 temporaries of one parameter's size that AdamW's single-tensor update holds at once (``exp_avg_sq.sqrt()``
#: and its quotient in ``torch/optim/adamw.py``, ``_single_tensor_adam``); the largest parameter tensor sets them.
ADAM_TEMPORARIES = 2
#: Model chunks per rank of the interleaved schedule (Megatron-LM's ``--num-layers-per-virtual-pipeline-stage``
#: choice in Narayanan et al., 2021 experiments uses 2 and more; we price 2).
VIRTUAL_STAGES = 2
#: FSDP2 keeps the current block's and the prefetched next block's unsharded parameters.
FSDP_PREFETCH_BLOCKS = 2

SHARDS = ("none", "fsdp", "zero1", "zero2")
PP_SCHEDULES = ("1F1B", "GPipe", "interleaved")
CHECKPOINTS = ("none", "all", "selective")


@dataclass(frozen=True)
class Layout:
    """One parallel layout of a training run.

    Attributes:
        tp / pp / dp: tensor-, pipeline- and data-parallel degrees (:class:`slapo_lab.parallel_dims.ParallelDims`).
        shard: ``"none"`` (DDP), ``"fsdp"`` (FSDP2), ``"zero1"`` or ``"zero2"`` (DeepSpeed ZeRO stages 1, 2).
        micro_batch_size: sequences per micro-batch per replica.
        checkpoint: ``"none"``, ``"all"`` blocks, ``"selective"`` (per op: :data:`~.profile.SELECTIVE_SAVE`), or
            an int ``k``: every k-th block (blocks ``0, k, 2k, ...``, as ``presets.checkpoint_blocks(every=k)``).
        pp_schedule: ``"1F1B"``, ``"GPipe"`` or ``"interleaved"`` (1F1B with :data:`VIRTUAL_STAGES` chunks).
        sequence_parallel: Megatron sequence parallelism with the tensor-parallel preset.

    Raises:
        ScheduleError: a field outside its choices (one sentence naming it).
    """

    tp: int
    pp: int
    dp: int
    shard: str = "none"
    micro_batch_size: int = 1
    checkpoint: str | int = "none"
    pp_schedule: str = "1F1B"
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        try:  # kept: a search reads ``dims`` of every layout several times
            object.__setattr__(self, "_dims", ParallelDims(self.tp, self.pp, self.dp))
        except ValueError as err:
            raise ScheduleError(f"Layout: {err}") from err
        if self.shard not in SHARDS:
            raise ScheduleError(f"Layout: shard must be one of {', '.join(SHARDS)}, not {self.shard!r}.")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ScheduleError(
                f"Layout: pp_schedule must be one of {', '.join(PP_SCHEDULES)}, not {self.pp_schedule!r}."
            )
        ck = self.checkpoint
        if not (ck in CHECKPOINTS or (isinstance(ck, int) and not isinstance(ck, bool) and ck >= 1)):
            raise ScheduleError(
                f"Layout: checkpoint must be 'none', 'all', 'selective' or a positive int k, not {ck!r}."
            )
        if (
            isinstance(self.micro_batch_size, bool)
            or not isinstance(self.micro_batch_size, int)
            or (self.micro_batch_size < 1)
        ):
            raise ScheduleError(
                f"Layout: micro_batch_size must be a positive int, not {self.micro_batch_size!r}."
            )

    @property
    def dims(self) -> ParallelDims:
        """The layout's :class:`~slapo_lab.parallel_dims.ParallelDims` (tp, pp, dp)."""
        return self._dims

    def describe(self) -> str:
        """``tp 8 x pp 2 x dp 4, fsdp, mbs 1, checkpoint selective, 1F1B``."""
        ck = self.checkpoint if isinstance(self.checkpoint, str) else f"every {self.checkpoint}"
        sp = ", sequence parallel" if self.sequence_parallel else ""
        pps = f", {self.pp_schedule}" if self.pp > 1 else ""
        return f"{self.dims.describe()}, {self.shard}, mbs {self.micro_batch_size}, checkpoint {ck}{pps}{sp}"


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``gpus_per_node`` accelerators of one kind (``gpu``: a built-in name or a DeviceProfile)."""

    nodes: int = 1
    gpus_per_node: int = 8
    gpu: str | DeviceProfile = "H100-SXM"

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ScheduleError(f"Cluster: {name} must be a positive int, not {v!r}.")
        try:
            device_profile(self.gpu)
        except ValueError as err:  # an unknown name fails here, in one sentence
            raise ScheduleError(f"Cluster: {err}") from err

    @property
    def device(self) -> DeviceProfile:
        return device_profile(self.gpu)

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass
class Estimate:
    """The predicted cost of one layout (see the module docstring for every term).

    Attributes:
        layout / cluster: what was priced.
        memory: ``{stage: {category: bytes}}`` per rank of each stage; categories ``params``, ``grads``,
            ``optimizer``, ``activations``, ``fsdp_gather``, ``ddp_buckets``, ``pp_outputs``, ``optimizer_step``,
            ``headroom``.
        peak_memory_bytes: the busiest rank's total (bytes, headroom included).
        step_time_s: seconds per optimizer step.
        time_parts: ``{"compute", "exposed_comm", "bubble", "recompute", "optimizer"}`` seconds; they add up to
            ``step_time_s``.
        tokens_per_s_per_gpu / mfu: throughput per GPU and model FLOPs utilisation (0..1).
        micro_batches: micro-batches per step and replica.
        stage_blocks: blocks per pipeline stage (the balanced cuts).
        fits: ``peak_memory_bytes`` <= the device's memory.
        stage_micro_batch_s: seconds of one micro-batch (forward, backward, recompute, tensor-parallel and
            pipeline communication) on each stage; the bubble is their sum less the busiest one's (over ``v``).
    """

    layout: Layout
    cluster: Cluster
    stage_memory: dict  # category -> numpy array over stages (bytes per rank)
    peak_memory_bytes: int
    step_time_s: float
    time_parts: dict
    tokens_per_s_per_gpu: float
    mfu: float
    micro_batches: int
    stage_blocks: list
    fits: bool
    stage_micro_batch_s: list = field(default_factory=list)

    @property
    def memory(self) -> dict:
        """``{stage: {category: bytes}}`` per rank of each stage."""
        cats = self.stage_memory
        n = len(next(iter(cats.values())))
        return {s: {k: int(v[s]) for k, v in cats.items()} for s in range(n)}

    @property
    def peak_live_bytes(self) -> int:
        """The busiest rank's live tensor bytes (the peak without the allocator's headroom)."""
        return max(sum(v for k, v in cats.items() if k != "headroom") for cats in self.memory.values())

    def export_options(self) -> dict:
        """The export form's fields for this plan: ``dp``, ``shard``, ``micro_batch_size``,
        ``global_batch_size``, ``grad_accumulation``, ``pp``, ``pp_schedule``, ``tp``, and the prediction the
        exported script prints its measurements against: ``predicted_step_s`` (seconds) and
        ``predicted_peak_gib`` (the busiest rank's live bytes in GiB, headroom left out, as
        ``torch.cuda.max_memory_allocated`` counts them)."""
        lay = self.layout
        return {
            "tp": lay.tp,
            "pp": lay.pp,
            "dp": lay.dp,
            "shard": lay.shard,
            "micro_batch_size": lay.micro_batch_size,
            "global_batch_size": lay.micro_batch_size * lay.dp * self.micro_batches,
            "grad_accumulation": self.micro_batches,
            "pp_schedule": lay.pp_schedule,
            "predicted_step_s": round(self.step_time_s, 6),
            "predicted_peak_gib": round(self.peak_live_bytes / GiB, 3),
        }

    def apply(self, sch) -> list:
        """Record this plan on ``sch`` as ordinary primitive calls, all or nothing (:func:`slapo_lab.presets.atomic`):
        the Megatron preset for ``tp > 1`` (unless something is sharded already), ``checkpoint_blocks`` for
        ``"all"``, every k-th block or ``"selective"`` (``checkpoint(policy="selective")`` on every block), and ``cut_pipeline_stage`` after the last block of every stage but the last
        (the balanced cuts of ``stage_blocks``). The calls are undoable and exported like any others, and the
        presets check them numerically.

        Returns:
            list: the recorded calls.

        Raises:
            ScheduleError: ``sch`` is not for ``tp`` ranks, the plan interleaves stages (not a schedule option
                yet), or a primitive refuses (one sentence; nothing recorded).
        """

        lay = self.layout
        if sch.world_size != lay.tp:
            raise ScheduleError(
                f"apply: the schedule is for {sch.world_size} tensor-parallel ranks, the plan for tp {lay.tp}; "
                f"create it with world_size={lay.tp}."
            )
        if lay.pp > 1 and lay.pp_schedule == "interleaved":
            raise ScheduleError(
                "apply: interleaved stages are not a schedule option yet; pick a 1F1B or GPipe plan."
            )
        start = len(sch.record)
        with presets.atomic(sch):
            if lay.tp > 1 and not _sharded(sch):
                presets.megatron_tp(sch, sequence_parallel=lay.sequence_parallel)
            if lay.checkpoint in ("all", "selective") or isinstance(lay.checkpoint, int):
                every = lay.checkpoint if isinstance(lay.checkpoint, int) else 1
                policy = "selective" if lay.checkpoint == "selective" else "full"
                presets.checkpoint_blocks(sch, every=every, policy=policy)
            if lay.pp > 1:
                blocks = presets.find_blocks(sch)
                ends = list(itertools.accumulate(self.stage_blocks))[:-1]
                for end in ends:
                    sch[blocks[end - 1]].cut_pipeline_stage()
        return list(sch.record.calls[start:])

    def summary(self) -> str:
        """One line: layout, peak memory, step time, tokens/s/GPU, MFU."""
        return (
            f"{self.layout.describe()}: {self.peak_memory_bytes / GiB:.1f} GiB, {self.step_time_s:.3f} s/step, "
            f"{self.tokens_per_s_per_gpu:,.0f} tok/s/GPU, MFU {self.mfu:.1%}"
        )


def _checkpointed(i: int, checkpoint) -> str:
    if checkpoint in ("none", "all", "selective"):
        return checkpoint
    return "all" if i % checkpoint == 0 else "none"


def _partition(costs: list[float], k: int) -> list[int]:
    """Cut ``costs`` (in order) into ``k`` contiguous non-empty groups minimising the largest sum (bisection on
    the bottleneck, each candidate checked by a greedy fill over prefix sums); returns the group sizes."""
    n = len(costs)
    if k >= n:
        return [1] * n + [0] * (k - n)
    prefix = list(itertools.accumulate(costs, initial=0.0))

    def groups(limit: float) -> list[int] | None:
        sizes, i = [], 0
        while i < n:
            if len(sizes) == k:
                return None
            # the furthest j with prefix[j] - prefix[i] <= limit, leaving one item per group still to open
            j = bisect.bisect_right(prefix, prefix[i] + limit, i + 1, n + 1) - 1
            j = max(i + 1, min(j, n - (k - len(sizes) - 1)))
            sizes.append(j - i)
            i = j
        return sizes

    def bottleneck(sizes: list[int]) -> float:
        ends = list(itertools.accumulate(sizes, initial=0))
        return max(prefix[e] - prefix[a] for a, e in itertools.pairwise(ends))

    # bisection on the limit; a feasible one drops to the largest group sum its fill reached (the optimum is not
    # above it), and the search ends once a hair below that is infeasible: it is the optimum
    lo, hi = max(costs), prefix[-1]
    for _ in range(30):
        mid = (lo + hi) / 2
        got = groups(mid)
        if got is None:
            lo = mid
            continue
        hi = min(mid, bottleneck(got))
        if groups(hi * (1 - 1e-12)) is None:
            break
    sizes = groups(hi * (1 + 1e-9)) or [n]
    while len(sizes) < k:  # split the largest group until there are k
        j = max(range(len(sizes)), key=lambda i: sizes[i])
        a = sizes[j] // 2
        sizes[j : j + 1] = [sizes[j] - a, a]
    return sizes


def _sharded(sch) -> list:
    """Parameters of ``sch``'s model that a shard call annotated (``orig_shape``)."""
    return [p for p in sch.mod.parameters() if getattr(p, "orig_shape", None) is not None]


def _acc(xs: list) -> list:
    return list(itertools.accumulate(xs, initial=0.0))


class _Blocks:
    """Per-block figures of one (TP degree, sequence parallelism, micro-batch, checkpoint policy), in model
    order, with prefix sums for the stage ranges."""

    def __init__(self, pr: Pricer, prof: ModelProfile, tp: int, b: int, checkpoint):
        seq = [p for p in prof.blocks for _ in range(p.count)]
        rows = [(p, _checkpointed(i, checkpoint)) for i, p in enumerate(seq)]
        cost: dict = {}
        compute, recompute, comm, saved, full, largest, params, train, big = ([] for _ in range(9))
        for p, ck in rows:
            key = (id(p), ck)
            if key not in cost:
                cost[key] = pr.part_cost(p, tp, b, ck)
            c, r, cm, sv = cost[key]
            compute.append(c)
            recompute.append(r)
            comm.append(cm)
            saved.append(sv)
            full.append(p.saved_bytes * b if ck != "none" else 0.0)
            largest.append(p.saved_bytes * b)
            params.append(p.param_bytes)
            train.append(p.trainable_elems)
            big.append(p.largest_param_elems)
        self.time = [c + r + cm for c, r, cm in zip(compute, recompute, comm, strict=False)]
        # prefix sums over the blocks (index ``i`` sums blocks ``[0, i)``), and per-block maxima with a trailing 0:
        # ``np.maximum.reduceat``'s last chunk runs to the array's end and an empty chunk at the end starts there
        # (every figure is >= 0, so the 0 changes no maximum)
        self.prefix = {
            "compute": np.array(_acc(compute)),
            "recompute": np.array(_acc(recompute)),
            "comm": np.array(_acc(comm)),
            "saved": np.array(_acc(saved)),
            "params": np.array(_acc(params)),
            "trainable": np.array(_acc(train)),
        }
        self.peaks = {
            "full": np.array(full + [0.0]),
            "largest": np.array(largest + [0.0]),
            "unit": np.array(params + [0], dtype=float),
            "big_param": np.array(big + [0], dtype=float),
        }
        # every block's trainable tensor sizes, flattened in order, and the index where each block's sizes start
        self.flat_sizes = np.array([n for p, _ in rows for n in p.param_sizes], dtype=float)
        self.size_at = np.array(_acc([len(p.param_sizes) for p, _ in rows]), dtype=int)


class _StageSizes:
    """Per stage, the elements of each trainable tensor it holds (``(k,)`` float arrays), built when first read:
    the search reads only the busiest stage's."""

    def __init__(self, blk: _Blocks, ranges: list, ends: list):
        self.blk, self.ranges, self.ends = blk, ranges, ends
        self._built: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.ranges)

    def __getitem__(self, s: int) -> np.ndarray:
        got = self._built.get(s)
        if got is None:
            blk = self.blk
            held = [blk.flat_sizes[blk.size_at[a] : blk.size_at[e]] for a, e in self.ranges[s]]
            held += [np.array(part.param_sizes, dtype=float) for part in self.ends[s]]
            got = self._built[s] = np.concatenate(held) if held else np.zeros(0)
        return got


def _stage_table(blk: _Blocks, chunks: list, pp: int, prof: ModelProfile, pre, post, b: int) -> dict:
    """Per-stage sums of one cut (rank ``s`` holds chunks ``s, s + pp, ...``): numpy arrays over stages, and
    ``"param_sizes"``, per stage the elements of each trainable tensor it holds (:class:`_StageSizes`).

    ``chunks``: the blocks per chunk, ``pp x v`` of them (``v`` chunks per stage, interleaved); ``pre`` and
    ``post``: :meth:`Pricer.part_cost` of the parts before the first block (on stage 0) and after the last (on
    stage ``pp - 1``); ``b``: the micro-batch size, in sequences.
    """
    sizes = np.asarray(chunks, dtype=int)
    v = len(chunks) // pp
    starts = np.concatenate(([0], np.cumsum(sizes)))
    a, e = starts[:-1], starts[1:]
    out = {k: (pre_[e] - pre_[a]).reshape(v, pp).sum(axis=0) for k, pre_ in blk.prefix.items()}
    for k, arr in blk.peaks.items():
        # each chunk's largest block (0 for an empty chunk), then each stage's largest chunk
        peak = np.where(sizes > 0, np.maximum.reduceat(arr, a), 0.0)
        out[k] = peak.reshape(v, pp).max(axis=0)
    out["nparts"] = sizes.reshape(v, pp).sum(axis=0).astype(float)
    out["root"], out["root_train"] = np.zeros(pp), np.zeros(pp)
    ends = [[] for _ in range(pp)]
    ends[0].append((prof.pre, pre))
    ends[pp - 1].append((prof.post, post))
    for s in {0, pp - 1}:
        for part, (c, r, cm, sv) in ends[s]:
            # pre/post run once per micro-batch and are freed by its backward on the same stage
            out["compute"][s] += c
            out["recompute"][s] += r
            out["comm"][s] += cm
            out["saved"][s] += sv
            out["params"][s] += part.param_bytes
            out["trainable"][s] += part.trainable_elems
            out["root"][s] += part.param_bytes
            out["root_train"][s] += part.trainable_elems
            out["largest"][s] = max(out["largest"][s], part.saved_bytes * b)
            out["big_param"][s] = max(out["big_param"][s], part.largest_param_elems)
            if not out["unit"][s]:
                out["unit"][s] = part.param_bytes
    ranges = [list(zip(a[s::pp].tolist(), e[s::pp].tolist(), strict=True)) for s in range(pp)]
    out["param_sizes"] = _StageSizes(blk, ranges, [[part for part, _ in ends[s]] for s in range(pp)])
    out["time"] = out["compute"] + out["recompute"] + out["comm"]
    out["zero"] = np.zeros(pp)
    return out


def _check_layout(pr: Pricer, layout: Layout, global_batch_size: int) -> tuple[ModelProfile, int, int]:
    """``(profile, micro-batches, virtual stages)`` of a layout the cluster and model can run.

    Raises:
        ScheduleError: the one sentence that rejects it (too many GPUs, TP beyond a node, a batch that does not
            divide, heads TP does not divide, more stages than blocks, interleaving without whole rounds).
    """
    cl = pr.cluster
    tp, pp, dp, b = layout.tp, layout.pp, layout.dp, layout.micro_batch_size
    dims = layout.dims
    if dims.world_size > cl.gpus:
        raise ScheduleError(f"{dims.describe()} needs {dims.world_size} GPUs; the cluster has {cl.gpus}.")
    if tp > cl.gpus_per_node:
        raise ScheduleError(f"TP {tp} is beyond a node of {cl.gpus_per_node} GPUs.")
    if global_batch_size % (dp * b):
        raise ScheduleError(
            f"the global batch of {global_batch_size} does not divide into dp {dp} x micro-batch {b}."
        )
    m = global_batch_size // (dp * b)
    prof = pr.profile(tp, layout.sequence_parallel)
    if tp > 1 and prof.kv_heads and prof.kv_heads % tp:
        raise ScheduleError(f"TP {tp} does not divide {prof.kv_heads} KV heads.")
    if tp > 1 and prof.heads and prof.heads % tp:
        raise ScheduleError(f"TP {tp} does not divide {prof.heads} heads.")
    v = VIRTUAL_STAGES if layout.pp_schedule == "interleaved" and pp > 1 else 1
    if pp * v > prof.num_blocks:
        raise ScheduleError(f"PP {pp} x {v} chunk(s) exceeds the {prof.num_blocks} blocks.")
    if v > 1 and m % pp:
        raise ScheduleError(f"interleaved 1F1B needs the {m} micro-batches to be a multiple of PP {pp}.")
    return prof, m, v


def _check_key(tp, pp, dp, shard, micro_batch_size, checkpoint, pp_schedule, sequence_parallel) -> tuple:
    """Of a :class:`Layout`'s fields (in its order), those :func:`_check_layout` reads (not the shard, not the
    checkpoint): layouts that share them get the same answer."""
    return (tp, pp, dp, micro_batch_size, sequence_parallel, pp_schedule == "interleaved")


def _stages(pr: Pricer, prof: ModelProfile, layout: Layout, v: int) -> dict:
    """The stage table (:func:`_stage_table`) of a layout: its blocks cut into ``pp x v`` chunks balanced on
    micro-batch-1 costs (the micro-batch scales every block alike); each piece cached on the pricer."""
    tp, pp, b, ck, sp = (
        layout.tp,
        layout.pp,
        layout.micro_batch_size,
        layout.checkpoint,
        layout.sequence_parallel,
    )
    st = pr.stages.get((tp, sp, b, ck, pp, v))
    if st is not None:
        return st
    blk = pr.blocks.get((tp, sp, b, ck))
    if blk is None:
        blk = pr.blocks[(tp, sp, b, ck)] = _Blocks(pr, prof, tp, b, ck)
    pre = pr.part_cost(prof.pre, tp, b, "none")
    post = pr.part_cost(prof.post, tp, b, "none")
    pkey = (tp, sp, ck, pp * v)
    chunks = pr.cuts.get(pkey)
    if chunks is None:
        one = pr.blocks.get((tp, sp, 1, ck)) or pr.blocks.setdefault(
            (tp, sp, 1, ck), _Blocks(pr, prof, tp, 1, ck)
        )
        costs = list(one.time)
        costs[0] += sum(pr.part_cost(prof.pre, tp, 1, "none")[:3])
        costs[-1] += sum(pr.part_cost(prof.post, tp, 1, "none")[:3])
        chunks = pr.cuts[pkey] = _partition(costs, pp * v) if pp * v > 1 else [prof.num_blocks]
    st = pr.stages[(tp, sp, b, ck, pp, v)] = _stage_table(blk, chunks, pp, prof, pre, post, b)
    return st


def _in_flight(layout: Layout, m: int, v: int):
    """Micro-batches whose activations a stage holds at its peak: 1 without a pipeline, all ``m`` under GPipe,
    ``min(m, pp - stage)`` under 1F1B (more by ``(pp - 1) / (pp v)`` interleaved)."""
    pp = layout.pp
    if pp == 1:
        return 1.0
    if layout.pp_schedule == "GPipe":
        return float(m)
    in_flight = np.minimum(m, pp - np.arange(pp)).astype(float)
    return in_flight * (1 + (pp - 1) / (pp * v)) if v > 1 else in_flight


def _memory(pr: Pricer, prof: ModelProfile, st: dict, layout: Layout, m: int, v: int) -> dict:
    """Per-stage bytes by category (arrays over the stages; see the module docstring)."""
    pp, dp, b, shard = layout.pp, layout.dp, layout.micro_batch_size, layout.shard
    div_p = dp if shard == "fsdp" else 1
    div_g = dp if shard in ("fsdp", "zero2") else 1
    div_o = dp if shard != "none" else 1
    opt_bytes = 12 if pr.dtype != "fp32" else 8
    in_flight = _in_flight(layout, m, v)
    grads = st["trainable"] * (pr.elem / div_g)
    # the model's output (a causal LM's logits, ``post.output_bytes``) on the last stage: held by the caller
    # through backward (one micro-batch's; a pipeline keeps every micro-batch's: ``pp_outputs``), and its
    # backward holds two gradients of that size at once (the loss's gradient w.r.t. the log-softmax output and
    # log_softmax_backward's result, w.r.t. the logits)
    out_b = np.where(np.arange(pp) == pp - 1, b * prof.post.output_bytes, 0.0)
    held = out_b if pp == 1 else 0.0
    # one part at a time is recomputed (a checkpointed block's full activations) or holds the gradients of
    # its saved tensors: the larger of the transients, not all
    transient = np.maximum(np.maximum(st["full"], BACKWARD_WORKSET * st["largest"]), 2 * out_b)
    act = st["saved"] * in_flight + held + transient
    # with one micro-batch the gradients do not exist yet while the activations peak (the step before set them to
    # None; backward makes them as it frees the activations); with more, the earlier micro-batches' are there
    act_over_grads = act if m > 1 else np.maximum(0.0, act - grads)
    if shard == "fsdp" and dp > 1:
        # FSDP2: every block's parameters are gathered (current + prefetched) and its unsharded gradients made
        # during its backward; the root unit (the parameters outside the blocks) stays gathered through forward
        # and backward (``fully_shard`` does not reshard the root after forward), and its reduce-scatter runs
        # last, once the activations are freed: the unsharded gradients copied into the reduce-scatter input,
        # and the output shard (a new buffer added to the accumulated shard when earlier micro-batches left one)
        blocks_ws = (FSDP_PREFETCH_BLOCKS + 1) * st["unit"]
        root_g = st["root_train"] * pr.elem
        root_rs = root_g * (1 + 1 / dp) + (root_g / dp if m > 1 else 0.0)
        gather = st["root"] + np.maximum(blocks_ws, root_rs - act_over_grads)
    else:
        gather = st["zero"]
    cats = {
        "params": st["params"] / div_p,
        "grads": grads,
        "optimizer": st["trainable"] * (opt_bytes / div_o),
        "activations": act_over_grads,
        "fsdp_gather": gather,
        # DDP's reducer copies every gradient into its flat buckets (``gradient_as_bucket_view=False``, the
        # default, as ``train.parallel.wrap_ddp`` builds it): one more gradient-sized buffer per rank, held from
        # the first backward on (``torch.nn.parallel.DistributedDataParallel`` docs); ZeRO-1 all-reduces
        # through the same DDP reducer (``torch.distributed.optim.ZeroRedundancyOptimizer`` over DDP)
        "ddp_buckets": st["trainable"] * pr.elem if dp > 1 and shard in ("none", "zero1") else st["zero"],
        # torch.distributed.pipelining's last stage keeps every micro-batch's output until the step returns
        # them merged (``PipelineScheduleSingle._step_microbatches``: ``output_chunks``)
        "pp_outputs": np.where(np.arange(pp) == pp - 1, m * b * prof.post.output_bytes, 0.0)
        if pp > 1
        else st["zero"],
    }
    # the optimizer step runs after the activations and gathered parameters are freed: its temporaries count
    # where they exceed them;
    # FSDP steps each rank's shard of every tensor, ZeRO-1/2 whole tensors of the rank's partition
    temps = ADAM_TEMPORARIES * 4 * st["big_param"] / (dp if shard == "fsdp" else 1)
    cats["optimizer_step"] = np.maximum(0.0, temps - cats["activations"] - cats["fsdp_gather"])
    cats["headroom"] = ALLOCATOR_HEADROOM * sum(cats.values())
    return cats


def _dp_exposed(pr: Pricer, layout: Layout, st: dict, busiest: int, m: int) -> float:
    """Seconds of the busiest stage's data-parallel traffic that compute does not hide (the device's
    ``comm_overlap`` of it runs under compute)."""
    dp, shard = layout.dp, layout.shard
    if dp == 1:
        return 0.0
    within_node_dp = layout.dims.world_size <= pr.cluster.gpus_per_node
    compute, recompute = float(st["compute"][busiest]), float(st["recompute"][busiest])
    params, trainable = float(st["params"][busiest]), float(st["trainable"][busiest])
    ov = pr.dev.comm_overlap
    bwd_last = compute * 2 / 3  # backward is about two thirds of a micro-batch's compute
    if shard in ("none", "zero1"):  # ZeRO-1 all-reduces through DDP's reducer, then gathers the partitions
        t = pr.collective("all_reduce", trainable * pr.elem, dp, within_node_dp)
        gather = pr.collective("all_gather", params, dp, within_node_dp) if shard == "zero1" else 0.0
        return t - ov * min(t, bwd_last) + gather
    if shard == "zero2":
        rs = pr.collective("reduce_scatter", trainable * pr.elem, dp, within_node_dp)
        ag = pr.collective("all_gather", params, dp, within_node_dp)
        return rs - ov * min(rs, bwd_last) + ag
    # fsdp: per micro-batch, behind its compute; the first all-gather of each pass is exposed; one all-gather /
    # reduce-scatter per fully_shard unit (a block), each its latency
    units = max(1, int(st["nparts"][busiest]))
    ag = units * pr.collective("all_gather", params / units, dp, within_node_dp)
    rs = units * pr.collective("reduce_scatter", trainable * 4 / units, dp, within_node_dp)
    traffic = 2 * ag + rs
    # FSDP2 copies each all-gather's output into the parameters and the gradients into the reduce-scatter
    # input (``_fsdp_collectives.py``: ``split_with_sizes_copy``, ``chunk_cat``): read + write of the
    # unsharded bytes, on the compute stream
    copied = 2 * (2 * params + trainable * 4)
    copy_t = copied / float(pr.bandwidth(np.array([2 * params / units]))[0])
    return m * (traffic - ov * min(traffic, compute + recompute) + 2 * ag / units + copy_t)


def _price(
    pr: Pricer, layout: Layout, global_batch_size: int, checked: tuple[ModelProfile, int, int] | None = None
) -> Estimate:
    """The :class:`Estimate` of ``layout`` (raises ScheduleError with the rejection sentence); ``checked``: what
    :func:`_check_layout` returned for it, if the caller has it."""
    cl, dev = pr.cluster, pr.dev
    pp, dp, b = layout.pp, layout.dp, layout.micro_batch_size
    prof, m, v = checked or _check_layout(pr, layout, global_batch_size)
    st = _stages(pr, prof, layout, v)
    cats = _memory(pr, prof, st, layout, m, v)
    total = sum(cats.values())
    p2p = 0.0
    if pp > 1:
        boundary = max(prof.pre.output_bytes, *(p.output_bytes for p in prof.blocks)) * b
        bw, lat = pr.link(2, layout.dims.replica <= cl.gpus_per_node)
        p2p = 2 * (boundary / bw + lat) * v
    busiest = int(np.argmax(st["time"]))
    t_mb = float(st["time"][busiest]) + p2p
    compute, recompute = float(st["compute"][busiest]), float(st["recompute"][busiest])
    comm_mb = float(st["comm"][busiest]) + p2p
    # FSDP steps each rank's shard of every tensor; ZeRO-1/2 whole tensors, a dp-th of them per rank
    fsdp = layout.shard == "fsdp"
    optimizer = pr.optimizer_time(
        st["param_sizes"][busiest],
        shard_dp=dp if fsdp else 1,
        partition_dp=dp if layout.shard in ("zero1", "zero2") else 1,
    )
    # pipeline fill and drain: each other stage's micro-batch time once (1F1B and GPipe alike, Narayanan et al.
    # 2021, section 2.2, with the stages' own times instead of the busiest one's), over v chunks when interleaved
    stage_t = st["time"] + p2p
    bubble = (float(stage_t.sum()) - t_mb) / v if pp > 1 else 0.0
    # every micro-batch after the first adds its gradients into the ones held (FSDP: the rank's shards)
    accumulate = (m - 1) * pr.accumulate_time(st["param_sizes"][busiest], shard_dp=dp if fsdp else 1)
    parts_t = {
        "compute": m * compute + accumulate,
        "recompute": m * recompute,
        "exposed_comm": m * comm_mb + _dp_exposed(pr, layout, st, busiest, m),
        "bubble": bubble,
        "optimizer": optimizer,
    }
    step = sum(parts_t.values())
    peak = float(total.max())
    gpus = layout.dims.world_size
    return Estimate(
        layout=layout,
        cluster=cl,
        stage_memory=cats,
        peak_memory_bytes=int(peak),
        step_time_s=step,
        time_parts=parts_t,
        tokens_per_s_per_gpu=global_batch_size * pr.seq_len / step / gpus,
        mfu=pr.model_flops(prof) * global_batch_size / (gpus * dev.flops(pr.dtype) * step),
        micro_batches=m,
        stage_blocks=[int(x) for x in st["nparts"]],
        fits=peak <= dev.hbm_bytes,
        stage_micro_batch_s=[float(x) for x in stage_t],
    )


@lru_cache(maxsize=8)
def _pricer_for(model, cluster: Cluster, seq_len: int, dtype: str) -> Pricer:
    return Pricer(model, cluster, seq_len, dtype)


def estimate(
    model_or_schedule,
    layout: Layout,
    cluster: Cluster | None = None,
    seq_len: int = 2048,
    global_batch_size: int | None = None,
    dtype: str = "bf16",
) -> Estimate:
    """Price one layout: per-rank memory by category and step time by part (see the module docstring).

    Args:
        model_or_schedule: an ``nn.Module`` (any device; a meta model works) or a :class:`slapo_lab.Schedule`
            (its shards are used; ``layout.tp`` must be its ``world_size``).
        layout: the :class:`Layout`.
        cluster: the :class:`Cluster` (default: one node of 8 H100-SXM).
        seq_len: tokens per sequence.
        global_batch_size: sequences per optimizer step (default: ``dp x micro_batch_size``, one micro-batch).
        dtype: training dtype, ``"bf16"``, ``"fp16"`` or ``"fp32"``.

    Returns:
        Estimate (``.fits`` False when the busiest rank exceeds the device's memory; it is still priced).

    Raises:
        ScheduleError: a layout that cannot run (TP beyond a node or not dividing the heads, a batch that does
            not divide, more stages than blocks, ...) or a model that cannot be profiled; one sentence.
    """
    cluster = cluster or Cluster()
    if global_batch_size is None:
        global_batch_size = layout.dp * layout.micro_batch_size
    pr = _pricer_for(model_or_schedule, cluster, seq_len, dtype)
    return _price(pr, layout, global_batch_size)


def with_layout(est: Estimate, **changes) -> Layout:
    """``est.layout`` with ``changes`` (``dataclasses.replace``)."""
    return replace(est.layout, **changes)
