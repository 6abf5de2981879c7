"""Slapo's linear variants (Slapo 0.0.3 ``slapo/op/linear.py``): fused QKV, and linears that run a sync
function (e.g. a tensor-parallel all-reduce) between the matmul and the bias, optionally fused with the
activation or dropout that follows. ``LinearWithSeparateBias`` is
:class:`slapo_lab.primitives.replace.LinearWithSeparateBias` (re-exported by :mod:`slapo_lab.op`)."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ScheduleError
from .fused_bias import bias_dropout, bias_gelu, bias_new_gelu, fused

_ACTS = {"gelu": bias_gelu, "gelu_new": bias_new_gelu}


class FusedQKV(nn.Module):
    """One linear producing interleaved Q, K and V (Slapo 0.0.3 ``slapo/op/linear.py``).

    ``forward(hidden_states)``: ``(B, S, hidden_size)`` -> ``[q, k, v]``, each
    ``(B, S, num_heads // world_size, head_size)``; the weight is ``(3 * hidden_size, hidden_size)`` with the
    three projections interleaved per head (so sharding its rows keeps whole heads on a rank).

    Raises:
        ScheduleError: ``hidden_size`` not divisible by ``num_heads``, or ``num_heads`` by ``world_size``.
    """

    def __init__(self, hidden_size, num_heads, world_size) -> None:
        super().__init__()
        if hidden_size % num_heads:
            raise ScheduleError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}.")
        if world_size < 1 or num_heads % world_size:
            raise ScheduleError(f"num_heads {num_heads} is not divisible by world_size {world_size}.")
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.head_size = hidden_size // num_heads
        self.fused_linear = nn.Linear(hidden_size, self.num_heads * self.head_size * 3)
        self.world_size = world_size

    def reshape_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_heads // self.world_size, self.head_size, 3)
        return x.view(new_x_shape).contiguous()

    def forward(self, hidden_states):
        qkv = self.reshape_for_scores(self.fused_linear(hidden_states))
        q, k, v = torch.split(qkv, 1, dim=-1)
        return [torch.squeeze(t, -1).contiguous() for t in (q, k, v)]


def _fn_name(fn) -> str:
    if fn is None:
        return "None"
    if isinstance(fn, partial):
        args = [str(a) for a in fn.args] + [f"{k}={v}" for k, v in (fn.keywords or {}).items()]
        return f"partial({getattr(fn.func, '__name__', fn.func)}, {', '.join(args)})"
    return getattr(fn, "__name__", str(fn))


class LinearWithSyncFunc(nn.Linear):
    """``nn.Linear`` that calls ``sync_fn`` on ``x @ W.T`` before adding the bias (Slapo 0.0.3
    ``slapo/op/linear.py``): a row-parallel linear all-reduces its partial sums before the (replicated) bias.

    Shapes: ``x`` ``(*, in_features)`` -> ``(*, out_features)`` (``sync_fn`` must keep the shape, or change
    it consistently with the bias). Same parameters as ``nn.Linear``; ``traceable = False``.
    """

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, sync_fn=None):
        super().__init__(in_features, out_features, bias, device, dtype)
        self.traceable = False
        self.sync_fn = sync_fn

    def forward(self, x):
        x = F.linear(x, self.weight, None)
        if self.sync_fn is not None:
            x = self.sync_fn(x)
        if self.bias is not None:
            x = x + self.bias
        return x

    def extra_repr(self):
        return f"{super().extra_repr()}, sync_fn={_fn_name(self.sync_fn)}"


class LinearWithAct(LinearWithSyncFunc):
    """:class:`LinearWithSyncFunc` with the activation fused into the bias add (Slapo 0.0.3
    ``slapo/op/linear.py``): ``act(sync_fn(x @ W.T) + b)``.

    ``act_fn``: ``"gelu"`` (exact erf GELU, HF's ``gelu``) or ``"gelu_new"`` (tanh approximation, GPT-2's).
    Slapo used Megatron's tanh approximation for both; here each matches its HF name. Shapes as ``nn.Linear``.

    Raises:
        ScheduleError: ``bias=False``, or an unsupported ``act_fn``.
    """

    def __init__(
        self, in_features, out_features, bias=True, act_fn="gelu", device=None, dtype=None, sync_fn=None
    ):
        if not bias:
            raise ScheduleError("LinearWithAct needs a bias (bias=True); use nn.Linear without one.")
        if act_fn not in _ACTS:
            raise ScheduleError(
                f"LinearWithAct supports act_fn {' or '.join(map(repr, _ACTS))}, not {act_fn!r}."
            )
        super().__init__(in_features, out_features, True, device, dtype, sync_fn)
        self.act_fn = act_fn
        self.act = fused(_ACTS[act_fn])

    def forward(self, x: Tensor) -> Tensor:
        x = F.linear(x, self.weight, None)
        if self.sync_fn is not None:
            x = self.sync_fn(x)
        return self.act(x, self.bias)

    def extra_repr(self):
        return f"{super().extra_repr()}, act_fn={self.act_fn}"


class LinearWithDropout(LinearWithSyncFunc):
    """:class:`LinearWithSyncFunc` with dropout fused into the bias add (Slapo 0.0.3 ``slapo/op/linear.py``):
    ``dropout(sync_fn(x @ W.T) + b, p)`` (dropout only in training mode). ``use_torchscript`` is accepted for
    Slapo's signature; both settings use :func:`~slapo_lab.op.fused_bias.fused`. Shapes as ``nn.Linear``.

    Raises:
        ScheduleError: ``bias=False``, or ``p`` outside ``[0, 1]``.
    """

    def __init__(
        self,
        in_features,
        out_features,
        bias=True,
        p=0.5,
        inplace=False,
        device=None,
        dtype=None,
        sync_fn=None,
        use_torchscript=False,
    ):
        if not bias:
            raise ScheduleError("LinearWithDropout needs a bias (bias=True); use nn.Linear without one.")
        if not 0.0 <= float(p) <= 1.0:
            raise ScheduleError(f"The dropout probability p must be in [0, 1], not {p}.")
        super().__init__(in_features, out_features, True, device, dtype, sync_fn)
        self.p = float(p)
        self.inplace = inplace
        self.use_torchscript = use_torchscript
        self.dropout = fused(bias_dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = F.linear(x, self.weight, None)
        if self.sync_fn is not None:
            x = self.sync_fn(x)
        return self.dropout(x, self.bias, self.p, self.training, self.inplace)

    def extra_repr(self):
        return f"{super().extra_repr()}, p={self.p}, inplace={self.inplace}"
