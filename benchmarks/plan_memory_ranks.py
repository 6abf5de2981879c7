"""Predicted against measured peak memory per rank, on several gloo ranks of this CPU (issue 26, "Memory,
predicted against measured").

The model: a Llama of ~56 M parameters built from ``transformers.LlamaConfig`` (random weights, untied head),
fp32, AdamW. Every layout is built with the project's own runtime pieces, as ``slapo_lab/train`` builds them:

* the schedule: ``sl.create_schedule(model, group=mesh.tp_group)`` on the ``(dp, pp, tp)`` mesh of
  :func:`slapo_lab.pipeline.make_mesh`; tensor parallelism by :func:`slapo_lab.presets.megatron_tp`;
  checkpointing by :func:`slapo_lab.presets.checkpoint_blocks` (every k-th block, or all);
* pipelines: ``cut_pipeline_stage`` at the planner's balanced cuts (``Estimate.stage_blocks``) and
  :func:`slapo_lab.pipeline.build_pipeline` (``torch.distributed.pipelining`` GPipe / 1F1B) with AdamW;
* data parallelism: DDP as :func:`slapo_lab.train.parallel.wrap_ddp` wraps it; FSDP2's ``fully_shard`` on every
  decoder layer, then the root (:func:`slapo_lab.train.parallel.apply_fsdp`); ZeRO-1 as
  ``torch.distributed.optim.ZeroRedundancyOptimizer`` (AdamW's states sharded over the replicas).

Measured: each rank's peak of live tensors over two optimizer steps of ``micro`` micro-batches, with
``torch.distributed._tools.mem_tracker.MemTracker`` (PyTorch's tracker of tensor storages: parameters,
gradients, optimizer states, activations, temporaries). Predicted: :func:`slapo_lab.estimate`'s per-rank live
bytes (``Estimate.memory`` without the allocator's headroom: MemTracker counts tensors, not the caching
allocator's blocks) for the same :class:`slapo_lab.Layout`. The table gives, per layout, the busiest rank of each
and their ratio, and every rank's ratio.

Run: ``.venv/bin/python benchmarks/plan_memory_ranks.py [--seq 128] [--only NAME ...]`` (two processes,
gloo on 127.0.0.1; the first 16 layouts took 474 s on two shared cores; the two sequence-parallel ones, with
``--only tp_mbs8 tp_sp_mbs8 tp_ckpt_mbs8 tp_sp_ckpt_mbs8``, read 1.003 and 0.993 beside their plain TP twins' 1.008
and 1.001, 90 s).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
from plan_memory_cpu import CONFIG  # the one-process benchmark's model: the same Llama

WORLD = 2
STEPS = 2


@dataclass(frozen=True)
class Case:
    """One layout of the table: the planner's Layout fields plus the micro-batches per step."""

    name: str
    tp: int = 1
    pp: int = 1
    dp: int = 1
    shard: str = "none"
    micro_batch_size: int = 1
    checkpoint: str | int = "none"
    pp_schedule: str = "1F1B"
    micro: int = 1
    sequence_parallel: bool = False

    def layout(self):
        import slapo_lab as sl

        return sl.Layout(
            tp=self.tp,
            pp=self.pp,
            dp=self.dp,
            shard=self.shard,
            micro_batch_size=self.micro_batch_size,
            checkpoint=self.checkpoint,
            pp_schedule=self.pp_schedule,
            sequence_parallel=self.sequence_parallel,
        )


