"""The phases of a launched run, as one marker line each on rank 0's stdout.

An exported script prints ``slapo-lab phase: <name>`` when a phase begins; the editor's Verify progress
(:mod:`slapo_lab.editor.verify_runner`) reads these lines to name the phase and move its bar, and keeps them
out of the visible log. The kernel side adds the phases before the script prints anything (exporting it,
launching torchrun and importing torch on every rank).
"""

from __future__ import annotations

import sys

PREFIX = "slapo-lab phase: "

#: Every phase of a Verify run, in order, with the words the editor shows. ``export`` and ``launch`` happen
#: before the script prints; ``done`` after it exits.
PHASES: dict[str, str] = {
    "export": "exporting the script",
    "launch": "launching the ranks (starting Python, importing torch)",
    "setup": "building this rank's shards of the scheduled model",
    "reference": "building the unsharded reference",
    "compare": "running both models and comparing",
    "train": "training",
    "done": "done",
}


def say_phase(name: str) -> None:
    """Print the marker of phase ``name`` (a key of :data:`PHASES`) on rank 0 (every process when
    ``torch.distributed`` is not initialised).

    Raises:
        KeyError: an unknown phase.
    """
    if name not in PHASES:  # one home for the names: an unknown one is a bug here, not a silent line
        raise KeyError(f"unknown phase {name!r}; phases: {', '.join(PHASES)}")
    dist = sys.modules.get("torch.distributed")  # not imported: no process group (this module needs no torch)
    if dist is None or not dist.is_initialized() or dist.get_rank() == 0:
        print(PREFIX + name, flush=True)


def parse_phase(line: str) -> str | None:
    """The phase a marker line announces (``[rank0]:`` prefixes from torchrun's ``--tee`` allowed), else None."""
    at = line.find(PREFIX)
    if at < 0 or line[:at].strip() not in ("", "[rank0]:", "[default0]:"):
        return None
    name = line[at + len(PREFIX) :].strip()
    return name if name in PHASES else None
