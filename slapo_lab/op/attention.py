"""Slapo's attention ops (Slapo 0.0.3 ``slapo/op/attention.py``) on ``scaled_dot_product_attention``.

Slapo called flash-attention ("cuda", "triton") or xFormers ("cutlass", "auto") kernels. Here every
``attn_op_name`` runs ``torch.nn.functional.scaled_dot_product_attention`` and only picks which of PyTorch's
kernels may serve it: flash first for "cuda"/"triton" (falling back to memory-efficient or math where flash
cannot take the call, e.g. with an additive mask), memory-efficient for "cutlass", the math reference for
"native_flash_attn"/"native_xformers", PyTorch's own choice for "auto". Unlike Slapo's flash kernels, a mask
is never dropped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..errors import ScheduleError

_B = SDPBackend
ATTN_OP_NAMES = {
    "auto": None,
    "cuda": [_B.FLASH_ATTENTION, _B.EFFICIENT_ATTENTION, _B.MATH],
    "triton": [_B.FLASH_ATTENTION, _B.EFFICIENT_ATTENTION, _B.MATH],
    "cutlass": [_B.EFFICIENT_ATTENTION, _B.MATH],
    "native_flash_attn": [_B.MATH],
    "native_xformers": [_B.MATH],
}


def _check_name(attn_op_name) -> None:
    if attn_op_name not in ATTN_OP_NAMES:
        raise ScheduleError(
            f"Unknown attn_op_name {attn_op_name!r}; use one of {', '.join(map(repr, ATTN_OP_NAMES))}."
        )


class FlashAttentionOp(nn.Module):
    """Core attention on ``(B, S, H, D)`` tensors, HF-style additive mask (Slapo 0.0.3
    ``slapo/op/attention.py``).

    ``forward(query, key, value, attention_mask, p)``: ``query`` ``(B, Sq, H, D)``, ``key``/``value``
    ``(B, Sk, H, D)``; ``attention_mask`` None, ``(B, 1, 1, Sk)``, ``(B, 1, Sq, Sk)`` or ``(B, H, Sq, Sk)``
    (float: added to the scores; bool: True keeps); ``p``: dropout on the attention probabilities (training
    mode only). Returns ``(B, Sq, H, D)`` in ``query``'s dtype. ``apply_causal_mask`` masks keys after each
    query (aligned to the end when ``Sk > Sq``, as with a KV cache); ``scale`` defaults to ``1 / sqrt(D)``.

    Raises:
        ScheduleError: an unknown ``attn_op_name``.
    """

    def __init__(self, attn_op_name, apply_causal_mask, scale=None):
        super().__init__()
        _check_name(attn_op_name)
        self.attn_op_name = attn_op_name
        self.apply_causal_mask = apply_causal_mask
        self.scale = scale
        self.pkg = "torch"
        self.bias_layout = "bhqk"

    def forward(self, query_layer, key_layer, value_layer, attention_mask, p):
        q, k, v = (t.transpose(1, 2) for t in (query_layer, key_layer, value_layer))  # (B, H, S, D)
        mask, causal = attention_mask, bool(self.apply_causal_mask)
        sq, sk = q.shape[-2], k.shape[-2]
        if causal and (mask is not None or sq != sk):
            keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
            if mask is None:
                mask = keep
            elif mask.dtype == torch.bool:
                mask = mask & keep
            else:
                mask = mask.to(q.dtype).masked_fill(~keep, torch.finfo(q.dtype).min)
            causal = False
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(q.dtype)
        backends = ATTN_OP_NAMES[self.attn_op_name]
        dropout = float(p) if self.training else 0.0
        if backends is None:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=self.scale
            )
        else:
            with sdpa_kernel(backends):
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=self.scale
                )
        return out.transpose(1, 2).to(query_layer.dtype)


class FlashAttention(nn.Module):
    """A HuggingFace-style self-attention block: Q/K/V projections, core attention, optional output
    projection (Slapo 0.0.3 ``slapo/op/attention.py``, same constructor and parameter names).

    ``forward(hidden_states, attention_mask=None, layer_past=None, head_mask=None, encoder_hidden_states=None,
    encoder_attention_mask=None, use_cache=False, output_attentions=False)``: ``hidden_states``
    ``(B, S, hidden_size)``, ``attention_mask`` as :class:`FlashAttentionOp` takes it; returns
    ``(context (B, S, hidden_size), (key, value) if use_cache else None)`` with ``key``/``value``
    ``(B, S_total, H, D)``. Parameters: ``query``/``key``/``value`` (or ``qkv`` with ``fused_qkv``, per-head
    interleaved as Slapo lays it out) and ``out_proj`` with ``output_proj``. As in Slapo, the causal mask is on
    exactly when ``output_proj`` is (GPT blocks project inside the attention; BERT's ``BertSelfOutput`` does
    it outside).

    Raises:
        ScheduleError: ``hidden_size`` not divisible by ``num_attention_heads``, an unknown ``attn_op_name``;
            at call time, cross attention, a head mask or ``output_attentions`` (not supported, as in Slapo).
    """

    def __init__(
        self,
        hidden_size,
        num_attention_heads,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        attn_op_name="auto",
        bias=True,
        output_proj=True,
        fused_qkv=False,
    ):
        super().__init__()
        if hidden_size % num_attention_heads != 0:
            raise ScheduleError(
                f"The hidden size ({hidden_size}) is not a multiple of the number of attention heads "
                f"({num_attention_heads})."
            )
        _check_name(attn_op_name)
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.attention_head_size = hidden_size // num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.fused_qkv = fused_qkv
        if fused_qkv:
            self.qkv = nn.Linear(hidden_size, 3 * self.all_head_size, bias=bias)
        else:
            self.query = nn.Linear(hidden_size, self.all_head_size, bias=bias)
            self.key = nn.Linear(hidden_size, self.all_head_size, bias=bias)
            self.value = nn.Linear(hidden_size, self.all_head_size, bias=bias)
        self.output_proj = output_proj
        self.attn_pdrop = attn_pdrop
        if self.output_proj:
            self.out_proj = nn.Linear(hidden_size, hidden_size, bias=bias)
            self.resid_dropout = nn.Dropout(resid_pdrop)
        self.attn_op_name = attn_op_name
        self.attn_op = FlashAttentionOp(attn_op_name, self.output_proj)
        self.bias_layout = self.attn_op.bias_layout

    @staticmethod
    def layout_attention_mask(mask, num_attention_heads):
        """``(B, 1, 1, S)`` -> ``(B, H, S, S)`` (Slapo's layout for its kernels; SDPA broadcasts instead)."""
        return mask.expand(-1, num_attention_heads, mask.shape[-1], -1).contiguous()

    def reshape_for_scores(self, x: torch.Tensor):
        """``(B, S, H * D)`` -> ``(B, S, H, D)`` (``H`` inferred, so a sharded projection works)."""
        return x.view(x.size()[:-1] + (-1, self.attention_head_size))

    def forward(
        self,
        hidden_states: torch.Tensor | None,
        attention_mask: torch.Tensor | None = None,
        layer_past: tuple[torch.Tensor, torch.Tensor] | None = None,
        head_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        use_cache: bool | None = False,
        output_attentions: bool | None = False,
    ) -> tuple[torch.Tensor]:
        if encoder_hidden_states is not None or encoder_attention_mask is not None:
            raise ScheduleError("FlashAttention does not support cross attention.")
        if output_attentions:
            raise ScheduleError("FlashAttention does not return attention weights (output_attentions=True).")
        if head_mask is not None:
            raise ScheduleError("FlashAttention does not support a head mask.")
        if self.fused_qkv:
            layers = self.qkv(hidden_states)
            layers = layers.view(layers.size()[:-1] + (-1, 3 * self.attention_head_size))
            query_layer, key_layer, value_layer = layers.split(self.attention_head_size, dim=-1)
        else:
            query_layer = self.reshape_for_scores(self.query(hidden_states))
            key_layer = self.reshape_for_scores(self.key(hidden_states))
            value_layer = self.reshape_for_scores(self.value(hidden_states))
        if layer_past is not None:
            past_key, past_value = layer_past
            key_layer = torch.cat((past_key, key_layer), dim=1)
            value_layer = torch.cat((past_value, value_layer), dim=1)
        context = self.attn_op(
            query_layer.contiguous(),
            key_layer.contiguous(),
            value_layer.contiguous(),
            attention_mask,
            p=self.attn_pdrop,
        )
        context = context.contiguous()
        context = context.view(context.size()[:-2] + (-1,))
        if self.output_proj:
            context = self.resid_dropout(self.out_proj(context))
        return (context, (key_layer, value_layer) if use_cache else None)
