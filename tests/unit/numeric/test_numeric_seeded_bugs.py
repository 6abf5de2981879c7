"""Seeded bugs: the numeric check finds every single-bug schedule, names its culprit, and passes right ones.

Each bug is made from a right schedule (the Megatron preset, recorded on a tiny model of a real Hugging Face
family built from its config class) by removing or altering one recorded call, so the module at fault is
known: a row-parallel layer without its ``fwd_post`` all-reduce, a column-parallel layer without its
``bwd_post`` all-reduce, a weight sharded on the wrong axis, heads split in q but not in k, a column-parallel
bias left whole, an LM head without its gather, a vocab-parallel embedding without its reduce, a sharded MoE
router, a wrong sync op, an extra reduce around an attention. The right schedules are the presets themselves,
with checkpoints (encoder-decoder blocks included) and pipeline cuts, on configs that keep their dropout.

The test prints the figures (bugs detected, located at the culprit or its direct parent or child, false
alarms) and asserts issue 23's thresholds: every bug detected, at least 95 % located, no false alarm.
"""

from __future__ import annotations

import dataclasses
import random
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from zoo.families import FAMILIES, MORE, Family

import slapo_lab as sl
from slapo_lab import presets
from slapo_lab.numeric import numeric_check
from slapo_lab.record import Call
from slapo_lab.utils import meta_copy

WS = 2
FAMS = {
    f.name: f
    for f in (
        *(FAMILIES[n] for n in ("bert", "gpt2", "llama", "t5", "mixtral", "opt", "vit")),
        *MORE.values(),
    )
}


@dataclasses.dataclass
class Case:
    family: str
    label: str
    calls: list[Call]
    culprit: str | None  # None: a right schedule
    from_config: bool = False


def _right(fam: Family):
    model = fam.build()
    sch = sl.create_schedule(meta_copy(model), world_size=WS)
    presets.megatron_tp(sch, vocab_parallel=presets.has_vocab_embedding(sch))
    return model, sch


def _by_path(calls):
    out: dict[str, list[int]] = {}
    for i, c in enumerate(calls):
        out.setdefault(c.path, []).append(i)
    return out


def _is(c: Call, prim, **kw):
    return c.primitive == prim and all(c.kwargs.get(k) == v for k, v in kw.items())


def _without(calls, idx):
    drop = set(idx)
    return [c for i, c in enumerate(calls) if i not in drop]


def _replaced(calls, i, new: Call):
    return [new if j == i else c for j, c in enumerate(calls)]


def _reduced_elsewhere(path: str, calls: list[Call], mods: dict) -> bool:
    """Whether another path of the same module (T5's ``shared`` is also ``encoder.embed_tokens``) reduces its
    output: dropping the reduce on ``path`` alone is then no bug."""
    weight = getattr(mods.get(path), "weight", None)
    return any(
        c.path != path
        and (mods.get(c.path) is mods.get(path) or getattr(mods.get(c.path), "weight", None) is weight)
        and _is(c, "sync", mode="fwd_post", sync_op_or_fn="all_reduce")
        for c in calls
    )


