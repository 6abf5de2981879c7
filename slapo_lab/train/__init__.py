"""The training runtime of exported scripts: fine-tune a scheduled model on the user's weights and data.

An exported script holds the model spec, ``schedule(sch)``, the example inputs, its options (``CONFIG``) and one
call into :func:`slapo_lab.train.main`; everything else lives here, as importable code:

* ``preflight``  -- the launch checks that need no torch (arguments, layout, paths, tokenizer, sequence length,
  the checkpoint a relaunch resumes), run before the heavy imports;
* ``config``     -- :class:`~slapo_lab.train.config.TrainConfig`, every option typed (help, label, limits, checks);
* ``args``       -- the command line generated from it (``--model-path``, ``--data``, ``--dp``, ``--fsdp``, ...);
* ``data``       -- local text / jsonl / parquet files through HF ``datasets`` and ``tokenizers``, packed into
  fixed-length sequences in a seeded order, one part per data-parallel replica; synthetic inputs;
* ``metrics``    -- tqdm progress, per-step lines, TensorBoard events and ``metrics.csv``, peak memory, MFU;
* ``weights``    -- build on the meta device, materialise only this rank's shards (seeded init, or a
  Hugging Face directory read through ``torch.distributed.checkpoint``'s ``HuggingFaceStorageReader``);
* ``parallel``   -- the ``(dp, pp, tp)`` mesh, DDP / FSDP2 over ``dp``, the pipeline stages;
* ``optim``      -- AdamW / SGD, ``torch.optim.lr_scheduler`` schedules, clipping by the global norm;
* ``checkpoint`` -- ``torch.distributed.checkpoint`` save / resume at any layout, Hugging Face directories out;
* ``verify``     -- the scheduled model against the unscheduled one on a small batch;
* ``loop``       -- :func:`~slapo_lab.train.loop.main`, the run from the process group to the exit status;
* ``process``    -- the device, the backend and the process group of a rank; ``RunError``;
* ``assemble``   -- a run's layout, data and this rank's part of the model;
* ``run``        -- ``Run``: the training loop, and the torchrun target's optimizer step (``TorchStepper``);
* ``deepspeed``  -- the DeepSpeed target (its engine steps the optimizer);
* ``losses``     -- the model's loss, the probe objective, token cross entropy, the pipeline's loss, batch helpers;
* ``evaluate``   -- the validation loss.

The shard representation the ecosystem sees is :mod:`slapo_lab.sharding.placements` (DTensor views).
"""

from __future__ import annotations

from typing import Any


def main(**kwargs: Any) -> int:
    """The entry point of exported scripts: the launch checks of :mod:`slapo_lab.train.preflight` (no torch
    imported yet: a bad input fails in a second), then :func:`slapo_lab.train.loop.main` (imported only then).

    A rank that a launcher started ends there once the run has destroyed its process group
    (:func:`slapo_lab.train.lifeline.finish`); a caller whose own group outlives the run (a harness running
    several scripts in one launch) gets the exit status back."""
    from .preflight import preflight  # noqa: PLC0415 - import slapo_lab.train (lifeline) stays stdlib only

    checked = preflight(**kwargs)
    if isinstance(checked, int):
        return checked
    import torch.distributed as dist  # noqa: PLC0415 - torch loads only after the launch checks pass (a bad input fails in a second)

    from .lifeline import finish  # noqa: PLC0415 - torch loads only after the launch checks pass (a bad input fails in a second)
    from .loop import main as _main  # noqa: PLC0415 - torch loads only after the launch checks pass (a bad input fails in a second)

    code = _main(**kwargs, checked=checked)
    if dist.is_available() and dist.is_initialized():
        # the caller kept its own process group (several scripts in one launch): it ends the process itself
        return code
    return finish(code)


__all__ = ["main"]
