"""Hugging Face's own tensor-parallel plans applied with this project's primitives: :func:`hf_tp_plan` reads
``config.base_model_tp_plan`` (transformers 5.x, e.g. Llama's ``{"layers.*.self_attn.q_proj": "colwise",
...}``) relative to the schedule, and :func:`apply_hf_tp_plan` maps each style (``colwise``, ``rowwise``,
``colwise_gather_output``, ``replicated_with_grad_allreduce``, ``moe_tp_experts``) onto
:func:`~slapo_lab.presets.parallel.column_parallel` / ``row_parallel`` / ``experts_parallel`` and syncs.
"""

from __future__ import annotations

import re

from ..errors import ScheduleError
from ..record import Call
from .parallel import _all_or_nothing, _ensure_sync, _since, column_parallel, experts_parallel, row_parallel


def hf_tp_plan(sch) -> dict[str, str]:
    """HF's tensor-parallel plan for the model's blocks, with paths relative to ``sch``.

    ``config.base_model_tp_plan`` (e.g. Llama: ``{"layers.*.self_attn.q_proj": "colwise", ...}``) is keyed
    relative to the base model (``model.base_model_prefix``, e.g. ``model``); ``*`` matches one path
    component. Empty when the config has no plan.
    """
    cfg = getattr(sch.mod, "config", None)
    plan = getattr(cfg, "base_model_tp_plan", None) or {}
    prefix = getattr(sch.mod, "base_model_prefix", "") or ""
    if prefix and prefix not in sch.child:
        prefix = ""
    return {(f"{prefix}.{k}" if prefix else k): v for k, v in plan.items()}


_HF_STYLES = {
    "colwise": "column",
    "rowwise": "row",
    "colwise_gather_output": "column_gather",
    "replicated_with_grad_allreduce": "grad_allreduce",
    "moe_tp_experts": "experts",
    "packed_colwise": "packed_column",
}
# styles HF also uses for single parameters of an experts module (covered by that module's "moe_tp_experts")
_HF_PARAM_STYLES = ("packed_colwise", "colwise", "rowwise")


@_all_or_nothing
def apply_hf_tp_plan(sch, plan: dict[str, str] | None = None) -> list[Call]:
    """Apply an HF tensor-parallel plan (default :func:`hf_tp_plan`) with our primitives.

    ``"colwise"`` -> :func:`column_parallel`, ``"rowwise"`` -> :func:`row_parallel`,
    ``"colwise_gather_output"`` -> column parallel plus ``fwd_post all_gather(axis=-1,
    tensor_parallel_output_grad=False)``, ``"replicated_with_grad_allreduce"`` (Qwen3's per-head ``q_norm`` /
    ``k_norm``) -> ``sync(mode="bwd_post", sync_op_or_fn="all_reduce", param_grads=True)``,
    ``"moe_tp_experts"`` (Mixtral's ``mlp.experts``) -> :func:`experts_parallel`; the plan's entries for
    that module's parameters (``experts.gate_up_proj: packed_colwise``, ``experts.down_proj: rowwise``) are
    what :func:`experts_parallel` does, so they are covered by it. Modules are visited in tree order.
    Entries of the config's own plan that match no module of this model (layer kinds the family has but this
    config does not build) are skipped, as HF does; an explicit ``plan`` must match everywhere.

    Raises:
        ScheduleError: for an empty plan, a style with no mapping, or an explicit plan's pattern that matches
            nothing (all checked before anything changes).
    """
    from_config = plan is None
    plan = hf_tp_plan(sch) if plan is None else plan
    if not plan:
        raise ScheduleError(
            "The model's config has no base_model_tp_plan; use megatron_tp(sch, family=...) instead."
        )
    compiled = _compile_plan(plan)
    targets, hit = _plan_targets(sch, plan, compiled)
    packed = next((p for p, kind in targets if kind == "packed_column"), None)
    if packed is not None:
        raise ScheduleError(
            f"HF tensor-parallel style 'packed_colwise' on the module {packed} (a fused projection) "
            "has no preset mapping; it is supported for the weights of an experts module only."
        )
    missing = [pat for pat, _, _ in compiled if pat not in hit]
    if missing and from_config and hit:
        # a config's plan covers every layer kind of the family (Qwen3-MoE's dense mlp.gate_proj exists only
        # with mlp_only_layers): entries for kinds this model does not build are skipped, as HF does
        missing = []
    if missing:
        raise ScheduleError(f"The tensor-parallel plan entry {missing[0]!r} matches no module.")
    n = len(sch.record)
    for p, kind in targets:
        _apply_hf_kind(sch, p, kind)
    return _since(sch, n)


def _compile_plan(plan: dict[str, str]) -> list[tuple[str, re.Pattern, str]]:
    """``(pattern, regex, kind)`` per plan entry (``*`` matches one path component).

    Raises:
        ScheduleError: a style with no mapping.
    """
    compiled = []
    for pat, style in plan.items():
        if style not in _HF_STYLES:
            raise ScheduleError(
                f"HF tensor-parallel style {style!r} (for {pat}) has no preset mapping; supported: "
                f"{', '.join(_HF_STYLES)}."
            )
        rx = re.compile("^" + r"\.".join("[^.]+" if c == "*" else re.escape(c) for c in pat.split(".")) + "$")
        compiled.append((pat, rx, _HF_STYLES[style]))
    return compiled


def _plan_targets(
    sch, plan: dict[str, str], compiled: list[tuple[str, re.Pattern, str]]
) -> tuple[list[tuple[str, str]], set[str]]:
    """``(targets, hit)``: ``(module path, kind)`` of every module the first matching entry names, in tree order,
    and the patterns that matched (a parameter entry of an experts module counts: experts_parallel shards it)."""
    targets = []
    hit = set()
    for p, _node in sch.named_schedules():
        for pat, rx, kind in compiled:
            if rx.match(p):
                targets.append((p, kind))
                hit.add(pat)
                break
    experts = {p for p, kind in targets if kind == "experts"}
    for pat, rx, _kind in compiled:
        if pat in hit or plan[pat] not in _HF_PARAM_STYLES:
            continue
        owners = {
            p
            for p, node in sch.named_schedules()
            for name in node.mod._parameters
            if rx.match(f"{p}.{name}" if p else name)
        }
        if owners and owners <= experts:
            hit.add(pat)  # a parameter of an experts module that experts_parallel shards
    return targets, hit


def _apply_hf_kind(sch, p: str, kind: str) -> None:
    """The primitives of one plan kind on the module ``p``."""
    if kind == "row":
        row_parallel(sch, p)
    elif kind == "grad_allreduce":
        _ensure_sync(sch[p], "bwd_post", "all_reduce", param_grads=True)
    elif kind == "experts":
        experts_parallel(sch, p)
    else:
        column_parallel(sch, p)
        if kind == "column_gather":
            _ensure_sync(sch[p], "fwd_post", "all_gather", axis=-1, tensor_parallel_output_grad=False)
