"""Canonical schedules, applied through ordinary primitive calls (so they are recorded and exportable).

Every preset calls ``sch[path].shard(...)`` / ``.sync(...)`` / ``.checkpoint()`` like a user would and
returns the :class:`~slapo_lab.record.Call` objects it appended to ``sch.record``. Presets are all or
nothing (:func:`atomic`): when a call fails midway (block 2 of 24 ...), its
:class:`~slapo_lab.errors.ScheduleError` propagates and the schedule, the model and the record are exactly
as before the preset.

Megatron-LM tensor parallelism per transformer block (Slapo's canonical schedules, reference.md):

* column parallel (q, k, v, fused ``c_attn``, MLP up / gate / ``c_fc`` / ``intermediate.dense``): shard the
  weight on its output features (``nn.Linear`` axis 0, HF ``Conv1D`` axis 1) and the bias on axis 0, then
  ``sync(mode="bwd_post", sync_op_or_fn="all_reduce")`` (Megatron's *f*: all-reduce the input gradient);
* row parallel (attention output / ``o_proj`` / ``c_proj`` / ``output.dense``, MLP down): shard the weight on
  its input features (``nn.Linear`` axis 1, ``Conv1D`` axis 0), ``sync(mode="fwd_post", sync_op_or_fn=
  "all_reduce")`` (Megatron's *g*; the bias is added once, after the reduce);
* vocab parallel (``vocab_parallel=True``): the input embedding's weight on axis 0 + ``fwd_post all_reduce``;
  the output embedding (``lm_head``, BERT's MLM decoder) -- tied, so already sharded by the embedding, or
  sharded on axis 0 here -- becomes column parallel with a vocabulary-partitioned output, so it gets
  ``bwd_post all_reduce`` plus ``fwd_post all_gather(axis=-1, tensor_parallel_output_grad=False)`` and the
  loss sees full logits. (With the replicated loss every rank computes, the gradient of the gathered
  logits is already complete on each rank: backward just keeps this rank's slice, a reduce-scatter would
  multiply it by the world size.)

Sequence parallelism (``sequence_parallel=True``, any block stack): between the tensor-parallel regions each
rank holds a slice of the sequence (axis -2): ``scatter`` on each stack's first block input, ``all_gather`` at
each region's input (its backward reduce-scatter replaces *f*), ``reduce_scatter`` after each row-parallel
layer (replacing *g*), ``all_gather(tensor_parallel_output_grad=False)`` on the last block's output; the
replicated parameters that see this rank's tokens only (the blocks' norms, the row-parallel biases) sum their
gradients (``sync(mode="bwd_post", sync_op_or_fn="all_reduce", param_grads=True)``, what Megatron does for
its ``sequence_parallel`` parameters). Where each goes is read from the block's regions, with no family name:
:mod:`~slapo_lab.presets.sequence`. The sequence length must divide by the world size.

The package: this module holds the model-level presets (:func:`megatron_tp`, :func:`checkpoint_blocks`);
:mod:`~slapo_lab.presets.parallel` the layer-level ones (column, row, experts parallel),
:mod:`~slapo_lab.presets.roles` which layers of a block are split and how (:func:`block_layers`,
:func:`tp_block`), :mod:`~slapo_lab.presets.vocab` the vocabulary-parallel embeddings,
:mod:`~slapo_lab.presets.sequence` the sequence-parallel layout and
:mod:`~slapo_lab.presets.hf_plan` Hugging Face's own tensor-parallel plans.
"""

from __future__ import annotations

import functools

from torch import nn

