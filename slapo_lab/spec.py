"""What an exported script needs to rebuild a run: the model spec, the input spec, checked calls.

Everything here is plain JSON data, so that a schedule file (:mod:`slapo_lab.export.io`) can carry
it and the script renderer (:mod:`slapo_lab.export.script`) can trust it only after validation:
every name that ends up as code (a class, a factory, a primitive, a keyword) is checked against a
strict pattern or a registry, and every value ends up as a ``repr``'d literal.

A factory a schedule file names is never imported without consent: :func:`build_from_spec` refuses it
unless ``trust_factory=True`` (``--trust-factory`` on the command line), and even then only a factory
whose top-level package lives in the user's project folder (:func:`check_factory_in_project`).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import keyword
import math
import os
import re
import site
import sys
import sysconfig
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .errors import ScheduleError
from .primitives import get_primitive, list_primitives
from .record import Call


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


def transformers_class(name: Any, base_name: str):
    """The class ``transformers.<name>`` if it exists and subclasses ``transformers.<base_name>``."""
    if not is_identifier(name):
        return None
    import transformers  # noqa: PLC0415 - heavy (seconds): loaded only when a file names a model class

    try:  # a file's name: an identifier, looked up in transformers only, kept only if a subclass of base
        cls = getattr(transformers, name)
    except (AttributeError, ImportError, RuntimeError):
        return None
    base = getattr(transformers, base_name)
    return cls if isinstance(cls, type) and issubclass(cls, base) else None


def objective_of(model_class_name: str) -> str | None:
    """The training objective of a Hugging Face model class, by its name (a fact of the model spec's
    ``class``, read by the export's checks and the training data).

    Returns:
        ``"causal_lm"`` for ``*ForCausalLM`` and ``*LMHeadModel`` (GPT-2), ``"masked_lm"`` for
        ``*ForMaskedLM``, else ``None`` (a class whose forward takes no token ``labels``: train it on
        synthetic data).
    """
    if model_class_name.endswith(("ForCausalLM", "LMHeadModel")):
        return "causal_lm"
    if model_class_name.endswith("ForMaskedLM"):
        return "masked_lm"
    return None


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
    if transformers_class(name, "PreTrainedModel") is not cls:
        raise ExportError(
            f"{name} is not a transformers model that its config rebuilds, so the script cannot "
            f"rebuild it; {FACTORY_HINT}."
        )
    config = model.config
    config_name = type(config).__name__
    if transformers_class(config_name, "PretrainedConfig") is not type(config):
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


def build_hf(spec: dict, device: str = "meta") -> nn.Module:
    """The transformers model of a validated ``"hf"`` spec, built from its config class and config on ``device``
    (``"meta"``: no storage). Raises what transformers raises for a config it cannot build."""
    cls = transformers_class(spec["class"], "PreTrainedModel")
    config_cls = transformers_class(spec["config_class"], "PretrainedConfig")
    kwargs = {"attn_implementation": spec["attn_implementation"]} if "attn_implementation" in spec else {}
    config = config_cls.from_dict(dict(spec["config"]), **kwargs)
    with torch.device(device):
        return cls(config)


def factory_consent_error(factory: str, what: str = "the schedule file") -> ExportError:
    """The one-sentence refusal of a factory ``what`` names and the user has not consented to import.

    Args:
        factory: the ``"package.module:function"`` string.
        what: who names it, e.g. ``"the schedule file s.json"``.
    """
    return ExportError(
        f"{what[:1].upper()}{what[1:]} names the factory {factory!r}, which would be imported and called to "
        "build the model; run again with --trust-factory (trust_factory=True in Python) if you trust it."
    )


def _realpath(p) -> Path:
    return Path(os.path.realpath(os.fspath(p)))


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _python_roots() -> list[tuple[str, Path]]:
    """(what, folder) of every folder of the Python installation: a factory there is never the user's."""
    paths = sysconfig.get_paths()
    roots = [("site-packages", paths.get(key)) for key in ("purelib", "platlib")]
    with contextlib.suppress(AttributeError):  # site.getsitepackages is missing in some virtualenvs
        roots += [("site-packages", p) for p in site.getsitepackages()]
    roots.append(("site-packages", site.getusersitepackages()))
    roots += [("the standard library", paths.get(key)) for key in ("stdlib", "platstdlib")]
    for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, paths.get("data")):
        roots.append(("the Python installation", p))
    return [(what, _realpath(p)) for what, p in roots if p]


