"""Single-process tests of slapo_lab.pipeline: partitioning, stage counts, liveness, tied weights, the
cut-time errors of ``cut_pipeline_stage``, ``build_pipeline`` argument checks, ``suggest_cuts``,
``make_mesh`` and the DeepSpeed codecs. Multi-rank training is in test_pipeline_ranks.py."""

from __future__ import annotations

import socket

import pp_models as M
import pytest
import torch
import zoo.matrix
import zoo.pp
from torch import nn

import slapo_lab as sl
from slapo_lab.pipeline import (
    build_pipeline,
    call_order,
    make_mesh,
    partition_pipeline,
    set_example_inputs,
    suggest_cuts,
)


def _sched(name: str, cuts=(), seed: int = 0):
    torch.manual_seed(seed)
    model = M.make(name)
    sch = sl.create_schedule(model)
    for c in cuts:
        sch[c].cut_pipeline_stage()
    return model, sch


def _stage_of(part, fqn: str) -> list[int]:
    return [s.index for s in part.stages if fqn in s.params]


# --- partitioning ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cuts,n",
    [(["encoder.block.1", "encoder", "decoder.block.1"], 4), (["encoder.block.1", "decoder.block.1"], 3)],
)
def test_nested_cuts_stage_counts_like_slapo_t5(cuts, n):
    """Seed 002's T5 example: cutting after encoder.block.k, encoder, decoder.block.k gives 4 stages;
    without the encoder cut, the encoder's tail and the decoder's head share a stage (3)."""
    model, sch = _sched("nested", cuts)
    ids, _ = M.batch("nested", 0, 4)
    part = partition_pipeline(sch, (ids,), n_microbatches=2)
    assert part.num_stages == n == len(cuts) + 1
    assert part.cuts == cuts  # forward order
    assert _stage_of(part, "encoder.block.1.fc.weight") == [0]
    assert _stage_of(part, "encoder.block.2.fc.weight") == [1]
    assert _stage_of(part, "encoder.final_norm.weight") == [1]
    assert _stage_of(part, "decoder.block.0.fc.weight") == [2 if n == 4 else 1]
    assert _stage_of(part, "head.weight") == [n - 1]
    out = part.pipe(ids[:2])[0]
    torch.testing.assert_close(out, model(ids[:2]), rtol=0, atol=0)


def test_hf_t5_nested_cuts():
    from transformers import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    model = zoo.pp.t5()
    inputs, _ = M.batch("t5", 0, 2)
    for cuts, n in (
        (["encoder.block.1", "encoder", "decoder.block.1"], 4),
        (["encoder.block.1", "decoder.block.1"], 3),
    ):
        sch = sl.create_schedule(model)
        part = partition_pipeline(sch if not cuts else _cut(sch, cuts), inputs)
        assert part.num_stages == n
        # the shared embedding is used by the encoder, the decoder and the LM head: one tied group
        assert len(part.tied) == 1 and sorted(part.tied[0]) == ([0, 2, 3] if n == 4 else [0, 1, 2])
        torch.testing.assert_close(part.pipe(**inputs)[0], model(**inputs).logits, rtol=0, atol=0)
        for c in cuts:  # let the next schedule cut the same modules again
            sl.module_state(model.get_submodule(c)).cut = False


def _cut(sch, cuts):
    for c in cuts:
        sch[c].cut_pipeline_stage()
    return sch


def test_gpt2_tied_weights_and_shared_parameters():
    model, sch = _sched("gpt2", ["transformer.h.1"])
    ids, _ = M.batch("gpt2", 0, 2)
    part = partition_pipeline(sch, (ids,))
    assert part.tied == [{0: "transformer.wte.weight", 1: "lm_head.weight"}]
    s0, s1 = part.stages
    assert "lm_head.weight" not in s0.params  # no stale alias of the tied copy in stage 0
    wte, head = s0.params["transformer.wte.weight"], s1.params["lm_head.weight"]
    assert wte is not head and wte is not model.transformer.wte.weight  # one copy per stage
    torch.testing.assert_close(wte, model.transformer.wte.weight, rtol=0, atol=0)
    # every other parameter is the schedule's own object (training updates sch.mod in place)
    assert s1.params["transformer.h.3.mlp.c_fc.weight"] is model.transformer.h[3].mlp.c_fc.weight
    own = {n for s in part.stages for n in s.params}
    assert own == set(dict(model.named_parameters(remove_duplicate=False)))
    torch.testing.assert_close(part.pipe(ids)[0], model(input_ids=ids).logits, rtol=0, atol=0)


