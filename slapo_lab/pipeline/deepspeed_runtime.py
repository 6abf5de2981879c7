"""The DeepSpeed runtime: ``deepspeed.pipe.PipelineModule`` built from the exported stages.

DeepSpeed's pipeline (``deepspeed/runtime/pipe/{module,engine}.py``, 0.19) chains *layers*: each
stage's forward takes the previous stage's output -- one tensor or a tuple of tensors -- and the
engine sends and receives those tuples, with gradients for the floating-point ones only. Our stages
are graph modules with several inputs and outputs, some produced stages earlier, so each becomes one
DeepSpeed layer (:class:`DeepSpeedStage`) that follows Slapo's liveness analysis
(``analyze_pipeline_module``): layer ``i`` receives exactly the values alive at boundary ``i``
(:attr:`PipelinePartition.liveness`) and returns those alive at boundary ``i + 1``, carrying
skip values (torchgpipe's ``SkipLayout``) through the stages in between.

Engine constraints handled here:

* a floating-point tensor that needs no gradient (an additive attention mask) would make the
  engine call ``backward`` on a tensor without ``grad_fn``; it travels bit-exactly as an integer view
  of the same width (``float32 -> int32``), decided once by a dry run of one micro-batch;
* ``bool`` tensors travel as ``uint8`` views (no ``bool`` sends on every backend);
* the engine asserts that every floating-point input got a gradient; a zero-gradient anchor on the
  stage's first differentiable output guarantees one (it adds exact zeros);
* tied weights replicated on several stages: :func:`pipeline_module_class`'s module returns them from
  ``get_tied_weights_and_groups``, so the engine's ``ReduceTiedGrads`` step all-reduces them over
  process groups of the owning stages (one group per data-parallel index).

Only pipeline x data parallelism (no tensor parallelism) and one stage per rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..call_order import _split_inputs
from ..errors import ScheduleError
from ..parallel_dims import ParallelDims

_INT_OF = {
    torch.float32: torch.int32,
    torch.float64: torch.int64,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def _encode(t: torch.Tensor, codec: tuple) -> torch.Tensor:
    kind = codec[0]
    if kind == "bool":
        return t.view(torch.uint8)
    if kind == "float_nograd":
        return t.detach().contiguous().view(_INT_OF[t.dtype])
    return t


def _decode(t: torch.Tensor, codec: tuple) -> torch.Tensor:
    kind = codec[0]
    if kind == "bool":
        return t.view(torch.bool)
    if kind == "float_nograd":
        return t.view(codec[1])
    return t


def _codec(t: Any) -> tuple:
    if not isinstance(t, torch.Tensor):
        raise ScheduleError(
            f"DeepSpeed pipelines pass only tensors between stages, but a stage produces a "
            f"{type(t).__name__}."
        )
    if t.dtype == torch.bool:
        return ("bool",)
    if t.is_floating_point():
        if t.requires_grad:
            return ("float",)
        if t.dtype not in _INT_OF:
            raise ScheduleError(f"Cannot send a {t.dtype} tensor without gradient between DeepSpeed stages.")
        return ("float_nograd", t.dtype)
    return ("int",)


class _ZeroGradAnchor(torch.autograd.Function):
    """Identity on ``out``; in backward, gives every tensor in ``ins`` an (exactly) zero gradient."""

    @staticmethod
    def forward(ctx, out, *ins):
        ctx.metas = [(t.shape, t.dtype, t.device) for t in ins]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return (grad, *[torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.metas])


class DeepSpeedStage(nn.Module):
    """Stage ``index`` of a :class:`~slapo_lab.pipeline.PipelinePartition` as one DeepSpeed layer.

    ``forward(x)``: ``x`` is the tuple of values alive at boundary ``index`` (encoded as above; the
    model inputs for stage 0); returns the tuple alive at boundary ``index + 1``, or the model output
    on the last stage.
    """

    def __init__(self, partition, index: int, codecs: list[list[tuple]]) -> None:
        super().__init__()
        self.index = index
        self.stage = partition.stage_module(index)
        self._info = partition.stages[index]
        self._producer = partition.value_producer
        self._in_names = partition.liveness[index]
        self._out_names = partition.liveness[index + 1]
        self._codec_in = codecs[index]
        self._codec_out = codecs[index + 1]
        self._last = index == partition.num_stages - 1

    def run(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run the stage on named values; return the named values it produces."""
        res = self.stage(*[values[a] for a in self._info.inputs])
        out = {}
        for v in self._info.outputs:
            k = self._producer[v][1]
            out[v] = res if k is None else res[k]
        return out

    def forward(self, x):
        if isinstance(x, torch.Tensor):
            x = (x,)
        x = tuple(x)
        env = {n: _decode(t, c) for n, t, c in zip(self._in_names, x, self._codec_in, strict=False)}
        env.update(self.run(env))
        anchors = [t for t in x if t.is_floating_point() and t.requires_grad]
        outs = [env[v] for v in self._out_names]
        if not self._last:
            outs = [_encode(t, c) for t, c in zip(outs, self._codec_out, strict=False)]
        if anchors:
            for i, t in enumerate(outs):
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad:
                    outs[i] = _ZeroGradAnchor.apply(t, *anchors)
                    break
        if self._last:
            return outs[0] if len(outs) == 1 else tuple(outs)
        return tuple(outs)


