"""The dependencies of a channel-parallel sequence mixer, read by differentiation.

:func:`capture` records a candidate mixer's first call during the block's recorded forward.
:func:`slapo_lab.sharding.mixers.dependencies` then, with the helpers here, runs a copy of it with random weights
(:func:`_materialise`: a meta mixer materialised on the CPU) and random inputs of the recorded shapes
(:func:`_real_inputs`; state objects copied afresh by :func:`_fresh`), finds its linears' order (:func:`_run`:
the last is the output linear), and :func:`_dependencies` replaces the input linears' outputs with leaves, cuts
the output linear's input ``X`` into ``K`` chunks of features and, for each chunk, takes the gradient of a
positive random weighting of it with respect to every input linear's output and every other parameter: its
non-zero pattern is which input features and parameter entries the chunk's channels need
(:class:`~slapo_lab.sharding.mixer_plan.MixerDeps`). Norm-like modules whose statistics span the channels
(:func:`_stat_norms`) are read again with those statistics detached (:class:`_StatMode`; summed over the ranks
later by :mod:`slapo_lab.sharding.feature_stats`, as vLLM's ``Mixer2RMSNormGated`` all-reduces its variance).
Sources: transformers ``models/mamba2/modeling_mamba2.py``, ``models/mamba/modeling_mamba.py``; Megatron-LM
``megatron/core/ssm/mamba_mixer.py``. Split from :mod:`slapo_lab.sharding.mixers`, which re-exports
:func:`capture`.
"""

from __future__ import annotations

import copy
import itertools

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .feature_stats import _dims
from .mixer_plan import MAX_CHUNKS, MixerDeps, _is_linear, _world_sizes, plan


class _Stop(Exception):
    pass


def capture(block: nn.Module, store: dict) -> list:
    """Forward pre-hooks on every module of ``block`` (the block itself aside) holding two or more linears (a
    candidate mixer: Mamba's ``mixer``, or MRA's ``attention`` around its ``self.query`` ... ``output.dense``)
    that keep its first call's arguments in ``store[rel]``; returns the handles."""
    handles = []
    for rel, m in block.named_modules():
        if not rel or _is_linear(m) or sum(_is_linear(c) for c in m.modules()) < 2:
            continue

        def pre(_m, args, kwargs, rel=rel):
            if rel not in store:  # state objects (a cache) as they were before the call, which fills them
                store[rel] = (_fresh(args), {k: _fresh(v) for k, v in kwargs.items()})

        handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
    return handles


_PLAIN = (torch.Tensor, nn.Module, int, float, bool, str, bytes, type(None), torch.dtype, torch.device)


def _fresh(x):
    """``x`` with each state object in it (anything but tensors, modules, plain values and containers: a
    transformers ``Cache`` that the mixer's forward fills with its convolution and recurrent states) replaced
    by a deep copy, so each run of the mixer starts from the state it was first called with (a forward that
    read the state left by an earlier run would see a longer sequence, and in-place state updates break the
    gradients); an object that cannot be copied is kept."""
    if isinstance(x, _PLAIN) or callable(x):
        return x
    if isinstance(x, (list, tuple)):
        return type(x)(_fresh(y) for y in x)
    if isinstance(x, dict):
        return {k: _fresh(v) for k, v in x.items()}
    try:
        return copy.deepcopy(x)
    except Exception:  # noqa: BLE001 - an object without a copy: shared, as before
        return x


def _materialise(mixer: nn.Module) -> nn.Module:
    """A float32 CPU copy of ``mixer`` with random parameters (seeded), buffers kept where they hold values."""
    meta = any(t.is_meta for t in itertools.chain(mixer.parameters(), mixer.buffers()))
    m = copy.deepcopy(mixer)
    if meta:
        m = m.to_empty(device="cpu")
    m = m.float()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        if meta:
            for b in m.buffers():
                if b.is_floating_point():
                    b.copy_(torch.randn(b.shape, generator=g))
                else:
                    b.zero_()
    for (
        mod
    ) in m.modules():  # state a forward left on the module (RecurrentGemma's recurrent_states): none yet
        for k, v in list(vars(mod).items()):
            if isinstance(v, torch.Tensor) and not k.startswith("_"):
                setattr(mod, k, None)
    m.eval()
    return m


def _real_inputs(args, kwargs, g):
    def conv(x, key=""):
        if isinstance(x, torch.Tensor):
            if x.is_floating_point():
                return torch.randn(x.shape, generator=g)
            if x.dtype == torch.bool or "mask" in key:
                return torch.ones(x.shape, dtype=x.dtype)
            if not x.is_meta:
                return x.to("cpu")
            if "position" in key and x.dim():  # positions 0, 1, ... (a zero position resets a recurrence)
                return torch.arange(x.shape[-1], dtype=x.dtype).expand(x.shape).contiguous()
            return torch.zeros(x.shape, dtype=x.dtype)
        if isinstance(x, (list, tuple)):
            return type(x)(conv(y) for y in x)
        return x

    return conv(list(args)), {k: conv(v, k) for k, v in kwargs.items()}