def test_liveness_carries_values_through_stages():
    """The embedding output of SkipNet is read by the head only: it is carried through stages 1 and 2."""
    model, sch = _sched("skip", ["blocks.0", "blocks.1", "blocks.2"])
    ids, _ = M.batch("skip", 0, 2)
    part = partition_pipeline(sch, (ids,))
    assert part.num_stages == 4
    assert [len(live) for live in part.liveness] == [1, 2, 2, 2, 1]
    split = part.pipe.split_gm.graph
    stage_nodes = [n for n in split.nodes if n.op == "call_module"]
    index = {n: i for i, n in enumerate(stage_nodes)}
    for n in split.nodes:  # adjacent-stage communication only, as the runtimes require
        users = {index[u] for u in n.users if u.op == "call_module"}
        src = index.get(n.args[0]) if n.op == "call_function" else None
        if src is not None:
            assert users <= {src + 1}, (n, users)
    torch.testing.assert_close(part.pipe(ids)[0], model(ids), rtol=0, atol=0)


def test_bert_mask_output_is_contiguous_and_exact():
    model, sch = _sched("bert", ["bert.encoder.layer.1"])
    ids, _ = M.batch("bert", 0, 2)
    part = partition_pipeline(sch, (ids,))
    for s in part.stages:
        for n in s.module.graph.nodes:
            if n.op == "placeholder":
                assert n.meta["val"].is_contiguous()
    torch.testing.assert_close(part.pipe(ids)[0], model(ids), rtol=0, atol=0)
    assert "bert.encoder.layer.1" in part.describe() or "stage 1" in part.describe()


# --- activation checkpointing inside stages -------------------------------------------------------


class _DropMLP(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Dropout(0.3)

    def forward(self, x):
        return x + self.fc2(self.drop(torch.relu(self.fc1(x))))


class _DropNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[_DropMLP() for _ in range(3)])

    def forward(self, x):
        return self.blocks(x)


def _stage0_fwd_bwd(name, cut, layer, checkpointed):
    """Stage 0 forward + backward; bytes saved for backward while ``layer`` runs, its call count, grads."""
    torch.manual_seed(0)
    model = _DropNet() if name == "drop" else M.make(name)
    sch = sl.create_schedule(model)
    sch[cut].cut_pipeline_stage()
    if checkpointed:
        sch[layer].checkpoint()
    x = torch.randn(4, 8, 32) if name == "drop" else M.batch(name, 0, 2)[0]
    part = partition_pipeline(sch, (x,))
    stage = part.stages[0].module
    lay = stage.get_submodule("model." + layer)
    inner = next(m for m in lay.children())  # its hooks fire again when the layer is recomputed
    state = {"on": False, "saved": 0, "calls": 0}
    lay.register_forward_pre_hook(lambda *a: state.update(on=True))
    lay.register_forward_hook(lambda *a: state.update(on=False))
    inner.register_forward_hook(lambda *a: state.update(calls=state["calls"] + 1))

    def pack(t):
        if state["on"]:
            state["saved"] += t.numel() * t.element_size()
        return t

    torch.manual_seed(1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stage(x)
    out = out[0] if isinstance(out, tuple) else out
    out.float().pow(2).sum().backward()
    grads = {k: p.grad for k, p in part.stages[0].params.items()}
    return out.detach(), state, grads


@pytest.mark.parametrize(
    "name,cut,layer",
    [
        ("bert", "bert.encoder.layer.1", "bert.encoder.layer.0"),
        ("gpt2", "transformer.h.1", "transformer.h.0"),
        ("drop", "blocks.1", "blocks.0"),
        ("drop", "blocks.0", "blocks.0"),
    ],
)  # checkpointed cut module
def test_checkpoint_survives_partitioning(name, cut, layer):
    """torch.export inlines torch.utils.checkpoint; the stage module re-applies it to the checkpointed
    layer: it saves (much) fewer bytes for backward, is recomputed in backward, and forward output and
    gradients equal the un-checkpointed partition bit for bit (dropout RNG restored on recomputation)."""
    out0, st0, g0 = _stage0_fwd_bwd(name, cut, layer, checkpointed=False)
    out1, st1, g1 = _stage0_fwd_bwd(name, cut, layer, checkpointed=True)
    assert st0["calls"] == 1 and st1["calls"] == 2  # recomputed in backward
    assert 0 < st1["saved"] * 4 < st0["saved"], (st1["saved"], st0["saved"])
    torch.testing.assert_close(out1, out0, rtol=0, atol=0)
    assert g0.keys() == g1.keys() and all(g is not None for g in g1.values())
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=0, atol=0)


