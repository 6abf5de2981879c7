"""The editor's Export form: the training run's options (the exported script's defaults) and the Export button.

:class:`ExportPanel` holds the editor (the :class:`~slapo_lab.editor.state.EditorState` it exports) and inherits
nothing from it. Its fields are the options of :data:`slapo_lab.export.script.EXPORT_OPTIONS` that a form shows,
labelled from their :mod:`slapo_lab.train.config` metadata; Export calls ``editor.export(path, launcher=...,
**options)``. dp, FSDP and ZeRO also drive the memory view (:meth:`ExportPanel.plan_layout`); an applied plan fills
the form (:meth:`ExportPanel.fill_from_plan`).
"""

from __future__ import annotations

import functools
import html
import os
from typing import Any

import ipywidgets as W

from ..train.config import option_fields
from .export_form import _INT_OPTIONS, _LABELS, _PATH_OPTIONS, _SCRIPT_STEPS, _export_error
from .form_button import FormButton

__all__ = ["FIELDS", "ExportPanel"]

# the form's text fields: option -> tooltip (the label is the option's, slapo_lab.train.config)
FIELDS = {
    "model_path": "a Hugging Face directory (config.json + *.safetensors) to fine-tune; empty: seeded random weights",
    "tokenizer": "the tokenizer directory; empty: the model path",
    "data": (
        "'synthetic' (random inputs shaped like the example: a benchmark), or a .txt / .jsonl / "
        ".parquet file or a folder of them"
    ),
    "seq_len": "tokens per training sequence",
    "dp": "data-parallel replicas: the run uses tp x pp x dp processes",
    "global_batch_size": "sequences per optimizer step over all replicas (divisible by dp)",
    "micro_batch_size": "sequences per forward pass and replica; empty: the global batch / (dp x pipeline stages)",
    "steps": "optimizer steps to train for",
    "checkpoint_dir": "save resumable checkpoints here (created if missing); empty: none",
    "checkpoint_every": "save a checkpoint every N steps (0: only at the end)",
    "save_hf": "at the end, write a Hugging Face directory that from_pretrained loads; empty: none",
}


#: the export options of an applied plan that no field shows: the script prints its measurements against them
_PREDICTION = ("predicted_step_s", "predicted_peak_gib")


