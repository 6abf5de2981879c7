"""Verify: prove a scheduled model computes what the original computes.

Both models run on the same inputs and weights; the forward outputs are compared, and -- beyond
Slapo's ``Verify``, which checks only outputs -- so is every parameter gradient, with sharded
gradients gathered across the tensor-parallel ranks first. The loss used for gradients is a fixed
random projection of every output tensor, identical on every rank (a "replicated loss").
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .sharding.rules import local_shard, merge_shards
from .sharding.sync_ops import TPGroup


def flatten_outputs(out: Any, prefix: str = "output") -> list[tuple[str, torch.Tensor]]:
    """Named floating-point tensors of a model output (tensor, tuple, dict or HF ``ModelOutput``)."""
    items: list[tuple[str, torch.Tensor]] = []
    if isinstance(out, torch.Tensor):
        if out.is_floating_point():
            items.append((prefix, out))
    elif isinstance(out, dict):  # ModelOutput is an OrderedDict
        for k, v in out.items():
            items += flatten_outputs(v, f"{prefix}.{k}" if prefix != "output" else k)
    elif isinstance(out, (tuple, list)):
        for i, v in enumerate(out):
            items += flatten_outputs(v, f"{prefix}[{i}]")
    return items


def gather_full(t: torch.Tensor, like: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Reassemble a sharded tensor (``like`` carries ``shard_axis``) into its full shape.

    A strided shard (``like.shard_stride`` > 1, GPT-2's fused q, k, v) is put back block by block; a
    :class:`~slapo_lab.sharding.rules.BlockStride` (Phi-3's ``qkv_proj`` with fewer key/value heads) by its
    unequal blocks (:func:`~slapo_lab.sharding.rules.merge_shards`); a replicated shard
    (``like.shard_replicas`` = r > 1, one key/value head on r ranks) from the first rank of each replica group.

    Raises:
        RuntimeError: if the tensor is sharded but there is no process group to gather over.
    """
    axis = getattr(like, "shard_axis", None)
    if axis is None or tp.world_size == 1:
        return t
    if tp.group is None:
        raise RuntimeError("a sharded tensor can only be gathered with an initialised process group")
    parts = [torch.empty_like(t) for _ in range(tp.world_size)]
    dist.all_gather(parts, t.contiguous(), group=tp.group)
    return merge_shards(parts, axis, getattr(like, "shard_stride", 1), getattr(like, "shard_replicas", 1))


def _diff(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-5) -> tuple[float, float, bool, float, float]:
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return math.inf, math.inf, False, 0.0, 0.0
    d = (a - b).abs()
    max_abs = float(d.max()) if d.numel() else 0.0
    scale = float(b.abs().max()) if b.numel() else 0.0
    max_rel = max_abs / (scale + atol)  # stabilised: gradients that are exactly 0 in theory (e.g. a key bias)
    return max_abs, max_rel, True, float(d.sum()), scale


@dataclass
class Comparison:
    """One compared tensor: ``max_abs`` = max |a - b|, ``max_rel`` = max_abs / (max |reference| + atol)."""

    name: str
    max_abs: float
    max_rel: float
    ok: bool
    note: str = ""


