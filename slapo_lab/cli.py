"""The ``slapo-lab`` command line.

::

    slapo-lab export schedule.json -o train.py [--launcher torchrun|deepspeed] [--trust-factory [--project DIR]]
    slapo-lab check schedule.json [--trust-factory [--project DIR]]
    slapo-lab convert CKPT --to-hf DIR
    slapo-lab plan HF_DIR_OR_CONFIG --nodes 4 --gpus-per-node 8 --gpu H100-SXM --seq-len 8192 --global-batch-size 512

``plan`` builds the model of a Hugging Face directory (or its ``config.json``) on the meta device from its config
class (no weights are read) and prints :func:`slapo_lab.auto_plan`'s ranked table and why-not list; exit status
0 when a layout fits, 3 when none does, 2 for a bad argument or config (one sentence).

``check`` rebuilds the model on the meta device, replays the calls and prints the schedule check's open
items (:func:`slapo_lab.check_schedule`), one sentence each with the calls that close them; exit status 0
when nothing is open, 3 when something is. ``export`` runs the same check and warns on stderr (the
script is still written).

``schedule.json`` is a file written by :func:`slapo_lab.export.save_schedule` (or the editor): the
recorded calls plus ``meta.model``, ``meta.inputs`` and ``meta.world_size`` (the tensor-parallel
width; a schedule with pipeline cuts launches ``world_size x stages`` processes per replica). Errors
are printed as one sentence on stderr with exit status 2 (1 for an unexpected failure, still one
sentence and no traceback); nothing is written unless the whole file is valid.

A schedule file is data that people send each other. When its ``meta.model`` names a factory
(``"package.module:function"``), ``check`` would import and call it and ``export`` would write a script
that does, so both refuse (exit status 2, one sentence) unless run with ``--trust-factory``; even then the
factory's package must live in the project folder (``--project DIR``, default: the current directory),
never in the standard library or site-packages (:func:`slapo_lab.spec.check_factory_in_project`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from .errors import ScheduleError
from .planner import Cluster, auto_plan
from .planner.devices import DEVICES
from .record import replay
from .spec import ExportError, build_from_spec, check_factory_in_project, factory_consent_error

# Every command loads torch and the planner (the parser lists the planner's accelerators), so the imports above
# cost nothing more. Each command's heavier machinery stays inside it (``python -m slapo_lab.cli --help``: 3.6 s,
# +0.8 s with the schedule, export and check modules at the top, +1.6 s with transformers, +5.7 s with
# train.checkpoint; measured on 2 loaded CPU cores).


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="slapo-lab", description="slapo-lab: Slapo schedules for PyTorch models."
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    e = sub.add_parser(
        "export",
        help="render a saved schedule as a launchable training script",
        description="Render a saved schedule (JSON) as a standalone training script.",
    )
    e.add_argument("schedule", help="schedule file written by slapo_lab.export.save_schedule or the editor")
    e.add_argument("-o", "--output", default="train.py", help="script to write (default: train.py)")
    e.add_argument(
        "--launcher",
        default="torchrun",
        choices=["torchrun", "deepspeed"],
        help="launcher the script is written for (default: torchrun)",
    )
    e.add_argument(
        "--force-unverified",
        action="store_true",
        help="write the script even when the numeric check marks the schedule as failing",
    )
    _trust_arguments(e)
    c = sub.add_parser(
        "check",
        help="list what a saved tensor-parallel schedule still lacks",
        description="Replay a saved schedule on the meta device and list the schedule check's "
        "open items (exit status 3 when there are any).",
    )
    c.add_argument("schedule", help="schedule file written by slapo_lab.export.save_schedule or the editor")
    _trust_arguments(c)
    v = sub.add_parser(
        "convert",
        help="write a training checkpoint as a Hugging Face directory",
        description="Write the model of a checkpoint (a step-NNNNNNNN directory, or a --checkpoint-dir: "
        "its newest complete one), saved at any layout, as a Hugging Face directory "
        "(safetensors, config, tokenizer) that from_pretrained loads.",
    )
    v.add_argument(
        "checkpoint", help="a checkpoint directory written by an exported script's --checkpoint-dir"
    )
    v.add_argument("--to-hf", required=True, metavar="DIR", help="the Hugging Face directory to write")
    v.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="dtype of the weights written (auto: the dtype the run started from)",
    )
    pl = sub.add_parser(
        "plan",
        help="rank the parallel layouts of a model on a cluster (predicted memory and step time)",
        description="Build the model of a Hugging Face directory or config.json on the meta device and print "
        "the planner's ranked layouts (TP x PP x DP, FSDP/ZeRO, checkpointing, micro-batch) and why the others "
        "were refused.",
    )
    pl.add_argument("config", help="a Hugging Face model directory or its config.json")
    pl.add_argument("--nodes", type=int, default=1, help="nodes (default: 1)")
    pl.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default: 8)")
    pl.add_argument("--gpu", default="H100-SXM", help="accelerator: " + ", ".join(_gpu_names()))
    pl.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (default: 4096)")
    pl.add_argument("--global-batch-size", type=int, default=64, help="sequences per step (default: 64)")
    pl.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="training dtype")
    pl.add_argument("--top-k", type=int, default=5, help="layouts to list (default: 5)")
    return p


def _gpu_names() -> list[str]:
    return list(DEVICES)


def plan_command(args: argparse.Namespace) -> tuple[str, bool]:
    """The ``plan`` table for ``args`` and whether any layout fits.

    Raises:
        ValueError: a config that cannot be read or built, or a bad cluster (one sentence).
    """
    import transformers  # noqa: PLC0415 - transformers adds 1.6 s to every command; only plan needs it

    path = args.config
    try:
        if os.path.isdir(path):
            cfg = transformers.AutoConfig.from_pretrained(path)
        else:
            with open(path) as f:
                data = json.load(f)
            cfg = transformers.AutoConfig.for_model(**data)
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"cannot read a Hugging Face config from {path} ({err}).") from err
    with torch.device("meta"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        except ValueError:
            model = transformers.AutoModel.from_config(cfg)
    cluster = Cluster(nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu=args.gpu)
    found = auto_plan(
        model,
        cluster=cluster,
        seq_len=args.seq_len,
        global_batch_size=args.global_batch_size,
        dtype=args.dtype,
        top_k=args.top_k,
    )
    head = (
        f"{type(model).__name__} on {args.nodes} x {args.gpus_per_node} {cluster.device.name}, seq {args.seq_len}, "
        f"global batch {args.global_batch_size}, {args.dtype}:\n"
    )
    return head + found.table(), bool(found.candidates)


def _trust_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trust-factory",
        action="store_true",
        help="import and call the factory the file's meta.model names (package.module:function) to build "
        "the model; without it such a file is refused, since a schedule file may come from anyone",
    )
    p.add_argument(
        "--project",
        metavar="DIR",
        default=None,
        help="the project folder a trusted factory's package must live in (default: the current directory)",
    )


def _check_factory_consent(schedule: str, spec, trust_factory: bool, project) -> None:
    """Refuse a factory ``spec`` names unless trusted and in the project (imports nothing)."""
    if isinstance(spec, dict) and spec.get("kind") == "factory":
        if not trust_factory:
            raise factory_consent_error(spec["factory"], f"the schedule file {schedule}")
        check_factory_in_project(spec["factory"], project)


def check_command(schedule: str, trust_factory: bool = False, project: str | None = None) -> list:
    """The open items (:class:`slapo_lab.Finding`) of the schedule file ``schedule``.

    The model is rebuilt from ``meta.model`` on the meta device (no weights are allocated) and the
    calls are replayed at ``meta.world_size``.

    Args:
        schedule: the schedule file.
        trust_factory: consent to import and call the factory ``meta.model`` names (``--trust-factory``);
            a Hugging Face config spec needs none.
        project: the folder a trusted factory's package must live in (default: the current directory).

    Raises:
        ExportError: an invalid file, one without a model spec or world size, a factory without
            ``trust_factory`` or outside ``project``, a model that does not rebuild, or a call that no
            longer applies (one sentence).
    """
    from .check import check_schedule  # noqa: PLC0415 - with the schedule and export modules, 0.8 s only check and export need
    from .export import load_schedule  # noqa: PLC0415 - as above
    from .schedule import create_schedule  # noqa: PLC0415 - as above

    calls, meta = load_schedule(schedule)
    missing = [k for k in ("model", "world_size") if k not in meta]
    if missing:
        raise ExportError(
            f"{schedule} has no {', '.join('meta.' + k for k in missing)}; save it with "
            "save_schedule(path, calls, model=..., world_size=...)."
        )
    _check_factory_consent(schedule, meta["model"], trust_factory, project)
    try:
        model = build_from_spec(meta["model"], trust_factory=trust_factory, project=project)
    except ExportError as err:
        raise ExportError(f"{schedule}: {err}") from None
    sch = create_schedule(model, world_size=meta["world_size"])
    try:
        replay(sch, calls)
    except ScheduleError as err:
        raise ExportError(f"{schedule} no longer applies to its model: {err}") from None
    return check_schedule(sch)


def export_command(
    schedule: str,
    output: str,
    launcher: str = "torchrun",
    trust_factory: bool = False,
    project: str | None = None,
    force: bool = False,
) -> tuple[str, str]:
    """Render ``schedule`` (a schedule file) to ``output``; returns (path written, one-node launch command).

    The schedule is first checked numerically (:func:`slapo_lab.export.script.refuse_failing_schedule`, on
    the model rebuilt from its spec and inputs drawn like the spec's), and refused when it fails, unless
    ``force`` (``--force-unverified``).

    Nothing the file names is imported here, but a script that builds its model with a factory would
    import and call it, so such a file needs ``trust_factory`` and a factory in ``project``.

    Args:
        schedule: the schedule file.
        output: the script to write.
        launcher: ``"torchrun"`` or ``"deepspeed"``.
        trust_factory: consent to write a script that calls the factory ``meta.model`` names
            (``--trust-factory``).
        project: the folder a trusted factory's package must live in (default: the current directory).
        force: write the script even when the numeric check fails.

    Raises:
        ExportError: an invalid file, one without a model/input spec or world size, a factory without
            ``trust_factory`` or outside ``project``, a schedule the numeric check marks failing (without
            ``force``), or an unwritable output.
    """
    from .export import (  # noqa: PLC0415 - with the schedule and check modules, 0.8 s only check and export need
        launch_command,
        load_schedule,
        render_script,
    )
    from .export.script import write_text_atomic  # noqa: PLC0415 - as above

    calls, meta = load_schedule(schedule)
    missing = [k for k in ("model", "inputs", "world_size") if k not in meta]
    if missing:
        raise ExportError(
            f"{schedule} has no {', '.join('meta.' + k for k in missing)}; save it with "
            "save_schedule(path, calls, model=..., example_inputs=..., world_size=...)."
        )
    _check_factory_consent(schedule, meta["model"], trust_factory, project)
    if not force:
        _refuse_failing(schedule, calls, meta, trust_factory, project)
    out = Path(output).expanduser()
    text = render_script(
        meta["model"], calls, meta["inputs"], meta["world_size"], launcher, script_name=out.name
    )
    write_text_atomic(out, text)
    path = str(out.resolve())
    return path, launch_command(calls, meta["world_size"], path, launcher, device=None)


def _refuse_failing(schedule: str, calls, meta, trust_factory: bool, project: str | None) -> None:
    """Raise ExportError when the numeric check marks the schedule file's calls as failing."""
    from .export.script import refuse_failing_schedule  # noqa: PLC0415 - with the schedule and check modules, 0.8 s only check and export need

    try:
        model = build_from_spec(meta["model"], trust_factory=trust_factory, project=project)
    except ExportError as err:
        raise ExportError(f"{schedule}: {err}") from None
    inputs = {}
    for name, d in meta["inputs"].items():
        if "shape" in d:
            inputs[name] = torch.empty(d["shape"], dtype=getattr(torch, d["dtype"]), device="meta")
        elif "value" in d:
            inputs[name] = d["value"]
    refuse_failing_schedule(model, calls, inputs, meta["world_size"])


def _guarded(command: str, schedule: str, run):
    """``(run(), None)``, or ``(None, exit status)`` after printing the failure as one sentence on stderr:
    2 for a bad schedule file, 1 for anything unexpected (never a traceback)."""
    try:
        return run(), None
    except ExportError as err:
        print(f"slapo-lab {command}: error: {err}", file=sys.stderr)
        return None, 2
    except RecursionError:
        print(
            f"slapo-lab {command}: error: {schedule} is nested too deeply to be a schedule file.",
            file=sys.stderr,
        )
        return None, 2
    except Exception as err:  # noqa: BLE001 - one sentence, never a traceback
        reason = (str(err).strip().splitlines() or [""])[0][:300].rstrip(".")
        print(
            f"slapo-lab {command}: error: the {command} failed unexpectedly ({type(err).__name__}"
            + (f": {reason}" if reason else "")
            + ").",
            file=sys.stderr,
        )
        return None, 1


def _export(args: argparse.Namespace) -> int:
    """``slapo-lab export``: write the script, print its launch command, then warn about open check items."""
    done, status = _guarded(
        "export",
        args.schedule,
        lambda: export_command(
            args.schedule,
            args.output,
            args.launcher,
            args.trust_factory,
            args.project,
            args.force_unverified,
        ),
    )
    if status is not None:
        return status
    path, command = done
    print(f"wrote {path}\nlaunch: {command}")
    try:
        found = check_command(args.schedule, args.trust_factory, args.project)
    except Exception:  # noqa: BLE001 - the script is written; the check is advice
        found = []
    if found:
        print(
            f"slapo-lab export: warning: the schedule check has {len(found)} open item"
            f"{'s' if len(found) > 1 else ''}, so --verify will fail until they are closed "
            f"(slapo-lab check {args.schedule} lists them); the first: {found[0].message}",
            file=sys.stderr,
        )
    return 0


def _convert(args: argparse.Namespace) -> int:
    """``slapo-lab convert``: a checkpoint as a Hugging Face directory."""
    from .train.checkpoint import ConvertError, convert_to_hf  # noqa: PLC0415 - 5.7 s (transformers, safetensors, dcp): only convert needs it

    try:
        out = convert_to_hf(args.checkpoint, args.to_hf, args.dtype)
    except ConvertError as err:
        print(f"slapo-lab convert: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out} (from_pretrained loads it)")
    return 0


def _check(args: argparse.Namespace) -> int:
    """``slapo-lab check``: list the open items and the calls that close them (3 when there are any)."""
    found, status = _guarded(
        "check", args.schedule, lambda: check_command(args.schedule, args.trust_factory, args.project)
    )
    if status is not None:
        return status
    if not found:
        print(f"{args.schedule}: no open items.")
        return 0
    print(f"{args.schedule}: {len(found)} open item{'s' if len(found) > 1 else ''}:")
    for f in found:
        print(f"- {f.message}")
    print(
        "\nto close them, add (a fix can open the next item: check again, or let "
        "sl.close_open_items(sch) apply every round):\n" + "\n".join(f.fix for f in found)
    )
    return 3


def _plan(args: argparse.Namespace) -> int:
    """``slapo-lab plan``: print the ranked layouts (3 when none fits)."""
    try:
        text, any_fit = plan_command(args)
    except (ValueError, ScheduleError) as err:
        print(f"slapo-lab plan: error: {err}", file=sys.stderr)
        return 2
    print(text)
    return 0 if any_fit else 3


_COMMANDS = {"export": _export, "convert": _convert, "check": _check, "plan": _plan}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``slapo-lab`` console script; returns the exit status."""
    args = _parser().parse_args(argv)
    return _COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
