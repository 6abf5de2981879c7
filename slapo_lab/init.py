"""Empty-model construction and reproducible per-rank weight materialisation.

:func:`init_empty_weights` builds a model whose parameters live on the ``meta`` device (no memory,
no initialisation cost), the way Hugging Face Accelerate's context manager of the same name does
(and Slapo re-exports). After scheduling such a model (``shard`` slices meta tensors for free),
:func:`consolidate_model` gives every rank real weights: each parameter is initialised at its
*full* size from a seed derived from its module path, then this rank keeps its slice. Every rank
therefore holds a slice of the same full model, whatever the world size, and no rank ever needs more
than one full parameter at a time.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .errors import ScheduleError
from .module_state import ModuleMeta, peek_meta
from .plan import stage_assignment
from .sharding.rules import local_shard

__all__ = ["consolidate_model", "init_empty_weights", "param_seed"]


@contextlib.contextmanager
def init_empty_weights(enable: bool = True, include_buffers: bool = False) -> Iterator[None]:
    """Inside the block, every parameter registered on a module is moved to the ``meta`` device.

    ``with init_empty_weights(): model = BertModel(config)`` builds a model of any size in
    milliseconds with no tensor memory. Parameters keep their class, ``requires_grad`` and attributes;
    initialisers run on meta tensors and cost nothing. Buffers stay real unless ``include_buffers``
    (then all tensor creation inside the block defaults to meta, as with ``torch.device("meta")``).
    Semantics of Accelerate's ``init_empty_weights`` (``accelerate/big_modeling.py``), as exported by
    Slapo.

    Args:
        enable: False makes the block a no-op.
        include_buffers: also put buffers (and every tensor created without an explicit device) on meta.

    The patch of ``nn.Module.register_parameter`` is process-wide while the block runs (not
    thread-safe) and is always undone on exit.
    """
    if not enable:
        yield
        return
    meta = torch.device("meta")
    old_register_parameter = nn.Module.register_parameter
    old_register_buffer = nn.Module.register_buffer

    def register_parameter(module, name, param):
        old_register_parameter(module, name, param)
        if param is not None and not param.is_meta:
            p = module._parameters[name]
            attrs = dict(p.__dict__)
            new = (
                type(p)(p.to(meta), requires_grad=p.requires_grad)
                if isinstance(p, nn.Parameter)
                else p.to(meta)
            )
            new.__dict__.update(attrs)
            module._parameters[name] = new

    def register_buffer(module, name, tensor, persistent=True):
        old_register_buffer(module, name, tensor, persistent)
        if tensor is not None:
            module._buffers[name] = module._buffers[name].to(meta)

    nn.Module.register_parameter = register_parameter
    if include_buffers:
        nn.Module.register_buffer = register_buffer
    device_ctx = torch.device("meta") if include_buffers else contextlib.nullcontext()
    try:
        with device_ctx:
            yield
    finally:
        nn.Module.register_parameter = old_register_parameter
        nn.Module.register_buffer = old_register_buffer


def param_seed(seed: int, path: str) -> int:
    """The generator seed of the module at ``path``: a stable 63-bit mix of ``seed`` and the path's CRC32."""
    return (int(seed) * 1_000_003 + zlib.crc32(path.encode("utf-8"))) % (2**63 - 1)


def _hf_init_owner(sch) -> Callable[[nn.Module], None] | None:
    """``_init_weights`` of the nearest Hugging Face ``PreTrainedModel`` at or above ``sch``."""
    node = sch
    while node is not None:
        fn = getattr(type(node.mod), "_init_weights", None)
        if fn is not None and hasattr(node.mod, "config"):
            return node.mod._init_weights
        node = node.parent
    return None


