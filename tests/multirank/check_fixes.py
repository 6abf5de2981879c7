"""The schedule check on real ranks, run by torchrun (see tests/unit/core/test_check.py).

    torchrun --nproc_per_node=2 tests/multirank/check_fixes.py

A 2-layer Llama with grouped-query attention (4 query heads, 2 key/value heads, no dropout; same seed
on every rank) is scheduled half way: layer 0's ``q_proj`` column parallel and ``o_proj`` row
parallel, each with its sync, ``k_proj`` / ``v_proj`` left whole. That model runs without a shape
error (each rank's 2 query heads meet 2 key/value heads) but is not the original. Then the fixes the
check names are applied (``sl.close_open_items``: round after round, until it finds nothing). Rank 0 prints
``RESULT {json}`` for both states: the findings' kinds, the loss of the scheduled and of the reference
model, and the worst gradient difference (sharded gradients gathered across ranks).
"""

from __future__ import annotations

import copy
import json
import warnings

import torch
import torch.distributed as dist

import slapo_lab as sl
from slapo_lab.verify import gather_full

warnings.filterwarnings("ignore")


def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=64,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def loss_of(m, ids):
    return m(input_ids=ids, labels=ids, use_cache=False).loss


def compare(sch, ref, ids) -> dict:
    found = sl.check_schedule(sch)
    for m in (sch.mod, ref):
        m.zero_grad()
    loss, ref_loss = loss_of(sch.mod, ids), loss_of(ref, ids)
    loss.backward()
    ref_loss.backward()
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for name, p in sch.mod.named_parameters():
        g = gather_full(p.grad, p, sch.tp) if getattr(p, "shard_axis", None) is not None else p.grad
        worst = max(worst, (g - ref_params[name].grad).abs().max().item())
    return {
        "kinds": sorted({f.kind for f in found}),
        "n": len(found),
        "loss": loss.item(),
        "ref_loss": ref_loss.item(),
        "grad_diff": worst,
    }


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    m = model()
    ref = copy.deepcopy(m)
    sch = sl.create_schedule(m)
    a = sch["model.layers.0.self_attn"]
    a["q_proj"].shard("weight", axis=0)
    a["q_proj"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    a["o_proj"].shard("weight", axis=1)
    a["o_proj"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    half = compare(sch, ref, ids)
    applied = sl.close_open_items(sch)
    fixed = compare(sch, ref, ids)
    fixed["applied"] = [sl.format_call(c) for c in applied]
    if rank == 0:
        print("RESULT " + json.dumps({"case": "half", **half}), flush=True)
        print("RESULT " + json.dumps({"case": "fixed", **fixed}), flush=True)
    import gc

    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