def _run(
    m: nn.Module, args, kwargs, leaves: dict | None = None, row: str | None = None, seen: dict | None = None
):
    """Run ``m``; the output of each linear in ``leaves`` (path -> None) is replaced by a leaf that requires
    grad (stored there), and the input of ``row`` is returned (the run stops there). Returns (order of the
    linears called, row input)."""
    order, handles, got = [], [], {}
    for rel, c in m.named_modules():
        if not _is_linear(c) or not rel:
            continue

        def pre(_c, a, rel=rel):
            order.append(rel)
            if seen is not None:
                seen.setdefault(rel, a[0])
            if rel == row:
                got["x"] = a[0]
                raise _Stop

        def post(_c, _a, out, rel=rel):
            if leaves is not None and rel in leaves:
                leaf = out.detach().clone().requires_grad_(True)
                leaves[rel] = leaf
                return leaf
            return None

        handles += [c.register_forward_pre_hook(pre), c.register_forward_hook(post)]
    try:
        m(*_fresh(list(args)), **{k: _fresh(v) for k, v in kwargs.items()})
    except _Stop:
        pass
    finally:
        for h in handles:
            h.remove()
    return order, got.get("x")


class _StatMode(TorchFunctionMode):
    """Inside a norm-like module: each ``mean`` / ``sum`` / ``var`` / ``std`` over the last axis is detached
    (``"detach"``), recorded in ``store`` in call order (``"record"``), or, where its input holds ``local`` features,
    replaced by the next recorded value (``"replay"``: a rank copy gets the statistic over all ranks' features, as
    :class:`~slapo_lab.sharding.feature_stats.GlobalFeatureStats` gives it at run time)."""

    def __init__(self, how: str, store: list, local: int | None = None) -> None:
        super().__init__()
        self.how, self.store, self.local, self.hits = how, store, local, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        out = func(*args, **kwargs)
        x = args[0] if args else kwargs.get("input")
        if getattr(func, "__name__", "") not in ("mean", "sum", "var", "std") or not isinstance(
            x, torch.Tensor
        ):
            return out
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if x.dim() < 1 or not isinstance(dim, (int, tuple, list, type(None))):
            return out
        if x.dim() - 1 not in _dims(dim, x.dim()):
            return out
        self.hits += 1
        if self.how == "detach":
            return out.detach()
        if self.how == "record":
            self.store.append(out.detach())
            return out
        v = self.store.pop(0) if self.store else None
        if x.shape[-1] == self.local and v is not None and v.shape == out.shape:
            return v
        return out


def _with_stats(mod: nn.Module, make) -> None:
    """Run ``mod``'s forward (on this instance) under the mode ``make()`` returns."""
    inner = mod.forward

    def forward(*a, **k):
        mode = make()
        with mode:
            return inner(*a, **k)

    mod.forward = forward


def _stat_norms(m: nn.Module, args, kwargs) -> dict:
    """The norm-like modules of ``m`` (leaves other than linears and convolutions holding parameters) whose
    forward takes a statistic over its last axis, with those statistics' values in a run of ``m``:
    ``{path: [values]}``."""
    r = copy.deepcopy(m)
    found: dict = {}
    for sub, mod in r.named_modules():
        if (
            sub
            and not _is_linear(mod)
            and not isinstance(mod, nn.modules.conv._ConvNd)
            and any(p is not None for p in mod._parameters.values())
            and not any(True for _ in mod.children())
        ):
            found[sub] = []
            _with_stats(mod, lambda store=found[sub]: _StatMode("record", store))
    try:
        with torch.no_grad():
            r(*args, **kwargs)
    except Exception:  # noqa: BLE001 - no reading of its statistics
        return {}
    return {k: v for k, v in found.items() if v}


def _stats_split_features(deps: MixerDeps, norms: dict) -> bool:
    """Whether each norm in ``norms`` is split contiguously on the last axis of its parameters at every world
    size the plan allows (its features follow the output linear's input), never replicated."""
    for ws in _world_sizes(deps.chunks):
        p = plan(deps, ws)
        if p.reason:
            continue
        for key, shape in deps.shapes.items():
            sub = key.rsplit(":", 1)[0]
            if sub in norms and (sub in p.grad_sum or p.shards.get(key) != (len(shape) - 1, 1)):
                return False
    return True


