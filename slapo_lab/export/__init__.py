"""Export a recorded schedule as a standalone training script (``torchrun`` or ``deepspeed``).

::

    from slapo_lab.export import export_script
    export_script("train_bert.py", model, sch.record.calls, {"input_ids": ids}, world_size=2)
    # torchrun --nproc_per_node=2 train_bert.py --device cuda

Pieces: :func:`model_spec` / :func:`input_spec` describe the model and its inputs as JSON data;
:func:`render_script` turns them and the calls into Python text (loops over layers, ``repr``'d
literals only); :func:`save_schedule` / :func:`load_schedule` persist all of it
(``slapo-lab export schedule.json -o train.py`` renders a saved file). A factory a schedule file
names is imported only with consent (:func:`build_from_spec`'s ``trust_factory``, the command line's
``--trust-factory``) and only from the user's project (:func:`check_factory_in_project`).
"""

from ..spec import (
    ExportError,
    build_from_spec,
    check_factory_in_project,
    input_spec,
    model_spec,
    validate_calls,
    validate_input_spec,
    validate_model_spec,
)
from .fold import find_runs, schedule_lines
from .io import ScheduleFile, load_schedule, save_schedule
from .script import LAUNCHERS, export_script, launch_command, pipeline_stages, processes, render_script

__all__ = [
    "LAUNCHERS",
    "ExportError",
    "ScheduleFile",
    "build_from_spec",
    "check_factory_in_project",
    "export_script",
    "find_runs",
    "input_spec",
    "launch_command",
    "load_schedule",
    "model_spec",
    "pipeline_stages",
    "processes",
    "render_script",
    "save_schedule",
    "schedule_lines",
    "validate_calls",
    "validate_input_spec",
    "validate_model_spec",
]
