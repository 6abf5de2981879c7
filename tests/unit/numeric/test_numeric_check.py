"""The numeric check (``slapo_lab.numeric``, ``check_schedule(numeric=True)``, the editor's live check).

It replays a schedule on a shrunk copy of the model over simulated ranks (threads in PyTorch's threaded
process group) and compares with the unsharded copy: ✓ for each right schedule of every family the
two-rank suite trains, ✗ with the first differing (or failing) module for wrong ones.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
import tp_train
import zoo.tp
from torch import nn
from zoo.matrix import NanoGPT  # nanoGPT: its forward takes the head size from the width
from zoo.scale import llama3_70b_config, on_meta

import slapo_lab as sl
from slapo_lab import presets
from slapo_lab.numeric import numeric_check
from slapo_lab.utils import meta_copy

ALL_CASES = [c for c in tp_train.CASES.values() for c in ([c] if isinstance(c, tuple) else c)]
ALL_CASES += [c for cases in tp_train.FAMILY_CASES.values() for c in cases]


def _scheduled(make, apply, ws: int = 2):
    torch.manual_seed(1234)
    model = make()
    sch = sl.create_schedule(meta_copy(model), world_size=ws)
    apply(sch)
    return model, sch


@pytest.mark.parametrize("name,make,apply", ALL_CASES, ids=[c[0] for c in ALL_CASES])
def test_every_right_schedule_of_the_suite_checks_equal(name, make, apply):
    model, sch = _scheduled(make, apply)
    report = numeric_check(model, sch.record.calls, 2, tp_train.case_inputs(name))
    assert report.status == "passed", report.message
    assert report.message.startswith("Numerically equal to the unsharded model on 2 simulated ranks")
    assert report.worst < 1e-4 and report.seconds < 30


def test_a_missing_reduce_is_found_at_the_layer_that_lacks_it():
    model, sch = _scheduled(zoo.tp.bert_model, lambda s: presets.megatron_tp(s))
    calls = [
        c
        for c in sch.record.calls
        if not (c.path == "encoder.layer.1.output.dense" and c.primitive == "sync")
    ]
    report = numeric_check(model, calls, 2, tp_train.case_inputs("bert"))
    assert report.status == "failed" and report.module == "encoder.layer.1.output.dense", report.message
    assert report.message.startswith(
        "The scheduled model differs from the unsharded one: outputs first differ at encoder.layer.1.output.dense"
    )
    assert report.blocks == (2, 2)  # block 1's schedule differs from block 0's: both are checked


def test_the_embedding_scale_dropped_by_a_vocab_parallel_lookup_is_caught(monkeypatch):
    """The bug the live check must catch (Gemma-3's logits were off by 0.187): a vocab-parallel lookup that
    ignores the module's own forward, as the engine's once did."""
    from slapo_lab.sharding import rules

    model, sch = _scheduled(zoo.tp.gemma3_model, lambda s: presets.megatron_tp(s))
    inputs = tp_train.case_inputs("gemma3")
    assert numeric_check(model, sch.record.calls, 2, inputs).passed

    def lookup_only(self, ids):
        meta = rules.module_meta(self)
        start = meta.vocab_start
        outside = (ids < start) | (ids >= start + self.weight.shape[0])
        out = F.embedding((ids - start).masked_fill(outside, 0), self.weight, self.padding_idx)
        return rules._reduce_partial(self, out.masked_fill(outside.unsqueeze(-1), 0.0))

    monkeypatch.setattr(rules, "_vocab_parallel_embedding", lookup_only)
    report = numeric_check(model, sch.record.calls, 2, inputs)
    assert report.status == "failed" and report.module == "model.embed_tokens", report.message


def test_a_head_size_taken_from_the_width_fails_in_one_sentence_naming_the_attention():
    torch.manual_seed(0)
    model = NanoGPT()
    sch = sl.create_schedule(meta_copy(model), world_size=2)
    presets.megatron_tp(sch, vocab_parallel=False)
    assert sl.check_schedule(sch) == []  # structurally complete: only running it shows the fault
    found = sl.check_schedule(
        sch, numeric=True, reference=model, example_inputs={"input_ids": torch.randint(0, 128, (2, 16))}
    )
    assert [f.kind for f in found] == ["numeric"] and found[0].path == "h.0.attn", found
    assert found[0].message.startswith("The scheduled model fails in h.0.attn while running the forward")
    assert "\n" not in found[0].message


def test_check_schedule_numeric_rebuilds_a_hugging_face_model_from_its_config():
    _model, sch = _scheduled(zoo.tp.llama_model, lambda s: presets.megatron_tp(s))
    assert sl.check_schedule(sch, numeric=True) == []
    with pytest.raises(sl.ScheduleError, match=r"needs reference=<the unscheduled model>"):
        sl.check_schedule(sl.create_schedule(NanoGPT(), world_size=2), numeric=True)


def test_a_70b_plan_is_checked_on_a_shrunk_copy_in_seconds():

    big = on_meta(llama3_70b_config())
    sch = sl.create_schedule(meta_copy(big), world_size=8)
    presets.megatron_tp(sch)
    presets.checkpoint_blocks(sch, every=2)
    ids = torch.empty(1, 4096, dtype=torch.long, device="meta")
    report = numeric_check(big, sch.record.calls, 8, {"input_ids": ids})
    assert report.passed, report.message
    assert report.blocks == (2, 80) and report.params < 10e6  # checkpointed and plain blocks, small widths


def test_a_meta_model_without_a_config_is_skipped_in_one_sentence():
    with torch.device("meta"):
        model = NanoGPT()
    report = numeric_check(model, [], 2, {"input_ids": torch.zeros(2, 8, dtype=torch.long)})
    assert report.status == "skipped"
    assert report.message == (
        "The numeric check needs real weights or a Hugging Face config, and NanoGPT has neither (its "
        "parameters are on the meta device)."
    )


def _wait_for(ed, timeout: float = 60.0):
    end = time.monotonic() + timeout
    while ed.numeric_report is None and time.monotonic() < end:
        time.sleep(0.05)
    return ed.numeric_report


def test_the_editor_checks_in_the_background_after_every_change_and_lists_a_failure_as_an_open_item():
    torch.manual_seed(0)
    model = NanoGPT()
    ids = torch.randint(0, 128, (2, 16))
    ed = sl.ScheduleEditor(model, example_inputs={"input_ids": ids}, world_size=2, live_check=True)
    first = _wait_for(ed)
    assert first is not None and first.passed, first  # nothing scheduled: equal
    assert ed.apply("checkpoint", path="h.1") is None
    # the click returns before the check: a check run inside the click would have set the report (a click's
    # latency is benchmarks/editor_bench.py's to measure, not a timed assertion's on a shared machine)
    assert ed.numeric_report is None
    report = _wait_for(ed)
    assert report.passed and "✓" in ed._numeric_box.value.replace("&#10003;", "✓")
    # the preset checks its calls first: this attention takes its head size from the width, so split it
    # fails and stays whole (one sentence says so); the MLP is split, and the live check agrees ...
    assert ed.apply_preset("megatron") is None
    assert (
        "Kept whole: in every _NanoBlock attn (c_attn, c_proj), because it fails the numeric check when "
        in (ed.message)
    ), ed.message
    assert "the scheduled model fails in h.0.attn" in ed.message
    assert not any(".attn." in c.path for c in ed.schedule.record.calls)
    assert _wait_for(ed).passed
    ed.undo()
    assert _wait_for(ed).passed
    # ... and the same layers sharded by typing are caught by the live check
    sl.presets.tp_block(ed.schedule, "h.0")
    report = _wait_for(ed)
    assert report.status == "error" and report.module == "h.0.attn", report.message
    assert "&#10007;" in ed._numeric_box.value and "h.0.attn" in ed._numeric_box.value
    assert "1 open item" in ed._check.value and "h.0.attn" in ed._check.value
    ed.undo()
    assert _wait_for(ed).passed and "open item" not in ed._check.value


def test_a_burst_of_changes_runs_one_check_for_the_last_schedule():
    torch.manual_seed(0)
    model = NanoGPT(layers=4)
    ed = sl.ScheduleEditor(
        model, example_inputs={"input_ids": torch.randint(0, 128, (2, 8))}, world_size=2, live_check=True
    )
    _wait_for(ed)
    for i in range(4):
        ed.apply("checkpoint", path=f"h.{i}")
    report = _wait_for(ed)
    assert report.passed and report.blocks == (1, 4)  # four checkpointed blocks: one is checked


def test_ranks_told_to_leave_inside_a_collective_end_and_the_next_world_runs():
    """Cancel a world whose rank 0 waits in an all-reduce for a rank 1 that is still computing: every rank
    thread ends before the runner returns (the waiting rank is woken; the computing one leaves at its next
    check_stop), and a second world's collectives then run and agree. Setting the backend's termination event
    alone woke nobody: the waiting rank hung, and every later check waited behind it."""
    import threading

    import torch.distributed as dist

    from slapo_lab.numeric import check_stop, run_threaded_ranks

    cancel, in_collective = threading.Event(), threading.Event()

    def stuck(rank):
        if rank == 0:
            in_collective.set()
            dist.all_reduce(torch.ones(2))
        while True:  # a long computation between collectives
            check_stop()
            time.sleep(0.01)

    threading.Timer(0.5, lambda: in_collective.wait(10) and cancel.set()).start()
    t0 = time.monotonic()
    results, errors, stopped = run_threaded_ranks(stuck, 2, timeout=30, cancelled=cancel)
    assert stopped == "cancelled" and not results and time.monotonic() - t0 < 10
    assert sorted(errors) == [0, 1] and all(isinstance(e, SystemExit) for e in errors.values()), errors
    assert not [t for t in threading.enumerate() if t.name.startswith("slapo-rank")]

    def add(rank):
        t = torch.full((2,), float(rank + 1))
        dist.all_reduce(t)
        return t.tolist()

    results, errors, stopped = run_threaded_ranks(add, 3, timeout=30)
    assert (errors, stopped) == ({}, None) and results == {r: [6.0, 6.0] for r in range(3)}


def test_a_rank_that_fails_releases_the_ranks_waiting_for_it():
    import torch.distributed as dist

    from slapo_lab.numeric import run_threaded_ranks

    def one_fails(rank):
        if rank == 1:
            raise ValueError("rank 1 broke")
        dist.all_reduce(torch.ones(1))

    t0 = time.monotonic()
    results, errors, stopped = run_threaded_ranks(one_fails, 2, timeout=30)
    assert stopped is None and not results and time.monotonic() - t0 < 10
    assert isinstance(errors[1], ValueError) and isinstance(errors[0], SystemExit)


def test_changes_that_land_while_a_check_runs_still_end_in_the_last_schedules_result():
    """GPT-2 with its 50257-token vocabulary, scheduled as the browser walkthrough does (cluster, TP 2, Megatron,
    checkpoint, 2 stages) with each change landing while the previous check is running: the last check
    answers within seconds (a cancelled check used to leave a rank waiting in a collective forever, and every
    later check behind it: "running on 2 simulated ranks…" for good)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=50257, n_positions=64))
    ids = torch.randint(0, 50257, (2, 16))
    ed = sl.ScheduleEditor(model, example_inputs={"input_ids": ids}, world_size=4, live_check=True)
    steps = [
        lambda: ed.set_cluster(2, 2),
        lambda: ed.set_tp(2),
        lambda: ed.apply_preset("megatron"),
        lambda: ed.apply_preset("checkpoint"),
        lambda: ed.apply_preset("stages", 2),
    ]
    for i, step in enumerate(steps):
        step()
        if i + 1 < len(steps):  # the next change lands while this one's check runs
            end = time.monotonic() + 30
            while "running on" not in ed._numeric_box.value and time.monotonic() < end:
                time.sleep(0.01)
            time.sleep(0.05 * i)
    t0 = time.monotonic()
    assert (ed.world_size, [c.primitive for c in ed.schedule.record.calls][-1]) == (2, "cut_pipeline_stage")
    report = _wait_for(ed)
    assert report is not None and report.passed, report
    assert "as 2 pipeline stages" in report.message and time.monotonic() - t0 < 30


