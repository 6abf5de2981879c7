"""The training run of an exported script: :func:`main`.

One run, whatever the target:

1. join the process group the launcher describes (torchrun or the deepspeed launcher; ``python
   script.py`` runs one process on a group of its own) and lay the ranks out as ``dp x pp x tp``;
2. read the data (:mod:`slapo_lab.train.data`) and build the model on the meta device, apply the
   schedule on this rank's tensor-parallel group, split the pipeline stages, put FSDP2 over ``dp``,
   and materialise only this rank's tensors (:mod:`slapo_lab.train.weights`);
3. with ``--verify`` (the default), prove the scheduled model against the unscheduled one
   (:mod:`slapo_lab.train.verify`) and stop with status 1 if it differs;
4. resume from the newest complete checkpoint of ``--checkpoint-dir`` (any layout), then train
   ``--steps`` optimizer steps of ``--global-batch-size`` sequences: micro-batches with gradient
   accumulation (DDP / FSDP2 sync on the last), or the pipeline schedule; clip by the global norm,
   step the optimizer and the learning-rate schedule, log, evaluate and checkpoint;
5. save the last checkpoint and, with ``--save-hf``, a Hugging Face directory.

Exit status: 0 done, 1 Verify failed, 2 a launch or input problem (one sentence on stderr).
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ScheduleError
from ..parallel_dims import ParallelDims
from .config import ParallelOptions, TrainConfig
from .phases import say_phase


class RunError(ValueError):
    """A problem of the launch or of the user's input; ``str(err)`` is one sentence."""


# ---------------------------------------------------------------------------------------- process group
def _device_type(opts: ParallelOptions) -> str:
    """``--device``, else ``"cuda"`` when CUDA is available and ``"cpu"`` otherwise."""
    return opts.device or ("cuda" if torch.cuda.is_available() else "cpu")


def _device_of(opts: ParallelOptions) -> tuple[str, str | None]:
    """(device, error): cuda:<local rank % GPUs> or cpu."""
    want = _device_type(opts)
    if want == "cpu":
        return "cpu", None
    gpus = torch.cuda.device_count()
    if gpus == 0:
        return "", "error: CUDA is not available here; run with --device cpu."
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if ranks > gpus and _backend(opts) == "nccl":
        return "", (
            f"error: {ranks} processes on this node but {gpus} GPU(s), and NCCL needs one GPU per process; "
            "launch at most one process per GPU, or add --backend gloo to share GPUs (testing)."
        )
    return f"cuda:{local_rank % gpus}", None


def _backend(opts: ParallelOptions) -> str:
    """``--backend``; ``auto``: nccl on cuda, gloo on cpu (:func:`_device_type`)."""
    if opts.backend != "auto":
        return opts.backend
    return "nccl" if _device_type(opts) == "cuda" else "gloo"


def _init_process_group(opts: ParallelOptions, device: str) -> None:
    """Join the launcher's group (env://), or make a group of one process without a launcher."""
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        dist.init_process_group(_backend(opts), store=dist.HashStore(), rank=0, world_size=1)
        return
    if _backend(opts) == "nccl":
        dist.init_process_group("nccl", device_id=torch.device(device))
    else:
        dist.init_process_group("gloo")


def _rank0() -> bool:
    return dist.get_rank() == 0


def _say(*lines: str) -> None:
    if _rank0():
        for line in lines:
            print(line, flush=True)


# ---------------------------------------------------------------------------------------- losses
def first_tensor(outputs) -> torch.Tensor:
    """The first floating-point tensor of a model output (tensor, tuple or HF ModelOutput)."""
    from ..verify import flatten_outputs

    items = [t for name, t in flatten_outputs(outputs) if name != "loss"]
    if not items:
        raise RunError("The model returned no floating-point tensor to train on.")
    return items[0]


_PROBES: dict = {}


def probe_loss(hidden: torch.Tensor, seed: int) -> torch.Tensor:
    """The synthetic objective of benchmark runs without labels: the mean squared projection of
    ``hidden`` (..., d) onto a fixed random unit vector of size d (seeded; the same on every rank)."""
    key = (hidden.shape[-1], str(hidden.device), seed)
    if key not in _PROBES:
        probe = torch.randn(hidden.shape[-1], generator=torch.Generator().manual_seed(seed))
        _PROBES[key] = (probe / probe.norm()).to(hidden.device)
    return (hidden.float() @ _PROBES[key]).square().mean()


def no_cache_kwargs(model: nn.Module) -> dict:
    """``{"use_cache": False}`` for a model whose ``forward`` takes ``use_cache`` (Hugging Face decoders and
    encoder-decoders), else ``{}``.

    A training or evaluation forward never reads a key/value cache, but a Hugging Face model builds one when
    ``use_cache`` is left to its config (``DynamicCache`` in ``LlamaModel.forward``): it holds every layer's keys
    and values until the step ends, and under ``--compile`` each block's guard on its own cache entry recompiles
    the block, until dynamo's recompile limit stops the run (seen on an H200 with a 22-layer Llama).
    """
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"use_cache": False} if "use_cache" in params else {}


