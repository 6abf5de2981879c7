"""Numeric schedule check: replay a schedule on a shrunk copy of the model over simulated ranks and compare.

:func:`slapo_lab.check_schedule` reads only the schedule's own state, so a schedule whose every call is
consistent can still compute another model: a vocab-parallel embedding that drops the module's scale, a
forward that derives its head count from a width the schedule halved, a pipeline stage that duplicates a
shared projection. :func:`numeric_check` runs the model instead:

1. **A shrunk copy.** Blocks whose recorded calls are the same (relative to the block) are checked once:
   each stack of blocks (:func:`slapo_lab.presets.find_blocks`) keeps the shortest prefix that holds one
   block of every distinct schedule, so per-layer properties that depend on the index (T5's relative bias in
   block 0, Gemma-3's sliding / full pattern) stay what they are. A Hugging Face model too large to run
   quickly is rebuilt from its config with small widths that keep its head structure: the same head and
   key/value head counts, a head dimension of 8, an intermediate size and a vocabulary that divide the
   tensor-parallel degree exactly when the original's do (so every ``shard`` of the schedule still applies,
   and every refusal still refuses). Calls on later blocks are mapped onto the kept block with the same
   schedule.
2. **Simulated ranks.** One thread per tensor-parallel rank, joined in an in-process process group
   (PyTorch's threaded backend, ``torch.testing._internal.distributed.multi_threaded_pg``: real
   ``torch.distributed`` collectives between threads), each replaying the calls on its own copy.
3. **The comparison** is :func:`slapo_lab.verify_models`, the same one the exported script's ``--verify``
   runs: weights, forward outputs and every gradient against the unsharded copy. Hooks on every module of
   both copies name the culprit (:class:`_Trace`):

   * a call of the schedule that is refused: the module it was called on;
   * a forward that fails: the module whose call raised (the deepest frame of the traceback that runs a
     method of a module), or the module inside it whose ``fwd_post`` sync returned another shape than the
     unsharded model's (a reduce-scatter where an all-reduce belongs, which only the block's residual add
     notices);
   * an output of another shape (an LM head without its gather): both shapes, at the first module whose
     output has another shape while every module around it has too;
   * outputs that differ: the first module, in forward order, whose output differs while every enclosing
     module's does too (partial sums a parent reduces are no fault); an output projection that completes
     its output from a rank's slice of heads names its parent (heads split in q but not k start there);
   * gradients alone: the first module, in the order autograd produces them, whose gradient for its own
     input differs (a column-parallel layer without its ``bwd_post`` all-reduce sends back a partial sum).
     That gradient is compared per module, where a partial sum is off by a large part of it even when, with
     freshly initialised weights (nearly uniform attention), the parameters' gradients move by less than
     Verify's tolerance: such a schedule is reported as failed too.

   Every dropout is off in the copy (:func:`dropout_off`), and a checkpointed module whose forward draws from
   Python's ``random`` (a LayerDrop-style layer skip, which checkpointing does not replay) is reported before
   anything runs (:func:`python_random_draw`).

4. **The pipeline**, when the schedule cuts: the calls replayed on one rank, the copy split into its stages
   (:func:`slapo_lab.pipeline.partition_pipeline`, as the exported script splits it), the stages run one
   after another with dropout off, and each original parameter's gradient compared as the pipeline runtimes
   produce it: summed over the stages that share it only where the partition lists it as shared (a stage
   that holds a copy of a shared projection nobody sums -- DeBERTa's relative embeddings once -- trains on
   a partial gradient, and a parameter name the model does not have is named).

The exported script's Verify remains the full proof (real model, real ranks, micro-batches, optimiser steps);
this check answers within seconds whether the schedule is right, and where it is not.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import re
import threading
import time
from typing import Any

import torch
from torch import nn

from .blocks import find_blocks
from .errors import ScheduleError
from .record import Call

__all__ = ["NumericReport", "RanksStopped", "check_stop", "numeric_check", "run_threaded_ranks"]

#: Below this many parameters (after keeping one block per distinct schedule) the copy keeps its widths.
SHRINK_ABOVE = 4_000_000
#: Above this many parameters even the shrunk copy is too large to check within seconds.
MAX_CHECK_PARAMS = 40_000_000
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

_run_lock = threading.Lock()  # one check at a time: the threaded process group is process-wide state


@dataclasses.dataclass
class NumericReport:
    """What :func:`numeric_check` found.

    Attributes:
        status: ``"passed"``, ``"failed"`` (the scheduled copy computes another model), ``"error"`` (a call or
            the forward fails: :attr:`message` says where) or ``"skipped"`` (nothing to run: why in
            :attr:`message`).
        message: one sentence for the user.
        module: the culprit (module docstring, 3.): the module whose call of the schedule was refused, whose
            forward raised, whose output first differs (in value or shape), or whose input gradient first
            differs in backward order; "" when none.
        worst: the largest absolute difference over outputs and gradients (0.0 when passed exactly, ``inf``
            on a shape mismatch, ``nan`` when not run).
        ranks: the simulated tensor-parallel ranks.
        blocks: ``(kept, total)`` blocks of the copy against the original.
        params: parameters of the copy that ran.
        seconds: wall time of the check.
        unjudged: the modules of the copy holding a sharded tensor that never ran on the example inputs (a
            vision or audio tower given text only): the check says nothing about their split, and
            :attr:`message` says so.
    """

    status: str
    message: str
    module: str = ""
    worst: float = math.nan
    ranks: int = 1
    blocks: tuple[int, int] = (0, 0)
    params: int = 0
    seconds: float = 0.0
    unjudged: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        """True when the scheduled copy equals the unsharded copy."""
        return self.status == "passed"

    def __str__(self) -> str:
        return self.message


# ----------------------------------------------------------------------------------------------- the copy
def _block_of(path: str, blocks: list[str]) -> str | None:
    for b in blocks:
        if path == b or path.startswith(b + "."):
            return b
    return None


def _signature(calls: list[Call], block: str) -> tuple:
    out = []
    for c in calls:  # cuts included: a block that ends a stage is kept as itself, for the pipeline part
        if _block_of(c.path, [block]) is None:
            continue
        out.append((c.path[len(block) :], c.primitive, repr(c.args), repr(sorted(c.kwargs.items()))))
    return tuple(out)


def _plan_blocks(
    calls: list[Call], blocks: list[str], shapes: dict[str, tuple] | None = None
) -> tuple[dict[str, int], dict[str, str]]:
    """For each stack (a block's parent path): how many leading blocks to keep; and for each block path,
    the kept block whose schedule it shares. Blocks of other parameter shapes (``shapes``: ConvNeXt's or
    Swin's stages, each wider than the last) never stand in for each other."""
    stacks: dict[str, list[str]] = {}
    for b in blocks:
        stacks.setdefault(b.rsplit(".", 1)[0] if "." in b else "", []).append(b)
    keep: dict[str, int] = {}
    alias: dict[str, str] = {}
    for parent, members in stacks.items():
        first_of: dict[tuple, str] = {}
        last = 0
        for i, b in enumerate(members):
            sig = (_signature(calls, b), (shapes or {}).get(b))
            if sig not in first_of:
                first_of[sig] = b
                last = i
            alias[b] = first_of[sig]
        cut_last = any(
            c.primitive == "cut_pipeline_stage" and _block_of(c.path, [members[last]]) for c in calls
        )
        if cut_last and last + 1 < len(members):  # a stage ends at the last kept block: keep the next one as
            last += 1  # itself too, or the copy's stage after the cut would be empty where the model's is not
            alias[members[last]] = members[last]
        keep[parent] = last + 1
    return keep, alias


def _map_calls(
    calls: list[Call], blocks: list[str], alias: dict[str, str], keep_cuts: bool = False
) -> list[Call]:
    """The calls of the kept blocks (calls on a block that shares a kept block's schedule are dropped: the
    kept block runs the same calls)."""
    out = []
    for c in calls:
        if c.primitive in _SKIPPED and not keep_cuts:
            continue
        b = _block_of(c.path, blocks)
        if b is not None and alias.get(b, b) != b:
            continue
        out.append(c)
    return out


def _configs(cfg) -> list:
    """``cfg`` and its sub-configs (CLIP's text / vision, encoder / decoder configs)."""
    from transformers import PretrainedConfig

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
        heads_key = next((k for k in _HEADS if isinstance(getattr(c, k, None), int)), None)
        hidden_key = next((k for k in _HIDDEN if isinstance(getattr(c, k, None), int)), None)
        if heads_key is None or hidden_key is None:
            continue
        heads, hidden = getattr(c, heads_key), getattr(c, hidden_key)
        new_hidden = _keep_remainder(heads * SMALL_HEAD_DIM, hidden, ws)
        if new_hidden >= hidden:
            continue
        swap = {hidden: new_hidden}
        for k in _HEAD_DIM:
            v = getattr(c, k, None)
            if isinstance(v, int) and v > 0:
                setattr(c, k, SMALL_HEAD_DIM)
                changed[k] = (v, SMALL_HEAD_DIM)
        for k in _INTERMEDIATE:
            v = getattr(c, k, None)
            if isinstance(v, int) and v > 0:
                new = _keep_remainder(2 * new_hidden, v, ws)
                swap.setdefault(v, new)
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
        vocab = getattr(c, "vocab_size", None)
        if isinstance(vocab, int) and vocab > 64 * ws:
            vocab_new = _keep_remainder(32 * ws, vocab, ws)
            c.vocab_size = vocab_new
            changed["vocab_size"] = (vocab, vocab_new)
            for k in _TOKEN_IDS:
                t = getattr(c, k, None)
                if isinstance(t, int) and t >= vocab_new:
                    setattr(c, k, vocab_new - 1)
    if vocab_new is not None:  # placeholder tokens (image_token_id, audio_token_index ...) of any sub-config:
        # distinct ids inside the copy's vocabulary, below the special ones (shrunk_inputs maps the inputs alike)
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
    return changed


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
    from transformers import PretrainedConfig

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
    import random

    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy comes with torch
        numpy = None
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


def _refuse_too_big(n: int, kept_blocks: tuple[int, int]) -> None:
    if n > MAX_CHECK_PARAMS:
        raise ScheduleError(
            f"The numeric check skips this model: even with {kept_blocks[0]} of {kept_blocks[1]} blocks it has "
            f"{n / 1e6:.0f} M parameters (the live check runs up to {MAX_CHECK_PARAMS / 1e6:.0f} M)."
        )


def shrunk_copy(
    reference: nn.Module, calls: list[Call], world_size: int, seed: int = 2013, from_config: bool = False
):
    """A small copy of ``reference`` to check ``calls`` on, with real (seeded) weights.

    Args:
        reference: the unscheduled model, on any device (``meta`` included: a Hugging Face model is rebuilt
            from its config; any other model needs real weights).
        calls: the schedule's recorded calls (paths of ``reference``).
        world_size: the tensor-parallel degree the calls were recorded for.
        from_config: rebuild from the Hugging Face config even when small (``reference`` is a scheduled
            model, whose weights are shards).

    Returns:
        ``(copy, mapped calls without cuts, (kept blocks, total blocks), notes, mapped calls with the cuts)``.

    Raises:
        ScheduleError: a meta model without a Hugging Face config, or one still too large once shrunk.
    """
    from .schedule import create_schedule
    from .utils import meta_copy

    meta = meta_copy(reference)
    blocks = find_blocks(create_schedule(meta, world_size=world_size))
    params = {b: dict(meta.get_submodule(b).named_parameters()) for b in blocks}
    stack_of = {b: b.rsplit(".", 1)[0] if "." in b else "" for b in blocks}
    common: dict[str, set[str]] = {}
    for b in blocks:  # the parameters every block of the stack has (T5's block 0 alone holds its bias table)
        common[stack_of[b]] = common.get(stack_of[b], set(params[b])) & set(params[b])
    shapes = {b: tuple((n, tuple(params[b][n].shape)) for n in sorted(common[stack_of[b]])) for b in blocks}
    keep, alias = _plan_blocks(calls, blocks, shapes)
    lengths = {p: sum(1 for b in blocks if (b.rsplit(".", 1)[0] if "." in b else "") == p) for p in keep}
    mapped = _map_calls(calls, blocks, alias)
    mapped_cuts = _map_calls(calls, blocks, alias, keep_cuts=True)
    kept_blocks = (sum(keep.values()), len(blocks))
    _truncate(meta, keep)
    config = getattr(reference, "config", None)
    is_meta = any(p.is_meta for p in reference.parameters())
    notes: list[str] = []
    if (
        config is not None
        and hasattr(config, "to_dict")
        and (from_config or is_meta or _n_params(meta) > SHRINK_ABOVE)
    ):
        wide = copy.deepcopy(config)
        if _n_params(meta) > SHRINK_ABOVE:
            changed = _shrink_config(wide, world_size)
            if changed:
                notes.append("widths " + ", ".join(f"{k} {a}→{b}" for k, (a, b) in sorted(changed.items())))
        cfg = copy.deepcopy(wide)
        done = _set_layer_counts(cfg, keep, lengths)
        try:
            with torch.device("meta"):
                sized = type(reference)(cfg)
            _truncate(sized, {p: n for p, n in keep.items() if p not in done})
            got = _stack_lengths(sized, keep)
            if any(got[p] not in (n, -1) for p, n in keep.items()):  # a layer count served another stack
                cfg, done = wide, set()
                with torch.device("meta"):
                    sized = type(reference)(cfg)
                _truncate(sized, keep)
            _refuse_too_big(_n_params(sized), kept_blocks)
            torch.manual_seed(seed)
            model = type(reference)(cfg)
        except ScheduleError:
            raise
        except Exception as err:  # noqa: BLE001 - any constructor failure becomes one sentence
            raise ScheduleError(
                f"The numeric check could not rebuild {type(reference).__name__} from its config with small "
                f"widths ({type(err).__name__}: {err})."
            ) from None
        _truncate(model, {p: n for p, n in keep.items() if p not in done})
    elif is_meta:
        raise ScheduleError(
            f"The numeric check needs real weights or a Hugging Face config, and {type(reference).__name__} "
            "has neither (its parameters are on the meta device)."
        )
    else:  # the kept blocks' real weights, copied from the model (never a copy of the whole model)
        _refuse_too_big(_n_params(meta), kept_blocks)
        model = _materialize(meta, reference)
    dropout_off(model)
    model.train(False)
    return model, mapped, kept_blocks, notes, mapped_cuts


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
    vocab = None
    cfg = getattr(model, "config", None)
    if cfg is not None:
        vocab = getattr(cfg, "vocab_size", None) or getattr(
            getattr(cfg, "text_config", None), "vocab_size", None
        )
    if vocab is None:
        emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        vocab = emb.num_embeddings if emb is not None else None
    seqs = (
        {
            t.shape[-1]
            for k, t in inputs.items()
            if isinstance(t, torch.Tensor)
            and t.dim() == 2
            and not t.is_floating_point()
            and k.endswith("input_ids")
        }
        or {  # without token ids, every 2-D integer input; with them, those as long (an audio frame mask is not)
            t.shape[-1]
            for t in inputs.values()
            if isinstance(t, torch.Tensor) and t.dim() == 2 and not t.is_floating_point()
        }
    )
    out: dict[str, Any] = {}
    for k, t in inputs.items():
        if not isinstance(t, torch.Tensor):
            out[k] = t
            continue
        if t.is_meta:
            if t.is_floating_point():
                t = torch.randn(t.shape, generator=gen, dtype=t.dtype)
            elif t.dtype == torch.bool:
                t = torch.ones(t.shape, dtype=torch.bool)
            elif "mask" in k:
                t = torch.ones(t.shape, dtype=t.dtype)
            elif k.endswith("position_ids") and seqs:  # positions of tokens (LUKE's entity_position_ids)
                t = torch.randint(0, max(seqs), t.shape, generator=gen, dtype=t.dtype)
            elif k.endswith("_ids") and isinstance(own := getattr(cfg, f"{k[:-4]}_vocab_size", None), int):
                t = torch.randint(
                    0, own, t.shape, generator=gen, dtype=t.dtype
                )  # its own vocabulary (entities)
            else:
                t = torch.randint(0, vocab or 2, t.shape, generator=gen, dtype=t.dtype)
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
    import inspect

    from .call_order import _INPUTS_KEY, VALUES_KEY
    from .inputs import inputs_from_config

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


# ------------------------------------------------------------------------------------------------ the run
@contextlib.contextmanager
def _threaded_world():
    """Install PyTorch's threaded process-group backend for the duration (process-wide, one at a time), with
    no collective or termination left from an earlier world.

    The scaled-dot-product-attention backend flags are process-wide too, and ``torch.nn.attention.sdpa_kernel``
    saves and restores them per call: two rank threads inside a model that selects a backend for one call
    (Granite Speech's conformer attention: ``sdpa_kernel(SDPBackend.MATH)``) can interleave so that the last
    to leave restores the other's selection, leaving the math backend alone enabled for the rest of the
    process (every later attention then saves its whole score matrix). They are put back when the world ends.
    """
    import torch.distributed as dist
    from torch.nn import attention as sdpa

    if dist.is_available() and dist.is_initialized():
        raise ScheduleError(
            "The numeric check simulates ranks in this process, which already holds a process group; "
            "run Verify instead."
        )
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    with _run_lock:
        mtpg._install_threaded_pg()
        mtpg.ProcessLocalGroup.reset()
        torch._C._distributed_c10d._set_thread_isolation_mode(
            True
        )  # group names per thread, as torch's tests
        backends = sdpa._cur_sdpa_kernel_backends(with_priority=True)  # what sdpa_kernel itself saves
        try:
            yield mtpg
        finally:
            sdpa._sdpa_kernel(backends, set_priority=True)
            torch._C._distributed_c10d._set_thread_isolation_mode(False)
            mtpg._uninstall_threaded_pg()
            mtpg.ProcessLocalGroup.reset()


def _tell_ranks_to_leave(pg, err: BaseException) -> None:
    """Set the threaded backend's termination event and wake every rank waiting in a collective (each then
    raises ``SystemExit``). Setting the event alone wakes nobody: a waiting rank re-reads it only when its
    collective's condition is notified (``ProcessLocalGroup.exception_handle``)."""
    for _ in range(100):  # the ranks may add a collective while the handler walks them
        try:
            pg.exception_handle(err)
            return
        except RuntimeError:
            continue


class RanksStopped(SystemExit):
    """Raised inside a rank thread (at a module boundary or between replayed calls) once the ranks are told
    to leave: the check was cancelled, timed out, or another rank failed."""


def run_threaded_ranks(
    fn, world_size: int, timeout: float = 60.0, cancelled: threading.Event | None = None
) -> tuple[dict[int, Any], dict[int, BaseException], str | None]:
    """Call ``fn(rank)`` for every rank, each on its own thread inside its own
    ``init_process_group("threaded")`` (destroyed after), over one in-process threaded world.

    When a rank raises, the check is cancelled, or ``timeout`` seconds pass, the other ranks are told to leave
    (those in a collective raise ``SystemExit`` there; :func:`check_stop` lets ``fn`` leave between
    collectives), and this returns only after every rank thread has ended: no thread of this world ever runs
    on into the next one (a rank left waiting in a collective would hang it, or join its first collective).

    Args:
        fn: called with the rank (0 … ``world_size`` - 1) on that rank's thread.
        world_size: number of simulated ranks.
        timeout: seconds before the ranks are told to leave.
        cancelled: set it to tell the ranks to leave early.

    Returns:
        ``(results, errors, stopped)``: each rank's return value; each failing rank's exception (a
        ``SystemExit`` when it was told to leave); and ``"cancelled"``, ``"timeout"`` or None.

    Raises:
        ScheduleError: when this process already holds a (real) process group.
    """
    import torch.distributed as dist

    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}
    stopped: str | None = None
    with _threaded_world() as mtpg:
        pg = mtpg.ProcessLocalGroup
        store = dist.HashStore()

        def run(rank: int) -> None:
            try:
                dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
                try:
                    results[rank] = fn(rank)
                finally:
                    dist.destroy_process_group()
            except BaseException as err:  # noqa: BLE001 - reported to the caller; the other ranks must leave
                errors[rank] = err
                _tell_ranks_to_leave(pg, err)

        threads = [
            threading.Thread(target=run, args=(r,), name=f"slapo-rank{r}", daemon=True)
            for r in range(world_size)
        ]
        for th in threads:
            th.start()
        deadline = time.monotonic() + timeout
        while any(th.is_alive() for th in threads):
            if cancelled is not None and cancelled.is_set():
                stopped = "cancelled"
            elif time.monotonic() > deadline:
                stopped = "timeout"
            if stopped:
                _tell_ranks_to_leave(pg, RanksStopped(stopped))
            next(th for th in threads if th.is_alive()).join(0.05)
    return results, errors, stopped


def check_stop() -> None:
    """Inside a rank of :func:`run_threaded_ranks`: raise :class:`RanksStopped` when the ranks were told to
    leave (a computation between collectives ends at its next call of this)."""
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    if mtpg.ProcessLocalGroup._terminate.is_set():
        raise RanksStopped("the simulated ranks were told to stop")


def _module_of(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0] if "." in param_name else ""


def _first_tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)):
        return next((t for t in (_first_tensor(v) for v in x) if t is not None), None)
    if isinstance(x, dict):
        return next((t for t in (_first_tensor(v) for v in x.values()) if t is not None), None)
    return None


