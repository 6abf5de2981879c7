"""Read a block's tensor-parallel split from its recorded dataflow, not from its layers' names.

One forward of the model (real, shrunk or on the meta device, with one sample of example inputs) runs under a
:class:`torch.overrides.TorchFunctionMode` until the first block of every stack of blocks has run. Inside those
blocks every ``nn.Linear`` / HF ``Conv1D`` output, every parameter of another module and every attention output
gets an *index map*: an integer tensor of the same shape whose entries are the feature (or parameter entry) each
element came from. Shape ops (``view``, ``transpose``, ``chunk``, ``split``, ``unbind``, indexing, ``cat``,
``expand`` ...) are replayed on the maps, elementwise ops carry them (rotary embeddings, per-head norms,
activations, gating), anything else drops them. Where maps meet attention -- ``scaled_dot_product_attention``,
or a matmul of two mapped tensors whose scores a second matmul applies to a mapped value -- each q / k / v
argument's heads axis (``-3``) tells which features of which projection belong to which head:

* q / k / v projections, fused ones included, with the head and key/value head counts (``q.shape[-3]``, the
  distinct key heads) and the layout a column-parallel shard needs: the first of stride 1 (contiguous, e.g.
  GPT-NeoX's per-head interleaved ``query_key_value``: ``view(B, T, H, 3 * hd)`` then ``chunk(3)``), equal
  blocks (ModernBERT's ``Wqkv``: ``view(B, T, 3, H, hd)``) or blocks of unequal sizes (GPT-BigCode's
  ``split((H*hd, kv*hd, kv*hd))``) whose per-rank features are exactly the features of that rank's heads; with
  fewer key/value heads than ranks in a fused projection (multi-query attention: GPT-BigCode's ``c_attn``,
  Falcon's ``query_key_value``) the key/value blocks are kept by the ranks whose query heads use them (a
  ``BlockStride`` with ``groups``, Megatron-LM / vLLM key/value replication);
* a projection whose features reach every head (MLA's ``kv_a_proj_with_mqa`` rope part, broadcast over the
  heads) or also feed something else stays whole (a low-rank "a" of an a -> norm -> b chain);
* the output projection: the linear whose input is the attention output, its in-features of rank r exactly
  rank r's heads;
* per-head tensors: a parameter whose entries reach the heads (a relative-position table added to the scores,
  attention sinks concatenated to them, a q/k norm weight of shape ``(heads, head_dim)``, DeBERTa's flat
  ``q_bias`` of heads x head_dim) is split on the axis whose index is the head; a tensor argument from outside
  the block that meets the scores head by head (MPT's ALiBi ``position_bias``, MPNet's learned position bias)
  is a per-head *input*, cut to each rank's heads by the attention module's pre-hook
  (:func:`inferred_head_inputs`, :mod:`slapo_lab.sharding.heads`);
* MLP pairs whatever the activation: a linear whose input features are exactly, rank by rank, the features of
  one or more other linears under some stride (``act(gate) * up``, a fused ``gate|up`` chunked in two) is row
  parallel and those are column parallel;
* routers: a linear whose output reaches ``topk`` stays whole, and so does one whose output reaches the block's
  output only through a ``topk`` choice (a sparse-attention indexer's ``wq_b`` / ``wk`` / ``weights_proj``,
  DeepSeek-V3.2's DSA; lineage through any op and any later linear, cut at ``topk``'s results);
* norms over all of a split layer's features (OLMo 2's ``q_norm`` over every head's q, BitNet's
  ``attn_sub_norm`` over the attention output before ``o_proj``, ConvNeXt-V2's GRN between ``pwconv1`` and
  ``pwconv2``): a parameter of one entry per feature applied to a value whose last axis holds a projection's
  (or an attention output's) features in order follows them (``feature_params``); such a norm passes the maps
  on (unless its input is a sum with an unmapped value: a residual), is sharded like the features, and its
  statistics are summed over the ranks (:mod:`slapo_lab.sharding.feature_stats`).

Complex views (``view_as_complex`` / ``view_as_real``, DeepSeek-V2's rotary embedding) carry the maps of both
features of a pair. Where the meta forward stops before a block has run (an MoE block's data-dependent routing
on the meta device), that block is read from the schedule's remembered real model.

Results are cached per model instance, and registered per attention class, child name and config (so the shard
rules of :mod:`slapo_lab.sharding.rules`, which see one module, find the layout of a fused projection); the
shard primitive calls :func:`ensure` on the top model before its first shard, so a replay in a fresh process (an
exported script, the numeric check's shrunk copy) infers the same split. Sources: Megatron-LM
``ColumnParallelLinear`` / ``RowParallelLinear`` (``partition_stride``), transformers' ``base_model_tp_plan``
(cross-checked in tests/test_split_inference.py).
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import threading
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from . import attention_site as _attention_site
from . import channel_heads as _channel_heads
from . import fanout as _fanout
from . import head_axes as _head_axes
from . import head_buffers as _head_buffers
from . import score_terms as _score_terms

_SHAPE_OPS = frozenset(
    {
        "view",
        "reshape",
        "transpose",
        "permute",
        "unflatten",
        "flatten",
        "contiguous",
        "chunk",
        "split",
        "split_with_sizes",
        "unbind",
        "__getitem__",
        "narrow",
        "expand",
        "expand_as",
        "repeat",
        "repeat_interleave",
        "unsqueeze",
        "squeeze",
        "cat",
        "concat",
        "concatenate",
        "stack",
        "movedim",
        "moveaxis",
        "t",
        "clone",
        "view_as",
        "reshape_as",
        "select",
        "swapaxes",
        "swapdims",
        "index_select",
        "tensor_split",
        "gather",
        "take_along_dim",
    }
)
_PASS_OPS = frozenset(
    {"to", "float", "half", "bfloat16", "type_as", "type", "double", "detach", "requires_grad_"}
)
_ROUTE_OPS = frozenset({"topk", "argmax", "sort", "argsort"})
_FACTORY_OPS = frozenset(
    {
        "new_empty",
        "new_zeros",
        "new_ones",
        "new_full",
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
        "new_tensor",
    }
)
_WRITE_OPS = frozenset({"copy_", "__setitem__"})
_MAX_MAPS = 3
#: Complex views (DeepSeek-V2's rotary embedding: ``view_as_complex(x.reshape(..., -1, 2))`` then
#: ``view_as_real(...).flatten(3)``): a complex element's map holds its pair of features, see :func:`_complex_maps`.
_COMPLEX_OPS = frozenset({"view_as_complex", "view_as_real"})
_PAIR = 1 << 31
_BOOL = torch.Tensor.__bool__


def _is_dense(mod: nn.Module) -> bool:
    return isinstance(mod, nn.Linear) or (type(mod).__name__ == "Conv1D" and hasattr(mod, "nf"))


def _dense_out(mod: nn.Module) -> int:
    return mod.weight.shape[1] if type(mod).__name__ == "Conv1D" else mod.weight.shape[0]


@dataclass
class _Info:
    maps: dict = field(default_factory=dict)  # producer -> [index map (int64, the tensor's shape)]
    src: frozenset = frozenset()  # every linear the value derives from (lineage, any op)
    scores: tuple | None = None  # ((q arg, k arg), ...): the score terms not yet applied to v


@dataclass(frozen=True)
class HeadParam:
    """A parameter whose entries follow the heads: ``axis`` holds one entry per head."""

    module: str  # path relative to the block
    name: str
    axis: int
    heads: int


@dataclass(frozen=True)
class Layout:
    """How a column-parallel shard of a projection reaching attention must split its output features.

    ``stride``: 1 (contiguous: whole heads of every part), n (n equal blocks) or a
    :class:`~slapo_lab.sharding.rules.BlockStride`; ``parts``: its attention roles in feature order
    (``"qkv"``, ``"kv"``, ``"q"`` ...); ``units``: the heads a contiguous shard keeps whole (None for blocks).
    """

    parts: str
    stride: int
    units: int | None


@dataclass
class BlockSplit:
    """The split of one block read from its dataflow (paths relative to the block).

    ``roles``: linear path -> ``"q"``, ``"k"``, ``"v"``, ``"qkv"``, ``"kv"`` (fused), ``"o"``, ``"mlp_in"``,
    ``"mlp_out"``; ``layouts``: path -> :class:`Layout` of every q/k/v projection; ``whole``: linear path ->
    why it stays whole (router, shared by all heads, low-rank, a refused attention); ``head_params``: the
    per-head parameters; ``attention``: attention module path -> (heads, key/value heads); ``refusals``:
    attention module path -> why its heads cannot be split.
    """

    roles: dict = field(default_factory=dict)
    layouts: dict = field(default_factory=dict)
    whole: dict = field(default_factory=dict)
    head_params: list = field(default_factory=list)
    attention: dict = field(default_factory=dict)
    refusals: dict = field(default_factory=dict)
    refused_roles: dict = field(default_factory=dict)
    shared: set = field(default_factory=set)
    grad_sum: set = field(default_factory=set)
    ran: set = field(
        default_factory=set
    )  # the linears the recorded forward ran (the others: names are hints)
    # per-head tensor arguments of an attention module, built for all heads outside the block (MPT's ALiBi
    # position_bias): HeadParam(module, argument name, heads axis, heads); cut to each rank's heads
    head_inputs: list = field(default_factory=list)
    # module path -> the split linears whose features its parameters follow entry by entry (a norm over all of a
    # column-parallel output, or over the attention output / MLP features a row-parallel layer takes):
    # its parameters are sharded on their last axis and its statistics summed over the ranks (feature_stats)
    feature_params: dict = field(default_factory=dict)
    # the linears of a channel mixer kept whole because no per-rank split of its channels exists (mixers.py): they
    # pair with nothing, and each may still be column parallel with its output gathered (lone_linears.py)
    unpaired: set = field(default_factory=set)


class _Done(Exception):
    pass


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


class _Recorder(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.info: dict[int, _Info] = {}
        self.keep: list = []
        self.active = 0
        self.params: dict[int, str] = {}  # id(param) -> "module.rel:name" inside the analysed block
        self.events: list[dict] = []
        self.linear_in: dict[str, _Info] = {}
        self.linear_in_shape: dict[str, tuple] = {}
        self.routers: set[str] = set()
        self.n_attn = 0
        self.score_extras: list = []
        self.view_of: dict[int, tuple] = {}  # id(getitem output) -> (base tensor, index)
        self.param_uses: dict[str, set] = {}  # "module:param" -> linears whose outputs it is applied to
        self.ran: set = set()  # the linears the block ran
        # id(meta buffer or a value made from one) -> (it, the same made from the remembered model's real buffer)
        self.values: dict[int, tuple] = {}
        # "module:argument" -> shape of a tensor from outside the block; id(that tensor) -> where it was first
        # seen; "module:argument" -> the inner modules' arguments it was passed on to
        self.input_shapes: dict[str, tuple] = {}
        self.input_of: dict[int, str] = {}
        self.input_aliases: dict[str, list] = {}
        self.aligned: dict[
            str, set
        ] = {}  # "module:param" -> producers whose features it follows entry by entry
        self.mixed: set[int] = (
            set()
        )  # ids of values summed with an unmapped value of their shape (a residual)
        self.topk_src: set = set()  # the linears whose outputs reach a ``topk`` with no linear between
        self.buffer_keys: set = set()  # "module:buffer" of the block's floating buffers (head_buffers)
        self.meets: list = []  # where those buffers meet producer features, per head index (head_buffers)
        self.out_src: set = set()  # the same for the block's outputs (``topk``'s results derive from nothing)

    # -- bookkeeping
    def get(self, t) -> _Info | None:
        if not isinstance(t, torch.Tensor):
            return None
        inf = self.info.get(id(t))
        if inf is None and id(t) in self.params:
            shape = tuple(t.shape)
            m = torch.arange(max(t.numel(), 1)).view(shape) if t.numel() else None
            if m is None:
                return None
            inf = _Info({"param:" + self.params[id(t)]: [m]})
            self.set(t, inf)
        return inf

    def set(self, t, inf: _Info) -> None:
        self.info[id(t)] = inf
        self.keep.append(t)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _BOOL and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            # meta tensors have no values: a data-dependent ``if mask.all():`` (transformers' packed-sequence and
            # padding checks) takes the branch of full, unpadded inputs -- the example inputs' case
            return True
        out = func(*args, **kwargs)
        if self.active:
            try:
                self.note(func, args, kwargs, out)
            except Exception:  # noqa: BLE001, S110 - a map that cannot follow an op is dropped, the forward goes on
                pass
        return out

    def follow_values(self, func, args, kwargs, out) -> None:
        """An op on a meta buffer with remembered real values (``index.view(-1)``): its meta output gets
        the op's result on the real values."""
        if not isinstance(out, torch.Tensor) or not out.is_meta:
            return
        flat = list(_tensors((args, kwargs)))
        if not any(self.real(t) is not t for t in flat) or any(t.is_meta and self.real(t) is t for t in flat):
            return

        def sub(x):
            if isinstance(x, torch.Tensor):
                return self.real(x)
            if isinstance(x, (list, tuple)):
                return type(x)(sub(y) for y in x)
            return x

        real = func(*sub(list(args)), **{k: sub(v) for k, v in kwargs.items()})
        if isinstance(real, torch.Tensor) and tuple(real.shape) == tuple(out.shape):
            self.values[id(out)] = (out, real)  # holds ``out``: its id is not reused while the entry lives

    def real(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s real values where it is a meta buffer (or made from one) the remembered model holds, else
        ``t``."""
        hit = self.values.get(id(t))
        return hit[1] if hit is not None and hit[0] is t else t

    def note(self, func, args, kwargs, out) -> None:
        name = getattr(func, "__name__", "")
        if self.values:
            self.follow_values(func, args, kwargs, out)
        if name in _WRITE_OPS:
            self.write(name, args)
            return
        if name in _FACTORY_OPS:
            return
        if name == "__getitem__" and isinstance(out, torch.Tensor) and isinstance(args[0], torch.Tensor):
            self.view_of[id(out)] = (args[0], args[1])
            self.keep.append(out)
        ins = [(t, self.get(t)) for t in _tensors((args, kwargs))]
        ins = [(t, i) for t, i in ins if i is not None]
        if not ins:
            return
        src = frozenset().union(*(i.src for _, i in ins))
        if len(ins) > 1:  # a parameter (or a value made from one) applied to values some linear produced
            for t, i in ins:
                for u in (p for p in i.maps if p.startswith("param:") and p[6:] not in self.buffer_keys):
                    prods = {
                        p
                        for t2, i2 in ins
                        if t2 is not t
                        for p in i2.maps
                        if not p.startswith(("param:", "@", "input:"))
                    }
                    self.param_uses.setdefault(u[len("param:") :], set()).update(prods)
            if isinstance(out, torch.Tensor):
                self.align(ins, out)
                _channel_heads.note_conv(self, name, args, kwargs)  # heads as channels (channel_heads.py)
                if name in ("conv1d", "conv2d") and self.align_depthwise(args, kwargs, out, src):
                    return
        if name in _ROUTE_OPS:  # the linears whose features reach a top-k choice route tokens
            self.routers |= {
                p for _, i in ins for p in i.maps if not p.startswith(("param:", "@", "cols:", "input:"))
            }
        if (
            name == "topk"
        ):  # a choice of tokens or experts: what follows derives from the choice, not the scores
            self.topk_src |= {p for p in src if not p.startswith("@")}
            src = frozenset()
        if name == "scaled_dot_product_attention":
            q, k, v = args[:3]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            self.attention(q, k, v, [mask] if isinstance(mask, torch.Tensor) else [], out, src)
            return
        if name == "einsum" and self.einsum(args, out, src):
            return
        mm = None
        if name in ("matmul", "bmm", "__matmul__") and len(args) >= 2:
            mm = (args[0], args[1])
        elif name == "baddbmm":  # BLOOM: alibi.baddbmm(batch1=q, batch2=k^T)
            mm = (
                kwargs.get("batch1", args[1] if len(args) > 1 else None),
                kwargs.get("batch2", args[2] if len(args) > 2 else None),
            )
        if mm is not None and all(isinstance(x, torch.Tensor) for x in mm):
            a, b = self.get(mm[0]), self.get(mm[1])
            if (
                a is not None
                and b is not None
                and a.scores is None
                and _linear_maps(a)
                and _linear_maps(b)
                and isinstance(out, torch.Tensor)
                and out.dim() >= 3
            ):
                h = _head_axes.heads_axis(a, mm[0])  # heads not at -3 (Hiera's windows axis): head_axes.py
                if h is not None:
                    mm = _head_axes.canonical_scores(self, mm[0], mm[1], h)
                self.set(out, _Info({}, src, ((mm[0], mm[1]),)))
                return
            if a is not None and a.scores is not None and b is not None and _linear_maps(b):
                q, k, moved = _head_axes.scores_of(self, *a.scores[0])
                extras = [mm[0]]
                h, axes = _head_axes.heads_axis(b, mm[1]) if moved else None, None
                if h is not None and isinstance(out, torch.Tensor):
                    axes = (h + out.dim() - mm[1].dim(), out.dim() - 1)
                    mm = (mm[0], _head_axes.canonical(self, mm[1], h))
                self.attention(q, k, mm[1], extras, out, src, a.scores[1:], axes)
                return
            if _score_terms.param_matmul(self, mm, a, b, out, src):  # a weight over the features (Inkling)
                return
        outs = list(_tensors(out))
        if not outs:
            return
        scores = _merge_scores(i.scores for _, i in ins)
        if name in _PASS_OPS and len(outs) == 1 and ins[0][0] is args[0]:
            first = ins[0][1]
            self.set(outs[0], _Info(dict(first.maps), src, first.scores))
            return
        if name in _SHAPE_OPS:
            self.shape_op(func, args, kwargs, out, ins, src, scores)
            return
        if name == "embedding" and _channel_heads.embedding_rows(self, args, kwargs, out, src):
            return  # a table's rows looked up by index (a Shaw relative-position embedding): channel_heads.py
        if name == "pad" and kwargs.get("mode", args[2] if len(args) > 2 else "constant") == "constant":
            # padding moves features along an axis (LongT5's blocks of tokens): the padded entries come from
            # no feature
            kw = {k: v for k, v in kwargs.items() if k not in ("mode", "value")}
            self.shape_op(func, args[:2], {**kw, "value": -1}, out, ins, src, scores)
            return
        if name in _COMPLEX_OPS and len(outs) == 1 and ins[0][0] is args[0]:
            self.set(outs[0], _Info(_complex_maps(name, ins[0][1].maps, outs[0]), src, scores))
            return
        _head_axes.note_softmax(self, name, ins)
        if _head_axes.reduce_maps(self, name, args, kwargs, out):
            return  # pooling over tokens that hold the same features (Hiera's query pooling): head_axes.py
        for o in outs:  # elementwise (or anything else): carry maps that broadcast to the output
            maps: dict = {}
            for t, i in ins:
                for p, ms in i.maps.items():
                    for m in ms:
                        if m.dim() > o.dim():
                            continue
                        try:
                            mb = torch.broadcast_to(m, o.shape) if tuple(m.shape) != tuple(o.shape) else m
                        except RuntimeError:
                            continue
                        if t.dim() <= o.dim() and _broadcasts(tuple(t.shape), tuple(o.shape)):
                            lst = maps.setdefault(p, [])
                            if len(lst) < _MAX_MAPS and not any(x is m for x in lst):
                                lst.append(mb)
            self.set(o, _Info(maps, src, scores))
            if self.buffer_keys and maps:  # a per-head buffer applied to heads (head_buffers)
                _head_buffers.note_meet(self, o, maps, scores, self.get)
            if maps and any(
                t.is_floating_point() and tuple(t.shape) == tuple(o.shape) and _residual(self.get(t))
                for t in _tensors((args, kwargs))
            ):
                self.mixed.add(id(o))
            if scores is not None and _score_terms.is_term(maps):
                self.score_extras.append((o, self.info[id(o)]))

    def align(self, ins, out: torch.Tensor) -> None:
        """Note a parameter of one entry per feature (every axis but the last of size 1) applied elementwise to a
        producer's value whose last axis holds that producer's features in order: the parameter follows those
        features (a norm's weight or bias over all of a projection's output, GRN's gamma / beta)."""
        width = out.shape[-1] if out.dim() else 0
        if width < 2:
            return
        feats = torch.arange(width)
        for t, i in ins:
            if (
                t.dim() < 1
                or t.shape[-1] != width
                or not i.maps
                or any(not u.startswith("param:") for u in i.maps)
            ):
                continue  # a value made from parameters only (a weight, ``1 + weight``, a bias)
            keys = [
                u
                for u, ms in i.maps.items()
                if u[6:] not in self.buffer_keys and bool((ms[0].reshape(-1, width) == feats).all())
            ]
            for key in keys:
                for t2, i2 in ins:
                    if t2 is t or t2.dim() < 1 or t2.shape[-1] != width:
                        continue
                    for p, ms in i2.maps.items():
                        if not p.startswith("param:") and bool((ms[0].reshape(-1, width) == feats).all()):
                            self.aligned.setdefault(key[len("param:") :], set()).add(p)

    def align_depthwise(self, args, kwargs, out, src) -> bool:
        """A depthwise convolution (``groups`` = channels, one filter per channel: Inkling's short convolutions
        over k and v) whose input's channel axis holds a producer's features in order: its weight's (and
        bias') axis 0 follows those features, and its output's channel ``c`` holds feature ``c`` (True: the
        output's maps are set)."""
        x = args[0] if args else kwargs.get("input")
        w = args[1] if len(args) > 1 else kwargs.get("weight")
        b = args[2] if len(args) > 2 else kwargs.get("bias")
        groups = args[6] if len(args) > 6 else kwargs.get("groups", 1)
        if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor) or x.dim() < 3:
            return False
        c = x.shape[1]
        if groups != c or w.shape[0] != c or w.shape[1] != 1 or c < 2:
            return False
        if out.dim() != x.dim() or out.shape[1] != c:
            return False
        xi = self.get(x)
        if xi is None:
            return False
        feats = torch.arange(c)
        prods = {
            p
            for p, ms in xi.maps.items()
            if not p.startswith("param:") and bool((ms[0].movedim(1, -1).reshape(-1, c) == feats).all())
        }
        if not prods:
            return False
        for t in (w, b):
            inf = self.get(t) if isinstance(t, torch.Tensor) else None
            for u, ms in (inf.maps if inf is not None else {}).items():
                per = ms[0].numel() // c
                if u.startswith("param:") and bool(
                    (ms[0].reshape(c, -1).min(1).values // max(per, 1) == feats).all()
                ):
                    self.aligned.setdefault(u[len("param:") :], set()).update(prods)
        shape = [1] * out.dim()
        shape[1] = c
        m = torch.broadcast_to(feats.view(shape), out.shape)
        self.set(out, _Info({p: [m] for p in prods}, src))
        return True

    def canonical(self, t, axes: list[int]):
        """``t`` with ``axes`` (heads, rows, features) moved last, its maps moved alike (a new tensor)."""
        inf = self.get(t)
        moved = t.movedim(axes, [-3, -2, -1])
        maps = {p: [m.movedim(axes, [-3, -2, -1]) for m in ms] for p, ms in inf.maps.items()}
        self.set(moved, _Info(maps, inf.src, inf.scores))
        return moved

    def einsum(self, args, out, src) -> bool:
        """Attention written as two einsums (Funnel's ``bind,bjnd->bnij`` then ``bnij,bjnd->bind``): the
        operands are moved to the matmul layout (heads, rows, features last) and handled as two matmuls."""
        if not args or not isinstance(args[0], str) or not isinstance(out, torch.Tensor):
            return False
        ops = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
        eq = args[0].replace(" ", "")
        if len(ops) != 2 or "->" not in eq or not all(isinstance(o, torch.Tensor) for o in ops):
            return False
        eq = _expand_ellipsis(eq, ops)
        if eq is None:
            return False
        (s1, s2), so = eq.split("->")[0].split(","), eq.split("->")[1]
        a, b = self.get(ops[0]), self.get(ops[1])
        if a is None or b is None or len(set(s1)) != len(s1) or len(set(s2)) != len(s2):
            return False
        size = {c: ops[0].shape[s1.index(c)] for c in s1} | {c: ops[1].shape[s2.index(c)] for c in s2}
        heads = [c for c in s1 if c in s2 and c in so and size[c] > 1]
        if len(heads) > 1:  # batch-like axes beside the heads (LongT5's blocks, "...qhd,...khd->...hqk"): the
            # heads axis is the one along which the projections' features differ
            sub, inf = (s1, a) if a.scores is None else (s2, b)
            heads = [c for c in heads if _varies(inf, sub.index(c))]
        if len(heads) != 1:
            return False
        h = heads[0]
        if a.scores is None and _linear_maps(a) and _linear_maps(b):
            d = [c for c in s1 if c in s2 and c not in so]
            i = [c for c in s1 if c not in s2 and c in so]
            j = [c for c in s2 if c not in s1 and c in so]
            if len(d) != 1 or len(i) != 1 or len(j) != 1:
                return False
            q = self.canonical(ops[0], [s1.index(h), s1.index(i[0]), s1.index(d[0])])
            k = self.canonical(ops[1], [s2.index(h), s2.index(j[0]), s2.index(d[0])])
            self.set(out, _Info({}, src, ((q, k),)))
            return True
        if a.scores is not None and _linear_maps(b):
            j = [c for c in s1 if c in s2 and c not in so]
            d = [c for c in s2 if c not in s1 and c in so]
            if len(j) != 1 or len(d) != 1:
                return False
            v = self.canonical(ops[1], [s2.index(h), s2.index(j[0]), s2.index(d[0])])
            q, k = a.scores[0]
            self.attention(q, k, v, [ops[0]], out, src, a.scores[1:], (so.index(h), so.index(d[0])))
            return True
        return False

    def write(self, name: str, args) -> None:
        """An in-place write (``base[idx] = value``, ``base[idx].copy_(value)``): the base's maps get the
        value's maps at ``idx`` (DeepSeek-V3's keys are assembled this way)."""
        if name == "__setitem__":
            base, idx, value = args[0], args[1], args[2]
        else:
            dst, value = args[0], args[1]
            if id(dst) not in self.view_of:
                return
            base, idx = self.view_of[id(dst)]
        vi = self.get(value) if isinstance(value, torch.Tensor) else None
        if vi is None or not isinstance(base, torch.Tensor):
            return
        bi = self.info.get(id(base)) or _Info()
        maps = {p: list(ms) for p, ms in bi.maps.items()}
        for p, ms in vi.maps.items():
            cur = maps.get(p, [torch.full(tuple(base.shape), -1, dtype=torch.long)])[0].clone()
            try:
                cur[idx] = ms[0]
            except Exception:  # noqa: BLE001, S112 - an index the map cannot follow: dropped
                continue
            maps[p] = [cur]
        self.set(base, _Info(maps, bi.src | vi.src, bi.scores))

    def shape_op(self, func, args, kwargs, out, ins, src, scores) -> None:
        producers = {}
        for _, i in ins:
            for p, ms in i.maps.items():
                producers[p] = max(producers.get(p, 0), len(ms))
        outs_struct = out
        results: dict = {}
        for p, n in producers.items():
            for j in range(n):

                def sub(x, p=p, j=j):
                    if isinstance(x, torch.Tensor):
                        inf = self.info.get(id(x)) or (self.get(x) if id(x) in self.params else None)
                        if inf is not None and p in inf.maps:
                            ms = inf.maps[p]
                            # a map broadcast by an elementwise op is an expanded view, which ``view`` cannot
                            # reshape (Laguna's per-head gate, then ``.view(B, T, -1)``): a copy can
                            m = ms[min(j, len(ms) - 1)]
                            return m if m.is_contiguous() else m.contiguous()
                        if inf is not None or x.is_floating_point():
                            return torch.full(tuple(x.shape), -1, dtype=torch.long)
                        if x.device.type == "meta":  # an index buffer of a meta copy: the real one's values
                            if self.real(x).is_meta:  # no values (torch would gather a CPU map into garbage)
                                return _score_terms.unknown_index(func, x)
                            return self.real(x)
                        return x.to("cpu")
                    if isinstance(x, (list, tuple)):
                        return type(x)(sub(y) for y in x)
                    return x

                try:
                    mapped = func(*sub(list(args)), **{k: sub(v) for k, v in kwargs.items()})
                except Exception:  # noqa: BLE001, S112 - this map cannot follow the op: dropped
                    continue
                for idx, m in enumerate(_tensors(mapped)):
                    results.setdefault(idx, {}).setdefault(p, []).append(m)
        for idx, o in enumerate(_tensors(outs_struct)):
            maps = {
                p: [m for m in ms if tuple(m.shape) == tuple(o.shape) and bool((m >= 0).any())]
                for p, ms in results.get(idx, {}).items()
            }
            self.set(o, _Info({p: ms for p, ms in maps.items() if ms}, src, scores))
            if scores is not None and _score_terms.is_term(maps):
                self.score_extras.append((o, self.info[id(o)]))

    def attention(self, q, k, v, extras, out, src, pairs=(), out_axes=None) -> None:
        i = self.n_attn
        self.n_attn += 1
        ev = {
            "q": (q, self.get(q)),
            "k": (k, self.get(k)),
            "v": (v, self.get(v)),
            "extras": [],
            "pairs": pairs,
            "where": _attention_site.current(self),  # the module running the op (attention_site.py)
        }
        for a, b in pairs:
            ev.setdefault("infos", {})[id(a)] = self.get(a)
            ev["infos"][id(b)] = self.get(b)
        for e in extras:
            inf = self.get(e)
            if inf is not None:
                ev["extras"].append((e, inf))
        ev["extras"] += self.score_extras
        self.score_extras = []
        self.events.append(ev)
        if isinstance(out, tuple):
            out = out[0]
        if isinstance(out, torch.Tensor) and out.dim() >= 3:
            ha, da = out_axes or (out.dim() - 3, out.dim() - 1)
            h, dv = out.shape[ha], out.shape[da]
            shape_h, shape_d = [1] * out.dim(), [1] * out.dim()
            shape_h[ha], shape_d[da] = h, dv
            m = torch.arange(h).view(shape_h) * dv + torch.arange(dv).view(shape_d)
            m = torch.broadcast_to(m, out.shape)
            self.set(out, _Info({f"@attn{i}": [m]}, src | {f"@attn{i}"}))
            ev["out_heads"] = h


def _residual(inf: _Info | None) -> bool:
    """A value summed with a split layer's output that keeps the features from staying apart: unmapped, or a
    tensor from outside the block only (BERT's ``input_tensor``, the block's input passed to ``SelfOutput``)."""
    return inf is None or (bool(inf.maps) and all(p.startswith("input:") for p in inf.maps))


def _expand_ellipsis(eq: str, ops: list) -> str | None:
    """``eq`` with each ``...`` written out as letters it does not use (as many as the operand's extra axes;
    the output's as many as the most), or None when they cannot be."""
    if "..." not in eq:
        return eq
    ins, out = eq.split("->")
    subs = ins.split(",")
    free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in eq]
    counts = []
    for sub, t in zip(subs, ops, strict=True):
        n = t.dim() - (len(sub) - 3) if "..." in sub else 0
        if n < 0 or n > len(free):
            return None
        counts.append(n)
    most = max(counts)
    letters = free[:most]
    subs = [sub.replace("...", "".join(letters[most - n :])) for sub, n in zip(subs, counts, strict=True)]
    return ",".join(subs) + "->" + out.replace("...", "".join(letters))


def _varies(inf: _Info, axis: int) -> bool:
    """Whether ``axis`` of a value splits its producers' features apart, as a heads axis does: for some
    producer, the features at index 0 and at index 1 of that axis are disjoint (along a batch-like axis, such
    as LongT5's blocks of tokens, every index holds the same features, or none where padded)."""
    for p, ms in inf.maps.items():
        if p.startswith(("param:", "@")):
            continue
        for m in ms:
            if m.dim() <= axis or m.shape[axis] < 2:
                continue
            a, b = m.select(axis, 0), m.select(axis, 1)
            sa, sb = set(a[a >= 0].unique().tolist()), set(b[b >= 0].unique().tolist())
            if sa and sb and not sa & sb:
                return True
    return False


def _complex_maps(name: str, maps: dict, out: torch.Tensor) -> dict:
    """The maps of ``view_as_complex`` / ``view_as_real``'s output: a complex element's map entry encodes its
    (real, imaginary) features as ``(f0 + 1) * 2**31 + (f1 + 1)`` (-1 where unmapped), decoded back into a last
    axis of 2 by ``view_as_real``; elementwise complex ops in between carry the encoded maps unchanged."""
    res: dict = {}
    for p, ms in maps.items():
        for m in ms:
            if name == "view_as_complex":
                e = (m[..., 0] + 1) * _PAIR + (m[..., 1] + 1)
            else:
                e = torch.stack((m // _PAIR - 1, m % _PAIR - 1), dim=-1)
            if tuple(e.shape) == tuple(out.shape):
                res.setdefault(p, []).append(e)
    return res


def _merge_scores(tags) -> tuple | None:
    """The score terms of every input, in order, each once."""
    out: list = []
    for tag in tags:
        for pair in tag or ():
            if not any(pair[0] is x[0] and pair[1] is x[1] for x in out):
                out.append(pair)
    return tuple(out) or None


def _broadcasts(a: tuple, b: tuple) -> bool:
    if len(a) > len(b):
        return False
    return all(x == y or x == 1 for x, y in zip(a[::-1], b[::-1], strict=False))


def _linear_maps(inf: _Info) -> bool:
    return any(not p.startswith(("param:", "@", "input:")) for p in inf.maps)


def _head_sets(t: torch.Tensor, maps: list, n: int | None = None) -> list[set]:
    """For each head (axis -3 of ``t``), the set of producer features its elements come from."""
    heads = t.shape[-3] if n is None else n
    sets = [set() for _ in range(heads)]
    for m in maps:
        if m.dim() < 3 or m.shape[-3] != heads:
            continue
        for h in range(heads):
            vals = m.select(-3, h).reshape(-1)
            sets[h] |= set(vals[vals >= 0].unique().tolist())
    return sets


def _candidate_strides(n: int, feature_part: list[str]) -> list:
    from .rules import make_stride

    out: list = [1, 2, 3]
    runs = []
    for p in feature_part:
        if runs and runs[-1][0] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    if 1 < len(runs) <= 4:
        out.append(make_stride([r[1] for r in runs]))
    return [s for s in out if sum(_sizes(n, s)) == n]


def _replicated_strides(feature_part: list[str], replicated: dict[str, int]) -> list:
    """The stride of a fused projection whose parts are stored as blocks back to back, the replicated ones
    (key / value heads of multi-query attention) held whole by their replica groups; none when a part recurs."""
    from .rules import BlockStride

    runs = [[k, len(list(g))] for k, g in itertools.groupby(feature_part)]  # (part, run length), in order
    if len(runs) < 2 or len({r[0] for r in runs}) != len(runs):
        return []
    return [BlockStride([r[1] for r in runs], [replicated.get(r[0], 0) for r in runs])]


def _sizes(n: int, stride) -> list[int]:
    from .rules import block_sizes

    try:
        return block_sizes(n, stride)
    except ValueError:
        return [0]


def _fits(n: int, stride, ws: int, needed: list[set]) -> bool:
    from .rules import block_replicas, local_shard

    sizes = _sizes(n, stride)
    if any(s % (ws // r) for s, r in zip(sizes, block_replicas(stride, len(sizes), ws), strict=False)):
        return False
    idx = torch.arange(n)
    return all(set(local_shard(idx, 0, ws, r, stride).tolist()) == needed[r] for r in range(ws))


def _test_ws(*counts: int) -> int | None:
    for ws in (2, 3, 5, 7):
        if all(c % ws == 0 for c in counts):
            return ws
    return None


def _token_routers(rec) -> set[str]:
    """The linears whose outputs reach the block's output only through a ``topk`` choice of tokens (a
    sparse-attention indexer: DeepSeek-V3.2's ``wq_b`` / ``wk`` / ``weights_proj``): lineage from linear to
    linear, cut at ``topk``'s results."""
    succ: dict = {}
    for m_path, inf in rec.linear_in.items():
        for p in inf.src:
            succ.setdefault(p, set()).add(m_path)
    reach = set(rec.out_src)
    grown = True
    while grown:
        grown = False
        for p, ms in succ.items():
            if p not in reach and ms & reach:
                reach.add(p)
                grown = True
    return set(rec.topk_src) - reach


def _analyse(rec: _Recorder, block: nn.Module, dense: dict[str, nn.Module]) -> BlockSplit:
    split = BlockSplit()
    out_feats = {p: _dense_out(m) for p, m in dense.items()}
    parent_of = {p: p.rsplit(".", 1)[0] if "." in p else "" for p in dense}
    token_routers = _token_routers(rec)
    for i, ev in enumerate(rec.events):
        (q, qi), (k, ki), (v, vi) = ev["q"], ev["k"], ev["v"]
        if qi is None or ki is None or vi is None or q.dim() < 3:
            continue
        scorers = {
            p for inf in (qi, ki) for p in inf.maps if not p.startswith(("@", "param:", "input:", "cols:"))
        }
        if scorers and scorers <= token_routers:
            continue  # scores that choose tokens (a sparse-attention indexer's), not an attention to split
        n = q.shape[-3]
        roles: dict[str, dict] = {}  # producer -> role -> [set per head]
        kv = None
        head_lists: list = []
        infos = ev.get("infos", {})

        def rec_get(t, infos=infos):
            return infos.get(id(t))

        args = [("q", q, qi, True), ("k", k, ki, True), ("v", v, vi, True)]
        for a, b in ev.get(
            "pairs", ()
        ):  # more scores added to the first (DeBERTa's c2p / p2c position terms)
            pa, pb = rec_get(a), rec_get(b)
            made = {
                p
                for inf in (pa, pb)
                if inf is not None
                for p in inf.maps
                if not p.startswith(("@", "param:"))
            }
            if made and made <= token_routers:
                continue  # a token choice's scores added to the attention's (an indexer's mask), not a head term
            args += [("q", a, pa, False), ("k", b, pb, False)]
        for role, t, inf, main in args:
            if inf is None:
                continue
            for p, ms in inf.maps.items():
                if p.startswith("@"):
                    continue
                if p.startswith("input:"):
                    _note_head_param(split, p, ms, split.head_inputs)
                    continue
                if p.startswith("param:"):
                    owned = _head_owned(p, ms)
                    if owned is not None:
                        head_lists.append(owned)
                    _note_head_param(split, p, ms)
                    continue
                sets = _head_sets(t, ms)
                if len(sets) != n and role == "q":
                    continue
                have = roles.setdefault(p, {})
                if (
                    not main
                ):  # a score term's side takes the projection's role in the main term, if it has one
                    role = next((r for r in ("q", "k") if r in have), "k")
                if role in have:  # the same projection in two score terms (DeBERTa's q in c2p): one role
                    have[role] = [x | y for x, y in zip(have[role], sets, strict=False)]
                else:
                    have[role] = sets
                if role == "k" and main:
                    distinct = {frozenset(s) for s in sets if s}
                    kv = len(distinct) if kv is None else max(kv, len(distinct))
        for _e, inf in ev["extras"]:
            for p, ms in inf.maps.items():
                if p.startswith("param:"):
                    _note_head_param(split, p, ms)
                elif p.startswith("input:"):  # a per-head tensor the model builds (MPT's ALiBi position_bias)
                    _note_head_param(split, p, ms, split.head_inputs)
        mixed_term = _score_terms.note_roles(
            ev["extras"], roles, n, dense, rec.linear_in, token_routers | rec.routers
        )  # score terms
        kv = kv or n
        attn_mod = _attention_site.owner(
            _common_parent([parent_of.get(p, "") for p in roles if p in dense]), ev.get("where")
        )
        o_path = next(
            (p for p, inf in rec.linear_in.items() if f"@attn{i}" in inf.maps),
            None,
        )
        if (
            o_path is not None
        ):  # an output gate (sigmoid(g(x)) * attention, Qwen3-Next / AFMoE): per-head features
            o_in = rec.linear_in[o_path]
            fin = o_in.maps[f"@attn{i}"][0].shape[-1]
            heads_out = ev.get("out_heads", n)
            for p, ms in o_in.maps.items():
                if p.startswith("param:") and fin % heads_out == 0:  # a per-head gate bias (Beam's gate_bias)
                    width = fin // heads_out
                    row = ms[0].reshape(-1, fin)[0]
                    sets = [
                        frozenset(x for x in row[h * width : (h + 1) * width].tolist() if x >= 0)
                        for h in range(heads_out)
                    ]
                    key = p[len("param:") :].rsplit(":", 1)
                    pairs = ((a, b) for a in range(heads_out) for b in range(a + 1, heads_out))
                    known = any(hp[0] == key[0] and hp[1] == key[1] for hp in split.head_params)
                    if all(sets) and not known and not any(sets[a] & sets[b] for a, b in pairs):
                        split.head_params.append((key[0], key[1], sets, heads_out))
                    continue
                if p not in dense or p == o_path or fin % heads_out:
                    continue
                width = fin // heads_out
                sets = [set() for _ in range(heads_out)]
                for m in ms:
                    row = m.reshape(-1, m.shape[-1])[0]
                    for h in range(heads_out):
                        seg = row[h * width : (h + 1) * width]
                        sets[h] |= set(seg[seg >= 0].tolist())
                roles.setdefault(p, {})["g"] = sets
        split.attention[attn_mod] = (n, kv)
        _head_buffers.note_attention(split, rec, roles, n)  # per-head buffers (MiniMax's decays)
        _channel_heads.resolve(split, rec, roles)  # a convolution over heads (channel_heads.py)
        ws = _test_ws(n, kv) or _test_ws(n)
        refusal = mixed_term
        if head_lists:
            where = head_lists[0]
            refusal = (
                f"its per-head {where[0]} is a list of {where[1]} modules, one per head (e.g. StableLM's "
                "qk_layernorm), which no shard splits, so its heads stay whole"
            )
        for p, per_role in roles.items():
            if p not in dense or refusal:
                continue
            feats = out_feats[p]
            if ws is None:
                refusal = f"its {n} attention heads cannot be split by heads"
                break
            # which part each feature belongs to, and the features each rank needs
            part = ["?"] * feats
            needed = [set() for _ in range(ws)]
            shared = False
            replicated: dict[str, int] = {}  # k / v of a fused multi-query projection -> its key/value heads
            for role, sets in per_role.items():
                hn = len(sets)
                for s in sets:
                    for f in s:
                        if 0 <= f < feats:
                            if part[f] not in ("?", role):
                                if "g" in (role, part[f]):
                                    # a q/k/v feature that also reaches the output projection's input by head
                                    # (NeoMME's exclusive self-attention subtracts v's direction there): one
                                    # part; the ranks' needed features below must still agree
                                    part[f] = part[f] if role == "g" else role
                                    continue
                                shared = True
                            part[f] = role
                uniq = [x for j, x in enumerate(sets) if j == 0 or x != sets[j - 1]]  # key/value heads
                if (
                    role in ("k", "v")
                    and "q" in per_role
                    and len(uniq) % ws
                    and ws % len(uniq) == 0
                    and n % ws == 0
                ):
                    # a fused multi-query projection: each rank keeps the key/value head its query heads use,
                    # shared by ws / kv ranks (GPT-BigCode's c_attn, Falcon's query_key_value)
                    replicated[role] = len(uniq)  # key/value head groups
                    for r in range(ws):
                        needed[r] |= uniq[r // (ws // len(uniq))]
                    continue
                if hn % ws:
                    if role in ("k", "v") and len(per_role) == 1 and ws % max(kv, 1) == 0:
                        continue  # a separate key/value projection, replicated (kv_replicas)
                    refusal = (
                        f"its {kv} key/value head{'s' if kv != 1 else ''} for {n} query heads (multi-query "
                        f"attention) {'sit' if kv != 1 else 'sits'} in the fused {p.rsplit('.', 1)[-1]} beside the query heads, so it "
                        "cannot be split by heads"
                        if role in ("k", "v")
                        else f"its {hn} heads do not split by heads"
                    )
                    continue
                per = hn // ws
                for r in range(ws):
                    for h in range(r * per, (r + 1) * per):
                        needed[r] |= sets[h]
            if refusal and len(per_role) > 1:
                break
            refusal_here = None
            copies = {f for f in range(feats) if part[f] in replicated}
            if any((needed[r] & needed[s]) - copies for r in range(ws) for s in range(r + 1, ws)):
                shared = True
            covered = set().union(*needed)
            if shared or "?" in part or len(covered) != feats:
                split.shared.add(p)
                split.whole[p] = (
                    "its features reach every attention head or feed other layers too (a shared or low-rank "
                    "projection), so it stays whole"
                )
                continue
            parts = "".join(dict.fromkeys(part))
            cands = _replicated_strides(part, replicated) if replicated else _candidate_strides(feats, part)
            cands = [*cands, *_score_terms.run_strides(feats, needed)]  # one run of features per block
            lay = next((s for s in cands if _fits(feats, s, ws, needed)), None)
            if lay is None:
                refusal_here = f"no shard of {p} keeps whole heads on every rank"
                split.whole[p] = refusal_here
                continue
            split.roles[p] = parts
            units = len(per_role.get("q", per_role.get("k", []))) if lay == 1 and len(parts) > 1 else None
            if len(parts) > 1 and lay == 1 and "k" in per_role:
                units = kv if kv != n else n
            split.layouts[p] = Layout(parts, lay, units)
        refusal = refusal or _fanout.shared_heads_reason(roles, rec, dense, o_path)  # fanout.py
        if refusal:
            split.refusals[attn_mod] = refusal
            for p in roles:
                if p in dense:
                    split.roles.pop(p, None)
                    split.layouts.pop(p, None)
                    split.whole[p] = refusal
                    split.refused_roles[p] = "qkv"
            if o_path is not None:
                split.whole[o_path] = refusal
                split.refused_roles[o_path] = "o"
            continue
        if o_path is not None and o_path not in split.roles:
            inf = rec.linear_in[o_path]
            m = inf.maps[f"@attn{i}"][0]
            heads_out = ev.get("out_heads", n)
            fin = m.shape[-1]
            if ws and fin % ws == 0:
                col = m.reshape(-1, fin)[0]
                dv = max(int(col.max().item()) + 1, 1) // heads_out
                ok = dv > 0 and all(
                    set((col[r * fin // ws : (r + 1) * fin // ws] // dv).tolist())
                    == set(range(r * heads_out // ws, (r + 1) * heads_out // ws))
                    for r in range(ws)
                )
                if ok:
                    split.roles[o_path] = "o"
    # MLP pairs: a row linear whose input features are, rank by rank, exactly some column linears' features
    taken = set(split.roles) | set(split.whole)
    for r_path, inf in rec.linear_in.items():
        if r_path in taken or r_path not in dense or r_path in rec.routers:
            continue
        cols = {p: ms for p, ms in inf.maps.items() if p in dense and p not in taken and p != r_path}
        if not cols or any(not p.startswith("param:") and p not in cols for p in inf.maps if p in dense):
            continue
        fin = rec.linear_in_shape[r_path][-1]
        ws = _test_ws(fin)
        if ws is None:
            continue
        flat = {p: [m.reshape(-1, m.shape[-1])[0] for m in ms] for p, ms in cols.items()}
        explained = torch.zeros(fin, dtype=torch.bool)
        plan = {}
        for p, rows in flat.items():
            feats = out_feats[p]
            needed = [set() for _ in range(ws)]
            for row in rows:
                explained |= row >= 0
                for rk in range(ws):
                    seg = row[rk * fin // ws : (rk + 1) * fin // ws]
                    needed[rk] |= set(seg[seg >= 0].tolist())
            if len(set().union(*needed)) != feats:
                plan = None
                break
            part = ["x"] * feats
            lay = next((s for s in _candidate_strides(feats, part) if _fits(feats, s, ws, needed)), None)
            if lay is None:
                plan = None
                break
            plan[p] = lay
        if not plan or not bool(explained.all()):
            continue
        if any(p in inf2.maps for q, inf2 in rec.linear_in.items() if q != r_path for p in plan):
            continue  # a column layer's features also reach another linear (Mamba's x_proj), which would see a part
        split.roles[r_path] = "mlp_out"
        for p, lay in plan.items():
            split.roles[p] = "mlp_in"
            split.layouts[p] = Layout("gate_up" if lay == 2 else "in", lay, None)
            taken.add(p)
        taken.add(r_path)
    split.ran = set(rec.ran)
    _feature_params(split, rec, block)
    # replicated parameters applied to a column-parallel layer's (partitioned) output see this rank's features
    # only (XIELU's alpha in Apertus' MLP, a per-head q/k norm): their gradients are partial sums
    columns = {p for p, r in split.roles.items() if r not in ("o", "mlp_out")}
    split_params = {hp[0] for hp in split.head_params}
    for key, prods in rec.param_uses.items():
        mod = key.rsplit(":", 1)[0]
        if prods & columns and mod not in split_params and mod not in split.feature_params:
            split.grad_sum.add(mod)
    for p in rec.routers:
        if p in dense and p not in split.roles:
            split.whole[p] = "a router: every rank must route every token the same way"
    for p in sorted(token_routers):
        if p in dense and p not in split.roles and p not in split.whole:
            split.whole[p] = (
                "a token router: its output reaches the block only through a topk choice, which every rank must "
                "make the same way"
            )
    return split


def _feature_params(split: BlockSplit, rec, block: nn.Module) -> None:
    """``split.feature_params``: the modules all of whose parameters follow, entry by entry, the features of
    linears this split shards contiguously: a column-parallel projection's output (OLMo 2's ``q_norm`` over all
    heads' q), or an attention output whose output projection is row parallel (BitNet's ``attn_sub_norm``)."""
    o_of = {}
    for i in range(len(rec.events)):
        key = f"@attn{i}"
        o_of[key] = next((p for p, inf in rec.linear_in.items() if key in inf.maps), None)
    by_mod: dict[str, set] = {}
    for key, prods in rec.aligned.items():
        by_mod.setdefault(key.rsplit(":", 1)[0], set()).update(prods)
    for mod, prods in by_mod.items():
        owner = block.get_submodule(mod) if mod else block
        # every parameter of the module's subtree: a bias that follows the features after a convolution of
        # replicated weights (ConvBERT's SeparableConv1D: depthwise -> pointwise -> + bias) is not a feature norm
        keys = [
            f"{'.'.join(x for x in (mod, n.rpartition('.')[0]) if x)}:{n.rpartition('.')[2]}"
            for n, p in owner.named_parameters()
            if p.requires_grad
        ]
        if not keys or any(k not in rec.aligned for k in keys):
            continue
        linears = set()
        for p in prods:
            if p.startswith("@attn"):
                o = o_of.get(p)
                ok = o is not None and split.roles.get(o) == "o"
            else:
                role, lay = split.roles.get(p), split.layouts.get(p)
                o = p
                ok = (
                    role is not None
                    and (role == "mlp_in" or set(role) <= set("qkvg"))
                    and lay is not None
                    and type(lay.stride) is int
                    and lay.stride == 1
                )
            if not ok:
                break
            linears.add(o)
        else:
            if linears:
                split.feature_params[mod] = linears


def _common_parent(paths: list[str]) -> str:
    if not paths:
        return ""
    parts = [p.split(".") if p else [] for p in paths]
    out = []
    for xs in zip(*parts, strict=False):
        if len(set(xs)) != 1:
            break
        out.append(xs[0])
    return ".".join(out)


def _head_owned(p: str, ms: list) -> tuple[str, int] | None:
    """``(container path, heads)`` when parameter ``p`` reaches exactly one head and belongs to the i-th
    module of a module list (one module per head), else None."""
    m = ms[0]
    if m.dim() < 3:
        return None
    used = [h for h in range(m.shape[-3]) if bool((m.select(-3, h) >= 0).any())]
    mod = p[len("param:") :].rsplit(":", 1)[0]
    container, _, idx = mod.rpartition(".")
    if len(used) != 1 or not idx.isdigit():
        return None
    return container, m.shape[-3]


def _note_head_param(split: BlockSplit, p: str, ms: list, into: list | None = None) -> None:
    """A parameter (or, ``into`` ``split.head_inputs``, a tensor argument from outside the block) whose entries
    reach attention heads (axis -3 of its map): note, per head, its entries (heads repeated for grouped-query
    attention count once)."""
    into = split.head_params if into is None else into
    key = p.split(":", 1)[1]
    mod, name = key.rsplit(":", 1)
    if any(hp[0] == mod and hp[1] == name for hp in into):
        return
    m = ms[0]
    if m.dim() < 3:
        return
    raw = [
        frozenset(x for x in m.select(-3, h).reshape(-1).unique().tolist() if x >= 0)
        for h in range(m.shape[-3])
    ]
    sets = []
    for st in raw:
        if not sets or sets[-1] != st:
            sets.append(st)
    n = len(sets)
    if n < 2 or any(sets[a] & sets[b] for a in range(n) for b in range(a + 1, n)):
        return  # shared by several heads (a scale over head_dim)
    into.append((mod, name, sets, n))  # resolved against the parameter's (or argument's) shape later


# --------------------------------------------------------------------------------------------- running it
_DIGESTS: dict[int, tuple] = {}  # id(config) -> (weak reference, digest): configs are read, not changed


def _config_digest(cfg) -> str | None:
    """A digest of a config's values (the registry's key), cached per config object."""
    if cfg is None:
        return None
    hit = _DIGESTS.get(id(cfg))
    if hit is not None and hit[0]() is cfg:
        return hit[1]
    digest = _compute_digest(cfg)
    try:
        _DIGESTS[id(cfg)] = (weakref.ref(cfg), digest)
    except TypeError:  # not weakly referenceable: not cached
        pass
    return digest


def _compute_digest(cfg) -> str:
    try:
        text = cfg.to_json_string(use_diff=False)
    except Exception:  # noqa: BLE001
        text = repr(sorted((k, repr(v)) for k, v in vars(cfg).items()))
    return hashlib.sha1(text.encode()).hexdigest()


def _stacks(model: nn.Module, mixed: bool = False) -> list[tuple[str, nn.Module]]:
    """The first block of each class among the model's stacks of blocks (``nn.ModuleList`` of one class); where
    there is none, of each structure among its hybrid stacks (``mixed``: lists of blocks of several classes,
    each holding a dense layer, as :func:`slapo_lab.presets.find_blocks` takes them then)."""
    seen: set = set()
    out = []
    for p, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or len(m) < 1:
            continue
        kids = list(m)
        if mixed:
            if len(kids) < 2 or len({type(k) for k in kids}) < 2:
                continue
            if not any(any(_is_dense(x) for x in k.modules()) for k in kids):
                continue  # (a list beside convolution-only blocks, SwiftFormer's stages, is taken: those are skipped)
        elif len({type(k) for k in kids}) != 1 or not any(_is_dense(x) for x in kids[0].modules()):
            continue
        if isinstance(kids[0], (nn.ModuleList, nn.ModuleDict)):
            continue  # a list of lists (Funnel's blocks): the blocks are inside, and they run
        for j, kid in enumerate(kids):
            sig = _signature(kid)
            if sig in seen or (mixed and not any(_is_dense(x) for x in kid.modules())):
                continue
            if any(kid is not b and _inside(kid, b) for _, b in out):
                continue
            seen.add(sig)
            out.append((f"{p}.{j}" if p else str(j), kid))
    return out or (_stacks(model, True) if not mixed else [])


def _inside(mod: nn.Module, outer: nn.Module) -> bool:
    return any(mod is m for m in outer.modules())


def _example_inputs(model: nn.Module, stored: dict | None) -> dict | None:
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    cfg = getattr(model, "config", None)
    vocab = getattr(cfg, "vocab_size", None) or 2
    if stored:
        out = {}
        for k, t in stored.items():
            if not isinstance(t, torch.Tensor):
                out[k] = t
                continue
            shape = (1, *t.shape[1:]) if t.dim() >= 1 else tuple(t.shape)
            if dev.type == "meta":
                out[k] = torch.empty(shape, dtype=t.dtype, device="meta")
            elif t.is_floating_point():
                out[k] = torch.randn(shape, dtype=t.dtype, device=dev)
            elif not t.is_meta:  # remembered values (call_order.VALUES_KEY): placeholder tokens
                out[k] = t[:1].to(dev) if t.dim() >= 1 else t.to(dev)
            elif t.dtype == torch.bool or "mask" in k:
                out[k] = torch.ones(shape, dtype=t.dtype, device=dev)
            elif "input_ids" not in k:
                # another index tensor (positions, entity ids, token types): the stored meta tensor has no values
                # and its table's size is not the vocabulary's, but index 0 is valid in every table
                out[k] = torch.zeros(shape, dtype=t.dtype, device=dev)
            else:
                out[k] = torch.randint(0, int(vocab), shape, dtype=t.dtype, device=dev)
        return out
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    ids = lambda: torch.randint(1, int(vocab), (1, 8), device=dev)
    if "input_ids" in params:
        out = {"input_ids": ids()}
        if "decoder_input_ids" in params and getattr(cfg, "is_encoder_decoder", False):
            out["decoder_input_ids"] = ids()
        return out
    if "pixel_values" in params and cfg is not None:
        vis = getattr(cfg, "vision_config", None) or cfg
        size = getattr(vis, "image_size", None)
        size = size[0] if isinstance(size, (list, tuple)) else size
        ch = getattr(vis, "num_channels", 3)
        if isinstance(size, int):
            return {"pixel_values": torch.randn(1, ch, size, size, device=dev)}
    return None


_LOCK = threading.RLock()
_DONE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # top model -> {block path: BlockSplit}
_BY_DIGEST: dict = {}  # (top class, config digest, input shapes) -> {block path: BlockSplit}
# (attention class name, child name, config digest) -> (role, Layout or None, refusal or None)
_REGISTRY: dict = {}
_HEADS: dict = {}  # (attention class name, config digest) -> (heads, key/value heads)
_HEAD_INPUTS: dict = {}  # (attention class name, config digest) -> ((argument, heads axis), ...)


def analyse(
    model: nn.Module, stored_inputs: dict | None = None, real: nn.Module | None = None
) -> dict[str, BlockSplit]:
    """``{block path: BlockSplit}`` for the first block of each class among ``model``'s stacks of blocks.

    Runs the model forward once (``torch.no_grad``, one sample) until every such block has run; ``{}`` when it
    cannot (no example inputs to build, or a forward that fails: callers then fall back to names). Cached per
    model instance and per model class + config + input shapes. ``real``: the same model with real tensors
    (the unscheduled model a meta copy was made from): where ``model``'s buffers are on the meta device, the
    maps follow an indexing by them with ``real``'s values (Swin's ``relative_position_index``, which gathers
    its per-head relative-position table, is a non-persistent buffer that a meta copy holds without values).
    """
    with _LOCK:
        if model in _DONE:
            return _DONE[model]
        result = _analyse_model(model, stored_inputs, real)
        _DONE[model] = result
        return result


def _real_buffers(model: nn.Module, real: nn.Module | None) -> dict[int, tuple]:
    """``{id(meta buffer of model): (it, real's buffer at the same path)}`` (same shape and dtype, on the
    CPU)."""
    if real is None or real is model:
        return {}
    theirs = dict(real.named_buffers())
    out = {}
    for name, buf in model.named_buffers():
        other = theirs.get(name)
        if (
            buf.is_meta
            and isinstance(other, torch.Tensor)
            and not other.is_meta
            and tuple(other.shape) == tuple(buf.shape)
            and other.dtype == buf.dtype
        ):
            out[id(buf)] = (buf, other.detach().to("cpu"))
    return out


def _analyse_model(model: nn.Module, stored_inputs: dict | None, real=None) -> dict[str, BlockSplit]:
    from . import feature_inputs as _feature_inputs
    from . import mixers as _mixers

    blocks = _stacks(model)
    if not blocks:
        return {}
    inputs = _example_inputs(model, stored_inputs)
    if inputs is None:
        return {}
    key = (
        type(model).__qualname__,
        _config_digest(getattr(model, "config", None)),
        tuple((k, tuple(v.shape)) for k, v in inputs.items() if isinstance(v, torch.Tensor)),
        # each block's structure too: a shrunk copy (the numeric check's, a stack cut inside a block) shares the
        # config and the block paths but not what is inside them (LeViT's stages, each a block of layers)
        tuple((p, _signature(b)) for p, b in blocks),
    )
    if key[1] is not None and key in _BY_DIGEST:
        result = _BY_DIGEST[key]
        _register(model, result)
        return result
    rec = _Recorder()
    rec.values = _real_buffers(model, real)
    handles = []
    pending = {p for p, _ in blocks}
    dense_by_block: dict[str, dict] = {}
    recs: dict[str, _Snapshot] = {}
    mixer_args: dict[str, dict] = {}  # block path -> {candidate mixer path: its first call's arguments}

    def make_hooks(bpath: str, block: nn.Module):
        r = rec
        dense = {rel: m for rel, m in block.named_modules() if rel and _is_dense(m)}
        dense_by_block[bpath] = dense
        names = {}
        for rel, m in block.named_modules():
            if _is_dense(m) or m is block:
                continue
            for pn, prm in m.named_parameters(recurse=False):
                if prm is not None:
                    names[id(prm)] = f"{rel}:{pn}"
        buffers = _head_buffers.names(block, _is_dense)
        names.update(buffers)
        buffer_keys = set(buffers.values())

        def pre(_m, args, kwargs):
            r.active += 1
            r.params = names
            r.buffer_keys, r.meets = buffer_keys, []
            r.events, r.linear_in, r.linear_in_shape, r.routers, r.n_attn = [], {}, {}, set(), 0
            r.info, r.keep, r.score_extras, r.view_of, r.param_uses, r.ran = {}, [], [], {}, {}, set()
            r.input_shapes, r.input_of, r.input_aliases = {}, {}, {}
            r.aligned, r.mixed = {}, set()
            r.channel_groups = {}
            r.topk_src, r.out_src = set(), set()

        def post(_m, _args, _kwargs, _out):
            r.active -= 1
            r.out_src = set().union(
                *(i.src for i in map(r.info.get, map(id, _tensors(_out))) if i is not None)
            )
            recs[bpath] = _Snapshot(r)
            pending.discard(bpath)
            if not pending:
                raise _Done

        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(block.register_forward_hook(post, with_kwargs=True))
        handles.extend(_mixers.capture(block, mixer_args.setdefault(bpath, {})))
        handles.extend(_feature_inputs.capture(block, r))  # per-feature block arguments
        handles.extend(_attention_site.capture(bpath, block, r))  # where attention runs
        for rel, m in dense.items():

            def lin_pre(_m, args, rel=rel):
                r.ran.add(rel)
                if args and isinstance(args[0], torch.Tensor):
                    inf = r.get(args[0])
                    if inf is not None:
                        r.linear_in[rel] = inf
                        r.linear_in_shape[rel] = tuple(args[0].shape)

            feats = _dense_out(m)

            def lin_post(_m, _args, out, rel=rel, feats=feats):
                if isinstance(out, torch.Tensor) and out.shape[-1] == feats:
                    prev = r.info.get(id(out))
                    src = (prev.src if prev else frozenset()) | {rel}
                    mp = torch.arange(feats).expand(*out.shape)
                    r.set(out, _Info({rel: [mp]}, frozenset({rel}) | (src - src)))

            handles.append(m.register_forward_pre_hook(lin_pre))
            handles.append(m.register_forward_hook(lin_post))
        arg_names: dict[str, list] = {}
        for rel, m in block.named_modules():
            if rel and not _is_dense(m):

                def sub_pre(mod, args, kwargs, rel=rel):
                    # tensors from outside the block reaching a module (MPT's ALiBi position_bias): mapped, so a
                    # per-head one shows where it meets the attention scores
                    if not r.active:
                        return
                    if rel not in arg_names:
                        try:
                            arg_names[rel] = list(inspect.signature(type(mod).forward).parameters)[1:]
                        except (TypeError, ValueError):
                            arg_names[rel] = []
                    names_ = arg_names[rel]
                    named = [(names_[j] if j < len(names_) else None, a) for j, a in enumerate(args) if j]
                    for nm, a in [*named, *kwargs.items()]:
                        if nm is None or "hidden" in nm or not isinstance(a, torch.Tensor):
                            continue
                        if (
                            id(a) in r.input_of
                        ):  # passed on inward (MPNet's position_bias: layer -> attention)
                            r.input_shapes.setdefault(f"{rel}:{nm}", tuple(a.shape))
                            r.input_aliases.setdefault(r.input_of[id(a)], []).append(f"{rel}:{nm}")
                            continue
                        note_outside_input(r, f"{rel}:{nm}", a)

                handles.append(m.register_forward_pre_hook(sub_pre, with_kwargs=True))
        for rel, m in block.named_modules():
            if rel and not _is_dense(m) and _is_norm(m):

                def norm_post(_m, _args, out, rel=rel):
                    # a norm over a projection's whole output needs all its features: no split through it, unless
                    # its parameters follow those features (then it is sharded with them: feature_params)
                    if not isinstance(out, torch.Tensor):
                        return
                    inf = r.info.get(id(out))
                    if inf is None:
                        return
                    width = out.shape[-1]
                    if _feature_norm(_m, width) and not any(
                        isinstance(a, torch.Tensor) and id(a) in r.mixed for a in _args
                    ):
                        return
                    keep = {p: ms for p, ms in inf.maps.items() if p not in dense or dense_feats(p) != width}
                    r.set(out, _Info(keep, inf.src, inf.scores))

                handles.append(m.register_forward_hook(norm_post))

        def dense_feats(p):
            return _dense_out(dense[p])

    for bpath, block in blocks:
        make_hooks(bpath, block)
    was_training = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.no_grad(), rec:
            try:
                model(**inputs)
            except _Done:
                pass
    except Exception:  # noqa: BLE001, S110 - a model the inference cannot run: callers fall back to names
        pass
    finally:
        for h in handles:
            h.remove()
        for m, t in was_training.items():
            m.training = t
    result = {}
    for bpath, block in blocks:
        snap = recs.get(bpath)
        if snap is None:
            continue
        try:
            split = _analyse(snap, block, dense_by_block[bpath])
            _resolve_head_params(split, block)
            _resolve_head_inputs(split, snap.input_shapes, snap.input_aliases)
            _mixers.complete(
                split, block, mixer_args.get(bpath, {})
            )  # SSM mixers: slapo_lab/sharding/mixers.py
            _feature_inputs.complete(split, block, snap)  # slapo_lab/sharding/feature_inputs.py
            result[bpath] = split
        except Exception:  # noqa: BLE001, S112 - a block the analysis cannot read: names are the hints
            continue
    if key[1] is not None and len(result) == len(blocks):
        # only a complete reading stands for every model of this class and config: a forward that failed
        # part-way (a meta copy whose expert kernel needs real values) leaves the unscheduled model to try
        _BY_DIGEST[key] = result
    _register(model, result)
    return result


class _Snapshot:
    """What one block's forward recorded (the recorder is reset for the next block)."""

    def __init__(self, r: _Recorder) -> None:
        self.events, self.linear_in, self.linear_in_shape = r.events, r.linear_in, r.linear_in_shape
        self.routers = set(r.routers)
        self.param_uses = dict(r.param_uses)
        self.ran = set(r.ran)
        self.input_shapes = dict(r.input_shapes)
        self.input_aliases = dict(r.input_aliases)
        self.aligned = dict(r.aligned)
        self.meets, self.buffer_keys = list(r.meets), set(r.buffer_keys)
        self.channel_groups = dict(getattr(r, "channel_groups", {}))
        self.topk_src, self.out_src = set(r.topk_src), set(r.out_src)


def _feature_norm(mod: nn.Module, width: int) -> bool:
    """A norm with parameters, each of one entry per feature of a ``width``-wide last axis."""
    params = [p for p in mod._parameters.values() if p is not None]
    return bool(params) and all(p.dim() >= 1 and p.shape[-1] == width == p.numel() for p in params)


def _is_norm(mod: nn.Module) -> bool:
    return isinstance(mod, (nn.LayerNorm, nn.RMSNorm)) or type(mod).__name__.endswith(
        ("LayerNorm", "RMSNorm")
    )


def _resolve_head_params(split: BlockSplit, block: nn.Module) -> None:
    resolved = []
    for mod, name, sets, n in split.head_params:
        owner = block.get_submodule(mod) if mod else block
        prm = getattr(owner, name, None)
        if not isinstance(prm, torch.Tensor):
            continue
        shape = tuple(prm.shape)
        idx = torch.arange(prm.numel()).view(shape)
        for axis, size in enumerate(shape):
            if size != n:
                continue
            if all(set(idx.select(axis, h).reshape(-1).tolist()) >= sets[h] for h in range(n)):
                resolved.append(HeadParam(mod, name, axis, n))
                break
        else:  # heads x head_dim flattened on one axis (DeBERTa's q_bias / v_bias): head h a contiguous range
            for axis, size in enumerate(shape):
                if size % n or size == n:
                    continue
                chunks = idx.chunk(n, dim=axis)
                if all(set(chunks[h].reshape(-1).tolist()) >= sets[h] for h in range(n)):
                    resolved.append(HeadParam(mod, name, axis, n))
                    break
    split.head_params = resolved


def _resolve_head_inputs(split: BlockSplit, shapes: dict, aliases: dict) -> None:
    """The heads axis of each per-head tensor argument (of the attention module it reaches, itself or passed on
    to it by an outer module of the block), from its shape."""
    resolved = []
    for first, name0, sets, n in split.head_inputs:
        where = [f"{first}:{name0}", *aliases.get(f"{first}:{name0}", [])]
        at = next((w for w in where if w.rsplit(":", 1)[0] in split.attention), None)
        shape = shapes.get(at) if at is not None else None
        if shape is None:
            continue
        mod, name = at.rsplit(":", 1)
        idx = torch.arange(max(1, int(torch.tensor(shape).prod()))).view(shape)
        for axis, size in enumerate(shape):
            if size == n and all(set(idx.select(axis, h).reshape(-1).tolist()) >= sets[h] for h in range(n)):
                resolved.append(HeadParam(mod, name, axis, n))
                break
    split.head_inputs = resolved


def note_outside_input(rec, key: str, a: torch.Tensor) -> None:
    """Map ``a``, a tensor from outside the analysed block passed to the module at ``key``'s
    ``"module path:argument"`` (``""`` for the block itself), so its entries show where they meet the
    features: floating point, at least 2-D and at most 2**20 entries, and not yet mapped, else nothing."""
    if (
        not a.is_floating_point()
        or a.dim() < 2
        or a.numel() > 1 << 20
        or id(a) in rec.info
        or id(a) in rec.params
    ):
        return
    rec.set(a, _Info({f"input:{key}": [torch.arange(a.numel()).view(tuple(a.shape))]}))
    rec.input_shapes[key] = tuple(a.shape)
    rec.input_of[id(a)] = key


def _register(model: nn.Module, result: dict) -> None:
    """Make the inferred layouts and head counts visible to the shard rules (which see one module)."""
    for bpath, split in result.items():
        block = model.get_submodule(bpath)
        for rel, role in split.roles.items():
            if not (role in ("o", "mlp_in") or set(role) <= set("qkvg")):
                continue
            parent_rel, _, child = rel.rpartition(".")
            parent = block.get_submodule(parent_rel) if parent_rel else block
            key = (type(parent).__name__, child, _config_digest(getattr(parent, "config", None)))
            _REGISTRY[key] = (role, split.layouts.get(rel), None)
        for rel in split.whole:
            parent_rel, _, child = rel.rpartition(".")
            parent = block.get_submodule(parent_rel) if parent_rel else block
            attn = split.refusals.get(parent_rel)
            if attn and rel in split.refused_roles:
                key = (type(parent).__name__, child, _config_digest(getattr(parent, "config", None)))
                _REGISTRY[key] = (split.refused_roles[rel], None, attn)
        for apath, counts in split.attention.items():
            attn = block.get_submodule(apath) if apath else block
            _HEADS[(type(attn).__name__, _config_digest(getattr(attn, "config", None)))] = counts
        _attention_site.register(block, split, _REGISTRY, _config_digest)  # a wrapped projection (LeViT)
        for hi in split.head_inputs:
            attn = block.get_submodule(hi.module) if hi.module else block
            key = (type(attn).__name__, _config_digest(getattr(attn, "config", None)))
            found = _HEAD_INPUTS.setdefault(key, ())
            if hi.name not in dict(found):
                _HEAD_INPUTS[key] = (*found, (hi.name, hi.axis))


def lookup(parent: nn.Module | None, child: str) -> tuple | None:
    """``(role, Layout or None, refusal or None)`` inferred for ``parent``'s child ``child``, or None."""
    if parent is None:
        return None
    return _REGISTRY.get((type(parent).__name__, child, _config_digest(getattr(parent, "config", None))))


def inferred_heads(attn: nn.Module | None) -> tuple[int, int] | None:
    """``(heads, key/value heads)`` read from the dataflow of ``attn``'s class (and config), or None."""
    if attn is None:
        return None
    return _HEADS.get((type(attn).__name__, _config_digest(getattr(attn, "config", None))))


def inferred_head_inputs(attn: nn.Module | None) -> tuple:
    """``((argument name, heads axis), ...)``: the per-head tensor arguments ``attn``'s class (and config) takes,
    built for all heads outside its block (MPT's ALiBi ``position_bias``), read from the dataflow; ``()`` if none."""
    if attn is None:
        return ()
    return _HEAD_INPUTS.get((type(attn).__name__, _config_digest(getattr(attn, "config", None))), ())


def ensure(sch) -> None:
    """Infer the split of the schedule's top model once (before its first shard), so the shard rules find the
    layouts of fused projections in any process."""
    top = sch.get_top_schedule()
    if top.mod in _DONE:
        return
    _analyse_top(top)


def _analyse_top(top) -> dict[str, BlockSplit]:
    """:func:`analyse` of the top schedule's model; where its forward cannot run (a meta copy whose forward
    reads tensor values, such as DeBERTa's relative positions), of the unscheduled model with real weights the
    schedule remembers (:data:`slapo_lab.call_order.REFERENCE_KEY`), whose modules have the same paths."""
    from ..call_order import _INPUTS_KEY, REFERENCE_KEY, VALUES_KEY

    inputs = top._top.extra.get(_INPUTS_KEY)
    if inputs:
        inputs = {**inputs, **top._top.extra.get(VALUES_KEY, {})}
    ref = top._top.extra.get(REFERENCE_KEY)
    same = ref is not None and ref is not top.mod and type(ref) is type(top.mod)
    result = analyse(top.mod, inputs, ref if same else None)
    if not same:
        return result
    if result and len(result) >= len(_stacks(top.mod)):
        return result
    # the meta forward stopped before some block ran (an MoE block's data-dependent routing on the meta device,
    # DeepSeek-V3's layers after ``first_k_dense_replace``): the real model's forward records those blocks
    merged = {**analyse(ref, inputs), **result}
    if merged:
        with _LOCK:
            _DONE[top.mod] = merged
    return merged


def _signature(mod: nn.Module) -> tuple:
    """A block's structure: its modules' classes and its parameters' names and global shapes (blocks of one
    class may differ in their parameters: MiMo-V2-Flash's layers with and without attention sinks)."""
    return (
        type(mod),
        tuple((r, type(x).__name__) for r, x in mod.named_modules()),
        tuple((n, tuple(getattr(p, "orig_shape", p.shape))) for n, p in mod.named_parameters()),
    )


def _sub_split(split: BlockSplit, prefix: str) -> BlockSplit:
    """The part of ``split`` under ``prefix`` (a path inside its block), with paths relative to it."""
    pre = prefix + "."

    def cut(d):
        return {k[len(pre) :]: v for k, v in d.items() if k.startswith(pre)}

    return BlockSplit(
        cut(split.roles),
        cut(split.layouts),
        cut(split.whole),
        [
            HeadParam(hp.module[len(pre) :], hp.name, hp.axis, hp.heads)
            for hp in split.head_params
            if hp.module.startswith(pre)
        ],
        cut(split.attention),
        cut(split.refusals),
        cut(split.refused_roles),
        {k[len(pre) :] for k in split.shared if k.startswith(pre)},
        {k[len(pre) :] for k in split.grad_sum if k.startswith(pre)},
        {k[len(pre) :] for k in split.ran if k.startswith(pre)},
        head_inputs=[
            HeadParam(hi.module[len(pre) :], hi.name, hi.axis, hi.heads)
            for hi in split.head_inputs
            if hi.module.startswith(pre)
        ],
        feature_params={
            k[len(pre) :]: {x[len(pre) :] for x in v}
            for k, v in split.feature_params.items()
            if k.startswith(pre)
        },
        unpaired={k[len(pre) :] for k in split.unpaired if k.startswith(pre)},
    )


def _prefixed(split: BlockSplit, prefix: str) -> BlockSplit:
    """``split`` with ``prefix`` put before every path (the block seen from a container around it)."""
    pre = prefix + "."

    def add(d):
        return {pre + k: v for k, v in d.items()}

    return BlockSplit(
        add(split.roles),
        add(split.layouts),
        add(split.whole),
        [HeadParam(pre + hp.module, hp.name, hp.axis, hp.heads) for hp in split.head_params],
        {pre + k if k else prefix: v for k, v in split.attention.items()},
        {pre + k if k else prefix: v for k, v in split.refusals.items()},
        add(split.refused_roles),
        {pre + k for k in split.shared},
        {pre + k for k in split.grad_sum},
        {pre + k for k in split.ran},
        head_inputs=[HeadParam(pre + hi.module, hi.name, hi.axis, hi.heads) for hi in split.head_inputs],
        feature_params={pre + k: {pre + x for x in v} for k, v in split.feature_params.items()},
        unpaired={pre + k for k in split.unpaired},
    )


def block_split(sch, block_path: str) -> BlockSplit | None:
    """The :class:`BlockSplit` of the block at ``block_path`` (relative to ``sch``), read from the analysed
    block of the same structure (or the analysed block around it), or None when the dataflow could not be
    recorded."""
    top = sch.get_top_schedule()
    result = _analyse_top(top)
    if not result:
        return None
    full = ".".join(p for p in (sch.path, block_path) if p)
    if full in result:
        return result[full]
    for p, split in result.items():
        if full.startswith(p + "."):
            return _sub_split(split, full[len(p) + 1 :])
    mod = top.mod.get_submodule(full) if full else top.mod
    sig = _signature(mod)
    for p, split in result.items():  # a block of an analysed structure (before a block analysed inside it:
        if _signature(top.mod.get_submodule(p)) == sig:  # Swin's third stage, whose first layer was analysed)
            return split
    inner = [p for p in result if p.startswith(full + ".") or not full]
    if len(inner) == 1:  # the requested block is a container around one analysed block
        around = _around(top, mod, full, result)
        return around or _prefixed(result[inner[0]], inner[0][len(full) + 1 :] if full else inner[0])
    for p, split in result.items():  # a block of the same structure nested in an analysed one (Swin's stages)
        outer = top.mod.get_submodule(p)
        for rel, sub in outer.named_modules():
            if rel and _signature(sub) == sig:
                return _sub_split(split, rel)
    for p, split in result.items():  # a container around a block of an analysed structure (Funnel's lists)
        want = _signature(top.mod.get_submodule(p))
        found = [rel for rel, sub in mod.named_modules() if rel and _signature(sub) == want]
        if len(found) == 1:
            return _prefixed(split, found[0])
    return _around(top, mod, full, result)


def _around(top, mod: nn.Module, full: str, result: dict) -> BlockSplit | None:
    """The split of a container of several blocks (PVT's ``encoder.block.i``, a list of layers whose first
    alone was analysed): every outermost child that is an analysed block, or has an analysed block's
    structure, with its split; None when fewer than two children have one (the callers' cases)."""
    sigs = [(_signature(top.mod.get_submodule(p)), split) for p, split in result.items()]
    parts: list[BlockSplit] = []
    taken: list[str] = []
    for rel, sub in mod.named_modules():
        if not rel or any(rel.startswith(t + ".") for t in taken):
            continue
        hit = result.get(f"{full}.{rel}" if full else rel)
        if hit is None:
            sig = _signature(sub)
            hit = next((split for want, split in sigs if want == sig), None)
        if hit is not None:
            parts.append(_prefixed(hit, rel))
            taken.append(rel)
    if len(parts) < 2:
        return None
    out = BlockSplit()
    for part in parts:
        for f in ("roles", "layouts", "whole", "attention", "refusals", "refused_roles"):
            getattr(out, f).update(getattr(part, f))
        for f in ("shared", "grad_sum", "ran"):
            getattr(out, f).update(getattr(part, f))
        out.head_params.extend(part.head_params)
    return out


__all__ = [
    "BlockSplit",
    "HeadParam",
    "Layout",
    "analyse",
    "block_split",
    "ensure",
    "inferred_head_inputs",
    "inferred_heads",
    "lookup",
]
