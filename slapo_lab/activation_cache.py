"""Activation passes cached per schedule state, and composed from the distinct blocks of a deep model.

:func:`slapo_lab.plan.plan` counts activations with one meta forward (:mod:`slapo_lab.activations`). For a deep
model that pass grows with the depth (126 layers of a 405B Llama: seconds), and the editor's memory view needs it
after every click. So the ``"autograd"`` pass is **composed**: every stack of repeated blocks
(:func:`slapo_lab.blocks.find_blocks`) is cut down to the blocks that stand for every distinct *context* of a block,
the cut-down model runs one pass, and the saved bytes of the whole model are put back together:

* what the model saves outside its blocks (embeddings, rotary tables, the head, the loss) is counted as measured;
* a block saves what the kept block of its context saved. A block's context is its signature (below), the previous
  block's signature (which decides whether this block's input, the previous block's output, is saved already)
  and whether it is the first block of its signature (the first to save a tensor made before the stack for its
  kind: a rotary table, a mask). The cut-down keeps the first block of each context and the block before it, and
  the last block, in model order, so each measured block, and what runs after the stack, sees in the cut-down what
  it sees in the model. A block whose signature no other block has also runs twice in a row (the second time a
  copy), measuring the context the next click down the stack makes. Measured contexts are cached per state
  outside the blocks and gathered over passes, so a click whose contexts were all seen before (checkpointing one
  more block of a run, or the block after the only checkpointed one) needs no pass.

A block's signature is everything that changes what it saves: its recorded calls (relative to the block), its
submodules' classes and schedule state (checkpoint and its policy, a replaced forward), its parameters' per-rank
shapes, and the plain attributes in which blocks of the stack differ (a sliding-window flag), except counters that
differ in every block (``layer_idx``). A checkpoint click on block 7 makes block 7's signature new: the next pass
runs a few blocks per distinct context, whatever the depth.

The composed pass equals the whole-model pass when blocks of one signature behave alike given the same inputs
(``tests/test_activation_cache.py`` checks it per stage on several families against the whole pass); a model whose forward cannot run
cut down (it indexes its blocks by the config's layer count) falls back to the whole pass, and so does a model whose
cut-down would run every block anyway. The ``"estimate"`` pass does not depend on checkpoints and stays one cached whole pass.
"""

from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .activations import ActivationProfile, SavedProfile, estimate_activations, saved_activations
from .blocks import block_lists
from .module_state import peek_meta
from .record import Call, format_call
from .utils import meta_copy

__all__ = ["cached_profile", "has_cached_profile", "is_composed", "profile_for_cache"]

#: model -> {key: profile}; a few states per model (an undo returns to one of them)
_PROFILE_CACHE: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()
_KEEP = 8
#: calls the activation passes do not depend on: cuts only place modules in stages, annotate tags parameters
_SKIP_AUTOGRAD = ("cut_pipeline_stage", "annotate")
_SKIP_ESTIMATE = ("checkpoint", *_SKIP_AUTOGRAD)
#: the plain attribute types a block signature compares
_PLAIN = (bool, int, float, str, type(None))


def _input_signature(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), str(x.dtype))
    if isinstance(x, dict):
        return tuple((k, _input_signature(v)) for k, v in x.items())
    if isinstance(x, (tuple, list)):
        return tuple(_input_signature(v) for v in x)
    try:
        hash(x)
        return x
    except TypeError:
        return repr(x)


_FORMATTED: dict[int, tuple[weakref.ref, str, str]] = {}


def _formatted(call: Call, rel: str) -> str:
    """``format_call`` of ``call`` at path ``rel``, memoised per call object (a record of 10^4 calls is formatted
    once, not after every click)."""
    hit = _FORMATTED.get(id(call))
    if hit is not None and hit[0]() is call and hit[1] == rel:
        return hit[2]
    text = format_call(Call(rel, call.primitive, call.args, call.kwargs))
    if len(_FORMATTED) > 200_000:
        _FORMATTED.clear()
    _FORMATTED[id(call)] = (weakref.ref(call), rel, text)
    return text


