"""Cost profiles of a model's parts, one per distinct block, measured once on meta/fake tensors and cached.

:func:`profile_model` runs ONE forward and backward of the model cut down to one block of each distinct block
class (every stack of :func:`slapo_lab.blocks.find_blocks` keeps its first block of each class; HF models loop
over whatever their ``ModuleList`` holds), with tensor parallelism applied by the Megatron preset
(:func:`slapo_lab.presets.megatron_tp`, ``check=False``) on a simulated schedule of ``tp`` ranks, on meta tensors
(``FakeTensorMode`` when the forward reads a value). From that pass, per part -- ``"pre"`` (what runs before
the first block: embeddings, rotary tables), each block class, ``"post"`` (final norm, head, loss):

* every aten op's FLOPs (``torch.utils.flop_counter``'s formulas, the ones ``FlopCounterMode`` uses; CPU's
  flash attention mapped to the SDPA formula), its bytes read and written (activations and weights apart;
  views move nothing; a tensor shaped like a >= 2-d parameter, such as a weight's gradient, counts as weight
  bytes, which do not grow with the micro-batch), forward and backward apart (backward ops are attributed with
  ``torch.utils.module_tracker.ModuleTracker``);
* the bytes autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``, one count per storage,
  parameters excluded), the residual input a full checkpoint keeps, and what selective checkpointing keeps
  (:data:`slapo_lab.random.SELECTIVE_SAVE`: the outputs of every other matmul and of attention, torchtitan's
  ``selective_ac_option="op"`` policy in ``torchtitan/models/llama3/infra/parallelize.py``, ``_save_list``);
* parameter elements and bytes per tensor-parallel rank;
* collectives with their byte volumes: the schedule's syncs (``ModuleMeta.syncs``: ``fwd_post`` moves the
  module's output, ``fwd_pre`` its input, ``bwd_post`` its input's gradient) and the part's output (a pipeline
  stage boundary's send/recv). FSDP, ZeRO and DP volumes follow from the parameter bytes (``model.py``).

Every activation figure is for ONE sequence (micro-batch 1) at the profiled sequence length; activations,
FLOPs and activation bytes scale linearly with the micro-batch size, weight bytes do not. The whole model is
``pre + sum(count x block) + post``: the cost of a 126-layer model is one pass over three parts, whatever its
depth, and the planner prices every candidate from these numbers without another forward.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry
from torch.utils.module_tracker import ModuleTracker

from .. import presets
from ..activations import FlashSDPA
from ..blocks import block_lists
from ..errors import ScheduleError
from ..inputs import inputs_from_config
from ..module_state import peek_meta, syncs_of
from ..random import MATMULS as _MATMULS
from ..random import SELECTIVE_SAVE, selective_policy
from ..schedule import Schedule, create_schedule
from ..sharding import infer
from ..utils import human_bytes, meta_copy

__all__ = ["SELECTIVE_SAVE", "ModelProfile", "PartProfile", "profile_model", "selective_policy"]

aten = torch.ops.aten
_COLS = 6  # the columns of an op row (PartProfile.fwd)

_SDPA_CPU = {
    aten._scaled_dot_product_flash_attention_for_cpu: aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: aten._scaled_dot_product_flash_attention_backward,
}
_ATTENTION = frozenset(
    (
        aten._scaled_dot_product_flash_attention,
        aten._scaled_dot_product_efficient_attention,
        aten._scaled_dot_product_cudnn_attention,
        aten._scaled_dot_product_flash_attention_backward,
        aten._scaled_dot_product_efficient_attention_backward,
        aten._scaled_dot_product_cudnn_attention_backward,
    )
)


@dataclass
class PartProfile:
    """One part of the model at one tensor-parallel degree, for ONE sequence (see the module docstring).

    Attributes:
        name: ``"pre"``, ``"post"`` or the block class name.
        count: how many of it the model holds (1 for pre/post).
        param_elems / param_bytes: parameters per tensor-parallel rank (elements, bytes), each tensor once.
        fwd / bwd: ``(k, 6)`` float arrays, one row per aten op: (FLOPs the kernel does, activation bytes
            moved, weight bytes moved, 1.0 for a fused attention kernel else 0.0, activation bytes of its outputs,
            weight-shaped bytes of its outputs); activation bytes are per sequence, weight bytes per pass; causal
            attention counts half its FLOPs (the kernel skips the masked blocks: Dao, "FlashAttention-2", 2023,
            section 3.1).
        fwd_flops / bwd_flops: model FLOPs (``FlopCounterMode``'s count, causal attention in full) for MFU.
        saved_bytes: bytes autograd keeps for backward without checkpointing.
        input_bytes: the residual input (same shape as the output) a full checkpoint keeps.
        selective_bytes: what selective checkpointing keeps (``input_bytes`` + the kept op outputs).
        recompute_all / recompute_selective: ``(k, 6)`` rows of the forward ops a full / selective checkpoint
            runs again in backward.
        comm: ``[(op, phase, bytes)]`` the tensor-parallel collectives of one pass (``phase`` fwd|bwd).
        output_bytes: the part's output (the activation a pipeline boundary after it sends); for ``"post"``, the
            model's outputs but the scalar loss (a causal LM's logits).
        param_sizes: the elements of each trainable tensor (per tensor-parallel rank), in order (the optimizer
            step's cost per element depends on the tensor's size); ``trainable_elems``, ``param_tensors`` and
            ``largest_param_elems`` are read from it.
        fwd_ops / bwd_ops: every aten op dispatched in the part's forward / backward, views and in-place ops
            included (each pays the host's per-op dispatch time, ``DeviceProfile.op_overhead``).
    """

    name: str
    count: int = 1
    param_elems: int = 0
    param_bytes: int = 0
    fwd: np.ndarray = field(default_factory=lambda: np.zeros((0, _COLS)))
    bwd: np.ndarray = field(default_factory=lambda: np.zeros((0, _COLS)))
    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    saved_bytes: int = 0
    input_bytes: int = 0
    selective_bytes: int = 0
    recompute_all: np.ndarray = field(default_factory=lambda: np.zeros((0, _COLS)))
    recompute_selective: np.ndarray = field(default_factory=lambda: np.zeros((0, _COLS)))
    comm: list = field(default_factory=list)
    output_bytes: int = 0
    param_sizes: tuple = ()
    fwd_ops: int = 0
    bwd_ops: int = 0

    @property
    def trainable_elems(self) -> int:
        """Elements of the part's trainable tensors (per tensor-parallel rank)."""
        return sum(self.param_sizes)

    @property
    def param_tensors(self) -> int:
        """How many trainable tensors the part holds (an eager optimizer step dispatches its ops per tensor)."""
        return len(self.param_sizes)

    @property
    def largest_param_elems(self) -> int:
        """Elements of the part's largest trainable tensor (0 without one)."""
        return max(self.param_sizes, default=0)


@dataclass
class ModelProfile:
    """The parts of one model at one tensor-parallel degree (:func:`profile_model`).

    Attributes:
        tp / seq_len / dtype / sequence_parallel: what it was profiled at.
        pre / post: the parts before the first and after the last block.
        blocks: one :class:`PartProfile` per distinct block class, in model order, with its ``count``.
        heads / kv_heads: attention heads and key/value heads of the first block (None: no attention found).
        notes: the preset's notes (what it kept whole, and why).
        seconds: the profiling pass's wall time.
    """

    tp: int
    seq_len: int
    dtype: str
    sequence_parallel: bool
    pre: PartProfile
    post: PartProfile
    blocks: list[PartProfile]
    heads: int | None = None
    kv_heads: int | None = None
    notes: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def num_blocks(self) -> int:
        return sum(b.count for b in self.blocks)

    @property
    def parts(self) -> list[PartProfile]:
        return [self.pre, *self.blocks, self.post]

    def total(self, attr: str) -> float:
        """``pre + sum(count x block) + post`` of a numeric attribute (``param_elems``, ``fwd_flops``...)."""
        return sum(getattr(p, attr) * p.count for p in self.parts)


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
    elif hasattr(x, "to_tuple"):  # HF ModelOutput
        yield from _tensors(x.to_tuple())


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Recorder(TorchDispatchMode):
    """Per aten op: (part, phase, FLOPs, activation bytes, weight bytes, kept by selective checkpointing,
    output bytes). ``part_of()`` names the running part."""

    def __init__(self, part_of, weights: set[int]):
        super().__init__()
        self.part_of = part_of
        self.weights = weights
        self.rows: list[tuple] = []
        self.mm_count: dict[str, int] = {}
        self.created: dict[int, str] = {}  # storage -> the part whose op made it
        self.alive: list = []
        self.ops: dict[tuple[str, str], int] = {}  # (part, phase) -> aten ops dispatched, views included
        self.param_shapes: set[tuple] = set()  # shapes of the >= 2-d parameters (their gradients have them)

    def _weight_shaped(self, t: torch.Tensor) -> bool:
        return t.dim() >= 2 and tuple(t.shape) in self.param_shapes

    def _bytes(self, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> tuple[int, int, int, int]:
        """(activation bytes, weight bytes) an op reads and writes, then (activation bytes, weight bytes) of its
        outputs alone: a parameter, or a tensor of a parameter's shape (its gradient, which does not grow with
        the micro-batch), counts as weight."""
        act = wgt = 0
        for t in ins:
            nbytes = t.numel() * t.element_size()
            if _key(t) in self.weights or self._weight_shaped(t):
                wgt += nbytes
            else:
                act += nbytes
        out_act = out_wgt = 0
        for t in outs:
            nbytes = t.numel() * t.element_size()
            if self._weight_shaped(t):
                out_wgt += nbytes
            else:
                out_act += nbytes
        return act + out_act, wgt + out_wgt, out_act, out_wgt

    def _kept(self, func, part: str) -> bool:
        """Whether selective checkpointing keeps this forward op's output (``random.SELECTIVE_SAVE``: every other
        matmul of a part, and the ops it always keeps)."""
        if func not in SELECTIVE_SAVE:
            return False
        if func in _MATMULS:
            n = self.mm_count[part] = self.mm_count.get(part, 0) + 1
            return n % 2 == 1
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        part, phase = self.part_of()
        self.ops[(part, phase)] = self.ops.get((part, phase), 0) + 1
        packet = func._overloadpacket
        ins = list(_tensors((args, kwargs)))
        outs = list(_tensors(out))
        in_keys = {_key(t) for t in ins}
        if packet not in flop_registry and (not outs or all(_key(t) in in_keys for t in outs)):
            # a view or an in-place op on its input, or a query that returns no tensor (``prim.device``, a size):
            # no kernel of its own worth counting
            return out
        flops, model_flops = _kernel_flops(packet, args, kwargs, out)
        act, wgt, out_act, out_wgt = self._bytes(ins, outs)
        kept = phase == "fwd" and self._kept(func, part)
        for t in outs:
            if _key(t) not in self.created:
                self.created[_key(t)] = part
                self.alive.append(t)  # fake tensors (no data): kept so that no later storage reuses the key
        attention = float(_SDPA_CPU.get(packet, packet) in _ATTENTION)
        self.rows.append(
            (
                part,
                phase,
                flops,
                act,
                wgt,
                kept,
                (out_act, out_wgt),
                model_flops,
                outs if kept else (),
                attention,
            )
        )
        return out


def _kernel_flops(packet, args, kwargs, out) -> tuple[float, float]:
    """(FLOPs the kernel does, model FLOPs) of one op by ``torch.utils.flop_counter``'s formulas (0 for an op it
    has none for): a causal attention kernel does half its model FLOPs (it skips the masked blocks)."""
    packet = _SDPA_CPU.get(packet, packet)
    fn = flop_registry.get(packet)
    if fn is None:
        return 0.0, 0.0
    try:
        model_flops = float(fn(*args, **kwargs, out_val=out))
    except (TypeError, ValueError, RuntimeError, IndexError):  # a formula that does not take these args
        return 0.0, 0.0
    if packet in _ATTENTION and _is_causal(args, kwargs):
        return model_flops / 2, model_flops
    return model_flops, model_flops


def _is_causal(args, kwargs) -> bool:
    if "is_causal" in kwargs:
        return bool(kwargs["is_causal"])
    # (query, key, value, dropout_p, is_causal, ...) for the flash kernels' forward
    return len(args) > 4 and isinstance(args[4], bool) and args[4]


# --------------------------------------------------------------------------------------------------
# the cut-down model
# --------------------------------------------------------------------------------------------------
def _block_stacks(sch) -> list[tuple[str, list[int], list[int]]]:
    """``[(ModuleList path, indices kept, how many blocks each kept index stands for)]`` for every stack of
    blocks: the first block of each class, and the stack's last block too when it has syncs of its own the
    first of its class lacks (sequence parallelism gathers the sequence on the last block's output; without
    it the cut-down model's output stays split)."""

    out = []
    for parent, idxs in block_lists(sch):
        lst = sch.mod.get_submodule(parent) if parent else sch.mod
        first: dict[type, int] = {}
        counts: dict[type, int] = {}
        for i in idxs:
            cls = type(lst[i])
            first.setdefault(cls, i)
            counts[cls] = counts.get(cls, 0) + 1
        kept = sorted(first.values())
        stands = {i: counts[type(lst[i])] for i in kept}
        last = idxs[-1] if idxs else None
        if (
            last is not None
            and last not in stands
            and set(syncs_of(lst[last])) - set(syncs_of(lst[first[type(lst[last])]]))
        ):
            stands[first[type(lst[last])]] -= 1
            stands[last] = 1
            kept.append(last)
        out.append((parent, kept, [stands[i] for i in kept]))
    return out


@contextlib.contextmanager
def _cut_down(model: nn.Module, stacks):
    """Within the block: every stack of ``model`` holds only its kept blocks (restored after)."""
    saved = []
    try:
        for parent, kept, _ in stacks:
            lst = model.get_submodule(parent)
            saved.append((lst, dict(lst._modules)))
            lst._modules.clear()
            for j, i in enumerate(kept):
                lst._modules[str(j)] = saved[-1][1][str(i)]
        yield
    finally:
        for lst, mods in saved:
            lst._modules.clear()
            lst._modules.update(mods)


def _example_inputs(model: nn.Module, seq_len: int):
    """``input_ids`` and ``labels`` of one sequence of ``seq_len`` tokens (meta), for a model with a vocabulary;
    else the inputs :func:`slapo_lab.inputs.inputs_from_config` makes, with its sequence axis at ``seq_len``."""
    cfg = getattr(model, "config", None)
    if cfg is not None and getattr(cfg, "vocab_size", None):
        ids = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
        return {"input_ids": ids, "labels": ids, "use_cache": False}

    inputs = inputs_from_config(model)
    if inputs is None:
        raise ScheduleError(
            f"profile: cannot make inputs for {type(model).__name__} (no config with a vocab_size); "
            "pass a schedule whose example inputs were recorded."
        )
    return {k: v[:1].to("meta") if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


# --------------------------------------------------------------------------------------------------
# profiling
# --------------------------------------------------------------------------------------------------
_CACHE: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def profile_model(
    model_or_schedule,
    tp: int = 1,
    seq_len: int = 2048,
    dtype: str = "bf16",
    sequence_parallel: bool = False,
) -> ModelProfile:
    """The :class:`ModelProfile` of a model (or schedule) at tensor-parallel degree ``tp``, cached per model,
    ``tp``, sequence length, dtype and sequence parallelism.

    A plain model (any device, meta included) is cut down to one block per class, copied to meta in ``dtype``,
    and, for ``tp > 1``, given the Megatron preset on a simulated schedule of ``tp`` ranks. A schedule is
    profiled as it is (its own shards; ``tp`` must be its ``world_size``; its parameters keep their dtype).

    Args:
        model_or_schedule: an ``nn.Module`` or a :class:`slapo_lab.Schedule`.
        tp: tensor-parallel degree.
        seq_len: tokens per sequence.
        dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"`` (parameters and activations).
        sequence_parallel: apply the preset with sequence parallelism.

    Returns:
        ModelProfile (per-sequence figures).

    Raises:
        ScheduleError: no repeated blocks, a preset that refuses this ``tp``, or a forward that fails (one
            sentence naming the model or module).
    """

    sch = model_or_schedule if isinstance(model_or_schedule, Schedule) else None
    model = sch.mod if sch is not None else model_or_schedule
    if not isinstance(model, nn.Module):
        raise ScheduleError(f"profile: expected a torch.nn.Module or a Schedule, not {type(model).__name__}.")
    if dtype not in _DTYPES:
        raise ScheduleError(f"profile: dtype must be one of {', '.join(_DTYPES)}, not {dtype!r}.")
    if sch is not None and sch.world_size != tp:
        raise ScheduleError(
            f"profile: the schedule is for {sch.world_size} tensor-parallel ranks, not tp={tp}; "
            "price a plain model to search other degrees."
        )
    key = (tp, seq_len, dtype, sequence_parallel, len(sch.record) if sch is not None else -1)
    with _LOCK:
        hit = _CACHE.setdefault(model, {}).get(key)
    if hit is not None:
        return hit
    prof = _profile(model, sch, tp, seq_len, dtype, sequence_parallel)
    with _LOCK:
        _CACHE[model][key] = prof
    return prof


def _profile(model, sch, tp, seq_len, dtype, sp) -> ModelProfile:

    t0 = time.perf_counter()
    base = sch if sch is not None else create_schedule(model)
    stacks = _block_stacks(base)
    if not stacks:
        raise ScheduleError(
            f"profile: {type(model).__name__} has no repeated blocks (an nn.ModuleList of one block class)."
        )
    notes: list = []
    if sch is None:
        with _cut_down(model, stacks):
            small = copy.deepcopy(model) if _all_meta(model) else meta_copy(model)
        small = small.to(_DTYPES[dtype])
        small_stacks = [(p, list(range(len(k))), c) for p, k, c in stacks]
        heads = kv = None
        if tp > 1:
            s_tp = create_schedule(small, world_size=tp)
            try:
                calls = presets.megatron_tp(
                    s_tp,
                    check=False,
                    sequence_parallel=sp,
                    vocab_parallel=presets.has_vocab_embedding(s_tp),
                )
            except ScheduleError as err:
                raise ScheduleError(f"TP {tp}: {err}") from err
            notes = list(getattr(calls, "notes", []) or [])
            heads, kv = _heads(s_tp, small_stacks)  # the preset's dataflow pass, cached: no new forward
        run_model, run_stacks = small, small_stacks
        ctx = contextlib.nullcontext()
    else:
        heads, kv = _heads(sch, stacks) if tp > 1 else (None, None)
        # the cut-down list holds the kept blocks as 0, 1, ...
        run_model, run_stacks = model, [(p, list(range(len(k))), c) for p, k, c in stacks]
        ctx = _cut_down(model, stacks)
    with ctx:
        parts = _measure(run_model, run_stacks, seq_len)
    pre, post = parts.pop("pre"), parts.pop("post")
    blocks = []
    for parent, kept, counts in run_stacks:
        for i, count in zip(kept, counts, strict=False):
            p = parts[f"{parent}.{i}" if parent else str(i)]
            p.count = count
            blocks.append(p)
    return ModelProfile(
        tp=tp,
        seq_len=seq_len,
        dtype=dtype,
        sequence_parallel=sp,
        pre=pre,
        post=post,
        blocks=blocks,
        heads=heads,
        kv_heads=kv,
        notes=notes,
        seconds=time.perf_counter() - t0,
    )


def _all_meta(model: nn.Module) -> bool:
    return all(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


def _heads(sch, stacks) -> tuple[int | None, int | None]:
    """(heads, key/value heads) of the first block's attention, read from its dataflow
    (:func:`slapo_lab.sharding.infer.block_split`); (None, None) when none was found."""

    parent, kept, _ = stacks[0]
    path = f"{parent}.{kept[0]}" if parent else str(kept[0])
    try:
        split = infer.block_split(sch, path)
    except Exception:  # noqa: BLE001 - the dataflow could not be recorded: the preset says what it refuses
        return None, None
    if split is None or not split.attention:
        return None, None
    heads, kv = next(iter(split.attention.values()))
    return heads, kv


class _Pass:
    """One forward + backward of a cut-down model on fake tensors, recording per part (block path, "pre",
    "post"): each aten op (:class:`_Recorder`), what autograd saves, each block's inputs and outputs, and the
    schedule's syncs with their volumes."""

    def __init__(self, model: nn.Module, block_paths: list[str]):
        self.model = model
        mods = dict(model.named_modules())
        self.blocks = {id(mods[p]): p for p in block_paths}
        self.tracker = ModuleTracker()
        root = type(model).__name__  # ModuleTracker's names: "<RootClass>.<path>"
        self.fqn_of_block = {f"{root}.{p}": p for p in block_paths}
        self.seen = {"fwd": False, "bwd": False}
        self.weights: set[int] = set()
        self.rec = _Recorder(self.part_of, self.weights)
        self.saved: dict[int, tuple[str, int]] = {}  # storage -> (part that saved it first, bytes)
        self.keep: list = []
        self.io: dict[str, dict] = {}
        self.comm: list[tuple[str, str, str, int]] = []  # (part, op, phase, bytes)
        self.output_bytes = 0

    def part_of(self) -> tuple[str, str]:
        """The running (part, phase): the innermost block on the module stack, else "pre" before the first block
        ran ("post" after it; the other way round in backward)."""
        phase = "bwd" if self.tracker.is_bw else "fwd"
        for fqn in self.tracker.parents:
            p = self.fqn_of_block.get(fqn)
            if p is not None:
                self.seen[phase] = True
                return p, phase
        if phase == "fwd":
            return ("post" if self.seen["fwd"] else "pre"), phase
        return ("pre" if self.seen["bwd"] else "post"), phase

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """``saved_tensors_hooks``' pack: note each saved storage once, with the part that saved it."""
        k = _key(t)
        if k in self.weights:
            return t
        nbytes = t.untyped_storage().nbytes()
        if k not in self.saved:
            self.saved[k] = (self.part_of()[0], nbytes)
            self.keep.append(t)
        elif nbytes > self.saved[k][1]:
            self.saved[k] = (self.saved[k][0], nbytes)
        return t

    def _block_pre(self, mod, args, kwargs) -> None:
        self.io.setdefault(self.blocks[id(mod)], {})["in"] = list(_tensors((args, kwargs)))

    def _block_post(self, mod, args, kwargs, out) -> None:
        self.io.setdefault(self.blocks[id(mod)], {})["out"] = list(_tensors(out))

    def _sync_hook(self, syncs: list[tuple[str, str]]):
        def hook(mod, args, kwargs, out):
            part = self.part_of()[0]
            nin = sum(t.numel() * t.element_size() for t in _tensors((args, kwargs)) if t.is_floating_point())
            nout = sum(t.numel() * t.element_size() for t in _tensors(out) if t.is_floating_point())
            where = {"fwd_post": ("fwd", nout), "fwd_pre": ("fwd", nin), "bwd_post": ("bwd", nin)}
            for mode, op in syncs:
                if mode in where:
                    self.comm.append((part, op, *where[mode]))

        return hook

    def hooks(self) -> list:
        """Install the block and sync hooks; returns their handles."""
        handles = []
        for mod in self.model.modules():
            if id(mod) in self.blocks:
                handles.append(mod.register_forward_pre_hook(self._block_pre, with_kwargs=True))
                handles.append(mod.register_forward_hook(self._block_post, with_kwargs=True))
            meta = peek_meta(mod)
            if meta and meta.syncs:
                syncs = [
                    (s[0], s[1] if isinstance(s[1], str) else getattr(s[1], "__name__", "custom"))
                    for s in meta.syncs
                ]
                handles.append(mod.register_forward_hook(self._sync_hook(syncs), with_kwargs=True))
        return handles

    def run(self, inputs: dict) -> None:
        """The forward + backward, on fake tensors: HF models read tensor values (packed-sequence checks) that
        fake tensors answer."""
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        # the parameters as fake tensors, passed in by functional_call: autograd's saved weights and the ops'
        # weight operands are then these tensors, whose storages ``weights`` holds
        state_dict = dict(self.model.named_parameters())
        state_dict.update(self.model.named_buffers())
        fake_state = {name: mode.from_tensor(t) for name, t in state_dict.items()}
        self.weights.clear()
        self.weights.update(_key(t) for t in fake_state.values())
        self.rec.param_shapes = {tuple(t.shape) for t in fake_state.values() if t.dim() >= 2}
        with mode, self.tracker, self.rec, FlashSDPA():
            with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
                out = torch.func.functional_call(self.model, fake_state, (), dict(inputs))
            loss = _loss(out)
            # the model's outputs but the scalar loss (a causal LM's logits): what a pipeline's last stage returns
            self.output_bytes = sum(t.numel() * t.element_size() for t in _tensors(out) if t.dim() > 0)
            loss.backward()


def _measure(model: nn.Module, stacks, seq_len: int) -> dict[str, PartProfile]:
    """One forward + backward of the cut-down ``model``; a :class:`PartProfile` per block path, "pre", "post".

    Raises:
        ScheduleError: the pass failed (one sentence naming the model and the error).
    """
    block_paths = [f"{p}.{i}" if p else str(i) for p, kept, _ in stacks for i in kept]
    ps = _Pass(model, block_paths)
    handles = ps.hooks()
    inputs = _example_inputs(model, seq_len)
    modes = [(m, m.training) for m in model.modules()]
    model.train()
    try:
        ps.run(inputs)
    except ScheduleError:
        raise
    except Exception as err:
        msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ScheduleError(
            f"profile: the meta forward/backward of {type(model).__name__} failed ({type(err).__name__}: {msg})."
        ) from err
    finally:
        for h in handles:
            h.remove()
        for m, mode in modes:
            m.training = mode
        for p in model.parameters():
            p.grad = None
    return _collect(model, block_paths, ps)


def _loss(out) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    t = next(_tensors(out))
    return t.float().sum()


def _collect(model: nn.Module, block_paths: list[str], ps: _Pass) -> dict[str, PartProfile]:
    """The :class:`PartProfile` of each part ("pre", "post", each block path) from a finished :class:`_Pass`."""
    mods = dict(model.named_modules())
    parts = {name: PartProfile(name) for name in ("pre", "post")}
    parts.update({p: PartProfile(type(mods[p]).__name__) for p in block_paths})
    _collect_params(model, mods, block_paths, parts)
    kept_out = _collect_ops(parts, ps.rec.rows)
    _collect_saved(parts, block_paths, ps.saved, ps.io, ps.rec.created)
    _collect_io(parts, block_paths, ps.io, kept_out)
    for part, op, phase, nbytes in ps.comm:
        parts[part].comm.append((op, phase, nbytes))
    for (part, phase), n in ps.rec.ops.items():
        if phase == "fwd":
            parts[part].fwd_ops += n
        else:
            parts[part].bwd_ops += n
    parts["post"].output_bytes = ps.output_bytes
    return parts


def _collect_params(
    model: nn.Module, mods: dict, block_paths: list[str], parts: dict[str, PartProfile]
) -> None:
    """Each parameter once, in the part whose module owns it first: blocks own theirs; the rest go to "pre" or
    "post" by whether their module comes before the first block."""
    owned: set[int] = set()
    for p in block_paths:
        for t in mods[p].parameters():
            owned.add(id(t))
            _add_param(parts[p], t)
    first_block = mods[block_paths[0]]
    before = set()
    for m in model.modules():
        if m is first_block:
            break
        before.add(id(m))
    for m in model.modules():
        for t in m.parameters(recurse=False):
            if id(t) not in owned:
                owned.add(id(t))
                _add_param(parts["pre" if id(m) in before else "post"], t)


def _collect_ops(parts: dict[str, PartProfile], rows: list[tuple]) -> dict[str, dict[int, int]]:
    """The op rows of each part and phase (``fwd``, ``bwd``, the recomputed ones) and the model FLOPs; returns
    the outputs selective checkpointing keeps, per part (storage -> bytes)."""
    by: dict[tuple[str, str], list] = {}
    kept_out: dict[str, dict[int, int]] = {}
    for part, phase, flops, act, wgt, kept, (out_act, out_wgt), mflops, outs, attention in rows:
        by.setdefault((part, phase), []).append((flops, act, wgt, attention, out_act, out_wgt, kept))
        prof = parts[part]
        if phase == "fwd":
            prof.fwd_flops += mflops
        else:
            prof.bwd_flops += mflops
        if kept:
            for t in outs:
                kept_out.setdefault(part, {})[_key(t)] = t.untyped_storage().nbytes()
    for name, prof in parts.items():
        fwd = by.get((name, "fwd"), [])
        prof.fwd = np.array([r[:_COLS] for r in fwd], dtype=float).reshape(-1, _COLS)
        prof.bwd = np.array([r[:_COLS] for r in by.get((name, "bwd"), [])], dtype=float).reshape(-1, _COLS)
        prof.recompute_all = prof.fwd
        prof.recompute_selective = np.array([r[:_COLS] for r in fwd if not r[_COLS]], dtype=float).reshape(
            -1, _COLS
        )
    return kept_out


def _collect_saved(
    parts: dict[str, PartProfile], block_paths: list[str], saved: dict, io: dict, created: dict
) -> None:
    """What autograd saved, per part. A tensor every block is given (rotary cos/sin, masks) is made once, outside
    the blocks: a block that saves it shares it with the others, so it counts once, in the part that made it; a
    block's residual input (the previous block's output) is its own."""
    residual = {
        p: {
            _key(t)
            for t in io.get(p, {}).get("in", [])
            if io.get(p, {}).get("out") and t.shape == io[p]["out"][0].shape
        }
        for p in block_paths
    }
    for key, (part, nbytes) in saved.items():
        maker = created.get(key)
        if part in residual and maker is not None and maker != part and key not in residual[part]:
            part = maker
        parts[part].saved_bytes += nbytes


def _collect_io(parts: dict[str, PartProfile], block_paths: list[str], io: dict, kept_out: dict) -> None:
    """Each block's output and residual input bytes, what selective checkpointing keeps of it, and what "pre"
    hands the first block."""
    for p in block_paths:
        prof = parts[p]
        outs = io.get(p, {}).get("out", [])
        ins = io.get(p, {}).get("in", [])
        shape = outs[0].shape if outs else None
        prof.output_bytes = outs[0].numel() * outs[0].element_size() if outs else 0
        prof.input_bytes = sum(
            t.numel() * t.element_size() for t in ins if t.is_floating_point() and t.shape == shape
        )
        prof.selective_bytes = prof.input_bytes + sum(kept_out.get(p, {}).values())
    pre_out = io.get(block_paths[0], {}).get("in", [])
    parts["pre"].output_bytes = max((t.numel() * t.element_size() for t in pre_out), default=0)


def _add_param(prof: PartProfile, t: torch.Tensor) -> None:
    prof.param_elems += t.numel()
    prof.param_bytes += t.numel() * t.element_size()
    if t.requires_grad:
        prof.param_sizes += (t.numel(),)


def describe(prof: ModelProfile) -> str:
    """A few lines: per part, parameters, FLOPs and saved bytes per sequence."""

    lines = [f"profile at tp {prof.tp}, seq {prof.seq_len}, {prof.dtype} ({prof.seconds:.2f} s):"]
    for p in prof.parts:
        lines.append(
            f"  {p.name} x{p.count}: params {p.param_elems / 1e6:.1f} M, fwd {p.fwd_flops / 1e9:.1f} GFLOP, "
            f"bwd {p.bwd_flops / 1e9:.1f} GFLOP, saved {human_bytes(p.saved_bytes)}, "
            f"selective {human_bytes(p.selective_bytes)}, comm {len(p.comm)}"
        )
    return "\n".join(lines)
