"""One launched training run on this rank: :class:`Run`, and the torchrun target's optimizer step,
:class:`TorchStepper`.

:meth:`Run.setup` assembles the run (:mod:`slapo_lab.train.assemble`), :meth:`Run.verify` proves it against the
unscheduled model (:mod:`slapo_lab.train.verify`), and :meth:`Run.train` resumes from the newest checkpoint, then
trains ``--steps`` optimizer steps of ``--global-batch-size`` sequences: micro-batches with gradient accumulation
(DDP / FSDP2 synchronise on the last), or the pipeline schedule; it clips by the global norm, steps the optimizer
and the learning-rate schedule, logs (:mod:`slapo_lab.train.metrics`), evaluates (:mod:`slapo_lab.train.evaluate`)
and checkpoints (:mod:`slapo_lab.train.checkpoint`), then writes a Hugging Face directory with ``--save-hf``.

The stepper owns the optimizer step and the checkpoints: :class:`TorchStepper` (a torch optimizer, DDP over ``dp``,
``torch.distributed.checkpoint``) or :class:`slapo_lab.train.deepspeed.DeepSpeedStepper` (DeepSpeed's engine).
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LRScheduler

from ..random import set_random_seed
from ..record import format_call
from . import assemble, metrics
from .checkpoint import Checkpointer, latest_checkpoint
from .checkpoint import save_hf as save_hf_folder
from .config import TrainConfig
from .deepspeed import DeepSpeedStepper
from .evaluate import evaluate as evaluate_run
from .losses import cat_batches, model_loss, split_target, to_device
from .optim import clip_, global_grad_norm, make_optimizer, make_scheduler
from .parallel import wrap_ddp
from .phases import say_phase
from .preflight import read_run_info
from .process import is_rank0, say
from .verify import verify_run
from .weights import copy_hf_extras, source_dtype


class Run:
    """One launched training run (see the module docstring); :func:`slapo_lab.train.loop.main` builds and drives it.

    Attributes (after :meth:`setup`):
        layout: the :class:`~slapo_lab.train.parallel.Layout` of the ranks.
        data / eval_data / plan: the training data, the validation data (or None), the batch plan.
        sch: the schedule applied on this rank's tensor-parallel group.
        module: the module holding this rank's parameters (the scheduled model, or the pipeline stages).
        targets: this rank's parameters: canonical name, parameter object, :class:`ShardLayout`.
        pm: the pipeline (:class:`slapo_lab.pipeline.PipelineModel`) or None.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        spec: dict,
        schedule_fn: Callable,
        input_spec: dict,
        tp: int,
        stages: int,
        launcher: str,
        device: str,
    ) -> None:
        self.cfg = cfg
        self.steps = cfg.batch.steps  # optimizer steps: --steps, or what --epochs makes of the data (setup)
        self.spec = spec
        self.schedule_fn = schedule_fn
        self.input_spec = input_spec
        self.tp_size = tp
        self.stages = stages
        self.launcher = launcher
        self.device = device
        self.pipeline = stages > 1
        self.pm = None
        self.record: dict = {}  # the launch's part of run.json (preflight's Checked.record)
        self.ddp = None
        self.unused_params = True  # DDP's find_unused_parameters, until Verify has seen every gradient
        self.forward_extras: dict = {}  # keyword arguments of every forward besides the batch (no_cache_kwargs)

    def setup(self) -> None:
        """Lay out the ranks, read the data, build and materialise this rank's part of the model
        (:func:`slapo_lab.train.assemble.setup`)."""
        assemble.setup(self)

    def replica_batch(self, step: int) -> dict:
        """This replica's batch of ``step`` (0-based), its micro-batches concatenated."""
        return cat_batches(self.plan.micro_batches(self.data, step))

    def verify(self) -> bool:
        """Run Verify (:func:`slapo_lab.train.verify.verify_run`); prints the report on rank 0; True if it passed."""
        return verify_run(self)

    def forward_kwargs(self, batch: dict) -> dict:
        """The keyword arguments of a forward on ``batch``: :attr:`forward_extras` (``use_cache=False``), then the
        batch itself, whose own values win (an example input may already say ``use_cache``)."""
        return {**self.forward_extras, **batch}

    def norm_targets(self) -> list:
        """The targets whose gradients make up the global norm: every parameter once (a tied copy on a later
        pipeline stage is left to the first stage holding it)."""
        if self.pm is None:
            return self.targets
        owner: dict[str, int] = {}
        for group in self.pm.partition.tied:
            for stage, fqn in group.items():
                name = self.canon_of_fqn.get(fqn, fqn)
                owner[name] = min(owner.get(name, stage), stage)
        stage_of = {}
        for i in self.pm.stage_ids:
            for p in self.pm.partition.stages[i].params.values():
                stage_of.setdefault(id(p), i)
        seen, out = set(), []
        for t in self.targets:
            if t.name in seen or stage_of.get(id(t.param), 0) != owner.get(
                t.name, stage_of.get(id(t.param), 0)
            ):
                continue
            seen.add(t.name)
            out.append(t)
        return out

    def new_optimizer(self) -> torch.optim.Optimizer:
        """A fresh optimizer (``--optimizer``) over this rank's parameters: DTensors and plain tensors in separate
        groups (foreach kernels take one kind per group)."""
        dtensors = [t.param for t in self.targets if getattr(t.param, "_local_tensor", None) is not None]
        plain = [t.param for t in self.targets if getattr(t.param, "_local_tensor", None) is None]
        opt = make_optimizer(self.cfg.optimizer, dtensors or plain)
        if dtensors and plain:  # foreach kernels take one kind per group
            opt.add_param_group({"params": plain})
        return opt

    def dp_mean(self, value: torch.Tensor) -> float:
        """``value`` (a 0-d tensor) averaged over the data-parallel replicas, as a float."""
        if self.layout.dp > 1:
            value = value.detach().double().clone()
            dist.all_reduce(value, group=self.layout.mesh.dp_group)
            value /= self.layout.dp
        return float(value)

    def autocast(self) -> torch.autocast:
        """bf16 autocast on the run's device with ``--bf16`` (off for a pipeline, whose stages cast themselves)."""
        return torch.autocast(
            device_type=torch.device(self.device).type,
            dtype=torch.bfloat16,
            enabled=bool(self.cfg.precision.bf16) and self.pm is None,
        )

    def _forward_backward(self, step: int) -> float:
        """Forward and backward of this replica's part of ``step``; gradients ready on return. Returns the
        step's loss (the mean over the global batch, the same on every rank)."""
        lay = self.layout
        if self.pm is not None:
            inputs, target = split_target(to_device(self.replica_batch(step), self.device), 1, self.device)
            loss = torch.tensor(self.pm.train_step(**inputs, target=target), dtype=torch.float64)
            lay.average_ignored_grads()
            return self.dp_mean(loss.to(self.reduce_device))
        micro_batches = self.plan.micro_batches(self.data, step)
        n = len(micro_batches)
        total = torch.zeros((), device=self.device)
        for i, mb in enumerate(micro_batches):
            last = i == n - 1
            # DDP all-reduces on the last micro-batch only; FSDP2 reduce-scatters every micro-batch and accumulates
            # the sharded gradients (its default, as torchtitan trains: holding unsharded gradients over the
            # micro-batches, ``set_requires_gradient_sync(False)``, would cost a whole replica's gradients per
            # rank, which FSDP is chosen to avoid; the planner prices FSDP this way)
            sync = contextlib.nullcontext() if last or self.ddp is None else self.ddp.no_sync()
            with sync:
                with self.autocast():
                    out = self.model(**self.forward_kwargs(to_device(mb, self.device)))
                    loss = model_loss(out, self.cfg.data.seed) / n
                loss.backward()
            total += loss.detach().float()
        lay.average_ignored_grads()
        return self.dp_mean(total)

    @property
    def reduce_device(self) -> str:
        """Where a collective's tensor must be: the run's device under NCCL, the CPU under gloo."""
        return self.device if dist.get_backend() == "nccl" else "cpu"

    def grad_norm(self, norm_targets: list) -> torch.Tensor:
        """The global gradient norm over ``norm_targets`` (each parameter once): their gradients as DTensor
        views on the ``(dp, tp)`` mesh, summed over the pipeline stages (:mod:`slapo_lab.train.optim`)."""
        views = []
        for t in norm_targets:
            g = t.param.grad
            if g is not None:
                views.append(t.layout.norm_view(getattr(g, "_local_tensor", g), self.layout.view_mesh))
        return global_grad_norm(views, self.layout.mesh.pp_group if self.layout.pp > 1 else None)

    def _clip(self, norm_targets: list) -> float:

        norm = self.grad_norm(norm_targets)
        grads = [
            getattr(t.param.grad, "_local_tensor", t.param.grad)
            for t in self.targets
            if t.param.grad is not None
        ]
        clip_(grads, self.cfg.optimizer.max_grad_norm, norm)
        return float(norm)

    def evaluate(self) -> tuple[float, int]:
        """The validation loss and the number of sequences evaluated (:func:`slapo_lab.train.evaluate.evaluate`)."""
        return evaluate_run(self)

    @property
    def layout_key(self) -> str:
        """The layout as a checkpoint records it: ``tp2.pp1.spr1.dp2.fsdp``."""
        lay = self.layout
        return f"tp{lay.tp}.pp{lay.pp}.spr{lay.stages_per_rank}.dp{lay.dp}" + (".fsdp" if lay.fsdp else "")

    def train(self) -> int:
        """Resume, train, evaluate, checkpoint and write the model out; returns the exit status.

        The target's stepper (:class:`TorchStepper`, or DeepSpeed's engine in :mod:`slapo_lab.train.deepspeed`)
        owns the optimizer step and the checkpoints; this loop owns the order, the metrics and evaluation.
        """
        cfg, lay = self.cfg, self.layout
        if self.launcher == "deepspeed":
            stepper = DeepSpeedStepper(self)
        else:
            stepper = TorchStepper(self)
        start = stepper.resume()
        say_phase("train")
        tokens_per_step = cfg.batch.global_batch_size * (self.seq_len or 1)
        say(
            f"model: {self.n_params / 1e6:.2f} M parameters, {dist.get_world_size()} rank(s) = {lay.describe()}"
            + (f", DeepSpeed ZeRO-{cfg.parallel.zero}" if self.launcher == "deepspeed" else "")
            + f", device {self.device}, global batch {cfg.batch.global_batch_size}"
            + (f" x {self.seq_len} tokens" if self.seq_len else "")
            + f" in micro-batches of {self.micro} ({self.plan.accumulation} per step and replica)"
            + (", bf16 compute / fp32 weights" if cfg.precision.bf16 else ""),
            self.data.describe(),
        )
        precision = (
            "bf16"
            if cfg.precision.bf16
            else ("fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32")
        )
        logger = metrics.MetricsLogger(
            dist.get_rank(),
            log_dir=cfg.metrics.log_dir,
            total_steps=self.steps,
            start_step=start,
            progress=cfg.metrics.progress,
            device=self.device,
            n_params=self.n_params,
            world_size=dist.get_world_size(),
            precision=precision,
            peak_tflops=cfg.metrics.peak_tflops,
            predicted_step_s=cfg.metrics.predicted_step_s,
            predicted_peak_gib=cfg.metrics.predicted_peak_gib,
        )
        saved_at = start if start else None
        with logger:
            for step in range(start, self.steps):
                if self.device.startswith("cuda"):
                    torch.cuda.synchronize(self.device)
                t0 = time.perf_counter()
                loss, norm, lr = stepper.step(step)
                if self.device.startswith("cuda"):
                    torch.cuda.synchronize(self.device)
                seconds = time.perf_counter() - t0
                done = step + 1
                logger.log_step(
                    done,
                    loss=loss,
                    lr=lr,
                    grad_norm=norm,
                    tokens=tokens_per_step,
                    samples=cfg.batch.global_batch_size,
                    seconds=seconds,
                )
                if (
                    self.eval_data is not None
                    and cfg.eval.eval_every
                    and done % cfg.eval.eval_every == 0
                    and done < self.steps
                ):
                    self._log_eval(logger, done)
                if (
                    cfg.checkpoint.checkpoint_dir
                    and cfg.checkpoint.checkpoint_every
                    and done % cfg.checkpoint.checkpoint_every == 0
                ):
                    say(f"checkpoint step {done} saved: {stepper.save(done, self.train_state(done))}")
                    saved_at = done
            if self.eval_data is not None:
                self._log_eval(logger, self.steps)
        if cfg.checkpoint.checkpoint_dir and saved_at != self.steps:
            say(
                f"checkpoint step {self.steps} saved: {stepper.save(self.steps, self.train_state(self.steps))}"
            )
        if cfg.checkpoint.save_hf:
            self.save_hf(cfg.checkpoint.save_hf)
        return 0

    def stretch_schedule(
        self, optimizer: torch.optim.Optimizer, scheduler: LRScheduler, state: dict, start: int
    ) -> LRScheduler:
        """The learning-rate schedule to resume with: the checkpoint's, or -- when the run now trains for another
        number of ``--steps`` than the one that saved it (its schedule ends there) -- a new one over the new
        total, advanced to ``start`` (and said so)."""
        saved = int(state.get("total_steps") or self.steps)
        if saved == self.steps:
            return scheduler
        fresh = make_scheduler(
            optimizer, self.cfg.lr_schedule.lr_schedule, self.cfg.lr_schedule.warmup_steps, self.steps
        )
        with warnings.catch_warnings():  # stepping the schedule without optimizer steps is the point here
            warnings.simplefilter("ignore")
            for _ in range(start):
                fresh.step()
        say(
            f"note: the checkpoint's learning-rate schedule ended at step {saved}; it now runs over --steps "
            f"{self.steps} (lr {optimizer.param_groups[0]['lr']:.2e} at step {start + 1})."
        )
        return fresh

    def resumed(self, path: str | os.PathLike, state: dict, start: int) -> None:
        """Reseed when the checkpoint's layout differs (its RNG states are per rank), and say so; say when the
        checkpoint was saved by another schedule (its recorded calls in ``run.json``)."""
        lay = self.layout
        same = state.get("layout") == self.layout_key
        if not same:
            set_random_seed(
                self.cfg.data.seed + start, dp_rank=lay.dp_rank, pp_rank=lay.pp_rank, tp_rank=lay.tp_rank
            )
        say(
            f"resumed from {path} at step {start}"
            + (
                ""
                if same
                else f" (saved as {state.get('layout')}, now {self.layout_key}: weights and optimizer resharded)"
            )
        )
        saved = read_run_info(path).get("schedule")
        calls = [format_call(c) for c in self.sch.record.calls]
        if isinstance(saved, list) and saved != calls:
            say(
                f"note: {path} was saved by another schedule ({len(saved)} recorded calls, this one has "
                f"{len(calls)}); its tensors were resharded to this schedule's layouts."
            )

    def _log_eval(self, logger, step: int) -> None:
        loss, rows = self.evaluate()
        logger.log_eval(step, loss, samples=rows)

    def run_info(self) -> dict:
        """What a checkpoint records beside the tensors: for ``slapo-lab convert``, the model spec (with the
        config the run used), the tokenizer directory and the weights' source dtype; for a relaunch's
        comparison (:func:`slapo_lab.train.preflight.compare_run`), the launch's record (the config as
        config.json or the script gives it, the model directory and weights the run started from, the data,
        the sequence length, when it started) and the schedule (its recorded calls)."""
        spec = dict(self.spec)
        if self.config is not None and spec.get("kind") == "hf":
            spec["config"] = self.config.to_dict()
        absolute = lambda p: str(Path(p).resolve()) if p else None
        return {
            "model_path": absolute(self.cfg.model.model_path),
            **self.record,
            "model": spec,
            "tokenizer": absolute(self.cfg.model.tokenizer_dir),
            "source_dtype": str(source_dtype(self.cfg.model.model_path)).removeprefix("torch."),
            "schedule": [format_call(c) for c in self.sch.record.calls],
        }

    def train_state(self, step: int) -> dict:
        """What a checkpoint saved after ``step`` optimizer steps records beside the tensors (step, samples, epoch,
        seed, batch size, total steps)."""
        return {
            "step": step,
            "samples": step * self.cfg.batch.global_batch_size,
            "epoch": self.plan.epoch(step),
            "seed": self.cfg.data.seed,
            "global_batch_size": self.cfg.batch.global_batch_size,
            "total_steps": self.steps,
        }

    def save_hf(self, folder: str) -> None:
        """Write the trained model as a Hugging Face directory (gathered from every shard) with its config
        and tokenizer."""
        cfg = self.cfg
        dtype = (
            source_dtype(cfg.model.model_path)
            if cfg.checkpoint.save_dtype == "auto"
            else getattr(torch, cfg.checkpoint.save_dtype)
        )
        tensors = {t.name: (t.param, t.layout) for t in self.norm_targets()}
        save_hf_folder(folder, tensors, self.layout.view_mesh, dtype)
        if is_rank0() and self.config is not None:
            self.config.dtype = dtype
            copy_hf_extras(cfg.model.model_path, cfg.model.tokenizer_dir, folder, self.config)
        dist.barrier()
        say(f"saved the model as a Hugging Face directory: {folder} ({dtype}; from_pretrained loads it)")