#: A module's input gradient differs when max |a - b| exceeds this fraction of max |reference| (plus
#: :data:`GRAD_ATOL`): float32 sums in another order stay near 1e-6 of the scale, a partial sum that no
#: all-reduce completed is off by a large part of it.
GRAD_RTOL = 1e-3
GRAD_ATOL = 1e-12
#: An enclosing module's input gradient within this fraction of the reference's agrees (float noise).
GRAD_NOISE = 1e-5


class _Trace:
    """Hooks on every module of one copy (the reference or a rank's scheduled copy).

    * forward: each module's first tensor output (in completion order) and the modules still running;
    * backward: the gradient each module receives for each of its floating-point inputs, in the order
      autograd produces them (a pre-hook that runs before every other one, the schedule's ``bwd_post`` sync
      included, feeds the module a clone of the input whose gradient hook records it: the gradient this
      module alone sends back, after its own all-reduce).
    """

    def __init__(self, model: nn.Module) -> None:
        self.stack: list[str] = []
        self.outputs: dict[str, torch.Tensor] = {}
        self.in_shapes: dict[str, tuple | None] = {}
        self.grads: dict[tuple, torch.Tensor] = {}
        self.grad_order: list[tuple] = []
        self.calls: dict[str, int] = {}
        self.names = {id(m): n for n, m in model.named_modules()}
        self.modules = dict(model.named_modules())
        self.failed: str | None = None
        self.handles = []
        for name, m in model.named_modules():
            self.handles.append(
                m.register_forward_pre_hook(
                    lambda _m, a, kw, n=name: self._tap(n, a, kw), with_kwargs=True, prepend=True
                )
            )
            self.handles.append(m.register_forward_pre_hook(lambda _m, a, n=name: self._enter(n, a)))
            self.handles.append(m.register_forward_hook(lambda _m, _i, o, n=name: self._done(n, o)))

    def _enter(self, name: str, args: tuple) -> None:
        check_stop()  # a cancelled check ends at the next module
        self.stack.append(name)
        if name not in self.in_shapes:
            t = _first_tensor(args)
            self.in_shapes[name] = tuple(t.shape) if t is not None else None

    def _done(self, name: str, out) -> None:
        if self.stack and self.stack[-1] == name:
            self.stack.pop()
        t = _first_tensor(out)
        if t is not None and name not in self.outputs:
            self.outputs[name] = t.detach().clone()

    def _tap(self, name: str, args: tuple, kwargs: dict):
        if not torch.is_grad_enabled():
            return None
        call = self.calls.get(name, 0)
        self.calls[name] = call + 1
        changed = False

        def wrap(where, x):
            nonlocal changed
            if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.requires_grad):
                return x
            changed = True
            y = x.clone()
            y.register_hook(lambda g, k=(name, call, where): self._grad(k, g))
            return y

        new_args = tuple(wrap(i, a) for i, a in enumerate(args))
        new_kw = {k: wrap(k, v) for k, v in kwargs.items()}
        return (new_args, new_kw) if changed else None

    def _grad(self, key: tuple, g: torch.Tensor) -> None:
        if key not in self.grads:
            self.grads[key] = g.detach().clone()
            self.grad_order.append(key)

    def fail(self, err: BaseException | None = None) -> str:
        """The module whose call raised ``err``: the deepest frame of its traceback that runs a method of a
        module of this copy (its ``forward``, or a hook of its call); else the innermost module running."""
        deepest = None
        tb = err.__traceback__ if err is not None else None
        while tb is not None:
            owner = tb.tb_frame.f_locals.get("self")
            if owner is not None and id(owner) in self.names:
                deepest = self.names[id(owner)]
            tb = tb.tb_next
        if deepest is None:
            deepest = self.stack[-1] if self.stack else ""
        self.failed = deepest
        return deepest

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _ancestors(name: str) -> list[str]:
    parts = name.split(".") if name else []
    return [".".join(parts[:i]) for i in range(len(parts))]


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def first_differing_module(ref: _Trace, sch: _Trace, atol: float = 1e-5, rtol: float = 1e-5) -> str | None:
    """The first module (in forward completion order) whose output differs from the reference's while every
    enclosing module with a comparable output differs too (a row-parallel layer whose partial sums a sync
    on its parent reduces is not a difference). Outputs of another shape (a column-parallel layer's slice)
    are not compared. A module whose own sync completes its output (``fwd_post`` all-reduce or all-gather)
    from a rank's slice of its input did not start the difference: the code that made the slice did, so its
    parent is named (heads split in q but not in k show first at the output projection)."""
    from .module_state import peek_meta

    differs: dict[str, bool] = {}
    for name, a in sch.outputs.items():
        b = ref.outputs.get(name)
        if b is None or a.shape != b.shape or a.dtype != b.dtype:
            continue
        if a.is_floating_point():
            differs[name] = not torch.allclose(a.double(), b.double(), atol=atol, rtol=rtol)
        else:
            differs[name] = not torch.equal(a, b)
    for name, bad in differs.items():
        if not bad:
            continue
        if all(differs.get(a, True) for a in _ancestors(name)):
            mod = sch.modules.get(name)
            meta = peek_meta(mod) if mod is not None else None
            sliced = sch.in_shapes.get(name) != ref.in_shapes.get(name)
            if (
                name
                and sliced
                and meta
                and meta.get("output_synced")
                and meta.get("output_type") == "partial"
            ):
                return _parent(name)
            return name
    return None


