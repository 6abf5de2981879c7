"""What an exported script needs to rebuild a run: the model spec, the input spec, checked calls.

Everything here is plain JSON data, so that a schedule file (:mod:`slapo_lab.export.io`) can carry
it and the script renderer (:mod:`slapo_lab.export.script`) can trust it only after validation:
every name that ends up as code (a class, a factory, a primitive, a keyword) is checked against a
strict pattern or a registry, and every value ends up as a ``repr``'d literal.
"""

from __future__ import annotations

import importlib
import json
import keyword
import math
import re
from typing import Any

import torch
from torch import nn

from ..record import Call


class ExportError(ValueError):
    """A schedule could not be exported, saved or loaded; ``str(err)`` is one clear sentence."""


FACTORY_HINT = 'pass factory="package.module:function" naming an importable function that builds the model'

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_FACTORY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*\Z")

# dtypes an input may have (the names are ``torch.<name>`` attributes).
INPUT_DTYPES = (
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
)


def is_identifier(name: Any) -> bool:
    """True for an ASCII Python identifier that is not a keyword (safe to write as code)."""
    return isinstance(name, str) and bool(_IDENT.match(name)) and not keyword.iskeyword(name)


def _full_shapes(model: nn.Module) -> dict[str, tuple]:
    """Parameter name -> full (unsharded) shape; a scheduled model reports ``orig_shape``."""
    return {
        n: tuple(getattr(p, "orig_shape", p.shape)) for n, p in model.named_parameters(remove_duplicate=False)
    }


def _transformers_class(name: Any, base_name: str):
    """The class ``transformers.<name>`` if it exists and subclasses ``transformers.<base_name>``."""
    if not is_identifier(name):
        return None
    import transformers

    try:
        cls = getattr(transformers, name)
    except (AttributeError, ImportError, RuntimeError):
        return None
    base = getattr(transformers, base_name)
    return cls if isinstance(cls, type) and issubclass(cls, base) else None


def model_spec(model: nn.Module, factory: str | None = None) -> dict:
    """How an exported script rebuilds ``model`` (same architecture, fresh seeded weights).

    Args:
        model: the model the schedule was recorded on (original or already scheduled: sharded
            parameters are compared by their ``orig_shape``).
        factory: ``"package.module:function"``: a function importable on every node that takes no
            arguments and returns the model. When given it wins over the config route.

    Returns:
        ``{"kind": "factory", "factory": "pkg.mod:fn"}``, or for a ``transformers`` model built from
        its config ``{"kind": "hf", "module": "transformers", "class": "BertModel", "config_class":
        "BertConfig", "config": config.to_dict(), "attn_implementation": "sdpa"}``.

    Raises:
        ExportError: for a malformed factory string or one that does not import here, or a model
            that is not a ``transformers`` class, whose config is not JSON, or that its config does
            not rebuild (e.g. ``BertModel(cfg, add_pooling_layer=False)``): the sentence says to pass
            ``factory=``.
    """
    if factory is not None:
        check_factory(factory, importable=True)
        return {"kind": "factory", "factory": factory}
    cls = type(model)
    name = cls.__name__
    if _transformers_class(name, "PreTrainedModel") is not cls:
        raise ExportError(
            f"{name} is not a transformers model that its config rebuilds, so the script cannot "
            f"rebuild it; {FACTORY_HINT}."
        )
    config = model.config
    config_name = type(config).__name__
    if _transformers_class(config_name, "PretrainedConfig") is not type(config):
        raise ExportError(
            f"The config class {config_name} of {name} is not importable from transformers; {FACTORY_HINT}."
        )
    try:
        cfg = json.loads(json.dumps(config.to_dict(), allow_nan=False))
    except (TypeError, ValueError) as err:
        raise ExportError(
            f"The config of {name} cannot be written as JSON ({err}); {FACTORY_HINT}."
        ) from None
    spec = {"kind": "hf", "module": "transformers", "class": name, "config_class": config_name, "config": cfg}
    attn = getattr(config, "_attn_implementation", None)
    if isinstance(attn, str) and attn:
        spec["attn_implementation"] = attn
    _check_rebuilds(model, spec)
    return spec


def _build_hf(spec: dict, device: str = "meta") -> nn.Module:
    cls = _transformers_class(spec["class"], "PreTrainedModel")
    config_cls = _transformers_class(spec["config_class"], "PretrainedConfig")
    kwargs = {"attn_implementation": spec["attn_implementation"]} if "attn_implementation" in spec else {}
    config = config_cls.from_dict(dict(spec["config"]), **kwargs)
    with torch.device(device):
        return cls(config)