class _OwnAttention(nn.Module):
    """A user's attention: separate q/k/v/o projections, head count in an attribute its forward reads."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(width, width), nn.Linear(width, width)
        self.v_proj, self.o_proj = nn.Linear(width, width), nn.Linear(width, width)
        self.n_heads, self.head_dim = heads, width // heads

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (
            p(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class _OwnBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(width), _OwnAttention(width, heads)
        self.up_proj, self.down_proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        x = x + self.attn(self.norm(x))
        return x + self.down_proj(F.gelu(self.up_proj(x)))


class OwnModel(nn.Module):
    def __init__(self, vocab: int = 128, width: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList([_OwnBlock(width, heads) for _ in range(layers)])
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_a_users_own_modules_get_a_right_megatron_preset_without_hugging_face_hooks():
    torch.manual_seed(0)
    model = OwnModel()
    ids = torch.randint(0, 128, (2, 16))
    ed = sl.ScheduleEditor(model, example_inputs={"input_ids": ids}, world_size=2)
    assert ed.apply_preset("megatron") is None, ed.message
    assert ed.check() == [] and ed.schedule["blocks.0.attn.q_proj"].mod.weight.shape == (32, 64)
    report = ed.numeric_check()
    assert report.passed, report.message
    assert sl.check_schedule(ed.schedule, numeric=True, reference=model) == []


def _deberta_cut():
    import zoo.matrix as M

    model = M.deberta_v2()
    sch = sl.create_schedule(meta_copy(model), world_size=2)
    presets.megatron_tp(sch)
    sch["deberta.encoder.layer.0"].cut_pipeline_stage()
    ids = torch.randint(3, M.VOCAB, (2, M.SEQ), generator=torch.Generator().manual_seed(0))
    return model, sch, {"input_ids": ids}


def test_pipeline_stages_are_checked_too_and_deberta_passes():
    model, sch, inputs = _deberta_cut()
    report = numeric_check(model, sch.record.calls, 2, inputs)
    assert report.passed, report.message
    assert "and as 2 pipeline stages" in report.message


def test_a_shared_parameter_whose_stage_gradients_are_not_summed_is_caught(monkeypatch):
    """DeBERTa's relative embeddings feed every layer: each stage holds a copy, and before the partition listed
    it as shared, each copy trained on its own layers' part of the gradient. Put that old behaviour back (only
    aliases are shared) and the check names it."""
    from slapo_lab.pipeline import partition

    real = partition._tie_within_stages

    def aliases_only(model, stages, replicated):
        return [g for g in real(model, stages, replicated) if len(set(g.values())) > 1]

    monkeypatch.setattr(partition, "_tie_within_stages", aliases_only)
    model, sch, inputs = _deberta_cut()
    report = numeric_check(model, sch.record.calls, 2, inputs)
    assert report.status == "failed" and "rel_embeddings" in report.message, report.message
    assert report.message.startswith(
        "As pipeline stages the model trains deberta.encoder.rel_embeddings.weight"
    )


# ------------------------------------------------------------------ issue 23: the check names the culprit
def _without(calls, path, primitive, **kw):
    """``calls`` less the first call of ``primitive`` on ``path`` whose keyword arguments include ``kw``."""
    i = next(
        i
        for i, c in enumerate(calls)
        if c.path == path and c.primitive == primitive and all(c.kwargs.get(k) == v for k, v in kw.items())
    )
    return calls[:i] + calls[i + 1 :]


def test_a_gradient_only_difference_is_named_at_the_layer_whose_input_gradient_is_partial():
    """BERT's query without its bwd_post all-reduce: the forward is right, and its partial input gradient is
    small beside key's and value's (attention is nearly uniform at init), so the parameters' gradients differ by
    2e-6 only, under Verify's tolerance; the gradient the query sends back to its input is off by most of it."""
    model, sch = _scheduled(zoo.tp.bert_model, lambda s: presets.megatron_tp(s))
    path = "encoder.layer.0.attention.self.query"
    calls = _without(list(sch.record.calls), path, "sync", mode="bwd_post")
    report = numeric_check(model, calls, 2, tp_train.case_inputs("bert"))
    assert report.status == "failed" and report.module == path, report.message
    assert report.message.startswith(
        "The scheduled model differs from the unsharded one: only gradients differ, first the gradient "
        f"{path} sends back to its input (off by "
    )