def first_reshaped_module(ref: _Trace, sch: _Trace) -> tuple[str, tuple, tuple] | None:
    """The first module (in forward completion order) whose output has another shape than the reference's
    while every enclosing module's output has another shape too (a column-parallel slice inside a module
    whose output is whole is no fault): ``(module, its shape, the reference's shape)``."""
    reshaped: dict[str, bool] = {}
    for name, a in sch.outputs.items():
        b = ref.outputs.get(name)
        if b is not None:
            reshaped[name] = a.shape != b.shape
    for name, bad in reshaped.items():
        if bad and all(reshaped.get(a, True) for a in _ancestors(name)):
            return name, tuple(sch.outputs[name].shape), tuple(ref.outputs[name].shape)
    return None


def first_differing_input_grad(ref: _Trace, sch: _Trace) -> tuple[str, float] | None:
    """The first module, in the order autograd produced the scheduled copy's gradients, whose gradient for one
    of its inputs differs from the reference's by more than :data:`GRAD_RTOL` of its scale: ``(module,
    relative difference)``, else None. A wrong gradient spreads to every module before it, so the first one
    autograd produces is where it starts. Not a fault: a child's partial input gradient inside a module whose
    own ``bwd_post`` all-reduce sums its children's parts (its input gradient then agrees to
    :data:`GRAD_NOISE`), nor the partial gradient a gathered output's consumer receives inside a module whose
    input gradient agrees, the gather's backward summing the ranks' parts (Mamba's ``x_proj``). Gradients of another shape (a row-parallel layer's slice of its input) are not
    compared."""
    from .module_state import peek_meta

    diffs: dict[tuple, tuple[float, float]] = {}
    for key in sch.grad_order:
        a, b = sch.grads[key], ref.grads.get(key)
        if b is None or a.shape != b.shape:
            continue
        d = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
        diffs[key] = d, float(b.double().abs().max()) if b.numel() else 0.0
    # the float noise of the whole backward: a gradient that is zero in exact arithmetic (keys whose values
    # are all equal, as with identical tokens) holds only that noise, which is no fault however large a part
    # of its own tiny scale it is
    floor = GRAD_NOISE * max((scale for _d, scale in diffs.values()), default=0.0)
    rel = {key: d / (scale + max(GRAD_ATOL, floor)) for key, (d, scale) in diffs.items()}
    worst: dict[str, float] = {}
    for (name, _call, _where), r in rel.items():
        worst[name] = max(worst.get(name, 0.0), r)

    def sums_children(name: str) -> bool:  # a bwd_post all-reduce on it sums its children's input gradients
        mod = sch.modules.get(name)
        meta = peek_meta(mod) if mod is not None else None
        return bool(meta) and ("bwd_post", "all_reduce") in meta.get("syncs", ())

    def reduces_partial(name: str) -> bool:  # its output is a partial sum it reduces itself (vocab parallel)
        mod = sch.modules.get(name)
        meta = peek_meta(mod) if mod is not None else None
        return bool(meta) and meta.get("output_type") == "partial"

    def gathers_for(name: str, outer: str) -> bool:  # a module inside ``outer`` (not around ``name``) gathers
        # its output over the ranks (fwd_post all_gather: Mamba's x_proj in a channel-parallel mixer); every rank
        # then holds the whole output, its consumers (FalconMamba's b/c/dt_layernorm) receive this rank's part
        # of its gradient, and the gather's backward sums those parts (reduce-scatter)
        mod = sch.modules.get(outer)
        for rel, m in mod.named_modules() if mod is not None else ():
            meta = peek_meta(m)
            full = f"{outer}.{rel}" if outer and rel else outer or rel
            if (
                meta
                and ("fwd_post", "all_gather") in meta.get("syncs", ())
                and not (name == full or name.startswith(full + "."))
            ):
                return True
        return False

    for key, r in rel.items():
        name = key[0]
        # a child's partial input gradient is no fault where an enclosing module with a bwd_post all-reduce
        # receives the right one (its sync sums its children's parts), nor inside a module whose output is a
        # partial sum reduced at its own boundary (a norm in a vocab-parallel embedding's forward, Inkling's
        # embed_norm, sees this rank's rows only, as its forward outputs are partial: parameters are compared)
        if r > GRAD_RTOL and not any(
            ((sums_children(a) or gathers_for(name, a)) and worst.get(a, 1.0) <= GRAD_NOISE)
            or reduces_partial(a)
            for a in _ancestors(name)
        ):
            return name, r
    return None


