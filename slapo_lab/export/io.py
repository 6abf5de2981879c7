"""Schedule files: ``slapo_lab.record.dumps(calls, meta)`` JSON with what export needs in ``meta``.

::

    {"schema": "slapo-lab/schedule", "version": 1,
     "meta": {"model": <model spec>, "inputs": <input spec>, "world_size": 2, "slapo_lab": <slapo_lab.__version__>},
     "calls": [{"path": "encoder.layer.0.attention.self.query", "primitive": "shard",
                "args": ["weight"], "kwargs": {"axis": 0}}, ...]}

:func:`load_schedule` validates the whole file before returning anything (so a caller that replays
it never applies half a file): a corrupt file, another schema, a newer version, an unknown
primitive or malformed arguments each raise :class:`ExportError` with one sentence.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from torch import nn

from .. import __version__
from ..record import SCHEMA, SCHEMA_VERSION, Call, Recorder, dumps
from ..spec import (
    ExportError,
    check_factory,
    check_json,
    input_spec,
    model_spec,
    validate_calls,
    validate_input_spec,
    validate_model_spec,
)
from ..utils.collector import gc_paused
from .script import write_text_atomic

#: The most calls :func:`load_schedule` reads from one schedule file, and the most bytes (checked before
#: the file is read): the editor loads 50,000 calls in about 3 s (``benchmarks/schedule_load_bench.py``),
#: while a 70B Llama's Megatron schedule has about 1,100 calls. A file :func:`save_schedule` writes
#: takes 150 to 400 bytes per call, so 32 MiB holds 50,000 calls with room to spare.
MAX_SCHEDULE_CALLS = 50_000
MAX_SCHEDULE_BYTES = 32 * 2**20


class ScheduleFile(NamedTuple):
    """A loaded schedule file: ``calls, meta = load_schedule(path)``."""

    calls: list[Call]
    meta: dict

    @property
    def world_size(self) -> int | None:
        """The tensor-parallel width the calls were recorded for (None if the file has none)."""
        return self.meta.get("world_size")


def save_schedule(
    path: str | os.PathLike,
    calls: Sequence[Call] | Recorder,
    model: nn.Module | None = None,
    example_inputs: dict | None = None,
    world_size: int | None = None,
    factory: str | None = None,
    meta: dict | None = None,
) -> Path:
    """Write ``calls`` (and what export needs) to a JSON schedule file.

    Args:
        path: the file to write (its folder must exist); replaced atomically.
        calls: ``sch.record.calls`` (or the Recorder).
        model: if given, its :func:`~slapo_lab.export.model_spec` is stored as ``meta["model"]``.
        example_inputs: if given, their :func:`~slapo_lab.export.input_spec` is ``meta["inputs"]``.
        world_size: stored as ``meta["world_size"]``.
        factory: passed to ``model_spec``.
        meta: extra JSON-able entries (the editor may keep its own keys here).

    Returns:
        The absolute path written.

    Raises:
        ExportError: a call or meta value that cannot be saved, a model export cannot rebuild, or
            an unwritable path.
    """
    try:
        calls = validate_calls(calls)
    except RecursionError:
        raise ExportError("A call argument is nested too deeply to be saved.") from None
    out = dict(meta or {})
    if model is not None:
        out["model"] = model_spec(model, factory)
    elif factory is not None:
        check_factory(factory, importable=True)  # the caller's own factory= (their code), never a file's
        out["model"] = {"kind": "factory", "factory": factory}
    if example_inputs is not None:
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        out["inputs"] = input_spec(example_inputs, vocab if isinstance(vocab, int) else None)
    if world_size is not None:
        out["world_size"] = _check_world_size(world_size)
    out.setdefault("slapo_lab", __version__)
    try:
        check_json("The schedule's meta", out)
        text = dumps(calls, out)
    except RecursionError:
        raise ExportError("The schedule's meta is nested too deeply to be saved.") from None
    except (TypeError, ValueError) as err:
        raise ExportError(f"The schedule cannot be saved as JSON: {str(err).rstrip('.')}.") from None
    path = Path(os.fspath(path)).expanduser()
    write_text_atomic(path, text + "\n")
    return path.resolve()


def _check_world_size(ws: Any) -> int:
    if isinstance(ws, bool) or not isinstance(ws, int) or ws < 1:
        raise ExportError(f"world_size must be a positive integer, not {ws!r}.")
    return ws


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


@gc_paused()  # parsed JSON and Call objects hold no cycles: collecting meanwhile only re-scans them
def load_schedule(path: str | os.PathLike) -> ScheduleFile:
    """Read and fully validate a schedule file written by :func:`save_schedule`.

    A file is bounded: one larger than :data:`MAX_SCHEDULE_BYTES` (32 MiB) is refused before it is
    read, and one with more than :data:`MAX_SCHEDULE_CALLS` (50,000) calls before any call is
    validated, each with one sentence.

    Returns:
        ``ScheduleFile(calls, meta)``; ``meta["model"]``, ``meta["inputs"]`` and
        ``meta["world_size"]`` are validated when present.

    Raises:
        ExportError: a missing/unreadable file, a file over the bounds, invalid JSON (NaN included),
            another schema, a version newer than this slapo-lab reads, or any bad call or meta entry.
    """
    path = Path(os.fspath(path)).expanduser()
    data = _parse_json(path, _read_bounded(path))
    meta = _check_envelope(path, data)
    return ScheduleFile(_validate_entries(path, data["calls"], meta), meta)


def _read_bounded(path: Path) -> str:
    """The text of the file at ``path``, refused over :data:`MAX_SCHEDULE_BYTES` before it is read.

    Raises:
        ExportError: a missing, unreadable, oversized or non-UTF-8 file (one sentence).
    """
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(MAX_SCHEDULE_BYTES + 1) if size <= MAX_SCHEDULE_BYTES else b""
        if size > MAX_SCHEDULE_BYTES or len(raw) > MAX_SCHEDULE_BYTES:
            raise ExportError(
                f"{path} is {max(size, len(raw)) / 2**20:,.1f} MiB, over the {MAX_SCHEDULE_BYTES // 2**20} MiB "
                f"that slapo-lab reads per schedule file (at most {MAX_SCHEDULE_CALLS:,} calls; a 70B Llama's "
                "Megatron schedule has about 1,100)."
            )
        return raw.decode("utf-8")
    except FileNotFoundError:
        raise ExportError(f"The schedule file {path} does not exist.") from None
    except (OSError, UnicodeDecodeError) as err:
        reason = getattr(err, "strerror", None) or str(err)
        raise ExportError(f"Cannot read the schedule file {path}: {reason}.") from None


def _parse_json(path: Path, text: str) -> Any:
    """``json.loads(text)`` without NaN or infinities.

    Raises:
        ExportError: invalid or too deeply nested JSON (one sentence naming ``path``).
    """
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as err:
        raise ExportError(
            f"{path} is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})."
        ) from None
    except ValueError as err:
        raise ExportError(f"{path} is not valid JSON ({err}).") from None
    except RecursionError:
        raise ExportError(f"{path} nests its JSON too deeply to be a schedule file.") from None


def _check_envelope(path: Path, data: Any) -> dict:
    """Check the file's schema, version, ``meta`` object and list of calls (within :data:`MAX_SCHEDULE_CALLS`);
    returns ``meta``.

    Raises:
        ExportError: another schema, an invalid or newer version, a ``meta`` that is no object, no list of
            calls, or too many calls (one sentence).
    """
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ExportError(f'{path} is not a slapo-lab schedule file (no "schema": "{SCHEMA}").')
    version = data.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ExportError(f"{path} has an invalid schedule format version {version!r}.")
    if version > SCHEMA_VERSION:
        raise ExportError(
            f"{path} uses schedule format version {version}, newer than this slapo-lab reads "
            f"(up to {SCHEMA_VERSION}); upgrade slapo-lab."
        )
    meta = data.get("meta", {})
    if not isinstance(meta, dict):
        raise ExportError(f'{path} has a "meta" entry that is not a JSON object.')
    if not isinstance(data.get("calls"), list):
        raise ExportError(f"{path} has no list of calls.")
    if len(data["calls"]) > MAX_SCHEDULE_CALLS:
        raise ExportError(
            f"{path} has {len(data['calls']):,} calls; slapo-lab reads at most {MAX_SCHEDULE_CALLS:,} calls "
            "per schedule file (a 70B Llama's Megatron schedule has about 1,100)."
        )
    return meta


def _validate_entries(path: Path, calls: list, meta: dict) -> list[Call]:
    """The calls as :class:`Call` objects, after checking them and the ``meta`` entries export reads.

    Raises:
        ExportError: a bad call, model spec, input spec or world size, or a too deeply nested one (one sentence
            naming ``path``).
    """
    try:
        checked = validate_calls(calls)
        if "model" in meta:
            validate_model_spec(meta["model"])
        if "inputs" in meta:
            validate_input_spec(meta["inputs"])
        if "world_size" in meta:
            _check_world_size(meta["world_size"])
    except ExportError as err:
        raise ExportError(f"{path}: {err}") from None
    except RecursionError:
        raise ExportError(
            f"{path} nests a call argument or meta entry too deeply to be a schedule file."
        ) from None
    return checked
