"""The editor's live numeric check when changes land while a check runs (the browser walkthrough's sequence).

GPT-2 with its 50257-token vocabulary (4 layers, width 64) on 2 nodes x 2 GPUs: TP 2 from the cluster control,
the Megatron preset, checkpoint every block, 2 pipeline stages -- five changes, each made while the previous
change's check is running (the next one lands ``--gap`` seconds after the check started). Reported, per
repeat: the time from the last change until the last schedule's result is shown, and that result; as a ratio
against a baseline measured in the same process: one uninterrupted ``numeric_check`` of the final schedule.

Usage: python benchmarks/live_check_bench.py [--repeats 5] [--gaps 0.05,0.3,1.0]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time


def _model():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=50257, n_positions=64))
    return model, {"input_ids": torch.randint(0, 50257, (2, 16))}


def _burst(gap: float, timeout: float) -> tuple[float, str, int]:
    """One editor through the five changes; returns (seconds from the last change to its result, status,
    rank threads left alive)."""
    import slapo_lab as sl

    model, inputs = _model()
    ed = sl.ScheduleEditor(model, example_inputs=inputs, world_size=4, live_check=True)
    steps = [
        lambda: ed.set_cluster(2, 2),
        lambda: ed.set_tp(2),
        lambda: ed.apply_preset("megatron"),
        lambda: ed.apply_preset("checkpoint"),
        lambda: ed.apply_preset("stages", 2),
    ]
    for i, step in enumerate(steps):
        step()
        if i + 1 < len(steps):
            end = time.monotonic() + 30
            while "running on" not in ed._numeric_box.value and time.monotonic() < end:
                time.sleep(0.005)
            time.sleep(gap)
    t0 = time.perf_counter()
    end = time.monotonic() + timeout
    while ed.numeric_report is None and time.monotonic() < end:
        time.sleep(0.01)
    seconds = time.perf_counter() - t0
    status = ed.numeric_report.status if ed.numeric_report is not None else f"none after {timeout:.0f} s"
    ed.wait_background(timeout)
    alive = sum(t.name.startswith("slapo-rank") for t in threading.enumerate())
    return seconds, status, alive


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--gaps", default="0.05,0.3,1.0", help="seconds after a check starts before the next change"
    )
    ap.add_argument("--timeout", type=float, default=120.0)
    args = ap.parse_args()

    import slapo_lab as sl
    from slapo_lab.numeric import numeric_check

    model, inputs = _model()
    ed = sl.ScheduleEditor(model, example_inputs=inputs, world_size=4, live_check=False)
    ed.set_cluster(2, 2)
    ed.set_tp(2)
    for preset, k in (("megatron", 1), ("checkpoint", 1), ("stages", 2)):
        ed.apply_preset(preset, k)
    calls = list(ed.schedule.record.calls)
    base = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        report = numeric_check(model, calls, 2, inputs)
        base.append(time.perf_counter() - t0)
        assert report.passed, report.message
    b = statistics.median(base)
    print(f"baseline: one uninterrupted check of the final schedule, median {b:.2f} s ({report.message})")
    for gap in (float(g) for g in args.gaps.split(",")):
        runs = [_burst(gap, args.timeout) for _ in range(args.repeats)]
        secs = [s for s, _st, _a in runs]
        statuses = sorted({st for _s, st, _a in runs})
        alive = max(a for _s, _st, a in runs)
        print(
            f"gap {gap:.2f} s: last result after median {statistics.median(secs):.2f} s "
            f"(x{statistics.median(secs) / b:.2f} of the baseline), max {max(secs):.2f} s "
            f"(x{max(secs) / b:.2f}); results {statuses}; rank threads left alive: {alive}"
        )


if __name__ == "__main__":
    main()