from ..atomic import atomic
from ..blocks import _BLOCK_CLASSES, FAMILIES, detect_family, find_blocks, is_conv1d
from ..call_order import _INPUTS_KEY
from ..errors import ScheduleError
from ..module_state import peek_meta
from ..plan import estimate_activations
from ..preset_check import OUTSIDE, Applied, Region, RegionRefused, WholeRefused, gate, layer_regions
from ..primitives.checkpoint import POLICIES
from ..record import Call
from . import sequence
from .hf_plan import apply_hf_tp_plan as apply_hf_tp_plan
from .hf_plan import hf_tp_plan as hf_tp_plan
from .parallel import COLUMN_NAMES as COLUMN_NAMES
from .parallel import HEAD_NORM_NAMES as HEAD_NORM_NAMES
from .parallel import ROW_NAMES as ROW_NAMES
from .parallel import EarlierCallConflict as EarlierCallConflict
from .parallel import PresetCalls as PresetCalls
from .parallel import _all_or_nothing, _since
from .parallel import apply_layer as apply_layer
from .parallel import column_parallel as column_parallel
from .parallel import experts_parallel as experts_parallel
from .parallel import row_parallel as row_parallel
from .roles import _no_pair_reason
from .roles import block_layers as block_layers
from .roles import replicated_dense as replicated_dense
from .roles import tp_block as tp_block
from .vocab import has_vocab_embedding as has_vocab_embedding
from .vocab import vocab_parallel_embeddings as vocab_parallel_embeddings
from .vocab import vocab_size as vocab_size


@_all_or_nothing
def megatron_tp(
    sch,
    family: str | None = None,
    *,
    vocab_parallel: bool = True,
    sequence_parallel: bool = False,
    use_hf_plan: bool = False,
    check: bool = True,
) -> list[Call]:
    """Slapo's canonical Megatron tensor-parallel schedule for BERT, GPT-2, Llama (or any block stack).

    Args:
        sch: the root schedule (its ``world_size`` is the TP width).
        family: ``"bert"``, ``"gpt2"``, ``"llama"``, ``"roberta"``, ``"opt"``, ``"gpt_neo"``, ``"t5"`` (encoder and
            decoder blocks, cross attention, the per-head ``relative_attention_bias``; see ``FAMILIES``) or
            ``"generic"``; None detects it from the block classes (``"generic"`` = :func:`find_blocks` +
            :func:`tp_block` by projection names). A named family must match the model's blocks.
        vocab_parallel: also shard the word embedding (and the output embedding) by vocabulary
            (:func:`vocab_parallel_embeddings`); a vocabulary that does not divide by the world size
            (GPT-2's 50257 on 4 ranks), or a model without an ``nn.Embedding`` from
            ``get_input_embeddings()`` (CLIP, a hand-written GPT), stays replicated, with a sentence in
            the result's ``notes``.
        sequence_parallel: Megatron sequence parallelism between the TP regions (see the module docstring).
            It is checked as a whole: where the numeric check finds any difference (T5's cross-attention,
            whose keys read the encoder's sequence), the preset is refused in one sentence.
        use_hf_plan: shard the blocks by the config's ``base_model_tp_plan`` (:func:`apply_hf_tp_plan`)
            instead of by names.
        check: check the calls numerically before they are committed (:func:`slapo_lab.preset_check.gate`):
            a region (an attention's q/k/v...o, an MLP's up...down, an expert bank, the embeddings) that a
            primitive refuses or that makes the check fail is kept whole in every block of its class, with
            one sentence in ``notes``. Inside a real process group nothing is checked (Verify is the proof).

    The result's ``notes`` say what stayed whole and why: a vocabulary that does not divide, and the dense
    layers left replicated (:func:`replicated_dense`).

    Composes with what is already there: a tensor already sharded on the axis the preset would use and a
    sync the module already has are skipped, so a layer sharded by hand first is completed, not refused.

    Returns:
        PresetCalls: the recorded calls this preset made (a list) and its ``notes``.

    Raises:
        ScheduleError: unknown family, sequence parallelism that cannot be laid out or changes the result,
            no blocks found, a tensor already sharded on another axis, or the first primitive call that fails
            (e.g. heads not divisible by the world size).
    """
    fam = family or detect_family(sch) or "generic"
    if fam not in (*FAMILIES, "generic"):
        raise ScheduleError(
            f"Unknown model family {family!r}; use one of {', '.join(FAMILIES)}, generic or None."
        )
    if family in _BLOCK_CLASSES and not {type(m).__name__ for m in sch.mod.modules()} & set(
        _BLOCK_CLASSES[family]
    ):
        raise ScheduleError(
            f"family={family!r} expects {' or '.join(_BLOCK_CLASSES[family])} blocks and this model has "
            "none; pass family=None to detect the family."
        )
    if sequence_parallel and use_hf_plan:
        raise ScheduleError(
            "use_hf_plan does not combine with sequence_parallel: HF plans carry no sequence layout."
        )
    blocks = find_blocks(sch)
    if not blocks and not use_hf_plan:
        raise ScheduleError(
            "megatron_tp found no repeated transformer blocks (an nn.ModuleList of one block class)."
        )

    # every block's layers are read once, before anything is split or checked: each application of the
    # gate then splits the same regions (the dataflow a block's split is read from is the unscheduled model's)
    layers_of = {b: block_layers(sch, b) for b in (blocks if not use_hf_plan else ())}
    # sequence parallelism tries its layouts in turn (sequence.STYLES: around each region's module, then at
    # its column layers) and keeps the first that checks; when none does it is refused whole, with the first
    # layout's sentence
    refused: WholeRefused | None = None
    apply = functools.partial(
        _megatron_regions, sch, blocks, vocab_parallel, sequence_parallel, use_hf_plan, layers_of
    )
    for style in sequence.STYLES if sequence_parallel and check else sequence.STYLES[:1]:
        try:
            calls, notes = gate(
                sch,
                functools.partial(apply, style),
                check=check,
                whole=_SP_REFUSED if sequence_parallel else None,
            )
            break
        except WholeRefused as err:
            refused = refused or err
    else:
        assert refused is not None
        raise refused
    if not check and getattr(sch.get_top_schedule().mod, "config", None) is None and sch.world_size > 1:
        _refuse_width_derived_heads(sch)
    whole = replicated_dense(sch, exclude_noted=True)
    if not calls and not _any_sharded(sch):
        if any(n.startswith("Kept whole:") for n in notes):
            raise ScheduleError(f"megatron_tp found no dense projection it can split: {' '.join(notes)}")
        # the reason of the first block that holds a dense layer (a hybrid stack's convolutional blocks say
        # nothing about why its attention blocks stay whole: SwiftFormer)
        first = next(
            (
                b
                for b in blocks
                if any(isinstance(m, nn.Linear) or is_conv1d(m) for m in sch[b].mod.modules())
            ),
            blocks[0] if blocks else "",
        )
        raise ScheduleError(_no_pair_reason(sch, first, block_layers(sch, first) if blocks else []))
    return PresetCalls(calls, [*notes, *([whole] if whole else [])])


