"""Loading big schedule files (issue 18 figures): calls per second, and the refusal above the bound.

A file is a realistic editor save of a tiny transformers model (BERT or GPT-2 from a config): the
Megatron preset and a checkpoint per block (one action each), then typed ``annotate`` lines -- the one
primitive that may legally repeat on the same tensor (it overwrites the tag) -- until the file has N
calls, each typed line its own action in ``meta["editor_actions"]``, as :meth:`ScheduleEditor.save`
writes them. For each N it times, median of ``--reps`` runs:

  * baseline: ``json.loads`` of the file's text (read included, garbage collector paused), the least
    any loader pays;
  * (a) ``load_schedule`` (read, parse, bound checks, validate every call);
  * (b) ``replay`` of the loaded calls onto a fresh ``create_schedule`` of a meta copy of the model;
  * (c) ``ScheduleEditor.load`` end to end (the above, plus the editor's rebuild and redraw);

and prints calls per second and the ratio to the baseline. Then a file over the bound
(``--over`` calls, 290,000 like the issue's 50 MB file) is refused by ``load_schedule`` and by the
editor: the time, the sentence, and that the editor kept its schedule.

Usage: python benchmarks/schedule_load_bench.py [--calls 10000 25000 50000] [--models bert gpt2]
       [--reps 3] [--over 290000] [--no-editor]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import slapo_lab as sl
from slapo_lab import presets
from slapo_lab.export import io
from slapo_lab.record import SCHEMA, SCHEMA_VERSION, Call, format_call
from slapo_lab.utils import meta_copy

KEYS = ("lr_scale", "weight_decay_group", "tag")
# the bound (None: a slapo-lab without one, to measure the code before it)
MAX_CALLS = getattr(io, "MAX_SCHEDULE_CALLS", None)
MAX_BYTES = getattr(io, "MAX_SCHEDULE_BYTES", None)


def tiny(name: str):
    """``(model, example inputs)``: a 2-layer BERT or GPT-2 (hidden 64, 4 heads) built from its config."""
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    if name == "bert":
        cfg = BertConfig(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            intermediate_size=128,
            vocab_size=120,
            max_position_embeddings=64,
        )
        model = BertModel(cfg)
    else:
        cfg = GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=120, n_positions=64, bos_token_id=0, eos_token_id=0
        )
        model = GPT2LMHeadModel(cfg)
    return model, {"input_ids": torch.randint(0, 120, (2, 16))}


def schedule_calls(model, n: int) -> tuple[list[Call], list[list]]:
    """``n`` valid calls (preset + checkpoints + annotate lines) and their editor actions."""
    sch = sl.create_schedule(meta_copy(model), world_size=2)
    with sch.record.action("preset megatron"):
        presets.megatron_tp(sch, vocab_parallel=presets.has_vocab_embedding(sch))
    n_preset = len(sch.record.calls)
    with sch.record.action("preset checkpoint"):
        presets.checkpoint_blocks(sch)
    head = list(sch.record.calls)[:n]
    actions = [["preset megatron", min(n_preset, len(head))]]
    if len(head) > n_preset:
        actions.append(["preset checkpoint", len(head) - n_preset])
    params = [n.rpartition(".") for n, _ in model.named_parameters()]
    calls = list(head)
    i = 0
    while len(calls) < n:
        path, _, pname = params[i % len(params)]
        value = (0.5 + (i % 100) / 200, i % 3, f"trial{i}")[i % 3]  # a third of the lines unique
        call = Call(path, "annotate", (pname, KEYS[i % len(KEYS)], value), {})
        calls.append(call)
        actions.append([format_call(call), 1])
        i += 1
    return calls, actions


def write_file(folder: Path, name: str, model, inputs, n: int, compact: bool = False) -> Path:
    """The file the editor saves for ``n`` calls; ``compact``: the same calls as JSON without spaces or
    editor actions (about 110 bytes a call, so that the call count, not the size, is what is over)."""
    calls, actions = schedule_calls(model, n)
    path = folder / f"{name}-{n}{'-compact' if compact else ''}.json"
    if compact:
        data = {"schema": SCHEMA, "version": SCHEMA_VERSION, "meta": {"world_size": 2}}
        data["calls"] = [c.to_json() for c in calls]
        path.write_text(json.dumps(data, separators=(",", ":")), encoding="utf-8")
        return path
    return sl.save_schedule(
        path, calls, model=model, example_inputs=inputs, world_size=2, meta={"editor_actions": actions}
    )


def json_time(path: Path, reps: int) -> float:
    """The baseline: ``json.loads`` of the file's text (read included), the garbage collector paused so
    that the figure is the parser's own cost (with it, the same parse varies several-fold with the heap)."""

    def parse():
        gc.disable()
        try:
            json.loads(path.read_text(encoding="utf-8"))
        finally:
            gc.enable()

    return median_time(parse, reps)


