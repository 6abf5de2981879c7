"""Tensor parallelism on attention that stores head counts (issue 10): RoBERTa, OPT, GPT-Neo, T5.

OPT, GPT-Neo and T5 keep the head count in an attribute their forward reads (``OPTAttention.num_heads``,
``GPTNeoSelfAttention.num_heads``, ``T5Attention.n_heads``); sharding q/k/v must rewrite it for the rank
(``slapo_lab/sharding/heads.py``) or refuse in one sentence. T5 also splits ``relative_attention_bias`` on its
heads axis and shards the decoder (self and cross attention) and its (gated) feed-forward.

* fast, one process: the simulated schedule (``create_schedule(model, world_size=2)``) has the per-rank head
  attributes, records the rewrite in ``_slapo_meta``, replays to the same state, refuses what it cannot do;
* real, 2 gloo ranks: ``tests/multirank/tp_train.py`` runs each family's TP preset inside ``sl.Verify`` and
  three SGD steps against the unsharded model (forward, every gathered gradient, updated weights: 1e-5);
* the exported OPT and T5 scripts pass ``--verify`` under torchrun on 2 CPU ranks.
"""

from __future__ import annotations

import re

import harness
import pytest
import torch
import tp_train
import zoo.tp
from harness import launch_results
from torch import nn

import slapo_lab as sl
from slapo_lab import presets
from slapo_lab.export import export_script
from slapo_lab.module_state import module_meta

ROOT = harness.REPO_ROOT
SCRIPT = ROOT / "tests" / "multirank" / "tp_train.py"

FAMILY_CASES = [
    "roberta_megatron_tp",
    "opt_megatron_tp",
    "opt_350m_layout_megatron_tp",
    "gpt_neo_megatron_tp",
    "t5_megatron_tp",
    "t5_gated_megatron_tp",
    "umt5_megatron_tp",
]


def _sched(make, ws=2):
    torch.manual_seed(0)
    model = make()
    return model, sl.create_schedule(model, world_size=ws)


def _one_sentence(msg: str) -> None:
    assert msg.endswith(".") and ". " not in msg.rstrip("."), msg


def _assert_refused(sch, fn, match, attrs=()):
    """fn() raises one ScheduleError sentence matching ``match``; record, parameters and attributes unchanged."""
    before = len(sch.record)
    params = dict(sch.mod.named_parameters())
    values = [(obj, a, getattr(obj, a)) for obj, a in attrs]
    with pytest.raises(sl.ScheduleError, match=match) as ei:
        fn()
    assert len(sch.record) == before
    assert all(p is params[n] for n, p in sch.mod.named_parameters())
    assert all(getattr(obj, a) == v for obj, a, v in values)
    _one_sentence(str(ei.value))
    return str(ei.value)


# --- the simulated schedule: per-rank head attributes -------------------------------------------------------
def test_opt_preset_rewrites_head_counts():
    model, sch = _sched(zoo.tp.opt_model)
    assert presets.detect_family(sch) == "opt"
    presets.megatron_tp(sch)
    for layer in model.model.decoder.layers:
        attn = layer.self_attn
        assert (attn.num_heads, attn.embed_dim, attn.head_dim) == (2, 16, 8)
        assert attn.q_proj.weight.shape == (16, 32) and attn.out_proj.weight.shape == (32, 16)
        rec = sl.module_state(attn).attention_heads
        assert rec["heads"] == 4 and rec["attrs"] == {"num_heads": [4, 2], "embed_dim": [32, 16]}
    assert model.config.num_attention_heads == 4  # the shared config keeps the global count


def test_gpt_neo_preset_rewrites_head_counts_and_runs():
    model, sch = _sched(zoo.tp.gpt_neo_model)
    assert presets.detect_family(sch) == "gpt_neo"
    presets.megatron_tp(sch)
    for block in model.transformer.h:
        attn = block.attn.attention
        assert (attn.num_heads, attn.embed_dim, attn.head_dim) == (2, 16, 8)
    # the per-rank module is self-consistent: _split_heads no longer crashes (syncs are inert when simulated)
    out = model(input_ids=torch.randint(1, tp_train.VOCAB, (2, 8)), use_cache=False)
    assert out.logits.shape == (2, 8, tp_train.VOCAB)


