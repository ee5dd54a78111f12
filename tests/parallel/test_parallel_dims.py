"""ParallelDims validation and degree arithmetic (no process group needed)."""

import pytest

from titan_thd.config import Parallelism
from titan_thd.parallel.parallel_dims import ParallelDims


def test_minus_one_takes_the_rest():
    dims = ParallelDims(pp=2, dp_shard=-1, cp=2, tp=4, world_size=64)
    assert dims.dp == 4
    assert (dims.fsdp_degree, dims.loss_degree) == (8, 8)
    assert [dims.mesh_size(n) for n in ("batch", "loss", "fsdp", "cp", "tp", "pp")] == [4, 8, 8, 2, 4, 2]


def test_from_config_reads_every_degree():
    cfg = Parallelism(
        data_parallel_shard_degree=3,
        context_parallel_degree=2,
        tensor_parallel_degree=1,
        pipeline_parallel_degree=2,
    )
    dims = ParallelDims.from_config(cfg, 12)
    assert (dims.pp, dims.dp, dims.cp, dims.tp) == (2, 3, 2, 1)
    assert dims.fsdp_enabled and dims.cp_enabled and dims.pp_enabled and not dims.tp_enabled


def test_rest_must_divide_the_world():
    with pytest.raises(ValueError, match=r"pp 2 × cp 2 × tp 2 = 8 does not divide world size 12"):
        ParallelDims(pp=2, dp_shard=-1, cp=2, tp=2, world_size=12)


def test_degrees_must_multiply_to_the_world():
    with pytest.raises(ValueError, match=r"multiply to 8 .* but the world has 16 processes"):
        ParallelDims(pp=1, dp_shard=4, cp=2, tp=1, world_size=16)


@pytest.mark.parametrize("kwargs", [{"cp": 0}, {"tp": -1}, {"dp_shard": 0}, {"dp_shard": -2}])
def test_bad_degrees(kwargs):
    base = {"pp": 1, "dp_shard": -1, "cp": 1, "tp": 1, "world_size": 4} | kwargs
    with pytest.raises(ValueError, match="expected"):
        ParallelDims(**base)


def test_single_process_needs_no_meshes():
    dims = ParallelDims(pp=1, dp_shard=-1, cp=1, tp=1, world_size=1)
    dims.build_meshes("cpu")  # no process group exists: must be a no-op
    assert not dims.fsdp_enabled and dims.loss_degree == 1
    assert all(dims.get_optional_mesh(n) is None for n in ("batch", "loss", "fsdp", "cp", "tp", "pp"))
    assert dims.mesh_rank("batch") == 0
    with pytest.raises(RuntimeError, match="get_optional_mesh"):
        dims.get_mesh("fsdp")


def test_unknown_mesh_name():
    dims = ParallelDims(pp=1, dp_shard=-1, cp=1, tp=1, world_size=1)
    with pytest.raises(ValueError, match="unknown mesh name 'dp_shard_cp'.*batch, loss, fsdp"):
        dims.get_optional_mesh("dp_shard_cp")
