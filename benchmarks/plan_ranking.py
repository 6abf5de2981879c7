"""Step-time ranking on this machine (issue 26, "Step-time ranking"): after :func:`slapo_lab.calibrate`, ten
layouts of one model on 2 gloo ranks, the same global batch, predicted step time against the measured median.

The model and the way each layout is built are ``benchmarks/plan_memory_ranks.py``'s (a 56 M Llama, fp32 AdamW,
the project's schedule, Megatron preset, ``build_pipeline``, DDP / FSDP2 / ZeRO-1). Each rank runs on one thread
(``torch.set_num_threads(1)``), and the calibration runs on one thread too, so the device profile is one rank's.
Measured: one warm-up step, then ``--steps`` steps, each timed between two barriers; the median per layout (the
slower rank). Predicted: :func:`slapo_lab.estimate`'s ``step_time_s`` on a cluster of one node of 2 calibrated
devices. Prints each layout's predicted and measured seconds and their ratio, the Spearman rank correlation
(computed here from the ranks: no scipy), and the planner's pick (the fastest predicted) against the fastest
measured. Goal: Spearman >= 0.7, pick within 15 % of the best.

Run: ``.venv/bin/python benchmarks/plan_ranking.py [--seq 128] [--steps 3]``.

NOT MET yet (2026-11-26, two shared cores, load average 6-15): Spearman -0.49, the pick (fsdp, mbs 2) 2.32x the
best measured (pp 2 1F1B, 4 micro-batches). The predictions are 1.0-3.5x the measured steps and dominated by the
memory-bound roofline term: the calibrated bandwidth (a 256 MiB clone on one thread: 1.9 GB/s) prices every
elementwise op as if it left the cache, so layouts that move more activation bytes per rank (TP's replicated
norms and logits, PP's extra micro-batches) rank slowest while they measure fastest; and DDP's gradient
all-reduce is priced as hidden behind backward, which gloo on one CPU thread does not do.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import plan_memory_ranks as pm  # the model, the layouts' builder, the spawn

Case = pm.Case
GLOBAL_BATCH = 4
CASES = [
    Case("ddp_mbs1_m2", dp=2, micro=2),
    Case("ddp_mbs2", dp=2, micro_batch_size=2),
    Case("ddp_mbs2_ckpt", dp=2, micro_batch_size=2, checkpoint="all"),
    Case("fsdp_mbs2", dp=2, shard="fsdp", micro_batch_size=2),
    Case("zero1_mbs2", dp=2, shard="zero1", micro_batch_size=2),
    Case("tp_mbs4", tp=2, micro_batch_size=4),
    Case("tp_mbs1_m4", tp=2, micro=4),
    Case("tp_mbs4_ckpt", tp=2, micro_batch_size=4, checkpoint="all"),
    Case("pp_1f1b_mbs1_m4", pp=2, micro=4),
    Case("pp_gpipe_mbs2_m2", pp=2, pp_schedule="GPipe", micro_batch_size=2, micro=2),
]


def ranks(xs: list[float]) -> list[float]:
    """Average ranks (1-based; ties share the mean of their positions)."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rho: Pearson's correlation of the ranks."""
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    return cov / (va * vb) ** 0.5


