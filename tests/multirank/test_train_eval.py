"""Evaluation that does not depend on the layout (issue 24, item 4).

One tiny pretrained Llama and a validation file whose number of packed sequences is odd, so it is a multiple
of no layout's micro-batch (TP2 x DP2: micro-batches of 4; DP4: of 2; TP2 x PP2: 2 micro-batches of 4 per
pipeline batch). Each layout runs the exported script for 0 steps on 4 gloo ranks, which evaluates the
pretrained weights once; the losses must agree within 1e-6 and equal the mean token loss that plain
transformers computes over the same sequences in one process. Before this, each layout evaluated the
sequences that filled whole micro-batches only (12, 12 and 8 of 13), and the loss moved with the layout.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from tests.harness import launch_torchrun
from tests.train_fixtures import meta_model, write_corpus, write_pretrained, write_tokenizer

pytestmark = pytest.mark.multirank

SEQ = 32
LAYOUTS = {  # name -> (script, options)
    "TP2xDP2": ("tp", ["--dp", "2"]),
    "DP4": ("plain", ["--dp", "4"]),
    "TP2xPP2": ("tppp", []),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from transformers import AutoConfig, LlamaForCausalLM

    import slapo_lab as sl
    from slapo_lab.train.data import TokenData

    d = tmp_path_factory.mktemp("eval_layouts")
    corpus = write_corpus(d / "data", 60)
    model_dir = write_pretrained(d / "llama")
    write_tokenizer(model_dir, [corpus])
    for n_docs in range(12, 40):  # a validation file of an odd number of sequences
        eval_file = write_corpus(d / "eval", n_docs, seed=7, name="eval")
        data = TokenData.from_files(
            eval_file, model_dir, SEQ, objective="causal_lm", seed=0, cache_dir=d / "c"
        )
        if data.num_samples % 2 and data.num_samples > 8:
            break
    config = AutoConfig.from_pretrained(model_dir)
    with sl.init_empty_weights():
        model = LlamaForCausalLM(config)
    scripts = {}
    for name, tp, megatron, cut in (
        ("plain", 1, False, False),
        ("tp", 2, True, False),
        ("tppp", 2, True, True),
    ):
        sch = sl.create_schedule(meta_model("LlamaForCausalLM", config), world_size=tp)
        if megatron:
            sl.presets.megatron_tp(sch)
        if cut:
            sch["model.layers.0"].cut_pipeline_stage()
        scripts[name] = sl.export_script(
            d / f"train_{name}.py",
            model,
            sch.record.calls,
            {"input_ids": torch.zeros(8, SEQ, dtype=torch.long)},
            world_size=tp,
        )
    return {
        "dir": d,
        "data": corpus,
        "eval": eval_file,
        "model": model_dir,
        "scripts": scripts,
        "eval_set": data,
    }


def _eval_loss(log_dir: Path) -> float:
    with open(log_dir / "metrics.csv", newline="") as f:
        (row,) = [r for r in csv.DictReader(f) if r["eval_loss"]]
    return float(row["eval_loss"])


def test_eval_loss_is_the_same_at_every_layout_and_equals_plain_transformers(files):
    from transformers import LlamaForCausalLM

    data = files["eval_set"]
    n = data.num_samples
    assert n % 2 == 1  # a multiple of no layout's micro-batch
    losses = {}
    for name, (script, extra) in LAYOUTS.items():
        log_dir = files["dir"] / f"log_{name}"
        args = ["--device", "cpu", "--model-path", files["model"], "--data", files["data"], "--seq-len", SEQ]
        args += ["--global-batch-size", "8", "--steps", "0", "--no-verify", "--eval-data", files["eval"]]
        rc, out = launch_torchrun(
            files["scripts"][script], 4, [*args, "--log-dir", log_dir, *extra], timeout=300
        )
        assert rc == 0, out[-4000:]
        assert f"({n} sequences)" in out, out[-3000:]
        losses[name] = _eval_loss(log_dir)
    model = LlamaForCausalLM.from_pretrained(files["model"]).eval()
    with torch.no_grad():  # the mean over every predicted token of the n sequences, in one forward
        reference = float(model(**data.batch(list(range(n)), 0)).loss)
    print(f"eval loss over {n} sequences: {losses}, plain transformers {reference!r}")
    for name, loss in losses.items():
        assert abs(loss - losses["TP2xDP2"]) <= 1e-6, (name, losses)
        assert abs(loss - reference) <= 1e-6, (name, loss, reference)