def test_a_forward_failure_is_named_at_the_module_whose_call_raised():
    model, sch = _scheduled(zoo.tp.opt_model, lambda s: presets.megatron_tp(s))
    path = "model.decoder.layers.0.fc1"
    calls = _without(
        list(sch.record.calls), path, "shard"
    )  # the weight whole, its bias ... (first shard: weight)
    calls = [
        c for c in sch.record.calls if not (c.path == path and c.primitive == "shard" and c.args == ("bias",))
    ]
    report = numeric_check(model, calls, 2, tp_train.case_inputs("opt"))
    assert report.status == "error" and report.module == path, report.message
    assert report.message.startswith(f"The scheduled model fails in {path} while running the forward")


def test_a_reduce_scatter_where_an_all_reduce_belongs_is_named_at_the_layer_not_the_block_that_fails():
    from slapo_lab.record import Call

    model, sch = _scheduled(zoo.tp.gpt2_model, lambda s: presets.megatron_tp(s))
    path = "transformer.h.0.mlp.c_proj"
    calls = [
        Call(path, "sync", (), {"mode": "fwd_post", "sync_op_or_fn": "reduce_scatter", "axis": 1})
        if (c.path == path and c.primitive == "sync")
        else c
        for c in sch.record.calls
    ]
    report = numeric_check(model, calls, 2, tp_train.case_inputs("gpt2"))
    assert report.status == "error" and report.module == path, report.message  # the block's add raised


