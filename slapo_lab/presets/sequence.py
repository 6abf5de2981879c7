"""Megatron sequence parallelism on any stack of blocks, read from the model's structure.

Sequence parallelism (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
MLSys 2023; Megatron-LM's ``megatron/core/tensor_parallel/mappings.py``) keeps one slice of the sequence
(axis -2: the sequence of ``(batch, seq, hidden)``, the tokens of a flattened ``(tokens, hidden)``) per
tensor-parallel rank wherever the tensor-parallel regions leave the activation replicated: the norms, the
residual adds and dropout run on ``seq / world_size`` tokens. Where the
tokens enter a region they are all-gathered (its backward reduce-scatters, which also sums the input gradient
Megatron's *f* all-reduces), and the row-parallel output is reduce-scattered instead of all-reduced (*g*).

:func:`block_layout` reads where each of these goes from one block's regions (:func:`slapo_lab.preset_check.
layer_regions`), with no family name:

* **stacks.** Each ``nn.ModuleList`` of blocks scatters the sequence on its first block's input and gathers
  it on its last block's output (``tensor_parallel_output_grad=False``: every rank computes the same loss
  after it). The embeddings, masks and position tables before a stack are built on the whole sequence, and
  so are the final norm and head after it, whatever the family calls them.
* **gather points.** A Megatron region (column layers closed by a row layer) all-gathers where its column
  layers' input enters: the module that takes Megatron's *f* when the family puts it on the attention module
  (MLA); else the module around the region's column and row layers, when it is inside the block and holds
  none of the region's norms (GPT-NeoX's ``attention``, Phi-3's ``self_attn``: each reshapes with its own
  input's sequence length around one fused projection); else, when that layout changes the result (a norm
  or a residual inside that module: BERT's ``attention.output``), the column layers' deepest common module
  (BERT's ``attention.self``) or the one column layer itself (BERT's ``intermediate.dense``). The column
  layers then only shard, and the row layer reduce-scatters.
* **islands.** A region whose split is not a column-to-row pair (an expert bank, with the router beside it; a
  Mamba mixer; a column-parallel linear whose output is gathered), and a region the preset keeps whole,
  run on the whole sequence: their owner module's input is all-gathered (``tensor_parallel_output_grad=
  False``: every rank computes the same gradient, each keeps its slice) and its output scattered back, with
  plain tensor parallelism inside.
* **gradients.** Every replicated trainable parameter of the block outside the gather points and islands sees
  this rank's tokens only, so its gradient is summed over the ranks (``sync(mode="bwd_post",
  sync_op_or_fn="all_reduce", param_grads=True)``: the norms, a row layer's bias, a layer scale), as
  Megatron all-reduces its ``sequence_parallel`` parameters.

Nothing here judges the result: :func:`slapo_lab.presets.megatron_tp` runs the numeric check on the whole
layout and refuses sequence parallelism, in one sentence, for a model where it computes anything else than
the unsharded model (a token-mixing module outside every region, a cross-attention whose keys read another
sequence, a block that reshapes the sequence into an image).
"""

from __future__ import annotations

import dataclasses

from ..errors import ScheduleError
from ..preset_check import Region, _common, _under
from .parallel import SEQUENCE_AXIS, _ensure_sync

#: Kinds whose split is not a column-to-row pair on the tokens (kind prefixes of ``block_layers``): their
#: region runs on the whole sequence, as an island.
ISLAND_KINDS = ("experts", "column_gather", "gather_linear", "channel_params", "features")
#: The layouts :func:`block_layout` draws, in the order :func:`slapo_lab.presets.megatron_tp` tries them.
STYLES = ("wide", "narrow")


class LayoutRefused(ScheduleError):
    """Sequence parallelism cannot be laid out on this model (one sentence): the preset is refused whole."""


@dataclasses.dataclass
class BlockLayout:
    """Where sequence parallelism gathers and scatters in one block (paths relative to the block).

    Attributes:
        gather: the gather points of the Megatron regions (all-gather on the input, backward reduce-scatter).
        islands: the modules run on the whole sequence (gathered in, scattered out).
        mode: region key -> ``"gather"`` (a Megatron region: columns shard, the row reduce-scatters),
            ``"plain"`` (tensor parallel as without sequence parallelism: inside an island) or ``"tokens"``
            (norms and such on this rank's tokens: their parameter gradients are summed).
        region: the region the layout's own calls belong to (for :func:`slapo_lab.preset_check.gate`).
    """

    gather: list[str]
    islands: list[str]
    mode: dict[tuple, str]
    region: Region

    def exempt(self, rel: str) -> bool:
        """Whether the module ``rel`` sees the whole sequence (under a gather point or an island)."""
        return any(_under(rel, g) for g in (*self.gather, *self.islands))

    def layer_sp(self, key: tuple, rel: str, kind: str) -> tuple[str | None, bool]:
        """``(kind, sequence_parallel)`` to apply the layer ``rel`` of region ``key`` with
        (:func:`slapo_lab.presets.apply_layer`); kind None: nothing to apply."""
        mode = self.mode[key]
        if mode in ("plain", "island"):
            return kind, False
        if kind == "attention_f":
            return None, False  # the gather at this module replaces Megatron's f
        if kind == "column":  # gathered on its own input, or by the module around it
            return ("column", True) if rel in self.gather else ("column_shard", False)
        if kind == "row":
            return kind, True
        return kind, not self.exempt(rel)


