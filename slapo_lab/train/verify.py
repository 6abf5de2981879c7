"""Verify a launched run: the scheduled model against the unscheduled one, without a second full copy.

The reference is the *unscheduled* model built from the same spec and filled from the same source
(the same seeded initialisation, or the same Hugging Face directory), sharded by FSDP2's
``fully_shard`` over **all** ranks of the run (every repeated block, then the root): each rank holds
1 / world of it, and only one block is whole at a time. On one small batch (``--verify-batch-size``
sequences of ``--verify-seq-len`` tokens of the user's data; a pipeline runs one training step's batch,
its shapes being fixed) both models run forward and backward with dropout off and in float32, and
Verify compares

* every parameter of this rank against its slice of the reference's (the weights were read right),
* the loss, and the outputs (without pipeline stages: on every rank),
* every gradient against its slice of the reference's gradient,

within ``atol + rtol * |reference|`` (1e-5 each). Reference tensors are gathered one parameter at a
time (``DTensor.full_tensor``). The report is :class:`slapo_lab.VerifyReport`; its last line is
``Verify: PASSED`` or ``Verify: FAILED``.

:func:`verify_run` is the Verify of a launched run (:meth:`slapo_lab.train.run.Run.verify`): its batch, the
scheduled model's step and the reference's, dropout off and bf16 autocast off around them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ..blocks import find_blocks
from ..schedule import create_schedule
from ..sharding.placements import ShardLayout
from ..verify import Comparison, VerifyReport, flatten_outputs
from . import metrics
from .data import BatchPlan
from .losses import cat_batches, first_tensor, model_loss, pipeline_loss_fn, split_target, to_device
from .phases import say_phase
from .process import say
from .weights import Target, build_meta_model, init_random, load_hf

if TYPE_CHECKING:
    from .run import Run


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a reference parameter or gradient: gathered from FSDP2's shards, or as it is (a
    parameter kept whole on every rank)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _diff(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> tuple[float, float, bool]:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if a.shape != b.shape:
        return math.inf, math.inf, False
    if not a.numel():
        return 0.0, 0.0, True
    d = float((a - b).abs().max())
    scale = float(b.abs().max()) + atol
    rel = d / scale if scale > 0 else (0.0 if d == 0 else math.inf)
    return d, rel, bool(torch.allclose(a, b, atol=atol, rtol=rtol))


class Reference:
    """The unscheduled model sharded by FSDP2 over every rank (see the module docstring).

    Args:
        build: ``build() -> nn.Module`` on the meta device (parameters meta, buffers real).
        fill: ``fill(schedule, targets, mesh)`` fills the reference's tensors (seeded init or a directory;
            ``mesh`` is the ``(world, 1)`` view mesh).
        device: this rank's device.
    """

    def __init__(
        self, build: Callable[[], nn.Module], fill: Callable[[Any, list[Target], Any], None], device: str
    ) -> None:
        world = dist.get_world_size()
        rank = dist.get_rank()
        self.mesh = init_device_mesh(torch.device(device).type, (world, 1), mesh_dim_names=("dp", "tp"))
        model = build()
        sch = create_schedule(model, group=self.mesh["tp"].get_group())  # a group of one: nothing is split
        blocks = [sch[p].mod for p in find_blocks(sch)]
        # FSDP2 cannot shard a 0-dim parameter (CLIP's logit_scale): it stays whole on every rank, where each
        # rank's gradient is already the whole batch's (every rank runs the same Verify batch)
        scalars = {p for p in model.parameters() if p.dim() == 0}
        for block in blocks:
            fully_shard(block, mesh=self.mesh["dp"], ignored_params=scalars)
        fully_shard(model, mesh=self.mesh["dp"], ignored_params=scalars)
        buffers = {name: b for name, b in model.named_buffers()}
        model.to_empty(device=device)
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in buffers and not buffers[name].is_meta:
                    b.copy_(buffers[name])
        self.targets: list[Target] = []
        for name, p in model.named_parameters():
            shape = tuple(p.shape)
            p.orig_shape = torch.Size(shape)
            whole = getattr(p, "_local_tensor", None) is None
            layout = ShardLayout(shape) if whole else ShardLayout(shape, fsdp_dim=0, dp=world, dp_rank=rank)
            self.targets.append(Target(name, p, layout))
        fill(sch, self.targets, self.mesh)
        self.model = model
        self.sch = sch


def run_verify(
    reference: Reference,
    scheduled: list[Target],
    run_scheduled: Callable[[], tuple[float, Any]],
    run_reference: Callable[[nn.Module], tuple[float, Any]],
    *,
    device: str,
    note: str,
    atol: float = 1e-5,
    rtol: float = 1e-5,
) -> VerifyReport:
    """Run both models and compare (see the module docstring); every rank calls it and gets the same report.

    Args:
        reference: the FSDP2-sharded unscheduled model.
        scheduled: this rank's tensors of the training model (name, parameter, layout); their gradients
            are read after ``run_scheduled``.
        run_scheduled: one forward and backward of the training model on the verify batch; returns
            ``(loss, model output or None)`` (None for a pipeline).
        run_reference: the same for ``reference.model``.
        device: for the report.
        note: the first line of the report (what ran).
    """
    report = VerifyReport(atol=atol, rtol=rtol, device=device, note=note)
    ref_by_name = {t.name: t for t in reference.targets}
    mine: dict[str, list[Target]] = {}
    for t in scheduled:
        mine.setdefault(t.name, []).append(t)
    unknown = sorted(set(mine) - set(ref_by_name))
    # 1. weights, before anything ran
    weights = []
    for name, ref in ref_by_name.items():
        full = _full(ref.param)
        for t in mine.get(name, ()):
            a, _, ok = _diff(t.local, t.layout.take(full), 0.0, 0.0)
            weights.append(Comparison(name, a, 0.0, ok and a == 0.0))
        del full
    # 2. forward and backward of both
    say_phase("compare")
    loss, out = run_scheduled()
    ref_loss, ref_out = run_reference(reference.model)
    a, r, ok = _diff(torch.tensor(loss), torch.tensor(ref_loss), atol, rtol)
    report.outputs.append(Comparison("loss", a, r, ok, f"(scheduled {loss:.6f}, reference {ref_loss:.6f})"))
    if out is not None:
        report.outputs += _compare_outputs(out, ref_out, atol, rtol)
    del out, ref_out
    # 3. gradients, one reference parameter at a time
    grads = _compare_grads(ref_by_name, mine, atol, rtol)
    report.weights = weights + [
        Comparison(n, math.inf, 0.0, False, "(not in the reference)") for n in unknown
    ]
    report.grads = grads
    _agree(report, device)
    return report


def _compare_outputs(out: Any, ref_out: Any, atol: float, rtol: float) -> list[Comparison]:
    """One comparison per floating-point output of the reference (its loss aside), by name; an output the
    scheduled model lacks, or of another shape (a missing all_gather?), is said so."""
    found = []
    sched_outs = dict(flatten_outputs(out))
    for name, t in flatten_outputs(ref_out):
        if name == "loss":
            continue
        s = sched_outs.get(name)
        if s is None:
            found.append(Comparison(name, math.inf, math.inf, False, "(missing in the scheduled output)"))
            continue
        a, r, ok = _diff(s, t, atol, rtol)
        note_ = (
            ""
            if s.shape == t.shape
            else f"(shape {tuple(s.shape)} vs {tuple(t.shape)}: a missing all_gather?)"
        )
        found.append(Comparison(name, a, r, ok, note_))
    return found


def _compare_grads(
    ref_by_name: dict[str, Target], mine: dict[str, list[Target]], atol: float, rtol: float
) -> list[Comparison]:
    """One comparison per tensor of this rank against its piece of the reference gradient, one reference
    parameter gathered at a time (a missing gradient counts as zeros; none on both sides is skipped)."""
    grads = []
    for name, ref in ref_by_name.items():
        g = ref.param.grad
        full = _full(g) if g is not None else None
        for t in mine.get(name, ()):
            local_grad = t.param.grad
            if local_grad is None and full is None:
                continue
            local_grad = getattr(local_grad, "_local_tensor", local_grad)
            if local_grad is None:
                local_grad = torch.zeros(t.layout.local_shape, dtype=t.local.dtype)
            want = t.layout.take(full) if full is not None else torch.zeros_like(local_grad)
            a, r, ok = _diff(local_grad, want, atol, rtol)
            grads.append(Comparison(name, a, r, ok))
        del full
    return grads


def _agree(report: VerifyReport, device: str) -> None:
    """Make every rank's report the worst over all ranks (each rank compared only its own tensors)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    local = {"outputs": report.outputs, "weights": report.weights, "grads": report.grads}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(
        gathered, {k: [(c.name, c.max_abs, c.max_rel, c.ok, c.note) for c in v] for k, v in local.items()}
    )
    for key in local:
        merged: dict[str, Comparison] = {}
        for g in gathered:
            for name, a, r, ok, note in g[key]:
                old = merged.get(name)
                if old is None:
                    merged[name] = Comparison(name, a, r, ok, note)
                else:
                    old.max_abs, old.max_rel = max(old.max_abs, a), max(old.max_rel, r)
                    old.ok = old.ok and ok
                    old.note = old.note or note
        setattr(report, key, list(merged.values()))