def _whole_key(sch, example_inputs, mode: str) -> tuple:
    """The cache key of a whole-model pass of ``mode`` for the schedule's current state."""
    skip = _SKIP_ESTIMATE if mode == "estimate" else _SKIP_AUTOGRAD
    calls = tuple(_formatted(c, c.path) for c in sch.record.calls if c.primitive not in skip)
    shapes = tuple((n, tuple(p.shape), p.requires_grad) for n, p in sch.mod.named_parameters())
    ckpt = (
        ()
        if mode == "estimate"
        else tuple(
            p for p, node in sch.named_schedules() if (meta := peek_meta(node.mod)) and meta.checkpoint
        )
    )
    return mode, calls, shapes, ckpt, _input_signature(example_inputs)


# --------------------------------------------------------------------------------------------------
# the composition
# --------------------------------------------------------------------------------------------------
@dataclass
class _Stack:
    """One stack of blocks: the ``ModuleList`` at ``path``, every block's signature and context (see
    :func:`_contexts`), the blocks the cut-down keeps (positions in ``indices``, model order) and, per context,
    the kept position whose measured items every block of that context takes."""

    path: str
    indices: list[int]
    signatures: list[int]
    contexts: list[tuple] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    source: dict[tuple, int] = field(default_factory=dict)


def _contexts(sigs: list[int]) -> list[tuple]:
    """Per block, what its saved bytes depend on: ``(its signature, the previous block's signature or None, the
    signatures seen before it if it is the first of its own, else None)``. The previous block decides whether this
    block's input (the previous block's output) is saved already; the first block of a kind is the first to save a
    tensor made before the stack for blocks of its kind (a rotary table, a sliding-window mask), unless a block of
    a kind seen before saved it."""
    seen: set[int] = set()
    out = []
    for k, sig in enumerate(sigs):
        prev = sigs[k - 1] if k else None
        out.append((sig, prev, None if sig in seen else frozenset(seen)))
        seen.add(sig)
    return out


def _keep(contexts: list[tuple]) -> tuple[list[int], dict[tuple, int]]:
    """The blocks the cut-down runs: the first block of every distinct context and the block just before it (so
    that in the cut-down it follows a block of the same signature as in the model), and the last block (what runs
    after the stack sees an output of the same kind). Returns the kept positions and, per context, the position
    among the kept ones of the block that measures it. The first block of each signature is kept (its context is
    new), so every kept first-of-its-kind block has the same kinds before it in the cut-down as in the model.

    A signature that one block alone has (one block just checkpointed) also gets the context the next click down
    the stack makes, a block of it after a block of it: that block is kept twice in a row (a position repeated in
    the list; :func:`_cut_down_copy` runs a copy of it there). So a person who checkpoints blocks one after another
    pays one pass, on the first click, not two. A pattern of kinds (a sliding-window layer every third block)
    repeats its kinds and gets no copy."""
    first: dict[tuple, int] = {}
    for k, ctx in enumerate(contexts):
        first.setdefault(ctx, k)
    kept = sorted({k for v in first.values() for k in (v - 1, v) if k >= 0} | {len(contexts) - 1})
    count = collections.Counter(sig for sig, _, _ in contexts)
    twice = {
        k: (sig, sig, None) for (sig, _, seen), k in first.items() if seen is not None and count[sig] == 1
    }
    kept = [k for k in kept for _ in range(2 if k in twice else 1)]
    where = {k: j for j, k in enumerate(kept)}  # a repeated position: its last, the copy
    source = {ctx: kept.index(k) for ctx, k in first.items()}
    source.update({ctx: where[k] for k, ctx in twice.items()})
    return kept, source


@dataclass
class _Composition:
    stacks: list[_Stack]
    key: tuple


@dataclass
class _Parts:
    """What the cut-down pass saved: ``outside`` items with their model paths; ``blocks[(stack, j)]`` the items of
    the ``j``-th kept block with paths relative to the block ("" the block itself, and what the loop around the
    blocks saves right after it)."""

    outside: list[tuple[str, int, int, bool]]
    blocks: dict[tuple[int, int], list[tuple[str, int, int, bool]]]
    batch: int | None
    seconds: float
    fake: bool


