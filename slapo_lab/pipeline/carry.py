"""Adapt a split model for ``torch.distributed.pipelining``'s stage runtime: values carried between adjacent
stages only, and contiguous stage outputs (:func:`normalize_pipe`, run by
:func:`slapo_lab.pipeline.partition_pipeline` on every split).

Sources: Slapo ``slapo/pipeline.py`` (liveness forwarding); torchgpipe ``skip/layout.py``; PyTorch
``torch/distributed/pipelining/_IR.py`` (the split graph this rewrites).
"""

from __future__ import annotations

import operator

import torch
from torch import fx


def _contiguous_val(val):
    if isinstance(val, torch.Tensor) and not val.is_contiguous():
        return val.contiguous()
    return val


def _output_node(g: fx.Graph) -> fx.Node:
    return next(n for n in g.nodes if n.op == "output")


def _add_passthrough(split: fx.GraphModule, stage_node: fx.Node, value: fx.Node) -> fx.Node:
    """Make ``stage_node``'s stage also return its input ``value`` (a contiguous copy); return the new getitem."""
    sub = split.get_submodule(stage_node.target)
    g = sub.graph
    pos = list(stage_node.args).index(value)
    ph = [n for n in g.nodes if n.op == "placeholder"][pos]
    out = _output_node(g)
    with g.inserting_before(out):
        cl = g.call_function(torch.ops.aten.clone.default, (ph,), {"memory_format": torch.contiguous_format})
    cl.meta["val"] = _contiguous_val(ph.meta.get("val"))
    top = split.graph
    res = out.args[0]
    if isinstance(res, (tuple, list)):
        new_idx = len(res)
        out.args = (tuple(res) + (cl,),)
    else:  # single output -> tuple: existing users read item 0
        out.args = ((res, cl),)
        with top.inserting_after(stage_node):
            gi0 = top.call_function(operator.getitem, (stage_node, 0))
        stage_node.replace_all_uses_with(gi0, delete_user_cb=lambda u: u is not gi0)
        new_idx = 1
    last = max((u for u in stage_node.users), key=lambda u: _position(top, u), default=stage_node)
    with top.inserting_after(last if _position(top, last) > _position(top, stage_node) else stage_node):
        gi = top.call_function(operator.getitem, (stage_node, new_idx))
    sub.recompile()
    return gi


def _position(g: fx.Graph, node: fx.Node) -> int:
    for i, n in enumerate(g.nodes):
        if n is node:
            return i
    return -1


def _value_meta(split: fx.GraphModule, v: fx.Node):
    """The recorded example value (``meta["val"]``) of a value of the top split graph."""
    if v.op == "placeholder":
        for u in v.users:
            if u.op == "call_module":
                sub = split.get_submodule(u.target)
                return [n for n in sub.graph.nodes if n.op == "placeholder"][list(u.args).index(v)].meta.get(
                    "val"
                )
        return None
    if v.op == "call_function" and v.target is operator.getitem:
        res = _output_node(split.get_submodule(v.args[0].target).graph).args[0]
        x = res[v.args[1]]
    else:
        x = _output_node(split.get_submodule(v.target).graph).args[0]
    return x.meta.get("val") if isinstance(x, fx.Node) else None


def _add_input(split: fx.GraphModule, stage_node: fx.Node, value: fx.Node, val) -> None:
    """Give ``stage_node``'s stage one more input (unused inside) fed with ``value``."""
    sub = split.get_submodule(stage_node.target)
    g = sub.graph
    phs = [n for n in g.nodes if n.op == "placeholder"]
    with g.inserting_after(phs[-1]) if phs else g.inserting_before(next(iter(g.nodes))):
        ph = g.placeholder(f"carry_{value.name}")
    ph.meta["val"] = val
    stage_node.args = tuple(stage_node.args) + (value,)
    sub.recompile()


def _next_carry(top: fx.Graph, sidx: dict):
    """A value whose consumers are not just the next stage: ``(value, producer stage, consumer stages)``."""
    for v in top.nodes:
        if v.op == "placeholder":
            prod = 0
        elif v.op == "call_function" and v.target is operator.getitem and v.args[0] in sidx:
            prod = sidx[v.args[0]]
        elif v.op == "call_module" and not any(
            u.op == "call_function" and u.target is operator.getitem for u in v.users
        ):
            prod = sidx[v]
        else:
            continue
        consumers = {sidx[u] for u in v.users if u.op == "call_module"}
        if v.op == "placeholder":
            if consumers - {0}:
                return v, prod, consumers
        elif consumers - {prod + 1}:
            return v, prod, consumers
    return None


def _align_outputs(split: fx.GraphModule, stage_nodes: list[fx.Node]) -> None:
    """Order each stage's outputs as the next stage reads them.

    The runtime matches point-to-point messages by posting order only: the sender posts its outputs
    by index, the receiver its inputs by placeholder position. Two same-shaped tensors (a hidden
    state and a carried skip value) would silently swap unless both orders agree.
    """
    top = split.graph
    for i, node in enumerate(stage_nodes[:-1]):
        getitems = [u for u in node.users if u.op == "call_function" and u.target is operator.getitem]
        if len(getitems) < 2:
            continue
        nxt = stage_nodes[i + 1]
        pos = {a: k for k, a in enumerate(nxt.args) if isinstance(a, fx.Node)}
        order = sorted(getitems, key=lambda u: (pos.get(u, len(pos)), u.args[1]))
        if [u.args[1] for u in order] == list(range(len(order))) and list(node.users) == order:
            continue
        sub = split.get_submodule(node.target)
        out = _output_node(sub.graph)
        res = list(out.args[0])
        out.args = (tuple(res[u.args[1]] for u in order),)
        sub.recompile()
        anchor = node
        for k, old in enumerate(order):
            with top.inserting_after(anchor):
                new = top.call_function(operator.getitem, (node, k))
            new.meta = dict(old.meta)
            anchor = new
        news = [u for u in node.users if u not in getitems]
        for old, new in zip(order, news, strict=False):
            old.replace_all_uses_with(new)
            top.erase_node(old)


