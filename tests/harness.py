"""Plain helpers shared by test modules (importable from module-scoped fixtures, unlike fixtures).

* :func:`apply_bert_tp` — issue 2's Megatron-style BERT schedule, typed call by call;
* :func:`free_port`, :func:`child_env`, :func:`launch_torchrun` — a bounded local CPU torchrun launch;
* :func:`report`, :func:`agree` — inside such a launched script: its ``RESULT`` lines, agreement of all ranks.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
"""The repository root (holds ``slapo_lab``, ``tests``, ``benchmarks``, ``notebooks``)."""
TESTS = REPO_ROOT / "tests"
"""The test tree: shared helpers at its root, ``data/``, ``multirank/`` (the scripts torchrun launches)."""

BERT_COL = ("attention.self.query", "attention.self.key", "attention.self.value", "intermediate.dense")
BERT_ROW = ("attention.output.dense", "output.dense")


def apply_bert_tp(
    sch,
    num_layers: int,
    checkpoint: bool = True,
    prefix: str = "encoder.layer",
    embeddings: str | None = None,
) -> None:
    """Issue 2's BERT tensor-parallel schedule on layers ``0..num_layers-1`` of ``prefix``.

    Column parallel (weight and bias on axis 0 + ``bwd_post all_reduce``): query, key, value,
    intermediate.dense; row parallel (weight on axis 1 + ``fwd_post all_reduce``): attention.output.dense,
    output.dense; then ``checkpoint()`` on each layer when ``checkpoint``; finally, when ``embeddings``
    names the word embedding, vocab parallelism there (weight on axis 0 + ``fwd_post all_reduce``).
    """
    for i in range(num_layers):
        p = f"{prefix}.{i}"
        for n in BERT_COL:
            sch[f"{p}.{n}"].shard("weight", axis=0)
            sch[f"{p}.{n}"].shard("bias", axis=0)
            sch[f"{p}.{n}"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        for n in BERT_ROW:
            sch[f"{p}.{n}"].shard("weight", axis=1)
            sch[f"{p}.{n}"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
        if checkpoint:
            sch[p].checkpoint()
    if embeddings is not None:
        sch[embeddings].shard("weight", axis=0)
        sch[embeddings].sync(mode="fwd_post", sync_op_or_fn="all_reduce")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for torchrun's --master_port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str) -> dict:
    """Environment for child Pythons: the repo on PYTHONPATH, HF offline, one thread, gloo on loopback."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_HOME", str(REPO_ROOT / ".cache" / "hf"))
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO_ROOT / ".cache" / "torch_extensions"))
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    if Path("/sys/class/net/lo").exists():
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.update(extra)
    return env


def kill_tree(pid: int) -> None:
    """SIGKILL process ``pid``, its process group and every descendant: torchrun 2.13 starts each rank in a
    session of its own, so killing torchrun's group alone would leave the ranks running."""
    import psutil

    try:
        procs = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        procs = []
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


def torchrun_argv(script, nproc: int, args: list[str]) -> list[str]:
    """``python -m torch.distributed.run --nproc_per_node=nproc`` on 127.0.0.1 and a free port, then ``script *args``."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(script),
        *map(str, args),
    ]


def launch_torchrun(script, nproc: int, args: list[str], timeout: float) -> tuple[int, str]:
    """Run ``torchrun --nproc_per_node=nproc script *args`` on 127.0.0.1 (no shell), bounded.

    The launch runs in its own process session, killed whole on timeout (return code -9 and the
    output so far). Returns ``(returncode, stdout + stderr)``.
    """
    proc = subprocess.Popen(
        torchrun_argv(script, nproc, args),
        cwd=REPO_ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)  # torchrun and the ranks it started
        out, _ = proc.communicate()
        return -9, f"timed out after {timeout} s\n{out}"
    finally:
        if proc.poll() is None:  # pragma: no cover - interrupted
            kill_tree(proc.pid)
            proc.wait()
    return proc.returncode, out


def report(case: str, ok: bool, **extra) -> None:
    """In a multi-rank script: print one ``RESULT {json}`` line for ``case`` on rank 0 (what
    :func:`launch_results` reads back)."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"case": case, "ok": bool(ok), **extra}), flush=True)


def agree(ok: bool) -> bool:
    """In a multi-rank script: whether ``ok`` holds on every rank (gathered from all of them)."""
    import torch.distributed as dist

    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bool(ok))
    return all(flags)


def launch_results(script, nproc: int, args: list[str], timeout: float) -> tuple[int, str, dict]:
    """:func:`launch_torchrun`, once more if the free port was taken in between, and the ranks' results.

    The script prints one ``RESULT {json}`` line per case, the JSON holding at least ``"case"``.
    Returns ``(returncode, output, {case: result dict})``.
    """
    rc, out = launch_torchrun(script, nproc, args, timeout)
    if "EADDRINUSE" in out or "address already in use" in out:
        rc, out = launch_torchrun(script, nproc, args, timeout)
    res = {}
    decoder = json.JSONDecoder()
    for line in out.splitlines():
        if line.startswith("RESULT "):
            # the JSON object alone: another rank's stderr can land on the same line after it (stdout and stderr
            # of 4 ranks share one pipe; seen in CI as a FutureWarning glued to a RESULT line)
            r, _ = decoder.raw_decode(line[len("RESULT ") :])
            res[r["case"]] = r
    return rc, out, res