def test_partition_needs_cuts_and_divisible_batch():
    _, sch = _sched("skip")
    ids, _ = M.batch("skip", 0, 4)
    with pytest.raises(sl.ScheduleError, match="no pipeline cuts"):
        partition_pipeline(sch, (ids,))
    sch["blocks.1"].cut_pipeline_stage()
    with pytest.raises(sl.ScheduleError, match="not divisible by n_microbatches=3"):
        partition_pipeline(sch, (ids,), n_microbatches=3)


# --- cut-time errors --------------------------------------------------------------------------------


class Twice(nn.Module):
    """``blk`` runs twice per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.blk = zoo.pp.Block()
        self.unused = nn.Linear(4, 4)
        self.head = nn.Linear(zoo.pp.HIDDEN, 3)

    def forward(self, x):
        return self.head(self.blk(self.blk(x)))


def _twice_sched():
    sch = sl.create_schedule(Twice())
    set_example_inputs(sch, torch.zeros(2, zoo.pp.HIDDEN))
    return sch


def test_cut_errors_are_one_sentence_and_change_nothing():
    sch = _twice_sched()
    cases = [
        ("", "root module"),
        ("blk", "runs 2 times"),
        ("blk.fc", "inside blk, which runs 2 times"),
        ("unused", "does not run"),
        ("head", "last pipeline stage empty"),
    ]
    for path, msg in cases:
        with pytest.raises(sl.ScheduleError, match=msg) as err:
            sch[path].cut_pipeline_stage()
        assert "\n" not in str(err.value)
        assert sl.check_primitive(sch[path], "cut_pipeline_stage") == str(err.value)
    assert sch.metadata.primitives["cut_pipeline_stage"] == [] and sch.record.calls == []


def test_cut_errors_empty_middle_stage_and_duplicate():
    _, sch = _sched("nested")
    sch["encoder.block.3"].cut_pipeline_stage()  # HF-less custom model: dummy inputs are not known ...
    set_example_inputs(sch, (torch.zeros(2, M.SEQ, dtype=torch.long),))  # ... until given
    with pytest.raises(sl.ScheduleError, match="already ends a pipeline stage"):
        sch["encoder.block.3"].cut_pipeline_stage()
    sch["encoder"].cut_pipeline_stage()  # the final norm runs in between: a real stage
    with pytest.raises(
        sl.ScheduleError,
        match="empty pipeline stage: nothing runs between the end of "
        "encoder.final_norm and the end of encoder",
    ):
        sch["encoder.final_norm"].cut_pipeline_stage()
    assert sch.metadata.primitives["cut_pipeline_stage"] == ["encoder.block.3", "encoder"]
    assert [c.path for c in sch.record.calls] == ["encoder.block.3", "encoder"]


def test_hf_models_use_dummy_inputs_for_the_call_order():
    _, sch = _sched("bert")
    assert call_order(sch).ok  # found through the wrapped BertModel's dummy_inputs
    sch["bert.encoder.layer.3"].cut_pipeline_stage()
    with pytest.raises(
        sl.ScheduleError,
        match="nothing runs between the end of bert.encoder.layer.3 and the end of bert.encoder",
    ):
        sch["bert.encoder"].cut_pipeline_stage()
    _, sch = _sched("gpt2")
    with pytest.raises(sl.ScheduleError, match="last pipeline stage empty"):
        sch["lm_head"].cut_pipeline_stage()
    assert call_order(sch) is call_order(sch)  # cached on the schedule


def test_unknown_order_defers_the_check_to_build():
    sch = sl.create_schedule(Twice())  # no example inputs, no dummy inputs
    assert not call_order(sch).ok
    sch["blk"].cut_pipeline_stage()  # accepted: the order is unknown
    with pytest.raises(sl.ScheduleError, match="runs 2 times"):
        partition_pipeline(sch, (torch.zeros(2, zoo.pp.HIDDEN),))


# --- build_pipeline argument checks (no process group: a pipeline of one rank) ---------------------


def test_build_pipeline_argument_errors():
    _, sch = _sched("skip", ["blocks.1"])
    ids, _ = M.batch("skip", 0, 4)
    kw = {"example_inputs": (ids,), "loss_fn": M.token_loss}
    with pytest.raises(sl.ScheduleError, match="Unknown pipeline target"):
        build_pipeline(sch, "megatron", **kw)
    with pytest.raises(sl.ScheduleError, match="Unknown pipeline schedule"):
        build_pipeline(sch, schedule="ZeroBubble", **kw)
    with pytest.raises(sl.ScheduleError, match="2 stages, but the pipeline group has 1 ranks"):
        build_pipeline(sch, **kw)
    with pytest.raises(sl.ScheduleError, match="needs schedule='Interleaved1F1B'"):
        build_pipeline(sch, schedule="1F1B", stages_per_rank=2, **kw)
    with pytest.raises(sl.ScheduleError, match="one stage per rank"):
        build_pipeline(sch, "deepspeed", stages_per_rank=2, schedule="Interleaved1F1B", **kw)
    with pytest.raises(sl.ScheduleError, match="loss_fn"):
        build_pipeline(sch, example_inputs=(ids,), loss_fn=None)


# --- suggest_cuts ---------------------------------------------------------------------------------------


class Uniform(nn.Module):
    def __init__(self, n: int = 24) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_suggest_cuts_slapo_bert_large_layout():
    """24 equal layers on 4 stages: Slapo's canonical cuts after layers 5, 11, 17."""
    sch = sl.create_schedule(Uniform())
    s = suggest_cuts(sch, 4, example_inputs=torch.zeros(2, 8))
    assert s.paths == ["layers.5", "layers.11", "layers.17"] and s.per_stage == [6 * 72] * 4
    assert s.blocks == "layers" and s.unit == "parameters"
    assert sch.metadata.primitives["cut_pipeline_stage"] == []  # not applied


