"""Render a recorded schedule as a short, standalone training script (``torchrun`` or ``deepspeed``).

The script holds data, not machinery: the model spec (a transformers class and its config, or a
factory), the example inputs' spec, the tensor-parallel width and pipeline stages, the options chosen
at export, and ``schedule(sch)`` -- the recorded calls, loops folded (:mod:`slapo_lab.export.fold`) --
then one call into the training runtime, :func:`slapo_lab.train.main`, which owns the command line,
the data, the layouts, Verify, checkpoints and metrics. It imports only ``slapo_lab``.

Every value is JSON data validated before rendering (:mod:`slapo_lab.spec`) and written as a Python
literal (``pprint``), every name a checked identifier, so nothing a schedule file holds becomes code. The options
are a ``CONFIG = TrainConfig(...)`` expression of :mod:`slapo_lab.train.config`'s section classes whose arguments
are literals (:meth:`~slapo_lab.train.config.TrainConfig.literal`; ``TrainConfig.from_literal`` reads it back
without running it). Scripts exported before it hold ``DEFAULTS = {...}`` and call ``main(..., defaults=DEFAULTS)``,
which :func:`slapo_lab.train.main` still accepts.
"""

from __future__ import annotations

import os
import pprint
import re
import tempfile
import textwrap
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import nn

from .. import __version__, numeric
from ..module_state import peek_meta
from ..parallel_dims import ParallelDims
from ..pipeline.coupling import (
    batchnorm_single_value,
    coupling_refusal,
    export_batchnorm_refusal,
    single_value_refusal,
)
from ..record import Call, Recorder
from ..spec import (
    ExportError,
    build_hf,
    check_json,
    input_spec,
    model_spec,
    objective_of,
    validate_calls,
    validate_input_spec,
    validate_model_spec,
)
from ..train.config import ConfigError, TrainConfig
from ..train.preflight import example_sizes
from .fold import schedule_lines

LAUNCHERS = ("torchrun", "deepspeed")
_SAFE_NAME = re.compile(r"[A-Za-z0-9_.\-]+\Z")

# Options an export may bake in as the script's defaults (the command line still overrides them).
EXPORT_OPTIONS = (
    "model_path",
    "tokenizer",
    "data",
    "eval_data",
    "seq_len",
    "dp",
    "fsdp",
    "zero",
    "checkpoint_dir",
    "checkpoint_every",
    "save_hf",
    "global_batch_size",
    "micro_batch_size",
    "steps",
    "lr",
    "bf16",
    "log_dir",
    "predicted_step_s",
    "predicted_peak_gib",
)


def _literal(value, indent: int = 0) -> str:
    """``value`` (validated JSON data) as a Python literal, wrapped at 110 columns."""
    text = pprint.pformat(value, width=110 - indent, sort_dicts=False)
    return textwrap.indent(text, " " * indent).lstrip()


def _check_defaults(defaults: dict | None, launcher: str) -> dict:
    """The export-time option defaults, checked (names and JSON values)."""
    defaults = dict(defaults or {})
    for key, value in defaults.items():
        if key not in EXPORT_OPTIONS:
            raise ExportError(
                f"{key!r} is not an option an export can set; use one of {', '.join(EXPORT_OPTIONS)}."
            )
        if key == "zero" and launcher != "deepspeed":
            raise ExportError('zero= (a DeepSpeed ZeRO stage) needs launcher="deepspeed".')
        check_json(f"The export option {key}", value)
    return {k: v for k, v in defaults.items() if v is not None}


