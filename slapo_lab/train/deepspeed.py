"""The DeepSpeed target: the scheduled model (or its pipeline stages) under DeepSpeed's engine.

Without cuts the engine gets the tensor-parallel model with a model-parallel unit (``mpu``: the ``tp``
group is the model-parallel group, the replicas are data parallel) and the shards marked as Megatron
marks them (``tensor_model_parallel``, ``partition_dim``, ``partition_stride``; DeepSpeed's
``is_model_parallel_parameter`` reads the first), so ZeRO (``--zero 1``: optimizer states, ``--zero 2``:
and gradients, sharded over ``dp``) and its ``gradient_clipping`` count every shard once and every
replicated parameter once. With cuts it is DeepSpeed's pipeline engine (pipeline x data parallelism,
ZeRO up to 1). The engine owns the optimizer step, the learning-rate schedule (the same
``torch.optim.lr_scheduler`` as the torchrun target), clipping, bf16 with fp32 master weights, and its
checkpoints (``engine.save_checkpoint``: a tag directory, then the ``latest`` file, so an interrupted
save never becomes the one resumed from; DeepSpeed's format resumes at the same layout).

Sources: DeepSpeed ``deepspeed/runtime/engine.py`` (``initialize``, ``backward``, ``step``,
``save_checkpoint``), ``deepspeed/runtime/utils.py`` (``clip_grad_norm_`` and its model-parallel rules),
Megatron-LM ``megatron/core/tensor_parallel/layers.py`` (the parameter attributes).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..pipeline.runtime import deepspeed_from
from .config import TrainConfig
from .lifeline import check
from .losses import model_loss, split_target, to_device
from .optim import make_optimizer, make_scheduler

if TYPE_CHECKING:
    from .parallel import Layout
    from .run import Run
    from .weights import Target


def ds_config(cfg: TrainConfig, micro: int, accumulation: int, dp: int) -> dict[str, Any]:
    """DeepSpeed's config for these options (``--print-ds-config`` prints it).

    The batch sizes follow ``--global-batch-size`` / ``--micro-batch-size`` and ``dp``; ``--zero`` is the ZeRO
    stage; ``--max-grad-norm`` the clipping; ``--bf16`` bf16 with fp32 masters. No ``optimizer`` section:
    the script hands DeepSpeed a torch optimizer (no fused-op builds), hence
    ``zero_allow_untested_optimizer``.
    """
    return {
        "train_batch_size": micro * accumulation * dp,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "zero_optimization": {"stage": cfg.parallel.zero},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": float(cfg.optimizer.max_grad_norm),
        "bf16": {"enabled": bool(cfg.precision.bf16)},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


class ModelParallelUnit:
    """DeepSpeed's ``mpu``: the tensor-parallel group is the model-parallel group, the replicas are data
    parallel (DeepSpeed broadcasts weights and averages gradients between replicas, never across shards)."""

    def __init__(self, layout: Layout) -> None:
        self.mesh = layout.mesh

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self.mesh.tp_group

    def get_model_parallel_rank(self) -> int:
        return self.mesh.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.mesh.tp

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.mesh.dp_group

    def get_data_parallel_rank(self) -> int:
        return self.mesh.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.mesh.dp

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size


def mark_model_parallel(targets: Iterable[Target]) -> int:
    """Set Megatron's attributes on every tensor-parallel shard (``tensor_model_parallel = True``,
    ``partition_dim``, ``partition_stride``; ``model_parallel = True`` for older DeepSpeed code paths) and
    ``False`` on replicated parameters; returns the number of shards marked.

    A key/value head replicated on r ranks (``layout.tp_replicas``) is marked on the first rank of its replica
    group only: DeepSpeed's clipping norm counts a model-parallel parameter on every rank and any other on
    model-parallel rank 0 only, so the head is counted once."""
    n = 0
    for t in targets:
        sharded = t.layout.tp_sharded and t.layout.tp_rank % t.layout.tp_replicas == 0
        t.param.tensor_model_parallel = sharded
        t.param.model_parallel = sharded
        if sharded:
            t.param.partition_dim = t.layout.tp_axis
            t.param.partition_stride = t.layout.tp_stride
            n += 1
    return n


class DeepSpeedStepper:
    """The DeepSpeed target's optimizer step and checkpoints (see the module docstring)."""

    def __init__(self, run: Run) -> None:
        import deepspeed  # noqa: PLC0415 - optional and heavy: only a run under the DeepSpeed launcher needs it

        cfg, lay = run.cfg, run.layout
        self.run = run
        self.zero = cfg.parallel.zero
        if run.pm is not None:  # the same stages on DeepSpeed's pipeline engine
            # DeepSpeed counts a parameter in its clipping norm on model-parallel rank 0 only unless it is marked
            # model parallel, and its pipeline grid puts the stages into the model-parallel group: every stage's
            # own parameters are distinct, so all are marked (a tied copy on a later stage is not)
            owners = {id(t.param) for t in run.norm_targets()}
            for t in run.targets:
                t.param.model_parallel = t.param.tensor_model_parallel = id(t.param) in owners
            run.pm = deepspeed_from(
                run.pm,
                loss_fn=run.pipeline_loss,  # the same object: evaluation switches it to token sums
                optimizer=lambda params: make_optimizer(cfg.optimizer, params),
                lr_scheduler=lambda opt: make_scheduler(
                    opt, cfg.lr_schedule.lr_schedule, cfg.lr_schedule.warmup_steps, run.steps
                ),
                ds_config=ds_config(cfg, run.micro, run.plan.accumulation, lay.dp),
                device=run.device,
            )
            self.engine = run.pm.engine
        else:
            mark_model_parallel(run.targets)
            deepspeed.init_distributed(dist_backend=dist.get_backend())
            optimizer = run.new_optimizer()
            scheduler = make_scheduler(
                optimizer, cfg.lr_schedule.lr_schedule, cfg.lr_schedule.warmup_steps, run.steps
            )
            self.engine, _, _, _ = deepspeed.initialize(
                model=run.module,
                optimizer=optimizer,
                lr_scheduler=scheduler,
                config=ds_config(cfg, run.micro, run.plan.accumulation, lay.dp),
                mpu=ModelParallelUnit(lay),
            )
            run.model = self.engine
        self.engine.train()
        self.norm = None
        if self.zero == 0:  # ZeRO-0 clips without keeping the norm: read it off the reduced gradients first
            clip = self.engine.clip_fp32_gradients
            norm_targets = run.norm_targets()

            def clip_and_keep_norm():
                self.norm = float(run.grad_norm(norm_targets))
                clip()

            self.engine.clip_fp32_gradients = clip_and_keep_norm

    def resume(self) -> int:
        """Load DeepSpeed's latest checkpoint of ``--checkpoint-dir``; returns the step to start from."""
        run = self.run
        if not run.cfg.checkpoint.checkpoint_dir or run.cfg.checkpoint.no_resume:
            return 0
        if not (Path(run.cfg.checkpoint.checkpoint_dir) / "latest").is_file():
            return 0
        path, state = self.engine.load_checkpoint(run.cfg.checkpoint.checkpoint_dir)
        if path is None:
            return 0
        state = state or {}
        start = int(state.get("step", 0))
        run.resumed(path, state, start)
        optimizer = getattr(self.engine, "basic_optimizer", None) or self.engine.optimizer
        self.engine.lr_scheduler = run.stretch_schedule(optimizer, self.engine.lr_scheduler, state, start)
        return start

    def step(self, step: int) -> tuple[float, float, float]:
        """One optimizer step through the engine; returns (loss, grad norm, lr used)."""
        run = self.run
        lr = self.engine.get_lr()[0]
        self.norm = None
        if run.pm is not None:
            inputs, target = split_target(to_device(run.replica_batch(step), run.device), 1, run.device)
            loss = run.dp_mean(torch.tensor(run.pm.train_step(**inputs, target=target), dtype=torch.float64))
        else:
            micro_batches = run.plan.micro_batches(run.data, step)
            total = torch.zeros((), device=run.device)
            for mb in micro_batches:
                loss = model_loss(self.engine(**to_device(mb, run.device)), run.cfg.data.seed)
                self.engine.backward(
                    loss
                )  # scaled by 1 / gradient_accumulation_steps, averaged over replicas
                self.engine.step()  # steps the optimizer (and the scheduler) after the last micro-batch
                total += loss.detach().float() / len(micro_batches)
            loss = run.dp_mean(total)
        norm = self.norm if self.norm is not None else self.engine.get_global_grad_norm()
        return loss, float(norm) if norm is not None else float("nan"), lr

    def save(self, step: int, state: dict) -> Path:
        """Save DeepSpeed's checkpoint of ``step`` (tag ``step-<step>``) with ``state`` and the layout; returns
        its folder."""
        check()  # a rank whose launcher died never writes (slapo_lab/train/lifeline.py)
        tag = f"step-{step:08d}"
        self.engine.save_checkpoint(
            self.run.cfg.checkpoint.checkpoint_dir,
            tag=tag,
            client_state=dict(state, layout=self.run.layout_key),
        )
        return Path(self.run.cfg.checkpoint.checkpoint_dir) / tag