def build_from_spec(spec: dict, device: str = "meta") -> nn.Module:
    """The model a spec from :func:`model_spec` describes, built on ``device`` (``"meta"``: no weights
    are allocated): the config route builds the ``transformers`` class from its config, the factory
    route calls ``package.module:function`` under that device.

    Raises:
        ExportError: when the model cannot be built (one sentence with the reason).
    """
    try:
        if spec["kind"] == "factory":
            mod_name, fn_name = spec["factory"].split(":")
            with torch.device(device):
                return getattr(importlib.import_module(mod_name), fn_name)()
        return _build_hf(spec, device)
    except Exception as err:  # noqa: BLE001 - any failure to build is one sentence
        raise ExportError(
            f"The model could not be built on the {device} device ({type(err).__name__}: {err})."
        ) from None


def _check_rebuilds(model: nn.Module, spec: dict) -> None:
    """Build the spec on the meta device and compare parameter names and full shapes with ``model``."""
    name = spec["class"]
    try:
        rebuilt = _build_hf(spec)
    except Exception as err:  # noqa: BLE001 - any failure means the script would fail the same way
        raise ExportError(
            f"{name} could not be rebuilt from its config ({type(err).__name__}: {err}); {FACTORY_HINT}."
        ) from None
    want, got = _full_shapes(model), _full_shapes(rebuilt)
    if want != got:
        extra = sorted(set(got) - set(want))
        missing = sorted(set(want) - set(got))
        shape = sorted(k for k in set(want) & set(got) if want[k] != got[k])
        what = (
            f"it would add {extra[0]!r}"
            if extra
            else f"it would lack {missing[0]!r}"
            if missing
            else f"{shape[0]!r} would have shape {got[shape[0]]} instead of {want[shape[0]]}"
        )
        raise ExportError(
            f"{name} rebuilt from its config differs from the given model ({what}); {FACTORY_HINT}."
        )


def check_factory(factory: Any, importable: bool = False) -> None:
    """Raise ExportError unless ``factory`` is ``"package.module:function"`` (and, if asked, imports).

    Raises:
        ExportError: a malformed string, or with ``importable`` a module that does not import here or
            a name in it that is missing or not callable.
    """
    if (
        not isinstance(factory, str)
        or not _FACTORY.match(factory)
        or any(keyword.iskeyword(p) for p in re.split(r"[.:]", factory))
    ):
        raise ExportError(f'The factory {factory!r} is not of the form "package.module:function".')
    if not importable:
        return
    mod_name, fn_name = factory.split(":")
    if mod_name == "__main__":
        raise ExportError(
            f"The factory {factory!r} lives in __main__ (a notebook or script), which the exported "
            "script cannot import; move it into an importable module."
        )
    try:
        mod = importlib.import_module(mod_name)
    except Exception as err:  # noqa: BLE001 - an import can raise anything
        raise ExportError(
            f"The factory module {mod_name!r} does not import here ({type(err).__name__}: {err}); "
            "it must be importable on every node."
        ) from None
    if not callable(getattr(mod, fn_name, None)):
        raise ExportError(f"The factory module {mod_name!r} has no function {fn_name!r}.")


def validate_model_spec(spec: Any) -> dict:
    """Check a model spec (from :func:`model_spec` or a file) before it is rendered as code.

    Raises:
        ExportError: naming the first problem.
    """
    if not isinstance(spec, dict) or spec.get("kind") not in ("hf", "factory"):
        raise ExportError('The model spec must be a dict with kind "hf" or "factory".')
    if spec["kind"] == "factory":
        check_factory(spec.get("factory"))
        return spec
    if spec.get("module", "transformers") != "transformers":
        raise ExportError(f'The model spec\'s module must be "transformers", not {spec.get("module")!r}.')
    if _transformers_class(spec.get("class"), "PreTrainedModel") is None:
        raise ExportError(f"The model spec's class {spec.get('class')!r} is not a transformers model class.")
    if _transformers_class(spec.get("config_class"), "PretrainedConfig") is None:
        raise ExportError(
            f"The model spec's config_class {spec.get('config_class')!r} is not a transformers config class."
        )
    if not isinstance(spec.get("config"), dict):
        raise ExportError("The model spec's config must be a JSON object.")
    _check_json("the model config", spec["config"])
    attn = spec.get("attn_implementation")
    if attn is not None and not (isinstance(attn, str) and re.fullmatch(r"[A-Za-z0-9_.\-/]+", attn)):
        raise ExportError(f"The model spec's attn_implementation {attn!r} is not a plain name.")
    return spec


