"""Build on the meta device, then materialise only this rank's shards.

No rank ever holds the full model: the model is built with :func:`slapo_lab.init_empty_weights`
(parameters on ``meta``, buffers real), the schedule slices the meta parameters, the pipeline and
FSDP2 pick this rank's parameters, and only then does each of them get storage -- exactly its local
shape (:class:`~slapo_lab.sharding.placements.ShardLayout`) -- and values:

* seeded random weights (:func:`init_random`): each module's parameters are initialised at full size
  from a seed derived from its path (Hugging Face's ``_init_weights``, else ``reset_parameters``; the
  scheme of :func:`slapo_lab.consolidate_model`), one module at a time, and this rank keeps its piece
  -- so every layout trains the same model;
* a Hugging Face directory (:func:`load_hf`): ``torch.distributed.checkpoint.load`` with its
  ``HuggingFaceStorageReader`` into DTensor views of the local tensors, which reads only this rank's
  slices of the safetensors files.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import _getdtype
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.device_mesh import DeviceMesh
from transformers import AutoTokenizer, PretrainedConfig

from ..init import _init_full, init_empty_weights, param_seed
from ..sharding.placements import ShardLayout
from ..spec import build_from_spec
from .preflight import PreflightError, read_model_config

if TYPE_CHECKING:
    from ..schedule import Schedule


class WeightsError(ValueError):
    """Weights could not be read; ``str(err)`` is one sentence."""


@dataclass
class Target:
    """One tensor to materialise on this rank.

    Attributes:
        name: the canonical FQN (the first name of the tensor in the unscheduled model).
        param: the parameter object as the model holds it (a plain tensor, or FSDP2's DTensor).
        layout: which piece of the global tensor it holds.
    """

    name: str
    param: nn.Parameter
    layout: ShardLayout

    @property
    def local(self) -> torch.Tensor:
        """The local tensor (FSDP2's DTensor parameters hold theirs inside)."""
        inner = getattr(self.param, "_local_tensor", None)
        return inner if inner is not None else self.param


def build_meta_model(spec: dict, model_path: str | None = None) -> nn.Module:
    """The model of an export spec, parameters on the meta device, buffers real (no weights allocated).

    With ``model_path``, the config comes from that Hugging Face directory (``config.json``) instead of the
    spec, so a schedule recorded on a small config can run on the real one. A factory spec is imported and
    called as it is: this builds the model of the script the user launched (never pass it a file's spec).

    Raises:
        WeightsError: the directory has no readable config.json, or its model type differs from the spec's.
        ExportError: the model cannot be built (one sentence).
    """

    if model_path is not None and spec.get("kind") == "hf":
        try:  # the same check as the launch's preflight
            config = read_model_config(spec, model_path)
        except PreflightError as err:
            raise WeightsError(str(err)) from None
        spec = dict(spec, config=config)
    with init_empty_weights():
        # The spec is the MODEL literal of the exported script the user launched: code they run (and can
        # read), like a factory= they pass in Python, not a schedule file's data. So its factory is trusted
        # and imported from sys.path as it is (Verify runs the script from a temporary folder, other nodes
        # from theirs); `slapo-lab export` already asked for --trust-factory before writing it.
        return build_from_spec(spec, device="cpu", trust_factory=True, confine=False)


def canonical_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> its first FQN`` in ``model`` (tied parameters share one name, the one Hugging
    Face's ``save_pretrained`` keeps)."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def allocate(
    targets: Iterable[Target],
    device: torch.device | str,
    module: nn.Module | None = None,
    tables: Iterable[dict] = (),
) -> None:
    """Give every meta (or fake) parameter of ``targets`` uninitialised storage of its local shape on ``device``.

    In place where it can be (``torch.utils.swap_tensors``: the same Python object, so everything that
    holds it stays valid, annotations included); a parameter something holds a weak reference to (a
    ``torch.export``-ed pipeline stage) is replaced by a new one in every slot of ``module`` and every
    value of the ``tables`` (dicts) that held it, and in its target.
    """

    for t in targets:
        p = t.param
        if not (p.is_meta or is_fake(p)) or getattr(p, "_local_tensor", None) is not None:
            continue
        new = nn.Parameter(
            torch.empty(t.layout.local_shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad
        )
        new.__dict__.update(p.__dict__)
        try:
            torch.utils.swap_tensors(p, new)
            continue
        except RuntimeError:
            if module is None:
                raise
        _replace_parameter(p, new, module, tables)
        t.param = new


def _replace_parameter(
    old: nn.Parameter, new: nn.Parameter, module: nn.Module, tables: Iterable[dict]
) -> None:
    """Put ``new`` in every parameter slot of ``module``'s submodules and every value of ``tables`` that holds
    ``old``."""
    for mod in module.modules():
        for name, value in mod._parameters.items():
            if value is old:
                mod._parameters[name] = new
    for table in tables:
        for key, value in table.items():
            if value is old:
                table[key] = new


def init_random(sch: Schedule, targets: list[Target], seed: int) -> None:
    """Fill ``targets`` with seeded random weights, the same full model on every layout.

    Every module owning a target is initialised at full size on the CPU under
    ``torch.manual_seed(param_seed(seed, path))`` (:func:`slapo_lab.init.consolidate_model`'s scheme),
    then each target takes its piece (:meth:`ShardLayout.take`). Peak extra memory: one module's
    parameters at full size. The global RNG state is left as it was.

    Args:
        sch: the schedule of the model (its top node is walked in module order).
        targets: this rank's tensors (allocated); several objects may share one name (tied copies).
        seed: the base seed.
    """

    by_name: dict[str, list[Target]] = {}
    for t in targets:
        by_name.setdefault(t.name, []).append(t)
    top = sch.get_top_schedule()
    owners = canonical_names(top.mod)
    done: set[str] = set()
    for path, node in top.named_schedules():
        own = {}
        for name, p in node.mod._parameters.items():
            if p is None:
                continue
            fqn = owners.get(id(p), f"{path}.{name}" if path else name)
            if fqn in by_name and fqn not in done:
                own[name] = p
        if not own:
            continue
        full = _init_full(node, own, None, param_seed(seed, path))
        with torch.no_grad():
            for name, p in own.items():
                fqn = owners.get(id(p), f"{path}.{name}" if path else name)
                done.add(fqn)
                for t in by_name[fqn]:
                    t.local.copy_(t.layout.take(full[name].to(t.local.dtype)))
    missing = sorted(set(by_name) - done)
    if missing:
        raise WeightsError(f"No module of the model owns {missing[0]!r}, so it could not be initialised.")


def hf_index(model_path: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{tensor name: (shape, dtype)}`` of the safetensors files of a Hugging Face directory.

    Raises:
        WeightsError: the directory is missing or holds no ``*.safetensors`` file.
    """

    folder = Path(model_path)
    if not folder.is_dir():
        raise WeightsError(f"The model directory {model_path} does not exist.")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        extra = (
            " (it has pytorch_model.bin: re-save it with save_pretrained(safe_serialization=True))"
            if any(folder.glob("pytorch_model*.bin"))
            else ""
        )
        raise WeightsError(f"{model_path} has no *.safetensors weights{extra}.")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for key in h.keys():  # noqa: SIM118 - a safetensors handle is not a dict
                sl = h.get_slice(key)
                out[key] = (tuple(sl.get_shape()), _getdtype(sl.get_dtype()))
    return out


def load_hf(model_path: str, targets: list[Target], mesh: DeviceMesh) -> None:
    """Fill ``targets`` from a Hugging Face directory; each rank reads only its own slices.

    ``torch.distributed.checkpoint.load`` with ``HuggingFaceStorageReader`` into
    :meth:`ShardLayout.checkpoint_view` s of the local tensors (a dtype different from the file's is
    converted on copy). Tied copies (same name) are read once and copied.

    Raises:
        WeightsError: a tensor the model needs is missing from the files or has another shape (one
            sentence naming it and the directory).
    """

    index = hf_index(model_path)
    first: dict[str, Target] = {}
    for t in targets:
        first.setdefault(t.name, t)
    for name, t in first.items():
        if name not in index:
            raise WeightsError(
                f"{model_path} has no tensor {name!r} (the model needs {len(first)} on this rank); "
                "is it a checkpoint of this model class?"
            )
        if tuple(index[name][0]) != tuple(t.layout.shape):
            raise WeightsError(
                f"{name} in {model_path} has shape {tuple(index[name][0])}, but the model expects "
                f"{tuple(t.layout.shape)}."
            )
    state = {name: t.layout.checkpoint_view(t.local, mesh) for name, t in first.items()}
    dcp.load(state, storage_reader=HuggingFaceStorageReader(model_path))
    with torch.no_grad():
        for t in targets:
            src = first[t.name]
            if src is not t:
                t.local.copy_(src.local)


def source_dtype(model_path: str | None) -> torch.dtype:
    """The dtype of a Hugging Face directory's weights (its first floating tensor), float32 without one."""
    if model_path is None:
        return torch.float32
    for _, dtype in hf_index(model_path).values():
        if dtype.is_floating_point:
            return dtype
    return torch.float32


def copy_hf_extras(
    model_path: str | None, tokenizer_dir: str | None, out: str | os.PathLike, config: PretrainedConfig
) -> None:
    """Write ``config`` (and the model directory's generation config) and the tokenizer files into ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    if model_path is not None and (Path(model_path) / "generation_config.json").is_file():
        (out / "generation_config.json").write_bytes(
            (Path(model_path) / "generation_config.json").read_bytes()
        )
    if tokenizer_dir is not None and Path(tokenizer_dir).is_dir():
        AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True).save_pretrained(out)
