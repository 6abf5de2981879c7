"""Editor speed on a Llama-70B config built on the meta device (issue 6 figures).

Prints, with ratios against baselines measured in the same run:
  * constructor → first view (tree, graph, inspector, costs), vs one full ``torch.export`` of the model;
  * expanding one decoder layer (opening its level);
  * a click (apply a primitive + update of the visible level): median and p95 over N clicks.

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
    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
                      intermediate_size=28672, vocab_size=32000, max_position_embeddings=4096)
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


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
    print(f"model: Llama {args.layers} layers, {sum(p.numel() for p in model.parameters()) / 1e9:.1f} B params "
          f"(meta), built in {build_s:.2f} s")

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

    ed.open_level("model")
    t = time.perf_counter()
    ed.open_level("model.layers.0")  # what a double-click on one decoder layer does
    expand = time.perf_counter() - t
    ed.open_level("model")
    folded = [n for n, d in ed._last_graph.nodes(data=True) if d.get("kind") == "folded"]
    t = time.perf_counter()
    if folded:
        ed._on_node_dblclick(folded[0])  # unfold "LlamaDecoderLayer × 80" into 80 nodes
    unfold = time.perf_counter() - t

    ed.open_level("model.layers.0.self_attn")
    targets = [f"model.layers.{i}.self_attn.{n}" for i in range(args.layers) for n in ("q_proj", "k_proj", "v_proj")]
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
    print(f"constructor → first view: {ctor:.3f} s (goal ≤ 1.0 s)"
          + (f"; one torch.export of the model: {export_s:.2f} s; ratio {ctor / export_s:.3f}" if export_s else ""))
    print(f"open one decoder layer: {expand:.3f} s (goal ≤ 0.5 s); unfold all {args.layers} layers into nodes: "
          f"{unfold:.3f} s ({unfold / expand:.1f}x)")
    print(f"click (apply + update), {len(times)} clicks: median {med * 1e3:.1f} ms, p95 {p95 * 1e3:.1f} ms "
          f"(goal p95 ≤ 100 ms); ratio p95/median {p95 / med:.2f}")


if __name__ == "__main__":
    main()
