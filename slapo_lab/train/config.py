"""Every option of a training run, typed: :class:`TrainConfig`, a dataclass of sections.

One home for each option's name, type, default, help text, form label and limits. The command line of an
exported script (:mod:`slapo_lab.train.args`) is generated from these fields, an exported script renders its
defaults as a ``TrainConfig(...)`` literal (:mod:`slapo_lab.export.script`), and the runtime
(:mod:`slapo_lab.train.run` and its helpers) reads typed fields (``cfg.optimizer.lr``), never an argparse
``Namespace``. The parallel degrees themselves live in :class:`slapo_lab.parallel_dims.ParallelDims`;
:meth:`ParallelOptions.dims` yields one.

The shape follows torchtitan's config: nested dataclasses, one per concern, whose fields carry their help
(``torchtitan/config/configs.py``; before its 2025 refactor ``torchtitan/config/job_config.py``), turned into a
command line by a manager that walks the fields (``torchtitan/config/manager.py``, ``ConfigManager``, through
tyro there, argparse here: the same flags, defaults and messages as this project's scripts always had).

Each field's ``metadata`` (:func:`option`) holds:

* ``help`` -- the ``--help`` text; ``label`` -- the Export form's label; ``noun`` -- the option in the form's
  sentences ("The global batch size must be ...", default: the label);
* ``min`` / ``max`` / ``choices`` -- the limits :meth:`_Section.__post_init__` checks;
* ``metavar``, ``flags`` (other spellings), ``only`` (``"deepspeed"`` / ``"pipeline"``: the option exists only
  in such a script), ``hidden`` (not listed by ``--help``).

Field names are unique over all sections: they are the command line's option names (``lr`` is ``--lr``), so a
config flattens to ``{name: value}`` (:meth:`TrainConfig.flat`) and back (:meth:`TrainConfig.from_flat`).

Standard library only (the launch preflight imports this before torch).

Raises (everywhere here): :class:`ConfigError`, one sentence naming the option (its command-line flag).
"""

from __future__ import annotations

import ast
import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..parallel_dims import ParallelDims

__all__ = [
    "LR_SCHEDULES",
    "OPTIMIZERS",
    "PP_SCHEDULES",
    "SAVE_DTYPES",
    "BatchOptions",
    "CheckpointOptions",
    "ConfigError",
    "DataOptions",
    "EvalOptions",
    "LaunchOptions",
    "MetricsOptions",
    "ModelOptions",
    "OptimizerOptions",
    "ParallelOptions",
    "PrecisionOptions",
    "ScheduleOptions",
    "TrainConfig",
    "VerifyOptions",
    "flag",
    "option",
    "option_fields",
    "option_type",
]

LR_SCHEDULES = ("constant", "linear", "cosine")
PP_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")
OPTIMIZERS = ("adamw", "sgd")
SAVE_DTYPES = ("auto", "float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """An option value or combination a run cannot use; ``str(err)`` is one sentence naming the option."""


def option(
    default: Any,
    help: str = "",
    *,
    label: str,
    min: float | None = None,
    max: float | None = None,
    choices: tuple | None = None,
    metavar: str | None = None,
    flags: tuple[str, ...] = (),
    only: str | None = None,
    hidden: bool = False,
    noun: str | None = None,
) -> Any:
    """A dataclass field of an options section, its metadata as in the module docstring.

    A value below ``min`` is refused as "--x must be at least 1, not 0" (``min=1``) or "--x must not be negative"
    (``min=0``); anything finer (``--epochs must be positive``) is the section's own ``_check``.
    """
    meta = {
        "help": help,
        "label": label,
        "min": min,
        "max": max,
        "choices": choices,
        "metavar": metavar,
        "flags": flags,
        "only": only,
        "hidden": hidden,
        "noun": noun or label,
    }
    return field(default=default, metadata=meta)


def flag(name: str) -> str:
    """The command-line flag of option ``name``: ``global_batch_size`` -> ``--global-batch-size``."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class _Section:
    """An options section: its fields' limits are checked on construction."""

    TITLE: ClassVar[str] = ""  # the --help group the section's options are listed under

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check_limits(f, getattr(self, f.name))
        self._check()

    def _check(self) -> None:
        """The section's checks between its own fields (one sentence each)."""


def _check_limits(f: dataclasses.Field, value: Any) -> None:
    meta = f.metadata
    if value is None:
        return
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"{flag(f.name)} must be one of {', '.join(map(str, choices))}, not {value!r}.")
    low, high = meta.get("min"), meta.get("max")
    if low is not None and value < low:
        if low == 1:
            raise ConfigError(f"{flag(f.name)} must be at least 1, not {value}")
        raise ConfigError(f"{flag(f.name)} must not be negative")
    if high is not None and value > high:
        raise ConfigError(f"{flag(f.name)} must be at most {high}, not {value}")


