"""2 gloo ranks: a Phi-3 ``qkv_proj`` weight of unequal q/k/v blocks through ShardLayout checkpoint views.

The tensor is (128, 64): ``[q (4 heads x 16); k (2 x 16); v (2 x 16)]`` on axis 0, a
:class:`~slapo_lab.sharding.rules.BlockStride` ``(64, 32, 32)``; its global values are arange-based, so every
element is distinct. Saved by DCP at tp 2 (the ShardedTensor view: one shard per block), then loaded at tp 2,
at tp 1 x dp 2 with FSDP on dim 1, and as a full tensor; a DTensor view is refused in one sentence.
"""

import gc
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from slapo_lab.sharding.placements import ShardLayout
from slapo_lab.sharding.rules import BlockStride, local_shard
from tests.harness import agree, report

SHAPE = (128, 64)
STRIDE = BlockStride((64, 32, 32))


def full():
    return torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32).reshape(SHAPE)


def main():
    # DCP warns (on stderr) that ShardedTensor is deprecated, on every rank: in the merged output a warning can
    # land in the middle of another rank's RESULT line, which then no longer parses (seen once in CI)
    warnings.filterwarnings("ignore", category=FutureWarning)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    folder = [tempfile.mkdtemp(prefix="slapo-fused-dcp-") if rank == 0 else None]
    dist.broadcast_object_list(folder)
    ckpt = os.path.join(folder[0], "ckpt")

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    lay = ShardLayout(SHAPE, 0, STRIDE, 2, rank)
    local = lay.take(full()).clone()
    same = torch.equal(local, local_shard(full(), 0, 2, rank, STRIDE))
    view = lay.checkpoint_view(local, mesh)
    dcp.save({"qkv": view}, checkpoint_id=ckpt)
    report("save_tp2", agree(same), kind=type(view).__name__, shards=len(view.local_shards()))

    zeros = torch.zeros(lay.local_shape)
    dcp.load({"qkv": lay.checkpoint_view(zeros, mesh)}, checkpoint_id=ckpt)
    report("load_tp2", agree(torch.equal(zeros, local)))

    m = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    fsdp = ShardLayout(SHAPE).with_fsdp(1, 2, m["dp"].get_local_rank())
    zeros = torch.zeros(fsdp.local_shape)
    dcp.load({"qkv": fsdp.checkpoint_view(zeros, m)}, checkpoint_id=ckpt)
    report("load_tp1_dp2_fsdp", agree(torch.equal(zeros, fsdp.take(full()))))

    whole = torch.zeros(SHAPE)
    dcp.load({"qkv": whole}, checkpoint_id=ckpt)
    report("load_full", agree(torch.equal(whole, full())))

    try:
        lay.dtensor(local, mesh)
        refused = ""
    except ValueError as err:
        refused = str(err)
    report("dtensor_refused", agree(bool(refused)), message=refused)
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
