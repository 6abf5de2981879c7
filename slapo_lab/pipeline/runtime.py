"""Run a cut schedule on a pipeline runtime: PyTorch's ``torch.distributed.pipelining`` or DeepSpeed.

:func:`build_pipeline` partitions the schedule (:func:`~slapo_lab.pipeline.partition_pipeline`),
builds this rank's stage(s) and returns a :class:`PipelineModel` whose :meth:`~PipelineModel.train_step`
runs one whole batch: the runtime's micro-batch schedule, then the gradient reductions the split
introduced (tied weights replicated across stages, Slapo's ``analyze_tie_weights``; data-parallel
replicas), then the optimizer step.

Runtimes (the ``target``):

* ``"torch"``: ``torch.distributed.pipelining`` -- ``Pipe.build_stage`` per local stage and
  ``ScheduleGPipe`` / ``Schedule1F1B`` (one stage per rank) or ``ScheduleInterleaved1F1B`` (``stages_per_rank``
  > 1, stage ``s`` on pipeline rank ``s % pp``; on a single rank, ``pp = 1``, all stages run in one
  process and pass their values in memory). Gradients are scaled by ``1 / n_microbatches``
  (``scale_grads=True``), so a ``loss_fn`` that averages gives the full-batch gradient.
* ``"deepspeed"``: ``deepspeed.pipe.PipelineModule`` with one layer per stage (see
  :mod:`slapo_lab.pipeline.deepspeed_runtime`) and ``engine.train_batch``.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from ..errors import ScheduleError
from .deepspeed_runtime import _dry_run_codecs, build_deepspeed, deepspeed_eval_step, deepspeed_train_step
from .partition import PipelinePartition, partition_pipeline

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
TARGETS = ("torch", "deepspeed")


def _group_size(g) -> int:
    return 1 if g is None else dist.get_world_size(g)


def _group_rank(g) -> int:
    return 0 if g is None else dist.get_rank(g)


class PipelineModel:
    """This rank's part of a built pipeline.

    Attributes:
        partition: the :class:`~slapo_lab.pipeline.PipelinePartition` (all stages; every rank has it).
        target: ``"torch"`` or ``"deepspeed"``.
        stage_ids: the stage indices this rank runs.
        stage_modules: their GraphModules (``stage_modules[k]`` runs stage ``stage_ids[k]``).
        schedule: the ``torch.distributed.pipelining`` schedule (torch target) or None.
        engine: the DeepSpeed ``PipelineEngine`` (deepspeed target) or None.
        optimizer: the optimizer over this rank's parameters, or None.
        n_microbatches: micro-batches per step.
    """

    def __init__(
        self,
        partition: PipelinePartition,
        target: str,
        stage_ids: list[int],
        pp_group,
        dp_group,
        n_microbatches: int,
    ) -> None:
        self.partition = partition
        self.target = target
        self.stage_ids = stage_ids
        self.stage_modules = [partition.stage_module(i) for i in stage_ids]
        self.pp_group = pp_group
        self.dp_group = dp_group
        self.n_microbatches = n_microbatches
        self.schedule = None
        self.engine = None
        self.optimizer = None
        self.stages: list = []

    @property
    def _device(self) -> torch.device:
        """This rank's device: its stages' parameters', else the CPU (gloo) or the current CUDA device."""
        for p in self.parameters():
            if not p.is_meta:
                return p.device
        if dist.is_initialized() and self.pp_group is not None and dist.get_backend(self.pp_group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # --- parameters --------------------------------------------------------------------------------
    def named_parameters(self) -> Iterable[tuple[str, nn.Parameter]]:
        """``(original FQN, parameter)`` for this rank's stages; each FQN once (tied copies included)."""
        seen = set()
        for i in self.stage_ids:
            for name, p in self.partition.stages[i].params.items():
                if name not in seen:
                    seen.add(name)
                    yield name, p

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameter objects, each once."""
        out, seen = [], set()
        for i in self.stage_ids:
            for p in self.partition.stages[i].params.values():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    @property
    def is_first(self) -> bool:
        """Whether this rank runs stage 0 (it feeds the inputs)."""
        return 0 in self.stage_ids

    @property
    def is_last(self) -> bool:
        """Whether this rank runs the last stage (it holds the targets and losses)."""
        return self.partition.num_stages - 1 in self.stage_ids

    # --- gradient reductions -------------------------------------------------------------------------
    def reduce_tied_grads(self) -> None:
        """Sum the gradients of each tied parameter over all its stage copies (then every copy has the sum).

        An all-reduce over the pipeline group per tied parameter; ranks that hold no copy add zeros
        (every pipeline rank takes part, so no extra process groups are needed).
        """
        for group in self.partition.tied:
            local = []
            for s, name in group.items():
                if s in self.stage_ids:
                    local.append(self.partition.stages[s].params[name])
            uniq = list({id(p): p for p in local}.values())
            like = (
                uniq[0]
                if uniq
                else self.partition.stages[next(iter(group))].params[next(iter(group.values()))]
            )
            # a rank without a copy adds zeros of the copies' shape, on its own device (the others are meta there)
            total = torch.zeros(like.shape, dtype=like.dtype, device=like.device if uniq else self._device)
            for p in uniq:
                if p.grad is not None:
                    total += p.grad
            if self.pp_group is not None and _group_size(self.pp_group) > 1:
                dist.all_reduce(total, group=self.pp_group)
            for p in uniq:
                p.grad = total.clone()

    def reduce_dp_grads(self) -> None:
        """Average gradients over the data-parallel group (one flat all-reduce)."""
        n = _group_size(self.dp_group)
        if n <= 1:
            return
        params = [p for p in self.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads]) if grads else torch.zeros(0)
        dist.all_reduce(flat, group=self.dp_group)
        flat /= n
        off = 0
        for p, g in zip(params, grads, strict=False):
            k = g.numel()
            p.grad = flat[off : off + k].view_as(g).clone()
            off += k

    # --- training ------------------------------------------------------------------------------------
    def train_step(self, *args, target=None, **kwargs) -> float:
        """Run one full batch through the pipeline and step the optimizer (if any).

        Args:
            *args / **kwargs: the full-batch model inputs (dim 0 = batch, divisible by
                ``n_microbatches``, same shapes as the example inputs). Only stage 0's rank needs
                real values; others may pass the same tensors (they are ignored there).
            target: the full-batch target for ``loss_fn`` (used on the last stage's rank).

        Returns:
            float: the mean of the micro-batch losses, the same on every rank of the pipeline.
        """
        if self.target == "deepspeed":
            return deepspeed_train_step(self, args, kwargs, target)
        for m in self.stage_modules:
            m.train()
        losses: list | None = [] if self.is_last else None
        inputs = self.partition.stage0_inputs(args, kwargs) if self.is_first else ()
        self.schedule.step(*inputs, target=target if self.is_last else None, losses=losses)
        self.reduce_tied_grads()
        self.reduce_dp_grads()
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return self._broadcast_loss(losses)

    def set_dropout(self, enabled: bool) -> None:
        """Switch the dropout of this rank's stages on or off. ``torch.export`` bakes dropout into the stage
        graphs as ``aten.dropout(x, p, train=True)`` (``module.eval()`` does not reach it), so this rewrites
        the ``train`` argument of those nodes."""
        for m in self.stage_modules:
            set_graph_dropout(m, enabled)

    def eval_step(self, *args, target=None, **kwargs) -> float:
        """Run one full batch forward only (``schedule.eval``, dropout off) and return the mean micro-batch
        loss, the same on every rank of the pipeline (torch target)."""
        if self.target == "deepspeed":
            return deepspeed_eval_step(self, args, kwargs, target)
        for m in self.stage_modules:
            m.eval()
        self.set_dropout(False)
        losses: list | None = [] if self.is_last else None
        inputs = self.partition.stage0_inputs(args, kwargs) if self.is_first else ()
        try:
            with torch.no_grad():
                self.schedule.eval(*inputs, target=target if self.is_last else None, losses=losses)
        finally:
            self.set_dropout(True)
        return self._broadcast_loss(losses)

    def _broadcast_loss(self, losses) -> float:
        # NCCL only moves CUDA tensors: put the loss on this rank's device (CPU for gloo)
        dev = (
            torch.device("cuda", torch.cuda.current_device())
            if (
                dist.is_initialized()
                and self.pp_group is not None
                and dist.get_backend(self.pp_group) == "nccl"
            )
            else torch.device("cpu")
        )
        val = torch.zeros((), dtype=torch.float64, device=dev)
        if losses:
            val = torch.stack([torch.as_tensor(x).detach().double().to(dev) for x in losses]).mean()
        if self.pp_group is not None and _group_size(self.pp_group) > 1:
            last = (self.partition.num_stages - 1) % _group_size(self.pp_group)
            dist.broadcast(val, src=dist.get_global_rank(self.pp_group, last), group=self.pp_group)
        return float(val)

    def zero_grad(self) -> None:
        """Clear this rank's gradients."""
        for p in self.parameters():
            p.grad = None


def deepspeed_from(
    pm: PipelineModel,
    *,
    loss_fn: Callable,
    optimizer: Callable[[list], Any],
    lr_scheduler: Callable[[Any], Any] | None = None,
    ds_config: dict | None = None,
    device: str | torch.device = "cpu",
) -> PipelineModel:
    """The same stages (same partition, same parameter objects) on DeepSpeed's pipeline engine.

    ``pm`` was built by :func:`build_pipeline` with ``deepspeed_later=True`` (its torch runtime is
    dropped). Arguments as :func:`build_pipeline`'s for ``target="deepspeed"``.

    Raises:
        ScheduleError: as :func:`build_pipeline` for DeepSpeed, or ``pm`` was not built for it.
    """
    codecs = getattr(pm.partition, "ds_codecs", None)
    if codecs is None:
        raise ScheduleError(
            "deepspeed_from needs a pipeline built with build_pipeline(..., deepspeed_later=True)."
        )
    if len(pm.stage_ids) != 1:
        raise ScheduleError(
            "DeepSpeed runs one stage per rank: use stages_per_rank=1 with target='deepspeed'."
        )
    out = PipelineModel(pm.partition, "deepspeed", pm.stage_ids, pm.pp_group, pm.dp_group, pm.n_microbatches)
    example = dict(pm.partition.mb_kwargs) or tuple(pm.partition.mb_args)
    build_deepspeed(
        out, loss_fn, optimizer, ds_config or {}, example, device, codecs=codecs, lr_scheduler=lr_scheduler
    )
    return out


def _graph_modules(module: nn.Module):
    """The modules of ``module`` that run an fx graph: GraphModules, and torch.export's InterpreterModules."""
    return [m for m in module.modules() if isinstance(getattr(m, "graph", None), fx.Graph)]


def _recompile(gm: nn.Module) -> None:
    """Regenerate the code of a module whose graph changed (an InterpreterModule runs its ``graph_module``)."""
    if isinstance(gm, fx.GraphModule):
        gm.recompile()
    elif isinstance(getattr(gm, "graph_module", None), fx.GraphModule):
        gm.graph_module.recompile()


def set_graph_dropout(module: nn.Module, enabled: bool) -> int:
    """Switch the dropout traced into ``module``'s graphs on or off; returns how many nodes it touched.

    ``torch.export`` bakes dropout in as ``aten.dropout(x, p, train=True)`` and as the ``dropout_p`` of
    ``scaled_dot_product_attention``, whatever ``module.training`` says later: this sets ``train`` and
    ``dropout_p`` (to 0, and back to the traced value)."""
    n = 0
    for gm in _graph_modules(module):
        changed = False
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            if node.target is torch.ops.aten.dropout.default:
                args = list(node.args)
                if "train" in node.kwargs:
                    node.kwargs = {**node.kwargs, "train": enabled}
                elif len(args) >= 3:
                    args[2] = enabled
                    node.args = tuple(args)
                changed, n = True, n + 1
            elif node.target is torch.ops.aten.scaled_dot_product_attention.default:
                p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
                traced = node.meta.setdefault("slapo_dropout_p", p)
                value = traced if enabled else 0.0
                if "dropout_p" in node.kwargs or len(node.args) <= 4:
                    node.kwargs = {**node.kwargs, "dropout_p": value}
                else:
                    node.args = (*node.args[:4], value, *node.args[5:])
                changed, n = True, n + 1
        if changed:
            _recompile(gm)
    return n


def _retarget_devices(module: nn.Module, device: torch.device) -> None:
    """Rewrite the ``meta`` device constants ``torch.export`` baked into a stage's graphs (``x.to(x.device)``
    in rotary embeddings ...) when it traced the model on the meta device, so the stage runs on ``device``
    (the rule of ``torch.export.passes.move_to_device_pass``, applied to the split graph modules)."""
    meta = torch.device("meta")

    def swap(a):
        if isinstance(a, torch.device) and a == meta:
            return device
        if isinstance(a, str) and a == "meta":
            return str(device)
        return a

    for gm in _graph_modules(module):
        changed = False
        for node in list(gm.graph.nodes):
            args = fx.node.map_aggregate(node.args, swap)
            kwargs = fx.node.map_aggregate(node.kwargs, swap)
            if args != node.args or kwargs != node.kwargs:
                node.args, node.kwargs = args, kwargs
                changed = True
            if device.type == "cpu" and node.target is torch.ops.aten.histc.default:
                # code that picks a histc dtype by device (transformers' MoE routing: int32 off the CPU)
                # traced the meta branch; the CPU kernel takes floating inputs only (the counts are equal)
                val = node.meta.get("val")
                if val is None or val.dtype.is_floating_point:
                    continue
                with gm.graph.inserting_before(node):
                    as_float = gm.graph.call_function(
                        torch.ops.aten._to_copy.default, (node.args[0],), {"dtype": torch.float32}
                    )
                node.args = (as_float, *node.args[1:])
                with gm.graph.inserting_after(node):  # and hand on the dtype the graph was traced with
                    back = gm.graph.call_function(
                        torch.ops.aten._to_copy.default, (node,), {"dtype": val.dtype}
                    )
                node.replace_all_uses_with(back, delete_user_cb=lambda user, back=back: user is not back)
                changed = True
        if changed:
            _recompile(gm)


def _autocast_forward(module: nn.Module, device_type: str) -> None:
    """Make ``module``'s forward run under bf16 autocast and return its floating outputs in float32 (the
    dtype the stages were traced with, which the receiving stage's buffers expect). Setting the module's
    ``autocast_bf16`` attribute to False turns it off (Verify runs in float32)."""
    inner = module.forward
    module.autocast_bf16 = True

    def forward(self, *args, **kwargs):
        with torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=self.autocast_bf16):
            out = inner(*args, **kwargs)
        return torch.utils._pytree.tree_map(
            lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 else t, out
        )

    module.forward = types.MethodType(forward, module)


def _default_pp_group():
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def build_pipeline(
    sch,
    target: str = "torch",
    *,
    example_inputs,
    loss_fn: Callable,
    schedule: str = "1F1B",
    n_microbatches: int | None = None,
    pp_group=None,
    dp_group=None,
    stages_per_rank: int = 1,
    optimizer: Callable[[list], Any] | None = None,
    output_fn: Callable | None = None,
    device: str | torch.device = "cpu",
    ds_config: dict | None = None,
    prepare_stages: Callable[[PipelinePartition, list[int]], None] | None = None,
    autocast_bf16: bool = False,
    lr_scheduler: Callable[[Any], Any] | None = None,
    deepspeed_later: bool = False,
) -> PipelineModel:
    """Build this rank's pipeline stages from a cut schedule (Slapo's ``build(sch, target=...)`` for pipelines).

    Every rank of ``pp_group`` calls this with the same schedule (same cuts, same shapes); with tensor
    parallelism, ``sch`` is this rank's tensor-parallel shard (``create_schedule(model, group=tp_group)``
    plus the TP primitives), and the exported stages run its sync ops on ``tp_group``.

    Args:
        sch: a schedule with ``cut_pipeline_stage`` cuts (n cuts -> n + 1 stages).
        target: ``"torch"`` (``torch.distributed.pipelining``) or ``"deepspeed"`` (``deepspeed.pipe``).
        example_inputs: one full batch of model inputs (tuple of positional tensors, dict of keyword
            tensors, or one tensor); dim 0 = batch; later batches must have the same shapes.
        loss_fn: ``loss_fn(output, target) -> scalar`` applied per micro-batch on the last stage;
            ``output`` is ``output_fn(model(...))``. Use a mean so the result matches the full batch.
        schedule: ``"GPipe"``, ``"1F1B"`` or ``"Interleaved1F1B"`` (torch target; needed for
            ``stages_per_rank > 1``). DeepSpeed always runs its own 1F1B-style ``TrainSchedule``.
        n_microbatches: micro-batches per step (default: the pipeline size).
        pp_group: the pipeline process group (default: the whole world); its size ``pp`` times
            ``stages_per_rank`` must equal the number of stages.
        dp_group: data-parallel replicas whose gradients are averaged after each step (None: no DP).
        stages_per_rank: stages per pipeline rank (rank ``r`` runs stages ``r, r + pp, ...``).
        optimizer: ``optimizer(params) -> torch.optim.Optimizer`` over this rank's parameters; None to
            step yourself (``PipelineModel.parameters()``). For DeepSpeed an optimizer is required
            (a torch one avoids DeepSpeed's fused-op builds).
        output_fn: picks the last stage's output from the model output (default: first float tensor).
        device: the device stages run on ("cpu" with gloo here).
        ds_config: extra DeepSpeed config entries (merged over the generated batch-size settings).
        prepare_stages: ``prepare_stages(partition, stage_ids)`` runs after the split and before this
            rank's stages are built: the hook that materialises a partition exported on the meta device
            (only this rank's stage parameters get storage) or wraps stage modules (FSDP2).
        autocast_bf16: run every stage's forward under ``torch.autocast(bfloat16)`` and hand its
            floating-point outputs on in their traced dtype: bf16 compute, fp32 weights (the masters).
        lr_scheduler: DeepSpeed: ``lr_scheduler(optimizer) -> scheduler`` the engine steps with the optimizer.
        deepspeed_later: build the torch runtime now (to verify it: DeepSpeed's ``train_batch`` steps the
            optimizer, leaving no gradients to compare) and keep what :func:`deepspeed_from` needs.

    Returns:
        PipelineModel: ``train_step(*inputs, target=y) -> loss``; ``.optimizer``; ``.named_parameters()``
        under the original FQNs.

    Raises:
        ScheduleError: unknown target or schedule; torch.distributed not initialised; no cuts or a cut that cannot be honoured; a stage
            count that does not match ``pp * stages_per_rank``; ``stages_per_rank > 1`` with a
            single-stage schedule or with DeepSpeed; a batch not divisible by ``n_microbatches``; 1F1B
            with more than one but fewer micro-batches than stages (one micro-batch runs as GPipe);
            micro-batches that BatchNorm or a contrastive loss cannot honour (see
            :func:`~slapo_lab.pipeline.partition_pipeline`); no optimizer for DeepSpeed.
    """
    _check_arguments(target, schedule, stages_per_rank, loss_fn)
    if pp_group is None:
        pp_group = _default_pp_group()
    pp = _group_size(pp_group)
    pp_rank = _group_rank(pp_group)
    if n_microbatches is None:
        n_microbatches = max(pp, 1) * stages_per_rank if schedule == "Interleaved1F1B" else max(pp, 1)
    _check_layout(sch, target, schedule, pp_group, pp, stages_per_rank, n_microbatches)
    partition = partition_pipeline(sch, example_inputs, n_microbatches, output_fn)
    stage_ids = [pp_rank + k * pp for k in range(stages_per_rank)]
    codecs = None
    if target == "deepspeed" or deepspeed_later:
        # how values travel between DeepSpeed stages: one micro-batch through every stage, while they are all
        # alike (all meta, or all real)
        codecs = partition.ds_codecs = _dry_run_codecs(partition)
    _prepare_stage_modules(partition, stage_ids, prepare_stages, autocast_bf16, torch.device(device))
    pm = PipelineModel(partition, target, stage_ids, pp_group, dp_group, n_microbatches)
    if target == "deepspeed":
        build_deepspeed(
            pm,
            loss_fn,
            optimizer,
            ds_config or {},
            example_inputs,
            device,
            codecs=codecs,
            lr_scheduler=lr_scheduler,
        )
        return pm
    _build_torch_schedule(pm, pp, schedule, loss_fn, torch.device(device))
    if optimizer is not None:
        pm.optimizer = optimizer(pm.parameters())
    return pm


def _check_arguments(target: str, schedule: str, stages_per_rank: int, loss_fn: Callable) -> None:
    """Refuse an unknown target or schedule, a bad ``stages_per_rank`` or a missing ``loss_fn`` (one sentence)."""
    if target not in TARGETS:
        raise ScheduleError(f"Unknown pipeline target {target!r}; use one of {', '.join(TARGETS)}.")
    if schedule not in SCHEDULES:
        raise ScheduleError(f"Unknown pipeline schedule {schedule!r}; use one of {', '.join(SCHEDULES)}.")
    if isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int) or stages_per_rank < 1:
        raise ScheduleError(f"stages_per_rank must be a positive integer, not {stages_per_rank!r}.")
    if not callable(loss_fn):
        raise ScheduleError("build_pipeline needs loss_fn(output, target) -> scalar loss.")


