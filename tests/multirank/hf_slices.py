"""2 gloo ranks: --model-path reads only this rank's slices of the safetensors files.

Builds the Llama of ``argv[1]`` (a save_pretrained directory) on the meta device, applies the Megatron
preset on the 2 ranks, materialises this rank's shards and fills them with
``slapo_lab.train.weights.load_hf`` while recording every read request of
``HuggingFaceStorageReader``: the elements read must be this rank's local elements (each TP shard read as
its own slice, never the whole tensor), and the values those of the files.
"""

import gc
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.device_mesh import init_device_mesh

import slapo_lab as sl
from slapo_lab.sharding.placements import layout_of
from slapo_lab.train.weights import Target, allocate, build_meta_model, load_hf


def main() -> int:
    model_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    spec = {
        "kind": "hf",
        "module": "transformers",
        "class": "LlamaForCausalLM",
        "config_class": "LlamaConfig",
        "config": {"model_type": "llama"},
    }
    model = build_meta_model(spec, model_dir)
    sch = sl.create_schedule(model, group=mesh["tp"].get_group())
    sl.presets.megatron_tp(sch)
    targets = []
    seen = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            targets.append(Target(name, p, layout_of(p, 2, rank)))
    allocate(targets, "cpu")
    reads = []
    original = HuggingFaceStorageReader._process_read_request

    def record(self, f, req, planner):
        reads.append((req.storage_index.fqn, list(req.lengths)))
        return original(self, f, req, planner)

    HuggingFaceStorageReader._process_read_request = record
    load_hf(model_dir, targets, mesh)
    from safetensors.torch import load_file

    files = {}
    for path in __import__("pathlib").Path(model_dir).glob("*.safetensors"):
        files.update(load_file(path))
    read = sum(torch.Size(n).numel() for _, n in reads)
    local = sum(t.local.numel() for t in targets)
    full = sum(torch.Size(t.layout.shape).numel() for t in targets)
    sharded = [t.name for t in targets if t.layout.tp_sharded]
    whole_reads = [f for f, n in reads if f in sharded and list(n) == list(files[f].shape)]
    equal = all(torch.equal(t.local, t.layout.take(files[t.name])) for t in targets)
    result = {
        "rank": rank,
        "read": read,
        "local": local,
        "full": full,
        "sharded": len(sharded),
        "whole_reads_of_shards": whole_reads,
        "equal": equal,
    }
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if rank == 0:
        print("RESULT " + json.dumps({"case": "slices", "ranks": gathered}), flush=True)
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
