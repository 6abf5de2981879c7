"""Schedule check: what a tensor-parallel schedule still lacks before the model equals the original.

Each primitive validates itself when it is called (``shard`` refuses an axis that does not divide,
``sync`` refuses an all_reduce of a complete output ...), but a schedule is built one call at a time,
and some half-built states run without an error and compute a different model. :func:`check_schedule`
looks at the whole schedule and names each open item in one sentence, with the call that closes it:

* **partial sums never reduced** — a row-parallel layer (weight split on its input features, or
  tensor-parallel experts' ``down_proj``) produces per-rank partial sums; unless a ``fwd_post``
  ``all_reduce`` / ``reduce_scatter`` on it or on a module around it sums them, every later layer
  computes on a fraction of the activation (Megatron-LM's ``g`` operator, Shoeybi et al., 2019, §3);
* **input gradient never reduced** — a column-parallel dense layer (weight split on its output
  features) receives a replicated input, so each rank's gradient of that input is a partial sum;
  unless a ``bwd_post`` ``all_reduce`` on it or on a module around it sums them (Megatron's ``f``), the
  layers before it train on wrong gradients while the forward looks right. Skipped when the schedule
  uses ``reduce_scatter`` (sequence parallelism: the input arrives through an ``all_gather`` whose
  backward reduces);
* **attention heads split in some projections only** — q, k, v (or a fused qkv: GPT-2's ``c_attn``,
  Falcon's / BLOOM's ``query_key_value``, Phi-3's ``qkv_proj``, recognised by their layout,
  :func:`slapo_lab.sharding.rules.fused_layout`) and the output projection of one attention module must
  all split the same heads; otherwise each rank pairs its query heads with other heads' keys, which
  grouped-query attention can even compute without a shape error. The output projection is the
  attention's ``o_proj`` / ``out_proj`` / ``c_proj`` ..., ``dense`` beside a fused qkv (Falcon, BLOOM) or
  in ALBERT, or BERT / ViT's ``output.dense`` beside the heads' module;
* **per-head norm gradients never reduced** — a norm inside an attention module whose heads are split
  (Qwen3's ``q_norm`` / ``k_norm``: one weight shared by every head) gets a partial gradient on each rank
  unless ``sync(mode="bwd_post", sync_op_or_fn="all_reduce", param_grads=True)`` sums it;
* **a column-parallel bias left whole** — the layer's output is this rank's slice, its bias the whole
  vector (the forward fails on the shape).

It reads only the schedule's own state (each module's :class:`~slapo_lab.module_state.ModuleMeta`); no forward runs, so it costs
a walk of the module tree (10 to 20 ms for an 80-layer 70B model on meta after the Megatron preset).
A clean check is not a proof: :class:`slapo_lab.Verify` is (it compares outputs and gradients with the
original model).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from .atomic import atomic
from .errors import ScheduleError
from .module_state import ModuleMeta, has_sequence_parallel, peek_meta, syncs_of
from .numeric import numeric_check, remembered_inputs
from .primitives.tensor_parallel import PARAM_GRADS_OP
from .record import Call, format_call
from .sharding.rules import (
    DenseRule,
    ShardSite,
    attention_heads,
    attention_role,
    get_shard_rule,
    head_dim,
    is_norm,
)

__all__ = ["Finding", "check_schedule", "close_open_items"]


@dataclasses.dataclass(frozen=True)
class Finding:
    """One open item of a schedule.

    Attributes:
        path: the module it is about (a path of the scheduled model, "" for the root).
        kind: ``"unreduced_partial"``, ``"unreduced_input_grad"``, ``"partial_heads"``, ``"whole_bias"``,
            ``"unreduced_param_grads"``, ``"numeric"`` (the numeric check: the scheduled copy computes
            another model, or fails, at :attr:`path`), ``"numeric_skipped"`` (the numeric check could not
            judge the schedule: the unsharded copy cannot run, or cannot be rebuilt; why in :attr:`message`), or ``"replicated"`` (dense layers kept whole: right,
            but not split; asked for with ``coverage=True``).
        message: one sentence: what is missing, why it matters, and the call that fixes it.
        calls: the primitive calls that close it (what the message names).
    """

    path: str
    kind: str
    message: str
    calls: tuple[Call, ...] = ()

    @property
    def fix(self) -> str:
        """:attr:`calls` as code on a schedule named ``sch``, one call per line."""
        return "\n".join(format_call(c) for c in self.calls)

    def __str__(self) -> str:
        return self.message


def _has_sync(chain: list[nn.Module], pairs: set[tuple[str, str]]) -> bool:
    return any(s in pairs for m in chain for s in syncs_of(m))


def _sync(path: str, mode: str) -> Call:
    return Call(path, "sync", (), {"mode": mode, "sync_op_or_fn": "all_reduce"})


def _shard(path: str, name: str, axis: int) -> Call:
    return Call(path, "shard", (name,), {"axis": axis})


def check_schedule(
    sch,
    numeric: bool = False,
    reference: nn.Module | None = None,
    example_inputs=None,
    coverage: bool = False,
) -> list[Finding]:
    """The open items of ``sch``'s tensor parallelism (see the module docstring), in module order.

    Args:
        sch: a :class:`~slapo_lab.Schedule` (any node: the whole tree from its top is checked).
        numeric: also run the schedule's recorded calls on a shrunk copy of the model over simulated ranks
            and compare outputs and gradients with the unsharded copy (:func:`slapo_lab.numeric.numeric_check`:
            a second or two for most models). A difference or a failing forward is a ``"numeric"``
            finding naming the first module that differs (or fails); run only when the structural check
            finds nothing open, since an open item already explains a difference.
        reference: the unscheduled model for the numeric check (any device). Default: a Hugging Face
            model is rebuilt from ``sch``'s config; any other model needs it.
        example_inputs: keyword inputs for the numeric check. Default: the inputs the schedule remembers
            (the editor's), else ``input_ids`` of 2 x 16 tokens.
        coverage: also say, as one ``"replicated"`` finding, which dense layers a schedule that shards
            something keeps whole on every rank, and why (:func:`slapo_lab.presets.replicated_dense`). Not a
            fault (the model stays right), but their memory and compute are not split.

    Returns:
        A list of :class:`Finding` (empty when nothing is open). A schedule with world size 1 has no
        structural findings (the numeric check still runs when asked).

    Raises:
        ScheduleError: ``numeric=True`` on a model that is neither a Hugging Face model with a config nor
            given as ``reference``, or without inputs to run.
    """
    top = sch.get_top_schedule() if hasattr(sch, "get_top_schedule") else sch
    findings = _structural(top)
    if numeric and not findings:
        findings.extend(_numeric(top, reference, example_inputs))
    if coverage:
        findings.extend(coverage_findings(top))
    return findings


def coverage_findings(sch) -> list[Finding]:
    """The ``"replicated"`` finding of a schedule that shards some parameter but keeps dense layers whole
    (one sentence naming them and why), or none."""
    from .presets import replicated_dense  # noqa: PLC0415 - presets: a layer above (KNOWN_UPWARD)

    top = sch.get_top_schedule() if hasattr(sch, "get_top_schedule") else sch
    if getattr(top, "world_size", 1) <= 1 or not any(
        getattr(p, "shard_axis", None) is not None for p in top.mod.parameters()
    ):
        return []
    sentence = replicated_dense(top)
    return [Finding("", "replicated", sentence)] if sentence else []


def _numeric(top, reference, example_inputs) -> list[Finding]:
    if reference is None:
        if getattr(top.mod, "config", None) is None:
            raise ScheduleError(
                "check_schedule(numeric=True) needs reference=<the unscheduled model> for a model without a "
                "Hugging Face config."
            )
        reference = top.mod
    inputs = example_inputs if example_inputs is not None else remembered_inputs(top, reference)
    report = numeric_check(
        reference, top.record.calls, top.world_size, inputs, from_config=reference is top.mod
    )
    if report.status in ("failed", "error"):
        return [Finding(report.module, "numeric", report.message)]
    if (
        report.status == "skipped"
    ):  # the check could not judge (the unsharded copy cannot run ...): said, not raised
        return [Finding(report.module, "numeric_skipped", report.message)]
    return []


def _structural(top) -> list[Finding]:
    if getattr(top, "world_size", 1) <= 1:
        return []
    return _StructuralCheck(top.mod).run(getattr(top, "path", "") or "")


def _dense(mod: nn.Module | None) -> DenseRule | None:
    """``mod``'s shard rule when it is a dense layer with a weight parameter, else None."""
    if mod is None or not isinstance(getattr(mod, "weight", None), nn.Parameter):
        return None
    rule = get_shard_rule(mod)
    return rule if isinstance(rule, DenseRule) else None


def _projections(attn: nn.Module, apath: str, outer: nn.Module | None, opath: str) -> list[tuple]:
    """``[(label, path, module, rule, role)]``: the attention's q/k/v (or fused) projections and its output
    projection, which BERT-style models keep outside it (``<outer>.output.dense``) and ALBERT names
    ``dense``."""

    def full(name: str) -> str:
        return f"{apath}.{name}" if apath else name

    parts = []
    for name, child in attn.named_children():
        rule = _dense(child)
        role = attention_role(ShardSite(child, "weight", attn, name)) if rule else None
        if role:
            parts.append((name, full(name), child, rule, role))
    if parts and not any(p[4] == "o" for p in parts):
        dense = getattr(attn, "dense", None)
        out = getattr(outer, "output", None) if outer is not None else None
        out_dense = getattr(out, "dense", None) if out is not None and out is not attn else None
        if (rule := _dense(dense)) is not None:
            parts.append(("dense", full("dense"), dense, rule, "o"))
        elif (rule := _dense(out_dense)) is not None:
            path = f"{opath}.output.dense" if opath else "output.dense"
            parts.append((path, path, out_dense, rule, "o"))
    return parts


class _StructuralCheck:
    """One walk of a tensor-parallel model's module tree for the structural findings of
    :func:`check_schedule`: partial sums nothing reduces, input gradients nothing all-reduces, a whole bias
    beside a split weight, attention heads split in some projections only, per-head norms whose gradients
    are partial sums."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self.sequence_parallel = has_sequence_parallel(root)
        self.findings: list[Finding] = []
        self.seen_attn: set[int] = set()

    def run(self, path: str) -> list[Finding]:
        """The findings under the root (whose path is ``path``), in module order."""
        self.walk(self.root, path, [])
        return self.findings

    def walk(self, mod: nn.Module, path: str, chain: list[nn.Module]) -> None:
        """Check ``mod`` (reached through its ancestors ``chain``) if it is sharded, then its children."""
        meta = peek_meta(mod)
        if meta is not None and (meta.sharded or meta.output_type):
            self.check_module(mod, path, chain, meta)
        for name, child in mod.named_children():
            self.walk(child, f"{path}.{name}" if path else name, [*chain, mod])

    def check_module(self, mod: nn.Module, path: str, chain: list[nn.Module], meta: ModuleMeta) -> None:
        """The findings of one sharded module, then of the attention it belongs to."""
        here = [*chain, mod]
        rule = get_shard_rule(mod)
        self.check_partial_sums(here, path, meta)
        self.check_input_grad(here, path, meta, rule)
        self.check_bias(mod, path, meta, rule)
        self.check_attention_around(path, chain)

    def check_partial_sums(self, here: list[nn.Module], path: str, meta: ModuleMeta) -> None:
        if meta.output_type != "partial" or _has_sync(
            here, {("fwd_post", "all_reduce"), ("fwd_post", "reduce_scatter")}
        ):
            return
        fix = _sync(path, "fwd_post")
        self.findings.append(
            Finding(
                path,
                "unreduced_partial",
                (
                    f"{path} produces partial sums (row or vocab parallel) but nothing all-reduces them, so every later layer "
                    f"computes on a fraction of the activation; add {format_call(fix)}."
                ),
                (fix,),
            )
        )

    def check_input_grad(self, here: list[nn.Module], path: str, meta: ModuleMeta, rule: Any) -> None:
        if (
            meta.output_type != "partition"
            or not isinstance(rule, DenseRule)
            or self.sequence_parallel
            or _has_sync(
                here, {("bwd_post", "all_reduce"), ("fwd_pre", "all_gather"), ("fwd_pre", "scatter")}
            )
        ):
            return
        fix = _sync(path, "bwd_post")
        self.findings.append(
            Finding(
                path,
                "unreduced_input_grad",
                (
                    f"{path} is column parallel but its input gradient is never all-reduced, so the layers before it "
                    f"train on one rank's partial gradient; add {format_call(fix)}."
                ),
                (fix,),
            )
        )

    def check_bias(self, mod: nn.Module, path: str, meta: ModuleMeta, rule: Any) -> None:
        if not (
            isinstance(rule, DenseRule)
            and meta.sharded.get("weight") == rule.out_axis
            and getattr(mod, "bias", None) is not None
            and "bias" not in meta.sharded
        ):
            return
        fix = _shard(path, "bias", 0)
        self.findings.append(
            Finding(
                path,
                "whole_bias",
                (
                    f"{path}'s weight is split on its output features but its bias is whole, so the forward fails "
                    f"on the shape; add {format_call(fix)}."
                ),
                (fix,),
            )
        )

    def check_attention_around(self, path: str, chain: list[nn.Module]) -> None:
        """Check the attention a module at ``path`` may be a projection of: its parent, or for BERT / ViT's
        ``output.dense`` its grandparent's attention child."""
        parent = chain[-1] if chain else None
        parent_path = path.rpartition(".")[0]
        grand = chain[-2] if len(chain) > 1 else None
        gpath = parent_path.rpartition(".")[0]
        if parent is not None:
            self.check_attention(parent, parent_path, grand, gpath)
        if (
            path.endswith("output.dense") and grand is not None
        ):  # BERT / ViT: the output projection's attention
            for cname, cand in grand.named_children():
                if cand is not parent and attention_heads(cand) is not None:
                    self.check_attention(cand, f"{gpath}.{cname}" if gpath else cname, grand, gpath)

    def check_attention(self, attn: nn.Module, apath: str, outer: nn.Module | None, opath: str) -> None:
        """Once per attention module: its heads split in every projection or in none."""
        if id(attn) in self.seen_attn:
            return
        self.seen_attn.add(id(attn))
        if attention_heads(attn) is None:
            return
        split, whole = [], []
        for label, path, mod, rule, role in _projections(attn, apath, outer, opath):
            axis = meta.sharded.get("weight") if (meta := peek_meta(mod)) else None
            want = rule.in_axis if role == "o" else rule.out_axis
            (split if axis == want else whole).append((label, path, want, role))
        if split:
            self.check_head_norms(attn, apath)
        if not (split and whole):
            return
        names = ", ".join(w[0] for w in whole)
        calls = tuple(_shard(path, "weight", axis) for _, path, axis, _ in whole)
        why = (
            "each rank would pair its query heads with other heads' keys and values"
            if any(w[3] != "o" for w in whole)
            else "the output projection would receive this rank's heads but expect all of them"
        )
        self.findings.append(
            Finding(
                apath,
                "partial_heads",
                (
                    f"{apath} splits its heads in {', '.join(w[0] for w in split)} but not in {names}, so {why}; "
                    f"shard them too: {'; '.join(format_call(c) for c in calls)}."
                ),
                calls,
            )
        )

    def check_head_norms(self, attn: nn.Module, apath: str) -> None:
        """Per-head norms (one weight shared by every head) of an attention whose heads are split: their
        gradients need an all-reduce."""
        hd = head_dim(attn)
        for name, child in attn.named_children():
            params = [
                p
                for p in child.parameters(recurse=False)
                if p.requires_grad and getattr(p, "shard_axis", None) is None
            ]
            if not is_norm(child) or not params or hd is None or params[0].shape[-1] != hd:
                continue  # not a per-head norm (ALBERT's attention.LayerNorm normalises the whole hidden state)
            if ("bwd_post", PARAM_GRADS_OP) in syncs_of(child):
                continue
            path = f"{apath}.{name}" if apath else name
            fix = Call(
                path, "sync", (), {"mode": "bwd_post", "sync_op_or_fn": "all_reduce", "param_grads": True}
            )
            self.findings.append(
                Finding(
                    path,
                    "unreduced_param_grads",
                    (
                        f"{path} normalises each head with one shared weight, so once {apath} splits its heads each rank's "
                        f"gradient of that weight is a partial sum; add {format_call(fix)}."
                    ),
                    (fix,),
                )
            )


def close_open_items(sch, max_rounds: int = 4) -> list[Call]:
    """Apply the fixes :func:`check_schedule` names, round after round, until it finds nothing.

    A fix can open the next item (k_proj split by heads is column parallel: its input gradient needs
    an all_reduce), hence rounds. All or nothing and one recorded action (one undo removes it), as a
    preset (:func:`slapo_lab.atomic.atomic`).

    Returns:
        The calls applied, in order (empty when nothing was open).

    Raises:
        ScheduleError: when a fix is refused, or items are still open after ``max_rounds`` rounds
            (nothing is applied then).
    """

    top = sch.get_top_schedule()
    n0 = len(top.record.calls)
    with atomic(top), top.record.action("close open items"):
        for _ in range(max_rounds):
            found = check_schedule(top)
            if not found:
                return list(top.record.calls[n0:])
            for f in found:
                for c in f.calls:
                    getattr(top[c.path], c.primitive)(*c.args, **c.kwargs)
        left = check_schedule(top)
        if left:
            raise ScheduleError(
                f"{len(left)} item(s) are still open after {max_rounds} rounds of fixes, so none "
                f"was applied; the first: {left[0].message}"
            )
    return list(top.record.calls[n0:])