def _any_sharded(sch) -> bool:
    return any(getattr(p, "shard_axis", None) is not None for p in sch.mod.parameters())


#: How a sequence-parallel preset that fails the numeric check is refused (the check's sentence follows).
_SP_REFUSED = (
    "Sequence parallelism is not applied, because with it the numeric check does not pass (apply the preset "
    "without sequence_parallel):"
)


def _megatron_regions(sch, blocks, vocab_parallel, sequence_parallel, use_hf_plan, layers_of, style, skip):
    """One application of :func:`megatron_tp` region by region (:mod:`slapo_lab.preset_check`), leaving out
    the regions whose keys ``skip`` holds; a region a primitive refuses raises ``RegionRefused``."""
    n = len(sch.record)
    runner = _RegionRunner(sch, skip)
    notes: list[str] = []
    if use_hf_plan:
        plan = Region(("", ("base_model_tp_plan",)), "the config's base_model_tp_plan", "the model")
        runner.run(plan, lambda: apply_hf_tp_plan(sch))
    for b in blocks if not use_hf_plan else ():
        _block_regions(runner, sch, b, layers_of[b], sequence_parallel, style)
    if vocab_parallel:
        vocab = vocab_size(sch)
        if vocab is None:
            notes.append(
                "No word embedding is sharded: the model's get_input_embeddings() is not an nn.Embedding, "
                "so its embeddings stay replicated."
            )
        elif vocab % sch.world_size:
            notes.append(
                f"The word embedding stays replicated: its vocabulary of {vocab} does not divide by the "
                f"world size {sch.world_size} (pad the vocabulary to a multiple of {sch.world_size} to shard it)."
            )
        else:
            runner.run(OUTSIDE, lambda: vocab_parallel_embeddings(sch))
    if sequence_parallel:
        runner.run(OUTSIDE, lambda: sequence.scatter_gather(sch, blocks))
    return Applied(_since(sch, n), runner.region_of_call, runner.owned, notes)