@pytest.mark.parametrize("ff", ["relu", "gated-gelu"])
def test_t5_preset_covers_encoder_decoder_and_head_tables(ff):
    model, sch = _sched(lambda: zoo.tp.t5_model(ff))
    assert presets.detect_family(sch) == "t5"
    calls = presets.megatron_tp(sch)
    attns = [m for m in model.modules() if type(m).__name__ == "T5Attention"]
    assert len(attns) == 6  # encoder 2 self; decoder 2 self + 2 cross (EncDecAttention)
    for attn in attns:
        assert (attn.n_heads, attn.inner_dim, attn.key_value_proj_dim, attn.d_model) == (2, 16, 8, 32)
        for p in (attn.q, attn.k, attn.v):
            assert p.weight.shape == (16, 32) and p.weight.shard_axis == 0
        assert attn.o.weight.shape == (32, 16) and attn.o.weight.shard_axis == 1
    for stack in (model.encoder, model.decoder):
        bias = stack.block[0].layer[0].SelfAttention.relative_attention_bias
        assert bias.weight.shape == (8, 2) and bias.weight.orig_shape == (8, 4) and bias.embedding_dim == 2
        for block in stack.block:
            ffn = block.layer[-1].DenseReluDense
            ins = [ffn.wi_0, ffn.wi_1] if ff.startswith("gated") else [ffn.wi]
            assert all(w.weight.shape == (32, 32) and w.weight.shard_axis == 0 for w in ins)
            assert ffn.wo.weight.shape == (32, 32) and ffn.wo.weight.shard_axis == 1
    code = sch.record.code()
    for path in (
        "decoder.block.1.layer.1.EncDecAttention.k",
        "decoder.block.0.layer.0.SelfAttention.relative_attention_bias",
        "encoder.block.1.layer.1.DenseReluDense.wo",
    ):
        assert f'sch["{path}"]' in code
    # the tied shared / encoder / decoder embeddings all reduce their vocab-parallel partial lookups
    for emb in ("shared", "encoder.embed_tokens", "decoder.embed_tokens"):
        assert f'sch["{emb}"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")' in code
    assert model.lm_head.weight is model.shared.weight and model.lm_head.weight.shape == (64, 32)
    assert len(calls) == len(sch.record)
    out = model(
        input_ids=torch.randint(1, tp_train.VOCAB, (2, 8)),
        decoder_input_ids=torch.randint(1, tp_train.VOCAB, (2, 4)),
    )
    assert out.logits.shape == (2, 4, tp_train.VOCAB)


@pytest.mark.parametrize("variant", ["MT5", "UMT5"])
def test_t5_copies_are_the_t5_family(variant):
    model, sch = _sched(lambda: zoo.tp.t5_model("gated-gelu", variant))
    assert presets.detect_family(sch) == "t5"
    calls = presets.megatron_tp(sch)
    attns = [m for m in model.modules() if type(m).__name__ == f"{variant}Attention"]
    assert len(attns) == 6 and {(a.n_heads, a.inner_dim) for a in attns} == {(2, 16)}
    tables = [c.path for c in calls if c.path.endswith("relative_attention_bias")]
    assert len(tables) == (
        2 if variant == "MT5" else 4
    )  # UMT5: a relative bias in every self-attention layer


def test_roberta_is_detected_and_keeps_its_reshape_attributes():
    model, sch = _sched(zoo.tp.roberta_mlm_model)
    assert presets.detect_family(sch) == "roberta"
    presets.megatron_tp(sch)
    attn = model.roberta.encoder.layer[0].attention.self
    # RobertaSelfAttention reshapes with -1 heads and never reads its head count after __init__
    assert (attn.num_attention_heads, attn.attention_head_size) == (4, 8)
    assert sl.module_state(attn).attention_heads["attrs"] == {}
    assert attn.query.weight.shape == (16, 32)


