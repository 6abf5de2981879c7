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

This module is the entry point, :func:`main`; the run lives in :mod:`slapo_lab.train.process` (the process group),
:mod:`slapo_lab.train.assemble` (step 2), :mod:`slapo_lab.train.verify` (step 3), :mod:`slapo_lab.train.run`
(steps 4 and 5), :mod:`slapo_lab.train.evaluate` and :mod:`slapo_lab.train.losses`. The names scripts and tests
imported from here before the split (``Run``, ``RunError``, ``model_loss``, ``pipeline_loss_fn``, ``probe_loss``,
``_backend``, ``_device_of`` ...) are re-exported below.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ..parallel_dims import ParallelDims
from ..spec import ExportError, validate_input_spec, validate_model_spec
from .config import TrainConfig
from .deepspeed import ds_config
from .lifeline import arm
from .losses import (
    _PROBES,
    PipelineLoss,
    first_tensor,
    labelled_tokens,
    model_loss,
    no_cache_kwargs,
    pipeline_loss_fn,
    probe_loss,
    token_losses,
)
from .parallel import LayoutError
from .phases import say_phase
from .preflight import Checked, failed, preflight, speaks_errors
from .process import RunError, backend, device_of, init_process_group
from .run import Run, TorchStepper

# the names of this module before it was split (tests and earlier code imported them from here)
_backend = backend
_device_of = device_of

__all__ = [
    "_PROBES",
    "PipelineLoss",
    "Run",
    "RunError",
    "TorchStepper",
    "_backend",
    "_device_of",
    "first_tensor",
    "labelled_tokens",
    "main",
    "model_loss",
    "no_cache_kwargs",
    "pipeline_loss_fn",
    "probe_loss",
    "token_losses",
]


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
    checked: Checked | None = None,
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
        _print_ds_config(cfg, tp, stages)
        return 0
    device, error = _device(cfg, stages)
    if error:
        if speaks_errors():  # once per node, not once per rank
            print(error, file=sys.stderr, flush=True)
        return failed(2)
    init_process_group(cfg.parallel, device)
    say_phase("setup")
    return _train(
        checked,
        spec=spec,
        schedule_fn=schedule,
        input_spec=input_spec,
        tp=tp,
        stages=stages,
        launcher=launcher,
        device=device,
    )


def _train(checked: Checked, **run_args: Any) -> int:
    """Set up the :class:`Run` (``run_args``: its keyword arguments), Verify it when asked, train; returns the exit
    status (a run, layout or spec error: its one sentence on rank 0, and 2). The process group is destroyed
    at the end."""
    cfg = checked.config
    run = None
    try:
        run = Run(cfg, **run_args)
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


def _print_ds_config(cfg: TrainConfig, tp: int, stages: int) -> None:
    """Print the DeepSpeed config JSON this launch would use (``--print-ds-config``)."""
    world = int(os.environ.get("WORLD_SIZE", ParallelDims(tp, stages).world_size))
    dims = cfg.parallel.dims(tp, stages, world)
    micro, accumulation = dims.micro_batches(cfg.batch.global_batch_size, cfg.batch.micro_batch_size, stages)
    print(json.dumps(ds_config(cfg, micro, accumulation, dims.dp), indent=2))


def _device(cfg: TrainConfig, stages: int) -> tuple[str, str | None]:
    """``(device, error)``: this rank's device (:func:`device_of`), and the one-sentence error when it cannot run
    (gloo cannot send CUDA tensors between pipeline stages)."""
    device, error = device_of(cfg.parallel)
    if not error and stages > 1 and device.startswith("cuda") and backend(cfg.parallel) == "gloo":
        error = (
            "error: gloo cannot send CUDA tensors between pipeline stages; use --backend nccl with one GPU per "
            "process, or --device cpu."
        )
    return device, error
