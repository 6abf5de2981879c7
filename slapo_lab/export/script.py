"""Render a recorded schedule as a standalone training script launched with ``torchrun`` or ``deepspeed``.

The script is assembled from one template (:data:`TEMPLATE`) by a single-pass substitution of
``<<NAME>>`` markers, so text inserted for one marker is never scanned for another. Every inserted
piece is either a fixed snippet, an ``int``, a validated Python name, or a ``repr``'d literal (the
model config travels as the ``repr`` of its JSON text).
"""
from __future__ import annotations

import json
import os
import re
import tempfile
import textwrap
from pathlib import Path

from torch import nn

from .fold import schedule_lines
from .spec import (
    ExportError,
    example_sizes,
    input_spec,
    lm_labels,
    model_spec,
    validate_calls,
    validate_input_spec,
    validate_model_spec,
)

LAUNCHERS = ("torchrun", "deepspeed")
_SAFE_NAME = re.compile(r"[A-Za-z0-9_.\-]+\Z")

TEMPLATE = '''\
"""Train <<MODEL_NAME>> with a slapo-lab schedule: <<HEADLINE>>.

<<INTRO>>

Launch:
<<LAUNCH>>
Options (python <<SCRIPT>> --help): --device, --backend {auto,nccl,gloo}, --steps, --batch-size,
<<SEQ_OPT>>--micro-batches, --lr, --optimizer {sgd,adamw}, --seed, --verify/--no-verify,
--verify-batch-size, <<EXTRA_OPTS>>--peak-tflops.

<<WHAT>>
Rank 0 prints, per step: loss, samples/s, tokens/s, peak memory (CUDA: max allocated during
training, Verify excluded; CPU: the process's peak resident set, which includes Verify) and on
CUDA the model FLOPs utilisation, 6 * parameters * tokens / time / (GPUs * peak FLOP/s of the
precision run: bf16 with --bf16, else TF32 or FP32 as torch.get_float32_matmul_precision() says).
"""
import argparse
import copy
import gc
import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
<<IMPORTS>>
import slapo_lab  # isort: skip
<<SLAPO_IMPORTS>><<FACTORY_IMPORT>>
WORLD_SIZE = <<WORLD_SIZE>>  # the tensor-parallel width the schedule was planned for
<<PIPE_CONSTANTS>><<MODEL_DATA>>
# Synthetic inputs like the example's: "batch" / "seq" axes follow --batch-size / --seq-len.
INPUTS = json.loads(
<<INPUTS_JSON>>
)
LM_LABELS = <<LM_LABELS>>  # pass labels=input_ids and train on the model's own LM loss
<<DS_DATA>>
# Peak dense TFLOP/s per GPU by precision: (bf16 tensor core, TF32 tensor core, FP32 without tensor cores),
# first matching name wins; None where the GPU lacks that path. Source: NVIDIA datasheets (H100 / H200 / B200,
# A100, L40S, L40, L4, A10, V100, T4) and the Ada architecture whitepaper (RTX 4090); dense figures, i.e.
# half the "with sparsity" ones; SXM parts unless named. --peak-tflops overrides the lookup.
PEAK_TFLOPS = [
    ("B200", (2250.0, 1100.0, None)), ("H200", (989.0, 494.0, 67.0)), ("H100 PCIe", (756.0, 378.0, 51.0)),
    ("H100", (989.0, 494.0, 67.0)), ("H800", (989.0, 494.0, 67.0)), ("A100", (312.0, 156.0, 19.5)),
    ("A800", (312.0, 156.0, 19.5)), ("L40S", (362.0, 183.0, 91.6)), ("L40", (181.0, 90.5, 90.5)),
    ("L4", (121.0, 60.0, 30.3)), ("A10", (125.0, 62.5, 31.2)), ("RTX 4090", (165.0, 82.6, 82.6)),
    ("V100", (None, None, 15.7)), ("T4", (None, None, 8.1)),
]


def build_model(seed):
    """The full (unsharded) model, identical on every rank."""
    torch.manual_seed(seed)
<<BUILD_BODY>>


def schedule(sch):
    """The recorded schedule, applied to this rank's copy of the model (slicing its shard)."""
<<SCHEDULE_BODY>>


def make_inputs(batch_size, seq_len, seed, device, float_dtype=None):
    """Synthetic keyword inputs like the example's, the same on every rank (seeded); floating-point
    inputs in ``float_dtype`` when given (the model's dtype)."""
    gen = torch.Generator().manual_seed(seed)
    inputs = {}
    for name, spec in INPUTS.items():
        if "value" in spec:
            inputs[name] = spec["value"]
            continue
        shape = [batch_size if d == "batch" else seq_len if d == "seq" else d for d in spec["dims"]]
        dtype = getattr(torch, spec["dtype"])
        if "fill" in spec:
            t = torch.full(shape, spec["fill"], dtype=dtype)
        elif dtype.is_floating_point:
            t = torch.randn(shape, generator=gen).to(float_dtype or dtype)
        else:
            t = torch.randint(spec["low"], spec["high"], shape, generator=gen).to(dtype)
        inputs[name] = t.to(device)
    if LM_LABELS:
        inputs["labels"] = inputs["input_ids"]
    return inputs


def first_tensor(outputs):
    """The first floating-point tensor of a model output (tensor, tuple or HF ModelOutput)."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    values = outputs.values() if isinstance(outputs, dict) else outputs
    for v in values:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v
    raise RuntimeError("the model returned no floating-point tensor to train on")


def compute_loss(outputs, seed):
    """The model's own loss when it has one (labels given), else a replicated synthetic loss.

    The synthetic loss is the mean squared projection of the first output onto a fixed random unit
    vector (seeded, so it is the same on every rank): a stand-in objective for throughput runs.
    """
    loss = getattr(outputs, "loss", None)
    if loss is not None:
        return loss
    return probe_loss(first_tensor(outputs), seed)


PROBES = {}


def probe_loss(hidden, seed):
    """Mean squared projection of ``hidden`` onto a fixed random unit vector (seeded).

    The vector is made once per (size, device, seed) and kept: a fresh CPU vector copied to the GPU in
    every step would make the host wait for the forward pass before it can queue the backward.
    """
    key = (hidden.shape[-1], str(hidden.device), seed)
    if key not in PROBES:
        probe = torch.randn(hidden.shape[-1], generator=torch.Generator().manual_seed(seed))
        PROBES[key] = (probe / probe.norm()).to(hidden.device)
    return (hidden.float() @ PROBES[key]).square().mean()


def split_batch(inputs, micro_batches, batch_size):
    """``micro_batches`` slices of the batch along axis 0 (gradient accumulation)."""
    size = batch_size // micro_batches
    return [take(inputs, m * size, size, batch_size) for m in range(micro_batches)]


def take(inputs, start, size, batch_size):
    """Rows ``start .. start + size`` of every input whose axis 0 is the batch (others unchanged)."""
    chunk = {}
    for name, value in inputs.items():
        batched = isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch_size
        chunk[name] = value[start:start + size] if batched else value
    return chunk


def make_optimizer(args, params):
    """The optimizer of --optimizer over ``params`` (plain torch optimizers)."""
    if args.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=args.lr)
    return torch.optim.SGD(params, lr=args.lr)


def full_numel(p):
    """Elements of a parameter before sharding (slapo_lab sets ``orig_shape`` on shards)."""
    shape = getattr(p, "orig_shape", p.shape)
    n = 1
    for s in shape:
        n *= s
    return n


def peak_memory_mib(device):
    """Peak memory of this process in MiB: CUDA max allocated (since the last reset), or the CPU peak
    resident set (over the whole process: it cannot be reset)."""
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def free_verify_memory(device):
    """After Verify: collect the reference copy and, on CUDA, return its cached blocks and restart the
    peak-memory count, so the printed peak is training's own."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def precision(args):
    """The precision the matmuls run in: "bf16" (--bf16), "tf32" or "fp32" (torch's float32 setting)."""
    if getattr(args, "bf16", False):
        return "bf16"
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def peak_tflops(args, device):
    """Peak TFLOP/s of one GPU in the precision run: --peak-tflops, else PEAK_TFLOPS by device name (None if
    unknown)."""
    if args.peak_tflops:
        return args.peak_tflops
    name = torch.cuda.get_device_name(device)
    column = ("bf16", "tf32", "fp32").index(precision(args))
    return next((value[column] for key, value in PEAK_TFLOPS if key in name), None)


def step_line(args, step, loss, elapsed, seq_len, device, n_params, world_size):
    """The line rank 0 prints after each step."""
    tokens = args.batch_size * (seq_len or 1)
    memory = "peak mem" if device.startswith("cuda") else "peak RSS"
    line = (f"step {step}/{args.steps} loss {loss:.6f} | {args.batch_size / elapsed:.1f} samples/s"
            + (f" | {tokens / elapsed:.0f} tokens/s" if seq_len else "")
            + f" | {memory} {peak_memory_mib(device):.0f} MiB")
    if args.device == "cuda":
        peak = peak_tflops(args, device)
        flops = 6 * n_params * tokens / elapsed
        line += (f" | MFU {100 * flops / (world_size * peak * 1e12):.1f}% of {peak:g} TF {precision(args)}" if peak
                 else f" | MFU n/a (pass --peak-tflops for {precision(args)})")
    return line


def memory_note(device):
    """The line that says what the printed peak memory measures."""
    if device.startswith("cuda"):
        return "memory: peak mem = CUDA max allocated during training (Verify's peak excluded)"
    return "memory: peak RSS = the process's peak resident set, Verify and start-up included (it cannot be reset)"
<<EXTRA_FUNCS>>

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    p.add_argument("--device", choices=["cuda", "cpu"], default=default_device,
                   help="cuda: one GPU per process (local rank %% GPUs); cpu (default: cuda if available)")
    p.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                   help="the process group: auto = nccl on cuda, gloo on cpu; gloo on cuda lets several "
                        "processes share a GPU for testing (not pipelines: gloo sends CPU tensors only)")
    p.add_argument("--steps", type=int, default=10, help="training steps")
    p.add_argument("--batch-size", type=int, default=<<BATCH>>, help=<<BATCH_HELP>>)
<<SEQ_ARG>>    p.add_argument("--micro-batches", type=int, default=<<MICRO>>,
                   help=<<MICRO_HELP>>)
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate")
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    p.add_argument("--seed", type=int, default=1234, help="seed of the weights and the synthetic data")
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                   help=<<VERIFY_HELP>>)
    p.add_argument("--verify-batch-size", type=int, default=None,
                   help=<<VERIFY_BATCH_HELP>>)
<<EXTRA_ARGS>>    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s per GPU in the precision run, for MFU (default: looked up by GPU name)")
    args = p.parse_args(argv)
    bad = args.steps < 0 or args.batch_size < 1 or args.micro_batches < 1
    if bad or args.batch_size % args.micro_batches:
        p.error("need --steps >= 0, --batch-size >= 1 and a --batch-size divisible by --micro-batches")
    if args.verify_batch_size is not None and args.verify_batch_size < 1:
        p.error("--verify-batch-size must be >= 1")
    if args.backend == "nccl" and args.device == "cpu":
        p.error("--backend nccl moves CUDA tensors only; use --backend gloo (or auto) with --device cpu")
<<ARGS_CHECK>>    return args


def backend_of(args):
    """The process-group backend: --backend, or for auto nccl on cuda and gloo on cpu."""
    if args.backend != "auto":
        return args.backend
    return "nccl" if args.device == "cuda" else "gloo"


def place(args, local_rank, gpus):
    """(device, None) for this process, or (None, the one-line error); ``gpus`` = CUDA devices here.

    On cuda, local rank i runs on GPU i % gpus: one GPU per process, or with gloo several processes
    per GPU (a test of the script, not of its speed: NCCL refuses two ranks on one GPU).
    """
    if args.device == "cpu":
        return "cpu", None
    if gpus == 0:
        return None, "error: CUDA is not available here; run with --device cpu."
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if ranks > gpus and backend_of(args) == "nccl":
        return None, (f"error: {ranks} processes on this node but {gpus} GPU(s), and NCCL needs one GPU per "
                      "process; launch at most one process per GPU, or add --backend gloo to share GPUs (testing).")
<<PLACE_CHECK>>    return f"cuda:{local_rank % gpus}", None


def init_distributed(args, device):
    """Join the process group the launcher describes (env://) with backend_of(args); without a launcher,
    run as one process. Returns (rank, world size)."""
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    if "RANK" not in os.environ:
        return 0, 1
    if backend_of(args) == "nccl":
        dist.init_process_group("nccl", device_id=torch.device(device))
    else:
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def main(argv=None):
    args = parse_args(argv)
<<PRE_INIT>>    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device, error = place(args, local_rank, torch.cuda.device_count() if args.device == "cuda" else 0)
    if error:
        print(error, file=sys.stderr)
        return 2
    rank, world_size = init_distributed(args, device)
    ranks, gpus = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count()
    if rank == 0 and device.startswith("cuda") and ranks > gpus:
        print(f"note: {ranks} processes share {gpus} GPU(s) over gloo (local rank i -> cuda:i % {gpus}): a test "
              "run, not a throughput figure.", flush=True)
    try:
        return train(args, rank, world_size, device)
    finally:
        # the model's sync hooks hold the process group in reference cycles: collect them first, or the gloo
        # group outlives destroy_process_group and its worker threads abort the exit ("terminate called ...")
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


<<TRAIN>>

if __name__ == "__main__":
    sys.exit(main())
'''

