"""Random-number state for tensor parallelism and activation checkpointing.

Follows Megatron-LM's ``CudaRNGStatesTracker`` (``megatron/core/tensor_parallel/random.py``) and
Slapo's ``slapo.random``: a tracker holds named RNG states; ``fork(name)`` runs a block under that
state and saves the advanced state back. Works for CPU and CUDA generators. The checkpoint wrapper
restores the tracker's states on recomputation so that dropout inside a tensor-parallel region
draws the same masks twice.
"""

from __future__ import annotations

import contextlib
import random
from typing import Any

import torch
import torch.utils.checkpoint as _torch_ckpt
from torch.utils.checkpoint import CheckpointPolicy

try:  # not a dependency of its own: torch runs without it
    import numpy as np
except ImportError:  # pragma: no cover
    np = None

_MODEL_PARALLEL_RNG = "model-parallel-rng"
_SEED_SET = False


def _device_state(device: str):
    if device == "cuda":
        return torch.cuda.get_rng_state()
    return torch.get_rng_state()


def _set_device_state(device: str, state) -> None:
    if device == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named RNG states (Megatron's tracker), for the CUDA generator if available, else the CPU one."""

    def __init__(self) -> None:
        self.states: dict[str, Any] = {}
        self.seeds: set[int] = set()

    @property
    def device(self) -> str:
        return "cuda" if torch.cuda.is_available() and torch.cuda.is_initialized() else "cpu"

    def reset(self) -> None:
        """Forget every state."""
        self.states.clear()
        self.seeds.clear()

    def get_states(self) -> dict[str, Any]:
        """A copy of the named states."""
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self.states.items()}

    def set_states(self, states: dict[str, Any]) -> None:
        """Replace the named states (as returned by :meth:`get_states`; tensors are copied)."""
        self.states = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Create state ``name`` seeded with ``seed``.

        Raises:
            ValueError: if the seed or the name is already used.
        """
        if seed in self.seeds:
            raise ValueError(f"seed {seed} already exists in the RNG tracker")
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists")
        self.seeds.add(seed)
        dev = self.device
        orig = _device_state(dev)
        if dev == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states[name] = _device_state(dev)
        _set_device_state(dev, orig)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG):
        """Run the block under state ``name`` (a no-op if that state was never added).

        Swaps the global generator's state (``torch.get_rng_state`` / ``set_rng_state``), which Dynamo does not
        trace: under ``torch.compile`` a fork is a graph break (an error with ``fullgraph=True``).
        """
        if name not in self.states:
            yield
            return
        dev = self.device
        orig = _device_state(dev)
        _set_device_state(dev, self.states[name])
        try:
            yield
        finally:
            self.states[name] = _device_state(dev)
            _set_device_state(dev, orig)


_TRACKER = RNGStatesTracker()

# Slapo's (and Megatron's) names for the tracker class and the process-wide tracker
CudaRNGStatesTracker = RNGStatesTracker
_CUDA_RNG_STATE_TRACKER = _TRACKER


def model_parallel_cuda_manual_seed(seed: int, tp_rank: int, always_enable_tp_seed: bool) -> int:
    """Seed the default generator and the tracker's tensor-parallel state (Slapo's / Megatron-LM's
    ``model_parallel_cuda_manual_seed``, ``slapo/random.py``): the TP state gets ``seed + 2718 + tp_rank``;
    the default generator gets ``seed``, or the TP seed with ``always_enable_tp_seed`` (sequence
    parallelism). The CUDA generator where CUDA is initialised, else the CPU one.

    Returns:
        int: the tensor-parallel seed of this rank.
    """
    tp_seed = seed + 2718 + tp_rank
    _TRACKER.reset()
    default = tp_seed if always_enable_tp_seed else seed
    if _TRACKER.device == "cuda":
        torch.cuda.manual_seed(default)
    else:
        torch.manual_seed(default)
    _TRACKER.add(_MODEL_PARALLEL_RNG, tp_seed)
    return tp_seed


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (named for Slapo/Megatron compatibility; it also serves the CPU)."""
    return _TRACKER


def set_random_seed(
    seed: int = 2013,
    dp_rank: int | None = None,
    pp_rank: int | None = None,
    tp_rank: int | None = None,
    always_enable_tp_seed: bool = False,
) -> int:
    """Seed Python, NumPy and torch for reproducibility, Slapo's scheme.

    The default seed is offset by ``100 * pp_rank`` and ``10 * dp_rank``; the tensor-parallel tracker
    state gets ``seed + 2718 + tp_rank`` so that dropout inside a TP region differs across TP ranks.
    With ``always_enable_tp_seed`` the TP seed becomes the default seed (sequence parallelism).

    Returns:
        int: the seed used for the default generator of this rank.
    """
    global _SEED_SET
    if pp_rank is not None:
        seed += 100 * pp_rank
    if dp_rank is not None:
        seed += 10 * dp_rank
    tp_seed = seed + 2718 + (tp_rank or 0)
    if always_enable_tp_seed and tp_rank is not None:
        seed = tp_seed
    random.seed(seed)
    if np is not None:
        np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    _TRACKER.reset()
    if tp_rank is not None:
        _TRACKER.add(_MODEL_PARALLEL_RNG, tp_seed)
    _SEED_SET = True
    return seed


def is_random_seed_set() -> bool:
    """Whether :func:`set_random_seed` ran in this process."""
    return _SEED_SET


class _TrackerStateContext:
    """Saves the tracker states at forward time and restores them around recomputation."""

    def __init__(self) -> None:
        self.saved = _TRACKER.get_states()

    @contextlib.contextmanager
    def restore(self):
        current = _TRACKER.get_states()
        _TRACKER.set_states(self.saved)
        try:
            yield
        finally:
            _TRACKER.set_states(current)


