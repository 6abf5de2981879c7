"""Multi-rank ``torch.compile`` check, run by torchrun (see tests/multirank/test_compile.py).

    torchrun --nproc_per_node=2 tests/multirank/compile_train.py [--backend aot_eager] [case names ...]

For each case: build a small HF model (same seed on every rank) twice, schedule both copies alike (the Megatron
preset, then ``checkpoint_blocks``), compile every decoder layer of the second copy the way torchtitan's
``apply_compile`` does (``torch.compile(block, fullgraph=True)``, registered back in its ``ModuleList``) or in place
(``block.compile(fullgraph=True)``, the training runtime's ``--compile``), and train both for two SGD steps on the
same batches. At every step the losses and every (local, possibly sharded) gradient must agree within ``ATOL``
(fp32) on every rank, and the loss must match an unscheduled single-process copy's within ``REF_ATOL``; Dynamo must
report no graph break and must have put the tensor-parallel collectives into the graphs (as the ``slapo_lab_pp``
custom ops). Rank 0 prints one ``RESULT {json}`` line per case; the exit status is non-zero when any case fails on
any rank.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import warnings

import torch
import torch.distributed as dist

import slapo_lab as sl
from slapo_lab import presets

warnings.filterwarnings("ignore")
ATOL = 1e-6
REF_ATOL = 1e-5  # against the unscheduled model: sharded matmuls sum in another order
STEPS = 2
BATCH, SEQ, VOCAB = 2, 8, 128


def llama_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return LlamaForCausalLM(cfg)


def gpt2_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    return GPT2LMHeadModel(cfg)


def _tp_ckpt(**kw):
    return lambda s: (presets.megatron_tp(s, **kw), presets.checkpoint_blocks(s))


# case -> (model factory, schedule, path of the block list, how: "wrap" = torchtitan's torch.compile(block) put back
# in the ModuleList, "inplace" = block.compile(), which keeps the module (and its schedule paths): the runtime's way)
CASES = {
    "llama_tp_checkpoint": (llama_model, _tp_ckpt(), "model.layers", "wrap"),
    "llama_tp_checkpoint_inplace": (llama_model, _tp_ckpt(), "model.layers", "inplace"),
    "gpt2_tp_checkpoint": (gpt2_model, _tp_ckpt(), "transformer.h", "wrap"),
    "gpt2_sequence_parallel_checkpoint": (
        gpt2_model,
        _tp_ckpt(sequence_parallel=True),
        "transformer.h",
        "wrap",
    ),
}


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(1, VOCAB, (BATCH, SEQ), generator=g), torch.randint(
        0, VOCAB, (BATCH, SEQ), generator=g
    )


def recording_backend(backend: str, ops: set):
    """``backend`` that also notes the targets of the Dynamo graphs it receives."""
    inner = torch._dynamo.lookup_backend(backend)

    def compile_fn(gm, example_inputs):
        for sub in gm.modules():  # the checkpoint body is a submodule of the graph
            if isinstance(sub, torch.fx.GraphModule):
                ops.update(str(n.target) for n in sub.graph.nodes if n.op == "call_function")
        return inner(gm, example_inputs)

    return compile_fn


def run_case(name: str, backend: str) -> dict:
    from torch._dynamo.utils import counters

    make, schedule, blocks_path, how = CASES[name]
    # as the training runtime does: the tensor-parallel RNG tracker holds a state, so the eager checkpoint passes
    # its tracker-restoring context_fn (which the compiled one must leave out)
    sl.set_random_seed(2013, tp_rank=dist.get_rank())
    torch._dynamo.reset()
    counters.clear()
    models = []
    for _ in range(2):
        torch.manual_seed(1234)
        m = make()
        m.train()
        schedule(sl.create_schedule(m))
        models.append(m)
    eager, compiled = models
    torch.manual_seed(1234)
    ref = make()
    ref.train()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ops: set = set()
    blocks = compiled.get_submodule(blocks_path)
    for i, block in enumerate(list(blocks)):
        if how == "inplace":
            block.compile(backend=recording_backend(backend, ops), fullgraph=True)
        else:  # torchtitan's apply_compile
            blocks.register_module(
                str(i), torch.compile(block, backend=recording_backend(backend, ops), fullgraph=True)
            )
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in models]
    res = {
        "case": name,
        "backend": backend,
        "loss": [],
        "max_loss_diff": 0.0,
        "max_grad_diff": 0.0,
        "bad": [],
    }
    t0 = time.perf_counter()
    for step in range(STEPS):
        ids, labels = batch(step)
        losses = []
        for m, opt in zip(models, opts, strict=False):
            opt.zero_grad(set_to_none=True)
            loss = m(input_ids=ids, labels=labels).loss
            loss.backward()
            losses.append(loss.detach())
        ref_opt.zero_grad(set_to_none=True)
        ref_loss = ref(input_ids=ids, labels=labels).loss
        ref_loss.backward()
        ref_opt.step()
        d_ref = float((ref_loss.detach() - losses[1]).abs())
        res["max_ref_loss_diff"] = max(res.get("max_ref_loss_diff", 0.0), d_ref)
        if d_ref > REF_ATOL:
            res["bad"].append(f"step {step}: loss {float(losses[1])} vs unscheduled {float(ref_loss)}")
        d = float((losses[0] - losses[1]).abs())
        res["loss"].append(float(losses[0]))
        res["max_loss_diff"] = max(res["max_loss_diff"], d)
        if d > ATOL:
            res["bad"].append(f"step {step}: loss {float(losses[1])} vs eager {float(losses[0])}")
        ref_params = dict(eager.named_parameters())
        for pname, p in compiled.named_parameters():
            r = ref_params[pname.replace("._orig_mod", "")]
            if (p.grad is None) != (r.grad is None):
                res["bad"].append(f"step {step}: grad of {pname} is missing on one side")
                continue
            if p.grad is not None:
                gd = float((p.grad - r.grad).abs().max())
                res["max_grad_diff"] = max(res["max_grad_diff"], gd)
                if gd > ATOL:
                    res["bad"].append(f"step {step}: grad {pname} max diff {gd:.3e}")
        for opt in opts:
            opt.step()
    res["seconds"] = round(time.perf_counter() - t0, 2)
    res["graph_breaks"] = sum(counters["graph_break"].values())
    if res["graph_breaks"]:
        res["bad"].append(f"graph breaks: {sorted(k.splitlines()[0] for k in counters['graph_break'])}")
    res["graphs"] = counters["stats"]["unique_graphs"]
    res["tp_ops"] = sorted(o for o in ops if o.startswith("slapo_lab_pp."))
    if not res["tp_ops"]:
        res["bad"].append("no tensor-parallel collective in the compiled graphs")
    res["n_sharded"] = sum(getattr(p, "shard_axis", None) is not None for p in compiled.parameters())
    # agree across ranks: the worst figures, and every rank's failures
    t = torch.tensor(
        [res["max_loss_diff"], res["max_grad_diff"], float(len(res["bad"]))], dtype=torch.float64
    )
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    res["max_loss_diff"], res["max_grad_diff"], n_bad = t.tolist()
    if n_bad and not res["bad"]:
        res["bad"].append("another rank reported a mismatch")
    res["bad"] = res["bad"][:8]
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="aot_eager")
    ap.add_argument("cases", nargs="*", default=list(CASES))
    args = ap.parse_args()
    dist.init_process_group("gloo")
    failed = 0
    for name in args.cases:
        try:
            res = run_case(name, args.backend)
        except Exception as err:  # noqa: BLE001 - report it (a graph break under fullgraph=True raises here)
            res = {"case": name, "bad": [f"{type(err).__name__}: {str(err)[:2000]}"]}
        failed += bool(res["bad"])
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps(res), flush=True)
    dist.barrier()
    gc.collect()  # sync hooks hold the gloo group in reference cycles; free them first
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
