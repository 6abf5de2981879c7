"""Vocabulary-parallel embeddings (Megatron-LM's ``VocabParallelEmbedding``, Shoeybi et al. 2019): the input
embedding sharded on the vocabulary with a forward all-reduce, the output embedding (``lm_head``, tied or not)
column parallel with a vocabulary-partitioned output gathered for the loss. Read through Hugging Face's
``get_input_embeddings()`` / ``get_output_embeddings()``; :func:`has_vocab_embedding` and :func:`vocab_size`
say whether a model has such an embedding and how large its vocabulary is.
"""

from __future__ import annotations

from torch import nn

from ..errors import ScheduleError
from ..record import Call
from .parallel import _all_or_nothing, _ensure_shard, _ensure_sync, _since


def _path_of(sch, mod: nn.Module) -> str | None:
    for p, node in sch.named_schedules():
        if node.mod is mod:
            return p
    return None


def _input_embedding(sch) -> nn.Embedding | None:
    """The model's ``get_input_embeddings()`` when it is an ``nn.Embedding``, else None (no such method, a
    patch ``Conv2d``, or transformers' ``NotImplementedError`` for a model with several towers: CLIP)."""
    get_in = getattr(sch.mod, "get_input_embeddings", None)
    try:
        emb = get_in() if callable(get_in) else None
    except NotImplementedError:
        emb = None
    return emb if isinstance(emb, nn.Embedding) else None


def vocab_size(sch) -> int | None:
    """Rows of the model's input ``nn.Embedding`` (``get_input_embeddings()``), or None without one."""
    emb = _input_embedding(sch)
    return None if emb is None else emb.num_embeddings


def has_vocab_embedding(sch) -> bool:
    """Whether the model's ``get_input_embeddings()`` is an ``nn.Embedding`` (a vocabulary to shard).

    False for vision models (ViT's input embedding is a patch ``Conv2d``) and models without the HF method;
    the editor's Megatron button passes this as ``megatron_tp(vocab_parallel=...)``.
    """
    return vocab_size(sch) is not None


@_all_or_nothing
def vocab_parallel_embeddings(sch) -> list[Call]:
    """Vocab-parallel input embedding and, if the model has one, a vocab-parallel output embedding.

    Uses HF's ``get_input_embeddings()`` / ``get_output_embeddings()``. The output layer (``lm_head``) is
    tied to the embedding in GPT-2 and BERT-MLM, so sharding the embedding already shards it (the
    tensor stays one object); an untied one (Llama) is sharded on axis 0 here.

    Raises:
        ScheduleError: when the model has no ``nn.Embedding`` input embedding.
    """
    top = sch.mod
    emb = _input_embedding(sch)
    if emb is None:
        raise ScheduleError("vocab_parallel needs a model whose get_input_embeddings() is an nn.Embedding.")
    emb_path = _path_of(sch, emb)
    n = len(sch.record)
    _ensure_shard(sch[emb_path], "weight", 0)
    _ensure_sync(sch[emb_path], "fwd_post", "all_reduce")
    # a module inside the embedding's own forward (Inkling's embed_norm after the lookup) runs on this rank's
    # rows only, before the reduce: its replicated parameters' gradients are partial sums over the ranks
    for rel, node in sch[emb_path].named_schedules():
        if rel and any(p is not None and p.requires_grad for p in node.mod._parameters.values()):
            _ensure_sync(node, "bwd_post", "all_reduce", param_grads=True)
    # every other embedding tied to it (T5: encoder.embed_tokens, decoder.embed_tokens share ``shared.weight``)
    # looks up through the same masked vocab-parallel forward, so its partial output needs the same all_reduce
    for owner, _name in sch.owners_of(sch[emb_path].mod.weight):
        if owner is not emb and isinstance(owner, nn.Embedding):
            _ensure_sync(sch[_path_of(sch, owner)], "fwd_post", "all_reduce")
    get_out = getattr(top, "get_output_embeddings", None)
    try:
        head = get_out() if callable(get_out) else None
    except NotImplementedError:  # pragma: no cover - some HF models
        head = None
    if isinstance(head, nn.Linear):
        hp = _path_of(sch, head)
        node = sch[hp]
        if getattr(head.weight, "shard_axis", None) is None:  # untied
            _ensure_shard(node, "weight", 0)
        if head.bias is not None and getattr(head.bias, "shard_axis", None) is None:
            _ensure_shard(node, "bias", 0)
        _ensure_sync(node, "bwd_post", "all_reduce")
        _ensure_sync(node, "fwd_post", "all_gather", axis=-1, tensor_parallel_output_grad=False)
    return _since(sch, n)