def test_replay_reproduces_the_rewrite():
    model, sch = _sched(zoo.tp.t5_model)
    presets.megatron_tp(sch)
    fresh, sch2 = _sched(zoo.tp.t5_model)
    sl.replay(sch2, sch.record.calls)
    for (p, a), (_, b) in zip(model.named_modules(), fresh.named_modules(), strict=False):
        if type(a).__name__ == "T5Attention":
            assert (b.n_heads, b.inner_dim) == (a.n_heads, a.inner_dim) == (2, 16), p
            assert sl.module_state(b).attention_heads == sl.module_state(a).attention_heads
    assert sch2.record.code() == sch.record.code()


def test_editor_preset_undo_redo_restore_head_attributes():
    """The editor rebuilds from a meta copy and replays on undo: the per-rank head counts follow."""
    torch.manual_seed(0)
    ids = torch.randint(1, tp_train.VOCAB, (2, 8))
    ed = sl.ScheduleEditor(
        zoo.tp.t5_model(), example_inputs={"input_ids": ids, "decoder_input_ids": ids[:, :4]}, world_size=2
    )

    def heads():
        return {
            (m.n_heads, m.inner_dim) for m in ed.schedule.mod.modules() if type(m).__name__ == "T5Attention"
        }

    assert heads() == {(4, 32)}
    assert ed.apply_preset("megatron") is None and heads() == {(2, 16)}
    assert ed.undo() is None and heads() == {(4, 32)}
    assert ed.redo() is None and heads() == {(2, 16)}


def test_world_size_one_changes_nothing():
    model, sch = _sched(zoo.tp.opt_model, ws=1)
    presets.megatron_tp(sch, vocab_parallel=False)
    assert model.model.decoder.layers[0].self_attn.num_heads == 4


# --- refusals: one sentence, nothing changed -------------------------------------------------------------------
def test_heads_not_divisible_keep_the_attention_whole_and_the_rest_is_split():
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(
        num_hidden_layers=1,
        hidden_size=48,
        ffn_dim=64,
        num_attention_heads=6,
        vocab_size=128,
        max_position_embeddings=32,
        word_embed_proj_dim=48,
    )
    model, sch = _sched(lambda: OPTForCausalLM(cfg), ws=4)
    attn = model.model.decoder.layers[0].self_attn
    # the attention's split is refused, so that region stays whole; the MLP (64 / 4) is still split
    notes = presets.megatron_tp(sch).notes
    kept = next(n for n in notes if n.startswith("Kept whole") and "q_proj" in n)
    assert re.search("6 attention heads do not divide by (the world size )?4", kept), notes
    _one_sentence(kept)
    assert (attn.num_heads, attn.embed_dim) == (6, 48)
    assert attn.q_proj.weight.shape == (48, 48) and attn.out_proj.weight.shape == (48, 48)
    layer = model.model.decoder.layers[0]
    assert layer.fc1.weight.shape == (16, 48) and layer.fc2.weight.shape == (48, 16)


def test_t5_relative_bias_heads_not_divisible_refused():
    model, sch = _sched(zoo.tp.t5_model, ws=8)  # 4 heads; the 32-wide projections would divide by 8
    path = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias"
    attn = model.encoder.block[0].layer[0].SelfAttention
    _assert_refused(
        sch,
        lambda: sch[path].shard("weight", axis=1),
        "4 attention heads do not divide by 8",
        [(attn, "n_heads")],
    )
    _assert_refused(
        sch,
        lambda: sch["encoder.block.0.layer.0.SelfAttention.q"].shard("weight", axis=0),
        "4 attention heads do not divide by 8",
        [(attn, "n_heads")],
    )


def test_family_must_match_the_model():
    _, sch = _sched(zoo.tp.opt_model)
    _assert_refused(sch, lambda: presets.megatron_tp(sch, family="t5"), "expects T5Block or MT5Block")


class _Cfg:
    num_attention_heads = 4


class _Projections(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(16, 16) for _ in range(4))


