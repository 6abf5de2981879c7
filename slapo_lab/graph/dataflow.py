"""One recorded forward pass and the per-level dataflow graphs built from it."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import TYPE_CHECKING

import networkx as nx
import torch
from torch import nn

from ..utils.collector import gc_paused
from ._record import PASSTHROUGH, Call, Recorder
from .tree import count_params, join, snapshot

if TYPE_CHECKING:
    from ..module_state import ModuleMeta

INPUT_PREFIX = ".input:"
OUTPUT_NODE = ".output"
_MAX_EDGE_SHAPES = 3


class DataflowError(RuntimeError):
    """The recorded forward pass failed; ``str()`` is one sentence naming the module that raised.

    Attributes: ``where`` (``"module 'encoder.layer.0'"`` or ``"the model itself"``), ``reason`` (the
    underlying error, one line) and ``meta_bool`` (the pass failed on ``bool()`` of a meta tensor, which
    ``assume_bool`` can guess).
    """

    where: str = "the model itself"
    reason: str = ""
    meta_bool: bool = False


def shape_str(shape) -> str:
    """``(8, 128, 256)`` -> ``"8×128×256"``; a 0-d shape -> ``"scalar"``."""
    return "×".join(str(int(s)) for s in shape) if len(shape) else "scalar"


def _dtype_str(dtype) -> str:
    return str(dtype).replace("torch.", "")


# The real-tensor fallback runs models up to this many parameter and buffer elements (fp32: 800 MB).
REAL_FALLBACK_LIMIT = 200_000_000


def record_dataflow(
    model: nn.Module,
    example_inputs,
    *,
    cache_meta_ops: bool = True,
    assume_bool: bool | None = None,
    real_fallback: bool = True,
) -> Dataflow:
    """Run ONE forward pass of ``model`` under ``torch.no_grad`` and record its dataflow.

    Args:
      model: the model as given (not copied, not moved, train/eval mode untouched).  Normally on the
        ``meta`` device, so the pass allocates nothing and is cheap even for a 70B-parameter model.
      example_inputs: a dict of keyword arguments (``{"input_ids": ids}``) or a tuple of positional
        arguments for ``model.forward``; normally meta tensors of the real shapes, e.g. ``(8, 128)``.
      cache_meta_ops: replay results of out-of-place ops on meta tensors from a cache keyed by the
        op and its argument metadata (shapes, strides, dtypes, scalar values).  Meta kernels are pure
        functions of that metadata, so this only changes speed; set False to run every kernel.
      assume_bool: meta tensors have no values, so a data-dependent ``if t.all():`` fails on them.
        With ``True`` / ``False``, ``bool()`` of a one-element meta tensor returns that value instead
        (a guess: the recorded branch may differ from a real run); every guess is listed in
        ``Dataflow.assumptions`` as ``(module path, "__bool__")``.  ``.item()`` still fails.
        Example: HF BERT with an ``attention_mask`` on meta needs ``assume_bool=True``.
      real_fallback: when the pass fails on meta tensors for another reason than a guessable ``bool()``
        (e.g. DeBERTa-v2's ``Tensor.item()`` on relative positions), record again on a real CPU copy of
        the model (rebuilt from its Hugging Face config, else materialised with small random weights; at
        most :data:`REAL_FALLBACK_LIMIT` elements) with real inputs of the example shapes (the given
        values where real, else zeros, ones for a ``*mask``, standard normal floats).  The result's
        ``fallback`` says so.

    Returns:
      a :class:`Dataflow`: every module call (path, class, call number, named input/output tensor
      shapes and dtypes) and every torch-level op (producer/consumer tensors, module stack).

    Raises:
      DataflowError: if the forward raises (e.g. ``.item()`` on a meta tensor in data-dependent
        control flow) and the real fallback is off, not possible or fails too; the message is one
        sentence naming the innermost module that was running and what to do.
        The recorder's hooks are always removed.  :func:`module_tree` still works without a pass.
      TypeError: if ``model`` is not an ``nn.Module`` or ``example_inputs`` is not a dict/tuple/list.

    Every tensor seen during the pass is kept alive until the Dataflow is dropped (object ids must not
    be reused); on meta that costs nothing, on real tensors it holds all activations.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"record_dataflow needs a torch.nn.Module, got {type(model).__name__}.")
    if isinstance(example_inputs, dict):
        args, kwargs = (), dict(example_inputs)
    elif isinstance(example_inputs, (tuple, list)):
        args, kwargs = tuple(example_inputs), {}
    elif isinstance(example_inputs, torch.Tensor):
        args, kwargs = (example_inputs,), {}
    else:
        raise TypeError(
            "example_inputs must be a dict of keyword arguments or a tuple of positional arguments, "
            f"got {type(example_inputs).__name__}."
        )
    try:
        return _record(model, args, kwargs, cache_meta_ops, assume_bool)
    except DataflowError as err:
        if (
            not real_fallback
            or not _uses_meta(model, args, kwargs)
            or (err.meta_bool and assume_bool is None)
        ):
            raise
        first = err
    what = f"{type(model).__name__}'s forward pass failed on meta tensors in {first.where} ({first.reason})"
    real, why = _real_copy(model)
    if real is None:
        raise DataflowError(
            f"{what} and {why}, so no dataflow was recorded; record it on a real model with real example "
            "inputs (record_dataflow(model, inputs))."
        ) from first
    try:
        flow = _record(real, _real_args(args), _real_args(kwargs), False, assume_bool)
    except DataflowError as err:
        raise DataflowError(
            f"{what} and on a small real copy in {err.where} ({err.reason}), so no dataflow was recorded; "
            "check that the example inputs fit the model (names, shapes, value ranges)."
        ) from err
    flow.fallback = f"recorded on a real CPU copy with real inputs of the example shapes: {what}"
    return flow


