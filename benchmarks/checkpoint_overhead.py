"""What each activation-checkpointing policy costs a forward + backward, and where the time goes.

A Llama from ``benchmarks/gpu_check.py``'s sizes (``1b``: 1.1 B parameters, batch 4 x 2048 on CUDA; ``tiny``: batch
2 x 64 on a CPU), bf16 autocast over fp32 weights, one forward + backward (no optimizer), under: no checkpointing;
the project's ``checkpoint(policy="selective")`` on every block (torch's ``create_selective_checkpoint_contexts``
with :func:`slapo_lab.random.selective_policy`); the project's full checkpointing on every block; and
``torch.utils.checkpoint.checkpoint`` wrapped around every block by hand (the reference for full). Prints each
one's median of 6 timed passes after 2 warm-ups, its peak memory (CUDA), a ``torch.profiler`` table of its top
ops by device (CUDA) or CPU time, and the ratios to no checkpointing.

Run: ``.venv/bin/python benchmarks/checkpoint_overhead.py [1b|tiny]``.

On an H200 (2026-11-28, torch 2.11, the lent image): none 171.6 ms, selective 253.3 ms (1.48x), full 215.8 ms
(1.26x), full by hand 217.8 ms (1.27x); peak 28.1 / 18.3 / 17.8 / 21.9 GiB. The selective pass ran about the
same kernels as the full one, yet took 1.17x as long: the step waits on the host, whose selective-checkpoint mode
runs Python for every op of the forward and of the recomputation (``DeviceProfile.selective_op_overhead``, which
``calibrate`` measured at 19 us per op on that host, beside 10.6 us per kernel launch).
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_check import SIZES


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    import slapo_lab as sl
    from slapo_lab import presets

    size = sys.argv[1] if len(sys.argv) > 1 else "1b"
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    batch, seq = (4, 2048) if size == "1b" else (2, 64)
    cfg = LlamaConfig(**SIZES[size])
    torch.manual_seed(0)
    with torch.device(dev):
        base = LlamaForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=dev)

    def sync() -> None:
        if dev == "cuda":
            torch.cuda.synchronize()

    def scheduled(policy: str):
        sch = sl.create_schedule(copy.deepcopy(base))
        presets.checkpoint_blocks(sch, policy=policy, check=False)
        return sch.mod

    def by_hand():
        model = copy.deepcopy(base)
        for layer in model.model.layers:
            fwd = layer.forward

            def wrapped(*a, _fwd=fwd, **k):
                return checkpoint(_fwd, *a, use_reentrant=False, **k)

            layer.forward = wrapped
        return model

    variants = {
        "none": lambda: base,
        "selective": lambda: scheduled("selective"),
        "full": lambda: scheduled("full"),
        "full by hand": by_hand,
    }

    def step(model) -> None:
        with torch.autocast(dev, dtype=torch.bfloat16):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        for p in model.parameters():
            p.grad = None

    from torch.profiler import ProfilerActivity, profile

    medians = {}
    for name, make in variants.items():
        model = make()
        model.train()
        for _ in range(2):
            step(model)
        sync()
        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(6):
            t0 = time.perf_counter()
            step(model)
            sync()
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else float("nan")
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
        with profile(activities=acts) as prof:
            step(model)
            sync()

        def spent(e) -> float:
            if dev == "cuda":
                return getattr(e, "self_device_time_total", 0) or 0
            return e.self_cpu_time_total

        medians[name] = sorted(times)[len(times) // 2]
        print(
            f"== {name}: median forward + backward {medians[name] * 1e3:.1f} ms, peak {peak:.2f} GiB",
            flush=True,
        )
        for e in sorted(prof.key_averages(), key=spent, reverse=True)[:12]:
            print(f"   {e.key[:60]:<60} {spent(e) / 1e3:9.1f} ms  x{e.count}")
        del model
        if dev == "cuda":
            torch.cuda.empty_cache()
    print(", ".join(f"{k} {v / medians['none']:.2f}x" for k, v in medians.items()))


if __name__ == "__main__":
    main()
