"""Small models, batches and losses shared by the pipeline tests (tests/unit/pipeline/test_pipeline.py, pp_train.py).

* ``bert``: HF ``BertModel`` (2-4 layers, hidden 64) + a linear classification head on the first token;
* ``gpt2``: HF ``GPT2LMHeadModel`` with its tied ``lm_head`` / ``transformer.wte`` (causal-LM loss);
* ``skip``: a custom MLP stack whose head adds the *embedding output* (a skip connection that crosses
  every stage between the first and the last);
* ``t5``: HF ``T5ForConditionalGeneration`` (the real nested case, seed 002's example scaled to 4 + 4
  blocks; ``shared`` is tied to both ``embed_tokens`` and the ``lm_head``);
* ``nested``: a T5-like encoder/decoder of custom blocks, each stack with a final norm, the decoder
  reading the encoder output in every block (Slapo's nested-cut example, seed 002).

All with random weights (seeded), dropout 0, fp32.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # tests/: the builders shared with tp_train.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from zoo.matrix import DECODER, mixtral_model, qwen3_model

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


def make(name: str) -> nn.Module:
    """A fresh model by name (seed it first)."""
    if name == "bert":
        return BertClassifier()
    if name == "gpt2":
        return gpt2()
    if name == "skip":
        return SkipNet()
    if name == "nested":
        return NestedNet()
    if name == "t5":
        return t5()
    if name in FAMILIES:
        return FAMILIES[name][0]()
    raise KeyError(name)


def lm_loss(logits, labels):
    """Next-token cross entropy (mean over every position but the last)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def token_loss(logits, labels):
    """Per-token cross entropy (mean)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def cls_loss(logits, labels):
    """Classification cross entropy (mean)."""
    return F.cross_entropy(logits, labels)


LOSS = {"bert": cls_loss, "gpt2": lm_loss, "skip": token_loss, "nested": token_loss, "t5": token_loss}


def batch(name: str, step: int, batch_size: int):
    """``(inputs, target)`` of step ``step`` (same on every rank); ``inputs`` is a tensor of ids, or for T5
    a dict ``{"input_ids", "decoder_input_ids"}``."""
    if name in FAMILIES:
        return family_batch(name, step, batch_size)
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(1, VOCAB, (batch_size, SEQ), generator=g)
    if name == "t5":
        dec = torch.randint(1, VOCAB, (batch_size, SEQ), generator=g)
        return {"input_ids": ids, "decoder_input_ids": dec}, torch.randint(
            0, VOCAB, (batch_size, SEQ), generator=g
        )
    if name == "bert":
        y = torch.randint(0, CLASSES, (batch_size,), generator=g)
    elif name == "gpt2":
        y = ids.clone()
    else:
        y = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    return ids, y


def forward_output(name: str, model: nn.Module, inputs):
    """What the pipeline's last stage returns for this model (its default ``output_fn``)."""
    if name == "t5" or name in FAMILIES:
        return model(**inputs).logits
    out = model(inputs) if name != "gpt2" else model(input_ids=inputs)
    return out.logits if name == "gpt2" else out


def take(inputs, lo: int, n: int):
    """Rows ``lo .. lo + n`` of a batch of inputs (tensor or dict of tensors)."""
    if isinstance(inputs, dict):
        return {k: v[lo : lo + n] for k, v in inputs.items()}
    return inputs[lo : lo + n]


# ------------------------------------------------------------------ twelve HF families (issue 10)
# Tiny random configs (2 blocks, hidden 64, 4 heads, vocab 128, no dropout, no KV cache); the cut is
# after the first block, so each family runs as 2 stages. ``FAMILY_SEQ`` tokens per sample (ViT:
# a 32 x 32 image in 8 x 8 patches, i.e. 16 patches + CLS). The decoders' config, and the Qwen3 and
# Mixtral builders, are tests/zoo/matrix.py's (tp_train.py builds the same models).
FAMILY_SEQ = 16
_DROP = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def _bert_mlm():
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


def _roberta():
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


def _albert():
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


def _opt():
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


def _gpt_neo():
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


def _t5_fam():
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


def _vit():
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


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(num_key_value_heads=2, **DECODER))


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(num_key_value_heads=2, sliding_window=8, **DECODER))


# family: (builder, the cut, "kind": causal_lm | mlm | seq2seq | image)
FAMILIES = {
    "fam_bert": (_bert_mlm, "bert.encoder.layer.0", "mlm"),
    "fam_roberta": (_roberta, "roberta.encoder.layer.0", "mlm"),
    "fam_albert": (_albert, "albert.encoder.albert_layer_groups.0", "mlm"),
    "fam_opt": (_opt, "model.decoder.layers.0", "causal_lm"),
    "fam_gpt_neo": (_gpt_neo, "transformer.h.0", "causal_lm"),
    "fam_gpt2": (lambda: gpt2(2), "transformer.h.0", "causal_lm"),
    "fam_t5_enc": (_t5_fam, "encoder.block.0", "seq2seq"),
    "fam_t5_dec": (_t5_fam, "decoder.block.0", "seq2seq"),
    "fam_vit": (_vit, "vit.layers.0", "image"),
    "fam_llama": (_llama, "model.layers.0", "causal_lm"),
    "fam_mistral": (_mistral, "model.layers.0", "causal_lm"),
    "fam_qwen3": (qwen3_model, "model.layers.0", "causal_lm"),
    "fam_mixtral": (mixtral_model, "model.layers.0", "causal_lm"),
}
_FAM_LOSS = {"causal_lm": lm_loss, "mlm": token_loss, "seq2seq": token_loss, "image": cls_loss}


def family_batch(name: str, step: int, batch_size: int):
    """``(inputs dict, target)`` of step ``step`` for a family (same on every rank)."""
    kind = FAMILIES[name][2]
    g = torch.Generator().manual_seed(2000 + step)
    if kind == "image":
        return (
            {"pixel_values": torch.randn(batch_size, 3, 32, 32, generator=g)},
            torch.randint(0, CLASSES, (batch_size,), generator=g),
        )
    ids = torch.randint(3, VOCAB, (batch_size, FAMILY_SEQ), generator=g)
    if kind == "seq2seq":
        dec = torch.randint(3, VOCAB, (batch_size, FAMILY_SEQ), generator=g)
        return {"input_ids": ids, "decoder_input_ids": dec}, torch.randint(
            0, VOCAB, (batch_size, FAMILY_SEQ), generator=g
        )
    if kind == "mlm":
        return {"input_ids": ids}, torch.randint(0, VOCAB, (batch_size, FAMILY_SEQ), generator=g)
    return {"input_ids": ids}, ids.clone()


LOSS.update({name: _FAM_LOSS[kind] for name, (_, _, kind) in FAMILIES.items()})
