"""Benchmark of slapo_lab.graph on a 70B-parameter Llama built on the meta device.

Figures are printed in seconds and as ratios against baselines measured in the same run (the
machine may be shared, so ratios are the comparable numbers):

* forward baseline: a plain ``model(input_ids=ids)`` on meta under ``torch.no_grad``;
* graphviz baseline: ``dot -Tsvg`` of a two-node graph (process start-up + minimal layout).

    source scripts/env.sh && $PY benchmarks/graph_bench.py            # 80 layers, hidden 8192
    $PY benchmarks/graph_bench.py --layers 4 --hidden 512 --repeat 3  # quick
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch


def _median(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=28672)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM

    import slapo_lab.graph as g
    from slapo_lab.graph import _record

    cfg = LlamaConfig(
        num_hidden_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate,
        vocab_size=args.vocab,
    )
    t = time.perf_counter()
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    build = time.perf_counter() - t
    nparams = sum(p.numel() for p in model.parameters())
    ids = torch.zeros(1, args.seq, dtype=torch.long, device="meta")
    inputs = {"input_ids": ids}
    print(
        f"model: LlamaForCausalLM, {args.layers} layers, hidden {args.hidden}, {nparams / 1e9:.1f} B params "
        f"on meta (built in {build:.3f} s); input_ids 1×{args.seq}; median of {args.repeat}"
    )

    def plain():
        with torch.no_grad():
            model(**inputs)

    plain()  # warm-up (lazy imports, HF mask functions)
    base_fwd = _median(plain, args.repeat)

    def record_cold():
        _record._META_CACHE.clear()
        g.record_dataflow(model, inputs)

    t_cold = _median(record_cold, args.repeat)
    flow = g.record_dataflow(model, inputs)
    t_warm = _median(lambda: g.record_dataflow(model, inputs), args.repeat)
    t_nocache = _median(
        lambda: g.record_dataflow(model, inputs, cache_meta_ops=False), max(1, args.repeat // 2)
    )
    t_tree = _median(lambda: g.module_tree(model), args.repeat)

    two = "digraph { a -> b }"
    base_gv = _median(
        lambda: subprocess.run(
            ["dot", "-Tsvg"], input=two.encode(), capture_output=True, check=True, timeout=30
        ),
        args.repeat,
    )

    print(f"\n{'what':58s} {'seconds':>9s} {'ratio':>8s}")
    print(f"{'baseline: plain meta forward (no_grad)':58s} {base_fwd:9.3f} {1.0:8.2f}")
    print(f"{'record_dataflow, meta-op cache cold':58s} {t_cold:9.3f} {t_cold / base_fwd:8.2f}")
    print(f"{'record_dataflow, meta-op cache warm (re-record)':58s} {t_warm:9.3f} {t_warm / base_fwd:8.2f}")
    print(f"{'record_dataflow, cache_meta_ops=False':58s} {t_nocache:9.3f} {t_nocache / base_fwd:8.2f}")
    print(f"{'module_tree (no forward)':58s} {t_tree:9.3f} {t_tree / base_fwd:8.2f}")
    print(f"  ({len(flow.calls)} module calls, {flow.num_ops} ops recorded)")

    print(f"\n{'baseline: dot -Tsvg on a 2-node graph':58s} {base_gv:9.3f} {1.0:8.2f}")
    last = args.layers - 1
    levels = [
        ("", ()),
        ("model", ()),
        ("model.layers.0", ()),
        ("model.layers.0.self_attn", ()),
        ("model", (f"model.layers.0-{last}",)),
    ]
    for path, expanded in levels:
        _bench_level(g, flow, path, expanded, base_gv, args.repeat)


def _bench_level(g, flow, path: str, expanded, base_gv: float, repeat: int) -> None:
    G = flow.level_graph(path, expanded)
    t_level = _median(lambda: flow.level_graph(path, expanded), repeat)
    first = next(n for n, a in G.nodes(data=True) if a["kind"] in ("module", "folded"))

    def render_miss():
        g.clear_layout_cache()
        g.render_svg(G)

    t_miss = _median(render_miss, repeat)
    g.render_svg(G)
    before = g.layout_cache_info()["hits"]
    colours = iter(["#ffd8a8", "#a5d8ff", "#b2f2bb", "#ffc9c9", "#d0bfff"] * repeat)
    t_hit = _median(lambda: g.render_svg(G, {first: {"fill": next(colours)}}), repeat)
    hits = g.layout_cache_info()["hits"] - before
    name = f"level {path or '(root)'}" + (" expanded" if expanded else "")
    print(f"{name} [{len(G)} nodes, {G.number_of_edges()} edges]")
    print(f"{'  level_graph':58s} {t_level:9.4f} {t_level / base_gv:8.2f}")
    print(f"{'  render_svg, layout cache miss (dot + neato -n2)':58s} {t_miss:9.4f} {t_miss / base_gv:8.2f}")
    print(
        f"{'  render_svg, recoloured (cache hit: neato -n2 only)':58s} {t_hit:9.4f} {t_hit / base_gv:8.2f}"
        f"   ({hits}/{repeat} hits)"
    )
    tot = t_level + t_miss
    print(f"{'  level_graph + render (miss)':58s} {tot:9.4f} {tot / base_gv:8.2f}")


if __name__ == "__main__":
    main()
