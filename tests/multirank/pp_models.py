"""Batches, losses and the family table shared by the pipeline tests (tests/unit/pipeline/test_pipeline.py,
pp_train.py, tests/families/test_families_pp.py); the models are the zoo's (tests/zoo/pp.py).

By name (:func:`make`): ``bert`` (a BERT classifier), ``gpt2`` (tied ``lm_head``, causal-LM loss), ``skip`` (an
embedding output that skips every middle stage), ``t5`` (the real nested case, seed 002's example scaled to 4 + 4
blocks), ``nested`` (Slapo's nested-cut example, seed 002), and the ``fam_*`` families of :data:`FAMILIES`.
All with random weights (seeded), dropout 0, fp32.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # tests/: the model zoo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from zoo.matrix import mixtral_model, qwen3_model
from zoo.pp import (  # the models; VOCAB .. CLASSES are read from here too (M.HIDDEN, M.SEQ)
    CLASSES,
    SEQ,
    VOCAB,
    BertClassifier,
    NestedNet,
    SkipNet,
    albert,
    bert_mlm,
    gpt2,
    gpt_neo,
    llama,
    mistral,
    opt,
    roberta,
    t5,
    t5_family,
    vit,
)


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
# a 32 x 32 image in 8 x 8 patches, i.e. 16 patches + CLS). The builders are tests/zoo/pp.py's (Qwen3 and
# Mixtral: tests/zoo/matrix.py's, which tp_train.py builds too).
FAMILY_SEQ = 16


# family: (builder, the cut, "kind": causal_lm | mlm | seq2seq | image)
FAMILIES = {
    "fam_bert": (bert_mlm, "bert.encoder.layer.0", "mlm"),
    "fam_roberta": (roberta, "roberta.encoder.layer.0", "mlm"),
    "fam_albert": (albert, "albert.encoder.albert_layer_groups.0", "mlm"),
    "fam_opt": (opt, "model.decoder.layers.0", "causal_lm"),
    "fam_gpt_neo": (gpt_neo, "transformer.h.0", "causal_lm"),
    "fam_gpt2": (lambda: gpt2(2), "transformer.h.0", "causal_lm"),
    "fam_t5_enc": (t5_family, "encoder.block.0", "seq2seq"),
    "fam_t5_dec": (t5_family, "decoder.block.0", "seq2seq"),
    "fam_vit": (vit, "vit.layers.0", "image"),
    "fam_llama": (llama, "model.layers.0", "causal_lm"),
    "fam_mistral": (mistral, "model.layers.0", "causal_lm"),
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