def _dry_run_codecs(partition) -> list[list[tuple]]:
    """Per boundary, how each live value travels (one micro-batch through all stages, DeepSpeed rules)."""
    n = partition.num_stages
    flat = partition.flat_inputs(partition.mb_args, partition.mb_kwargs)
    values = dict(zip(partition.liveness[0], flat, strict=False))
    codecs = [[("int",) if not t.is_floating_point() else ("float",) for t in flat]]
    codecs[0] = [("bool",) if t.dtype == torch.bool else c for t, c in zip(flat, codecs[0], strict=False)]
    for i in range(n):
        stage = DeepSpeedStage(partition, i, [[]] * (n + 1))
        ins = {}
        for name, c in zip(partition.liveness[i], codecs[i], strict=False):
            t = values[name].detach()
            if c[0] == "float" and i > 0:
                t = t.clone().requires_grad_(True)
            ins[name] = t
        with torch.enable_grad():
            produced = stage.run(ins)
        values = {**ins, **produced}
        if i < n - 1:
            codecs.append([_codec(values[v]) for v in partition.liveness[i + 1]])
    codecs.append([("float",)] * len(partition.liveness[n]))
    return codecs


def build_deepspeed(
    pm, loss_fn, optimizer, ds_config: dict, example_inputs, device, codecs=None, lr_scheduler=None
) -> None:
    """Fill ``pm`` (a :class:`~slapo_lab.pipeline.PipelineModel`) with a DeepSpeed ``PipelineEngine``.

    ``codecs``: :func:`_dry_run_codecs` of the partition, computed before this rank's stages were
    materialised (default: computed here, which needs every stage runnable on this rank).
    ``lr_scheduler``: ``lr_scheduler(optimizer)`` -> the scheduler the engine steps.

    Raises:
        ScheduleError: no optimizer; a world size other than pp x dp (tensor parallelism is not
            supported on this target); non-tensor inputs; DeepSpeed missing.
    """
    try:
        import deepspeed  # noqa: PLC0415 - DeepSpeed is a heavy optional dependency: only target='deepspeed' loads it
        from deepspeed.runtime.pipe.topology import ProcessTopology  # noqa: PLC0415 - optional DeepSpeed, as above
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ScheduleError(
            "target='deepspeed' needs DeepSpeed (DS_BUILD_OPS=0 pip install deepspeed)."
        ) from err
    if optimizer is None:
        raise ScheduleError(
            "target='deepspeed' needs optimizer=lambda params: torch.optim.SGD(params, lr=...) "
            "(DeepSpeed's engine owns the optimizer step)."
        )
    partition = pm.partition
    args, kwargs = _split_inputs(example_inputs)
    for v in list(args) + list(kwargs.values()):
        if not isinstance(v, torch.Tensor):
            raise ScheduleError(
                "target='deepspeed' feeds only tensors to the first stage; every example input "
                f"must be a tensor, not a {type(v).__name__}."
            )
    pp = partition.num_stages
    ws = dist.get_world_size()
    dims = ParallelDims.for_world(ws, pp=pp)
    dp = dims.dp if dims is not None else 0
    if dims is None or (pm.dp_group is not None and dist.get_world_size(pm.dp_group) != dp):
        raise ScheduleError(
            f"target='deepspeed' supports pipeline x data parallelism only: the world size {ws} must "
            f"be {pp} stages x the data-parallel size (tensor parallelism is not supported there)."
        )
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    codecs = codecs if codecs is not None else _dry_run_codecs(partition)
    layers = [DeepSpeedStage(partition, i, codecs) for i in range(pp)]
    # Our mesh puts the pipeline inside the data-parallel replicas: rank = d * pp + p.
    topo = ProcessTopology(axes=["data", "pipe"], dims=[dp, pp])
    mb = (
        partition.mb_args[0].shape[0]
        if partition.mb_args
        else next(iter(partition.mb_kwargs.values())).shape[0]
    )
    module = pipeline_module_class()(
        partition, layers=layers, topology=topo, loss_fn=loss_fn, partition_method="uniform"
    )
    config = {
        "train_micro_batch_size_per_gpu": int(mb),
        "gradient_accumulation_steps": pm.n_microbatches,
        "train_batch_size": int(mb) * pm.n_microbatches * dp,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 0},
        "gradient_clipping": 0.0,
        "wall_clock_breakdown": False,
    }
    config.update(ds_config)
    opt = optimizer([p for p in module.parameters()])
    sched = lr_scheduler(opt) if lr_scheduler is not None else None
    engine, opt, _, _ = deepspeed.initialize(model=module, optimizer=opt, lr_scheduler=sched, config=config)
    pm.engine = engine
    pm.optimizer = opt
    pm.stages = [module]


