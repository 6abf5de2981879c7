"""Full-size configs for the tests that plan, draw or check a real-scale model on the meta device.

No weights are ever allocated: build the model under ``torch.device("meta")`` (:func:`on_meta`). The sizes are the
published ones (Llama 2 70B: Touvron et al. 2023, "Llama 2", Table 1; Llama 3 70B: its ``config.json`` on the Hugging
Face hub): 80 layers, hidden 8192, 64 query heads, 8 key/value heads, MLP 28672.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

LLAMA_70B = {
    "num_hidden_layers": 80,
    "hidden_size": 8192,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "intermediate_size": 28672,
}


def llama2_70b_config(**overrides) -> LlamaConfig:
    """Llama 2 70B: :data:`LLAMA_70B`, vocabulary 32000, 4096 positions; ``overrides`` replace any field."""
    return LlamaConfig(**{**LLAMA_70B, "vocab_size": 32000, "max_position_embeddings": 4096, **overrides})


def llama3_70b_config(**overrides) -> LlamaConfig:
    """Llama 3 70B's shape: :data:`LLAMA_70B`, vocabulary 128256 (positions: LlamaConfig's default)."""
    return LlamaConfig(**{**LLAMA_70B, "vocab_size": 128256, **overrides})


def on_meta(config: LlamaConfig) -> LlamaForCausalLM:
    """``LlamaForCausalLM(config)`` with every parameter and buffer on the meta device."""
    with torch.device("meta"):
        return LlamaForCausalLM(config)
