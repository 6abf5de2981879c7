"""Tiny random-weight models of every common HF family, for the family matrix tests.

Each entry builds a real transformers model from a small config (2 blocks, hidden 64, 4 heads, 2 KV heads
where the family has grouped-query attention) and its example inputs, so that a test can open the editor,
apply presets, cut a pipeline stage, export and launch, on the same classes a user schedules.
"""

from __future__ import annotations

import dataclasses

import torch

VOCAB = 128
BATCH, SEQ = 4, 16


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    config_cls: str  # transformers class names, resolved lazily
    model_cls: str
    config: dict
    inputs: str = "ids"  # "ids" | "seq2seq" | "pixels"
    cut: str | None = None  # where one pipeline cut goes; None: after the middle block

    def build(self, seed: int = 0):
        import transformers

        torch.manual_seed(seed)
        cfg = getattr(transformers, self.config_cls)(**self.config)
        return getattr(transformers, self.model_cls)(cfg).eval()

    def example_inputs(self, batch: int = BATCH, seq: int = SEQ, seed: int = 0) -> dict:
        g = torch.Generator().manual_seed(seed)
        if self.inputs == "pixels":
            return {"pixel_values": torch.randn(batch, 3, 32, 32, generator=g)}
        ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
        if self.inputs == "seq2seq":
            return {
                "input_ids": ids,
                "decoder_input_ids": torch.randint(0, VOCAB, (batch, seq // 2), generator=g),
            }
        return {"input_ids": ids}


_BERTLIKE = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64,
}
_ROPE = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64,
}

FAMILIES = {
    f.name: f
    for f in (
        Family("bert", "BertConfig", "BertForMaskedLM", _BERTLIKE),
        Family("roberta", "RobertaConfig", "RobertaForMaskedLM", _BERTLIKE),
        # ALBERT runs its one shared layer num_hidden_layers times: the only cut between blocks is after the embeddings.
        Family(
            "albert",
            "AlbertConfig",
            "AlbertForMaskedLM",
            {**_BERTLIKE, "embedding_size": 32},
            cut="albert.embeddings",
        ),
        Family(
            "gpt2",
            "GPT2Config",
            "GPT2LMHeadModel",
            {
                "n_layer": 2,
                "n_embd": 64,
                "n_head": 4,
                "vocab_size": VOCAB,
                "n_positions": 64,
                "bos_token_id": 0,
                "eos_token_id": 0,
            },
        ),
        Family(
            "opt",
            "OPTConfig",
            "OPTForCausalLM",
            {
                "num_hidden_layers": 2,
                "hidden_size": 64,
                "num_attention_heads": 4,
                "ffn_dim": 128,
                "vocab_size": VOCAB,
                "max_position_embeddings": 64,
                "word_embed_proj_dim": 64,
            },
        ),
        Family(
            "gpt_neo",
            "GPTNeoConfig",
            "GPTNeoForCausalLM",
            {
                "num_layers": 2,
                "hidden_size": 64,
                "num_heads": 4,
                "vocab_size": VOCAB,
                "max_position_embeddings": 64,
                "attention_types": [[["global", "local"], 1]],
                "window_size": 8,
                "bos_token_id": 0,
                "eos_token_id": 0,
            },
        ),
        Family(
            "t5",
            "T5Config",
            "T5ForConditionalGeneration",
            {
                "num_layers": 2,
                "num_decoder_layers": 2,
                "d_model": 64,
                "d_kv": 16,
                "num_heads": 4,
                "d_ff": 128,
                "vocab_size": VOCAB,
            },
            inputs="seq2seq",
        ),
        Family(
            "vit",
            "ViTConfig",
            "ViTForImageClassification",
            {
                "num_hidden_layers": 2,
                "hidden_size": 64,
                "num_attention_heads": 4,
                "intermediate_size": 128,
                "image_size": 32,
                "patch_size": 8,
                "num_labels": 10,
            },
            inputs="pixels",
        ),
        Family("llama", "LlamaConfig", "LlamaForCausalLM", _ROPE),
        Family("mistral", "MistralConfig", "MistralForCausalLM", _ROPE),
        Family("qwen3", "Qwen3Config", "Qwen3ForCausalLM", {**_ROPE, "head_dim": 16}),
        Family(
            "mixtral",
            "MixtralConfig",
            "MixtralForCausalLM",
            {**_ROPE, "num_local_experts": 4, "num_experts_per_tok": 2},
        ),
    )
}

_BART = Family(
    "bart",
    "BartConfig",
    "BartForConditionalGeneration",
    {
        "encoder_layers": 2,
        "decoder_layers": 2,
        "d_model": 64,
        "encoder_attention_heads": 4,
        "decoder_attention_heads": 4,
        "encoder_ffn_dim": 128,
        "decoder_ffn_dim": 128,
        "vocab_size": 128,
        "max_position_embeddings": 64,
        "dropout": 0.1,
        "attention_dropout": 0.1,
        "activation_dropout": 0.1,
    },
    inputs="seq2seq",
)
_QWEN3_MOE = Family(
    "qwen3_moe",
    "Qwen3MoeConfig",
    "Qwen3MoeForCausalLM",
    {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "moe_intermediate_size": 64,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "vocab_size": 128,
        "max_position_embeddings": 64,
    },
)

#: Families beside :data:`FAMILIES` (which the family-matrix tests iterate): an encoder-decoder with dropout on
#: (BART) and a mixture of experts with a router and per-head q/k norms (Qwen3-MoE), for the numeric check's
#: seeded bugs (``tests/unit/numeric/test_numeric_seeded_bugs.py``).
MORE = {f.name: f for f in (_BART, _QWEN3_MOE)}
