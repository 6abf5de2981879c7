"""Slapo's custom ops (``slapo.op``) rebuilt on today's PyTorch kernels.

Source: Slapo 0.0.3 ``slapo/op/`` (``attention.py``, ``linear.py``, ``mlp.py``, ``fused_bias.py``,
``cross_entropy.py``, ``utils.py``): the same class names and constructor signatures, so Slapo's model
schedules can replace HuggingFace modules with them. Attention runs on
``torch.nn.functional.scaled_dot_product_attention`` (flash / memory-efficient / math kernels chosen by
PyTorch) instead of the flash-attention and xFormers packages; bias + activation and bias + dropout are
``torch.compile``-fused on CUDA and plain eager elsewhere, instead of TorchScript / ``memory_efficient_fusion``.
"""

from ..primitives.replace import LinearWithSeparateBias
from .attention import ATTN_OP_NAMES, FlashAttention, FlashAttentionOp
from .cross_entropy import ParallelCrossEntropy, vocab_parallel_cross_entropy
from .fused_bias import BiasGeLUFunction, bias_dropout, bias_new_gelu, new_gelu
from .linear import FusedQKV, LinearWithAct, LinearWithDropout, LinearWithSyncFunc
from .mlp import FusedMLP
from .utils import Print

__all__ = [
    "ATTN_OP_NAMES",
    "BiasGeLUFunction",
    "FlashAttention",
    "FlashAttentionOp",
    "FusedMLP",
    "FusedQKV",
    "LinearWithAct",
    "LinearWithDropout",
    "LinearWithSeparateBias",
    "LinearWithSyncFunc",
    "ParallelCrossEntropy",
    "Print",
    "bias_dropout",
    "bias_new_gelu",
    "new_gelu",
    "vocab_parallel_cross_entropy",
]