def test_a_missing_gather_is_reported_with_both_shapes():
    model, sch = _scheduled(zoo.tp.llama_model, lambda s: presets.megatron_tp(s))
    calls = _without(list(sch.record.calls), "lm_head", "sync", sync_op_or_fn="all_gather")
    report = numeric_check(model, calls, 2, tp_train.case_inputs("llama"))
    assert report.status == "failed" and report.module == "lm_head", report.message
    assert report.message == (
        "The scheduled model's output logits has another shape than the unsharded one's: lm_head returns "
        "(2, 8, 64) where the unsharded model returns (2, 8, 128) (on 2 simulated ranks)."
    )


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_an_encoder_decoder_of_equal_depths_checkpointing_a_decoder_block_checks_equal(family):
    """The shrunk copy keeps 1 encoder block and 2 decoder blocks; it used to cut both stacks to 1 through the
    config (a layer count equal to both depths) and then fail on its own replay ("No module 'decoder.block.1'")."""
    from test_numeric_seeded_bugs import FAMS

    fam = FAMS[family]
    model = fam.build()
    sch = sl.create_schedule(meta_copy(model), world_size=2)
    last = presets.find_blocks(sch)[-1]
    sch[last].checkpoint()
    report = numeric_check(model, sch.record.calls, 2, fam.example_inputs(2, 16), from_config=True)
    assert report.passed and report.blocks == (3, 4), report.message
    assert sl.check_schedule(sch, numeric=True, example_inputs=fam.example_inputs(2, 16)) == []