_TRAIN_TP = '''\
def train(args, rank, world_size, device):
    if world_size != WORLD_SIZE:
        if rank == 0:
            print(f"error: this schedule is planned for {WORLD_SIZE} tensor-parallel ranks, but {world_size} "
                  f"process(es) were launched; use torchrun --nproc_per_node={WORLD_SIZE}.", file=sys.stderr)
        return 2
    seq_len = <<SEQ_VALUE>>
    model = build_model(args.seed)
    reference = copy.deepcopy(model) if args.verify else None
    sch = slapo_lab.create_schedule(model)  # the default process group, or one rank without torchrun
    schedule(sch)
    model = sch.mod.to(device)

    if reference is not None:
        verify_batch = args.verify_batch_size or min(args.batch_size, 2)
        inputs = make_inputs(verify_batch, seq_len, args.seed + 1, device)
        report = slapo_lab.verify_models(reference, model, inputs, sch.tp, device=device)
        del reference, inputs
        model.zero_grad(set_to_none=True)  # Verify's gradients must not reach the first step
        free_verify_memory(device)
        report.note = f"inputs of batch {verify_batch} (--verify-batch-size)"
        if rank == 0:
            print(report.summary(), flush=True)
        if not report.passed:
            return 1

    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(args, params)
    n_params = sum(full_numel(p) for p in params)
    if rank == 0:
        print(f"model: {n_params / 1e6:.2f} M parameters, {world_size} rank(s), device {device}, "
              f"batch {args.batch_size}" + (f" x {seq_len} tokens" if seq_len else "")
              + (", bf16 autocast" if args.bf16 else ""), flush=True)
        print(memory_note(device), flush=True)
    for step in range(1, args.steps + 1):
        batch = make_inputs(args.batch_size, seq_len, args.seed + 1 + step, device)
        if args.device == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for chunk in split_batch(batch, args.micro_batches, args.batch_size):
            with torch.autocast(device_type=args.device, dtype=torch.bfloat16, enabled=args.bf16):
                loss = compute_loss(model(**chunk), args.seed) / args.micro_batches
            loss.backward()
            total += loss.detach()  # no host sync per micro-batch: read once, after the step
        optimizer.step()
        total = total.item()
        if args.device == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        if rank == 0:
            print(step_line(args, step, total, elapsed, seq_len, device, n_params, world_size), flush=True)
    return 0
'''