class _RegionRunner:
    """Runs the calls of one region at a time and remembers which region made each call and owns each path."""

    def __init__(self, sch, skip) -> None:
        self.sch = sch
        self.skip = skip
        self.region_of_call: list = []
        self.owned: dict = {}
        self.done: set = set()

    def run(self, region, fn) -> None:
        """``fn()`` for ``region`` unless it is skipped; a refusal raises ``RegionRefused`` (an earlier call's
        conflict, or a refusal in a region an earlier block of its class applied, is raised as it is)."""
        if region.key in self.skip:
            return
        k = len(self.sch.record)
        try:
            fn()
        except (EarlierCallConflict, sequence.LayoutRefused):
            raise
        except ScheduleError as err:
            if (
                region.key in self.done
            ):  # the same layers applied in an earlier block of this class: what differs
                raise  # here is a call made before the preset, so the preset is refused as a whole
            raise RegionRefused(region, str(err)) from None
        self.done.add(region.key)
        self.region_of_call.extend([region] * (len(self.sch.record) - k))
        for c in self.sch.record.calls[k:]:
            self.owned.setdefault(c.path, region)


def _block_regions(runner: _RegionRunner, sch, b: str, layers, sequence_parallel: bool, style: str) -> None:
    """Apply the layers of block ``b`` (its :func:`block_layers`) region by region through ``runner``; with
    ``sequence_parallel``, laid out by :func:`slapo_lab.presets.sequence.block_layout`."""
    cls = type(sch[b].mod).__name__
    rel_layers = [(p[len(b) + 1 :] if b else p, k) for p, k in layers]
    kinds = dict(rel_layers)
    # a module with several kinds (GPT-OSS-style sinks on an MLA attention that also takes Megatron's f:
    # ``head_param`` then ``attention_f``) gets each of them, in block_layers' order
    queues: dict = {}
    for r, k in rel_layers:
        queues.setdefault(r, []).append(k)
    regions = layer_regions(cls, rel_layers)
    layout = sequence.block_layout(cls, regions, kinds, runner.skip, style) if sequence_parallel else None
    for region, rels in regions:
        if not any(kinds[r] in ("column", "column_shard", "experts", "heads") for r in rels) and any(
            kinds[r] == "row" for r in rels
        ):  # a row-parallel layer with no column-parallel partner can never be right: leave it
            continue
        paths = [f"{b}.{r}" if b else r for r in rels]
        for p in paths:
            runner.owned[p] = region
        full = next((p for p, r in zip(paths, rels, strict=True) if kinds[r] == "qk_norm_full"), None)
        if full is not None:
            reason = (
                f"{full} normalises q or k over all attention heads' features, so splitting the heads across "
                "ranks would change its result."
            )
            runner.run(region, functools.partial(_raise, reason))
            continue
        todo = [queues[r].pop(0) if len(queues[r]) > 1 else queues[r][0] for r in rels]
        how: list[tuple[str | None, bool]] = [(k, False) for k in todo]
        if layout is not None:
            how = [layout.layer_sp(region.key, r, k) for r, k in zip(rels, todo, strict=True)]
        runner.run(region, functools.partial(_apply_layers, sch, paths, how))
    if layout is not None:
        runner.run(layout.region, functools.partial(sequence.apply_layout, sch, b, layout))


def _raise(reason: str) -> None:
    raise ScheduleError(reason)


def _apply_layers(sch, paths: list[str], how: list[tuple[str | None, bool]]) -> None:
    """:func:`apply_layer` on each path with its ``(kind, sequence_parallel)`` (a None kind: nothing)."""
    for path, (kind, sp) in zip(paths, how, strict=True):
        if kind is not None:
            apply_layer(sch, path, kind, sp)


