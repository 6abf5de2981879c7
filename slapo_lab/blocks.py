"""Where a model's repeated blocks are: the one home of block finding and family detection.

Presets (:mod:`slapo_lab.presets`), the numeric check's shrunk copy (:mod:`slapo_lab.numeric`), the memory plan
(:mod:`slapo_lab.plan`), pipeline balancing (:mod:`slapo_lab.pipeline.balance`) and the training runtime
(:mod:`slapo_lab.train`) all ask this module. It sits below all of them and imports only torch.

* :func:`find_blocks`: the blocks of every stack (known families by class; else the children of each
  ``nn.ModuleList`` of one class, longest first, then hybrid lists of several classes, then -- for a model
  with no such list -- the longest ``nn.Sequential`` of one class).
* :func:`block_stack`: the stack holding the most of those blocks (the memory plan's unit of FSDP gathers and
  of per-stage block ranges).
"""

from __future__ import annotations

import weakref

from torch import nn

FAMILIES = ("bert", "gpt2", "llama")
_BLOCK_CLASSES = {"bert": ("BertLayer",), "gpt2": ("GPT2Block",), "llama": ("LlamaDecoderLayer",)}

# Families whose attention keeps head counts in attributes (OPT, GPT-Neo, T5: the shard rules rewrite them per
# rank, slapo_lab/sharding/heads.py) and RoBERTa (BERT's names); T5Block covers the encoder and the decoder.
_BLOCK_CLASSES.update(
    {
        "roberta": ("RobertaLayer",),
        "opt": ("OPTDecoderLayer",),
        "gpt_neo": ("GPTNeoBlock",),
        "t5": ("T5Block", "MT5Block", "UMT5Block"),
    }
)
FAMILIES = (*FAMILIES, "roberta", "opt", "gpt_neo", "t5")


def detect_family(sch) -> str | None:
    """``"bert"``, ``"gpt2"`` or ``"llama"`` from the block classes under ``sch``, else None."""
    names = {type(m).__name__ for m in sch.mod.modules()}
    for fam, classes in _BLOCK_CLASSES.items():
        if names.intersection(classes):
            return fam
    return None


_FOUND: dict[int, tuple[weakref.ref, tuple, list[str]]] = {}


def find_blocks(sch) -> list[str]:
    """Paths (relative to ``sch``) of the repeated transformer blocks, in order (remembered per module and the
    schedule's record: the module tree changes only through recorded calls, and an undo rebuilds the model).

    The blocks of a known family by class (``BertLayer``, ``GPT2Block``, ``LlamaDecoderLayer``); otherwise
    the children of every stack of blocks: the largest ``nn.ModuleList`` whose children all share one class
    and have parameters (lists whose blocks hold dense layers first, so StableLM's per-head q/k norms are not
    taken for its blocks), then each other such list of at least two that is neither inside nor around one
    already taken (Whisper's decoder beside its encoder, CLIP's vision tower beside its text tower), in
    module order; where there is none, a hybrid list of several block classes (:func:`_mixed_blocks`), then the
    longest ``nn.Sequential`` of one block class (:func:`_sequential_blocks`).
    """
    calls = sch.get_top_schedule().record.calls
    stamp = (sch.path, len(calls), id(calls[-1]) if calls else None)
    hit = _FOUND.get(id(sch.mod))
    if hit is not None and hit[0]() is sch.mod and hit[1] == stamp:
        return list(hit[2])
    found = _find_blocks(sch)
    if len(_FOUND) > 10_000:
        _FOUND.clear()
    _FOUND[id(sch.mod)] = (weakref.ref(sch.mod), stamp, found)
    return list(found)


def _find_blocks(sch) -> list[str]:
    fam = detect_family(sch)
    if fam is not None:
        classes = _BLOCK_CLASSES[fam]
        return [p for p, node in sch.named_schedules() if p and type(node.mod).__name__ in classes]
    stacks: list[tuple[int, str, list[str]]] = []  # (order, path, block paths)
    for i, (p, node) in enumerate(sch.named_schedules()):
        if not isinstance(node.mod, nn.ModuleList) or len(node.mod) < 1:
            continue
        kids = list(node.mod)
        if len({type(k) for k in kids}) != 1 or not any(True for _ in kids[0].parameters()):
            continue
        stacks.append((i, p, [f"{p}.{name}" if p else name for name in node.child]))
    taken: list[tuple[int, str, list[str]]] = []
    dense = {p: _has_dense(sch[p].mod[0]) for _, p, _ in stacks}
    # blocks hold dense layers: a list of per-head norms (StableLM's q_layernorm.norms) is no stack of blocks,
    # however long; then the longest first (stable: the first of equal lengths wins)
    for stack in sorted(stacks, key=lambda s: (not dense[s[1]], -len(s[2]))):
        if taken and len(stack[2]) < 2:
            continue
        p = stack[1]
        if any(_nested(p, q) or _nested(q, p) for _, q, _ in taken):
            continue
        taken.append(stack)
    return (
        [b for _, _, blocks in sorted(taken) for b in blocks] or _mixed_blocks(sch) or _sequential_blocks(sch)
    )


