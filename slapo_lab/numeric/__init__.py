"""Numeric schedule check: replay a schedule on a shrunk copy of the model over simulated ranks and compare.

:func:`slapo_lab.check_schedule` reads only the schedule's own state, so a schedule whose every call is
consistent can still compute another model: a vocab-parallel embedding that drops the module's scale, a
forward that derives its head count from a width the schedule halved, a pipeline stage that duplicates a
shared projection. :func:`numeric_check` runs the model instead:

1. **A shrunk copy.** Blocks whose recorded calls are the same (relative to the block) are checked once:
   each stack of blocks (:func:`slapo_lab.presets.find_blocks`) keeps the shortest prefix that holds one
   block of every distinct schedule, so per-layer properties that depend on the index (T5's relative bias in
   block 0, Gemma-3's sliding / full pattern) stay what they are. A Hugging Face model too large to run
   quickly is rebuilt from its config with small widths that keep its head structure: the same head and
   key/value head counts, a head dimension of 8, an intermediate size and a vocabulary that divide the
   tensor-parallel degree exactly when the original's do (so every ``shard`` of the schedule still applies,
   and every refusal still refuses). Calls on later blocks are mapped onto the kept block with the same
   schedule.
2. **Simulated ranks.** One thread per tensor-parallel rank, joined in an in-process process group
   (PyTorch's threaded backend, ``torch.testing._internal.distributed.multi_threaded_pg``: real
   ``torch.distributed`` collectives between threads), each replaying the calls on its own copy.
3. **The comparison** is :func:`slapo_lab.verify_models`, the same one the exported script's ``--verify``
   runs: weights, forward outputs and every gradient against the unsharded copy. Hooks on every module of
   both copies name the culprit (:class:`_Trace`):

   * a call of the schedule that is refused: the module it was called on;
   * a forward that fails: the module whose call raised (the deepest frame of the traceback that runs a
     method of a module), or the module inside it whose ``fwd_post`` sync returned another shape than the
     unsharded model's (a reduce-scatter where an all-reduce belongs, which only the block's residual add
     notices);
   * an output of another shape (an LM head without its gather): both shapes, at the first module whose
     output has another shape while every module around it has too;
   * outputs that differ: the first module, in forward order, whose output differs while every enclosing
     module's does too (partial sums a parent reduces are no fault); an output projection that completes
     its output from a rank's slice of heads names its parent (heads split in q but not k start there);
   * gradients alone: the first module, in the order autograd produces them, whose gradient for its own
     input differs (a column-parallel layer without its ``bwd_post`` all-reduce sends back a partial sum).
     That gradient is compared per module, where a partial sum is off by a large part of it even when, with
     freshly initialised weights (nearly uniform attention), the parameters' gradients move by less than
     Verify's tolerance: such a schedule is reported as failed too.

   Every dropout is off in the copy (:func:`dropout_off`), and a checkpointed module whose forward draws from
   Python's ``random`` (a LayerDrop-style layer skip, which checkpointing does not replay) is reported before
   anything runs (:func:`python_random_draw`).

4. **The pipeline**, when the schedule cuts: the calls replayed on one rank, the copy split into its stages
   (:func:`slapo_lab.pipeline.partition_pipeline`, as the exported script splits it), the stages run one
   after another with dropout off, and each original parameter's gradient compared as the pipeline runtimes
   produce it: summed over the stages that share it only where the partition lists it as shared (a stage
   that holds a copy of a shared projection nobody sums -- DeBERTa's relative embeddings once -- trains on
   a partial gradient, and a parameter name the model does not have is named).

The exported script's Verify remains the full proof (real model, real ranks, micro-batches, optimiser steps);
this check answers within seconds whether the schedule is right, and where it is not.

The package: this module holds :func:`numeric_check`, :func:`shrunk_copy` and the pipeline part;
:mod:`~slapo_lab.numeric.shrink` the shrunk copy's parts and its inputs (1.), :mod:`~slapo_lab.numeric.ranks`
the simulated ranks (2.), :mod:`~slapo_lab.numeric.culprit` the hooks that name the culprit (3.).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import threading
import time
from typing import Any

import torch
from torch import nn

from ..blocks import find_blocks
from ..errors import ScheduleError
from ..pipeline.partition import default_output_fn, partition_pipeline
from ..pipeline.runtime import set_graph_dropout
from ..record import Call, replay
from ..schedule import create_schedule
from ..utils import meta_copy
from .culprit import GRAD_ATOL as GRAD_ATOL
from .culprit import GRAD_NOISE as GRAD_NOISE
from .culprit import GRAD_RTOL as GRAD_RTOL
from .culprit import _rank_run
from .culprit import first_differing_input_grad as first_differing_input_grad
from .culprit import first_differing_module as first_differing_module
from .culprit import first_reshaped_module as first_reshaped_module
from .ranks import RanksStopped as RanksStopped
from .ranks import check_stop as check_stop
from .ranks import run_threaded_ranks as run_threaded_ranks
from .shrink import MAX_SEQ as MAX_SEQ
from .shrink import SMALL_HEAD_DIM as SMALL_HEAD_DIM
from .shrink import (
    _map_calls,
    _materialize,
    _n_params,
    _plan_blocks,
    _set_layer_counts,
    _shrink_config,
    _stack_lengths,
    _truncate,
)
from .shrink import dropout_off as dropout_off
from .shrink import python_random_draw as python_random_draw
from .shrink import remembered_inputs as remembered_inputs
from .shrink import shrunk_inputs as shrunk_inputs

__all__ = ["NumericReport", "RanksStopped", "check_stop", "numeric_check", "run_threaded_ranks"]

#: Below this many parameters (after keeping one block per distinct schedule) the copy keeps its widths.
SHRINK_ABOVE = 4_000_000
#: Above this many parameters even the shrunk copy is too large to check within seconds.
MAX_CHECK_PARAMS = 40_000_000


@dataclasses.dataclass
class NumericReport:
    """What :func:`numeric_check` found.

    Attributes:
        status: ``"passed"``, ``"failed"`` (the scheduled copy computes another model), ``"error"`` (a call or
            the forward fails: :attr:`message` says where) or ``"skipped"`` (nothing to run: why in
            :attr:`message`).
        message: one sentence for the user.
        module: the culprit (module docstring, 3.): the module whose call of the schedule was refused, whose
            forward raised, whose output first differs (in value or shape), or whose input gradient first
            differs in backward order; "" when none.
        worst: the largest absolute difference over outputs and gradients (0.0 when passed exactly, ``inf``
            on a shape mismatch, ``nan`` when not run).
        ranks: the simulated tensor-parallel ranks.
        blocks: ``(kept, total)`` blocks of the copy against the original.
        params: parameters of the copy that ran.
        seconds: wall time of the check.
        unjudged: the modules of the copy holding a sharded tensor that never ran on the example inputs (a
            vision or audio tower given text only): the check says nothing about their split, and
            :attr:`message` says so.
    """

    status: str
    message: str
    module: str = ""
    worst: float = math.nan
    ranks: int = 1
    blocks: tuple[int, int] = (0, 0)
    params: int = 0
    seconds: float = 0.0
    unjudged: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        """True when the scheduled copy equals the unsharded copy."""
        return self.status == "passed"

    def __str__(self) -> str:
        return self.message


def _refuse_too_big(n: int, kept_blocks: tuple[int, int]) -> None:
    if n > MAX_CHECK_PARAMS:
        raise ScheduleError(
            f"The numeric check skips this model: even with {kept_blocks[0]} of {kept_blocks[1]} blocks it has "
            f"{n / 1e6:.0f} M parameters (the live check runs up to {MAX_CHECK_PARAMS / 1e6:.0f} M)."
        )


def shrunk_copy(
    reference: nn.Module, calls: list[Call], world_size: int, seed: int = 2013, from_config: bool = False
):
    """A small copy of ``reference`` to check ``calls`` on, with real (seeded) weights.

    Args:
        reference: the unscheduled model, on any device (``meta`` included: a Hugging Face model is rebuilt
            from its config; any other model needs real weights).
        calls: the schedule's recorded calls (paths of ``reference``).
        world_size: the tensor-parallel degree the calls were recorded for.
        from_config: rebuild from the Hugging Face config even when small (``reference`` is a scheduled
            model, whose weights are shards).

    Returns:
        ``(copy, mapped calls without cuts, (kept blocks, total blocks), notes, mapped calls with the cuts)``.

    Raises:
        ScheduleError: a meta model without a Hugging Face config, or one still too large once shrunk.
    """
    meta = meta_copy(reference)
    blocks = find_blocks(create_schedule(meta, world_size=world_size))
    params = {b: dict(meta.get_submodule(b).named_parameters()) for b in blocks}
    stack_of = {b: b.rsplit(".", 1)[0] if "." in b else "" for b in blocks}
    common: dict[str, set[str]] = {}
    for b in blocks:  # the parameters every block of the stack has (T5's block 0 alone holds its bias table)
        common[stack_of[b]] = common.get(stack_of[b], set(params[b])) & set(params[b])
    shapes = {b: tuple((n, tuple(params[b][n].shape)) for n in sorted(common[stack_of[b]])) for b in blocks}
    keep, alias, tails = _plan_blocks(calls, blocks, shapes)
    lengths = {p: sum(1 for b in blocks if (b.rsplit(".", 1)[0] if "." in b else "") == p) for p in keep}
    mapped = _map_calls(calls, blocks, alias, tails=tails)
    mapped_cuts = _map_calls(calls, blocks, alias, keep_cuts=True, tails=tails)
    kept_blocks = (sum(keep.values()), len(blocks))
    _truncate(meta, keep)
    config = getattr(reference, "config", None)
    is_meta = any(p.is_meta for p in reference.parameters())
    notes: list[str] = []
    if (
        config is not None
        and hasattr(config, "to_dict")
        and (from_config or is_meta or _n_params(meta) > SHRINK_ABOVE)
    ):
        wide = copy.deepcopy(config)
        if _n_params(meta) > SHRINK_ABOVE:
            changed = _shrink_config(wide, world_size)
            if changed:
                notes.append("widths " + ", ".join(f"{k} {a}→{b}" for k, (a, b) in sorted(changed.items())))
        cfg = copy.deepcopy(wide)
        done = _set_layer_counts(cfg, keep, lengths)
        try:
            with torch.device("meta"):
                sized = type(reference)(cfg)
            _truncate(sized, {p: n for p, n in keep.items() if p not in done})
            got = _stack_lengths(sized, keep)
            if any(got[p] not in (n, -1) for p, n in keep.items()):  # a layer count served another stack
                cfg, done = wide, set()
                with torch.device("meta"):
                    sized = type(reference)(cfg)
                _truncate(sized, keep)
            _refuse_too_big(_n_params(sized), kept_blocks)
            torch.manual_seed(seed)
            model = type(reference)(cfg)
        except ScheduleError:
            raise
        except Exception as err:  # noqa: BLE001 - any constructor failure becomes one sentence
            raise ScheduleError(
                f"The numeric check could not rebuild {type(reference).__name__} from its config with small "
                f"widths ({type(err).__name__}: {err})."
            ) from None
        _truncate(model, {p: n for p, n in keep.items() if p not in done})
    elif is_meta:
        raise ScheduleError(
            f"The numeric check needs real weights or a Hugging Face config, and {type(reference).__name__} "
            "has neither (its parameters are on the meta device)."
        )
    else:  # the kept blocks' real weights, copied from the model (never a copy of the whole model)
        _refuse_too_big(_n_params(meta), kept_blocks)
        model = _materialize(meta, reference)
    dropout_off(model)
    model.train(False)
    return model, mapped, kept_blocks, notes, mapped_cuts


def _module_of(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0] if "." in param_name else ""


def _pipeline_check(base: nn.Module, calls: list[Call], inputs: dict):
    """The pipeline part (module docstring, 4.): None when the stages equal the unsharded copy, else
    ``(status, module, worst, one sentence)``."""
    reference = copy.deepcopy(base)
    sch = create_schedule(copy.deepcopy(base))
    try:
        replay(sch, calls)
        part = partition_pipeline(sch, inputs, 1)
    except ScheduleError as err:
        return "error", "", math.inf, f"The pipeline cannot be built from this schedule: {err}"
    except Exception as err:  # noqa: BLE001 - any failure of the split is said, never raised
        return (
            "error",
            "",
            math.inf,
            f"The pipeline cannot be built from this schedule ({type(err).__name__}: {_first_line(err)}).",
        )
    for st in part.stages:
        set_graph_dropout(st.module, False)
    try:
        out = _run_stages(part, inputs)
    except Exception as err:  # noqa: BLE001 - a stage that fails is said in one sentence
        return "error", "", math.inf, f"A pipeline stage fails ({type(err).__name__}: {_first_line(err)})."
    _dropout_off(reference)
    ref_out = default_output_fn(reference(**inputs))
    if out.shape != ref_out.shape or not torch.allclose(out.double(), ref_out.double(), atol=1e-5, rtol=1e-5):
        worst = (
            float((out.double() - ref_out.double()).abs().max()) if out.shape == ref_out.shape else math.inf
        )
        return (
            "failed",
            "",
            worst,
            f"The pipeline's output differs from the unsharded model's (worst difference {worst:.3g}).",
        )
    proj = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    (out * proj).sum().backward()
    (ref_out * proj).sum().backward()
    return _compare_stage_grads(part, dict(reference.named_parameters(remove_duplicate=False)))


def _run_stages(part: Any, inputs: dict) -> torch.Tensor:
    """The pipeline's output: the stages of ``part`` run one after the other on ``inputs`` (raises what a stage
    raises)."""
    env = dict(zip(part.input_names, part.flat_inputs((), inputs), strict=False))
    for st in part.stages:
        res = st.module(*[env[n] for n in st.inputs])
        env.update(zip(st.outputs, res if isinstance(res, (tuple, list)) else (res,), strict=False))
    return env[part.stages[-1].outputs[0]]


def _dropout_off(reference: nn.Module) -> None:
    """Train mode with dropout off (modules, and attention's own rate), as the stages run."""
    reference.train(True)
    for m in reference.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0


def _summed_tied_grads(part: Any) -> dict[tuple, torch.Tensor]:
    """``(stage, id(parameter)) -> gradient`` summed over the copies of one parameter across stages (what the
    runtimes all-reduce)."""
    summed: dict[tuple, torch.Tensor] = {}
    for group in part.tied:
        g = sum(
            part.stages[i].params[name].grad
            for i, name in group.items()
            if part.stages[i].params[name].grad is not None
        )
        for i, name in group.items():  # by tensor: a stage's aliases of it (T5's tied lm_head) share the sum
            summed[(i, id(part.stages[i].params[name]))] = g
    return summed


def _compare_stage_grads(part: Any, ref_params: dict[str, nn.Parameter]):
    """None when every stage parameter's gradient (tied copies summed) equals the unsharded model's, else
    ``(status, module, worst, one sentence)`` for the first that does not."""
    summed = _summed_tied_grads(part)
    for st in part.stages:
        for name, p in st.params.items():
            r = ref_params.get(name)
            if r is None:
                return (
                    "failed",
                    name.rsplit(".", 1)[0],
                    math.inf,
                    f"Pipeline stage {st.index} holds a parameter the model does not have: {name}.",
                )
            g = summed.get((st.index, id(p)), p.grad)
            rg = r.grad
            if g is None or rg is None:
                continue
            diff = float((g.double() - rg.double()).abs().max()) if g.shape == rg.shape else math.inf
            if g.shape != rg.shape or not torch.allclose(g.double(), rg.double(), atol=1e-5, rtol=1e-4):
                return (
                    "failed",
                    name.rsplit(".", 1)[0],
                    diff,
                    (
                        f"As pipeline stages the model trains {name} on another gradient than the unsharded "
                        f"model (stage {st.index}; worst difference {diff:.3g}): a parameter several stages hold "
                        "whose gradients are not summed?"
                    ),
                )
    return None


def numeric_check(
    reference: nn.Module,
    calls: list[Call],
    world_size: int,
    example_inputs: dict,
    timeout: float = 60.0,
    cancelled: threading.Event | None = None,
    from_config: bool = False,
) -> NumericReport:
    """Check ``calls`` numerically on a shrunk copy of ``reference`` over ``world_size`` simulated ranks.

    Args:
        reference: the unscheduled model (any device; see :func:`shrunk_copy`).
        calls: the recorded calls (``sch.record.calls``), paths of ``reference``.
        world_size: the tensor-parallel degree (1 checks replacements and checkpoints alone).
        example_inputs: keyword inputs of the model's forward (tensors; meta tensors are drawn at random;
            token inputs are cut to 2 samples of :data:`MAX_SEQ` positions).
        timeout: seconds before the ranks are told to stop (the report then says so).
        cancelled: set it to stop early; the report is then ``"skipped"``.
        from_config: see :func:`shrunk_copy`.

    Returns:
        NumericReport: never raises for a wrong schedule, a failing call or forward (those are reported).

    Raises:
        ScheduleError: only for a ``world_size`` below 1.
    """
    t0 = time.perf_counter()
    if not isinstance(world_size, int) or world_size < 1:
        raise ScheduleError(f"The numeric check needs a positive integer world size, not {world_size!r}.")

    def done(status, message, **kw) -> NumericReport:
        return NumericReport(status, message, ranks=world_size, seconds=time.perf_counter() - t0, **kw)

    if not example_inputs:
        return done("skipped", "The numeric check needs example inputs (pass example_inputs= to the editor).")
    try:
        base, mapped, kept, _notes, with_cuts = shrunk_copy(
            reference, list(calls), world_size, from_config=from_config
        )
        inputs = shrunk_inputs(example_inputs, base, reference=reference)
    except ScheduleError as err:
        return done("skipped", str(err))
    except Exception as err:  # noqa: BLE001 - the copy cannot be made: said, never raised
        return done(
            "skipped",
            f"The numeric check skipped: it could not make a small copy of {type(reference).__name__} to run "
            f"({type(err).__name__}: {_first_line(err)}).",
        )
    n_params = _n_params(base)
    kw = {"blocks": kept, "params": n_params}
    verdict = _before_ranks(base, mapped, inputs, cancelled)
    if verdict is not None:
        return done(verdict[0], verdict[1], **verdict[2], **kw)

    failures: dict[int, Any] = {}
    try:
        results, errors, stopped = run_threaded_ranks(
            functools.partial(_rank_run, base, mapped, inputs, failures), world_size, timeout, cancelled
        )
    except ScheduleError as err:
        return done("skipped", str(err), **kw)
    verdict = _ranks_stopped(stopped, cancelled, timeout, failures, errors, len(results), world_size)
    if verdict is None:
        report, first_module, reshaped, grad_at, unjudged = results[0]
        worst = max([c.max_abs for c in report.outputs + report.grads] or [0.0])
        if report.passed:
            verdict = _passed_verdict(
                grad_at, worst, unjudged, world_size, kept, n_params, base, with_cuts, inputs, cancelled
            )
        else:
            verdict = _failed_verdict(report, first_module, reshaped, grad_at, worst, world_size)
    return done(verdict[0], verdict[1], **verdict[2], **kw)


#: ``(status, message, NumericReport's other fields)``: what :func:`numeric_check` reports.
_Verdict = tuple[str, str, dict[str, Any]]


def _first_line(err: BaseException) -> str:
    """The first line of ``err``'s text ("" when it has none)."""
    return str(err).strip().splitlines()[0] if str(err).strip() else ""


def _ranks_word(world_size: int) -> str:
    return f"{world_size} simulated rank{'s' if world_size > 1 else ''}"


def _before_ranks(
    base: nn.Module, mapped: list[Call], inputs: dict, cancelled: threading.Event | None
) -> _Verdict | None:
    """What to report without running the ranks (a checkpoint around Python's random generator, a failing
    unscheduled copy, a cancelled check), or None."""
    verdict = _random_in_checkpoint(base, mapped) or _unscheduled_fails(base, inputs)
    if verdict is None and cancelled is not None and cancelled.is_set():
        verdict = "skipped", "The numeric check was cancelled.", {}
    return verdict


def _random_in_checkpoint(base: nn.Module, mapped: list[Call]) -> _Verdict | None:
    """A failure when a checkpointed module of the copy draws from Python's or NumPy's random generator, whose
    state activation checkpointing does not restore; else None."""
    for c in mapped:
        if c.primitive != "checkpoint":
            continue
        try:
            drawn = python_random_draw(base.get_submodule(c.path) if c.path else base)
        except AttributeError:
            continue
        if drawn is not None:
            return (
                "failed",
                (
                    f"{c.path or 'The model root'} is checkpointed, but {drawn} draws from Python's (or NumPy's) "
                    "random generator, whose state activation checkpointing does not restore, so the recompute in "
                    "the backward can take another branch (a skipped layer) than the forward did; draw with torch "
                    f"(torch.rand, restored by checkpointing) or leave {c.path or 'it'} unchecked."
                ),
                {"module": c.path, "worst": math.nan},
            )
    return None


def _unscheduled_fails(base: nn.Module, inputs: dict) -> _Verdict | None:
    """A skip when the unscheduled copy's own forward fails on the inputs (the check cannot judge the
    schedule then); else None."""
    try:  # on a copy: a forward may leave non-leaf tensors on the modules (RecurrentGemma's state), which
        copy.deepcopy(base)(**inputs)  # the ranks' copies of ``base`` could then not deep-copy
    except Exception as err:  # noqa: BLE001 - the unscheduled copy itself: the check cannot judge the schedule
        return (
            "skipped",
            (
                f"The numeric check skipped: the unscheduled copy's forward fails on the example inputs "
                f"({type(err).__name__}: {_first_line(err)})."
            ),
            {},
        )
    return None


def _ranks_stopped(
    stopped: Any,
    cancelled: threading.Event | None,
    timeout: float,
    failures: dict[int, Any],
    errors: dict[int, BaseException],
    n_results: int,
    world_size: int,
) -> _Verdict | None:
    """What to report when the simulated ranks did not all finish (cancelled, timed out, a rank failed or
    left); None when they did."""
    if stopped == "cancelled" or (cancelled is not None and cancelled.is_set()):
        return "skipped", "The numeric check was cancelled.", {}
    if stopped == "timeout":
        phase = next((f[0] for f in failures.values()), "running")
        return "error", f"The numeric check stopped after {timeout:.0f} s while {phase}.", {}
    real = [
        failures.get(r, ("starting the rank", "", e))
        for r, e in sorted(errors.items())
        if not isinstance(e, SystemExit)
    ]
    if real:
        phase, module, exc = real[0]
        at = f" in {module}" if module else ""
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if not isinstance(exc, ScheduleError):
            text = f"{type(exc).__name__}: {text}"
        return (
            "error",
            f"The scheduled model fails{at} while {phase} on {_ranks_word(world_size)}: {text}",
            {"module": module, "worst": math.inf},
        )
    if n_results < world_size:  # only told to leave, with no rank failing: nothing to judge by
        return "error", "The numeric check's simulated ranks stopped before they finished.", {}
    return None


def _passed_verdict(
    grad_at: tuple[str, float] | None,
    worst: float,
    unjudged: list[str],
    world_size: int,
    kept: tuple[int, int],
    n_params: int,
    base: nn.Module,
    with_cuts: list[Call],
    inputs: dict,
    cancelled: threading.Event | None,
) -> _Verdict:
    """The verdict when the ranks' outputs and gradients are within verify's tolerance: failed still for an
    input gradient nobody reduced, or for the pipeline part; else passed, saying which modules went
    unjudged."""
    if grad_at is not None:  # below verify's tolerance, but a partial sum nobody reduced
        return (
            "failed",
            (
                f"The scheduled model differs from the unsharded one: only gradients differ, first the gradient "
                f"{grad_at[0]} sends back to its input (off by {grad_at[1]:.0%} of its largest value; the "
                f"parameters' gradients differ by only {worst:.3g} with these weights, more with trained ones) on "
                f"{_ranks_word(world_size)}."
            ),
            {"module": grad_at[0], "worst": worst},
        )
    stages = sum(c.primitive == "cut_pipeline_stage" for c in with_cuts) + 1
    if stages > 1:
        if cancelled is not None and cancelled.is_set():
            return "skipped", "The numeric check was cancelled.", {}
        pp = _pipeline_check(base, with_cuts, inputs)
        if pp is not None:
            status, module, pp_worst, text = pp
            return status, text, {"module": module, "worst": pp_worst}
    caveat = ""
    if unjudged:
        caveat = (
            f" {len(unjudged)} module{'s' if len(unjudged) > 1 else ''} holding a sharded tensor never ran on "
            f"the example inputs ({', '.join(unjudged[:2])}{' ...' if len(unjudged) > 2 else ''}), so the "
            "check did not judge their split; give inputs that reach them to check it (for a vision or audio "
            "tower, slapo_lab.multimodal_inputs.multimodal_inputs(model, inputs) adds them)."
        )
    return (
        "passed",
        f"Numerically equal to the unsharded model on {_ranks_word(world_size)}"
        + (f" and as {stages} pipeline stages" if stages > 1 else "")
        + f" (worst difference {worst:.1e}; {kept[0]} of {kept[1]} blocks, {n_params / 1e6:.1f} M parameters)."
        + caveat,
        {"worst": worst, "unjudged": tuple(unjudged)},
    )


def _failed_verdict(
    report: Any,
    first_module: str | None,
    reshaped: tuple | None,
    grad_at: tuple[str, float] | None,
    worst: float,
    world_size: int,
) -> _Verdict:
    """The verdict when verify's comparison failed: what differs first (weights, an output's shape, an
    output, an input gradient, a parameter's gradient) and where."""
    ranks = f"on {_ranks_word(world_size)}"
    bad_w = [c for c in report.weights if not c.ok]
    bad_g = [c for c in report.grads if not c.ok]
    bad_shape = next((c for c in report.outputs if c.max_abs >= 1e300), None)  # inf, as verify reduces it
    if bad_w:
        what, first = "the weights differ first", _module_of(bad_w[0].name)
    elif bad_shape is not None and reshaped is not None:
        first, got, want = reshaped
        return (
            "failed",
            (
                f"The scheduled model's output {bad_shape.name} has another shape than the unsharded one's: "
                f"{first or 'the model root'} returns {_shape(got)} where the unsharded model returns "
                f"{_shape(want)} ({ranks})."
            ),
            {"module": first, "worst": math.inf},
        )
    elif first_module is not None:
        what, first = "outputs first differ", first_module
    elif grad_at is not None:
        first = grad_at[0]
        return (
            "failed",
            (
                f"The scheduled model differs from the unsharded one: only gradients differ, first the gradient "
                f"{first} sends back to its input (off by {grad_at[1]:.0%} of its largest value; worst difference "
                f"{worst:.3g} {ranks})."
            ),
            {"module": first, "worst": worst},
        )
    elif bad_g:
        what, first = "only gradients differ, first", _module_of(bad_g[0].name)
    else:
        what, first = "outputs differ", next((c.name for c in report.outputs if not c.ok), "")
    return (
        "failed",
        (
            f"The scheduled model differs from the unsharded one: {what} at {first or 'the model root'} "
            f"(worst difference {worst:.3g} {ranks})."
        ),
        {"module": first, "worst": worst},
    )


def _shape(shape: tuple) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"