# ---- helpers shared by the pipeline and DeepSpeed variants (tensor x pipeline x data parallelism)
_LAYOUT_FUNCS = '''

def check_layout(args, rank, world_size):
    """The data-parallel size of ``world_size`` processes laid out as tp x pp x dp; None (and an error) if
    they do not fit."""
    tp, pp = WORLD_SIZE, NUM_STAGES // getattr(args, "stages_per_rank", 1)
    unit = tp * pp
    dp = world_size // unit
    if world_size % unit or (args.dp is not None and args.dp != dp):
        if rank == 0:
            want = unit * (args.dp or max(dp, 1))
            need = f"--dp {args.dp} x {unit} = {want}" if args.dp else f"a multiple of {unit}"
            print(f"error: this schedule runs on tp x pp x dp processes with tp={tp} (tensor parallel) and "
                  f"pp={pp} (pipeline), so the world size must be {need}, but {world_size} process(es) were "
                  f"launched; use <<LAUNCH_HINT>>{want}.", file=sys.stderr)
        return None
    if args.batch_size % (dp * args.micro_batches):
        if rank == 0:
            print(f"error: --batch-size {args.batch_size} does not split into {dp} data-parallel replica(s) "
                  f"of {args.micro_batches} micro-batch(es); use a multiple of {dp * args.micro_batches}.",
                  file=sys.stderr)
        return None
    return dp


def dp_mean(value, group, dp, device):
    """The mean of a float over the data-parallel replicas."""
    if dp == 1:
        return value
    t = torch.tensor(value, dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return float(t) / dp
'''

_DS_FUNCS = '''

def ds_config(args, dp):
    """DS_CONFIG with the batch sizes of these options (``dp`` data-parallel replicas)."""
    config = json.loads(json.dumps(DS_CONFIG))
    micro = args.batch_size // dp // args.micro_batches
    config["train_micro_batch_size_per_gpu"] = micro
    config["gradient_accumulation_steps"] = args.micro_batches
    config["train_batch_size"] = micro * args.micro_batches * dp
    return config


def print_ds_config(args):
    """--print-ds-config: the config for --dp (or the launcher's WORLD_SIZE) replicas."""
    unit = WORLD_SIZE * NUM_STAGES
    dp = args.dp or max(1, int(os.environ.get("WORLD_SIZE", unit)) // unit)
    print(json.dumps(ds_config(args, dp), indent=2))
    return 0
'''