def _launch_lines(name: str, tp: int, stages: int, launcher: str, defaults: dict) -> list[str]:
    dims = ParallelDims(tp, stages, int(defaults.get("dp") or 1))
    unit, dp, n = dims.replica, dims.dp, dims.world_size
    data = " --data corpus.jsonl --tokenizer TOKENIZER_DIR --seq-len 1024" if "data" not in defaults else ""
    model = " --model-path HF_DIR" if "model_path" not in defaults else ""
    if launcher == "deepspeed":
        return [
            (
                f"  one node with N GPUs (N a multiple of {unit}: data parallelism over the rest, --zero 1 or 2 to "
                "shard optimizer states):"
            ),
            f"    deepspeed --num_gpus {n} {name} --device cuda{model}{data}",
            f"  CPU test (gloo on 127.0.0.1):  torchrun --nproc_per_node={n} --master_addr=127.0.0.1 {name} --device cpu",
            f"  the DeepSpeed config:  python {name} --print-ds-config",
        ]
    layout = f"tp {tp}" + (f" x pp {stages}" if stages > 1 else "") + (f" x dp {dp}" if dp > 1 else "")
    lines = [
        f"  one node with {n} GPU(s) ({layout}):",
        f"    torchrun --nproc_per_node={n} {name} --device cuda{model}{data}",
    ]
    cluster = ParallelDims.for_world(32, tp, stages)  # 4 nodes x 8 GPUs, when replicas of tp x pp fill them
    if cluster is not None:
        lines += [
            f"  4 nodes x 8 GPUs: data parallelism over the rest (dp = 32 / {unit}), FSDP2, resumable:",
            (
                f"    torchrun --nnodes=4 --nproc_per_node=8 --node_rank=R --master_addr=HOST0 --master_port=29500 "
                f"{name} \\"
            ),
            (
                f"      --device cuda --bf16{model}{data} --dp {cluster.dp} --fsdp --checkpoint-dir CKPT_DIR "
                "--checkpoint-every 500"
            ),
        ]
    lines.append(
        f"  CPU test (gloo on 127.0.0.1):  torchrun --nproc_per_node={n} --master_addr=127.0.0.1 {name} "
        "--device cpu"
    )
    if n == 1:
        lines.append(f"  one process:  python {name} --device cpu")
    return lines


def _micro_batch_rows(inputs: dict, stages: int, defaults: dict) -> tuple[int, int]:
    """``(micro-batches per step, rows per micro-batch)`` of the script's defaults (as the run computes them)."""
    batch, _ = example_sizes(inputs)
    g = int(defaults.get("global_batch_size") or batch or 1)
    dims = ParallelDims(dp=int(defaults.get("dp") or 1))
    micro, accumulation = dims.micro_batches(g, int(defaults.get("micro_batch_size") or 0) or None, stages)
    return accumulation, micro


def _check_batch_coupling(spec: dict, inputs: dict, stages: int, defaults: dict, model) -> None:
    """Refuse defaults under which BatchNorm or a contrastive loss makes the run wrong or crash.

    With more than one pipeline stage: BatchNorm using batch statistics (the exported stages keep them
    in the run's Verify, which compares in eval mode), or micro-batches > 1 with a contrastive model
    (CLIP, SigLIP). Always (when the model is known): a micro-batch that leaves a training
    BatchNorm one value per channel. Without ``model`` only a transformers spec is checked, on meta.
    """
    if model is None:
        if stages <= 1 or spec["kind"] != "hf":
            return
        try:
            model = build_hf(spec, "meta")
        except Exception:  # noqa: BLE001 - the run reports a model it cannot build
            return
    # the script rebuilds a transformers model in training mode, and a run without stages trains every module
    all_bn = stages <= 1 or spec["kind"] == "hf" or not model.training
    n, rows = _micro_batch_rows(inputs, stages, defaults)
    if stages > 1:
        refusal = export_batchnorm_refusal(model, all_bn)
        if refusal:
            raise ExportError(refusal)
        g = int(defaults.get("global_batch_size") or example_sizes(inputs)[0] or 1)
        whole = ParallelDims(dp=int(defaults.get("dp") or 1)).micro_batches(g)[
            0
        ]  # one micro-batch per replica
        one = f"export with micro_batch_size={whole}"
        refusal = coupling_refusal(model, n, one, all_batchnorms=all_bn)
        if refusal:
            raise ExportError(refusal)
    kwargs = {}
    for name, e in inputs.items():
        if "value" in e:
            kwargs[name] = e["value"]
            continue
        shape = [rows if d == "batch" else int(s) for d, s in zip(e["dims"], e["shape"], strict=False)]
        kwargs[name] = torch.empty(shape, dtype=getattr(torch, e["dtype"]), device="meta")
    path = batchnorm_single_value(model, (), kwargs, all_batchnorms=all_bn)
    if path is not None:
        raise ExportError(
            single_value_refusal(
                model, rows, path, "export with a larger micro_batch_size or global_batch_size"
            )
        )


