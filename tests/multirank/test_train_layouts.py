"""The proof of "Train for real": an exported script fine-tunes a pretrained model on real data, the same way
at every layout, resumes, and writes a Hugging Face model out.

One tiny Llama written with ``save_pretrained`` (its tokenizer, trained on the corpus with ``tokenizers``,
saved beside the weights), a 400-document jsonl corpus and a 60-document validation file. Four scripts
exported from the editor's engine: no schedule, the Megatron TP preset (TP 2), the preset plus one pipeline
cut (TP 2 x PP 2), and the cut alone (PP 2). Each run: 6 AdamW steps of a global batch of 8 sequences of
32 tokens, warm-up then cosine, clipping at 1.0, Verify on; metrics.csv holds every step's loss and grad norm.
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.harness import REPO_ROOT, child_env, kill_tree, launch_torchrun, torchrun_argv
from tests.train_fixtures import meta_model, write_corpus, write_pretrained, write_tokenizer

pytestmark = pytest.mark.multirank

STEPS = 6
RTOL = 1e-5
COMMON = [
    "--device",
    "cpu",
    "--data",
    "DATA",
    "--seq-len",
    "32",
    "--global-batch-size",
    "8",
    "--micro-batch-size",
    "2",
    "--steps",
    str(STEPS),
    "--lr",
    "1e-3",
    "--warmup-steps",
    "2",
    "--lr-schedule",
    "cosine",
    "--max-grad-norm",
    "1.0",
    "--eval-data",
    "EVAL",
    "--eval-samples",
    "96",
]

# layout name -> (script, processes, extra options)
LAYOUTS = {
    "TP2": ("tp", 2, []),
    "TP2xDP2": ("tp", 4, []),
    "TP2xPP2": ("tppp", 4, []),
    "TP2xDP2-FSDP": ("tp", 4, ["--fsdp"]),
    "DP2xPP2": ("pp", 4, []),
    # every decoder layer compiled with fullgraph=True: a graph break in the schedule's wrappers would raise
    "TP2-compile": ("tp", 2, ["--compile", "--compile-backend", "aot_eager"]),
    # the deepspeed launcher's scripts (launched by torchrun here): ZeRO and its clipping see the shards
    "DeepSpeed-TP2xDP2-ZeRO1": ("ds_tp", 4, ["--zero", "1"]),
    "DeepSpeed-TP2xDP2-ZeRO2": ("ds_tp", 4, ["--zero", "2"]),
    "DeepSpeed-DP2xPP2-ZeRO1": ("ds_pp", 4, ["--zero", "1"]),
}


@pytest.fixture(scope="module")
def ft(tmp_path_factory):
    """The user's files and the four exported scripts."""
    from transformers import AutoConfig, LlamaForCausalLM

    import slapo_lab as sl

    d = tmp_path_factory.mktemp("finetune")
    corpus = write_corpus(d / "data", 400)
    eval_corpus = write_corpus(d / "eval", 60, seed=1, name="eval")
    model_dir = write_pretrained(d / "llama")
    write_tokenizer(model_dir, [corpus])  # the tokenizer lives beside the weights: --tokenizer defaults to it
    config = AutoConfig.from_pretrained(model_dir)
    with sl.init_empty_weights():
        model = LlamaForCausalLM(config)
    ids = torch.zeros(8, 32, dtype=torch.long)
    scripts = {}
    for name, tp, megatron, cut in (
        ("plain", 1, False, False),
        ("tp", 2, True, False),
        ("tppp", 2, True, True),
        ("pp", 1, False, True),
        ("ds_tp", 2, True, False),
        ("ds_pp", 1, False, True),
    ):
        sch = sl.create_schedule(meta_model("LlamaForCausalLM", config), world_size=tp)
        if megatron:
            sl.presets.megatron_tp(sch)
        if cut:
            sch["model.layers.0"].cut_pipeline_stage()
        launcher = "deepspeed" if name.startswith("ds_") else "torchrun"
        scripts[name] = sl.export_script(
            d / f"train_{name}.py",
            model,
            sch.record.calls,
            {"input_ids": ids},
            world_size=tp,
            launcher=launcher,
            defaults={"model_path": str(model_dir)},
        )
    return {
        "dir": d,
        "data": str(corpus),
        "eval": str(eval_corpus),
        "model": model_dir,
        "scripts": scripts,
        "runs": {},
    }