class ExportPanel:
    """The Export form.

    Args:
        editor: the editor (its state: ``model``, ``export``, the example sizes, the message line, and the
            memory view and cluster line it redraws when dp, FSDP or ZeRO change).

    Attributes:
        box: the form (``ipywidgets.VBox``); fields: option -> its widget; f_launcher, f_dp, f_fsdp, f_zero,
        f_batch, f_micro, f_seq ...: the fields by name; export_path: the script's file name; btn_export;
        export_info: the line under the form (what was written, or why not).
    """

    def __init__(self, editor) -> None:
        self.editor = editor
        self._build(type(editor.model).__name__)

    def _build(self, name: str) -> None:
        """The Export form: model, data, parallelism, batch and steps, checkpoints; the script path and the
        Export button last. dp / FSDP / ZeRO also drive the memory view."""
        self.updating = False
        self.prediction: dict = {}  # an applied plan's predicted_step_s / predicted_peak_gib (export options)
        wide, narrow = W.Layout(width="340px"), W.Layout(width="190px")
        style = {"description_width": "84px"}
        fields: dict[str, W.Widget] = {}
        for key, tip in FIELDS.items():
            w = W.Text(
                description=option_fields()[key][1].metadata["label"],
                tooltip=tip,
                placeholder=tip.split("; ")[-1] if "; " in tip else "",
                layout=wide if key in _PATH_OPTIONS else narrow,
                style=style,
            )
            fields[key] = w
        fields["dp"].continuous_update = False
        self.f_launcher = W.Dropdown(
            options=["torchrun", "deepspeed"],
            value="torchrun",
            description="launcher",
            layout=narrow,
            style=style,
        )
        self.f_fsdp = W.Checkbox(
            value=False,
            description="FSDP",
            indent=False,
            layout=W.Layout(width="90px"),
            tooltip="shard parameters, gradients and optimizer states over dp (FSDP2)",
        )
        self.f_zero = W.Dropdown(
            options=[("0: none", 0), ("1: optimizer states", 1), ("2: + gradients", 2)],
            value=0,
            description="ZeRO",
            layout=W.Layout(width="240px", display="none"),
            style=style,
            tooltip="the DeepSpeed ZeRO stage: what is sharded over dp",
        )
        fields["fsdp"], fields["zero"] = self.f_fsdp, self.f_zero
        self.fields = fields
        self.f_model, self.f_tokenizer, self.f_data = (
            fields["model_path"],
            fields["tokenizer"],
            fields["data"],
        )
        self.f_seq, self.f_dp, self.f_batch, self.f_steps = (
            fields["seq_len"],
            fields["dp"],
            fields["global_batch_size"],
            fields["steps"],
        )
        self.f_micro = fields["micro_batch_size"]
        self.f_ckpt, self.f_ckpt_every, self.f_save_hf = (
            fields["checkpoint_dir"],
            fields["checkpoint_every"],
            fields["save_hf"],
        )
        for w in (self.f_launcher, self.f_dp, self.f_fsdp, self.f_zero):
            w.observe(self.on_layout_change, names="value")
        self.export_path = W.Text(
            value=f"train_{name.lower()}.py", description="script", layout=wide, style=style
        )
        self.btn_export = FormButton(
            [self.f_launcher, *fields.values(), self.export_path],
            description="Export",
            icon="download",
            button_style="primary",
            tooltip="write the training script with these options as its defaults",
        )
        self.btn_export.on_click(lambda _: self.on_export())
        self.export_info = W.HTML()
        row = functools.partial(W.HBox, layout=W.Layout(flex_flow="row wrap", align_items="center"))
        self.box = W.VBox(
            [
                W.HTML(
                    "<b>Export a training run</b> (the script's defaults; its command line overrides them)"
                ),
                row([self.f_model, self.f_tokenizer]),
                row([self.f_data, self.f_seq]),
                row([self.f_launcher, self.f_dp, self.f_fsdp, self.f_zero]),
                row([self.f_batch, self.f_micro, self.f_steps]),
                row([self.f_ckpt, self.f_ckpt_every, self.f_save_hf]),
                row([self.export_path, self.btn_export]),
                self.export_info,
            ]
        )
        self.box.add_class("slapo-export")
        self.set_form(None, refresh=False)

    def show_export(self, out, cmd: str) -> None:
        self.export_info.value = (
            f"<div class='slapo-export-info'>Wrote <code>{html.escape(str(out))}</code>. "
            f"Launch: <code>{html.escape(cmd)}</code></div>"
        )

    def form_defaults(self) -> dict:
        """The form's values before any export: the script's defaults, the model path of a model that
        ``from_pretrained`` read from a local directory."""
        batch, seq = self.editor.export_form.example_sizes()
        name = getattr(getattr(self.editor.model, "config", None), "_name_or_path", "")
        model_path = name if isinstance(name, str) and name and os.path.isdir(name) else ""
        return {
            "model_path": model_path,
            "tokenizer": "",
            "data": "synthetic",
            "seq_len": seq,
            "dp": 1,
            "fsdp": False,
            "zero": 0,
            "checkpoint_dir": "",
            "checkpoint_every": 0,
            "save_hf": "",
            "global_batch_size": batch or 1,
            "micro_batch_size": None,
            "steps": _SCRIPT_STEPS,
        }

    def set_form(self, remembered: dict | None, refresh: bool = True) -> None:
        """Show ``remembered`` (``export_options``) in the form; what it lacks shows the script's defaults.
        Values of the wrong type are skipped (a hand-edited schedule file)."""
        values = self.form_defaults()
        if remembered is not None:
            values["model_path"] = ""  # the export used no model path unless it says so
            values.update({k: v for k, v in (remembered.get("options") or {}).items() if k in values})
        self.updating = True
        try:
            for key, w in self.fields.items():
                v = values.get(key)
                if isinstance(w, W.Checkbox):
                    w.value = bool(v) if isinstance(v, bool) else False
                elif key == "zero":
                    w.value = v if v in (0, 1, 2) else 0
                else:
                    w.value = (
                        "" if v is None or isinstance(v, bool) or not isinstance(v, (str, int)) else str(v)
                    )
            if remembered is not None:
                if remembered.get("launcher") in ("torchrun", "deepspeed"):
                    self.f_launcher.value = remembered["launcher"]
                if isinstance(remembered.get("script"), str) and remembered["script"]:
                    self.export_path.value = remembered["script"]
        finally:
            self.updating = False
        self.on_launcher()
        if refresh:
            self.editor._refresh_costs()

    def fill_from_plan(self, options: dict) -> None:
        """Put an applied plan's options (:meth:`~slapo_lab.editor.planning.PlanController.export_kwargs`) into the
        form: the launcher, dp, FSDP or the ZeRO stage, the global and micro batch, the sequence length; the other
        fields keep what they show. The plan's prediction goes into the exported script (which prints its
        measurements as ratios to it) until a layout field is changed. The memory view then replans."""
        self.updating = True
        self.prediction = {k: options[k] for k in _PREDICTION if options.get(k) is not None}
        try:
            self.f_launcher.value = options.get("launcher", self.f_launcher.value)
            for key, v in options.items():
                w = self.fields.get(key)
                if w is None:
                    continue
                if isinstance(w, W.Checkbox):
                    w.value = bool(v)
                elif key == "zero":
                    w.value = v if v in (0, 1, 2) else 0
                else:
                    w.value = "" if v is None else str(v)
            if self.f_launcher.value == "torchrun":
                self.f_zero.value = 0
            else:
                self.f_fsdp.value = False
        finally:
            self.updating = False
        self.on_launcher()
        self.editor._refresh_cluster()
        self.editor._refresh_costs()

    def form_options(self) -> tuple[str, str, dict]:
        """``(launcher, script path, options)`` read off the form; numbers parsed, empty text = the default.

        Raises:
            ExportError: a field that is not a whole number, in one sentence (the fields keep what was typed).
        """
        launcher = self.f_launcher.value
        options: dict[str, Any] = {}
        for key, w in self.fields.items():
            if key == "fsdp":
                if launcher == "torchrun":
                    options[key] = bool(w.value)
            elif key == "zero":
                if launcher == "deepspeed":
                    options[key] = int(w.value)
            elif key in _INT_OPTIONS:
                text = str(w.value).strip()
                if not text:
                    continue
                try:
                    options[key] = int(text)
                except ValueError:
                    raise _export_error(f"The {_LABELS[key]} must be a whole number, not {text!r}.") from None
            else:
                options[key] = str(w.value).strip()
        options.update(self.prediction)  # the applied plan's, until a layout field changes
        path = self.export_path.value.strip()
        if not path:
            raise _export_error("Give the script a file name, e.g. train.py.")
        return launcher, path, options

    def plan_layout(self) -> tuple[int, str | None, str]:
        """``(dp, shard, note)`` for the memory plan, from the form: the note says when dp is unreadable."""
        text = str(self.f_dp.value).strip()
        try:
            dp = int(text) if text else 1
        except ValueError:
            dp = 0
        note = ""
        if dp < 1:
            note = (
                f" <i>(dp {html.escape(repr(text))} is not a positive whole number, so this plans dp 1)</i>"
            )
            dp = 1
        if self.f_launcher.value == "deepspeed":
            shard = {1: "zero1", 2: "zero2"}.get(self.f_zero.value)
        else:
            shard = "fsdp" if self.f_fsdp.value else None
        return dp, shard, note

    def on_launcher(self) -> None:
        """FSDP with torchrun, a ZeRO stage with deepspeed."""
        deepspeed = self.f_launcher.value == "deepspeed"
        self.f_fsdp.layout.display = "none" if deepspeed else None
        self.f_zero.layout.display = None if deepspeed else "none"

    def on_layout_change(self, _change=None) -> None:
        """dp, FSDP, ZeRO or the launcher changed in the form: replan the memory view."""
        if self.updating:
            return
        self.prediction = {}  # another layout than the applied plan's: its prediction no longer holds
        with self.editor._lock:
            self.on_launcher()
            self.editor._refresh_cluster()
            self.editor._refresh_costs()

    def on_export(self) -> None:
        try:
            launcher, path, options = self.form_options()
            self.editor.export(path, launcher=launcher, **options)
        except Exception as err:  # noqa: BLE001 - reported, never raised past this point
            text = str(err) or type(err).__name__
            self.editor._error(text)
            self.export_info.value = (
                f"<div class='slapo-export-info slapo-err'>&#9888; {html.escape(text)}</div>"
            )
