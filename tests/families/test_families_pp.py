"""Pipeline parallelism and activation checkpointing on every common Hugging Face family.

Twelve families with tiny random configs (``tests/multirank/pp_models.py``: 2 blocks, hidden 64, 4
heads, sequence 16, batch 4, no dropout): BERT, RoBERTa, ALBERT, OPT, GPT-Neo, GPT-2, T5 (a cut in the
encoder, and one in the decoder), ViT, Llama, Mistral, Qwen3, Mixtral. For each:

* single process: ``sl.presets.checkpoint_blocks`` (plus T5's decoder blocks) keeps the output and
  every gradient of the unscheduled model, with the KV cache on (``use_cache=True``: the checkpoint
  recomputation must not append to it again -- GPT-Neo crashed) and the blocks really recomputed;
* 2 gloo ranks under torchrun: one cut after the first block, 1F1B over 2 micro-batches, three SGD
  steps: losses and every updated parameter equal single-process training (1e-5);
* the exported pipeline script (``slapo_lab.export.export_script``) passes ``--verify`` on 2 gloo
  ranks under torchrun (one launch per family: ~20-30 s each on 2 CPU cores).

Plus regression tests for the rotary models' stage 0 (an inlined ``no_grad`` region), tied aliases
inside one stage (T5's ``decoder.embed_tokens`` / ``lm_head``) and Interleaved1F1B with both stages on
a single rank (world size 1).
"""

from __future__ import annotations

import copy
import re
import warnings

import harness
import pp_models as M
import pytest
import torch
from harness import launch_results, launch_torchrun

import slapo_lab as sl
from slapo_lab.pipeline import partition_pipeline

ROOT = harness.REPO_ROOT
SCRIPT = ROOT / "tests" / "multirank" / "pp_train.py"

FAMILIES = list(M.FAMILIES)
CKPT_FAMILIES = [f for f in FAMILIES if f != "fam_t5_dec"]  # the same T5 model as fam_t5_enc
ATOL = 1e-5


def _scheduled(name: str, cut: bool = True):
    torch.manual_seed(0)
    model = M.make(name)
    model.train()
    ref = copy.deepcopy(model)
    sch = sl.create_schedule(model)
    if cut:
        sch[M.FAMILIES[name][1]].cut_pipeline_stage()
    return model, ref, sch


# ----------------------------------------------------------------------- partition regressions
def test_rotary_model_stage0_runs():
    """Llama's rotary embedding runs under no_grad: export wraps it in a HOP whose outlining lost stage 0's
    position ids ("Expected positional argument for parameter unsqueeze_default")."""
    _, ref, sch = _scheduled("fam_llama")
    inputs, _ = M.batch("fam_llama", 0, 4)
    part = partition_pipeline(sch, inputs, 2)
    hop = torch.ops.higher_order.wrap_with_set_grad_enabled
    assert not [
        n
        for st in part.stages
        for m in st.module.modules()
        if hasattr(m, "graph")
        for n in m.graph.nodes
        if n.target is hop
    ]
    mb = M.take(inputs, 0, 2)
    env = dict(zip(part.input_names, part.flat_inputs((), mb), strict=False))
    for st in part.stages:  # the stages in sequence, autograd connected
        out = st.module(*[env[n] for n in st.inputs])
        outs = out if isinstance(out, (tuple, list)) else (out,)
        env.update(zip(st.outputs, outs, strict=False))
    want = M.forward_output("fam_llama", ref, mb)
    torch.testing.assert_close(env[part.stages[-1].outputs[0]], want, rtol=0, atol=1e-6)
    # of what crosses to stage 1 only the hidden state carries a gradient: the rotary cos / sin are
    # detached, as under no_grad, and the mask is boolean
    sent = [env[n] for n in part.stages[0].outputs]
    assert len(sent) == 4 and sum(t.requires_grad for t in sent) == 1


def test_tied_aliases_share_one_parameter_per_stage():
    """T5 cut in the encoder: decoder.embed_tokens and lm_head (both ``shared``) land in stage 1 and must stay
    one parameter there (they were two copies, each trained on part of the gradient)."""
    _, _, sch = _scheduled("fam_t5_enc")
    inputs, _ = M.batch("fam_t5_enc", 0, 4)
    part = partition_pipeline(sch, inputs, 2)
    s1 = part.stages[1].params
    assert s1["decoder.embed_tokens.weight"] is s1["lm_head.weight"]
    names = dict(part.stages[1].module.named_parameters(remove_duplicate=False))
    assert names["model.decoder.embed_tokens.weight"] is names["model.lm_head.weight"]
    assert part.tied == [{0: "encoder.embed_tokens.weight", 1: "decoder.embed_tokens.weight"}]
    assert part.stages[1].n_params == sum(p.numel() for p in {id(p): p for p in s1.values()}.values())


