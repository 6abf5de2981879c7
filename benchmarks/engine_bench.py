"""Engine figures for issue 3, each a ratio against a baseline measured in the same run.

(a) overhead: a world-size-1 schedule with no primitives vs the eager model (training step time of a
    small BERT; goal <= 1.03), plus the same with the full TP schedule applied at world size 1 (hooks
    and row-parallel forwards installed, no communication);
(b) activation checkpointing on every layer of a BERT-base config: bytes saved for backward
    (``torch.autograd.graph.saved_tensors_hooks``, unique storages, parameters excluded) and step
    time, both vs eager; and ``sl.plan``'s activation estimate vs the measured bytes;
(c) applying full tensor parallelism (q/k/v/o/gate/up/down: shard + sync, 80 layers, TP 8) to a 70B
    Llama config on meta vs building the meta model; plus ``sl.plan`` times.

Step times are medians over interleaved runs (eager, scheduled, eager, ...) after warm-up, so drift
on a shared machine hits both sides alike. Run: ``python benchmarks/engine_bench.py [--quick]``
(``--json out.json`` writes the figures).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import slapo_lab as sl


def megatron_tp(sch) -> None:
    """Full Megatron tensor parallelism on every block (the editor's preset; embeddings stay replicated)."""
    sl.presets.megatron_tp(sch, vocab_parallel=False)


def make_step(model, ids):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        opt.zero_grad(set_to_none=True)
        out = model(input_ids=ids).last_hidden_state
        loss = out.float().pow(2).mean()
        loss.backward()
        opt.step()

    return step


def interleaved(steps: dict, reps: int, warmup: int) -> dict:
    """Median seconds per step of each callable, runs interleaved round-robin (order alternating)."""
    names = list(steps)
    for _ in range(warmup):
        for n in names:
            steps[n]()
    times = {n: [] for n in names}
    for r in range(reps):
        order = names if r % 2 == 0 else names[::-1]
        for n in order:
            t0 = time.perf_counter()
            steps[n]()
            times[n].append(time.perf_counter() - t0)
    return {n: statistics.median(v) for n, v in times.items()}


def bench_overhead(quick: bool) -> dict:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(
        num_hidden_layers=4,
        hidden_size=256,
        num_attention_heads=4,
        intermediate_size=1024,
        vocab_size=8000,
        max_position_embeddings=128,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    eager = BertModel(cfg).train()
    plain = copy.deepcopy(eager)
    sl.create_schedule(plain)  # world size 1, no primitives
    tp1 = copy.deepcopy(eager)
    megatron_tp(sl.create_schedule(tp1, world_size=1))
    ids = torch.randint(0, cfg.vocab_size, (4, 128))
    med = interleaved(
        {
            "eager": make_step(eager, ids),
            "schedule_ws1": make_step(plain, ids),
            "tp_schedule_ws1": make_step(tp1, ids),
        },
        reps=10 if quick else 40,
        warmup=3,
    )
    return {
        "config": "BERT 4x256, batch 4, seq 128, AdamW step",
        "eager_step_s": med["eager"],
        "ratio_schedule_ws1_vs_eager": med["schedule_ws1"] / med["eager"],
        "ratio_tp_schedule_ws1_vs_eager": med["tp_schedule_ws1"] / med["eager"],
    }


class SavedBytes:
    """Bytes of unique storages saved for backward while active (parameters and buffers excluded)."""

    def __init__(self, tensors) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in tensors}
        self.seen: dict[int, int] = {}

    def pack(self, t):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr and ptr not in self.skip:
            self.seen[ptr] = max(self.seen.get(ptr, 0), st.nbytes())
        return t

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def saved_bytes(model, ids) -> int:
    rec = SavedBytes(list(model.parameters()) + list(model.buffers()))
    with torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
        out = model(input_ids=ids).last_hidden_state
        loss = out.float().pow(2).mean()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return rec.total


def bench_checkpoint(quick: bool) -> dict:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    layers = 12
    cfg = BertConfig(
        num_hidden_layers=layers,
        hidden_size=768,
        num_attention_heads=12,
        intermediate_size=3072,
        max_position_embeddings=512,
    )
    batch, seq = (2, 128) if quick else (4, 128)
    eager = BertModel(cfg).train()
    ckpt = copy.deepcopy(eager)
    sch = sl.create_schedule(ckpt)
    for i in range(layers):
        sch[f"encoder.layer.{i}"].checkpoint()
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    bytes_eager = saved_bytes(eager, ids)
    bytes_ckpt = saved_bytes(ckpt, ids)
    med = interleaved(
        {"eager": make_step(eager, ids), "checkpoint": make_step(ckpt, ids)}, reps=3 if quick else 7, warmup=1
    )
    # the planner's two activation counts (one meta forward each) for the same two models
    sch_eager = sl.create_schedule(copy.deepcopy(eager))
    est_eager = sl.plan(sch_eager, example_inputs={"input_ids": ids})
    est_ckpt = sl.plan(sch, example_inputs={"input_ids": ids})
    a_e = est_eager.per_stage[0]["activation_bytes"]
    a_c = est_ckpt.per_stage[0]["activation_bytes"]
    ag_eager = sl.plan(sch_eager, example_inputs={"input_ids": ids}, activation="autograd")
    ag_ckpt = sl.plan(sch, example_inputs={"input_ids": ids}, activation="autograd")
    return {
        "config": f"BERT-base 12x768, batch {batch}, seq {seq}, AdamW step, checkpoint on every layer",
        "saved_bytes_eager": bytes_eager,
        "saved_bytes_checkpoint": bytes_ckpt,
        "ratio_saved_bytes_checkpoint_vs_eager": bytes_ckpt / bytes_eager,
        "eager_step_s": med["eager"],
        "ratio_step_checkpoint_vs_eager": med["checkpoint"] / med["eager"],
        "plan_estimate_eager": a_e,
        "plan_estimate_checkpoint": a_c,
        "ratio_plan_estimate_vs_measured_eager": a_e / bytes_eager,
        "ratio_plan_estimate_vs_measured_checkpoint": a_c / bytes_ckpt,
        "ratio_plan_autograd_vs_measured_eager": ag_eager.per_stage[0]["activation_bytes"] / bytes_eager,
        "ratio_plan_autograd_vs_measured_checkpoint": ag_ckpt.per_stage[0]["activation_bytes"] / bytes_ckpt,
        "plan_estimate_pass_s": est_eager.activation_seconds,
        "plan_autograd_pass_s": ag_eager.activation_seconds,
    }


def bench_llama70b(quick: bool) -> dict:
    from editor_bench import llama70b  # the same 70B config the editor benchmark uses

    layers = 80

    def build():
        return llama70b(layers)

    build()  # warm imports
    builds, tps = [], []
    sch = None
    for _ in range(1 if quick else 2):
        t0 = time.perf_counter()
        model = build()
        builds.append(time.perf_counter() - t0)
        sch = sl.create_schedule(model, world_size=8)
        t0 = time.perf_counter()
        megatron_tp(sch)
        tps.append(time.perf_counter() - t0)
    sl.plan(sch)
    t0 = time.perf_counter()
    pl = sl.plan(sch, param_dtype=torch.bfloat16, master_weights=True)
    plan_s = time.perf_counter() - t0
    result = {
        "config": "Llama 70B (80 x 8192, 64 heads, 8 KV heads, 28672 FFN, vocab 32000), meta, TP 8",
        "build_meta_s": statistics.median(builds),
        "apply_tp_s": statistics.median(tps),
        "ratio_apply_tp_vs_build": statistics.median(tps) / statistics.median(builds),
        "primitive_calls": len(sch.record.calls),
        "plan_params_s": plan_s,
        "per_rank_bytes_bf16_adam": pl.total_bytes,
    }
    if not quick:
        ids = torch.zeros(1, 4096, dtype=torch.long)
        for method in ("estimate", "autograd"):
            kw = {
                "param_dtype": torch.bfloat16,
                "master_weights": True,
                "activation_dtype": torch.bfloat16,
                "example_inputs": {"input_ids": ids, "use_cache": False},
                "activation": method,
            }
            t0 = time.perf_counter()
            pa = sl.plan(sch, **kw)
            result[f"plan_{method}_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            sl.plan(sch, **kw)
            result[f"plan_{method}_cached_s"] = time.perf_counter() - t0
            result[f"activation_bytes_{method}_seq4096"] = pa.per_stage[0]["activation_bytes"]
    return result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, smaller batch (a smoke run)")
    ap.add_argument("--only", choices=("a", "b", "c"), action="append", help="run only these parts")
    ap.add_argument("--json", help="write the figures to this file")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: steadier ratios on a shared machine)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    parts = args.only or ["a", "b", "c"]
    results = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    fns = {
        "a": ("overhead", bench_overhead),
        "b": ("checkpoint", bench_checkpoint),
        "c": ("llama70b", bench_llama70b),
    }
    for p in parts:
        name, fn = fns[p]
        t0 = time.perf_counter()
        results[name] = fn(args.quick)
        results[name]["bench_wall_s"] = time.perf_counter() - t0
        print(f"({p}) {name}:", flush=True)
        for k, v in results[name].items():
            print(f"    {k}: {v:.4g}" if isinstance(v, float) else f"    {k}: {v}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