def _check_layout(
    sch, target: str, schedule: str, pp_group, pp: int, stages_per_rank: int, n_microbatches: int
) -> None:
    """Refuse micro-batches, stages per rank or a stage count the pipeline group and schedule cannot run, or a
    missing process group (one sentence)."""
    if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ScheduleError(f"n_microbatches must be a positive integer, not {n_microbatches!r}.")
    if stages_per_rank > 1 and target == "deepspeed":
        raise ScheduleError(
            "DeepSpeed runs one stage per rank: use stages_per_rank=1 with target='deepspeed'."
        )
    if stages_per_rank > 1 and schedule != "Interleaved1F1B":
        raise ScheduleError(
            f"stages_per_rank={stages_per_rank} needs schedule='Interleaved1F1B' ({schedule} runs "
            "one stage per rank)."
        )
    n_cuts = len(sch.get_top_schedule().metadata.primitives["cut_pipeline_stage"])
    if n_cuts + 1 != pp * stages_per_rank:
        raise ScheduleError(
            f"The schedule has {n_cuts} cuts, i.e. {n_cuts + 1} stages, but the pipeline group has "
            f"{pp} ranks x stages_per_rank={stages_per_rank} = {pp * stages_per_rank} stage slots."
        )
    if schedule == "1F1B" and target == "torch" and 1 < n_microbatches < n_cuts + 1:
        raise ScheduleError(
            f"The 1F1B schedule needs at least as many micro-batches as stages ({n_cuts + 1}), not "
            f"n_microbatches={n_microbatches}; use more micro-batches, one, or schedule='GPipe'."
        )
    if pp_group is None:
        raise ScheduleError(
            "build_pipeline runs its stages on a process group, but torch.distributed is not "
            "initialised: launch with torchrun (or call dist.init_process_group, world size 1 "
            "for all stages in one process) first."
        )