# ------------------------------------------------------------------------------- checkpointing
@pytest.mark.parametrize("name", CKPT_FAMILIES)
def test_checkpoint_preset_matches_original(name):
    model, ref, sch = _scheduled(name, cut=False)
    for m in (model, ref):  # the KV cache on, as in a default config
        if hasattr(m.config, "use_cache"):
            m.config.use_cache = True
    calls = sl.presets.checkpoint_blocks(sch)
    paths = [c.path for c in calls]
    if name == "fam_t5_enc":  # both stacks (the decoder's blocks get an EncoderDecoderCache)
        for i in range(2):
            if f"decoder.block.{i}" not in paths:
                sch[f"decoder.block.{i}"].checkpoint()
                paths.append(f"decoder.block.{i}")
        assert {f"{s}.block.{i}" for s in ("encoder", "decoder") for i in range(2)} <= set(paths)
    assert len(paths) >= 2, paths
    # recomputation is real: in each checkpointed block the parameterised leaves run twice per step
    # (torch stops recomputing after the last tensor backward needs, so count the most-run leaf)
    runs: dict[tuple[str, str], int] = {}
    for p in paths:
        for leaf, m in sch[p].mod.named_modules():
            if leaf and not list(m.children()) and list(m.parameters(recurse=False)):
                m.register_forward_hook(lambda *a, k=(p, leaf): runs.__setitem__(k, runs.get(k, 0) + 1))
    inputs, y = M.batch(name, 0, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = M.forward_output(name, model, inputs)
        want = M.forward_output(name, ref, inputs)
        M.LOSS[name](out, y).backward()
        M.LOSS[name](want, y).backward()
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
    refs = dict(ref.named_parameters())
    n = 0
    for pname, p in model.named_parameters():
        if refs[pname].grad is None:
            assert p.grad is None, pname
            continue
        torch.testing.assert_close(p.grad, refs[pname].grad, rtol=0, atol=1e-6, msg=pname)
        n += 1
    assert n > 10
    most = {p: max(c for (q, _), c in runs.items() if q == p) for p in paths}
    assert most == dict.fromkeys(paths, 2), runs


def test_checkpoint_keeps_the_kv_cache_without_grad():
    """Under no_grad nothing is checkpointed, so generation keeps filling the cache of checkpointed blocks."""
    model, ref, sch = _scheduled("fam_gpt_neo", cut=False)
    sl.presets.checkpoint_blocks(sch)
    ids, _ = M.batch("fam_gpt_neo", 0, 2)
    with torch.no_grad():
        out = model(**ids, use_cache=True)
        want = ref(**ids, use_cache=True)
    assert out.past_key_values.get_seq_length() == want.past_key_values.get_seq_length() == M.FAMILY_SEQ


# -------------------------------------------------------------------------- multi-rank pipelines
_RESULTS: dict[str, tuple[int, str, dict]] = {}
LAUNCHES = {
    "families": (2, 480, FAMILIES),
    "one_rank": (1, 240, ["gpt2_interleaved_ws1", "llama_interleaved_ws1"]),
}


def _results(launch: str):
    if launch not in _RESULTS:
        nproc, timeout, cases = LAUNCHES[launch]
        _RESULTS[launch] = launch_results(SCRIPT, nproc, cases, timeout)
    return _RESULTS[launch]


@pytest.mark.multirank
@pytest.mark.parametrize("name", FAMILIES)
def test_family_pipeline_matches_single_process(name):
    rc, out, res = _results("families")
    assert name in res, f"no result for {name} (torchrun exit {rc}):\n{out[-5000:]}"
    r = res[name]
    assert not r["bad"], f"{name}: " + "; ".join(r["bad"])
    assert r["num_stages"] == 2 and len(r["loss"]) == 3
    assert r["max_loss_diff"] <= ATOL and r["max_param_diff"] <= ATOL, r
    if M.FAMILIES[name][2] in ("mlm", "seq2seq") or name in ("fam_opt", "fam_gpt_neo", "fam_gpt2"):
        assert len(r["tied"]) == 1, r["tied"]  # the embedding on stage 0, its tied head on stage 1
        assert sorted(dict(r["tied"][0])) == [0, 1]


@pytest.mark.multirank
@pytest.mark.parametrize("case", LAUNCHES["one_rank"][2])
def test_interleaved_two_stages_on_one_rank(case):
    rc, out, res = _results("one_rank")
    assert case in res, f"no result for {case} (torchrun exit {rc}):\n{out[-5000:]}"
    r = res[case]
    assert not r["bad"], f"{case}: " + "; ".join(r["bad"])
    assert r["stage_ids"] == [0, 1] and r["max_loss_diff"] <= ATOL and r["max_param_diff"] <= ATOL, r


# ---------------------------------------------------------------------------- exported scripts
# slapo_lab.train's Verify of a pipeline: one training step's batch through the stages and through the unscheduled
# model (sharded by FSDP2 over the ranks), comparing the loss and every gradient
LOSS_DIFF = re.compile(r"^Verify: output loss: max abs diff (\S+),", re.MULTILINE)
GRADS = re.compile(r"^Verify: gradients of (\d+) parameters: max abs diff (\S+) ", re.MULTILINE)


EXPORT_FAMILIES = [f for f in FAMILIES if f != "fam_t5_dec"]  # one T5 script (its cut is in the encoder)


@pytest.mark.multirank
@pytest.mark.parametrize("name", EXPORT_FAMILIES)
def test_exported_family_script_verifies_on_two_ranks(tmp_path, name):
    """The family's exported pipeline script, launched on 2 gloo ranks, passes its own --verify and trains."""
    from slapo_lab.export import export_script

    model, _, sch = _scheduled(name)
    inputs, _ = M.batch(name, 0, 4)
    script = export_script(tmp_path / f"train_{name}.py", model, sch.record.calls, inputs, world_size=1)
    rc, text = launch_torchrun(script, 2, ["--device", "cpu", "--steps", "1"], 300)
    if "EADDRINUSE" in text or "address already in use" in text:  # the free port was taken: once more
        rc, text = launch_torchrun(script, 2, ["--device", "cpu", "--steps", "1"], 300)
    assert rc == 0 and "Verify: PASSED" in text, text[-5000:]
    (loss_diff,) = LOSS_DIFF.findall(text)
    ((n_grads, grad_diff),) = GRADS.findall(text)
    assert int(n_grads) > 10, text[-3000:]
    for d in (loss_diff, grad_diff):
        assert float(d) <= ATOL, text[-3000:]
    assert "2 rank(s) = tp 1 x pp 2 x dp 1" in text and "step 1/1 loss" in text, text[-3000:]
