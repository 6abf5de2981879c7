"""Activation checkpointing: ``checkpoint``.

The module's forward runs under non-reentrant :func:`torch.utils.checkpoint.checkpoint` (keyword
arguments pass through; RNG state -- including the tensor-parallel tracker's -- is restored on
recomputation), so only its inputs are saved for backward. Semantics after Slapo's
``slapo/primitives/checkpoint.py``.

``checkpoint(policy="selective")`` keeps more: the outputs of the ops of :data:`slapo_lab.random.SELECTIVE_SAVE`
(attention and every second matmul) are saved and only the rest is recomputed, torchtitan's per-op selective
activation checkpointing (``selective_ac_option="op"``) through torch's
:func:`~torch.utils.checkpoint.create_selective_checkpoint_contexts` (:func:`slapo_lab.random.checkpoint_selective`).

A checkpointed module runs its forward twice (once more in backward), so nothing it does may have a
side effect outside its outputs. Hugging Face decoder blocks append their keys and values to the KV
cache object they are handed (``past_key_values`` / ``layer_past``: a ``transformers`` ``Cache``); the
recomputation would append them again (GPT-Neo: "The size of tensor a (32) must match the size of
tensor b (16)"). So while gradients are enabled a checkpointed module is called without its cache:
the composed forward replaces every ``Cache`` argument by ``None`` and ``use_cache=True`` by ``False``
(what ``transformers`` does itself under gradient checkpointing; the model's returned cache then
lacks those blocks); see :func:`slapo_lab.module_state.without_kv_cache`, applied by the composed forward.
Under ``torch.no_grad()`` (generation) nothing is checkpointed or changed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import ScheduleError
from ..module_state import install_forward, module_meta, peek_meta
from .base import Primitive, register_primitive

if TYPE_CHECKING:
    from ..schedule import Schedule

#: ``checkpoint(policy=...)``: recompute everything but the inputs, or keep what selective checkpointing keeps.
POLICIES = ("full", "selective")


@register_primitive()
class CheckpointPrimitive(Primitive):
    """Recompute this module's activations in backward instead of storing them.

    ``order_args_fn`` (Slapo compatibility) may map ``(*args, **kwargs)`` to positional arguments; with
    the non-reentrant implementation keyword arguments already work, so it is only applied if given.
    ``policy``: ``"full"`` (the default: only the inputs are saved) or ``"selective"`` (the outputs of attention
    and every second matmul are saved too; see the module docstring).

    Raises:
        ScheduleError: on the root module, when already checkpointed, for an fx ``subgraph`` (use
            ``replace`` to make the subgraph a module first), or for another ``policy``.
    """

    name = "checkpoint"

    @classmethod
    def check(
        cls,
        sch: Schedule,
        subgraph: Any = None,
        order_args_fn: Callable[..., Any] | None = None,
        policy: str = "full",
    ) -> None:
        if sch.parent is None:
            raise ScheduleError(
                "Cannot checkpoint the root module: nothing outside it would keep fewer activations; "
                "checkpoint its blocks (e.g. each encoder layer) instead."
            )
        meta = peek_meta(sch.mod)
        if meta and meta.checkpoint:
            raise ScheduleError(f"{sch.path} is already checkpointed.")
        if subgraph is not None:
            raise ScheduleError(
                "checkpoint(subgraph=...) needs a traced parent; replace the subgraph with a module first, "
                "then checkpoint that module."
            )
        if order_args_fn is not None and not callable(order_args_fn):
            raise ScheduleError("order_args_fn must be a callable.")
        if policy not in POLICIES:
            raise ScheduleError(
                f"checkpoint(policy={policy!r}) on {sch.path}: the policy is one of {', '.join(map(repr, POLICIES))}."
            )

    @staticmethod
    def apply(
        sch: Schedule,
        subgraph: Any = None,
        order_args_fn: Callable[..., Any] | None = None,
        policy: str = "full",
    ) -> None:
        CheckpointPrimitive.check(sch, subgraph, order_args_fn, policy)
        meta = module_meta(sch.mod)
        meta.checkpoint = True
        meta.checkpoint_policy = policy
        meta.order_args_fn = order_args_fn
        install_forward(sch.mod)