def release(reference: Reference, device: str) -> None:
    """Free the reference (and CUDA's cached blocks)."""
    reference.model = reference.sch = None
    reference.targets = []
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    else:
        trim_heap()


def trim_heap() -> None:
    """Hand the memory the CPU allocator freed back to the system (glibc's ``malloc_trim``; a no-op elsewhere):
    glibc keeps freed heap pages, so the reference's memory would stay in the process's resident set."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        libc = None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def verify_run(run: Run) -> bool:
    """Run Verify on ``run`` (see the module docstring); prints the report on rank 0; True if it passed."""
    say_phase("reference")
    cfg = run.cfg
    batch = _verify_batch(run)
    rows = next(v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim())
    seq = next((v.shape[1] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() > 1), None)

    def fill(ref_sch, targets, mesh):
        if cfg.model.model_path:
            load_hf(cfg.model.model_path, targets, mesh)
        else:
            init_random(ref_sch, targets, cfg.data.seed)

    ref = Reference(lambda: build_meta_model(run.spec, cfg.model.model_path), fill, run.device)
    note = (
        f"one forward and backward of {rows} sequence(s)"
        + (f" of {seq} tokens" if seq else "")
        + f" ({'synthetic inputs' if cfg.data.data == 'synthetic' else 'from --data'}, fp32, dropout off) against "
        f"the unscheduled model sharded by FSDP2 over all {dist.get_world_size()} rank(s); layout "
        f"{run.layout.describe()}"
    )
    dropouts = dropout_off([run.module, ref.model])
    if run.pm is not None:  # dropout traced into the stage graphs
        run.pm.set_dropout(False)
    autocast = [m for m in run.module.modules() if getattr(m, "autocast_bf16", False)]
    for m in autocast:  # Verify compares in float32
        m.autocast_bf16 = False
    try:
        report = run_verify(
            ref,
            run.targets,
            lambda: _scheduled_step(run, batch),
            lambda m: _reference_step(run, m, batch),
            device=run.device,
            note=note,
        )
    finally:
        dropout_restore(dropouts)
        if run.pm is not None:
            run.pm.set_dropout(True)
        for m in autocast:
            m.autocast_bf16 = True
        release(ref, run.device)
        for t in run.targets:
            t.param.grad = None

    report.note += f"; Verify's peak memory {metrics.peak_memory_mib(run.device):.0f} MiB on rank 0"
    say(report.summary())
    metrics.reset_peak_memory(run.device)  # the step lines' peak is training's own
    return report.passed


def _verify_batch(run: Run) -> dict:
    """Verify's batch on this rank's device: ``--verify-batch-size`` rows of ``--verify-seq-len`` tokens (a
    pipeline: one step's batch of replica 0)."""
    cfg = run.cfg
    if run.pipeline:  # its shapes are fixed: one step's batch, replica 0's on every replica
        first = BatchPlan(
            run.data.num_samples,
            cfg.batch.global_batch_size,
            run.micro,
            run.layout.dp,
            0,
            cfg.data.seed,
        )
        return to_device(cat_batches(first.micro_batches(run.data, 0)), run.device)
    rows = cfg.verify.verify_batch_size or 2
    batch = run.data.batch(list(range(rows)), 0)
    length = cfg.verify.verify_seq_len or (min(run.seq_len, 64) if run.seq_len else None)
    if length is not None and run.seq_len:
        batch = {
            k: v[:, :length]
            if isinstance(v, torch.Tensor) and v.dim() > 1 and v.shape[1] == run.seq_len
            else v
            for k, v in batch.items()
        }
    return to_device(batch, run.device)


def _scheduled_step(run: Run, batch: dict) -> tuple[float, Any]:
    """The scheduled model's forward and backward on ``batch``: ``(loss, outputs or None)``."""
    if run.pipeline:
        inputs, target = split_target(batch, 1, run.device)
        loss = run.pm.train_step(**inputs, target=target)
        run.layout.average_ignored_grads()
        return float(loss), None
    run.module.eval()
    out = run.module(**run.forward_kwargs(batch))
    loss = model_loss(out, run.cfg.data.seed)
    loss.backward()
    run.layout.average_ignored_grads()
    run.unused_params = any(t.param.requires_grad and t.param.grad is None for t in run.targets)
    return float(loss.detach()), out


def _reference_step(run: Run, model: nn.Module, batch: dict) -> tuple[float, Any]:
    """The reference's forward and backward on ``batch`` (a pipeline's micro-batches, as its schedule cuts
    them): ``(loss, outputs or None)``."""
    model.eval()
    if not run.pipeline:
        out = model(**run.forward_kwargs(batch))
        loss = model_loss(out, run.cfg.data.seed)
        loss.backward()
        return float(loss.detach()), out
    n = run.plan.accumulation  # the pipeline's micro-batches: the same means, summed the same way
    loss_fn = pipeline_loss_fn(run.objective, run.cfg.data.seed)
    inputs, target = split_target(batch, n, run.device)
    total = 0.0
    for i in range(n):
        chunk = {
            k: v.chunk(n)[i] if isinstance(v, torch.Tensor) and v.dim() else v for k, v in inputs.items()
        }
        loss = loss_fn(first_tensor(model(**run.forward_kwargs(chunk))), target.chunk(n)[i]) / n
        loss.backward()
        total += float(loss.detach())
    return total, None


def dropout_off(models: list[nn.Module]) -> list[tuple[nn.Module, float]]:
    """Set every dropout rate of ``models`` to 0; returns ``[(module, rate)]`` to put back."""
    saved = []
    for m in models:
        for mod in m.modules():
            if isinstance(mod, nn.modules.dropout._DropoutNd) and mod.p > 0:
                saved.append((mod, mod.p))
                mod.p = 0.0
    return saved


def dropout_restore(saved: list[tuple[nn.Module, float]]) -> None:
    """Put back the dropout rates :func:`dropout_off` returned."""
    for mod, p in saved:
        mod.p = p