def test_every_dropout_is_off_in_the_copy_and_the_users_config_keeps_its_own():
    from test_numeric_seeded_bugs import FAMS

    from slapo_lab.numeric import dropout_off

    model = FAMS["t5"].build()
    copy_ = dropout_off(__import__("copy").deepcopy(model))
    attn = copy_.encoder.block[0].layer[0].SelfAttention
    assert attn.dropout == 0.0 and copy_.config.dropout_rate == 0.0 and attn.config.dropout_rate == 0.0
    assert all(m.p == 0.0 for m in copy_.modules() if isinstance(m, nn.Dropout))
    assert model.config.dropout_rate == 0.1 and model.encoder.block[0].layer[0].SelfAttention.dropout == 0.1


def test_an_unscheduled_copy_that_cannot_run_is_a_finding_not_an_exception():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64, n_positions=8))
    sch = sl.create_schedule(meta_copy(model), world_size=2)
    found = sl.check_schedule(
        sch, numeric=True, example_inputs={"input_ids": torch.zeros(2, 16, dtype=torch.long)}
    )
    assert [f.kind for f in found] == ["numeric_skipped"], found
    assert found[0].message.startswith("The numeric check skipped: the unscheduled copy's forward fails")
    assert "\n" not in found[0].message


def test_every_refusal_names_its_module():
    _model, sch = _scheduled(zoo.tp.llama_model, lambda s: None)
    q = sch["model.layers.0.self_attn.q_proj"]
    q.shard("weight", axis=0)
    with pytest.raises(sl.ScheduleError) as err:
        q.sync(mode="bwd_post", sync_op_or_fn="all_gather")
    assert str(err.value) == (
        "sync() on model.layers.0.self_attn.q_proj: bwd_post supports only all_reduce (got all_gather)."
    )
    assert sl.check_primitive(q, "sync", mode="nope", sync_op_or_fn="all_reduce").startswith(
        "sync() on model.layers.0.self_attn.q_proj: Unknown sync mode 'nope'"
    )


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_sharding_a_moe_router_is_refused_in_one_sentence_naming_it(family):
    from test_numeric_seeded_bugs import FAMS

    sch = sl.create_schedule(meta_copy(FAMS[family].build()), world_size=2)
    for axis in (0, 1):
        with pytest.raises(sl.ScheduleError) as err:
            sch["model.layers.0.mlp.gate"].shard("weight", axis=axis)
        assert str(err.value).startswith(
            "Cannot shard model.layers.0.mlp.gate.weight: model.layers.0.mlp.gate is the mixture-of-experts "
            "router of model.layers.0.mlp.experts"
        )
    assert not sch.record.calls and presets.megatron_tp(sch)  # the preset keeps it whole


