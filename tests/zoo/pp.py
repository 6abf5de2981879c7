"""The tiny models of the pipeline tests (``tests/multirank/pp_models.py``, ``pp_train.py``,
``tests/unit/pipeline/test_pipeline.py``, ``tests/families/test_families_pp.py``).

Random weights (seed before building), dropout 0, fp32, vocab 128, hidden 64 unless said:

* :class:`BertClassifier`: HF ``BertModel`` (2-4 layers) + a linear classification head on the first token;
* :func:`gpt2`: HF ``GPT2LMHeadModel`` with its tied ``lm_head`` / ``transformer.wte``;
* :class:`SkipNet`: a custom MLP stack whose head adds the *embedding output* (a skip connection that crosses
  every stage between the first and the last);
* :func:`t5`: HF ``T5ForConditionalGeneration`` (hidden 32, 4 + 4 blocks; ``shared`` is tied to both
  ``embed_tokens`` and the ``lm_head``);
* :class:`NestedNet`: a T5-like encoder/decoder of custom blocks, each stack with a final norm, the decoder
  reading the encoder output in every block (Slapo's nested-cut example, seed 002);
* one builder per family of the pipeline family runs (2 blocks, 4 heads, no KV cache): :func:`bert_mlm`,
  :func:`roberta`, :func:`albert` (one layer group per layer, so each block can end a stage), :func:`opt`,
  :func:`gpt_neo`, :func:`t5_family`, :func:`vit` (a 32 x 32 image in 8 x 8 patches), :func:`llama` and
  :func:`mistral` (on :data:`zoo.matrix.DECODER`); Qwen3 and Mixtral are :mod:`zoo.matrix`'s.
"""

from __future__ import annotations

import torch
from torch import nn

from zoo.matrix import DECODER

VOCAB, SEQ, HIDDEN, CLASSES = 128, 8, 64, 5


class BertClassifier(nn.Module):
    """``BertModel`` + ``Linear(hidden, CLASSES)`` on the first token: ``forward(input_ids) -> (B, CLASSES)``."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        from transformers import BertConfig, BertModel

        cfg = BertConfig(
            num_hidden_layers=layers,
            hidden_size=HIDDEN,
            num_attention_heads=4,
            intermediate_size=128,
            vocab_size=VOCAB,
            max_position_embeddings=32,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        self.bert = BertModel(cfg, add_pooling_layer=False)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, input_ids):
        return self.head(self.bert(input_ids=input_ids).last_hidden_state[:, 0])


def gpt2(layers: int = 4):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=layers,
        n_embd=HIDDEN,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    return GPT2LMHeadModel(cfg)


def t5():
    """HF ``T5ForConditionalGeneration`` (4 + 4 blocks); ``shared`` / both ``embed_tokens`` / ``lm_head`` tied."""
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=4,
        num_decoder_layers=4,
        num_heads=4,
        dropout_rate=0.0,
        use_cache=False,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return T5ForConditionalGeneration(cfg)


class Block(nn.Module):
    def __init__(self, d: int = HIDDEN, cross: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.cross = nn.Linear(d, d) if cross else None

    def forward(self, x, mem=None):
        h = torch.tanh(self.fc(x))
        if self.cross is not None:
            h = h + self.cross(mem)
        return x + h


class SkipNet(nn.Module):
    """``emb -> blocks.0..3 -> head(h + e)``: the embedding output ``e`` skips to the head."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(n))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids):
        e = self.emb(input_ids)
        h = e
        for b in self.blocks:
            h = b(h)
        return self.head(h + e)


class Stack(nn.Module):
    def __init__(self, n: int, cross: bool) -> None:
        super().__init__()
        self.block = nn.ModuleList(Block(cross=cross) for _ in range(n))
        self.final_norm = nn.LayerNorm(HIDDEN)

    def forward(self, x, mem=None):
        for b in self.block:
            x = b(x, mem)
        return self.final_norm(x)


class NestedNet(nn.Module):
    """T5-like: ``encoder`` and ``decoder`` stacks (4 blocks + final norm each); decoder blocks read the encoder output."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.encoder = Stack(n, cross=False)
        self.decoder = Stack(n, cross=True)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids):
        e = self.emb(input_ids)
        mem = self.encoder(e)
        return self.head(self.decoder(e, mem))


_DROP = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def bert_mlm():
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(
        BertConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=64,
            **_DROP,
        )
    )


def roberta():
    from transformers import RobertaConfig, RobertaForMaskedLM

    return RobertaForMaskedLM(
        RobertaConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=64,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            **_DROP,
        )
    )


def albert():
    # one layer group per layer (num_hidden_groups = layers): each block runs once, so it can end a stage
    from transformers import AlbertConfig, AlbertForMaskedLM

    return AlbertForMaskedLM(
        AlbertConfig(
            vocab_size=VOCAB,
            embedding_size=32,
            hidden_size=HIDDEN,
            num_hidden_layers=2,
            num_hidden_groups=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=64,
            classifier_dropout_prob=0.0,
            **_DROP,
        )
    )


def opt():
    from transformers import OPTConfig, OPTForCausalLM

    return OPTForCausalLM(
        OPTConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            num_hidden_layers=2,
            num_attention_heads=4,
            ffn_dim=128,
            max_position_embeddings=64,
            word_embed_proj_dim=HIDDEN,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            layerdrop=0.0,
            use_cache=False,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=0,
        )
    )


def gpt_neo():
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    return GPTNeoForCausalLM(
        GPTNeoConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            num_layers=2,
            num_heads=4,
            intermediate_size=128,
            attention_types=[[["global", "local"], 1]],
            window_size=8,
            max_position_embeddings=64,
            embed_dropout=0.0,
            attention_dropout=0.0,
            resid_dropout=0.0,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
        )
    )


def t5_family():
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(
        T5Config(
            vocab_size=VOCAB,
            d_model=HIDDEN,
            d_kv=16,
            d_ff=128,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            dropout_rate=0.0,
            use_cache=False,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        )
    )


def vit():
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(
        ViTConfig(
            hidden_size=HIDDEN,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            image_size=32,
            patch_size=8,
            num_channels=3,
            num_labels=CLASSES,
            **_DROP,
        )
    )


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(num_key_value_heads=2, **DECODER))


def mistral():
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(num_key_value_heads=2, sliding_window=8, **DECODER))