_PIPE_FUNCS = '''

def make_loss_fn(seed):
    """``loss_fn(output, target)`` of the last pipeline stage, per micro-batch (means, so the micro-batch
    losses average to the whole batch's); ``output`` is the model's first floating-point output."""
    def loss_fn(output, target):
        if LOSS == "causal_lm":  # next-token prediction, as transformers' ForCausalLMLoss
            return torch.nn.functional.cross_entropy(output[:, :-1].reshape(-1, output.shape[-1]).float(),
                                                     target[:, 1:].reshape(-1))
        if LOSS == "lm":
            return torch.nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]).float(),
                                                     target.reshape(-1))
        return probe_loss(output, seed)
    return loss_fn


def pipeline_batch(inputs, batch_size, device):
    """(model inputs, target): the labels are the target (LM); without labels a zero tensor (unused)."""
    inputs = dict(inputs)
    target = inputs.pop("labels", None)
    if target is None:
        target = torch.zeros(batch_size, device=device)
    return inputs, target


DROPOUT = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d,
           torch.nn.AlphaDropout, torch.nn.FeatureAlphaDropout)


def dropout_off(model):
    """Set every dropout rate of ``model`` to 0; returns the [(module, rate)] to put back."""
    saved = [(m, m.p) for m in model.modules() if isinstance(m, DROPOUT) and m.p > 0]
    for m, _ in saved:
        m.p = 0.0
    return saved


def restore_dropout(saved):
    for m, p in saved:
        m.p = p


def build_pipeline(args, sch, mesh, dp, example, device):
    """This rank's pipeline stage(s) (slapo_lab.build) and the torch optimizer over their parameters."""
    made = []

    def optimizer(params):
        made.append(make_optimizer(args, params))
        return made[-1]

    pm, _ = slapo_lab.build(sch, TARGET, example_inputs=example, loss_fn=make_loss_fn(args.seed),
                            schedule=<<PP_SCHEDULE>>, n_microbatches=args.micro_batches,
                            pp_group=mesh.pp_group, dp_group=mesh.dp_group if dp > 1 else None,
                            stages_per_rank=<<SPR>>, optimizer=optimizer, device=device<<DS_KW>>)
    return pm, made[-1]


def on_one_device(a, b):
    """``a`` and ``b`` detached, as float64, on one device: theirs if they share it, else the CPU (a stage's
    weights may sit on a GPU while the unscheduled reference is still on the CPU)."""
    a, b = a.detach(), b.detach()
    if a.device != b.device:
        a, b = a.cpu(), b.cpu()
    return a.double(), b.double()


def same(a, b):
    """Whether two tensors hold the same values (wherever they are)."""
    a, b = on_one_device(a, b)
    return a.shape == b.shape and torch.equal(a, b)


def compare(a, b, atol=1e-5, rtol=1e-5, scale=0.0):
    """(max abs diff, max rel diff, within atol + scale * max|b| + rtol * |b| everywhere) of two tensors (wherever
    they are); ``scale`` > 0 lets the absolute tolerance follow the tensor's magnitude (bf16)."""
    a, b = on_one_device(a, b)
    if a.shape != b.shape:
        return float("inf"), float("inf"), False
    if not a.numel():
        return 0.0, 0.0, True
    diff, top = float((a - b).abs().max()), float(b.abs().max())
    return diff, diff / (top + atol), bool(torch.allclose(a, b, atol=atol + scale * top, rtol=rtol))


def verify_pipeline(args, pm, opt, reference, mesh, dp, batch, batch_size, device, dropout):
    """One training step of the pipeline next to the unscheduled ``reference`` on ``batch`` (``batch_size``
    samples); True if it matches.

    Compares the step's loss, every gradient and every updated weight -- this rank's shard of each of
    its parameters against the matching slice of the reference's -- within atol = rtol = 1e-5 (fp32),
    or with --bf16 (both models in bfloat16, but the pipeline sums its micro-batches' gradients in bf16
    where the reference takes one batch) rtol = BF16_TOL and atol = 1e-5 + BF16_TOL x the tensor's
    largest reference value, prints the largest differences over all ranks
    (rank 0), then puts the weights and the optimizer state back, so training starts where it would
    have without --verify.
    """
    from slapo_lab.sharding.rules import local_shard

    params = dict(pm.named_parameters())
    bf16 = any(p.dtype == torch.bfloat16 for p in params.values())
    atol, rtol, scale = (1e-5, BF16_TOL, BF16_TOL) if bf16 else (1e-5, 1e-5, 0.0)
    local = batch_size // dp
    before = {name: p.detach().clone() for name, p in params.items()}
    refs = dict(reference.named_parameters(remove_duplicate=False))

    def mine(name, t):  # this rank's slice of a reference tensor
        p = params[name]
        axis = getattr(p, "shard_axis", None)
        if axis is None or mesh.tp == 1:
            return t
        return local_shard(t.detach(), axis, mesh.tp, mesh.tp_rank, getattr(p, "shard_stride", 1))

    unknown = [name for name in params if name not in refs]
    init_bad = [name for name in params if name in refs and not same(before[name], mine(name, refs[name]))]
    grads = {}

    def grab(optimizer, a, kw):
        grads.update({name: p.grad.detach().clone() for name, p in params.items() if p.grad is not None})

    hook = opt.register_step_pre_hook(grab)
    inputs, target = pipeline_batch(take(batch, mesh.dp_rank * local, local, batch_size), local, device)
    loss = dp_mean(pm.train_step(**inputs, target=target), mesh.dp_group, dp, device)
    hook.remove()

    reference.to(device).train()
    ref_opt = make_optimizer(args, reference.parameters())
    full_inputs, full_target = pipeline_batch(batch, batch_size, device)
    ref_loss = make_loss_fn(args.seed)(first_tensor(reference(**full_inputs)), full_target)
    ref_loss.backward()
    ref_grads = {name: r.grad.detach().clone() if r.grad is not None else torch.zeros_like(r)
                 for name, r in refs.items()}
    ref_opt.step()
    rows = {}
    for name, p in params.items():
        if name in refs:
            g = grads.get(name, torch.zeros_like(p))
            rows[name] = (compare(g, mine(name, ref_grads[name]), atol, rtol, scale)
                          + compare(p, mine(name, refs[name]), atol, rtol, scale))
    mine_all = {"rows": rows, "init_bad": init_bad, "unknown": unknown}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine_all)
    merged = {}
    for g in gathered:
        for name, row in g["rows"].items():
            old = merged.get(name, (0.0, 0.0, True, 0.0, 0.0, True))
            merged[name] = (max(old[0], row[0]), max(old[1], row[1]), old[2] and row[2],
                            max(old[3], row[3]), max(old[4], row[4]), old[5] and row[5])
    canon, first = {}, {}
    for name, r in refs.items():
        canon[name] = first.setdefault(id(r), name)
    missing = sorted(set(canon.values()) - {canon[name] for name in merged})
    init_bad = sorted({name for g in gathered for name in g["init_bad"]})
    unknown = sorted({name for g in gathered for name in g["unknown"]})
    ref_value = float(ref_loss.detach())
    loss_diff = abs(loss - ref_value)
    loss_ok = loss_diff <= atol + rtol * abs(ref_value)
    passed = bool(merged) and loss_ok and not (missing or init_bad or unknown) and all(
        row[2] and row[5] for row in merged.values())

    with torch.no_grad():  # back to the starting point, for training
        for name, p in params.items():
            p.copy_(before[name])
    opt.state.clear()
    pm.zero_grad()
    if dist.get_rank() == 0:
        lines = [f"Verify: one training step ({TARGET} pipeline of {NUM_STAGES} stages on tp {mesh.tp} x pp "
                 f"{mesh.pp} x dp {dp} ranks, batch {batch_size} in {args.micro_batches} micro-batches, "
                 f"{'bf16' if bf16 else 'fp32'}, {args.optimizer} lr {args.lr:g}"
                 + (", dropout off" if dropout else "") + ") against the unscheduled model",
                 f"Verify: loss of step 1: max abs diff {loss_diff:.3e}, max rel diff "
                 f"{loss_diff / (abs(ref_value) + atol):.3e} (pipeline {loss:.6f}, reference {ref_value:.6f})"
                 + ("" if loss_ok else "  <-- exceeds tolerance")]
        for what, k in (("gradients", 0), ("updated weights", 3)):
            if merged:
                worst = max(merged, key=lambda name: merged[name][k])
                bad = [name for name, row in merged.items() if not row[k + 2]]
                lines.append(f"Verify: {what} of {len(merged)} parameters: max abs diff "
                             f"{merged[worst][k]:.3e} ({worst}), max rel diff "
                             f"{max(row[k + 1] for row in merged.values()):.3e}"
                             + (f", {len(bad)} over tolerance" if bad else ""))
                lines += [f"Verify:   {name}: max abs diff {merged[name][k]:.3e}" for name in bad[:5]]
        for name in init_bad[:5]:
            lines.append(f"Verify: weight {name} differs from the reference slice before training")
        if missing:
            lines.append(f"Verify: parameters held by no rank: {', '.join(missing[:5])}")
        if unknown:
            lines.append(f"Verify: parameters the reference lacks: {', '.join(unknown[:5])}")
        status = "PASSED" if passed else "FAILED"
        tolerance = f"atol {atol:g}" + (f" + {scale:g} x max |reference| per tensor" if scale else "")
        lines.append(f"Verify: {status} ({tolerance}, rtol {rtol:g}, device {device})")
        print("\\n".join(lines), flush=True)
    return passed
'''

_TRAIN_PIPE = '''\
def train(args, rank, world_size, device):
    dp = check_layout(args, rank, world_size)
    if dp is None:
        return 2
    verify_batch = args.verify_batch_size or dp * args.micro_batches  # one sample per micro-batch and replica
    if args.verify and verify_batch % (dp * args.micro_batches):
        if rank == 0:
            print(f"error: --verify-batch-size {verify_batch} does not split into {dp} data-parallel replica(s) "
                  f"of {args.micro_batches} micro-batch(es); use a multiple of {dp * args.micro_batches}.",
                  file=sys.stderr)
        return 2
    seq_len = <<SEQ_VALUE>>
    tp, pp = WORLD_SIZE, NUM_STAGES // <<SPR>>
    mesh = slapo_lab.pipeline.make_mesh(tp=tp, pp=pp, dp=dp, device=args.device)
    dtype = <<PIPE_DTYPE>>
    model = build_model(args.seed).to(dtype)  # every stage in one dtype: they exchange tensors of it
    reference = copy.deepcopy(model) if args.verify else None
    sch = slapo_lab.create_schedule(model, group=mesh.tp_group)  # this rank's tensor-parallel group
    schedule(sch)
    sch.mod.to(device)
    local = args.batch_size // dp
    lo = mesh.dp_rank * local

    def example_of(batch_size):  # this replica's slice of a batch: the stages' shapes come from it
        inputs = make_inputs(batch_size, seq_len, args.seed, device, dtype)
        share = batch_size // dp
        return pipeline_batch(take(inputs, mesh.dp_rank * share, share, batch_size), share, device)[0]

    pm = None
    if reference is not None:
        saved = dropout_off(sch.mod)  # the reference runs without dropout, so must the verified step
        dropout_off(reference)
        pm, opt = build_pipeline(args, sch, mesh, dp, example_of(verify_batch), device)
        batch = make_inputs(verify_batch, seq_len, args.seed + 2, device, dtype)  # step 1's data, maybe fewer rows
        passed = verify_pipeline(args, pm, opt, reference, mesh, dp, batch, verify_batch, device, bool(saved))
        del reference, batch
        restore_dropout(saved)
        if not passed:
            return 1
        if saved or verify_batch != args.batch_size:  # rebuild with dropout / the training shapes
            pm = opt = None
        free_verify_memory(device)
    if pm is None:
        pm, opt = build_pipeline(args, sch, mesh, dp, example_of(args.batch_size), device)
    n_params = sum(full_numel(p) for p in sch.mod.parameters())
    if rank == 0:
        print(f"model: {n_params / 1e6:.2f} M parameters, {world_size} rank(s) = tp {tp} x pp {pp} x dp "
              f"{dp}, {NUM_STAGES} pipeline stages (<<SCHEDULE_DOC>>, {args.micro_batches} micro-batches), "
              f"device {device}, batch {args.batch_size}" + (f" x {seq_len} tokens" if seq_len else "")
              + (", bf16 weights and activations" if dtype == torch.bfloat16 else ""), flush=True)
        print(memory_note(device), flush=True)
    for step in range(1, args.steps + 1):
        batch = make_inputs(args.batch_size, seq_len, args.seed + 1 + step, device, dtype)
        inputs, target = pipeline_batch(take(batch, lo, local, args.batch_size), local, device)
        if args.device == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        loss = dp_mean(pm.train_step(**inputs, target=target), mesh.dp_group, dp, device)
        if args.device == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        if rank == 0:
            print(step_line(args, step, loss, elapsed, seq_len, device, n_params, world_size), flush=True)
    return 0
'''