def _project_folder(project=None) -> Path:
    """The resolved project folder: ``project``, or the current working directory when None.

    Raises:
        ExportError: ``project`` is not an existing folder.
    """
    folder = _realpath(Path.cwd() if project is None else Path(os.fspath(project)).expanduser())
    if not folder.is_dir():
        raise ExportError(f"The project folder {folder} is not an existing folder.")
    return folder


@contextlib.contextmanager
def _importable_from(folder: Path):
    """``folder`` first on ``sys.path`` while the block runs (unless it is there already)."""
    entry = str(folder)
    added = entry not in sys.path
    if added:
        sys.path.insert(0, entry)
        importlib.invalidate_caches()
    try:
        yield
    finally:
        if added:
            with contextlib.suppress(ValueError):
                sys.path.remove(entry)


def check_factory_in_project(factory: Any, project=None) -> Path:
    """Check, without importing anything, that ``factory``'s top-level package lives in the project.

    The package is located the way ``import`` would find it with the project folder first on
    ``sys.path`` (:func:`importlib.util.find_spec` of the top-level name only, which loads no code; a
    module already imported is located by its spec). It must be a file or folder inside the project
    and outside the Python installation (``sys.prefix``, ``sys.base_prefix``, the standard library,
    site-packages, any ``site-packages`` or ``dist-packages`` folder; a virtual environment inside the
    project is still the installation), so that a schedule file can name only the user's own code,
    never ``os:abort``. Symbolic links are resolved first.

    Args:
        factory: ``"package.module:function"``.
        project: the user's project folder (default: the current working directory).

    Returns:
        The resolved location of the top-level package (its folder, or its ``.py`` file).

    Raises:
        ExportError: a malformed factory, a missing project folder, or (one sentence naming the factory
            and why) a package that is ``__main__``, built into Python, not found, or resolves outside
            the project or inside the Python installation.
    """
    check_factory(factory)
    folder = _project_folder(project)
    top = factory.split(":")[0].split(".")[0]

    located, why = _locate_in_project(top, folder)
    if why:
        raise _project_refusal(factory, why)
    return located


def _project_refusal(factory: str, why: str) -> ExportError:
    return ExportError(
        f"The factory {factory!r} is refused because {why}; only a factory whose package lives in "
        "the project folder (--project DIR, project= in Python) is imported."
    )


def _locate_in_project(top: str, folder: Path) -> tuple[Path | None, str]:
    """``(location, "")`` of the top-level module ``top`` when it lives in ``folder``, else ``(None, why)``."""
    if top == "__main__":
        return None, f"__main__ is the running program, not a module of the project {folder}"
    with _importable_from(folder):
        try:
            # a top-level name: find_spec imports no parent package and runs no module code
            found = importlib.util.find_spec(top)
        except (ImportError, ValueError) as err:
            return None, f"{top} cannot be located ({type(err).__name__}: {err})"
    if found is None:
        return None, f"no module {top} is found in the project {folder} or on sys.path"
    where = list(found.submodule_search_locations or [])
    if not where and found.has_location and found.origin:
        where = [found.origin]
    if not where:
        how = "built into Python" if found.origin in ("built-in", "frozen") else "not loaded from a file"
        return None, f"{top} is {how}, not a module in the project {folder}"
    roots = _python_roots()
    for loc in map(_realpath, where):
        why = _outside_project(top, loc, folder, roots)
        if why:
            return None, why
    return _realpath(where[0]), ""


def _outside_project(top: str, loc: Path, folder: Path, roots: Any) -> str:
    """Why module ``top``'s location ``loc`` is not a module of the project ``folder`` (outside it, inside a
    Python installation ``roots`` gives, e.g. a venv inside the project, or a site-packages folder), or ""."""
    if not _inside(loc, folder):
        return f"{top} resolves to {loc}, outside the project {folder}"
    for what, root in roots:
        if _inside(loc, root) and not _inside(folder, root):  # e.g. a venv inside the project
            return f"{top} resolves to {loc}, inside {what} {root}"
    if {"site-packages", "dist-packages"} & set(loc.relative_to(folder).parts):
        return f"{top} resolves to {loc}, inside a site-packages folder"
    return ""