def render_script(
    spec: dict,
    calls: Sequence[Call | dict] | Recorder,
    inputs: dict,
    world_size: int,
    launcher: str = "torchrun",
    script_name: str = "train.py",
    defaults: dict | None = None,
    *,
    model: nn.Module | None = None,
) -> str:
    """The training script for a recorded schedule, as Python source text.

    Args:
        spec: the model spec (:func:`slapo_lab.export.model_spec`).
        calls: the recorded calls (list of :class:`~slapo_lab.Call` or their JSON dicts, or a Recorder).
        inputs: the input spec (:func:`slapo_lab.export.input_spec`).
        world_size: the tensor-parallel width the calls were recorded for.
        launcher: ``"torchrun"`` or ``"deepspeed"``.
        script_name: the file name shown in the launch commands of the docstring.
        defaults: option defaults baked into the script (:data:`EXPORT_OPTIONS`: ``model_path``, ``data``,
            ``dp``, ``fsdp``, ``checkpoint_dir`` ...).
        model: the model the calls were recorded on, for the batch-coupling checks (None: a transformers
            spec is built on the meta device when the schedule has pipeline stages).

    Returns:
        The script: ruff-clean, importing only ``slapo_lab`` (and, through it, torch and transformers).

    Raises:
        ExportError: an unknown launcher or option, a bad world size, a spec / call / value that fails
            validation (see :func:`~slapo_lab.spec.validate_calls`), a pipeline with constant
            (non-tensor) inputs, or tensor x pipeline parallelism with the DeepSpeed launcher; a pipeline
            of a model with BatchNorm using batch statistics, or of a contrastive model (CLIP, SigLIP)
            whose default micro-batches (``global_batch_size / (micro_batch_size * dp)``) are more than
            one; a micro-batch that leaves a training BatchNorm one value per channel (one sentence
            naming the module and the fix).
    """
    if launcher not in LAUNCHERS:
        raise ExportError(f'The launcher {launcher!r} is not supported; use "torchrun" or "deepspeed".')
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ExportError(f"world_size must be a positive integer, not {world_size!r}.")
    spec = validate_model_spec(spec)
    inputs = validate_input_spec(inputs)
    calls = validate_calls(calls)
    defaults = _check_defaults(defaults, launcher)
    data = defaults.get("data", "synthetic")
    if data != "synthetic":
        cls = spec["class"] if spec["kind"] == "hf" else spec["factory"]
        if spec["kind"] != "hf" or objective_of(cls) is None:
            raise ExportError(
                f"{cls} has no language-model head, so it has no loss to train on text; export a "
                "*ForCausalLM or *ForMaskedLM model, or leave data synthetic."
            )
    stages = pipeline_stages(calls)
    if stages > 1 and launcher == "deepspeed" and world_size > 1:
        raise ExportError(
            f"DeepSpeed's pipeline engine runs pipeline x data parallelism only, but this schedule "
            f'also has {world_size}-way tensor parallelism; export it with launcher="torchrun" '
            "(torch.distributed.pipelining runs tensor x pipeline x data parallelism)."
        )
    constants = [k for k, e in inputs.items() if "value" in e]
    if stages > 1 and constants:
        raise ExportError(
            f"A pipeline feeds only tensors to its first stage, but the example input {constants[0]!r} "
            "is a constant; drop it from the example inputs (or set it in the model config)."
        )
    _check_batch_coupling(spec, inputs, stages, defaults, model)
    config = export_config(inputs, defaults)
    name = script_name if isinstance(script_name, str) and _SAFE_NAME.match(script_name) else "train.py"
    what = spec["class"] if spec["kind"] == "hf" else spec["factory"].split(":")[1]
    parts = [f"{world_size}-way tensor parallelism"] if world_size > 1 else []
    if stages > 1:
        parts.append(f"{stages} pipeline stages")
    headline = " x ".join(parts) or "no model parallelism"
    built = (
        f"transformers {spec['class']} built from the config below (--model-path DIR reads the config and "
        "weights of a Hugging Face directory instead)"
        if spec["kind"] == "hf"
        else f"built by calling {spec['factory']} (importable on every node)"
    )
    body = schedule_lines(calls) or ["pass  # no recorded calls"]
    doc = "\n".join(
        [
            f'"""Train {what} with a slapo-lab schedule: {headline}.',
            "",
            textwrap.fill(
                f"Generated by slapo-lab {__version__} from a recorded schedule; edit freely. The training "
                "itself (data, data / tensor / pipeline parallelism, FSDP2, Verify, checkpoints, metrics) is "
                "slapo_lab.train; this file holds what is yours: the model, the schedule and the defaults.",
                width=100,
            ),
            "",
            "Launch:",
            *_launch_lines(name, world_size, stages, launcher, defaults),
            "",
            f"All options: python {name} --help",
            '"""',
        ]
    )
    lines = [
        doc,
        "import slapo_lab.train",
        f"from slapo_lab.train.config import {', '.join([*config.section_classes(), 'TrainConfig'])}",
        "",
        f"# The model: {built}.",
        f"MODEL = {_literal(spec, 8)}",
        "",
        "# The example inputs the schedule was recorded with (--data synthetic draws inputs of these shapes).",
        f"INPUTS = {_literal(inputs, 9)}",
        "",
        f"TP = {world_size}  # the tensor-parallel width the schedule was recorded for",
        f"STAGES = {stages}  # pipeline stages: the recorded cuts + 1",
        "",
        "# Option defaults chosen at export (the rest: slapo_lab.train.config's); the command line overrides them.",
        f"CONFIG = {config.literal()}",
        "",
        "",
        "def schedule(sch):",
        '    """The recorded schedule, applied to this rank\'s tensor-parallel shard of the model."""',
        *("    " + ln for ln in body),
        "",
        "",
        'if __name__ == "__main__":',
        "    raise SystemExit(slapo_lab.train.main(model=MODEL, schedule=schedule, inputs=INPUTS, tp=TP, stages=STAGES,",
        f"                                          launcher={launcher!r}, config=CONFIG, title=__doc__.splitlines()[0]))",
        "",
    ]
    return "\n".join(lines)


