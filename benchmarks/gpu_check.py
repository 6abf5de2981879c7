"""The GPU check: calibrate the device, train a ~1B Llama with the exported script in bf16 with and without
``--compile``, and set its tokens/s, MFU and peak memory beside the planner's prediction and a hand-written
Hugging Face + AdamW loop on the same model and batch.

Run: ``bash benchmarks/gpu_check.sh`` on a machine with one CUDA GPU (it finishes in under 8 minutes on an
H100 or H200); ``bash benchmarks/gpu_check.sh --size tiny --device cpu`` is the same flow on a 10-layer model
on the CPU, which the test suite runs so that the check still works on the day a GPU is lent.

What it does, each step in a process of its own with a time limit, so that one failure leaves the others'
figures (every step writes ``<out>/<step>.json``; the report is ``<out>/report.md`` and ``report.json``):

1. ``env``: torch, CUDA, device name and the versions the figures come from.
2. ``calibrate``: :func:`slapo_lab.planner.calibrate` (achieved matmul FLOP/s by size, HBM copy bandwidth,
   gloo collectives between two local processes).
3. ``model``: a Llama of TinyLlama-1.1B's dimensions (``TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T``'s
   ``config.json``: hidden 2048, intermediate 5632, 22 layers, 32 heads, 4 key/value heads, vocabulary 32000;
   1.10 G parameters) built from ``LlamaConfig`` with seeded random weights and written with
   ``save_pretrained`` (fp32 safetensors); a byte-level BPE tokenizer trained with HF ``tokenizers`` on a real
   text file (the Python standard library's own source files, concatenated); and the exported training script
   (:func:`slapo_lab.export.render_script`, no schedule calls: one GPU, TP 1).
4. ``script`` and ``script_compile``: ``torchrun --nproc-per-node 1`` of that script (NCCL, ``--bf16``, the
   pretrained directory, the text file through HF ``datasets``; synthetic inputs where ``datasets`` cannot be
   imported), ``--steps`` optimizer steps of ``--batch`` sequences of ``--seq`` tokens; the eager run also runs
   the script's Verify first. Figures are the medians over the steps after the first ``--warmup`` ones, read from
   the run's ``metrics.csv`` (tokens/s, ``torch.cuda.max_memory_allocated`` MiB, MFU against the runtime's
   datasheet peak).
5. ``hand``: the loop one writes without slapo-lab, same directory, same batch shape: ``from_pretrained`` in fp32,
   ``torch.autocast(bfloat16)``, ``labels=input_ids``, ``clip_grad_norm_`` 1.0, ``torch.optim.AdamW`` at the
   script's default lr with linear decay; peak memory reset after the model is on the device, as the runtime
   does.
6. ``plan`` (run before the scripts): :func:`slapo_lab.planner.estimate` of the same layout (TP 1 x PP 1 x DP 1,
   no checkpointing, the batch as one micro-batch) on the built-in profile of this GPU and on the calibrated
   profile; the scripts get the built-in one's prediction (``--predicted-step-s`` / ``--predicted-peak-gib``) and
   print their measurements as ratios to it.

Every figure is measured in this one run, and the report gives the exported script against the hand loop and
the measurements against the predictions as ratios.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = (
    "env",
    "calibrate",
    "model",
    "plan",
    "script",
    "hand",
    "script_compile",
    "script_selective_eager",
    "script_selective",
)
#: TinyLlama-1.1B's config.json (hub id TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T), and a 10-layer one
#: for the CPU run of the suite.
SIZES = {
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 10,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
    },
}
LR, MAX_NORM = 1e-4, 1.0  # the exported script's --lr and --max-grad-norm defaults (slapo_lab.train.config)


def _save(out: Path, step: str, data: dict) -> None:
    (out / f"{step}.json").write_text(json.dumps(data, indent=2, default=str))


def _load(out: Path, step: str) -> dict | None:
    p = out / f"{step}.json"
    return json.loads(p.read_text()) if p.exists() else None


def _pythonpath() -> str:
    """The repository first, then whatever the caller had (carried wheels, for one)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


def _device(args) -> str:
    import torch

    return args.device or ("cuda" if torch.cuda.is_available() else "cpu")


