"""Predicted against measured peak memory on this CPU: one process, a Llama of ~58 M parameters built from
``transformers.LlamaConfig`` (random weights), fp32 AdamW, checkpointing off and on, 1 to 4 micro-batches.

Measured: the peak of live tensors over two optimizer steps with ``torch.distributed._tools.mem_tracker.MemTracker``
(parameters, gradients, optimizer states, activations and temporaries, as PyTorch's own tracker counts them).
Predicted: :func:`slapo_lab.estimate`'s busiest rank without the allocator headroom (``Estimate.peak_live_bytes``:
MemTracker counts tensors, not the caching allocator's blocks). Prints one row per layout with the ratio.

Run: ``.venv/bin/python benchmarks/plan_memory_cpu.py [--seq 256]``. Checkpointing wraps every decoder layer in
``torch.utils.checkpoint`` (non-reentrant), as the schedule's ``checkpoint`` primitive does; selective checkpointing
uses :func:`slapo_lab.planner.profile.selective_policy` with ``create_selective_checkpoint_contexts``.
"""

from __future__ import annotations

import argparse
import functools

import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
from transformers import LlamaConfig, LlamaForCausalLM

import slapo_lab as sl
from slapo_lab.planner.profile import selective_policy

CONFIG = {
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


def build() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG))


def _wrap(layer, how: str):
    fwd = layer.forward

    def run(*args, **kwargs):
        if how == "selective":
            ctx = functools.partial(create_selective_checkpoint_contexts, selective_policy())
            return checkpoint(fwd, *args, use_reentrant=False, context_fn=ctx, **kwargs)
        return checkpoint(fwd, *args, use_reentrant=False, **kwargs)

    layer.forward = run


def measure(ck, mbs: int, micro: int, seq: int) -> dict:
    """MemTracker's peak snapshot (category -> bytes, ``"Total"``) of two AdamW steps of ``micro`` micro-batches
    of ``mbs`` sequences."""
    model = build()
    if ck != "none":
        for i, layer in enumerate(model.model.layers):
            if ck in ("all", "selective") or i % ck == 0:
                _wrap(layer, "selective" if ck == "selective" else "all")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    ids = torch.randint(0, CONFIG["vocab_size"], (mbs, seq))
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        for _ in range(2):
            for _ in range(micro):
                out = model(input_ids=ids, labels=ids, use_cache=False)
                out.loss.backward()
                del out
                tracker.reset_mod_stats()  # per-module stats of one pass; the peak stays
            opt.step()
            opt.zero_grad(set_to_none=True)
    peak = tracker.get_tracker_snapshot("peak")
    return {str(k).rsplit(".", 1)[-1]: v for k, v in next(iter(peak.values())).items()}


def predict(model, ck, mbs: int, micro: int, seq: int):
    cluster = sl.Cluster(nodes=1, gpus_per_node=1, gpu=sl.DeviceProfile(
        "this cpu", 1e11, 1e11, 64 << 30, 1e10, 1e9, 1e-4, 1e9, 1e-4))  # fmt: skip
    lay = sl.Layout(tp=1, pp=1, dp=1, micro_batch_size=mbs, checkpoint=ck)
    return sl.estimate(model, lay, cluster=cluster, seq_len=seq, global_batch_size=mbs * micro, dtype="fp32")


LAYOUTS = [("none", 1, 1), ("none", 2, 1), ("none", 1, 4), ("all", 1, 1), ("all", 2, 2), ("selective", 1, 1),
           (2, 1, 1), ("none", 4, 1)]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=256)
    args = ap.parse_args()
    ref = build()
    print(
        f"Llama {sum(p.numel() for p in ref.parameters()) / 1e6:.1f} M parameters, fp32 AdamW, seq {args.seq}, 1 process"
    )
    print(
        f"{'checkpoint':>10} {'mbs':>4} {'micro':>5} {'predicted MiB':>14} {'measured MiB':>13} {'ratio':>6}"
    )
    for ck, mbs, micro in LAYOUTS:
        est = predict(ref, ck, mbs, micro, args.seq)
        cats = measure(ck, mbs, micro, args.seq)
        got = cats.pop("Total")
        pred = est.peak_live_bytes
        detail = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in cats.items() if v)
        print(f"{ck!s:>10} {mbs:>4} {micro:>5} {pred / 2**20:>14.1f} {got / 2**20:>13.1f} {pred / got:>6.3f}   {detail}",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
