"""The editor's inspector panel: the selected module's details, its action buttons and why each may not apply.

:class:`InspectorPanel` holds the editor (the :class:`~slapo_lab.editor.state.EditorState` it draws) and inherits
nothing from it. It shows the selected module's tensors (global and this rank's shape, the shard axis), its
inputs and outputs from the dataflow, and its schedule state (checkpointed, a stage's end, its syncs); the
shard / sync / checkpoint / cut buttons with "apply to all similar", each button's reason
(:func:`slapo_lab.check_primitive`: ``""`` when it applies, else one sentence, also sent to the browser's context
menus and keys); and the presets. Each button calls the state's public ``apply`` / ``apply_preset``.
"""

from __future__ import annotations

import html

import ipywidgets as W

from .. import check_primitive, module_state
from ..call_order import cached_call_order
from ..utils.collector import running_loop
from .form_button import FormButton

__all__ = ["SYNC_CHOICES", "InspectorPanel"]

SYNC_CHOICES = [
    ("fwd_post · all_reduce (after a row-parallel layer)", ("fwd_post", "all_reduce")),
    ("bwd_post · all_reduce (before a column-parallel layer)", ("bwd_post", "all_reduce")),
]


def _io_text(v) -> str:
    """``[{"name": "x", "shapes": [(8, 128)], "dtypes": ["float32"]}]`` → ``x 8×128 float32``."""
    if not isinstance(v, list):
        return str(v)
    parts = []
    for d in v:
        if isinstance(d, dict):
            shapes = "/".join("×".join(map(str, sh)) for sh in d.get("shapes", []))
            parts.append(
                " ".join(x for x in (str(d.get("name", "")), shapes, "/".join(d.get("dtypes", []))) if x)
            )
    return ", ".join(parts)