def _failed_at(err: BaseException, ref: _Trace, sch: _Trace) -> str:
    """Where the scheduled copy's forward failed: the module whose call raised (:meth:`_Trace.fail`), or, when
    a module inside it that ran before returned an output of another shape than the reference's through its
    own ``fwd_post`` sync (a reduce-scatter where an all-reduce belongs), that module."""
    from .module_state import peek_meta

    raised = sch.fail(err)
    inside = [
        n
        for n, out in sch.outputs.items()
        if (not raised or n.startswith(raised + "."))
        and n in ref.outputs
        and out.shape != ref.outputs[n].shape
    ]
    for n in reversed(inside):
        meta = peek_meta(sch.modules[n]) if n in sch.modules else None
        if meta and any(mode == "fwd_post" for mode, _op in meta.get("syncs", ())):
            return n
    return raised


def _unjudged(model: nn.Module, trace: _Trace) -> list[str]:
    """The modules of ``model`` (after its forward and backward) holding sharded trainable parameters that took
    no part: never called under ``trace`` and no gradient reached any of them (a tower the inputs never reach;
    a module whose weight its parent reads directly, Mamba's ``conv1d``, does get gradients)."""
    out = []
    for name, m in model.named_modules():
        sharded = [
            p
            for p in m._parameters.values()
            if p is not None and p.requires_grad and getattr(p, "shard_axis", None) is not None
        ]
        if sharded and name not in trace.calls and all(p.grad is None for p in sharded):
            out.append(name)
    return out