def bugs(fam: Family, calls: list[Call], model) -> list[Case]:
    """The single-bug schedules of ``calls`` (the Megatron preset of ``fam``), each with its culprit."""
    mods = dict(model.named_modules(remove_duplicate=False))
    out: list[Case] = []
    by = _by_path(calls)

    def add(label, new, culprit):
        out.append(Case(fam.name, label, new, culprit))

    for path, idx in by.items():
        mod = mods.get(path)
        shards = [i for i in idx if calls[i].primitive == "shard"]
        w = next((i for i in shards if calls[i].args[0] == "weight"), None)
        bias = next((i for i in shards if calls[i].args[0] == "bias"), None)
        fwd_ar = next(
            (i for i in idx if _is(calls[i], "sync", mode="fwd_post", sync_op_or_fn="all_reduce")), None
        )
        bwd_ar = next(
            (i for i in idx if _is(calls[i], "sync", mode="bwd_post", sync_op_or_fn="all_reduce")), None
        )
        gather = next(
            (i for i in idx if _is(calls[i], "sync", mode="fwd_post", sync_op_or_fn="all_gather")), None
        )
        in_block = ".0." in path or ".1." in path
        if fwd_ar is not None and w is not None and not _reduced_elsewhere(path, calls, mods):
            kind = (
                "vocab-parallel embedding without its reduce"
                if isinstance(mod, torch.nn.Embedding)
                else "row-parallel layer without its fwd_post all_reduce"
            )
            add(kind, _without(calls, [fwd_ar]), path)
            if not isinstance(mod, torch.nn.Embedding):
                add(
                    "row-parallel output reduce-scattered instead of all-reduced",
                    _replaced(
                        calls,
                        fwd_ar,
                        Call(
                            path,
                            "sync",
                            (),
                            {"mode": "fwd_post", "sync_op_or_fn": "reduce_scatter", "axis": 1},
                        ),
                    ),
                    path,
                )
                wc = calls[w]
                other = 1 - wc.kwargs["axis"] if wc.kwargs.get("axis") in (0, 1) else None
                if other is not None:
                    add(
                        "row-parallel weight sharded on the wrong axis",
                        _replaced(calls, w, Call(path, "shard", ("weight",), {"axis": other})),
                        path,
                    )
        if bwd_ar is not None and w is not None and in_block:
            add("column-parallel layer without its bwd_post all_reduce", _without(calls, [bwd_ar]), path)
            add(
                "bwd_post all_gather instead of all_reduce",
                _replaced(
                    calls, bwd_ar, Call(path, "sync", (), {"mode": "bwd_post", "sync_op_or_fn": "all_gather"})
                ),
                path,
            )
            wc = calls[w]
            other = 1 - wc.kwargs["axis"] if wc.kwargs.get("axis") in (0, 1) else None
            if other is not None and isinstance(mod, torch.nn.Linear):
                add(
                    "column-parallel weight sharded on the wrong axis",
                    _replaced(calls, w, Call(path, "shard", ("weight",), {"axis": other})),
                    path,
                )
        if bias is not None and in_block:
            add("column-parallel bias left whole", _without(calls, [bias]), path)
        if gather is not None:
            add("LM head without its gather", _without(calls, [gather]), path)
    # heads split in q but not in k: k's shard calls and its sync dropped
    for path in by:
        name = path.rsplit(".", 1)[-1]
        if name in ("k_proj", "key", "k") and ".0." in path:
            add("heads split in q but not in k", _without(calls, by[path]), path)
    # an extra all_reduce around an attention whose output projection already reduces
    for path in by:
        name = path.rsplit(".", 1)[-1]
        if (
            name in ("o_proj", "out_proj", "o")
            and ".0." in path
            and any(_is(calls[i], "sync", mode="fwd_post") for i in by[path])
        ):
            attn = path.rsplit(".", 1)[0]
            add(
                "a second all_reduce around the attention",
                [*calls, Call(attn, "sync", (), {"mode": "fwd_post", "sync_op_or_fn": "all_reduce"})],
                attn,
            )
    # a sharded MoE router
    for path, mod in mods.items():
        if (
            path.endswith("mlp.gate")
            and isinstance(mod, torch.nn.Module)
            and hasattr(mod, "weight")
            and ".0." in path
        ):
            add(
                "sharded MoE router",
                [
                    *calls,
                    Call(path, "shard", ("weight",), {"axis": 0}),
                    Call(path, "sync", (), {"mode": "bwd_post", "sync_op_or_fn": "all_reduce"}),
                ],
                path,
            )
    return out


