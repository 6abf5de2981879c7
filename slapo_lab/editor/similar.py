""" "Apply to all similar": which modules are similar to one, and the gate that refuses spreading a click.

Both read only the schedule (and, for the gate, the numeric check): :class:`~slapo_lab.editor.state.EditorState`
uses them for :meth:`~slapo_lab.editor.state.EditorState.similar` and for an :meth:`apply` with "apply to all
similar" ticked.
"""

from __future__ import annotations

from .. import numeric as numeric_module

__all__ = ["similar_gate", "similar_paths"]


def similar_paths(schedule, path: str) -> list[str]:
    """``path`` and the modules of the same type at the same relative path in every repeated block of
    ``schedule`` (a :class:`~slapo_lab.Schedule`).

    E.g. ``encoder.layer.0.attention.self.query`` → the ``query`` of every ``encoder.layer.i``.
    The block index is the first numeric path component whose container holds more than one child; a path
    without one gives ``[path]``. Raises KeyError when ``path`` is not in the schedule.
    """
    parts = path.split(".")
    typ = type(schedule[path].mod)
    for i, part in enumerate(parts):
        if not part.isdigit():
            continue
        container = ".".join(parts[:i])
        siblings = schedule[container].child if container in schedule else {}
        if len(siblings) < 2:
            continue
        out = []
        for name in siblings:
            cand = ".".join(parts[:i] + [name] + parts[i + 1 :])
            if cand in schedule and type(schedule[cand].mod) is typ:
                out.append(cand)
        return out
    return [path]


def similar_gate(state, target: str, n: int, earlier: list, calls: list, one: list) -> str | None:
    """The gate of "apply to all similar" (as :mod:`slapo_lab.preset_check` gates presets): None, or the one
    sentence refusing it when the calls on all ``n`` similar modules fail the numeric check
    (:func:`slapo_lab.numeric.numeric_check` on ``state.model`` with ``state.example_inputs``) while the same
    click on ``target`` alone passes -- spreading it is then what breaks the model.

    A schedule that already fails with the click on ``target`` alone is the user's work in progress (a
    column-parallel layer waits for its row-parallel partner): the action goes through and the live check shows
    ✗. Without example inputs nothing is checked.

    Args:
        earlier: the recorded calls before the action; calls: the action's calls on every similar module;
            one: the action's calls on ``target`` alone.
    """
    if not state.example_inputs:
        return None
    report = numeric_module.numeric_check(
        state.model, [*earlier, *calls], state.world_size, state.example_inputs
    )
    if report.status not in ("failed", "error"):
        return None
    alone = numeric_module.numeric_check(
        state.model, [*earlier, *one], state.world_size, state.example_inputs
    )
    if alone.status != "passed":
        return None
    why = report.message.rstrip(".")
    return (
        f"Not applied to the {n} similar modules: on {target} alone the schedule passes the numeric check, but "
        f"on all of them it fails ({why[:1].lower() + why[1:]})."
    )
