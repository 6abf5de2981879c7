"""The recorder of the split inference: a :class:`torch.overrides.TorchFunctionMode` that carries index maps.

During one forward of the model (:func:`slapo_lab.sharding.infer.analyse`), inside the first block of each
stack, :class:`_Recorder` gives every ``nn.Linear`` / HF ``Conv1D`` output, every parameter of another module
and every attention output an index map (:mod:`slapo_lab.sharding.infer_maps`), replays shape ops on the maps,
carries them through elementwise ops and drops them anywhere else; where maps meet attention
(``scaled_dot_product_attention``, or a matmul of two mapped tensors whose scores a second matmul applies to a
mapped value) it records an event naming each q / k / v argument's maps, which the analysis
(:mod:`slapo_lab.sharding.infer_analyse`) reads into heads and layouts. Routing ops (``topk`` ...) mark router
lineage; per-head score terms (:mod:`slapo_lab.sharding.score_terms`), head axes other than ``-3``
(:mod:`slapo_lab.sharding.head_axes`), per-head buffers (:mod:`slapo_lab.sharding.head_buffers`) and channel
heads (:mod:`slapo_lab.sharding.channel_heads`) are noted on the way. :class:`_Snapshot` keeps what one block
recorded; :func:`note_outside_input` maps a tensor argument built outside the block (MPT's ALiBi bias). Source
of the mechanism: PyTorch's ``torch.overrides`` (``__torch_function__`` modes). Split from
:mod:`slapo_lab.sharding.infer`, which re-exports :func:`note_outside_input`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from . import attention_site as _attention_site
from . import channel_heads as _channel_heads
from . import head_axes as _head_axes
from . import head_buffers as _head_buffers
from . import score_terms as _score_terms
from .infer_maps import (
    _BOOL,
    _COMPLEX_OPS,
    _FACTORY_OPS,
    _MAX_MAPS,
    _PASS_OPS,
    _ROUTE_OPS,
    _SHAPE_OPS,
    _WRITE_OPS,
    _broadcasts,
    _complex_maps,
    _expand_ellipsis,
    _Info,
    _linear_maps,
    _merge_scores,
    _residual,
    _tensors,
    _varies,
)


def _is_score_matmul(a: _Info | None, b: _Info | None, out: Any) -> bool:
    """Whether a product of values mapped ``a`` and ``b`` (neither scores) of two linears' features is an
    attention's scores (an output of at least 3 axes)."""
    return (
        a is not None
        and b is not None
        and a.scores is None
        and _linear_maps(a)
        and _linear_maps(b)
        and isinstance(out, torch.Tensor)
        and out.dim() >= 3
    )


def _broadcast_map(m: torch.Tensor, o: torch.Tensor) -> torch.Tensor | None:
    """The index map ``m`` broadcast to the shape of ``o``, or None when it does not broadcast."""
    if m.dim() > o.dim():
        return None
    try:
        return torch.broadcast_to(m, o.shape) if tuple(m.shape) != tuple(o.shape) else m
    except RuntimeError:
        return None