CASES = [
    Case("ddp", dp=2),
    Case("ddp_ckpt_mb2x2", dp=2, checkpoint="all", micro_batch_size=2, micro=2),
    Case("fsdp", dp=2, shard="fsdp"),
    Case("fsdp_ckpt_micro4", dp=2, shard="fsdp", checkpoint="all", micro=4),
    Case("fsdp_mbs8", dp=2, shard="fsdp", micro_batch_size=8),
    Case("ddp_mbs8", dp=2, micro_batch_size=8),
    Case("zero1", dp=2, shard="zero1"),
    Case("zero1_ckpt2_micro2", dp=2, shard="zero1", checkpoint=2, micro=2),
    Case("tp", tp=2),
    Case("tp_mbs8", tp=2, micro_batch_size=8),
    Case("tp_ckpt_mbs8", tp=2, checkpoint="all", micro_batch_size=8),
    Case("tp_micro3", tp=2, micro=3),
    Case("tp_sp_mbs8", tp=2, micro_batch_size=8, sequence_parallel=True),
    Case("tp_sp_ckpt_mbs8", tp=2, checkpoint="all", micro_batch_size=8, sequence_parallel=True),
    Case("pp_1f1b_micro2", pp=2, micro=2),
    Case("pp_1f1b_mbs4_micro4", pp=2, micro_batch_size=4, micro=4),
    Case("pp_gpipe_micro2", pp=2, pp_schedule="GPipe", micro=2),
    Case("pp_gpipe_micro4_ckpt", pp=2, pp_schedule="GPipe", micro=4, checkpoint="all"),
]


def _tracker():
    """A ``MemTracker`` that lets a root module run once per micro-batch (a pipeline stage's module does): its
    second forward in one step starts the module's own statistics afresh instead of raising; the per-device
    peak, which this benchmark reads, is kept by the storage tracking and is unaffected."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class MicroBatchMemTracker(MemTracker):
        def _pre_fw_hook(self, module, inputs):
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                name = self._mod_tracker.get_known_fqn(module)
                if set(self._mod_tracker.parents) - {name} == {"Global"}:
                    del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

    return MicroBatchMemTracker()


def build():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**CONFIG)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def cpu_cluster(world: int):
    import slapo_lab as sl

    dev = sl.DeviceProfile("this cpu", 1e11, 1e11, 64 << 30, 1e10, 1e9, 1e-4, 1e9, 1e-4)
    return sl.Cluster(nodes=1, gpus_per_node=world, gpu=dev)


def predict(case: Case, seq: int, model=None):
    """The planner's :class:`~slapo_lab.planner.model.Estimate` of ``case`` (fp32, this CPU's cluster)."""
    import slapo_lab as sl

    if model is None:
        with torch.device("meta"):
            model = build()
    gbs = case.micro_batch_size * case.dp * case.micro
    return sl.estimate(
        model, case.layout(), cluster=cpu_cluster(WORLD), seq_len=seq, global_batch_size=gbs, dtype="fp32"
    )


def _loss(logits, target):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def measure(case: Case, seq: int, stage_blocks: list[int], timed: int = 0) -> dict:
    """This rank's MemTracker peak (bytes, by category) for two AdamW steps of ``case`` (inside the process
    group of ``WORLD`` ranks); with ``timed``, instead one warm-up step and ``timed`` steps without the tracker,
    their wall times in ``"times"`` (seconds, each between two barriers), DDP's all-reduce skipped on all but the
    last micro-batch (``no_sync``, as ``slapo_lab.train``'s loop runs it)."""
    import torch.distributed as dist

    import slapo_lab as sl
    from slapo_lab import presets
    from slapo_lab.pipeline import build_pipeline, make_mesh

    mesh = make_mesh(tp=case.tp, pp=case.pp, dp=case.dp)
    model = build()
    model.train()
    sch = sl.create_schedule(model, group=mesh.tp_group)
    if case.tp > 1:
        presets.megatron_tp(sch, check=False, sequence_parallel=case.sequence_parallel)
    if case.checkpoint != "none":
        presets.checkpoint_blocks(sch, every=1 if case.checkpoint == "all" else case.checkpoint, check=False)
    mbs, m = case.micro_batch_size, case.micro
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG["vocab_size"], (mbs * m, seq), generator=g)
    blocks = presets.find_blocks(sch)
    make_opt = lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=False)
    if case.pp > 1:
        ends = [sum(stage_blocks[: i + 1]) for i in range(len(stage_blocks) - 1)]
        for end in ends:
            sch[blocks[end - 1]].cut_pipeline_stage()
        pm = build_pipeline(
            sch,
            "torch",
            example_inputs={"input_ids": ids},
            loss_fn=_loss,
            output_fn=lambda out: out.logits if hasattr(out, "logits") else out,
            schedule=case.pp_schedule,
            n_microbatches=m,
            pp_group=mesh.pp_group,
            optimizer=make_opt,
        )
        tracked = pm.stage_modules[0]
        opt = pm.optimizer

        def step():
            pm.train_step(input_ids=ids, target=ids)

    else:
        mod = sch.mod
        if case.shard == "fsdp" and case.dp > 1:
            from torch.distributed.fsdp import fully_shard

            dp_mesh = mesh.mesh["dp"]
            for path in blocks:
                fully_shard(mod.get_submodule(path), mesh=dp_mesh)
            fully_shard(mod, mesh=dp_mesh)
            run_mod = mod
        elif case.dp > 1:
            from torch.nn.parallel import DistributedDataParallel

            run_mod = DistributedDataParallel(mod, process_group=mesh.dp_group)
        else:
            run_mod = mod
        if case.shard in ("zero1", "zero2") and case.dp > 1:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(
                list(mod.parameters()),
                optimizer_class=torch.optim.AdamW,
                process_group=mesh.dp_group,
                lr=1e-4,
                foreach=False,
            )
        else:
            opt = make_opt(list(mod.parameters()))
        tracked = run_mod

        # timed, DDP all-reduces on the last micro-batch only (``no_sync`` before), as slapo_lab.train's loop does
        ddp = bool(timed) and hasattr(run_mod, "no_sync")

        def step():
            for i in range(m):
                x = ids[i * mbs : (i + 1) * mbs]
                with run_mod.no_sync() if ddp and i < m - 1 else contextlib.nullcontext():
                    out = run_mod(input_ids=x, use_cache=False)
                    loss = _loss(out.logits, x) / m
                    loss.backward()
                del out, loss
            opt.step()
            opt.zero_grad(set_to_none=True)

    if timed:
        times = []
        for i in range(timed + 1):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            dist.barrier()
            if i:
                times.append(time.perf_counter() - t0)
        return {"rank": dist.get_rank(), "stage": mesh.pp_rank, "times": times}
    tracker = _tracker()
    tracker.track_external(tracked, opt)
    dist.barrier()
    with tracker:
        for _ in range(STEPS):
            step()
            tracker.reset_mod_stats()
    peak = tracker.get_tracker_snapshot("peak")
    cats = {str(k).rsplit(".", 1)[-1]: int(v) for k, v in next(iter(peak.values())).items()}
    dist.barrier()
    return {"rank": dist.get_rank(), "stage": mesh.pp_rank, **cats}