class TorchStepper:
    """The torchrun target's optimizer step and checkpoints: a torch optimizer and ``torch.optim.lr_scheduler``
    over this rank's parameters, DDP over ``dp`` (FSDP2 and pipelines reduce their own gradients), clipping by
    the global norm (:mod:`slapo_lab.train.optim`), ``torch.distributed.checkpoint`` (:class:`Checkpointer`)."""

    def __init__(self, run: Run) -> None:

        cfg, lay = run.cfg, run.layout
        self.run = run
        self.optimizer = run.new_optimizer()
        self.scheduler = make_scheduler(
            self.optimizer, cfg.lr_schedule.lr_schedule, cfg.lr_schedule.warmup_steps, run.steps
        )
        run.model = run.module
        if run.pm is None and not lay.fsdp and lay.dp > 1:
            run.ddp = run.model = wrap_ddp(run.module, lay, run.device, find_unused=run.unused_params)
        for m in run.module.modules():
            m.train()
        self.norm_targets = run.norm_targets()
        self.ckpt = None
        if cfg.checkpoint.checkpoint_dir:
            info = {id(t.param): (t.name, t.layout) for t in run.targets}
            self.ckpt = Checkpointer(
                cfg.checkpoint.checkpoint_dir,
                [(run.module, info)],
                self.optimizer,
                self.scheduler,
                lay.view_mesh,
                run.layout_key,
                keep=cfg.checkpoint.keep_checkpoints,
                run_info=run.run_info(),
            )

    def resume(self) -> int:
        """Load the newest complete checkpoint (any layout); returns the step to start from."""
        run = self.run
        if self.ckpt is None or run.cfg.checkpoint.no_resume:
            return 0
        latest = latest_checkpoint(run.cfg.checkpoint.checkpoint_dir)
        if latest is None:
            return 0
        state = self.ckpt.load(latest[1], run.train_state(0))
        start = int(state.get("step", latest[0]))
        run.resumed(latest[1], state, start)
        self.scheduler = self.ckpt.scheduler = run.stretch_schedule(
            self.optimizer, self.scheduler, state, start
        )
        return start

    def step(self, step: int) -> tuple[float, float, float]:
        """Forward, backward, clip, optimizer and scheduler step; returns (loss, grad norm, lr used)."""
        loss = self.run._forward_backward(step)
        norm = self.run._clip(self.norm_targets)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, norm, lr

    def save(self, step: int, state: dict) -> Path:
        return self.ckpt.save(step, state)