def export_config(inputs: dict, defaults: dict) -> TrainConfig:
    """The :class:`~slapo_lab.train.config.TrainConfig` a script renders for the options chosen at export
    (``defaults``, checked by :func:`_check_defaults`); training on text names its sequence length (the example's
    unless chosen), since the script's ``CONFIG`` must stand on its own.

    Raises:
        ExportError: options that do not go together (the config's sentence).
    """
    chosen = dict(defaults)
    if chosen.get("data", "synthetic") != "synthetic" and chosen.get("seq_len") is None:
        seq = example_sizes(inputs)[1]
        if seq is not None:
            chosen["seq_len"] = seq
    try:
        return TrainConfig.from_flat(chosen)
    except ConfigError as err:
        raise ExportError(f"The export options do not go together: {str(err).rstrip('.')}.") from None


def pipeline_stages(calls: Iterable[Call] | Recorder) -> int:
    """The number of pipeline stages the calls describe: the distinct cut paths + 1 (1 without cuts)."""
    calls = getattr(calls, "calls", calls)
    cuts = {c.path for c in calls if getattr(c, "primitive", None) == "cut_pipeline_stage"}
    return len(cuts) + 1


def processes(calls: Iterable[Call] | Recorder, world_size: int) -> int:
    """Processes one replica of the schedule needs: tensor-parallel width x pipeline stages
    (:attr:`ParallelDims.replica <slapo_lab.parallel_dims.ParallelDims.replica>`)."""
    return ParallelDims(world_size, pipeline_stages(calls)).replica


def launch_command(
    calls: Iterable[Call] | Recorder,
    world_size: int,
    script: str = "train.py",
    launcher: str = "torchrun",
    device: str | None = "cuda",
) -> str:
    """The one-node command that launches an exported script (``tp x pp`` processes, no data parallelism);
    ``device=None``: the launch for this machine (:func:`launch_here`)."""
    n = processes(calls, world_size)
    if device is None:
        return launch_here(n, script, launcher)
    if launcher == "deepspeed":
        return f"deepspeed --num_gpus {n} {script} --device {device}"
    return f"torchrun --nproc_per_node={n} {script} --device {device}"


def launch_here(n: int, script: str, launcher: str = "torchrun", gpus: int | None = None) -> str:
    """The one-node launch of ``n`` processes of ``script``: on GPUs (``--device cuda``, one each) when this
    machine has ``n`` of them (``gpus``: its CUDA devices, default torch's count), else that launch and the CPU
    launch that runs here (gloo on 127.0.0.1)."""
    gpu = (
        f"deepspeed --num_gpus {n} {script} --device cuda"
        if launcher == "deepspeed"
        else f"torchrun --nproc_per_node={n} {script} --device cuda"
    )
    if gpus is None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= n:
        return gpu
    here = "no CUDA" if gpus == 0 else f"{gpus} GPU(s)"
    return f"{gpu} on {n} GPUs; on this machine ({here}): torchrun --nproc_per_node={n} --master_addr=127.0.0.1 {script} --device cpu"