_TRAIN_DS_TP = '''\
class ModelParallelUnit:
    """DeepSpeed's ``mpu``: the tensor-parallel group is the model-parallel group, the replicas are data
    parallel (so DeepSpeed broadcasts weights and averages gradients between replicas, never across
    shards)."""

    def __init__(self, mesh):
        self.mesh = mesh

    def get_model_parallel_group(self):
        return self.mesh.tp_group

    def get_model_parallel_rank(self):
        return self.mesh.tp_rank

    def get_model_parallel_world_size(self):
        return self.mesh.tp

    def get_data_parallel_group(self):
        return self.mesh.dp_group

    def get_data_parallel_rank(self):
        return self.mesh.dp_rank

    def get_data_parallel_world_size(self):
        return self.mesh.dp

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size


def train(args, rank, world_size, device):
    import deepspeed

    if not dist.is_initialized():
        print("error: run this script with a launcher: deepspeed --num_gpus N (or torchrun "
              "--nproc_per_node=N).", file=sys.stderr)
        return 2
    dp = check_layout(args, rank, world_size)
    if dp is None:
        return 2
    seq_len = <<SEQ_VALUE>>
    mesh = slapo_lab.pipeline.make_mesh(tp=WORLD_SIZE, pp=1, dp=dp, device=args.device)
    model = build_model(args.seed)
    reference = copy.deepcopy(model) if args.verify else None
    sch = slapo_lab.create_schedule(model, group=mesh.tp_group)  # this rank's tensor-parallel group
    schedule(sch)
    model = sch.mod.to(device)

    if reference is not None:
        verify_batch = args.verify_batch_size or min(args.batch_size, 2)
        inputs = make_inputs(verify_batch, seq_len, args.seed + 1, device)
        report = slapo_lab.verify_models(reference, model, inputs, sch.tp, device=device)
        del reference, inputs
        model.zero_grad(set_to_none=True)  # Verify's gradients must not reach the first step
        free_verify_memory(device)
        report.note = f"inputs of batch {verify_batch} (--verify-batch-size)"
        if rank == 0:
            print(report.summary(), flush=True)
        if not report.passed:
            return 1

    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(full_numel(p) for p in params)
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=make_optimizer(args, params),
                                           config=ds_config(args, dp), mpu=ModelParallelUnit(mesh))
    local = args.batch_size // dp
    if rank == 0:
        print(f"model: {n_params / 1e6:.2f} M parameters, {world_size} rank(s) = tp {WORLD_SIZE} x dp {dp} "
              f"(DeepSpeed engine), device {args.device}, batch {args.batch_size}"
              + (f" x {seq_len} tokens" if seq_len else "") + (", bf16 autocast" if args.bf16 else ""), flush=True)
        print(memory_note(device), flush=True)
    for step in range(1, args.steps + 1):
        batch = make_inputs(args.batch_size, seq_len, args.seed + 1 + step, device)
        mine = take(batch, mesh.dp_rank * local, local, args.batch_size)
        if args.device == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        total = torch.zeros((), device=device)
        for chunk in split_batch(mine, args.micro_batches, local):
            with torch.autocast(device_type=args.device, dtype=torch.bfloat16, enabled=args.bf16):
                loss = compute_loss(engine(**chunk), args.seed)
            engine.backward(loss)  # scaled by 1 / gradient_accumulation_steps, averaged over replicas
            engine.step()          # steps the optimizer after the last micro-batch
            total += loss.detach() / args.micro_batches  # read once, after the step
        total = dp_mean(total.item(), mesh.dp_group, dp, device)
        if args.device == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        if rank == 0:
            print(step_line(args, step, total, elapsed, seq_len, device, n_params, world_size), flush=True)
    return 0
'''

_LAUNCH_TP = '''\
  one node with <<GPUS>>:
    torchrun --nproc_per_node=<<WORLD_SIZE>> <<SCRIPT>> --device cuda
  several nodes (M nodes x N processes per node, M * N = <<WORLD_SIZE>>; run on every node, R = 0 .. M-1):
    torchrun --nnodes=M --nproc_per_node=N --node_rank=R --master_addr=HOST --master_port=29500 <<SCRIPT>>
  CPU test on one machine (gloo on 127.0.0.1):
    torchrun --nproc_per_node=<<WORLD_SIZE>> --master_addr=127.0.0.1 <<SCRIPT>> --device cpu
'''

_SINGLE = '''\
  one process without torchrun (world size 1):
    python <<SCRIPT>> --device cpu
'''

_LAUNCH_PIPE = '''\
  one node with <<NPROC>> GPUs (tp <<WORLD_SIZE>> x pp <<PP>>):
    torchrun --nproc_per_node=<<NPROC>> <<SCRIPT>> --device cuda
  with data parallelism on top (any multiple of <<NPROC>> processes, dp = processes / <<NPROC>>):
    torchrun --nproc_per_node=<<NPROC_DP>> <<SCRIPT>> --device cuda
  several nodes (M nodes x N processes per node, M * N a multiple of <<NPROC>>; on every node, R = 0 .. M-1):
    torchrun --nnodes=M --nproc_per_node=N --node_rank=R --master_addr=HOST --master_port=29500 <<SCRIPT>>
  CPU test on one machine (gloo on 127.0.0.1):
    torchrun --nproc_per_node=<<NPROC>> --master_addr=127.0.0.1 <<SCRIPT>> --device cpu
'''

_LAUNCH_DS = '''\
  one node with N GPUs (N = <<NPROC>>, or a multiple of it: dp = N / <<NPROC>> data-parallel replicas):
    deepspeed --num_gpus <<NPROC>> <<SCRIPT>> --device cuda
  several nodes (a hostfile with one line "HOST slots=N" per node; M * N a multiple of <<NPROC>>):
    deepspeed --hostfile hostfile --num_nodes M --num_gpus N <<SCRIPT>> --device cuda
  CPU test on one machine (gloo on 127.0.0.1), with the deepspeed launcher or torchrun:
    deepspeed --num_gpus <<NPROC>> <<SCRIPT>> --device cpu
    torchrun --nproc_per_node=<<NPROC>> --master_addr=127.0.0.1 <<SCRIPT>> --device cpu
  the DeepSpeed config (DS_CONFIG below, with the batch sizes of the options):
    python <<SCRIPT>> --print-ds-config
'''

