"""The ``slapo-lab`` command line.

::

    slapo-lab export schedule.json -o train.py [--launcher torchrun|deepspeed]

``schedule.json`` is a file written by :func:`slapo_lab.export.save_schedule` (or the editor): the
recorded calls plus ``meta.model``, ``meta.inputs`` and ``meta.world_size`` (the tensor-parallel
width; a schedule with pipeline cuts launches ``world_size x stages`` processes per replica). Errors
are printed as one sentence on stderr with exit status 2 (1 for an unexpected failure, still one
sentence and no traceback); nothing is written unless the whole file is valid.
"""
from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="slapo-lab", description="slapo-lab: Slapo schedules for PyTorch models.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    e = sub.add_parser("export", help="render a saved schedule as a launchable training script",
                       description="Render a saved schedule (JSON) as a standalone training script.")
    e.add_argument("schedule", help="schedule file written by slapo_lab.export.save_schedule or the editor")
    e.add_argument("-o", "--output", default="train.py", help="script to write (default: train.py)")
    e.add_argument("--launcher", default="torchrun", choices=["torchrun", "deepspeed"],
                   help="launcher the script is written for (default: torchrun)")
    return p


def export_command(schedule: str, output: str, launcher: str = "torchrun") -> tuple[str, str]:
    """Render ``schedule`` (a schedule file) to ``output``; returns (path written, one-node launch command).

    Raises:
        ExportError: an invalid file, one without a model/input spec or world size, or an
            unwritable output.
    """
    from pathlib import Path

    from .export import ExportError, launch_command, load_schedule, render_script
    from .export.script import write_text_atomic

    calls, meta = load_schedule(schedule)
    missing = [k for k in ("model", "inputs", "world_size") if k not in meta]
    if missing:
        raise ExportError(f"{schedule} has no {', '.join('meta.' + k for k in missing)}; save it with "
                          "save_schedule(path, calls, model=..., example_inputs=..., world_size=...).")
    out = Path(output).expanduser()
    text = render_script(meta["model"], calls, meta["inputs"], meta["world_size"], launcher, script_name=out.name)
    write_text_atomic(out, text)
    path = str(out.resolve())
    return path, launch_command(calls, meta["world_size"], path, launcher)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``slapo-lab`` console script; returns the exit status."""
    args = _parser().parse_args(argv)
    from .export import ExportError

    if args.command == "export":
        try:
            path, command = export_command(args.schedule, args.output, args.launcher)
        except ExportError as err:
            print(f"slapo-lab export: error: {err}", file=sys.stderr)
            return 2
        except RecursionError:
            print(f"slapo-lab export: error: {args.schedule} is nested too deeply to be a schedule file.",
                  file=sys.stderr)
            return 2
        except Exception as err:  # one sentence, never a traceback
            reason = (str(err).strip().splitlines() or [""])[0][:300].rstrip(".")
            print(f"slapo-lab export: error: the export failed unexpectedly ({type(err).__name__}"
                  + (f": {reason}" if reason else "") + ").", file=sys.stderr)
            return 1
        print(f"wrote {path}\nlaunch: {command}")
        return 0
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
