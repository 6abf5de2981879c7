"""Slapo compatibility (issue 16 item 10): ``import slapo_lab as slapo`` runs Slapo 0.0.3's own tests and schedules.

* Slapo 0.0.3's own test files, from the ``slapo==0.0.3`` wheel that ``scripts/install.sh`` downloads and
  unpacks into ``.cache/slapo/wheel`` (no Slapo code is kept in this repository), are copied into a temporary
  folder with ``tests/slapo_compat/conftest_template.py`` as their conftest (``slapo`` -> ``slapo_lab``:
  ``tests/slapo_compat/slapo_alias.py``); :func:`test_slapo_cpu_suite` runs them: 21 CPU tests pass, one
  known difference is listed there with its reason (an xfail), and the tests Slapo runs only with CUDA /
  ``torchrun`` on GPUs or with torchvision (not installed) are skipped, each with its reason.
* Slapo's model schedules (the wheel's ``slapo/model_schedule/*.py``) on transformers 5.x classes built from tiny configs: T5's applies; BERT, RoBERTa, ALBERT, GPT-2, GPT-Neo and
  OPT replace attention with modules written for transformers 4.x calls (``past_key_value``,
  ``layer_past``), which transformers 5.x no longer makes.
* ``slapo_lab.op`` (Slapo's attention / MLP / linear ops on SDPA), ``analyze_tie_weights``, the Slapo module
  paths and Slapo's replace naming.
"""

from __future__ import annotations

import copy
import math
import os
import re
import shutil
import sys

import harness
import pytest
import torch
import torch.nn.functional as F
import transformers as T
from torch import nn

import slapo_lab as sl
from slapo_lab import op

HERE = harness.TESTS / "slapo_compat"
sys.path.insert(0, str(HERE))
import slapo_alias  # installs the ``slapo`` -> ``slapo_lab`` alias

SLAPO_CPU_PASSING = 21  # of 23 CPU tests: 1 known failure (xfail), 1 needs torchvision


@pytest.fixture(autouse=True)
def _wheel_unpacked():
    problem = slapo_alias.missing()
    assert problem is None, problem


def test_slapo_cpu_suite(tmp_path, subprocess_env, run_bounded):
    dst = tmp_path / "slapo_tests"
    shutil.copytree(slapo_alias.WHEEL / "tests", dst)
    shutil.copy(HERE / "conftest_template.py", dst / "conftest.py")
    env = dict(subprocess_env, PYTHONPATH=os.pathsep.join([str(HERE), subprocess_env["PYTHONPATH"]]))
    res = run_bounded(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-rsx",
            "--rootdir",
            str(tmp_path),
            str(dst),
        ],
        300,
        cwd=tmp_path,
        env=env,
    )
    tail = res.stdout[-6000:]
    assert res.returncode == 0, tail + res.stderr[-2000:]
    # every test not passing says why: Slapo's GPU-only tests, torchvision, Slapo's own skip, the xfail
    reasons = re.findall(
        r"^(?:SKIPPED \[\d+\] \S+|XFAIL \S+) - (.*)$|^SKIPPED \[\d+\] \S+: (.*)$", tail, re.MULTILINE
    )
    allowed = (
        "needs CUDA",
        "needs torchrun with 2 GPUs",
        "torchvision is not installed",
        "Flaky test",
        "expects NewMod_1",
    )
    assert reasons and all(any((a or b).startswith(ok) for ok in allowed) for a, b in reasons), reasons
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|xfailed|xpassed|errors?)", tail)}
    assert counts.get("passed", 0) >= SLAPO_CPU_PASSING, tail
    assert not counts.get("failed") and not counts.get("error") and not counts.get("errors"), tail