_SEQ_ARG = '''\
    p.add_argument("--seq-len", type=int, default=<<SEQ>>, help="tokens per sample")
'''

_BF16_ARG = '''\
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast in training (Verify stays fp32)")
'''

_PIPE_BF16_ARG = '''\
    p.add_argument("--bf16", action="store_true",
                   help="bfloat16 weights and activations in every stage (Verify too, with a bf16 tolerance)")
'''

_TP_VERIFY_BATCH_HELP = '"samples Verify runs on (default: min(--batch-size, 2))"'

_BF16_TOL = ("BF16_TOL = 3e-2  # --bf16 Verify tolerance (atol = rtol): a few bf16 roundings (2 ** -8 each)\n")

# gloo moves CUDA tensors in collectives, but its send / recv take CPU tensors only, and pipeline stages send.
_PIPE_PLACE_CHECK = '''\
    if backend_of(args) == "gloo":
        return None, ("error: gloo cannot send CUDA tensors between pipeline stages; use --backend nccl with one GPU "
                      "per process, or --device cpu.")
'''

_PIPE_ARGS = '''\
    p.add_argument("--pp-schedule", choices=["1F1B", "GPipe", "Interleaved1F1B"], default="1F1B",
                   help="the torch.distributed.pipelining schedule")
    p.add_argument("--stages-per-rank", type=int, default=1,
                   help="pipeline stages per pipeline rank (> 1 with Interleaved1F1B: pp = stages / this)")
'''

_DP_ARG = '''\
    p.add_argument("--dp", type=int, default=None,
                   help="data-parallel replicas (default: world size / (tp x pp))")
'''

_DS_ARGS = '''\
    p.add_argument("--print-ds-config", action="store_true", help="print the DeepSpeed config and exit")
    # the deepspeed launcher passes --local_rank (LOCAL_RANK is read from the environment)
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
'''

_PIPE_CHECK = '''\
    if args.stages_per_rank < 1 or NUM_STAGES % args.stages_per_rank:
        p.error(f"--stages-per-rank must divide the {NUM_STAGES} pipeline stages")
    if args.stages_per_rank > 1 and args.pp_schedule != "Interleaved1F1B":
        p.error("--stages-per-rank > 1 needs --pp-schedule Interleaved1F1B")
'''

_DP_CHECK = '''\
    if args.dp is not None and args.dp < 1:
        p.error("--dp must be a positive number of data-parallel replicas")
'''

_DS_PRE_INIT = '''\
    if args.print_ds_config:
        return print_ds_config(args)
'''

# DeepSpeed's config: the script passes a torch optimizer (no "optimizer" section, so no fused-op builds),
# fp32, ZeRO stage 0; the batch sizes are set at run time from the options.
DS_BASE = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "steps_per_print": 1000000, "zero_optimization": {"stage": 0}, "gradient_clipping": 0.0,
           "wall_clock_breakdown": False}


def _sub(template: str, values: dict[str, str]) -> str:
    """Replace every ``<<NAME>>`` in one pass (inserted text is never rescanned)."""
    def repl(m: re.Match) -> str:
        return values[m.group(1)]

    return re.sub(r"<<([A-Z_]+)>>", repl, template)


def _json_literal(data: dict, indent: str = "    ") -> str:
    """``data`` as JSON text written as adjacent ``repr``'d string literals, one top-level key each."""
    items = [f" {json.dumps(k)}: {json.dumps(v, allow_nan=False)}" for k, v in data.items()]
    lines = ["{\n"] + [item + (",\n" if n + 1 < len(items) else "\n") for n, item in enumerate(items)] + ["}"]
    return "\n".join(indent + repr(line) for line in lines)


def _model_parts(spec: dict) -> dict[str, str]:
    if spec["kind"] == "factory":
        mod, fn = spec["factory"].split(":")
        return {"MODEL_NAME": fn, "IMPORTS": "", "MODEL_DATA": "", "BUILD_DOC": f"by calling {mod}.{fn}()",
                "FACTORY_IMPORT": f"from {mod} import {fn} as model_factory  # isort: skip\n",
                "BUILD_BODY": "    return model_factory()"}
    cls, cfg_cls = spec["class"], spec["config_class"]
    attn = spec.get("attn_implementation")
    kwargs = f", attn_implementation={json.dumps(attn)}" if attn else ""
    return {
        "MODEL_NAME": cls,
        "IMPORTS": f"from transformers import {cfg_cls}, {cls}\n",
        "FACTORY_IMPORT": "",
        "MODEL_DATA": f"# The model's config (transformers {cfg_cls}), as JSON.\nCONFIG = json.loads(\n"
                      f"{_json_literal(spec['config'])}\n)\n",
        "BUILD_DOC": f"from its config ({cls})",
        "BUILD_BODY": f"    return {cls}({cfg_cls}.from_dict(dict(CONFIG){kwargs}))",
    }


def pipeline_stages(calls) -> int:
    """The number of pipeline stages the calls describe: the distinct cut paths + 1 (1 without cuts)."""
    calls = getattr(calls, "calls", calls)
    cuts = {c.path for c in calls if getattr(c, "primitive", None) == "cut_pipeline_stage"}
    return len(cuts) + 1


def processes(calls, world_size: int) -> int:
    """Processes one replica of the schedule needs: tensor-parallel width x pipeline stages."""
    return world_size * pipeline_stages(calls)


def launch_command(calls, world_size: int, script: str = "train.py", launcher: str = "torchrun",
                   device: str = "cuda") -> str:
    """The one-node command that launches an exported script (``tp x pp`` processes, no data parallelism)."""
    n = processes(calls, world_size)
    if launcher == "deepspeed":
        return f"deepspeed --num_gpus {n} {script} --device {device}"
    return f"torchrun --nproc_per_node={n} {script} --device {device}"


def _loss_kind(spec: dict, inputs: dict) -> str:
    """``"causal_lm"`` / ``"lm"`` (labels = the input ids or given labels) or ``"probe"`` for pipelines."""
    cls = spec.get("class", "") if spec.get("kind") == "hf" else ""
    if ("input_ids" in inputs or "labels" in inputs) and re.fullmatch(r".*(ForCausalLM|LMHeadModel)", cls):
        return "causal_lm"
    if ("input_ids" in inputs or "labels" in inputs) and cls.endswith("ForMaskedLM"):
        return "lm"
    return "probe"


