"""A linear of a block that pairs with nothing: column parallel, its output gathered.

:mod:`slapo_lab.sharding.infer` gives a block's linears a Megatron role when its dataflow shows one: a q / k / v
projection whose features reach attention heads, the output projection after them, an MLP pair whose features
meet rank by rank. A linear whose output features reach neither a head nor a row-parallel partner through ops
that keep features apart -- Swin's and Donut-Swin's patch-merging ``downsample.reduction`` (a ``LayerNorm``
over the 4C merged features, then ``Linear(4C, 2C)``, whose output is the next stage's residual stream, read by
its ``LayerNorm`` over all 2C features), Hiera's stage-transition ``proj`` (its output max-pooled over the
mask unit into the residual) -- still has one right split: Megatron-LM's ``ColumnParallelLinear`` with
``gather_output=True``. Each rank computes its share of the output features from the whole input (its weight
rows and bias entries: half the layer's parameters at TP 2), the shares are gathered on the last axis, and
everything after it runs on the whole features, as before. Backward: the gather's backward takes this rank's
share of the (replicated) output gradient; the input gradient is a partial sum, summed over the ranks
(``bwd_post all_reduce``, Megatron's *f*). :func:`lone_linear_kind` gives such a linear the preset kind
``"column_gather"`` (:func:`slapo_lab.presets.apply_layer`: :func:`~slapo_lab.presets.column_parallel`, then
``fwd_post all_gather(axis=-1, tensor_parallel_output_grad=False)``), a region of its own for the numeric gate
(:func:`slapo_lab.preset_check.layer_regions`), so a wrong split of it is kept whole alone.

A channel mixer's linears that :mod:`slapo_lab.sharding.mixers` keeps whole because no per-rank split of its
channels exists (SwiftFormer's additive attention: the query contracted with a learned vector over all features)
pair with nothing either, and are gathered the same way. A linear the dataflow keeps whole for another reason stays
whole: a router (its logits reach ``topk``), the low-rank
"a" of an ``a -> norm -> b`` chain, a projection shared by every head (:attr:`~slapo_lab.sharding.infer.BlockSplit.whole`),
and every linear of an attention whose heads are split with a projection shared by all of them
(:attr:`~slapo_lab.sharding.infer.BlockSplit.shared`: Megatron's *f* sits on that attention module's input,
so a second input-gradient sum would count it twice). A mixture-of-experts router recognised by its shape (:mod:`slapo_lab.sharding.router`) stays whole too. A linear
the recorded forward did not run keeps no kind.

Sources: Megatron-LM ``megatron/core/tensor_parallel/layers.py`` (``ColumnParallelLinear(gather_output=True)``,
``gather_from_tensor_model_parallel_region``); transformers' ``colwise_gather_output`` tensor-parallel style.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from .router import router_experts

if TYPE_CHECKING:
    from .infer_maps import BlockSplit


def lone_linear_kind(
    split: BlockSplit, rel: str, mod: nn.Module | None = None, parent: nn.Module | None = None
) -> str | None:
    """``"column_gather"`` for the linear ``rel`` (path relative to its block) of ``split`` (a
    :class:`~slapo_lab.sharding.infer.BlockSplit`) that the recorded forward ran, that has no role and that
    nothing keeps whole (see the module docstring); None otherwise. ``mod`` / ``parent`` (the linear and the
    module holding it), where given, also keep a mixture-of-experts router whole when the dataflow did not
    see its top-k (:func:`slapo_lab.sharding.router.router_experts`: one logit per expert of a sibling bank)."""
    if split is None or rel not in split.ran or split.roles.get(rel) is not None:
        return None
    if rel in split.whole and rel not in split.unpaired:
        return None
    if mod is not None and router_experts(mod, parent) is not None:
        return None
    parent = rel.rpartition(".")[0]
    if split.shared and any(not a or parent == a or parent.startswith(a + ".") for a in split.attention):
        return None
    return "column_gather"