def build_from_spec(
    spec: dict, device: str = "meta", trust_factory: bool = False, project=None, *, confine: bool = True
) -> nn.Module:
    """The model a spec from :func:`model_spec` describes, built on ``device`` (``"meta"``: no weights
    are allocated): the config route builds the ``transformers`` class from its config, the factory
    route imports ``package.module:function`` and calls it under that device.

    A spec is usually read from a schedule file, which is data that people send each other, so the
    factory route needs consent: without ``trust_factory`` it raises before importing anything, and with
    it the factory must still pass :func:`check_factory_in_project` before its module is imported, and
    the function must be defined in a module of the project (not ``from os import abort``) before it is
    called.

    Args:
        spec: a model spec (``{"kind": "hf", ...}`` or ``{"kind": "factory", "factory": "pkg.mod:fn"}``).
        device: where the model is built.
        trust_factory: consent to import and call the factory the spec names (the command line's
            ``--trust-factory``).
        project: the user's project folder the factory's package must live in (default: the current
            working directory); it is first on ``sys.path`` while the factory is imported and called.
        confine: False skips the project check (the factory is imported from ``sys.path`` as it is):
            only for a spec that is part of code the user runs, such as an exported script's ``MODEL``,
            never for one read from a file.

    Raises:
        ExportError: a factory without ``trust_factory`` (one sentence naming it and the flag), one that
            :func:`check_factory_in_project` refuses or whose function the project does not define, or a
            model that cannot be built (one sentence with the reason).
    """
    if not (isinstance(spec, dict) and spec.get("kind") == "factory"):
        try:
            return build_hf(spec, device)
        except Exception as err:  # noqa: BLE001 - any failure to build is one sentence
            raise _not_built(device, err) from None
    factory = spec.get("factory")
    check_factory(factory)
    if not trust_factory:
        raise factory_consent_error(factory, "the model spec")
    folder = None
    if confine:
        folder = _project_folder(project)
        check_factory_in_project(factory, folder)
    mod_name, fn_name = factory.split(":")
    with _importable_from(folder) if folder is not None else contextlib.nullcontext():
        try:
            # consented above, and (unless confine=False) checked to be the user's project code
            fn = getattr(importlib.import_module(mod_name), fn_name)
        except Exception as err:  # noqa: BLE001 - an import can raise anything
            raise _not_built(device, err) from None
        if folder is not None:
            _check_defined_in_project(factory, fn, folder)
        try:
            with torch.device(device):
                return fn()
        except Exception as err:  # noqa: BLE001 - any failure to build is one sentence
            raise _not_built(device, err) from None


def _not_built(device: str, err: BaseException) -> ExportError:
    return ExportError(f"The model could not be built on the {device} device ({type(err).__name__}: {err}).")


def _check_defined_in_project(factory: str, fn: Any, folder: Path) -> None:
    """Refuse a factory the project module only re-exports (``from os import abort``): the callable itself
    must be defined in a module of the project."""
    owner = getattr(fn, "__module__", None)
    fn_name = factory.split(":")[1]
    if not isinstance(owner, str) or not owner:
        why = f"{fn_name} is a {type(fn).__name__} that no module of the project {folder} defines"
    else:
        why = _locate_in_project(owner.split(".")[0], folder)[1]
        if why:
            why = f"{fn_name} is defined in {owner} and {why}"
    if why:
        raise _project_refusal(factory, why)


