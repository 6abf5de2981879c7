"""Propose balanced pipeline cuts over a model's repeated blocks.

Slapo's canonical pipeline schedules cut after evenly spaced transformer layers (BERT-large, 24
layers on 4 stages: after layers 5, 11, 17). :func:`suggest_cuts` finds the longest list of
same-type blocks (``encoder.layer.i``, ``transformer.h.i``, ``model.layers.i`` ...), measures a
cost per block and for what runs before the first block (embeddings) and after the last (final
norm, head), and picks the cut positions that minimise the largest stage cost (the linear-partition
problem, solved exactly by dynamic programming). It does not apply the cuts unless ``apply=True``.

Costs (``by``):

* ``"params"``: parameter elements each part uses (a tied weight counts in every stage using it,
  since each such stage holds a copy);
* ``"flops"``: FLOPs of one forward (``torch.utils.flop_counter.FlopCounterMode``) on a meta copy --
  an estimate of time that needs no real compute;
* ``"time"``: measured forward wall time of each part on the real model (one warm-up run, then the
  median of ``repeats`` runs under ``torch.no_grad``; forward only -- backward is roughly 2x and
  scales alike).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ..blocks import find_blocks
from ..call_order import (
    _INPUTS_KEY,
    _OpCounter,
    _split_inputs,
    _strip_schedule,
    cached_call_order,
    dummy_inputs,
    record_call_order,
)
from ..errors import ScheduleError
from ..utils import meta_copy, to_meta

BY = ("params", "flops", "time")


class CutSuggestion(NamedTuple):
    """The result of :func:`suggest_cuts`.

    Attributes:
        paths: cut paths in forward order (``len(paths) == num_stages - 1``).
        per_stage: the cost of each stage (``num_stages`` numbers) in ``unit``.
        by: the cost measure (``"params"``, ``"flops"`` or ``"time"``).
        unit: ``"parameters"``, ``"FLOPs"`` or ``"seconds"``.
        blocks: the path of the block list the cuts were chosen from.
    """

    paths: list
    per_stage: list
    by: str
    unit: str
    blocks: str


def block_stacks(sch) -> tuple[str, list[str]]:
    """The repeated blocks to cut between, and the paths of their stacks (comma-separated).

    The blocks are :func:`slapo_lab.presets.find_blocks`'s (every stack: Whisper's and T5's encoder and
    decoder, both towers of a dual encoder), in the order the forward runs them when that is known, else in
    module order.

    Raises:
        ScheduleError: the model has fewer than two repeated blocks.
    """
    top = sch.get_top_schedule()
    blocks = find_blocks(top)
    if len(blocks) < 2:
        raise ScheduleError(
            "suggest_cuts found no list of repeated blocks (a ModuleList or Sequential of at least "
            "two modules of one type) to cut between."
        )
    order = cached_call_order(top)
    if order is not None and order.ok and all(order.count(b) for b in blocks):
        blocks = sorted(blocks, key=lambda b: order.calls[b][0][0])
    stacks = list(dict.fromkeys(b.rsplit(".", 1)[0] if "." in b else "" for b in blocks))
    return ", ".join(stacks), blocks


def _linear_partition(costs: list[float], k: int, allowed: list[bool]) -> list[int]:
    """Split ``costs`` into ``k`` contiguous groups minimising the max group sum.

    ``allowed[i]``: a cut may follow item ``i``. Returns the indices of the items that end groups 0..k-2.
    """
    n = len(costs)
    best, arg = _partition_table(costs, k, allowed)
    if best[k][n] == float("inf"):
        raise ScheduleError(f"Cannot place {k - 1} cuts between the blocks.")
    cuts, i = [], n
    for j in range(k, 0, -1):
        m = arg[j][i]
        if j > 1:
            cuts.append(m - 1)
        i = m
    return sorted(cuts)


def _partition_table(
    costs: list[float], k: int, allowed: list[bool]
) -> tuple[list[list[float]], list[list[int]]]:
    """The dynamic program of :func:`_linear_partition`: ``best[j][i]``, the minimal largest group cost of the
    first ``i`` items in ``j`` groups, and ``arg[j][i]``, where its last group starts (the latest on ties)."""
    n = len(costs)
    pre = [0.0]
    for c in costs:
        pre.append(pre[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    arg = [[-1] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(1, n + 1):
            for m in range(j - 1, i):
                if (m > 0 and not allowed[m - 1]) or best[j - 1][m] == inf:
                    continue
                v = max(best[j - 1][m], pre[i] - pre[m])
                if v < best[j][i] or (v == best[j][i] and arg[j][i] != -1 and m > arg[j][i]):
                    best[j][i], arg[j][i] = v, m
    return best, arg


def _segment_costs(model: nn.Module, blocks: list[str], inputs, by: str, repeats: int) -> list[float]:
    """Cost of [before the first block, block 0, ..., block n-1, after the last block]."""
    args, kwargs = _split_inputs(inputs)
    n = len(blocks)
    if by == "params":
        return _param_costs(model, blocks, args, kwargs)
    if by == "flops":
        copy = meta_copy(model)
        _strip_schedule(copy)
        counter = FlopCounterMode(display=False)
        marks: list[tuple[int, float]] = []
        handles = []
        for i, b in enumerate(blocks):
            m = copy.get_submodule(b)
            handles.append(
                m.register_forward_pre_hook(
                    lambda mod, a, i=i: marks.append((2 * i, counter.get_total_flops()))
                )
            )
            handles.append(
                m.register_forward_hook(
                    lambda mod, a, o, i=i: marks.append((2 * i + 1, counter.get_total_flops()))
                )
            )
        with torch.no_grad(), _OpCounter(), counter:
            copy(*to_meta(args), **to_meta(kwargs))
        total = counter.get_total_flops()
        return _from_marks(marks, n, total)
    # time: the real model, one warm-up run, then several timed runs, medians
    with torch.no_grad():
        model(*args, **kwargs)
    runs = []
    for _ in range(max(1, repeats)):
        marks: list[tuple[int, float]] = []
        handles = []
        for i, b in enumerate(blocks):
            m = model.get_submodule(b)
            handles.append(
                m.register_forward_pre_hook(
                    lambda mod, a, i=i, marks=marks: marks.append((2 * i, time.perf_counter()))
                )
            )
            handles.append(
                m.register_forward_hook(
                    lambda mod, a, o, i=i, marks=marks: marks.append((2 * i + 1, time.perf_counter()))
                )
            )
        try:
            with torch.no_grad():
                t0 = time.perf_counter()
                model(*args, **kwargs)
                t1 = time.perf_counter()
        finally:
            for h in handles:
                h.remove()
        runs.append(_from_marks([(k, v - t0) for k, v in marks], n, t1 - t0))
    return [sorted(r[i] for r in runs)[len(runs) // 2] for i in range(n + 2)]


def _from_marks(marks, n: int, total: float) -> list[float]:
    at = {}
    for k, v in marks:
        if k in at:
            raise ScheduleError(
                "suggest_cuts: a block runs more than once per forward pass; cannot balance by it."
            )
        at[k] = v
    if len(at) != 2 * n:
        raise ScheduleError("suggest_cuts: some blocks did not run in the forward pass with these inputs.")
    costs = [at[0]]
    for i in range(n):
        costs.append(at[2 * i + 1] - at[2 * i])
    costs.append(total - at[2 * n - 1])
    # work between blocks (residual glue) goes to the block before it
    for i in range(n - 1):
        costs[i + 1] += at[2 * i + 2] - at[2 * i + 1]
    return [float(c) for c in costs]


def _param_costs(model: nn.Module, blocks: list[str], args, kwargs) -> list[float]:
    n = len(blocks)
    order = record_call_order(model, args=args, kwargs=kwargs)
    block_ids = {b: i for i, b in enumerate(blocks)}
    costs = [0.0] * (n + 2)
    if not order.ok:  # fall back on definition order: everything before the list = first stage
        return _param_costs_by_definition(model, blocks)
    b_enter = [order.calls[b][0][0] for b in blocks]
    b_exit = [order.calls[b][-1][1] for b in blocks]
    counted: set[tuple[int, int]] = set()
    for nm, m in model.named_modules(remove_duplicate=False):
        own = list(m.parameters(recurse=False))
        if not own or nm not in order.calls:
            continue
        inside = next((b for b in blocks if nm == b or nm.startswith(b + ".")), None)
        if inside is not None:
            seg = block_ids[inside] + 1
        else:
            s = order.calls[nm][0][0]
            if s < b_enter[0]:
                seg = 0
            elif s > b_exit[-1]:
                seg = n + 1
            else:
                seg = next(i + 1 for i in range(n) if s < b_exit[i])
        _add_params(costs, counted, seg, own)
    return costs


def _param_costs_by_definition(model: nn.Module, blocks: list[str]) -> list[float]:
    """:func:`_param_costs` where the call order is unknown: a module defined before the first block costs in
    the first segment, one defined after the last block in the last, each block its parameters."""
    n = len(blocks)
    costs = [0.0] * (n + 2)
    names = [nm for nm, _ in model.named_modules()]
    first = names.index(blocks[0])
    last_block_end = max(
        i for i, nm in enumerate(names) if any(nm == b or nm.startswith(b + ".") for b in blocks)
    )
    where = {}
    for i, nm in enumerate(names):
        where[nm] = 0 if i < first else (n + 1 if i > last_block_end else None)
    for bi, b in enumerate(blocks):
        costs[bi + 1] = float(sum(p.numel() for p in model.get_submodule(b).parameters()))
    counted: set[tuple[int, int]] = set()
    for nm, m in model.named_modules():
        seg = where.get(nm)
        if seg is not None:
            _add_params(costs, counted, seg, m.parameters(recurse=False))
    return costs


def _add_params(costs: list[float], counted: set[tuple[int, int]], seg: int, params) -> None:
    """Add the element counts of ``params`` to ``costs[seg]``, each parameter once per segment."""
    for p in params:
        if (seg, id(p)) not in counted:
            counted.add((seg, id(p)))
            costs[seg] += p.numel()


def suggest_cuts(
    sch, num_stages: int, by: str = "params", example_inputs=None, apply: bool = False, repeats: int = 3
) -> CutSuggestion:
    """Propose ``num_stages - 1`` cut paths over the model's repeated blocks, balanced by ``by``.

    Args:
        sch: a schedule (its root module is analysed).
        num_stages: the number of pipeline stages wanted (2 .. number of blocks + 1).
        by: ``"params"`` (parameter elements), ``"flops"`` (estimated on a meta copy) or ``"time"``
            (measured on the real model).
        example_inputs: model inputs (tuple / dict / tensor); default: those given to
            ``set_example_inputs`` or a Hugging Face model's ``dummy_inputs``.
        apply: if True, call ``sch[path].cut_pipeline_stage()`` for each suggested path (recorded).
        repeats: timed runs for ``by="time"`` (median).

    Returns:
        CutSuggestion(paths, per_stage, by, unit, blocks): ``per_stage[k]`` is stage ``k``'s cost,
        including the embeddings (stage 0) and the head (last stage).

    Raises:
        ScheduleError: unknown ``by``; bad ``num_stages``; no repeated blocks; no example inputs for
            ``flops`` / ``time``; cuts already recorded when ``apply=True``.
    """
    if by not in BY:
        raise ScheduleError(f"suggest_cuts: by must be one of {', '.join(BY)}, not {by!r}.")
    top = sch.get_top_schedule()
    model = top.mod
    list_path, blocks = block_stacks(top)
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or not 2 <= num_stages <= len(blocks):
        raise ScheduleError(
            f"suggest_cuts: num_stages must be an integer in [2, {len(blocks)}] for the "
            f"{len(blocks)} blocks of {list_path}, not {num_stages!r}."
        )
    if apply and top.metadata.primitives["cut_pipeline_stage"]:
        raise ScheduleError(
            "suggest_cuts(apply=True): the schedule already has cuts "
            f"({', '.join(top.metadata.primitives['cut_pipeline_stage'])}); apply to a fresh schedule."
        )
    inputs = example_inputs
    if inputs is None:
        inputs = top._top.extra.get(_INPUTS_KEY)
    if inputs is None:
        inputs = dummy_inputs(model)
    if inputs is None:
        raise ScheduleError(
            "suggest_cuts needs example_inputs= (or set_example_inputs(sch, ...)) to run the model."
        )
    costs = _segment_costs(model, blocks, inputs, by, repeats)
    # items: block i carries the pre part (i == 0) or the post part (i == n - 1)
    n = len(blocks)
    items = list(costs[1 : n + 1])
    items[0] += costs[0]
    items[-1] += costs[n + 1]
    allowed = [True] * n
    allowed[-1] = costs[n + 1] > 0  # cutting after the last block leaves only the head
    idx = _linear_partition(items, num_stages, allowed)
    paths = [blocks[i] for i in idx]
    bounds = [-1] + idx + [n - 1]
    per_stage = [sum(items[bounds[k] + 1 : bounds[k + 1] + 1]) for k in range(num_stages)]
    unit = {"params": "parameters", "flops": "FLOPs", "time": "seconds"}[by]
    if by != "time":
        per_stage = [round(v) for v in per_stage]
    if apply:
        for p in paths:
            top[p].cut_pipeline_stage()
    return CutSuggestion(paths, per_stage, by, unit, list_path)
