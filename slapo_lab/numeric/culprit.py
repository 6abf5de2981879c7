"""Naming the culprit of a failed numeric check (:mod:`slapo_lab.numeric`, step 3).

:class:`_Trace` puts hooks on every module of one copy (the reference, or a rank's scheduled copy): each
module's first tensor output in completion order, the modules still running when a forward raised, and each
module's gradient for its own input in the order autograd produces them. From two traces:
:func:`first_differing_module` (the first module whose output differs while every enclosing module's does
too), :func:`first_reshaped_module` (an output of another shape), :func:`first_differing_input_grad` (a
partial gradient no all-reduce completed: tolerances :data:`GRAD_RTOL`, :data:`GRAD_ATOL`,
:data:`GRAD_NOISE`). :func:`_rank_run` is what one simulated rank runs: replay the schedule on its copy, then
forward and backward against the reference (:func:`slapo_lab.verify_models`).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..module_state import peek_meta, syncs_of
from ..record import Call, replay
from ..schedule import create_schedule
from ..verify import verify_models
from .ranks import check_stop


def _first_tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)):
        return next((t for t in (_first_tensor(v) for v in x) if t is not None), None)
    if isinstance(x, dict):
        return next((t for t in (_first_tensor(v) for v in x.values()) if t is not None), None)
    return None


#: A module's input gradient differs when max |a - b| exceeds this fraction of max |reference| (plus
#: :data:`GRAD_ATOL`): float32 sums in another order stay near 1e-6 of the scale, a partial sum that no
#: all-reduce completed is off by a large part of it.
GRAD_RTOL = 1e-3
GRAD_ATOL = 1e-12
#: An enclosing module's input gradient within this fraction of the reference's agrees (float noise).
GRAD_NOISE = 1e-5


class _Trace:
    """Hooks on every module of one copy (the reference or a rank's scheduled copy).

    * forward: each module's first tensor output (in completion order) and the modules still running;
    * backward: the gradient each module receives for each of its floating-point inputs, in the order
      autograd produces them (a pre-hook that runs before every other one, the schedule's ``bwd_post`` sync
      included, feeds the module a clone of the input whose gradient hook records it: the gradient this
      module alone sends back, after its own all-reduce).
    """

    def __init__(self, model: nn.Module) -> None:
        self.stack: list[str] = []
        self.outputs: dict[str, torch.Tensor] = {}
        self.in_shapes: dict[str, tuple | None] = {}
        self.grads: dict[tuple, torch.Tensor] = {}
        self.grad_order: list[tuple] = []
        self.calls: dict[str, int] = {}
        self.names = {id(m): n for n, m in model.named_modules()}
        self.modules = dict(model.named_modules())
        self.failed: str | None = None
        self.handles = []
        for name, m in model.named_modules():
            self.handles.append(
                m.register_forward_pre_hook(
                    lambda _m, a, kw, n=name: self._tap(n, a, kw), with_kwargs=True, prepend=True
                )
            )
            self.handles.append(m.register_forward_pre_hook(lambda _m, a, n=name: self._enter(n, a)))
            self.handles.append(m.register_forward_hook(lambda _m, _i, o, n=name: self._done(n, o)))

    def _enter(self, name: str, args: tuple) -> None:
        check_stop()  # a cancelled check ends at the next module
        self.stack.append(name)
        if name not in self.in_shapes:
            t = _first_tensor(args)
            self.in_shapes[name] = tuple(t.shape) if t is not None else None

    def _done(self, name: str, out) -> None:
        if self.stack and self.stack[-1] == name:
            self.stack.pop()
        t = _first_tensor(out)
        if t is not None and name not in self.outputs:
            self.outputs[name] = t.detach().clone()

    def _tap(self, name: str, args: tuple, kwargs: dict):
        if not torch.is_grad_enabled():
            return None
        call = self.calls.get(name, 0)
        self.calls[name] = call + 1
        changed = False

        def wrap(where, x):
            nonlocal changed
            if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.requires_grad):
                return x
            changed = True
            y = x.clone()
            y.register_hook(lambda g, k=(name, call, where): self._grad(k, g))
            return y

        new_args = tuple(wrap(i, a) for i, a in enumerate(args))
        new_kw = {k: wrap(k, v) for k, v in kwargs.items()}
        return (new_args, new_kw) if changed else None

    def _grad(self, key: tuple, g: torch.Tensor) -> None:
        if key not in self.grads:
            self.grads[key] = g.detach().clone()
            self.grad_order.append(key)

    def fail(self, err: BaseException | None = None) -> str:
        """The module whose call raised ``err``: the deepest frame of its traceback that runs a method of a
        module of this copy (its ``forward``, or a hook of its call); else the innermost module running."""
        deepest = None
        tb = err.__traceback__ if err is not None else None
        while tb is not None:
            owner = tb.tb_frame.f_locals.get("self")
            if owner is not None and id(owner) in self.names:
                deepest = self.names[id(owner)]
            tb = tb.tb_next
        if deepest is None:
            deepest = self.stack[-1] if self.stack else ""
        self.failed = deepest
        return deepest

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _ancestors(name: str) -> list[str]:
    parts = name.split(".") if name else []
    return [".".join(parts[:i]) for i in range(len(parts))]


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def first_differing_module(ref: _Trace, sch: _Trace, atol: float = 1e-5, rtol: float = 1e-5) -> str | None:
    """The first module (in forward completion order) whose output differs from the reference's while every
    enclosing module with a comparable output differs too (a row-parallel layer whose partial sums a sync
    on its parent reduces is not a difference). Outputs of another shape (a column-parallel layer's slice)
    are not compared. A module whose own sync completes its output (``fwd_post`` all-reduce or all-gather)
    from a rank's slice of its input did not start the difference: the code that made the slice did, so its
    parent is named (heads split in q but not in k show first at the output projection)."""
    differs: dict[str, bool] = {}
    for name, a in sch.outputs.items():
        b = ref.outputs.get(name)
        if b is None or a.shape != b.shape or a.dtype != b.dtype:
            continue
        if a.is_floating_point():
            differs[name] = not torch.allclose(a.double(), b.double(), atol=atol, rtol=rtol)
        else:
            differs[name] = not torch.equal(a, b)
    for name, bad in differs.items():
        if not bad:
            continue
        if all(differs.get(a, True) for a in _ancestors(name)):
            mod = sch.modules.get(name)
            meta = peek_meta(mod) if mod is not None else None
            sliced = sch.in_shapes.get(name) != ref.in_shapes.get(name)
            if name and sliced and meta and meta.output_synced and meta.output_type == "partial":
                return _parent(name)
            return name
    return None


def first_reshaped_module(ref: _Trace, sch: _Trace) -> tuple[str, tuple, tuple] | None:
    """The first module (in forward completion order) whose output has another shape than the reference's
    while every enclosing module's output has another shape too (a column-parallel slice inside a module
    whose output is whole is no fault): ``(module, its shape, the reference's shape)``."""
    reshaped: dict[str, bool] = {}
    for name, a in sch.outputs.items():
        b = ref.outputs.get(name)
        if b is not None:
            reshaped[name] = a.shape != b.shape
    for name, bad in reshaped.items():
        if bad and all(reshaped.get(a, True) for a in _ancestors(name)):
            return name, tuple(sch.outputs[name].shape), tuple(ref.outputs[name].shape)
    return None


def first_differing_input_grad(
    ref: _Trace, sch: _Trace, rank: int = 0, world_size: int = 1
) -> tuple[str, float] | None:
    """The first module, in the order autograd produced the scheduled copy's gradients, whose gradient for one
    of its inputs differs from the reference's by more than :data:`GRAD_RTOL` of its scale: ``(module,
    relative difference)``, else None. A wrong gradient spreads to every module before it, so the first one
    autograd produces is where it starts. Not a fault: a child's partial input gradient inside a module whose
    own ``bwd_post`` all-reduce sums its children's parts (its input gradient then agrees to
    :data:`GRAD_NOISE`), nor the partial gradient a gathered output's consumer receives inside a module whose
    input gradient agrees, the gather's backward summing the ranks' parts (Mamba's ``x_proj``), nor a child's
    partial input gradient inside a module that all-gathers its input (sequence parallelism: the gather's
    backward reduce-scatter sums the parts). A gradient ``world_size`` times shorter on the sequence axis (this
    rank's slice of the sequence) is compared with rank ``rank``'s slice of the reference's; gradients of
    another shape (a row-parallel layer's slice of its input) are not compared."""
    rel = _relative_grad_differences(ref, sch, rank, world_size)
    worst: dict[str, float] = {}
    for (name, _call, _where), r in rel.items():
        worst[name] = max(worst.get(name, 0.0), r)
    for key, r in rel.items():
        name = key[0]
        # a child's partial input gradient is no fault where an enclosing module with a bwd_post all-reduce
        # receives the right one (its sync sums its children's parts), nor inside a module whose output is a
        # partial sum reduced at its own boundary (a norm in a vocab-parallel embedding's forward, Inkling's
        # embed_norm, sees this rank's rows only, as its forward outputs are partial: parameters are compared)
        if r > GRAD_RTOL and not any(
            (
                (_sums_children(sch, a) or _gathers_input(sch, a) or _gathers_for(sch, name, a))
                and worst.get(a, 1.0) <= GRAD_NOISE
            )
            or _reduces_partial(sch, a)
            for a in _ancestors(name)
        ):
            return name, r
    return None


def _slice_of(a: torch.Tensor, b: torch.Tensor, rank: int, world_size: int) -> torch.Tensor | None:
    """``b``'s slice that rank ``rank`` holds when ``a`` is ``b`` split ``world_size`` ways on its sequence axis
    (axis -2 of an activation of 3 or more axes: sequence parallelism), ``b`` itself for the same shape, else
    None."""
    if a.shape == b.shape:
        return b
    if a.dim() != b.dim() or world_size < 2:
        return None
    axes = [d for d in range(a.dim()) if a.shape[d] != b.shape[d]]
    # only the sequence of a (..., seq, features) activation: a split feature axis (a row layer's input) is
    # this rank's features of a gradient it alone cannot complete, and flattened tokens come in rank order
    if axes != [a.dim() - 2] or a.dim() < 3 or a.shape[axes[0]] * world_size != b.shape[axes[0]]:
        return None
    return b.chunk(world_size, axes[0])[rank]


def _relative_grad_differences(
    ref: _Trace, sch: _Trace, rank: int = 0, world_size: int = 1
) -> dict[tuple, float]:
    """Input-gradient key -> its largest difference from the reference's, relative to the reference's scale
    (a gradient of this rank's slice of a split axis is compared with that slice, gradients of another shape
    are left out), in the order autograd produced them."""
    diffs: dict[tuple, tuple[float, float]] = {}
    for key in sch.grad_order:
        a, b = sch.grads[key], ref.grads.get(key)
        b = _slice_of(a, b, rank, world_size) if b is not None else None
        if b is None:
            continue
        d = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
        diffs[key] = d, float(b.double().abs().max()) if b.numel() else 0.0
    # the float noise of the whole backward: a gradient that is zero in exact arithmetic (keys whose values
    # are all equal, as with identical tokens) holds only that noise, which is no fault however large a part
    # of its own tiny scale it is
    floor = GRAD_NOISE * max((scale for _d, scale in diffs.values()), default=0.0)
    return {key: d / (scale + max(GRAD_ATOL, floor)) for key, (d, scale) in diffs.items()}


def _sums_children(sch: _Trace, name: str) -> bool:
    """Whether a bwd_post all-reduce on module ``name`` sums its children's input gradients."""
    return ("bwd_post", "all_reduce") in _syncs_at(sch, name)


def _gathers_input(sch: _Trace, name: str) -> bool:
    """Whether module ``name`` all-gathers its input (fwd_pre all_gather: sequence parallelism), whose
    backward reduce-scatter sums its children's partial input gradients."""
    return ("fwd_pre", "all_gather") in _syncs_at(sch, name)


def _syncs_at(sch: _Trace, name: str) -> list[tuple[str, str]]:
    mod = sch.modules.get(name)
    return syncs_of(mod) if mod is not None else []


def _reduces_partial(sch: _Trace, name: str) -> bool:
    """Whether module ``name``'s output is a partial sum it reduces itself (vocab parallel)."""
    mod = sch.modules.get(name)
    meta = peek_meta(mod) if mod is not None else None
    return bool(meta) and meta.output_type == "partial"


def _gathers_for(sch: _Trace, name: str, outer: str) -> bool:
    """Whether a module inside ``outer`` (not around ``name``) gathers its output over the ranks (fwd_post
    all_gather: Mamba's x_proj in a channel-parallel mixer); every rank then holds the whole output, its
    consumers (FalconMamba's b/c/dt_layernorm) receive this rank's part of its gradient, and the gather's
    backward sums those parts (reduce-scatter)."""
    mod = sch.modules.get(outer)
    for rel, m in mod.named_modules() if mod is not None else ():
        meta = peek_meta(m)
        full = f"{outer}.{rel}" if outer and rel else outer or rel
        if (
            meta
            and ("fwd_post", "all_gather") in meta.syncs
            and not (name == full or name.startswith(full + "."))
        ):
            return True
    return False


def _failed_at(err: BaseException, ref: _Trace, sch: _Trace) -> str:
    """Where the scheduled copy's forward failed: the module whose call raised (:meth:`_Trace.fail`), or, when
    a module inside it that ran before returned an output of another shape than the reference's through its
    own ``fwd_post`` sync (a reduce-scatter where an all-reduce belongs), that module."""
    raised = sch.fail(err)
    inside = [
        n
        for n, out in sch.outputs.items()
        if (not raised or n.startswith(raised + "."))
        and n in ref.outputs
        and out.shape != ref.outputs[n].shape
    ]
    for n in reversed(inside):
        meta = peek_meta(sch.modules[n]) if n in sch.modules else None
        if meta and any(mode == "fwd_post" for mode, _op in meta.syncs):
            return n
    return raised


def _unjudged(model: nn.Module, trace: _Trace) -> list[str]:
    """The modules of ``model`` (after its forward and backward) holding sharded trainable parameters that took
    no part: never called under ``trace`` and no gradient reached any of them (a tower the inputs never reach;
    a module whose weight its parent reads directly, Mamba's ``conv1d``, does get gradients)."""
    out = []
    for name, m in model.named_modules():
        sharded = [
            p
            for p in m._parameters.values()
            if p is not None and p.requires_grad and getattr(p, "shard_axis", None) is not None
        ]
        if sharded and name not in trace.calls and all(p.grad is None for p in sharded):
            out.append(name)
    return out


def _rank_run(base: nn.Module, calls: list[Call], inputs: dict, failures: dict, rank: int):
    """One simulated rank (inside :func:`run_threaded_ranks`): replay ``calls`` on a copy of ``base`` and
    compare it with another copy. Returns ``(VerifyReport, first module whose output differs, first module
    whose output has another shape (module, shape, reference shape), first module whose input gradient differs
    (module, relative difference), the sharded modules that never ran (:func:`_unjudged`))``; on a failure records ``(phase, module, exception)`` in
    ``failures[rank]`` (the module of the replayed call that was refused, or the module whose forward raised)
    and raises it again."""
    traces: list[_Trace] = []
    phase, at = "replaying the schedule", ""
    try:
        reference = copy.deepcopy(base)
        sch = create_schedule(copy.deepcopy(base))
        for i, c in enumerate(calls):
            check_stop()
            phase, at = f"replaying call {i + 1} (sch[{c.path!r}].{c.primitive})", c.path
            replay(sch, [c])
        phase, at = "running the forward and backward", ""
        traces = [_Trace(reference), _Trace(sch.mod)]
        report = verify_models(reference, sch.mod, inputs, sch.tp, device="cpu", eval_mode=True)
        return (
            report,
            first_differing_module(*traces),
            first_reshaped_module(*traces),
            first_differing_input_grad(*traces, rank, sch.world_size),
            _unjudged(sch.mod, traces[1]),
        )
    except BaseException as err:
        failures[rank] = (phase, _failed_at(err, *traces) if len(traces) == 2 else at, err)
        raise
    finally:
        for t in traces:
            t.remove()
