"""4 gloo ranks: key/value heads replicated over tensor-parallel ranks (2 kv heads at tp 4) through ShardLayout.

* DCP: a ``k_proj``-like weight (2 heads x 4 rows, 6 columns) and its bias, tensor parallel on axis 0 with
  ``tp_replicas`` 2 (each rank holds one whole head, ranks {0, 1} head 0, {2, 3} head 1: the DTensor view on the
  ``(dp, kv, r)`` mesh, placements ``(Replicate, Shard(0), Replicate)``). Saved at tp 4, loaded at tp 4, at
  tp 2 x dp 2 (plain shard, FSDP on dim 1) and as full tensors; saved at tp 2 x dp 2 and loaded at tp 4.
* norms: ``global_grad_norm`` over views on both meshes equals the full tensors' norm (a replicated head
  counted once), and a Llama with 8 query heads and 2 key/value heads under the Megatron preset at tp 4 has,
  after one backward, the unsharded model's gradient norm.
"""

import copy
import gc
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))
from slapo_lab.sharding.placements import ShardLayout, layout_of
from slapo_lab.train.optim import global_grad_norm
from tests.harness import agree, report

SPECS = {"k": ((8, 6), 1), "k_bias": ((8,), None)}  # name -> (global shape, FSDP dim)
KV = 2


def full(name):
    shape = SPECS[name][0]
    n = torch.Size(shape).numel()
    return torch.arange(n, dtype=torch.float32).reshape(shape) + 1000 * list(SPECS).index(name)


def layouts(tp, dp, mesh, fsdp=False):
    tp_rank, dp_rank = mesh["tp"].get_local_rank(), mesh["dp"].get_local_rank()
    out = {}
    for name, (shape, fdim) in SPECS.items():
        lay = ShardLayout(shape, 0, 1, tp, tp_rank, tp_replicas=max(1, tp // KV))
        if fsdp and dp > 1 and fdim is not None:
            lay = lay.with_fsdp(fdim, dp, dp_rank)
        out[name] = lay
    return out


def save_at(ckpt, tp, dp, fsdp):
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    lays = layouts(tp, dp, mesh, fsdp)
    views = {n: lays[n].checkpoint_view(lays[n].take(full(n)).clone(), mesh) for n in lays}
    dcp.save(views, checkpoint_id=ckpt)
    return {n: [type(v).__name__, [str(p) for p in v.placements]] for n, v in views.items()}


def load_at(ckpt, tp, dp, fsdp):
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    lays = layouts(tp, dp, mesh, fsdp)
    zeros = {n: torch.zeros(lay.local_shape) for n, lay in lays.items()}
    dcp.load({n: lays[n].checkpoint_view(zeros[n], mesh) for n in lays}, checkpoint_id=ckpt)
    return agree(all(torch.equal(zeros[n], lays[n].take(full(n))) for n in lays))


def model_norm(mesh):
    """Llama (8 heads, 2 kv heads) under the Megatron preset at tp 4: one backward, then the gradient norm over
    the DTensor views of every parameter, against the unsharded model's."""
    import tp_train

    import slapo_lab as sl
    from slapo_lab import presets

    torch.manual_seed(1234)
    model = tp_train.llama_kv2_model()
    ref = copy.deepcopy(model)
    sch = sl.create_schedule(model, group=dist.group.WORLD)
    presets.megatron_tp(sch)
    ids, labels = tp_train.batch(0)
    tp_train.loss_of(model, ids, labels).backward()
    tp_train.loss_of(ref, ids, labels).backward()
    tp = dist.get_world_size()
    views = [
        layout_of(p, tp, dist.get_rank()).dtensor(p.grad, mesh)
        for p in model.parameters()
        if p.grad is not None
    ]
    got = float(global_grad_norm(views))
    want = float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters() if p.grad is not None]))
    replicated = sum(getattr(p, "shard_replicas", 1) > 1 for p in model.parameters())
    return got, want, replicated


def main():
    dist.init_process_group("gloo")
    folder = [tempfile.mkdtemp(prefix="slapo-kv-dcp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder)
    a, b = os.path.join(folder[0], "tp4"), os.path.join(folder[0], "tp2dp2")

    kinds = save_at(a, 4, 1, False)
    report("save_tp4_replicas", True, kinds=kinds)
    report("load_tp4_replicas", load_at(a, 4, 1, False))
    report("load_tp2_dp2_fsdp", load_at(a, 2, 2, True))
    whole = {n: torch.zeros(SPECS[n][0]) for n in SPECS}
    dcp.load(whole, checkpoint_id=a)
    report("load_full", agree(all(torch.equal(whole[n], full(n)) for n in SPECS)))
    save_at(b, 2, 2, True)
    report("save_tp2_dp2_load_tp4_replicas", load_at(b, 4, 1, False))

    mesh = init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp", "tp"))
    lays = layouts(4, 1, mesh)
    views = [lays[n].dtensor(lays[n].take(full(n)), mesh) for n in lays]
    plain = ShardLayout((8, 12), 1, 1, 4, mesh["tp"].get_local_rank())  # on the (dp, tp) mesh: mixed meshes
    other = torch.arange(96, dtype=torch.float32).reshape(8, 12) / 7
    views.append(plain.dtensor(plain.take(other), mesh))
    got = float(global_grad_norm(views))
    want = float(torch.nn.utils.get_total_norm([full(n) for n in SPECS] + [other]))
    report("norm_views", agree(abs(got - want) <= 1e-5 * want), got=got, want=want)

    got, want, replicated = model_norm(mesh)
    report(
        "norm_llama_tp4",
        agree(abs(got - want) <= 1e-5 * want and replicated == 4),
        got=got,
        want=want,
        replicated=replicated,
    )
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
