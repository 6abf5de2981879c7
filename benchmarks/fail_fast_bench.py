"""Time from launch to the one sentence, for the 8 launch mistakes of issue 24, against ``import torch``.

Each mistake is launched as a user would: ``python script.py ...`` (one process, no launcher) and ``torchrun
--nproc_per_node=2 script.py ...`` (2 gloo ranks on 127.0.0.1). The clock runs from the launch until the line the
user reads appears on the combined stdout / stderr: the ``error: ...`` sentence, or for the two mistakes that are
not errors (the same shapes with other weights, a stale checkpoint directory the script names by default) the
``note: ...`` sentence said before the run loads anything (the launch is then stopped). Every check runs in
:mod:`slapo_lab.train.preflight`, before torch is imported; torchrun's own agent imports torch before it starts
the ranks, so its column cannot be below one ``import torch``. The baseline, measured in the same run, is
``python -c "import torch"``; each figure is the median of ``--repeat`` launches.

The fixtures are real: tiny Llama directories written by ``save_pretrained`` (hidden 64, intermediate 128, 512
positions; one with intermediate 96, one with other weights at the same shapes, one without tokenizer files), a
BPE tokenizer trained on a generated corpus, scripts written by ``slapo_lab.export_script`` (TP 2 with the Megatron
preset for torchrun, TP 1 for one process), and a checkpoint saved by a real 1-step run of the script.

Run: ``python benchmarks/fail_fast_bench.py [--repeat 3] [--json out.json]`` (CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.harness import child_env, free_port
from tests.train_fixtures import meta_model, write_corpus, write_pretrained, write_tokenizer


def _timed(argv: list[str], want: str, timeout: float = 300.0) -> tuple[float, str, int | None]:
    """Launch ``argv`` (its own session), and return (seconds until a line containing ``want`` appears, that line,
    the exit status or None when the launch was stopped at the line)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.start()
    found, seconds, tail = None, float("nan"), []
    try:
        for line in proc.stdout:
            tail.append(line)
            if want in line:
                seconds, found = time.perf_counter() - t0, line.strip()
                break
        if found is not None and found.startswith(("note:", "[rank0]:note:")):
            os.killpg(proc.pid, signal.SIGKILL)  # the run would go on training: the note is what is timed
            proc.wait()
            return seconds, found, None
        rest = proc.stdout.read()
        proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if found is None:
        raise RuntimeError(f"{' '.join(argv)} never printed {want!r}:\n{''.join(tail)[-3000:]}{rest[-2000:]}")
    return seconds, found, proc.returncode


