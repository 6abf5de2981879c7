"""The Export form without widgets: what the export options mean, how they are checked, and what is baked in.

:class:`ExportForm` is owned by :class:`~slapo_lab.editor.state.EditorState` (``state.export_form``) and holds it.
It reads each option's label, kind and smallest value off :class:`slapo_lab.train.config.TrainConfig`'s fields
(:func:`slapo_lab.train.config.option_fields`), checks a set of options as :meth:`EditorState.export
<slapo_lab.editor.state.EditorState.export>` takes them (:meth:`ExportForm.check`: one sentence per problem, as an
:class:`~slapo_lab.export.ExportError`), writes the script (:func:`slapo_lab.export.export_script`) and says how to
launch it (:func:`slapo_lab.export.script.launch_here`). The form's widgets are
:class:`~slapo_lab.editor.export_panel.ExportPanel`; Verify (:mod:`slapo_lab.editor.verify_panel`) checks its
options here too.
"""

from __future__ import annotations

import json
import math
import os
import shlex
from typing import Any

from ..export import LAUNCHERS, ExportError, export_script
from ..export.script import EXPORT_OPTIONS, launch_here
from ..parallel_dims import ParallelDims
from ..spec import input_spec, objective_of
from ..train.config import BatchOptions, option_fields, option_type
from ..train.preflight import example_sizes, has_tokenizer

__all__ = ["ExportForm"]

# ---------------------------------------------------------------------------------------- export options
# what the Export form checks, read off the options' fields (slapo_lab.train.config): the script's own --steps
# default, the options that are paths (metavar DIR / PATH), the whole-number options and their smallest value,
# and each option's noun in a sentence ("The global batch size must be ...")
_SCRIPT_STEPS = BatchOptions().steps
_PATH_OPTIONS = tuple(
    k for k in EXPORT_OPTIONS if option_fields()[k][1].metadata["metavar"] in ("DIR", "PATH")
)
_INT_OPTIONS = {
    k: option_fields()[k][1].metadata["min"] or 0 for k in EXPORT_OPTIONS if option_type(k) is int
}
_LABELS = {k: option_fields()[k][1].metadata["noun"] for k in EXPORT_OPTIONS}


def _export_error(text: str) -> ExportError:
    """The export's refusal: an :class:`~slapo_lab.export.ExportError` (a ValueError) with ``text``."""
    return ExportError(text)


def _path_kind(path: str) -> str:
    """``"dir"``, ``"file"`` or ``"missing"`` (relative paths: from the kernel's working directory)."""
    return "dir" if os.path.isdir(path) else "file" if os.path.exists(path) else "missing"


def _has_tokenizer(folder: str) -> bool:
    """Whether ``folder`` holds a vocabulary ``AutoTokenizer.from_pretrained`` reads (the exported script's
    launch check, :func:`slapo_lab.train.preflight.has_tokenizer`)."""
    return has_tokenizer(folder)


def _shown_path(path) -> str:
    """``path`` as a command line shows it: relative to the working directory when inside it, quoted."""
    rel = os.path.relpath(path)
    return shlex.quote(str(path) if rel.startswith("..") else rel)


def _check_names(launcher: str, options: dict) -> None:
    """The launcher is one of :data:`slapo_lab.export.LAUNCHERS` and every option is an export option."""
    if launcher not in LAUNCHERS:
        raise _export_error(f"The launcher {launcher!r} is not supported; use torchrun or deepspeed.")
    for key in options:
        if key not in EXPORT_OPTIONS:
            raise _export_error(f"{key!r} is not an export option; use one of {', '.join(EXPORT_OPTIONS)}.")