# ------------------------------------------------------------------------------------------ inputs
def input_spec(example_inputs: dict, vocab_size: int | None = None) -> dict:
    """Describe the example inputs so that the script can synthesise ones of the same kind.

    Args:
        example_inputs: keyword arguments of one forward call: tensors (any device, meta included)
            or JSON scalars (passed through unchanged), e.g. ``{"input_ids": ids}`` with ``ids`` of
            shape ``(batch, seq)``.
        vocab_size: the high bound of ``*input_ids`` (the config's ``vocab_size``), if known.

    Returns:
        name -> ``{"shape": [8, 128], "dims": ["batch", "seq"], "dtype": "int64", "low": 0,
        "high": 30522}``. ``dims`` names each axis: ``"batch"`` (axis 0 of every tensor whose
        first size equals the first tensor's), ``"seq"`` (axis 1 of every tensor whose second size
        equals the sequence length of the first integer tensor with two or more axes), else the
        fixed size. Integer tensors get ``low``/``high`` (``high`` = ``vocab_size`` for ``*input_ids``
        if known, else max + 1) or, when constant (an all-ones attention mask), ``fill``; floating
        tensors are standard normal; a scalar is ``{"value": v}``.

    Raises:
        ExportError: for a non-dict, a non-string name, a value that is neither a tensor nor a JSON
            scalar, or an unsupported dtype.
    """
    if not isinstance(example_inputs, dict):
        raise ExportError('The example inputs must be a dict of keyword arguments, e.g. {"input_ids": ids}.')
    tensors = {k: v for k, v in example_inputs.items() if isinstance(v, torch.Tensor)}
    batch = next((t.shape[0] for t in tensors.values() if t.dim() >= 1), None)
    seq = next(
        (
            t.shape[1]
            for t in tensors.values()
            if t.dim() >= 2 and not t.is_floating_point() and t.dtype != torch.bool
        ),
        None,
    )
    spec: dict[str, dict] = {}
    for name, v in example_inputs.items():
        if not isinstance(name, str):
            raise ExportError(f"Example input names must be strings, not {name!r}.")
        if not isinstance(v, torch.Tensor):
            if v is None or isinstance(v, (bool, int, str)) or (isinstance(v, float) and math.isfinite(v)):
                spec[name] = {"value": v}
                continue
            raise ExportError(
                f"The example input {name!r} is a {type(v).__name__}; only tensors and JSON scalars "
                "can be exported."
            )
        dtype = str(v.dtype).removeprefix("torch.")
        if dtype not in INPUT_DTYPES:
            raise ExportError(f"The example input {name!r} has dtype {dtype}, which export does not support.")
        dims: list = list(v.shape)
        if dims and batch is not None and dims[0] == batch:
            dims[0] = "batch"
        if len(dims) >= 2 and seq is not None and dims[1] == seq:
            dims[1] = "seq"
        entry: dict[str, Any] = {"shape": list(v.shape), "dims": dims, "dtype": dtype}
        if not v.is_floating_point():
            entry.update(_int_range(name, v, vocab_size))
        spec[name] = entry
    return spec


def _int_range(name: str, t: torch.Tensor, vocab_size: int | None) -> dict:
    is_ids = name.endswith("input_ids")
    if is_ids and vocab_size:
        return {"low": 0, "high": int(vocab_size)}
    if t.device.type == "meta" or t.numel() == 0:  # values unknown: a mask of ones, else zeros
        return {"fill": 1 if "mask" in name else 0}
    lo, hi = int(t.min()), int(t.max())
    if t.dtype == torch.bool:
        return {"fill": bool(lo)} if lo == hi else {"low": 0, "high": 2}
    low = max(lo, 0)  # negative sentinels (e.g. an ignore index of -100) are not drawn
    if lo == hi or hi < low:
        return {"fill": lo}
    return {"low": low, "high": hi + 1}