# ---------------------------------------------------------------------------------------------------- the steps
def step_env(args, out: Path) -> dict:
    import torch
    import transformers

    info = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "cuda_available": torch.cuda.is_available(),
        "device": _device(args),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(
            gpu=torch.cuda.get_device_name(0),
            gpu_memory_gib=p.total_memory / 2**30,
            multiprocessors=p.multi_processor_count,
            cuda=torch.version.cuda,
            nccl=".".join(map(str, torch.cuda.nccl.version())),
        )
    try:
        import datasets

        info["datasets"] = datasets.__version__
    except Exception as err:  # noqa: BLE001 (any failure: the text run falls back to synthetic inputs)
        info["datasets"] = f"not importable: {type(err).__name__}: {err}"
    return info


def step_calibrate(args, out: Path) -> dict:
    import dataclasses

    from slapo_lab.planner import calibrate

    t0 = time.perf_counter()
    prof = calibrate(quick=args.size == "tiny")
    return {"profile": dataclasses.asdict(prof), "seconds": time.perf_counter() - t0}


def _corpus(path: Path, min_chars: int) -> int:
    """Concatenate the standard library's ``.py`` files (real text, present on every machine) into ``path``."""
    import sysconfig

    lib = Path(sysconfig.get_paths()["stdlib"])
    n = 0
    with path.open("w", encoding="utf-8") as f:
        for src in sorted(lib.glob("*.py")):
            try:
                text = src.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            for line in text.splitlines():
                if line.strip():
                    f.write(line + "\n")
                    n += len(line) + 1
            if n >= min_chars:
                break
    return n