def _prepare_stage_modules(
    partition: PipelinePartition,
    stage_ids: list[int],
    prepare_stages: Callable[[PipelinePartition, list[int]], None] | None,
    autocast_bf16: bool,
    device: torch.device,
) -> None:
    """Run the caller's ``prepare_stages`` hook on this rank's stages (then move their graphs' meta device
    constants to ``device``), and wrap their forwards in bf16 autocast when asked."""
    if prepare_stages is not None:
        prepare_stages(partition, stage_ids)
        for i in stage_ids:
            _retarget_devices(partition.stage_module(i), device)
    if autocast_bf16:
        for i in stage_ids:
            _autocast_forward(partition.stage_module(i), device.type)


def _build_torch_schedule(
    pm: PipelineModel, pp: int, schedule: str, loss_fn: Callable, dev: torch.device
) -> None:
    """Give ``pm`` this rank's ``torch.distributed.pipelining`` stages (``pm.stages``) and the schedule that
    runs them (``pm.schedule``)."""
    from torch.distributed.pipelining import (  # noqa: PLC0415 - torch.distributed.pipelining takes 2.5 s to import: only a pipeline run loads it
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    partition, stage_ids, n_microbatches = pm.partition, pm.stage_ids, pm.n_microbatches
    if pp == 1:
        # every stage on this one rank (Interleaved1F1B, stages_per_rank = stages): the traced stages of
        # Pipe.build_stage warm up by sending to their neighbour's rank, i.e. to themselves, which gloo
        # refuses ("Pair is not connected"); PipelineStage passes values between stages of one rank
        # in memory and infers their shapes from the first micro-batch.
        from torch.distributed.pipelining import PipelineStage  # noqa: PLC0415 - 2.5 s to import: only a pipeline run loads it

        pm.stages = [
            PipelineStage(partition.stage_module(i), i, partition.num_stages, dev, group=pm.pp_group)
            for i in stage_ids
        ]
    else:
        pm.stages = [partition.pipe.build_stage(i, dev, pm.pp_group) for i in stage_ids]
    if schedule == "Interleaved1F1B":
        pm.schedule = ScheduleInterleaved1F1B(pm.stages, n_microbatches, loss_fn=loss_fn)
    else:
        # one micro-batch: 1F1B is GPipe's order (forward, then backward), which torch's 1F1B refuses
        one = n_microbatches == 1 and partition.num_stages > 1
        cls = ScheduleGPipe if schedule == "GPipe" or one else Schedule1F1B
        pm.schedule = cls(pm.stages[0], n_microbatches, loss_fn=loss_fn)
