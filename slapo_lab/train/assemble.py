"""Assemble a launched run on this rank: the layout of the ranks, the data, and this rank's part of the model.

:func:`setup` (what :meth:`slapo_lab.train.run.Run.setup` does) lays the ranks out as ``dp x pp x tp``
(:func:`slapo_lab.train.parallel.make_layout`), seeds every rank, reads the data (:mod:`slapo_lab.train.data`), builds
the model on the meta device, applies the schedule on this rank's tensor-parallel group, splits the pipeline stages
(:func:`slapo_lab.pipeline.build_pipeline`) or puts FSDP2 over ``dp``, and materialises only this rank's tensors
(:mod:`slapo_lab.train.weights`: seeded initialisation, or a Hugging Face directory). It sets the run's ``layout``,
``data``, ``eval_data``, ``plan``, ``micro``, ``sch``, ``targets``, ``module`` and ``pm``.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from ..blocks import find_blocks
from ..errors import ScheduleError
from ..pipeline import build_pipeline
from ..random import set_random_seed
from ..schedule import create_schedule
from ..sharding.placements import layout_of
from ..spec import objective_of
from . import metrics
from .data import BatchPlan, load_data
from .losses import no_cache_kwargs, pipeline_loss_fn, split_target
from .parallel import LayoutError, apply_fsdp, make_layout
from .process import RunError, is_rank0, say
from .weights import Target, WeightsError, allocate, build_meta_model, canonical_names, init_random, load_hf

if TYPE_CHECKING:
    from .run import Run


def setup(run: Run) -> None:
    """Lay out the ranks, read the data, build and materialise this rank's part of the model."""
    cfg = run.cfg
    metrics.mark_memory_baseline()
    hint = "deepspeed --num_gpus " if run.launcher == "deepspeed" else "torchrun --nproc_per_node="
    try:
        run.layout = make_layout(
            run.tp_size,
            run.stages,
            dist.get_world_size(),
            dp=cfg.parallel.dp,
            stages_per_rank=cfg.parallel.stages_per_rank,
            fsdp=cfg.parallel.fsdp,
            device=torch.device(run.device).type,
            launch_hint=hint,
        )
    except (LayoutError, ScheduleError) as err:
        raise RunError(str(err)) from None
    lay = run.layout
    if cfg.parallel.fsdp and lay.dp == 1:
        say("note: --fsdp with one data-parallel replica shards nothing; training without FSDP2.")
    set_random_seed(cfg.data.seed, dp_rank=lay.dp_rank, pp_rank=lay.pp_rank, tp_rank=lay.tp_rank)
    reads_files = cfg.data.data != "synthetic" or cfg.eval.eval_data is not None
    if reads_files and not (
        is_rank0() and cfg.metrics.progress != "off" and (cfg.metrics.progress == "on" or sys.stderr.isatty())
    ):
        import datasets  # noqa: PLC0415 - only a run that reads text files needs Hugging Face datasets

        datasets.disable_progress_bars()  # one set of bars, on rank 0 at a terminal
    setup_data(run)
    setup_model(run)


def setup_data(run: Run) -> None:
    """The training data, the validation data (or None), the batch plan and the micro-batch size; ``--epochs``
    turns into optimizer steps here.

    Raises:
        RunError: text data for a model without a language-model head, text without a tokenizer, or a data
            problem (one sentence).
    """
    cfg, lay = run.cfg, run.layout
    cls = run.spec.get("class", "") if run.spec.get("kind") == "hf" else ""
    run.objective = objective_of(cls)
    if cfg.data.data != "synthetic":
        if run.objective is None:
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
            "--eval-data needs a tokenizer: pass --tokenizer DIR (or a --model-path with tokenizer files)."
        )
    objective = run.objective or "causal_lm"
    try:
        run.data = load_data(
            cfg.data.data,
            tokenizer_dir=cfg.model.tokenizer_dir,
            seq_len=cfg.data.seq_len,
            objective=objective,
            seed=cfg.data.seed,
            input_spec=run.input_spec,
            main_first=main_first(),
            lm_labels=run.objective is not None,
        )
        run.eval_data = None
        if cfg.eval.eval_data:
            run.eval_data = load_data(
                cfg.eval.eval_data,
                tokenizer_dir=cfg.model.tokenizer_dir,
                seq_len=cfg.data.seq_len,
                objective=objective,
                seed=cfg.data.seed,
                main_first=main_first(),
                lm_labels=True,
            )
        g = cfg.batch.global_batch_size
        run.micro = lay.dims.micro_batches(g, cfg.batch.micro_batch_size, run.stages if run.pipeline else 1)[
            0
        ]
        run.plan = BatchPlan(
            run.data.num_samples,
            g,
            run.micro,
            lay.dp,
            lay.dp_rank,
            cfg.data.seed,
            source=getattr(run.data, "source", None),
        )
    except ValueError as err:
        raise RunError(str(err)) from None
    if cfg.batch.epochs is not None:
        if run.plan.steps_per_epoch is None:
            raise RunError("--epochs needs --data (synthetic data has no epochs); use --steps.")
        run.steps = max(1, math.ceil(cfg.batch.epochs * run.plan.steps_per_epoch))
    run.seq_len = cfg.data.seq_len


@contextlib.contextmanager
def main_first() -> Iterator[None]:
    """Rank 0 runs the block first (tokenises into the datasets cache); the others then read it."""
    if not is_rank0():
        dist.barrier()
    try:
        yield
    finally:
        if is_rank0():
            dist.barrier()