def _mixed_blocks(sch) -> list[str]:
    """Where no list of one block class exists: the children of the longest ``nn.ModuleList`` (then of each
    other one neither inside nor around it) whose children are blocks of several classes, each holding a dense
    layer -- a hybrid stack (OLMo-Hybrid's attention and linear-attention layers, Inkling2's full and sliding
    layers, SwiftFormer's convolutional and attention encoders)."""
    lists = []
    for i, (p, node) in enumerate(sch.named_schedules()):
        kids = list(node.mod) if isinstance(node.mod, nn.ModuleList) else []
        if len(kids) < 2 or len({type(k) for k in kids}) < 2:
            continue
        if any(isinstance(k, (nn.ModuleList, nn.ModuleDict)) or not _has_dense(k) for k in kids):
            continue
        lists.append((i, p, [f"{p}.{name}" if p else name for name in node.child]))
    # the innermost lists: a list around another (SwiftFormer's stages around their blocks) holds no blocks
    lists = [s for s in lists if not any(q != s[1] and _nested(q, s[1]) for _, q, _ in lists)]
    taken: list = []
    for stack in sorted(lists, key=lambda s: -len(s[2])):
        if not any(_nested(stack[1], q) or _nested(q, stack[1]) for _, q, _ in taken):
            taken.append(stack)
    return [b for _, _, blocks in sorted(taken) for b in blocks]


def _has_dense(mod: nn.Module) -> bool:
    return any(isinstance(m, (nn.Linear, nn.Conv2d)) or is_conv1d(m) for m in mod.modules())


def _nested(inner: str, outer: str) -> bool:
    """Whether module path ``inner`` is ``outer`` or below it ("" is the root)."""
    return not outer or inner == outer or inner.startswith(outer + ".")


def is_conv1d(mod: nn.Module) -> bool:
    """Whether ``mod`` is Hugging Face's ``Conv1D`` (GPT-2's transposed linear)."""
    return type(mod).__name__ == "Conv1D" and hasattr(mod, "nf")


def _sequential_blocks(sch) -> list[str]:
    """Where no ``nn.ModuleList`` holds blocks: the children of the longest ``nn.Sequential`` whose children share
    one class and hold a dense layer (a user's ``nn.Sequential(*[Block() for _ in range(n)])``)."""
    best: tuple[int, list[str]] | None = None
    for p, node in sch.named_schedules():
        kids = list(node.mod) if isinstance(node.mod, nn.Sequential) else []
        if len(kids) < 2 or len({type(k) for k in kids}) != 1 or not _has_dense(kids[0]):
            continue
        if best is None or len(kids) > best[0]:
            best = (len(kids), [f"{p}.{name}" if p else name for name in node.child])
    return best[1] if best else []


def block_lists(sch) -> list[tuple[str, list[int]]]:
    """``[(path of the list, indices of its blocks)]`` for every stack of :func:`find_blocks` whose blocks are numbered
    children of one ``nn.ModuleList`` (the path is "" when ``sch`` itself is the list), in model order."""
    out: dict[str, list[int]] = {}
    for path in find_blocks(sch):
        parent, _, idx = path.rpartition(".")
        if idx.isdigit():
            out.setdefault(parent, []).append(int(idx))
    return list(out.items())


def block_stack(sch) -> tuple[str | None, int]:
    """``(path of the stack holding the most blocks, its number of blocks)`` among :func:`find_blocks`'s (the
    first of equal stacks), or ``(None, 0)`` for a model without repeated blocks."""
    counts: dict[str, int] = {}
    for b in find_blocks(sch):
        stack = b.rsplit(".", 1)[0] if "." in b else ""
        counts[stack] = counts.get(stack, 0) + 1
    if not counts:
        return None, 0
    stack = max(counts, key=lambda k: counts[k])  # max keeps the first of equals
    return stack, counts[stack]
