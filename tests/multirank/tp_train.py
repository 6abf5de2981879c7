"""Multi-rank tensor-parallel check, run by torchrun (see tests/multirank/test_tensor_parallel_ranks.py).

    torchrun --nproc_per_node=2 tests/multirank/tp_train.py [all | bert gpt2 llama ...] [case names ...]

For each case of the family: build a small HF model with random weights (same seed on every rank), keep a
deep copy as the single-process reference, schedule the model (inside ``sl.Verify``, which must pass:
outputs, gathered gradients and weight slices), then train scheduled and reference model for three SGD
steps on the same batches and compare, at every step, the loss, every gradient (sharded ones gathered
across ranks) and every updated parameter. Rank 0 prints one ``RESULT {json}`` line per case; the exit
status is non-zero when any comparison exceeds the tolerance (atol = rtol = 1e-5, fp32) on any rank.
"""

from __future__ import annotations

import copy
import gc
import json
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared harness, the model zoo
from harness import apply_bert_tp
from zoo.matrix import (  # the matrix's parameterised builders, shared
    bloom_model,
    deberta_v2_model,
    falcon_mqa,
    falcon_new_arch_model,
    mixtral_model,
    phi3_model,
    qwen3_model,
    whisper_model,
)
from zoo.tp import (  # the tiny models of these runs (unseeded: run_case seeds)
    albert_model,
    bert_mlm_model,
    bert_model,
    falcon_old_layout_model,
    gemma3_model,
    gpt2_model,
    gpt2_odd_vocab_model,
    gpt_neo_model,
    llama_kv2_model,
    llama_model,
    mistral_model,
    opt_model,
    phi3_gqa_model,
    qwen3_moe_kv2_model,
    qwen3_moe_model,
    roberta_mlm_model,
    t5_model,
    vit_model,
)

import slapo_lab as sl
from slapo_lab import presets
from slapo_lab.verify import gather_full

warnings.filterwarnings("ignore")
ATOL = RTOL = 1e-5
STEPS = 3
BATCH, SEQ, VOCAB = 2, 8, 128


def pixels(ids):
    """ViT's input for a batch: images drawn from a generator seeded by the token batch (same on every rank)."""
    g = torch.Generator().manual_seed(int(ids.sum()))
    return torch.randn(BATCH, 3, 32, 32, generator=g)


def features(ids):
    """Whisper's input for a batch: log-mel features (16 bins, 64 frames) seeded by the token batch."""
    g = torch.Generator().manual_seed(int(ids.sum()))
    return torch.randn(BATCH, 16, 64, generator=g)


def bert_manual(sch):
    """Slapo's canonical BERT schedule written out call by call (the reference.md list)."""
    apply_bert_tp(sch, 2, checkpoint=False, embeddings="embeddings.word_embeddings")


