"""Scale of the planner: Llama-3-405B dimensions on 16,384 H100s (2,048 nodes of 8), in a fresh process.

Run: ``.venv/bin/python benchmarks/plan_scale.py`` (prints the layouts priced, the wall time from the first line
of this script -- imports included -- and the top of the table). Goal (issue 26): >= 10^4 layouts in <= 10 s.

The model is built from ``transformers.LlamaConfig`` under ``torch.device("meta")`` with Llama 3.1 405B's
published dimensions (``config.json`` of meta-llama/Llama-3.1-405B: hidden 16384, 126 layers, 128 heads, 8
key/value heads, intermediate 53248, vocabulary 128256).
"""

import time

T0 = time.perf_counter()

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import slapo_lab as sl


def main() -> None:
    cfg = LlamaConfig(
        hidden_size=16384,
        intermediate_size=53248,
        num_hidden_layers=126,
        num_attention_heads=128,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    cluster = sl.Cluster(nodes=2048, gpus_per_node=8, gpu="H100-SXM")
    plan = sl.auto_plan(model, cluster=cluster, seq_len=8192, global_batch_size=2048, top_k=5)
    total = time.perf_counter() - T0
    print(plan.table())
    print(
        f"\nLlama-3-405B dims on {cluster.gpus:,} H100: {plan.priced:,} layouts considered, {plan.costed:,} costed; search {plan.seconds:.2f} s, "
        f"whole process {total:.2f} s (goal: >= 10,000 in <= 10 s)"
    )


if __name__ == "__main__":
    main()
