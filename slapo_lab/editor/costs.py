"""The editor's cost panel: per-rank memory per pipeline stage as a stacked bar chart (inline SVG).

Reads a :class:`slapo_lab.plan.Plan`; draws one bar per stage (one rank of that stage) split into
parameters, gradients, optimizer states, activations and, under FSDP, the all-gather working set, with
the chosen GPU's memory as a line.
Colours are fixed six-digit hex; text uses JupyterLab's theme font colour, so light and dark both read.
"""

from __future__ import annotations

import html

from ..utils import human_bytes

GPU_SIZES = {
    "80 GB (A100/H100)": 80e9,
    "141 GB (H200)": 141e9,
    "24 GB": 24e9,
    "40 GB": 40e9,
    "192 GB (B200)": 192e9,
}
PARTS = (
    ("param_bytes", "parameters", "#4c78a8"),
    ("grad_bytes", "gradients", "#f58518"),
    ("optimizer_bytes", "optimizer (Adam)", "#54a24b"),
    ("activation_bytes", "activations", "#b279a2"),
    ("gather_bytes", "FSDP all-gather", "#9d755d"),
)


def cost_chart_svg(plan, gpu_bytes: float, width: int = 520, bar_h: int = 22) -> str:
    """An SVG bar chart of ``plan.per_stage`` (bytes of one rank per stage) against ``gpu_bytes``.

    Args:
        plan: a Plan (``per_stage`` dicts with the byte fields of :data:`PARTS`).
        gpu_bytes: the GPU memory line, in bytes (decimal GB as vendors state them).
    Returns:
        SVG text (no scripts), ``width`` px wide, one row of ``bar_h`` px per stage plus a legend.
    """
    stages = plan.per_stage
    busiest = max(s["total_bytes"] for s in stages) or 1
    off_scale = gpu_bytes > 20 * busiest  # a tiny model: draw to the data's scale, the GPU line at the edge
    peak = busiest * 1.1 if off_scale else max(busiest, gpu_bytes)
    left, right = 70, 80
    scale = (width - left - right) / peak
    rows = []
    y = 18
    for s in stages:
        x = left
        label = f"stage {s['stage']}" if len(stages) > 1 else "each rank"
        rows.append(f"<text x='4' y='{y + bar_h * 0.7:.0f}' class='t'>{html.escape(label)}</text>")
        for key, name, colour in PARTS:
            v = s.get(key) or 0
            w = v * scale
            if w > 0:
                rows.append(
                    f"<rect x='{x:.1f}' y='{y}' width='{max(w, 0.5):.1f}' height='{bar_h}' fill='{colour}'>"
                    f"<title>{html.escape(name)}: {human_bytes(v)}</title></rect>"
                )
            x += w
        over = s["total_bytes"] > gpu_bytes
        rows.append(
            f"<text x='{x + 4:.1f}' y='{y + bar_h * 0.7:.0f}' class='t{' over' if over else ''}'>"
            f"{human_bytes(s['total_bytes'])}</text>"
        )
        y += bar_h + 6
    gx = width - right + 10 if off_scale else left + gpu_bytes * scale
    tag = f"GPU {gpu_bytes / 1e9:.0f} GB" + (" (off scale)" if off_scale else "")
    rows.append(
        f"<line x1='{gx:.1f}' y1='8' x2='{gx:.1f}' y2='{y}' stroke='#d62728' stroke-width='2' "
        f"stroke-dasharray='5,3'/><text x='{max(gx - 110, left):.1f}' y='12' class='t' fill='#d62728'>"
        f"{tag}</text>"
    )
    lx = left
    y += 8
    for key, name, colour in PARTS:
        if key == "gather_bytes" and not any(s.get(key) for s in stages):
            continue  # only under FSDP
        if lx > left and lx + 14 + 7 * len(name) > width:  # the next legend row
            lx, y = left, y + 16
        rows.append(
            f"<rect x='{lx}' y='{y}' width='10' height='10' fill='{colour}'/>"
            f"<text x='{lx + 14}' y='{y + 9}' class='t'>{html.escape(name)}</text>"
        )
        lx += 16 + 7 * len(name)
    height = y + 18
    style = (
        "<style>.t{font:11px var(--jp-ui-font-family, sans-serif);fill:var(--jp-ui-font-color1,#222222)}"
        ".over{fill:#d62728;font-weight:bold}</style>"
    )
    return (
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
        f"viewBox='0 0 {width} {height}'>{style}{''.join(rows)}</svg>"
    )