def _record(model: nn.Module, args: tuple, kwargs: dict, cache_meta_ops: bool, assume_bool) -> Dataflow:
    modules, path_of = snapshot(model)
    rec = Recorder(path_of, use_cache=cache_meta_ops, assume_bool=assume_bool)
    handles = []
    # the pass allocates thousands of small objects; a full collection over a process holding a big
    # import graph (transformers) costs more than the pass itself, and the pass makes no cycles. A hold, not
    # gc.disable(): the editor records in a background thread, and its end must not turn the collector back on
    # under another thread's paused or deferred block
    with gc_paused():
        try:
            seen = set()
            for mod in model.modules():
                if id(mod) in seen:
                    continue
                seen.add(id(mod))
                handles.append(mod.register_forward_pre_hook(rec.pre_hook, prepend=True, with_kwargs=True))
                handles.append(mod.register_forward_hook(rec.post_hook, with_kwargs=True))
            try:
                with torch.no_grad(), rec:
                    output = model(*args, **kwargs)
            except Exception as e:
                where = rec.innermost_path()
                where = f"module '{where}'" if where else "the model itself"
                msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
                msg = f"{type(e).__name__}: {msg}" if msg else type(e).__name__
                err = DataflowError(f"The forward pass of {type(model).__name__} failed in {where} ({msg}).")
                err.where, err.reason, err.meta_bool = where, msg, rec.meta_bool_failed
                raise err from e
        finally:
            for h in handles:
                h.remove()
    return Dataflow(model, modules, rec, output)


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, (tuple, list)):
        for v in x:
            yield from _tensors(v)