def validate_input_spec(spec: Any) -> dict:
    """Check an input spec (from :func:`input_spec` or a file) before it is rendered as code.

    Raises:
        ExportError: naming the first problem.
    """
    if not isinstance(spec, dict) or not spec:
        raise ExportError("The input spec must be a non-empty dict of input name -> description.")
    for name, e in spec.items():
        where = f"The input spec of {name!r}"
        if not isinstance(name, str) or not isinstance(e, dict):
            raise ExportError(f"{where} must be a dict under a string name.")
        _check_json(where, e)
        if "value" in e:
            continue
        if e.get("dtype") not in INPUT_DTYPES:
            raise ExportError(f"{where} has dtype {e.get('dtype')!r}; supported: {', '.join(INPUT_DTYPES)}.")
        dims = e.get("dims", e.get("shape"))
        if not isinstance(dims, list) or not all(
            d in ("batch", "seq") or (isinstance(d, int) and not isinstance(d, bool) and d >= 0) for d in dims
        ):
            raise ExportError(f'{where} needs dims: a list of sizes, "batch" or "seq".')
        if not isinstance(e.get("shape", dims), list) or len(e.get("shape", dims)) != len(dims):
            raise ExportError(f"{where} has a shape that does not match its dims.")
        if e["dtype"].startswith(("float", "bfloat")):
            continue
        if "fill" in e:
            if not isinstance(e["fill"], (int, bool)):
                raise ExportError(f"{where} has a non-integer fill value.")
        elif (
            not all(isinstance(e.get(k), int) and not isinstance(e.get(k), bool) for k in ("low", "high"))
            or e["low"] >= e["high"]
        ):
            raise ExportError(f"{where} needs integer bounds low < high (or a fill value).")
    return spec


def example_sizes(spec: dict) -> tuple[int | None, int | None]:
    """``(batch_size, seq_len)`` of the example, read off the input spec (None when no axis has it)."""
    batch = seq = None
    for e in spec.values():
        for d, n in zip(e.get("dims", ()), e.get("shape", ())):
            if d == "batch" and batch is None:
                batch = n
            if d == "seq" and seq is None:
                seq = n
    return batch, seq


# ------------------------------------------------------------------------------------------- calls
def _check_json(where: str, v: Any) -> None:
    """Raise ExportError unless ``v`` is JSON data that ``repr`` writes as a valid Python literal."""
    if v is None or isinstance(v, (bool, int, str)):
        return
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ExportError(
                f"{where} has the value {v!r}, which is not finite and cannot be written as JSON "
                "or a Python literal."
            )
        return
    if isinstance(v, (list, tuple)):
        for x in v:
            _check_json(where, x)
        return
    if isinstance(v, dict):
        for k, x in v.items():
            if not isinstance(k, str):
                raise ExportError(f"{where} has a non-string key {k!r}.")
            _check_json(where, x)
        return
    if isinstance(v, nn.Module):
        raise ExportError(
            f"{where} passes a {type(v).__name__} module object, which cannot be written into a "
            "script; only JSON values (strings, numbers, lists, dicts) can be exported."
        )
    if callable(v):
        name = getattr(v, "__qualname__", None) or type(v).__name__
        hint = (
            'use a named sync op such as "all_reduce"'
            if ".sync" in where
            else "only JSON values can be exported"
        )
        raise ExportError(
            f"{where} passes the Python function {name}, which cannot be written into a script; {hint}."
        )
    raise ExportError(f"{where} has an argument of type {type(v).__name__}, which cannot be exported.")


def validate_calls(calls: Any) -> list[Call]:
    """Check recorded calls (Call objects or their JSON dicts) before they are rendered as code.

    Each must name a registered primitive, bind to its signature, and carry only JSON literals.

    Returns:
        the calls as :class:`Call` objects.

    Raises:
        ExportError: naming the first bad call (by position and path).
    """
    from ..errors import ScheduleError
    from ..primitives import get_primitive, list_primitives

    calls = getattr(calls, "calls", calls)  # a Recorder
    if not isinstance(calls, (list, tuple)):
        raise ExportError("The recorded calls must be a list.")
    out = []
    for n, c in enumerate(calls, 1):
        if isinstance(c, dict):
            if not isinstance(c.get("args", []), list) or not isinstance(c.get("kwargs", {}), dict):
                raise ExportError(f"Call {n} has malformed args or kwargs.")
            try:
                c = Call.from_json(c)
            except (KeyError, TypeError):
                raise ExportError(f"Call {n} is not a {{path, primitive, args, kwargs}} object.") from None
        if not isinstance(c, Call) or not isinstance(c.path, str):
            raise ExportError(f"Call {n} is not a recorded call with a string path.")
        where = f"Call {n} (sch[{c.path!r}].{c.primitive if isinstance(c.primitive, str) else '?'})"
        if not is_identifier(c.primitive) or get_primitive(c.primitive) is None:
            raise ExportError(f"{where} names an unknown primitive; known: {', '.join(list_primitives())}.")
        for k in c.kwargs:
            if not is_identifier(k):
                raise ExportError(f"{where} has the keyword {k!r}, which is not a Python name.")
        _check_json(where, list(c.args))
        _check_json(where, dict(c.kwargs))
        try:
            get_primitive(c.primitive).bind(*c.args, **c.kwargs)
        except ScheduleError as err:
            raise ExportError(f"{where}: {str(err).rstrip('.')}.") from None
        out.append(c)
    return out
