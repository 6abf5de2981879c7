"""Which module of a block computes an attention: the owner of its head count, read from where the op ran.

:mod:`slapo_lab.sharding.infer` names an attention module by its q / k / v projections' common parent. Where one
fused projection sits in a wrapper of its own (LeViT's ``queries_keys_values`` is an ``MLPLayerWithBN``:
``Linear -> BatchNorm1d``; its head count, ``num_attention_heads``, and the widths derived from it live on the
``LevitAttention`` around it, whose ``forward`` runs the score matmuls), that parent is the wrapper, and the
head attributes :mod:`slapo_lab.sharding.heads` localises are never found: the sharded forward then views this
rank's features into all heads (``split_with_sizes expects split_sizes to sum exactly to 32``).

:func:`capture` keeps, while a block's first forward is recorded, the stack of its modules whose ``forward``
is running; the recorder notes the innermost one when an attention op runs (:func:`current`), and
:func:`owner` returns the common parent of that module and the q / k / v projections' parents: the module whose
forward both made (or received) the projections and ran the attention. For a layout where the attention runs
in the projections' own parent (Llama's ``self_attn``, BERT's ``attention.self``) or in a parameterless inner
module of it (an ``attn_fn``), the result is the projections' parent, as before.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Collection, Iterable
from typing import TYPE_CHECKING, Any

from torch import nn

from .class_source import runtime_methods
from .infer_maps import _is_dense
from .infer_registry import lookup

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from .infer_maps import BlockSplit
    from .infer_recorder import _Recorder


def capture(bpath: str, block: nn.Module, rec: _Recorder) -> list[RemovableHandle]:
    """Forward pre- and post-hooks on every module inside ``block`` (the block aside) that keep
    ``rec.site_stacks[bpath]`` (paths relative to the block) while it runs; the block's own pre-hook makes
    ``bpath`` the current block (``rec.site_block``). Returns the hook handles."""
    stacks = rec.__dict__.setdefault("site_stacks", {})
    stack = stacks.setdefault(bpath, [])
    handles = []

    def block_pre(_m, _args):
        rec.site_block = bpath
        stack.clear()

    handles.append(block.register_forward_pre_hook(block_pre))
    for rel, m in block.named_modules():
        if not rel:
            continue

        def pre(_m, _args, rel=rel):
            stack.append(rel)

        def post(_m, _args, _out, rel=rel):
            if stack and stack[-1] == rel:
                stack.pop()
            elif rel in stack:  # an exception unwound past inner modules: drop them with it
                del stack[stack.index(rel) :]

        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post, always_call=True))
    return handles


def current(rec: _Recorder) -> str | None:
    """The innermost module (path relative to the block) running now, ``""`` for the block itself, or None
    when nothing was captured."""
    stacks = getattr(rec, "site_stacks", None)
    if not stacks:
        return None
    stack = stacks.get(getattr(rec, "site_block", None))
    if stack is None:
        return None
    return stack[-1] if stack else ""


def owner(parent: str, where: str | None) -> str:
    """The attention module: the common parent of ``parent`` (the q / k / v projections' common parent) and
    ``where`` (the module that ran the attention op, :func:`current`); ``parent`` when ``where`` is None or
    lies inside it."""
    if where is None or where == parent or where.startswith(parent + ".") or not parent:
        return parent
    a, b = parent.split("."), where.split(".") if where else []
    out = []
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        out.append(x)
    return ".".join(out)


def register(
    block: nn.Module, split: BlockSplit, registry: dict, digest: Callable[[Any], str | None]
) -> None:
    """Make a projection that sits in a wrapper of its own inside its attention module visible to the shard
    rules under that attention module: ``registry[(attention class, path from it, config digest)]`` (the key
    :func:`slapo_lab.sharding.infer.lookup` reads) for every q / k / v / o role whose direct parent is not the
    attention module (LeViT's ``queries_keys_values.linear`` / ``projection.linear`` under ``LevitAttention``).
    ``digest`` is infer's config digest function."""
    for apath in split.attention:
        attn = block.get_submodule(apath) if apath else block
        key_digest = digest(getattr(attn, "config", None))
        for rel, role in split.roles.items():
            if not (role == "o" or set(role) <= set("qkvg")):
                continue
            inner = rel[len(apath) + 1 :] if apath else rel
            if apath and not rel.startswith(apath + "."):
                continue  # outside this attention module
            if "." in inner:  # (a direct child is registered under its parent already)
                registry[(type(attn).__name__, inner, key_digest)] = (role, split.layouts.get(rel), None)


def output_width(attn: nn.Module) -> int | None:
    """The attention output's global width: the in-features of ``attn``'s output projection (the linear inside
    it with the inferred role ``"o"``, :func:`slapo_lab.sharding.infer.lookup`), read from its unsharded
    shape; None when it has none."""
    for rel, m in attn.named_modules():
        if not rel or not _is_dense(m):
            continue
        prel, _, name = rel.rpartition(".")
        found = lookup(attn, rel) or lookup(attn.get_submodule(prel) if prel else attn, name)
        if found is not None and found[0] == "o":
            shape = getattr(m.weight, "orig_shape", m.weight.shape)
            conv1d = type(m).__name__ == "Conv1D"  # HF Conv1D stores (in, out)
            return int(shape[0] if conv1d else shape[1])
    return None


def lift(top: nn.Module, path: str, parent: nn.Module | None, child: str) -> tuple[nn.Module | None, str]:
    """The ``(parent, child name)`` a shard rule should see for the module at ``path`` of ``top``: the attention
    module around it and the path from there, where :func:`register` registered that pair (the nearest
    ancestor, at most 3 levels up); else ``(parent, child)`` unchanged."""
    parts = path.split(".") if path else []
    for j in range(len(parts) - 2, max(len(parts) - 5, -1), -1):
        try:
            anc = top.get_submodule(".".join(parts[:j]))
        except AttributeError:
            return parent, child
        rel = ".".join(parts[j:])
        if lookup(anc, rel) is not None:
            return anc, rel
    return parent, child


def width_attrs(attn: nn.Module, read_attrs: Iterable[str], known: Collection[str]) -> list[str]:
    """The attributes (not in ``known``) that ``attn``'s class reshapes to at run time (``self.<name>`` as an
    argument of a ``view`` / ``reshape`` call in a method other than ``__init__``) and that hold the attention
    output's width read from the dataflow (:func:`output_width`): LeViT's ``reshape(batch, seq,
    self.out_dim_projection)``, Hiera's ``reshape(batch, -1, self.hidden_size_output)``. They are per-rank
    widths once the heads are split (:func:`slapo_lab.sharding.heads.plan_local_heads` rewrites them with the
    head counts). ``read_attrs`` are the attributes the class reads at run time."""
    width = output_width(attn)
    if width is None:
        return []
    reshaped = _reshaped_attrs(type(attn))
    read_attrs = set(read_attrs) if reshaped is None else set(read_attrs) & reshaped
    return sorted(
        a
        for a in read_attrs
        if a not in known and type(getattr(attn, a, None)) is int and getattr(attn, a) == width
    )


def _reshaped_attrs(cls: type) -> set[str] | None:
    """``self`` attributes passed to a ``view`` / ``reshape`` call by ``cls``'s methods other than
    ``__init__``; None when the class has no source to read."""
    methods = runtime_methods(cls)
    if methods is None:
        return None
    out = set()
    for fn in methods:
        for node in ast.walk(fn):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr
                in (
                    "view",
                    "reshape",
                )
            ):
                for a in node.args:
                    if (
                        isinstance(a, ast.Attribute)
                        and isinstance(a.value, ast.Name)
                        and a.value.id == "self"
                    ):
                        out.add(a.attr)
    return out