# --- Slapo's model schedules -----------------------------------------------------------------------------
def _tiny(key):
    cfgs = {
        "bert": (
            T.BertModel,
            T.BertConfig,
            {"hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64},
        ),
        "roberta": (
            T.RobertaModel,
            T.RobertaConfig,
            {"hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64},
        ),
        "albert": (
            T.AlbertModel,
            T.AlbertConfig,
            {"embedding_size": 16, "hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64},
        ),
        "gpt2": (T.GPT2Model, T.GPT2Config, {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}),
        "gpt_neo": (
            T.GPTNeoModel,
            T.GPTNeoConfig,
            {
                "hidden_size": 32,
                "num_layers": 2,
                "num_heads": 4,
                "attention_types": [[["global", "local"], 1]],
                "max_position_embeddings": 64,
                "window_size": 16,
            },
        ),
        "opt": (
            T.OPTModel,
            T.OPTConfig,
            {"hidden_size": 32, "num_attention_heads": 4, "ffn_dim": 64, "word_embed_proj_dim": 32},
        ),
        "t5": (
            T.T5Model,
            T.T5Config,
            {"d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4},
        ),
    }
    cls, cfg_cls, kw = cfgs[key]
    if key not in ("gpt2", "gpt_neo", "t5"):
        kw = {**kw, "num_hidden_layers": 2, "max_position_embeddings": 64}
    cfg = cfg_cls(vocab_size=100, **kw)
    torch.manual_seed(0)
    return cls(cfg).eval(), cfg


def _run_schedule(key, **sch_config):
    from slapo.model_schedule import apply_schedule

    model, cfg = _tiny(key)
    ref = copy.deepcopy(model)
    sch = apply_schedule(model, key, model_config=cfg, attn_op_name="auto", delay_init=False, **sch_config)
    ids = torch.randint(0, 100, (2, 8))
    kw = {"decoder_input_ids": ids} if key == "t5" else {}
    with torch.no_grad():
        return sch, sch.mod(ids, **kw)[0], ref(ids, **kw)[0]


def test_t5_model_schedule_applies():
    sch, out, ref = _run_schedule("t5", ckpt_ratio=1.0)
    torch.testing.assert_close(out, ref)
    code = sch.record.code()
    assert 'sch["encoder.block.0"].checkpoint()' in code and 'sch["decoder.block.1"].checkpoint()' in code


@pytest.mark.parametrize("key", ["bert", "roberta", "albert", "gpt2", "gpt_neo", "opt"])
@pytest.mark.xfail(
    strict=True,
    raises=TypeError,
    reason="Slapo 0.0.3's schedule replaces attention with a module written for transformers 4.x calls "
    "(past_key_value / layer_past / no position_ids); transformers 5.x calls it differently",
)
def test_model_schedules_written_for_transformers_4(key):
    _run_schedule(key)


# --- slapo_lab.op --------------------------------------------------------------------------------------
def _ref_attention(q, k, v, mask, causal):
    """(B, S, H, D) reference: softmax(q k^T / sqrt(D) + mask [+ causal]) v."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores + mask
    if causal:
        s = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("attn_op_name", ["auto", "cuda", "triton", "cutlass", "native_xformers"])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_op_matches_reference(attn_op_name, causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 6, 4, 8) for _ in range(3))
    mask = torch.zeros(2, 1, 1, 6)
    mask[0, ..., -2:] = torch.finfo(torch.float32).min  # HF's padding mask: the last 2 keys of sample 0
    attn = op.FlashAttentionOp(attn_op_name, apply_causal_mask=causal).eval()
    for m in (None, mask):
        torch.testing.assert_close(attn(q, k, v, m, p=0.1), _ref_attention(q, k, v, m, causal))


def test_flash_attention_module_shapes_and_cache():
    torch.manual_seed(0)
    attn = op.FlashAttention(32, 4, output_proj=True, fused_qkv=True).eval()
    x = torch.randn(2, 5, 32)
    out, present = attn(x, use_cache=True)
    assert out.shape == (2, 5, 32) and present[0].shape == (2, 5, 4, 8)
    layers = attn.qkv(x).view(2, 5, 4, 24)
    q, k, v = layers.split(8, dim=-1)
    ref = attn.out_proj(_ref_attention(q, k, v, None, causal=True).reshape(2, 5, 32))
    torch.testing.assert_close(out, ref)
    nxt, _ = attn(torch.randn(2, 1, 32), layer_past=present, use_cache=True)  # one more token
    assert nxt.shape == (2, 1, 32)
    bert_like = op.FlashAttention(32, 4, output_proj=False).eval()  # BERT: not causal, no out_proj
    assert not hasattr(bert_like, "out_proj") and bert_like(x)[0].shape == (2, 5, 32)


def test_fused_mlp_matches_gpt2_mlp():
    cfg = T.GPT2Config(n_embd=16, n_layer=1, n_head=2, activation_function="gelu_new", resid_pdrop=0.0)
    ref = T.models.gpt2.modeling_gpt2.GPT2MLP(64, cfg).eval()
    mlp = op.FusedMLP(16, 64, "gelu_new", 0.0).eval()
    mlp.fc_in.weight = nn.Parameter(ref.c_fc.weight.detach().t().contiguous())
    mlp.fc_in.bias = ref.c_fc.bias
    mlp.fc_out.weight = nn.Parameter(ref.c_proj.weight.detach().t().contiguous())
    mlp.fc_out.bias = ref.c_proj.bias
    x = torch.randn(2, 3, 16)
    torch.testing.assert_close(mlp(x), ref(x))
    gelu = op.LinearWithAct(16, 8, act_fn="gelu")
    torch.testing.assert_close(gelu(x), F.gelu(F.linear(x, gelu.weight, gelu.bias)))


def test_linear_ops():
    torch.manual_seed(0)
    x = torch.randn(3, 8)
    sync = op.LinearWithSyncFunc(8, 4, sync_fn=lambda t: 2 * t)
    torch.testing.assert_close(sync(x), 2 * F.linear(x, sync.weight) + sync.bias)
    assert "sync_fn=<lambda>" in repr(sync)
    drop = op.LinearWithDropout(8, 4, p=0.5).eval()
    torch.testing.assert_close(drop(x), F.linear(x, drop.weight, drop.bias))
    assert op.LinearWithSeparateBias is sl.LinearWithSeparateBias  # one class, the decompose() one
    q, k, v = op.FusedQKV(16, 4, world_size=1)(torch.randn(2, 3, 16))
    assert q.shape == k.shape == v.shape == (2, 3, 4, 4)
    out = torch.Tensor([1.0])
    assert op.Print()(out, "value:", 1) is out


def test_parallel_cross_entropy_without_a_group_is_cross_entropy():
    torch.manual_seed(0)
    logits, target = torch.randn(4, 5, 11), torch.randint(0, 11, (4, 5))
    ce = op.ParallelCrossEntropy()
    flat = (logits.view(-1, 11), target.view(-1))
    torch.testing.assert_close(ce(logits, target).view(-1), F.cross_entropy(*flat, reduction="none"))
    smooth = op.vocab_parallel_cross_entropy(logits, target, label_smoothing=0.1).view(-1)
    eps = 0.1 * 11 / 10  # Megatron's (and Slapo's) smoothing: the other classes share eps / (V - 1)
    nll = F.cross_entropy(*flat, reduction="none")
    torch.testing.assert_close(smooth, (1 - eps) * nll - eps * flat[0].log_softmax(-1).mean(-1))


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: op.FlashAttention(30, 4), r"not a multiple of the number of attention heads"),
        (lambda: op.FlashAttentionOp("xformers", True), r"Unknown attn_op_name 'xformers'"),
        (lambda: op.LinearWithAct(4, 4, act_fn="relu"), r"act_fn 'gelu' or 'gelu_new', not 'relu'"),
        (lambda: op.LinearWithAct(4, 4, bias=False), r"needs a bias"),
        (lambda: op.LinearWithDropout(4, 4, p=2), r"must be in \[0, 1\]"),
        (lambda: op.FusedQKV(16, 4, world_size=3), r"not divisible by world_size 3"),
        (
            lambda: op.vocab_parallel_cross_entropy(torch.randn(2, 5), torch.zeros(3, dtype=torch.long)),
            r"target has shape \(3,\)",
        ),
        (lambda: op.FlashAttention(8, 2)(torch.randn(1, 2, 8), head_mask=torch.ones(2)), r"head mask"),
    ],
)
def test_op_errors_are_one_sentence(make, match):
    with pytest.raises(sl.ScheduleError, match=match):
        make()


# --- Slapo's module paths, tie weights, naming -------------------------------------------------------------
def test_slapo_module_paths():
    import slapo
    import slapo.pattern
    import slapo.utils.common
    from slapo.sharding import reduce_backward_grad, reduce_forward_output

    assert slapo is sl and slapo.pattern.call_module is sl.call_module
    x = torch.randn(3, requires_grad=True)
    assert torch.equal(reduce_forward_output(x, None), x)  # no process group: width 1, the identity
    reduce_backward_grad(x, None).sum().backward()
    assert torch.equal(x.grad, torch.ones(3))
    lin = nn.Linear(2, 2)
    lin.register_forward_pre_hook(lambda m, a: a)
    assert [len(v) for v in slapo.utils.common.get_hooks(lin).values()] == [1, 0, 0]
    with pytest.raises(sl.ScheduleError, match="Unknown hook type 'fwd'"):
        slapo.utils.common.has_hook(lin, "fwd")


def test_analyze_tie_weights_is_public():
    emb = nn.Embedding(4, 4)
    model = nn.Sequential(nn.Sequential(emb), nn.Sequential(nn.Linear(4, 4)))
    model[1][0].weight = emb.weight
    (group,) = sl.analyze_tie_weights(model, False).values()
    assert group == {("0.0.weight", 0), ("1.0.weight", 0)}
    (group,) = sl.analyze_tie_weights(model, True).values()
    assert group == [("0.weight", 0), ("0.weight", 1)]
    with pytest.raises(sl.ScheduleError, match="takes an nn.Module, not int"):
        sl.analyze_tie_weights(3, False)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return F.relu(self.fc(x)) + x


class _Add(nn.Module):
    def forward(self, a, b):
        return torch.relu(a) + b


class _Id(nn.Module):
    def forward(self, x):
        return x


def test_replace_names_modules_as_slapo_does():
    sch = sl.create_schedule(_Net())
    sch.replace(_Add(), sch.find(lambda a, b: F.relu(a) + b))
    assert "_Add_0" in sch.child
    sch = sl.create_schedule(_Net())
    sch.replace(_Add(), sch.find(lambda a, b: F.relu(a) + b), name="fused")
    assert "fused_0" in sch.child
    x = torch.randn(2, 4)
    torch.testing.assert_close(sch.mod(x), F.relu(sch.mod.fc(x)) + x)


def test_replace_function_drops_default_keywords():
    sch = sl.create_schedule(_Net())
    (relu,) = sch.find_node(lambda n: n.op == "call_function" and n.target is F.relu)
    assert relu[1].kwargs == {"inplace": False}

    def double(t):
        return 2 * t

    node = sch.replace(double, relu)
    assert node.target is double and node.kwargs == {}
    x = torch.randn(2, 4)
    torch.testing.assert_close(sch.mod(x), 2 * sch.mod.fc(x) + x)

    def needs_two(t, u):
        return t + u

    (found,) = sch.find_node(lambda n: n.op == "call_function" and n.target is double)
    with pytest.raises(sl.ScheduleError, match=r"needs_two\(t, u\) cannot take the arguments"):
        sch.replace(needs_two, found)


def test_replace_moves_hooks_or_refuses():
    calls = []
    sch = sl.create_schedule(_Net())
    sch.mod.fc.register_forward_pre_hook(lambda m, a: calls.append("pre"))
    new = sch.replace(_Id(), sch.find(lambda x: F.relu(sl.call_module("fc", x)) + x))
    assert len(new._forward_pre_hooks) == 1
    sch.mod(torch.randn(1, 4))
    assert calls == ["pre"]
    sch = sl.create_schedule(_Net())
    sch.mod.fc.register_forward_hook(lambda m, a, o: o)
    with pytest.raises(sl.ScheduleError, match="fc has a forward hook but is not the last op"):
        sch.replace(_Id(), sch.find(lambda x: F.relu(sl.call_module("fc", x)) + x))