def test_suggest_cuts_gpt2_by_params_flops_time_and_apply():
    model, sch = _sched("gpt2")
    s = suggest_cuts(sch, 2)  # HF dummy inputs
    assert s.paths == ["transformer.h.1"]
    total = sum(p.numel() for p in model.parameters()) + model.lm_head.weight.numel()  # the tie counts twice
    assert sum(s.per_stage) == total
    f = suggest_cuts(sch, 2, by="flops")
    assert f.unit == "FLOPs" and len(f.paths) == 1 and all(v > 0 for v in f.per_stage)
    t = suggest_cuts(sch, 3, by="time", repeats=1)
    assert t.unit == "seconds" and len(t.paths) == 2 and len(t.per_stage) == 3
    a = suggest_cuts(sch, 3, apply=True)
    assert sch.metadata.primitives["cut_pipeline_stage"] == a.paths
    assert [c.primitive for c in sch.record.calls] == ["cut_pipeline_stage"] * 2
    with pytest.raises(sl.ScheduleError, match="already has cuts"):
        suggest_cuts(sch, 2, apply=True)
    with pytest.raises(sl.ScheduleError, match="by must be one of"):
        suggest_cuts(sch, 2, by="memory")
    with pytest.raises(sl.ScheduleError, match=r"num_stages must be an integer in \[2, 4\]"):
        suggest_cuts(sch, 9)


# --- mesh, collectives, DeepSpeed codecs ------------------------------------------------------------------