def main() -> None:
    import dataclasses
    import json

    import slapo_lab as sl

    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per layout and round")
    ap.add_argument("--rounds", type=int, default=3, help="round-robin passes over the layouts")
    ap.add_argument("--json", default=None, help="write the calibrated profile and the measured times here")
    ap.add_argument("--replay", default=None, help="price again a --json file's profile and times (no run)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    saved = json.loads(Path(args.replay).read_text()) if args.replay else None
    if saved:
        prof = saved["profile"]
        prof["memory_curve"] = tuple(tuple(x) for x in prof["memory_curve"])
        prof["collective_scale"] = tuple(tuple(x) for x in prof["collective_scale"])
        dev = sl.DeviceProfile(**prof)
        args.seq = saved["seq"]
    else:
        dev = sl.calibrate()
    curve = ", ".join(f"{n >> 10} KiB {v / 1e9:.0f}" for n, v in dev.memory_curve)
    scale = ", ".join(f"{k} {v:.1f}x" for k, v in dev.collective_scale)
    print(
        f"calibrated (1 thread): fp32 {dev.fp32_flops / 1e9:.1f} GFLOP/s, memory {dev.hbm_bandwidth / 1e9:.1f} GB/s "
        f"(by working set, GB/s: {curve}), op {dev.op_overhead * 1e6:.1f} us, gloo {dev.intra_bandwidth / 1e9:.2f} "
        f"GB/s + {dev.intra_latency * 1e6:.0f} us ({scale} a ring), overlap {dev.comm_overlap:.2f} "
        f"({time.perf_counter() - t0:.0f} s)"
    )
    cluster = sl.Cluster(nodes=1, gpus_per_node=pm.WORLD, gpu=dev)
    with torch.device("meta"):
        ref = pm.build()
    ests = {}
    for c in CASES:
        assert c.micro_batch_size * c.dp * c.micro == GLOBAL_BATCH, c
        ests[c.name] = sl.estimate(
            ref, c.layout(), cluster=cluster, seq_len=args.seq, global_batch_size=GLOBAL_BATCH, dtype="fp32"
        )
    if saved:
        res, load0, load1 = saved["results"], saved["load"][0], saved["load"][1]
    else:
        # round-robin: every round builds and times each layout once, so that load drifts hit all layouts alike
        runs = [replace(c, name=f"{c.name}@{r}") for r in range(args.rounds) for c in CASES]
        blocks = {c.name: ests[c.name.split("@")[0]].stage_blocks for c in runs}
        load0 = Path("/proc/loadavg").read_text().split()[:3]
        got = pm.spawn(runs, args.seq, blocks, timed=args.steps)
        load1 = Path("/proc/loadavg").read_text().split()[:3]
        res = {c.name: [] for c in CASES}
        for c in runs:
            base = res[c.name.split("@")[0]]
            for rank, row in enumerate(got[c.name]):
                if len(base) <= rank:
                    base.append({"times": []})
                if "error" in row:
                    base[rank]["error"] = row["error"]
                base[rank]["times"] += row.get("times", [])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {
                        "profile": dataclasses.asdict(dev),
                        "seq": args.seq,
                        "results": res,
                        "load": [load0, load1],
                    },
                    f,
                    indent=1,
                )
    print(f"{'case':<18} {'layout':<60} {'pred s':>8} {'meas s':>8} {'ratio':>6} {'min s':>6}")
    pred, meas, low, names = [], [], [], []
    for c in CASES:
        rows = res[c.name]
        err = next((r["error"] for r in rows if "error" in r), None)
        if err:
            print(f"{c.name:<18} failed: {err}")
            continue
        steps = [max(ts) for ts in zip(*(r["times"] for r in rows), strict=True)]
        m = statistics.median(steps)
        p = ests[c.name].step_time_s
        names.append(c.name)
        pred.append(p)
        meas.append(m)
        low.append(min(steps))
        parts = ", ".join(f"{k} {v:.2f}" for k, v in ests[c.name].time_parts.items() if v)
        print(
            f"{c.name:<18} {c.layout().describe():<60} {p:>8.3f} {m:>8.3f} {p / m:>6.2f} {min(steps):>6.3f}  {parts}"
        )
    rho = spearman(pred, meas)
    pick = min(range(len(pred)), key=lambda i: pred[i])
    best = min(range(len(meas)), key=lambda i: meas[i])
    print(
        f"\n{len(names)} layouts, global batch {GLOBAL_BATCH} x seq {args.seq}, {len(steps)} steps each: Spearman "
        f"{rho:.2f} (goal >= 0.7; against each layout's fastest step {spearman(pred, low):.2f}); planner's pick "
        f"{names[pick]} measured {meas[pick]:.3f} s = {meas[pick] / meas[best]:.2f}x the best measured "
        f"({names[best]}, {meas[best]:.3f} s; goal <= 1.15); {time.perf_counter() - t0:.0f} s; "
        f"load average {' '.join(load0)} before, {' '.join(load1)} after"
    )


if __name__ == "__main__":
    main()
