import pytest
import torch
import torch.distributed as dist

from tests._dist import spawn


def _allreduce(rank, world_size):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return float(t)


def _fail(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def test_spawn_runs_collectives():
    assert spawn(_allreduce, 2) == [3.0, 3.0]


def test_spawn_reports_rank_failure():
    with pytest.raises(RuntimeError, match="boom on rank 1"):
        spawn(_fail, 2)
