"""``torch.compile(block, fullgraph=True)`` on scheduled models (the runtime's ``--compile``, torchtitan's
``apply_compile``): the schedule's wrappers (composed forward, activation checkpoint, sync hooks, sharded
forwards, parameter-gradient all-reduce) must trace without a graph break and train exactly as in eager mode.

Multi-rank: one torchrun launch of ``tests/multirank/compile_train.py`` (2 gloo ranks, ``aot_eager``): the Megatron
preset + ``checkpoint_blocks`` on Llama (GQA; compiled as torchtitan does and in place with ``block.compile``, as
the runtime's ``--compile`` does), GPT-2 (fused strided ``c_attn``, Conv1D) and GPT-2 with sequence parallelism,
each decoder layer compiled with ``fullgraph=True``; two SGD steps whose losses and gradients equal
the eager scheduled model's within 1e-6, no graph break, collectives in the graphs.
Single process: checkpointed blocks at world size 1, the KV-cache filter the checkpoint applies, and the one
wrapper that cannot be traced (``fork_rng`` swaps the global RNG state): it breaks the graph and stays exact.
"""

from __future__ import annotations

import copy
import warnings

import harness
import pytest
import torch
from harness import launch_results
from torch import nn

import slapo_lab as sl
from slapo_lab import presets

warnings.filterwarnings("ignore")
ROOT = harness.REPO_ROOT
SCRIPT = ROOT / "tests" / "multirank" / "compile_train.py"
TIMEOUT_S = 240
CASES = [
    "llama_tp_checkpoint",
    "llama_tp_checkpoint_inplace",
    "gpt2_tp_checkpoint",
    "gpt2_sequence_parallel_checkpoint",
]
BACKEND = "aot_eager"  # inductor compiles the same graphs (tried by hand) but takes ~60 s per launch on a CPU


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


# --- two ranks ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def results():
    return launch_results(SCRIPT, 2, ["--backend", BACKEND, *CASES], TIMEOUT_S)


@pytest.mark.multirank
@pytest.mark.parametrize("case", CASES)
def test_compiled_tp_blocks_match_eager(results, case):
    rc, out, res = results
    assert case in res, f"no result for {case} (torchrun exit {rc}):\n{out[-4000:]}"
    r = res[case]
    assert not r["bad"], f"{case}: " + "; ".join(r["bad"])
    assert r["graph_breaks"] == 0 and r["graphs"] >= 1, r
    assert r["max_loss_diff"] <= 1e-6 and r["max_grad_diff"] <= 1e-6, r
    assert r["max_ref_loss_diff"] <= 1e-5 and len(r["loss"]) == 2 and r["n_sharded"] > 0, r
    # row-parallel outputs: all_reduce_fwd; column-parallel inputs: an alias whose backward is the plain all_reduce
    expected = {"slapo_lab_pp.all_reduce_fwd.default", "slapo_lab_pp.all_reduce.default"}
    if "sequence_parallel" in case:
        # all-gather before the column-parallel layers, reduce-scatter after the row ones, and the first block
        # scatters the sequence on its input
        expected = {
            "slapo_lab_pp.all_reduce.default",
            "slapo_lab_pp.gather_fwd.default",
            "slapo_lab_pp.reduce_scatter_fwd.default",
            "slapo_lab_pp.scatter_fwd.default",
        }
    assert set(r["tp_ops"]) == expected, r["tp_ops"]


@pytest.mark.multirank
def test_compile_launch_exit_status(results):
    rc, out, res = results
    assert rc == 0 and set(res) == set(CASES), out[-4000:]


# --- one process ----------------------------------------------------------------------------------------------
def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return LlamaForCausalLM(cfg)


def test_checkpointed_blocks_compile_fullgraph_in_one_process():
    eager = _llama()
    compiled = copy.deepcopy(eager)
    for m in (eager, compiled):
        presets.checkpoint_blocks(sl.create_schedule(m, world_size=1))
    layers = compiled.model.layers
    for i, block in enumerate(list(layers)):
        layers.register_module(str(i), torch.compile(block, backend=BACKEND, fullgraph=True))
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (eager, compiled)]
    for step in range(2):
        ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(step))
        losses = []
        for m, opt in zip((eager, compiled), opts, strict=False):
            opt.zero_grad(set_to_none=True)
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], atol=1e-6, rtol=0)
        ref = dict(eager.named_parameters())
        for name, p in compiled.named_parameters():
            torch.testing.assert_close(p.grad, ref[name.replace("._orig_mod", "")].grad, atol=1e-6, rtol=0)
        for opt in opts:
            opt.step()
    assert not torch._dynamo.utils.counters["graph_break"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1


def test_kv_cache_filter_of_the_checkpoint():
    from transformers.cache_utils import DynamicCache

    from slapo_lab.module_state import _is_kv_cache, without_kv_cache

    cache = DynamicCache()
    assert _is_kv_cache(cache)
    assert not any(
        _is_kv_cache(v) for v in (torch.ones(1), (torch.ones(1), torch.ones(1)), None, True, 3, "x")
    )
    args, kwargs = without_kv_cache(
        (torch.ones(1), cache), {"past_key_values": cache, "use_cache": True, "n": 1}
    )
    assert args[1] is None and kwargs == {"past_key_values": None, "use_cache": False, "n": 1}


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5))
        self.out = nn.Linear(16, 16)

    def forward(self, x):
        return self.out(self.inner(x))


def test_fork_rng_breaks_the_graph_and_stays_exact():
    """``fork_rng`` swaps the global RNG state (``torch.get_rng_state``, which Dynamo refuses to trace); no preset
    uses it. Compiled without fullgraph, Dynamo runs the block eagerly, and the checkpoint still restores the
    tracker's states for the recomputation (without that the gradients below differ by ~5)."""
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block())
    sch = sl.create_schedule(model, world_size=1)
    for i in range(2):
        sch[f"{i}.inner"].fork_rng()
        sch[str(i)].checkpoint()
    compiled = copy.deepcopy(model)
    x = torch.randn(4, 16)

    def grads(m):
        sl.set_random_seed(1, tp_rank=0)
        m(x).sum().backward()
        return [p.grad for p in m.parameters()]

    seed_was_set = sl.random._SEED_SET
    try:
        expected = grads(model)
        with pytest.raises(torch._dynamo.exc.Unsupported, match="get_rng_state"):
            torch.compile(copy.deepcopy(model)[0], backend=BACKEND, fullgraph=True)(x)
        for i in range(2):
            compiled.register_module(str(i), torch.compile(compiled[i], backend=BACKEND))
        for g, e in zip(grads(compiled), expected, strict=False):
            torch.testing.assert_close(g, e, atol=0, rtol=0)
        assert torch._dynamo.utils.counters["graph_break"]
    finally:
        sl.get_cuda_rng_tracker().reset()
        sl.random._SEED_SET = seed_was_set
