"""The layer-level presets: one layer made column, row or expert parallel through ordinary primitive calls.

Megatron-LM's two halves of a block (Shoeybi et al. 2019, "Megatron-LM", arXiv:1909.08053, section 3; Slapo's
canonical schedules, reference.md): :func:`column_parallel` shards the output features and all-reduces the
input gradient in backward (Megatron's *f*), :func:`row_parallel` shards the input features and all-reduces
the output in forward (*g*); :func:`experts_parallel` splits every expert of a 3-D experts module (Mixtral's
``mlp.experts``) the same way. :func:`apply_layer` does one layer by its
:func:`~slapo_lab.presets.roles.block_layers` kind. The projection names (``COLUMN_NAMES``, ``ROW_NAMES``,
``HEAD_NORM_NAMES``), :class:`PresetCalls` and the all-or-nothing wrapper every preset runs in
(:func:`~slapo_lab.atomic.atomic` plus one recorded action) live here too.
"""

from __future__ import annotations

import functools

from torch import nn

from ..atomic import atomic
from ..errors import ScheduleError
from ..module_state import peek_meta, syncs_of
from ..primitives.tensor_parallel import PARAM_GRADS_OP
from ..record import Call
from ..sharding.experts import UP_NAMES, intermediate_axis, is_experts_module
from ..sharding.rules import DenseRule, get_shard_rule

# Projections by their attribute name (last path component) or path suffix inside a block.
COLUMN_NAMES = frozenset(
    {
        "q_proj",
        "k_proj",
        "v_proj",
        "query",
        "key",
        "value",
        "q",
        "k",
        "v",
        "wq",
        "wk",
        "wv",
        "q_lin",
        "k_lin",
        "v_lin",
        "q_attn",
        "c_attn",
        "c_fc",
        "gate_proj",
        "up_proj",
        "fc1",
        "w1",
        "w3",
        "fc_in",
        "dense_h_to_4h",
        "lin1",
        "intermediate.dense",
    }
)
ROW_NAMES = frozenset(
    {
        "o_proj",
        "out_proj",
        "o",
        "wo",
        "out_lin",
        "c_proj",
        "down_proj",
        "fc2",
        "w2",
        "fc_out",
        "dense_4h_to_h",
        "lin2",
        "output.dense",
    }
)


COLUMN_NAMES = COLUMN_NAMES | {"wi", "wi_0", "wi_1"}  # T5's (gated) feed-forward input projections
# ALBERT: AlbertAttention.dense is its output projection, AlbertLayer.ffn / ffn_output its MLP
COLUMN_NAMES = COLUMN_NAMES | {"ffn"}
ROW_NAMES = ROW_NAMES | {"attention.dense", "ffn_output"}
# DeBERTa-v2/v3: q/k/v and the relative-position projections (applied to the replicated relative embeddings,
# then split by heads like k and q)
COLUMN_NAMES = COLUMN_NAMES | {"query_proj", "key_proj", "value_proj", "pos_key_proj", "pos_query_proj"}
# Per-head norms applied to q / k after the head split (Qwen3, Gemma 3 ...): replicated weights of size head_dim
# that see only this rank's heads, so their gradients are partial sums (HF style "replicated_with_grad_allreduce").
HEAD_NORM_NAMES = frozenset(
    {"q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_layernorm", "key_layernorm"}
)


def _since(sch, n: int) -> list[Call]:
    return list(sch.record.calls[n:])


class PresetCalls(list):
    """The calls a preset recorded (a list of :class:`~slapo_lab.record.Call`), plus ``notes``: one
    sentence for each part the preset left as it was and why (e.g. a vocabulary that does not divide)."""

    def __init__(self, calls, notes=()) -> None:
        super().__init__(calls)
        self.notes = list(notes)


def _all_or_nothing(fn):
    """Run the preset ``fn(sch, ...)`` inside :func:`atomic` (a failing preset leaves nothing applied) and as one
    recorded action (one undo removes it, typed in a cell or clicked)."""

    @functools.wraps(fn)
    def wrapper(sch, *args, **kwargs):
        with atomic(sch), sch.record.action(f"preset {fn.__name__}"):
            return fn(sch, *args, **kwargs)

    return wrapper


