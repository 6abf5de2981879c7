"""ShardLayout: the schedule's shards as DTensor placements, and what DCP / clipping see through them.

Single-process checks of the geometry against ``local_shard`` (the engine's own slicing), and a 4-rank
gloo run (tests/multirank/placements_dcp.py) that saves TP x FSDP views (a fused q/k/v included) with
``torch.distributed.checkpoint`` and reloads them at other layouts, and compares
``torch.nn.utils.get_total_norm`` over the views with the single-tensor norm.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from slapo_lab.sharding.placements import ShardLayout, fsdp_dim_for
from slapo_lab.sharding.rules import local_shard
from tests.harness import REPO_ROOT, launch_results


@pytest.mark.parametrize(
    "shape,axis,stride,tp",
    [
        ((12, 6), 0, 1, 2),
        ((12, 6), 0, 3, 2),
        ((6, 12), 1, 3, 2),
        ((8,), 0, 1, 4),
        ((24,), 0, 3, 4),
        ((4, 8, 6), 1, 1, 2),
    ],
)
def test_tp_layout_takes_what_local_shard_takes(shape, axis, stride, tp):
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    pieces = []
    for r in range(tp):
        lay = ShardLayout(shape, axis, stride, tp, r)
        got = lay.take(full)
        assert torch.equal(got, local_shard(full, axis, tp, r, stride))
        assert tuple(got.shape) == lay.local_shape
        assert len(lay.blocks()) == stride
        pieces.append(got)
    # the blocks of all ranks tile the tensor exactly once
    seen = torch.zeros(shape, dtype=torch.int64)
    for r in range(tp):
        for _, offs, szs in ShardLayout(shape, axis, stride, tp, r).blocks():
            seen[tuple(slice(o, o + s) for o, s in zip(offs, szs, strict=False))] += 1
    assert bool((seen == 1).all())


@pytest.mark.parametrize("dp", [2, 3])
def test_fsdp_on_top_of_tp_tiles_the_tensor(dp):
    shape = (12, 7)  # 7 does not divide by 2 or 3: FSDP's torch.chunk pieces are uneven
    full = torch.arange(84, dtype=torch.float32).reshape(shape)
    seen = torch.zeros(shape, dtype=torch.int64)
    for tp_rank, dp_rank in itertools.product(range(2), range(dp)):
        lay = ShardLayout(shape, 0, 3 if shape[0] % 6 == 0 else 1, 2, tp_rank).with_fsdp(1, dp, dp_rank)
        local = lay.take(full)
        assert tuple(local.shape) == lay.local_shape
        # the FSDP piece is torch.chunk of the tensor-parallel local tensor, as FSDP2 cuts it
        tp_local = ShardLayout(shape, 0, 3, 2, tp_rank).take(full)
        chunks = tp_local.chunk(dp, dim=1)
        want = chunks[dp_rank] if dp_rank < len(chunks) else tp_local[:, :0]
        assert torch.equal(local, want)
        for _, offs, szs in lay.blocks():
            seen[tuple(slice(o, o + s) for o, s in zip(offs, szs, strict=False))] += 1
    assert bool((seen == 1).all())


def test_fsdp_never_shards_the_tensor_parallel_axis():
    col = ShardLayout((64, 32), 0, 1, 2, 0)
    assert fsdp_dim_for(col, 2) == 1
    row = ShardLayout((32, 64), 1, 1, 2, 0)
    assert fsdp_dim_for(row, 2) == 0
    assert fsdp_dim_for(ShardLayout((64,), 0, 1, 2, 0), 2) is None  # a column-parallel bias stays whole
    assert fsdp_dim_for(ShardLayout((64,)), 2) == 0  # a replicated norm weight is sharded
    with pytest.raises(ValueError, match="tensor-parallel axis"):
        col.with_fsdp(0, 2, 0)


def test_take_and_views_refuse_wrong_shapes():
    lay = ShardLayout((8, 4), 0, 1, 2, 1)
    with pytest.raises(ValueError, match="global shape"):
        lay.take(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="local tensor"):
        lay.dtensor(torch.zeros(8, 4), None)


@pytest.mark.multirank
def test_dcp_and_norms_through_views_on_4_gloo_ranks():
    rc, out, res = launch_results(REPO_ROOT / "tests" / "multirank" / "placements_dcp.py", 4, [], timeout=240)
    assert rc == 0, out[-3000:]
    for case in ("save_tp2_fsdp2", "load_tp4", "load_tp1_dp4_fsdp", "load_full", "norm"):
        assert case in res, f"{case} missing\n{out[-3000:]}"
        assert res[case]["ok"], (case, res[case], out[-3000:])
    # the strided (fused q/k/v) tensor really went through a ShardedTensor, the others through DTensor
    assert res["save_tp2_fsdp2"]["kinds"] == {"qkv": "ShardedTensor", "dense": "DTensor", "bias": "DTensor"}


@pytest.mark.multirank
def test_model_path_reads_only_this_ranks_slices(tmp_path):
    """--model-path: each of 2 tensor-parallel ranks reads exactly its local elements of the safetensors files
    (every split tensor as its own slice), and gets the files' values."""
    from tests.train_fixtures import write_pretrained

    model_dir = write_pretrained(tmp_path / "llama", intermediate_size=128, vocab_size=256)
    rc, out, res = launch_results(
        REPO_ROOT / "tests" / "multirank" / "hf_slices.py", 2, [str(model_dir)], timeout=240
    )
    assert rc == 0 and "slices" in res, out[-3000:]
    for r in res["slices"]["ranks"]:
        assert r["equal"], r
        assert r["sharded"] > 0 and r["whole_reads_of_shards"] == [], r
        assert r["read"] == r["local"] < r["full"], r


def test_unequal_blocks_norm_and_gather_on_two_simulated_ranks():
    """Phi-3's grouped q/k/v (unequal blocks) has no DTensor placement: its norm view (plain Shard) gives the
    norm of the whole tensor, and ``full_tensor`` gathers it back in the model's order (the HF save)."""
    from torch.distributed.device_mesh import init_device_mesh

    from slapo_lab.sharding.rules import BlockStride
    from tests.threaded_ranks import run_threaded_ranks

    full = torch.randn(128, 16, generator=torch.Generator().manual_seed(0))
    stride = BlockStride((64, 32, 32))
    out = {}

    def rank(r):
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
        lay = ShardLayout(tuple(full.shape), tp_axis=0, tp_stride=stride, tp=2, tp_rank=r)
        local = local_shard(full, 0, 2, r, stride).clone()
        norm = torch.linalg.vector_norm(lay.norm_view(local, mesh).full_tensor())
        out[r] = (float(norm), lay.full_tensor(local, mesh))

    run_threaded_ranks(rank, world_size=2, timeout=60)
    assert set(out) == {0, 1}
    for norm, gathered in out.values():
        assert abs(norm - float(torch.linalg.vector_norm(full))) < 1e-4
        assert torch.equal(gathered, full)
