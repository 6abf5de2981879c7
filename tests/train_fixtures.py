"""Plain helpers that write small, real training inputs offline: a text corpus, a BPE tokenizer trained on
it, a tiny Hugging Face model directory. No hub downloads; everything is seeded and deterministic.

Import them from tests (``from train_fixtures import write_corpus, write_tokenizer, write_pretrained``);
they are functions, not pytest fixtures, so that module-scoped fixtures and subprocess tests can share them.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from pathlib import Path

# A fixed vocabulary of English-like words: the corpus is reproducible from (n_docs, seed) alone.
_WORD_TEXT = (
    "the a an one this that some every model layer data token train step batch loss rate small large "
    "fast slow new old good clear simple deep wide long short quiet bright green red blue river stone "
    "cloud garden window market letter engine signal number pattern question answer reason story "
    "runs reads writes learns finds keeps moves holds turns shows builds opens closes grows falls "
    "and but or so because while when after before under over near into from with without about"
)
WORDS = tuple(_WORD_TEXT.split())

CORPUS_KINDS = ("jsonl", "txt", "parquet")
SPECIAL_TOKENS = ("<unk>", "<pad>", "<eos>", "[MASK]", "[CLS]", "[SEP]")


def corpus_documents(n_docs: int = 400, seed: int = 0) -> list[str]:
    """``n_docs`` documents of 1 to 6 sentences (3 to 14 words each), drawn from :data:`WORDS` by a
    ``random.Random(seed)``; no newlines inside a document."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        sentences = []
        for _ in range(rng.randint(1, 6)):
            words = [rng.choice(WORDS) for _ in range(rng.randint(3, 14))]
            sentences.append(" ".join(words).capitalize() + rng.choice(".!?"))
        docs.append(" ".join(sentences))
    return docs


def write_corpus(folder, n_docs: int = 400, seed: int = 0, kind: str = "jsonl", name: str = "corpus") -> Path:
    """Write :func:`corpus_documents` ``(n_docs, seed)`` as ``folder/<name>.<kind>`` and return its path.

    ``kind``: ``"jsonl"`` (one ``{"text": doc, "id": i}`` object per line), ``"txt"`` (one document per
    line) or ``"parquet"`` (a ``text`` column and an ``id`` column).

    Raises:
        ValueError: for another ``kind``.
    """
    if kind not in CORPUS_KINDS:
        raise ValueError(f"kind must be one of {CORPUS_KINDS}, not {kind!r}.")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    docs = corpus_documents(n_docs, seed)
    path = folder / f"{name}.{kind}"
    if kind == "jsonl":
        path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    elif kind == "txt":
        path.write_text("".join(d + "\n" for d in docs))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": docs, "id": list(range(len(docs)))}), path)
    return path


def read_texts(files: Iterable) -> Iterator[str]:
    """The documents of corpus files written by :func:`write_corpus` (any kind), in order."""
    for f in map(Path, files):
        if f.suffix == ".jsonl":
            for line in f.read_text().splitlines():
                if line.strip():
                    yield json.loads(line)["text"]
        elif f.suffix == ".parquet":
            import pyarrow.parquet as pq

            yield from pq.read_table(f, columns=["text"]).column("text").to_pylist()
        else:
            yield from (line for line in f.read_text().splitlines() if line.strip())


def write_tokenizer(
    folder, corpus_files, vocab_size: int = 256, *, eos: bool = True, sep: bool = True, mask: bool = True
) -> Path:
    """Train a small BPE tokenizer on ``corpus_files`` with the ``tokenizers`` library (offline) and write it
    with ``PreTrainedTokenizerFast.save_pretrained(folder)``; return ``folder``.

    The vocabulary holds the special tokens ``<unk>`` (0), ``<pad>`` (1), ``<eos>`` (2), ``[MASK]`` (3),
    ``[CLS]`` (4), ``[SEP]`` (5), then the corpus' characters and merges up to ``vocab_size`` entries in all
    (Metaspace pre-tokenisation, so words keep their leading space). The wrapper names unk / pad / cls and,
    unless switched off, ``eos_token="<eos>"``, ``sep_token="[SEP]"``, ``mask_token="[MASK]"`` (switch them
    off to test tokenizers that lack one).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False
    )
    tok.train_from_iterator(read_texts(corpus_files), trainer=trainer)
    named = {"unk_token": "<unk>", "pad_token": "<pad>", "cls_token": "[CLS]"}
    if eos:
        named["eos_token"] = "<eos>"
    if sep:
        named["sep_token"] = "[SEP]"
    if mask:
        named["mask_token"] = "[MASK]"
    PreTrainedTokenizerFast(tokenizer_object=tok, **named).save_pretrained(folder)
    return folder


# Tiny configurations by config ``model_type``; other families get the generic names below.
_DECODER = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 128, "max_position_embeddings": 512}  # fmt: skip
_ENCODER = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
            "max_position_embeddings": 512}  # fmt: skip
_TINY = {
    "llama": _DECODER,
    "mistral": _DECODER,
    "qwen3": {**_DECODER, "head_dim": 16},
    "gpt2": {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 512},
    "bert": _ENCODER,
    "roberta": {**_ENCODER, "max_position_embeddings": 514},
}
_GENERIC = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128}
# The special token ids of :func:`write_tokenizer` (``<pad>`` 1, ``<eos>`` 2).
_TOKEN_IDS = {"pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 2}


def write_pretrained(
    folder, model_cls: str = "LlamaForCausalLM", vocab_size: int = 256, seed: int = 0, **config
) -> Path:
    """Build a tiny real ``transformers.<model_cls>`` from its config (seeded weights) and write it with
    ``save_pretrained(folder)`` (``config.json`` + ``model.safetensors``); return ``folder``.

    Llama: 2 layers, hidden 64, 4 heads, 2 kv heads, intermediate 128; GPT-2, BERT, RoBERTa, Mistral,
    Qwen3 alike; pad / bos / eos ids are :func:`write_tokenizer`'s (1, 2, 2); ``**config`` overrides or adds
    config fields (e.g. ``tie_word_embeddings=True``).
    """
    import torch
    import transformers

    cls = getattr(transformers, model_cls)
    config_cls = cls.config_class
    fields = dict(_TINY.get(config_cls.model_type, _GENERIC), vocab_size=vocab_size, **_TOKEN_IDS)
    fields.update(config)
    torch.manual_seed(seed)
    model = cls(config_cls(**fields))
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    return folder


def meta_model(model_cls: str, config):
    """``transformers.<model_cls>(config)`` on the meta device, to record a schedule on, as the editor does
    (``init_empty_weights`` keeps tied weights tied; ``model.to("meta")`` would untie them)."""
    import transformers

    import slapo_lab as sl

    with sl.init_empty_weights():
        return getattr(transformers, model_cls)(config)