def _dense(sch, path: str, what: str):
    """The node at ``path`` and its dense-layer shard rule (which weight axis is out / in)."""
    node = sch[path]
    rule = get_shard_rule(node.mod)
    if not isinstance(rule, DenseRule):
        raise ScheduleError(
            f"{what} needs an nn.Linear or HF Conv1D at {path}, not a {type(node.mod).__name__}."
        )
    return node, rule


class EarlierCallConflict(ScheduleError):
    """A call made before the preset is in its way (a tensor sharded on another axis): the preset is
    refused as a whole, never kept whole around it, since the user's own call is what must change."""


def _ensure_shard(node, name: str, axis: int) -> None:
    """``node.shard(name, axis=axis)``, unless the tensor is already sharded on that axis (typed earlier, or
    tied to a sharded tensor): presets compose with what is there.

    Raises:
        ScheduleError: the tensor is sharded on another axis (one sentence saying which call to undo).
    """
    t = getattr(node.mod, name)
    axis %= max(t.dim(), 1)
    meta = peek_meta(node.mod)
    have = meta.sharded.get(name) if meta else None
    if have is None:
        have = getattr(t, "shard_axis", None)
    if have is None:
        node.shard(name, axis=axis)
    elif have != axis:
        full = f"{node.path}.{name}" if node.path else name
        raise EarlierCallConflict(
            f"{full} is already sharded on axis {have}, but this preset shards it on axis {axis}; undo "
            f"that shard (or shard it on axis {axis}) and apply the preset again."
        )


def _ensure_sync(node, mode: str, op: str, **kwargs) -> None:
    """``node.sync(mode=mode, sync_op_or_fn=op, **kwargs)``, unless the module already has that sync."""
    meta = peek_meta(node.mod)
    key = (mode, PARAM_GRADS_OP if kwargs.get("param_grads") else op)
    if not (meta and key in meta.syncs):
        node.sync(mode=mode, sync_op_or_fn=op, **kwargs)


#: The axis sequence parallelism splits: the sequence of ``(batch, seq, hidden)``, and the tokens of a block
#: that flattens them to ``(tokens, hidden)`` before its MLP (OPT): a token-wise region gathers and
#: reduce-scatters them in the same order, so either layout comes back as it was.
SEQUENCE_AXIS = -2


@_all_or_nothing
def column_parallel(sch, path: str, sequence_parallel: bool = False) -> list[Call]:
    """Make the ``nn.Linear`` / HF ``Conv1D`` at ``path`` column parallel (Megatron ``ColumnParallelLinear``).

    Weight on its output features, bias on axis 0, then ``bwd_post all_reduce`` -- or, with
    ``sequence_parallel``, ``fwd_pre all_gather(axis=-2)`` (whose backward reduce-scatter also sums the input
    gradient).
    """
    n = len(sch.record)
    node, rule = _dense(sch, path, "column_parallel")
    mod = node.mod
    _ensure_shard(node, "weight", rule.out_axis)
    if getattr(mod, "bias", None) is not None:
        _ensure_shard(node, "bias", 0)
    if sequence_parallel:
        _ensure_sync(node, "fwd_pre", "all_gather", axis=SEQUENCE_AXIS)
    else:
        _ensure_sync(node, "bwd_post", "all_reduce")
    return _since(sch, n)


@_all_or_nothing
def row_parallel(sch, path: str, sequence_parallel: bool = False) -> list[Call]:
    """Make the ``nn.Linear`` / HF ``Conv1D`` at ``path`` row parallel (Megatron ``RowParallelLinear``).

    Weight on its input features, then ``fwd_post all_reduce`` -- or, with ``sequence_parallel``,
    ``fwd_post reduce_scatter(axis=-2)`` plus ``bwd_post all_reduce(param_grads=True)`` for the replicated bias
    (added after the reduce-scatter, so it sees only this rank's tokens).
    """
    n = len(sch.record)
    node, rule = _dense(sch, path, "row_parallel")
    mod = node.mod
    _ensure_shard(node, "weight", rule.in_axis)
    if sequence_parallel:
        if ("fwd_post", "all_reduce") in syncs_of(mod):
            raise EarlierCallConflict(
                f"{path} already all-reduces its output (tensor parallelism without sequence parallelism, "
                "e.g. the plain Megatron preset); undo that before applying sequence parallelism."
            )
        _ensure_sync(node, "fwd_post", "reduce_scatter", axis=SEQUENCE_AXIS)
        if getattr(mod, "bias", None) is not None:
            _ensure_sync(node, "bwd_post", "all_reduce", param_grads=True)
    else:
        _ensure_sync(node, "fwd_post", "all_reduce")
    return _since(sch, n)