aten = torch.ops.aten

#: Ops whose outputs selective activation checkpointing keeps (the rest of a block is recomputed in backward):
#: torchtitan's ``_save_list`` for ``selective_ac_option="op"`` (``torchtitan/models/llama3/infra/parallelize.py``)
#: plus CPU's flash attention and ``addmm`` (a linear with bias). Of the matmuls (``mm`` / ``addmm``) every second
#: one is recomputed, as torchtitan's policy does.
SELECTIVE_SAVE = frozenset(
    op
    for op in (
        getattr(aten.mm, "default", None),
        getattr(aten.addmm, "default", None),
        getattr(aten._scaled_dot_product_flash_attention, "default", None),
        getattr(aten._scaled_dot_product_efficient_attention, "default", None),
        getattr(aten._scaled_dot_product_cudnn_attention, "default", None),
        getattr(aten._scaled_dot_product_flash_attention_for_cpu, "default", None),
        getattr(aten.max, "default", None),
    )
    if op is not None
)
MATMULS = frozenset(op for op in (aten.mm.default, aten.addmm.default))


#: Callables told of every tensor selective checkpointing keeps in a forward (:func:`observe_selective_saves`).
_SAC_OBSERVERS: list = []


@contextlib.contextmanager
def observe_selective_saves(fn):
    """Call ``fn(tensor)`` for every output :func:`selective_policy` keeps in a forward while the context is open
    (what the memory plan counts: those outputs live in the checkpoint's own cache, where autograd's
    ``saved_tensors_hooks`` do not see them)."""
    _SAC_OBSERVERS.append(fn)
    try:
        yield
    finally:
        _SAC_OBSERVERS.remove(fn)


def selective_policy():
    """A fresh ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` policy for one checkpointed call:
    keep the outputs of :data:`SELECTIVE_SAVE` but every second matmul's, recompute the rest.

    The matmuls are counted separately in the forward and in the recomputation (torchtitan's
    ``_get_custom_policy``), so that both make the same choice for the same op: the recomputation takes a kept
    output from the cache in the order the forward stored it.
    """
    count = {False: 0, True: 0}  # is_recompute -> matmuls seen

    def policy(ctx, func, *args, **kwargs):
        if func in MATMULS:
            count[ctx.is_recompute] += 1
        if func in SELECTIVE_SAVE and not (func in MATMULS and count[ctx.is_recompute] % 2 == 0):
            if _SAC_OBSERVERS and not ctx.is_recompute:
                out = getattr(ctx, "op_output", None)
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(t, torch.Tensor):
                        for fn in _SAC_OBSERVERS:
                            fn(t)
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _selective_contexts():
    return _torch_ckpt.create_selective_checkpoint_contexts(selective_policy())


def checkpoint_selective(function, *args, **kwargs):
    """Selective activation checkpointing of ``function(*args, **kwargs)``: the outputs of the ops of
    :data:`SELECTIVE_SAVE` are kept and the rest is recomputed in backward (torch's
    :func:`~torch.utils.checkpoint.create_selective_checkpoint_contexts`, non-reentrant; torchtitan's
    ``selective_ac_option="op"``). Like :func:`checkpoint`, it restores the tensor-parallel RNG tracker's states
    around the recomputation, except under ``torch.compile``, which takes the selective policy alone.
    """
    return _checkpoint(function, args, kwargs, False, _selective_contexts)


def checkpoint(function, *args, use_reentrant: bool = False, **kwargs):
    """Activation checkpointing that also preserves the tensor-parallel RNG tracker's states.

    A thin layer over :func:`torch.utils.checkpoint.checkpoint` (non-reentrant by default, so
    keyword arguments and non-tensor arguments pass through, ``preserve_rng_state=True``). When the
    tracker holds states (:func:`set_random_seed` with ``tp_rank``), a ``context_fn`` restores them around
    the recomputation in backward, so a :meth:`RNGStatesTracker.fork` inside draws the same dropout masks.

    Under ``torch.compile`` no ``context_fn`` is passed: Dynamo turns the call into its activation-checkpoint
    higher-order op (no graph break), whose recomputation is planned by AOTAutograd's partitioner; that never
    recomputes a random op (its output is saved), and no Python runs again in backward, so there is nothing to
    restore. (Dynamo accepts only selective-checkpoint policies as ``context_fn``.)
    """
    return _checkpoint(function, args, kwargs, use_reentrant, None)


def _checkpoint(function, args, kwargs, use_reentrant: bool, contexts):
    """:func:`checkpoint` (``contexts`` None) and :func:`checkpoint_selective` (``contexts`` gives the selective
    ``(forward, recompute)`` context pair): with tracker states, the recomputation runs with them restored, set
    outside the recompute context (torch's selective recompute mode must see only the forward's ops)."""
    if not _TRACKER.states or torch.compiler.is_compiling():
        extra = {} if contexts is None else {"context_fn": contexts}
        return _torch_ckpt.checkpoint(
            function, *args, use_reentrant=use_reentrant, preserve_rng_state=True, **extra, **kwargs
        )
    ctx = _TrackerStateContext()

    def context_fn():
        if contexts is None:
            return contextlib.nullcontext(), ctx.restore()
        forward, recompute = contexts()

        @contextlib.contextmanager
        def both():
            with ctx.restore(), recompute:
                yield

        return forward, both()

    return _torch_ckpt.checkpoint(
        function, *args, use_reentrant=False, preserve_rng_state=True, context_fn=context_fn, **kwargs
    )