@dataclass
class _Composed:
    """The cache of composed passes for one state outside the blocks: what the model saves outside them, and the
    items of every block context measured so far (``(stack path, context) -> items``), merged over passes."""

    outside: list[tuple[str, int, int, bool]]
    contexts: dict[tuple, list[tuple[str, int, int, bool]]]
    batch: int | None
    seconds: float
    fake: bool

    def covers(self, comp: _Composition) -> bool:
        """Whether every block context of ``comp`` was measured."""
        return all((st.path, ctx) in self.contexts for st in comp.stacks for ctx in st.source)


def _module_state(mod: nn.Module) -> tuple:
    meta = peek_meta(mod)
    if not meta:
        return ()
    return (
        meta.checkpoint,
        meta.checkpoint_policy,
        meta.impl is not None,
        meta.fork_rng,
        tuple(meta.syncs),
    )


def _block_facts(block: nn.Module) -> tuple[list[tuple], list[tuple]]:
    """``(structure, plain attributes)`` of one block: per submodule its relative path, class, schedule state and
    parameters' shapes; and ``(relative path, attribute, value)`` of every plain public attribute."""
    structure, plain = [], []
    for rel, m in block.named_modules():
        params = tuple(
            (n, tuple(p.shape), p.requires_grad, getattr(p, "shard_axis", None))
            for n, p in m._parameters.items()
            if p is not None
        )
        structure.append((rel, type(m).__qualname__, _module_state(m), params))
        for k, v in vars(m).items():
            if not k.startswith("_") and k != "training" and isinstance(v, _PLAIN):
                plain.append((rel, k, v))
    return structure, plain


_FACTS: dict[int, tuple[weakref.ref, tuple, tuple]] = {}
#: block signature -> its number, for the life of the process (the cached contexts name signatures by number)
_SIG_IDS: dict[tuple, int] = {}


def _memo_facts(block: nn.Module, stamp: tuple) -> tuple[list[tuple], list[tuple]]:
    """:func:`_block_facts`, recomputed only when the block object or ``stamp`` (its recorded calls and the number
    of calls outside every block: what can change it) differs from the last time."""
    hit = _FACTS.get(id(block))
    if hit is not None and hit[0]() is block and hit[1] == stamp:
        return hit[2]
    facts = _block_facts(block)
    if len(_FACTS) > 100_000:
        _FACTS.clear()
    _FACTS[id(block)] = (weakref.ref(block), stamp, facts)
    return facts


def _outside_params(mod: nn.Module, stacks: set[int], prefix: str = "") -> list[tuple]:
    """``(name, shape, requires_grad)`` of the parameters outside the stacks of blocks (their ids in ``stacks``)."""
    out = [(prefix + n, tuple(p.shape), p.requires_grad) for n, p in mod._parameters.items() if p is not None]
    for name, child in mod._modules.items():
        if child is not None and id(child) not in stacks:
            out.extend(_outside_params(child, stacks, f"{prefix}{name}."))
    return out


def _composition(top, example_inputs) -> _Composition | None:
    """The cut-down of ``top`` for a composed ``"autograd"`` pass, or None when it would run every block anyway."""
    found = [(path, idx) for path, idx in block_lists(top) if path]  # a list inside the model
    if not found:
        return None
    stacks: list[_Stack] = []
    saving = False
    rel_calls, outside = _calls_by_block(top, found)
    lists = {path: top.mod.get_submodule(path) for path, _ in found}
    for s, (path, indices) in enumerate(found):
        sigs = _block_signatures(lists[path], indices, rel_calls[s], len(outside))
        ctxs = _contexts(sigs)
        kept, source = _keep(ctxs)
        saving = saving or (len(indices) >= 3 and len(set(kept)) < len(indices))
        stacks.append(_Stack(path, indices, sigs, ctxs, kept, source))
    if not saving:
        return None
    key = (  # the state outside the blocks; what runs after a stack depends on its last block's kind
        "composed",
        tuple(outside),
        tuple(_outside_params(top.mod, {id(m) for m in lists.values()})),
        tuple((st.path, st.signatures[-1]) for st in stacks),
        _input_signature(example_inputs),
    )
    return _Composition(stacks, key)


