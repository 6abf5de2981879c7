"""Editor speed on a Llama-70B config built on the meta device (issue 6 figures).

Prints, with ratios against a baseline measured in the same run (one full ``torch.export`` of the model):
  * constructor → first view (tree, graph, inspector, costs);
  * the first double-click (open 'model'), after the call order for cut checks was recorded while the
    kernel was idle, and without that idle time;
  * opening one decoder layer; unfolding all layers into nodes;
  * a selection (median; it must run no graphviz: the count of renders is printed);
  * a click (apply a primitive + update of the visible level): median and p95 over N clicks;
  * undo/redo per user action after the Megatron preset (undo one later click, undo the preset, redo).

Usage: python benchmarks/editor_bench.py [--clicks 100] [--layers 80] [--no-export]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import slapo_lab as sl


def llama70b(layers: int):
    cfg = LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=8192,
        num_attention_heads=64,
        num_key_value_heads=8,
        intermediate_size=28672,
        vocab_size=32000,
        max_position_embeddings=4096,
    )
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def undo_figures(model, ids) -> dict[str, float]:
    """Undo/redo per user action after the Megatron preset (issue 11), on a fresh editor of ``model``.

    Returns seconds: ``preset`` (applying it, ~14 calls per layer), ``undo_click`` (undo one click made
    after the preset: the preset's calls are replayed on a fresh meta copy), ``undo_preset`` (undo the
    preset: one action, whatever its number of calls) and ``redo_preset``; ``calls`` is the preset's
    number of calls.
    """
    ed = sl.ScheduleEditor(model, example_inputs={"input_ids": ids}, world_size=8)
    out = {}
    t = time.perf_counter()
    assert ed.apply_preset("megatron") is None, ed.message
    out["preset"] = time.perf_counter() - t
    out["calls"] = len(ed.schedule.record.calls)
    assert ed.apply("checkpoint", path="model.layers.0") is None, ed.message
    for key, fn in (("undo_click", ed.undo), ("undo_preset", ed.undo), ("redo_preset", ed.redo)):
        t = time.perf_counter()
        assert fn() is None, ed.message
        out[key] = time.perf_counter() - t
    assert len(ed.schedule.record.calls) == out["calls"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clicks", type=int, default=100)
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--no-export", action="store_true", help="skip the torch.export baseline")
    args = ap.parse_args()
    t = time.perf_counter()
    model = llama70b(args.layers)
    build_s = time.perf_counter() - t
    ids = torch.randint(0, 32000, (1, 128))
    print(
        f"model: Llama {args.layers} layers, {sum(p.numel() for p in model.parameters()) / 1e9:.1f} B params "
        f"(meta), built in {build_s:.2f} s"
    )

    # warm-up: imports, graphviz, the dataflow op cache (a person's second editor is this fast too)
    sl.ScheduleEditor(llama70b(2), example_inputs={"input_ids": ids}, world_size=8)

    t = time.perf_counter()
    ed = sl.ScheduleEditor(model, example_inputs={"input_ids": ids}, world_size=8)
    ctor = time.perf_counter() - t
    export_s = None
    if not args.no_export:
        t = time.perf_counter()
        torch.export.export(model, (), {"input_ids": ids.to("meta"), "use_cache": False}, strict=False)
        export_s = time.perf_counter() - t

    # first double-click (root -> "model"), as in a kernel: the forward call order that the cut checks
    # need was recorded while the kernel was idle after the cell (ScheduleEditor._prefetch_checks)
    prefetch = ed._prefetch_checks()
    t = time.perf_counter()
    ed._on_node_dblclick("model")
    first_dbl = time.perf_counter() - t
    # the same without idle time, as in a kernel: the editor records the call order in its background work
    # (ScheduleEditor._schedule_background), and the double-click comes at once
    import asyncio

    loop = asyncio.new_event_loop()

    async def kernel_cell():
        return sl.ScheduleEditor(model, example_inputs={"input_ids": ids}, world_size=8)

    cold = loop.run_until_complete(kernel_cell())

    async def dblclick(editor):
        t = time.perf_counter()
        editor._on_node_dblclick("model")
        return time.perf_counter() - t

    first_dbl_cold = loop.run_until_complete(dblclick(cold))
    cold.wait_background()
    loop.close()
    del cold
    t = time.perf_counter()
    ed._on_node_dblclick("model.layers.0")  # open one decoder layer
    expand = time.perf_counter() - t
    ed.open_level("model")
    folded = [n for n, d in ed._last_graph.nodes(data=True) if d.get("kind") == "folded"]
    t = time.perf_counter()
    if folded:
        ed._on_node_dblclick(folded[0])  # unfold "LlamaDecoderLayer × 80" into 80 nodes
    unfold = time.perf_counter() - t

    # selection: must restyle nothing and run no graphviz (the browser draws the selection)
    import slapo_lab.graph as sg

    renders = [0]
    real_render = sg.render_svg

    def counting(*a, **k):
        renders[0] += 1
        return real_render(*a, **k)

    ed.open_level("model.layers.0.self_attn")
    sg.render_svg = counting
    sel = []
    for i in range(40):
        t = time.perf_counter()
        ed.select(f"model.layers.0.self_attn.{('q_proj', 'k_proj', 'v_proj', 'o_proj')[i % 4]}")
        sel.append(time.perf_counter() - t)
    sel_renders = renders[0]
    sg.render_svg = real_render

    ed.open_level("model.layers.0.self_attn")
    targets = [
        f"model.layers.{i}.self_attn.{n}" for i in range(args.layers) for n in ("q_proj", "k_proj", "v_proj")
    ]
    times = []
    for i in range(args.clicks):
        path = targets[i % len(targets)]
        ed.selected = path
        t = time.perf_counter()
        err = ed.apply("shard", "weight", axis=0, path=path)
        times.append(time.perf_counter() - t)
        assert err is None, err
    times.sort()
    p95 = times[int(0.95 * (len(times) - 1))]
    med = statistics.median(times)

    def vs(x: float) -> str:  # ratio against the baseline: one torch.export of the same model, this run
        return f" ({x / export_s:.3f}x torch.export)" if export_s else ""

    sel.sort()
    if export_s:
        print(f"baseline: one torch.export of the model: {export_s:.2f} s")
    print(f"constructor → first view: {ctor:.3f} s{vs(ctor)} (goal ≤ 1.0 s)")
    print(
        f"first double-click (open 'model'): {first_dbl:.3f} s{vs(first_dbl)} after the idle call-order "
        f"recording ({prefetch:.3f} s{vs(prefetch)}); without idle time: {first_dbl_cold:.3f} s{vs(first_dbl_cold)}"
    )
    print(
        f"open one decoder layer: {expand:.3f} s{vs(expand)} (goal ≤ 0.5 s); unfold all {args.layers} layers "
        f"into nodes: {unfold:.3f} s{vs(unfold)}"
    )
    print(
        f"select (no schedule change), {len(sel)} selections: median {statistics.median(sel) * 1e3:.1f} ms, "
        f"graphviz renders: {sel_renders}"
    )
    print(
        f"click (apply + update), {len(times)} clicks: median {med * 1e3:.1f} ms{vs(med)}, p95 {p95 * 1e3:.1f} ms"
        f"{vs(p95)} (goal p95 ≤ 100 ms); ratio p95/median {p95 / med:.2f}"
    )
    u = undo_figures(model, ids)
    print(
        f"undo after the Megatron preset ({u['calls']} calls, one action): undo one later click "
        f"{u['undo_click']:.3f} s{vs(u['undo_click'])} ({u['undo_click'] / u['preset']:.2f}x applying the preset, "
        f"{u['preset']:.3f} s); undo the whole preset {u['undo_preset']:.3f} s{vs(u['undo_preset'])}; "
        f"redo it {u['redo_preset']:.3f} s{vs(u['redo_preset'])} (goal: undo well under 1 s per action)"
    )


if __name__ == "__main__":
    main()
