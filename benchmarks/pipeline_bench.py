"""Pipeline runtimes compared: PyTorch (``torch.distributed.pipelining``, 1F1B) vs DeepSpeed (``PipelineModule``).

The same model (HF GPT-2 with its tied LM head), the same cut (after ``transformer.h.<L/2-1>``: PP=2),
the same batches, micro-batches and SGD optimizer, on 2 CPU ranks (gloo, 127.0.0.1). Both pipelines
are built in one run from two identical copies; their training steps are timed *interleaved*
(torch, DeepSpeed, torch, ...) after warm-up, so drift on a shared machine hits both alike. Reported:
the median step time of each runtime and their ratio ``torch / deepspeed`` (< 1: torch faster), and
both runtimes' losses at every step (they should agree to ~1e-6: same math, different schedules).

Run: ``python benchmarks/pipeline_bench.py [--quick] [--json out.json]`` (it launches torchrun on 2
local ranks itself, bounded by ``--timeout``); DeepSpeed must be installed
(``DS_BUILD_OPS=0 pip install deepspeed``; its first initialisation compiles a shm op, ~1 min).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _config(quick: bool) -> dict:
    if quick:
        return {
            "layers": 4,
            "hidden": 64,
            "heads": 4,
            "vocab": 256,
            "seq": 32,
            "batch": 8,
            "n_mb": 4,
            "warmup": 2,
            "steps": 6,
        }
    return {
        "layers": 4,
        "hidden": 128,
        "heads": 4,
        "vocab": 1024,
        "seq": 64,
        "batch": 16,
        "n_mb": 4,
        "warmup": 2,
        "steps": 10,
    }


def worker(args) -> int:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers import logging as hf_logging

    import slapo_lab as sl
    from slapo_lab.pipeline import build_pipeline

    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    cfg = _config(args.quick)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    hf = GPT2Config(
        n_layer=cfg["layers"],
        n_embd=cfg["hidden"],
        n_head=cfg["heads"],
        vocab_size=cfg["vocab"],
        n_positions=cfg["seq"],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    base = GPT2LMHeadModel(hf)
    cut = f"transformer.h.{cfg['layers'] // 2 - 1}"

    def lm_loss(logits, labels):
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))

    g = torch.Generator().manual_seed(7)
    batches = [
        torch.randint(1, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
        for _ in range(cfg["warmup"] + cfg["steps"])
    ]
    built = {}
    build_s = {}
    for target in ("torch", "deepspeed"):
        sch = sl.create_schedule(copy.deepcopy(base))
        sch[cut].cut_pipeline_stage()
        t0 = time.perf_counter()
        built[target] = build_pipeline(
            sch,
            target,
            example_inputs=(batches[0],),
            loss_fn=lm_loss,
            schedule="1F1B",
            n_microbatches=cfg["n_mb"],
            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05),
        )
        build_s[target] = time.perf_counter() - t0
    times = {"torch": [], "deepspeed": []}
    losses = {"torch": [], "deepspeed": []}
    for i, ids in enumerate(batches):
        for target in ("torch", "deepspeed"):
            dist.barrier()
            t0 = time.perf_counter()
            loss = built[target].train_step(ids, target=ids)
            dist.barrier()
            dt = time.perf_counter() - t0
            losses[target].append(loss)
            if i >= cfg["warmup"]:
                times[target].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {
        "model": f"GPT2LMHeadModel {cfg['layers']} layers, hidden {cfg['hidden']}, vocab {cfg['vocab']}, "
        f"seq {cfg['seq']}, batch {cfg['batch']} in {cfg['n_mb']} micro-batches, cut after {cut}",
        "ranks": dist.get_world_size(),
        "steps_timed": cfg["steps"],
        "torch_step_s": round(med["torch"], 5),
        "deepspeed_step_s": round(med["deepspeed"], 5),
        "ratio_torch_over_deepspeed": round(med["torch"] / med["deepspeed"], 3),
        "build_s": {k: round(v, 2) for k, v in build_s.items()},
        "loss_torch": [round(x, 6) for x in losses["torch"]],
        "loss_deepspeed": [round(x, 6) for x in losses["deepspeed"]],
        "max_loss_diff": max(abs(a - b) for a, b in zip(losses["torch"], losses["deepspeed"], strict=False)),
    }
    if rank == 0:
        print("BENCH " + json.dumps(res), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def launch(args) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    if Path("/sys/class/net/lo").exists():
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        str(Path(__file__).resolve()),
        "--worker",
    ] + (["--quick"] if args.quick else [])
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        print(out[-4000:])
        print(f"pipeline_bench: timed out after {args.timeout} s", file=sys.stderr)
        return 1
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    line = next((ln for ln in out.splitlines() if ln.startswith("BENCH ")), None)
    if line is None or proc.returncode:
        print(out[-4000:])
        return proc.returncode or 1
    res = json.loads(line[len("BENCH ") :])
    print(json.dumps(res, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller model and fewer steps")
    ap.add_argument("--json", help="write the figures to this file")
    ap.add_argument("--timeout", type=int, default=300, help="seconds before the torchrun launch is killed")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    return worker(args) if args.worker else launch(args)


if __name__ == "__main__":
    sys.exit(main())
