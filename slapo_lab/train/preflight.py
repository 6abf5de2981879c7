"""The launch checks of an exported script that need no torch: a bad input fails in a second, not after the imports.

:func:`preflight` runs first in :func:`slapo_lab.train.main`, before torch, transformers or datasets are imported and
before a process group exists. It imports the standard library only (``python -X importtime`` shows no torch
on this path; ``slapo_lab/__init__.py`` loads its public names on first use for that reason) and checks:

* the command line (:mod:`slapo_lab.train.args`, argparse generated from :class:`~slapo_lab.train.config.TrainConfig`);
* the layout: the world size the launcher gives (``WORLD_SIZE``; 1 without a launcher) against
  ``tp x pp x --dp`` (:func:`layout_problem`, which :func:`slapo_lab.train.parallel.make_layout` raises too);
* ``--model-path`` (a directory with a readable ``config.json`` of the script's model type), ``--data`` and
  ``--eval-data`` (existing ``.txt`` / ``.jsonl`` / ``.parquet`` files or folders of them,
  :func:`data_files`), the tokenizer files of ``--tokenizer`` (default: the model path, :func:`has_tokenizer`);
* ``--seq-len`` against the model's position limit read from its config (:func:`position_limit`:
  ``max_position_embeddings``, ``n_positions``, ``n_ctx``, ... and a RoPE scaling's longer context);
* the checkpoint a relaunch would resume (:func:`compare_run`): its ``run.json`` records the model's config, the
  weights it started from (:func:`weights_fingerprint`: file names, sizes and the hash of the safetensors index),
  the data, the sequence length and the schedule. Other shapes or another model class are an error naming the
  difference; other weights at the same shapes, other data or another sequence length a note.

A failed check prints ``error: <one sentence>`` on the node's local rank 0 (the only line that rank writes for
it; the other ranks print nothing) and the run exits with status 2, without a traceback. Checks that need torch
(whether CUDA is there, the model's build, the schedule's calls) stay in :mod:`slapo_lab.train.loop` and
:mod:`slapo_lab.train.assemble`.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..parallel_dims import ParallelDims
from .args import build_parser, parse_args
from .config import TrainConfig

# The file kinds --data reads, by extension: the ``datasets`` packaged builder that reads each.
FILE_BUILDERS = {".txt": "text", ".jsonl": "json", ".parquet": "parquet"}
DATA_HINT = "pass --data a .txt, .jsonl or .parquet file, a directory of them, or 'synthetic'"
RUN_INFO = "run.json"
STEP_DIR = re.compile(r"step-(\d{8})\Z")
# config.json keys that bound the positions a model embeds (learned tables, or the context a RoPE model was
# trained for): transformers' names across families (BERT / Llama ``max_position_embeddings``, GPT-2
# ``n_positions`` / ``n_ctx``, others' ``max_sequence_length`` / ``seq_length`` / ``max_seq_len``).
POSITION_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "n_ctx",
    "max_sequence_length",
    "seq_length",
    "max_seq_len",
)
# a vocabulary file AutoTokenizer can build a tokenizer from (fast tokenizer, BPE, WordPiece, sentencepiece, tiktoken)
_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model")
_TOKENIZER_SUFFIXES = (".model", ".spm", ".tiktoken")


class PreflightError(ValueError):
    """A launch or input problem found before the heavy imports; ``str(err)`` is one sentence."""


class DataError(ValueError):
    """Training data that cannot be used as given; ``str(err)`` is one sentence naming the file or setting
    and what to do."""


@dataclass
class Checked:
    """What :func:`preflight` hands to the run.

    Attributes:
        config: the run's options (the parsed command line over the script's defaults).
        world: the processes launched (``WORLD_SIZE``, 1 without a launcher).
        resume: ``(step, path)`` of the checkpoint the run will resume, or None.
        record: what this run's checkpoints record in ``run.json`` besides what the run adds (the config, the
            weights it started from, the data, the sequence length, when the run started); a resumed run keeps
            the saved run's origin.
        notes: sentences said once before the run starts (other weights ignored, other data ...).
    """

    config: TrainConfig
    world: int = 1
    resume: tuple[int, Path] | None = None
    record: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------- who speaks
def speaks_errors() -> bool:
    """Whether this process prints a launch error: the node's local rank 0 (or a process without a launcher)."""
    return os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")) == "0"