def _uses_meta(model: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether the model or the inputs hold meta tensors (the only passes the real fallback redoes)."""
    held = [*model.parameters(), *model.buffers(), *_tensors(args), *_tensors(kwargs)]
    return any(t.is_meta for t in held)


def _real_args(x, name: str = ""):
    """``x`` with every meta tensor replaced by a real CPU one of its shape and dtype."""
    if isinstance(x, torch.Tensor):
        if not x.is_meta:
            return x
        if x.dtype == torch.bool:
            return torch.ones(x.shape, dtype=torch.bool)
        if x.is_floating_point() or x.is_complex():
            return torch.randn(x.shape, generator=torch.Generator().manual_seed(0)).to(x.dtype)
        return (torch.ones if "mask" in name else torch.zeros)(x.shape, dtype=x.dtype)
    if isinstance(x, dict):
        return {k: _real_args(v, str(k)) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_real_args(v, name) for v in x)
    return x


def _rebuilt_from_config(model: nn.Module) -> nn.Module | None:
    """A transformers model rebuilt on the CPU from its config (real buffers: position ids, rotary tables), in
    its floating dtype; None when ``model`` is none, the config does not rebuild it, or the parameters' names,
    shapes or dtypes differ."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(type(model), "config_class"):
        return None
    shapes = [(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters(remove_duplicate=False)]
    try:
        with torch.device("cpu"):
            out = type(model)(copy.deepcopy(config))
        dtypes = {d for _, _, d in shapes if d.is_floating_point}
        if len(dtypes) == 1:
            out = out.to(next(iter(dtypes)))
        got = [(n, tuple(p.shape), p.dtype) for n, p in out.named_parameters(remove_duplicate=False)]
    except Exception:  # noqa: BLE001 - a model its config does not rebuild: materialise a copy
        return None
    return out if got == shapes else None


def _materialised_copy(model: nn.Module) -> nn.Module:
    """A CPU copy of ``model`` with seeded random floating tensors (``N(0, 0.02)``) and zero integer ones.

    Raises:
        Exception: whatever copying or materialising the model raises (the caller reports it).
    """
    out = copy.deepcopy(model).to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in [*out.parameters(), *out.buffers()]:
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=gen) * 0.02)
            else:
                t.zero_()
    return out


def _real_copy(model: nn.Module) -> tuple[nn.Module | None, str]:
    """A real CPU copy of ``model`` with the same module paths, shapes and modes, or ``(None, why not)``."""
    size = sum(t.numel() for t in [*model.parameters(), *model.buffers()])
    if size > REAL_FALLBACK_LIMIT:
        return None, (
            f"the model is too large for a real copy ({size / 1e6:.0f}M elements, the limit is "
            f"{REAL_FALLBACK_LIMIT / 1e6:.0f}M)"
        )
    out = _rebuilt_from_config(model)
    if out is None:
        try:
            out = _materialised_copy(model)
        except Exception as err:  # noqa: BLE001 - reported as the reason
            return (
                None,
                f"no real copy could be made ({type(err).__name__}: {str(err).splitlines()[0][:120]})",
            )
    for (_, a), (_, b) in zip(
        model.named_modules(remove_duplicate=False), out.named_modules(remove_duplicate=False), strict=False
    ):
        b.training = a.training
    return out, ""


def _add_edge(edge_shapes: dict, u: str, v: str, shape: str) -> None:
    """Note an edge ``u -> v`` carrying a tensor of ``shape`` (each distinct shape once)."""
    lst = edge_shapes.setdefault((u, v), [])
    if shape not in lst:
        lst.append(shape)


class _FrameSources:
    """The source nodes of each tensor version inside one call's op range ``[s, e)``: an input's node, the node
    whose call made it, or (made by an op of the frame's own forward) the sources of that op's inputs."""

    def __init__(self, input_of: dict, producer: list, op_call: list, owner: dict, s: int, e: int) -> None:
        self.input_of, self.producer, self.op_call, self.owner = input_of, producer, op_call, owner
        self.s, self.e = s, e
        self.src_op: dict[int, frozenset] = {}  # direct op -> source nodes

    def sources(self, t: int) -> frozenset:
        """The nodes tensor version ``t`` comes from (none when made outside the range)."""
        inp = self.input_of.get(t)
        if inp is not None:
            return frozenset((inp,))
        p = self.producer[t]
        if p < self.s or p >= self.e:
            return _EMPTY
        node = self.owner.get(self.op_call[p])
        if node is not None:
            return frozenset((node,))
        return self.src_op.get(p, _EMPTY)

    def pass_through(self, o: int, ins: tuple) -> None:
        """Op ``o`` of the frame's own forward: its outputs come from its inputs' sources."""
        acc: set = set()
        for t in ins:
            acc.update(self.sources(t))
        if acc:
            self.src_op[o] = frozenset(acc)


_EMPTY: frozenset = frozenset()


