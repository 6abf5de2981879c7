"""The command line of an exported training script, generated from :class:`~slapo_lab.train.config.TrainConfig`.

Every option is a field of a ``TrainConfig`` section (its flag ``--global-batch-size``, type, default, help,
choices and metavar read off the field and its metadata); an export bakes its own defaults (the model path, the
data, the data-parallel size ...) into the script, which the command line still overrides. A bad value or
combination is refused by argparse with the config's one sentence and exit status 2 before anything is built.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from .config import (
    LR_SCHEDULES,
    OPTIMIZERS,
    PP_SCHEDULES,
    SAVE_DTYPES,
    ConfigError,
    TrainConfig,
    flag,
    option_fields,
    option_type,
)

__all__ = ["LR_SCHEDULES", "OPTIMIZERS", "PP_SCHEDULES", "SAVE_DTYPES", "build_parser", "parse_args"]


def build_parser(
    description: str = "",
    launcher: str = "torchrun",
    pipeline: bool = False,
    example_batch: int = 1,
    example_seq: int | None = None,
    defaults: Mapping[str, Any] | TrainConfig | None = None,
) -> argparse.ArgumentParser:
    """The argument parser of one exported script: one flag per :class:`TrainConfig` option.

    Args:
        description: the first line of ``--help``.
        launcher: ``"torchrun"`` or ``"deepspeed"`` (adds ``--zero`` and ``--print-ds-config``).
        pipeline: whether the schedule has pipeline cuts (adds ``--pp-schedule``, ``--stages-per-rank``).
        example_batch / example_seq: the example inputs' batch size and sequence length (the defaults
            of ``--global-batch-size`` and ``--seq-len``).
        defaults: option defaults baked in by the export, over the example's sizes: a :class:`TrainConfig` (new
            scripts' ``CONFIG``; the options it changes from the class defaults) or a dict
            ``{"model_path": ..., "data": ..., "dp": 2}`` (``DEFAULTS`` of scripts exported before it).

    Raises:
        ValueError: ``defaults`` names an option that is not one.
    """
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    present = set()
    for name, (section, f) in option_fields().items():
        meta = f.metadata
        if (meta["only"] == "deepspeed" and launcher != "deepspeed") or (
            meta["only"] == "pipeline" and not pipeline
        ):
            continue
        if section.TITLE not in groups:
            groups[section.TITLE] = p.add_argument_group(section.TITLE)
        groups[section.TITLE].add_argument(*(meta["flags"] or (flag(name),)), **_argument(name, f))
        present.add(name)
    if isinstance(defaults, TrainConfig):
        defaults = defaults.changed()
    p.set_defaults(global_batch_size=example_batch, seq_len=example_seq)
    if defaults:
        unknown = sorted(set(defaults) - present)
        if unknown:
            raise ValueError(f"unknown default option(s) {', '.join(unknown)}")
        p.set_defaults(**defaults)
    return p


def _argument(name: str, f: dataclasses.Field) -> dict[str, Any]:
    """``add_argument``'s keyword arguments for the option ``name`` (its :class:`TrainConfig` field ``f``): its
    default, help (hidden ones suppressed), a flag pair or switch for a bool, else its type, choices and metavar."""
    meta = f.metadata
    kind = option_type(name)
    kwargs: dict[str, Any] = {"default": f.default, "dest": name}
    if meta["hidden"]:
        kwargs["help"] = argparse.SUPPRESS
    elif meta["help"]:
        kwargs["help"] = meta["help"].replace("%", "%%")
    if kind is bool:
        kwargs["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
        return kwargs
    if kind is not str:
        kwargs["type"] = kind
    if meta["choices"] is not None:
        kwargs["choices"] = meta["choices"]
    if meta["metavar"] is not None:
        kwargs["metavar"] = meta["metavar"]
    return kwargs


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> TrainConfig:
    """Parse and check ``argv`` into a :class:`TrainConfig`; a bad value or combination exits with status 2 and
    the config's one sentence (``parser.error``)."""
    ns = parser.parse_args(argv)
    try:
        return TrainConfig.from_flat(vars(ns))
    except ConfigError as err:
        parser.error(str(err))
    raise AssertionError("parser.error returns only by an exception")  # pragma: no cover