def step_model(args, out: Path) -> dict:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from slapo_lab.export import input_spec, model_spec, render_script

    dev = _device(args)
    cfg = LlamaConfig(**SIZES[args.size])
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(dev):  # HF's init on the GPU: seconds, where the CPU takes a minute at 1.1 B
        model = LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    model_dir = out / "model"
    model.save_pretrained(model_dir)
    built = time.perf_counter() - t0

    # a real text file and a tokenizer trained on it (byte-level BPE, HF tokenizers)
    corpus = out / "corpus.txt"
    tokens_needed = args.steps * args.batch * args.seq + args.batch * args.seq
    chars = _corpus(corpus, 5 * tokens_needed)  # about 3 to 4 characters per BPE token on code
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, special_tokens=["</s>"], show_progress=False)
    tok.train([str(corpus)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")
    fast.save_pretrained(model_dir)

    ids = torch.zeros(args.batch, args.seq, dtype=torch.long)
    text = render_script(model_spec(model), [], input_spec({"input_ids": ids}, cfg.vocab_size), world_size=1)
    script = out / "train_llama.py"
    script.write_text(text)
    # the same model with every block under selective activation checkpointing (checkpoint(policy="selective"))
    import slapo_lab as sl
    from slapo_lab import presets

    with torch.device("meta"):
        sch = sl.create_schedule(LlamaForCausalLM(cfg))
    presets.checkpoint_blocks(sch, policy="selective", check=False)
    spec = input_spec({"input_ids": ids}, cfg.vocab_size)
    sac = out / "train_llama_sac.py"
    sac.write_text(render_script(model_spec(model), sch.record.calls, spec, world_size=1))
    return {
        "config": SIZES[args.size],
        "n_params": n_params,
        "build_and_save_s": built,
        "corpus_chars": chars,
        "tokenizer_vocab": tok.get_vocab_size(),
        "model_dir": str(model_dir),
        "script": str(script),
        "script_selective": str(sac),
    }


def _metrics(log_dir: Path, warmup: int) -> dict:
    rows = list(csv.DictReader((log_dir / "metrics.csv").open()))
    use = rows[warmup:] or rows

    def med(key):
        vals = [float(r[key]) for r in use if r.get(key) not in (None, "")]
        return statistics.median(vals) if vals else None

    return {
        "steps_logged": len(rows),
        "steps_used": len(use),
        "tokens_per_s": med("tokens_per_s"),
        "peak_mem_mib": max((float(r["peak_mem_mib"]) for r in rows if r.get("peak_mem_mib")), default=None),
        "mfu": med("mfu"),
        "loss_first": float(rows[0]["loss"]) if rows and rows[0].get("loss") else None,
        "loss_last": float(rows[-1]["loss"]) if rows and rows[-1].get("loss") else None,
        "columns": list(rows[0].keys()) if rows else [],
    }


#: the script runs: name -> (the script of the model step, --compile, Verify first, the plan's checkpoint policy)
RUNS = {
    "script": ("script", False, True, "none"),
    "script_compile": ("script", True, False, "none"),
    "script_selective_eager": ("script_selective", False, False, "selective"),
    "script_selective": ("script_selective", True, False, "selective"),
}


def _run_script(args, out: Path, name: str) -> dict:
    made = _load(out, "model")
    if made is None:
        raise RuntimeError("the model step did not finish, so there is no script to run")
    env_info = _load(out, "env") or {}
    dev = _device(args)
    which, compile_, verify, ckpt = RUNS[name]
    log_dir = out / f"logs_{name}"
    data = ["--data", str(out / "corpus.txt"), "--seq-len", str(args.seq)]
    if str(env_info.get("datasets", "")).startswith("not importable"):
        data = ["--data", "synthetic"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    cmd += [made[which], "--model-path", made["model_dir"], *data, "--device", dev, "--bf16"]
    cmd += [
        "--steps",
        str(args.steps),
        "--global-batch-size",
        str(args.batch),
        "--micro-batch-size",
        str(args.batch),
    ]
    cmd += ["--log-dir", str(log_dir), "--progress", "off", "--lr-schedule", "linear"]
    cmd += ["--compile"] + (["--compile-backend", "aot_eager"] if dev == "cpu" else []) if compile_ else []
    cmd += ["--verify"] if verify else ["--no-verify"]
    plan = _load(out, "plan") or {}
    pred = next((p for key, p in plan.items() if key.startswith("built-in")), None) or plan.get("calibrated")
    pred = pred and (pred if ckpt == "none" else pred[ckpt])
    if pred:  # the script prints its step times and peak memory as ratios to the plan's prediction
        cmd += [
            "--predicted-step-s",
            f"{pred['step_s']:.6f}",
            "--predicted-peak-gib",
            f"{pred['peak_live_mib'] / 1024:.3f}",
        ]
    t0 = time.perf_counter()
    proc = subprocess.run(
        cmd,
        check=False,
        capture_output=True,
        text=True,
        cwd=out,
        env={**os.environ, "PYTHONPATH": _pythonpath()},
    )
    wall = time.perf_counter() - t0
    (out / f"{name}.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
        raise RuntimeError(f"torchrun exited {proc.returncode}: " + " | ".join(tail))
    res = _metrics(log_dir, args.warmup)
    res.update(wall_s=wall, data=data[1], command=" ".join(cmd[cmd.index(made[which]) :]))
    res["verify_line"] = next(
        (ln for ln in proc.stdout.splitlines() if "Verify" in ln or "verif" in ln), None
    )
    res["plan_line"] = next(
        (ln for ln in proc.stdout.splitlines() if ln.startswith("measured / predicted")), None
    )
    return res


def step_script(args, out: Path) -> dict:
    return _run_script(args, out, "script")


def step_script_compile(args, out: Path) -> dict:
    return _run_script(args, out, "script_compile")


def step_script_selective_eager(args, out: Path) -> dict:
    return _run_script(args, out, "script_selective_eager")


def step_script_selective(args, out: Path) -> dict:
    return _run_script(args, out, "script_selective")


def step_hand(args, out: Path) -> dict:
    """The hand-written loop (see the module docstring); synthetic token ids of the script's shape."""
    import torch
    from transformers import LlamaForCausalLM

    made = _load(out, "model")
    if made is None:
        raise RuntimeError("the model step did not finish, so there is no model to load")
    dev = _device(args)
    cuda = dev == "cuda"
    model = LlamaForCausalLM.from_pretrained(made["model_dir"], dtype=torch.float32).to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / args.steps))
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for _ in range(args.steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=gen).to(dev)
        with torch.autocast(device_type=dev, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    use = times[args.warmup :] or times
    step = statistics.median(use)
    tokens = args.batch * args.seq
    n = sum(p.numel() for p in model.parameters())
    res = {"step_s": step, "tokens_per_s": tokens / step, "n_params": n, "loss_first": losses[0]}
    res["loss_last"] = losses[-1]
    if cuda:
        from slapo_lab.hardware import peak_tflops_for

        peak = peak_tflops_for(torch.cuda.get_device_name(0), "bf16")
        res["peak_mem_mib"] = torch.cuda.max_memory_allocated() / 2**20
        res["peak_reserved_mib"] = torch.cuda.max_memory_reserved() / 2**20
        res["mfu"] = 6 * n * tokens / step / (peak * 1e12) if peak else None
    return res


def step_plan(args, out: Path) -> dict:
    import dataclasses

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from slapo_lab.planner import Cluster, Layout, device_profile, estimate
    from slapo_lab.planner.devices import DeviceProfile

    env_info = _load(out, "env") or {}
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**SIZES[args.size]))
    layout = Layout(tp=1, pp=1, dp=1, micro_batch_size=args.batch, checkpoint="none")
    profiles = {}
    gpu = env_info.get("gpu")
    if gpu:
        builtin = (
            "H200"
            if "H200" in gpu
            else "H100-PCIe"
            if "PCIe" in gpu
            else "H100-SXM"
            if "H100" in gpu
            else None
        )
        if builtin is None and "A100" in gpu:
            builtin = "A100-80GB" if env_info.get("gpu_memory_gib", 0) > 50 else "A100-40GB"
        if builtin:
            profiles[f"built-in {builtin}"] = device_profile(builtin)
    cal = _load(out, "calibrate")
    if cal:
        profiles["calibrated"] = DeviceProfile(**cal["profile"])

    def priced(prof, layout) -> dict:
        est = estimate(
            model,
            layout,
            cluster=Cluster(nodes=1, gpus_per_node=1, gpu=prof),
            seq_len=args.seq,
            global_batch_size=args.batch,
            dtype="bf16",
        )
        return {
            "peak_memory_mib": est.peak_memory_bytes / 2**20,
            "peak_live_mib": est.peak_live_bytes / 2**20,
            "memory_mib": {k: v / 2**20 for k, v in est.memory[0].items()},
            "step_s": est.step_time_s,
            "time_parts_s": est.time_parts,
            "tokens_per_s": est.tokens_per_s_per_gpu,
            "mfu": est.mfu,
        }

    res = {}
    for name, prof in profiles.items():
        res[name] = priced(prof, layout)
        res[name]["selective"] = priced(prof, dataclasses.replace(layout, checkpoint="selective"))
    return res


# ---------------------------------------------------------------------------------------------------- the report
def _fmt(x, unit="", digits=0):
    return "—" if x is None else f"{x:,.{digits}f}{unit}"


def _ratio(a, b):
    return "—" if a is None or not b else f"{a / b:.2f}×"


def report(args, out: Path, status: dict) -> str:
    env_info, made = _load(out, "env") or {}, _load(out, "model") or {}
    lines = [f"# GPU check ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", ""]
    lines.append(
        f"Device: {env_info.get('gpu', env_info.get('device'))}; torch {env_info.get('torch')}, CUDA "
        f"{env_info.get('cuda')}, NCCL {env_info.get('nccl')}, transformers {env_info.get('transformers')}, "
        f"datasets {env_info.get('datasets')}."
    )
    if made:
        lines.append(
            f"Model: Llama {made['config']['num_hidden_layers']} layers, hidden {made['config']['hidden_size']}, "
            f"{made['n_params'] / 1e9:.3f} G parameters; batch {args.batch} x {args.seq} tokens, bf16 autocast "
            f"over fp32 weights, AdamW, {args.steps} steps (medians after the first {args.warmup})."
        )
    cal = _load(out, "calibrate")
    if cal:
        p = cal["profile"]
        lines.append(
            f"Calibrated: bf16 matmul {p['bf16_flops'] / 1e12:,.0f} TFLOP/s, fp32 {p['fp32_flops'] / 1e12:,.1f} "
            f"TFLOP/s, copy {p['hbm_bandwidth'] / 1e9:,.0f} GB/s ({cal['seconds']:.0f} s)."
        )
        curve = ", ".join(f"{(f / 2) ** (1 / 3):,.0f}: {x:.2f}" for f, x in p.get("matmul_curve") or ())
        attention = p.get("attention_efficiency")
        lines.append(
            f"Calibrated matmul by size (n x n, fraction of the best): {curve or 'not measured'}; causal SDPA "
            f"forward + backward at {attention if attention is None else f'{attention:.2f}'} of the best matmul "
            f"rate; host launch {p.get('op_overhead', 0) * 1e6:.1f} us per op, and "
            f"{p.get('selective_op_overhead', 0) * 1e6:.1f} us more under selective checkpointing's dispatch mode."
        )
    lines += [
        "",
        "| run | tokens/s | MFU | peak allocated (GiB) | vs hand loop (tokens/s) |",
        "|---|---|---|---|---|",
    ]
    hand = _load(out, "hand") or {}
    labels = {
        "script": "exported script",
        "script_compile": "exported script --compile",
        "script_selective_eager": "exported script, selective checkpointing",
        "script_selective": "exported script --compile, selective checkpointing",
    }
    for name, label in labels.items():
        r = _load(out, name)
        if r:
            lines.append(
                f"| {label} ({r['data']}) | {_fmt(r['tokens_per_s'])} | {_fmt(r['mfu'] and 100 * r['mfu'], ' %', 1)} "
                f"| {_fmt(r['peak_mem_mib'] and r['peak_mem_mib'] / 1024, '', 2)} "
                f"| {_ratio(r['tokens_per_s'], hand.get('tokens_per_s'))} |"
            )
    if hand:
        lines.append(
            f"| hand HF + AdamW loop | {_fmt(hand['tokens_per_s'])} | {_fmt(hand.get('mfu') and 100 * hand['mfu'], ' %', 1)} "
            f"| {_fmt(hand.get('peak_mem_mib') and hand['peak_mem_mib'] / 1024, '', 2)} | 1.00× |"
        )
    plan = _load(out, "plan") or {}
    if plan:
        lines += [
            "",
            (
                "| planner profile, layout | measured by | predicted tokens/s | measured / predicted "
                "| predicted live GiB | measured / predicted |"
            ),
            "|---|---|---|---|---|---|",
        ]
        for name, p in plan.items():
            for pred, run, what in (
                (p, "script", "no checkpointing"),
                (p["selective"], "script_selective_eager", "selective"),
            ):
                measured = _load(out, run) or {}
                lines.append(
                    f"| {name}, {what} | {labels[run]} | {_fmt(pred['tokens_per_s'])} "
                    f"| {_ratio(measured.get('tokens_per_s'), pred['tokens_per_s'])} | {pred['peak_live_mib'] / 1024:.2f} "
                    f"| {_ratio(measured.get('peak_mem_mib'), pred['peak_live_mib'])} |"
                )
    for name, label in labels.items():
        r = _load(out, name) or {}
        if r.get("plan_line"):
            lines += ["", f"The {label} run printed: {r['plan_line']}"]
    lines += ["", "| step | status | seconds |", "|---|---|---|"]
    for name in STEPS:
        st = status.get(name, {"status": "not run"})
        lines.append(f"| {name} | {st['status']} | {_fmt(st.get('seconds'), '', 1)} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "artifacts" / "gpu_check"), help="folder for the figures")
    p.add_argument("--size", choices=sorted(SIZES), default="1b")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if available")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--budget-s", type=float, default=450, help="stop starting steps after this many seconds")
    p.add_argument("--only", default=None, help="comma-separated steps (default: all)")
    p.add_argument("--step", default=None, help=argparse.SUPPRESS)  # one step, in its own process
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)

    if args.step:  # the child: run one step, write its figures
        sys.path.insert(0, str(ROOT))
        _save(out, args.step, globals()[f"step_{args.step}"](args, out))
        return 0

    start = time.perf_counter()
    status = {}
    steps = args.only.split(",") if args.only else list(STEPS)
    child = [f"--size={args.size}", f"--steps={args.steps}", f"--warmup={args.warmup}"]
    child += [f"--batch={args.batch}", f"--seq={args.seq}"] + (
        [f"--device={args.device}"] if args.device else []
    )
    for name in steps:
        left = args.budget_s - (time.perf_counter() - start)
        if left < 5:
            status[name] = {"status": "skipped: out of time"}
            continue
        (out / f"{name}.json").unlink(missing_ok=True)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                [sys.executable, __file__, *child, "--out", str(out), "--step", name],
                check=False,
                capture_output=True,
                text=True,
                timeout=left,
                env={**os.environ, "PYTHONPATH": _pythonpath(), "PYTHONUNBUFFERED": "1"},
            )
            ok = proc.returncode == 0
            err = (proc.stderr or "").strip().splitlines()[-1:] if not ok else []
            status[name] = {"status": "ok" if ok else f"failed: {' '.join(err)[:600]}"}
            (out / f"{name}.step.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
        except subprocess.TimeoutExpired:
            status[name] = {"status": f"timed out after {left:.0f} s"}
        status[name]["seconds"] = time.perf_counter() - t0
        print(f"[gpu_check] {name}: {status[name]['status']} ({status[name]['seconds']:.1f} s)", flush=True)
    text = report(args, out, status)
    (out / "report.md").write_text(text)
    results = {name: _load(out, name) for name in STEPS}
    (out / "report.json").write_text(json.dumps({"status": status, **results}, indent=2, default=str))
    print(text)
    return 0 if all(s["status"] == "ok" for s in status.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