def _dependencies(pristine: nn.Module, a, kw, order: list, g, norms: dict):
    """The body of :func:`dependencies`: ``(MixerDeps, the output linear's input)`` or None; the statistics of
    the modules in ``norms`` are detached."""
    m = copy.deepcopy(pristine)
    for sub in norms:
        _with_stats(m.get_submodule(sub), lambda: _StatMode("detach", []))
    row = order[-1]
    ins = order[:-1]
    leaves = dict.fromkeys(ins)
    seen: dict = {}
    bufs = _leaf_buffers(m)
    with torch.enable_grad():
        _, x = _run(m, a, kw, leaves, row, seen)
        if x is None or not x.requires_grad or any(v is None for v in leaves.values()):
            return None
        feats = x.shape[-1]
        k = next((c for c in (16, 8, 4, 2) if c <= MAX_CHUNKS and feats % c == 0), None)
        if k is None:
            return None
        params = _mixer_params(m, ins, row, bufs)
        deps = MixerDeps(k, row)
        deps.feats = {p: leaves[p].shape[-1] for p in ins}
        deps.shapes = {key: tuple(p.shape) for key, p in params.items()}
        _note_feeds(deps, ins, leaves, seen)
        _note_chunk_deps(deps, x, ins, leaves, params, g)
    return deps, x


def _leaf_buffers(m: nn.Module) -> dict[str, list[str]]:
    """Make each floating buffer of ``m`` of more than one entry a leaf that requires a gradient (a per-feature
    buffer, Falcon-H1's ``mup_vector`` scaling in_proj's outputs: its entries' dependencies are read like a
    parameter's); returns ``{submodule path: [buffer names]}``."""
    bufs: dict = {}
    for sub, mod in m.named_modules():
        for n, b in list(mod._buffers.items()):
            if isinstance(b, torch.Tensor) and b.is_floating_point() and b.numel() > 1:
                mod._buffers[n] = b.detach().clone().requires_grad_(True)
                bufs.setdefault(sub, []).append(n)
    return bufs


def _mixer_params(m: nn.Module, ins: list, row: str, bufs: dict) -> dict[str, torch.Tensor]:
    """``{"submodule:name": tensor}``: the parameters (and leaf buffers ``bufs``) of ``m``'s modules other than
    the input linears ``ins`` and the output linear ``row``."""
    params = {}
    for sub, mod in m.named_modules():
        if sub in ins or sub == row:
            continue  # (a linear whose weight the forward uses directly, Mamba's dt_proj, counts here)
        for n, p in mod.named_parameters(recurse=False):
            params[f"{sub}:{n}"] = p
        for n in bufs.get(sub, ()):
            params[f"{sub}:{n}"] = mod._buffers[n]
    return params


def _note_feeds(deps: MixerDeps, ins: list, leaves: dict, seen: dict) -> None:
    """``deps.values`` (each input linear's input and output) and ``deps.feeds`` (the input linears whose
    outputs reach each one's input)."""
    for p in ins:
        xin = seen.get(p)
        deps.values[p] = (None if xin is None else xin.detach(), leaves[p].detach())
        deps.feeds[p] = set()
        if isinstance(xin, torch.Tensor) and xin.requires_grad:
            gs = torch.autograd.grad(
                xin.sum(), [leaves[q] for q in ins], retain_graph=True, allow_unused=True
            )
            deps.feeds[p] = {q for q, gq in zip(ins, gs, strict=True) if gq is not None}


def _nonzero_features(gr: torch.Tensor | None) -> torch.Tensor:
    """The last-axis indices where the gradient ``gr`` is non-zero somewhere (none for no gradient)."""
    if gr is None:
        return torch.zeros(0, dtype=torch.long)
    return torch.nonzero(gr.abs().reshape(-1, gr.shape[-1]).sum(0)).flatten()


def _note_chunk_deps(
    deps: MixerDeps, x: torch.Tensor, ins: list, leaves: dict, params: dict, g: torch.Generator
) -> None:
    """For each of the ``deps.chunks`` chunks of the output linear's input ``x``: the features of each input
    linear (``deps.outs``) and the entries of each parameter (``deps.params``) it depends on (non-zero
    gradients of a randomly weighted sum of the chunk)."""
    k = deps.chunks
    targets = [leaves[p] for p in ins] + list(params.values())
    w = torch.rand(x.shape, generator=g) + 0.5
    width = x.shape[-1] // k
    for c in range(k):
        loss = (x[..., c * width : (c + 1) * width] * w[..., c * width : (c + 1) * width]).sum()
        grads = torch.autograd.grad(loss, targets, retain_graph=True, allow_unused=True)
        for p, gr in zip(ins, grads[: len(ins)], strict=True):
            deps.outs.setdefault(p, []).append(_nonzero_features(gr))
        for key, gr in zip(params, grads[len(ins) :], strict=True):
            nz = torch.zeros(0, dtype=torch.long) if gr is None else torch.nonzero(gr.reshape(-1)).flatten()
            deps.params.setdefault(key, []).append(nz)