def timings(fn, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def median_time(fn, reps: int) -> float:
    return statistics.median(timings(fn, reps))


def figures(name: str, model, inputs, path: Path, n: int, reps: int, editor) -> None:
    base = json_time(path, reps)
    sf = sl.load_schedule(path)
    assert len(sf.calls) == n
    load = median_time(lambda: sl.load_schedule(path), reps)

    def replay_once() -> float:
        sch = sl.create_schedule(meta_copy(model), world_size=2)
        t = time.perf_counter()
        sl.replay(sch, sf.calls)
        dt = time.perf_counter() - t
        assert len(sch.record.calls) == n
        return dt

    replay = statistics.median(replay_once() for _ in range(reps))
    size = path.stat().st_size
    print(
        f"{name}, {n:,} calls ({size / 2**20:.1f} MiB, {size / n:.0f} B/call): "
        f"baseline json.loads {base:.3f} s = {n / base:,.0f} calls/s"
    )

    def row(what: str, dt: float, note: str = "") -> None:
        print(f"  {what:<34} {dt:7.3f} s  {n / dt:>10,.0f} calls/s  {dt / base:7.1f}x json.loads{note}")

    row("(a) load_schedule", load)
    row("(b) replay on a fresh meta schedule", replay)
    if editor is not None:

        def load_editor():
            msg = editor.load(str(path))
            assert msg is None, msg
            assert len(editor.schedule.record.calls) == n

        times = timings(load_editor, reps)  # the first also highlights the code panel's new lines
        row("(c) ScheduleEditor.load", statistics.median(times), f"  (slowest {max(times):.3f} s)")


def refusal(name: str, model, inputs, folder: Path, n: int, editor, compact: bool = False) -> None:
    path = write_file(folder, name, model, inputs, n, compact)
    size = path.stat().st_size
    base = json_time(path, 1)
    t = time.perf_counter()
    try:
        sl.load_schedule(path)
        said = "loaded (no bound)"
    except sl.ExportError as err:
        said = str(err)
    dt = time.perf_counter() - t
    print(
        f"{name}, {n:,} calls ({size / 2**20:.1f} MiB{', compact JSON' if compact else ''}), over the bound: "
        f"load_schedule answers in {dt * 1e3:.1f} ms ({dt / base:.2f}x json.loads): {said}"
    )
    if editor is None:
        return
    before = editor.code
    t = time.perf_counter()
    msg = editor.load(str(path))
    dt = time.perf_counter() - t
    print(
        f"  ScheduleEditor.load answers in {dt * 1e3:.1f} ms ({dt / base:.2f}x json.loads), schedule kept: "
        f"{editor.code == before}, busy: {editor._busy}: {msg}"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, nargs="+", default=[10_000, 25_000, MAX_CALLS or 50_000])
    ap.add_argument("--models", nargs="+", choices=("bert", "gpt2"), default=["bert", "gpt2"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--over", type=int, default=290_000, help="calls of the file over the bound (0: skip)")
    ap.add_argument("--no-editor", action="store_true", help="skip (c), the editor's load")
    args = ap.parse_args()
    bound = f"{MAX_CALLS:,} calls, {MAX_BYTES / 2**20:.0f} MiB per schedule file" if MAX_CALLS else "none"
    print(f"bound: {bound}; {args.reps} runs each, median")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name in args.models:
            model, inputs = tiny(name)
            editor = None
            if not args.no_editor:
                editor = sl.ScheduleEditor(model, example_inputs=inputs, world_size=2)
                editor.load(str(write_file(folder, name, model, inputs, 100)))  # warm-up
            for n in args.calls:
                if MAX_CALLS is not None and n > MAX_CALLS:
                    print(f"{name}, {n:,} calls: over the bound, see the refusal below")
                    continue
                figures(name, model, inputs, write_file(folder, name, model, inputs, n), n, args.reps, editor)
            if editor is not None:
                editor.load(str(write_file(folder, name, model, inputs, 50)))
            if args.over:  # as the editor saves it: over the size bound (the 50 MB file)
                refusal(name, model, inputs, folder, args.over, editor)
            if MAX_CALLS is not None:  # one call too many, in a file small enough to be read
                refusal(name, model, inputs, folder, MAX_CALLS + 1, editor, compact=True)


if __name__ == "__main__":
    main()