def _add_root_input(split: fx.GraphModule, stage0: fx.Node, v: fx.Node) -> None:
    """Make stage 0 take the model input ``v`` too (a placeholder of the same name, in model order)."""
    top_order = {n: i for i, n in enumerate(n for n in split.graph.nodes if n.op == "placeholder")}
    sub = split.get_submodule(stage0.target)
    g = sub.graph
    phs = [n for n in g.nodes if n.op == "placeholder"]
    args = list(stage0.args)
    k = next((i for i, a in enumerate(args) if top_order.get(a, -1) > top_order[v]), len(args))
    val = _value_meta(split, v)
    if k < len(phs):
        with g.inserting_before(phs[k]):
            ph = g.placeholder(v.target)
    else:
        with g.inserting_after(phs[-1]) if phs else g.inserting_before(next(iter(g.nodes))):
            ph = g.placeholder(v.target)
    ph.meta["val"] = val
    args.insert(k, v)
    stage0.args = tuple(args)
    sub.recompile()


def normalize_pipe(pipe) -> None:
    """Adapt the split for ``torch.distributed.pipelining``'s stage runtime (in place).

    * Only adjacent stages talk (the multi-stage schedules reject other sends, and a value with
      several consumers gets no backward: "Backward of skip connections not supported yet"). A
      value produced by stage ``i`` and read by stage ``j > i + 1`` -- a skip connection, T5's
      encoder output, an attention mask -- is therefore carried through stages ``i + 1 .. j - 1``:
      each passes a contiguous copy on (Slapo's liveness forwarding, torchgpipe's skip layout, made
      explicit). Gradients of the copies flow back along the same chain, so they sum correctly.
    * Model inputs reach only stage 0; one read later (T5's ``decoder_input_ids``) becomes an input of
      stage 0 as well and is carried from there the same way.
    * Every stage output is made contiguous (and so is the receiving placeholder's recorded value,
      from which receive buffers are allocated): gloo sends only contiguous tensors, and exported
      values can be expanded views (BERT's attention mask has stride 0).
    """
    split = pipe.split_gm
    top = split.graph
    stage_nodes = [n for n in top.nodes if n.op == "call_module"]
    sidx = {n: i for i, n in enumerate(stage_nodes)}
    while True:
        job = _next_carry(top, sidx)
        if job is None:
            break
        _carry(split, stage_nodes, *job)
    _align_outputs(split, stage_nodes)
    for n in stage_nodes:
        _make_contiguous(split.get_submodule(n.target))
    # stage 0 takes its inputs positionally, in model-input order (the runtime may hand keyword
    # arguments to every local stage, so none of them accepts any)
    sub0 = split.get_submodule(stage_nodes[0].target)
    if type(sub0.graph._codegen) is not fx.graph.CodeGen:
        sub0.graph._codegen = fx.graph.CodeGen()
        sub0.recompile()
    top.lint()
    split.recompile()


def _carry(
    split: fx.GraphModule, stage_nodes: list[fx.Node], v: fx.Node, prod: int, consumers: set[int]
) -> None:
    """Carry the value ``v`` (produced by stage ``prod``, or a model input) through every stage between it and
    its last consumer in ``consumers``: each passes a copy on, and each consumer reads the copy it receives."""
    if v.op == "placeholder" and 0 not in consumers:
        _add_root_input(split, stage_nodes[0], v)
    last = max(consumers)
    start = 1 if v.op == "placeholder" else prod + 1
    val = _contiguous_val(_value_meta(split, v))
    cur = v
    holder = stage_nodes[start - 1]  # the stage holding `cur` (as output or input) before stage `start`
    for s in range(start, last + 1):
        node = stage_nodes[s]
        if v.op == "placeholder" or s - 1 != prod:
            cur = _add_passthrough(split, holder, cur)  # the previous stage passes its input on
        if s in consumers:
            node.args = tuple(cur if a is v else a for a in node.args)
        else:
            _add_input(split, node, cur, val)
        holder = node


def _make_contiguous(sub: fx.GraphModule) -> None:
    """Make a stage module's tensor outputs contiguous (a ``.contiguous()`` node each where they are not), and
    its placeholders' recorded values, from which receive buffers are allocated (in place)."""
    g = sub.graph
    out = _output_node(g)
    res = out.args[0]
    items = list(res) if isinstance(res, (tuple, list)) else [res]
    changed = False
    for i, x in enumerate(items):
        val = x.meta.get("val") if isinstance(x, fx.Node) else None
        if isinstance(val, torch.Tensor) and not val.is_contiguous():
            with g.inserting_before(out):
                c = g.call_method("contiguous", (x,))
            c.meta["val"] = val.contiguous()
            items[i] = c
            changed = True
    if changed:
        out.args = (tuple(items),) if isinstance(res, (tuple, list)) else (items[0],)
    for ph in g.nodes:
        if ph.op == "placeholder" and isinstance(ph.meta.get("val"), torch.Tensor):
            ph.meta["val"] = _contiguous_val(ph.meta["val"])
    sub.recompile()