def _args(ft, extra, log_dir):
    out = [str(a).replace("DATA", ft["data"]).replace("EVAL", ft["eval"]) for a in COMMON]
    return out + ["--log-dir", str(log_dir), *extra]


def _rows(log_dir) -> dict[int, dict]:
    """metrics.csv as {step: row} (training rows) plus {-step: row} for evaluation rows."""
    rows = {}
    with open(Path(log_dir) / "metrics.csv", newline="") as f:
        for r in csv.DictReader(f):
            step = int(r["step"])
            rows[-step if r["eval_loss"] else step] = r
    return rows


def run_layout(ft, name: str, script: str, nproc: int, extra: list[str]) -> tuple[str, dict]:
    log_dir = ft["dir"] / f"log_{name}"
    args = _args(ft, extra, log_dir)
    if nproc == 1:  # one process, no launcher
        proc = subprocess.run(
            [sys.executable, str(ft["scripts"][script]), *args],
            cwd=REPO_ROOT,
            env=child_env(),
            capture_output=True,
            text=True,
            check=False,
            timeout=600,
        )
        rc, out = proc.returncode, proc.stdout + proc.stderr
    else:
        rc, out = launch_torchrun(ft["scripts"][script], nproc, args, timeout=600)
    assert rc == 0, out[-4000:]
    assert "Verify: PASSED" in out, out[-4000:]
    return out, _rows(log_dir)


@pytest.fixture(scope="module")
def baseline(ft):
    """One process, no schedule: the unscheduled model's curve."""
    _, rows = run_layout(ft, "1p", "plain", 1, ["--save-hf", str(ft["dir"] / "hf_1p")])
    assert [rows[s]["step"] for s in range(1, STEPS + 1)] == [str(s) for s in range(1, STEPS + 1)]
    return rows


def _close(a: str, b: str) -> bool:
    return abs(float(a) - float(b)) <= RTOL * abs(float(b))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_same_curve_in_every_layout(ft, baseline, layout):
    script, nproc, extra = LAYOUTS[layout]
    _, rows = run_layout(ft, layout, script, nproc, extra)
    ft["runs"][layout] = rows
    for s in range(1, STEPS + 1):
        for col in ("loss", "grad_norm", "lr"):
            assert _close(rows[s][col], baseline[s][col]), (layout, s, col, rows[s][col], baseline[s][col])
    assert float(baseline[1]["grad_norm"]) > 1.0  # clipping was active: the norms must agree for it to agree
    assert _close(rows[-STEPS]["eval_loss"], baseline[-STEPS]["eval_loss"])


@pytest.mark.parametrize("layout", ["TP2xPP2", "TP2xDP2-FSDP", "DeepSpeed-TP2xDP2-ZeRO1"])
def test_bf16_keeps_fp32_master_weights(ft, baseline, layout):
    """--bf16: bf16 compute (autocast; DeepSpeed's bf16 mode), fp32 masters: Verify (in fp32) passes, the
    curve stays within bf16 rounding of the fp32 one, and the weights written out are float32."""
    from safetensors import safe_open

    script, nproc, extra = LAYOUTS[layout]
    out_dir = ft["dir"] / f"hf_bf16_{layout}"
    _, rows = run_layout(ft, f"bf16_{layout}", script, nproc, [*extra, "--bf16", "--save-hf", str(out_dir)])
    for s in range(1, STEPS + 1):
        assert abs(float(rows[s]["loss"]) - float(baseline[s]["loss"])) < 2e-2 * float(baseline[s]["loss"])
    assert any(rows[s]["loss"] != baseline[s]["loss"] for s in range(1, STEPS + 1))  # it really ran in bf16
    for f in out_dir.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            assert {h.get_slice(k).get_dtype() for k in h.keys()} == {"F32"}  # noqa: SIM118 - not a dict


