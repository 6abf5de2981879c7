"""The editor's memory plan without widgets: the per-rank memory of the schedule as it is now, priced after each change.

:class:`MemoryPricer` is owned by :class:`~slapo_lab.editor.state.EditorState` (``state.memory``) and holds it. It
prices :func:`slapo_lab.plan.plan` for the state's schedule and example inputs, for the dp and FSDP / ZeRO the state's
``_plan_layout`` hook says (:meth:`MemoryPricer.default_layout` without a form), and keeps the result
(:attr:`MemoryPricer.plan`), why it failed (:attr:`MemoryPricer.problem`) and whether the activation pass is left to
the background work (:attr:`MemoryPricer.pending`). :class:`~slapo_lab.editor.memory_panel.MemoryPanel` draws it.
"""

from __future__ import annotations

import logging

from ..activation_cache import has_cached_profile, is_composed
from ..errors import ScheduleError
from .cluster import data_parallel
from .costs import memory_failure

__all__ = ["ACTIVATIONS", "MemoryPricer"]

_log = logging.getLogger("slapo_lab.editor")

#: What the memory plan counts as activations: what autograd saves, SDPA as flash attention
#: (:data:`slapo_lab.activations.ATTENTION_KERNEL`), composed from the distinct blocks of a deep model
#: (:mod:`slapo_lab.activation_cache`).
ACTIVATIONS = "autograd"


class MemoryPricer:
    """The memory plan of one editor state.

    Args:
        state: the :class:`~slapo_lab.editor.state.EditorState` (its ``schedule``, ``example_inputs``,
            ``world_size``, ``dims()``, cluster shape, ``export_options`` and its ``_plan_layout`` hook).

    Attributes:
        plan: the :class:`~slapo_lab.plan.Plan` of the last :meth:`price` (per-rank bytes per stage), or None when
            it could not be priced (:attr:`problem` says why) or before the first.
        problem: one sentence when the plan or its activation pass failed, else None.
        pending: True while a whole-model activation pass is left to a kernel's background work (the plan then
            holds no activations until it is done).
    """

    def __init__(self, state) -> None:
        self.state = state
        self.plan = None
        self.problem: str | None = None
        self.pending = False

    def default_layout(self) -> tuple[int, str | None, str]:
        """``(dp, shard, note)`` without an export form: dp fills the cluster shape once it is set
        (:meth:`EditorState.set_cluster <slapo_lab.editor.state.EditorState.set_cluster>`), else 1; the last
        export's options say FSDP (``"fsdp"``) or a ZeRO stage (``"zero1"`` / ``"zero2"``), else None."""
        st = self.state
        dp = data_parallel(st.cluster, st.world_size, st.dims().pp)[0] if st._cluster_set else 1
        exported = st.export_options or {}
        opts = exported.get("options") or {}
        if exported.get("launcher") == "deepspeed":
            shard = {1: "zero1", 2: "zero2"}.get(opts.get("zero"))
        else:
            shard = "fsdp" if opts.get("fsdp") else None
        return dp, shard, ""

    def _defers(self, inputs, defer_whole_pass: bool) -> bool:
        """Whether the activation pass for ``inputs`` is left to the background: asked to (a kernel), and neither
        cached for this schedule nor composed from its blocks (a model without a stack of blocks)."""
        sch = self.state.schedule
        return bool(
            inputs is not None
            and defer_whole_pass
            and not has_cached_profile(sch, inputs, ACTIVATIONS)
            and not is_composed(sch, inputs, ACTIVATIONS)
        )

    def price(self, defer_whole_pass: bool = False):
        """Price :attr:`plan` for the schedule as it is now (:meth:`EditorState.price_memory
        <slapo_lab.editor.state.EditorState.price_memory>` says what and how fast). Nothing raises: a failed
        activation pass prices the rest and says why in :attr:`problem`.

        Returns:
            The :class:`~slapo_lab.plan.Plan`, or None when even the parameter count failed.
        """
        from ..plan import plan  # noqa: PLC0415 - looked up at each call: tests replace plan.plan

        st = self.state
        dp, shard, _ = st._plan_layout()
        inputs = st.example_inputs or None
        self.pending = self._defers(inputs, defer_whole_pass)
        if self.pending:
            inputs = None
        self.problem = None
        try:
            try:
                pl = plan(
                    st.schedule,
                    example_inputs=inputs,
                    activation=ACTIVATIONS if inputs is not None else None,
                    dp=dp,
                    shard=shard,
                )
            except ScheduleError as err:  # e.g. a weight sharded but not yet its bias: the forward fails
                _log.info("activation estimate failed: %s", err)
                pl = plan(st.schedule, activation=None, dp=dp, shard=shard)
                self.problem = memory_failure(err, "activations not estimated")
        except Exception as err:  # noqa: BLE001 - said in one sentence, never raised past this point
            _log.warning("memory plan failed", exc_info=True)
            pl = None
            self.problem = memory_failure(err, "Memory plan unavailable")
        self.plan = pl
        return pl