def _is_experts(mod: nn.Module) -> bool:

    return is_experts_module(mod)


@_all_or_nothing
def experts_parallel(sch, path: str) -> list[Call]:
    """Tensor-parallel experts at ``path`` (an HF experts module with 3-D ``gate_up_proj`` / ``down_proj``).

    ``gate_up_proj`` (or ``up_proj``) and its bias on the intermediate axis, ``bwd_post all_reduce`` (the
    input and routing-weight gradients are partial), ``down_proj`` on the intermediate axis, ``fwd_post
    all_reduce`` (the experts' outputs are partial sums); see :mod:`slapo_lab.sharding.experts`.

    Raises:
        ScheduleError: when ``path`` is no such module, or a primitive refuses (sizes not divisible ...).
    """
    node = sch[path]
    mod = node.mod
    if not _is_experts(mod):
        raise ScheduleError(
            f"experts_parallel needs an experts module with 3-D expert weights at {path}, "
            f"not a {type(mod).__name__}."
        )
    n = len(sch.record)
    for name in (*UP_NAMES, "gate_up_proj_bias", "up_proj_bias"):
        if mod._parameters.get(name) is not None:
            _ensure_shard(node, name, intermediate_axis(mod, name))
    _ensure_sync(node, "bwd_post", "all_reduce")
    _ensure_shard(node, "down_proj", intermediate_axis(mod, "down_proj"))
    _ensure_sync(node, "fwd_post", "all_reduce")
    if mod._parameters.get("down_proj_bias") is not None and sch.world_size > 1:
        # added on one rank only (see slapo_lab/sharding/experts.py): its gradient is summed over the ranks
        _ensure_sync(node, "bwd_post", "all_reduce", param_grads=True)
    return _since(sch, n)


def apply_layer(sch, path: str, kind: str, sequence_parallel: bool = False) -> None:
    """Make one layer of a block tensor parallel by its :func:`block_layers` kind (the calls are recorded).

    Raises:
        ScheduleError: the first primitive call that refuses.
    """
    apply = _APPLY_KIND.get(kind) or next((f for pre, f in _APPLY_PREFIX if kind.startswith(pre)), None)
    if apply is not None:
        apply(sch, path, kind, sequence_parallel)
    elif kind == "head_norm" or sequence_parallel:  # a head norm sees this rank's heads only; under
        # sequence parallelism a norm sees this rank's tokens only: either way, sum its gradients over the ranks
        _ensure_sync(sch[path], "bwd_post", "all_reduce", param_grads=True)


def _column(sch, path: str, kind: str, sequence_parallel: bool) -> None:
    column_parallel(sch, path, sequence_parallel)


def _row(sch, path: str, kind: str, sequence_parallel: bool) -> None:
    row_parallel(sch, path, sequence_parallel)


def _column_shard(sch, path: str, kind: str, sequence_parallel: bool) -> None:
    """Column parallel whose input gradient the attention module's f sums: the weight and bias sharded only."""
    node, rule = _dense(sch, path, "column_parallel")
    _ensure_shard(node, "weight", rule.out_axis)
    if getattr(node.mod, "bias", None) is not None:
        _ensure_shard(node, "bias", 0)


def _attention_f(sch, path: str, kind: str, sequence_parallel: bool) -> None:
    _ensure_sync(sch[path], "bwd_post", "all_reduce")


def _grad_sum(sch, path: str, kind: str, sequence_parallel: bool) -> None:
    _ensure_sync(sch[path], "bwd_post", "all_reduce", param_grads=True)


def _features(sch, path: str, kind: str, sequence_parallel: bool) -> None:
    """A norm over a split layer's features: its parameters are sharded like them, and its statistics are
    summed over the ranks (slapo_lab/sharding/feature_stats.py)."""
    node = sch[path]
    conv = isinstance(node.mod, nn.modules.conv._ConvNd)  # a depthwise convolution: one filter per channel
    for name, prm in list(node.mod._parameters.items()):
        if prm is not None:
            _ensure_shard(node, name, 0 if conv else prm.dim() - 1)
    _shard_running_stats(node)