def _check_rebuilds(model: nn.Module, spec: dict) -> None:
    """Build the spec on the meta device and compare parameter names and full shapes with ``model``."""
    name = spec["class"]
    try:
        rebuilt = build_hf(spec)
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

    ``importable=True`` imports the module, so it is only for a factory the caller's own code passes
    (``model_spec``, ``save_schedule``, ``ScheduleEditor(factory=...)``); a factory read from a file
    goes through :func:`build_from_spec`'s consent and :func:`check_factory_in_project` instead.

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
        mod = importlib.import_module(mod_name)  # the caller's own factory (see above), never a file's
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
    if transformers_class(spec.get("class"), "PreTrainedModel") is None:
        raise ExportError(f"The model spec's class {spec.get('class')!r} is not a transformers model class.")
    if transformers_class(spec.get("config_class"), "PretrainedConfig") is None:
        raise ExportError(
            f"The model spec's config_class {spec.get('config_class')!r} is not a transformers config class."
        )
    if not isinstance(spec.get("config"), dict):
        raise ExportError("The model spec's config must be a JSON object.")
    check_json("the model config", spec["config"])
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
        check_json(where, e)
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
        if not e["dtype"].startswith(("float", "bfloat")):
            _check_integer_values(where, e)
    return spec


def _check_integer_values(where: str, e: dict) -> None:
    """Raise ExportError unless an integer input's description gives an integer ``fill`` or bounds
    ``low < high``."""
    if "fill" in e:
        if not isinstance(e["fill"], (int, bool)):
            raise ExportError(f"{where} has a non-integer fill value.")
    elif (
        not all(isinstance(e.get(k), int) and not isinstance(e.get(k), bool) for k in ("low", "high"))
        or e["low"] >= e["high"]
    ):
        raise ExportError(f"{where} needs integer bounds low < high (or a fill value).")


# ------------------------------------------------------------------------------------------- calls
def check_json(where: str, v: Any) -> None:
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
            check_json(where, x)
        return
    if isinstance(v, dict):
        for k, x in v.items():
            if not isinstance(k, str):
                raise ExportError(f"{where} has a non-string key {k!r}.")
            check_json(where, x)
        return
    raise _not_json(where, v)


def _not_json(where: str, v: Any) -> ExportError:
    """The error for a value that is no JSON data: a module, a function (a named sync op is the way for a
    sync), or another object."""
    if isinstance(v, nn.Module):
        return ExportError(
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
        return ExportError(
            f"{where} passes the Python function {name}, which cannot be written into a script; {hint}."
        )
    return ExportError(f"{where} has an argument of type {type(v).__name__}, which cannot be exported.")


def _call_from_json(n: int, d: dict) -> Call:
    """Call ``n``'s JSON dict as a :class:`Call` (raises ExportError for a malformed one)."""
    if not isinstance(d.get("args", []), list) or not isinstance(d.get("kwargs", {}), dict):
        raise ExportError(f"Call {n} has malformed args or kwargs.")
    try:
        return Call.from_json(d)
    except (KeyError, TypeError):
        raise ExportError(f"Call {n} is not a {{path, primitive, args, kwargs}} object.") from None


def validate_calls(calls: Any) -> list[Call]:
    """Check recorded calls (Call objects or their JSON dicts) before they are rendered as code.

    Each must name a registered primitive, bind to its signature, and carry only JSON literals.

    Returns:
        the calls as :class:`Call` objects.

    Raises:
        ExportError: naming the first bad call (by position and path).
    """
    calls = getattr(calls, "calls", calls)  # a Recorder
    if not isinstance(calls, (list, tuple)):
        raise ExportError("The recorded calls must be a list.")
    out = []
    for n, c in enumerate(calls, 1):
        if isinstance(c, dict):
            c = _call_from_json(n, c)
        if not isinstance(c, Call) or not isinstance(c.path, str):
            raise ExportError(f"Call {n} is not a recorded call with a string path.")
        where = f"Call {n} (sch[{c.path!r}].{c.primitive if isinstance(c.primitive, str) else '?'})"
        if not is_identifier(c.primitive) or get_primitive(c.primitive) is None:
            raise ExportError(f"{where} names an unknown primitive; known: {', '.join(list_primitives())}.")
        for k in c.kwargs:
            if not is_identifier(k):
                raise ExportError(f"{where} has the keyword {k!r}, which is not a Python name.")
        check_json(where, list(c.args))
        check_json(where, dict(c.kwargs))
        try:
            get_primitive(c.primitive).bind(*c.args, **c.kwargs)
        except ScheduleError as err:
            raise ExportError(f"{where}: {str(err).rstrip('.')}.") from None
        out.append(c)
    return out
