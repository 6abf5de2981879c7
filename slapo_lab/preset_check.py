"""A preset's result is right, or the part that is not is kept whole: presets checked before they commit.

:func:`slapo_lab.presets.megatron_tp` splits every block into *regions*: a Megatron region is the column-parallel
layers up to the row-parallel layer that closes them (attention: q, k, v ... o; MLP: up / gate ... down),
an expert bank is a region of its own, and the layers outside the blocks (the vocab-parallel embeddings, the
sequence-parallel scatter and gather) form one more. A region is the unit a preset may keep whole: its calls
are all there or none of them, in every block of the same class, so the model stays a sum of right
Megatron regions and replicated layers, whatever else is split.

:func:`gate` then runs the numeric check (:func:`slapo_lab.numeric.numeric_check`: the calls replayed on a
shrunk copy over simulated ranks and compared with the unsharded copy) on the calls the preset made:

1. a region whose calls a primitive refuses (heads that do not divide ...) is kept whole, with that sentence;
2. while the check fails, the region holding the module it names is dropped from the calls (when it names a
   block or the model root, each region in turn is tried alone first), and the check runs again;
3. the preset commits only calls that checked ✓ (or, where the check cannot run, says so in a note), and
   one sentence per region kept whole names it, in every block of which class, and why.

Nothing is committed if not even that can be made right: when every region is dropped, the preset raises.

The unscheduled model the check compares with is, in order: the model the schedule's editor remembers
(:func:`set_reference`), the Hugging Face model rebuilt from its config (the check's ``from_config``), or,
for the first calls on a model of the user's own classes, the model itself with the preset's calls taken
back for the check (:class:`slapo_lab.atomic.Snapshot`). Inside a real process group (an exported script,
a torchrun test) nothing is checked here: the script's Verify is the proof there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torch import nn

from .atomic import Snapshot
from .call_order import REFERENCE_KEY
from .errors import ScheduleError
from .numeric import numeric_check, remembered_inputs
from .record import Call

__all__ = ["KEPT_WHOLE_KEY", "Region", "WholeRefused", "gate", "layer_regions", "set_reference"]

#: ``extra`` key of the schedule: ``{layer path: why a preset kept it whole}`` (read by
#: :func:`slapo_lab.presets.replicated_dense` for the coverage note).
KEPT_WHOLE_KEY = "kept_whole"
#: Seconds a gate's numeric check may run before it is reported as an error.
GATE_TIMEOUT = 60.0


@dataclasses.dataclass(frozen=True)
class Region:
    """One part a preset keeps whole or splits as a unit.

    Attributes:
        key: identifies the same part in every block of a class: ``(block class name, relative paths)``;
            ``("", ("outside the blocks",))`` for the layers outside the repeated blocks.
        label: how a sentence names it, e.g. ``"self_attn (q_proj, k_proj, v_proj, o_proj)"``.
        where: ``"every LlamaDecoderLayer"`` or ``"outside the repeated blocks"``.
        kept: how a note begins when the preset leaves the region out (``"Kept whole"``, ``"Not checkpointed"``).
        done: what the preset does to it, for "it fails the numeric check when <done>".
        owner: the deepest module around the region's layers, relative to the block (``"self_attn"``; ``""``
            for the block itself or a region outside the blocks).
    """

    key: tuple
    label: str
    where: str
    kept: str = "Kept whole"
    done: str = "split"
    owner: str = ""


OUTSIDE = Region(("", ("outside the blocks",)), "the embeddings and layers outside the blocks", "the model")


def _parent(rel: str) -> str:
    return rel.rsplit(".", 1)[0] if "." in rel else ""


def _common(paths: list[str]) -> str:
    parts = [_parent(p).split(".") if _parent(p) else [] for p in paths]
    out: list[str] = []
    for group in zip(*parts, strict=False):
        if len(set(group)) != 1:
            break
        out.append(group[0])
    return ".".join(out)


def _under(rel: str, owner: str) -> bool:
    return not owner or rel == owner or rel.startswith(owner + ".")


def _depth(a: str, b: str) -> int:
    """How many leading module names the parents of layer paths ``a`` and ``b`` share."""
    pa, pb = _parent(a).split(".") if _parent(a) else [], _parent(b).split(".") if _parent(b) else []
    n = 0
    for x, y in zip(pa, pb, strict=False):
        if x != y:
            break
        n += 1
    return n


def _own(kind: str) -> str:
    """How a region names a layer that is its owner module itself (an attention module's own per-head table:
    LeViT's ``attention_biases``)."""
    if kind.startswith("head_param:"):
        return "its own " + ", ".join(one.split(":")[0] for one in kind[len("head_param:") :].split(";"))
    return "the module's own tensors"


def layer_regions(block_cls: str, layers: list[tuple[str, str]]) -> list[tuple[Region, list[str]]]:
    """Group one block's layers (``(path relative to the block, kind)`` from
    :func:`slapo_lab.presets.block_layers`, in module order) into regions.

    Each row-parallel layer closes one region: every column-parallel layer (``"column"``, ``"column_shard"``)
    joins the row layer it shares the deepest module with (an attention's q/k/v its output projection, in
    whatever order the module registers them; Phi-3 registers ``o_proj`` first), on a tie the first row
    after it, else the last before it; columns with no row stand alone. ``"experts"`` and ``"column_gather"``
    (a column-parallel linear whose output is gathered) are regions of their own;
    any other kind (a per-head norm or table, a norm under sequence parallelism) joins the region with the
    deepest owning module around it (the common parent of the region's projections), or stands alone.

    Returns:
        ``[(Region, [relative layer paths])]`` in module order of each region's first layer.
    """
    order = {rel: i for i, (rel, _k) in enumerate(layers)}
    rows = [rel for rel, k in layers if k == "row"]
    groups: dict[str, list[str]] = {r: [] for r in rows}
    alone: list[list[str]] = []
    extras: list[str] = []
    for rel, kind in layers:
        if kind in ("column", "column_shard"):
            if not rows:
                alone.append([rel])
                continue
            best = max(_depth(rel, r) for r in rows)
            ties = [r for r in rows if _depth(rel, r) == best]
            after = [r for r in ties if order[r] > order[rel]]
            groups[after[0] if after else ties[-1]].append(rel)
        elif kind in ("experts", "column_gather"):  # a column-parallel linear with its output gathered
            alone.append([rel])
        elif kind != "row":
            extras.append(rel)
    found = [[*cols, r] for r, cols in groups.items()] + alone
    found.sort(key=lambda g: min(order[x] for x in g))
    owners = [_common(g) if len(g) > 1 else _parent(g[0]) for g in found]
    for rel in extras:
        best_i = max(
            (i for i, o in enumerate(owners) if _under(rel, o)),
            key=lambda i: len(owners[i]) if owners[i] else -1,
            default=None,
        )
        if best_i is None:
            found.append([rel])
            owners.append(_parent(rel))
        else:
            found[best_i].append(rel)
    kinds = dict(layers)
    out = []
    for g, owner in zip(found, owners, strict=True):
        # a layer that is the owner itself (an attention module's own per-head table) is named by its own tensors
        rels = [(p[len(owner) + 1 :] if owner else p) or _own(kinds.get(p, "")) for p in g]
        names = ", ".join(rels[:5]) + (f" and {len(rels) - 5} more" if len(rels) > 5 else "")
        label = f"{owner} ({names})" if owner else names
        out.append((Region((block_cls, tuple(g)), label, f"every {block_cls}", owner=owner), g))
    return out


def set_reference(sch, model: nn.Module) -> None:
    """Remember ``model``, the unscheduled model ``sch`` was made from (the editor's), for :func:`gate`."""
    sch.get_top_schedule()._top.extra[REFERENCE_KEY] = model


def _reference(sch, earlier_calls: int):
    """``(reference, from_config, needs_undo)`` for the gate's check, or ``(None, reason, False)``."""
    top = sch.get_top_schedule()
    ref = top._top.extra.get(REFERENCE_KEY)
    if ref is not None:
        return ref, False, False
    cfg = getattr(top.mod, "config", None)
    if cfg is not None and hasattr(cfg, "to_dict"):
        return top.mod, True, False
    if earlier_calls == 0:
        return top.mod, False, True
    why = (
        "the model has no Hugging Face config and already carries earlier calls, so no unscheduled copy is at "
        "hand (the editor's live check and the script's Verify still check it)"
    )
    return None, why, False


def _inputs(sch, model: nn.Module) -> dict | None:
    """The example inputs for the gate's check (:func:`slapo_lab.numeric.remembered_inputs`), or None."""
    try:
        return remembered_inputs(sch, model)
    except ScheduleError:
        return None


def _region_of(module: str | None, owned: dict[str, Region]) -> Region | None:
    """The region whose layers hold ``module``, the one region inside it (the attention module around q, k,
    v and o), or None: no module, or one around several regions (a block, the root).

    The shrunk copy keeps a prefix of every stack of blocks under the same paths, so a module it names is a
    path of the model too."""
    if not module:
        return None
    best, depth = None, -1
    for path, region in owned.items():
        if (module == path or module.startswith(path + ".")) and len(path) > depth:
            best, depth = region, len(path)
    if best is not None:
        return best
    inner = {region for path, region in owned.items() if path.startswith(module + ".")}
    return inner.pop() if len(inner) == 1 else None


@dataclasses.dataclass
class Applied:
    """What one application of a region-wise preset recorded."""

    calls: list[Call]
    region_of_call: list[Region]
    owned: dict[str, Region]  # layer path -> its region
    notes: list[str]


def gate(
    sch,
    apply: Callable[[dict[tuple, str]], Applied],
    check: bool = True,
    whole: str | None = None,
) -> tuple[list[Call], list[str]]:
    """Apply a region-wise preset, check it numerically, and keep whole the regions that make it fail.

    Args:
        sch: the root schedule (the preset runs inside :func:`slapo_lab.atomic.atomic`).
        apply: ``apply(skip)`` records the preset's calls leaving out the regions whose keys ``skip`` maps
            to a reason, and returns :class:`Applied`; it raises :class:`RegionRefused` for a region a
            primitive refuses (the gate restores the schedule, keeps that region whole and applies again).
        check: run the numeric check (off: only refusals keep regions whole).
        whole: when set, a failing check keeps no region whole: the preset is refused, with this sentence
            followed by the check's (a layout whose regions are not independent: sequence parallelism).

    Returns:
        ``(calls, notes)``: the committed calls and one sentence per reason regions were kept whole (and
        one when the check could not run).

    Raises:
        ScheduleError: when no region can be applied right.
    """

    skip: dict[tuple, str] = {}
    labels: dict[tuple, Region] = {}
    earlier = list(sch.record.calls)
    before = Snapshot(sch)
    not_checked: list[str] = []
    for _ in range(256):
        try:
            applied = apply(skip)
        except RegionRefused as refused:
            before.restore()
            if refused.region.key in skip:  # refused again: nothing to learn, stop here
                raise ScheduleError(refused.reason) from None
            skip[refused.region.key] = refused.reason
            labels[refused.region.key] = refused.region
            continue
        if not check or not applied.calls or sch.group is not None:
            break
        why = _checked(sch, earlier, applied, before, whole)
        if why is None:
            break
        if isinstance(why, str):  # the check could not run: commit what the preset made, and say so
            not_checked.append(f"The preset's calls were not checked numerically: {_lower(why)}")
            break
        if all(region.key in skip for region, _ in why):  # nothing new to leave out: stop, as refused
            before.restore()
            raise ScheduleError(
                f"No part of the preset can be applied right, so nothing is applied: {why[0][1]}"
            )
        before.restore()
        for region, reason in why:
            skip.setdefault(region.key, reason)
            labels[region.key] = region
        # applied again without those regions and checked again: what is committed is what was checked
    else:  # pragma: no cover - bounded by the number of regions
        raise ScheduleError("The preset could not settle on a right schedule.")
    if skip and not applied.calls:
        before.restore()
        raise ScheduleError(
            "No part of the preset can be applied right, so nothing is applied: "
            + "; ".join(f"in {labels[k].where} {labels[k].label} {_lower(v)}" for k, v in skip.items())
        )
    _note_kept_whole(sch, applied, skip)
    return applied.calls, list(applied.notes) + _kept_whole_notes(skip, labels) + not_checked


def _note_kept_whole(sch: Any, applied: Applied, skip: dict[tuple, str]) -> None:
    """Note on the schedule, path by path, why the preset kept a module whole (``KEPT_WHOLE_KEY``)."""
    kept = sch.get_top_schedule()._top.extra.setdefault(KEPT_WHOLE_KEY, {})
    for path, region in applied.owned.items():
        if region.key in skip:
            kept[path] = _lower(skip[region.key])


def _kept_whole_notes(skip: dict[tuple, str], labels: dict[tuple, Region]) -> list[str]:
    """One sentence per reason regions were kept whole, naming them."""
    by_reason: dict[tuple[str, str], list[Region]] = {}
    for key, reason in skip.items():
        by_reason.setdefault((labels[key].kept, reason), []).append(labels[key])
    notes = []
    for (kept_as, reason), regions in by_reason.items():
        what = "; ".join(f"in {r.where} {r.label}" if r.key[0] else r.label for r in regions)
        notes.append(f"{kept_as}: {what}, because {_lower(reason)}")
    return notes


def _lower(sentence: str) -> str:
    s = sentence.strip()
    if len(s) > 1 and s[0].isupper() and not s[1].isupper():
        s = s[0].lower() + s[1:]
    return s if s.endswith(".") else s + "."


def _regions_to_drop(
    report: Any, run: Callable[[set], Any], order: list[Region], earlier: bool, applied: Applied
) -> list[tuple[Region, str]] | str:
    """Leave out, one by one, the region the failing check names (or, when it names a block or the root, the
    first region whose removal alone passes, else the first left) until the check passes: ``[(region,
    reason)]`` in that order; or a sentence when the check cannot judge (it skips, or fails with no call).

    Raises:
        ScheduleError: when the calls made before the preset (``earlier``) fail on their own.
    """
    dropped: set = set()
    out: list[tuple[Region, str]] = []
    while report.status != "passed":
        if report.status == "skipped":
            return report.message
        left = [r for r in order if r.key not in dropped]
        if not left and not earlier:  # no call at all fails: the check cannot judge this model
            return f"with no call at all the check already reports a difference ({_lower(report.message)})"
        if not left:  # the calls made before the preset fail on their own
            raise ScheduleError(
                f"The schedule fails the numeric check before the preset ({_lower(report.message).rstrip('.')}); "
                "undo or fix that first, then apply the preset."
            )
        culprit = _region_of(report.module, applied.owned)
        if culprit is None or culprit.key in dropped:  # a block or the root: try each region alone first
            alone = next((r for r in left if run(dropped | {r.key}).status == "passed"), None)
            if alone is not None:
                out.append((alone, f"it fails the numeric check when {alone.done}: {_lower(report.message)}"))
                return out
            culprit = left[0]
        out.append((culprit, f"it fails the numeric check when {culprit.done}: {_lower(report.message)}"))
        dropped.add(culprit.key)
        report = run(dropped)
    return out


class WholeRefused(ScheduleError):
    """A preset checked as a whole (:func:`gate`'s ``whole``) fails the numeric check; the schedule is as
    before the preset."""


class RegionRefused(Exception):
    """A primitive refused a call of ``region``: keep it whole (``reason`` is the refusal's sentence)."""

    def __init__(self, region: Region, reason: str) -> None:
        super().__init__(reason)
        self.region = region
        self.reason = reason


def _checked(sch, earlier: list[Call], applied: Applied, before, whole: str | None):
    """:func:`_check_regions`; a :class:`WholeRefused` leaves the schedule as before the preset."""
    try:
        return _check_regions(sch, earlier, applied, before, whole)
    except WholeRefused:
        before.restore()
        raise


def _check_regions(sch, earlier: list[Call], applied: Applied, before, whole: str | None = None):
    """None when the preset's calls check ✓ (after ``earlier``); a list of ``(region, reason)`` whose removal
    makes them check ✓; or a sentence when the check cannot run.

    Raises:
        ScheduleError: when even no region of the preset checks ✓ (then ``earlier`` alone fails), or, with
            ``whole``, when the calls fail the check (``whole`` then the check's sentence).
    """
    ref, from_config, undo = _reference(sch, len(earlier))
    if ref is None:
        return from_config
    inputs = _inputs(sch, ref)
    if inputs is None:
        return "no example inputs (pass example_inputs= to the editor, or set_example_inputs on the schedule)"
    after = Snapshot(sch) if undo else None
    if undo:  # the model of the user's own classes, unscheduled again for the check
        before.restore()
    pairs = list(zip(applied.calls, applied.region_of_call, strict=True))

    def run(dropped: set):
        calls = earlier + [c for c, r in pairs if r.key not in dropped]
        return numeric_check(
            ref, calls, sch.world_size, inputs, timeout=GATE_TIMEOUT, from_config=from_config
        )

    try:
        report = run(set())
        if report.status == "passed":
            return None
        if report.status == "skipped":
            return report.message
        if whole is not None:
            raise WholeRefused(f"{whole} {_lower(report.message)}")
        order = list(dict.fromkeys(r for _, r in pairs))
        return _regions_to_drop(report, run, order, bool(earlier), applied)
    finally:
        if undo:
            after.restore()
