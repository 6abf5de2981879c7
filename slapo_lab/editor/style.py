"""The editor's look of a module, pure functions of the schedule (no widgets): one visual channel per fact.

Fill = tensor parallelism (column / row parallel, or "contains sharded modules"), band on the left = pipeline
stage, dashed border = checkpointed, bar on the outgoing edges = cut, halo (the browser draws it) = selected;
short badges repeat them in text (``TP col``, ``AR fwd``, ``ckpt``, ``stage 1``, ``cut``). The colours live in
:mod:`slapo_lab.graph.render`, which draws them; :func:`legend_html` explains them.
"""

from __future__ import annotations

from typing import Any

from ..graph import legend_svg
from ..graph.render import (
    CHECKPOINT_COLOUR,
    COLUMN_COLOUR,
    CUT_COLOUR,
    ROW_COLOUR,
    SELECTED_COLOUR,
    STAGE_COLOURS,
    TP_INSIDE_COLOUR,
)
from ..module_state import ModuleMeta, peek_meta

__all__ = ["folded_style", "legend_html", "module_style"]

#: Badge abbreviations of the collectives a sync runs.
OPS = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "scatter": "SC"}


def _sharded_inside(mod) -> bool:
    return any((meta := peek_meta(m)) and meta.sharded for m in mod.modules())


def module_style(sch, path: str, stage_of: dict[str, int] | None = None) -> dict[str, Any]:
    """The look of the module at ``path`` of schedule ``sch``: ``fill``, ``band``, ``dashed``, ``cut`` and
    ``badges`` (what :func:`slapo_lab.graph.render_svg` reads); ``stage_of`` maps paths to pipeline stages
    (None: no cuts). Empty for a path that is not in the schedule."""
    if path not in sch:
        return {}
    mod = sch[path].mod
    meta = peek_meta(mod) or ModuleMeta()
    badges, fill = [], None
    if meta.sharded:
        partial = meta.output_type == "partial"
        badges.append("TP row" if partial else "TP col")
        fill = ROW_COLOUR if partial else COLUMN_COLOUR
    elif _sharded_inside(mod):
        fill = TP_INSIDE_COLOUR
        badges.append("TP inside")
    for mode, op in meta.syncs:
        op_name = op if isinstance(op, str) else getattr(op, "__name__", "fn")
        badges.append(f"{OPS.get(op_name, op_name)} {str(mode).split('_')[0]}")
    style: dict[str, Any] = {}
    if meta.checkpoint:
        badges.append("ckpt")
        style["dashed"] = True
    if meta.cut:
        badges.append("cut")
        style["cut"] = True
    if stage_of is not None and path in stage_of:  # last: the band shows it when badges overflow
        badges.append(f"stage {stage_of[path]}")
        style["band"] = STAGE_COLOURS[stage_of[path] % len(STAGE_COLOURS)]
    if fill:
        style["fill"] = fill
    if badges:
        style["badges"] = badges
    return style


def folded_style(sch, members: list[str], stage_of: dict[str, int] | None) -> dict[str, Any]:
    """A folded run of repeated modules (``members``): the first member's colours, badges that count over all
    members (``TP 3/8``, ``ckpt 4/8``, ``2 cuts``, ``stages 0–1``)."""
    members = [m for m in members if m in sch]
    if not members:
        return {}
    style = {k: v for k, v in module_style(sch, members[0], stage_of).items() if k in ("fill", "band")}
    metas = [peek_meta(sch[m].mod) or ModuleMeta() for m in members]
    if any(m.checkpoint for m in metas):
        style["dashed"] = True
    if metas[-1].cut:
        style["cut"] = True
    badges = _count_badges(sch, members, metas)
    stages = sorted({stage_of[m] for m in members if m in stage_of}) if stage_of is not None else []
    if stages:
        badges.append(f"stage {stages[0]}" if len(stages) == 1 else f"stages {stages[0]}–{stages[-1]}")
        if len(stages) > 1:
            style.pop("band", None)
    if badges:
        style["badges"] = badges
    return style


def _count_badges(sch, members: list[str], metas: list[ModuleMeta]) -> list[str]:
    """The badges that count over a folded run's ``members``: how many are sharded inside (``TP 3/8``),
    checkpointed (``ckpt 4/8``) and end a pipeline stage (``2 cuts``); none for a count of 0."""
    badges = []
    n_tp = sum(_sharded_inside(sch[m].mod) for m in members)
    if n_tp:
        badges.append(f"TP {n_tp}/{len(members)}")
    n_ck = sum(m.checkpoint for m in metas)
    if n_ck:
        badges.append(f"ckpt {n_ck}/{len(members)}")
    n_cut = sum(m.cut for m in metas)
    if n_cut:
        badges.append(f"{n_cut} cut{'s' if n_cut > 1 else ''}")
    return badges


def legend_html(stage_of: dict[str, int] | None) -> str:
    """The legend: one swatch per channel (and per stage, at most 8), the badges explained; light and dark."""
    entries = [
        ("column parallel (partitioned output): TP col", COLUMN_COLOUR),
        ("row parallel (partial sums): TP row", ROW_COLOUR),
        ("contains sharded modules: TP inside", TP_INSIDE_COLOUR),
        ("checkpointed: dashed border, ckpt", CHECKPOINT_COLOUR, "dashed"),
        ("a pipeline stage ends after it: bar on its edges", CUT_COLOUR, "bar"),
        ("selected: halo", SELECTED_COLOUR, "halo"),
    ]
    if stage_of:
        n = max(stage_of.values()) + 1
        entries += [
            (f"stage {i} (band on the left)", STAGE_COLOURS[i % len(STAGE_COLOURS)], "band")
            for i in range(min(n, 8))
        ]
    badges = (
        "<div class='slapo-legend-badges'><small>Badges: <b>TP col</b> / <b>TP row</b> column / row "
        "parallel; <b>AR fwd</b>, <b>AG fwd</b>, <b>RS fwd</b>, <b>AR bwd</b> all-reduce, all-gather, "
        "reduce-scatter after the forward / in the backward; <b>TP 3/8</b>, <b>ckpt 4/8</b> in a folded "
        "run: how many of its modules; <b>+2</b>: two more badges (hover the node for all).</small></div>"
    )
    return (
        "<style>.slapo-legend svg text{fill:var(--jp-ui-font-color1,#222222)}"
        # the dark theme draws node fills see-through and their outlines light (labextension base.css):
        # the swatches follow, so that a legend colour looks like the nodes it explains
        "body[data-jp-theme-light='false'] .slapo-legend svg rect[stroke='#4a5568']"
        "{fill-opacity:0.3;stroke:var(--jp-ui-font-color2)}</style>" + legend_svg(entries) + badges
    )