@dataclass
class VerifyReport:
    """The outcome of :func:`verify_models`: per-output and per-gradient comparisons."""

    outputs: list[Comparison] = field(default_factory=list)
    grads: list[Comparison] = field(default_factory=list)
    weights: list[Comparison] = field(default_factory=list)
    atol: float = 1e-5
    rtol: float = 1e-5
    device: str = "cpu"
    note: str = ""

    @property
    def passed(self) -> bool:
        """True when every output, gradient and weight comparison is within tolerance (and there were outputs)."""
        return all(c.ok for c in self.outputs + self.grads + self.weights) and bool(self.outputs)

    def worst(self, items: list[Comparison]) -> Comparison | None:
        """The comparison with the largest ``max_abs`` in ``items`` (None if empty)."""
        return max(items, key=lambda c: c.max_abs, default=None)

    def summary(self) -> str:
        """Human-readable lines, the last one ``Verify: PASSED`` or ``Verify: FAILED ...``."""
        lines = []
        if self.note:
            lines.append(f"Verify: {self.note}")
        for c in self.outputs:
            lines.append(
                f"Verify: output {c.name}: max abs diff {c.max_abs:.3e}, max rel diff {c.max_rel:.3e}"
                + ("" if c.ok else f"  <-- exceeds tolerance {c.note}")
            )
        bad_w = [c for c in self.weights if not c.ok]
        for c in bad_w[:5]:
            lines.append(
                f"Verify: weight {c.name} differs from the reference slice (max abs {c.max_abs:.3e}) {c.note}"
            )
        w = self.worst(self.grads)
        if w is not None:
            n_bad = sum(not c.ok for c in self.grads)
            lines.append(
                f"Verify: gradients of {len(self.grads)} parameters: max abs diff {w.max_abs:.3e} "
                f"({w.name}), max rel diff {max(c.max_rel for c in self.grads):.3e}"
                + (f", {n_bad} over tolerance" if n_bad else "")
            )
            for c in [c for c in self.grads if not c.ok][:5]:
                lines.append(f"Verify:   {c.name}: max abs diff {c.max_abs:.3e} {c.note}")
        status = "PASSED" if self.passed else "FAILED"
        lines.append(f"Verify: {status} (atol {self.atol:g}, rtol {self.rtol:g}, device {self.device})")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """A JSON-able dict of the figures (for the editor and scripts)."""
        return {
            "passed": self.passed,
            "device": self.device,
            "note": self.note,
            "outputs": [c.__dict__ for c in self.outputs],
            "grads": [c.__dict__ for c in self.grads],
            "weights_mismatched": [c.name for c in self.weights if not c.ok],
        }


def _move_inputs(inputs, device):
    if isinstance(inputs, dict):
        return {k: _move_inputs(v, device) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(_move_inputs(v, device) for v in inputs)
    return inputs.to(device) if isinstance(inputs, torch.Tensor) else inputs


def broadcast_inputs(inputs, tp: TPGroup, src: int = 0):
    """Make every rank's example inputs equal rank ``src``'s (in place for tensors)."""
    if tp.group is None or tp.world_size == 1:
        return inputs
    for t in _tensors(inputs):
        dist.broadcast(
            t,
            src=dist.get_global_rank(tp.group, src) if tp.group is not dist.group.WORLD else src,
            group=tp.group,
        )
    return inputs


from .utils import iter_tensors as _tensors  # (one walker for nested tensors)


def _call(model, inputs):
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _reduce_max(values: list[float], tp: TPGroup, device) -> list[float]:
    if tp.group is None or tp.world_size == 1 or not values:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    t = torch.nan_to_num(t, nan=1e300, posinf=1e300)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=tp.group)
    return t.tolist()


