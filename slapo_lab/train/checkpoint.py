"""Checkpoints with ``torch.distributed.checkpoint``: save, resume at any layout, Hugging Face out.

A checkpoint is a DCP directory ``<checkpoint-dir>/step-00000004`` holding

* ``model.<name>``: every parameter under its Hugging Face name, as the DTensor (or, for a strided
  fused projection, ``ShardedTensor``) view of its layout (:mod:`slapo_lab.sharding.placements`), so a
  checkpoint saved with TP2 x DP2 loads with TP2 x PP2, DP4 or one process;
* ``optim.*``: the optimizer state, flattened by parameter name (``torch.distributed.checkpoint.state_dict
  .get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)``), each state tensor viewed like its
  parameter;
* ``scheduler``, ``train`` (the step, samples seen, the data epoch), and ``rng`` (this layout's per-rank
  generator states, restored only when the layout is the same).

A save writes ``step-00000004.partial`` and renames it once every rank has finished (DCP writes its
``.metadata`` last), so an interrupted save never looks complete; :func:`latest_checkpoint` takes the
newest complete one.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.optim.lr_scheduler import LRScheduler

from ..spec import transformers_class
from .lifeline import check
from .preflight import RUN_INFO, STEP_DIR, latest_checkpoint, step_dir
from .weights import copy_hf_extras

_STEP_DIR = STEP_DIR


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class Checkpointer:
    """Saves and restores one run's state (see the module docstring).

    Args:
        folder: ``--checkpoint-dir``.
        modules: ``[(module, {id(parameter): (name, ShardLayout)})]``: the module(s) holding this rank's
            parameters (one, or one per pipeline stage) and the name and layout of each parameter.
        optimizer: the torch optimizer over those parameters.
        scheduler: its ``torch.optim.lr_scheduler`` (or None).
        mesh: the ``(dp, tp)`` DeviceMesh of the views.
        layout_key: a string naming the layout (``"tp2.pp1.dp2.fsdp"``): RNG states come back only
            when it matches.
        keep: keep the ``keep`` newest checkpoints (0: all).
        run_info: JSON data written as ``run.json`` in every checkpoint (the model spec, the tokenizer, the
            weights' source dtype): what ``slapo-lab convert`` needs to write a Hugging Face directory.
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        modules: list[tuple[nn.Module, dict[int, tuple]]],
        optimizer: torch.optim.Optimizer | None,
        scheduler: LRScheduler | None,
        mesh: DeviceMesh,
        layout_key: str,
        keep: int = 0,
        run_info: dict | None = None,
    ) -> None:
        self.run_info = run_info or {}
        self.folder = Path(folder)
        self.modules = modules
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.mesh = mesh
        self.layout_key = layout_key
        self.keep = keep

    # ------------------------------------------------------------------------------ state dicts
    def _model_state(self) -> dict[str, Any]:
        state = {}
        for module, info in self.modules:
            for p in module.parameters():
                name, lay = info[id(p)]
                if name not in state:
                    state[name] = lay.checkpoint_view(_local(p), self.mesh)
        return state

    def _optim_state(self) -> tuple[dict[str, Any], list]:
        """(views by ``<param name>.<state>`` / ``param_groups.*``, the originals to set back after a load:
        ``[(module, flat state dict, {view key: original key})]``)."""

        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        views: dict[str, Any] = {}
        originals = []
        for module, info in self.modules:
            sd = get_optimizer_state_dict(module, self.optimizer, options=opts)
            keys: dict[str, str] = {}
            originals.append((module, sd, keys))
            fqn_info = {}
            for fqn, p in module.named_parameters(remove_duplicate=False):
                if id(p) in info:
                    fqn_info[fqn] = info[id(p)]
            # longest FQN first, so "a.b.weight" wins over "a.b"
            ordered = sorted(fqn_info, key=len, reverse=True)
            for key, value in sd.items():
                kind, _, rest = key.partition(".")
                fqn = next((f for f in ordered if rest.startswith(f + ".")), None)
                if fqn is None:
                    continue
                name, lay = fqn_info[fqn]
                suffix = rest[len(fqn) + 1 :]
                new_key = f"{kind}.{name}.{suffix}"
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    value = lay.checkpoint_view(_local(value), self.mesh)
                views.setdefault(new_key, value)
                keys.setdefault(new_key, key)
        return views, originals

    def _rng_state(self) -> dict[str, Any]:
        rank = dist.get_rank() if dist.is_initialized() else 0
        out = {f"rank{rank}.cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out[f"rank{rank}.cuda"] = torch.cuda.get_rng_state()
        return out

    # ------------------------------------------------------------------------------ save / load
    def save(self, step: int, train_state: dict[str, Any]) -> Path:
        """Save everything at ``step``; returns the complete directory. Every rank calls it."""

        check()  # a rank whose launcher died never writes: a relaunch may own this directory now
        final = step_dir(self.folder, step)
        partial = final.with_name(final.name + ".partial")
        rank0 = (not dist.is_initialized()) or dist.get_rank() == 0
        if rank0:
            self.folder.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
        _barrier()
        optim, _ = self._optim_state() if self.optimizer is not None else ({}, [])
        state = {
            "model": self._model_state(),
            "optim": optim,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else {},
            "train": dict(train_state, layout=self.layout_key),
            "rng": {self.layout_key: self._rng_state()},
        }
        dcp.save(state, checkpoint_id=str(partial))
        _barrier()
        check()
        if rank0:
            (partial / RUN_INFO).write_text(
                json.dumps(dict(self.run_info, step=step, layout=self.layout_key), indent=1), encoding="utf-8"
            )
            if final.exists():
                shutil.rmtree(final)
            os.replace(partial, final)
            self._prune()
        _barrier()
        return final

    def _prune(self) -> None:
        if self.keep <= 0:
            return
        done = sorted(
            (int(m.group(1)), p)
            for p in self.folder.iterdir()
            if (m := _STEP_DIR.match(p.name)) and (p / ".metadata").is_file()
        )
        for _, p in done[: -self.keep]:
            shutil.rmtree(p, ignore_errors=True)

    def load(self, path: str | os.PathLike, train_state: dict[str, Any]) -> dict[str, Any]:
        """Restore the model, optimizer and scheduler from ``path`` in place; returns the ``train`` state.

        Args:
            path: a complete checkpoint directory.
            train_state: the keys of the ``train`` state to read (values are replaced).

        RNG states come back when the checkpoint was saved at this layout (else the caller reseeds).
        """

        model = self._model_state()
        optim, originals = self._optim_state() if self.optimizer is not None else ({}, [])
        # DCP reads the keys it is given: the templates name them (their values are replaced)
        state = {
            "model": model,
            "optim": optim,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else {},
            "train": dict(train_state, layout=""),
            "rng": {self.layout_key: self._rng_state()},
        }
        # DCP unpickles .metadata: only checkpoints the user's own runs wrote are read (docs/SECURITY.md)
        dcp.load(state, checkpoint_id=str(path), planner=DefaultLoadPlanner(allow_partial_load=True))
        for module, sd, keys in originals:
            for new_key, old_key in keys.items():  # tensors were read in place; other values were replaced
                if not isinstance(sd[old_key], torch.Tensor) or sd[old_key].dim() == 0:
                    sd[old_key] = optim[new_key]
            set_optimizer_state_dict(
                module, self.optimizer, sd, options=StateDictOptions(flatten_optimizer_state_dict=True)
            )
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        train = state["train"]
        if train.get("layout") == self.layout_key:
            rng = state["rng"][self.layout_key]
            for key, value in rng.items():
                if key.endswith(".cpu"):
                    torch.set_rng_state(value)
                elif key.endswith(".cuda"):
                    torch.cuda.set_rng_state(value)
        return train


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (FSDP2's parameters and states), else ``t``; detached (same storage)."""
    inner = getattr(t, "_local_tensor", None)
    return (inner if inner is not None else t).detach()


def save_hf(
    folder: str | os.PathLike,
    tensors: dict[str, tuple[torch.Tensor, Any]],
    mesh: DeviceMesh,
    dtype: torch.dtype,
    max_shard_bytes: int = 5 * 2**30,
) -> None:
    """Write the model as a Hugging Face safetensors directory (consolidated full tensors).

    Every rank passes its local tensors; ``torch.distributed.checkpoint.save`` with
    ``HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True)`` writes the shards and
    consolidates them into ``model-0000i-of-0000n.safetensors`` files of at most ``max_shard_bytes`` each
    plus ``model.safetensors.index.json``. A strided layout (fused q, k, v), which one safetensors file
    entry per rank cannot describe, is gathered to the full tensor first (one parameter at a time).

    Args:
        folder: the output directory (config and tokenizer files are written by the caller).
        tensors: ``{hf name: (local tensor, ShardLayout)}`` of this rank, each name once per rank.
        mesh: the ``(dp, tp)`` DeviceMesh.
        dtype: the dtype written.
    """

    folder = Path(folder)
    rank0 = (not dist.is_initialized()) or dist.get_rank() == 0
    state = {}
    sizes = {}
    for name, (local, lay) in tensors.items():
        local = _local(local).detach().to(dtype)
        # strided or unequal blocks have no view the writer can place: the whole tensor, in the model's order
        state[name] = lay.full_tensor(local, mesh) if len(lay.blocks()) > 1 else lay.dtensor(local, mesh)
        n = 1
        for s in lay.shape:
            n *= s
        sizes[name] = n * torch.empty((), dtype=dtype).element_size()
    # every rank must name the same files: agree on the names and sizes first
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sizes)
        for g in gathered:
            sizes.update(g)
    mapping, index, used = {}, 1, 0
    for name in sorted(sizes):
        if used and used + sizes[name] > max_shard_bytes:
            index, used = index + 1, 0
        mapping[name] = index
        used += sizes[name]
    if rank0:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(folder / "sharded", ignore_errors=True)
    _barrier()
    writer = HuggingFaceStorageWriter(
        str(folder), fqn_to_index_mapping=mapping, save_distributed=True, enable_consolidation=True
    )
    dcp.save(state, storage_writer=writer)
    _barrier()
    if rank0:
        shutil.rmtree(folder / "sharded", ignore_errors=True)
    _barrier()


class ConvertError(ValueError):
    """A checkpoint could not be converted; ``str(err)`` is one sentence."""


def convert_to_hf(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    dtype: str = "auto",
    max_shard_bytes: int = 5 * 2**30,
) -> Path:
    """Write the model of a checkpoint as a Hugging Face directory that ``from_pretrained`` loads.

    ``checkpoint`` is a ``step-NNNNNNNN`` directory (or a ``--checkpoint-dir``: its newest complete one).
    One process, no process group: ``torch.distributed.checkpoint.load(..., no_dist=True)`` reads the full
    tensors a safetensors file at a time (at most ``max_shard_bytes`` of tensors in memory), whatever
    layout saved them; config and tokenizer come from the checkpoint's ``run.json``.

    Args:
        dtype: ``"auto"`` (the dtype of the weights the run started from) or a torch dtype name.

    Returns:
        The output directory.

    Raises:
        ConvertError: not a complete checkpoint of this runtime (one sentence).
    """
    path = _complete_checkpoint(Path(checkpoint))
    info = json.loads((path / RUN_INFO).read_text(encoding="utf-8"))
    spec = info.get("model") or {}
    src_dtype = info.get("source_dtype", "float32")
    if src_dtype not in ("float32", "bfloat16", "float16", "float64"):
        raise ConvertError(
            f"{path}/{RUN_INFO} names the dtype {src_dtype!r}; expected float32, bfloat16, float16 or float64."
        )
    want = getattr(torch, src_dtype) if dtype == "auto" else getattr(torch, dtype)
    # torch.distributed.checkpoint unpickles .metadata (and non-tensor entries): only checkpoints the
    # user's own runs wrote are read (docs/SECURITY.md)
    meta = FileSystemReader(str(path)).read_metadata()
    names = sorted(
        k[len("model.") :]
        for k, v in meta.state_dict_metadata.items()
        if k.startswith("model.") and isinstance(v, TensorStorageMetadata)
    )
    if not names:
        raise ConvertError(f"{path} holds no model tensors.")
    size = {n: meta.state_dict_metadata["model." + n].size for n in names}
    nbytes = {n: torch.Size(size[n]).numel() * torch.empty((), dtype=want).element_size() for n in names}
    groups = _shard_groups(names, nbytes, max_shard_bytes)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    total = len(groups)
    weight_map = {}
    for i, group in enumerate(groups, 1):
        src = {
            n: torch.empty(size[n], dtype=meta.state_dict_metadata["model." + n].properties.dtype)
            for n in group
        }
        with (
            warnings.catch_warnings()
        ):  # "torch.distributed is disabled ... a single process": that is the point
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": src}, checkpoint_id=str(path), no_dist=True)
        fname = "model.safetensors" if total == 1 else f"model-{i:05d}-of-{total:05d}.safetensors"
        save_file(
            {n: t.to(want).contiguous() for n, t in src.items()}, str(out / fname), metadata={"format": "pt"}
        )
        os.chmod(out / fname, 0o644)  # safetensors writes 0600
        weight_map.update(dict.fromkeys(group, fname))
    if total > 1:
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map}, indent=2)
        )
    if spec.get("kind") == "hf":
        config_cls = transformers_class(spec.get("config_class"), "PretrainedConfig")
        if config_cls is None:
            raise ConvertError(
                f"{path}/{RUN_INFO} names the config class {spec.get('config_class')!r}, which is not a "
                "transformers config class."
            )
        config = config_cls.from_dict(dict(spec["config"]))
        config.dtype = want
        copy_hf_extras(info.get("model_path"), info.get("tokenizer"), out, config)
    return out