def _refuse_width_derived_heads(sch) -> None:
    """A model of the user's own classes (no Hugging Face config, so no attribute the shard rules rewrite per
    rank is known to be the one its forward reads): run the sharded model once on meta tensors with the
    schedule's example inputs (simulated ranks: shapes only); a forward that fails means it derives head
    counts or sizes from widths the preset split (nanoGPT's ``C // self.n_head``), and the preset is refused
    in one sentence (all or nothing: nothing stays applied). Without example inputs nothing is run (the
    editor's live numeric check still runs the model)."""
    top = sch.get_top_schedule()
    inputs = top._top.extra.get(_INPUTS_KEY)
    if inputs is None:
        return
    try:
        estimate_activations(top.mod, inputs)
    except ScheduleError as err:
        where = getattr(err, "module", None)
        at = f"{where}'s forward" if where else "the model's forward"
        cause = err.__cause__ if err.__cause__ is not None else err
        text = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise ScheduleError(
            f"with its heads split over {sch.world_size} ranks, {at} fails ({type(cause).__name__}: {text}); it "
            "probably derives head counts or sizes from the input's width (e.g. C // n_head), which tensor "
            "parallelism changes, so shard it by hand with a forward that reads per-rank sizes."
        ) from None


@_all_or_nothing
def checkpoint_blocks(
    sch, every: int = 1, ratio: float = 1.0, *, policy: str = "full", check: bool = True
) -> list[Call]:
    """Activation-checkpoint the transformer blocks (:func:`find_blocks`).

    Checkpoints block ``i`` of the first ``int(len(blocks) * ratio)`` blocks (Slapo's ``ckpt_ratio``) when
    ``i % every == 0``; blocks already checkpointed are skipped. ``policy``: ``"full"`` or ``"selective"`` (see
    :mod:`slapo_lab.primitives.checkpoint`). With ``check`` the calls are checked
    numerically first (:func:`slapo_lab.preset_check.gate`): the blocks of a class whose recomputation
    differs (randomness the checkpoint does not replay) stay as they are, said in the result's ``notes``.

    Returns:
        PresetCalls: the recorded calls and their ``notes``.

    Raises:
        ScheduleError: for a bad ``every`` / ``ratio``, when no blocks are found, or when no checkpoint
            checks right.
    """
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ScheduleError(f"every must be a positive integer, not {every!r}.")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
        raise ScheduleError(f"ratio must be a number in [0, 1], not {ratio!r}.")

    if policy not in POLICIES:
        raise ScheduleError(f"policy must be one of {', '.join(map(repr, POLICIES))}, not {policy!r}.")
    blocks = find_blocks(sch)
    if not blocks:
        raise ScheduleError(
            "checkpoint_blocks found no repeated blocks (an nn.ModuleList of one block class)."
        )

    apply = functools.partial(_checkpoint_regions, sch, blocks, every, ratio, policy=policy)
    calls, notes = gate(sch, apply, check=check)
    return PresetCalls(calls, notes)


def _checkpoint_regions(sch, blocks, every, ratio, skip, policy="full"):
    """One application of :func:`checkpoint_blocks`; a region is the checkpoints of one block class."""
    n = len(sch.record)
    region_of_call, owned = [], {}
    for i, b in enumerate(blocks[: int(len(blocks) * ratio)]):
        cls = type(sch[b].mod).__name__
        region = Region(
            (cls, ("checkpoint",)), "block", f"every {cls}", kept="Not checkpointed", done="checkpointed"
        )
        owned[b] = region
        meta = peek_meta(sch[b].mod)
        if i % every == 0 and not (meta and meta.checkpoint) and region.key not in skip:
            if policy == "full":
                sch[b].checkpoint()  # recorded as before: schedules without a policy stay Slapo's calls
            else:
                sch[b].checkpoint(policy=policy)
            region_of_call.append(region)
    return Applied(_since(sch, n), region_of_call, owned, [])


__all__ = [
    "COLUMN_NAMES",
    "FAMILIES",
    "HEAD_NORM_NAMES",
    "ROW_NAMES",
    "apply_hf_tp_plan",
    "apply_layer",
    "atomic",
    "block_layers",
    "checkpoint_blocks",
    "column_parallel",
    "detect_family",
    "experts_parallel",
    "find_blocks",
    "has_vocab_embedding",
    "hf_tp_plan",
    "megatron_tp",
    "row_parallel",
    "tp_block",
    "vocab_parallel_embeddings",
]