def _fixtures(d: Path) -> dict:
    import torch
    import transformers
    from transformers import AutoConfig, LlamaForCausalLM

    import slapo_lab as sl

    transformers.utils.logging.disable_progress_bar()
    corpus = write_corpus(d / "data", 60)
    a = write_tokenizer(write_pretrained(d / "llama"), [corpus])
    same = write_tokenizer(write_pretrained(d / "llama_other_weights", seed=1), [corpus])
    other = write_tokenizer(write_pretrained(d / "llama_688", intermediate_size=96), [corpus])
    bare = write_pretrained(d / "llama_no_tokenizer")
    config = AutoConfig.from_pretrained(a)
    ids = torch.zeros(4, 16, dtype=torch.long)
    with sl.init_empty_weights():
        lm = LlamaForCausalLM(config)
    sch = sl.create_schedule(meta_model("LlamaForCausalLM", config), world_size=2)
    sl.presets.megatron_tp(sch)
    ckpt = d / "ckpt"
    baked = {"model_path": str(a), "data": str(corpus), "seq_len": 16, "checkpoint_dir": str(ckpt)}
    scripts = {
        1: sl.export_script(d / "train_1.py", lm, [], {"input_ids": ids}, world_size=1, defaults=baked),
        2: sl.export_script(
            d / "train_tp2.py", lm, sch.record.calls, {"input_ids": ids}, world_size=2, defaults=baked
        ),
    }
    # the checkpoint a bad earlier run left in the script's default --checkpoint-dir: one real step
    p = subprocess.run(
        [
            sys.executable,
            str(scripts[1]),
            "--device",
            "cpu",
            "--steps",
            "1",
            "--no-verify",
            "--progress",
            "off",
        ],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if p.returncode != 0:
        raise RuntimeError(
            f"the 1-step run that writes the checkpoint failed:\n{p.stdout[-2000:]}{p.stderr[-2000:]}"
        )
    return {
        "dir": d,
        "corpus": corpus,
        "a": a,
        "same": same,
        "other": other,
        "bare": bare,
        "scripts": scripts,
    }


def _cases(f: dict, nproc: int) -> list[tuple[str, list[str], str]]:
    """(mistake, arguments, the text of the line the user reads)."""
    dp = "2" if nproc == 1 else "3"
    return [
        (
            "Resuming another model's checkpoint",
            ["--model-path", str(f["other"])],
            "was saved for intermediate_size",
        ),
        ("same shapes, other weights", ["--model-path", str(f["same"])], "is ignored"),
        ("stale default checkpoint dir", [], "note: resuming step"),
        ("seq-len above max_position_embeddings", ["--seq-len", "1024"], "max_position_embeddings"),
        ("wrong --data path", ["--data", str(f["dir"] / "corpus_typo.jsonl")], "does not exist"),
        ("model dir without tokenizer", ["--model-path", str(f["bare"])], "--tokenizer"),
        ("dp not dividing the world size", ["--dp", dp], "world size must be"),
        ("bad argument", ["--steps", "-3"], "must not be negative"),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="launches per figure (the median is reported)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    opts = ap.parse_args(argv)

    base = [
        _timed([sys.executable, "-c", "import torch; print('imported')"], "imported")[0]
        for _ in range(opts.repeat)
    ]
    torch_s = statistics.median(base)
    rows = []
    with tempfile.TemporaryDirectory(prefix="fail-fast-") as tmp:
        f = _fixtures(Path(tmp))
        for nproc in (1, 2):
            script = str(f["scripts"][nproc])
            for name, args, want in _cases(f, nproc):
                if nproc == 1:
                    cmd = [sys.executable, script, "--device", "cpu", *args]
                else:
                    cmd = [
                        sys.executable,
                        "-m",
                        "torch.distributed.run",
                        "--nproc_per_node=2",
                        "--master_addr=127.0.0.1",
                        f"--master_port={free_port()}",
                        script,
                        "--device",
                        "cpu",
                        *args,
                    ]
                runs = [_timed(cmd, want) for _ in range(opts.repeat)]
                seconds = statistics.median(r[0] for r in runs)
                rows.append(
                    {
                        "mistake": name,
                        "launch": "python script.py" if nproc == 1 else "torchrun --nproc_per_node=2",
                        "seconds": round(seconds, 3),
                        "x_import_torch": round(seconds / torch_s, 2),
                        "status": runs[0][2],
                        "line": runs[0][1],
                    }
                )
    print(f'baseline: python -c "import torch" {torch_s:.2f} s (median of {opts.repeat})')
    print(
        "every check runs in slapo_lab.train.preflight, before torch is imported (none needs the heavy imports)"
    )
    print(f"{'mistake':40s} {'launch':28s} {'s':>6s} {'x torch':>8s} {'exit':>5s}  the line the user reads")
    for r in rows:
        status = "-" if r["status"] is None else str(r["status"])
        line = r["line"] if len(r["line"]) <= 150 else r["line"][:147] + "..."
        print(
            f"{r['mistake']:40s} {r['launch']:28s} {r['seconds']:6.2f} {r['x_import_torch']:8.2f} {status:>5s}  {line}"
        )
    print(
        "exit '-': a note, not an error; the launch was stopped once it was printed (the run would train on)"
    )
    if opts.json:
        Path(opts.json).write_text(json.dumps({"import_torch_s": torch_s, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