_MODULE_CLASS = None


def pipeline_module_class():
    """``SlapoPipelineModule``: a ``deepspeed.pipe.PipelineModule`` whose tied weights are the partition's copies.

    ``get_tied_weights_and_groups`` returns, for every tied parameter this rank holds, the parameter
    and a process group of the ranks holding the other copies (same data-parallel index), so the
    engine's ``ReduceTiedGrads`` instruction sums their gradients. Created on first use, so that
    importing this module does not import DeepSpeed.
    """
    global _MODULE_CLASS
    if _MODULE_CLASS is not None:
        return _MODULE_CLASS
    import deepspeed.comm as ds_dist  # noqa: PLC0415 - DeepSpeed is a heavy optional dependency: only target='deepspeed' loads it
    from deepspeed.runtime.pipe.module import PipelineModule  # noqa: PLC0415 - optional DeepSpeed, as above

    class SlapoPipelineModule(PipelineModule):
        def __init__(self, partition, **kwargs) -> None:
            super().__init__(**kwargs)
            self._slapo_tied: list[tuple[torch.Tensor, Any]] = []
            topo = self._topo
            dp = topo.get_dim("data")
            me = dist.get_rank()
            for group in partition.tied:
                stages = sorted(group)
                for d in range(dp):
                    ranks = [topo.get_rank(data=d, pipe=s) for s in stages]
                    g = ds_dist.new_group(ranks=ranks)
                    if me in ranks:
                        s = stages[ranks.index(me)]
                        self._slapo_tied.append((partition.stages[s].params[group[s]], g))

        def get_tied_weights_and_groups(self):
            return list(self._slapo_tied) + list(super().get_tied_weights_and_groups())

        def allreduce_tied_weight_gradients(self):
            for w, g in self._slapo_tied:
                if w.grad is not None:
                    ds_dist.all_reduce(w.grad, group=g)
            super().allreduce_tied_weight_gradients()

    _MODULE_CLASS = SlapoPipelineModule
    return _MODULE_CLASS


def deepspeed_train_step(pm, args: tuple, kwargs: dict, target) -> float:
    """One ``engine.train_batch`` over the full batch split into ``n_microbatches`` micro-batches."""
    return float(pm.engine.train_batch(iter(_micro_batches(pm, args, kwargs, target))))


def _micro_batches(pm, args: tuple, kwargs: dict, target) -> list[tuple[tuple, Any]]:
    """``[(inputs, target)]`` of the ``n_microbatches`` micro-batches of a full batch."""
    n = pm.n_microbatches
    flat = pm.partition.flat_inputs(args, kwargs)
    chunks = [t.chunk(n, dim=0) for t in flat]
    tchunks = target.chunk(n, dim=0) if isinstance(target, torch.Tensor) else [target] * n
    return [(tuple(c[i] for c in chunks), tchunks[i]) for i in range(n)]


def deepspeed_eval_step(pm, args: tuple, kwargs: dict, target) -> float:
    """One ``engine.eval_batch`` (forward only) over the full batch split into ``n_microbatches`` micro-batches."""
    return float(pm.engine.eval_batch(iter(_micro_batches(pm, args, kwargs, target))))