def block_layout(
    cls: str, regions: list[tuple[Region, list[str]]], kinds: dict, skip, style: str = "wide"
) -> BlockLayout:
    """The :class:`BlockLayout` of one block of class ``cls`` from its regions (``[(Region, [relative layer
    paths])]``, :func:`slapo_lab.preset_check.layer_regions`) and their layers' ``kinds``; the regions whose
    keys ``skip`` holds are kept whole (islands). ``style`` is one of :data:`STYLES`:

    * ``"wide"``: a Megatron region gathers at the module around its column and row layers when no norm of
      the region is inside it (GPT-NeoX's ``attention``, which reshapes with its own input's length around one
      fused ``query_key_value``), else as ``"narrow"``;
    * ``"narrow"``: at its column layers' deepest common module, or at each column layer (see the module
      docstring).

    :func:`slapo_lab.presets.megatron_tp` tries them in this order and keeps the first that checks ✓.

    Raises:
        LayoutRefused: a region to run on the whole sequence that is not inside a module of its own (its
            layers are the block's direct children), so no module boundary can gather it.
    """
    gather: list[str] = []
    islands: list[str] = []
    mode: dict[tuple, str] = {}
    for region, rels in regions:
        ks = [kinds[r] for r in rels]
        dense = [r for r, k in zip(rels, ks, strict=True) if k in ("column", "column_shard", "row")]
        pair = "row" in ks and any(k in ("column", "column_shard") for k in ks)
        if region.key in skip or any(k.startswith(ISLAND_KINDS) for k in ks) or (dense and not pair):
            if not region.owner:
                raise LayoutRefused(
                    f"Sequence parallelism cannot run {region.label} in {region.where} on the whole sequence: "
                    "its layers are direct parts of the block, with no module of their own to gather at."
                )
            islands.append(region.owner)
            mode[region.key] = "island"
        elif pair:
            f = [r for r, k in zip(rels, ks, strict=True) if k == "attention_f"]
            cols = [r for r, k in zip(rels, ks, strict=True) if k in ("column", "column_shard")]
            norms = [r for r, k in zip(rels, ks, strict=True) if k == "norm"]
            around = _common(dense)
            if f:
                gather.append(f[0])
            elif style != "narrow" and around and not any(_under(n, around) for n in norms):
                gather.append(around)
            elif len(cols) > 1 and _common(cols):
                gather.append(_common(cols))
            else:
                gather.extend(cols)
            mode[region.key] = "gather"
        else:  # norms and such, on this rank's tokens
            mode[region.key] = "tokens"
    for region, rels in regions:  # a region inside an island runs as without sequence parallelism
        if mode[region.key] != "island" and all(any(_under(r, i) for i in islands) for r in rels):
            mode[region.key] = "plain"
    gather = [g for g in gather if not any(_under(g, i) for i in islands)]
    region = Region(
        (cls, ("sequence layout",)), "its sequence-parallel gathers", f"every {cls}", done="laid out"
    )
    return BlockLayout(gather, islands, mode, region)


def apply_layout(sch, block: str, layout: BlockLayout) -> None:
    """Record the gathers, the islands' gathers and scatters, and the summed gradients of one block.

    Raises:
        LayoutRefused: a primitive refuses one of these calls (its sentence).
    """
    pre = f"{block}." if block else ""
    try:
        for g in layout.gather:
            _ensure_sync(sch[pre + g], "fwd_pre", "all_gather", axis=SEQUENCE_AXIS)
        for i in layout.islands:
            _ensure_sync(
                sch[pre + i], "fwd_pre", "all_gather", axis=SEQUENCE_AXIS, tensor_parallel_output_grad=False
            )
            _ensure_sync(sch[pre + i], "fwd_post", "scatter", axis=SEQUENCE_AXIS)
        for rel, mod in sch[block].mod.named_modules():
            if rel and layout.exempt(rel):
                continue
            if any(
                p is not None and p.requires_grad and getattr(p, "shard_axis", None) is None
                for p in mod._parameters.values()
            ):
                _ensure_sync(
                    sch[pre + rel] if rel else sch[block], "bwd_post", "all_reduce", param_grads=True
                )
    except LayoutRefused:
        raise
    except ScheduleError as err:
        raise LayoutRefused(f"Sequence parallelism cannot be laid out on {block}: {err}") from None


def stacks(blocks: list[str]) -> list[tuple[str, str]]:
    """``(first, last)`` block of each stack (the blocks of one ``nn.ModuleList``), in order."""
    by: dict[str, list[str]] = {}
    for b in blocks:
        by.setdefault(b.rsplit(".", 1)[0] if "." in b else "", []).append(b)
    return [(bs[0], bs[-1]) for bs in by.values()]


def scatter_gather(sch, blocks: list[str]) -> None:
    """Scatter the sequence on each stack's first block's input and gather it on its last block's output.

    Raises:
        LayoutRefused: a primitive refuses one of these calls.
    """
    try:
        for first, last in stacks(blocks):
            _ensure_sync(sch[first], "fwd_pre", "scatter", axis=SEQUENCE_AXIS)
            _ensure_sync(
                sch[last], "fwd_post", "all_gather", axis=SEQUENCE_AXIS, tensor_parallel_output_grad=False
            )
    except ScheduleError as err:
        raise LayoutRefused(f"Sequence parallelism cannot scatter the sequence: {err}") from None