def _kill_after_checkpoint(script, nproc, args, step: int) -> str:
    """Launch, read the output line by line, SIGKILL the whole process group right after it reports the
    checkpoint of ``step``; returns the output so far."""
    proc = subprocess.Popen(
        torchrun_argv(script, nproc, args),
        cwd=REPO_ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        bufsize=1,
    )
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if f"checkpoint step {step} saved" in line:
                kill_tree(proc.pid)
                break
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
        proc.wait(timeout=60)
    return "".join(lines)


def test_resume_after_a_kill_and_at_other_layouts(ft, baseline):
    import shutil

    ckpt = ft["dir"] / "ckpt"
    args = _args(ft, ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"], ft["dir"] / "log_killed")
    out = _kill_after_checkpoint(ft["scripts"]["tp"], 4, args, 4)
    assert "checkpoint step 4 saved" in out, out[-4000:]
    assert "step 6/6" not in out and not (ckpt / "step-00000006").exists(), "the run finished before the kill"
    (ckpt / "step-00000005.partial").mkdir()  # an interrupted save left behind: never taken for a checkpoint
    for layout, script, nproc in (("TP2xDP2", "tp", 4), ("TP2xPP2", "tppp", 4), ("DP4", "plain", 4)):
        here = ft["dir"] / f"ckpt_{layout}"
        shutil.copytree(ckpt, here)
        log_dir = ft["dir"] / f"log_resumed_{layout}"
        rc, out = launch_torchrun(
            ft["scripts"][script],
            nproc,
            _args(ft, ["--checkpoint-dir", str(here), "--checkpoint-every", "2"], log_dir),
            timeout=600,
        )
        assert rc == 0, out[-4000:]
        assert f"resumed from {here / 'step-00000004'} at step 4" in out, out[-4000:]
        rows = _rows(log_dir)
        assert sorted(s for s in rows if s > 0) == [5, 6]  # steps 1-4 are not trained again
        for s in (5, 6):
            for col in ("loss", "grad_norm", "lr"):
                assert _close(rows[s][col], baseline[s][col]), (
                    layout,
                    s,
                    col,
                    rows[s][col],
                    baseline[s][col],
                )
    # the last checkpoint, saved at DP4, as a Hugging Face directory: the one-process run's trained model
    from safetensors.torch import load_file

    out_dir = ft["dir"] / "converted"
    conv = subprocess.run(
        [sys.executable, "-m", "slapo_lab.cli", "convert", str(here), "--to-hf", str(out_dir)],
        cwd=REPO_ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert conv.returncode == 0, conv.stdout + conv.stderr
    got = load_file(out_dir / "model.safetensors")
    want = load_file(next((ft["dir"] / "hf_1p").glob("*.safetensors")))
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.allclose(got[k], want[k], rtol=1e-4, atol=1e-6), k


def test_deepspeed_resumes_from_its_own_checkpoint(ft, baseline):
    ckpt = ft["dir"] / "ds_ckpt"
    args = _args(
        ft,
        ["--zero", "1", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"],
        ft["dir"] / "log_ds_killed",
    )
    out = _kill_after_checkpoint(ft["scripts"]["ds_tp"], 4, args, 4)
    assert "checkpoint step 4 saved" in out, out[-4000:]
    assert (ckpt / "latest").read_text().strip() == "step-00000004", "the run finished before the kill"
    log_dir = ft["dir"] / "log_ds_resumed"
    rc, out = launch_torchrun(
        ft["scripts"]["ds_tp"],
        4,
        _args(ft, ["--zero", "1", "--checkpoint-dir", str(ckpt)], log_dir),
        timeout=600,
    )
    assert rc == 0, out[-4000:]
    assert "resumed from" in out and "at step 4" in out, out[-4000:]
    rows = _rows(log_dir)
    for s in (5, 6):
        for col in ("loss", "grad_norm", "lr"):
            assert _close(rows[s][col], baseline[s][col]), (s, col, rows[s][col], baseline[s][col])


def test_pretrained_weights_round_trip_bitwise(ft):
    from safetensors.torch import load_file

    out_dir = ft["dir"] / "roundtrip"
    rc, out = launch_torchrun(
        ft["scripts"]["tp"], 2, ["--device", "cpu", "--steps", "0", "--save-hf", str(out_dir)], timeout=600
    )
    assert rc == 0, out[-4000:]

    def tensors(folder):
        t = {}
        for f in sorted(Path(folder).glob("*.safetensors")):
            t.update(load_file(f))
        return t

    src, got = tensors(ft["model"]), tensors(out_dir)
    assert sorted(got) == sorted(src)
    for k in src:
        assert got[k].dtype == src[k].dtype and torch.equal(got[k], src[k]), k
    assert (out_dir / "tokenizer.json").is_file() and (out_dir / "config.json").is_file()


def test_model_out_loads_with_from_pretrained_and_gives_the_reported_loss(ft, baseline):
    """The 1-process run wrote hf_1p after training; its validation loss (reported in metrics.csv) is what
    the model loaded back with from_pretrained gives on the same sequences."""
    from transformers import AutoModelForCausalLM

    from slapo_lab.train.data import TokenData, eval_micro_batches

    model = AutoModelForCausalLM.from_pretrained(ft["dir"] / "hf_1p").eval()
    data = TokenData.from_files(ft["eval"], ft["dir"] / "hf_1p", 32, objective="causal_lm", seed=1234)
    total = rows = 0
    with torch.no_grad():
        for mb in eval_micro_batches(data, 2, 1, 0, max_samples=96):
            n = mb["input_ids"].shape[0]
            total += float(model(**mb).loss) * n
            rows += n
    assert _close(str(total / rows), baseline[-STEPS]["eval_loss"]), (
        total / rows,
        baseline[-STEPS]["eval_loss"],
    )
    # and the weights really moved away from the pretrained ones
    first = AutoModelForCausalLM.from_pretrained(ft["model"])
    assert not torch.equal(first.lm_head.weight, model.lm_head.weight)


def test_fsdp_evaluation_with_uneven_replicas_then_a_checkpoint(ft):
    """Six validation sequences in micro-batches of 2 over 2 replicas: replica 0 evaluates two, replica 1 one;
    under FSDP2 every forward all-gathers over the replicas, so replica 1 must run a third (uncounted) one, and
    the checkpoint saved right after must still map the optimizer's parameters (FSDP2 resharded)."""
    ckpt = ft["dir"] / "ckpt_uneven"
    log_dir = ft["dir"] / "log_uneven"
    args = _args(ft, ["--fsdp", "--eval-samples", "6", "--checkpoint-dir", str(ckpt)], log_dir)
    args[args.index("--steps") + 1] = "1"
    rc, out = launch_torchrun(ft["scripts"]["tp"], 4, args, timeout=300)
    assert rc == 0, out[-4000:]
    assert "(6 sequences)" in out and (ckpt / "step-00000001" / ".metadata").is_file(), out[-3000:]


def test_resuming_with_more_steps_stretches_the_schedule(ft):
    """A run that saved at step 4 of 6 and is relaunched with --steps 8: the schedule runs over 8 steps (the
    saved one would end at 6 and train at lr 0)."""
    import shutil

    here = ft["dir"] / "ckpt_more"
    shutil.copytree(ft["dir"] / "ckpt_DP4", here)
    for late in here.glob("step-0000000[56]"):
        shutil.rmtree(late)
    log_dir = ft["dir"] / "log_more"
    args = _args(ft, ["--checkpoint-dir", str(here), "--no-verify"], log_dir)
    args[args.index("--steps") + 1] = "8"
    rc, out = launch_torchrun(ft["scripts"]["plain"], 2, args, timeout=300)
    assert rc == 0, out[-4000:]
    assert "at step 4" in out and "now runs over --steps 8" in out, out[-3000:]
    rows = _rows(log_dir)
    assert sorted(s for s in rows if s > 0) == [5, 6, 7, 8]
    assert all(float(rows[s]["lr"]) > 0 for s in (5, 6, 7, 8))