def _einsum_of_two(args: tuple, out: Any) -> tuple[list[torch.Tensor], str, str, str] | None:
    """``(operands, subscripts of the first, of the second, of the output)`` of an ``einsum`` of two tensors
    (an ellipsis expanded), or None for any other call."""
    if not args or not isinstance(args[0], str) or not isinstance(out, torch.Tensor):
        return None
    ops = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
    eq = args[0].replace(" ", "")
    if len(ops) != 2 or "->" not in eq or not all(isinstance(o, torch.Tensor) for o in ops):
        return None
    eq = _expand_ellipsis(eq, ops)
    if eq is None:
        return None
    (s1, s2), so = eq.split("->")[0].split(","), eq.split("->")[1]
    return ops, s1, s2, so


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

    def note(self, func: Callable, args: tuple, kwargs: dict, out: Any) -> None:
        """Carry the index maps of one torch call's inputs to its output ``out`` (or note what it tells: a write,
        an attention, a parameter applied to a producer's features)."""
        name = getattr(func, "__name__", "")
        if self.values:
            self.follow_values(func, args, kwargs, out)
        if name in _WRITE_OPS:
            self.write(name, args)
            return
        if name in _FACTORY_OPS:
            return
        self._note_index_view(name, args, out)
        ins = [(t, self.get(t)) for t in _tensors((args, kwargs))]
        ins = [(t, i) for t, i in ins if i is not None]
        if not ins:
            return
        src = frozenset().union(*(i.src for _, i in ins))
        if len(ins) > 1 and self._note_param_uses(name, args, kwargs, out, ins, src):
            return
        src = self._note_routing(name, ins, src)
        if name == "scaled_dot_product_attention":
            q, k, v = args[:3]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            self.attention(q, k, v, [mask] if isinstance(mask, torch.Tensor) else [], out, src)
            return
        if name == "einsum" and self.einsum(args, out, src):
            return
        if self._note_product(name, args, kwargs, out, src):
            return
        outs = list(_tensors(out))
        if outs:
            self._carry_maps(func, name, args, kwargs, out, outs, ins, src)

    def _note_index_view(self, name: str, args: tuple, out: Any) -> None:
        """Remember ``out = t[index]`` (``view_of``), kept alive so its id is not reused."""
        if name == "__getitem__" and isinstance(out, torch.Tensor) and isinstance(args[0], torch.Tensor):
            self.view_of[id(out)] = (args[0], args[1])
            self.keep.append(out)

    def _note_param_uses(
        self, name: str, args: tuple, kwargs: dict, out: Any, ins: list, src: frozenset
    ) -> bool:
        """A parameter (or a value made from one) applied to values some linear produced: note the producers it
        meets (``param_uses``), and a parameter that follows their features (:meth:`align`, a depthwise
        convolution's :meth:`align_depthwise`); True when the call is fully handled."""
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
        if not isinstance(out, torch.Tensor):
            return False
        self.align(ins, out)
        _channel_heads.note_conv(self, name, args, kwargs)  # heads as channels (channel_heads.py)
        return name in ("conv1d", "conv2d") and self.align_depthwise(args, kwargs, out, src)

    def _note_routing(self, name: str, ins: list, src: frozenset) -> frozenset:
        """The linears whose features reach a top-k choice route tokens (``routers``); after ``topk`` what
        follows derives from the choice, not the scores: returns the sources the output keeps."""
        if name in _ROUTE_OPS:
            self.routers |= {
                p for _, i in ins for p in i.maps if not p.startswith(("param:", "@", "cols:", "input:"))
            }
        if (
            name == "topk"
        ):  # a choice of tokens or experts: what follows derives from the choice, not the scores
            self.topk_src |= {p for p in src if not p.startswith("@")}
            return frozenset()
        return src

    def _note_product(self, name: str, args: tuple, kwargs: dict, out: Any, src: frozenset) -> bool:
        """A product of two mapped values: the scores of q and k (tagged on the output), the scores applied to v
        (an attention), or a weight over a linear's features (:func:`score_terms.param_matmul`); True when
        handled."""
        mm = None
        if name in ("matmul", "bmm", "__matmul__") and len(args) >= 2:
            mm = (args[0], args[1])
        elif name == "baddbmm":  # BLOOM: alibi.baddbmm(batch1=q, batch2=k^T)
            mm = (
                kwargs.get("batch1", args[1] if len(args) > 1 else None),
                kwargs.get("batch2", args[2] if len(args) > 2 else None),
            )
        if mm is None or not all(isinstance(x, torch.Tensor) for x in mm):
            return False
        a, b = self.get(mm[0]), self.get(mm[1])
        if _is_score_matmul(a, b, out):
            h = _head_axes.heads_axis(a, mm[0])  # heads not at -3 (Hiera's windows axis): head_axes.py
            if h is not None:
                mm = _head_axes.canonical_scores(self, mm[0], mm[1], h)
            self.set(out, _Info({}, src, ((mm[0], mm[1]),)))
            return True
        if a is not None and a.scores is not None and b is not None and _linear_maps(b):
            self._scores_times_values(a, b, mm, out, src)
            return True
        # a weight over the features (Inkling)
        return _score_terms.param_matmul(self, mm, a, b, out, src)

    def _scores_times_values(self, a: _Info, b: _Info, mm: tuple, out: Any, src: frozenset) -> None:
        """Scores (tagged ``a``) applied to v (``mm[1]``): an attention, its heads axis moved where the score
        matmul moved it (:mod:`slapo_lab.sharding.head_axes`)."""
        q, k, moved = _head_axes.scores_of(self, *a.scores[0])
        extras = [mm[0]]
        h, axes = _head_axes.heads_axis(b, mm[1]) if moved else None, None
        if h is not None and isinstance(out, torch.Tensor):
            axes = (h + out.dim() - mm[1].dim(), out.dim() - 1)
            mm = (mm[0], _head_axes.canonical(self, mm[1], h))
        self.attention(q, k, mm[1], extras, out, src, a.scores[1:], axes)

    def _carry_maps(
        self,
        func: Callable,
        name: str,
        args: tuple,
        kwargs: dict,
        out: Any,
        outs: list,
        ins: list,
        src: frozenset,
    ) -> None:
        """Carry the maps through an op that is no product: a pass-through, a shape op, a table lookup, a
        constant pad, a complex view, a reduction over tokens, or anything elementwise."""
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
            self._carry_elementwise(o, ins, args, kwargs, src, scores)

    def _carry_elementwise(
        self, o: torch.Tensor, ins: list, args: tuple, kwargs: dict, src: frozenset, scores: tuple | None
    ) -> None:
        """Give the output ``o`` of an elementwise op (or anything else) the maps of its inputs that broadcast
        to it; note a per-head buffer applied to heads, a residual mix and a score term."""
        maps: dict = {}
        for t, i in ins:
            if t.dim() > o.dim() or not _broadcasts(tuple(t.shape), tuple(o.shape)):
                continue
            for p, ms in i.maps.items():
                for m in ms:
                    mb = _broadcast_map(m, o)
                    lst = maps.setdefault(p, []) if mb is not None else None
                    if lst is not None and len(lst) < _MAX_MAPS and not any(x is m for x in lst):
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
        parsed = _einsum_of_two(args, out)
        if parsed is None:
            return False
        ops, s1, s2, so = parsed
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
        """Run a shape op (view, permute, gather, ...) on each producer's index maps in place of the values, so
        the output's maps follow the op; a map the op cannot follow is dropped."""
        producers = {}
        for _, i in ins:
            for p, ms in i.maps.items():
                producers[p] = max(producers.get(p, 0), len(ms))
        results: dict = {}
        for p, n in producers.items():
            for j in range(n):
                try:
                    mapped = func(
                        *self._map_arg(list(args), func, p, j),
                        **{k: self._map_arg(v, func, p, j) for k, v in kwargs.items()},
                    )
                except Exception:  # noqa: BLE001, S112 - this map cannot follow the op: dropped
                    continue
                for idx, m in enumerate(_tensors(mapped)):
                    results.setdefault(idx, {}).setdefault(p, []).append(m)
        for idx, o in enumerate(_tensors(out)):
            maps = {
                p: [m for m in ms if tuple(m.shape) == tuple(o.shape) and bool((m >= 0).any())]
                for p, ms in results.get(idx, {}).items()
            }
            self.set(o, _Info({p: ms for p, ms in maps.items() if ms}, src, scores))
            if scores is not None and _score_terms.is_term(maps):
                self.score_extras.append((o, self.info[id(o)]))

    def _map_arg(self, x: Any, func: Callable, p: str, j: int) -> Any:
        """An argument of a shape op with each tensor replaced by the ``j``-th index map of producer ``p`` (-1
        where it has none; an index tensor by its real, CPU values); lists and tuples element-wise."""
        if isinstance(x, torch.Tensor):
            return self._map_tensor(x, func, p, j)
        if isinstance(x, (list, tuple)):
            return type(x)(self._map_arg(y, func, p, j) for y in x)
        return x

    def _map_tensor(self, x: torch.Tensor, func: Callable, p: str, j: int) -> torch.Tensor:
        """One tensor argument of a shape op in :meth:`_map_arg`."""
        inf = self.info.get(id(x)) or (self.get(x) if id(x) in self.params else None)
        if inf is not None and p in inf.maps:
            ms = inf.maps[p]
            # a map broadcast by an elementwise op is an expanded view, which ``view`` cannot reshape (Laguna's
            # per-head gate, then ``.view(B, T, -1)``): a copy can
            m = ms[min(j, len(ms) - 1)]
            return m if m.is_contiguous() else m.contiguous()
        if inf is not None or x.is_floating_point():
            return torch.full(tuple(x.shape), -1, dtype=torch.long)
        if x.device.type == "meta":  # an index buffer of a meta copy: the real one's values
            if self.real(x).is_meta:  # no values (torch would gather a CPU map into garbage)
                return _score_terms.unknown_index(func, x)
            return self.real(x)
        return x.to("cpu")

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


def note_outside_input(rec: _Recorder, key: str, a: torch.Tensor) -> None:
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