def rights(fam: Family, sch, model) -> list[Case]:
    calls = list(sch.record.calls)
    blocks = presets.find_blocks(sch)
    ck = lambda bs: [Call(b, "checkpoint", (), {}) for b in bs]
    out = [
        Case(fam.name, "Megatron preset", calls, None),
        Case(fam.name, "Megatron preset, every block checkpointed", [*calls, *ck(blocks)], None),
        Case(fam.name, "Megatron preset, last block checkpointed", [*calls, *ck(blocks[-1:])], None),
        Case(fam.name, "checkpoints alone", ck(blocks), None),
        Case(
            fam.name,
            "Megatron preset, 2 pipeline stages",
            [*calls, Call(blocks[0], "cut_pipeline_stage", (), {})],
            None,
        ),
    ]
    if (
        fam.inputs == "seq2seq"
    ):  # equal depths: the encoder keeps 1 block, the decoder 2 (rebuilt from the config)
        out.append(
            Case(
                fam.name,
                "last decoder block checkpointed, rebuilt from its config",
                ck(blocks[-1:]),
                None,
                True,
            )
        )
    return out


class _SkipBlock(nn.Module):
    """A pre-norm block with q/k/v/o projections and an MLP that, in training, skips itself with probability
    ``skip`` drawn from Python's ``random`` (LayerDrop, Fan et al., 2019, written as many research codebases
    write it)."""

    def __init__(self, width: int = 32, heads: int = 4, skip: float = 0.2) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.q_proj, self.k_proj = nn.Linear(width, width), nn.Linear(width, width)
        self.v_proj, self.o_proj = nn.Linear(width, width), nn.Linear(width, width)
        self.up_proj, self.down_proj = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.head_dim, self.skip = width // heads, skip

    def forward(self, x):
        if self.training and random.random() < self.skip:
            return x
        B, T, _ = x.shape
        h = self.norm(x)
        q, k, v = (
            p(h).view(B, T, -1, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        x = x + self.o_proj(y)
        return x + self.down_proj(F.gelu(self.up_proj(x)))


class LayerDropLM(nn.Module):
    def __init__(self, vocab: int = 128, width: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList([_SkipBlock(width) for _ in range(layers)])
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _layerdrop_cases() -> tuple[nn.Module, dict, list[Case]]:
    torch.manual_seed(0)
    model = LayerDropLM()
    sch = sl.create_schedule(meta_copy(model), world_size=WS)
    for i in range(2):  # the heads' widths come from the input (view(..., -1)): Megatron by hand
        p = f"blocks.{i}"
        for col in ("q_proj", "k_proj", "v_proj", "up_proj"):
            sch[f"{p}.{col}"].shard("weight", axis=0)
            sch[f"{p}.{col}"].shard("bias", axis=0)
            sch[f"{p}.{col}"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        for row in ("o_proj", "down_proj"):
            sch[f"{p}.{row}"].shard("weight", axis=1)
            sch[f"{p}.{row}"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    calls = list(sch.record.calls)
    inputs = {"input_ids": torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))}
    cases = [Case("layerdrop", "Megatron by hand", calls, None)]
    for b in ("blocks.0", "blocks.1"):
        cases.append(
            Case(
                "layerdrop",
                "checkpoint on a block that skips itself by Python's random",
                [*calls, Call(b, "checkpoint", (), {})],
                b,
            )
        )
    return model, inputs, cases


def _located(module: str, culprit: str) -> bool:
    """The reported module is the culprit, its direct parent or one of its direct children."""
    if module == culprit:
        return True
    parent = culprit.rsplit(".", 1)[0] if "." in culprit else ""
    return module == parent or (module.startswith(culprit + ".") and "." not in module[len(culprit) + 1 :])


def _select(cases: list[Case], per_kind: int) -> list[Case]:
    """At most ``per_kind`` bugs of each kind (the first ones: block 0's, then the embedding's or block 1's), and
    every right schedule."""
    seen: dict[str, int] = {}
    out = []
    for c in cases:
        if c.culprit is not None:
            seen[c.label] = seen.get(c.label, 0) + 1
            if seen[c.label] > per_kind:
                continue
        out.append(c)
    return out


def run_all(per_kind: int = 1, pipelines=("t5", "bart"), verbose: bool = False):
    """Every selected case: ``[(case, NumericReport)]``."""
    results = []
    todo = []
    for fam in FAMS.values():
        model, sch = _right(fam)
        cases = bugs(fam, list(sch.record.calls), model) + rights(fam, sch, model)
        cases = [c for c in cases if "pipeline" not in c.label or fam.name in pipelines]
        todo.append((model, fam.example_inputs(batch=2, seq=16), _select(cases, per_kind)))
    todo.append(_layerdrop_cases())
    for model, inputs, cases in todo:
        for case in cases:
            rep = numeric_check(model, case.calls, WS, inputs, from_config=case.from_config)
            results.append((case, rep))
            if verbose:
                ok = (
                    rep.passed
                    if case.culprit is None
                    else (not rep.passed and _located(rep.module, case.culprit))
                )
                print(
                    f"{'ok ' if ok else 'BAD'} {case.family:10s} {case.label:60s} culprit={case.culprit} "
                    f"got={rep.status}:{rep.module} {rep.seconds:.2f}s | {rep.message[:200]}",
                    flush=True,
                )
    return results


def figures(results) -> dict:
    buggy = [(c, r) for c, r in results if c.culprit is not None]
    right = [(c, r) for c, r in results if c.culprit is None]
    return {
        "bugs": len(buggy),
        "families": len({c.family for c, _ in buggy}),
        "kinds": len({c.label for c, _ in buggy}),
        "detected": sum(not r.passed for _, r in buggy),
        "located": sum(not r.passed and _located(r.module, c.culprit) for c, r in buggy),
        "right": len(right),
        "check_seconds": sum(r.seconds for _, r in results),
        "false_alarms": sum(not r.passed for _, r in right),
        "missed": [f"{c.family}: {c.label} at {c.culprit}" for c, r in buggy if r.passed],
        "mislocated": [
            f"{c.family}: {c.label} at {c.culprit}, named {r.module or 'no module'}"
            for c, r in buggy
            if not r.passed and not _located(r.module, c.culprit)
        ],
        "alarms": [f"{c.family}: {c.label}: {r.message}" for c, r in right if not r.passed],
    }


def test_seeded_bugs_are_found_at_their_culprit_and_right_schedules_pass(capsys):
    t0 = time.perf_counter()
    f = figures(run_all())
    seconds = time.perf_counter() - t0
    lines = [
        (
            f"seeded bugs: {f['bugs']} single-bug schedules of {f['kinds']} kinds over {f['families']} "
            f"families, {f['right']} right schedules ({seconds:.0f} s, of which the checks {f['check_seconds']:.0f} s)"
        ),
        f"  detected {f['detected']}/{f['bugs']}",
        (
            f"  located at the culprit, its parent or a child {f['located']}/{f['bugs']} "
            f"({100 * f['located'] / f['bugs']:.1f} %)"
        ),
        f"  false alarms {f['false_alarms']}/{f['right']}",
        *(f"  missed: {m}" for m in f["missed"]),
        *(f"  mislocated: {m}" for m in f["mislocated"]),
        *(f"  false alarm: {m}" for m in f["alarms"]),
    ]
    with capsys.disabled():  # shown with or without -s
        print("\n" + "\n".join(lines))
    assert f["bugs"] >= 60 and f["families"] >= 6 and f["right"] >= 30, f
    assert f["detected"] == f["bugs"], f["missed"]
    assert f["located"] >= 0.95 * f["bugs"], f["mislocated"]
    assert f["false_alarms"] == 0, f["alarms"]


if __name__ == "__main__":
    run_all(per_kind=int(sys.argv[1]) if len(sys.argv) > 1 else 1000, pipelines=tuple(FAMS), verbose=True)
