"""Peak memory per rank of an exported training script: one process vs tensor parallelism on 2 ranks.

A 220 M-parameter Llama (hidden 1024, 12 layers, vocabulary 32,000) built from its config, scheduled with
the Megatron preset (every projection, the embedding and the LM head split over 2 ranks) and exported;
both runs train 3 AdamW steps on synthetic inputs of 4 x 128 tokens (micro-batches of 1) on the CPU. The figure is the peak
resident set above the process's start-up baseline (the runtime's ``peak mem`` column of metrics.csv,
rank 0; the runtime restarts it after Verify), so imports do not count; the baseline of the ratio is the
one-process run measured in the same invocation. Run with Verify off and on; with it on, Verify's own peak
(its report: the scheduled model next to the FSDP2-sharded reference) is printed too.

    python benchmarks/train_memory_bench.py            # prints the figures and the ratios
"""

from __future__ import annotations

import argparse
import csv
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.harness import child_env, torchrun_argv
from tests.train_fixtures import meta_model

CONFIG = {
    "hidden_size": 1024,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "intermediate_size": 2816,
    "vocab_size": 32000,
    "max_position_embeddings": 256,
}


def export(folder: Path) -> dict[str, Path]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import slapo_lab as sl

    config = LlamaConfig(**CONFIG)
    with sl.init_empty_weights():
        model = LlamaForCausalLM(config)
    ids = torch.zeros(4, 128, dtype=torch.long)
    out = {}
    for name, tp in (("one", 1), ("tp2", 2)):
        sch = sl.create_schedule(meta_model("LlamaForCausalLM", config), world_size=tp)
        if tp > 1:
            sl.presets.megatron_tp(sch)
        out[name] = sl.export_script(
            folder / f"train_{name}.py", model, sch.record.calls, {"input_ids": ids}, world_size=tp
        )
    n = sum(p.numel() for p in model.parameters())
    print(f"model: LlamaForCausalLM, {n / 1e6:.1f} M parameters")
    return out


def peak_mib(
    script: Path, nproc: int, verify: bool, log_dir: Path, env: dict | None = None
) -> tuple[float, float | None]:
    """(training's peak from metrics.csv, Verify's peak from its report or None), rank 0, MiB."""
    args = [
        "--device",
        "cpu",
        "--steps",
        "3",
        "--micro-batch-size",
        "1",
        "--log-dir",
        str(log_dir),
        "--verify" if verify else "--no-verify",
    ]
    if nproc == 1:
        cmd = [sys.executable, str(script), *args]
    else:
        cmd = torchrun_argv(script, nproc, args)
    proc = subprocess.run(
        cmd, cwd=ROOT, env=child_env(**(env or {})), capture_output=True, text=True, check=False, timeout=1800
    )
    if proc.returncode != 0:
        raise SystemExit(f"{script.name} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    with open(log_dir / "metrics.csv", newline="") as f:
        train = max(float(r["peak_mem_mib"]) for r in csv.DictReader(f) if r["peak_mem_mib"])
    found = re.search(r"Verify's peak memory (\d+) MiB", proc.stdout)
    return train, float(found.group(1)) if found else None


# glibc raises its mmap threshold as large blocks are freed, then keeps freed heap pages: the resident set
# then also counts memory no tensor holds. A fixed threshold returns freed tensors to the system, so the
# resident set follows the tensors (the one-process and TP2 live tensors measure 0.50 of each other).
TRIM = "MALLOC_MMAP_THRESHOLD_=65536"


def main() -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    with tempfile.TemporaryDirectory(prefix="slapo-mem-") as d:
        d = Path(d)
        scripts = export(d)
        for label, env, verify in (
            ("glibc default", {}, False),
            (TRIM, {"MALLOC_MMAP_THRESHOLD_": "65536"}, False),
            (TRIM, {"MALLOC_MMAP_THRESHOLD_": "65536"}, True),
        ):
            tag = f"{len(env)}_{verify}"
            one, one_v = peak_mib(scripts["one"], 1, verify, d / f"one_{tag}", env)
            tp2, tp2_v = peak_mib(scripts["tp2"], 2, verify, d / f"tp2_{tag}", env)
            print(
                f"training, Verify {'on ' if verify else 'off'}, {label}: peak RSS above start-up, rank 0: one "
                f"process {one:.0f} MiB, TP2 {tp2:.0f} MiB per rank -> ratio {tp2 / one:.2f} (goal <= 0.60)"
            )
            if verify:
                print(
                    f"Verify itself (its reference sharded over the ranks), {label}: one process {one_v:.0f} MiB, "
                    f"TP2 {tp2_v:.0f} MiB per rank -> ratio {tp2_v / one_v:.2f}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