def setup_model(run: Run) -> None:
    """Build the model on the meta device, apply the schedule on this rank's tensor-parallel group, split the
    pipeline stages or put FSDP2 over ``dp``, and materialise only this rank's tensors.

    Raises:
        RunError: a model that cannot be built, or a schedule or pipeline that does not apply (one sentence).
    """
    cfg, lay = run.cfg, run.layout
    try:
        model = build_meta_model(run.spec, cfg.model.model_path)
    except WeightsError as err:
        raise RunError(str(err)) from None
    run.config = getattr(model, "config", None)
    run.forward_extras = no_cache_kwargs(model)
    run.n_params = sum(p.numel() for p in model.parameters())
    canon = canonical_names(model)
    run.canon_of_fqn = {name: canon[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}
    sch = create_schedule(model, group=lay.mesh.tp_group)
    try:
        run.schedule_fn(sch)
    except ScheduleError as err:
        raise RunError(f"The schedule does not apply to this model: {err}") from None
    run.sch = sch
    run.block_paths = find_blocks(sch)
    if cfg.precision.compile:
        for path in run.block_paths:
            sch[path].mod.compile(fullgraph=True, backend=cfg.precision.compile_backend)
    blocks = [sch[p].mod for p in run.block_paths]
    run.targets = []
    if run.pipeline:
        _setup_pipeline(run, sch, blocks)
        return
    module = sch.mod
    targets = _targets_of(run, module.named_parameters(remove_duplicate=False))
    if lay.fsdp:
        targets = apply_fsdp(module, blocks, targets, lay)
    materialise(run, module, targets, lay.fsdp)
    run.targets = targets
    run.module = module


def _targets_of(run: Run, named) -> list:
    """Targets (canonical name, parameter, tensor-parallel layout) of ``(fqn, parameter)`` pairs, each
    parameter once."""
    out, seen = [], set()
    for fqn, p in named:
        if id(p) in seen:
            continue
        seen.add(id(p))
        out.append(Target(run.canon_of_fqn.get(fqn, fqn), p, layout_of(p, run.layout.tp, run.layout.tp_rank)))
    return out


def _setup_pipeline(run: Run, sch, blocks) -> None:
    """The pipeline stages of ``sch`` on this rank (:func:`slapo_lab.pipeline.build_pipeline`), each
    materialised (under FSDP2 when the layout says so) as it is built."""
    cfg, lay = run.cfg, run.layout
    # torch.export traces the model with fake tensors on the run's device (no memory): device-dependent code
    # takes this device's branch, and constants made during the trace keep their values
    fake = fake_parameters(sch.mod, run.device)
    example, _ = split_target(run.replica_batch(0), 1, "meta")
    with fake:
        example = {
            k: torch.empty_like(v, device=run.device) if isinstance(v, torch.Tensor) else v
            for k, v in example.items()
        }

    def prepare(partition, stage_ids):
        for i in stage_ids:
            stage = partition.stages[i]
            targets = _targets_of(run, stage.params.items())
            if lay.fsdp:  # FSDP2 shards meta parameters (to_empty cannot make fake ones real)
                allocate(targets, "meta", stage.module, [stage.params])
                inside = [m for m in stage.module.modules() if any(m is b for b in blocks)]
                targets = apply_fsdp(stage.module, inside, targets, lay)
            materialise(run, stage.module, targets, lay.fsdp, tables=[stage.params])
            run.targets.extend(targets)

    # DeepSpeed's engine comes after Verify (its train_batch steps the optimizer): the torch runtime first
    run.pipeline_loss = pipeline_loss_fn(run.objective, cfg.data.seed)
    try:
        run.pm = build_pipeline(
            sch,
            "torch",
            example_inputs=example,
            loss_fn=run.pipeline_loss,
            schedule=cfg.parallel.pp_schedule,
            n_microbatches=run.plan.accumulation,
            pp_group=lay.mesh.pp_group,
            dp_group=None if lay.fsdp or lay.dp == 1 else lay.mesh.dp_group,
            stages_per_rank=lay.stages_per_rank,
            device=run.device,
            prepare_stages=prepare,
            autocast_bf16=cfg.precision.bf16 and run.launcher != "deepspeed",
            deepspeed_later=run.launcher == "deepspeed",
        )
    except ScheduleError as err:
        raise RunError(f"The pipeline could not be built: {err}") from None
    run.module = nn.ModuleList([run.pm.partition.stage_module(i) for i in run.pm.stage_ids])


def materialise(run: Run, module: nn.Module, targets: list, fsdp: bool, tables: Iterable[dict] = ()) -> None:
    """Storage for ``targets`` (FSDP2: ``to_empty``, keeping the real buffers), then values from
    ``--model-path`` or the seeded initialisation."""
    if fsdp:
        buffers = dict(module.named_buffers())
        allocate(
            [t for t in targets if getattr(t.param, "_local_tensor", None) is None],
            run.device,
            module,
            tables,
        )
        module.to_empty(device=run.device)
        with torch.no_grad():
            for name, b in module.named_buffers():
                src = buffers.get(name)
                if src is not None and src is not b and not src.is_meta:
                    b.copy_(src)
        for t in targets:  # FSDP2 made new parameter objects: init reads the global shape from here
            t.param.orig_shape = torch.Size(t.layout.shape)
    else:
        allocate(targets, run.device, module, tables)
        module.to(run.device)
    if run.cfg.model.model_path:
        load_hf(run.cfg.model.model_path, targets, run.layout.view_mesh)
    else:
        init_random(run.sch, targets, run.cfg.data.seed)


def fake_parameters(model: nn.Module, device: str | torch.device) -> FakeTensorMode:
    """Replace ``model``'s meta parameters by fake tensors on ``device`` (``FakeTensorMode``: shapes, dtypes and
    the device, no storage), tied ones by one fake tensor, annotations kept; returns the fake mode."""
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
