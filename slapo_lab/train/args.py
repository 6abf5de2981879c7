"""The command line of an exported training script.

Every option has a default; an export may bake its own defaults (the model path, the data, the
data-parallel size ...) into the script, which the command line still overrides. A bad combination is
refused by argparse with one sentence and exit status 2 before anything is built.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

LR_SCHEDULES = ("constant", "linear", "cosine")
PP_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")
OPTIMIZERS = ("adamw", "sgd")
SAVE_DTYPES = ("auto", "float32", "bfloat16", "float16")


def build_parser(
    description: str = "",
    launcher: str = "torchrun",
    pipeline: bool = False,
    example_batch: int = 1,
    example_seq: int | None = None,
    defaults: dict[str, Any] | None = None,
) -> argparse.ArgumentParser:
    """The argument parser of one exported script.

    Args:
        description: the first line of ``--help``.
        launcher: ``"torchrun"`` or ``"deepspeed"`` (adds ``--zero`` and ``--print-ds-config``).
        pipeline: whether the schedule has pipeline cuts (adds ``--pp-schedule``, ``--stages-per-rank``).
        example_batch / example_seq: the example inputs' batch size and sequence length (the defaults
            of ``--global-batch-size`` and ``--seq-len``).
        defaults: option defaults baked in by the export (``{"model_path": ..., "data": ..., "dp": 2}``).
    """
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    g = p.add_argument_group("model and data")
    g.add_argument(
        "--model-path",
        default=None,
        metavar="DIR",
        help="a Hugging Face model directory (config.json + *.safetensors, sharded index too) to "
        "fine-tune; each rank reads only its own slices. Without it the model gets seeded "
        "random weights",
    )
    g.add_argument(
        "--tokenizer", default=None, metavar="DIR", help="the tokenizer directory (default: --model-path)"
    )
    g.add_argument(
        "--data",
        default="synthetic",
        metavar="PATH",
        help="training text: a .txt, a .jsonl with a 'text' field, a .parquet, or a directory of them; "
        "'synthetic' trains on random inputs shaped like the example (a benchmark)",
    )
    g.add_argument(
        "--eval-data", default=None, metavar="PATH", help="validation text, same formats as --data"
    )
    g.add_argument(
        "--eval-every",
        type=int,
        default=0,
        metavar="N",
        help="report the validation loss every N steps (0: at the end only)",
    )
    g.add_argument(
        "--eval-samples",
        type=int,
        default=None,
        metavar="N",
        help="validation sequences per evaluation (default: all)",
    )
    g.add_argument(
        "--seq-len", type=int, default=example_seq, metavar="N", help="tokens per training sequence"
    )
    g.add_argument(
        "--seed", type=int, default=1234, help="seed of the random weights, the data order and dropout"
    )

    g = p.add_argument_group("parallelism")
    g.add_argument(
        "--dp",
        type=int,
        default=None,
        metavar="N",
        help="data-parallel replicas (default: world size / (tp x pp)); world size = tp x pp x dp",
    )
    g.add_argument(
        "--fsdp",
        action="store_true",
        help="shard parameters, gradients and optimizer states over the data-parallel replicas (FSDP2)",
    )
    if launcher == "deepspeed":
        g.add_argument("--zero", type=int, choices=(0, 1, 2), default=0, help="DeepSpeed ZeRO stage")
        g.add_argument("--print-ds-config", action="store_true", help="print the DeepSpeed config and exit")
        g.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    if pipeline:
        g.add_argument(
            "--pp-schedule",
            choices=PP_SCHEDULES,
            default="1F1B",
            help="the torch.distributed.pipelining schedule",
        )
        g.add_argument(
            "--stages-per-rank",
            type=int,
            default=1,
            help="pipeline stages per pipeline rank (> 1 needs --pp-schedule Interleaved1F1B)",
        )
    g.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default=None,
        help="cuda: one GPU per process (local rank %% GPUs); default: cuda if available",
    )
    g.add_argument(
        "--backend",
        choices=("auto", "nccl", "gloo"),
        default="auto",
        help="process group backend: auto = nccl on cuda, gloo on cpu",
    )

    g = p.add_argument_group("batch and steps")
    g.add_argument(
        "--global-batch-size",
        type=int,
        default=example_batch,
        metavar="N",
        help="sequences per optimizer step over all replicas, the same whatever the layout "
        "(gradient accumulation makes up the difference)",
    )
    g.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        metavar="N",
        help="sequences per forward pass and replica (default: the global batch / dp, or / the "
        "pipeline stages for a pipeline)",
    )
    g.add_argument("--steps", type=int, default=10, metavar="N", help="optimizer steps to train for")
    g.add_argument(
        "--epochs",
        type=float,
        default=None,
        metavar="E",
        help="train for E passes over --data instead of --steps",
    )

    g = p.add_argument_group("optimizer")
    g.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    g.add_argument("--lr", type=float, default=1e-4, help="peak learning rate")
    g.add_argument("--weight-decay", type=float, default=0.0, help="decoupled weight decay (AdamW)")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up steps from 0 to --lr")
    g.add_argument(
        "--lr-schedule",
        choices=LR_SCHEDULES,
        default="linear",
        help="after warm-up: constant, linear decay to 0, or cosine decay to 0 (torch.optim.lr_scheduler)",
    )
    g.add_argument(
        "--max-grad-norm",
        type=float,
        default=1.0,
        help="clip gradients to this global norm (over every shard, replica and stage); 0: no clipping",
    )

    g = p.add_argument_group("checkpoints and output")
    g.add_argument(
        "--checkpoint-dir",
        default=None,
        metavar="DIR",
        help="save torch.distributed.checkpoint checkpoints here; a relaunch resumes from the latest "
        "complete one (at any layout)",
    )
    g.add_argument(
        "--checkpoint-every", type=int, default=0, metavar="N", help="save every N steps (0: only at the end)"
    )
    g.add_argument("--keep-checkpoints", type=int, default=0, metavar="K", help="keep the K newest (0: all)")
    g.add_argument(
        "--no-resume", action="store_true", help="start fresh even if --checkpoint-dir has checkpoints"
    )
    g.add_argument(
        "--save-hf",
        default=None,
        metavar="DIR",
        help="at the end, write a Hugging Face directory (safetensors, config, tokenizer) that "
        "from_pretrained loads",
    )
    g.add_argument(
        "--save-dtype",
        choices=SAVE_DTYPES,
        default="auto",
        help="dtype of --save-hf weights (auto: the pretrained checkpoint's, else float32)",
    )

    g = p.add_argument_group("precision and speed")
    g.add_argument("--bf16", action="store_true", help="bfloat16 compute with fp32 master weights")
    g.add_argument("--compile", action="store_true", help="torch.compile each repeated block (fullgraph)")
    g.add_argument(
        "--compile-backend",
        default="inductor",
        help="the torch.compile backend of --compile (aot_eager: checks the graphs without code generation)",
    )

    g = p.add_argument_group("verify")
    g.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="first prove that the scheduled model's loss, outputs and every gradient equal the "
        "unscheduled model's on a small batch",
    )
    g.add_argument(
        "--verify-batch-size",
        type=int,
        default=None,
        metavar="N",
        help="sequences Verify runs on (default: 2, or one pipeline step's batch)",
    )
    g.add_argument(
        "--verify-seq-len",
        type=int,
        default=None,
        metavar="N",
        help="tokens per sequence in Verify (default: min(--seq-len, 64); pipelines: --seq-len)",
    )

    g = p.add_argument_group("progress and metrics")
    g.add_argument(
        "--log-dir", default=None, metavar="DIR", help="write TensorBoard events and metrics.csv here"
    )
    g.add_argument(
        "--progress",
        choices=("auto", "on", "off"),
        default="auto",
        help="a tqdm bar on rank 0 (auto: when attached to a terminal)",
    )
    g.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="peak TFLOP/s per GPU in the precision run, for MFU (default: looked up by GPU name)",
    )
    if defaults:
        known = {a.dest for a in p._actions}
        unknown = sorted(set(defaults) - known)
        if unknown:
            raise ValueError(f"unknown default option(s) {', '.join(unknown)}")
        p.set_defaults(**defaults)
    return p


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check ``argv``; a bad value or combination exits with status 2 and one sentence."""
    args = parser.parse_args(argv)
    positive = {
        "global_batch_size": args.global_batch_size,
        "micro_batch_size": args.micro_batch_size,
        "seq_len": args.seq_len,
        "dp": args.dp,
        "verify_batch_size": args.verify_batch_size,
        "verify_seq_len": args.verify_seq_len,
        "eval_samples": args.eval_samples,
    }
    for name, value in positive.items():
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, not {value}")
    for name in ("steps", "warmup_steps", "checkpoint_every", "keep_checkpoints", "eval_every"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must not be negative")
    if args.epochs is not None and args.epochs <= 0:
        parser.error("--epochs must be positive")
    if args.lr < 0 or args.max_grad_norm < 0 or args.weight_decay < 0:
        parser.error("--lr, --max-grad-norm and --weight-decay must not be negative")
    if args.backend == "nccl" and args.device == "cpu":
        parser.error("--backend nccl moves CUDA tensors only; use --backend gloo (or auto) with --device cpu")
    if args.data != "synthetic" and args.seq_len is None:
        parser.error("--data needs --seq-len (tokens per training sequence)")
    if args.checkpoint_every and not args.checkpoint_dir:
        parser.error("--checkpoint-every needs --checkpoint-dir")
    if args.eval_every and not args.eval_data:
        parser.error("--eval-every needs --eval-data")
    if getattr(args, "stages_per_rank", 1) < 1:
        parser.error("--stages-per-rank must be at least 1")
    if getattr(args, "stages_per_rank", 1) > 1 and getattr(args, "pp_schedule", None) != "Interleaved1F1B":
        parser.error("--stages-per-rank > 1 needs --pp-schedule Interleaved1F1B")
    if getattr(args, "zero", 0) and args.fsdp:
        parser.error("--fsdp and --zero both shard over the data-parallel replicas; choose one")
    if args.tokenizer is None:
        args.tokenizer = args.model_path
    return args