def model_loss(outputs, seed: int) -> torch.Tensor:
    """The model's own loss (labels were given), else :func:`probe_loss` of its first output."""
    loss = getattr(outputs, "loss", None)
    if loss is None and isinstance(outputs, dict):
        loss = outputs.get("loss")
    return loss if loss is not None else probe_loss(first_tensor(outputs), seed)


def token_losses(logits: torch.Tensor, labels: torch.Tensor, objective: str | None) -> torch.Tensor:
    """The cross entropy of every labelled token, float32 ``(tokens,)``; ``-100`` labels count nothing.

    ``logits`` ``(batch, seq, vocab)``, ``labels`` ``(batch, seq)``; causal LM: token ``t``'s logits predict
    label ``t + 1`` (transformers' ``ForCausalLMLoss`` shift), masked LM: label ``t`` itself.
    """
    if objective == "causal_lm":
        logits, labels = logits[:, :-1], labels[:, 1:]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100, reduction="none"
    )


def labelled_tokens(labels: torch.Tensor, objective: str | None) -> int:
    """The number of tokens :func:`token_losses` counts in ``labels`` ``(batch, seq)`` (-100: none)."""
    if objective == "causal_lm":
        labels = labels[:, 1:]
    return int((labels != -100).sum())


class PipelineLoss:
    """``loss_fn(output, target)`` of the last pipeline stage: next-token cross entropy (causal LM, as
    transformers' ``ForCausalLMLoss``), token cross entropy ignoring -100 (masked LM), or the probe.

    It averages over the micro-batch's labelled tokens; inside :meth:`summed` (evaluation) it returns their
    float64 sum instead (a micro-batch of padding rows adds 0), so that a loss over several micro-batches
    is the sum over all their tokens divided by the count, however they were cut.
    """

    def __init__(self, objective: str | None, seed: int) -> None:
        self.objective = objective
        self.seed = seed
        self.sum = False

    def __call__(self, output, target):
        if self.objective not in ("causal_lm", "masked_lm"):
            return probe_loss(output, self.seed)
        if self.sum:
            return token_losses(output, target, self.objective).double().sum()
        if self.objective == "causal_lm":
            output, target = output[:, :-1], target[:, 1:]
        return torch.nn.functional.cross_entropy(
            output.reshape(-1, output.shape[-1]).float(), target.reshape(-1), ignore_index=-100
        )

    @contextlib.contextmanager
    def summed(self):
        """Within the block, the loss is the float64 sum over labelled tokens."""
        self.sum = True
        try:
            yield self
        finally:
            self.sum = False


def pipeline_loss_fn(objective: str | None, seed: int) -> PipelineLoss:
    """The last pipeline stage's :class:`PipelineLoss` for ``objective`` (``"causal_lm"``, ``"masked_lm"``,
    or None: the probe loss of ``seed``)."""
    return PipelineLoss(objective, seed)


def _to(batch: dict, device: str) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _cat(batches: list[dict]) -> dict:
    out = {}
    for k, v in batches[0].items():
        out[k] = torch.cat([b[k] for b in batches]) if isinstance(v, torch.Tensor) and v.dim() else v
    return out


def _split_target(batch: dict, n: int, device: str) -> tuple[dict, torch.Tensor]:
    batch = dict(batch)
    target = batch.pop("labels", None)
    if target is None:
        rows = next(v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim())
        target = torch.zeros(rows, device=device)
    return batch, target


