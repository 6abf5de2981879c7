"""4 gloo ranks: DCP through ShardLayout views at one layout, reloaded at others; norms over the views.

Tensors (global values are arange-based, so every element is distinct):
* ``qkv``:   (12, 6), tensor-parallel on axis 0 with stride 3 (a fused q/k/v), FSDP on dim 1;
* ``dense``: (8, 12), tensor-parallel on axis 1, FSDP on dim 0;
* ``bias``:  (8,),    tensor-parallel on axis 0, whole on every replica.
Saved at tp 2 x dp 2 (FSDP), then loaded at tp 4, at tp 1 x dp 4 (FSDP), and as full tensors.
"""

import gc
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from slapo_lab.sharding.placements import ShardLayout
from tests.harness import report

SPECS = {"qkv": ((12, 6), 0, 3, 1), "dense": ((8, 12), 1, 1, 0), "bias": ((8,), 0, 1, None)}


def full(name):
    shape = SPECS[name][0]
    n = torch.Size(shape).numel()
    return torch.arange(n, dtype=torch.float32).reshape(shape) + 1000 * list(SPECS).index(name)


def layouts(tp, dp, fsdp, mesh):
    tp_rank, dp_rank = mesh["tp"].get_local_rank(), mesh["dp"].get_local_rank()
    out = {}
    for name, (shape, axis, stride, fdim) in SPECS.items():
        lay = ShardLayout(shape, axis if tp > 1 else None, stride if tp > 1 else 1, tp, tp_rank)
        if fsdp and dp > 1 and fdim is not None:
            lay = lay.with_fsdp(fdim, dp, dp_rank)
        out[name] = lay
    return out


def main():
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    folder = [tempfile.mkdtemp(prefix="slapo-dcp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder)
    ckpt = os.path.join(folder[0], "ckpt")

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    lays = layouts(2, 2, True, mesh)
    locals_ = {n: lay.take(full(n)).clone() for n, lay in lays.items()}
    views = {n: lays[n].checkpoint_view(locals_[n], mesh) for n in lays}
    kinds = {n: type(v).__name__ for n, v in views.items()}
    dcp.save(views, checkpoint_id=ckpt)
    report("save_tp2_fsdp2", True, kinds=kinds)

    def load_at(case, tp, dp, fsdp):
        m = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        lays = layouts(tp, dp, fsdp, m)
        zeros = {n: torch.zeros(lay.local_shape) for n, lay in lays.items()}
        dcp.load({n: lays[n].checkpoint_view(zeros[n], m) for n in lays}, checkpoint_id=ckpt)
        ok = all(torch.equal(zeros[n], lays[n].take(full(n))) for n in lays)
        flags = [None] * world
        dist.all_gather_object(flags, ok)
        report(case, all(flags))

    load_at("load_tp4", 4, 1, False)
    load_at("load_tp1_dp4_fsdp", 1, 4, True)
    whole = {n: torch.zeros(SPECS[n][0]) for n in SPECS}
    dcp.load(whole, checkpoint_id=ckpt)
    ok = all(torch.equal(whole[n], full(n)) for n in SPECS)
    flags = [None] * world
    dist.all_gather_object(flags, ok)
    report("load_full", all(flags))

    # the global norm over the views equals the norm of the full tensors (replicated parts counted once)
    grads = [lays[n].dtensor(locals_[n], mesh) for n in lays]
    total = torch.nn.utils.get_total_norm(grads, 2.0).full_tensor()
    want = torch.linalg.vector_norm(torch.stack([full(n).norm() for n in SPECS]))
    report("norm", torch.allclose(total, want, rtol=1e-6), got=float(total), want=float(want))
    dist.barrier()
    gc.collect()  # sync hooks hold the gloo group in reference cycles; free them first
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