#: Seconds a silent rank (not its node's speaker) waits before it exits on a launch error: the speaker, local
#: rank 0, prints the sentence and exits first, so the launcher stops the job on the speaker's status instead of
#: on a silent rank's, which would have SIGTERMed the speaker before it printed (a race seen in CI).
SILENT_WAIT_S = 30.0


def failed(status: int) -> int:
    """``status`` for a launch error on this rank; a launched rank that does not print it (see
    :func:`speaks_errors`) first waits up to :data:`SILENT_WAIT_S` for its launcher to stop it."""
    if not speaks_errors() and "LOCAL_RANK" in os.environ:
        time.sleep(SILENT_WAIT_S)
    return status


def speaks_notes() -> bool:
    """Whether this process prints notes: global rank 0 (or a process without a launcher)."""
    return os.environ.get("RANK", "0") == "0"


def launched_world() -> int:
    """The number of processes the launcher started (``WORLD_SIZE``), 1 without a launcher."""
    if "RANK" not in os.environ:
        return 1
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


# ---------------------------------------------------------------------------------------------- inputs
def example_sizes(spec: dict) -> tuple[int | None, int | None]:
    """``(batch_size, seq_len)`` of the example, read off the input spec (None when no axis has it)."""
    batch = seq = None
    for e in spec.values():
        for d, n in zip(e.get("dims", ()), e.get("shape", ()), strict=False):
            if d == "batch" and batch is None:
                batch = n
            if d == "seq" and seq is None:
                seq = n
    return batch, seq


def data_files(path: str | os.PathLike) -> list[Path]:
    """The files ``--data path`` names: the file itself, or a directory's top-level ``.txt`` / ``.jsonl`` /
    ``.parquet`` files in sorted order (hidden files and other extensions skipped).

    Raises:
        DataError: when the path does not exist, a file has another extension, or a directory holds
            no such file.
    """
    p = Path(path)
    if not p.exists():
        raise DataError(f"The data path {p} does not exist; {DATA_HINT}.")
    if p.is_dir():
        files = sorted(
            f
            for f in p.iterdir()
            if f.is_file() and not f.name.startswith(".") and f.suffix.lower() in FILE_BUILDERS
        )
        if not files:
            raise DataError(
                f"The data directory {p} holds no .txt, .jsonl or .parquet file; put the training "
                "text there or pass --data one such file."
            )
        return files
    if p.suffix.lower() not in FILE_BUILDERS:
        raise DataError(
            f"The data file {p} is not a .txt, .jsonl or .parquet file; convert it to one of "
            "these (jsonl and parquet need a text field)."
        )
    return [p]