def _calls_by_block(top: Any, found: list[tuple[str, list[int]]]) -> tuple[list[list[list[str]]], list[str]]:
    """``(calls[stack][block], calls outside)``: the recorded calls (but those the ``"autograd"`` pass skips),
    formatted relative to the block of a stack of ``found`` they are in, or whole outside every block."""
    prefixes: dict[str, tuple[int, dict[int, int]]] = {}
    for s, (path, indices) in enumerate(found):
        prefixes[path + "."] = (s, {i: k for k, i in enumerate(indices)})
    rel_calls: list[list[list[str]]] = [[[] for _ in idx] for _, idx in found]
    outside: list[str] = []
    for c in top.record.calls:
        if c.primitive in _SKIP_AUTOGRAD:
            continue
        where = _block_of(c.path, prefixes)
        if where is None:
            outside.append(_formatted(c, c.path))
        else:
            rel_calls[where[0]][where[1]].append(_formatted(c, where[2]))
    return rel_calls, outside


def _block_of(path: str, prefixes: dict[str, tuple[int, dict[int, int]]]) -> tuple[int, int, str] | None:
    """``(stack, block position, path inside the block)`` of ``path``, or None outside every block (the first
    stack whose prefix it has decides)."""
    for prefix, (s, pos) in prefixes.items():
        if path.startswith(prefix):
            head, _, tail = path[len(prefix) :].partition(".")
            if head.isdigit() and int(head) in pos:
                return s, pos[int(head)], tail
            return None
    return None


def _block_signatures(
    lst: nn.Module, indices: list[int], rel_calls: list[list[str]], n_outside: int
) -> list[int]:
    """One small int per block of the list ``lst`` (at ``indices``): blocks of equal structure, kind and
    calls share it."""
    facts = [_memo_facts(lst[i], (tuple(rel_calls[k]), n_outside)) for k, i in enumerate(indices)]
    values: dict[tuple[str, str], set] = {}
    for _, plain in facts:
        for rel, k, v in plain:
            values.setdefault((rel, k), set()).add((type(v), v))
    # a plain attribute that differs between blocks marks a kind of block (a sliding-window layer), unless
    # it differs in every block: a counter (layer_idx), which no forward reads for its activations' sizes
    n = len(indices)
    kinds_of = {key for key, vals in values.items() if len(vals) > 1 and not (n > 2 and len(vals) == n)}
    sigs = []
    for k, (structure, plain) in enumerate(facts):
        kinds = tuple((rel, a, v) for rel, a, v in plain if (rel, a) in kinds_of)
        sig = (tuple(structure), kinds, tuple(rel_calls[k]))
        sigs.append(_SIG_IDS.setdefault(sig, len(_SIG_IDS)))  # a small int: contexts hash it many times
    return sigs


def _cut_down_copy(top, comp: _Composition) -> nn.Module:
    """A meta copy of ``top.mod`` whose stacks hold only their kept blocks, renumbered ``0 .. k-1``; a block kept
    twice in a row (:func:`_keep`) is a copy of itself the second time (the model is restored before this
    returns)."""
    saved = []
    try:
        for st in comp.stacks:
            lst = top.mod.get_submodule(st.path)
            mods = dict(lst._modules)
            saved.append((lst, mods))
            lst._modules.clear()
            for j, k in enumerate(st.kept):
                lst._modules[str(j)] = mods[str(st.indices[k])]
        cut = meta_copy(top.mod)
    finally:
        for lst, mods in saved:
            lst._modules.clear()
            lst._modules.update(mods)
    for st in comp.stacks:
        lst = cut.get_submodule(st.path)
        for j in range(1, len(st.kept)):
            if st.kept[j] == st.kept[j - 1]:  # the same block object twice: run a copy of it
                lst._modules[str(j)] = meta_copy(lst._modules[str(j - 1)])
    return cut


def _run_composed(top, comp: _Composition, example_inputs, cancelled=None) -> _Parts:
    """The composed pass of ``top`` (its cut-down copy, then :func:`_run_cut_down`)."""
    return _run_cut_down(_cut_down_copy(top, comp), comp, example_inputs, cancelled)