def _worker(
    rank: int, world: int, port: int, cases: list[dict], seq: int, out_dir: str, timed: int = 0
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for c in cases:
            case = Case(**{k: v for k, v in c.items() if k != "stage_blocks"})
            t0 = time.perf_counter()
            try:
                res = measure(case, seq, c["stage_blocks"], timed)
            except Exception as err:  # noqa: BLE001 - reported in the table, the other layouts still run
                import traceback

                tb = traceback.format_exc().strip().splitlines()
                res = {
                    "rank": rank,
                    "error": f"{type(err).__name__}: {str(err).strip()[:300]}",
                    "trace": tb[-12:],
                    "cause": repr(err.__cause__)[:500],
                }
            res["seconds"] = round(time.perf_counter() - t0, 1)
            with open(os.path.join(out_dir, f"{case.name}.{rank}.json"), "w") as f:
                json.dump(res, f)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(cases: list[Case], seq: int, stage_blocks: dict, timed: int = 0) -> dict:
    """Run ``cases`` on ``WORLD`` spawned gloo ranks: ``{case name: [per-rank result dict]}``."""
    import torch.multiprocessing as mp

    payload = [dict(asdict(c), stage_blocks=stage_blocks[c.name]) for c in cases]
    out = {}
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(WORLD, _free_port(), payload, seq, out_dir, timed), nprocs=WORLD, join=True)
        for c in cases:
            out[c.name] = []
            for r in range(WORLD):
                with open(os.path.join(out_dir, f"{c.name}.{r}.json")) as f:
                    out[c.name].append(json.load(f))
    return out