# ---------------------------------------------------------------------------------------------- sections
@dataclass(frozen=True)
class ModelOptions(_Section):
    """The model's weights and tokenizer."""

    TITLE: ClassVar[str] = "model and data"
    model_path: str | None = option(
        None,
        "a Hugging Face model directory (config.json + *.safetensors, sharded index too) to fine-tune; each rank "
        "reads only its own slices. Without it the model gets seeded random weights",
        label="model path",
        metavar="DIR",
    )
    tokenizer: str | None = option(
        None,
        "the tokenizer directory (default: --model-path)",
        label="tokenizer",
        noun="tokenizer directory",
        metavar="DIR",
    )

    @property
    def tokenizer_dir(self) -> str | None:
        """The tokenizer directory the run reads: ``tokenizer``, else ``model_path`` (None: neither)."""
        return self.tokenizer if self.tokenizer is not None else self.model_path


@dataclass(frozen=True)
class DataOptions(_Section):
    """The training text (or synthetic inputs), its sequence length, and the seed."""

    TITLE: ClassVar[str] = "model and data"
    data: str = option(
        "synthetic",
        "training text: a .txt, a .jsonl with a 'text' field, a .parquet, or a directory of them; 'synthetic' "
        "trains on random inputs shaped like the example (a benchmark)",
        label="data",
        noun="data path",
        metavar="PATH",
    )
    seq_len: int | None = option(
        None, "tokens per training sequence", label="seq len", noun="sequence length", min=1, metavar="N"
    )
    seed: int = option(1234, "seed of the random weights, the data order and dropout", label="seed")

    def _check(self) -> None:
        if self.data != "synthetic" and self.seq_len is None:
            raise ConfigError("--data needs --seq-len (tokens per training sequence)")


@dataclass(frozen=True)
class EvalOptions(_Section):
    """Validation: the data, how often, how much."""

    TITLE: ClassVar[str] = "model and data"
    eval_data: str | None = option(
        None,
        "validation text, same formats as --data",
        label="eval data",
        noun="validation data path",
        metavar="PATH",
    )
    eval_every: int = option(
        0,
        "report the validation loss every N steps (0: at the end only)",
        label="eval every",
        min=0,
        metavar="N",
    )
    eval_samples: int | None = option(
        None,
        "validation sequences per evaluation (default: all)",
        label="eval samples",
        min=1,
        metavar="N",
    )

    def _check(self) -> None:
        if self.eval_every and not self.eval_data:
            raise ConfigError("--eval-every needs --eval-data")


