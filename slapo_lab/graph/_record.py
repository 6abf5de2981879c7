"""One recorded forward pass: module calls and torch-level ops, tensors identified by object.

Internal module; the public entry point is :func:`slapo_lab.graph.record_dataflow`.

Recording model
---------------
* Every tensor *version* gets an integer id (``tid``).  A tensor object gets a new tid each time an
  op returns it (in-place ops, ops that return an input unchanged), so data flow through mutation is
  kept.  Tensors never produced by a recorded op (parameters, buffers, graph inputs, constants made
  outside the pass) get a tid with producer ``-1``.
* Every ``__torch_function__``-level call that returns at least one tensor is an op: it stores the
  innermost module call on the stack, its input tids and its output tids.  Ops are numbered in
  execution order, so the ops of one module call (including its submodules) form the contiguous
  range ``[call.start, call.end)``.
* Every call of a module of the model is a ``Call`` (path, call number, parent call, op range, named
  input and output tensors).  When a module returns a tensor it did not produce (``nn.Identity``, a
  parameter, a passed-through input), a synthetic ``passthrough`` op inside the call re-versions it,
  so consumers see that module as the producer.

Speed: on meta tensors the cost of a forward is almost entirely torch's Python meta kernels.  Those
are pure functions of the input metadata, so results of out-of-place ops on meta tensors are cached
by (function, argument metadata) and replayed as fresh meta tensors of the recorded shape, stride,
offset and dtype.  Repeated layers therefore cost a dictionary lookup per op.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

try:  # torch internals: where the helper moved, no constructor is known (the set is empty)
    from torch.utils._device import _device_constructors as _torch_device_constructors
except ImportError:  # pragma: no cover - torch internals moved
    _torch_device_constructors = None

_Tensor = torch.Tensor
_META = torch.device("meta")
_BOOL = torch.Tensor.__bool__

# Argument types that are hashable and whose value fully describes them.
_ATOM_TYPES = frozenset(
    {
        int,
        float,
        bool,
        complex,
        str,
        type(None),
        type(Ellipsis),
        torch.dtype,
        torch.device,
        torch.memory_format,
        torch.layout,
    }
)

# In-place dunders (Python operator protocol) and other functions whose results must not be cached.
_NO_CACHE_NAMES = frozenset(
    {
        "__iadd__",
        "__isub__",
        "__imul__",
        "__itruediv__",
        "__ifloordiv__",
        "__imod__",
        "__ipow__",
        "__iand__",
        "__ior__",
        "__ixor__",
        "__ilshift__",
        "__irshift__",
        "__imatmul__",
        "__setitem__",
        "__get__",
        "__set__",
        "__delitem__",
        "__deepcopy__",
        "__reduce_ex__",
        "__setstate__",
        "__torch_function__",
        "item",
        "tolist",
        "numpy",
        "data_ptr",
        "backward",
        "register_hook",
        "retain_grad",
        "set_",
        "untyped_storage",
        "storage",
    }
)


def _meta_grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """``torch._grouped_mm`` on meta tensors: the output of the shape and dtype a CPU or GPU kernel gives.

    torch's meta kernel for ``_grouped_mm`` enforces the CUDA kernel's limits (bfloat16 only, 16-byte
    aligned strides), so an fp32 model that runs fine on CPU -- HF's default ``grouped_mm`` experts of
    Mixtral / Qwen3-MoE in transformers 5.x -- could not be recorded on meta at all. Shapes follow
    ``torch._meta_registrations._create_grouped_mm_output_tensor`` (2-D x 3-D -> ``(M, N)``, 3-D x 3-D ->
    ``(G, M, N)``, 2-D x 2-D -> ``(len(offs), M, N)``, 3-D x 2-D -> ``(M, N)``).
    """
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    if a2 and b2:
        size = (offs.shape[0], mat_a.shape[0], mat_b.shape[1])
    elif a2:
        size = (mat_a.shape[0], mat_b.shape[-1])
    elif b2:
        size = (mat_a.shape[1], mat_b.shape[1])
    else:
        size = (mat_a.shape[0], mat_a.shape[1], mat_b.shape[-1])
    return torch.empty(size, dtype=out_dtype or mat_a.dtype, device=_META)


# ops whose meta kernels refuse inputs their CPU kernels accept: replaced on meta by a shape-only version
_META_OVERRIDES = {torch._grouped_mm: _meta_grouped_mm} if hasattr(torch, "_grouped_mm") else {}


class PassThrough:
    """Marker "function" of the synthetic op that re-versions a tensor a module returns unchanged."""

    __name__ = "passthrough"

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return "passthrough"


PASSTHROUGH = PassThrough()


@dataclass
class Call:
    """One call of one module of the model.

    ``inputs``/``outputs``: list of ``(name, tids)``, name = forward argument name (``"args[3]"`` for
    ``*args``) or output name (``"output"``, ``"output[1]"``, a ModelOutput / dict key).
    ``start``/``end``: op index range ``[start, end)``; ``end`` is -1 while running or if the call
    never returned (an exception inside it).
    """

    index: int
    path: str
    n: int  # call number of this module, 0-based
    parent: int  # index of the enclosing call, -1 for the outermost
    depth: int
    start: int
    end: int = -1
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)


def _collect(obj, out: list, depth: int = 0) -> None:
    """Append every tensor in ``obj`` (nested tuple / list / dict / ModelOutput) to ``out``."""
    if isinstance(obj, _Tensor):
        out.append(obj)
    elif depth < 6:
        tp = type(obj)
        if tp is tuple or tp is list or isinstance(obj, (tuple, list)):
            for x in obj:
                _collect(x, out, depth + 1)
        elif isinstance(obj, dict):
            for x in obj.values():
                _collect(x, out, depth + 1)


def _scan(a, ins: list, key: list) -> bool:
    """Collect tensors of one argument into ``ins`` and a hashable description into ``key``.

    Returns False when the argument cannot be described (then the op is not cached).
    """
    tp = type(a)
    if tp in _ATOM_TYPES:
        key.append(tp)
        key.append(a)
        return True
    if isinstance(a, _Tensor):
        ins.append(a)
        if not a.is_meta:
            return False
        key.append((tp, a.shape, a.stride(), a.storage_offset(), a.dtype))
        return True
    if tp is tuple or tp is list or tp is torch.Size:
        key.append(tp)
        key.append(len(a))
        ok = True
        for x in a:
            if not _scan(x, ins, key):
                ok = False
        return ok
    if tp is slice:
        key.append(slice)
        ok = _scan(a.start, ins, key)
        ok = _scan(a.stop, ins, key) and ok
        return _scan(a.step, ins, key) and ok
    _collect(a, ins)
    return False


def _describe(out, ins: list):
    """Cache entry for an op result, or None when the result is not a plain (tuple of) meta tensor."""
    tp = type(out)
    if tp is _Tensor:
        spec = _tensor_spec(out, ins)
        return None if spec is None else (0, spec)
    if tp is tuple or tp is list:
        specs = []
        for o in out:
            if type(o) is not _Tensor:
                return None
            spec = _tensor_spec(o, ins)
            if spec is None:
                return None
            specs.append(spec)
        return (1 if tp is tuple else 2, tuple(specs))
    return None


def _tensor_spec(t: _Tensor, ins: list):
    for i, x in enumerate(ins):
        if x is t:
            return (i,)
    if not t.is_meta or t.requires_grad:
        return None
    return (t.shape, t.stride(), t.storage_offset(), t.dtype)


def _make(spec, ins: list) -> _Tensor:
    if len(spec) == 1:
        return ins[spec[0]]
    shape, stride, offset, dtype = spec
    if offset == 0:
        return torch.empty_strided(shape, stride, dtype=dtype, device=_META)
    extent = 1 + sum((s - 1) * st for s, st in zip(shape, stride, strict=False)) if all(shape) else 0
    base = torch.empty((offset + extent,), dtype=dtype, device=_META)
    return base.as_strided(shape, stride, offset)


def _materialize(entry, ins: list):
    kind, body = entry
    if kind == 0:
        return _make(body, ins)
    outs = [_make(s, ins) for s in body]
    return tuple(outs) if kind == 1 else outs


# Global cache of meta-op results: (func, argument metadata) -> output description.  Pure functions of
# metadata, so it is valid across passes and models; bounded to keep memory flat.
_META_CACHE: dict = {}
_META_CACHE_MAX = 200_000
_FUNC_CACHEABLE: dict = {}


def _func_cacheable(func) -> bool:
    try:
        return _FUNC_CACHEABLE[func]
    except KeyError:
        pass
    except TypeError:  # unhashable callable
        return False
    name = getattr(func, "__name__", "") or ""
    ok = not (
        name in _NO_CACHE_NAMES
        or (name.endswith("_") and not name.endswith("__"))
        or func in _device_constructors()
    )
    _FUNC_CACHEABLE[func] = ok
    return ok


_FUNC_MUTATING: dict = {}
_INPLACE_DUNDERS = frozenset(
    {
        "__iadd__",
        "__isub__",
        "__imul__",
        "__itruediv__",
        "__ifloordiv__",
        "__imod__",
        "__ipow__",
        "__iand__",
        "__ior__",
        "__ixor__",
        "__ilshift__",
        "__irshift__",
        "__imatmul__",
        "__setitem__",
    }
)


def _func_mutating(func) -> bool:
    """Whether ``func`` mutates its first tensor argument (``add_``, ``__iadd__``, ``__setitem__``)."""
    try:
        return _FUNC_MUTATING[func]
    except KeyError:
        pass
    except TypeError:
        return True
    name = getattr(func, "__name__", "") or ""
    m = name in _INPLACE_DUNDERS or (name.endswith("_") and not name.endswith("__"))
    _FUNC_MUTATING[func] = m
    return m


_DEVICE_CTORS: frozenset | None = None


def _device_constructors() -> frozenset:
    """The torch functions that take a ``device=`` and build a tensor (torch's own list), read once."""
    global _DEVICE_CTORS
    if _DEVICE_CTORS is None:
        try:
            _DEVICE_CTORS = frozenset(_torch_device_constructors())
        except (TypeError, AttributeError):  # pragma: no cover - torch internals moved
            _DEVICE_CTORS = frozenset()
    return _DEVICE_CTORS


_POS_NAMES: dict = {}


def _positional_names(mod) -> tuple:
    """Names of the positional parameters of ``mod.forward`` (cached per class)."""
    cls = type(mod)
    own = "forward" in mod.__dict__
    if not own:
        try:
            return _POS_NAMES[cls]
        except KeyError:
            pass
    names = []
    try:
        sig = inspect.signature(mod.forward)
        for p in sig.parameters.values():
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                names.append(p.name)
            else:
                break
    except (TypeError, ValueError):
        pass
    names = tuple(names)
    if not own:
        _POS_NAMES[cls] = names
    return names


def _scan_call(args: tuple, kwargs: dict, ins: list, key: list) -> bool:
    """:func:`_scan` every argument of a call into ``ins`` (tensors) and ``key`` (the cache key); False when the
    call cannot be cached (an argument :func:`_scan` refuses, or a write: ``out=`` / ``inplace=True``)."""
    ok = True
    for a in args:
        if not _scan(a, ins, key):
            ok = False
    if kwargs:
        if "out" in kwargs or kwargs.get("inplace") is True:
            ok = False
        for k, v in kwargs.items():
            key.append(k)
            if not _scan(v, ins, key):
                ok = False
    return ok


def _output_pairs(output: object) -> list[tuple[str, object]]:
    """``[(name, value)]`` of a module's output: ``output``, its dict items, or ``output[i]``."""
    if isinstance(output, _Tensor):
        return [("output", output)]
    if isinstance(output, dict):
        return list(output.items())
    if isinstance(output, (tuple, list)):
        return [(f"output[{i}]", o) for i, o in enumerate(output)]
    return []


def _tensor_outputs(out: object) -> tuple | list:
    """The tensors an op returned: ``out`` itself, or those of a tuple or list."""
    if isinstance(out, _Tensor):
        return (out,)
    if isinstance(out, (tuple, list)):
        return [o for o in out if isinstance(o, _Tensor)]
    return ()


def _is_one_of(o: object, ins: list) -> bool:
    """Whether ``o`` is (the same object as) one of ``ins``."""
    for t in ins:
        if t is o:
            return True
    return False


class Recorder(TorchFunctionMode):
    """TorchFunctionMode + module hooks that build the op / call lists of one pass."""

    def __init__(self, path_of: dict, use_cache: bool = True, assume_bool: bool | None = None):
        super().__init__()
        self.path_of = path_of  # id(module) -> path
        self.use_cache = use_cache
        self.assume_bool = assume_bool
        self.assumptions: list = []  # (module path, function name) where a meta bool was assumed
        # bool() of a meta tensor reached torch (and failed there): a failure assume_bool can guess past
        self.meta_bool_failed = False
        self.tensors: list = []  # tid -> tensor (keeps every seen tensor alive: ids stay unique)
        self.tid_of: dict = {}  # id(tensor) -> latest tid
        self.producer: list = []  # tid -> op index, -1 for tensors from outside the pass
        self.shape: list = []  # tid -> torch.Size
        self.dtype: list = []  # tid -> torch.dtype
        self.op_func: list = []
        self.op_call: list = []
        self.op_in: list = []  # tuple of tids
        self.op_out: list = []  # tuple of tids
        self.calls: list[Call] = []
        self.ncalls: dict = {}
        self.stack: list = [-1]
        self.cache_hits = 0
        self.cache_misses = 0

    # -- tensors -------------------------------------------------------------------------------
    def _new_tid(self, t: _Tensor, prod: int) -> int:
        tid = len(self.producer)
        self.tensors.append(t)
        self.tid_of[id(t)] = tid
        self.producer.append(prod)
        self.shape.append(t.shape)
        self.dtype.append(t.dtype)
        return tid

    def _tid(self, t: _Tensor) -> int:
        tid = self.tid_of.get(id(t))
        if tid is None:
            tid = self._new_tid(t, -1)
        return tid

    def _named(self, pairs) -> list:
        named = []
        for name, obj in pairs:
            leaves: list = []
            _collect(obj, leaves)
            if leaves:
                named.append((name, tuple(self._tid(t) for t in leaves)))
        return named

    # -- ops -----------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if func is _BOOL and args and isinstance(args[0], _Tensor) and args[0].is_meta:
            assumed = self._meta_bool(args[0])
            if assumed is not None:
                return assumed
        ins: list = []
        recorded = func  # the op as the model called it (an override only computes its meta result)
        override = _META_OVERRIDES.get(func) if _META_OVERRIDES else None
        if override is not None and args and isinstance(args[0], _Tensor) and args[0].is_meta:
            func = override
        if self.use_cache and _func_cacheable(func):
            out = self._call_cached(func, args, kwargs, ins)
        else:
            for a in args:
                _collect(a, ins)
            for v in kwargs.values():
                _collect(v, ins)
            out = func(*args, **kwargs)
        outs = _tensor_outputs(out)
        mutating = _func_mutating(func) or (
            bool(kwargs) and ("out" in kwargs or kwargs.get("inplace") is True)
        )
        if mutating and not outs and ins and getattr(func, "__name__", "") == "__setitem__":
            outs = (ins[0],)  # x[i] = y mutates x
        if outs:
            self._record_op(recorded, ins, outs, mutating)
        return out

    def _meta_bool(self, t: _Tensor) -> bool | None:
        """``bool()`` of the meta tensor ``t``: the assumed value (noted in ``assumptions``) for a one-element
        tensor when ``assume_bool`` is set; else None, and the call fails (``meta_bool_failed``)."""
        if self.assume_bool is not None and t.numel() == 1:
            top = self.stack[-1]
            self.assumptions.append((self.calls[top].path if top >= 0 else "", "__bool__"))
            return self.assume_bool
        self.meta_bool_failed = True
        return None

    def _call_cached(self, func: Callable, args: tuple, kwargs: dict, ins: list) -> object:
        """``func(*args, **kwargs)``, its meta result rebuilt from :data:`_META_CACHE` where the same op on the
        same input shapes ran before (no grad, nothing written); ``ins`` gets the input tensors."""
        key = [func]
        ok = _scan_call(args, kwargs, ins, key)
        if not (ok and ins and torch.is_grad_enabled() is False):
            return func(*args, **kwargs)
        key.append(torch.get_default_dtype())
        key = tuple(key)
        try:
            entry = _META_CACHE.get(key)
        except TypeError:
            return func(*args, **kwargs)
        if entry is not None:
            out = _materialize(entry, ins)
            self.cache_hits += 1
            return out
        out = func(*args, **kwargs)
        self.cache_misses += 1
        entry = _describe(out, ins)
        if entry is not None:
            if len(_META_CACHE) >= _META_CACHE_MAX:
                _META_CACHE.clear()
            _META_CACHE[key] = entry
        return out

    def _record_op(self, recorded: Callable, ins: list, outs: tuple | list, mutating: bool) -> None:
        """Record one op (``recorded``) from the tensor versions of ``ins`` to new versions of ``outs``; a
        non-mutating op that returns an input as is (``x.to(same dtype)``, ``contiguous()``) makes no new
        version, and an op that makes none is not recorded."""
        tid_of = self.tid_of
        in_tids = []
        for t in ins:
            tid = tid_of.get(id(t))
            if tid is None:
                tid = self._new_tid(t, -1)
            in_tids.append(tid)
        op = len(self.op_func)
        out_tids = [self._new_tid(o, op) for o in outs if mutating or not _is_one_of(o, ins)]
        if not out_tids:
            return
        self.op_func.append(recorded)
        self.op_call.append(self.stack[-1])
        self.op_in.append(tuple(in_tids))
        self.op_out.append(tuple(out_tids))

    # -- module hooks ---------------------------------------------------------------------------
    def pre_hook(self, mod, args, kwargs):
        path = self.path_of.get(id(mod))
        if path is None:
            return
        with torch._C.DisableTorchFunction():
            n = self.ncalls.get(path, 0)
            self.ncalls[path] = n + 1
            parent = self.stack[-1]
            depth = self.calls[parent].depth + 1 if parent >= 0 else 0
            ci = len(self.calls)
            call = Call(ci, path, n, parent, depth, len(self.op_func))
            names = _positional_names(mod)
            pairs = [(names[i] if i < len(names) else f"args[{i}]", a) for i, a in enumerate(args)]
            pairs.extend(kwargs.items())
            call.inputs = self._named(pairs)
            self.calls.append(call)
            self.stack.append(ci)
        return

    def post_hook(self, mod, args, kwargs, output):
        path = self.path_of.get(id(mod))
        if path is None:
            return
        with torch._C.DisableTorchFunction():
            stack = self.stack
            # find this module's call (stale entries above it belong to calls that raised and were
            # caught inside the forward)
            j = len(stack) - 1
            while j > 0 and self.calls[stack[j]].path != path:
                j -= 1
            if j <= 0:
                return
            ci = stack[j]
            call = self.calls[ci]
            named = []
            for name, obj in _output_pairs(output):
                leaves: list = []
                _collect(obj, leaves)
                tids = [self._output_tid(t, ci, call.start) for t in leaves]
                if tids:
                    named.append((name, tuple(tids)))
            call.outputs = named
            end = len(self.op_func)
            for k in stack[j:]:
                self.calls[k].end = end
            del stack[j:]
        return

    def _output_tid(self, t: _Tensor, ci: int, start: int) -> int:
        """The version of ``t`` that call ``ci`` (whose ops start at ``start``) returns: a tensor returned
        unchanged gets a new version made inside the call (a pass-through op)."""
        tid = self._tid(t)
        if self.producer[tid] >= start:
            return tid
        op = len(self.op_func)
        self.op_func.append(PASSTHROUGH)
        self.op_call.append(ci)
        self.op_in.append((tid,))
        tid = self._new_tid(t, op)
        self.op_out.append((tid,))
        return tid

    def innermost_path(self) -> str | None:
        """Path of the innermost module call still open (the one that raised), or None."""
        if len(self.stack) > 1:
            return self.calls[self.stack[-1]].path
        return None