def render_script(spec: dict, calls, inputs: dict, world_size: int, launcher: str = "torchrun",
                  script_name: str = "train.py") -> str:
    """The training script for a recorded schedule, as Python source text.

    Three layouts, chosen by the calls and the launcher:

    * tensor parallelism only, ``torchrun``: ``world_size`` processes, the scheduled model trained in
      place (``--verify``: :func:`slapo_lab.verify_models` on outputs and gradients);
    * pipeline cuts (``cut_pipeline_stage``): ``tp x pp x dp`` processes on
      :func:`slapo_lab.pipeline.make_mesh` (tp = ``world_size``, pp = the stages, dp derived or
      ``--dp``), the schedule applied on the tensor-parallel group, then ``slapo_lab.build(sch,
      target, ...)`` and ``train_step``; ``--verify`` checks one training step against the
      unscheduled model (loss, every gradient and every updated weight);
    * ``launcher="deepspeed"``: pipelines on DeepSpeed's engine (``target="deepspeed"``, pipeline x
      data parallelism), tensor-parallel schedules with ``deepspeed.initialize`` (a model-parallel
      unit keeps DeepSpeed's data parallelism off the shards); the DeepSpeed config is embedded
      (``DS_CONFIG``, ``--print-ds-config``).

    Args:
        spec: the model spec (:func:`slapo_lab.export.model_spec`).
        calls: the recorded calls (list of :class:`~slapo_lab.Call` or their JSON dicts, or a Recorder).
        inputs: the input spec (:func:`slapo_lab.export.input_spec`).
        world_size: the tensor-parallel width the calls were recorded for.
        launcher: ``"torchrun"`` or ``"deepspeed"``.
        script_name: the file name shown in the launch commands of the docstring.

    Returns:
        The script: ruff-clean, importing only the standard library, torch, transformers,
        slapo_lab (and the factory's module for a factory spec; DeepSpeed inside ``train``).

    Raises:
        ExportError: an unknown launcher, a bad world size, a spec/call that fails validation
            (see :func:`~slapo_lab.export.spec.validate_calls`), a pipeline with constant (non-tensor)
            inputs, or tensor x pipeline parallelism with the DeepSpeed launcher.
    """
    if launcher not in LAUNCHERS:
        raise ExportError(f"The launcher {launcher!r} is not supported; use \"torchrun\" or \"deepspeed\".")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ExportError(f"world_size must be a positive integer, not {world_size!r}.")
    spec = validate_model_spec(spec)
    inputs = validate_input_spec(inputs)
    calls = validate_calls(calls)
    stages = pipeline_stages(calls)
    pipeline = stages > 1
    ds = launcher == "deepspeed"
    if pipeline and ds and world_size > 1:
        raise ExportError(f"DeepSpeed's pipeline engine runs pipeline x data parallelism only, but this schedule "
                          f"also has {world_size}-way tensor parallelism; export it with launcher=\"torchrun\" "
                          "(torch.distributed.pipelining runs tensor x pipeline x data parallelism).")
    constants = [k for k, e in inputs.items() if "value" in e]
    if pipeline and constants:
        raise ExportError(f"A pipeline feeds only tensors to its first stage, but the example input {constants[0]!r} "
                          "is a constant; drop it from the example inputs (or set it in the model config).")
    batch, seq = example_sizes(inputs)
    lines = schedule_lines(calls) or ["pass  # no recorded calls"]
    from .. import __version__

    name = script_name if isinstance(script_name, str) and _SAFE_NAME.match(script_name) else "train.py"
    labels = lm_labels(spec, inputs)
    parts = _model_parts(spec)
    batch = int(batch or 1)
    nproc = world_size * stages
    loss_kind = _loss_kind(spec, inputs)
    if pipeline:
        micro = stages if batch % stages == 0 else 1
        loss_doc = {"causal_lm": "The loss is next-token cross entropy of the logits against labels=input_ids "
                                 "(transformers' causal-LM loss), per micro-batch on the last stage.",
                    "lm": "The loss is cross entropy of the logits against labels=input_ids (transformers' "
                          "masked-LM loss), per micro-batch on the last stage.",
                    "probe": "The loss is the mean squared projection of the model's first floating-point output "
                             "onto a fixed random unit vector (seeded), per micro-batch on the last stage."}[loss_kind]
        runtime = ("DeepSpeed's pipeline engine (slapo_lab.build target \"deepspeed\")" if ds else
                   "torch.distributed.pipelining (slapo_lab.build, --pp-schedule 1F1B, GPipe or Interleaved1F1B)")
        what = (f"What it does: builds the full model {parts['BUILD_DOC']} with a fixed seed (random weights, "
                "identical on every rank); lays the processes out as tensor x pipeline x data parallelism "
                f"(slapo_lab.pipeline.make_mesh: tp = {world_size}, pp = {stages} stages, dp = the rest); "
                "applies the schedule on this rank's tensor-parallel group and splits the model into its "
                f"pipeline stages on {runtime}. With --verify (the default) it first runs one training step "
                "on a small batch (--verify-batch-size) next to an unscheduled copy (dropout off) and compares "
                "the loss, every gradient and every updated weight, printing the largest differences and "
                "exiting with status 1 on failure; then it frees the copy, puts the weights back and trains for --steps steps on synthetic inputs of the example's "
                "shapes (seeded), each data-parallel replica on its slice of the batch. " + loss_doc)
        headline = f"{stages} pipeline stages" + (f" x {world_size}-way tensor parallelism" if world_size > 1 else "")
        layout = ((f"Processes are laid out as tensor x pipeline x data parallelism (tp = {world_size}, pp = "
                   f"{stages}, neighbouring ranks form a tensor-parallel group)" if world_size > 1 else
                   f"Processes are laid out as pipeline x data parallelism (pp = {stages})")
                  + f": launch a multiple of {nproc}; the data-parallel size is the world size / {nproc}.")
    else:
        micro = 1
        if labels:
            loss_doc = "The loss is the model's own LM loss (labels=input_ids)."
        else:
            loss_doc = ("The loss is the model's own .loss when it returns one, else the mean squared projection "
                        "of its first output onto a fixed random unit vector (the same on every rank).")
        what = (f"What it does: builds the full model {parts['BUILD_DOC']} with a fixed seed (random "
                "weights, identical on every rank); with --verify (the default) keeps a copy, applies the schedule "
                "and checks this rank's shard against the copy on a small batch (--verify-batch-size; forward "
                "outputs and every gradient, sharded gradients gathered), printing the largest differences and "
                "exiting with status 1 on failure; then frees the copy and trains for --steps steps on synthetic inputs of the example's shapes (seeded)"
                + (", each data-parallel replica on its slice of the batch, with DeepSpeed's engine "
                   "(deepspeed.initialize). " if ds else ", the same on every rank. ") + loss_doc)
        headline = f"{world_size}-way tensor parallelism" if world_size > 1 else "one process"
        if ds:
            layout = (f"Processes are laid out as tensor x data parallelism (tp = {world_size}, neighbouring ranks "
                      f"form a tensor-parallel group): launch a multiple of {world_size}.")
        else:
            layout = f"One process per tensor-parallel rank; the world size must be {world_size}."
    if ds:
        headline += " on DeepSpeed"
    values = {
        "WHAT": textwrap.fill(what, width=100),
        "WORLD_SIZE": str(world_size),
        "HEADLINE": headline,
        "INTRO": textwrap.fill(f"Generated by slapo-lab {__version__} from a recorded schedule; edit freely. {layout}",
                               width=100),
        "GPUS": f"{world_size} GPUs" if world_size > 1 else "one GPU",
        "VERSION": __version__,
        "SCRIPT": name,
        "SEQ_OPT": "--seq-len, " if seq is not None else "",
        "INPUTS_JSON": _json_literal(inputs),
        "LM_LABELS": str(labels),
        "SCHEDULE_BODY": "\n".join("    " + ln for ln in lines),
        "BATCH": str(batch),
        "MICRO": str(micro),
        "SEQ_ARG": _sub(_SEQ_ARG, {"SEQ": str(int(seq))}) if seq is not None else "",
        "SEQ_VALUE": "args.seq_len" if seq is not None else "None",
        "SLAPO_IMPORTS": "import slapo_lab.pipeline  # isort: skip\n" if pipeline or ds else "",
        "PRE_INIT": _DS_PRE_INIT if ds else "",
        **parts,
    }
    layout_funcs = _sub(_LAYOUT_FUNCS, {"LAUNCH_HINT": "deepspeed --num_gpus " if ds else "torchrun --nproc_per_node="})
    if pipeline:
        values.update({
            "PIPE_CONSTANTS": (f"NUM_STAGES = {stages}  # pipeline stages: the recorded cuts + 1\n"
                               f"TARGET = {json.dumps('deepspeed' if ds else 'torch')}  # the slapo_lab.build target\n"
                               f"LOSS = {json.dumps(loss_kind)}  # the last stage's loss: causal_lm, lm or probe\n"
                               + _BF16_TOL),
            "BATCH_HELP": '"samples per step, over all data-parallel replicas"',
            "MICRO_HELP": '"micro-batches per step and replica (the pipeline\'s n_microbatches)"',
            "VERIFY_HELP": '"first check one training step against the unscheduled model"',
            "EXTRA_OPTS": "--dp, --print-ds-config, " if ds else "--bf16, --dp, --pp-schedule, --stages-per-rank, ",
            "EXTRA_ARGS": (_DP_ARG + _DS_ARGS) if ds else (_PIPE_BF16_ARG + _PIPE_ARGS + _DP_ARG),
            "VERIFY_BATCH_HELP": '"samples in the verified step (default: one per micro-batch and replica)"',
            "PLACE_CHECK": _PIPE_PLACE_CHECK,
            "ARGS_CHECK": _DP_CHECK if ds else _PIPE_CHECK + _DP_CHECK,
            "EXTRA_FUNCS": layout_funcs + (_DS_FUNCS if ds else "") + _sub(_PIPE_FUNCS, {
                "PP_SCHEDULE": '"1F1B"' if ds else "args.pp_schedule",
                "SPR": "1" if ds else "args.stages_per_rank",
                "DS_KW": ",\n                            ds_config=ds_config(args, dp)" if ds else ""}),
            "TRAIN": _sub(_TRAIN_PIPE, {"SEQ_VALUE": values["SEQ_VALUE"], "SPR": "1" if ds else "args.stages_per_rank",
                                        "PIPE_DTYPE": "torch.float32  # (DeepSpeed pipelines run fp32)" if ds else
                                        "torch.bfloat16 if args.bf16 else torch.float32",
                                        "SCHEDULE_DOC": "DeepSpeed 1F1B" if ds else "{args.pp_schedule}"}),
            "LAUNCH": _sub(_LAUNCH_DS if ds else _LAUNCH_PIPE, {"NPROC": str(nproc), "NPROC_DP": str(2 * nproc),
                                                              "WORLD_SIZE": str(world_size), "PP": str(stages),
                                                              "SCRIPT": name}),
        })
    elif ds:
        values.update({
            "PIPE_CONSTANTS": "NUM_STAGES = 1  # no pipeline cuts: tensor x data parallelism\n",
            "BATCH_HELP": '"samples per step, over all data-parallel replicas"',
            "MICRO_HELP": '"split each replica\'s batch and accumulate gradients"',
            "VERIFY_HELP": '"check the scheduled model against the unscheduled one first"',
            "EXTRA_OPTS": "--bf16, --dp, --print-ds-config, ",
            "EXTRA_ARGS": _BF16_ARG + _DP_ARG + _DS_ARGS,
            "VERIFY_BATCH_HELP": _TP_VERIFY_BATCH_HELP,
            "PLACE_CHECK": "",
            "ARGS_CHECK": _DP_CHECK,
            "EXTRA_FUNCS": layout_funcs + _DS_FUNCS,
            "TRAIN": _sub(_TRAIN_DS_TP, {"SEQ_VALUE": values["SEQ_VALUE"]}),
            "LAUNCH": _sub(_LAUNCH_DS, {"NPROC": str(nproc), "SCRIPT": name}),
        })
    else:
        values.update({
            "PIPE_CONSTANTS": "",
            "BATCH_HELP": '"samples per step (every rank sees all)"',
            "MICRO_HELP": '"split each batch and accumulate gradients"',
            "VERIFY_HELP": '"check the scheduled model against the unscheduled one first"',
            "EXTRA_OPTS": "--bf16, ",
            "EXTRA_ARGS": _BF16_ARG,
            "VERIFY_BATCH_HELP": _TP_VERIFY_BATCH_HELP,
            "PLACE_CHECK": "",
            "ARGS_CHECK": "",
            "EXTRA_FUNCS": "",
            "TRAIN": _sub(_TRAIN_TP, {"SEQ_VALUE": values["SEQ_VALUE"]}),
            "LAUNCH": _sub(_LAUNCH_TP, {"GPUS": values["GPUS"], "WORLD_SIZE": str(world_size), "SCRIPT": name})
                      + (_sub(_SINGLE, {"SCRIPT": name}) if world_size == 1 else ""),
        })
    if ds:
        micro_size = batch // micro if batch % micro == 0 else batch
        config = dict(DS_BASE, train_micro_batch_size_per_gpu=micro_size, gradient_accumulation_steps=micro,
                      train_batch_size=micro_size * micro)
        values["DS_DATA"] = ("# DeepSpeed's config (printed by --print-ds-config). The script hands DeepSpeed a torch optimizer\n"
                             "# (no \"optimizer\" section, so no fused-op builds); the batch sizes follow --batch-size,\n"
                             "# --micro-batches and the data-parallel size at run time (ds_config).\n"
                             f"DS_CONFIG = json.loads(\n{_json_literal(config)}\n)\n")
    else:
        values["DS_DATA"] = ""
    return _sub(TEMPLATE, values)