class ConfigHeadsAttention(_Projections):
    """Reads its head count from the shared config at run time: gets a per-rank config copy."""

    def __init__(self):
        super().__init__()
        self.config = _Cfg()

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (
            p(x).view(b, s, self.config.num_attention_heads, -1).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = torch.softmax(q @ k.transpose(-1, -2), -1) @ v
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class AttrHeadsAttention(_Projections):
    """Keeps its head count (and head width) in attributes the forward reads: rewritten per rank."""

    def __init__(self):
        super().__init__()
        self.num_heads, self.all_head_size = 4, 16

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (
            p(x).view(b, s, self.num_heads, 4).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = torch.softmax(q @ k.transpose(-1, -2), -1) @ v
        return self.o_proj(y.transpose(1, 2).reshape(b, s, self.all_head_size))


class Wrong(AttrHeadsAttention):
    """``n_heads`` (read at run time) disagrees with ``num_heads``."""

    def __init__(self):
        super().__init__()
        self.n_heads = 2

    def forward(self, x):
        return super().forward(x) * self.n_heads


def test_config_head_count_read_at_run_time_gets_a_per_rank_config():
    torch.manual_seed(0)
    model = nn.Sequential(ConfigHeadsAttention())
    ref = ConfigHeadsAttention()
    ref.load_state_dict(model[0].state_dict())
    shared = model[0].config
    sch = sl.create_schedule(model, world_size=2, rank=1)
    for n in ("q_proj", "k_proj", "v_proj"):
        presets.column_parallel(sch, f"0.{n}")
    presets.row_parallel(sch, "0.o_proj")
    attn = model[0]
    assert (
        attn.config is not shared and attn.config.num_attention_heads == 2
    )  # its own copy, found by parsing
    assert shared.num_attention_heads == 4  # the shared config stays global
    assert module_meta(attn).attention_heads["config"] == {"num_attention_heads": [4, 2]}
    x = torch.randn(2, 5, 16)
    with torch.no_grad():  # rank 1 (simulated, no reduce) computes heads 2 and 3 of the reference
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, 4, 4).transpose(1, 2)[:, 2:] for p in (ref.q_proj, ref.k_proj, ref.v_proj))
        y = (torch.softmax(q @ k.transpose(-1, -2), -1) @ v).transpose(1, 2).reshape(b, s, 8)
        expect = y @ ref.o_proj.weight[:, 8:].T + ref.o_proj.bias
        assert torch.allclose(model(x), expect, atol=1e-6)


def test_inconsistent_head_attribute_refused():
    model = nn.Sequential(Wrong())
    sch = sl.create_schedule(model, world_size=2)
    _assert_refused(
        sch,
        lambda: sch["0.k_proj"].shard("weight", axis=0),
        r"Wrong.n_heads is 2, not the module's 4",
        [(model[0], "num_heads"), (model[0], "n_heads")],
    )


def test_unregistered_attention_is_rewritten_by_detection():
    torch.manual_seed(0)
    model = nn.Sequential(AttrHeadsAttention())
    ref = AttrHeadsAttention()
    ref.load_state_dict(model[0].state_dict())
    sch = sl.create_schedule(model, world_size=2, rank=1)
    for n in ("q_proj", "k_proj", "v_proj"):
        presets.column_parallel(sch, f"0.{n}")
    presets.row_parallel(sch, "0.o_proj")
    attn = model[0]
    assert (attn.num_heads, attn.all_head_size) == (2, 8)
    # rank 1 (simulated, no reduce) computes exactly heads 2 and 3's contribution: check it against the full module
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        b, s, _ = x.shape  # heads 2..3 of the reference, projected by their o_proj columns
        q, k, v = (p(x).view(b, s, 4, 4).transpose(1, 2)[:, 2:] for p in (ref.q_proj, ref.k_proj, ref.v_proj))
        y = (torch.softmax(q @ k.transpose(-1, -2), -1) @ v).transpose(1, 2).reshape(b, s, 8)
        expect = y @ ref.o_proj.weight[:, 8:].T + ref.o_proj.bias
        assert torch.allclose(model(x), expect, atol=1e-6)


