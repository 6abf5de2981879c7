"""The numeric check's shrunk copy and its inputs (:mod:`slapo_lab.numeric`, step 1).

* Which blocks are kept: each stack of blocks (:func:`slapo_lab.blocks.find_blocks`) keeps the shortest prefix
  that holds one block of every distinct schedule (:func:`_plan_blocks`); the calls on later blocks are mapped
  onto the kept block with the same schedule (:func:`_map_calls`), and the syncs on a stack's last block itself
  (sequence parallelism's gather) onto the last kept block.
* A Hugging Face config rebuilt small (:func:`_shrink_config`): the same head and key/value head counts, a
  head dimension of :data:`SMALL_HEAD_DIM`, widths and a vocabulary that divide the tensor-parallel degree
  exactly when the original's do; the layer counts of every stack set to the kept blocks
  (:func:`_set_layer_counts`).
* The copy's hygiene: every dropout off (:func:`dropout_off`), and a forward that draws from Python's
  ``random`` found before anything runs (:func:`python_random_draw`).
* The inputs (:func:`shrunk_inputs`, :func:`remembered_inputs`): the example inputs folded into the shrunk
  vocabulary and at most :data:`MAX_SEQ` positions, or inputs made from the config.

:func:`~slapo_lab.numeric.shrunk_copy`, which puts these together, and the size limits ``SHRINK_ABOVE`` and
``MAX_CHECK_PARAMS`` live in :mod:`slapo_lab.numeric`.
"""

from __future__ import annotations

import copy
import inspect
import random
import re
from typing import Any

import torch
from torch import nn

from ..call_order import _INPUTS_KEY, VALUES_KEY
from ..errors import ScheduleError
from ..inputs import inputs_from_config
from ..record import Call

try:
    import numpy
except ImportError:  # pragma: no cover - numpy comes with torch
    numpy = None

#: Head dimension of a shrunk copy (even, so rotary embeddings still pair dimensions).
SMALL_HEAD_DIM = 8
#: Sequence length the example inputs are cut to.
MAX_SEQ = 32
#: Primitives the tensor-parallel part skips (the pipeline part replays them).
_SKIPPED = frozenset({"cut_pipeline_stage"})

