"""Split a scheduled model into pipeline stages at its recorded cuts.

Slapo (seed ``002``: ``generate_pipeline_partition`` / ``propagate_partition``) traces every level of
the hierarchy with ``torch.fx`` and propagates each cut up to the common ancestor; the marked module
is the *last* module of its stage, and a cut at a parent closes the stage its children's cuts left
open (the T5 example: cuts after ``encoder.block.11``, ``encoder`` and ``decoder.block.11`` give 4
stages; without the ``encoder`` cut, 3). ``torch.fx`` fails on every full Hugging Face 5.x model, so
here the whole model is captured once with ``torch.export`` and split by PyTorch's pipelining
frontend (seed ``003``: ``pipe_split`` / ``pipeline()``): a forward hook placed after each cut module's
own hooks calls ``pipe_split()``, which marks the end of that module in the exported graph. Because a
cut is a point in the flat execution order, cuts at any depth compose exactly as in Slapo: ``n``
honoured cuts give ``n + 1`` stages.

What crosses stages (torchgpipe's ``SkipLayout``, seed ``004``; Slapo's ``analyze_pipeline_module``
liveness) comes from the split graph: a value defined in stage ``i`` and used in stage ``j > i + 1``
is sent from ``i`` to ``j`` directly by the torch runtime, and carried through the stages between by
the DeepSpeed runtime (see :attr:`PipelinePartition.liveness`).

Tied weights used by several stages (GPT-2's ``wte`` / ``lm_head``), and parameters with one name that
several stages read (DeBERTa's ``rel_embeddings``), are replicated: each stage gets its own copy (PyTorch's
``MultiUseParameterConfig.REPLICATE``), and :attr:`PipelinePartition.tied` lists them so the runtimes can
sum their gradients (Slapo's ``analyze_tie_weights``). Every other
parameter of a stage *is* the schedule's parameter object, so training a pipeline updates ``sch.mod``
in place (tied copies excepted) and sharding annotations (``shard_axis``, ``orig_shape``) stay on.
"""

from __future__ import annotations

import contextlib
import operator
import re
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..call_order import _split_inputs, check_cuts, record_call_order, stage_ops
from ..errors import ScheduleError
from ..module_state import peek_meta
from ..random import checkpoint as _ckpt
from ..verify import flatten_outputs
from ._collectives import exportable_sync_ops
from .carry import normalize_pipe
from .coupling import batchnorm_single_value, coupling_refusal, single_value_refusal