def _rank_run(base: nn.Module, calls: list[Call], inputs: dict, failures: dict, rank: int):
    """One simulated rank (inside :func:`run_threaded_ranks`): replay ``calls`` on a copy of ``base`` and
    compare it with another copy. Returns ``(VerifyReport, first module whose output differs, first module
    whose output has another shape (module, shape, reference shape), first module whose input gradient differs
    (module, relative difference), the sharded modules that never ran (:func:`_unjudged`))``; on a failure records ``(phase, module, exception)`` in
    ``failures[rank]`` (the module of the replayed call that was refused, or the module whose forward raised)
    and raises it again."""
    from .record import replay
    from .schedule import create_schedule
    from .verify import verify_models

    traces: list[_Trace] = []
    phase, at = "replaying the schedule", ""
    try:
        reference = copy.deepcopy(base)
        sch = create_schedule(copy.deepcopy(base))
        for i, c in enumerate(calls):
            check_stop()
            phase, at = f"replaying call {i + 1} (sch[{c.path!r}].{c.primitive})", c.path
            replay(sch, [c])
        phase, at = "running the forward and backward", ""
        traces = [_Trace(reference), _Trace(sch.mod)]
        report = verify_models(reference, sch.mod, inputs, sch.tp, device="cpu", eval_mode=True)
        return (
            report,
            first_differing_module(*traces),
            first_reshaped_module(*traces),
            first_differing_input_grad(*traces),
            _unjudged(sch.mod, traces[1]),
        )
    except BaseException as err:
        failures[rank] = (phase, _failed_at(err, *traces) if len(traces) == 2 else at, err)
        raise
    finally:
        for t in traces:
            t.remove()