def _run_cut_down(model: nn.Module, comp: _Composition, example_inputs, cancelled=None) -> _Parts:
    """One ``saved_activations`` pass of the cut-down copy ``model``, its items split into outside and per kept
    block."""
    heads = {f"{st.path}.{j}": (s, j) for s, st in enumerate(comp.stacks) for j in range(len(st.kept))}

    def after(path: str) -> str:
        # a tensor saved after a whole block returned belongs to the loop around the blocks: counted once
        return path + "#after" if path in heads else path

    prof = saved_activations(model, example_inputs, cancelled=cancelled, after=after)
    outside: list[tuple[str, int, int, bool]] = []
    blocks: dict[tuple[int, int], list[tuple[str, int, int, bool]]] = {}
    for path, nbytes, esize, is_float in prof.items:
        hit, rel = _owner(path.removesuffix("#after"), heads)
        if hit is None:
            outside.append((path, nbytes, esize, is_float))
        else:
            blocks.setdefault(hit, []).append((rel, nbytes, esize, is_float))
    return _Parts(outside, blocks, prof.batch, prof.seconds, prof.fake)


def _owner(path: str, heads: dict[str, tuple[int, int]]) -> tuple[tuple[int, int] | None, str]:
    """The kept block ``(stack, j)`` holding module ``path`` (or None) and ``path`` relative to it."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        hit = heads.get(".".join(parts[:i]))
        if hit is not None:
            rest = ".".join(parts[i:])
            return hit, ("." + rest) if rest else ""
    return None, path


def _absorb(value: _Composed | None, parts: _Parts, comp: _Composition) -> _Composed:
    """``value`` (None: a new one) with the contexts the cut-down pass ``parts`` measured."""
    if value is None:
        value = _Composed(parts.outside, {}, parts.batch, parts.seconds, parts.fake)
    value.outside, value.seconds, value.fake = parts.outside, parts.seconds, value.fake or parts.fake
    for s, st in enumerate(comp.stacks):
        for ctx, j in st.source.items():
            value.contexts[(st.path, ctx)] = parts.blocks.get((s, j), [])
    return value


def _expand(value: _Composed, comp: _Composition) -> SavedProfile:
    """The whole model's saved items from the measured contexts (see the module docstring)."""
    items = list(value.outside)
    for st in comp.stacks:
        for k, i in enumerate(st.indices):
            base = f"{st.path}.{i}"
            items.extend(
                (base + rel, nb, es, fl) for rel, nb, es, fl in value.contexts[(st.path, st.contexts[k])]
            )
    return SavedProfile(items=items, batch=value.batch, seconds=value.seconds, fake=value.fake)


# --------------------------------------------------------------------------------------------------
# the cache
# --------------------------------------------------------------------------------------------------
_ENTRIES: dict[int, tuple[weakref.ref, tuple, tuple, _Composition | None]] = {}


def _entry(top, example_inputs, mode: str) -> tuple[tuple, _Composition | None]:
    """``(cache key, composition or None)`` of the pass of ``mode`` for the schedule's state, remembered per model
    object and record (its length and last call: the state changes only through recorded calls, and an undo
    rebuilds the model), so the view's checks and the plan that follows share one computation. A composed pass's
    key is the state outside the blocks; its value, a :class:`_Composed`, gathers block contexts over passes."""
    calls = top.record.calls
    stamp = (mode, len(calls), id(calls[-1]) if calls else None, _input_signature(example_inputs))
    hit = _ENTRIES.get(id(top.mod))
    if hit is not None and hit[0]() is top.mod and hit[1] == stamp:
        return hit[2], hit[3]
    comp = _composition(top, example_inputs) if mode == "autograd" else None
    if comp is not None and _PROFILE_CACHE.get(top.mod, {}).get(("no cut-down", comp.key)):
        comp = None  # its forward failed cut down before: the whole pass
    key = comp.key if comp is not None else _whole_key(top, example_inputs, mode)
    if len(_ENTRIES) > 1_000:
        _ENTRIES.clear()
    _ENTRIES[id(top.mod)] = (weakref.ref(top.mod), stamp, key, comp)
    return key, comp


def _store(per_model: dict, key: tuple, value) -> None:
    if key not in per_model and len(per_model) >= _KEEP:
        per_model.pop(next(iter(per_model)))
    per_model[key] = value


def _hit(per_model: dict, key: tuple, comp: _Composition | None) -> bool:
    value = per_model.get(key)
    if value is None:
        return False
    return comp is None or (isinstance(value, _Composed) and value.covers(comp))


