"""Small models, batches and losses shared by the pipeline tests (tests/test_pipeline.py, pp_train.py).

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

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, HIDDEN, CLASSES = 128, 8, 64, 5


class BertClassifier(nn.Module):
    """``BertModel`` + ``Linear(hidden, CLASSES)`` on the first token: ``forward(input_ids) -> (B, CLASSES)``."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        from transformers import BertConfig, BertModel

        cfg = BertConfig(num_hidden_layers=layers, hidden_size=HIDDEN, num_attention_heads=4, intermediate_size=128,
                         vocab_size=VOCAB, max_position_embeddings=32, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0)
        self.bert = BertModel(cfg, add_pooling_layer=False)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, input_ids):
        return self.head(self.bert(input_ids=input_ids).last_hidden_state[:, 0])


def gpt2(layers: int = 4):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=layers, n_embd=HIDDEN, n_head=4, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, use_cache=False)
    return GPT2LMHeadModel(cfg)


def t5():
    """HF ``T5ForConditionalGeneration`` (4 + 4 blocks); ``shared`` / both ``embed_tokens`` / ``lm_head`` tied."""
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=4, num_decoder_layers=4, num_heads=4,
                   dropout_rate=0.0, use_cache=False, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
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
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(1, VOCAB, (batch_size, SEQ), generator=g)
    if name == "t5":
        dec = torch.randint(1, VOCAB, (batch_size, SEQ), generator=g)
        return {"input_ids": ids, "decoder_input_ids": dec}, torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    if name == "bert":
        y = torch.randint(0, CLASSES, (batch_size,), generator=g)
    elif name == "gpt2":
        y = ids.clone()
    else:
        y = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    return ids, y


def forward_output(name: str, model: nn.Module, inputs):
    """What the pipeline's last stage returns for this model (its default ``output_fn``)."""
    if name == "t5":
        return model(**inputs).logits
    out = model(inputs) if name != "gpt2" else model(input_ids=inputs)
    return out.logits if name == "gpt2" else out


def take(inputs, lo: int, n: int):
    """Rows ``lo .. lo + n`` of a batch of inputs (tensor or dict of tensors)."""
    if isinstance(inputs, dict):
        return {k: v[lo:lo + n] for k, v in inputs.items()}
    return inputs[lo:lo + n]