def _heads(sch, path: str, kind: str, sequence_parallel: bool) -> None:
    """A per-head table (T5's relative_attention_bias): this rank's heads' columns."""
    _ensure_shard(sch[path], "weight", 1)


def _head_params(sch, path: str, kind: str, sequence_parallel: bool) -> None:
    """``head_param:<name>:<axis>;...``: parameters with one entry per head on an axis (Swin's relative position
    table, GPT-OSS's sinks, Cohere's q/k norm weights), read from the dataflow: this rank's heads. A module may
    hold several (DeBERTa's q_bias, v_bias)."""
    for one in kind[len("head_param:") :].split(";"):
        name, axis = one.split(":")
        _ensure_shard(sch[path], name, int(axis))
    _shard_running_stats(sch[path])


def _column_gather(sch, path: str, kind: str, sequence_parallel: bool) -> None:
    """A linear whose features reach no head and no row-parallel partner (Swin's patch-merging
    downsample.reduction): column parallel, its output gathered; see slapo_lab/sharding/lone_linears.py."""
    column_parallel(sch, path)
    _ensure_sync(sch[path], "fwd_post", "all_gather", axis=-1, tensor_parallel_output_grad=False)


def _gather_linear(sch, path: str, kind: str, sequence_parallel: bool) -> None:
    """A mixer's linear whose whole output every rank needs (Mamba's x_proj: dt, B, C from all channels): its
    input channels gathered, its output features split, its output gathered (the gathers' backward
    reduce-scatters sum the ranks' partial gradients); see slapo_lab/sharding/mixers.py."""
    node, rule = _dense(sch, path, "column_parallel")
    _ensure_shard(node, "weight", rule.out_axis)
    if getattr(node.mod, "bias", None) is not None:
        _ensure_shard(node, "bias", 0)
    _ensure_sync(node, "fwd_pre", "all_gather", axis=-1)
    _ensure_sync(node, "fwd_post", "all_gather", axis=-1)


def _channel_params(sch, path: str, kind: str, sequence_parallel: bool) -> None:
    """``channel_params:<name>=<axis>,...[;grad_sum]``: a mixer's per-channel / per-head parameters (A_log, D,
    dt_bias, a depthwise conv1d, a grouped norm: slapo_lab/sharding/mixers.py), each on its axis; then, with
    ``;grad_sum``, its replicated ones sum gradients."""
    spec, _, extra = kind.split(":", 1)[1].partition(";")
    for item in spec.split(","):
        name, axis = item.split("=")
        _ensure_shard(sch[path], name, int(axis))
    if extra == "grad_sum":
        _ensure_sync(sch[path], "bwd_post", "all_reduce", param_grads=True)


def _experts(sch, path: str, kind: str, sequence_parallel: bool) -> None:
    experts_parallel(sch, path)


#: :func:`apply_layer` by kind: ``fn(sch, path, kind, sequence_parallel)``; then by the kinds' prefixes.
_APPLY_KIND = {
    "column": _column,
    "column_shard": _column_shard,
    "attention_f": _attention_f,
    "grad_sum": _grad_sum,
    "features": _features,
    "row": _row,
    "heads": _heads,
    "column_gather": _column_gather,
    "gather_linear": _gather_linear,
    "experts": _experts,
}
_APPLY_PREFIX = (("head_param:", _head_params), ("channel_params:", _channel_params))


def _shard_running_stats(node) -> None:
    """Shard a batch norm's running statistics like its sharded per-feature parameters: LeViT's
    ``Linear -> BatchNorm1d`` and any norm that keeps one running mean / variance per feature. Each buffer of
    the parameters' shape follows the first of them that is sharded (same axis, hence the same index map), so
    the module's eval-mode forward sees this rank's features' statistics (``running_mean should contain 128
    elements not 256`` otherwise)."""
    if not isinstance(node.mod, nn.modules.batchnorm._BatchNorm):
        return
    axes = {
        tuple(getattr(p, "orig_shape", p.shape)): p.shard_axis
        for p in node.mod._parameters.values()
        if p is not None and getattr(p, "shard_axis", None) is not None
    }
    for name, buf in list(node.mod._buffers.items()):
        axis = axes.get(tuple(buf.shape)) if buf is not None else None
        if axis is not None:
            _ensure_shard(node, name, axis)