# --- real 2-rank runs -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def multirank_results():
    args = ["roberta", "opt", "gpt_neo", "t5"]
    return launch_results(SCRIPT, 2, args, 300)


@pytest.mark.multirank
@pytest.mark.parametrize("case", FAMILY_CASES)
def test_family_tp_matches_single_process_on_two_ranks(multirank_results, case):
    rc, out, res = multirank_results
    assert case in res, f"no result for {case} (torchrun exit {rc}):\n{out[-4000:]}"
    r = res[case]
    assert not r["bad"], f"{case}: " + "; ".join(r["bad"])
    assert r["verify"] is True and r["n_sharded"] > 0
    assert r["max_loss_diff"] <= 1e-5 and r["max_grad_diff"] <= 1e-5 and r["max_param_diff"] <= 1e-5, r
    assert len(r["loss"]) == 3


@pytest.mark.multirank
def test_family_launch_exit_status(multirank_results):
    rc, out, res = multirank_results
    assert rc == 0 and set(res) == set(FAMILY_CASES), out[-4000:]


OUTPUT_DIFF = re.compile(r"^Verify: output (\S+): max abs diff (\S+),", re.MULTILINE)
GRAD_DIFF = re.compile(r"^Verify: gradients of (\d+) parameters: max abs diff (\S+) ", re.MULTILINE)


@pytest.mark.multirank
@pytest.mark.parametrize("family", ["opt", "t5"])
def test_exported_family_script_verifies_on_two_ranks(
    family, tmp_path, run_bounded, torchrun_cmd, free_port, subprocess_env
):
    make = {"opt": zoo.tp.opt_model, "t5": zoo.tp.t5_model}[family]
    model, sch = _sched(make)
    presets.megatron_tp(sch)
    ids = torch.randint(2, tp_train.VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids}
    if family == "t5":
        inputs["decoder_input_ids"] = ids[:, :8]
    script = export_script(tmp_path / f"train_{family}.py", model, sch.record.calls, inputs, world_size=2)
    r = run_bounded(
        torchrun_cmd(2, free_port, script, "--device", "cpu", "--steps", "1"),
        timeout=300,
        cwd=tmp_path,
        env=subprocess_env,
    )
    explain = f"exit {r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    assert r.returncode == 0 and "Verify: PASSED" in r.stdout, explain
    outputs = dict(OUTPUT_DIFF.findall(r.stdout))
    assert "logits" in outputs and (family != "t5" or "encoder_last_hidden_state" in outputs), explain
    grads = GRAD_DIFF.findall(r.stdout)
    assert len(grads) == 1 and int(grads[0][0]) > 0 and float(grads[0][1]) <= 1e-5, explain
    assert all(float(d) <= 1e-5 for d in outputs.values()), explain


class MinusOneAttention(_Projections):
    """Reshapes with -1 heads: its head attributes are never read after __init__."""

    def __init__(self):
        super().__init__()
        self.num_heads, self.inner_dim = 4, 16

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, 4).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.o_proj((torch.softmax(q @ k.transpose(-1, -2), -1) @ v).transpose(1, 2).reshape(b, s, -1))


class RegisteredAttention(MinusOneAttention):
    pass


def test_register_attention_heads():
    from slapo_lab.sharding import register_attention_heads

    with pytest.raises(ValueError, match="not a head-count or head-width attribute"):
        register_attention_heads("RegisteredAttention", ["dropout"])
    register_attention_heads("RegisteredAttention", ["num_heads", "inner_dim"])
    model = nn.Sequential(MinusOneAttention(), RegisteredAttention())
    sch = sl.create_schedule(model, world_size=2)
    for i in (0, 1):
        presets.column_parallel(sch, f"{i}.q_proj")
    assert (model[0].num_heads, model[0].inner_dim) == (4, 16)  # not read at run time: left as built
    assert (model[1].num_heads, model[1].inner_dim) == (2, 8)  # registered: per rank
    assert sl.module_state(model[1]).attention_heads["attrs"] == {
        "num_heads": [4, 2],
        "inner_dim": [16, 8],
    }