def _normal_value(key: str, v: Any) -> Any:
    """Option ``key``'s value ``v`` checked for its kind (a path, a whole number at or above its least, a bool,
    the learning rate) and normalised (a path stripped and ``~`` expanded, lr a float); None when it is left out
    (None or an empty path)."""
    if v is None:
        return None
    if key in _PATH_OPTIONS:
        if not isinstance(v, (str, os.PathLike)):
            raise _export_error(f"The {_LABELS[key]} must be a path, not {v!r}.")
        return os.path.expanduser(os.fspath(v).strip()) or None
    if key in _INT_OPTIONS:
        _check_whole(key, v)
    elif key in ("fsdp", "bf16") and not isinstance(v, bool):
        raise _export_error(f"{key} must be True or False, not {v!r}.")
    elif key == "lr":
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise _export_error(f"The learning rate must be a number of zero or more, not {v!r}.")
        return float(v)
    return v


def _check_whole(key: str, v: Any) -> None:
    """Whole-number option ``key`` is an int (not a bool) at or above its least value."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise _export_error(f"The {_LABELS[key]} must be a whole number, not {v!r}.")
    low = _INT_OPTIONS[key]
    if v < low:
        raise _export_error(f"The {_LABELS[key]} must be {'positive' if low else 'zero or more'}, not {v}.")


def _check_sharding(launcher: str, o: dict) -> None:
    """A ZeRO stage is 0, 1 or 2, needs deepspeed, and is not combined with FSDP."""
    zero = o.get("zero", 0)
    if zero not in (0, 1, 2):
        raise _export_error(f"The ZeRO stage must be 0, 1 or 2, not {zero}.")
    if zero and launcher != "deepspeed":
        raise _export_error(
            "A ZeRO stage needs the deepspeed launcher; with torchrun, shard over dp with FSDP."
        )
    if zero and o.get("fsdp"):
        raise _export_error("FSDP and ZeRO both shard over the data-parallel replicas; choose one.")


def _check_folders(o: dict) -> None:
    """A checkpoint interval has a checkpoint folder, and the output folders are not files."""
    if o.get("checkpoint_every") and "checkpoint_dir" not in o:
        raise _export_error(f"A checkpoint every {o['checkpoint_every']} steps needs a checkpoint directory.")
    for key in ("checkpoint_dir", "save_hf", "log_dir"):
        if key in o and _path_kind(o[key]) == "file":
            raise _export_error(
                f"The {_LABELS[key]} {o[key]} is a file; give a folder (it is created if missing)."
            )


def _baked_defaults(o: dict, text: bool, batch_default: int | None, seq_default: int | None) -> dict:
    """The checked options ``o`` that differ from the exported script's own defaults (what it bakes in); training
    on ``text`` says the sequence length explicitly."""
    script = {
        "data": None,
        "dp": 1,
        "fsdp": False,
        "zero": 0,
        "checkpoint_every": 0,
        "bf16": False,
        "steps": _SCRIPT_STEPS,
        "global_batch_size": batch_default or 1,
        "seq_len": seq_default,
    }
    defaults = {}
    for key in EXPORT_OPTIONS:
        if key in o and ((key == "seq_len" and text) or key not in script or o[key] != script[key]):
            defaults[key] = o[key]
    if text and "seq_len" not in defaults:
        defaults["seq_len"] = seq_default
    return defaults


class ExportForm:
    """The export options of one editor: checked, normalised, and the ones an exported script bakes in.

    Args:
        state: the :class:`~slapo_lab.editor.state.EditorState` (its ``model``, ``schedule``, ``example_inputs``,
            ``world_size``, ``factory``, ``numeric_report`` and ``dims``).

    Attributes:
        sizes: ``(batch, seq)`` of the example inputs as an exported script reads them, once computed
            (:meth:`example_sizes`).
    """

    def __init__(self, state) -> None:
        self.state = state
        self.sizes: tuple[int | None, int | None] | None = None

    def export(self, path: str, launcher: str, force: bool, options: dict) -> str:
        """Check ``options``, write the script to ``path`` and remember the options (the state's
        ``export_options``, the form, the schedule file); says the path and the launch command on the message line,
        with the schedule check's open items. :meth:`EditorState.export <slapo_lab.editor.state.EditorState.export>`
        says what each option means. Returns the path written; raises ExportError (one sentence, nothing written).
        """
        st = self.state
        options, defaults = self.check(launcher, options)
        out = self.write_script(path, launcher, defaults, force)
        cmd = self.launch_command(out, launcher, options.get("dp") or 1)
        st.export_options = {"launcher": launcher, "script": str(path), "options": options}
        st._set_form(st.export_options)
        st._autosave()
        open_items = st._open_count()
        warn = (
            f" — the schedule check has {open_items} open item{'s' if open_items > 1 else ''} (listed above the "
            "code): --verify will fail until they are closed"
            if open_items
            else ""
        )
        st._info(f"Exported {out} — launch: {cmd}{warn}")
        st._show_export(out, cmd)
        return str(out)

    def write_script(self, path, launcher: str, defaults: dict, force: bool = False):
        """Write the state's schedule as a training script to ``path`` with ``defaults`` baked in
        (:func:`slapo_lab.export.export_script`, the live check's report reused when it is of this schedule);
        returns the path written. Raises :class:`~slapo_lab.export.ExportError` as ``export_script`` does."""
        report = self.state.numeric_report  # None whenever the schedule changed after the live check
        return export_script(
            path,
            self.state.model,
            self.state.schedule.record.calls,
            self.state.example_inputs,
            world_size=self.state.world_size,
            launcher=launcher,
            factory=self.state.factory,
            defaults=defaults,
            force=force,
            report=report if report is not None and report.status != "skipped" else None,
        )

    def launch_command(self, script, launcher: str, dp: int, gpus: int | None = None) -> str:
        """The one-node launch of ``script`` for ``tp x pp x dp`` processes on this machine
        (:func:`slapo_lab.export.script.launch_here`)."""
        return launch_here(self.state.dims(dp).world_size, _shown_path(script), launcher, gpus)

    def example_sizes(self) -> tuple[int | None, int | None]:
        """``(batch, seq)`` of the example inputs as the exported script reads them (None when unknown); computed
        once (:func:`slapo_lab.train.preflight.example_sizes`)."""
        if self.sizes is None:
            try:
                vocab = getattr(getattr(self.state.model, "config", None), "vocab_size", None)
                self.sizes = example_sizes(
                    input_spec(self.state.example_inputs, vocab if isinstance(vocab, int) else None)
                )
            except (ValueError, TypeError):  # inputs export refuses: it says so itself at export time
                self.sizes = (None, None)
        return self.sizes

    def model_dir_problem(self, path: str) -> str | None:
        """None if ``path`` is a Hugging Face directory this model can load its weights from, else why not."""
        kind = _path_kind(path)
        if kind == "missing":
            return (
                f"The model path {path} does not exist; give a Hugging Face directory (written by save_pretrained) "
                "or leave it empty for seeded random weights."
            )
        if kind == "file":
            return (
                f"The model path {path} is a file; give the directory that holds config.json and the weights."
            )
        cfg = os.path.join(path, "config.json")
        if not os.path.isfile(cfg):
            return f"The model path {path} has no config.json; give a directory written by save_pretrained."
        if not any(f.endswith(".safetensors") for f in os.listdir(path)):
            return (
                f"The model path {path} has no *.safetensors weights; save the model with save_pretrained "
                "(safetensors is its default)."
            )
        want = getattr(getattr(self.state.model, "config", None), "model_type", None)
        try:
            with open(cfg, encoding="utf-8") as f:
                got = json.load(f).get("model_type")
        except (OSError, ValueError, AttributeError):
            return f"The config.json in {path} could not be read as a JSON object."
        if want and got and got != want:
            return f"The model path {path} holds a {got!r} model, but this editor schedules a {want!r} model."
        return None

    def check(self, launcher: str, options: dict, local: bool = True) -> tuple[dict, dict]:
        """Check export options; returns ``(options, defaults)``: the options normalised (paths stripped and
        ``~`` expanded, empty ones dropped) and the ones to bake into the script (those that differ from its
        own defaults). ``local=False`` skips the checks that the model / tokenizer / data paths exist.

        Raises:
            ExportError: the first problem, in one sentence.
        """
        _check_names(launcher, options)
        o = {}
        for key, v in options.items():
            v = _normal_value(key, v)
            if v is not None:
                o[key] = v
        if o.get("data") == "synthetic":
            del o["data"]
        _check_sharding(launcher, o)
        batch_default, seq_default = self.example_sizes()
        self._check_batch(o, batch_default)
        _check_folders(o)
        if local:
            self._check_local_paths(o)
        text = "data" in o or "eval_data" in o
        if text:
            self._check_text(o, seq_default)
        return o, _baked_defaults(o, text, batch_default, seq_default)

    def _check_batch(self, o: dict, batch_default: int | None) -> None:
        """The global batch splits into equal micro-batches over dp replicas and the pipeline stages (the
        runtime's micro-batch, :mod:`slapo_lab.train.loop`: given, or the global batch / (dp x stages))."""
        dp = o.get("dp", 1)
        batch = o.get("global_batch_size", batch_default or 1)
        stages = self.state.dims().pp
        micro = ParallelDims(dp=dp).micro_batches(batch, o.get("micro_batch_size"), stages)[0]
        if not (batch % dp or batch % (micro * dp)):
            return
        if "micro_batch_size" in o:
            raise _export_error(
                f"The global batch size {batch} is not divisible by micro batch {micro} x dp {dp}: "
                "every replica takes the same number of micro-batches per step."
            )
        if batch % dp == 0:
            raise _export_error(
                f"The global batch size {batch} does not split into equal micro-batches over dp "
                f"{dp} and {stages} pipeline stages; choose a multiple of {dp * stages}."
            )
        raise _export_error(
            f"The global batch size {batch} is not divisible by dp {dp}: every replica takes the "
            "same number of sequences per step."
        )

    def _check_local_paths(self, o: dict) -> None:
        """The model, tokenizer and data paths exist on this machine, and text has a tokenizer to read it."""
        if "model_path" in o:
            why = self.model_dir_problem(o["model_path"])
            if why:
                raise _export_error(why)
        if "tokenizer" in o and _path_kind(o["tokenizer"]) != "dir":
            raise _export_error(
                f"The tokenizer directory {o['tokenizer']} does not exist; give a directory "
                "written by tokenizer.save_pretrained, or leave it empty to use the model path."
            )
        if (
            ("data" in o or "eval_data" in o)
            and "tokenizer" not in o
            and "model_path" in o
            and not _has_tokenizer(o["model_path"])
        ):
            raise _export_error(
                f"The model path {o['model_path']} holds no tokenizer files; fill in the tokenizer directory."
            )
        for key in ("data", "eval_data"):
            if key in o and _path_kind(o[key]) == "missing":
                raise _export_error(
                    f"The {_LABELS[key]} {o[key]} does not exist; give a .txt, .jsonl or .parquet "
                    "file or a folder of them, or 'synthetic' (a path that exists only where "
                    "the run is launched can be passed there with --data)."
                )

    def _check_text(self, o: dict, seq_default: int | None) -> None:
        """Training on text needs a language-model head, a tokenizer and a sequence length."""
        name = type(self.state.model).__name__
        if objective_of(name) is None:
            raise _export_error(
                f"{name} has no language-model head, so it cannot train on text; schedule a "
                "*ForCausalLM or *ForMaskedLM model, or use synthetic data."
            )
        if "tokenizer" not in o and "model_path" not in o:
            raise _export_error(
                "Training on text needs a tokenizer; fill in the tokenizer directory (or a "
                "model path that holds the tokenizer files)."
            )
        if "seq_len" not in o and seq_default is None:
            raise _export_error("Training on text needs a sequence length (tokens per sequence).")
