"""An exported training script's step vs a hand-written Hugging Face loop, same model, same run.

The script (``slapo_lab.export.render_script`` for a BERT encoder, one process, no schedule calls) is
loaded as a module and its one call, ``slapo_lab.train.main`` (with ``--no-verify``), runs a few steps at a
time (its printed per-step samples/s give the step times: they cover drawing the synthetic batch, forward,
loss, backward, the global gradient norm and clipping, the optimizer and learning-rate scheduler steps and
zero_grad, as the runtime times them). The hand loop is what one writes without slapo-lab: the same
``BertModel`` built from the same config, ``torch.autocast`` when ``--bf16``, the same probe loss (mean
squared projection of the last hidden state onto a fixed unit vector made once), AdamW at the script's
default lr with linear decay, ``clip_grad_norm_`` at the script's default 1.0, the batch drawn inside the
step. The two alternate in short rounds (script, hand, script, ...; the script's first step of a round,
right after it built its model, is not counted) so drift on a shared machine hits both alike; the CPU runs
one thread. Reported: the median step time of each and ``script / hand`` (> 1: the script is slower).

Run: ``python benchmarks/script_bench.py [--quick] [--bf16] [--json out.json]`` (CPU; on a GPU machine
add ``--device cuda``). Figures on the CPU say nothing about GPU launch/sync overheads (a host wait
costs nothing when the host does the compute), which is where issue 10's 13-18 % gap on an H100 came
from; see the report for what the script changed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import statistics
import time
import warnings

STEP = re.compile(r"^step \d+/\d+ loss \S+ \| .*?\| ([\d.]+) samples/s", re.MULTILINE)


def _config(quick: bool) -> dict:
    if quick:
        return {
            "layers": 2,
            "hidden": 128,
            "heads": 4,
            "ffn": 512,
            "seq": 64,
            "batch": 4,
            "rounds": 10,
            "steps": 2,
        }
    return {
        "layers": 4,
        "hidden": 256,
        "heads": 4,
        "ffn": 1024,
        "seq": 128,
        "batch": 8,
        "rounds": 20,
        "steps": 2,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast in both loops")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")

    import torch
    from transformers import BertConfig, BertModel
    from transformers import logging as hf_logging

    import slapo_lab.train
    from slapo_lab.export import input_spec, model_spec, render_script

    hf_logging.set_verbosity_error()
    if args.device == "cpu":
        torch.set_num_threads(1)  # one core each step: less sensitive to other work on a shared machine
    os.environ.pop("RANK", None)  # one process of its own, without a launcher
    cfg = _config(args.quick)
    hf = BertConfig(
        num_hidden_layers=cfg["layers"],
        hidden_size=cfg["hidden"],
        num_attention_heads=cfg["heads"],
        intermediate_size=cfg["ffn"],
        vocab_size=1000,
        max_position_embeddings=cfg["seq"],
    )
    model = BertModel(hf)
    ids = torch.randint(0, 1000, (cfg["batch"], cfg["seq"]))
    text = render_script(model_spec(model), [], input_spec({"input_ids": ids}, 1000), world_size=1)
    ns = {"__name__": "exported"}
    exec(compile(text, "train.py", "exec"), ns)  # noqa: S102 - the generated script is what is measured
    opts = ["--device", args.device, "--steps", str(cfg["steps"]), "--no-verify", "--progress", "off"] + (
        ["--bf16"] if args.bf16 else []
    )
    device = "cuda:0" if args.device == "cuda" else "cpu"

    def script_round() -> list[float]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = slapo_lab.train.main(
                model=ns["MODEL"],
                schedule=ns["schedule"],
                inputs=ns["INPUTS"],
                tp=ns["TP"],
                stages=ns["STAGES"],
                defaults=ns["DEFAULTS"],
                argv=opts,
            )
        assert rc == 0, out.getvalue()
        return [cfg["batch"] / float(s) for s in STEP.findall(out.getvalue())]

    lr, max_norm = 1e-4, 1.0  # the script's defaults (--lr, --max-grad-norm)
    torch.manual_seed(0)
    hand = BertModel(hf).to(device).train()
    opt = torch.optim.AdamW(hand.parameters(), lr=lr)
    probe = torch.randn(cfg["hidden"], generator=torch.Generator().manual_seed(0))
    probe = (probe / probe.norm()).to(device)

    def hand_round() -> list[float]:
        times = []
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: max(0.0, 1 - step / cfg["steps"]))
        for step in range(cfg["steps"]):
            if args.device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            batch = torch.randint(
                0, 1000, (cfg["batch"], cfg["seq"]), generator=torch.Generator().manual_seed(step)
            ).to(device)
            with torch.autocast(device_type=args.device, dtype=torch.bfloat16, enabled=args.bf16):
                hidden = hand(input_ids=batch).last_hidden_state
                loss = (hidden.float() @ probe).square().mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(hand.parameters(), max_norm)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            loss.item()
            if args.device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return times

    script_round(), hand_round()  # warm-up
    script_times, hand_times = [], []
    for _ in range(cfg["rounds"]):
        script_times += script_round()[1:]  # each round rebuilds the model: skip its first step
        hand_times += hand_round()[1:]
    s, h = statistics.median(script_times), statistics.median(hand_times)
    result = {
        "config": cfg,
        "bf16": args.bf16,
        "device": args.device,
        "script_step_s": s,
        "hand_step_s": h,
        "ratio_script_over_hand": s / h,
        "samples": [len(script_times), len(hand_times)],
        "torch_threads": torch.get_num_threads(),
    }
    print(
        f"BERT {cfg['layers']} layers, hidden {cfg['hidden']}, batch {cfg['batch']} x {cfg['seq']}, "
        f"{'bf16 autocast' if args.bf16 else 'fp32'}, {args.device}: exported script {s * 1e3:.1f} ms/step, "
        f"hand HF loop {h * 1e3:.1f} ms/step, script / hand = {s / h:.3f} "
        f"(medians of {len(script_times)} and {len(hand_times)} steps)"
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