class InspectorPanel:
    """The selected module's details, the action buttons with their reasons, and the presets.

    Args:
        editor: the editor (its state: ``schedule``, ``selected``, ``level``, ``rank``, ``similar``, ``apply``,
            ``apply_preset``, the dataflow ``_flow``, the graph widget the reasons are sent to, the message line).

    Attributes:
        inspector (``HTML``), param / axis / sync (``Dropdown``), similar (``Checkbox``: apply to all similar),
        btn_shard, btn_sync, btn_ckpt, btn_cut, btn_preset (:class:`~slapo_lab.editor.form_button.FormButton`),
        reasons, similar_info (``HTML``), preset (``Dropdown``), preset_k (``BoundedIntText``), actions (the
        buttons' ``VBox``), box (the right column: inspector, actions, presets).
    """

    def __init__(self, editor) -> None:
        self.editor = ed = editor
        self.inspector = W.HTML()
        self.inspector.add_class("slapo-inspector")
        self.param = W.Dropdown(description="tensor", layout=W.Layout(width="95%"))
        self.axis = W.Dropdown(description="axis", options=[0, 1], layout=W.Layout(width="95%"))
        self.param.observe(lambda ch: self.update_axes(), names="value")
        self.sync = W.Dropdown(options=SYNC_CHOICES, description="sync", layout=W.Layout(width="95%"))
        self.similar = W.Checkbox(
            value=False,
            description="apply to all similar",
            indent=False,
            tooltip="also apply to the modules of the same type at the same relative "
            "path in every repeated block",
        )
        # each click carries the page's values of the choices it reads (FormButton: never a stale choice)
        self.btn_shard = FormButton(
            [self.param, self.axis, self.similar],
            description="shard",
            icon="cut",
            tooltip="shard(tensor, axis)",
        )
        self.btn_sync = FormButton([self.sync, self.similar], description="sync", icon="exchange")
        self.btn_ckpt = FormButton([self.similar], description="checkpoint", icon="history")
        self.btn_cut = FormButton([self.similar], description="cut pipeline stage", icon="scissors")
        for b in (self.btn_shard, self.btn_sync, self.btn_ckpt, self.btn_cut):
            b.layout = W.Layout(width="95%")
        self.btn_shard.on_click(lambda _: self.on_shard())
        self.btn_sync.on_click(
            lambda _: ed.apply("sync", mode=self.sync.value[0], sync_op_or_fn=self.sync.value[1])
        )
        self.btn_ckpt.on_click(lambda _: ed.apply("checkpoint"))
        self.btn_cut.on_click(lambda _: ed.apply("cut_pipeline_stage"))
        self.reasons = W.HTML()
        self.similar_info = W.HTML()
        self.actions = W.VBox(
            [
                self.param,
                self.axis,
                self.btn_shard,
                self.sync,
                self.btn_sync,
                self.btn_ckpt,
                self.btn_cut,
                self.similar,
                self.similar_info,
                self.reasons,
            ]
        )
        self.preset = W.Dropdown(
            options=[
                ("Megatron tensor parallelism (every block)", "megatron"),
                ("Megatron + sequence parallelism", "megatron_sp"),
                ("HF base_model_tp_plan (from the config)", "hf_plan"),
                ("checkpoint every k-th block", "checkpoint"),
                ("cut into N balanced pipeline stages", "stages"),
            ],
            description="preset",
            layout=W.Layout(width="95%"),
        )
        self.preset_k = W.BoundedIntText(
            value=1, min=1, max=4096, description="k / N", layout=W.Layout(width="95%")
        )
        self.btn_preset = FormButton(
            [self.preset, self.preset_k],
            description="apply preset",
            icon="magic",
            layout=W.Layout(width="95%"),
        )
        self.btn_preset.on_click(lambda _: ed.apply_preset(self.preset.value, self.preset_k.value))
        narrow = {"description_width": "48px"}
        for w in (self.param, self.axis, self.sync, self.preset, self.preset_k):
            w.style = narrow
        self.box = W.VBox(
            [
                W.HTML("<b>Inspector</b>"),
                self.inspector,
                self.actions,
                W.HTML("<b>Presets</b>"),
                self.preset,
                self.preset_k,
                self.btn_preset,
            ],
            layout=W.Layout(width="30%"),
        )

    def on_shard(self) -> None:
        """The shard button: shard the chosen tensor on the chosen axis, or say why there is nothing to shard."""
        ed = self.editor
        if self.param.value is None:
            ed._error(
                f"{ed.selected or 'The root module'} ({type(ed.schedule[ed.selected].mod).__name__}) "
                "has no parameters or buffers of its own to shard; select one of its submodules."
            )
            return
        ed.apply("shard", self.param.value, axis=self.axis.value)

    def select_similar(self) -> None:
        """Highlight the modules similar to the selected one and tick "apply to all similar" for the next action."""
        ed = self.editor
        found = ed.similar(ed.selected) if ed.selected else [ed.selected]
        if len(found) < 2:
            ed._error(
                f"{ed.selected or 'The root module'} has no modules of the same type at the same place in "
                "other repeated blocks."
            )
            return
        ed._graph.highlight(found, centre=False)
        self.similar.value = True
        ed._info(
            f"Selected {len(found)} similar modules ({found[0]} … {found[-1]}); the next action applies to all of them."
        )

    def refresh(self) -> None:
        """Show the selected module: its tensors, inputs and outputs, schedule state, the similar count, the
        shard choices and every button's reason."""
        ed = self.editor
        node = ed.schedule[ed.selected]
        mod = node.mod
        rows = []
        tensors = [(n, t, "param") for n, t in mod.named_parameters(recurse=False)] + [
            (n, t, "buffer") for n, t in mod.named_buffers(recurse=False)
        ]
        for n, t, _kind in tensors:
            full = tuple(getattr(t, "orig_shape", t.shape))
            local = tuple(t.shape)
            axis = getattr(t, "shard_axis", None)
            rows.append(
                f"<tr><td>{html.escape(n)}</td><td>{'×'.join(map(str, full)) or 'scalar'}</td>"
                f"<td>{'×'.join(map(str, local)) or 'scalar'}</td><td>{'' if axis is None else axis}</td></tr>"
            )
        total = sum(p.numel() for p in mod.parameters())
        table = (
            (
                "<table class='slapo-params'><tr><th>tensor</th><th>global</th>"
                f"<th>rank {ed.rank}</th><th>axis</th></tr>" + "".join(rows) + "</table>"
            )
            if rows
            else "<i>no parameters of its own</i>"
        )
        flow = ""
        if ed._flow is not None:
            try:
                info = ed._flow.module_info(ed.selected)
                ins = info.get("inputs") or info.get("input_shapes")
                outs = info.get("outputs") or info.get("output_shapes")
                if ins or outs:
                    flow = (
                        f"<div class='slapo-io'>in: {html.escape(_io_text(ins))}<br>"
                        f"out: {html.escape(_io_text(outs))}</div>"
                    )
            except Exception:  # noqa: BLE001 - reported, never raised past this point
                flow = ""
        meta = module_state(mod)
        state = []
        if meta and meta.checkpoint:
            state.append("checkpointed")
        if meta and meta.cut:
            state.append("ends a pipeline stage")
        for mode, op in meta.syncs if meta else ():
            state.append(f"sync {mode} {op}")
        self.inspector.value = (
            f"<div><b>{html.escape(ed.selected or '(model)')}</b><br>{html.escape(type(mod).__name__)} · "
            f"{total:,} parameters (this rank)</div>{table}{flow}"
            + (f"<div>{html.escape(', '.join(state))}</div>" if state else "")
        )
        names = [n for n, _, _ in tensors]
        shard_display = None if names else "none"
        for w in (self.param, self.axis, self.btn_shard):
            w.layout.display = shard_display
        self.param.options = names
        if names:
            self.param.value = "weight" if "weight" in names else names[0]
        self.update_axes()

    def refresh_similar(self) -> None:
        """The "N similar modules" line under the buttons."""
        ed = self.editor
        n_sim = len(ed.similar(ed.selected)) if ed.selected else 1
        self.similar_info.value = f"<small>{n_sim} similar modules</small>" if n_sim > 1 else ""

    def update_axes(self) -> None:
        """The axis choices of the chosen tensor (0 for a scalar), then the reasons."""
        node = self.editor.schedule[self.editor.selected]
        name = self.param.value
        t = None
        if name is not None:
            t = dict(node.mod.named_parameters(recurse=False)).get(name)
            if t is None:
                t = dict(node.mod.named_buffers(recurse=False)).get(name)
        dims = list(range(t.dim())) if t is not None and t.dim() else [0]
        self.axis.options = dims
        self.axis.value = 0 if 0 in dims else dims[0]
        self.refresh_reasons()

    def refresh_reasons(self) -> None:
        """Each action button's reason (:func:`slapo_lab.check_primitive`) as its tooltip and colour, the list
        of reasons under the buttons, and the same to the browser's menus and keys."""
        ed = self.editor
        node = ed.schedule[ed.selected]
        reasons = {}
        if self.param.value is None:
            reasons[self.btn_shard] = f"{ed.selected or 'The root module'} has no parameters of its own."
        else:
            reasons[self.btn_shard] = check_primitive(node, "shard", self.param.value, axis=self.axis.value)
        mode, op = self.sync.value
        reasons[self.btn_sync] = check_primitive(node, "sync", mode=mode, sync_op_or_fn=op)
        reasons[self.btn_ckpt] = check_primitive(node, "checkpoint")
        if running_loop() is not None and cached_call_order(ed.schedule) is None:
            reasons[self.btn_cut] = (
                None  # recorded in the background (a kernel): the button checks when clicked
            )
        else:
            reasons[self.btn_cut] = check_primitive(node, "cut_pipeline_stage")
        lines = []
        for btn, why in reasons.items():
            btn.tooltip = why or ""
            btn.button_style = "" if why else "primary"
            if why:
                lines.append(f"<li><b>{html.escape(btn.description)}</b>: {html.escape(why)}</li>")
        # Buttons stay clickable: a click on an invalid action explains itself in the message line.
        self.reasons.value = f"<ul class='slapo-reasons'>{''.join(lines)}</ul>" if lines else ""
        self.sync_action_reasons()

    def sync_action_reasons(self) -> None:
        """Send the selected module's per-action reasons (the buttons' tooltips) to the browser's context
        menus and keys: action -> "" when it applies, else the one sentence why not."""
        ed = self.editor
        sel = ed.selected
        node = ed.schedule[sel]
        name = sel or "The root module"
        n_similar = len(ed.similar(sel)) if sel else 1
        reasons = {
            "checkpoint": self.btn_ckpt.tooltip,
            "cut": self.btn_cut.tooltip,
            "shard": self.btn_shard.tooltip,
            "sync": self.btn_sync.tooltip,
            "open": "" if node.child else f"{name} has no submodules to open.",
            "up": "" if ed.level else "The graph already shows the top level of the model.",
            "similar": ""
            if n_similar > 1
            else f"{name} has no modules of the same type at the same place in other repeated blocks.",
        }
        mode, op = self.sync.value
        op_name = op if isinstance(op, str) else getattr(op, "__name__", "fn")
        labels = {
            "shard": f"Shard {self.param.value} on axis {self.axis.value}"
            if self.param.value is not None
            else "Shard…",
            "sync": f"Sync {op_name} ({mode})",
            "similar": f"Select similar ({n_similar} modules)" if n_similar > 1 else "Select similar",
        }
        ed._graph.set_action_reasons(sel, reasons, labels)