def _pipeline_check(base: nn.Module, calls: list[Call], inputs: dict):
    """The pipeline part (module docstring, 4.): None when the stages equal the unsharded copy, else
    ``(status, module, worst, one sentence)``."""
    from .pipeline.partition import default_output_fn, partition_pipeline
    from .pipeline.runtime import set_graph_dropout
    from .record import replay
    from .schedule import create_schedule

    reference = copy.deepcopy(base)
    sch = create_schedule(copy.deepcopy(base))
    try:
        replay(sch, calls)
        part = partition_pipeline(sch, inputs, 1)
    except ScheduleError as err:
        return "error", "", math.inf, f"The pipeline cannot be built from this schedule: {err}"
    except Exception as err:  # noqa: BLE001 - any failure of the split is said, never raised
        text = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return (
            "error",
            "",
            math.inf,
            f"The pipeline cannot be built from this schedule ({type(err).__name__}: {text}).",
        )
    for st in part.stages:
        set_graph_dropout(st.module, False)
    env = dict(zip(part.input_names, part.flat_inputs((), inputs), strict=False))
    try:
        for st in part.stages:
            res = st.module(*[env[n] for n in st.inputs])
            env.update(zip(st.outputs, res if isinstance(res, (tuple, list)) else (res,), strict=False))
    except Exception as err:  # noqa: BLE001 - a stage that fails is said in one sentence
        text = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return "error", "", math.inf, f"A pipeline stage fails ({type(err).__name__}: {text})."
    out = env[part.stages[-1].outputs[0]]
    reference.train(True)
    for m in reference.modules():  # as the stages run: dropout off (modules, and attention's own rate)
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0
    ref_out = default_output_fn(reference(**inputs))
    if out.shape != ref_out.shape or not torch.allclose(out.double(), ref_out.double(), atol=1e-5, rtol=1e-5):
        worst = (
            float((out.double() - ref_out.double()).abs().max()) if out.shape == ref_out.shape else math.inf
        )
        return (
            "failed",
            "",
            worst,
            f"The pipeline's output differs from the unsharded model's (worst difference {worst:.3g}).",
        )
    proj = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    (out * proj).sum().backward()
    (ref_out * proj).sum().backward()
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    summed: dict[tuple, torch.Tensor] = {}
    for group in part.tied:  # what the runtimes all-reduce: the copies of one parameter across stages
        g = sum(
            part.stages[i].params[name].grad
            for i, name in group.items()
            if part.stages[i].params[name].grad is not None
        )
        for i, name in group.items():  # by tensor: a stage's aliases of it (T5's tied lm_head) share the sum
            summed[(i, id(part.stages[i].params[name]))] = g
    worst = 0.0
    for st in part.stages:
        for name, p in st.params.items():
            r = ref_params.get(name)
            if r is None:
                return (
                    "failed",
                    name.rsplit(".", 1)[0],
                    math.inf,
                    f"Pipeline stage {st.index} holds a parameter the model does not have: {name}.",
                )
            g = summed.get((st.index, id(p)), p.grad)
            rg = r.grad
            if g is None or rg is None:
                continue
            diff = float((g.double() - rg.double()).abs().max()) if g.shape == rg.shape else math.inf
            worst = max(worst, diff)
            if g.shape != rg.shape or not torch.allclose(g.double(), rg.double(), atol=1e-5, rtol=1e-4):
                return (
                    "failed",
                    name.rsplit(".", 1)[0],
                    diff,
                    (
                        f"As pipeline stages the model trains {name} on another gradient than the unsharded "
                        f"model (stage {st.index}; worst difference {diff:.3g}): a parameter several stages hold "
                        "whose gradients are not summed?"
                    ),
                )
    return None