# ---------------------------------------------------------------------------------------- the run
class Run:
    """One launched training run (see the module docstring); :func:`main` builds and drives it.

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

    # ------------------------------------------------------------------ layout, data
    def setup(self) -> None:
        """Lay out the ranks, read the data, build and materialise this rank's part of the model."""
        from ..random import set_random_seed
        from . import metrics
        from .parallel import LayoutError, make_layout

        cfg = self.cfg
        metrics.mark_memory_baseline()
        hint = "deepspeed --num_gpus " if self.launcher == "deepspeed" else "torchrun --nproc_per_node="
        try:
            self.layout = make_layout(
                self.tp_size,
                self.stages,
                dist.get_world_size(),
                dp=cfg.parallel.dp,
                stages_per_rank=cfg.parallel.stages_per_rank,
                fsdp=cfg.parallel.fsdp,
                device=torch.device(self.device).type,
                launch_hint=hint,
            )
        except (LayoutError, ScheduleError) as err:
            raise RunError(str(err)) from None
        lay = self.layout
        if cfg.parallel.fsdp and lay.dp == 1:
            _say("note: --fsdp with one data-parallel replica shards nothing; training without FSDP2.")
        set_random_seed(cfg.data.seed, dp_rank=lay.dp_rank, pp_rank=lay.pp_rank, tp_rank=lay.tp_rank)
        reads_files = cfg.data.data != "synthetic" or cfg.eval.eval_data is not None
        if reads_files and not (
            _rank0()
            and cfg.metrics.progress != "off"
            and (cfg.metrics.progress == "on" or sys.stderr.isatty())
        ):
            import datasets  # only a run that reads text files needs Hugging Face datasets

            datasets.disable_progress_bars()  # one set of bars, on rank 0 at a terminal
        self._setup_data()
        self._setup_model()

    def _setup_data(self) -> None:
        from .data import BatchPlan, load_data, objective_of

        cfg, lay = self.cfg, self.layout
        cls = self.spec.get("class", "") if self.spec.get("kind") == "hf" else ""
        self.objective = objective_of(cls)
        if cfg.data.data != "synthetic":
            if self.objective is None:
                raise RunError(
                    f"{cls or 'This model'} has no language-model head, so it has no loss to train on "
                    "text; export a *ForCausalLM or *ForMaskedLM model (or use --data synthetic)."
                )
            if cfg.model.tokenizer_dir is None:
                raise RunError(
                    "--data needs a tokenizer: pass --tokenizer DIR (or a --model-path with tokenizer files)."
                )
        if cfg.eval.eval_data and cfg.model.tokenizer_dir is None:
            raise RunError(
                "--eval-data needs a tokenizer: pass --tokenizer DIR (or a --model-path with tokenizer "
                "files)."
            )
        objective = self.objective or "causal_lm"
        try:
            self.data = load_data(
                cfg.data.data,
                tokenizer_dir=cfg.model.tokenizer_dir,
                seq_len=cfg.data.seq_len,
                objective=objective,
                seed=cfg.data.seed,
                input_spec=self.input_spec,
                main_first=self._main_first(),
                lm_labels=self.objective is not None,
            )
            self.eval_data = None
            if cfg.eval.eval_data:
                self.eval_data = load_data(
                    cfg.eval.eval_data,
                    tokenizer_dir=cfg.model.tokenizer_dir,
                    seq_len=cfg.data.seq_len,
                    objective=objective,
                    seed=cfg.data.seed,
                    main_first=self._main_first(),
                    lm_labels=True,
                )
            g = cfg.batch.global_batch_size
            self.micro = lay.dims.micro_batches(
                g, cfg.batch.micro_batch_size, self.stages if self.pipeline else 1
            )[0]
            self.plan = BatchPlan(
                self.data.num_samples,
                g,
                self.micro,
                lay.dp,
                lay.dp_rank,
                cfg.data.seed,
                source=getattr(self.data, "source", None),
            )
        except ValueError as err:
            raise RunError(str(err)) from None
        if cfg.batch.epochs is not None:
            if self.plan.steps_per_epoch is None:
                raise RunError("--epochs needs --data (synthetic data has no epochs); use --steps.")
            self.steps = max(1, math.ceil(cfg.batch.epochs * self.plan.steps_per_epoch))
        self.seq_len = cfg.data.seq_len

    @contextlib.contextmanager
    def _main_first(self):
        """Rank 0 runs the block first (tokenises into the datasets cache); the others then read it."""
        if not _rank0():
            dist.barrier()
        try:
            yield
        finally:
            if _rank0():
                dist.barrier()

    # ------------------------------------------------------------------ model
    def _setup_model(self) -> None:
        from ..blocks import find_blocks
        from ..schedule import create_schedule
        from .parallel import apply_fsdp
        from .weights import Target, WeightsError, build_meta_model, canonical_names

        cfg, lay = self.cfg, self.layout
        try:
            model = build_meta_model(self.spec, cfg.model.model_path)
        except WeightsError as err:
            raise RunError(str(err)) from None
        self.config = getattr(model, "config", None)
        self.forward_extras = no_cache_kwargs(model)
        self.n_params = sum(p.numel() for p in model.parameters())
        canon = canonical_names(model)
        self.canon_of_fqn = {name: canon[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}
        sch = create_schedule(model, group=lay.mesh.tp_group)
        try:
            self.schedule_fn(sch)
        except ScheduleError as err:
            raise RunError(f"The schedule does not apply to this model: {err}") from None
        self.sch = sch
        self.block_paths = find_blocks(sch)
        if cfg.precision.compile:
            for path in self.block_paths:
                sch[path].mod.compile(fullgraph=True, backend=cfg.precision.compile_backend)
        blocks = [sch[p].mod for p in self.block_paths]
        self.targets: list[Target] = []
        if self.pipeline:
            self._setup_pipeline(sch, blocks)
            return
        module = sch.mod
        targets = self._targets_of(module.named_parameters(remove_duplicate=False))
        if lay.fsdp:
            targets = apply_fsdp(module, blocks, targets, lay)
        self._materialise(module, targets, lay.fsdp)
        self.targets = targets
        self.module = module

    def _targets_of(self, named) -> list:
        """Targets (canonical name, parameter, tensor-parallel layout) of ``(fqn, parameter)`` pairs, each
        parameter once."""
        from ..sharding.placements import layout_of
        from .weights import Target

        out, seen = [], set()
        for fqn, p in named:
            if id(p) in seen:
                continue
            seen.add(id(p))
            out.append(
                Target(self.canon_of_fqn.get(fqn, fqn), p, layout_of(p, self.layout.tp, self.layout.tp_rank))
            )
        return out

    def _setup_pipeline(self, sch, blocks) -> None:
        from ..pipeline import build_pipeline
        from .parallel import apply_fsdp
        from .weights import allocate

        cfg, lay = self.cfg, self.layout
        # torch.export traces the model with fake tensors on the run's device (no memory): device-dependent code
        # takes this device's branch, and constants made during the trace keep their values
        fake = _fake_parameters(sch.mod, self.device)
        example, _ = _split_target(self._replica_batch(0), 1, "meta")
        with fake:
            example = {
                k: torch.empty_like(v, device=self.device) if isinstance(v, torch.Tensor) else v
                for k, v in example.items()
            }

        def prepare(partition, stage_ids):
            for i in stage_ids:
                stage = partition.stages[i]
                targets = self._targets_of(stage.params.items())
                if lay.fsdp:  # FSDP2 shards meta parameters (to_empty cannot make fake ones real)
                    allocate(targets, "meta", stage.module, [stage.params])
                    inside = [m for m in stage.module.modules() if any(m is b for b in blocks)]
                    targets = apply_fsdp(stage.module, inside, targets, lay)
                self._materialise(stage.module, targets, lay.fsdp, tables=[stage.params])
                self.targets.extend(targets)

        # DeepSpeed's engine comes after Verify (its train_batch steps the optimizer): the torch runtime first
        self.pipeline_loss = pipeline_loss_fn(self.objective, cfg.data.seed)
        try:
            self.pm = build_pipeline(
                sch,
                "torch",
                example_inputs=example,
                loss_fn=self.pipeline_loss,
                schedule=cfg.parallel.pp_schedule,
                n_microbatches=self.plan.accumulation,
                pp_group=lay.mesh.pp_group,
                dp_group=None if lay.fsdp or lay.dp == 1 else lay.mesh.dp_group,
                stages_per_rank=lay.stages_per_rank,
                device=self.device,
                prepare_stages=prepare,
                autocast_bf16=cfg.precision.bf16 and self.launcher != "deepspeed",
                deepspeed_later=self.launcher == "deepspeed",
            )
        except ScheduleError as err:
            raise RunError(f"The pipeline could not be built: {err}") from None
        self.module = nn.ModuleList([self.pm.partition.stage_module(i) for i in self.pm.stage_ids])

    def _materialise(self, module: nn.Module, targets: list, fsdp: bool, tables=()) -> None:
        """Storage for ``targets`` (FSDP2: ``to_empty``, keeping the real buffers), then values from
        ``--model-path`` or the seeded initialisation."""
        from .weights import allocate, init_random, load_hf

        if fsdp:
            buffers = dict(module.named_buffers())
            allocate(
                [t for t in targets if getattr(t.param, "_local_tensor", None) is None],
                self.device,
                module,
                tables,
            )
            module.to_empty(device=self.device)
            with torch.no_grad():
                for name, b in module.named_buffers():
                    src = buffers.get(name)
                    if src is not None and src is not b and not src.is_meta:
                        b.copy_(src)
            for t in targets:  # FSDP2 made new parameter objects: init reads the global shape from here
                t.param.orig_shape = torch.Size(t.layout.shape)
        else:
            allocate(targets, self.device, module, tables)
            module.to(self.device)
        if self.cfg.model.model_path:
            load_hf(self.cfg.model.model_path, targets, self.layout.view_mesh)
        else:
            init_random(self.sch, targets, self.cfg.data.seed)

    # ------------------------------------------------------------------ batches
    def _replica_batch(self, step: int) -> dict:
        """This replica's batch of ``step`` (0-based), its micro-batches concatenated."""
        return _cat(self.plan.micro_batches(self.data, step))

    # ------------------------------------------------------------------ verify
    def verify(self) -> bool:
        """Run Verify (see :mod:`slapo_lab.train.verify`); prints the report on rank 0; True if it passed."""
        from .verify import Reference, release, run_verify
        from .weights import build_meta_model, init_random, load_hf

        say_phase("reference")
        cfg = self.cfg
        batch = self._verify_batch()
        rows = next(v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim())
        seq = next((v.shape[1] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() > 1), None)

        def fill(ref_sch, targets, mesh):
            if cfg.model.model_path:
                load_hf(cfg.model.model_path, targets, mesh)
            else:
                init_random(ref_sch, targets, cfg.data.seed)

        ref = Reference(lambda: build_meta_model(self.spec, cfg.model.model_path), fill, self.device)
        note = (
            f"one forward and backward of {rows} sequence(s)"
            + (f" of {seq} tokens" if seq else "")
            + f" ({'synthetic inputs' if cfg.data.data == 'synthetic' else 'from --data'}, fp32, dropout off) against "
            f"the unscheduled model sharded by FSDP2 over all {dist.get_world_size()} rank(s); layout "
            f"{self.layout.describe()}"
        )
        dropouts = _dropout_off([self.module, ref.model])
        if self.pm is not None:  # dropout traced into the stage graphs
            self.pm.set_dropout(False)
        autocast = [m for m in self.module.modules() if getattr(m, "autocast_bf16", False)]
        for m in autocast:  # Verify compares in float32
            m.autocast_bf16 = False
        try:
            report = run_verify(
                ref,
                self.targets,
                lambda: self._verify_scheduled(batch),
                lambda m: self._verify_reference(m, batch),
                device=self.device,
                note=note,
            )
        finally:
            _dropout_restore(dropouts)
            if self.pm is not None:
                self.pm.set_dropout(True)
            for m in autocast:
                m.autocast_bf16 = True
            release(ref, self.device)
            for t in self.targets:
                t.param.grad = None
        from .metrics import peak_memory_mib, reset_peak_memory

        report.note += f"; Verify's peak memory {peak_memory_mib(self.device):.0f} MiB on rank 0"
        _say(report.summary())
        reset_peak_memory(self.device)  # the step lines' peak is training's own
        return report.passed

    def _verify_batch(self) -> dict:
        cfg = self.cfg
        if self.pipeline:  # its shapes are fixed: one step's batch, replica 0's on every replica
            from .data import BatchPlan

            first = BatchPlan(
                self.data.num_samples,
                cfg.batch.global_batch_size,
                self.micro,
                self.layout.dp,
                0,
                cfg.data.seed,
            )
            return _to(_cat(first.micro_batches(self.data, 0)), self.device)
        rows = cfg.verify.verify_batch_size or 2
        batch = self.data.batch(list(range(rows)), 0)
        length = cfg.verify.verify_seq_len or (min(self.seq_len, 64) if self.seq_len else None)
        if length is not None and self.seq_len:
            batch = {
                k: v[:, :length]
                if isinstance(v, torch.Tensor) and v.dim() > 1 and v.shape[1] == self.seq_len
                else v
                for k, v in batch.items()
            }
        return _to(batch, self.device)

    def _kwargs(self, batch: dict) -> dict:
        """The keyword arguments of a forward on ``batch``: :attr:`forward_extras` (``use_cache=False``), then the
        batch itself, whose own values win (an example input may already say ``use_cache``)."""
        return {**self.forward_extras, **batch}

    def _verify_scheduled(self, batch: dict) -> tuple[float, Any]:
        if self.pipeline:
            inputs, target = _split_target(batch, 1, self.device)
            loss = self.pm.train_step(**inputs, target=target)
            self.layout.average_ignored_grads()
            return float(loss), None
        self.module.eval()
        out = self.module(**self._kwargs(batch))
        loss = model_loss(out, self.cfg.data.seed)
        loss.backward()
        self.layout.average_ignored_grads()
        self.unused_params = any(t.param.requires_grad and t.param.grad is None for t in self.targets)
        return float(loss.detach()), out

    def _verify_reference(self, model: nn.Module, batch: dict) -> tuple[float, Any]:
        model.eval()
        if not self.pipeline:
            out = model(**self._kwargs(batch))
            loss = model_loss(out, self.cfg.data.seed)
            loss.backward()
            return float(loss.detach()), out
        n = self.plan.accumulation  # the pipeline's micro-batches: the same means, summed the same way
        loss_fn = pipeline_loss_fn(self.objective, self.cfg.data.seed)
        inputs, target = _split_target(batch, n, self.device)
        total = 0.0
        for i in range(n):
            chunk = {
                k: v.chunk(n)[i] if isinstance(v, torch.Tensor) and v.dim() else v for k, v in inputs.items()
            }
            loss = loss_fn(first_tensor(model(**self._kwargs(chunk))), target.chunk(n)[i]) / n
            loss.backward()
            total += float(loss.detach())
        return total, None

    # ------------------------------------------------------------------ train
    def _norm_targets(self) -> list:
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

    def _optimizer(self):
        from .optim import make_optimizer

        dtensors = [t.param for t in self.targets if getattr(t.param, "_local_tensor", None) is not None]
        plain = [t.param for t in self.targets if getattr(t.param, "_local_tensor", None) is None]
        opt = make_optimizer(self.cfg.optimizer, dtensors or plain)
        if dtensors and plain:  # foreach kernels take one kind per group
            opt.add_param_group({"params": plain})
        return opt

    def _dp_mean(self, value: torch.Tensor) -> float:
        if self.layout.dp > 1:
            value = value.detach().double().clone()
            dist.all_reduce(value, group=self.layout.mesh.dp_group)
            value /= self.layout.dp
        return float(value)

    def _autocast(self):
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
            inputs, target = _split_target(_to(self._replica_batch(step), self.device), 1, self.device)
            loss = torch.tensor(self.pm.train_step(**inputs, target=target), dtype=torch.float64)
            lay.average_ignored_grads()
            return self._dp_mean(loss.to(self._reduce_device))
        micro_batches = self.plan.micro_batches(self.data, step)
        n = len(micro_batches)
        total = torch.zeros((), device=self.device)
        for i, mb in enumerate(micro_batches):
            last = i == n - 1
            sync = contextlib.nullcontext() if last or self.ddp is None else self.ddp.no_sync()
            if lay.fsdp:
                self.module.set_requires_gradient_sync(last)
            with sync:
                with self._autocast():
                    out = self.model(**self._kwargs(_to(mb, self.device)))
                    loss = model_loss(out, self.cfg.data.seed) / n
                loss.backward()
            total += loss.detach().float()
        lay.average_ignored_grads()
        return self._dp_mean(total)

    @property
    def _reduce_device(self) -> str:
        return self.device if dist.get_backend() == "nccl" else "cpu"

    def grad_norm(self, norm_targets: list) -> torch.Tensor:
        """The global gradient norm over ``norm_targets`` (each parameter once): their gradients as DTensor
        views on the ``(dp, tp)`` mesh, summed over the pipeline stages (:mod:`slapo_lab.train.optim`)."""
        from .optim import global_grad_norm

        views = []
        for t in norm_targets:
            g = t.param.grad
            if g is not None:
                views.append(t.layout.norm_view(getattr(g, "_local_tensor", g), self.layout.view_mesh))
        return global_grad_norm(views, self.layout.mesh.pp_group if self.layout.pp > 1 else None)

    def _clip(self, norm_targets: list) -> float:
        from .optim import clip_

        norm = self.grad_norm(norm_targets)
        grads = [
            getattr(t.param.grad, "_local_tensor", t.param.grad)
            for t in self.targets
            if t.param.grad is not None
        ]
        clip_(grads, self.cfg.optimizer.max_grad_norm, norm)
        return float(norm)

    def evaluate(self) -> tuple[float, int]:
        """The validation loss over the first ``--eval-samples`` sequences of ``--eval-data`` (all by default):
        the sum of every labelled token's cross entropy divided by the number of those tokens, summed over the
        data-parallel replicas (each evaluates its part) and taken from the last pipeline stage, the same on
        every rank; and the number of sequences evaluated.

        The sequences are the same at every layout: :func:`~slapo_lab.train.data.eval_micro_batches` pads the
        last micro-batch (and a pipeline's last group) with rows whose labels count nothing, so the loss at
        equal weights does not depend on the micro-batch size, ``dp``, ``tp`` or ``pp``. Replicas may get one
        group of micro-batches fewer; under FSDP2 every forward all-gathers over the replicas, so each runs as
        many forwards as replica 0 (which has the most), the extra ones uncounted.
        """
        from .data import eval_micro_batches, eval_sample_count

        lay = self.layout
        objective = self.objective or "causal_lm"
        group = self.plan.accumulation if self.pm is not None else 1
        micro = list(
            eval_micro_batches(
                self.eval_data, self.micro, lay.dp, lay.dp_rank, self.cfg.eval.eval_samples, group=group
            )
        )
        most = len(
            eval_micro_batches(self.eval_data, self.micro, lay.dp, 0, self.cfg.eval.eval_samples, group=group)
        )
        batches = [(mb, True) for mb in micro]
        if lay.fsdp:
            batches += [(batches[0][0] if batches else self._eval_filler(group), False)] * (most - len(micro))
        total = torch.zeros((), dtype=torch.float64)
        tokens = torch.zeros((), dtype=torch.float64)
        with torch.no_grad():
            if self.pm is not None:
                for k in range(0, len(batches), group):
                    batch = _to(_cat([b for b, _ in batches[k : k + group]]), self.device)
                    inputs, target = _split_target(batch, 1, self.device)
                    with self.pipeline_loss.summed():  # the mean over micro-batches of their token sums
                        loss = self.pm.eval_step(**inputs, target=target)
                    if batches[k][1]:
                        total += loss * group
                        tokens += labelled_tokens(target, objective)
            else:
                self.module.eval()
                for mb, counted in batches:
                    inputs, labels = _split_target(_to(mb, self.device), 1, self.device)
                    with self._autocast():
                        logits = first_tensor(self.model(**self._kwargs(inputs)))
                    if counted:
                        total += token_losses(logits, labels, objective).double().sum().cpu()
                        tokens += labelled_tokens(labels, objective)
                self.module.train()
        if (
            lay.fsdp
        ):  # a forward without backward leaves FSDP2's root unsharded (then the optimizer's parameters
            from torch.distributed.fsdp import (
                FSDPModule,  # are not the module's, and a checkpoint cannot map them)
            )

            for m in self.module.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()
        if lay.dp > 1:
            both = torch.stack([total, tokens]).to(self._reduce_device)
            dist.all_reduce(both, group=lay.mesh.dp_group)
            total, tokens = both[0].cpu(), both[1].cpu()
        rows = eval_sample_count(self.eval_data, self.cfg.eval.eval_samples)
        return (float(total / tokens) if float(tokens) else float("nan")), rows

    def _eval_filler(self, group: int) -> dict:
        """A batch of the evaluation shapes for a replica that has none left (its forwards are not counted)."""
        from .data import eval_micro_batches

        return next(
            iter(
                eval_micro_batches(
                    self.eval_data, self.micro, self.layout.dp, 0, self.cfg.eval.eval_samples, group=group
                )
            )
        )

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
        from .metrics import MetricsLogger

        cfg, lay = self.cfg, self.layout
        if self.launcher == "deepspeed":
            from .deepspeed import DeepSpeedStepper

            stepper = DeepSpeedStepper(self)
        else:
            stepper = TorchStepper(self)
        start = stepper.resume()
        say_phase("train")
        tokens_per_step = cfg.batch.global_batch_size * (self.seq_len or 1)
        _say(
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
        logger = MetricsLogger(
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
                    _say(f"checkpoint step {done} saved: {stepper.save(done, self._train_state(done))}")
                    saved_at = done
            if self.eval_data is not None:
                self._log_eval(logger, self.steps)
        if cfg.checkpoint.checkpoint_dir and saved_at != self.steps:
            _say(
                f"checkpoint step {self.steps} saved: {stepper.save(self.steps, self._train_state(self.steps))}"
            )
        if cfg.checkpoint.save_hf:
            self.save_hf(cfg.checkpoint.save_hf)
        return 0

    def stretch_schedule(self, optimizer, scheduler, state: dict, start: int):
        """The learning-rate schedule to resume with: the checkpoint's, or -- when the run now trains for another
        number of ``--steps`` than the one that saved it (its schedule ends there) -- a new one over the new
        total, advanced to ``start`` (and said so)."""
        from .optim import make_scheduler

        saved = int(state.get("total_steps") or self.steps)
        if saved == self.steps:
            return scheduler
        import warnings

        fresh = make_scheduler(
            optimizer, self.cfg.lr_schedule.lr_schedule, self.cfg.lr_schedule.warmup_steps, self.steps
        )
        with warnings.catch_warnings():  # stepping the schedule without optimizer steps is the point here
            warnings.simplefilter("ignore")
            for _ in range(start):
                fresh.step()
        _say(
            f"note: the checkpoint's learning-rate schedule ended at step {saved}; it now runs over --steps "
            f"{self.steps} (lr {optimizer.param_groups[0]['lr']:.2e} at step {start + 1})."
        )
        return fresh

    def resumed(self, path, state: dict, start: int) -> None:
        """Reseed when the checkpoint's layout differs (its RNG states are per rank), and say so; say when the
        checkpoint was saved by another schedule (its recorded calls in ``run.json``)."""
        from ..random import set_random_seed
        from ..record import format_call
        from .preflight import read_run_info

        lay = self.layout
        same = state.get("layout") == self.layout_key
        if not same:
            set_random_seed(
                self.cfg.data.seed + start, dp_rank=lay.dp_rank, pp_rank=lay.pp_rank, tp_rank=lay.tp_rank
            )
        _say(
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
            _say(
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
        from ..record import format_call
        from .weights import source_dtype

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

    def _train_state(self, step: int) -> dict:
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
        from .checkpoint import save_hf
        from .weights import copy_hf_extras, source_dtype

        cfg = self.cfg
        dtype = (
            source_dtype(cfg.model.model_path)
            if cfg.checkpoint.save_dtype == "auto"
            else getattr(torch, cfg.checkpoint.save_dtype)
        )
        tensors = {t.name: (t.param, t.layout) for t in self._norm_targets()}
        save_hf(folder, tensors, self.layout.view_mesh, dtype)
        if _rank0() and self.config is not None:
            self.config.dtype = dtype
            copy_hf_extras(cfg.model.model_path, cfg.model.tokenizer_dir, folder, self.config)
        dist.barrier()
        _say(f"saved the model as a Hugging Face directory: {folder} ({dtype}; from_pretrained loads it)")


class TorchStepper:
    """The torchrun target's optimizer step and checkpoints: a torch optimizer and ``torch.optim.lr_scheduler``
    over this rank's parameters, DDP over ``dp`` (FSDP2 and pipelines reduce their own gradients), clipping by
    the global norm (:mod:`slapo_lab.train.optim`), ``torch.distributed.checkpoint`` (:class:`Checkpointer`)."""

    def __init__(self, run: Run) -> None:
        from .checkpoint import Checkpointer
        from .optim import make_scheduler
        from .parallel import wrap_ddp

        cfg, lay = run.cfg, run.layout
        self.run = run
        self.optimizer = run._optimizer()
        self.scheduler = make_scheduler(
            self.optimizer, cfg.lr_schedule.lr_schedule, cfg.lr_schedule.warmup_steps, run.steps
        )
        run.model = run.module
        if run.pm is None and not lay.fsdp and lay.dp > 1:
            run.ddp = run.model = wrap_ddp(run.module, lay, run.device, find_unused=run.unused_params)
        for m in run.module.modules():
            m.train()
        self.norm_targets = run._norm_targets()
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
        from .checkpoint import latest_checkpoint

        run = self.run
        if self.ckpt is None or run.cfg.checkpoint.no_resume:
            return 0
        latest = latest_checkpoint(run.cfg.checkpoint.checkpoint_dir)
        if latest is None:
            return 0
        state = self.ckpt.load(latest[1], run._train_state(0))
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

    def save(self, step: int, state: dict):
        return self.ckpt.save(step, state)


# ---------------------------------------------------------------------------------------- entry point
def main(
    *,
    model: dict,
    schedule: Callable,
    inputs: dict,
    tp: int,
    stages: int = 1,
    launcher: str = "torchrun",
    config: TrainConfig | None = None,
    defaults: dict | None = None,
    argv: list[str] | None = None,
    title: str | None = None,
    checked=None,
) -> int:
    """Train the model of an exported script; the one call an exported script makes.

    Args:
        model: the model spec (:func:`slapo_lab.export.model_spec`: a transformers class and config, or a
            factory).
        schedule: ``schedule(sch)``, the recorded calls.
        inputs: the example inputs' spec (:func:`slapo_lab.export.input_spec`): the synthetic data's shapes.
        tp: the tensor-parallel width the schedule was recorded for.
        stages: pipeline stages (cuts + 1).
        launcher: ``"torchrun"`` or ``"deepspeed"``.
        config: the options chosen at export (:class:`~slapo_lab.train.config.TrainConfig`, a script's ``CONFIG``):
            the command line's defaults.
        defaults: the same as a dict of options (``DEFAULTS`` of scripts exported before ``TrainConfig``, still
            accepted: the compatibility path).
        argv: the command line (default: ``sys.argv[1:]``).
        title: the first line of ``--help``.
        checked: what :func:`slapo_lab.train.preflight.preflight` returned for these arguments (None: run it
            here; :func:`slapo_lab.train.main` runs it before importing torch).

    Returns:
        The exit status: 0 done, 1 Verify failed, 2 a problem of the launch or the input (one sentence on
        stderr).
    """
    from ..spec import ExportError, validate_input_spec, validate_model_spec
    from .lifeline import arm
    from .parallel import LayoutError
    from .preflight import preflight

    arm()  # armed on import of slapo_lab already; again here for a runtime imported another way

    spec = validate_model_spec(model)
    input_spec = validate_input_spec(inputs)
    if checked is None:
        checked = preflight(
            model=spec,
            inputs=input_spec,
            tp=tp,
            stages=stages,
            launcher=launcher,
            config=config,
            defaults=defaults,
            argv=argv,
            title=title,
        )
        if isinstance(checked, int):
            return checked
    cfg = checked.config
    if cfg.launch.print_ds_config:
        import json

        from .deepspeed import ds_config

        world = int(os.environ.get("WORLD_SIZE", ParallelDims(tp, stages).world_size))
        dims = cfg.parallel.dims(tp, stages, world)
        micro, accumulation = dims.micro_batches(
            cfg.batch.global_batch_size, cfg.batch.micro_batch_size, stages
        )
        print(json.dumps(ds_config(cfg, micro, accumulation, dims.dp), indent=2))
        return 0
    device, error = _device_of(cfg.parallel)
    if not error and stages > 1 and device.startswith("cuda") and _backend(cfg.parallel) == "gloo":
        error = (
            "error: gloo cannot send CUDA tensors between pipeline stages; use --backend nccl with one GPU per "
            "process, or --device cpu."
        )
    if error:
        from .preflight import failed, speaks_errors

        if speaks_errors():  # once per node, not once per rank
            print(error, file=sys.stderr, flush=True)
        return failed(2)
    _init_process_group(cfg.parallel, device)
    say_phase("setup")
    run = None
    try:
        run = Run(
            cfg,
            spec=spec,
            schedule_fn=schedule,
            input_spec=input_spec,
            tp=tp,
            stages=stages,
            launcher=launcher,
            device=device,
        )
        run.record = checked.record
        run.setup()
        if cfg.verify.verify:
            passed = run.verify()
            if not passed:
                return 1
        return run.train()
    except (RunError, LayoutError, ExportError) as err:
        if dist.get_rank() == 0:
            print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    finally:
        # sync hooks hold the process group in reference cycles: collect them first, or the gloo group
        # outlives destroy_process_group and its worker threads abort the exit ("terminate called ...")
        del run
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


def _fake_parameters(model: nn.Module, device: str):
    """Replace ``model``'s meta parameters by fake tensors on ``device`` (``FakeTensorMode``: shapes, dtypes and
    the device, no storage), tied ones by one fake tensor, annotations kept; returns the fake mode."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    made: dict[int, nn.Parameter] = {}
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is None or not p.is_meta:
                continue
            new = made.get(id(p))
            if new is None:
                with mode:
                    data = torch.empty(p.shape, dtype=p.dtype, device=device)
                new = made[id(p)] = nn.Parameter(data, requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)
            mod._parameters[name] = new
    return mode


def _dropout_off(models: list[nn.Module]) -> list[tuple[nn.Module, float]]:
    """Set every dropout rate of ``models`` to 0; returns ``[(module, rate)]`` to put back."""
    saved = []
    for m in models:
        for mod in m.modules():
            if isinstance(mod, nn.modules.dropout._DropoutNd) and mod.p > 0:
                saved.append((mod, mod.p))
                mod.p = 0.0
    return saved


def _dropout_restore(saved: list[tuple[nn.Module, float]]) -> None:
    for mod, p in saved:
        mod.p = p