def _complete_checkpoint(path: Path) -> Path:
    """``path`` if it is a complete checkpoint, else the newest complete one in the ``--checkpoint-dir`` it names.

    Raises:
        ConvertError: a DeepSpeed checkpoint, a folder without a complete checkpoint, or one lacking
            ``.metadata`` or ``run.json`` (one sentence).
    """
    if path.is_dir() and not (path / ".metadata").is_file():
        latest = latest_checkpoint(path)
        if latest is None:
            if (path / "latest").is_file():
                raise ConvertError(
                    f"{path} is a DeepSpeed checkpoint; convert it with the zero_to_fp32.py DeepSpeed "
                    "wrote beside it, or train with the torchrun script and --save-hf."
                )
            raise ConvertError(
                f"{path} holds no complete checkpoint (a step-NNNNNNNN directory with .metadata)."
            )
        path = latest[1]
    if not (path / ".metadata").is_file() or not (path / RUN_INFO).is_file():
        raise ConvertError(
            f"{path} is not a complete slapo-lab checkpoint (it needs .metadata and {RUN_INFO})."
        )
    return path


def _shard_groups(names: list[str], nbytes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """``names`` in order, cut into safetensors files of at most ``max_shard_bytes`` (a larger tensor alone)."""
    groups: list[list[str]] = [[]]
    used = 0
    for n in names:
        if used and used + nbytes[n] > max_shard_bytes:
            groups.append([])
            used = 0
        groups[-1].append(n)
        used += nbytes[n]
    return groups
