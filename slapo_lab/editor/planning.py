"""The Plan pane's controller, without widgets: plan the layout for a cluster, choose a candidate, record it.

:class:`PlanController` is owned by :class:`~slapo_lab.editor.state.EditorState` (``state.planner``), so a script
or a test drives the Plan pane's flow by calls::

    st = EditorState(model, example_inputs)
    st.planner.run(nodes=1, gpus_per_node=4, gpu="H100-SXM", seq_len=2048, global_batch_size=64)
    st.planner.apply(0)                          # one action: one Undo removes it
    st.export("train.py", **st.planner.export_kwargs())

:meth:`PlanController.run` searches with :func:`slapo_lab.planner.auto_plan` (the user's model, every TP degree
within a node); :meth:`PlanController.apply` records the chosen :class:`~slapo_lab.planner.Estimate` through the
state's action path (:meth:`~slapo_lab.planner.Estimate.apply`: the Megatron preset, checkpointed blocks, the
balanced pipeline cuts), first replaying the schedule at the plan's TP degree
(:meth:`~slapo_lab.editor.state.EditorState.set_tp`) and setting the cluster shape; :meth:`export_kwargs` turns
the candidate's :meth:`~slapo_lab.planner.Estimate.export_options` into the Export form's options. The widget
(:mod:`slapo_lab.editor.plan_panel`) only draws :meth:`rows` and :meth:`why_not` and forwards clicks.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ..errors import ScheduleError
from ..planner import DEVICES, Cluster, Estimate, Plan, auto_plan
from ..planner.devices import GiB

__all__ = ["PlanController", "PlanRequest"]

_log = logging.getLogger("slapo_lab.editor")

#: what a sharded data-parallel layout is in the Export form: (launcher, form options)
_SHARD_FORM = {
    "none": ("torchrun", {"fsdp": False}),
    "fsdp": ("torchrun", {"fsdp": True}),
    "zero1": ("deepspeed", {"zero": 1}),
    "zero2": ("deepspeed", {"zero": 2}),
}


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """What the Plan pane asks :func:`~slapo_lab.planner.auto_plan` for.

    Attributes:
        nodes / gpus_per_node: the cluster shape (positive ints).
        gpu: a built-in device profile name (:data:`slapo_lab.planner.DEVICES`).
        seq_len: tokens per sequence; global_batch_size: sequences per optimizer step.
        dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"``; top_k: rows of the ranked table.
    """

    nodes: int = 1
    gpus_per_node: int = 8
    gpu: str = "H100-SXM"
    seq_len: int = 2048
    global_batch_size: int = 8
    dtype: str = "bf16"
    top_k: int = 5


class PlanController:
    """The Plan pane's state: the last request, its :class:`~slapo_lab.planner.Plan`, the chosen candidate.

    Args:
        state: the :class:`~slapo_lab.editor.state.EditorState` it plans for (held, not inherited).

    Attributes:
        request: the last :class:`PlanRequest` (the defaults read from the state before the first run).
        result: the last :class:`~slapo_lab.planner.Plan`, or None.
        chosen: the applied :class:`~slapo_lab.planner.Estimate`, or None (cleared by a new run).
        listeners: callables run with no argument after :meth:`run` and :meth:`apply` (a view redraws).
    """

    def __init__(self, state) -> None:
        self.state = state
        self.request: PlanRequest | None = None
        self.result: Plan | None = None
        self.chosen: Estimate | None = None
        self.listeners: list = []

    # ------------------------------------------------------------------ the request
    def defaults(self) -> PlanRequest:
        """The request before the user names one: the state's cluster shape, the example inputs' sequence length
        and batch (2048 and 8 without them), H100-SXM, bf16."""
        if self.request is not None:
            return self.request
        batch, seq = self.state.export_form.example_sizes()
        shape = self.state.cluster
        return PlanRequest(shape.nodes, shape.gpus_per_node, "H100-SXM", seq or 2048, batch or 8)

    def run(self, **changes: Any) -> Plan:
        """Search the layouts for the request (the last one, or :meth:`defaults`, with ``changes``: any field of
        :class:`PlanRequest`, plus :func:`~slapo_lab.planner.auto_plan`'s search keywords such as
        ``checkpoints=`` or ``pp_schedules=``, passed through).

        Planning reads only the user's model (never changed by the editor), so it may run in a background thread.

        Returns:
            The :class:`~slapo_lab.planner.Plan` (also :attr:`result`).

        Raises:
            ScheduleError: an unknown field, a bad value (a GPU name not in ``DEVICES``, a non-positive size) or a
                model the planner cannot profile; one sentence.
        """
        fields = {f.name for f in dataclasses.fields(PlanRequest)}
        req = dataclasses.replace(self.defaults(), **{k: v for k, v in changes.items() if k in fields})
        search = {k: v for k, v in changes.items() if k not in fields}
        for name in ("seq_len", "global_batch_size", "top_k"):
            v = getattr(req, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ScheduleError(f"Plan: {name} must be a positive whole number, not {v!r}.")
        if isinstance(req.gpu, str) and req.gpu not in DEVICES:
            raise ScheduleError(f"Plan: unknown GPU {req.gpu!r}; choose one of {', '.join(DEVICES)}.")
        cluster = Cluster(req.nodes, req.gpus_per_node, req.gpu)
        try:
            result = auto_plan(
                self.state.model,
                cluster,
                seq_len=req.seq_len,
                global_batch_size=req.global_batch_size,
                dtype=req.dtype,
                top_k=req.top_k,
                **search,
            )
        except TypeError as err:  # an unknown search keyword
            raise ScheduleError(f"Plan: {err}.") from err
        self.request, self.result, self.chosen = req, result, None
        self._changed()
        return result

    # ------------------------------------------------------------------ what the pane shows
    def rows(self) -> list[dict]:
        """The ranked table of :attr:`result`, best first: ``{"rank", "layout", "peak_gib", "step_s",
        "tokens_per_s_per_gpu", "mfu"}`` (GiB, seconds per optimizer step, tokens/s per GPU, MFU 0..1)."""
        if self.result is None:
            return []
        return [
            {
                "rank": i,
                "layout": e.layout.describe(),
                "peak_gib": e.peak_memory_bytes / GiB,
                "step_s": e.step_time_s,
                "tokens_per_s_per_gpu": e.tokens_per_s_per_gpu,
                "mfu": e.mfu,
            }
            for i, e in enumerate(self.result.candidates)
        ]

    def why_not(self) -> list[tuple[int, str]]:
        """The rejected layouts grouped by reason, most frequent first: ``(count, sentence)``."""
        return [] if self.result is None else [(r.count, r.sentence) for r in self.result.rejected]

    # ------------------------------------------------------------------ choosing one
    def candidate(self, index: int) -> Estimate:
        """The ``index``-th candidate of :attr:`result` (0 the best).

        Raises:
            ScheduleError: no plan yet, or no such row (one sentence).
        """
        if self.result is None:
            raise ScheduleError("Plan first: there is no ranked table to choose from.")
        if (
            isinstance(index, bool)
            or not isinstance(index, int)
            or not 0 <= index < len(self.result.candidates)
        ):
            raise ScheduleError(
                f"The plan has {len(self.result.candidates)} candidates; there is no row {index!r} to apply."
            )
        return self.result.candidates[index]

    def apply(self, index: int = 0) -> str | None:
        """Record candidate ``index`` on the schedule: set the cluster shape, replay at its TP degree when it differs
        (:meth:`~slapo_lab.editor.state.EditorState.set_tp`), then its calls as one action (one Undo removes them;
        all or nothing: a refusal leaves the schedule as it was).

        Returns:
            None, or the one sentence (also on the message line) saying why nothing was recorded.
        """
        st = self.state
        try:
            est = self.candidate(index)
        except ScheduleError as err:
            return st._error(str(err))
        with st._lock:
            if st._busy:
                return st._error("Still applying the previous action; try again in a moment.")
            cl = est.cluster
            if (st.cluster.nodes, st.cluster.gpus_per_node) != (cl.nodes, cl.gpus_per_node):
                st.set_cluster(cl.nodes, cl.gpus_per_node)
            why = st.set_tp(est.layout.tp)
            if why:
                return why
            label = f"plan {est.layout.describe()}"
            n0 = len(st.schedule.record.calls)
            try:
                st._run_action(label, lambda: est.apply(st.schedule))
            except Exception as err:  # noqa: BLE001 - never let a click kill the kernel or lose the record
                if not isinstance(err, ScheduleError):
                    _log.exception("applying the plan failed")
                msg = str(err) if isinstance(err, ScheduleError) else f"{type(err).__name__}: {err}"
                return st._error(f"The plan was not applied: {msg}")
            n = len(st.schedule.record.calls) - n0
            self.chosen = est
            st._info(
                f"Applied the plan {est.layout.describe()} with {n} call{'s' if n != 1 else ''} (one Undo removes "
                "them); the Export form has its options."
                if n
                else f"The plan {est.layout.describe()} added no call: the schedule has it all; the Export form "
                "has its options."
            )
        self._changed()
        return None

    def export_kwargs(self, index: int | None = None) -> dict:
        """The Export form's options for the chosen candidate (or row ``index``): ``launcher`` (deepspeed for a
        ZeRO stage), ``dp``, ``fsdp`` or ``zero``, ``global_batch_size``, ``micro_batch_size``, ``seq_len``, and the
        plan's ``predicted_step_s`` / ``predicted_peak_gib``, which the script prints its measurements against;
        ``state.export(path, **export_kwargs())`` writes the plan's run.

        Raises:
            ScheduleError: nothing chosen and no ``index`` (one sentence).
        """
        est = self.chosen if index is None else self.candidate(index)
        if est is None:
            raise ScheduleError("Apply a plan first: no candidate is chosen.")
        opts = est.export_options()
        launcher, shard = _SHARD_FORM[opts["shard"]]
        out = {"launcher": launcher, "dp": opts["dp"], **shard}
        out["global_batch_size"] = opts["global_batch_size"]
        out["micro_batch_size"] = opts["micro_batch_size"]
        out["predicted_step_s"] = opts["predicted_step_s"]  # the script prints its measurements against them
        out["predicted_peak_gib"] = opts["predicted_peak_gib"]
        if self.request is not None:
            out["seq_len"] = self.request.seq_len
        return out

    def _changed(self) -> None:
        for fn in list(self.listeners):
            try:
                fn()
            except Exception:  # noqa: BLE001 - a view must never break the controller
                _log.exception("plan view refresh failed")