def verify_models(
    reference: nn.Module,
    scheduled: nn.Module,
    example_inputs,
    tp: TPGroup,
    device: str = "cpu",
    eval_mode: bool = True,
    atol: float = 1e-5,
    rtol: float = 1e-5,
    seed: int = 2013,
) -> VerifyReport:
    """Compare ``scheduled`` (this rank's shard) with the full ``reference`` on ``example_inputs``.

    Checks, in order: every scheduled parameter equals this rank's slice of the reference's; the
    forward outputs (full tensors on every rank); and every parameter gradient of a replicated loss
    ``sum_i <output_i, R_i> / numel_i`` (``R_i`` standard normal from ``seed``), with sharded gradients
    all-gathered along their ``shard_axis``. A comparison passes when ``|a - b| <= atol + rtol * |b|``
    elementwise, or when the largest ``|a - b|`` is within ``rtol`` of the tensor's largest ``|b|`` (a float32
    sum over many terms, reordered by the shards, errs relative to the tensor's scale, not to each element: a
    position embedding's gradient of scale 7e3 differs by 5e-3 in its small entries); the reported figures are
    the maxima over all ranks.

    Returns:
        VerifyReport (``.passed``, ``.summary()``).
    """
    report = VerifyReport(atol=atol, rtol=rtol, device=device)
    reference = reference.to(device)
    scheduled = scheduled.to(device)
    inputs = _move_inputs(example_inputs, device)
    ref_params = dict(reference.named_parameters())
    # 1. weights: the shard must be this rank's slice of the reference.
    report.weights.extend(_compare_weights(scheduled, ref_params, tp))
    # 2. forward + backward, same seed for both; the reference's pass ends (its autograd graph freed)
    # before the scheduled model's begins, so only one model's activations are alive at a time.
    for m in (reference, scheduled):
        m.train(not eval_mode)
        m.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out_ref = flatten_outputs(_call(reference, inputs))
    gen = torch.Generator().manual_seed(seed)
    projections = [torch.randn(t.shape, generator=gen, dtype=torch.float32).to(device) for _, t in out_ref]
    ref_loss = _projected_loss(out_ref, projections)
    if isinstance(ref_loss, torch.Tensor):
        ref_loss.backward()
    out_ref = [(name, t.detach()) for name, t in out_ref]
    del ref_loss
    torch.manual_seed(seed)
    out_sch = flatten_outputs(_call(scheduled, inputs))
    sch_by_name = dict(out_sch)
    report.outputs.extend(_compare_outputs(out_ref, sch_by_name, atol, rtol))
    sch_loss = _projected_loss([(n, sch_by_name.get(n, torch.zeros(0))) for n, _ in out_ref], projections)
    if isinstance(sch_loss, torch.Tensor):
        sch_loss.backward()
    del out_sch, sch_by_name, sch_loss
    report.grads.extend(_compare_grads(scheduled, ref_params, tp, atol, rtol))
    # 3. agree across ranks: report the worst figures everywhere.
    for items in (report.outputs, report.grads, report.weights):
        vals = _reduce_max(
            [c.max_abs for c in items] + [c.max_rel for c in items] + [0.0 if c.ok else 1.0 for c in items],
            tp,
            device,
        )
        n = len(items)
        for i, c in enumerate(items):
            c.max_abs, c.max_rel, c.ok = vals[i], vals[n + i], vals[2 * n + i] == 0.0
    return report


def _compare_weights(
    scheduled: nn.Module, ref_params: dict[str, nn.Parameter], tp: TPGroup
) -> list[Comparison]:
    """Each scheduled parameter against this rank's slice of the reference's (exactly equal or not)."""
    out = []
    for name, p in scheduled.named_parameters():
        r = ref_params.get(name)
        if r is None:
            continue
        axis = getattr(p, "shard_axis", None)
        want = (
            local_shard(
                r.detach(),
                axis,
                tp.world_size,
                tp.rank,
                getattr(p, "shard_stride", 1),
                getattr(p, "shard_replicas", 1),
            )
            if (axis is not None and tp.world_size > 1)
            else r
        )
        a, _, same, _, _ = _diff(p, want)
        out.append(Comparison(name, a, 0.0, same and a == 0.0))
    return out


def _projected_loss(outs: list[tuple[str, torch.Tensor]], projections: list[torch.Tensor]) -> Any:
    """``sum_i <output_i, R_i> / numel_i`` over the outputs that need a gradient (0.0 when none does)."""
    total = 0.0
    for (_name, t), proj in zip(outs, projections, strict=False):
        if t.requires_grad and t.shape == proj.shape:
            total = total + (t.float() * proj).sum() / t.numel()
    return total


