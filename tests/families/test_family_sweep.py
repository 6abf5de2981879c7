"""The sweep over transformers' own families (issue 23; ``tests/family_sweep.py`` is the harness).

Every family of transformers' seq2seq, masked-LM, causal-LM and image-classification auto mappings is built
tiny from its config class, gets the Megatron preset at TP 2 as the editor applies it, and the numeric check;
the test prints the table (family | ✓ full | ✓ partial: what and why | refused: why | ✗ | crash) with the
counts, writes it to ``artifacts/family_sweep.md``.

What must hold today: every family is classified within its timeout, the harness itself never fails, and the
families the suite already proves end to end (the README's list) are ✓ full. The issue's goal (✓ full on at
least 90 % of the families that build, 0 ✗, 0 crashes) is :func:`test_goal`, which asserts only with
``SLAPO_SWEEP_STRICT=1`` (set it, or make ``STRICT`` true, once the engine work of issue 23 lands) and is
skipped with the current counts otherwise.

Also here: the tiny configs keep the structure the preset reads (grouped key/value heads, DeepSeek's rope head
dim, a sliding / full layer pattern), the projection rule counts what it should (routers and a shared expert's
gate out, expert banks in), and a family that hangs or kills its worker is classified without stopping the
sweep.
"""

from __future__ import annotations

import os
import time
import warnings

import family_sweep as fs
import pytest

STRICT = os.environ.get("SLAPO_SWEEP_STRICT") == "1"
#: Families whose Megatron schedule other tests prove end to end (README); the sweep must find them ✓ full.
PROVEN = (
    "bert",
    "roberta",
    "albert",
    "gpt2",
    "opt",
    "gpt_neo",
    "t5",
    "vit",
    "llama",
    "mistral",
    "qwen3",
    "mixtral",
)


@pytest.fixture(scope="module")
def sweep():
    """The whole sweep (2 workers), its table printed and written: ``(results, seconds)``."""
    t0 = time.perf_counter()
    results = fs.run_sweep(workers=2)
    seconds = time.perf_counter() - t0
    text = fs.table(results) + fs.causes(results) + f"\nSweep wall time: {seconds:.0f} s on 2 workers.\n"
    print(text)
    fs.write_table(text)
    return results, seconds


def test_every_family_is_classified_within_its_timeout(sweep):
    results, seconds = sweep
    assert [r.family for r in results] == list(fs.families())
    assert len(results) > 250, len(results)  # transformers 5.x: about 295 families in the four mappings
    for r in results:
        assert r.status in fs.STATUSES, r
        assert r.status == "full" or r.detail.strip(), r
        assert "no result within" not in r.detail and "did not start" not in r.detail, r
    built = [r for r in results if r.status != "no_build"]
    assert len(built) >= 0.75 * len(results), fs.counts(results)  # the shrinker builds most families tiny
    print(fs.goal(results), f"({seconds:.0f} s)")


def test_families_proven_elsewhere_are_full(sweep):
    results, _ = sweep
    by = {r.family: r for r in results}
    wrong = {f: (by[f].status, by[f].detail) for f in PROVEN if by[f].status != "full"}
    assert not wrong, wrong


def test_partial_and_refused_say_what_and_why(sweep):
    results, _ = sweep
    for r in results:
        # split, but some sharded modules were not reached by the sweep's inputs (a tower given text only)
        if r.status == "partial" and r.detail.startswith("not judged: "):
            assert "never ran on the example inputs" in r.detail and "did not judge" in r.detail, r
        elif r.status == "partial":
            assert r.detail.startswith("kept whole: ") and ".*." in r.detail, r
        if r.status == "refused":
            assert r.detail.endswith(".") and "\n" not in r.detail, r


def test_goal(sweep):
    """Issue 23's goal: ✓ full on >= 90 % of the families that build, 0 ✗, 0 crashes (strict only)."""
    results, _ = sweep
    line = fs.goal(results)
    if not STRICT:
        pytest.skip(f"{line} Set SLAPO_SWEEP_STRICT=1 to assert it.")
    c = fs.counts(results)
    assert c["failed"] == 0 and c["crash"] == 0, line
    assert c["full"] >= 0.9 * (len(results) - c["no_build"]), line


def test_a_hang_and_a_dead_worker_are_classified_and_the_sweep_goes_on():
    results = fs.run_sweep([fs.HANG, fs.DIE, "gpt2"], workers=2, timeout=30)
    by = {r.family: r for r in results}
    assert by[fs.HANG].status == "crash" and "no result within 30 s" in by[fs.HANG].detail, by
    assert by[fs.DIE].status == "crash" and "the worker died (exit code 3)" in by[fs.DIE].detail, by
    assert by["gpt2"].status == "full", by


def _tiny(model_type):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fs.tiny_config(model_type)


def test_tiny_configs_keep_the_structure():
    mistral = _tiny("mistral")  # 32 heads / 8 key-value heads: grouped stays grouped
    assert (mistral.num_hidden_layers, mistral.hidden_size, mistral.vocab_size) == (2, 64, 256)
    assert (mistral.num_attention_heads, mistral.num_key_value_heads) == (4, 2)
    llama = _tiny("llama")  # 32 / 32: plain multi-head stays plain
    assert (llama.num_attention_heads, llama.num_key_value_heads) == (4, 4)
    ds = _tiny("deepseek_v3")  # its head_dim is the rope part of q/k (equal values stay equal)
    assert ds.head_dim == ds.qk_rope_head_dim == 8 and ds.qk_nope_head_dim == ds.v_head_dim == 16
    assert ds.n_routed_experts == 4 and ds.num_experts_per_tok == 2
    gemma = _tiny("gemma3_text")  # 5 sliding : 1 full; both kinds stay
    assert set(gemma.layer_types) == {"sliding_attention", "full_attention"} and len(gemma.layer_types) == 2
    t5 = _tiny("t5")
    assert all(getattr(t5, k) < t5.vocab_size for k in ("pad_token_id", "eos_token_id"))


def _projections(model_type: str, cls: str) -> list[str]:
    import transformers

    import slapo_lab as sl

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = getattr(transformers, cls)(_tiny(model_type))
    sch = sl.create_schedule(model, world_size=2)
    found = fs.projections(sch)
    first = next(iter(found))
    return [p[len(first) + 1 :] for p in found[first]]


def test_projection_rule_counts_linears_and_expert_banks_but_not_routers():
    assert _projections("bert", "BertForMaskedLM") == [
        "attention.self.query",
        "attention.self.key",
        "attention.self.value",
        "attention.output.dense",
        "intermediate.dense",
        "output.dense",
    ]
    mixtral = _projections("mixtral", "MixtralForCausalLM")  # 3-D expert bank in, router (4 logits) out
    assert "mlp.experts" in mixtral and not any("gate" in p and "proj" not in p for p in mixtral), mixtral
    qwen = _projections("qwen2_moe", "Qwen2MoeForCausalLM")  # the shared expert's 1-wide gate is out too
    assert "mlp.shared_expert.down_proj" in qwen and "mlp.shared_expert_gate" not in qwen, qwen
    assert "mlp.gate" not in qwen, qwen
    switch = _projections("switch_transformers", "SwitchTransformersForConditionalGeneration")
    assert not any("router" in p for p in switch), switch  # experts in a ModuleDict
