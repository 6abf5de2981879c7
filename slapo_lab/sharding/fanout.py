"""A head-split projection whose features also reach another linear: its attention stays whole.

When q / k / v are column parallel, each rank holds only its heads' features of them. That is right only if those
features reach nothing but the attention (whose output projection is row parallel). ConvBERT's span-based
dynamic convolution (Jiang et al. 2020, "ConvBERT: Improving BERT with Span-based Dynamic Convolution",
transformers' ``modeling_convbert.py``) multiplies the query by a separable convolution of the hidden states and
feeds the product to ``conv_kernel_layer``, a linear over *all* heads' query features that produces every
conv head's kernel: with the query split, each rank's ``conv_kernel_layer`` would see half of its input (a
crash, or a silently partial sum).

:func:`shared_heads_reason` reads that from the recorded dataflow of one attention: a projection with a q / k /
v role whose index map reaches the input of a linear other than the attention's own projections and its output
projection makes the attention's heads unsplittable, and one sentence names that linear. The split inference
(:func:`slapo_lab.sharding.infer._analyse`) then keeps the attention's q / k / v and output projection whole, as
for any refused attention; the block's MLP pair is unaffected.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .infer_recorder import _Snapshot


def shared_heads_reason(roles: dict, rec: _Snapshot, dense: dict, o_path: str | None) -> str | None:
    """Why an attention cannot split its heads because a projection of it also feeds another linear, or None.

    ``roles``: the attention's projections (``{producer: {role: [feature set per head]}}``); ``rec``: the
    recording (``rec.linear_in``: linear path -> the index maps of its input); ``dense``: the block's linears by
    path; ``o_path``: the attention's output projection, or None.
    """
    mine = {p for p in roles if p in dense}
    for lin, inf in rec.linear_in.items():
        if lin not in dense or lin in mine or lin == o_path:
            continue
        hit = sorted(p for p in inf.maps if p in mine)
        if hit:
            return (
                f"its {hit[0]} features also reach {lin}, a linear that would see only this rank's heads, so its "
                "heads stay whole"
            )
    return None