@dataclass(frozen=True)
class ParallelOptions(_Section):
    """Data parallelism over the ``tp x pp`` replicas the schedule defines, the pipeline schedule, the device."""

    TITLE: ClassVar[str] = "parallelism"
    dp: int | None = option(
        None,
        "data-parallel replicas (default: world size / (tp x pp)); world size = tp x pp x dp",
        label="dp",
        noun="number of data-parallel replicas (dp)",
        min=1,
        metavar="N",
    )
    fsdp: bool = option(
        False,
        "shard parameters, gradients and optimizer states over the data-parallel replicas (FSDP2)",
        label="FSDP",
    )
    zero: int = option(
        0,
        "DeepSpeed ZeRO stage",
        label="ZeRO",
        noun="ZeRO stage",
        min=0,
        max=2,
        choices=(0, 1, 2),
        only="deepspeed",
    )
    pp_schedule: str = option(
        "1F1B",
        "the torch.distributed.pipelining schedule",
        label="pp schedule",
        choices=PP_SCHEDULES,
        only="pipeline",
    )
    stages_per_rank: int = option(
        1,
        "pipeline stages per pipeline rank (> 1 needs --pp-schedule Interleaved1F1B)",
        label="stages per rank",
        only="pipeline",
    )
    device: str | None = option(
        None,
        "cuda: one GPU per process (local rank % GPUs); default: cuda if available",
        label="device",
        choices=("cuda", "cpu"),
    )
    backend: str = option(
        "auto",
        "process group backend: auto = nccl on cuda, gloo on cpu",
        label="backend",
        choices=("auto", "nccl", "gloo"),
    )

    def _check(self) -> None:
        if self.backend == "nccl" and self.device == "cpu":
            raise ConfigError(
                "--backend nccl moves CUDA tensors only; use --backend gloo (or auto) with --device cpu"
            )
        if self.stages_per_rank < 1:
            raise ConfigError("--stages-per-rank must be at least 1")
        if self.stages_per_rank > 1 and self.pp_schedule != "Interleaved1F1B":
            raise ConfigError("--stages-per-rank > 1 needs --pp-schedule Interleaved1F1B")
        if self.zero and self.fsdp:
            raise ConfigError("--fsdp and --zero both shard over the data-parallel replicas; choose one")

    def dims(self, tp: int, pp: int, world: int) -> ParallelDims:
        """The :class:`ParallelDims` of ``tp x pp`` replicas in ``world`` processes: ``--dp`` replicas when given,
        else as many as fit (:meth:`ParallelDims.filling`).

        Raises:
            ParallelDimsError: a degree or ``world`` that is not a positive integer.
        """
        return ParallelDims(tp, pp, self.dp or ParallelDims.filling(world, tp, pp)[0].dp)


@dataclass(frozen=True)
class BatchOptions(_Section):
    """Batch sizes (sequences) and the length of the run (optimizer steps or epochs).

    ``global_batch_size`` None (and :class:`DataOptions`' ``seq_len`` None) mean the script's example inputs'
    batch size (sequence length): the command line's defaults (:func:`slapo_lab.train.args.build_parser`), so a
    parsed config always holds a number.
    """

    TITLE: ClassVar[str] = "batch and steps"
    global_batch_size: int | None = option(
        None,
        "sequences per optimizer step over all replicas, the same whatever the layout (gradient accumulation "
        "makes up the difference)",
        label="global batch",
        noun="global batch size",
        min=1,
        metavar="N",
    )
    micro_batch_size: int | None = option(
        None,
        "sequences per forward pass and replica (default: the global batch / dp, or / the pipeline stages for "
        "a pipeline)",
        label="micro batch",
        noun="micro batch size",
        min=1,
        metavar="N",
    )
    steps: int = option(
        10, "optimizer steps to train for", label="steps", noun="number of steps", min=0, metavar="N"
    )
    epochs: float | None = option(
        None, "train for E passes over --data instead of --steps", label="epochs", metavar="E"
    )

    def _check(self) -> None:
        if self.epochs is not None and self.epochs <= 0:
            raise ConfigError("--epochs must be positive")


@dataclass(frozen=True)
class OptimizerOptions(_Section):
    """The optimizer (``torch.optim.AdamW`` or ``SGD``) and gradient clipping."""

    TITLE: ClassVar[str] = "optimizer"
    optimizer: str = option("adamw", label="optimizer", choices=OPTIMIZERS)
    lr: float = option(1e-4, "peak learning rate", label="lr", noun="learning rate", min=0)
    weight_decay: float = option(0.0, "decoupled weight decay (AdamW)", label="weight decay", min=0)
    adam_beta1: float = option(0.9, label="Adam beta1")
    adam_beta2: float = option(0.999, label="Adam beta2")
    adam_eps: float = option(1e-8, label="Adam epsilon")
    max_grad_norm: float = option(
        1.0,
        "clip gradients to this global norm (over every shard, replica and stage); 0: no clipping",
        label="max grad norm",
        min=0,
    )


@dataclass(frozen=True)
class ScheduleOptions(_Section):
    """The learning-rate schedule (``torch.optim.lr_scheduler``)."""

    TITLE: ClassVar[str] = "optimizer"
    warmup_steps: int = option(0, "linear warm-up steps from 0 to --lr", label="warm-up steps", min=0)
    lr_schedule: str = option(
        "linear",
        "after warm-up: constant, linear decay to 0, or cosine decay to 0 (torch.optim.lr_scheduler)",
        label="lr schedule",
        choices=LR_SCHEDULES,
    )


