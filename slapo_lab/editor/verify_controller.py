"""What the editor's Verify runs, without widgets: the options it keeps, the script it writes, the ranks and device.

:class:`VerifyController` is owned by :class:`~slapo_lab.editor.state.EditorState` (``state.verifier``) and holds
it. From the Export form's options it keeps what can run here (:meth:`VerifyController.options`: the model path,
data and tokenizer when they exist on this machine, as absolute paths; checkpoints, logs, steps and the ZeRO stage
dropped), checks them and writes the script to a temporary folder (:meth:`VerifyController.write`), and plans the
run (:meth:`VerifyController.plan`: ``tp x pp x dp`` ranks, GPUs or CPU/gloo,
:func:`slapo_lab.editor.verify_runner.plan_device`). :class:`~slapo_lab.editor.verify_panel.VerifyPanel` draws the
run (:class:`~slapo_lab.editor.verify_runner.VerifyRunner`): the bar, the phase, the log.
"""

from __future__ import annotations

import os
import tempfile

from .export_form import _has_tokenizer, _path_kind
from .verify_runner import cpu_verify_too_big, plan_device

__all__ = ["VerifyController"]


class VerifyController:
    """What a Verify run of one editor state runs.

    Args:
        state: the :class:`~slapo_lab.editor.state.EditorState` (its ``model``, ``dims``, and the Export form's
            checks and script writer).
    """

    def __init__(self, state) -> None:
        self.state = state

    def options(self, launcher: str, options: dict) -> tuple[dict, str]:
        """The form's options for a Verify run, and the sentence saying which weights and data it uses.

        The model path and the data (and the tokenizer) are kept, as absolute paths (the run's working
        directory is a temporary folder), when they exist here; otherwise Verify uses seeded random weights
        / synthetic data. Checkpoints, save-HF, logs, validation data, steps and the ZeRO stage are dropped.
        """
        o = {
            k: v
            for k, v in options.items()
            if k
            not in ("checkpoint_dir", "checkpoint_every", "save_hf", "log_dir", "eval_data", "steps", "zero")
        }
        o = {k: v for k, v in o.items() if not (isinstance(v, str) and not v.strip())}
        missing = []
        model = o.pop("model_path", None)
        if model is not None:
            model = os.path.expanduser(model)
            if self.state.export_form.model_dir_problem(model) is None:
                o["model_path"] = os.path.abspath(model)
            else:
                missing.append(f"the model path {model}")
        data = o.pop("data", "synthetic")
        tokenizer = o.pop("tokenizer", None)
        if data != "synthetic":
            data = os.path.expanduser(data)
            tok = os.path.expanduser(tokenizer) if tokenizer else o.get("model_path")
            if _path_kind(data) == "missing":
                missing.append(f"the data path {data}")
            elif tok is None or _path_kind(tok) != "dir" or not _has_tokenizer(tok):
                missing.append(f"the tokenizer directory {tok or tokenizer or '(none)'}")
            else:
                o["data"] = os.path.abspath(data)
                if tokenizer:
                    o["tokenizer"] = os.path.abspath(tok)
        weights = f"the weights in {o['model_path']}" if "model_path" in o else "seeded random weights"
        text = f"the data in {o['data']}" if "data" in o else "synthetic data"
        used = f"Verify uses {weights} and {text}"
        if missing:
            used += (
                f", because {' and '.join(missing)} {'does' if len(missing) == 1 else 'do'} not exist here"
            )
        if launcher == "deepspeed" and options.get("zero"):
            used += f" (ZeRO-{options['zero']} is left out: it changes neither outputs nor gradients)"
        return o, used + "."

    def write(self, launcher: str, options: dict) -> tuple[str, dict, str]:
        """Check the form's ``options`` for a Verify run and write its script to a new temporary folder.

        Returns:
            ``(script path, options as checked, the sentence on the weights and data used)``.

        Raises:
            ExportError: (a ValueError) the first problem with the options or the schedule, in one sentence.
        """
        options, used = self.options(launcher, options)
        options, defaults = self.state.export_form.check("torchrun", options)
        folder = tempfile.mkdtemp(prefix="slapo-verify-")
        name = f"{folder}/verify_{type(self.state.model).__name__.lower()}.py"
        return str(self.state.export_form.write_script(name, "torchrun", defaults)), options, used

    def plan(self, options: dict, device: str) -> tuple[int, str, str, str | None]:
        """``(ranks, device, note, refusal)`` of a run with ``options``: ``tp x pp x dp`` ranks, ``"cuda"`` or
        ``"cpu"`` (:func:`~slapo_lab.editor.verify_runner.plan_device`, the note saying why CPU), and the one
        sentence refusing a CPU run too big for this machine's memory
        (:func:`~slapo_lab.editor.verify_runner.cpu_verify_too_big`), else None."""
        nproc = self.state.dims(options.get("dp", 1)).world_size
        dev, note = plan_device(nproc, device)
        too_big = None
        if dev == "cpu":
            too_big = cpu_verify_too_big(sum(p.numel() for p in self.state.model.parameters()), nproc)
        return nproc, dev, note, too_big