def export_script(
    path: str | os.PathLike,
    model: nn.Module,
    calls: Sequence[Call],
    example_inputs: dict,
    world_size: int,
    launcher: str = "torchrun",
    factory: str | None = None,
    defaults: dict | None = None,
    *,
    force: bool = False,
    report: numeric.NumericReport | None = None,
) -> Path:
    """Write the training script for ``model`` scheduled by ``calls`` to ``path``.

    Before anything is written the schedule is checked numerically (:func:`slapo_lab.numeric.numeric_check`:
    the calls replayed on a shrunk copy over simulated ranks, compared with the unsharded copy): a schedule
    the check marks ✗ is refused, so a failing schedule never reaches torchrun unless ``force`` says so.

    Args:
        path: the script file to write (e.g. ``"train_bert.py"``); its folder must exist.
        model: the model the schedule was recorded on (see :func:`~slapo_lab.export.model_spec`).
        calls: the recorded calls (``sch.record.calls``).
        example_inputs: the keyword inputs of one forward call, e.g. ``{"input_ids": ids}`` with
            ``ids`` of shape ``(batch, seq)``: their shapes and dtypes become the script's defaults.
        world_size: the tensor-parallel width (processes to launch: this x the pipeline stages).
        launcher: ``"torchrun"`` or ``"deepspeed"`` (see :func:`render_script`).
        factory: ``"package.module:function"`` rebuilding the model, for a model its config cannot.
        defaults: option defaults baked into the script (see :func:`render_script`), e.g.
            ``{"model_path": "llama-7b", "data": "corpus.jsonl", "dp": 4, "fsdp": True, "checkpoint_dir": "ckpt"}``.
        force: write the script even when the numeric check fails (the script's ``--verify`` still runs).
        report: a :class:`~slapo_lab.numeric.NumericReport` of exactly these calls (the editor's live check),
            used instead of checking again.

    Returns:
        The absolute path written (the file is replaced atomically: no partial script on failure).

    Raises:
        ExportError: everything :func:`render_script` and :func:`model_spec` raise, plus a missing,
            read-only or otherwise unwritable folder, or a path that is a folder, or (without ``force``) a
            schedule the numeric check marks ✗: one sentence naming the module.
    """
    path = Path(os.fspath(path)).expanduser()
    if not force:
        refuse_failing_schedule(model, calls, example_inputs, world_size, report)
    spec = model_spec(model, factory)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    inputs = input_spec(example_inputs, vocab if isinstance(vocab, int) else None)
    text = render_script(
        spec, calls, inputs, world_size, launcher, script_name=path.name, defaults=defaults, model=model
    )
    write_text_atomic(path, text)
    return path.resolve()


def refuse_failing_schedule(
    model: nn.Module,
    calls: Iterable[Call],
    example_inputs: dict,
    world_size: int,
    report: numeric.NumericReport | None = None,
) -> numeric.NumericReport:
    """Run the numeric check on ``calls`` (or take ``report``) and raise when it marks them ✗.

    ``model`` is the unscheduled model the calls were recorded on; a model the calls already changed in place
    is rebuilt from its Hugging Face config for the check (without a config the check is left to Verify).

    Returns:
        The :class:`~slapo_lab.numeric.NumericReport` (``"skipped"`` when it cannot run).

    Raises:
        ExportError: the check fails: "Not exported: <where and how it differs>; pass force=True ...".
    """
    if report is None:
        scheduled = any(peek_meta(m) is not None for m in model.modules())
        has_config = hasattr(getattr(model, "config", None), "to_dict")
        if scheduled and not has_config:
            return numeric.NumericReport(
                "skipped", "The model is already scheduled and has no config to rebuild from."
            )
        report = numeric.numeric_check(model, list(calls), world_size, example_inputs, from_config=scheduled)
    if report.status in ("failed", "error"):
        raise ExportError(
            f"Not exported: {report.message[:1].lower()}{report.message[1:].rstrip('.')}; fix the schedule (the live check and "
            "check_schedule(numeric=True) show where), or pass force=True (--force-unverified) to write it anyway."
        )
    return report


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file in the same folder and a rename.

    Raises:
        ExportError: one sentence for a path that is a folder, a missing folder, or any OSError.
    """
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise ExportError(f"{path} is a folder; give a file name such as {path / 'train.py'}.")
    if not folder.is_dir():
        if folder.exists():
            raise ExportError(f"Cannot write {path}: {folder} is a file, not a folder.")
        raise ExportError(f"Cannot write {path}: the folder {folder} does not exist.")
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
        tmp = None
    except OSError as err:
        reason = err.strerror or str(err)
        raise ExportError(
            f"Cannot write {path}: {reason[0].lower() + reason[1:] if reason else 'unknown error'}."
        ) from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