def test_make_mesh_errors_without_and_with_a_group():
    import torch.distributed as dist

    with pytest.raises(sl.ScheduleError, match="initialised torch.distributed"):
        make_mesh(tp=2)
    with pytest.raises(sl.ScheduleError, match="positive integer"):
        make_mesh(tp=0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        with pytest.raises(sl.ScheduleError, match="world size is 1, but tp=2 x pp=2 x dp=1 = 4"):
            make_mesh(tp=2, pp=2)
        mesh = make_mesh()
        assert (mesh.tp, mesh.pp, mesh.dp, mesh.tp_rank, mesh.pp_rank, mesh.dp_rank) == (1, 1, 1, 0, 0, 0)
    finally:
        dist.destroy_process_group()


def test_sync_ops_are_exportable_without_a_swap():
    """The sync ops are custom ops on live groups (one home: sharding/sync_ops.py); the export block is empty."""
    from slapo_lab.pipeline._collectives import exportable_sync_ops
    from slapo_lab.sharding import sync_ops

    before = sync_ops.all_reduce_forward
    with exportable_sync_ops():
        assert sync_ops.all_reduce_forward is before
        x = torch.ones(2)  # simulated group: shape-only
        assert torch.equal(sync_ops.all_reduce_forward(x, sl.TPGroup(2, 0, None)), x)
    assert torch.ops.slapo_lab_pp.all_reduce_fwd.default is not None


def test_deepspeed_codecs_are_bit_exact():
    from slapo_lab.pipeline.deepspeed_runtime import _codec, _decode, _encode

    x = torch.randn(3, 4)
    c = _codec(x)
    assert c == ("float_nograd", torch.float32)
    enc = _encode(x, c)
    assert not enc.is_floating_point() and torch.equal(_decode(enc, c), x)
    m = torch.rand(2, 2) > 0.5
    assert torch.equal(_decode(_encode(m, _codec(m)), _codec(m)), m)
    g = torch.randn(2, requires_grad=True) * 2
    assert _codec(g) == ("float",) and _encode(g, ("float",)) is g


def test_model_inputs_and_traced_module_inputs_do_not_share_a_store():
    """record_example_inputs (per-module args for tracing) must not overwrite the model inputs that the
    cut checks run on: after both, a cut leaving the last stage empty is still refused."""
    from transformers import BertConfig, BertModel

    from slapo_lab.call_order import set_example_inputs

    torch.manual_seed(0)
    model = BertModel(
        BertConfig(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            intermediate_size=128,
            vocab_size=120,
            max_position_embeddings=64,
        )
    )
    ids = torch.randint(0, 120, (2, 16))
    sch = sl.create_schedule(model)
    set_example_inputs(sch, {"input_ids": ids})
    sl.record_example_inputs(sch, {"input_ids": ids})
    assert set(sch._top.extra["example_inputs"]) == {"input_ids"}
    with pytest.raises(sl.ScheduleError, match="empty"):
        sch["pooler"].cut_pipeline_stage()


def test_balanced_cuts_span_every_stack_of_blocks():
    """Whisper's encoder and decoder are both cut between (the default cut used to land at encoder.layers.0,
    the middle of the encoder alone)."""

    import tp_train

    from slapo_lab.pipeline import suggest_cuts

    sch = sl.create_schedule(zoo.matrix.whisper_model())
    two = suggest_cuts(sch, 2, example_inputs=tp_train.case_inputs("whisper"))
    assert (
        two.paths == ["model.encoder.layers.1"] and two.blocks == "model.encoder.layers, model.decoder.layers"
    )
    three = suggest_cuts(sch, 3, example_inputs=tp_train.case_inputs("whisper"))
    assert three.paths == ["model.encoder.layers.1", "model.decoder.layers.0"]


def test_partitioning_raises_no_torch_deprecation_warning():
    """Issue 24: torch.distributed.pipelining's own LeafSpec FutureWarning (``isinstance(treespec, LeafSpec)`` is
    deprecated) is not shown on every rank of a pipeline run: our call site silences torch's internal one."""
    import warnings

    _, sch = _sched("skip", ["blocks.0"])
    ids, _ = M.batch("skip", 0, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        part = partition_pipeline(sch, (ids,))
    assert part.num_stages == 2
    assert not [w for w in caught if "LeafSpec" in str(w.message)], [str(w.message) for w in caught]
