"""Simulated planning: how many bytes each rank of a scheduled model needs, per pipeline stage.

``plan(sch)`` reads a schedule (normally a *simulated* one, ``create_schedule(model, world_size=8)``
on a ``meta`` model, where every sharded parameter already has its per-rank shape) and reports, for
one rank of every pipeline stage:

* **parameters** -- sharded parameters at their per-rank shape, replicated ones in full; a tensor
  shared by several modules (tied weights) is counted once per stage that uses it;
* **gradients** -- one per trainable parameter, in ``grad_dtype``;
* **optimizer states** -- Adam/AdamW: two fp32 moments per trainable element (8 B); SGD: none, or
  one fp32 momentum buffer (4 B) with ``"sgd_momentum"``; plus a 4-byte fp32 master copy per
  trainable element with ``master_weights=True`` (mixed precision, as Megatron-LM and DeepSpeed keep);
* **activations** (optional) -- the bytes saved for backward by one micro-batch, from one forward
  pass on meta tensors, two ways:

  - ``activation="estimate"`` (:func:`estimate_activations`): the outputs of every leaf module, and
    only the inputs of a checkpointed module. Misses tensors saved inside non-leaf modules
    (attention scores, functional ops), so it undercounts: 0.72x the measured bytes on BERT-base
    without checkpointing, 1.02x with every layer checkpointed (``benchmarks/engine_bench.py``).
    One pass serves every checkpoint/cut variant of a sharding (cached).
  - ``activation="autograd"`` (:func:`saved_activations`): what autograd really saves, via
    ``torch.autograd.graph.saved_tensors_hooks`` on the meta forward, one count per storage; equal
    to the bytes measured on real tensors (BERT-base, with and without checkpointing). A checkpoint
    change needs a new pass (cached per checkpoint set).

The parameter/gradient/optimizer part only walks the module tree (a 70B Llama with full TP: a few
milliseconds). The activation part runs one meta forward (seconds for 80 large layers), whose result
is cached per model, sharding and input shapes.

Pipeline stages (``sch[p].cut_pipeline_stage()``, recorded in
``sch.metadata.primitives["cut_pipeline_stage"]``) follow Slapo's rule: the cut module is the
*last* module of its stage. Modules are ordered by registration order (depth first), which for
Hugging Face models is forward order: embeddings before the first block land in stage 0, the final
norm and head after the last block land in the last stage. A stage is served by ``world_size``
tensor-parallel ranks, so a plan covers ``num_stages * world_size`` ranks.

Data parallelism (``dp`` replicas of the ``tp x pp`` layout, world size ``tp x pp x dp``) leaves a rank's
bytes as they are, unless the replicas shard (``shard=``): ``"fsdp"`` (FSDP2) divides parameters,
gradients and optimizer states by ``dp`` and adds, as the all-gather working set, one repeated block's
full-size (``dp``-unsharded) parameters and gradients -- the largest block of the stage, or the stage's
whole parameters when it holds no repeated block (FSDP then gathers it as one unit); ``"zero1"``
(DeepSpeed ZeRO stage 1) divides the optimizer states, ``"zero2"`` the optimizer states and the gradients.
Divisions round up; the padding of uneven shards is not counted. Buffers and activations are per replica.

Sources: Adam state sizes and the 16-bytes-per-parameter mixed-precision rule follow the ZeRO paper
(Rajbhandari et al., 2020, section 3.1); the stage rule follows Slapo's ``cut_pipeline_stage``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

import torch

from .activation_cache import cached_profile
from .activations import ActivationProfile, SavedProfile, estimate_activations, saved_activations
from .blocks import block_stack
from .errors import ScheduleError
from .module_state import peek_meta
from .parallel_dims import ParallelDims
from .utils import human_bytes

__all__ = [
    "SHARDINGS",
    "ActivationProfile",
    "Plan",
    "SavedProfile",
    "StageAssignment",
    "estimate_activations",
    "plan",
    "saved_activations",
    "stage_assignment",
]

#: what ``plan(shard=...)`` divides by ``dp``: (parameters, gradients, optimizer states)
SHARDINGS = {
    None: (False, False, False),
    "fsdp": (True, True, True),
    "zero1": (False, False, True),
    "zero2": (False, True, True),
}

_OPTIMIZERS = {
    # name -> fp32 state elements per trainable parameter element
    "adam": 2,
    "adamw": 2,
    "sgd": 0,
    "sgd_momentum": 1,
    "momentum": 1,
    "none": 0,
}
_FP32 = 4


def _elem_bytes(dtype_or_bytes: Any, what: str) -> int | None:
    """Bytes per element for a ``torch.dtype`` or a positive int; None passes through."""
    if dtype_or_bytes is None:
        return None
    if isinstance(dtype_or_bytes, torch.dtype):
        return torch.empty((), dtype=dtype_or_bytes, device="meta").element_size()
    if (
        isinstance(dtype_or_bytes, (int, float))
        and not isinstance(dtype_or_bytes, bool)
        and dtype_or_bytes > 0
    ):
        return dtype_or_bytes
    raise ScheduleError(
        f"{what} must be a torch.dtype or a positive number of bytes per element, not {dtype_or_bytes!r}."
    )


def _optimizer_states(optimizer: Any) -> int:
    if optimizer is None:
        return 0
    name = optimizer.__name__ if isinstance(optimizer, type) else optimizer
    if not isinstance(name, str) or name.lower().replace("-", "_") not in _OPTIMIZERS:
        raise ScheduleError(
            f"Unknown optimizer {optimizer!r}; use one of {', '.join(sorted(_OPTIMIZERS))} (or None)."
        )
    return _OPTIMIZERS[name.lower().replace("-", "_")]


# --------------------------------------------------------------------------------------------------
# stage assignment
# --------------------------------------------------------------------------------------------------
@dataclass
class StageAssignment:
    """Which pipeline stage each module belongs to.

    Attributes:
        num_stages: ``len(cuts) + 1``.
        cuts: the cut paths that end a stage, sorted by module order (one per stage boundary).
        stage_of: module path -> stage index (every path of the schedule tree; "" is the root).
        order: module paths in registration (depth-first) order.
        blocks: path of the top-level repeated blocks (the longest ``ModuleList``/``Sequential``), or None.
        num_blocks: how many blocks it holds.
        merged: cuts that end at the same place as an outer cut (a module's last descendant), so add
            no stage.
    """

    num_stages: int
    cuts: list[str]
    stage_of: dict[str, int]
    order: list[str]
    blocks: str | None = None
    num_blocks: int = 0
    merged: list[str] = field(default_factory=list)
    #: path -> schedule node, for every path of ``order`` (one walk serves the plan too)
    nodes: dict = field(default_factory=dict, repr=False, compare=False)


def _depth_first(sch: Any) -> tuple[list[str], dict[str, int], dict[str, Any]]:
    """``(paths in depth-first registration order, path -> index of its subtree's last path, path -> node)``
    of the schedule tree under ``sch`` (the root's path is ``""``)."""
    order: list[str] = []
    end: dict[str, int] = {}
    nodes: dict[str, Any] = {}

    def walk(node: Any, path: str) -> None:
        order.append(path)
        nodes[path] = node
        for name, c in node.child.items():
            walk(c, f"{path}.{name}" if path else name)
        end[path] = len(order) - 1

    walk(sch, "")
    return order, end, nodes


def _place_by_forward(stage_of: dict[str, int], cuts: list[str], fo: Any) -> None:
    """Move every module that runs to the stage in which it first runs (after how many cuts' exits), when the
    forward order ``fo`` is known and runs each cut once; in place."""
    if not (fo.ok and cuts and all(fo.count(c) == 1 for c in cuts)):
        return
    exits = sorted(fo.exit_point(c)[0] for c in cuts)
    for path in stage_of:
        calls = fo.calls.get(path)
        if calls:
            stage_of[path] = bisect.bisect_right(exits, calls[0][0])


def stage_assignment(sch, forward_order=None) -> StageAssignment:
    """Assign every module of ``sch`` to a pipeline stage from the recorded cuts.

    A module belongs to the stage in which it starts in depth-first registration order; a cut at
    ``p`` ends its stage after ``p``'s whole subtree, so everything inside ``p`` shares ``p``'s stage.
    With no cuts every module is in stage 0. Given the forward's ``forward_order``
    (:class:`slapo_lab.call_order.CallOrder`), a module that runs is placed by when it first runs
    instead: after how many cuts' exits (Llama's ``rotary_emb``, registered after the layers, runs before
    them, so in stage 0, where the pipeline computes it).

    Raises:
        ScheduleError: if a recorded cut names a module that is no longer in the schedule.
    """
    order, end, nodes = _depth_first(sch)
    cuts = list(sch.metadata.primitives.get("cut_pipeline_stage", []) or [])
    for c in cuts:
        if c not in end:
            raise ScheduleError(
                f"The pipeline cut at {c!r} names a module that is no longer in the schedule."
            )
    index = {p: i for i, p in enumerate(order)}
    by_end: dict[int, list[str]] = {}
    for c in sorted(set(cuts), key=lambda c: index[c]):
        by_end.setdefault(end[c], []).append(c)
    boundaries = sorted(by_end)
    cuts = [by_end[b][0] for b in boundaries]  # the outermost cut at each boundary
    merged = [c for b in boundaries for c in by_end[b][1:]]
    stage_of: dict[str, int] = {}
    s = 0
    for i, path in enumerate(order):
        while s < len(boundaries) and boundaries[s] < i:
            s += 1
        stage_of[path] = s
    if forward_order is not None:
        _place_by_forward(stage_of, cuts, forward_order)
    blocks, n_blocks = block_stack(sch)
    return StageAssignment(len(boundaries) + 1, cuts, stage_of, order, blocks, n_blocks, merged, nodes)


def _outermost_checkpoint(path: str, ckpt_set: set[str]) -> str | None:
    """The outermost checkpointed ancestor-or-self of ``path`` (among ``ckpt_set``), or None."""
    parts = path.split(".") if path else []
    for i in range(1, len(parts) + 1):
        q = ".".join(parts[:i])
        if q in ckpt_set:
            return q
    return None


def _new_bytes(its: Any, counted: set[int], elem_bytes: int | None) -> int:
    """The bytes of the tensors ``its`` (``(id, numel, element size, is floating)``) not in ``counted`` yet
    (they are added to it), floating ones at ``elem_bytes`` each when given."""
    total = 0
    for tid, numel, esize, is_float in its:
        if tid in counted:
            continue
        counted.add(tid)
        total += numel * (elem_bytes if (is_float and elem_bytes is not None) else esize)
    return total


def _activation_per_stage(
    sch, prof: ActivationProfile, assign: StageAssignment, act_scale: float, elem_bytes: int | None
) -> list[int]:
    """Sum saved bytes per stage: leaf outputs outside checkpoints + inputs of outermost checkpoints. A selective
    checkpoint (``checkpoint(policy="selective")``) counts as none here, an upper bound: which leaf outputs its
    policy keeps is known only per aten op, which the ``"autograd"`` pass sees."""
    ckpt = [
        p
        for p, node in sch.named_schedules()
        if (meta := peek_meta(node.mod)) and meta.checkpoint and meta.checkpoint_policy != "selective"
    ]
    ckpt_set = set(ckpt)
    counted: list[set[int]] = [set() for _ in range(assign.num_stages)]
    totals = [0] * assign.num_stages

    def add(stage: int, its: Any) -> None:
        totals[stage] += _new_bytes(its, counted[stage], elem_bytes)

    for path, its in prof.leaf_out.items():
        if _outermost_checkpoint(path, ckpt_set) is None:
            add(assign.stage_of.get(path, 0), its)
    for c in ckpt:
        if _outermost_checkpoint(c, ckpt_set) == c:
            add(assign.stage_of.get(c, 0), prof.mod_in.get(c, []))
    return [round(t * act_scale) for t in totals]


def _saved_per_stage(
    prof: SavedProfile, assign: StageAssignment, act_scale: float, elem_bytes: int | None
) -> list[int]:
    totals = [0] * assign.num_stages
    for path, nbytes, esize, is_float in prof.items:
        if is_float and elem_bytes is not None:
            nbytes = nbytes // esize * elem_bytes
        totals[assign.stage_of.get(path, 0)] += nbytes
    return [round(t * act_scale) for t in totals]


# --------------------------------------------------------------------------------------------------
# the plan
# --------------------------------------------------------------------------------------------------
_FIELDS = ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "buffer_bytes")


@dataclass
class Plan:
    """Per-rank memory of a schedule, one entry per pipeline stage (bytes; binary units in text).

    Attributes:
        world_size: tensor-parallel ranks per stage (the schedule's world size).
        num_stages: pipeline stages (cuts + 1); the plan covers ``num_stages * world_size * dp`` ranks.
        per_stage: one dict per stage with keys ``stage``, ``ranks`` ([first, last] global rank of
            data-parallel replica 0; replica ``d`` adds ``d * world_size * num_stages``),
            ``first`` / ``last`` (first module path of the stage in module order; the cut that ends it,
            or for the last stage its last module path), ``blocks`` ([lo, hi] indices
            of the top-level repeated blocks in it, or None), ``num_params`` (elements on one rank of the
            ``tp x pp`` layout, before any ``dp`` sharding),
            ``sharded_params`` / ``replicated_params`` (elements), ``param_bytes``, ``grad_bytes``,
            ``optimizer_bytes``, ``activation_bytes`` (None when not estimated), ``buffer_bytes``,
            ``gather_bytes`` (FSDP's all-gather working set: one block's full-size parameters and
            gradients; 0 without FSDP), ``gather_block`` (that block's path, None without FSDP or when
            the stage has no repeated block), ``total_bytes`` (the sum; parameters, gradients and
            optimizer states already divided by ``dp`` as ``shard`` says).
        settings: the arguments the plan was made with (JSON-able).
        activation: "estimated", "cached" (reused an earlier pass), "given" or "skipped".
        activation_method: "estimate" or "autograd" (how activations were counted), or None.
        activation_seconds: wall time of the meta forward (0 when cached or skipped).
        notes: sentences worth showing (e.g. an empty stage).
        dp: data-parallel replicas of the ``tp x pp`` layout (1: none).
        shard: what the replicas shard: None, ``"fsdp"``, ``"zero1"`` or ``"zero2"`` (see :data:`SHARDINGS`).
    """

    world_size: int
    num_stages: int
    per_stage: list[dict]
    settings: dict
    blocks: str | None = None
    activation: str = "skipped"
    activation_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    activation_method: str | None = None
    dp: int = 1
    shard: str | None = None

    @property
    def dims(self) -> ParallelDims:
        """The plan's parallel degrees: TP ``world_size``, PP ``num_stages``, DP ``dp``."""
        return ParallelDims(self.world_size, self.num_stages, self.dp)

    @property
    def num_ranks(self) -> int:
        """Ranks the plan covers: tp x pp x dp (``dims.world_size``)."""
        return self.dims.world_size

    @property
    def total_bytes(self) -> int:
        """Bytes the busiest rank needs (the maximum over stages of ``total_bytes``)."""
        return max(s["total_bytes"] for s in self.per_stage)

    @property
    def cluster_bytes(self) -> int:
        """Bytes over all ranks (each stage's per-rank total times the ranks that hold it, ``dims.stage_ranks``)."""
        return sum(s["total_bytes"] for s in self.per_stage) * self.dims.stage_ranks

    def fits(self, gpu_bytes: float) -> bool:
        """Whether every rank's total fits in ``gpu_bytes`` (e.g. ``80 * 2**30``).

        Raises:
            ScheduleError: if ``gpu_bytes`` is not a positive number.
        """
        if isinstance(gpu_bytes, bool) or not isinstance(gpu_bytes, (int, float)) or gpu_bytes <= 0:
            raise ScheduleError(
                f"fits() needs the GPU memory as a positive number of bytes, not {gpu_bytes!r}."
            )
        return self.total_bytes <= gpu_bytes

    def to_dict(self) -> dict:
        """A JSON-able dict: settings, stages, totals."""
        return {
            "world_size": self.world_size,
            "num_stages": self.num_stages,
            "dp": self.dp,
            "shard": self.shard,
            "num_ranks": self.num_ranks,
            "blocks": self.blocks,
            "settings": dict(self.settings),
            "activation": self.activation,
            "activation_method": self.activation_method,
            "activation_seconds": self.activation_seconds,
            "per_stage": [dict(s) for s in self.per_stage],
            "total_bytes": self.total_bytes,
            "cluster_bytes": self.cluster_bytes,
            "notes": list(self.notes),
        }

    def table(self) -> str:
        """A fixed-width text table, one row per stage (bytes of ONE rank of that stage).

        With FSDP over ``dp > 1`` a ``gather`` column shows the all-gather working set, and a last line
        says what it holds and what ``dp`` divides."""
        gather = self.shard == "fsdp" and self.dp > 1
        head = ["stage", "ranks", "modules", "params", "grads", "optimizer", "activations", "total"]
        if gather:
            head.insert(7, "gather")
        rows = []
        for s in self.per_stage:
            if s["blocks"] is not None:
                lo, hi = s["blocks"]
                span = f"{self.blocks}[{lo}]" if lo == hi else f"{self.blocks}[{lo}..{hi}]"
            else:
                span = s["last"] or "(root)"
            act = "-" if s["activation_bytes"] is None else human_bytes(s["activation_bytes"])
            row = [
                str(s["stage"]),
                f"{s['ranks'][0]}-{s['ranks'][1]}",
                span,
                human_bytes(s["param_bytes"]),
                human_bytes(s["grad_bytes"]),
                human_bytes(s["optimizer_bytes"]),
                act,
                human_bytes(s["total_bytes"]),
            ]
            if gather:
                row.insert(7, human_bytes(s.get("gather_bytes") or 0))
            rows.append(row)
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        lines = [
            "  ".join(
                h.ljust(w) if i < 3 else h.rjust(w)
                for i, (h, w) in enumerate(zip(head, widths, strict=False))
            )
        ]
        lines.append("  ".join("-" * w for w in widths))
        for r in rows:
            lines.append(
                "  ".join(
                    c.ljust(w) if i < 3 else c.rjust(w)
                    for i, (c, w) in enumerate(zip(r, widths, strict=False))
                )
            )
        layout = f"{self.num_stages} stage(s) x TP {self.world_size}"
        if self.dp > 1:
            layout += f" x DP {self.dp}" + (f", {_SHARD_NAMES[self.shard]}" if self.shard else "")
        lines.append(f"busiest rank: {human_bytes(self.total_bytes)} of {self.num_ranks} rank(s) ({layout})")
        if self.dp > 1 and self.shard:
            lines.append(_shard_sentence(self.shard, self.dp))
        return "\n".join(lines)

    def __repr__(self) -> str:
        dp = f", dp={self.dp}, shard={self.shard!r}" if self.dp > 1 or self.shard else ""
        return (
            f"Plan(world_size={self.world_size}, num_stages={self.num_stages}{dp}, "
            f"total_bytes={self.total_bytes} ({human_bytes(self.total_bytes)}))"
        )


_SHARD_NAMES = {"fsdp": "FSDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2"}


def _shard_sentence(shard: str, dp: int) -> str:
    """What ``shard`` divides by ``dp``, in one sentence (the table's last line and the plan's notes)."""
    if shard == "fsdp":
        return (
            f"FSDP over dp {dp}: parameters, gradients and optimizer states are divided by {dp}; 'gather' is "
            "the all-gather working set, one repeated block's full-size parameters and gradients while it "
            "computes (the largest block of the stage, or the stage's parameters when it has no block)."
        )
    if shard == "zero1":
        return (
            f"ZeRO-1 over dp {dp}: optimizer states are divided by {dp}; parameters and gradients are whole."
        )
    return f"ZeRO-2 over dp {dp}: optimizer states and gradients are divided by {dp}; parameters are whole."


def plan(
    sch,
    optimizer: Any = "adam",
    param_dtype: Any = torch.float32,
    grad_dtype: Any = None,
    master_weights: bool = False,
    micro_batch_size: int | None = None,
    example_inputs: Any = None,
    activation: Any = "estimate",
    activation_dtype: Any = None,
    cache: bool = True,
    dp: int = 1,
    shard: str | None = None,
) -> Plan:
    """Plan the per-rank memory of schedule ``sch`` (see the module docstring).

    Args:
        sch: a schedule (any node; its top is used). Simulated schedules give per-rank shapes for free.
        optimizer: "adam" / "adamw" (2 fp32 states), "sgd" (0), "sgd_momentum" (1), None / "none", or an
            optimizer class (``torch.optim.AdamW``; looked up by name).
        param_dtype: the training dtype of parameters, a ``torch.dtype`` or bytes per element; None uses
            each parameter's own dtype. Default fp32 (4 B).
        grad_dtype: gradient dtype (or bytes); None = same as the parameter.
        master_weights: add a 4-byte fp32 master copy per trainable element to the optimizer bytes.
        micro_batch_size: scale the activation estimate from the example inputs' batch size (dim 0 of
            the first tensor) to this one (activations are linear in the batch).
        example_inputs: inputs of one forward (dict of kwargs / tuple / tensor, any device, real
            shapes); needed for ``activation="estimate"`` / ``"autograd"``.
        activation: "estimate" (leaf outputs, one cached meta forward), "autograd" (exact saved
            tensors, one cached meta forward per checkpoint set) -- both skipped with a note when there
            are no ``example_inputs`` --, None / "none" (skip), or a number of bytes per micro-batch for
            the whole model (split over stages in proportion to their parameters).
        activation_dtype: count floating activations at this size (dtype or bytes); None = as run.
        cache: reuse an earlier activation pass of the same model, sharding and input shapes.
        dp: data-parallel replicas of the ``tp x pp`` layout (world size ``tp x pp x dp``); a positive int.
        shard: what the replicas shard over ``dp`` (ignored at ``dp=1``, with a note): None (DDP: nothing),
            ``"fsdp"`` (parameters, gradients and optimizer states, plus one block's full-size parameters
            and gradients as the all-gather working set, ``gather_bytes``), ``"zero1"`` (optimizer
            states) or ``"zero2"`` (optimizer states and gradients).

    Returns:
        Plan (``per_stage``, ``total_bytes``, ``to_dict()``, ``table()``, ``fits(gpu_bytes)``).

    Raises:
        ScheduleError: for an unknown optimizer, dtype or ``shard``, a ``dp`` that is not a positive
            integer, a bad micro-batch size, a stale cut, or a failed activation pass.
    """
    top = sch.get_top_schedule()
    pbytes = _elem_bytes(param_dtype, "param_dtype")
    gbytes = _elem_bytes(grad_dtype, "grad_dtype")
    abytes = _elem_bytes(activation_dtype, "activation_dtype")
    states = _optimizer_states(optimizer)
    _check_plan_options(dp, shard, micro_batch_size, activation)

    assign = stage_assignment(top)
    n = assign.num_stages
    ws = top.world_size
    opt_bytes = states * _FP32 + (_FP32 if master_weights else 0)  # per trainable element
    tallies = _tally_stages(assign, pbytes, gbytes, opt_bytes)

    notes: list[str] = [
        f"The cut at {c} ends where an outer cut already ends a stage, so it adds no stage."
        for c in assign.merged
    ]
    act, act_mode, act_seconds = _plan_activations(
        top, assign, tallies, activation, example_inputs, cache, micro_batch_size, abytes, notes
    )
    for s, cut in enumerate(assign.cuts):  # a cut module is the last module of its stage
        tallies[s].last = cut
    if shard is not None and dp == 1:
        notes.append(
            f"{_SHARD_NAMES[shard]} with one data-parallel replica shards nothing, so the plan is unsharded."
        )
    elif shard is not None:
        notes.append(_shard_sentence(shard, dp))
    divide = SHARDINGS[shard if dp > 1 else None]
    per_stage = [_stage_row(s, tallies[s], act[s], ws, dp, divide, assign) for s in range(n)]
    notes.extend(
        f"Stage {s} holds no parameters; check the cuts."
        for s in range(n)
        if n > 1 and not tallies[s].num_params
    )
    settings = _plan_settings(
        optimizer, param_dtype, grad_dtype, master_weights, micro_batch_size, activation_dtype, dp, shard
    )
    method = activation if activation in ("estimate", "autograd") and act_mode != "skipped" else None
    return Plan(ws, n, per_stage, settings, assign.blocks, act_mode, act_seconds, notes, method, dp, shard)


def _check_plan_options(dp: Any, shard: Any, micro_batch_size: Any, activation: Any) -> None:
    """Raise ScheduleError (one sentence) for a bad ``dp``, ``shard``, ``micro_batch_size`` or ``activation``
    of :func:`plan`."""
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ScheduleError(f"dp (data-parallel replicas) must be a positive integer, not {dp!r}.")
    if shard not in SHARDINGS:
        raise ScheduleError(f"shard must be None, 'fsdp', 'zero1' or 'zero2', not {shard!r}.")
    if micro_batch_size is not None and (
        isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1
    ):
        raise ScheduleError(f"micro_batch_size must be a positive integer, not {micro_batch_size!r}.")
    bad_number = isinstance(activation, bool) or (isinstance(activation, (int, float)) and activation < 0)
    if bad_number or not (
        activation is None
        or isinstance(activation, (int, float))
        or activation in ("estimate", "autograd", "none")
    ):
        raise ScheduleError(
            f"activation must be 'estimate', 'autograd', None or a number of bytes, not {activation!r}."
        )


@dataclass
class _StageTally:
    """What one rank of one pipeline stage holds, counted module by module (element counts for the
    ``*_params`` fields, bytes for the others)."""

    num_params: int = 0
    sharded_params: int = 0
    replicated_params: int = 0
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    buffer_bytes: int = 0
    #: ids of the tensors counted (a tied weight counts once per stage)
    seen: set[int] = field(default_factory=set)
    #: the stage's first and last module paths
    first: str | None = None
    last: str | None = None
    #: the range of repeated-block indices in the stage
    blk_lo: int | None = None
    blk_hi: int | None = None
    #: block name -> [parameter bytes, gradient bytes] of one rank, for FSDP's all-gather working set
    block_bytes: dict[str, list[int]] = field(default_factory=dict)

    def stats(self) -> dict[str, int]:
        """The counts a plan's stage row shows, by name."""
        return {k: getattr(self, k) for k in _STAT_KEYS}

    def note_path(self, path: str) -> None:
        """Extend the stage's first..last module range with ``path`` (the root, ``""``, is not one)."""
        if path:
            if self.first is None:
                self.first = path
            self.last = path

    def note_block(self, idx: int) -> None:
        """Extend the stage's range of repeated blocks with block ``idx``."""
        self.blk_lo = idx if self.blk_lo is None else min(self.blk_lo, idx)
        self.blk_hi = idx if self.blk_hi is None else max(self.blk_hi, idx)

    def add_parameter(
        self, p: torch.Tensor, pbytes: int | None, gbytes: int | None, opt_bytes: int, blk: list[int] | None
    ) -> None:
        """Count parameter ``p`` at ``pbytes`` per element (None: its own), its gradient at ``gbytes``
        (None: as the parameter) and ``opt_bytes`` of optimizer state per trainable element; ``blk``
        collects the bytes of the repeated block it is in."""
        numel = p.numel()
        eb = pbytes if pbytes is not None else p.element_size()
        self.num_params += numel
        if getattr(p, "shard_axis", None) is not None:
            self.sharded_params += numel
        else:
            self.replicated_params += numel
        self.param_bytes += numel * eb
        grad = numel * (gbytes if gbytes is not None else eb) if p.requires_grad else 0
        if p.requires_grad:
            self.grad_bytes += grad
            self.optimizer_bytes += numel * opt_bytes
        if blk is not None:
            blk[0] += numel * eb
            blk[1] += grad


_STAT_KEYS = (
    "num_params",
    "sharded_params",
    "replicated_params",
    "param_bytes",
    "grad_bytes",
    "optimizer_bytes",
    "buffer_bytes",
)


def _tally_stages(
    assign: StageAssignment, pbytes: int | None, gbytes: int | None, opt_bytes: int
) -> list[_StageTally]:
    """One :class:`_StageTally` per stage of ``assign``: every module's own parameters and buffers, counted in
    the stage the module is in."""
    tallies = [_StageTally() for _ in range(assign.num_stages)]
    bprefix = (assign.blocks + ".") if assign.blocks else None
    block_index = _block_index(assign)
    for path in assign.order:
        node = assign.nodes[path]
        tally = tallies[assign.stage_of[path]]
        tally.note_path(path)
        blk = None
        if bprefix is not None and path.startswith(bprefix):
            rest = path[len(bprefix) :]
            if "." not in rest:
                tally.note_block(block_index.get(node.name, 0))
            blk = tally.block_bytes.setdefault(rest.split(".", 1)[0], [0, 0])
        for p in node.mod._parameters.values():
            if p is not None and id(p) not in tally.seen:
                tally.seen.add(id(p))
                tally.add_parameter(p, pbytes, gbytes, opt_bytes, blk)
        for b in node.mod._buffers.values():
            if b is not None and id(b) not in tally.seen:
                tally.seen.add(id(b))
                tally.buffer_bytes += b.numel() * b.element_size()
    return tallies


def _block_index(assign: StageAssignment) -> dict[str, int]:
    """Repeated block name -> its index in the block list (none without a block list)."""
    if not assign.blocks:
        return {}
    return {name: i for i, name in enumerate(assign.nodes[assign.blocks].child)}


def _plan_activations(
    top: Any,
    assign: StageAssignment,
    tallies: list[_StageTally],
    activation: Any,
    example_inputs: Any,
    cache: bool,
    micro_batch_size: int | None,
    abytes: int | None,
    notes: list[str],
) -> tuple[list[int | None], str, float]:
    """``(bytes per stage or None, mode, seconds)`` of one micro-batch's activations, as :func:`plan`'s
    ``activation`` asks; a note on why they were skipped, or how they were found, goes to ``notes``."""
    n = assign.num_stages
    if isinstance(activation, (int, float)) and not isinstance(activation, bool):
        total_p = sum(t.num_params for t in tallies) or 1
        return [round(activation * t.num_params / total_p) for t in tallies], "given", 0.0
    if activation not in ("estimate", "autograd"):
        return [None] * n, "skipped", 0.0
    if example_inputs is None:
        notes.append("No example_inputs were given, so activations were not estimated.")
        return [None] * n, "skipped", 0.0
    prof, hit = cached_profile(top, example_inputs, cache, activation)
    scale = 1.0
    if micro_batch_size is not None:
        if not prof.batch:
            raise ScheduleError(
                "micro_batch_size needs example inputs whose first tensor has a batch dimension (dim 0)."
            )
        scale = micro_batch_size / prof.batch
    if activation == "estimate":
        act = _activation_per_stage(top, prof, assign, scale, abytes)
    else:
        act = _saved_per_stage(prof, assign, scale, abytes)
    if prof.fake:
        notes.append("The activation pass ran under FakeTensorMode (the forward reads tensor values).")
    return list(act), "cached" if hit else "estimated", 0.0 if hit else prof.seconds


def _fsdp_gather(s: int, tally: _StageTally, assign: StageAssignment) -> tuple[int, str | None]:
    """FSDP's all-gather working set of stage ``s``: ``(bytes, block path)`` of its largest repeated block's
    full-size parameters and gradients (the first such block on a tie), or the whole stage's with no block
    (``None``)."""
    block_index = _block_index(assign)
    mine = [(sum(v), name) for name, v in tally.block_bytes.items()]
    if not mine:  # no repeated block in the stage: FSDP gathers the stage as one unit
        return tally.param_bytes + tally.grad_bytes, None
    gather, name = max(mine, key=lambda x: (x[0], -block_index.get(x[1], 0)))
    return gather, f"{assign.blocks}.{name}"


def _stage_row(
    s: int,
    tally: _StageTally,
    act: int | None,
    ws: int,
    dp: int,
    divide: tuple[bool, bool, bool],
    assign: StageAssignment,
) -> dict[str, Any]:
    """Stage ``s``'s row of :attr:`Plan.per_stage`: its tally with what the data-parallel replicas shard
    divided by ``dp`` (``divide``: parameters, gradients, optimizer states; rounded up), plus activations,
    FSDP's gather and the total."""
    st = tally.stats()
    div_params, div_grads, div_states = divide
    gather, gather_block = 0, None
    if div_params:  # FSDP: one block's full-size parameters and gradients while it computes
        gather, gather_block = _fsdp_gather(s, tally, assign)
        st["param_bytes"] = -(-st["param_bytes"] // dp)
    if div_grads:
        st["grad_bytes"] = -(-st["grad_bytes"] // dp)
    if div_states:
        st["optimizer_bytes"] = -(-st["optimizer_bytes"] // dp)
    total = (
        st["param_bytes"]
        + st["grad_bytes"]
        + st["optimizer_bytes"]
        + st["buffer_bytes"]
        + gather
        + (act or 0)
    )
    return {
        "stage": s,
        "ranks": [s * ws, (s + 1) * ws - 1],
        "first": tally.first,
        "last": tally.last,
        "blocks": [tally.blk_lo, tally.blk_hi] if tally.blk_lo is not None else None,
        **st,
        "activation_bytes": act,
        "gather_bytes": gather,
        "gather_block": gather_block,
        "total_bytes": total,
    }


def _dtype_name(dtype: Any) -> str | None:
    return str(dtype) if dtype is not None else None


def _plan_settings(
    optimizer: Any,
    param_dtype: Any,
    grad_dtype: Any,
    master_weights: bool,
    micro_batch_size: int | None,
    activation_dtype: Any,
    dp: int,
    shard: str | None,
) -> dict[str, Any]:
    """:attr:`Plan.settings`: the options :func:`plan` ran with, JSON-able."""
    return {
        "optimizer": optimizer.__name__ if isinstance(optimizer, type) else optimizer,
        "param_dtype": _dtype_name(param_dtype),
        "grad_dtype": _dtype_name(grad_dtype),
        "master_weights": bool(master_weights),
        "micro_batch_size": micro_batch_size,
        "activation_dtype": _dtype_name(activation_dtype),
        "dp": dp,
        "shard": shard,
    }
