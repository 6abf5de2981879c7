"""Bias fused with the op that follows it (Slapo 0.0.3 ``slapo/op/fused_bias.py``).

The element-wise functions are plain PyTorch; :func:`fused` compiles one with ``torch.compile`` the first time
it runs on CUDA tensors (one kernel instead of two or three) and runs it eagerly elsewhere (CPU, meta, or where
compilation is unavailable), with the same results.
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F


def new_gelu(inp: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh-approximated GELU (HF ``gelu_new``); any shape -> same shape."""
    return 0.5 * inp * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (inp + 0.044715 * torch.pow(inp, 3.0))))


def bias_new_gelu(inp: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``new_gelu(inp + bias)``; ``inp`` ``(*, n)``, ``bias`` ``(n,)`` -> ``(*, n)``."""
    return new_gelu(inp + bias)


def bias_gelu(inp: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Exact (erf) GELU of ``inp + bias`` (HF ``gelu``); ``inp`` ``(*, n)``, ``bias`` ``(n,)`` -> ``(*, n)``."""
    return F.gelu(inp + bias)


def bias_dropout(
    x: torch.Tensor, bias: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
) -> torch.Tensor:
    """``dropout(x + bias)``; ``x`` ``(*, n)``, ``bias`` ``(n,)`` -> ``(*, n)``."""
    return F.dropout(x + bias, p=p, training=training, inplace=inplace)


class BiasGeLUFunction(torch.autograd.Function):
    """Megatron-LM's bias + tanh-approximated GELU with a hand-written backward (Slapo 0.0.3, copied from
    Megatron-LM). ``BiasGeLUFunction.apply(inp, bias)``: ``inp`` ``(*, n)``, ``bias`` ``(n,)`` -> ``(*, n)``;
    the bias gradient has ``inp``'s shape (as in Slapo; autograd sums it to ``(n,)``)."""

    @staticmethod
    def bias_gelu(bias, y):
        x = bias + y
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def bias_gelu_back(g, bias, y):
        x = bias + y
        tanh_out = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        ff = 0.5 * x * ((1 - tanh_out * tanh_out) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (
            1 + tanh_out
        )
        return ff * g

    @staticmethod
    def forward(ctx, inp, bias):
        ctx.save_for_backward(inp, bias)
        return BiasGeLUFunction.bias_gelu(bias, inp)

    @staticmethod
    def backward(ctx, grad_output):
        inp, bias = ctx.saved_tensors
        tmp = BiasGeLUFunction.bias_gelu_back(grad_output, bias, inp)
        return tmp, tmp


class fused:  # used like a function
    """``fused(fn)``: ``fn`` compiled with ``torch.compile`` for CUDA inputs, eager otherwise.

    Compilation happens at the first CUDA call; if it fails (no Triton, an unsupported platform) the function
    stays eager from then on.
    """

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "fused")
        self._compiled = None
        self._failed = False

    def __call__(self, *args, **kwargs):
        first = args[0] if args else None
        if (
            self._failed
            or not isinstance(first, torch.Tensor)
            or first.device.type != "cuda"
            or torch.compiler.is_compiling()
        ):
            return self.fn(*args, **kwargs)
        if self._compiled is None:
            self._compiled = torch.compile(self.fn, dynamic=True)
        try:
            return self._compiled(*args, **kwargs)
        except Exception:  # noqa: BLE001 - compilation unavailable here: eager is exact, only slower
            self._failed = True
            return self.fn(*args, **kwargs)

    def __reduce__(self):
        return (fused, (self.fn,))