def numeric_check(
    reference: nn.Module,
    calls: list[Call],
    world_size: int,
    example_inputs: dict,
    timeout: float = 60.0,
    cancelled: threading.Event | None = None,
    from_config: bool = False,
) -> NumericReport:
    """Check ``calls`` numerically on a shrunk copy of ``reference`` over ``world_size`` simulated ranks.

    Args:
        reference: the unscheduled model (any device; see :func:`shrunk_copy`).
        calls: the recorded calls (``sch.record.calls``), paths of ``reference``.
        world_size: the tensor-parallel degree (1 checks replacements and checkpoints alone).
        example_inputs: keyword inputs of the model's forward (tensors; meta tensors are drawn at random;
            token inputs are cut to 2 samples of :data:`MAX_SEQ` positions).
        timeout: seconds before the ranks are told to stop (the report then says so).
        cancelled: set it to stop early; the report is then ``"skipped"``.
        from_config: see :func:`shrunk_copy`.

    Returns:
        NumericReport: never raises for a wrong schedule, a failing call or forward (those are reported).

    Raises:
        ScheduleError: only for a ``world_size`` below 1.
    """
    t0 = time.perf_counter()
    if not isinstance(world_size, int) or world_size < 1:
        raise ScheduleError(f"The numeric check needs a positive integer world size, not {world_size!r}.")

    def done(status, message, **kw) -> NumericReport:
        return NumericReport(status, message, ranks=world_size, seconds=time.perf_counter() - t0, **kw)

    if not example_inputs:
        return done("skipped", "The numeric check needs example inputs (pass example_inputs= to the editor).")
    try:
        base, mapped, kept, _notes, with_cuts = shrunk_copy(
            reference, list(calls), world_size, from_config=from_config
        )
        inputs = shrunk_inputs(example_inputs, base, reference=reference)
    except ScheduleError as err:
        return done("skipped", str(err))
    except Exception as err:  # noqa: BLE001 - the copy cannot be made: said, never raised
        text = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return done(
            "skipped",
            f"The numeric check skipped: it could not make a small copy of {type(reference).__name__} to run "
            f"({type(err).__name__}: {text}).",
        )
    n_params = _n_params(base)
    for c in mapped:
        if c.primitive != "checkpoint":
            continue
        try:
            drawn = python_random_draw(base.get_submodule(c.path) if c.path else base)
        except AttributeError:
            continue
        if drawn is not None:
            return done(
                "failed",
                f"{c.path or 'The model root'} is checkpointed, but {drawn} draws from Python's (or NumPy's) "
                "random generator, whose state activation checkpointing does not restore, so the recompute in "
                "the backward can take another branch (a skipped layer) than the forward did; draw with torch "
                f"(torch.rand, restored by checkpointing) or leave {c.path or 'it'} unchecked.",
                module=c.path,
                worst=math.nan,
                blocks=kept,
                params=n_params,
            )
    try:  # on a copy: a forward may leave non-leaf tensors on the modules (RecurrentGemma's state), which
        copy.deepcopy(base)(**inputs)  # the ranks' copies of ``base`` could then not deep-copy
    except Exception as err:  # noqa: BLE001 - the unscheduled copy itself: the check cannot judge the schedule
        text = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return done(
            "skipped",
            f"The numeric check skipped: the unscheduled copy's forward fails on the example inputs "
            f"({type(err).__name__}: {text}).",
            blocks=kept,
            params=n_params,
        )
    if cancelled is not None and cancelled.is_set():
        return done("skipped", "The numeric check was cancelled.", blocks=kept, params=n_params)

    failures: dict[int, Any] = {}
    try:
        results, errors, stopped = run_threaded_ranks(
            functools.partial(_rank_run, base, mapped, inputs, failures), world_size, timeout, cancelled
        )
    except ScheduleError as err:
        return done("skipped", str(err), blocks=kept, params=n_params)
    kw = {"blocks": kept, "params": n_params}
    if stopped == "cancelled" or (cancelled is not None and cancelled.is_set()):
        return done("skipped", "The numeric check was cancelled.", **kw)
    if stopped == "timeout":
        phase = next((f[0] for f in failures.values()), "running")
        return done("error", f"The numeric check stopped after {timeout:.0f} s while {phase}.", **kw)
    real = [
        failures.get(r, ("starting the rank", "", e))
        for r, e in sorted(errors.items())
        if not isinstance(e, SystemExit)
    ]
    if real:
        phase, module, exc = real[0]
        at = f" in {module}" if module else ""
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if not isinstance(exc, ScheduleError):
            text = f"{type(exc).__name__}: {text}"
        return done(
            "error",
            f"The scheduled model fails{at} while {phase} on {world_size} simulated rank"
            f"{'s' if world_size > 1 else ''}: {text}",
            module=module,
            worst=math.inf,
            **kw,
        )
    if len(results) < world_size:  # only told to leave, with no rank failing: nothing to judge by
        return done("error", "The numeric check's simulated ranks stopped before they finished.", **kw)
    report, first_module, reshaped, grad_at, unjudged = results[0]
    worst = max([c.max_abs for c in report.outputs + report.grads] or [0.0])
    if report.passed and grad_at is not None:  # below verify's tolerance, but a partial sum nobody reduced
        return done(
            "failed",
            f"The scheduled model differs from the unsharded one: only gradients differ, first the gradient "
            f"{grad_at[0]} sends back to its input (off by {grad_at[1]:.0%} of its largest value; the "
            f"parameters' gradients differ by only {worst:.3g} with these weights, more with trained ones) on "
            f"{world_size} simulated rank{'s' if world_size > 1 else ''}.",
            module=grad_at[0],
            worst=worst,
            **kw,
        )
    if report.passed and any(c.primitive == "cut_pipeline_stage" for c in with_cuts):
        if cancelled is not None and cancelled.is_set():
            return done("skipped", "The numeric check was cancelled.", **kw)
        pp = _pipeline_check(base, with_cuts, inputs)
        if pp is not None:
            status, module, pp_worst, text = pp
            return done(status, text, module=module, worst=pp_worst, **kw)
    if report.passed:
        stages = sum(c.primitive == "cut_pipeline_stage" for c in with_cuts) + 1
        caveat = ""
        if unjudged:
            caveat = (
                f" {len(unjudged)} module{'s' if len(unjudged) > 1 else ''} holding a sharded tensor never ran on "
                f"the example inputs ({', '.join(unjudged[:2])}{' ...' if len(unjudged) > 2 else ''}), so the "
                "check did not judge their split; give inputs that reach them to check it (for a vision or audio "
                "tower, slapo_lab.multimodal_inputs.multimodal_inputs(model, inputs) adds them)."
            )
        return done(
            "passed",
            f"Numerically equal to the unsharded model on {world_size} simulated rank"
            f"{'s' if world_size > 1 else ''}"
            + (f" and as {stages} pipeline stages" if stages > 1 else "")
            + f" (worst difference {worst:.1e}; {kept[0]} of {kept[1]} blocks, {n_params / 1e6:.1f} M parameters)."
            + caveat,
            worst=worst,
            unjudged=tuple(unjudged),
            **kw,
        )
    ranks = f"on {world_size} simulated rank{'s' if world_size > 1 else ''}"
    bad_w = [c for c in report.weights if not c.ok]
    bad_g = [c for c in report.grads if not c.ok]
    bad_shape = next((c for c in report.outputs if c.max_abs >= 1e300), None)  # inf, as verify reduces it
    if bad_w:
        what, first = "the weights differ first", _module_of(bad_w[0].name)
    elif bad_shape is not None and reshaped is not None:
        first, got, want = reshaped
        return done(
            "failed",
            f"The scheduled model's output {bad_shape.name} has another shape than the unsharded one's: "
            f"{first or 'the model root'} returns {_shape(got)} where the unsharded model returns "
            f"{_shape(want)} ({ranks}).",
            module=first,
            worst=math.inf,
            **kw,
        )
    elif first_module is not None:
        what, first = "outputs first differ", first_module
    elif grad_at is not None:
        first = grad_at[0]
        return done(
            "failed",
            f"The scheduled model differs from the unsharded one: only gradients differ, first the gradient "
            f"{first} sends back to its input (off by {grad_at[1]:.0%} of its largest value; worst difference "
            f"{worst:.3g} {ranks}).",
            module=first,
            worst=worst,
            **kw,
        )
    elif bad_g:
        what, first = "only gradients differ, first", _module_of(bad_g[0].name)
    else:
        what, first = "outputs differ", next((c.name for c in report.outputs if not c.ok), "")
    return done(
        "failed",
        f"The scheduled model differs from the unsharded one: {what} at {first or 'the model root'} "
        f"(worst difference {worst:.3g} {ranks}).",
        module=first,
        worst=worst,
        **kw,
    )


def _shape(shape: tuple) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"
