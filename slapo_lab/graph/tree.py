"""The module tree of a model as a networkx graph (no forward pass needed)."""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx
from torch import nn


@dataclass
class ModuleSnapshot:
    """Structure of one module at one path, taken when the snapshot was made.

    ``params`` / ``buffers``: the module's own tensors, ``[(name, key, shape, dtype, numel)]`` where
    ``key`` is ``id(tensor)`` (used to count shared parameters once).
    """

    path: str
    type: str
    children: list = field(default_factory=list)  # child names, in registration order
    params: list = field(default_factory=list)
    buffers: list = field(default_factory=list)
    container: str | None = None  # "list" (ModuleList), "seq" (Sequential), "dict" (ModuleDict)


def join(path: str, name: str) -> str:
    """Qualified name of child ``name`` of the module at ``path`` ("" is the root)."""
    return f"{path}.{name}" if path else name


def _container_kind(mod: nn.Module) -> str | None:
    """``"list"``, ``"seq"`` or ``"dict"`` for a ModuleList, Sequential or ModuleDict; None otherwise."""
    if isinstance(mod, nn.ModuleList):
        return "list"
    if isinstance(mod, nn.Sequential):
        return "seq"
    if isinstance(mod, nn.ModuleDict):
        return "dict"
    return None


def _snapshot_one(path: str, mod: nn.Module) -> ModuleSnapshot:
    """The :class:`ModuleSnapshot` of ``mod`` at ``path``: its class, container kind, own parameters and
    buffers (``(name, id, shape, dtype, numel)``); children are added by :func:`snapshot`."""
    snap = ModuleSnapshot(path, type(mod).__name__, container=_container_kind(mod))
    for name, p in mod._parameters.items():
        if p is not None:
            snap.params.append((name, id(p), tuple(p.shape), p.dtype, p.numel()))
    for name, b in mod._buffers.items():
        if b is not None:
            snap.buffers.append((name, id(b), tuple(b.shape), b.dtype, b.numel()))
    return snap


def snapshot(model: nn.Module) -> tuple[dict, dict]:
    """Walk ``named_children`` from the root.

    Returns ``(modules, path_of)``: path -> :class:`ModuleSnapshot` for every path (a module shared
    under two names appears at both), and ``id(module)`` -> its first path (pre-order).
    """
    modules: dict[str, ModuleSnapshot] = {}
    path_of: dict[int, str] = {}
    stack = [("", model, ())]
    while stack:
        path, mod, ancestors = stack.pop()
        snap = _snapshot_one(path, mod)
        modules[path] = snap
        path_of.setdefault(id(mod), path)
        kids = []
        for name, child in mod._modules.items():
            if child is None or id(child) in ancestors:
                continue
            snap.children.append(name)
            kids.append((join(path, name), child, ancestors + (id(mod),)))
        stack.extend(reversed(kids))
    return modules, path_of


def count_params(modules: dict, path: str, memo: dict | None = None) -> int:
    """Number of parameter elements in the subtree at ``path``; a shared parameter counts once."""
    if memo is not None and path in memo:
        return memo[path]
    seen: dict[int, int] = {}
    stack = [path]
    while stack:
        p = stack.pop()
        snap = modules[p]
        for _, key, _, _, numel in snap.params:
            seen[key] = numel
        stack.extend(join(p, c) for c in snap.children)
    total = sum(seen.values())
    if memo is not None:
        memo[path] = total
    return total


def module_tree(model: nn.Module) -> nx.DiGraph:
    """The module hierarchy of ``model`` as a tree, from ``named_children`` only (no forward pass).

    Nodes are qualified module paths (``""`` is the root, ``"encoder.layer.0"``...), with attributes
    ``path`` (same string), ``name`` (last path component, ``""`` for the root), ``label`` (name, or
    the class name for the root), ``type`` (class name), ``params`` (parameter elements in the
    subtree, shared parameters counted once), ``own_params`` (the module's own parameters only) and
    ``depth`` (0 for the root).  Edges go parent -> child in registration order.  A module registered
    under two names appears under both paths.  Works on any device, including ``meta``.

    Raises ``TypeError`` when ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"module_tree needs a torch.nn.Module, got {type(model).__name__}.")
    modules, _ = snapshot(model)
    memo: dict = {}
    G = nx.DiGraph(model=type(model).__name__)
    for path, snap in modules.items():
        name = path.rsplit(".", 1)[-1] if path else ""
        G.add_node(
            path,
            path=path,
            name=name,
            label=name or snap.type,
            type=snap.type,
            kind="module",
            params=count_params(modules, path, memo),
            own_params=sum(x[4] for x in snap.params),
            depth=0 if not path else path.count(".") + 1,
        )
    for path, snap in modules.items():
        for c in snap.children:
            G.add_edge(path, join(path, c))
    return G