@dataclass(frozen=True)
class CheckpointOptions(_Section):
    """``torch.distributed.checkpoint`` checkpoints and the Hugging Face directory written at the end."""

    TITLE: ClassVar[str] = "checkpoints and output"
    checkpoint_dir: str | None = option(
        None,
        "save torch.distributed.checkpoint checkpoints here; a relaunch resumes from the latest complete one "
        "(at any layout)",
        label="checkpoints",
        noun="checkpoint directory",
        metavar="DIR",
    )
    checkpoint_every: int = option(
        0,
        "save every N steps (0: only at the end)",
        label="every",
        noun="checkpoint interval (every)",
        min=0,
        metavar="N",
    )
    keep_checkpoints: int = option(0, "keep the K newest (0: all)", label="keep", min=0, metavar="K")
    no_resume: bool = option(False, "start fresh even if --checkpoint-dir has checkpoints", label="no resume")
    save_hf: str | None = option(
        None,
        "at the end, write a Hugging Face directory (safetensors, config, tokenizer) that from_pretrained loads",
        label="save HF",
        noun="save-HF directory",
        metavar="DIR",
    )
    save_dtype: str = option(
        "auto",
        "dtype of --save-hf weights (auto: the pretrained checkpoint's, else float32)",
        label="save dtype",
        choices=SAVE_DTYPES,
    )

    def _check(self) -> None:
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ConfigError("--checkpoint-every needs --checkpoint-dir")


@dataclass(frozen=True)
class PrecisionOptions(_Section):
    """Compute precision and compilation."""

    TITLE: ClassVar[str] = "precision and speed"
    bf16: bool = option(False, "bfloat16 compute with fp32 master weights", label="bf16")
    compile: bool = option(False, "torch.compile each repeated block (fullgraph)", label="compile")
    compile_backend: str = option(
        "inductor",
        "the torch.compile backend of --compile (aot_eager: checks the graphs without code generation)",
        label="compile backend",
    )


@dataclass(frozen=True)
class VerifyOptions(_Section):
    """Verify: the scheduled model against the unscheduled one before training."""

    TITLE: ClassVar[str] = "verify"
    verify: bool = option(
        True,
        "first prove that the scheduled model's loss, outputs and every gradient equal the unscheduled "
        "model's on a small batch",
        label="verify",
    )
    verify_batch_size: int | None = option(
        None,
        "sequences Verify runs on (default: 2, or one pipeline step's batch)",
        label="verify batch",
        min=1,
        metavar="N",
    )
    verify_seq_len: int | None = option(
        None,
        "tokens per sequence in Verify (default: min(--seq-len, 64); pipelines: --seq-len)",
        label="verify seq len",
        min=1,
        metavar="N",
    )


@dataclass(frozen=True)
class MetricsOptions(_Section):
    """Progress, TensorBoard events and metrics.csv, MFU."""

    TITLE: ClassVar[str] = "progress and metrics"
    log_dir: str | None = option(
        None,
        "write TensorBoard events and metrics.csv here",
        label="log dir",
        noun="log directory",
        metavar="DIR",
    )
    progress: str = option(
        "auto",
        "a tqdm bar on rank 0 (auto: when attached to a terminal)",
        label="progress",
        choices=("auto", "on", "off"),
    )
    peak_tflops: float | None = option(
        None,
        "peak TFLOP/s per GPU in the precision run, for MFU (default: looked up by GPU name)",
        label="peak TFLOP/s",
    )
    predicted_step_s: float | None = option(
        None,
        "a plan's predicted seconds per optimizer step (slapo_lab.planner): each step's time is printed as a ratio "
        "to it, and the median at the end",
        label="predicted step time (s)",
        min=0,
    )
    predicted_peak_gib: float | None = option(
        None,
        "a plan's predicted peak allocated GiB of the busiest rank: rank 0's measured peak is printed as a ratio "
        "to it at the end",
        label="predicted peak memory (GiB)",
        min=0,
    )