_HEADS = ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads")
_HIDDEN = ("hidden_size", "n_embd", "d_model", "embed_dim")
_HEAD_DIM = ("head_dim", "d_kv", "kv_channels")
_INTERMEDIATE = (
    "intermediate_size",
    "n_inner",
    "ffn_dim",
    "d_ff",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id")


# ----------------------------------------------------------------------------------------------- the copy
def _block_of(path: str, blocks: list[str]) -> str | None:
    for b in blocks:
        if path == b or path.startswith(b + "."):
            return b
    return None


def _signature(calls: list[Call], block: str, root_syncs: bool = True) -> tuple:
    out = []
    for c in calls:  # cuts included: a block that ends a stage is kept as itself, for the pipeline part
        if _block_of(c.path, [block]) is None or (not root_syncs and _root_sync(c, block)):
            continue
        out.append((c.path[len(block) :], c.primitive, repr(c.args), repr(sorted(c.kwargs.items()))))
    return tuple(out)


def _root_sync(c: Call, block: str) -> bool:
    return c.path == block and c.primitive == "sync"


def _plan_blocks(
    calls: list[Call], blocks: list[str], shapes: dict[str, tuple] | None = None
) -> tuple[dict[str, int], dict[str, str], dict[str, str]]:
    """For each stack (a block's parent path): how many leading blocks to keep; for each block path, the kept
    block whose schedule it shares; and the stacks' ends whose own syncs move to the last kept block.

    Blocks of other parameter shapes (``shapes``: ConvNeXt's or Swin's stages, each wider than the last) never
    stand in for each other. Every kept block runs its own calls. A stack's last block whose schedule differs
    from an earlier block's only by syncs on the block itself (sequence parallelism gathers the sequence on
    the last block's output) is not kept: those syncs end the copy's shorter stack instead, on its last kept
    block, so a deep stack is still checked on a few blocks.
    """
    stacks: dict[str, list[str]] = {}
    for b in blocks:
        stacks.setdefault(b.rsplit(".", 1)[0] if "." in b else "", []).append(b)
    keep: dict[str, int] = {}
    alias: dict[str, str] = {}
    tails: dict[str, str] = {}
    for parent, members in stacks.items():
        first_of: dict[tuple, str] = {}
        last = 0
        tail = None
        for i, b in enumerate(members):
            sig = (_signature(calls, b), (shapes or {}).get(b))
            end = (_signature(calls, b, root_syncs=False), sig[1])
            if i == len(members) - 1 and i > 1 and sig not in first_of and end in first_of:
                alias[b] = first_of[end]
                tail = b
                continue
            if sig not in first_of:
                first_of[sig] = b
                last = i
            alias[b] = first_of[sig]
        cut_last = any(
            c.primitive == "cut_pipeline_stage" and _block_of(c.path, [members[last]]) for c in calls
        )
        if cut_last and last + 1 < len(members):  # a stage ends at the last kept block: keep the next one as
            last += 1  # itself too, or the copy's stage after the cut would be empty where the model's is not
        for b in members[: last + 1]:  # a kept block runs its own calls, even one that shares an earlier
            alias[b] = b  # block's (sequence parallelism's middle blocks, between the first and the last)
        if tail is not None:  # its own syncs end the copy's stack, on the last kept block
            tails[tail] = members[last]
        keep[parent] = last + 1
    return keep, alias, tails


def _map_calls(
    calls: list[Call],
    blocks: list[str],
    alias: dict[str, str],
    keep_cuts: bool = False,
    tails: dict[str, str] | None = None,
) -> list[Call]:
    """The calls of the kept blocks (calls on a block that shares a kept block's schedule are dropped: the
    kept block runs the same calls); a stack end's own syncs (``tails``: block -> the last kept block of its
    stack, :func:`_plan_blocks`) are made on that kept block."""
    out = []
    for c in calls:
        if c.primitive in _SKIPPED and not keep_cuts:
            continue
        b = _block_of(c.path, blocks)
        if b is not None and alias.get(b, b) != b:
            if tails and b in tails and _root_sync(c, b):
                out.append(Call(tails[b], c.primitive, c.args, dict(c.kwargs)))
            continue
        out.append(c)
    return out


def _configs(cfg) -> list:
    """``cfg`` and its sub-configs (CLIP's text / vision, encoder / decoder configs)."""
    from transformers import PretrainedConfig  # noqa: PLC0415 - heavy (0.7 s); only an HF model needs it

    out, todo = [], [cfg]
    while todo:
        c = todo.pop()
        if any(c is o for o in out):
            continue
        out.append(c)
        for v in vars(c).values():
            if isinstance(v, PretrainedConfig):
                todo.append(v)
    return out


def _keep_remainder(small: int, orig: int, ws: int) -> int:
    """The smallest value >= ``small`` with the same remainder modulo ``ws`` as ``orig``."""
    base = -(-small // ws) * ws
    return base + orig % ws


#: Config sizes of the model's inputs, which the shrunk copy keeps: its example inputs keep their shapes (an
#: audio tower's mel bins may equal the tiny intermediate width the shrinker halves).
_INPUT_SIZES = (
    "num_mel_bins",
    "num_channels",
    "feature_size",
    "input_feat_per_channel",
    "image_size",
    "patch_size",
)


def _shrink_config(cfg, ws: int) -> dict[str, Any]:
    """Small widths in place on ``cfg`` (a deep copy); returns {attribute: (old, new)} of what changed."""
    changed: dict[str, Any] = {}
    vocab_new = None
    for c in _configs(cfg):
        if not _shrink_widths(c, ws, changed):
            continue
        vocab = getattr(c, "vocab_size", None)
        if isinstance(vocab, int) and vocab > 64 * ws:
            vocab_new = _keep_remainder(32 * ws, vocab, ws)
            c.vocab_size = vocab_new
            changed["vocab_size"] = (vocab, vocab_new)
            for k in _TOKEN_IDS:
                t = getattr(c, k, None)
                if isinstance(t, int) and t >= vocab_new:
                    setattr(c, k, vocab_new - 1)
    if vocab_new is not None:
        _move_placeholder_tokens(cfg, vocab_new, changed)
    return changed


def _shrink_widths(c: Any, ws: int, changed: dict[str, Any]) -> bool:
    """Give the (sub-)config ``c`` small heads (:data:`SMALL_HEAD_DIM`) and the widths that go with them (hidden,
    intermediate, and every field equal to one of them), in place, noting each in ``changed``; whether it
    shrank (a config without heads and a hidden width, or already small, does not)."""
    heads_key = next((k for k in _HEADS if isinstance(getattr(c, k, None), int)), None)
    hidden_key = next((k for k in _HIDDEN if isinstance(getattr(c, k, None), int)), None)
    if heads_key is None or hidden_key is None:
        return False
    heads, hidden = getattr(c, heads_key), getattr(c, hidden_key)
    new_hidden = _keep_remainder(heads * SMALL_HEAD_DIM, hidden, ws)
    if new_hidden >= hidden:
        return False
    swap = {hidden: new_hidden}
    for k in _HEAD_DIM:
        v = getattr(c, k, None)
        if isinstance(v, int) and v > 0:
            setattr(c, k, SMALL_HEAD_DIM)
            changed[k] = (v, SMALL_HEAD_DIM)
    for k in _INTERMEDIATE:
        v = getattr(c, k, None)
        if isinstance(v, int) and v > 0:
            swap.setdefault(v, _keep_remainder(2 * new_hidden, v, ws))
    for k, v in list(vars(c).items()):
        if (
            isinstance(v, int)
            and not isinstance(v, bool)
            and v in swap
            and k not in _HEADS
            and k not in _INPUT_SIZES
            and "layer" not in k
        ):
            setattr(c, k, swap[v])
            changed[k] = (v, swap[v])
    return True


def _move_placeholder_tokens(cfg: Any, vocab_new: int, changed: dict[str, Any]) -> None:
    """Give the placeholder tokens (``image_token_id``, ``audio_token_index`` ...) of any sub-config that fall
    outside the shrunk vocabulary distinct ids inside it, below the special ones, in place (``shrunk_inputs``
    maps the inputs alike)."""
    taken: set = set()
    for c in _configs(cfg):
        for k in _TOKEN_IDS:
            v = getattr(c, k, None)
            taken.update(v if isinstance(v, (list, tuple)) else [v])
    moved: dict[int, int] = {}
    for c in _configs(cfg):
        for k, t in list(vars(c).items()):
            folded = k.endswith(("_token_id", "_token_index")) and k not in _TOKEN_IDS
            if folded and isinstance(t, int) and not isinstance(t, bool) and t >= vocab_new:
                if t not in moved:
                    new = next(i for i in range(vocab_new - 1, -1, -1) if i not in taken)
                    taken.add(new)
                    moved[t] = new
                setattr(c, k, moved[t])
                changed[k] = (t, moved[t])


#: Words that tie a config's layer count to one stack: in the field's name, its config class's name, and the
#: stack's path (T5's ``num_decoder_layers`` is the decoder's, CLIP's text config's ``num_hidden_layers`` the
#: text tower's).
_STACK_ROLES = ("encoder", "decoder", "vision", "text", "audio", "image")


def _roles(*names: str) -> set[str]:
    return {r for r in _STACK_ROLES for n in names if r in n.lower()}


def _set_layer_counts(cfg, keep: dict[str, int], lengths: dict[str, int]) -> set[str]:
    """Set each config layer count that belongs to a stack to that stack's kept prefix; returns the stacks
    done.

    A field belongs to the stacks of its length whose path names every role word the field (or its config
    class) names; a field without a role word belongs only to those of them that have no field of their own
    (T5's ``num_layers`` is the encoder's once ``num_decoder_layers`` is the decoder's; BART's
    ``num_hidden_layers``, a copy of ``encoder_layers``, is then nobody's). A field is set only when every stack
    it belongs to keeps the same number of blocks (an encoder and a decoder of equal depth may keep different
    prefixes); the other stacks are cut after the model is built."""
    fields = []  # (config, name, value, roles)
    for c in _configs(cfg):
        for k, v in vars(c).items():
            if k.startswith("_"):
                continue
            if (isinstance(v, int) and not isinstance(v, bool) and ("layer" in k or "block" in k)) or (
                isinstance(v, list) and k.endswith("layer_types")
            ):
                fields.append((c, k, v, _roles(k, type(c).__name__)))

    def size(v) -> int:
        return len(v) if isinstance(v, list) else v

    def fits(roles: set[str], parent: str) -> bool:
        return roles <= _roles(parent)

    own = {
        p for p in keep for _c, _k, v, roles in fields if roles and size(v) == lengths[p] and fits(roles, p)
    }
    done = {p for p, n in keep.items() if n == lengths[p]}
    for c, k, v, roles in fields:
        owners = [p for p in keep if size(v) == lengths[p] and fits(roles, p) and (roles or p not in own)]
        wanted = {keep[p] for p in owners}
        if len(wanted) != 1:
            continue
        n = wanted.pop()
        if n == size(v):
            continue
        setattr(c, k, v[:n] if isinstance(v, list) else n)
        done.update(owners)
    return done


def _stack_lengths(model: nn.Module, parents) -> dict[str, int]:
    out = {}
    for p in parents:
        try:
            stack = model.get_submodule(p) if p else model
        except AttributeError:
            out[p] = 0
            continue
        out[p] = len(stack) if isinstance(stack, (nn.ModuleList, nn.Sequential)) else -1
    return out


def _truncate(model: nn.Module, keep: dict[str, int]) -> None:
    for parent, n in keep.items():
        stack = model.get_submodule(parent) if parent else model
        if isinstance(stack, (nn.ModuleList, nn.Sequential)) and len(stack) > n:
            for name in list(stack._modules)[n:]:
                del stack._modules[name]


def _n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _materialize(meta: nn.Module, reference: nn.Module) -> nn.Module:
    """``meta`` (a truncated structural copy of ``reference``) with ``reference``'s tensors copied in, tied
    tensors kept tied (a deep copy whose memo maps each meta tensor to its real copy, as :func:`meta_copy`)."""
    src = dict(reference.named_parameters(remove_duplicate=False))
    src.update(reference.named_buffers(remove_duplicate=False))
    memo: dict[int, Any] = {}
    for name, t in [
        *meta.named_parameters(remove_duplicate=False),
        *meta.named_buffers(remove_duplicate=False),
    ]:
        if id(t) in memo:
            continue
        real = src[name].detach().to("cpu", copy=True)
        if isinstance(t, nn.Parameter):
            real = nn.Parameter(real, requires_grad=t.requires_grad)
        memo[id(t)] = real
    return copy.deepcopy(meta, memo)


_DROPOUT_NAME = re.compile(r"dropout|pdrop|drop_prob|layerdrop|drop_path|drop_rate")


def dropout_off(model: nn.Module) -> nn.Module:
    """Turn off, in place, every dropout ``model`` has, so that a right schedule never differs by a random
    mask in any part of the check (the tensor-parallel ranks run in eval mode, but the pipeline part runs its
    stages in training mode): ``p = 0`` on every ``nn.Dropout``-like module (``torch.nn.modules.dropout``), 0.0
    in every float attribute whose name says dropout (T5's ``self.dropout``, Llama's ``attention_dropout``,
    GPT-2's ``resid_pdrop``, a stochastic depth's ``drop_prob``, LayerDrop's ``layerdrop``) and in the same
    fields of the model's configs, which are first copied (a forward that reads ``self.config.attention_dropout``
    at run time reads 0.0; the user's config is left as it is). Returns ``model``."""
    from transformers import PretrainedConfig  # noqa: PLC0415 - heavy (0.7 s); only an HF model needs it

    memo: dict[int, Any] = {}
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
        for k, v in list(vars(m).items()):
            if isinstance(v, float) and not isinstance(v, bool) and _DROPOUT_NAME.search(k):
                setattr(m, k, 0.0)
            elif isinstance(v, PretrainedConfig):
                if id(v) not in memo:
                    cfg = copy.deepcopy(v)
                    for c in _configs(cfg):
                        for ck, cv in list(vars(c).items()):
                            if isinstance(cv, float) and _DROPOUT_NAME.search(ck):
                                setattr(c, ck, 0.0)
                    memo[id(v)] = cfg
                setattr(m, k, memo[id(v)])
    return model


def _codes(code):
    yield code
    for c in code.co_consts:
        if hasattr(c, "co_names"):
            yield from _codes(c)


def python_random_draw(module: nn.Module) -> str | None:
    """The first ``forward`` in ``module`` (itself or a submodule) that draws from Python's ``random`` module or
    NumPy's global generator (a LayerDrop-style layer skip: ``if self.training and random.random() < p``), as
    ``"ClassName.forward"``; None when there is none. Read from the code objects (the names the forward looks
    up in its module's globals), without running it."""
    seen: set = set()
    for m in module.modules():
        fn = getattr(type(m).forward, "__func__", type(m).forward)
        code = getattr(fn, "__code__", None)
        if code is None or code in seen:
            continue
        seen.add(code)
        glb = getattr(fn, "__globals__", {})
        names = {n for c in _codes(code) for n in c.co_names}
        for n in names:
            v = glb.get(n)
            if v is random or getattr(v, "__self__", None) is getattr(random, "_inst", object()):
                return f"{type(m).__name__}.forward"
            if numpy is not None and v is numpy and "random" in names:
                return f"{type(m).__name__}.forward"
    return None


def shrunk_inputs(
    inputs: dict, model: nn.Module, seed: int = 2013, reference: nn.Module | None = None
) -> dict:
    """``inputs`` for the shrunk copy: real tensors (meta ones drawn at random: an ``*position_ids`` among the
    token positions, an ``<x>_ids`` within the config's ``<x>_vocab_size`` where it has one, LUKE's entities),
    at most 2 samples and :data:`MAX_SEQ` positions of token inputs, token ids folded into the copy's vocabulary
    (-100 kept); with ``reference`` (the model the copy was made from), its placeholder tokens
    (``image_token_id`` ...) map to the copy's and no other token lands on one (:func:`_fold_tokens`)."""
    gen = torch.Generator().manual_seed(seed)
    placeholders = _placeholder_map(reference, model)
    cfg = getattr(model, "config", None)
    vocab = _vocab_size(model, cfg)
    seqs = _token_lengths(inputs)
    out: dict[str, Any] = {}
    for k, t in inputs.items():
        if not isinstance(t, torch.Tensor):
            out[k] = t
            continue
        if t.is_meta:
            t = _drawn_input(k, t, gen, cfg, seqs, vocab)
        t = t[:2] if t.dim() >= 1 and t.shape[0] > 2 else t
        if t.dim() == 2 and not t.is_floating_point() and t.shape[-1] in seqs and t.shape[-1] > MAX_SEQ:
            t = t[:, :MAX_SEQ]
        if vocab and not t.is_floating_point() and t.dtype != torch.bool and "mask" not in k:
            t = (
                _fold_tokens(t, vocab, placeholders)
                if placeholders
                else torch.where(t >= vocab, t % vocab, t)
            )
        out[k] = t.clone()
    return out


def _vocab_size(model: nn.Module, cfg: Any) -> int | None:
    """The token vocabulary of ``model``: its config's (or its text config's), else its first embedding's."""
    vocab = None
    if cfg is not None:
        vocab = getattr(cfg, "vocab_size", None) or getattr(
            getattr(cfg, "text_config", None), "vocab_size", None
        )
    if vocab is None:
        emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        vocab = emb.num_embeddings if emb is not None else None
    return vocab


def _token_lengths(inputs: dict) -> set[int]:
    """The sequence lengths of the token inputs: of the 2-D integer ``*input_ids``, or without them of every
    2-D integer input (with them, those as long are token inputs too; an audio frame mask is not)."""
    return {
        t.shape[-1]
        for k, t in inputs.items()
        if isinstance(t, torch.Tensor)
        and t.dim() == 2
        and not t.is_floating_point()
        and k.endswith("input_ids")
    } or {
        t.shape[-1]
        for t in inputs.values()
        if isinstance(t, torch.Tensor) and t.dim() == 2 and not t.is_floating_point()
    }


def _drawn_input(
    k: str, t: torch.Tensor, gen: torch.Generator, cfg: Any, seqs: set[int], vocab: int | None
) -> torch.Tensor:
    """A real value for the meta input ``k``: random floats, true booleans and masks, positions among the
    token positions, ids within their own vocabulary (LUKE's entities) or the model's."""
    if t.is_floating_point():
        return torch.randn(t.shape, generator=gen, dtype=t.dtype)
    if t.dtype == torch.bool:
        return torch.ones(t.shape, dtype=torch.bool)
    if "mask" in k:
        return torch.ones(t.shape, dtype=t.dtype)
    if k.endswith("position_ids") and seqs:  # positions of tokens (LUKE's entity_position_ids)
        return torch.randint(0, max(seqs), t.shape, generator=gen, dtype=t.dtype)
    if k.endswith("_ids") and isinstance(own := getattr(cfg, f"{k[:-4]}_vocab_size", None), int):
        return torch.randint(0, own, t.shape, generator=gen, dtype=t.dtype)  # its own vocabulary (entities)
    return torch.randint(0, vocab or 2, t.shape, generator=gen, dtype=t.dtype)


def _placeholder_map(reference: nn.Module | None, copy: nn.Module) -> dict[int, int]:
    """``{placeholder token id of reference: its id in the shrunk copy}``: the integer config fields ending in
    ``_token_id`` / ``_token_index`` other than :data:`_TOKEN_IDS` (``image_token_id``, ``audio_token_index``
    ...), which a multimodal model counts in its ``input_ids`` against its tower's rows of features."""
    a, b = getattr(reference, "config", None), getattr(copy, "config", None)
    if a is None or b is None or not hasattr(a, "to_dict") or not hasattr(b, "to_dict"):
        return {}
    out: dict[int, int] = {}
    for ca, cb in zip(_configs(a), _configs(b), strict=False):  # the copy's config is a deep copy: same order
        for k, v in vars(ca).items():
            if not k.endswith(("_token_id", "_token_index")) or k in _TOKEN_IDS:
                continue
            new = vars(cb).get(k)  # not getattr: a per-layer config's property may raise (Gemma 4's)
            if isinstance(new, int) and isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                out.setdefault(v, new)
    return out


def _fold_tokens(t: torch.Tensor, vocab: int, placeholders: dict[int, int]) -> torch.Tensor:
    """Token ids ``t`` inside ``vocab``: each placeholder id to its id in the copy, every other id that is out
    of the vocabulary or equal to a placeholder's new id to an id that is no placeholder (so the copy counts
    exactly the placeholders the model counts)."""
    keys = torch.tensor(list(placeholders), dtype=t.dtype)
    vals = torch.tensor(list(placeholders.values()), dtype=t.dtype)
    reserved = set(placeholders.values())
    allowed = torch.tensor([i for i in range(vocab) if i not in reserved] or [0], dtype=t.dtype)
    hit = t.unsqueeze(-1) == keys
    is_ph = hit.any(-1)
    mapped = (hit.to(t.dtype) * vals).sum(-1)
    clash = (t >= vocab) | torch.isin(t, vals)
    other = torch.where(t >= 0, allowed[t.clamp(min=0) % len(allowed)], t)  # -100 (ignored labels) kept
    return torch.where(is_ph, mapped, torch.where(clash & (t >= 0), other, t))


def remembered_inputs(sch, model: nn.Module) -> dict:
    """The example inputs the schedule remembers (:func:`slapo_lab.call_order.set_example_inputs`, as the
    editor sets them), else ones made from a Hugging Face model's config
    (:func:`slapo_lab.inputs.inputs_from_config`), else ``input_ids`` of 2 x 16 tokens for a model whose forward
    takes them.

    Raises:
        ScheduleError: neither is available.
    """
    stored = sch.get_top_schedule()._top.extra.get(_INPUTS_KEY)
    if stored:  # integer inputs with their real values (placeholder tokens), the rest drawn by the check
        return {**stored, **sch.get_top_schedule()._top.extra.get(VALUES_KEY, {})}
    made = inputs_from_config(model)
    if made:
        return made
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    if "input_ids" in params:
        return {"input_ids": torch.empty(2, 16, dtype=torch.long, device="meta")}
    raise ScheduleError(
        f"The numeric check needs example inputs for {type(model).__name__}; pass example_inputs=."
    )