_SHARDS = {"fsdp": "FSDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2"}


def cost_summary(plan, gpu_bytes: float) -> str:
    """One line: the busiest rank's bytes, the layout (``stages × TP × DP, FSDP``) and whether it fits the GPU."""
    busiest = plan.total_bytes
    fits = busiest <= gpu_bytes
    dp = getattr(plan, "dp", 1)
    shard = _SHARDS.get(getattr(plan, "shard", None) or "") if dp > 1 else None
    layout = (
        f"{plan.num_stages} stage(s) × TP {plan.world_size}"
        + (f" × DP {dp}" if dp > 1 else "")
        + (f", {shard}" if shard else "")
    )
    return (
        f"Busiest rank needs {human_bytes(busiest)} ({layout} = {plan.num_ranks} GPUs): "
        f"{'fits' if fits else 'does NOT fit'} in {gpu_bytes / 1e9:.0f} GB."
    )


_SHAPES = (
    "shapes cannot be multiplied",
    "size mismatch",
    "must match the size",
    "broadcast",
    "mismatching",
    "size of tensor",
    "shape",
    "expected input",
)
_VALUES = ("item()", "data-dependent", "on meta tensors", "meta tensor")


def _root_cause(err: BaseException) -> BaseException:
    seen = set()
    while err.__cause__ is not None and id(err) not in seen:
        seen.add(id(err))
        err = err.__cause__
    return err


def memory_failure(err: BaseException, what: str) -> str:
    """One sentence for the memory line when a plan (or its activation pass) failed.

    Says what failed, where (the innermost module running, from ``err.module`` as set by
    :func:`slapo_lab.plan.plan`'s activation pass) and why, in words: the exception's own text is never
    included (callers log it). Example::

        activations not estimated: the meta forward pass failed in encoder.layer.0.intermediate.dense
        because tensor shapes do not match, usually a weight sharded without its bias or its partner layer.

    Args:
        err: the exception raised by ``plan`` (a ScheduleError chained to the pass's error, or any other).
        what: the sentence's subject, e.g. ``"Memory plan unavailable"``.
    Returns:
        One sentence ending in a full stop.
    """
    cause = _root_cause(err)
    text = str(cause).lower()
    module = getattr(err, "module", None)
    if module is None and cause is not err:
        module = getattr(cause, "_slapo_failed_in", None)
    if isinstance(cause, MemoryError):
        why = "the planning process ran out of memory"
    elif any(s in text for s in _VALUES):
        why = "the model reads tensor values, which meta tensors do not have"
    elif any(s in text for s in _SHAPES):
        why = "tensor shapes do not match, usually a weight sharded without its bias or its partner layer"
    else:
        why = f"of an unexpected {type(cause).__name__}; the details are in the log"
    if module is not None:
        where = f"in {module}" if module else "in the model's own forward"
        return f"{what}: the meta forward pass failed {where} because {why}."
    if cause is err and type(err).__name__ == "ScheduleError" and str(err).strip():
        # the engine's own one-sentence refusal (no wrapped exception): it already says what and why
        sentence = str(err).strip().splitlines()[0].rstrip(".")
        return f"{what}: {sentence[:1].lower() + sentence[1:]}."
    return f"{what}: the plan could not be computed because {why}."