class Dataflow:
    """The recorded forward pass of one model (see :func:`record_dataflow`).

    Attributes:
      model_type: class name of the model.
      calls: list of ``Call`` records in execution (pre-)order.
      num_ops: number of recorded torch-level ops (including synthetic passthroughs).
      cache_hits / cache_misses: meta-op cache statistics of the pass.
      assumptions: ``(module path, "__bool__")`` for every guessed meta bool (see ``assume_bool``).
      fallback: ``""``, or one sentence saying the pass was recorded on a real copy and why (see
        ``real_fallback``).

    The module structure is snapshotted at record time; re-record after changing the model.
    """

    def __init__(self, model: nn.Module, modules: dict, rec: Recorder, output):
        self.model_type = type(model).__name__
        self._modules = modules
        self.calls: list[Call] = rec.calls
        self._producer = rec.producer
        self._shape = rec.shape
        self._dtype = rec.dtype
        self._tensors = rec.tensors  # keep alive: tids refer to these objects
        self._op_func = rec.op_func
        self._op_call = rec.op_call
        self._op_in = rec.op_in
        self._op_out = rec.op_out
        self.output = output
        self.cache_hits = rec.cache_hits
        self.cache_misses = rec.cache_misses
        self.assumptions: list[tuple[str, str]] = list(rec.assumptions)
        self.fallback = ""  # why the pass ran on a real copy instead of meta ("" when it did not)
        self._calls_of: dict[str, list[int]] = {}
        for c in self.calls:
            self._calls_of.setdefault(c.path, []).append(c.index)
        self._param_memo: dict = {}
        # paths with at least one called descendant (or themselves called)
        self._active: set[str] = set()
        for p in self._calls_of:
            while True:
                if p in self._active:
                    break
                self._active.add(p)
                if not p:
                    break
                p = p.rsplit(".", 1)[0] if "." in p else ""

    # -- small queries -----------------------------------------------------------------------------
    @property
    def num_ops(self) -> int:
        return len(self._op_func)

    @property
    def paths(self) -> list[str]:
        """Every module path of the model (``""`` = root), pre-order."""
        return list(self._modules)

    def call_count(self, path: str) -> int:
        """How many times the module at ``path`` ran in the pass (0 if never)."""
        self._check(path)
        return len(self._calls_of.get(path, ()))

    def op_names(self, path: str = "") -> list[str]:
        """Names of the ops run directly in ``path``'s own forward (not in a submodule), all calls."""
        self._check(path)
        out = []
        for ci in self._calls_of.get(path, ()):
            c = self.calls[ci]
            for o in range(c.start, c.end if c.end >= 0 else len(self._op_func)):
                if self._op_call[o] == ci:
                    out.append(getattr(self._op_func[o], "__name__", str(self._op_func[o])))
        return out

    def _check(self, path: str) -> None:
        if not isinstance(path, str) or path not in self._modules:
            raise KeyError(f"No module at path {path!r} in {self.model_type}.")

    def _spec(self, named) -> list[dict]:
        return [
            {
                "name": name,
                "shapes": [tuple(int(s) for s in self._shape[t]) for t in tids],
                "dtypes": [_dtype_str(self._dtype[t]) for t in tids],
            }
            for name, tids in named
        ]

    def params(self, path: str) -> int:
        """Parameter elements in the subtree at ``path`` (shared parameters counted once)."""
        self._check(path)
        return count_params(self._modules, path, self._param_memo)

    def module_info(self, path: str) -> dict:
        """Facts about the module at ``path`` for an inspector panel.

        Returns a dict: ``path``, ``type`` (class name), ``calls`` (times it ran), ``inputs`` /
        ``outputs`` of the first call as ``[{"name", "shapes": [tuple], "dtypes": [str]}]``
        (names are forward argument names / output keys), ``per_call`` (the same for every call),
        ``parameters`` (``{relative name: {"shape": tuple, "dtype": str, "numel": int}}``, whole
        subtree), ``buffers`` (same form), ``params`` (total parameter elements, shared counted
        once), ``children`` (child names).  Shapes are element counts per dimension, as recorded.

        Raises ``KeyError`` (one sentence) when no module has that path.
        """
        self._check(path)
        snap = self._modules[path]
        per_call = [
            {"inputs": self._spec(self.calls[ci].inputs), "outputs": self._spec(self.calls[ci].outputs)}
            for ci in self._calls_of.get(path, ())
        ]
        parameters: dict = {}
        buffers: dict = {}
        stack = [(path, "")]
        while stack:
            p, rel = stack.pop()
            s = self._modules[p]
            for name, _, shape, dtype, numel in s.params:
                parameters[join(rel, name)] = {"shape": shape, "dtype": _dtype_str(dtype), "numel": numel}
            for name, _, shape, dtype, numel in s.buffers:
                buffers[join(rel, name)] = {"shape": shape, "dtype": _dtype_str(dtype), "numel": numel}
            stack.extend((join(p, c), join(rel, c)) for c in reversed(s.children))
        return {
            "path": path,
            "type": snap.type,
            "calls": len(per_call),
            "inputs": per_call[0]["inputs"] if per_call else [],
            "outputs": per_call[0]["outputs"] if per_call else [],
            "per_call": per_call,
            "parameters": parameters,
            "buffers": buffers,
            "params": self.params(path),
            "children": list(snap.children),
        }

    # -- levels ------------------------------------------------------------------------------------
    def _visible_children(self, path: str) -> list[str]:
        """Children of ``path``, with containers lifted: ModuleList / ModuleDict children, and
        children of modules that never ran themselves while something inside them did."""
        out = []
        for name in self._modules[path].children:
            p = join(path, name)
            snap = self._modules[p]
            lift = snap.children and (
                snap.container in ("list", "dict") or (p not in self._calls_of and p in self._active)
            )
            if lift:
                out.extend(self._visible_children(p))
            else:
                out.append(p)
        return out

    def _groups(self, members: list[str], expanded: frozenset, fold: bool) -> list[tuple[str, list[str]]]:
        """Fold runs of same-class siblings of a ModuleList / Sequential into one group."""
        groups: list[tuple[str, list[str]]] = []
        i = 0
        while i < len(members):
            p = members[i]
            parent = p.rsplit(".", 1)[0] if "." in p else ""
            j = i + 1
            if fold and self._modules[parent].container in ("list", "seq"):
                t = self._modules[p].type
                while j < len(members):
                    q = members[j]
                    qp = q.rsplit(".", 1)[0] if "." in q else ""
                    if qp != parent or self._modules[q].type != t:
                        break
                    j += 1
            run = members[i:j]
            if len(run) > 1:
                first = run[0].rsplit(".", 1)[-1]
                last = run[-1].rsplit(".", 1)[-1]
                key = join(parent, f"{first}-{last}")
                if key in expanded:
                    groups.extend((m, [m]) for m in run)
                else:
                    groups.append((key, run))
            else:
                groups.append((p, run))
            i = j
        return groups

    def level_graph(
        self, path: str = "", expanded: Iterable[str] = frozenset(), fold: bool = True
    ) -> nx.DiGraph:
        """The dataflow between the children of the module at ``path`` as a networkx DiGraph.

        Nodes (ids are strings):
          * one per visible child, id = its full module path (``"encoder"``, ``"encoder.layer.3"``);
            ModuleList / ModuleDict containers, and modules that never ran themselves while their
            children did, are see-through (their children are shown instead);
          * folded runs: consecutive same-class children of a ModuleList / Sequential become one node,
            id ``"<container path>.<first>-<last>"`` (e.g. ``"encoder.layer.0-11"``), label
            ``"BertLayer × 12"``, unless that id is in ``expanded`` (or ``fold`` is False);
          * one per forward argument of ``path`` that holds tensors, id ``".input:<name>"``;
          * one ``".output"`` node.  (No module path starts with ".", so ids never collide.)

        Node attributes: ``path`` (module path; the first member for a folded node; ``path`` itself
        for input/output nodes), ``label``, ``sub`` (second display line: class name, member range, or
        shapes), ``type`` (class name; "input"/"output"), ``kind`` in {"module", "folded", "input",
        "output"}, ``params`` (parameter elements, shared counted once), ``count`` (members, 1 unless
        folded), ``members`` (module paths), ``ran`` (whether it ran), ``calls``.

        Edges ``u -> v``: a tensor produced in ``u`` (or an input) is consumed in ``v`` (or returned),
        directly or through ops run in ``path``'s own forward (followed transitively).  Attributes
        ``label`` (shapes such as ``"8×128×256"``, distinct ones joined by ", ") and ``shapes``.
        Children that never ran appear without edges.  When the module at ``path`` never ran, edges
        are taken from its nearest ancestor that did, with everything outside the visible children
        treated as see-through.  All calls of ``path`` are merged.  Graph attributes: ``path``,
        ``model``, ``frame`` (path whose calls gave the edges, or None).

        Raises ``KeyError`` (one sentence) when no module has that path.
        """
        self._check(path)
        expanded = frozenset(expanded)
        children = self._visible_children(path)
        groups = self._groups(children, expanded, fold)
        node_of_path: dict[str, str] = {}
        G = nx.DiGraph(path=path, model=self.model_type, frame=None)

        frame_path, frames = self._frames(path)
        if frames:
            G.graph["frame"] = frame_path
        self._add_input_nodes(G, path, frames)
        for node, members in groups:
            self._add_child_node(G, path, node, members)
            for m in members:
                node_of_path[m] = node
        self._add_output_node(G, path, frames)
        edge_shapes: dict[tuple[str, str], list[str]] = {}
        for f in frames:
            self._frame_edges(f, node_of_path, edge_shapes)
        for (u, v), shapes in edge_shapes.items():
            if u == v and G.nodes[u]["kind"] == "folded":
                continue  # the chain inside a folded run
            label = ", ".join(shapes[:_MAX_EDGE_SHAPES]) + (", …" if len(shapes) > _MAX_EDGE_SHAPES else "")
            G.add_edge(u, v, label=label, shapes=list(shapes))
        return G

    def _frames(self, path: str) -> tuple[str, list[Call]]:
        """``(frame path, its calls)``: the calls whose op ranges give the edges of ``path``'s level, those of
        ``path`` or, when it never ran, of its nearest ancestor that did."""
        frame_path = path
        while frame_path not in self._calls_of and frame_path:
            frame_path = frame_path.rsplit(".", 1)[0] if "." in frame_path else ""
        return frame_path, [self.calls[i] for i in self._calls_of.get(frame_path, ())]

    def _add_input_nodes(self, G: nx.DiGraph, path: str, frames: list[Call]) -> None:
        """One node per forward argument of the ``frames`` that holds tensors (``".input:<name>"``)."""
        input_names: list[str] = []
        for f in frames:
            for name, _ in f.inputs:
                if name not in input_names:
                    input_names.append(name)
        for name in input_names:
            G.add_node(
                INPUT_PREFIX + name,
                path=path,
                label=name,
                sub=self._input_shapes(frames, name),
                type="input",
                kind="input",
                params=0,
                count=1,
                members=[],
                ran=True,
                calls=len(frames),
            )

    def _add_child_node(self, G: nx.DiGraph, path: str, node: str, members: list[str]) -> None:
        """The node of a visible child of ``path``, or of a folded run of same-class ``members``."""
        snap = self._modules[members[0]]
        calls = sum(len(self._calls_of.get(m, ())) for m in members)
        folded = len(members) > 1
        if folded:
            rel = node[len(path) + 1 :] if path else node
            label, sub = f"{snap.type} × {len(members)}", rel
            params = sum(self.params(m) for m in members)
        else:
            rel = members[0][len(path) + 1 :] if path else members[0]
            label, sub = rel, snap.type
            params = self.params(members[0])
        G.add_node(
            node,
            path=members[0],
            label=label,
            sub=sub,
            type=snap.type,
            kind="folded" if folded else "module",
            params=params,
            count=len(members),
            members=list(members),
            ran=any(m in self._active for m in members),
            calls=calls,
        )

    def _add_output_node(self, G: nx.DiGraph, path: str, frames: list[Call]) -> None:
        """The ``".output"`` node, labelled with the shapes the ``frames`` returned."""
        out_shapes = []
        for f in frames:
            for _, tids in f.outputs:
                for t in tids:
                    s = shape_str(self._shape[t])
                    if s not in out_shapes:
                        out_shapes.append(s)
        G.add_node(
            OUTPUT_NODE,
            path=path,
            label="output",
            sub=", ".join(out_shapes[:_MAX_EDGE_SHAPES]),
            type="output",
            kind="output",
            params=0,
            count=1,
            members=[],
            ran=bool(frames),
            calls=len(frames),
        )

    def _input_shapes(self, frames, name) -> str:
        shapes: list[str] = []
        for f in frames:
            for n, tids in f.inputs:
                if n == name:
                    for t in tids:
                        s = shape_str(self._shape[t])
                        if s not in shapes:
                            shapes.append(s)
        return ", ".join(shapes[:_MAX_EDGE_SHAPES])

    def _frame_edges(self, f: Call, node_of_path: dict, edge_shapes: dict) -> None:
        """Add to ``edge_shapes`` (``{(u, v): [shape, ...]}``) the edges between the nodes (``node_of_path``)
        that the ops of call ``f`` show: a tensor made in ``u`` (or an input) used in ``v`` (or returned)."""
        e = f.end if f.end >= 0 else len(self._op_func)
        owner, owner_call = self._call_owners(f, node_of_path, e)
        input_of: dict[int, str] = {}
        for name, tids in f.inputs:
            for t in tids:
                input_of.setdefault(t, INPUT_PREFIX + name)
        flow = _FrameSources(input_of, self._producer, self._op_call, owner, f.start, e)
        op_call, op_in, shape = self._op_call, self._op_in, self._shape
        for o in range(f.start, e):
            node = owner.get(op_call[o])
            if node is None:  # an op of f's own forward (or of a see-through module): pass sources through
                flow.pass_through(o, op_in[o])
                continue
            oc_call = self.calls[owner_call[op_call[o]]]
            self._op_edges(
                op_in[o], node, (oc_call.start, oc_call.end if oc_call.end >= 0 else e), flow, edge_shapes
            )
        for _, tids in f.outputs:
            for t in tids:
                for u in flow.sources(t):
                    _add_edge(edge_shapes, u, OUTPUT_NODE, shape_str(shape[t]))

    def _op_edges(
        self, ins: tuple, node: str, span: tuple[int, int], flow: _FrameSources, edge_shapes: dict
    ) -> None:
        """The edges into ``node`` of an op of its call (ops ``span``: ``[lo, hi)``) from the sources of its
        inputs ``ins`` made outside that call."""
        lo, hi = span
        for t in ins:
            if lo <= self._producer[t] < hi:
                continue  # produced inside the same node call
            for u in flow.sources(t):
                _add_edge(edge_shapes, u, node, shape_str(self._shape[t]))

    def _call_owners(
        self, f: Call, node_of_path: dict, e: int
    ) -> tuple[dict[int, str | None], dict[int, int]]:
        """``(owner node, owner call)`` of every call nested in ``f`` (ops before ``e``; pre-order: parents come
        first): the visible node a call belongs to and that node's call, None / -1 for see-through ones."""
        calls = self.calls
        owner: dict[int, str | None] = {f.index: None}
        owner_call: dict[int, int] = {f.index: -1}
        ci = f.index + 1
        while ci < len(calls) and calls[ci].start < e and calls[ci].depth > f.depth:
            c = calls[ci]
            up = owner.get(c.parent)
            if up is not None:
                owner[ci] = up
                owner_call[ci] = owner_call[c.parent]
            else:
                node = node_of_path.get(c.path)
                owner[ci] = node
                owner_call[ci] = ci if node is not None else -1
            ci += 1
        return owner, owner_call

    def module_tree(self) -> nx.DiGraph:
        """The module tree as snapshotted at record time (same form as :func:`module_tree`)."""
        G = nx.DiGraph(model=self.model_type)
        for path, snap in self._modules.items():
            name = path.rsplit(".", 1)[-1] if path else ""
            G.add_node(
                path,
                path=path,
                name=name,
                label=name or snap.type,
                type=snap.type,
                kind="module",
                params=self.params(path),
                own_params=sum(x[4] for x in snap.params),
                depth=0 if not path else path.count(".") + 1,
                calls=len(self._calls_of.get(path, ())),
            )
        for path, snap in self._modules.items():
            for c in snap.children:
                G.add_edge(path, join(path, c))
        return G