def gpt2_manual(sch):
    """GPT-2 Megatron TP by hand: strided fused c_attn, row c_proj, tied vocab-parallel wte / lm_head."""
    for i in range(2):
        p = f"transformer.h.{i}"
        for col in (f"{p}.attn.c_attn", f"{p}.mlp.c_fc"):
            sch[col].shard("weight", axis=1)
            sch[col].shard("bias", axis=0)
            sch[col].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        for row in (f"{p}.attn.c_proj", f"{p}.mlp.c_proj"):
            sch[row].shard("weight", axis=0)
            sch[row].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    sch["transformer.wte"].shard("weight", axis=0)
    sch["transformer.wte"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    sch["lm_head"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    sch["lm_head"].sync(
        mode="fwd_post", sync_op_or_fn="all_gather", axis=-1, tensor_parallel_output_grad=False
    )


CASES = {
    "bert": [
        ("bert_manual", bert_model, bert_manual),
        ("bert_megatron_tp", bert_model, lambda s: presets.megatron_tp(s)),
        ("bert_mlm_tied_decoder", bert_mlm_model, lambda s: presets.megatron_tp(s)),
    ],
    "gpt2": [
        ("gpt2_manual_tied_vocab", gpt2_model, gpt2_manual),
        ("gpt2_megatron_tp", gpt2_model, lambda s: presets.megatron_tp(s)),
        ("gpt2_sequence_parallel", gpt2_model, lambda s: presets.megatron_tp(s, sequence_parallel=True)),
        (
            "gpt2_sequence_parallel_checkpointed",
            gpt2_model,
            lambda s: presets.megatron_tp(s, sequence_parallel=True) + presets.checkpoint_blocks(s),
        ),
    ],
    "llama": [
        ("llama_megatron_tp", llama_model, lambda s: presets.megatron_tp(s)),
        ("llama_sequence_parallel", llama_model, lambda s: presets.megatron_tp(s, sequence_parallel=True)),
        (
            "llama_hf_plan",
            llama_model,
            lambda s: presets.megatron_tp(s, use_hf_plan=True, vocab_parallel=False),
        ),
    ],
}


# Families whose attention keeps head counts in attributes (issue 10); launched by name, not by "all"
# (tests/families/test_families_tp_head_counts.py).
FAMILY_CASES = {
    "roberta": [("roberta_megatron_tp", roberta_mlm_model, lambda s: presets.megatron_tp(s))],
    "opt": [
        ("opt_megatron_tp", opt_model, lambda s: presets.megatron_tp(s)),
        (
            "opt_350m_layout_megatron_tp",
            lambda: opt_model(word_embed_proj_dim=16, do_layer_norm_before=False),
            lambda s: presets.megatron_tp(s),
        ),
    ],
    "gpt_neo": [("gpt_neo_megatron_tp", gpt_neo_model, lambda s: presets.megatron_tp(s))],
    "t5": [
        ("t5_megatron_tp", t5_model, lambda s: presets.megatron_tp(s)),
        ("t5_gated_megatron_tp", lambda: t5_model("gated-gelu"), lambda s: presets.megatron_tp(s)),
        ("umt5_megatron_tp", lambda: t5_model("gated-gelu", "UMT5"), lambda s: presets.megatron_tp(s)),
    ],
}

FAMILY_CASES.update(
    {
        # issue 10: the Megatron preset on Qwen3 (per-head q/k norms), Mistral (GQA), Mixtral (tensor-parallel experts),
        # ALBERT (one shared layer, tied vocab-parallel decoder), ViT (no vocabulary)
        "families2": [
            ("qwen3_megatron_tp", qwen3_model, lambda s: presets.megatron_tp(s)),
            (
                "qwen3_hf_plan",
                qwen3_model,
                lambda s: presets.megatron_tp(s, use_hf_plan=True, vocab_parallel=False),
            ),
            ("mistral_megatron_tp", mistral_model, lambda s: presets.megatron_tp(s)),
            ("mixtral_megatron_tp", mixtral_model, lambda s: presets.megatron_tp(s)),
            (
                "mixtral_hf_plan",
                mixtral_model,
                lambda s: presets.megatron_tp(s, use_hf_plan=True, vocab_parallel=False),
            ),
            ("qwen3_moe_hf_plan", qwen3_moe_model, lambda s: presets.megatron_tp(s, use_hf_plan=True)),
            ("albert_megatron_tp", albert_model, lambda s: presets.megatron_tp(s)),
            ("vit_megatron_tp", vit_model, lambda s: presets.megatron_tp(s, vocab_parallel=False)),
        ],
    }
)


def bert_typed_layer0_then_megatron(sch):
    """The quickstart: layer 0's attention sharded by hand first, then the Megatron preset completes the rest."""
    p = "encoder.layer.0.attention"
    for name in ("query", "key", "value"):
        node = sch[f"{p}.self.{name}"]
        node.shard("weight", axis=0)
        node.shard("bias", axis=0)
        node.sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    sch[f"{p}.output.dense"].shard("weight", axis=1)
    sch[f"{p}.output.dense"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    return presets.megatron_tp(sch)


# presets compose with calls typed before them, and fall back where the vocabulary does not divide
FAMILY_CASES["compose"] = [
    ("bert_typed_layer0_then_megatron", bert_model, bert_typed_layer0_then_megatron),
    ("gpt2_odd_vocab_megatron_tp", gpt2_odd_vocab_model, lambda s: presets.megatron_tp(s)),
    ("gemma3_vocab_parallel_megatron_tp", gemma3_model, lambda s: presets.megatron_tp(s)),
    ("whisper_encoder_and_decoder_megatron_tp", whisper_model, lambda s: presets.megatron_tp(s)),
    ("deberta_v2_megatron_tp", deberta_v2_model, lambda s: presets.megatron_tp(s)),
    ("deberta_v3_shared_keys_megatron_tp", lambda: deberta_v2_model(True), lambda s: presets.megatron_tp(s)),
]


# issue 16 item 4: fused q/k/v and gate/up projections, their layout read from the attention module
FAMILY_CASES["fused"] = [
    ("falcon_new_arch_megatron_tp", falcon_new_arch_model, lambda s: presets.megatron_tp(s)),
    ("falcon_old_layout_megatron_tp", falcon_old_layout_model, lambda s: presets.megatron_tp(s)),
    (
        "falcon_alibi_megatron_tp",
        lambda: falcon_old_layout_model(alibi=True),
        lambda s: presets.megatron_tp(s),
    ),
    # multi-query attention: the query heads split, the one key/value head on both ranks (its gradient summed)
    ("falcon_mqa_megatron_tp", falcon_mqa, lambda s: presets.megatron_tp(s)),
    ("bloom_megatron_tp", bloom_model, lambda s: presets.megatron_tp(s)),
    ("phi3_megatron_tp", phi3_model, lambda s: presets.megatron_tp(s)),
    ("phi3_gqa_megatron_tp", phi3_gqa_model, lambda s: presets.megatron_tp(s)),
]


# issue 16 item 3: more tensor-parallel ranks than key/value heads (run at 4 ranks: tp 4, 2 kv heads)
FAMILY_CASES["kv_replicas"] = [
    ("llama_kv_replicas_megatron_tp", llama_kv2_model, lambda s: presets.megatron_tp(s)),
    ("qwen3_moe_kv_replicas_megatron_tp", qwen3_moe_kv2_model, lambda s: presets.megatron_tp(s)),
]


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return ids, labels


def loss_of(model, ids, labels):
    """A replicated scalar loss: the LM / MLM loss, ViT's classification loss, or a fixed projection of
    BertModel's outputs."""
    if getattr(model.config, "model_type", "") == "whisper":
        return model(input_features=features(ids), labels=labels[:, : SEQ // 2]).loss
    if getattr(model.config, "model_type", "") == "vit":
        return model(pixel_values=pixels(ids), labels=labels[:, 0] % model.config.num_labels).loss
    if hasattr(model, "get_output_embeddings") and model.get_output_embeddings() is not None:
        return model(input_ids=ids, labels=labels).loss
    out = model(input_ids=ids)
    g = torch.Generator().manual_seed(7)
    h, pooled = out.last_hidden_state, out.pooler_output
    return (h * torch.randn(h.shape, generator=g)).mean() + (
        pooled * torch.randn(pooled.shape, generator=g)
    ).mean()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, bool]:
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return float("inf"), False
    return float((a - b).abs().max()), bool(torch.allclose(a, b, atol=ATOL, rtol=RTOL))


def case_inputs(name: str) -> dict:
    """The forward's keyword inputs of case ``name`` (token ids, ViT's pixels, Whisper's features; a decoder
    input for the encoder-decoder models)."""
    ids, labels = batch(-1)
    inputs = {"input_ids": ids} if not name.startswith("vit") else {"pixel_values": pixels(ids)}
    decoders = ("gpt2", "llama", "qwen3", "mistral", "mixtral", "falcon", "bloom", "phi3")  # qwen3_moe too
    if name.startswith(decoders):
        inputs["use_cache"] = False
    if name.startswith("whisper"):
        inputs = {"input_features": features(ids), "decoder_input_ids": labels[:, : SEQ // 2]}
    if name.split("_")[0].endswith("t5"):  # T5 / UMT5: encoder and decoder, a shorter target (q != k lengths)
        inputs["decoder_input_ids"] = labels[:, : SEQ // 2]
    return inputs


def run_case(name, make, schedule, tp) -> dict:
    torch.manual_seed(1234)
    model = make()
    model.train()
    ref = copy.deepcopy(model)
    t0 = time.perf_counter()
    sch = sl.create_schedule(model)
    inputs = case_inputs(name)
    with sl.Verify(sch, inputs, device="cpu", eval_mode=False) as v:
        calls = schedule(sch)
    n_calls = len(sch.record.calls)
    model.train()
    model.zero_grad(set_to_none=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref_params = dict(ref.named_parameters())
    res = {
        "case": name,
        "calls": n_calls,
        "preset_calls": len(calls) if isinstance(calls, list) else None,
        "verify": v.report.passed,
        "verify_max_grad_diff": max((c.max_abs for c in v.report.grads), default=0.0),
        "loss": [],
        "max_loss_diff": 0.0,
        "max_grad_diff": 0.0,
        "max_param_diff": 0.0,
        "bad": [],
    }
    sharded = sorted(n for n, p in model.named_parameters() if getattr(p, "shard_axis", None) is not None)
    res["n_sharded"] = len(sharded)
    res["strided"] = sorted(n for n, p in model.named_parameters() if getattr(p, "shard_stride", 1) > 1)
    res["replicated"] = sorted(n for n, p in model.named_parameters() if getattr(p, "shard_replicas", 1) > 1)
    for step in range(STEPS):
        ids, labels = batch(step)
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        loss = loss_of(model, ids, labels)
        ref_loss = loss_of(ref, ids, labels)
        d, ok = max_diff(loss, ref_loss)
        res["loss"].append(float(ref_loss))
        res["max_loss_diff"] = max(res["max_loss_diff"], d)
        if not ok:
            res["bad"].append(f"step {step} loss {float(loss)} vs {float(ref_loss)}")
        loss.backward()
        ref_loss.backward()
        for pname, p in model.named_parameters():
            r = ref_params[pname]
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            rg = r.grad if r.grad is not None else torch.zeros_like(r)
            d, ok = max_diff(gather_full(g, p, tp), rg)
            res["max_grad_diff"] = max(res["max_grad_diff"], d)
            if not ok:
                res["bad"].append(f"step {step} grad {pname} max diff {d:.3e}")
        opt.step()
        ref_opt.step()
        for pname, p in model.named_parameters():
            d, ok = max_diff(gather_full(p.detach(), p, tp), ref_params[pname])
            res["max_param_diff"] = max(res["max_param_diff"], d)
            if not ok:
                res["bad"].append(f"step {step} param {pname} max diff {d:.3e}")
    if name.startswith("gpt2"):
        res["tied"] = model.lm_head.weight is model.transformer.wte.weight
        if not res["tied"]:
            res["bad"].append("lm_head.weight is no longer transformer.wte.weight")
    res["seconds"] = round(time.perf_counter() - t0, 2)
    # agree across ranks: the worst figures, and every rank's failures
    t = torch.tensor(
        [res["max_loss_diff"], res["max_grad_diff"], res["max_param_diff"], float(len(res["bad"]))],
        dtype=torch.float64,
    )
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    res["max_loss_diff"], res["max_grad_diff"], res["max_param_diff"], n_bad = t.tolist()
    if n_bad and not res["bad"]:
        res["bad"].append("another rank reported a mismatch")
    res["bad"] = res["bad"][:8]
    return res


def main() -> int:
    args = sys.argv[1:] or ["all"]
    cases = {**CASES, **FAMILY_CASES}
    families = list(CASES) if "all" in args else [a for a in args if a in cases]
    only = {a for a in args if a not in cases and a != "all"}  # optional case names
    dist.init_process_group("gloo")
    tp = sl.TPGroup(dist.get_world_size(), dist.get_rank(), dist.group.WORLD)
    failed = 0
    for name, make, schedule in [c for f in families for c in cases[f]]:
        if only and name not in only:
            continue
        try:
            res = run_case(name, make, schedule, tp)
        except Exception as err:  # noqa: BLE001 - report it; Verify failures are raised on every rank alike
            res = {"case": name, "bad": [f"{type(err).__name__}: {err}"]}
        failed += bool(res["bad"])
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps(res), flush=True)
    dist.barrier()
    gc.collect()  # sync hooks hold the gloo group in reference cycles; free them first
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
