"""Multi-rank pipeline check, run by torchrun (see tests/multirank/test_pipeline_ranks.py).

    torchrun --nproc_per_node=N tests/multirank/pp_train.py CASE [CASE ...]

Each case: build a small model with random weights (same seed on every rank), keep a deep copy as the
single-process reference, schedule the model (tensor-parallel primitives on the mesh's TP group when
tp > 1, then the cuts), ``build_pipeline`` it on the case's runtime, and train both for three SGD
steps on the same batches (data-parallel replicas take consecutive slices of the batch; the reference
sees the whole batch). Compared at every step: the loss (the data-parallel mean of the pipeline's
loss vs the reference's full-batch loss), and after the last step every parameter each rank holds
(by original FQN; tied copies included; tensor-parallel shards against the reference's slice).
Rank 0 prints one ``RESULT {json}`` line per case; the exit status is non-zero if any case fails.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the shared harness
import pp_models as M
from harness import apply_bert_tp

import slapo_lab as sl
from slapo_lab.pipeline import build_pipeline, make_mesh

warnings.filterwarnings("ignore")
ATOL = 1e-5
STEPS = 3
LR = 0.1

# name: (model, target, schedule, tp, pp, dp, stages_per_rank, cuts, n_microbatches, batch)
CASES = {
    "gpt2_gpipe": ("gpt2", "torch", "GPipe", 1, 2, 1, 1, ["transformer.h.1"], 2, 4),
    "gpt2_1f1b": ("gpt2", "torch", "1F1B", 1, 2, 1, 1, ["transformer.h.1"], 4, 4),
    "bert_gpipe": ("bert", "torch", "GPipe", 1, 2, 1, 1, ["bert.encoder.layer.1"], 2, 4),
    "bert_1f1b": ("bert", "torch", "1F1B", 1, 2, 1, 1, ["bert.encoder.layer.1"], 4, 4),
    "gpt2_interleaved": (
        "gpt2",
        "torch",
        "Interleaved1F1B",
        1,
        2,
        1,
        2,
        ["transformer.h.0", "transformer.h.1", "transformer.h.2"],
        4,
        4,
    ),
    "bert_interleaved": (
        "bert",
        "torch",
        "Interleaved1F1B",
        1,
        2,
        1,
        2,
        ["bert.embeddings", "bert.encoder.layer.1", "bert.encoder.layer.2"],
        2,
        4,
    ),
    "skip_interleaved": (
        "skip",
        "torch",
        "Interleaved1F1B",
        1,
        2,
        1,
        2,
        ["blocks.0", "blocks.1", "blocks.2"],
        2,
        4,
    ),
    "nested_interleaved": (
        "nested",
        "torch",
        "Interleaved1F1B",
        1,
        2,
        1,
        2,
        ["encoder.block.1", "encoder", "decoder.block.1"],
        2,
        4,
    ),
    "gpt2_deepspeed": ("gpt2", "deepspeed", "1F1B", 1, 2, 1, 1, ["transformer.h.1"], 2, 4),
    "bert_deepspeed": ("bert", "deepspeed", "1F1B", 1, 2, 1, 1, ["bert.encoder.layer.1"], 2, 4),
    "skip_deepspeed": ("skip", "deepspeed", "1F1B", 1, 2, 1, 1, ["blocks.1"], 2, 4),
    "skip3_1f1b": ("skip", "torch", "1F1B", 1, 3, 1, 1, ["blocks.0", "blocks.2"], 3, 6),
    "skip3_deepspeed": ("skip", "deepspeed", "1F1B", 1, 3, 1, 1, ["blocks.0", "blocks.2"], 3, 6),
    "bert_tp2_pp2": ("bert", "torch", "1F1B", 2, 2, 1, 1, ["bert.encoder.layer.1"], 2, 4),
    "gpt2_tp2_pp2": ("gpt2", "torch", "GPipe", 2, 2, 1, 1, ["transformer.h.1"], 2, 4),
    "gpt2_dp2_pp2": ("gpt2", "torch", "1F1B", 1, 2, 2, 1, ["transformer.h.1"], 2, 4),
    "skip_tp2_pp2_dp2": ("skip", "torch", "1F1B", 2, 2, 2, 1, ["blocks.1"], 2, 8),
    "gpt2_dp2_pp2_deepspeed": ("gpt2", "deepspeed", "1F1B", 1, 2, 2, 1, ["transformer.h.1"], 2, 4),
    "t5_interleaved": (
        "t5",
        "torch",
        "Interleaved1F1B",
        1,
        2,
        1,
        2,
        ["encoder.block.1", "encoder", "decoder.block.1"],
        2,
        4,
    ),
}
# issue 10: two stages interleaved on a single rank (world size 1)
CASES["gpt2_interleaved_ws1"] = ("gpt2", "torch", "Interleaved1F1B", 1, 1, 1, 2, ["transformer.h.1"], 2, 4)
CASES["llama_interleaved_ws1"] = (
    "fam_llama",
    "torch",
    "Interleaved1F1B",
    1,
    1,
    1,
    2,
    ["model.layers.0"],
    2,
    4,
)
# issue 10: every common HF family, one cut after its first block, 2 ranks, 1F1B, 2 micro-batches of 2
CASES.update(
    {name: (name, "torch", "1F1B", 1, 2, 1, 1, [cut], 2, 4) for name, (_, cut, _) in M.FAMILIES.items()}
)


def bert_tp(sch, layers: int = 4) -> None:
    """Slapo's canonical BERT tensor parallelism (reference.md), on ``bert.*`` inside the classifier."""
    apply_bert_tp(
        sch,
        layers,
        checkpoint=False,
        prefix="bert.encoder.layer",
        embeddings="bert.embeddings.word_embeddings",
    )