def export_script(path, model: nn.Module, calls, example_inputs: dict, world_size: int,
                  launcher: str = "torchrun", factory: str | None = None) -> Path:
    """Write the training script for ``model`` scheduled by ``calls`` to ``path``.

    Args:
        path: the script file to write (e.g. ``"train_bert.py"``); its folder must exist.
        model: the model the schedule was recorded on (see :func:`~slapo_lab.export.model_spec`).
        calls: the recorded calls (``sch.record.calls``).
        example_inputs: the keyword inputs of one forward call, e.g. ``{"input_ids": ids}`` with
            ``ids`` of shape ``(batch, seq)``: their shapes and dtypes become the script's defaults.
        world_size: the tensor-parallel width (processes to launch: this x the pipeline stages).
        launcher: ``"torchrun"`` or ``"deepspeed"`` (see :func:`render_script`).
        factory: ``"package.module:function"`` rebuilding the model, for a model its config cannot.

    Returns:
        The absolute path written (the file is replaced atomically: no partial script on failure).

    Raises:
        ExportError: everything :func:`render_script` and :func:`model_spec` raise, plus a missing,
            read-only or otherwise unwritable folder, or a path that is a folder.
    """
    path = Path(os.fspath(path)).expanduser()
    spec = model_spec(model, factory)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    inputs = input_spec(example_inputs, vocab if isinstance(vocab, int) else None)
    text = render_script(spec, calls, inputs, world_size, launcher, script_name=path.name)
    write_text_atomic(path, text)
    return path.resolve()


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file in the same folder and a rename.

    Raises:
        ExportError: one sentence for a path that is a folder, a missing folder, or any OSError.
    """
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise ExportError(f"{path} is a folder; give a file name such as {path / 'train.py'}.")
    if not folder.is_dir():
        if folder.exists():
            raise ExportError(f"Cannot write {path}: {folder} is a file, not a folder.")
        raise ExportError(f"Cannot write {path}: the folder {folder} does not exist.")
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
        tmp = None
    except OSError as err:
        reason = err.strerror or str(err)
        raise ExportError(f"Cannot write {path}: {reason[0].lower() + reason[1:] if reason else 'unknown error'}.") \
            from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