@dataclass(frozen=True)
class LaunchOptions(_Section):
    """What the launcher passes and one-shot actions (DeepSpeed scripts only)."""

    TITLE: ClassVar[str] = "parallelism"
    print_ds_config: bool = option(
        False, "print the DeepSpeed config and exit", label="print DS config", only="deepspeed"
    )
    local_rank: int | None = option(
        None, label="local rank", flags=("--local_rank", "--local-rank"), only="deepspeed", hidden=True
    )


# ---------------------------------------------------------------------------------------------- the config
@dataclass(frozen=True)
class TrainConfig:
    """Every option of a training run, one section per concern (see the module docstring).

    Build one from Python (``TrainConfig(optimizer=OptimizerOptions(lr=3e-4))``), from a command line
    (:meth:`from_args`) or from flat ``{option: value}`` (:meth:`from_flat`); :meth:`to_argv` writes the command
    line back. Frozen: what the run derives (the steps of ``--epochs``, the device it picked) lives on the run.

    Raises:
        ConfigError: a value outside its limits, or options that do not go together (one sentence naming the
            option, e.g. ``--checkpoint-every needs --checkpoint-dir``).
    """

    model: ModelOptions = field(default_factory=ModelOptions)
    data: DataOptions = field(default_factory=DataOptions)
    eval: EvalOptions = field(default_factory=EvalOptions)
    parallel: ParallelOptions = field(default_factory=ParallelOptions)
    batch: BatchOptions = field(default_factory=BatchOptions)
    optimizer: OptimizerOptions = field(default_factory=OptimizerOptions)
    lr_schedule: ScheduleOptions = field(default_factory=ScheduleOptions)
    checkpoint: CheckpointOptions = field(default_factory=CheckpointOptions)
    precision: PrecisionOptions = field(default_factory=PrecisionOptions)
    verify: VerifyOptions = field(default_factory=VerifyOptions)
    metrics: MetricsOptions = field(default_factory=MetricsOptions)
    launch: LaunchOptions = field(default_factory=LaunchOptions)

    def __post_init__(self) -> None:
        for s in dataclasses.fields(self):
            value = getattr(self, s.name)
            if not isinstance(value, s.default_factory):
                raise ConfigError(
                    f"TrainConfig's {s.name} must be a {s.default_factory.__name__}, not {type(value).__name__}."
                )

    # -- flat views
    def flat(self) -> dict[str, Any]:
        """``{option name: value}`` over every section."""
        return {f.name: getattr(sec, f.name) for sec in self.sections() for f in dataclasses.fields(sec)}

    def sections(self) -> list[_Section]:
        """The section objects, in declaration order."""
        return [getattr(self, s.name) for s in dataclasses.fields(self)]

    @classmethod
    def from_flat(cls, values: Mapping[str, Any], base: TrainConfig | None = None) -> TrainConfig:
        """The config whose options are ``values`` (missing ones: ``base``'s, else the defaults).

        Raises:
            ConfigError: an unknown option name, or a bad value (see the class).
        """
        known = option_fields()
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(f"unknown option(s) {', '.join(unknown)}")
        base = base or cls()
        kwargs = {}
        for s in dataclasses.fields(cls):
            sec = getattr(base, s.name)
            mine = {f.name: values[f.name] for f in dataclasses.fields(sec) if f.name in values}
            kwargs[s.name] = dataclasses.replace(sec, **mine) if mine else sec
        return cls(**kwargs)

    @classmethod
    def from_args(
        cls, argv: list[str] | None = None, *, launcher: str = "torchrun", pipeline: bool = False
    ) -> TrainConfig:
        """Parse a command line of an exported script's flags (:func:`slapo_lab.train.args.build_parser`; a bad
        value exits with status 2 and one sentence, as argparse does)."""
        from .args import build_parser, parse_args  # noqa: PLC0415 - a cycle: args builds its parser from this module

        return parse_args(build_parser(launcher=launcher, pipeline=pipeline), argv)

    def to_argv(self) -> list[str]:
        """The command-line flags that set every option differing from the defaults (``from_args`` of them gives
        this config back)."""
        out: list[str] = []
        defaults = TrainConfig().flat()
        for name, value in self.flat().items():
            if value == defaults[name]:
                continue
            if isinstance(value, bool):
                out.append(flag(name) if value else f"--no-{name.replace('_', '-')}")
            elif value is None:
                raise ConfigError(f"{flag(name)} cannot be set back to its default on the command line.")
            else:
                out += [flag(name), repr(value) if isinstance(value, float) else str(value)]
        return out

    def changed(self) -> dict[str, Any]:
        """``{option: value}`` of the options set to other values than the defaults (what an export chose)."""
        base = TrainConfig().flat()
        return {k: v for k, v in self.flat().items() if v != base[k]}

    # -- as Python source
    def literal(self, indent: int = 4, width: int = 110) -> str:
        """This config as Python source: ``TrainConfig(data=DataOptions(data='corpus.jsonl', seq_len=128), ...)``
        naming only the options that differ from the defaults (values as ``repr``), one section per line, wrapped
        to ``width`` columns. :meth:`from_literal` reads it back."""
        parts = []
        for s in dataclasses.fields(self):
            sec = getattr(self, s.name)
            base = s.default_factory()
            items = [
                f"{f.name}={getattr(sec, f.name)!r}"
                for f in dataclasses.fields(sec)
                if getattr(sec, f.name) != getattr(base, f.name)
            ]
            if not items:
                continue
            cls = type(sec).__name__
            one = f"{s.name}={cls}({', '.join(items)}),"
            if indent + len(one) <= width:
                parts.append(" " * indent + one)
            else:
                inner = "".join(f"{' ' * (2 * indent)}{it},\n" for it in items)
                parts.append(f"{' ' * indent}{s.name}={cls}(\n{inner}{' ' * indent}),")
        if not parts:
            return "TrainConfig()"
        return "TrainConfig(\n" + "\n".join(parts) + "\n)"

    def section_classes(self) -> list[str]:
        """The names of the section classes :meth:`literal` uses, sorted (what a script imports)."""
        return sorted({type(getattr(self, k)).__name__ for k in _sections_of(self.changed())})

    @classmethod
    def from_literal(cls, source: str) -> TrainConfig:
        """Read :meth:`literal`'s text back without running it: the expression must be ``TrainConfig(...)`` of
        section classes whose arguments are Python literals (``ast.literal_eval``), nothing else.

        Raises:
            ConfigError: any other expression, or a bad value.
        """
        node = ast.parse(source.strip(), mode="eval").body
        sections = {s.name: s.default_factory for s in dataclasses.fields(cls)}

        def call_of(n, name: str) -> dict[str, Any]:
            if not (
                isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name and not n.args
            ):
                raise ConfigError(
                    f"expected a {name}(...) call of keyword literals, not {ast.unparse(n)[:60]!r}."
                )
            return {k.arg: k.value for k in n.keywords}

        kwargs = {}
        for name, sub in call_of(node, cls.__name__).items():
            if name not in sections:
                raise ConfigError(f"TrainConfig has no section {name!r}.")
            values = {k: ast.literal_eval(v) for k, v in call_of(sub, sections[name].__name__).items()}
            try:
                kwargs[name] = sections[name](**values)
            except TypeError:
                unknown = sorted(set(values) - {f.name for f in dataclasses.fields(sections[name])})
                raise ConfigError(f"{sections[name].__name__} has no option {', '.join(unknown)}.") from None
        return cls(**kwargs)

    # -- derived
    def dims(self, tp: int, pp: int, world: int) -> ParallelDims:
        """:meth:`ParallelOptions.dims` of this config."""
        return self.parallel.dims(tp, pp, world)


def _sections_of(names) -> list[str]:
    """The TrainConfig section names holding the options ``names``, in declaration order."""
    fields = option_fields()
    owner = {s.default_factory: s.name for s in dataclasses.fields(TrainConfig)}
    wanted = {owner[fields[n][0]] for n in names}
    return [s.name for s in dataclasses.fields(TrainConfig) if s.name in wanted]


def option_type(name: str) -> type:
    """``int`` / ``float`` / ``str`` / ``bool`` of option ``name`` (its annotation, ``| None`` dropped)."""
    section = option_fields()[name][0]
    hint = typing.get_type_hints(section)[name]
    if isinstance(hint, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def option_fields() -> dict[str, tuple[type, dataclasses.Field]]:
    """``{option name: (section class, field)}`` over every section of :class:`TrainConfig`, in order."""
    out = {}
    for s in dataclasses.fields(TrainConfig):
        for f in dataclasses.fields(s.default_factory):
            out[f.name] = (s.default_factory, f)
    return out