def gpt2_tp(sch, layers: int = 4) -> None:
    """GPT-2 MLP tensor parallelism + the tied vocab-parallel ``wte`` / ``lm_head`` (split across stages)."""
    for i in range(layers):
        p = f"transformer.h.{i}"
        sch[f"{p}.mlp.c_fc"].shard("weight", axis=1)
        sch[f"{p}.mlp.c_fc"].shard("bias", axis=0)
        sch[f"{p}.mlp.c_fc"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        sch[f"{p}.mlp.c_proj"].shard("weight", axis=0)
        sch[f"{p}.mlp.c_proj"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    sch["transformer.wte"].shard("weight", axis=0)
    sch["transformer.wte"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    sch["lm_head"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    sch["lm_head"].sync(
        mode="fwd_post", sync_op_or_fn="all_gather", axis=-1, tensor_parallel_output_grad=False
    )


def skip_tp(sch, n: int = 4) -> None:
    """Column-parallel ``fc`` in every block of SkipNet, output gathered (Megatron's gather_output)."""
    for i in range(n):
        p = f"blocks.{i}.fc"
        sch[p].shard("weight", axis=0)
        sch[p].shard("bias", axis=0)
        sch[p].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        sch[p].sync(mode="fwd_post", sync_op_or_fn="all_gather", axis=-1, tensor_parallel_output_grad=False)


TP_SCHEDULES = {"bert": bert_tp, "gpt2": gpt2_tp, "skip": skip_tp}


def ref_slice(r: torch.Tensor, p: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    axis = getattr(p, "shard_axis", None)
    if axis is None or tp == 1:
        return r
    return r.detach().chunk(tp, dim=axis)[tp_rank]


def run_case(name: str) -> dict:
    model_name, target, schedule, tp, pp, dp, spr, cuts, n_mb, bs = CASES[name]
    res = {"case": name, "bad": [], "loss": [], "ref_loss": [], "max_loss_diff": 0.0, "max_param_diff": 0.0}
    t0 = time.perf_counter()
    mesh = make_mesh(tp=tp, pp=pp, dp=dp)
    torch.manual_seed(1234)
    model = M.make(model_name)
    model.train()
    ref = copy.deepcopy(model)
    sch = sl.create_schedule(model, group=mesh.tp_group)
    if tp > 1:
        TP_SCHEDULES[model_name](sch)
    for c in cuts:
        sch[c].cut_pipeline_stage()
    local_bs = bs // dp
    ids, y = M.batch(model_name, -1, bs)
    example = M.take(ids, 0, local_bs)
    pm = build_pipeline(
        sch,
        target,
        example_inputs=example if isinstance(example, dict) else (example,),
        loss_fn=M.LOSS[model_name],
        schedule=schedule,
        n_microbatches=n_mb,
        pp_group=mesh.pp_group,
        dp_group=mesh.dp_group if dp > 1 else None,
        stages_per_rank=spr,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=LR),
    )
    res["build_s"] = round(time.perf_counter() - t0, 2)
    res["num_stages"] = pm.partition.num_stages
    res["stage_ids"] = pm.stage_ids
    res["tied"] = [sorted(t.items()) for t in pm.partition.tied]
    res["n_sharded"] = sum(getattr(p, "shard_axis", None) is not None for _, p in pm.named_parameters())
    res["tp_ops"] = sum(
        str(n.target).startswith("slapo_lab_pp.")
        for m in pm.stage_modules
        for sub in m.modules()
        if hasattr(sub, "graph")
        for n in sub.graph.nodes
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    lo = mesh.dp_rank * local_bs
    step_times = []
    for step in range(STEPS):
        ids, y = M.batch(model_name, step, bs)
        ts = time.perf_counter()
        mine = M.take(ids, lo, local_bs)
        if isinstance(mine, dict):
            loss = pm.train_step(target=y[lo : lo + local_bs], **mine)
        else:
            loss = pm.train_step(mine, target=y[lo : lo + local_bs])
        step_times.append(time.perf_counter() - ts)
        if dp > 1:
            t = torch.tensor(loss, dtype=torch.float64)
            dist.all_reduce(t, group=mesh.dp_group)
            loss = float(t) / dp
        ref_opt.zero_grad(set_to_none=True)
        ref_loss = M.LOSS[model_name](M.forward_output(model_name, ref, ids), y)
        ref_loss.backward()
        ref_opt.step()
        res["loss"].append(loss)
        res["ref_loss"].append(float(ref_loss))
        d = abs(loss - float(ref_loss))
        res["max_loss_diff"] = max(res["max_loss_diff"], d)
        if not d <= ATOL:
            res["bad"].append(f"step {step}: loss {loss} vs reference {float(ref_loss)}")
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    names = []
    for pname, p in pm.named_parameters():
        names.append(pname)
        r = ref_slice(ref_params[pname], p, tp, mesh.tp_rank)
        if r.shape != p.shape:
            res["bad"].append(f"{pname}: shape {tuple(p.shape)} vs reference slice {tuple(r.shape)}")
            continue
        d = float((p.detach().double() - r.detach().double()).abs().max())
        res["max_param_diff"] = max(res["max_param_diff"], d)
        if not d <= ATOL:
            res["bad"].append(f"{pname}: max diff {d:.3e} after {STEPS} steps")
    res["step_s"] = [round(t, 4) for t in step_times]
    res["seconds"] = round(time.perf_counter() - t0, 2)
    # every rank's view: coverage of the reference's parameters, worst diffs, failures
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(
        gathered,
        {
            "names": names,
            "bad": res["bad"],
            "loss_diff": res["max_loss_diff"],
            "param_diff": res["max_param_diff"],
        },
    )
    canon = {}  # every alias of a tied reference parameter -> its first name
    first = {}
    for pname, p in ref_params.items():
        canon[pname] = first.setdefault(id(p), pname)
    covered = {canon[nm] for g in gathered for nm in g["names"]}
    missing = sorted(set(canon.values()) - covered)
    if missing:
        res["bad"].append(f"parameters held by no rank: {missing[:5]}")
    res["max_loss_diff"] = max(g["loss_diff"] for g in gathered)
    res["max_param_diff"] = max(g["param_diff"] for g in gathered)
    res["n_params_checked"] = sum(len(g["names"]) for g in gathered)
    res["bad"] = (res["bad"] + [b for i, g in enumerate(gathered) if i != dist.get_rank() for b in g["bad"]])[
        :8
    ]
    if pm.engine is not None:
        pm.engine.destroy() if hasattr(pm.engine, "destroy") else None
    return res


def main() -> int:
    names = sys.argv[1:]
    unknown = [n for n in names if n not in CASES]
    if unknown or not names:
        print(f"unknown cases {unknown}; known: {', '.join(CASES)}", file=sys.stderr)
        return 2
    dist.init_process_group("gloo")
    failed = 0
    for name in names:
        try:
            res = run_case(name)
        except Exception as err:  # noqa: BLE001 - every rank fails the same way in practice; report, go on
            import traceback

            traceback.print_exc()
            res = {"case": name, "bad": [f"{type(err).__name__}: {err}"[:1000]]}
        failed += bool(res["bad"])
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps(res), flush=True)
    dist.barrier()
    gc.collect()  # sync hooks hold the gloo group in reference cycles; free them first
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