def run(cases: list[Case], seq: int = 128) -> list[dict]:
    """Predict and measure ``cases`` on ``WORLD`` spawned gloo ranks; one row per case: ``predicted`` (the
    busiest rank's live bytes), ``measured`` (the busiest rank's MemTracker peak), ``ratio``, ``ranks`` (per
    rank: stage, predicted, measured, categories) and ``error`` when a layout failed to run."""
    import torch.multiprocessing as mp

    with torch.device("meta"):
        ref = build()
    ests = {c.name: predict(c, seq, ref) for c in cases}
    payload = [dict(asdict(c), stage_blocks=ests[c.name].stage_blocks) for c in cases]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(WORLD, _free_port(), payload, seq, out_dir), nprocs=WORLD, join=True)
        rows = []
        for c in cases:
            est = ests[c.name]
            mem = est.memory
            per_rank = []
            for r in range(WORLD):
                with open(os.path.join(out_dir, f"{c.name}.{r}.json")) as f:
                    per_rank.append(json.load(f))
            err = next((x["error"] for x in per_rank if "error" in x), None)
            row = {"case": c.name, "layout": c.layout().describe(), "micro": c.micro, "error": err}
            if err is None:
                for x in per_rank:
                    cats = mem[x["stage"]]
                    x["predicted"] = sum(v for k, v in cats.items() if k != "headroom")
                    x["measured"] = x["Total"]
                    x["ratio"] = x["predicted"] / x["measured"]
                row["predicted"] = est.peak_live_bytes
                row["measured"] = max(x["measured"] for x in per_rank)
                row["ratio"] = row["predicted"] / row["measured"]
            row["ranks"] = per_rank
            row["seconds"] = max(x.get("seconds", 0) for x in per_rank)
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--only", nargs="*", default=None, help="case names (default: all)")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args()
    cases = [c for c in CASES if not args.only or c.name in args.only]
    with torch.device("meta"):
        n = sum(p.numel() for p in build().parameters())
    print(f"Llama {n / 1e6:.1f} M parameters, fp32 AdamW, seq {args.seq}, {WORLD} gloo ranks, {STEPS} steps")
    t0 = time.perf_counter()
    rows = run(cases, args.seq)
    mib = 2**20
    print(f"{'case':<22} {'layout':<58} {'m':>2} {'pred MiB':>9} {'meas MiB':>9} {'ratio':>6}  per rank")
    for r in rows:
        if r["error"]:
            print(f"{r['case']:<22} {r['layout']:<58} {r['micro']:>2} failed: {r['error']}")
            continue
        ranks = "  ".join(f"r{x['rank']}/s{x['stage']} {x['ratio']:.3f}" for x in r["ranks"])
        print(
            f"{r['case']:<22} {r['layout']:<58} {r['micro']:>2} {r['predicted'] / mib:>9.1f} "
            f"{r['measured'] / mib:>9.1f} {r['ratio']:>6.3f}  {ranks}"
        )
        for x in r["ranks"]:
            detail = ", ".join(
                f"{k} {v / mib:.0f}"
                for k, v in x.items()
                if k.isupper() and k != "Total" and isinstance(v, int) and v
            )
            print(f"{'':<22}   rank {x['rank']}: {detail}")
    ok = [r for r in rows if not r["error"]]
    worst = max((abs(r["ratio"] - 1) for r in ok), default=float("nan"))
    print(
        f"\n{len(ok)}/{len(rows)} layouts measured; worst busiest-rank error {worst:.1%}; "
        f"{time.perf_counter() - t0:.0f} s"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