def cached_profile(
    sch, example_inputs, cache: bool, mode: str = "estimate"
) -> tuple[ActivationProfile | SavedProfile, bool]:
    """The activation pass of ``mode`` ("estimate" or "autograd") for the schedule's current state, and whether
    it came from the cache. The ``"autograd"`` pass is composed from the distinct block contexts where the model
    has a stack of blocks (see the module docstring); a forward that fails cut down runs whole (and stays whole
    for that state outside the blocks).

    Raises:
        ScheduleError: when the forward pass fails (one sentence, :mod:`slapo_lab.activations`).
    """
    top = sch.get_top_schedule()
    key, comp = _entry(top, example_inputs, mode)
    per_model = _PROFILE_CACHE.setdefault(top.mod, {})
    if cache and _hit(per_model, key, comp):
        value = per_model[key]
        return (_expand(value, comp) if comp is not None else value), True
    fn = estimate_activations if mode == "estimate" else saved_activations
    if comp is not None:
        try:
            parts = _run_composed(top, comp, example_inputs)
        except Exception:  # noqa: BLE001 - e.g. a forward that indexes its blocks by its depth: the whole pass
            per_model[("no cut-down", comp.key)] = True
            _ENTRIES.pop(id(top.mod), None)
            return cached_profile(sch, example_inputs, cache, mode)
        value = _absorb(per_model.get(key) if cache else None, parts, comp)
        if cache:
            _store(per_model, key, value)
        return _expand(value, comp), False
    prof = fn(top.mod, example_inputs)
    if cache:
        _store(per_model, key, prof)
    return prof, False


def has_cached_profile(sch, example_inputs, mode: str = "autograd") -> bool:
    """Whether :func:`slapo_lab.plan.plan` has the activation pass of ``mode`` for this schedule state cached
    (answers without running the model)."""
    top = sch.get_top_schedule()
    key, comp = _entry(top, example_inputs, mode)
    return _hit(_PROFILE_CACHE.get(top.mod) or {}, key, comp)


def is_composed(sch, example_inputs, mode: str = "autograd") -> bool:
    """Whether the pass of ``mode`` for this state is composed from distinct blocks (a few blocks' forward,
    whatever the depth), so a view may run it at once instead of in the background."""
    return mode == "autograd" and _entry(sch.get_top_schedule(), example_inputs, mode)[1] is not None


def profile_for_cache(sch, example_inputs, lock, mode: str = "autograd", cancelled=None) -> bool:
    """Run :func:`slapo_lab.plan.plan`'s activation pass (``mode``: "estimate" or "autograd") and cache it, for a
    background thread: the schedule's state is read under ``lock``; the model (or, for a composed pass, its
    cut-down) is copied (:func:`slapo_lab.utils.meta_copy`, its hooks and forwards included) under it, and the
    pass runs on the copy without it, so no click waits; the profile is cached only if the schedule is still in
    the state read (a copy a click changed is dropped).

    Args:
        cancelled: a ``threading.Event``; once set, the pass stops at the next module.

    Returns:
        True when a new profile was cached (False: cached already, cancelled, failed or stale).
    """
    with lock:
        top = sch.get_top_schedule()
        key, comp = _entry(top, example_inputs, mode)
        per_model = _PROFILE_CACHE.setdefault(top.mod, {})
        if _hit(per_model, key, comp):
            return False
        try:
            snapshot = _cut_down_copy(top, comp) if comp is not None else meta_copy(top.mod)
        except Exception:  # noqa: BLE001 - the view runs the pass itself and says why it failed
            return False
    try:  # the pass without the lock, so that no click waits: a state a click changed is dropped below
        if comp is not None:
            value = _run_cut_down(snapshot, comp, example_inputs, cancelled)
        else:
            fn = estimate_activations if mode == "estimate" else saved_activations
            value = fn(snapshot, example_inputs, cancelled=cancelled)
    except Exception:  # noqa: BLE001 - cancelled, or the view runs the pass itself and says why it failed
        return False
    with lock:
        if _entry(top, example_inputs, mode)[0] != key:
            return False
        if isinstance(value, _Parts):
            value = _absorb(per_model.get(key), value, comp)
        _store(per_model, key, value)
    return True