def _fwd_ops(meta: ModuleMeta | None) -> set:
    return {
        op if isinstance(op, str) else getattr(op, "__name__", "fn")
        for mode, op in (meta.syncs if meta else ())
        if str(mode).startswith("fwd_post")
    }


def output_split(mod: nn.Module, state_of) -> tuple[str, int] | None:
    """How one rank holds the output of ``mod`` after sharding: ``("partition", axis)`` (a slice
    along ``axis``), ``("partial", -1)`` (partial sums, all-reduce pending) or None (whole).

    ``state_of(module)`` returns the module's schedule state (``slapo_lab.module_state``: a
    :class:`~slapo_lab.module_state.ModuleMeta`, of which ``output_type``, ``output_axis`` and ``syncs`` are read)
    or None.  Rules (Megatron's column / row
    parallel pairs): the module's own ``output_type`` unless a ``fwd_post`` all-reduce / all-gather
    makes it whole again; a module that is not sharded itself but contains column-parallel modules
    and no row-parallel or gathering one (an attention block's q/k/v, an MLP's up projection)
    outputs a slice on the last axis; one that contains both (a transformer layer) outputs whole.
    """
    meta = state_of(mod)
    ops = _fwd_ops(meta)
    if ops & {"all_reduce", "all_gather"}:
        return None
    kind = meta.output_type if meta else None
    if kind == "partition":
        axis = meta.output_axis
        return ("partition", -1 if axis is None else int(axis))
    if kind == "partial":
        return ("partial", -1)
    col = whole = False
    for sub in mod.modules():
        if sub is mod:
            continue
        m = state_of(sub)
        sub_kind = m.output_type if m else None
        if sub_kind == "partial" or _fwd_ops(m) & {"all_reduce", "all_gather"}:
            whole = True
        elif sub_kind == "partition":
            col = True
    return ("partition", -1) if col and not whole else None


