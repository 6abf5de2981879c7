"""ParallelDims: the one home of the tp x pp x dp arithmetic (slapo_lab/parallel_dims.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from slapo_lab.parallel_dims import ParallelDims, ParallelDimsError
from tests.harness import REPO_ROOT, child_env


@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 1), (2, 1, 4), (2, 2, 2), (4, 2, 1), (1, 3, 2)])
def test_coords_follow_the_device_mesh_layout(tp, pp, dp):
    """``coords`` is the index of the rank in ``arange(world).view(dp, pp, tp)``: init_device_mesh's layout."""
    dims = ParallelDims(tp, pp, dp)
    grid = torch.arange(dims.world_size).view(dp, pp, tp)
    for rank in range(dims.world_size):
        d, p, t = dims.coords(rank)
        assert grid[d, p, t].item() == rank
    assert dims.world_size == tp * pp * dp and dims.replica == tp * pp


def test_sizes_from_a_world_and_a_cluster():
    assert ParallelDims.for_world(8, tp=2, pp=2) == ParallelDims(2, 2, 2)
    assert ParallelDims.for_world(6, tp=4) is None
    assert ParallelDims.filling(10, tp=4) == (ParallelDims(4, 1, 2), 2)
    assert ParallelDims.filling(2, tp=4) == (ParallelDims(4, 1, 1), -2)  # one replica does not fit
    assert ParallelDims(dp=2).micro_batches(16) == (8, 1)
    assert ParallelDims(dp=2).micro_batches(16, stages=4) == (2, 4)
    assert ParallelDims(dp=2).micro_batches(16, micro=2) == (2, 4)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_a_bad_degree_is_one_sentence(bad):
    with pytest.raises(ParallelDimsError, match=r"^tp must be a positive integer, not .*\.$"):
        ParallelDims(tp=bad)
    with pytest.raises(ParallelDimsError, match="rank 8 is not one of the 8 ranks of tp 2 x pp 2 x dp 2"):
        ParallelDims(2, 2, 2).coords(8)


def test_the_preflight_imports_it_without_torch():
    """The launch preflight runs before torch is imported; ParallelDims must not pull it in."""
    code = "import sys, slapo_lab.parallel_dims, slapo_lab.train.preflight; print('torch' in sys.modules)"
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stdout + r.stderr