def has_tokenizer(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds a vocabulary ``AutoTokenizer.from_pretrained`` can build a tokenizer from
    (``tokenizer.json``, ``vocab.json`` / ``vocab.txt``, a sentencepiece or tiktoken model)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    return any(n in _TOKENIZER_FILES or n.endswith(_TOKENIZER_SUFFIXES) for n in names)


def read_model_config(spec: dict, model_path: str | os.PathLike | None) -> dict | None:
    """The model's config as a dict: ``config.json`` of ``model_path`` when given, else the script's spec
    (None for a factory-built model).

    Raises:
        PreflightError: the directory does not exist, has no readable ``config.json``, or holds another model
            type than the script's.
    """
    if model_path is None:
        cfg = spec.get("config") if spec.get("kind") == "hf" else None
        return dict(cfg) if isinstance(cfg, dict) else None
    d = Path(model_path)
    if not d.is_dir():
        raise PreflightError(
            f"--model-path {model_path} is not a directory; give a Hugging Face directory written by "
            "save_pretrained (config.json + *.safetensors)."
        )
    cfg_file = d / "config.json"
    try:
        config = json.loads(cfg_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PreflightError(
            f"{model_path} has no config.json; --model-path takes a directory written by save_pretrained."
        ) from None
    except (OSError, ValueError) as err:
        raise PreflightError(f"Cannot read {cfg_file}: {err}.") from None
    if not isinstance(config, dict):
        raise PreflightError(f"Cannot read {cfg_file}: it holds no JSON object.")
    if spec.get("kind") == "hf":
        want = (spec.get("config") or {}).get("model_type")
        if want and config.get("model_type") not in (None, want):
            raise PreflightError(
                f"{model_path} holds a {config.get('model_type')!r} model, but this script trains a "
                f"{want!r} ({spec.get('class')})."
            )
    return config


def position_limit(config: dict | None) -> tuple[str, int] | None:
    """The longest sequence a model's config allows, as ``(the key that says so, tokens)``, or None.

    Reads :data:`POSITION_KEYS` at the top level of ``config`` (else in its nested configs, such as a
    ``text_config``: their smallest); a RoPE scaling (``rope_scaling`` / ``rope_parameters`` with ``factor``
    and ``original_max_position_embeddings``) raises the limit to the context it was scaled to.
    """
    if not isinstance(config, dict):
        return None

    def own(cfg: dict) -> tuple[str, int] | None:
        found = [(k, cfg[k]) for k in POSITION_KEYS if type(cfg.get(k)) is int and cfg[k] > 0]
        if not found:
            return None
        key, limit = found[0]
        for rope_key in ("rope_scaling", "rope_parameters"):
            rope = cfg.get(rope_key)
            if isinstance(rope, dict):
                factor, orig = rope.get("factor"), rope.get("original_max_position_embeddings")
                if isinstance(factor, (int, float)) and type(orig) is int and factor * orig > limit:
                    key, limit = f"{rope_key} factor x original_max_position_embeddings", int(factor * orig)
        return key, limit

    top = own(config)
    if top is not None:
        return top
    nested = [own(v) for v in config.values() if isinstance(v, dict)]
    nested = [n for n in nested if n is not None]
    return min(nested, key=lambda kv: kv[1]) if nested else None


def weights_fingerprint(model_path: str | os.PathLike | None) -> dict | None:
    """A cheap identity of a Hugging Face directory's weights: the ``*.safetensors`` names and byte sizes and
    the SHA-256 of ``model.safetensors.index.json`` (no tensor is read). None without a model path."""
    if model_path is None:
        return None
    d = Path(model_path)
    files: dict[str, int] = {}
    index = None
    try:
        for f in sorted(d.iterdir()):
            if f.name.endswith(".safetensors") and f.is_file():
                files[f.name] = f.stat().st_size
            elif f.name.endswith(".safetensors.index.json") and f.is_file():
                index = hashlib.sha256(f.read_bytes()).hexdigest()
    except OSError:
        return None
    return {"files": files, "index_sha256": index}


# ---------------------------------------------------------------------------------------------- layout
def layout_problem(
    tp: int,
    stages: int,
    world: int,
    dp: int | None,
    stages_per_rank: int = 1,
    launch_hint: str = "torchrun --nproc_per_node=",
) -> str | None:
    """None when ``world`` processes lay out as ``tp x pp x dp`` for this schedule, else the sentence saying
    what to launch (``pp`` = ``stages / stages_per_rank``)."""
    if stages % stages_per_rank:
        return f"--stages-per-rank {stages_per_rank} does not divide the {stages} pipeline stages."
    pp = stages // stages_per_rank
    unit = ParallelDims(tp, pp).replica
    dims = ParallelDims.for_world(world, tp, pp) if world >= 1 else None
    if dims is None or (dp is not None and dp != dims.dp):
        fit = dims or ParallelDims.filling(max(world, 1), tp, pp)[0]  # the replicas that fit (at least one)
        want = ParallelDims(tp, pp, dp or fit.dp).world_size
        need = f"--dp {dp} x {unit} = {want}" if dp else f"a multiple of {unit}"
        return (
            f"This schedule runs tp={tp} (tensor parallel) x pp={pp} (pipeline) x dp processes, so the "
            f"world size must be {need}, but {world} process(es) were launched; use "
            f"{launch_hint}{want}."
        )
    return None


# ---------------------------------------------------------------------------------------------- checkpoints
def step_dir(folder: str | os.PathLike, step: int) -> Path:
    """``<folder>/step-<step, 8 digits>``."""
    return Path(folder) / f"step-{step:08d}"


def latest_checkpoint(folder: str | os.PathLike | None) -> tuple[int, Path] | None:
    """The newest complete checkpoint in ``folder`` as ``(step, path)``, or None.

    Complete means: named ``step-NNNNNNNN`` (not ``.partial``) and holding DCP's ``.metadata``.
    """
    if folder is None or not Path(folder).is_dir():
        return None
    best = None
    for p in Path(folder).iterdir():
        m = STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / ".metadata").is_file():
            step = int(m.group(1))
            if best is None or step > best[0]:
                best = (step, p)
    return best


def read_run_info(path: str | os.PathLike) -> dict:
    """A checkpoint's ``run.json`` as a dict ({} when it is missing or unreadable: a checkpoint of an older run)."""
    try:
        info = json.loads((Path(path) / RUN_INFO).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _shape_values(config: dict, prefix: str = "") -> dict[str, Any]:
    """The config values that decide the model's parameters: its integers (sizes, counts; not token ids) and
    ``model_type``, nested configs under dotted keys."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(_shape_values(v, f"{prefix}{k}."))
        elif (type(v) is int and not k.endswith(("_token_id", "_token_ids"))) or k == "model_type":
            out[prefix + k] = v
    return out


def config_differences(saved: dict | None, now: dict | None) -> list[tuple[str, Any, Any]]:
    """``[(key, saved value, current value)]`` for the shape-deciding values both configs hold and that differ."""
    if not isinstance(saved, dict) or not isinstance(now, dict):
        return []
    a, b = _shape_values(saved), _shape_values(now)
    return [(k, a[k], b[k]) for k in a if k in b and a[k] != b[k]]


def _absolute(path) -> str | None:
    return str(Path(path).resolve()) if path else None


def run_record(cfg: TrainConfig, spec: dict, config: dict | None) -> dict:
    """What this launch would record in ``run.json`` (the run adds the schedule, the layout and the step)."""
    data = cfg.data.data
    return {
        "config": config,
        "model_path": _absolute(cfg.model.model_path),
        "weights": weights_fingerprint(cfg.model.model_path),
        "data": data if data == "synthetic" else _absolute(data),
        "eval_data": _absolute(cfg.eval.eval_data),
        "seq_len": cfg.data.seq_len,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "script": _absolute(sys.argv[0]) if sys.argv and sys.argv[0] else None,
    }


def compare_run(
    cfg: TrainConfig, spec: dict, config: dict | None, path: Path, step: int, saved: dict
) -> tuple[dict, list[str]]:
    """Compare the checkpoint ``path`` (``saved``: its ``run.json``) with this launch before anything loads.

    Returns:
        ``(origin, notes)``: the saved run's origin (model path, weights, start time) that this run's
        checkpoints keep, and the notes to print (other weights at the same shapes are ignored; other data,
        another sequence length).

    Raises:
        PreflightError: the checkpoint was saved for another model class or other shapes (one sentence naming
            the first differences, with the way out).
    """
    way_out = "use a new --checkpoint-dir or --no-resume"
    saved_spec = saved.get("model") if isinstance(saved.get("model"), dict) else {}
    saved_class = saved_spec.get("class") or saved_spec.get("factory")
    now_class = spec.get("class") or spec.get("factory")
    if saved_class and now_class and saved_class != now_class:
        raise PreflightError(
            f"checkpoint {path} was saved for a {saved_class}, but this script trains a {now_class}; {way_out}."
        )
    saved_config = saved.get("config") or saved_spec.get("config")
    diffs = config_differences(saved_config, config)
    if diffs:
        shown = diffs[:3]
        keys = " and ".join(f"{k} {a}" for k, a, _ in shown)
        has = " and ".join(str(b) for _, _, b in shown)
        more = f" (and {len(diffs) - 3} more)" if len(diffs) > 3 else ""
        raise PreflightError(f"checkpoint {path} was saved for {keys}{more}, the model has {has}; {way_out}.")
    notes = []
    model_path, data, seq_len = cfg.model.model_path, cfg.data.data, cfg.data.seq_len
    now_path = _absolute(model_path)
    was_path = saved.get("model_path")
    if "weights" in saved or was_path:
        other = now_path != was_path or (
            now_path is not None and saved.get("weights") not in (None, weights_fingerprint(model_path))
        )
        if other:
            origin = was_path or "seeded random weights"
            given = (
                f"--model-path {model_path} is ignored; {way_out} to start from {model_path}"
                if model_path
                else f"{way_out} to start from seeded random weights"
            )
            if now_path == was_path:
                given = (
                    f"the weights in {model_path} changed since and are ignored; {way_out} to start from them"
                )
            notes.append(f"note: resuming step {step} of the run started from {origin}; {given}.")
    now_data = data if data == "synthetic" else _absolute(data)
    if saved.get("data") and saved["data"] != now_data:
        notes.append(
            f"note: checkpoint {path} trained on {saved['data']}; resuming it on --data {data} "
            f"({way_out} to start afresh)."
        )
    if saved.get("seq_len") and seq_len and saved["seq_len"] != seq_len:
        notes.append(
            f"note: checkpoint {path} trained on sequences of {saved['seq_len']} tokens; resuming it with "
            f"--seq-len {seq_len}."
        )
    if not notes:
        started = f" (a run started {saved['started']})" if saved.get("started") else ""
        notes.append(f"note: resuming step {step} from {path}{started}; {way_out} to start afresh.")
    origin = {k: saved[k] for k in ("model_path", "weights", "started") if k in saved}
    return origin, notes


# ---------------------------------------------------------------------------------------------- the checks
def check(cfg: TrainConfig, *, spec: dict, tp: int, stages: int, launcher: str, world: int) -> Checked:
    """Every check of the module docstring on the run's options ``cfg``; returns what the run needs.

    Raises:
        PreflightError: the first problem, in one sentence.
    """
    hint = "deepspeed --num_gpus " if launcher == "deepspeed" else "torchrun --nproc_per_node="
    problem = layout_problem(tp, stages, world, cfg.parallel.dp, cfg.parallel.stages_per_rank, hint)
    if problem:
        raise PreflightError(problem)
    config = read_model_config(spec, cfg.model.model_path)
    _check_text_inputs(cfg)
    _check_positions(cfg, config)
    out = Checked(cfg, world=world, record=run_record(cfg, spec, config))
    if cfg.checkpoint.checkpoint_dir and not cfg.checkpoint.no_resume:
        latest = latest_checkpoint(cfg.checkpoint.checkpoint_dir)
        if latest is not None:
            step, path = latest
            saved = read_run_info(path)
            origin, notes = compare_run(cfg, spec, config, path, step, saved)
            out.resume = latest
            out.record.update(origin)
            out.notes.extend(notes)
    return out


def _check_text_inputs(cfg: TrainConfig) -> None:
    """The files of ``--data`` / ``--eval-data`` exist, and text data has a tokenizer directory with a vocabulary.

    Raises:
        PreflightError: the first problem, in one sentence naming the option.
    """
    model_path, data, eval_data = cfg.model.model_path, cfg.data.data, cfg.eval.eval_data
    for option, path in (
        ("--data", data if data != "synthetic" else None),
        ("--eval-data", eval_data),
    ):
        if path is None:
            continue
        try:
            data_files(path)
        except DataError as err:
            raise PreflightError(str(err).replace("pass --data", f"pass {option}")) from None
    if not (data != "synthetic" or eval_data):
        return
    tok = cfg.model.tokenizer_dir
    if tok is None:
        raise PreflightError(
            f"{'--data' if data != 'synthetic' else '--eval-data'} needs a tokenizer: pass --tokenizer "
            "DIR (or a --model-path with tokenizer files)."
        )
    if not Path(tok).is_dir():
        raise PreflightError(
            f"The tokenizer directory {tok} does not exist; pass --tokenizer a directory written by "
            "tokenizer.save_pretrained(DIR)."
        )
    if not has_tokenizer(tok):
        where = "model directory" if tok == model_path else "tokenizer directory"
        raise PreflightError(
            f"The {where} {tok} holds no tokenizer files (tokenizer.json, vocab.json, vocab.txt or a "
            "sentencepiece model); pass --tokenizer DIR, a directory written by tokenizer.save_pretrained(DIR)."
        )


def _check_positions(cfg: TrainConfig, config: dict | None) -> None:
    """``--seq-len`` and ``--verify-seq-len`` fit the positions the model embeds (its config's limit, if any).

    Raises:
        PreflightError: one sentence naming the option, the limit and where it is read.
    """
    limit = position_limit(config)
    if limit is None:
        return
    key, most = limit
    for option, n in (("seq_len", cfg.data.seq_len), ("verify_seq_len", cfg.verify.verify_seq_len)):
        if n is not None and n > most:
            model_path = cfg.model.model_path
            where = f"{model_path}/config.json" if model_path else "the model's config"
            raise PreflightError(
                f"--{option.replace('_', '-')} {n} is longer than the {most} positions the model embeds "
                f"({key} in {where}); use --{option.replace('_', '-')} {most} or less."
            )


def preflight(
    *,
    model: dict,
    inputs: dict,
    tp: int,
    stages: int = 1,
    launcher: str = "torchrun",
    config: TrainConfig | None = None,
    defaults: dict | None = None,
    argv: list[str] | None = None,
    title: str | None = None,
    **_ignored: Any,
) -> Checked | int:
    """Parse the command line of an exported script and run the checks; the arguments of
    :func:`slapo_lab.train.main`.

    The command line overrides the script's defaults: ``config`` (a new script's ``CONFIG``, every option's
    default), or ``defaults`` (an old script's ``DEFAULTS`` dict, over the example's batch size and sequence
    length: the compatibility path of scripts exported before :class:`TrainConfig`).

    Returns:
        :class:`Checked` when the run can start (its notes already printed on rank 0), else the exit status (2)
        after the one sentence (on the node's local rank 0; argparse's usage line comes before it).

    Raises:
        ValueError: both ``config`` and ``defaults`` given, or ``defaults`` names an option that is not one.
    """
    if config is not None and defaults:
        raise ValueError(
            "pass the script's defaults as config= (a TrainConfig) or defaults= (a dict), not both"
        )
    batch, seq = example_sizes(inputs if isinstance(inputs, dict) else {})
    parser = build_parser(
        title or "Train a model with a slapo-lab schedule.",
        launcher=launcher,
        pipeline=stages > 1,
        example_batch=int(batch or 1),
        example_seq=seq,
        defaults=config if config is not None else defaults,
    )
    quiet = io.StringIO()
    try:
        with contextlib.redirect_stderr(sys.stderr if speaks_errors() else quiet):
            cfg = parse_args(parser, argv)
    except SystemExit as done:
        if done.code not in (0, None):
            return failed(int(done.code) if isinstance(done.code, int) else 2)
        raise
    if cfg.launch.print_ds_config:
        return Checked(cfg, world=launched_world())
    try:
        checked = check(cfg, spec=model, tp=tp, stages=stages, launcher=launcher, world=launched_world())
    except PreflightError as err:
        if speaks_errors():
            print(f"error: {err}", file=sys.stderr, flush=True)
        return failed(2)
    if speaks_notes():
        for note in checked.notes:
            print(note, flush=True)
    return checked