def _sentinel_fill(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(False)
    else:
        t.fill_(torch.iinfo(t.dtype).min)


def _is_filled(t: torch.Tensor) -> bool:
    if t.is_floating_point() or t.is_complex():
        return not bool(torch.isnan(t).any())
    if t.dtype == torch.bool:
        return True
    return not bool((t == torch.iinfo(t.dtype).min).any())


def _full_shape(t: torch.Tensor) -> torch.Size:
    return torch.Size(getattr(t, "orig_shape", None) or t.shape)


def _copy_module(mod: nn.Module) -> nn.Module:
    """A shallow copy of ``mod`` (``copy.copy`` without the class's ``__new__``: FSDP2's module classes rebuild
    the module there)."""
    sh = object.__new__(type(mod))
    sh.__dict__.update(mod.__dict__)
    return sh


def _shadow(mod: nn.Module, own: dict[str, torch.Tensor], meta_state: ModuleMeta | None) -> nn.Module:
    """A shallow copy of ``mod`` whose tensors in ``own`` are full-size CPU tensors (sentinel-filled) and
    whose other tensors (and children's) are full-size meta tensors, so that an init function can run
    on it without touching the real module."""
    sh = _copy_module(mod)
    sh._parameters = dict(mod._parameters)
    sh._buffers = dict(mod._buffers)
    for name, t in list(mod._parameters.items()) + list(mod._buffers.items()):
        if t is None:
            continue
        full = _full_shape(t)
        if name in own:
            new = torch.empty(full, dtype=t.dtype, device="cpu")
            _sentinel_fill(new)
        else:
            new = torch.empty(full, dtype=t.dtype, device="meta")
        if name in mod._parameters:
            sh._parameters[name] = nn.Parameter(new, requires_grad=False)
        else:
            sh._buffers[name] = new
    sh._modules = {k: _meta_shadow(c) for k, c in mod._modules.items()}
    if meta_state:  # undo what shard rules changed on the module so init sees the full layer
        if meta_state.orig_padding_idx is not None and isinstance(mod, nn.Embedding):
            sh.padding_idx = meta_state.orig_padding_idx
        for attr, name, axis in (
            ("out_features", "weight", 0),
            ("in_features", "weight", 1),
            ("num_embeddings", "weight", 0),
            ("embedding_dim", "weight", 1),
        ):
            if hasattr(sh, attr) and meta_state.sharded.get(name) == axis:
                setattr(sh, attr, _full_shape(mod._parameters[name])[axis])
    sh.__dict__.pop("forward", None)
    return sh


def _meta_shadow(mod: nn.Module | None, depth: int | None = None) -> nn.Module | None:
    """A copy of ``mod`` whose parameters and buffers are full-size meta tensors (no memory), children likewise:
    all of them, or ``depth`` levels (deeper ones dropped: what an init function reads of a module's children)."""
    if mod is None:
        return None
    sh = _copy_module(mod)
    sh._parameters = {
        k: (
            None
            if t is None
            else nn.Parameter(torch.empty(_full_shape(t), dtype=t.dtype, device="meta"), requires_grad=False)
        )
        for k, t in mod._parameters.items()
    }
    sh._buffers = {
        k: (None if t is None else torch.empty(_full_shape(t), dtype=t.dtype, device="meta"))
        for k, t in mod._buffers.items()
    }
    if depth is None:
        sh._modules = {k: _meta_shadow(c) for k, c in mod._modules.items()}
    else:
        sh._modules = {
            k: _meta_shadow(c, depth - 1) for k, c in mod._modules.items() if c is not None and depth > 0
        }
    sh.__dict__.pop("forward", None)
    return sh


def _default_init(name: str, t: torch.Tensor, gen: torch.Generator) -> None:
    """Fallback: N(0, 0.02) for matrices, ones for 1-D ``*weight``, zeros otherwise."""
    if not (t.is_floating_point() or t.is_complex()):
        t.zero_()
    elif t.dim() >= 2:
        t.normal_(0.0, 0.02, generator=gen)
    elif name.endswith("weight"):
        t.fill_(1.0)
    else:
        t.zero_()


def consolidate_model(
    sch,
    target: str | None = None,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    seed: int = 2013,
    device: str | torch.device | None = None,
    stage: int | None = None,
):
    """Materialise the weights of schedule ``sch`` on this rank, reproducibly (Slapo's ``consolidate_model``).

    For every module that owns parameters (and every module owning ``meta`` buffers), a temporary
    full-size copy is initialised on the CPU under ``torch.manual_seed(param_seed(seed, path))`` with
    the first init function that fills it: ``param_init_fn(module)`` if given; otherwise the nearest
    Hugging Face ancestor's ``_init_weights(module)``; otherwise ``module.reset_parameters()``;
    tensors still unset get :func:`_default_init` (parameters) or raise (meta buffers). Then this rank
    keeps this rank's slice (``sharding.rules.local_shard``: strided for a fused QKV; its replica group's key/value head
    for a shard with ``shard_replicas``) of every sharded tensor and the whole of every
    replicated one. So a TP=2 model consolidated on ranks 0 and 1 concatenates to the same tensors as
    the unsharded model consolidated with world size 1 -- on every process, without communication.

    Tied parameters stay tied (the first owner in module order initialises them). Real, non-meta
    buffers keep their values (moved to ``device``). Peak extra memory: the parameters of one module at
    full size. Global RNG state is saved and restored.

    Args:
        sch: any node of the schedule (its top is used); ``sch.world_size`` / ``sch.rank`` pick the slice.
        target: None or "deepspeed" (accepted for Slapo compatibility; no effect here).
        param_init_fn: ``fn(module)`` that initialises ``module``'s own parameters in place (it receives a
            full-size CPU copy of the module).
        seed: base seed; the same seed gives the same full model on every rank and world size.
        device: where the materialised tensors go; default: the tensor's device, or CPU for meta tensors.
        stage: only materialise modules of this pipeline stage (see :func:`slapo_lab.plan.stage_assignment`);
            the others stay as they are.

    Returns:
        The top module (modified in place).

    Raises:
        ScheduleError: for an unknown target or stage, or a meta buffer nothing could initialise.
    """
    if target not in (None, "deepspeed", "torch"):
        raise ScheduleError(f"Unknown target {target!r}; consolidate_model takes None or 'deepspeed'.")
    top = sch.get_top_schedule()
    ws, rank = top.world_size, top.rank
    stage_of = _stage_of(top, stage)
    nodes = list(top.named_schedules())
    owners = _tensor_owners(nodes)
    done: set[int] = set()
    replaced: dict[int, torch.Tensor] = {}
    for path, node in nodes:
        if stage_of is not None and stage_of.get(path) != stage:
            continue
        mod = node.mod
        own = _to_materialise(mod, done)
        if own:
            full = _init_full(node, own, param_init_fn, param_seed(seed, path))
            for name, t in own.items():
                new = _rank_tensor(t, full[name], ws, rank, device)
                _assign(owners[id(t)], name, new, replaced, old=t)
                done.update((id(t), id(new)))
        _move_buffers(mod, own, done, owners, device, replaced)  # real buffers: only moved
    # keep the schedule's tie table pointing at the live tensors
    ties = top.metadata.tie_weights
    for old_key in list(ties):
        new = replaced.get(id(old_key))
        if new is not None:
            ties[new] = ties.pop(old_key)
    return top.mod


def _stage_of(top: Any, stage: int | None) -> dict[str, int] | None:
    """Path -> pipeline stage of every module of ``top`` when only ``stage`` is to be materialised, else None.

    Raises:
        ScheduleError: for a ``stage`` that is not one of the schedule's stages.
    """
    if stage is None:
        return None
    assign = stage_assignment(top)
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < assign.num_stages:
        raise ScheduleError(f"stage must be an integer in [0, {assign.num_stages}), not {stage!r}.")
    return assign.stage_of


def _tensor_owners(nodes: list[tuple[str, Any]]) -> dict[int, list[tuple[nn.Module, str]]]:
    """Every ``(module, name)`` holding each parameter or buffer (by id), in module order (tied weights have
    several owners)."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for _, node in nodes:
        for name, t in list(node.mod._parameters.items()) + list(node.mod._buffers.items()):
            if t is not None:
                lst = owners.setdefault(id(t), [])
                if not any(m is node.mod and n == name for m, n in lst):
                    lst.append((node.mod, name))
    return owners


def _to_materialise(mod: nn.Module, done: set[int]) -> dict[str, torch.Tensor]:
    """``mod``'s own parameters and meta buffers not materialised yet (by an earlier owner of a tied one)."""
    own = {name: t for name, t in mod._parameters.items() if t is not None and id(t) not in done}
    for name, t in mod._buffers.items():
        if t is not None and id(t) not in done and t.is_meta:
            own[name] = t
    return own


def _rank_tensor(
    t: torch.Tensor, value: torch.Tensor, ws: int, rank: int, device: str | torch.device | None
) -> torch.Tensor:
    """The tensor that replaces ``t``: this rank's slice of its full-size ``value`` when ``t`` is sharded, on
    ``device`` (default: ``t``'s, or the CPU for a meta tensor), as a parameter of ``t``'s class with ``t``'s
    attributes when ``t`` is one, else a tensor with ``t``'s shard attributes."""
    axis = getattr(t, "shard_axis", None)
    if axis is not None and ws > 1:
        value = local_shard(
            value, axis, ws, rank, getattr(t, "shard_stride", 1), getattr(t, "shard_replicas", 1)
        )
    dev = device if device is not None else ("cpu" if t.is_meta else t.device)
    value = value.to(dev).contiguous()
    if not isinstance(t, nn.Parameter):
        for k in ("orig_shape", "shard_axis", "shard_stride", "shard_replicas"):
            if hasattr(t, k):
                setattr(value, k, getattr(t, k))
        return value
    try:
        new = type(t)(value, requires_grad=t.requires_grad)
    except TypeError:  # a Parameter subclass with another constructor
        new = nn.Parameter(value, requires_grad=t.requires_grad)
    for k, v in t.__dict__.items():
        new.__dict__.setdefault(k, v)
    return new


def _move_buffers(
    mod: nn.Module,
    own: dict[str, torch.Tensor],
    done: set[int],
    owners: dict[int, list[tuple[nn.Module, str]]],
    device: str | torch.device | None,
    replaced: dict[int, torch.Tensor],
) -> None:
    """Move ``mod``'s real buffers (those not in ``own`` nor done) to ``device``, when given, keeping their
    values."""
    for name, t in mod._buffers.items():
        if t is not None and id(t) not in done and name not in own:
            done.add(id(t))
            if device is not None:
                new = t.to(device)
                _assign(owners[id(t)], name, new, replaced, old=t)
                done.add(id(new))


def _assign(owner_list, name, new, replaced, old=None) -> None:
    for m, n in owner_list:
        if n in m._parameters:
            m._parameters[n] = new
        else:
            m._buffers[n] = new
    if old is not None:
        replaced[id(old)] = new


def _init_ancestors(node, sh: nn.Module, hf: Callable[[nn.Module], None]) -> None:
    """Run Hugging Face's ``_init_weights`` on ``node``'s ancestors too, up to the model, with ``sh`` (the shadow
    of ``node.mod``) in place of the module: ``PreTrainedModel.init_weights`` applies it to every module
    children first, and a parent may set its children's weights (T5's attention sets q/k/v/o; the model
    sets the shared embedding), so the last word on a parameter can be an ancestor's. Every other tensor
    of the ancestors is a meta tensor (no memory, no random draws)."""
    child, below = node, sh
    parent = node.parent
    while parent is not None:
        up = _meta_shadow(parent.mod, depth=2)
        up._modules[child.name] = below
        hf(up)
        if getattr(type(parent.mod), "_init_weights", None) is not None and hasattr(parent.mod, "config"):
            break  # the model that owns the init function: nothing above it is its
        child, below, parent = parent, up, parent.parent


def _init_full(node, own: dict[str, torch.Tensor], param_init_fn, seed: int) -> dict[str, torch.Tensor]:
    """Full-size CPU values for the tensors in ``own`` of ``node.mod`` (see :func:`consolidate_model`)."""
    mod = node.mod
    meta_state = peek_meta(mod)
    steps, hf = _init_steps(node, param_init_fn)
    values: dict[str, torch.Tensor] = {}
    missing = dict(own)
    for step in steps:
        if not missing:
            break
        sh = _shadow(mod, missing, meta_state)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            with torch.no_grad():
                step(sh)
                if param_init_fn is None and step is steps[0] and hf is not None:
                    _init_ancestors(node, sh, hf)
        for name in list(missing):
            t = sh._parameters.get(name) if name in mod._parameters else sh._buffers.get(name)
            if t is not None and not t.is_meta and _is_filled(t):
                values[name] = t.detach()
                del missing[name]
    values.update(_default_values(node, missing, seed))
    return values


def _init_steps(node: Any, param_init_fn: Callable[[nn.Module], None] | None) -> tuple[list, Any]:
    """``(init functions to try in order, the Hugging Face one or None)`` for ``node.mod``: ``param_init_fn``
    alone, or the nearest Hugging Face ``_init_weights`` then the module's ``reset_parameters``."""
    if param_init_fn is not None:
        return [param_init_fn], None
    steps: list[Callable[[nn.Module], None]] = []
    hf = _hf_init_owner(node)
    if hf is not None:
        steps.append(hf)
    for attr in ("reset_parameters", "_reset_parameters"):
        if callable(getattr(node.mod, attr, None)):
            steps.append(lambda m, a=attr: getattr(m, a)())
            break
    return steps, hf


def _default_values(node: Any, missing: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Full-size values from :func:`_default_init` for the parameters no init function set.

    Raises:
        ScheduleError: for a meta buffer among them (nothing can rebuild its value).
    """
    mod = node.mod
    values: dict[str, torch.Tensor] = {}
    for name, t in missing.items():
        if name in mod._buffers:
            raise ScheduleError(
                f"consolidate_model cannot rebuild the meta buffer {node.path + '.' if node.path else ''}{name}: "
                "no init function sets it; build the model with init_empty_weights(include_buffers=False) so "
                "buffers keep their values."
            )
        gen = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))
        value = torch.empty(_full_shape(t), dtype=t.dtype)
        with torch.no_grad():
            _default_init(name, value, gen)
        values[name] = value
    return values