def test_a_checkpoint_on_a_block_that_skips_itself_by_pythons_random_is_caught():
    from test_numeric_seeded_bugs import _layerdrop_cases

    model, inputs, cases = _layerdrop_cases()
    right, bug = cases[0], cases[1]
    assert numeric_check(model, right.calls, 2, inputs).passed
    report = numeric_check(model, bug.calls, 2, inputs)
    assert report.status == "failed" and report.module == "blocks.0", report.message
    assert "_SkipBlock.forward draws from Python's (or NumPy's) random generator" in report.message


class _TwoTowers(nn.Module):
    """A text path and an image tower the example inputs may leave unused (a multimodal model given text only)."""

    def __init__(self) -> None:
        super().__init__()
        self.text_up, self.text_down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.image_up, self.image_down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x, pixels=None):
        y = x + self.text_down(torch.relu(self.text_up(x)))
        if pixels is not None:
            y = y + self.image_down(torch.relu(self.image_up(pixels)))
        return y


def test_sharded_modules_the_inputs_never_reach_are_named_as_not_judged():
    torch.manual_seed(0)
    model = _TwoTowers()
    sch = sl.create_schedule(meta_copy(model), world_size=2)
    for side in ("text", "image"):
        presets.column_parallel(sch, f"{side}_up")
        presets.row_parallel(sch, f"{side}_down")
    x = torch.randn(2, 8)
    text_only = numeric_check(model, sch.record.calls, 2, {"x": x})
    assert text_only.passed and text_only.unjudged == ("image_up", "image_down")
    assert "2 modules holding a sharded tensor never ran on the example inputs (image_up, image_down)" in str(
        text_only
    )
    both = numeric_check(model, sch.record.calls, 2, {"x": x, "pixels": torch.randn(2, 8)})
    assert both.passed and both.unjudged == () and "never ran" not in str(both)