def per_rank_edges(G: nx.DiGraph, world_size: int, module_of, state_of) -> nx.DiGraph:
    """Relabel the edges of a level graph with the shapes ONE rank sees after sharding.

    Args:
      G: a graph from :meth:`Dataflow.level_graph` (edge ``shapes`` are whole-tensor shapes such as
        ``"8×128×768"``); changed in place and returned.
      world_size: ranks the tensor-parallel dimension is split over (nothing changes when 1).
      module_of: ``path -> nn.Module`` (or None when the path is unknown).
      state_of: ``module -> ModuleMeta | None``, e.g. ``slapo_lab.module_state``.

    An edge leaving a node whose output is split (see :func:`output_split`; a folded run uses its
    last member) is labelled with the split dimension as ``whole→per rank``, e.g. ``8×128×768→384``
    on the output of a column-parallel projection with 2 ranks, and ``… partial`` for partial sums;
    the edge's ``tooltip`` says it in words, and ``rank_shapes`` holds the per-rank shape strings.
    Other edges keep their labels.
    """
    if world_size <= 1:
        return G
    for u, _v, attrs in G.edges(data=True):
        node = G.nodes[u]
        if node.get("kind") not in ("module", "folded"):
            continue
        members = node.get("members") or [node.get("path", u)]
        mod = module_of(members[-1])
        split = output_split(mod, state_of) if mod is not None else None
        if split is None:
            continue
        kind, axis = split
        shapes = list(attrs.get("shapes") or [])
        labels, per_rank = [], []
        for st in shapes:
            dims = st.split("×") if st != "scalar" else []
            if kind == "partial" or not dims:
                labels.append(f"{st} partial" if kind == "partial" else st)
                per_rank.append(st)
                continue
            a = axis if axis >= 0 else len(dims) + axis
            if not 0 <= a < len(dims) or not dims[a].isdigit():
                labels.append(st)
                per_rank.append(st)
                continue
            whole = int(dims[a])
            part = whole // world_size if whole % world_size == 0 else -(-whole // world_size)
            labels.append("×".join(dims[:a] + [f"{whole}→{part}"] + dims[a + 1 :]))
            per_rank.append("×".join(dims[:a] + [str(part)] + dims[a + 1 :]))
        if not shapes:
            continue
        attrs["label"] = ", ".join(labels[:_MAX_EDGE_SHAPES]) + (
            ", …" if len(labels) > _MAX_EDGE_SHAPES else ""
        )
        attrs["rank_shapes"] = per_rank
        how = (
            "partial sums on every rank (all-reduce pending)"
            if kind == "partial"
            else f"split over {world_size} ranks on dim {axis}"
        )
        attrs["tooltip"] = (
            f"per rank: {', '.join(per_rank[:_MAX_EDGE_SHAPES])} ({how}); whole: {', '.join(shapes[:3])}"
        )
    return G


__all__ = [
    "PASSTHROUGH",
    "Dataflow",
    "DataflowError",
    "output_split",
    "per_rank_edges",
    "record_dataflow",
    "shape_str",
]
