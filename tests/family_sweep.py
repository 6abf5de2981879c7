"""The family sweep (issue 23): the Megatron preset at TP 2 and the numeric check on every transformers family.

For every family (``model_type``) of transformers' ``MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES``,
``MODEL_FOR_MASKED_LM_MAPPING_NAMES``, ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` and
``MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES`` (``transformers.models.auto.modeling_auto``; a family in several
mappings is swept once, with the class of the first mapping in that order, so an encoder-decoder keeps both
stacks and an encoder is its masked LM):

1. **Build tiny** from its config class (``AutoConfig.for_model(model_type)`` defaults, then
   :func:`tiny_config`: 2 layers per stack, 4 heads of 16 features (2 key/value heads where the family groups
   them, 1 where it has one), hidden 64, intermediate 128, 4 experts of which 2 per token, a vocabulary of at
   most 256 with every special token id kept inside it, images of 32 pixels (a vision or audio tower's other sizes
   made to fit: :func:`_tower_sizes`), like
   ``slapo_lab.numeric._shrink_config``); real weights on CPU, seeded. A family that cannot (a package that is
   not installed, a custom kernel, a config the shrinker breaks, an unscheduled forward that fails on the
   example inputs) is ``"does not build: <reason>"`` and not counted.
2. **Example inputs** from the forward's signature and the config (:func:`example_inputs`): ``input_ids``
   (2 x 16), ``decoder_input_ids`` (2 x 8) for an encoder-decoder, ``pixel_values`` (2 x C x 32 x 32) for an
   image model, ``input_features`` for a speech encoder, ``use_cache=False``; inputs that switch on projections
   the model has: a second sequence with its own vocabulary and positions (LUKE's entities,
   :func:`_second_sequence`) and Longformer's / LED's ``global_attention_mask`` (the first token global); then,
   for a model with a vision or audio tower beside its text, the tower's inputs and placeholder tokens that make
   the tower's output reach the model's output (``slapo_lab.multimodal_inputs.multimodal_inputs``, found by
   running the model), so the check judges the tower's split too; where none does, an all-zero weight matrix of
   the untrained model (a zero-initialized projection that hides the tower) is drawn like the others and the
   inputs looked for again (:func:`_draw_zero_matrices`).
3. **The preset as the editor applies it** (``slapo_lab/editor/state.py``): ``sl.create_schedule`` on a meta
   copy at world size 2 with the example inputs and the unscheduled model remembered
   (``set_example_inputs``, ``preset_check.set_reference``), then
   ``presets.megatron_tp(sch, vocab_parallel=presets.has_vocab_embedding(sch))``.
4. **The numeric check** (``slapo_lab.numeric.numeric_check``) of the recorded calls against the unscheduled
   model on 2 simulated ranks.

Classes (:class:`Result`.status):

* ``"full"``: the check passed and every projection of every block stack is sharded. **A projection** is,
  structurally, every ``nn.Linear`` / HF ``Conv1D`` inside a block of a stack :func:`slapo_lab.presets.find_blocks`
  finds, plus every expert bank (a module holding 3-D weights, at least 2 on the first axis, that is not a
  convolution), **except routers**:
  a linear, anywhere under a module that has an expert bank as a direct child, whose ``out_features`` is at most
  that bank's number of experts (a 3-D bank's first axis, or a ``ModuleList`` / ``ModuleDict`` of at least 2
  same-class modules each holding a linear): one logit per expert, or a shared expert's single gate
  (:func:`projections`; the tiny models have 4 experts and projections at least 16 wide, so nothing else
  matches). Two more exclusions are measured on one forward of the real tiny model with hooks and a
  ``TorchFunctionMode`` (:func:`structural_exclusions`, independent of ``slapo_lab``'s split inference, so the
  preset does not grade itself), as the issue names them: **a low-rank "a" projection** (MLA's ``a -> norm ->
  b`` chain, where b is split and a stays whole): a linear with fewer out- than in-features whose output (or a
  view of its storage) is the input of a norm module whose output feeds another linear of the same block, or
  whose output itself is the input of another linear of the block that widens it again (a low-rank gate); and
  **a token router** (a sparse-attention indexer such as DeepSeek-V3.2's): a linear whose output reaches
  ``topk`` and reaches no block's output except through ``topk``'s results. Layers outside the blocks
  (embeddings, pooler, heads) are not counted.
  A family whose sharded modules include some that never ran on the sweep's inputs (a vision or audio tower of
  a model given ``input_ids`` only: :attr:`slapo_lab.numeric.NumericReport.unjudged`) is not full: the check
  did not judge their split.
* ``"partial"``: the check passed; what is kept whole (per block, relative path) and the preset's notes, or
  which sharded modules the check did not judge (``not judged: ...``).
* ``"refused"``: ``megatron_tp`` raised ``ScheduleError`` (its sentence).
* ``"failed"`` (✗): the check failed or errored (its message), or it could not judge (skipped).
* ``"crash"``: any other exception (type and first line), a family over its timeout, a worker that died.
* ``"no_build"``: see 1.

Each family runs in one of at most 2 worker processes (``spawn``), each with a per-family timeout: a hang or
a hard crash of a family kills only its worker, which is started again. Run ``python -m tests.family_sweep``
(``--only a,b``, ``--workers``, ``--timeout``) for the table; it is also written to
``artifacts/family_sweep.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import multiprocessing as mp
import os
import re
import sys
import time
import traceback
import warnings
from multiprocessing.connection import wait
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAPPINGS = (
    ("seq2seq", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    ("masked", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    ("causal", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    ("image", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
)
STATUSES = ("full", "partial", "refused", "failed", "crash", "no_build")
#: Test-only family names: a family whose worker hangs, and one whose worker dies (exit code 3).
HANG, DIE = "__hang__", "__die__"
#: Seconds a new worker may take to import torch, transformers and slapo_lab (a loaded machine is slow).
STARTUP_TIMEOUT = 300.0
#: Parameters a tiny model may keep after shrinking (more means the shrinker missed a width).
MAX_TINY_PARAMS = 12_000_000
WORLD_SIZE = 2
#: ``SLAPO_SWEEP_SP=1``: the preset with sequence parallelism (``benchmarks/sp_sweep.py``).
SEQUENCE_PARALLEL = os.environ.get("SLAPO_SWEEP_SP") == "1"
#: Seconds the numeric check's ranks may run (its own default, 60 s, is short on a loaded 2-core machine).
CHECK_TIMEOUT = 100.0
BATCH, SEQ, DEC_SEQ, IMAGE = 2, 16, 8, 32
#: Items of a second input sequence with its own vocabulary (LUKE's entities, :func:`_second_sequence`).
ENTITIES = 4
SMALL = {"layers": 2, "heads": 4, "head_dim": 16, "hidden": 64, "inter": 128, "experts": 4, "vocab": 256}
TABLE_PATHS = (ROOT / "artifacts" / "family_sweep.md",)  # artifacts/ is git-ignored


@dataclasses.dataclass
class Result:
    family: str
    task: str = ""
    model_cls: str = ""
    status: str = "crash"
    detail: str = ""
    seconds: float = 0.0
    n_params: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class DoesNotBuild(Exception):
    """The family cannot be built tiny on CPU (the sentence says why)."""


# ------------------------------------------------------------------------------------------------ families
def families() -> dict[str, tuple[str, str]]:
    """``{model_type: (task, model class name)}`` over the four mappings (first mapping wins, see the module
    docstring); a mapping entry with several classes takes the first."""
    from transformers.models.auto import modeling_auto

    out: dict[str, tuple[str, str]] = {}
    for task, name in MAPPINGS:
        for mt, cls in getattr(modeling_auto, name).items():
            if mt not in out:
                out[mt] = (task, cls[0] if isinstance(cls, (tuple, list)) else cls)
    return dict(sorted(out.items()))


# ------------------------------------------------------------------------------------------------ tiny config
_LAYERS = re.compile(
    r"(num_)?(hidden_|encoder_|decoder_|text_|vision_|)?(layers|layer)|n_layers?|num_blocks|n_layer|"
    r"(encoder|decoder)_layers|num_(encoder|decoder)_layers|num_hidden_groups_layers"
)
_HEADS = re.compile(
    r"(num_|n_)?(attention_|encoder_attention_|decoder_attention_|)?heads?|\w*attention_heads|"
    r"linear_num_(key_|value_)?heads"
)
_KV_HEADS = re.compile(r"\w*(key_value_heads|kv_heads)|multi_query_group_num|num_query_groups")
_HIDDEN = {
    "hidden_size",
    "n_embd",
    "n_embed",
    "d_model",
    "embed_dim",
    "dim",
    "model_dim",
    "d_embed",
    "word_embed_proj_dim",
    "embedding_size",
    "embedding_dim",
    "emb_dim",
    "hidden_dim",
    "encoder_hidden_size",
}
_HEAD_DIM = {
    "head_dim",
    "d_kv",
    "kv_channels",
    "attention_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "d_head",
    "attention_head_size",
    "head_size",
    "qk_head_dim",
    "global_head_dim",
    "linear_head_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
}
_HALF_HEAD_DIM = {"qk_rope_head_dim", "rotary_dim", "rotary_emb_dim"}
_INTER = re.compile(
    r"\w*intermediate_size|\w*ffn_dim|d_ff|n_inner|ffn_hidden_size|mlp_dim|ffn_size|dim_feedforward|"
    r"mlp_hidden_size|d_inner|\w*expert_hidden_size|moe_intermediate_size\w*"
)
_RANK = re.compile(r"\w*lora_rank|\w*_rank")
_EXPERTS = re.compile(r"num_experts|num_local_experts|n_routed_experts|moe_num_experts|num_routed_experts")
_TOPK = re.compile(
    r"num_experts_per_tok|moe_topk|moe_top_k|top_k|num_selected_experts|moe_k|num_experts_per_token"
)
_ONE = re.compile(
    r"n_shared_experts|num_shared_experts|n_group|topk_group|first_k_dense_replace|num_dense_layers"
)
_POSITIONS = re.compile(
    r"max_position_embeddings|n_positions|n_ctx|max_seq_len|max_sequence_length|max_(source|target)_positions|"
    r"seq_length|max_length"
)
_SSM = re.compile(r"(mamba_|ssm_)?(d_state|state_size|chunk_size)|mamba_chunk_size|ssm_state_size")
_WIDTH_LISTS = re.compile(
    r"hidden_sizes|embed_dims|dims|embed_dim|widths|channels|hidden_sizes_list|embedding_sizes"
)


def _diverse(seq: list, n: int) -> list:
    """The first ``n`` items of a per-layer list, taking the first item that differs from the first one
    second (so a sliding / full pattern keeps both kinds)."""
    if len(seq) <= n:
        return list(seq)
    first = seq[0]
    other = next((x for x in seq if x != first), None)
    out = [first] + ([other] if other is not None else [])
    out += [x for x in seq[1:] if len(out) < n and x is not other][: max(0, n - len(out))]
    return out[:n]


def _shrink(d: dict, vocab_ids: set) -> dict:
    """``d`` (a config's ``to_dict()``) with small sizes; nested sub-config dicts are shrunk too."""
    out = dict(d)
    # head-dim keys that were equal stay equal (DeepSeek's head_dim is its qk_rope_head_dim)
    dims: dict[int, int] = {
        v: SMALL["head_dim"] // 2
        for k, v in d.items()
        if k in _HALF_HEAD_DIM and isinstance(v, int) and v > 0
    }
    heads = next((v for k, v in d.items() if isinstance(v, int) and _HEADS.fullmatch(k) and v > 0), None)
    layers = next(
        (v for k, v in d.items() if isinstance(v, int) and not isinstance(v, bool) and _LAYERS.fullmatch(k)),
        None,
    )
    for k, v in d.items():
        if isinstance(v, dict) and (
            k.endswith("_config") or "model_type" in v or k in ("encoder", "decoder")
        ):
            out[k] = _shrink(v, vocab_ids)
            continue
        if (
            v is None
        ):  # a size the class needs but the defaults leave open (ESM's vocabulary, Dots1's experts)
            if k == "vocab_size":
                out[k] = SMALL["vocab"]
            elif _EXPERTS.fullmatch(k):
                out[k] = SMALL["experts"]
            elif _TOPK.fullmatch(k):
                out[k] = 2
            elif _ONE.fullmatch(k):
                out[k] = 1
            continue
        if isinstance(v, bool):
            continue
        if isinstance(v, dict) and v and all(str(x).isdigit() for x in v):  # per-layer settings by index
            out[k] = {x: y for x, y in v.items() if int(x) < SMALL["layers"]}
        elif isinstance(v, int):
            if "vocab_size" in k and v > SMALL["vocab"] and "type" not in k:
                out[k] = SMALL["vocab"]
            elif _LAYERS.fullmatch(k) and v > SMALL["layers"]:
                out[k] = SMALL["layers"]
            elif _KV_HEADS.fullmatch(k):
                out[k] = SMALL["heads"] if heads and v == heads else (1 if v == 1 else 2)
            elif _HEADS.fullmatch(k) and v > 0:
                out[k] = SMALL["heads"]
            elif k in _HEAD_DIM and v > 0:
                out[k] = dims.setdefault(v, SMALL["head_dim"])
            elif k in _HALF_HEAD_DIM and v > 0:
                out[k] = dims.setdefault(v, SMALL["head_dim"] // 2)
            elif k in _HIDDEN and v > SMALL["hidden"]:
                out[k] = SMALL["hidden"]
            elif _INTER.fullmatch(k) and v > SMALL["inter"]:
                out[k] = SMALL["inter"]
            elif _RANK.fullmatch(k) and v > 32:
                out[k] = 32
            elif _EXPERTS.fullmatch(k) and v > SMALL["experts"]:
                out[k] = SMALL["experts"]
            elif _TOPK.fullmatch(k) and v > 2:
                out[k] = 2
            elif _ONE.fullmatch(k) and v > 1:
                out[k] = 1
            elif _POSITIONS.fullmatch(k) and v > 128:
                out[k] = 128
            elif k == "image_size" and v > IMAGE:
                out[k] = IMAGE
            elif k == "sliding_window" and v > 8:
                out[k] = 8
            elif k in ("n_groups", "mamba_n_groups") and v > 2:  # groups of the state-space heads
                out[k] = 2
            elif _SSM.fullmatch(k) and v > 16:  # state-space layers: state size and scan chunk (padded to it)
                out[k] = 16
        elif isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            if k == "image_size":
                out[k] = [IMAGE for _ in v]
            elif _LAYERS.fullmatch(k) or k in ("depths", "num_layers_per_stage"):
                out[k] = [min(x, SMALL["layers"]) for x in v]
            elif _HEADS.fullmatch(k) or k in ("num_heads", "num_attention_heads"):
                out[k] = [SMALL["heads"] for _ in v]
            elif _WIDTH_LISTS.fullmatch(k) and max(v) > 64:
                f = max(1, v[0] // 16)
                out[k] = [max(8, (x // f) // 8 * 8) for x in v]
            elif k == "mrope_section":
                out[k] = _mrope(v, SMALL["head_dim"] // 2)
            elif layers and len(v) == layers and k.endswith(("layers", "layer_types")):
                out[k] = [x for x in v if x < SMALL["layers"]] if k.endswith("layers") else _diverse(v, 2)
            elif layers and len(v) == layers and len(v) > SMALL["layers"]:  # one value per layer
                one = _shrink({**d, k: v[0]}, vocab_ids)[k]
                out[k] = [one if x == v[0] else _shrink({**d, k: x}, vocab_ids)[k] for x in _diverse(v, 2)]
        elif isinstance(v, list) and layers and len(v) == layers and len(v) > SMALL["layers"]:
            out[k] = _diverse(v, SMALL["layers"])
    return out


def _mrope(sections: list[int], total: int) -> list[int]:
    s = sum(sections)
    out = [max(1, x * total // s) for x in sections]
    out[0] += total - sum(out)
    return out


def _fix_token_ids(d: dict, vocab: int) -> None:
    """Every special token id at or above the (shrunk) vocabulary moved inside it, distinct ones kept distinct."""
    top = vocab - 1
    seen: dict[int, int] = {}
    for k, v in list(d.items()):
        if isinstance(v, dict) and (k.endswith("_config") or "model_type" in v):
            _fix_token_ids(v, v.get("vocab_size") or vocab)
            continue
        if not k.endswith(("_token_id", "_token_index", "_id", "token_ids")):
            continue
        if isinstance(v, int) and not isinstance(v, bool) and v >= vocab:
            if v not in seen:
                seen[v] = top - len(seen)
            d[k] = seen[v]
        elif isinstance(v, list) and all(isinstance(x, int) for x in v):
            d[k] = [seen.setdefault(x, top - len(seen)) if x >= vocab else x for x in v]


def _changed(old: dict, new: dict) -> dict:
    """The entries of ``new`` that differ from ``old``; a nested sub-config dict is passed whole (its class
    is rebuilt from it) when any of its entries changed."""
    out = {}
    for k, v in new.items():
        o = old.get(k)
        if o == v:
            continue
        out[k] = _changed(o, v) if isinstance(o, dict) and isinstance(v, dict) and "model_type" in v else v
    return out


def _cause(err: BaseException) -> str:
    """The first line of ``err``, with its cause's first line when it wraps one (a config validator's)."""
    text = _first_line(err)
    cause = err.__cause__
    return f"{text} {_first_line(cause)}" if cause is not None else text


def _tower_sizes(small: dict) -> None:
    """Sizes of a vision or audio tower that must fit the shrunk config, so the tower runs on the sweep's
    inputs (``slapo_lab.multimodal_inputs``): a pixel-shuffle factor (``scale_factor``,
    ``pixel_shuffle_factor``) divides the patches per side of the image (the image grows to
    ``patch_size * factor``); an image's token count (``mm_tokens_per_image``, Gemma 3's pooled patches) is at
    most its patches (more leave the pooling a kernel of 0); an audio tower's frames are few
    (``max_source_positions`` 16: 32 frames); a tower's ``output_dim`` (the width it hands to
    the text model, Qwen3-ASR) is the text config's ``hidden_size``."""
    for v in small.values():
        if isinstance(v, dict):
            _tower_sizes(v)  # T5Gemma 2's encoder holds both
    vision = next(
        (v for v in small.values() if isinstance(v, dict) and {"image_size", "patch_size"} <= v.keys()), None
    )
    for v in small.values():  # an audio tower's frames: few enough that its rows of features (placeholder
        # tokens) and its frame mask stay inside the numeric check's MAX_SEQ positions
        mels = isinstance(v, dict) and "num_mel_bins" in v
        if mels and isinstance(v.get("max_source_positions"), int) and v["max_source_positions"] > 16:
            v["max_source_positions"] = 16
    text = small.get("text_config")
    if isinstance(text, dict) and isinstance(text.get("hidden_size"), int):
        for k, v in small.items():
            if k != "text_config" and isinstance(v, dict) and isinstance(v.get("output_dim"), int):
                v["output_dim"] = text["hidden_size"]
    if vision is None or not all(isinstance(vision[k], int) for k in ("image_size", "patch_size")):
        return
    side = vision["image_size"] // vision["patch_size"]
    factor = next(
        (v for k, v in small.items() if k in ("scale_factor", "pixel_shuffle_factor") and isinstance(v, int)),
        1,
    )
    if factor > 1 and side % factor:
        side = math.lcm(side, factor)
        vision["image_size"] = side * vision["patch_size"]
    for k, v in small.items():
        if k.endswith("tokens_per_image") and "audio" not in k and isinstance(v, int) and v > side**2:
            small[k] = side**2


def tiny_config(model_type: str):
    """The config class of ``model_type`` with small sizes (see the module docstring).

    Raises:
        DoesNotBuild: the config class itself cannot be made (unknown type, an import that fails).
    """
    from transformers import AutoConfig

    try:
        base = AutoConfig.for_model(model_type)
    except Exception as err:  # noqa: BLE001 - any failure is the reason it does not build
        raise DoesNotBuild(f"config: {type(err).__name__}: {_first_line(err)}") from None
    d = base.to_dict()
    small = _shrink(d, set())
    _fix_token_ids(small, small.get("vocab_size") or SMALL["vocab"])
    depths, patch = small.get("depths"), small.get("patch_size")
    if isinstance(small.get("window_size"), int) and isinstance(depths, list) and isinstance(patch, int):
        # windowed attention (Swin): a window of 2 patches, and the last stage still holds a whole window
        small["window_size"] = 2
        small["image_size"] = patch * 2 ** (len(depths) - 1) * 2
    if isinstance(depths, list) and len(depths) > 2:  # stages that double the width: start narrower
        for k in ("embed_dim", "hidden_size"):
            if isinstance(small.get(k), int) and small[k] > 32 and k in d and not isinstance(d[k], list):
                small[k] = 32
    _tower_sizes(small)
    h, e, n = small.get("hidden_size"), small.get("expand"), small.get("num_heads")
    if all(
        isinstance(x, int) for x in (h, e, n, small.get("head_dim"))
    ):  # Mamba-2: heads x head_dim = expand x hidden
        small["head_dim"] = h * e // n
    changed = _changed(d, small)
    try:  # only the changed values, as keyword arguments: the class derives the rest (head_dim, layer_types ...)
        cfg = AutoConfig.for_model(model_type, **changed)
    except Exception as err:  # noqa: BLE001
        raise DoesNotBuild(f"config with small sizes: {type(err).__name__}: {_cause(err)}") from None
    for attn in ("_attn_implementation", "attn_implementation"):
        with contextlib.suppress(Exception):  # older config classes without the setter
            setattr(cfg, attn, "eager")
    return cfg


# ------------------------------------------------------------------------------------------------ inputs
def _sub(cfg, *names):
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return None


def _vocab(cfg) -> int | None:
    v = _sub(cfg, "vocab_size")
    if v is None:
        text = _sub(cfg, "text_config", "decoder")
        v = getattr(text, "vocab_size", None) if text is not None else None
    return v


def _special_ids(cfg) -> set[int]:
    out = set()
    for c in (cfg, getattr(cfg, "text_config", None)):
        if c is None:
            continue
        for k, v in vars(c).items():
            if k.endswith(("_token_id", "_token_index")) and isinstance(v, int):
                out.add(v)
    return out


def example_inputs(model, seed: int = 0) -> dict:
    """Keyword inputs for one forward of ``model``, from its forward's signature and its config (see the
    module docstring).

    Raises:
        DoesNotBuild: the forward takes none of the inputs this sweep knows how to make.
    """
    import inspect

    import torch

    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    params = inspect.signature(model.forward).parameters
    out: dict = {}
    vocab = _vocab(cfg)
    specials = _special_ids(cfg)
    if "input_ids" in params and vocab:
        allowed = torch.tensor([i for i in range(min(vocab, 1000)) if i not in specials])
        out["input_ids"] = allowed[torch.randint(0, len(allowed), (BATCH, SEQ), generator=g)]
        if getattr(cfg, "is_encoder_decoder", False) and "decoder_input_ids" in params:
            out["decoder_input_ids"] = allowed[torch.randint(0, len(allowed), (BATCH, DEC_SEQ), generator=g)]
    elif "pixel_values" in params:
        vc = _sub(cfg, "vision_config") or cfg
        size = getattr(vc, "image_size", IMAGE)
        size = size[0] if isinstance(size, (list, tuple)) else size
        chans = getattr(vc, "num_channels", 3)
        out["pixel_values"] = torch.randn(BATCH, chans, size, size, generator=g)
    elif "input_features" in params:
        mel = _sub(cfg, "num_mel_bins")
        if mel is not None and _sub(cfg, "max_source_positions"):
            out["input_features"] = torch.randn(BATCH, mel, 2 * cfg.max_source_positions, generator=g)
        else:
            feat = (_sub(cfg, "input_feat_per_channel") or 80) * (_sub(cfg, "input_channels") or 1)
            out["input_features"] = torch.randn(BATCH, 32, feat, generator=g)
        if getattr(cfg, "is_encoder_decoder", False) and "decoder_input_ids" in params and vocab:
            out["decoder_input_ids"] = torch.randint(0, vocab, (BATCH, DEC_SEQ), generator=g)
    else:
        raise DoesNotBuild(
            f"inputs: {type(model).__name__}.forward takes none of input_ids, pixel_values, input_features"
        )
    cross = next((k for k in ("encoder_hidden_states", "encoder_outputs") if k in params), None)
    if cross and "input_ids" in out and not getattr(cfg, "is_encoder_decoder", False):
        # a decoder with cross-attention used alone (Whisper's or TrOCR's ForCausalLM): an encoder's states, so
        # its cross-attention runs and the check judges its split
        width = next(
            (
                v
                for k in ("cross_attention_hidden_size", "d_model", "hidden_size")
                if isinstance(v := getattr(cfg, k, None), int) and v > 0
            ),
            None,
        )
        if width is not None and any(
            "encoder_attn" in n or "crossattention" in n for n, _ in model.named_modules()
        ):
            states = torch.randn(BATCH, SEQ, width, generator=g)
            out[cross] = states if cross == "encoder_hidden_states" else (states,)  # Whisper's: a 1-tuple
    out.update(_second_sequence(cfg, params, out, g))
    if "global_attention_mask" in params and "input_ids" in out:
        # Longformer's and LED's global attention (its query_global / key_global / value_global run only for
        # global tokens): the first token of each sample, as transformers' docs set it for classification
        out["global_attention_mask"] = torch.zeros_like(out["input_ids"])
        out["global_attention_mask"][:, 0] = 1
    if "use_cache" in params:
        out["use_cache"] = False
    return out


def _second_sequence(cfg, params, out: dict, g) -> dict:
    """A second input sequence the forward takes beside the tokens, with its own vocabulary and positions: an
    ``<x>_ids`` argument whose vocabulary the config sizes (``<x>_vocab_size``) and an ``<x>_position_ids``
    argument (LUKE's ``entity_ids`` / ``entity_position_ids``: its entity-aware attention's ``w2e_query`` /
    ``e2w_query`` / ``e2e_query`` run only with entities, so without them the check would not judge their split).
    ``ENTITIES`` ids per sample, drawn past id 0 (padding), each at one token position (positions of shape
    ``(batch, ENTITIES, 1)``: one token per mention)."""
    import torch

    extra: dict = {}
    if "input_ids" not in out:
        return extra
    for name in params:
        stem = name[: -len("_ids")] if name.endswith("_ids") else None
        vocab = getattr(cfg, f"{stem}_vocab_size", None) if stem else None
        if not isinstance(vocab, int) or vocab < 2 or f"{stem}_position_ids" not in params or name in out:
            continue
        extra[name] = torch.randint(1, vocab, (BATCH, ENTITIES), generator=g)
        extra[f"{stem}_position_ids"] = torch.randint(0, SEQ, (BATCH, ENTITIES, 1), generator=g)
    return extra


# ------------------------------------------------------------------------------------------------ build
def build(model_type: str, model_cls: str, seed: int = 0):
    """``(model, example inputs)``: the tiny model in eval mode, its forward run once on the inputs.

    Raises:
        DoesNotBuild: see the module docstring.
    """
    import torch
    import transformers

    from slapo_lab.multimodal_inputs import multimodal_inputs, tower_input_names

    cfg = tiny_config(model_type)
    try:
        cls = getattr(transformers, model_cls)
    except Exception as err:  # noqa: BLE001 - a missing optional package shows here
        raise DoesNotBuild(f"class {model_cls}: {type(err).__name__}: {_first_line(err)}") from None
    want = getattr(cls, "config_class", None)
    if isinstance(want, type) and not isinstance(cfg, want):  # a text-only class of a composite family
        sub = next((v for v in vars(cfg).values() if isinstance(v, want)), None)
        cfg = sub if sub is not None else cfg
    try:
        with torch.device("meta"):
            meta = cls(cfg)
    except Exception as err:  # noqa: BLE001
        raise DoesNotBuild(f"constructor: {type(err).__name__}: {_first_line(err)}") from None
    n = sum(p.numel() for p in meta.parameters())
    if n > MAX_TINY_PARAMS:
        raise DoesNotBuild(f"still {n / 1e6:.0f} M parameters with small sizes (a width the shrinker misses)")
    torch.manual_seed(seed)
    try:
        model = cls(cfg).eval()
    except Exception as err:  # noqa: BLE001
        raise DoesNotBuild(f"constructor: {type(err).__name__}: {_first_line(err)}") from None
    inputs = example_inputs(model, seed)
    try:
        with torch.no_grad():
            model(**inputs)
    except Exception as err:  # noqa: BLE001
        raise DoesNotBuild(f"unscheduled forward: {type(err).__name__}: {_first_line(err)}") from None
    full = multimodal_inputs(model, inputs, seed=seed)  # a vision / audio tower's inputs, if any reach it
    if any(n not in full for n in tower_input_names(model)) and _draw_zero_matrices(model, seed):
        full = multimodal_inputs(model, inputs, seed=seed)
    return model, full


def _draw_zero_matrices(model, seed: int) -> bool:
    """Draw every all-zero weight matrix of ``model`` like its other weights (normal, ``initializer_range``
    or 0.02), seeded; whether there was one. For a tower no input reaches the output of: an untrained model's
    zero-initialized projection (T5Gemma 2's ``mm_input_projection_weight``) hides the tower from the output,
    and from the check, where a trained one does not."""
    import torch

    std = getattr(model.config, "initializer_range", None) or 0.02
    g = torch.Generator().manual_seed(seed + 1)
    drawn = False
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2 and p.is_floating_point() and p.numel() > 1 and not p.any():
                p.copy_(torch.randn(p.shape, generator=g) * std)
                drawn = True
    return drawn


# ------------------------------------------------------------------------------------------------ coverage
def _is_linear(mod) -> bool:
    from torch import nn

    return isinstance(mod, nn.Linear) or type(mod).__name__ == "Conv1D"


def _expert_count(mod) -> int | None:
    """Experts in ``mod`` when it is an expert bank: 3-D weights whose first axis holds >= 2 experts, or a
    ModuleList of >= 2 modules of one class each holding a linear. A 3-D parameter with one entry on its first
    axis is a broadcast per-channel term, not a bank (Phi-4-multimodal's GLU biases ``b1``, ``b2`` of shape
    ``(1, channels, 1)``)."""
    from torch import nn

    if isinstance(mod, (nn.ModuleList, nn.ModuleDict)) and len(mod) >= 2:
        subs = list(mod.children())
        if len({type(m) for m in subs}) == 1 and any(_is_linear(x) for x in subs[0].modules()):
            return len(mod)
        return None
    if isinstance(mod, nn.modules.conv._ConvNd):
        return None
    three = [p for p in mod._parameters.values() if p is not None and p.dim() == 3 and p.shape[0] >= 2]
    return three[0].shape[0] if three else None


def _is_norm_module(mod) -> bool:
    from torch import nn

    return isinstance(mod, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)) or type(mod).__name__.endswith("Norm")


def _storage(t) -> int | None:
    import torch

    if not isinstance(t, torch.Tensor) or t.device.type == "meta" or t.numel() == 0:
        return None
    try:
        return t.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):  # a tensor without storage (vmap's batched tensors)
        return None


def _tensor_leaves(x):
    import torch

    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensor_leaves(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensor_leaves(y)
    elif hasattr(x, "to_tuple"):  # transformers' ModelOutput
        yield from _tensor_leaves(x.to_tuple())


def structural_exclusions(model, inputs: dict, blocks: list[str]) -> dict[str, str]:
    """``{linear path: why}`` for the linears inside ``blocks`` that are not projections to shard, measured on
    one forward of the real ``model`` (a deep copy, eval mode, no grad) on ``inputs`` with forward hooks and a
    :class:`torch.overrides.TorchFunctionMode` -- independent of ``slapo_lab``'s own split inference:

    * **a low-rank "a" projection** (MLA's ``q_a_proj`` / ``kv_a_proj_with_mqa``): a linear A with
      ``out_features < in_features`` whose output's storage (the output or a view of it, e.g. a ``split``) is
      the input of a norm module (``nn.LayerNorm`` / ``nn.RMSNorm`` / ``nn.GroupNorm``, or a class named
      ``*Norm``) whose output's storage is the input of another linear B of the same block, or whose output
      itself is B's input, B widening it again (Kimi-Linear's gate ``g_a_proj -> g_b_proj``: ``out(B) > out(A)``);
    * **a token router** (DeepSeek-V3.2's sparse-attention indexer ``wq_b`` / ``wk`` / ``weights_proj``): a
      linear whose output reaches an input of ``topk`` and reaches no block's output except through ``topk``'s
      results. Reach is value lineage: every op's outputs derive from all its tensor inputs (an in-place op's
      from its target's storage too, so a write into a view reaches the base), except ``topk``'s outputs, which
      derive from nothing; a linear's output derives from its own path.
    """
    import copy

    import torch
    from torch.overrides import TorchFunctionMode

    model = copy.deepcopy(model)
    mods = {b: model.get_submodule(b) for b in blocks}
    block_of = {}
    for b in blocks:  # (a module shared by the blocks, such as OpenAI GPT's activation, has a path in each)
        for rel, m in mods[b].named_modules(remove_duplicate=False):
            if rel and f"{b}.{rel}" not in block_of:
                block_of[f"{b}.{rel}"] = b
                mods[f"{b}.{rel}"] = m
    lineage: dict[int, frozenset] = {}  # storage -> linears the values in it derive from
    keep: list = []  # every recorded tensor stays alive (no storage is reused during the forward)
    topk_in: set = set()
    reach_out: set = set()
    lin_out: dict[int, str] = {}  # storage -> linear that produced it
    norm_in: dict[str, set] = {}  # norm path -> linears whose output storage it read
    norm_out: dict[int, str] = {}
    low_rank: dict[str, str] = {}

    def lin_of(x) -> frozenset:
        return frozenset().union(*(lineage.get(_storage(t), frozenset()) for t in _tensor_leaves(x)))

    class Lineage(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            with contextlib.suppress(
                Exception
            ):  # an op whose lineage cannot be followed: its outputs derive from nothing
                self.note(func, args, kwargs, out)
            return out

        def note(self, func, args, kwargs, out) -> None:
            name = getattr(func, "__name__", "")
            src = lin_of((args, kwargs))
            if name == "topk":
                topk_in.update(src)
                src = frozenset()
            elif name == "__setitem__" or (name.endswith("_") and not name.startswith("__")):
                target = args[0] if args else None
                if _storage(target) is not None:
                    lineage[_storage(target)] = src
                    keep.append(target)
            for t in _tensor_leaves(out):
                if _storage(t) is not None:
                    lineage[_storage(t)] = src
                    keep.append(t)

    handles = []

    def add(path, mod):
        if _is_linear(mod):

            def lin_pre(_m, args, path=path):
                st = _storage(args[0]) if args else None
                a = lin_out.get(st)  # a low-rank pair without a norm between (Kimi's g_a_proj -> g_b_proj)
                if a is not None and a != path and block_of.get(a) == block_of.get(path):
                    (a_in, a_out), (_b_in, b_out) = _in_out(mods[a]), _in_out(mods[path])
                    if a_out < a_in and b_out > a_out:
                        low_rank[a] = (
                            f"a low-rank projection ({a_in} -> {a_out} features) whose output feeds "
                            f"{path[len(block_of[path]) + 1 :]}"
                        )
                if st in norm_out:
                    for a in norm_in.get(norm_out[st], ()):
                        w_in, w_out = _in_out(mods[a])
                        if a != path and block_of.get(a) == block_of.get(path) and w_out < w_in:
                            low_rank[a] = (
                                f"a low-rank projection ({w_in} -> {w_out} features) whose normalised output "
                                f"feeds {path[len(block_of[path]) + 1 :]}"
                            )

            def lin_post(_m, _args, out, path=path):
                if _storage(out) is not None:
                    lineage[_storage(out)] = lineage.get(_storage(out), frozenset()) | {path}
                    lin_out[_storage(out)] = path
                    keep.append(out)

            handles.append(mod.register_forward_pre_hook(lin_pre))
            handles.append(mod.register_forward_hook(lin_post))
        elif _is_norm_module(mod):

            def norm_pre(_m, args, path=path):
                st = _storage(args[0]) if args else None
                if st in lin_out:
                    norm_in.setdefault(path, set()).add(lin_out[st])

            def norm_post(_m, _args, out, path=path):
                if _storage(out) is not None:
                    norm_out[_storage(out)] = path
                    keep.append(out)

            handles.append(mod.register_forward_pre_hook(norm_pre))
            handles.append(mod.register_forward_hook(norm_post))

    for path in block_of:
        add(path, mods[path])
    for b in blocks:
        handles.append(mods[b].register_forward_hook(lambda _m, _a, out: reach_out.update(lin_of(out))))
    model.eval()
    try:
        with torch.no_grad(), Lineage():
            model(**inputs)
    finally:
        for h in handles:
            h.remove()
    out = dict(low_rank)
    for path in sorted(topk_in - reach_out):
        if path in block_of and _is_linear(mods[path]):
            out.setdefault(
                path, "a token router: its output reaches topk and the block's output only through it"
            )
    return out


def _in_out(mod) -> tuple[int, int]:
    """``(in_features, out_features)`` of an ``nn.Linear`` (weight ``out x in``) or HF ``Conv1D`` (``in x out``)."""
    w = mod.weight.shape
    return (w[0], w[1]) if type(mod).__name__ == "Conv1D" else (w[1], w[0])


def projections(sch, model=None, inputs: dict | None = None) -> dict[str, list[str]]:
    """``{block path: [projection paths]}`` for every block of every stack (the rule in the module docstring:
    linears and 3-D expert banks inside the blocks, routers excluded). Given the unscheduled ``model`` (real
    weights, the same module paths as ``sch``'s) and example ``inputs``, the linears that
    :func:`structural_exclusions` measures as low-rank "a" projections or token routers are excluded too."""
    from torch import nn

    from slapo_lab import presets

    out: dict[str, list[str]] = {}
    blocks = presets.find_blocks(sch)
    skip = structural_exclusions(model, inputs, blocks) if model is not None and inputs is not None else {}
    for block in blocks:
        bmod = sch[block].mod
        routers: set[int] = set()
        for mod in bmod.modules():
            counts = [c for c in map(_expert_count, mod.children()) if c]
            if isinstance(mod, (nn.ModuleList, nn.ModuleDict)) or not counts:
                continue
            for child in mod.modules():
                if child is not mod and _is_linear(child) and child.weight.shape[0] <= max(counts):
                    routers.add(id(child))
        paths = []
        for rel, mod in bmod.named_modules():
            if not rel or id(mod) in routers or f"{block}.{rel}" in skip:
                continue
            three = not isinstance(mod, (nn.ModuleList, nn.ModuleDict)) and _expert_count(mod) is not None
            if _is_linear(mod) or three:
                paths.append(f"{block}.{rel}")
        out[block] = paths
    return out


def _sharded(mod) -> bool:
    return any(getattr(p, "shard_axis", None) is not None for p in mod.parameters(recurse=False))


def kept_whole(sch, model=None, inputs: dict | None = None) -> list[str]:
    """The projections (see :func:`projections`, given ``model`` and ``inputs``) no call shards, by path
    relative to their block, deduplicated over the blocks of a stack."""
    out: list[str] = []
    for block, paths in projections(sch, model, inputs).items():
        for p in paths:
            if not _sharded(sch.get_top_schedule().mod.get_submodule(p)):
                rel = f"{block.rsplit('.', 1)[0]}.*.{p[len(block) + 1 :]}"
                if rel not in out:
                    out.append(rel)
    return out


# ------------------------------------------------------------------------------------------------ one family
def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__


def sweep_one(model_type: str) -> Result:
    """Build, preset, check and classify one family (never raises)."""
    import torch

    import slapo_lab as sl
    from slapo_lab import presets
    from slapo_lab.call_order import set_example_inputs
    from slapo_lab.errors import ScheduleError
    from slapo_lab.numeric import numeric_check
    from slapo_lab.preset_check import set_reference
    from slapo_lab.utils import meta_copy

    t0 = time.perf_counter()
    task, cls = families().get(model_type, ("", ""))
    res = Result(model_type, task, cls)
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                model, inputs = build(model_type, cls)
            except DoesNotBuild as err:
                res.status, res.detail = "no_build", str(err)
                return res
            res.n_params = sum(p.numel() for p in model.parameters())
            sch = sl.create_schedule(meta_copy(model), world_size=WORLD_SIZE)
            set_example_inputs(sch, inputs)
            set_reference(sch, model)  # the preset checks against the user model, as in the editor
            try:
                calls = presets.megatron_tp(
                    sch, vocab_parallel=presets.has_vocab_embedding(sch), sequence_parallel=SEQUENCE_PARALLEL
                )
            except ScheduleError as err:
                res.status, res.detail = "refused", str(err)
                return res
            notes = list(getattr(calls, "notes", []))
            report = numeric_check(model, sch.record.calls, WORLD_SIZE, inputs, timeout=CHECK_TIMEOUT)
            if report.status == "skipped" and "unscheduled copy's forward fails" in report.message:
                # the tiny model does not run on the harness's inputs: nothing here can judge the preset
                res.status, res.detail = "no_build", f"does not run on the sweep's inputs: {report.message}"
                return res
            if report.status != "passed":
                res.status = "failed"
                res.detail = ("(check skipped) " if report.status == "skipped" else "") + report.message
                return res
            whole = kept_whole(sch, model, inputs)
            if not whole and not report.unjudged:
                res.status, res.detail = "full", report.message
            elif not whole:  # split, but a tower the sweep's inputs never reach: the check did not judge it
                res.status = "partial"
                res.detail = f"not judged: {report.message}"
            else:
                res.status = "partial"
                res.detail = f"kept whole: {', '.join(whole)}" + (
                    f" | notes: {' '.join(notes)}" if notes else ""
                )
            return res
    except Exception as err:  # noqa: BLE001 - the classification of anything unexpected
        tb = traceback.extract_tb(err.__traceback__)
        where = next(
            (f"{Path(f.filename).name}:{f.lineno}" for f in reversed(tb) if "slapo_lab" in f.filename), ""
        )
        res.status = "crash"
        res.detail = f"{type(err).__name__}: {_first_line(err)}" + (f" (at {where})" if where else "")
        return res
    finally:
        res.seconds = time.perf_counter() - t0


# ------------------------------------------------------------------------------------------------ the pool
def _worker(conn) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    with contextlib.suppress(Exception):
        import transformers

        transformers.logging.set_verbosity_error()
    import slapo_lab.numeric
    import slapo_lab.presets  # noqa: F401

    conn.send("ready")
    while True:
        try:
            mt = conn.recv()
        except EOFError:
            return
        if mt is None:
            return
        if mt == HANG:
            time.sleep(3600)
        if mt == DIE:
            os._exit(3)
        conn.send(sweep_one(mt).as_dict())


class _Slot:
    def __init__(self, ctx) -> None:
        self.parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        self.family: str | None = None
        self.started = time.monotonic()
        self.ready = False  # the worker has imported torch, transformers and slapo_lab
        self.done = 0

    def deadline(self, timeout: float) -> float:
        return self.started + (timeout if self.ready else STARTUP_TIMEOUT)

    def stop(self, kill: bool = False) -> None:
        if kill:
            self.proc.kill()
        else:
            try:
                self.parent.send(None)
            except (BrokenPipeError, OSError):
                pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.parent.close()


def run_sweep(
    names: list[str] | None = None,
    workers: int = 2,
    timeout: float = 150.0,
    recycle: int = 40,
    progress=None,
) -> list[Result]:
    """Sweep ``names`` (default: every family) over ``workers`` processes, ``timeout`` seconds per family
    (the worker is killed and the family classified ``"crash"``); a worker is replaced every ``recycle``
    families to bound its memory. Returns the results in family order."""
    all_fams = families()
    names = list(all_fams) if names is None else list(names)
    ctx = mp.get_context("spawn")
    todo = list(names)
    results: dict[str, Result] = {}
    slots = [_Slot(ctx) for _ in range(max(1, min(workers, len(todo))))]

    def feed(i: int) -> None:
        s = slots[i]
        if s.done >= recycle:
            s.stop()
            slots[i] = s = _Slot(ctx)
        if todo:
            s.family = todo.pop(0)
            if s.ready:
                s.started = time.monotonic()
            s.parent.send(s.family)
        else:
            s.family = None

    def finish(fam: str, res: Result) -> None:
        results[fam] = res
        if progress:
            progress(res)

    for i in range(len(slots)):
        feed(i)
    while any(s.family for s in slots):
        busy = [s for s in slots if s.family]
        left = min(s.deadline(timeout) for s in busy) - time.monotonic()
        ready = wait([s.parent for s in busy] + [s.proc.sentinel for s in busy], max(0.0, left))
        for i, s in enumerate(slots):
            if not s.family:
                continue
            fam = s.family
            task, cls = all_fams.get(fam, ("", ""))
            if s.parent in ready:
                try:
                    msg = s.parent.recv()
                    if msg == "ready":  # the family's clock starts now
                        s.ready, s.started = True, time.monotonic()
                        continue
                    finish(fam, Result(**msg))
                    s.done += 1
                    feed(i)
                    continue
                except (EOFError, OSError):
                    pass
            if s.parent in ready or s.proc.sentinel in ready:
                s.proc.join(5)
                finish(
                    fam,
                    Result(
                        fam,
                        task,
                        cls,
                        "crash",
                        f"the worker died (exit code {s.proc.exitcode})",
                        time.monotonic() - s.started,
                    ),
                )
                s.stop(kill=True)
                slots[i] = _Slot(ctx)
                feed(i)
            elif time.monotonic() > s.deadline(timeout):
                what = f"no result within {timeout:.0f} s" if s.ready else "the worker did not start"
                finish(fam, Result(fam, task, cls, "crash", f"{what} (killed)", timeout))
                s.stop(kill=True)
                slots[i] = _Slot(ctx)
                feed(i)
    for s in slots:
        s.stop()
    return [results[n] for n in names]


# ------------------------------------------------------------------------------------------------ the table
def counts(results: list[Result]) -> dict[str, int]:
    return {s: sum(r.status == s for r in results) for s in STATUSES}


def goal(results: list[Result]) -> str:
    """The issue's goal against ``results``: ✓ full on >= 90 % of the families that build, 0 ✗, 0 crashes."""
    c = counts(results)
    built = len(results) - c["no_build"]
    share = c["full"] / built if built else 0.0
    ok = share >= 0.9 and c["failed"] == 0 and c["crash"] == 0
    return (
        f"Goal (issue 23: ✓ full on >= 90 % of the {built} families that build, 0 ✗, 0 crashes): "
        f"{'MET' if ok else 'NOT MET'}: ✓ full {c['full']} ({100 * share:.0f} %), ✗ {c['failed']}, "
        f"crash {c['crash']}."
    )


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(results: list[Result]) -> str:
    """Markdown: the counts, the goal line, then one row per family (family | ✓ full | ✓ partial: what and why
    | refused: why | ✗ | crash), then the families that do not build with their reasons."""
    c = counts(results)
    lines = [
        f"# Family sweep: Megatron preset at TP {WORLD_SIZE} + numeric check ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        "",
        (
            f"{len(results)} families; {len(results) - c['no_build']} build tiny: ✓ full {c['full']}, "
            f"✓ partial {c['partial']}, refused {c['refused']}, ✗ {c['failed']}, crash {c['crash']}; "
            f"does not build {c['no_build']}."
        ),
        "",
        goal(results),
        "",
        "| family (task, class) | ✓ full | ✓ partial: what and why | refused: why | ✗ | crash |",
        "|---|---|---|---|---|---|",
    ]
    col = {"full": 1, "partial": 2, "refused": 3, "failed": 4, "crash": 5}
    for r in results:
        if r.status == "no_build":
            continue
        cells = [""] * 6
        cells[0] = f"{r.family} ({r.task}, {r.model_cls}, {r.seconds:.1f} s)"
        cells[col[r.status]] = "✓" if r.status == "full" else _cell(r.detail)
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Does not build tiny (not counted)", ""]
    lines += [f"- {r.family} ({r.model_cls}): {_cell(r.detail)}" for r in results if r.status == "no_build"]
    return "\n".join(lines) + "\n"


def cause_of(r: Result) -> str:
    """A family's failure, refusal or crash with module paths and numbers taken out, to group families by."""
    text = r.detail
    m = re.search(r"fails in (\S+) while (.*?) on \d+ simulated ranks?: (.*)", text)
    if m:
        text = f"fails in *.{m.group(1).rsplit('.', 1)[-1]} while {m.group(2)}: {m.group(3)}"
    m = re.search(
        r"(outputs first differ|only gradients differ, first|the weights differ first) at (\S+)", text
    )
    if m:
        text = f"{m.group(1)} at *.{m.group(2).rsplit('.', 1)[-1]}"
    text = re.sub(r"\(found: [^)]*\)", "", text)
    text = re.sub(r"\b[\w-]+(\.[\w-]+)+\b", "<module>", text)
    text = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", text)
    text = re.sub(r"\s+", " ", text.split(";")[0]).replace(" while running the forward and backward", "")
    return text[:90]


def causes(results: list[Result]) -> str:
    """Markdown: the ✗, crashed, refused and unbuilt families grouped by cause (:func:`cause_of`), largest
    group first."""
    lines = []
    for status, title in (
        ("failed", "✗"),
        ("crash", "crash"),
        ("refused", "refused"),
        ("no_build", "does not build"),
    ):
        groups: dict[str, list[str]] = {}
        for r in results:
            if r.status == status:
                groups.setdefault(cause_of(r), []).append(r.family)
        if not groups:
            continue
        lines += ["", f"## {title} by cause", ""]
        for cause, fams in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            lines.append(f"- ({len(fams)}) {_cell(cause)}: {', '.join(fams)}")
    return "\n".join(lines) + "\n"


def write_table(text: str) -> list[Path]:
    """Write ``text`` to each of :data:`TABLE_PATHS` that can be written; returns those written."""
    done = []
    for p in TABLE_PATHS:
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
            done.append(p)
        except OSError:
            continue
    return done


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated model types (default: every family)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=150.0)
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or None
    t0 = time.perf_counter()

    def progress(r: Result) -> None:
        print(f"{r.family:32s} {r.status:9s} {r.seconds:5.1f}s {r.detail[:150]}", file=sys.stderr, flush=True)

    results = run_sweep(names, workers=args.workers, timeout=args.timeout, progress=progress)
    text = (
        table(results)
        + causes(results)
        + f"\nSweep wall time: {time.perf_counter() - t0:.0f} s on {args.workers} workers.\n"
    )
    print(text)
    if not args.no_write and names is None:
        for p in write_table(text):
            print(f"written: {p}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