@contextlib.contextmanager
def _torch_internal_deprecations():
    """Silence the FutureWarning torch's own ``torch.distributed.pipelining`` raises on itself while it splits a
    module: its ``_IR.pipe_split`` deep-copies an fx codegen holding a ``LeafSpec``, whose construction torch 2.13
    deprecates ("``isinstance(treespec, LeafSpec)`` is deprecated"); nothing a user can change, printed once
    per rank otherwise."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"`isinstance\(treespec, LeafSpec\)`", category=FutureWarning
        )
        yield


ROOT_PREFIX = "model."


def default_output_fn(out: Any) -> torch.Tensor:
    """The first floating-point tensor of a model output (tensor, tuple, dict or HF ``ModelOutput``).

    For HF models this is ``logits`` (heads) or ``last_hidden_state`` (base models).

    Raises:
        ScheduleError: if the output holds no floating-point tensor.
    """
    items = flatten_outputs(out)
    if not items:
        raise ScheduleError(
            "The model output has no floating-point tensor for the pipeline to return; "
            "pass output_fn= to pick one."
        )
    return items[0][1]


class _Root(nn.Module):
    """``model`` under the attribute ``model`` (FQN prefix ``model.``), returning ``output_fn(model(...))``."""

    def __init__(self, model: nn.Module, output_fn: Callable[[Any], Any]) -> None:
        super().__init__()
        self.model = model
        self._output_fn = output_fn

    def forward(self, *args, **kwargs):
        return self._output_fn(self.model(*args, **kwargs))


@dataclass
class StageInfo:
    """One pipeline stage of a :class:`PipelinePartition`.

    Attributes:
        index: stage index (0-based, in forward order).
        module: the stage's ``torch.fx.GraphModule`` (the original hierarchy under ``model.``).
        params: original parameter FQN -> this stage's parameter object (tied copies included).
        inputs: names of the split-graph values the stage consumes (in call order).
        outputs: names of the values it produces (in output order).
        n_params: number of parameter elements held by the stage.
    """

    index: int
    module: nn.Module
    params: dict[str, nn.Parameter]
    inputs: list[str]
    outputs: list[str]
    n_params: int = 0


@dataclass
class PipelinePartition:
    """The result of :func:`partition_pipeline`.

    Attributes:
        pipe: PyTorch's ``torch.distributed.pipelining.Pipe`` (``pipe.build_stage(i, device, group)``).
        cuts: the cut paths in forward order.
        stages: one :class:`StageInfo` per stage.
        tied: one dict per parameter used by several stages (tied aliases, or one name read by several
            stages): stage index -> original FQN.
        liveness: ``liveness[b]`` = names of the values alive when stage ``b`` starts (``b = 0``: the
            model inputs, in placeholder order; ``b = num_stages``: the model output); Slapo's
            ``analyze_pipeline_module``.
        input_names: the model inputs (placeholders of the split graph), in order.
        mb_args / mb_kwargs: the micro-batch example inputs the model was exported with.
    """

    pipe: Any
    cuts: list[str]
    stages: list[StageInfo]
    tied: list[dict[int, str]]
    liveness: list[list[str]]
    input_names: list[str]
    mb_args: tuple = ()
    mb_kwargs: dict = field(default_factory=dict)
    value_producer: dict[str, tuple[int, int | None]] = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def flat_inputs(self, args: tuple = (), kwargs: dict | None = None) -> list:
        """The model inputs in placeholder order (positional first, then keywords in example order).

        Raises:
            ScheduleError: if the keyword names or the count differ from the example inputs.
        """
        kwargs = dict(kwargs or {})
        if set(kwargs) != set(self.mb_kwargs) or len(args) != len(self.mb_args):
            raise ScheduleError(
                f"The pipeline was built for {len(self.mb_args)} positional inputs and keyword inputs "
                f"{sorted(self.mb_kwargs)}; got {len(args)} positional and {sorted(kwargs)}."
            )
        return list(args) + [kwargs[k] for k in self.mb_kwargs]

    def stage0_inputs(self, args: tuple = (), kwargs: dict | None = None) -> tuple:
        """The positional inputs of stage 0 for these model inputs (the ones it reads, in order)."""
        flat = dict(zip(self.input_names, self.flat_inputs(args, kwargs), strict=False))
        return tuple(flat[n] for n in self.stages[0].inputs)

    def stage_module(self, i: int) -> nn.Module:
        """The GraphModule of stage ``i``."""
        return self.stages[i].module

    def describe(self) -> str:
        """One line per stage: index, parameter count, first and last parameter FQNs, crossing values."""
        lines = []
        for s in self.stages:
            names = list(s.params)
            span = f"{names[0]} .. {names[-1]}" if names else "(no parameters)"
            lines.append(
                f"stage {s.index}: {s.n_params} params, {span}; receives {len(self.liveness[s.index])} "
                f"values, passes on {len(self.liveness[s.index + 1])}"
            )
        for t in self.tied:
            lines.append("tied: " + ", ".join(f"stage {k}: {v}" for k, v in sorted(t.items())))
        return "\n".join(lines)


@contextlib.contextmanager
def _split_hooks(root: nn.Module, cuts: list[str]):
    from torch.distributed.pipelining import pipe_split  # noqa: PLC0415 - torch.distributed.pipelining takes 2.5 s to import: only a run that splits loads it

    handles = []

    def hook(mod, args, out):
        pipe_split()

    try:
        for p in cuts:
            mod = root.get_submodule(ROOT_PREFIX + p)
            handles.append(mod.register_forward_hook(hook))  # appended: runs after the schedule's syncs
        yield
    finally:
        for h in handles:
            h.remove()


def _hop_parts(node: fx.Node):
    """``(submodule get_attr node, operands, detach outputs?)`` of a grad/autocast wrapper HOP, else None.

    ``torch.export`` (training IR) turns a ``torch.no_grad()`` region -- the rotary embedding of Llama,
    Mistral, Qwen3, Mixtral -- into ``wrap_with_set_grad_enabled(False, submod, *operands)`` and an
    autocast region into ``wrap_with_autocast(device, dtype, enabled, cache, submod, *operands)``.
    """
    if node.op != "call_function":
        return None
    hops = torch.ops.higher_order
    if node.target is getattr(hops, "wrap_with_set_grad_enabled", None):
        return node.args[1], node.args[2:], not node.args[0]
    if node.target is getattr(hops, "wrap_with_autocast", None):
        return node.args[4], node.args[5:], False
    return None


def _refuse_trainable_in_no_grad(gm: fx.GraphModule, node: fx.Node, operands) -> None:
    """A ``set_grad_enabled(False)`` region may read no trainable parameter: the rotary embedding's is
    parameter-free, but a custom ``autograd.Function`` inside a checkpointed block (BLOOM's ``GeLUFunction``)
    makes ``torch.export`` trace everything from there to the model's end with gradients off, and the stages
    would then train none of those weights.

    Raises:
        ScheduleError: one sentence naming where the region starts and a weight it holds.
    """
    for o in operands:
        if not (isinstance(o, fx.Node) and o.op == "get_attr"):
            continue
        try:
            p = gm.get_parameter(o.target)
        except AttributeError:
            continue
        if p.requires_grad:
            stack = list((node.meta.get("nn_module_stack") or {}).values())
            where = _orig_name(stack[-1][0]) if stack else None
            raise ScheduleError(
                f"Cannot pipeline this schedule: torch.export traced {where or 'a module'} and what runs after it "
                f"with gradients off (a custom autograd.Function inside a checkpointed block, as BLOOM's GeLU), "
                f"so the stages would never train {_orig_name(o.target) or o.target} and the weights after it; "
                "cut without checkpointing those blocks, or checkpoint them without pipeline stages."
            )


def _inline_wrapper_hops(gm: fx.GraphModule) -> fx.GraphModule:
    """Inline grad-mode / autocast wrapper HOPs of the exported graph, in place (the ``split_policy``).

    The pipelining frontend outlines each stage back into the module hierarchy from the nodes'
    ``nn_module_stack``; the wrapper's ``get_attr`` of its body is placed apart from the call, so the
    outliner sees the wrapping module (Llama's ``rotary_emb``) called twice, the first time with no
    inputs, and stage 0 fails with "Expected positional argument for parameter unsqueeze_default".
    The body's nodes (which keep their own ``nn_module_stack``) are copied in place of the call; the
    outputs of a ``set_grad_enabled(False)`` region are detached, so no gradient flows through them,
    exactly as under ``torch.no_grad()``. Autocast regions become plain code: the stage runs in the
    caller's precision (the pipelines here train in one dtype). Nested wrappers are inlined too.
    """
    g = gm.graph
    while True:
        node = next((n for n in g.nodes if _hop_parts(n) is not None), None)
        if node is None:
            break
        _inline_hop(gm, node)
    g.lint()
    gm.recompile()
    return gm


def _inline_hop(gm: fx.GraphModule, node: fx.Node) -> None:
    """Replace the wrapper HOP call ``node`` by a copy of its body (outputs detached for a no-grad region), and
    drop its body from ``gm`` once nothing else calls it."""
    g = gm.graph
    body_node, operands, detach = _hop_parts(node)
    if detach:
        _refuse_trainable_in_no_grad(gm, node, operands)
    with g.inserting_before(node):
        results = _copy_hop_body(gm, node, body_node, operands)
        outs = list(results) if isinstance(results, (tuple, list)) else [results]
        if detach:
            outs = _detached(g, outs)
    for u in list(node.users):
        if u.op == "call_function" and u.target is operator.getitem:
            u.replace_all_uses_with(outs[u.args[1]])
            g.erase_node(u)
    if node.users:  # used as a whole (not seen in HF models): rebuild the tuple
        raise ScheduleError(
            "The exported model uses a no_grad/autocast region's result as a whole; "
            "the pipeline partitioner cannot inline it."
        )
    g.erase_node(node)
    if not body_node.users:
        g.erase_node(body_node)
        if not any(n.op == "get_attr" and n.target == body_node.target for n in g.nodes):
            delattr(gm, body_node.target)


def _copy_hop_body(gm: fx.GraphModule, node: fx.Node, body_node: fx.Node, operands) -> Any:
    """Copy the nodes of the HOP's body at the graph's insertion point, its placeholders bound to ``operands``
    (a node keeps its own ``nn_module_stack``, else takes the call's); returns the body's output mapped to
    the copies."""
    g = gm.graph
    body = gm.get_submodule(body_node.target)
    env: dict[fx.Node, Any] = {}
    phs = [n for n in body.graph.nodes if n.op == "placeholder"]
    env.update(zip(phs, operands, strict=False))
    results = None
    for b in body.graph.nodes:
        if b.op == "placeholder":
            continue
        if b.op == "output":
            results = fx.node.map_arg(b.args[0], env.__getitem__)
            continue
        if b.op == "get_attr":  # a nested wrapper's body: hoist it onto gm under a fresh name
            k = 0
            while hasattr(gm, f"_inlined_{body_node.target}_{k}"):
                k += 1
            name = f"_inlined_{body_node.target}_{k}"
            gm.add_submodule(name, body.get_submodule(b.target))
            new = g.get_attr(name)
            new.meta = dict(b.meta)
        else:
            new = g.node_copy(b, env.__getitem__)
            if not new.meta.get("nn_module_stack") and node.meta.get("nn_module_stack"):
                new.meta["nn_module_stack"] = dict(node.meta["nn_module_stack"])
        env[b] = new
    return results


def _detached(g: fx.Graph, outs: list) -> list:
    """``outs`` with each tensor-valued node replaced by an ``aten.detach`` of it (inserted at the graph's
    insertion point): no gradient flows through a ``set_grad_enabled(False)`` region's outputs."""
    outs = list(outs)
    for i, x in enumerate(outs):
        if isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor):
            d = g.call_function(torch.ops.aten.detach.default, (x,))
            d.meta = {k: v for k, v in x.meta.items() if k in ("val", "nn_module_stack", "stack_trace")}
            outs[i] = d
    return outs


def _chunk0(x, n: int):
    if isinstance(x, torch.Tensor):
        if x.dim() == 0 or x.shape[0] % n:
            raise ScheduleError(
                f"The batch dimension of an example input of shape {tuple(x.shape)} is not divisible "
                f"by n_microbatches={n}."
            )
        return x.chunk(n, dim=0)[0]
    if isinstance(x, dict):
        return {k: _chunk0(v, n) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_chunk0(v, n) for v in x)
    return x


def microbatch(example_inputs, n_microbatches: int):
    """The first of ``n_microbatches`` equal chunks (dim 0) of ``example_inputs``: ``(args, kwargs)``."""
    args, kwargs = _split_inputs(example_inputs)
    return _chunk0(args, n_microbatches), _chunk0(kwargs, n_microbatches)


def _graph_modules(mod: nn.Module):
    for m in mod.modules():
        g = getattr(m, "graph", None)
        if isinstance(g, fx.Graph):
            yield m, g


def _prune_unused_params(stage: nn.Module) -> None:
    """Delete parameter/buffer aliases no graph of the stage reads (stale tied aliases)."""
    used: set[int] = set()
    for m, g in _graph_modules(stage):
        for node in g.nodes:
            if node.op == "get_attr":
                try:
                    t = m.get_parameter(node.target)
                except AttributeError:
                    try:
                        t = m.get_buffer(node.target)
                    except AttributeError:
                        t = None
                if isinstance(t, torch.Tensor):
                    used.add(id(t))
    for name, p in list(stage.named_parameters(remove_duplicate=False)):
        if id(p) not in used:
            owner, _, attr = name.rpartition(".")
            sub = stage.get_submodule(owner) if owner else stage
            if attr in sub._parameters:
                del sub._parameters[attr]


_CKPT_CLASSES: dict[type, type] = {}


def _checkpointed_class(base: type) -> type:
    """A subclass of ``base`` whose forward runs under :func:`slapo_lab.random.checkpoint` (cached)."""
    cls = _CKPT_CLASSES.get(base)
    if cls is None:

        def forward(self, *args, **kwargs):
            if torch.is_grad_enabled():
                return _ckpt(base.forward, self, *args, **kwargs)
            return base.forward(self, *args, **kwargs)

        cls = type(
            base.__name__,
            (base,),
            {"forward": forward, "_slapo_checkpointed": True, "__module__": base.__module__},
        )
        cls.__qualname__ = base.__qualname__
        _CKPT_CLASSES[base] = cls
    return cls


def _checkpointed_paths(model: nn.Module) -> list[str]:
    """Paths of the submodules of ``model`` that the ``checkpoint`` primitive marked."""
    out = []
    for qn, m in model.named_modules():
        meta = peek_meta(m)
        if qn and meta and meta.checkpoint:
            out.append(qn)
    return out


def _keep_checkpoints(stage: nn.Module, paths: list[str]) -> list[str]:
    """Re-apply activation checkpointing inside a stage module (in place); return the paths wrapped.

    ``torch.export`` inlines ``torch.utils.checkpoint`` (the recomputation would be lost), but the
    pipelining frontend unflattens each stage back into the original hierarchy, so every checkpointed
    module still has its own submodule (an ``InterpreterModule``) at ``model.<path>``. Its class is
    swapped for a subclass whose forward runs the module under non-reentrant checkpoint again, so
    only its inputs are saved and it is recomputed in backward (RNG state restored, as in
    ``slapo_forward``). Parameter names and objects are unchanged. The module's own forward hooks
    (the schedule's sync ops) were recorded inside its graph, so unlike ``slapo_forward`` they are
    recomputed too. Paths with no submodule in this stage are skipped.
    """
    done = []
    for p in paths:
        try:
            sub = stage.get_submodule(ROOT_PREFIX + p)
        except AttributeError:
            continue
        if sub is stage or getattr(type(sub), "_slapo_checkpointed", False):
            continue
        if not isinstance(getattr(sub, "graph", None), fx.Graph):
            continue
        sub.__class__ = _checkpointed_class(type(sub))
        done.append(p)
    return done


def _tie_within_stages(model: nn.Module, stages: list[StageInfo], replicated) -> list[dict[int, str]]:
    """Re-tie aliased parameters inside each stage (in place) and return the cross-stage tied groups.

    The pipelining frontend gives every use of a tied weight its own copy, per stage *and* per name:
    T5's ``decoder.embed_tokens`` and ``lm_head`` (both ``shared``) ended up as two parameters of one
    stage, each trained on half of the gradient. Here every set of names that alias one parameter
    of ``model`` shares one object again within a stage (the stage module's attributes are pointed at
    it), and one group ``{stage: name}`` per parameter held by several stages is returned for the
    runtimes to sum gradients over (Slapo's ``analyze_tie_weights``). That includes a parameter with one
    name that several stages read: DeBERTa's ``encoder.rel_embeddings`` feeds the relative attention of
    every layer, so each stage gets a copy holding only its own layers' part of the gradient. The name per
    stage is the one PyTorch's ``Pipe.replicated_params`` reports where it has one, else the first in
    model order.
    """
    pref = _replicated_names(replicated)
    alias: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        alias.setdefault(id(p), []).append(name)
    tied = []
    for names in alias.values():
        group: dict[int, str] = {}
        for st in stages:
            held = [n for n in names if n in st.params]
            if held:
                group[st.index] = _retie(st, held, next((n for n in held if (st.index, n) in pref), held[0]))
        if len(group) > 1:
            tied.append(group)
    return tied


def _replicated_names(replicated) -> set[tuple[int, str]]:
    """``(stage, model name)`` of every copy ``Pipe.replicated_params`` reports (``[{"submod_<stage>": fqn}]``)."""
    pref: set[tuple[int, str]] = set()
    for mapping in replicated:
        for sub, q in mapping.items():
            orig = _orig_name(q)
            if orig is not None:
                pref.add((int(sub.rsplit("_", 1)[1]), orig))
    return pref


def _retie(st: StageInfo, held: list[str], keep_name: str) -> str:
    """Point every name of ``held`` in stage ``st`` at the one parameter ``keep_name`` holds; returns
    ``keep_name``."""
    keep = st.params[keep_name]
    for n in held:
        if st.params[n] is keep:
            continue
        owner, _, attr = (ROOT_PREFIX + n).rpartition(".")
        st.module.get_submodule(owner)._parameters[attr] = keep
        st.params[n] = keep
    return keep_name


#: One capture at a time: torch.export's dispatch-mode stack and module-hierarchy slot are process-wide, so two
#: threads capturing at once (the editor's live check and a check a script asked for) break each other
#: ("ProxyTorchDispatchMode slot already occupied", "_EXPORT_MODULE_HIERARCHY must not be None").
_EXPORT_LOCK = threading.Lock()
_CALL_SUFFIX = re.compile(r"@\d+(?=\.|$)")


def _orig_name(stage_fqn: str) -> str | None:
    """The model's name of a stage module's parameter: ``model.`` dropped, and the ``@N`` torch.export gives a
    module's N-th further call (DeBERTa's shared ``key_proj`` runs on the hidden states and on the relative
    embeddings: ``key_proj`` and ``key_proj@1``) folded into the module's own name."""
    if not stage_fqn.startswith(ROOT_PREFIX):
        return None
    return _CALL_SUFFIX.sub("", stage_fqn[len(ROOT_PREFIX) :])


def _analyze_split(split_gm: fx.GraphModule, n: int):
    """Stage inputs/outputs and liveness from the top split graph (Slapo's analyze_pipeline_module)."""
    nodes = list(split_gm.graph.nodes)
    stage_nodes = [nd for nd in nodes if nd.op == "call_module"]
    stage_of = {nd.name: i for i, nd in enumerate(stage_nodes)}
    # value name -> (producing stage, output index or None for a single output); stage -1 = model input
    producer: dict[str, tuple[int, int | None]] = {}
    input_names = [nd.name for nd in nodes if nd.op == "placeholder"]
    for nm in input_names:
        producer[nm] = (-1, None)
    for nd in nodes:
        if nd.op == "call_module":
            if not any(u.op == "call_function" and u.target is operator.getitem for u in nd.users):
                producer[nd.name] = (stage_of[nd.name], None)
        elif nd.op == "call_function" and nd.target is operator.getitem and nd.args[0].name in stage_of:
            producer[nd.name] = (stage_of[nd.args[0].name], nd.args[1])
    inputs = [[a.name for a in nd.args if isinstance(a, fx.Node)] for nd in stage_nodes]
    outputs: list[list[str]] = [[] for _ in range(n)]
    for v, (s, _k) in producer.items():
        if s >= 0:
            outputs[s].append(v)
    for s in range(n):
        outputs[s].sort(key=lambda v: producer[v][1] if producer[v][1] is not None else -1)
    liveness = _liveness(nodes, inputs, producer, input_names, n)
    return inputs, outputs, liveness, input_names, producer


def _liveness(
    nodes: list[fx.Node],
    inputs: list[list[str]],
    producer: dict[str, tuple[int, int | None]],
    input_names: list[str],
    n: int,
) -> list[list[str]]:
    """The values live at each stage boundary ``b`` (0: the model inputs): produced before stage ``b`` and used
    by a stage from ``b`` on or by the output, in definition order."""
    def_order = {nd.name: i for i, nd in enumerate(nodes)}
    out_node = next(nd for nd in nodes if nd.op == "output")
    final: list[str] = []
    fx.node.map_arg(out_node.args, lambda x: final.append(x.name) or x)
    users_after: list[set[str]] = [set() for _ in range(n + 1)]  # used by stages >= b or the output
    users_after[n] = set(final)
    for b in range(n - 1, -1, -1):
        users_after[b] = users_after[b + 1] | set(inputs[b])
    liveness = [list(input_names)]
    for b in range(1, n + 1):
        live = [v for v in producer if producer[v][0] < b and v in users_after[b]]
        live.sort(key=lambda v: def_order[v])
        liveness.append(live)
    return liveness


def _check_batch_coupling(model: nn.Module, n_microbatches: int, mb_args: tuple, mb_kwargs: dict) -> None:
    """Refuse micro-batches that BatchNorm or a contrastive loss cannot honour (see :mod:`.coupling`)."""
    refusal = coupling_refusal(model, n_microbatches, "n_microbatches=1")
    if refusal:
        raise ScheduleError(refusal)
    path = batchnorm_single_value(model, mb_args, mb_kwargs)
    if path is not None:
        rows = next((t.shape[0] for t in [*mb_args, *mb_kwargs.values()] if isinstance(t, torch.Tensor)), 1)
        raise ScheduleError(
            single_value_refusal(model, int(rows), path, "use fewer micro-batches or a bigger batch")
        )


def partition_pipeline(
    sch, example_inputs, n_microbatches: int = 1, output_fn: Callable[[Any], Any] | None = None
) -> PipelinePartition:
    """Split ``sch.mod`` into pipeline stages at ``sch.metadata.primitives["cut_pipeline_stage"]``.

    Args:
        sch: the (root) schedule; its cuts are Slapo's: each marked module is the last of its stage.
        example_inputs: one *full* batch: a tuple of positional tensors, a dict of keyword tensors, or
            one tensor; dim 0 is the batch. The model is exported on the first of ``n_microbatches``
            chunks, so every later batch must have these shapes.
        n_microbatches: micro-batches per step (dim 0 must divide by it).
        output_fn: picks the tensor(s) the last stage returns from the model output (default: the
            first floating-point tensor: HF ``logits`` / ``last_hidden_state``); ``loss_fn`` receives it.

    Returns:
        PipelinePartition with ``len(cuts) + 1`` stages.

    BatchNorm layers that a model in training mode has put in eval mode stay in eval mode (frozen:
    running statistics); everything else is exported in training mode.

    Raises:
        ScheduleError: no cuts; a cut that cannot be honoured (runs twice, never runs, empty stage);
            ``n_microbatches > 1`` with BatchNorm using batch statistics or a contrastive model (CLIP,
            SigLIP: see :mod:`slapo_lab.pipeline.coupling`); a micro-batch that leaves a training BatchNorm
            one value per channel; ``torch.export`` failing on the model; a stage count that differs from
            the cuts.
    """
    sch = sch.get_top_schedule()
    cuts = list(sch.metadata.primitives["cut_pipeline_stage"])
    if not cuts:
        raise ScheduleError(
            "The schedule has no pipeline cuts: call sch[path].cut_pipeline_stage() first "
            "(or slapo_lab.pipeline.suggest_cuts(sch, num_stages, apply=True))."
        )
    model = sch.mod
    mb_args, mb_kwargs = microbatch(example_inputs, n_microbatches)
    order = record_call_order(model, args=mb_args, kwargs=mb_kwargs)
    check_cuts(cuts, order)
    if order.ok:
        cuts, _ = stage_ops(cuts, order)
    root = _Root(model, output_fn or default_output_fn)
    pipe = _export_pipe(model, root, cuts, n_microbatches, mb_args, mb_kwargs)
    n = pipe.num_stages
    if n == len(cuts) + 1:
        normalize_pipe(pipe)
    if n != len(cuts) + 1:
        raise ScheduleError(
            f"The {len(cuts)} cuts produced {n} pipeline stages instead of {len(cuts) + 1}: a cut "
            "module probably runs more than once or its stage is empty."
        )
    orig_params = dict(model.named_parameters(remove_duplicate=False))
    split_gm = pipe.split_gm
    ins, outs, liveness, input_names, producer = _analyze_split(split_gm, n)
    if len(input_names) != len(mb_args) + len(mb_kwargs):
        raise ScheduleError(
            f"The exported model has {len(input_names)} inputs but {len(mb_args) + len(mb_kwargs)} "
            "example inputs were given; pass tensors only (constants such as use_cache=False belong "
            "in the model config)."
        )
    stages = []
    ckpt_paths = _checkpointed_paths(model)
    for i in range(n):
        mod = pipe.get_stage_module(i)
        _prune_unused_params(mod)
        _keep_checkpoints(mod, ckpt_paths)
        stages.append(StageInfo(i, mod, _stage_params(mod, orig_params), ins[i], outs[i]))
    tied = _tie_within_stages(model, stages, pipe.replicated_params)
    for st in stages:
        st.n_params = sum(p.numel() for p in {id(p): p for p in st.params.values()}.values())
    return PipelinePartition(
        pipe, cuts, stages, tied, liveness, input_names, tuple(mb_args), dict(mb_kwargs), producer
    )


def _export_pipe(model: nn.Module, root: nn.Module, cuts: list[str], n_microbatches: int, mb_args, mb_kwargs):
    """``torch.distributed.pipelining.pipeline`` of ``root`` split at ``cuts``, exported on one micro-batch in
    training mode (BatchNorm that a training model put in eval mode stays frozen: running statistics); the
    modules' training flags are restored afterwards.

    Raises:
        ScheduleError: micro-batches the model's batch coupling cannot honour, or torch.export failing.
    """
    from torch.distributed.pipelining import pipeline  # noqa: PLC0415 - torch.distributed.pipelining takes 2.5 s to import: only a run that splits loads it

    flags = [(m, m.training) for m in model.modules()]
    frozen = (
        [m for m in model.modules() if isinstance(m, _BatchNorm) and not m.training] if model.training else []
    )
    model.train()
    for m in frozen:
        m.eval()
    try:
        _check_batch_coupling(model, n_microbatches, mb_args, mb_kwargs)
        with _EXPORT_LOCK, _split_hooks(root, cuts), exportable_sync_ops(), _torch_internal_deprecations():
            return pipeline(root, mb_args, mb_kwargs or None, split_policy=_inline_wrapper_hops)
    except ScheduleError:
        raise
    except Exception as err:  # torch.export failures
        msg = f"{type(err).__name__}: {err}".splitlines()[0][:400]
        raise ScheduleError(f"Could not capture the model for pipelining with torch.export ({msg}).") from err
    finally:
        for m, training in flags:
            m.training = training


def _stage_params(mod: nn.Module, orig_params: dict[str, nn.Parameter]) -> dict[str, nn.Parameter]:
    """``{original name: parameter}`` of one stage module, each name once: a further call's alias
    (``key_proj@1``) is pointed at the stage's one parameter, and a replicated (tied) copy takes the original's
    annotations."""
    params: dict[str, nn.Parameter] = {}
    for name, p in mod.named_parameters(remove_duplicate=False):
        orig = _orig_name(name)
        if orig is None:
            continue
        held = params.get(orig)
        if held is not None:  # a further call's alias (``key_proj@1``): one parameter per name and stage
            if held is not p:
                owner, _, attr = name.rpartition(".")
                mod.get_submodule(owner)._parameters[attr] = held
            continue
        src = orig_params.get(orig)
        if src is not None and p is not src:  # a replicated (tied) copy: keep the annotations
            for k, v in src.__dict__.items():
                p.__dict__.setdefault(k, v)
        params[orig] = p
    return params