def _compare_outputs(
    out_ref: list[tuple[str, torch.Tensor]], sch_by_name: dict[str, torch.Tensor], atol: float, rtol: float
) -> list[Comparison]:
    """Each reference output against the scheduled one of its name (missing, of another shape, or within the
    tolerance)."""
    out = []
    for name, a_ref in out_ref:
        a = sch_by_name.get(name)
        if a is None:
            out.append(Comparison(name, math.inf, math.inf, False, "(missing in the scheduled output)"))
            continue
        max_abs, max_rel, same_shape, _, _ = _diff(a, a_ref)
        ok = same_shape and (
            max_rel <= rtol or torch.allclose(a.detach().double(), a_ref.double(), atol=atol, rtol=rtol)
        )
        note = (
            "" if same_shape else f"(shape {tuple(a.shape)} vs {tuple(a_ref.shape)}: a missing all_gather?)"
        )
        out.append(Comparison(name, max_abs, max_rel, ok, note))
    return out


def _compare_grads(
    scheduled: nn.Module, ref_params: dict[str, nn.Parameter], tp: TPGroup, atol: float, rtol: float
) -> list[Comparison]:
    """Each trainable scheduled parameter's gradient, gathered whole, against the reference's (a missing one
    counts as zeros; parameters neither model has a gradient for are skipped)."""
    out = []
    for name, p in scheduled.named_parameters():
        r = ref_params.get(name)
        if r is None or not p.requires_grad:
            continue
        if p.grad is None and r.grad is None:
            continue
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        full = gather_full(g, p, tp)
        rg = r.grad if r.grad is not None else torch.zeros_like(r)
        max_abs, max_rel, same_shape, _, _ = _diff(full, rg)
        ok = same_shape and (
            max_rel <= rtol or torch.allclose(full.double(), rg.double(), atol=atol, rtol=rtol)
        )
        out.append(Comparison(name, max_abs, max_rel, ok))
    return out


def resolve_device(device: str) -> tuple[str, str]:
    """Map a requested device to one that exists here; returns (device, note for the user)."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        return "cpu", "CUDA is not available here, so Verify ran on the CPU (gloo)."
    return device, ""


class Verify:
    """Context manager (Slapo's ``Verify``): schedule inside the block, compare on exit.

    ``with Verify(sch, example_inputs, device="cuda"): sch[...].shard(...)`` snapshots ``sch.mod``
    (broadcasting rank 0's weights and inputs to every rank first) and on exit compares the scheduled
    model with the snapshot, forward outputs and gradients (see :func:`verify_models`).

    Raises:
        AssertionError: on exit, with the summary, if the comparison fails.
    """

    def __init__(
        self,
        sch,
        example_inputs,
        device: str = "cuda",
        eval_mode: bool = True,
        enable: bool = True,
        atol: float = 1e-5,
        rtol: float = 1e-5,
    ) -> None:
        self.sch = sch
        self.example_inputs = example_inputs
        self.device, self.note = resolve_device(device)
        self.eval_mode = eval_mode
        self.enable = enable
        self.atol, self.rtol = atol, rtol
        self.report: VerifyReport | None = None
        self._reference: nn.Module | None = None

    def __enter__(self):
        if not self.enable:
            return self
        tp = self.sch.tp
        if tp.group is not None and tp.world_size > 1:
            with torch.no_grad():
                for t in list(self.sch.mod.parameters()) + list(self.sch.mod.buffers()):
                    if getattr(t, "shard_axis", None) is None:
                        dist.broadcast(t.data, src=0, group=tp.group)
            broadcast_inputs(self.example_inputs, tp)
        self._reference = copy.deepcopy(self.sch.mod)
        return self

    def __exit__(self, exc_type, exc, tb):
        if not self.enable or exc_type is not None:
            return False
        self.report = verify_models(
            self._reference,
            self.sch.mod,
            self.example_inputs,
            self.sch.tp,
            device=self.device,
            eval_mode=self.eval_mode,
            atol=self.atol,
            rtol=self.rtol,
        )
        self.report.note = self.note
        if not self.report.passed:
            raise AssertionError(self.report.summary())
        return False
